"""The replay harness's orchestration (compile, start, install, inject, collect, stop, compare)
against a fake BMv2 (tests/p4/fake_bmv2.py: the Python switch behind BMv2's command-line
interface). This checks the harness, not the P4 program: see test_bmv2_replay_e2e.py."""

import os

import pytest

from atp_pipeline.ina.p4 import bmv2 as br

from . import TRACE_FILE, V1MODEL_P4, fake_bmv2

# ⑦ clone; the ECN main run and its extra run; the machine may be loaded: generous wait
SCENARIOS = ["resend_level1", "ecn"]


@pytest.fixture
def fake_path(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_bmv2.install(bindir)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_BMV2_DIR", str(state))
    monkeypatch.delenv("FAKE_BMV2_BUG", raising=False)
    return tmp_path


def _run(tmp_path, scenarios=SCENARIOS, timeout=20):
    args = ["--workdir", str(tmp_path / "work"), "--wait", "6", "--timeout", str(timeout),
            "--trace", str(TRACE_FILE), "--p4", str(V1MODEL_P4)]
    for s in scenarios:
        args += ["--scenario", s]
    return br.main(args)


def test_replay_against_fake_bmv2_matches(fake_path, capsys):
    assert _run(fake_path) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "summary: 3 run(s)" in out and "0 run(s) with mismatches" in out
    assert "ecn/ecn@0" in out
    work = fake_path / "work"
    assert (work / "atp.json").is_file()  # compiled by the (fake) p4c-bm2-ss
    assert br.read_pcap(work / "resend_level1" / "port1_out.pcap")[0] == 0  # BMv2's linktype 0
    assert "mirroring_add 1 1" in (work / "resend_level1" / "commands.txt").read_text()


def test_divergence_is_reported_with_first_mismatch(fake_path, monkeypatch, capsys):
    """(Field-level diffs and any-order matching are unit-tested in test_bmv2_replay.py.)"""
    monkeypatch.setenv("FAKE_BMV2_BUG", "drop_clone")  # the ⑦ flush clone never leaves
    assert _run(fake_path, ["resend_level1"], timeout=8) == 1  # a frame that never comes: waits the timeout
    out = capsys.readouterr().out
    assert "MISMATCH at resend_level1[1], port 1" in out and "MISSING" in out
    assert "run(s) with mismatches" in out


def test_frames_of_a_scenario_without_outputs_are_still_collected(fake_path, monkeypatch, capsys):
    """``duplicate`` expects no frame at all: the harness must still wait until BMv2 has read
    its inputs before concluding, so a frame leaking out is caught."""
    monkeypatch.setenv("FAKE_BMV2_BUG", "leak_dropped")
    assert _run(fake_path, ["duplicate"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH at after duplicate[2], port 0" in out and "UNEXPECTED" in out
