"""ATP's model-agnostic tensor-parallel runtime (§3.2, §4.1-4.2, Figure 9).

* :mod:`.mesh` — the (dp, d1, d2) DeviceMesh and its :class:`~.mesh.Axis` names;
* :mod:`.comm` — the one counted (optionally emulated) collective wrapper;
* :mod:`.mappings` — conjugate communication operators as autograd functions;
* :mod:`.linear` — :class:`~.linear.ATPLinear`, row-/column-first linears;
* :mod:`.layers` — LayerNorm, embedding and vocabulary-parallel loss on the mesh;
* :mod:`.styles` — parallel styles (objects, registry); :mod:`.apply` — plans of styles;
* :mod:`.materialize` — meta-device models, shard by shard;
* :mod:`.grad_sync` — data-parallel gradient sync interface (ring here; atp/ps in ``ina``);
* :mod:`.sbp_exec` — AutoDDL plans executed with DTensor; :mod:`.emulation` — modeled links.

Nothing here knows a model family: families map their modules to styles through
:mod:`atp_pipeline.models`.
"""

from atp_pipeline.parallel.apply import apply_plan, match_plan
from atp_pipeline.parallel.comm import Comm, CommStats, comm_for
from atp_pipeline.parallel.linear import ATPLinear
from atp_pipeline.parallel.mesh import Axis, init_mesh, tp_mesh
from atp_pipeline.parallel.styles import ParallelStyle, StyleContext, parse_style, register_style

__all__ = ["ATPLinear", "Axis", "Comm", "CommStats", "ParallelStyle", "StyleContext", "apply_plan",
           "comm_for", "init_mesh", "match_plan", "parse_style", "register_style", "tp_mesh"]
