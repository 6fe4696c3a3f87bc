"""Both P4 programs compile where a P4 compiler is installed (skipped elsewhere, issue 7)."""

import shutil
import subprocess
from pathlib import Path

import pytest

P4 = Path(__file__).resolve().parents[2] / "p4"


@pytest.mark.skipif(shutil.which("p4c-bm2-ss") is None and shutil.which("p4test") is None,
                    reason="no P4 compiler (p4c-bm2-ss / p4test) on PATH; apt has no p4lang-p4c here")
def test_v1model_compiles(tmp_path):
    tool = shutil.which("p4c-bm2-ss") or shutil.which("p4test")
    cmd = [tool, str(P4 / "v1model" / "atp.p4")] + (["-o", str(tmp_path / "atp.json")] if "bm2" in tool else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("bf-p4c") is None, reason="no Tofino compiler (bf-p4c, Intel P4 Studio) on PATH")
def test_tna_compiles(tmp_path):
    r = subprocess.run(["bf-p4c", "--target", "tofino2", "--arch", "t2na", "-o", str(tmp_path),
                        str(P4 / "tna" / "atp.p4")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
