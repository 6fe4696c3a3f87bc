"""P4 tooling tests. The checkout's P4 files, found from this directory (the tooling itself
takes every path as an argument)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
P4_DIR = ROOT / "p4"
GENERATED_DIR = P4_DIR / "generated"
TRACE_FILE = P4_DIR / "traces" / "atp.jsonl"
V1MODEL_P4 = P4_DIR / "v1model" / "atp.p4"
