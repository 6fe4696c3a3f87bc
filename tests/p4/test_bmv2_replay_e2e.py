"""On BMv2, the v1model program reproduces the Python switch's trace corpus frame for frame
(issue 7 item 4). Runs where simple_switch, simple_switch_CLI and p4c are on PATH; skipped
elsewhere. Same as: python -m atp_pipeline.ina.p4.bmv2 --workdir <dir>"""

import pytest

from atp_pipeline.ina.p4 import bmv2 as br

from . import TRACE_FILE, V1MODEL_P4

TOOLS, WHY = br.find_tools()


@pytest.mark.skipif(TOOLS is None, reason=WHY or "BMv2 tools found")
def test_bmv2_replays_the_trace_corpus(tmp_path, capsys):
    rc = br.main(["--workdir", str(tmp_path), "--wait", "5", "--trace", str(TRACE_FILE), "--p4", str(V1MODEL_P4)])
    out = capsys.readouterr()
    assert rc == 0, f"{out.out}\n{out.err}\n(work directory: {tmp_path})"
