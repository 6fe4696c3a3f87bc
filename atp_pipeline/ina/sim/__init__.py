"""Packet-level discrete-event simulation of ATP on a multi-rack fabric.

* :mod:`.engine` — the event engines (SimPy adapter and the lean heap engine; measured),
* :mod:`.fabric` — hosts, ToRs, the core switch, links with queues, ECN, loss, duplication,
  reordering, multicast,
* :mod:`.rounds` — the round-based job driver shared by every scheme,
* :mod:`.atp_job` — an ATP job (workers + PS shards) wired to the fabric,
* :mod:`.switchml`, :mod:`.ring` — the SwitchML and ring all-reduce baselines (the plain
  N-to-1 PS baseline is an ATP job with ``in_network=False``),
* :mod:`.background` — background bulk flows,
* :mod:`.scenario` — :func:`run`, the one entry point (and :func:`pin_aggregators`, emulated
  contention for switch memory).
"""

from atp_pipeline.ina.sim.scenario import Result, pin_aggregators, run

__all__ = ["Result", "pin_aggregators", "run"]
