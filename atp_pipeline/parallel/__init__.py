"""ATP's tensor-parallel runtime: meshes, the counted collective wrapper, conjugate
communication operators, ``ATPLinear`` and the parallel GPT (§3.2, §4.1–4.2, Figure 9)."""

from atp_pipeline.parallel.comm import Comm, CommStats, comm_for
from atp_pipeline.parallel.gpt import check_mesh_fits, parallelize_gpt
from atp_pipeline.parallel.linear import ATPLinear
from atp_pipeline.parallel.mesh import init_mesh, tp_mesh
from atp_pipeline.parallel.plan import apply_parallel_plan

__all__ = ["ATPLinear", "apply_parallel_plan", "Comm", "CommStats", "check_mesh_fits", "comm_for",
           "init_mesh", "parallelize_gpt", "tp_mesh"]
