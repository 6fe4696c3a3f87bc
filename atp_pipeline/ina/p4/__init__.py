"""P4 tooling for the ATP switch programs in the checkout's ``p4/`` (issues 7, 16).

=========================  ==================================================================
module                     what it holds
=========================  ==================================================================
:mod:`.codegen`            P4 headers and lane registers generated from the Python field
                           table (:mod:`atp_pipeline.ina.packet`)
:mod:`.traces`             the packet-trace corpus of :func:`atp_pipeline.ina.switch.process`
:mod:`.control`            the control plane: table entries, multicast groups, registers
:mod:`.toolchain`          the shipped P4 tools (PATH or /opt/p4tools/bin), compiling both programs
:mod:`.simple_switch`      BMv2 ``simple_switch`` in a namespace of its own; its CLI session
:mod:`.nanomsg`            BMv2's nanomsg packet interface (frames to and from its ports)
:mod:`.bmv2`               the BMv2 replay harness: the trace corpus through the v1model program
=========================  ==================================================================

Every file these modules read or write is an argument; the command-line entry points, run
from the repository root, default to the checkout's paths relative to the current directory::

    python -m atp_pipeline.ina.p4.codegen [--check] [--out p4/generated]
    python -m atp_pipeline.ina.p4.traces [--check] [--out p4/traces/atp.jsonl]
    python -m atp_pipeline.ina.p4.control --topology ... --jobs ... [--aggregation conf/aggregation/atp.yaml]
    python -m atp_pipeline.ina.p4.bmv2 [--trace p4/traces/atp.jsonl] [--p4 p4/v1model/atp.p4] [--dry-run]
"""
