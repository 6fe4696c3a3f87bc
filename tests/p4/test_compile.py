"""Both P4 programs compile with the shipped toolchain: ``p4c-bm2-ss`` on the v1model
program, ``p4test`` on the TNA program for Tofino 1 and 2; exit 0 and no warning. Skipped,
with the reason, where the toolchain is missing."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from atp_pipeline.ina.p4 import control as cp
from atp_pipeline.ina.p4 import toolchain as tc
from atp_pipeline.ina.p4.codegen import N_AGGREGATORS, STATS
from atp_pipeline.ina.packet import DEFAULT_K

from . import P4_DIR, ROOT, V1MODEL_P4

TNA_P4 = P4_DIR / "tna" / "atp.p4"


def test_v1model_compiles_without_warnings(v1model_build):
    res, out = v1model_build
    assert res.returncode == 0, res.output
    assert res.warnings == [] and res.output.strip() == "", res.output
    prog = json.loads(out.read_text())
    # what the program uses, from the compiler's output (p4/README.md lists the same)
    regs = {r["name"]: (r["size"], r["bitwidth"]) for r in prog["register_arrays"]}
    lanes = [n for n in regs if n.startswith(f"{cp.INGRESS}.lane_")]
    assert len(lanes) == DEFAULT_K and all(regs[n] == (N_AGGREGATORS, 32) for n in lanes)
    assert regs[f"{cp.INGRESS}.agg_key"] == (N_AGGREGATORS, 49) and regs[f"{cp.INGRESS}.wm"] == (1 << 18, 32)
    assert regs[f"{cp.EGRESS}.{cp.R_ECN_THRESHOLD}"] == (1, 19)
    counters = {c["name"]: c["size"] for c in prog["counter_arrays"]}
    assert counters == {f"{cp.INGRESS}.stats": len(STATS), f"{cp.INGRESS}.job_allocs": 1 << 16,
                        f"{cp.INGRESS}.job_complete": 1 << 16, f"{cp.INGRESS}.job_params": 1 << 16}
    tables = {t["name"] for p in prog["pipelines"] for t in p["tables"] if not t["name"].startswith("tbl_")}
    assert tables == {f"{cp.INGRESS}.{t}" for t in (cp.T_IPV4_ROUTE, cp.T_L2_FORWARD, cp.T_ATP_JOB)}


def test_tna_passes_p4test_for_tofino_1_and_2():
    """p4test (front and mid end; about 10 s of CPU each, so both targets run side by side): the
    command lines p4/README.md shows (the docs' test leaves them to this one), exit 0, no output."""
    from tests.test_docs_commands import extract

    why = tc.why_missing(["p4test"])
    if why:
        pytest.skip(why)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip((1, 2), pool.map(lambda t: tc.check_tna(TNA_P4, t), (1, 2))))
    documented = [c.text.split() for c in extract(ROOT / "p4" / "README.md")[0] if c.text.startswith("p4test")]
    root = str(ROOT) + "/"
    ran = [[w.replace(str(tc.prefix()), "/opt/p4tools").replace(root, "") for w in ["p4test", *res.cmd[1:]]]
           for res in results.values()]
    assert sorted(documented) == sorted(ran), (documented, ran)
    for target, res in results.items():
        assert f"-D__TARGET_TOFINO__={target}" in res.cmd
        assert res.returncode == 0, (target, res.output)
        assert res.warnings == [] and res.output.strip() == "", (target, res.output)


def test_register_size_must_be_a_power_of_two(tmp_path):
    """The index is a mask of the hash (switch.agg_slot): the preprocessor refuses another size."""
    why = tc.why_missing(["p4c-bm2-ss"])
    if why:
        pytest.skip(why)
    res = tc.compile_v1model(V1MODEL_P4, tmp_path / "atp.json", {"ATP_N_AGG": 40_000})
    assert res.returncode != 0 and "ATP_N_AGG must be a power of two" in res.output, res.output


def test_tools_are_found_in_the_prefix_without_path(monkeypatch):
    if not (tc.prefix() / "bin" / "p4test").is_file():
        pytest.skip(f"no toolchain in {tc.prefix()}: {tc.why_missing(['p4test'])}")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert tc.find_tool("p4test") == str(tc.prefix() / "bin" / "p4test")
    monkeypatch.setenv("ATP_P4TOOLS", "/nonexistent")
    assert tc.find_tool("p4test") is None and "p4test" in tc.why_missing(["p4test"])
    assert os.environ["PATH"] == "/nonexistent"
