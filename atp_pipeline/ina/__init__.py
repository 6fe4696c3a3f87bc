"""ATP in-network aggregation (Lao et al., NSDI'21 — ``shared/papers/atp-in-network-aggregation.txt``).

One implementation of each protocol role, pure and transport-free, so that the
packet-level simulator here, a live UDP emulator and a P4 program (later issues) share
them unchanged:

=========================  ==================================================================
module                     what it holds
=========================  ==================================================================
:mod:`.packet`             the field table (§5.2, Figure 2) and the codec derived from it
:mod:`.quant`              float → int32 with provably non-overflowing headroom (§5.4)
:mod:`.switch`             the data plane ``process(state, packet)`` (§5.3, Figure 4 ①–⑩)
:mod:`.ps`                 the parameter server shard (§5.4)
:mod:`.worker`             the worker stack: window, ACKs, retransmission, AIMD (§5.4)
:mod:`.job`                per-job setup: groups, fan-ins, two-level hierarchy (§4.1, §5.1)
:mod:`.sim`                the discrete-event simulator, fabric, baselines (§6, §7)
:mod:`.live`               the live backend: switch emulator and PS processes, real UDP packets
:mod:`.p4`                 P4 tooling: generated headers, trace corpus, control plane, BMv2 replay
=========================  ==================================================================

The reduced-scale Figures 7–12 and the two-level report (CSV + PNG) and the simulator's
speed benchmark are repository tooling, run from the checkout's root:
``python -m benchmarks.ina_experiments <name>`` and ``python -m benchmarks.ina_sim_speed``.
"""

from atp_pipeline.ina.job import JobLayout, racks_layout
from atp_pipeline.ina.packet import DecodeError, Field, Packet, PacketFormat
from atp_pipeline.ina.ps import ParameterServer
from atp_pipeline.ina.switch import SwitchState, process
from atp_pipeline.ina.worker import Worker, WorkerConfig

__all__ = ["DecodeError", "Field", "JobLayout", "Packet", "PacketFormat", "ParameterServer", "SwitchState",
           "Worker", "WorkerConfig", "process", "racks_layout"]
