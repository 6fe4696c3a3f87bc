"""Hugging Face ``transformers`` causal LMs as a model family (imported lazily: nothing here
imports ``transformers`` until a model of it is found or built)."""


def _register_styles() -> None:
    """The styles the layout's derived plans name (``hf_attention``, ``hf_mla``, ...),
    registered with the package, so a plan :func:`layout.derive` writes parses whichever
    module of the family is imported first (none of these imports ``transformers``)."""
    from atp_pipeline.models.hf.attention import HFAttention, HFLatentAttention, HFScalars
    from atp_pipeline.models.hf.experts import HFExperts
    from atp_pipeline.parallel.styles import register_style

    for style in (HFAttention, HFLatentAttention, HFScalars, HFExperts):
        register_style(style.name, style)


_register_styles()
