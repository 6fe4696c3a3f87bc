"""atp-pipeline: declarative, topology-aware distributed training.

Importing the package registers its Hydra config schemas, the ``mesh=<d1>x<d2>`` config
source and the Lightning strategy ``"atp"`` — except where ``ATP_PIPELINE_ROLE`` is set:
in the live aggregation backend's role processes (switch emulator, parameter server),
which need numpy only, and in the workers of :func:`atp_pipeline.parallel.launch.spawn`
with a ready-made process group, which need torch only.
"""

import os

if not os.environ.get("ATP_PIPELINE_ROLE"):  # light mode: see the module docstring
    from atp_pipeline.config import register_mesh_source, register_schemas
    from atp_pipeline.errors import ConfigError
    from atp_pipeline.planning import Plan, make_plan
    from atp_pipeline.topology import Topology

    register_schemas()
    register_mesh_source()

    from atp_pipeline.lightning import ATPStrategy  # (registers strategy "atp")
    from atp_pipeline.parallel import ATPLinear, init_mesh

__version__ = "0.1.0"
__all__ = ["ATPLinear", "ATPStrategy", "ConfigError", "Plan", "Topology", "init_mesh", "make_plan",
           "__version__"]
