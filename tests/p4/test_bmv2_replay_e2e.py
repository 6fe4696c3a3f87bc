"""On BMv2, the v1model program reproduces the Python switch's trace corpus frame for frame and
counter for counter (issues 7 and 16), and the harness does catch a divergence. Runs where the
P4 toolchain is installed (and as root); skipped with the reason elsewhere. Same as:
``python -m atp_pipeline.ina.p4.bmv2 --workdir <dir>``."""

import io

import pytest

from atp_pipeline.ina.p4 import bmv2 as br
from atp_pipeline.ina.p4 import traces

from . import TRACE_FILE, bmv2_missing

pytestmark = pytest.mark.skipif(bool(bmv2_missing()), reason=bmv2_missing() or "BMv2 is here")


def test_bmv2_replays_every_replayable_scenario(v1model_json, tmp_path, capsys):
    rc = br.main(["--json", str(v1model_json), "--workdir", str(tmp_path), "--trace", str(TRACE_FILE)])
    out = capsys.readouterr().out
    assert rc == 0, f"{out}\n(work directory: {tmp_path})"
    heads = [r for r in traces.load(TRACE_FILE) if "step" not in r]
    replayable = [r for r in heads if r["p4_replay"]]
    assert f"summary: {len(replayable)} scenario(s) replayed in {len(replayable) + 1} run(s)" in out, out
    assert f"counters compared for {len(replayable)} scenario(s); 0 run(s) with mismatches" in out, out
    for r in heads:
        if not r["p4_replay"]:
            assert f"not replayable: {r['scenario']} (p4_replay false: {r['p4_replay_reason']})" in out
    assert "ecn/ecn@0" in out and " ok" in out.split("ecn/ecn@0")[1].splitlines()[0]
    assert not list(tmp_path.glob("*.ipc"))  # the switch's sockets are gone with it


def test_a_divergence_is_reported(v1model_json, tmp_path):
    """The same switch, a wrong expectation: one flipped bit of a frame and one counter."""
    (sc,) = [s for s in br.load_scenarios(traces.load(TRACE_FILE)) if s.name == "aggregate_complete_dealloc"]
    (f,) = sc.steps[1].expected[1]  # the completed aggregate toward the PS (port 1)
    off, _ = br._LAYOUT["bitmap0"]
    bad = bytearray(f)
    bad[br.L2L4 + off // 8 + 3] ^= 0x04  # bitmap0 3 -> 7
    sc.steps[1].expected[1] = [bytes(bad)]
    sc.stats["merged"] += 1
    out = io.StringIO()
    assert br.replay([sc], v1model_json, tmp_path, out=out) == 1
    text = out.getvalue()
    assert "COUNTERS differ: merged: Python 2, P4 1" in text, text
    assert "MISMATCH at aggregate_complete_dealloc[1], port 1" in text and "atp.bitmap0: expected 7, got 3" in text
