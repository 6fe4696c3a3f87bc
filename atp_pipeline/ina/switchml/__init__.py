"""SwitchML's protocol (Sapio et al., NSDI'21; the ATP paper's main comparison, §3, §6, §7).

One implementation, run by the simulator (:mod:`atp_pipeline.ina.sim.switchml`) and by the
live switch role (:mod:`atp_pipeline.ina.live.nodes`, ``--protocol switchml``):

* :class:`SMLSwitch` (:mod:`.switch`) — the switch function: a job's static partition of
  ``pool`` slots × 2 versions (the shadow copy that makes retransmission safe); a slot sums its
  ``W`` workers' contributions, then multicasts the result, which is also every worker's ACK; a
  retransmission for a completed slot gets the result by unicast. Each packet also carries an
  8-bit exponent that the slot aggregates by *max* (the shared block exponent below). Large
  batches are decided on arrays (:mod:`.batch`), the lane sums done in blocks (:mod:`.lanes`).
* :class:`SMLWorker` (:mod:`.worker`) — streams a tensor's chunks through the slots (chunk ``i``
  in slot ``i mod pool``, a new chunk of a slot when the slot's previous result arrives, version
  ``uses mod 2``), per-slot timeout retransmission, no congestion control.
* :class:`SMLFloatWorker` (:mod:`.float_worker`) — SwitchML's quantization on top (its
  §3.3/§5): each packet of slot ``s`` carries the local exponent of the *next* chunk of ``s``;
  the switch returns the max over workers with the result, and every worker quantizes that next
  chunk with the shared exponent ``e``: ``q = rint(x · 2^(B−e))`` with ``2^B ≤ ⌊(2³¹−1)/W⌋``, so
  every partial sum of ``W`` workers fits an int32 and the integer sums are exact. A tensor's
  first use of each slot is an exponent-only packet (no lanes). The result is ``Σq · 2^(e−B)``,
  the same bits on every worker whatever was lost on the way.
* :class:`SMLFormat` (:mod:`.wire`) — the wire format: the header of :data:`SML_FIELDS` (10
  bytes, the size the planner's estimate assumes) then ``K`` big-endian int32 lanes, or none
  for an exponent-only packet (``empty``).

Loss is recovered by the per-slot timeout only; the two-version scheme assumes no duplication
and reordering bounded by one slot version (a duplicate delayed past the slot's next use is
counted again), so the live backend injects loss only.
"""

from atp_pipeline.ina.packet import DecodeError
from atp_pipeline.ina.switchml.float_worker import SMLFloatWorker
from atp_pipeline.ina.switchml.switch import Result, SMLSwitch, SMLSwitchJob
from atp_pipeline.ina.switchml.wire import (
                                            EXP_BIAS,
                                            EXP_MAX,
                                            EXP_MIN,
                                            MAX_ITEMS,
                                            SHM_FLAG,
                                            SML_FIELDS,
                                            SML_HEADER_BYTES,
                                            WIRE_HEADER,
                                            SMLFormat,
                                            SMLPacket,
)
from atp_pipeline.ina.switchml.worker import SMLWorker, SMLWorkerStats

__all__ = ["DecodeError", "EXP_BIAS", "EXP_MAX", "EXP_MIN", "MAX_ITEMS", "Result", "SHM_FLAG", "SML_FIELDS",
           "SML_HEADER_BYTES", "SMLFloatWorker", "SMLFormat", "SMLPacket", "SMLSwitch", "SMLSwitchJob", "SMLWorker",
           "SMLWorkerStats", "WIRE_HEADER"]
