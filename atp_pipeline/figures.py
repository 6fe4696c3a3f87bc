"""Report figures without pyplot: a :class:`matplotlib.figure.Figure` drawn by the Agg canvas.

No global figure registry, no backend switch (a user's own ``matplotlib.use`` stays as it
was) and no pyplot import (about a third of matplotlib's import time, which counts in
``stage=plan``'s).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Tuple, Union


@contextmanager
def axes(path: Union[str, Path], figsize: Tuple[float, float], dpi: int = 120, ncols: int = 1) -> Iterator[Any]:
    """One-axes figure (``ncols > 1``: a row of that many axes) written to ``path`` (after
    ``tight_layout``) when the block ends."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot() if ncols == 1 else fig.subplots(1, ncols)
    yield ax
    fit_titles(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)


def fit_titles(fig: Any) -> None:
    """Wrap each axes' title onto as many lines as it needs to fit the axes' width (a title is
    never clipped at the figure's edge, whatever its length)."""
    import textwrap

    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        title = ax.title
        text = " ".join(title.get_text().split())
        width = ax.get_window_extent(renderer).width
        if not text or title.get_window_extent(renderer).width <= width:
            continue
        chars = len(text)
        while chars > 10:
            chars = int(chars * 0.9)
            title.set_text(textwrap.fill(text, chars))
            if title.get_window_extent(renderer).width <= width:
                break
