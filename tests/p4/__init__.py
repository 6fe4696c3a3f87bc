"""P4 tooling tests. The checkout's P4 files, found from this directory (the tooling itself
takes every path as an argument)."""

import os
from pathlib import Path

from atp_pipeline.ina.p4 import toolchain as tc

ROOT = Path(__file__).resolve().parents[2]
P4_DIR = ROOT / "p4"
GENERATED_DIR = P4_DIR / "generated"
TRACE_FILE = P4_DIR / "traces" / "atp.jsonl"
V1MODEL_P4 = P4_DIR / "v1model" / "atp.p4"


def bmv2_missing() -> str:
    """Why BMv2 cannot run here (tests that need it skip with this reason), or ``""``."""
    why = tc.why_missing()
    if why:
        return why
    if os.geteuid() != 0:
        return "simple_switch runs in a network namespace of its own: needs root"
    return ""
