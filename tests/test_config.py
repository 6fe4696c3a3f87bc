"""The config tree: every option composes into the typed schema; typos fail at compose."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException

from atp_pipeline.cli import describe_composition, describe_missing
from atp_pipeline.config.schema import (
    AggregationConfig,
    Config,
    MeshStrategy,
    ModelConfig,
    OverlapConfig,
    TrainerConfig,
    typed,
)
from atp_pipeline.errors import ConfigError
from atp_pipeline.topology.builders import switched, torus2d
from atp_pipeline.topology.model import Topology

from .conftest import CONF

TOPOLOGIES = sorted(p.stem for p in (CONF / "topology").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


def test_required_options_exist():
    assert set(TOPOLOGIES) >= {"ic1", "ic2", "ic3", "ic4", "ic5", "ic6", "fig7a", "fig7b", "local"}
    assert set(MODELS) >= {"m1", "m2", "m3", "m4", "tiny", "small"}
    assert {p.stem for p in (CONF / "overlap").glob("*.yaml")} == {"auto", "chunk1", "chunk2", "chunk4"}
    assert {p.stem for p in (CONF / "aggregation").glob("*.yaml")} == {"auto", "ring", "ps", "switchml", "atp"}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_topology_composes_and_validates(compose_cfg, topology):
    cfg = compose_cfg(f"topology={topology}")
    topo = Topology.from_config(cfg.topology)
    assert topo.name == topology
    assert topo.world_size == cfg.topology.world_size or cfg.topology.world_size is None


def test_models_and_groups_compose(compose_cfg):
    for model in MODELS:
        cfg = compose_cfg(f"model={model}", "overlap=chunk4", "aggregation=atp")
        assert cfg.model.name == model
        if model != "hf_pretrained":  # its shape is read from the checkpoint directory it names
            assert cfg.model.hidden % cfg.model.heads == 0
        assert cfg.overlap.chunks == 4 and cfg.aggregation.mode.value == "atp"
    m1 = compose_cfg("model=m1").model
    assert (m1.hidden, m1.heads, m1.batch_size, m1.seq_len, m1.dtype.value) == (2048, 16, 4, 2048, "fp16")


def test_mesh_options(compose_cfg):
    assert compose_cfg().mesh.strategy == MeshStrategy.auto
    assert compose_cfg("mesh=megatron").mesh.strategy == MeshStrategy.megatron
    fixed = compose_cfg("mesh=2x4").mesh
    assert (fixed.strategy, fixed.d1, fixed.d2) == (MeshStrategy.fixed, 2, 4)
    odd = compose_cfg("mesh=3x5").mesh  # any sizes compose; the planner checks the fit
    assert (odd.d1, odd.d2) == (3, 5)
    with pytest.raises(MissingConfigException) as exc:
        compose_cfg("mesh=2x2x2")
    assert describe_missing(exc.value).startswith("unknown mesh '2x2x2'")


def test_unknown_option_names_group_and_choices(compose_cfg):
    with pytest.raises(MissingConfigException) as exc:
        compose_cfg("topology=ic9")
    msg = describe_missing(exc.value)
    assert msg.startswith("unknown topology 'ic9' (available: fig7a, fig7b, ic1")
    assert "\n" not in msg


@pytest.mark.parametrize("override, key, hint", [
    ("topology.levels.0.p2p_gbps=3", "p2p_gbps", "p2p_GBps"),
    ("model.hiden=64", "hiden", "hidden"),
    ("topolgy=ic1", "topolgy", "topology"),
])
def test_misspelled_key_fails_at_compose_naming_it(compose_cfg, override, key, hint):
    with pytest.raises(ConfigCompositionException) as exc:
        compose_cfg(override)
    msg = describe_composition(exc.value)
    assert f"unknown key '{key}'" in msg and f"did you mean '{hint}'" in msg and "\n" not in msg


@pytest.mark.parametrize("override, key", [
    ("model.heads=abc", "model.heads"),
    ("topology.levels.0.routing=tunnel", "topology.levels[0].routing"),
    ("model.dtype=fp8", "model.dtype"),
    ("overlap.chunks=two", "overlap.chunks"),
])
def test_wrong_type_or_enum_fails_at_compose(compose_cfg, override, key):
    with pytest.raises(ConfigCompositionException) as exc:
        compose_cfg(override)
    assert describe_composition(exc.value).startswith(key)


@pytest.mark.parametrize("override, line", [
    ("trainer.max_steps=-5", "trainer.max_steps=-5 must be >= 1"),
    ("trainer.max_steps=0", "trainer.max_steps=0 must be >= 1"),
    ("trainer.devices=0", "trainer.devices=0 must be >= 1"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0 must be >= 1"),
    ("trainer.checkpoint_every_n_steps=-1", "trainer.checkpoint_every_n_steps=-1 must be >= 0"),
    ("trainer.collective_timeout_s=0", "trainer.collective_timeout_s=0.0 must be > 0"),
    ("trainer.gradient_clip_val=-0.5", "trainer.gradient_clip_val=-0.5 must be >= 0"),
    ("trainer.gradient_clip_algorithm=max", "trainer.gradient_clip_algorithm=max must be one of norm, value"),
    ("trainer.precision=16-mixed", "trainer.precision=16-mixed must be one of 32-true, bf16-mixed, bf16-true"),
    ("model.batch_size=0", "model.batch_size=0 must be >= 1"),
    ("model.seq_len=-64", "model.seq_len=-64 must be >= 1"),
    ("model.layers=0", "model.layers=0 must be >= 1"),
    ("mesh.dp=0", "mesh.dp=0 must be >= 1"),
    ("mesh.d2=-2", "mesh.d2=-2 must be >= 1"),
    ("overlap.chunks=0", "overlap.chunks=0 must be >= 1"),
    ("aggregation.payload_k=0", "aggregation.payload_k=0 must be >= 1"),
    ("aggregation.racks=0", "aggregation.racks=0 must be >= 1"),
    ("aggregation.n_ps=-1", "aggregation.n_ps=-1 must be >= 0"),
    ("aggregation.loss=1.0", "aggregation.loss=1.0 must be in [0, 1)"),
    ("aggregation.rto_s=0", "aggregation.rto_s=0.0 must be > 0"),
    ("planner.sbp.budget_s=0", "planner.sbp.budget_s=0.0 must be > 0"),
    ("calibration.passes=0", "calibration.passes=0 must be >= 1"),
])
def test_non_positive_counts_fail_at_compose_in_one_line_naming_the_key(compose_cfg, override, line):
    """Right after composition (``train.py`` calls :func:`typed` before anything starts)."""
    with pytest.raises(ConfigError) as exc:
        typed(compose_cfg(override))
    assert str(exc.value) == line


def test_the_composed_config_types_into_the_schema_dataclasses(compose_cfg):
    cfg = typed(compose_cfg("model=llama_tiny", "mesh=2x2", "overlap=chunk2"))
    assert isinstance(cfg, Config) and isinstance(cfg.trainer, TrainerConfig)
    assert isinstance(cfg.model, ModelConfig) and cfg.model.hidden == 64  # interpolated from model.hf
    assert (cfg.mesh.d1, cfg.mesh.d2, cfg.overlap.chunks) == (2, 2, 2)
    assert cfg.paths.output_dir == "${hydra:runtime.output_dir}"  # Hydra's runtime: unset under compose
    for model in MODELS:  # every shipped model, hf_pretrained's unset shape (0: read from the checkpoint) too
        assert typed(compose_cfg(f"model={model}")).model.name == model
    # the same checks where a user builds a group in code (e.g. ATPStrategy(aggregation={...}))
    with pytest.raises(ConfigError, match=r"^overlap.chunks=-1 must be >= 1$"):
        OverlapConfig(chunks=-1)
    with pytest.raises(ConfigError, match=r"^aggregation.payload_k=0 must be >= 1$"):
        AggregationConfig(payload_k=0)


def test_trainer_clipping_and_precision_reach_the_resolved_run(compose_cfg):
    """Lightning's names and values; a bf16 precision of a float64 model is refused when resolved."""
    from atp_pipeline.run.resolve import resolve

    cfg = typed(compose_cfg("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_algorithm=value",
                            "trainer.precision=bf16-mixed"))
    t = cfg.trainer
    assert (t.gradient_clip_val, t.gradient_clip_algorithm, t.precision) == (0.5, "value", "bf16-mixed")
    assert typed(compose_cfg()).trainer.gradient_clip_val is None  # Lightning's default: no clipping
    assert resolve(cfg).precision == "bf16-mixed"
    with pytest.raises(ConfigError, match=r"^trainer.precision=bf16-true casts a float32 model, but model.dtype=fp64 "):
        resolve(compose_cfg("model.dtype=fp64", "trainer.precision=bf16-true"))


def _user_dir(tmp_path: Path, name: str, body: dict) -> Path:
    (tmp_path / "topology").mkdir(parents=True, exist_ok=True)
    (tmp_path / "topology" / f"{name}.yaml").write_text(yaml.safe_dump(body))
    return tmp_path


def test_user_topology_outside_repo_is_validated(compose_cfg, tmp_path):
    good = _user_dir(tmp_path, "theirs", {
        "name": "theirs",
        "levels": [{"name": "node", "count": 2, "p2p_GBps": 50, "group_GBps": 50},
                   {"name": "gpu", "count": 2, "p2p_GBps": 100, "group_GBps": 100}]})
    cfg = compose_cfg(f"hydra.searchpath=[file://{good}]", "topology=theirs")
    assert Topology.from_config(cfg.topology).world_size == 4
    _user_dir(tmp_path, "typo", {"name": "typo", "levels": [
        {"name": "node", "count": 2, "p2p_gbps": 50, "group_GBps": 50}]})
    with pytest.raises(ConfigCompositionException) as exc:
        compose_cfg(f"hydra.searchpath=[file://{tmp_path}]", "topology=typo")
    assert describe_composition(exc.value) == (
        "in topology/typo: unknown key 'p2p_gbps' (LevelConfig keys: name, count, p2p_GBps, "
        "group_GBps, routing, aggregates); did you mean 'p2p_GBps'?")


def test_generated_presets_match_their_builders(compose_cfg):
    """ic5/ic6 are the builders' output, so sized variants plan the same way."""
    ic5 = Topology.from_config(compose_cfg("topology=ic5").topology)
    ref5 = Topology.from_config(switched(256, 900, name="ic5"))
    ic6 = Topology.from_config(compose_cfg("topology=ic6").topology)
    ref6 = Topology.from_config(torus2d(16, 16, 25, name="ic6"))
    for got, ref in ((ic5, ref5), (ic6, ref6)):
        assert [lv.to_dict() for lv in got.levels] == [lv.to_dict() for lv in ref.levels]
