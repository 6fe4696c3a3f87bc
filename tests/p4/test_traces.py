"""The trace corpus covers every branch of the switch function, and replays exactly."""

import dis
import sys

import pytest

from atp_pipeline.ina import switch
from atp_pipeline.ina.p4 import traces
from atp_pipeline.ina.packet import DecodeError

from . import TRACE_FILE


@pytest.fixture(scope="module")
def records():
    return traces.load(TRACE_FILE)


def test_checked_in_traces_are_fresh(records):
    assert TRACE_FILE.read_text(encoding="utf-8") == traces.render(), "run: python -m atp_pipeline.ina.p4.traces"


def _lines(code):
    return {ln for _, ln in dis.findlinestarts(code) if ln is not None and ln > code.co_firstlineno}


def test_replay_matches_and_covers_every_branch(records):
    codes = {f.__code__ for f in switch.PROCESS_STEPS}  # process and every step it calls
    hit = set()

    def tracer(frame, event, arg):
        if frame.f_code in codes:
            def local(f, ev, a):
                if ev == "line":
                    hit.add((f.f_code, f.f_lineno))
                return local
            return local
        return None

    switch._JOB_CRC.clear()  # so the per-job CRC cache miss is exercised too
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        replayed = traces.replay(records)
        batched = traces.replay(records, batched=True)  # the batch form (process_batch) hits plan.*
    finally:
        sys.settrace(old)
    for rec, out in replayed:
        assert out == rec["out"], f"{rec['scenario']} step {rec['step']}"
    assert len(batched) == len(replayed)
    for rec, out in batched:
        assert out == rec["out"], f"batched: {rec['scenario']} step {rec['step']}"
    # line coverage of the whole switch function (every branch of process and of its steps)
    missing = {(c.co_name, ln) for c in codes for ln in _lines(c) if (c, ln) not in hit}
    assert not missing, f"lines of switch.process not covered by the corpus: {sorted(missing)}"
    # the named Figure 4 branches, by their counters in the source
    import inspect
    sources = [(f.__code__, *inspect.getsourcelines(f)) for f in switch.PROCESS_STEPS]
    named = {
        "allocation": "S.alloc += 1", "hit/aggregate": "S.merged += 1", "collision": "p.resend = p.collision = 1",
        "duplicate": "S.dup_dropped += 1", "parameter/deallocation": "S.dealloc_param += 1",
        "resend level 0 (⑨⑩)": "S.resend_flush += 1", "resend level 1 (⑦ clone)": "S.l1_flush += 1",
        "resend forward": "S.resend_forward += 1", "stale reclaim": "S.stale_reclaimed += 1",
    }
    for branch, marker in named.items():
        lns = [(src, start + i) for src, lines, start in sources for i, t in enumerate(lines) if marker in t]
        assert lns and all(x in hit for x in lns), branch
    assert any((switch._complete.__code__, ln) in hit for ln in _lines(switch._complete.__code__)), "completion"


def test_ecn_and_non_atp_records(records):
    steps = [r for r in records if "step" in r]
    ecn = [r for r in steps if r["egress"]]
    assert ecn and all(r["out"] for r in ecn)
    fmt = traces.FMT
    assert any(fmt.decode(bytes.fromhex(o)[42:]).ecn and not fmt.decode(bytes.fromhex(r["in"])[42:]).ecn
               for r in ecn for o in r["out"])
    non_atp = [r for r in steps if traces.atp_payload(bytes.fromhex(r["in"])) is None]
    assert len(non_atp) >= 3 and all(r["out"] == [r["in"]] for r in non_atp)
    def decoded(r):
        try:
            return fmt.decode(traces.atp_payload(bytes.fromhex(r["in"])))
        except DecodeError:
            return None

    atp = [r for r in steps if traces.atp_payload(bytes.fromhex(r["in"])) is not None]
    multicast = [r for r in atp if decoded(r) is not None and decoded(r).is_param]
    assert multicast and all(len(r["out"]) == 1 for r in multicast)
    malformed = [r for r in atp if decoded(r) is None]  # bad app type, reserved bits, truncated, oversized
    assert len(malformed) == 4 and all(r["out"] == [] for r in malformed)
