"""Config schemas (Hydra ConfigStore) and the ``mesh=<d1>x<d2>`` config source."""

from atp_pipeline.config.mesh_source import parse_mesh_name, register_mesh_source
from atp_pipeline.config.schema import (
    DTYPE_BYTES,
    AggregationMode,
    Config,
    DType,
    MeshStrategy,
    ModelConfig,
    Routing,
    TopologyConfig,
    register_schemas,
)

__all__ = [
    "DTYPE_BYTES", "AggregationMode", "Config", "DType", "MeshStrategy", "ModelConfig",
    "Routing", "TopologyConfig", "parse_mesh_name", "register_mesh_source", "register_schemas",
]
