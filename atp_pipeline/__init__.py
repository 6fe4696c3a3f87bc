"""atp-pipeline: declarative, topology-aware distributed training.

Importing the package registers its Hydra config schemas and the ``mesh=<d1>x<d2>``
config source.
"""

from atp_pipeline.config import register_mesh_source, register_schemas
from atp_pipeline.errors import ConfigError
from atp_pipeline.planning import Plan, make_plan
from atp_pipeline.topology import Topology

register_schemas()
register_mesh_source()

__version__ = "0.1.0"
__all__ = ["ConfigError", "Plan", "Topology", "make_plan", "__version__"]
