"""Config schemas (registered in Hydra's ConfigStore by :func:`register_schemas`) and the
``mesh=<d1>x<d2>`` config source (:func:`register_mesh_source`). Importing this package
imports neither Hydra nor the config source; ``train.py`` registers both."""

from __future__ import annotations

from typing import Any

from atp_pipeline.config.schema import (
    DTYPE_BYTES,
    AggregationMode,
    Config,
    DType,
    MeshStrategy,
    ModelConfig,
    PlannerKind,
    Routing,
    TopologyConfig,
    register_schemas,
)

__all__ = [
    "DTYPE_BYTES", "AggregationMode", "Config", "DType", "MeshStrategy", "ModelConfig", "PlannerKind",
    "Routing", "TopologyConfig", "parse_mesh_name", "register_mesh_source", "register_schemas",
]


def register_mesh_source() -> None:
    from atp_pipeline.config.mesh_source import register_mesh_source as register

    register()


def parse_mesh_name(name: str) -> Any:
    from atp_pipeline.config.mesh_source import parse_mesh_name as parse

    return parse(name)
