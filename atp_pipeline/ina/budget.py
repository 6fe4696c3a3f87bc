"""The live roles' memory bound, in bytes: what each role's state needs, one function per role.

Every live role (:mod:`atp_pipeline.ina.live.nodes`) holds state that grows with what it serves;
each is given a bound in bytes (``--max-bytes``; a run's ``aggregation.role_max_bytes``) and
refuses, in one line naming both figures, whatever would need more:

* the ATP switch: its aggregator registers, fixed at start (:func:`switch_bytes`);
* the SwitchML switch: each job's static partition, at job setup (:func:`sml_job_bytes`);
* a parameter-server shard: per job, the sequences it may hold open and the completed results
  it keeps to answer retransmissions (:func:`ps_job_bytes`). Both are bounded by the workers'
  window: an honest worker never sends a sequence ``window`` packets or more beyond the
  shard's low watermark, nor waits for one further below it (:func:`ps_horizon`), so a shard
  refuses sequences beyond that horizon and forgets results below it, and stays exact.

The figures count the payload bytes a role stores plus :data:`ENTRY_OVERHEAD` per stored
packet (the interpreter's objects around it); a role's fixed costs (the interpreter, its
socket buffers, one drained batch) come on top and do not grow. :func:`check` is the one
refusal; resolve (``train.py``) calls the same functions before any role starts.
"""

from __future__ import annotations

#: a role's default bound (1 GiB)
DEFAULT_MAX_BYTES = 1 << 30
#: bytes counted per stored packet beyond its lanes (array, tuple and dict entry objects)
ENTRY_OVERHEAD = 256
#: the live workers' largest congestion window, bytes (:mod:`atp_pipeline.ina.live.sync`)
LIVE_WINDOW_BYTES = 4_000_000
#: a worker's window before its first ACK, packets (``WorkerConfig.initial_window_pkts``)
INITIAL_WINDOW_PKTS = 50


class BudgetError(ValueError):
    """A role's state would exceed its memory bound."""


def switch_bytes(n_aggregators: int, payload_k: int) -> int:
    """The ATP switch's aggregators: ``n`` rows of ``payload_k`` int32 lanes and their registers."""
    return n_aggregators * (4 * payload_k + ENTRY_OVERHEAD)


def sml_job_bytes(pool: int, payload_k: int) -> int:
    """One SwitchML job's static partition: ``pool`` slots × 2 versions of ``payload_k`` lanes."""
    return 2 * pool * (4 * payload_k + ENTRY_OVERHEAD)


def ps_horizon(window_bytes: int, wire_bytes: int) -> int:
    """Sequences an honest worker may have in flight: its window in packets of ``wire_bytes``
    (at least the initial window), plus one."""
    return max(-(-window_bytes // wire_bytes), INITIAL_WINDOW_PKTS) + 1


def ps_job_bytes(n_workers: int, payload_k: int, wire_bytes: int, window_bytes: int = LIVE_WINDOW_BYTES) -> int:
    """One job at one parameter-server shard: open sequences below the horizon ``H``, each holding
    at most one piece per worker, and at most ``2·(H + H) + 1`` completed results (the answer window
    is ``H`` too: :meth:`~atp_pipeline.ina.ps.ParameterServer.add_job`): ``((W + 4)·H + 1)`` packets."""
    h = ps_horizon(window_bytes, wire_bytes)
    return ((n_workers + 4) * h + 1) * (4 * payload_k + ENTRY_OVERHEAD)


def check(what: str, need: int, bound: int, held: int = 0, key: str = "--max-bytes") -> None:
    """:class:`BudgetError` naming ``need`` and ``bound`` (``held``: already taken) when ``need``
    does not fit."""
    if need + held > bound:
        taken = f" ({held:,} already held)" if held else ""
        raise BudgetError(f"{what} needs {need:,} bytes, above the role's memory bound {key}={bound:,}{taken}")
