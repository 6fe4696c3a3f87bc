"""Planning: pure cost models and searches (numpy only; no torch, Hydra or Lightning).

* :mod:`.shape` — :class:`~.shape.ModelShape`, what a planner reads of a model (FLOPs too);
* :mod:`.interface` — one planner interface (:func:`~.interface.plan`, :class:`~.interface.PlanResult`);
* :mod:`.search`, :mod:`.mesh_plan`, :mod:`.bandwidth`, :mod:`.cost` — ATP's mesh search (Eq. 2-4);
* :mod:`.sbp` — AutoDDL's per-layer SBP search and its alpha-beta model;
* :mod:`.memory`, :mod:`.gradsync` — per-device memory and the data-parallel sync estimate;
* :mod:`.report` — the plan report (table, ``plan.json``, ``plan.png``, summary);
* :mod:`.calibrate` — fitting alpha-beta to measured collectives (measuring: ``run.calibrate``).
"""
