"""The BMv2 trace replay harness (issues 7, 16): every piece that needs no BMv2.

Trace → replay steps with expected ports, the comparison and its diff, the
``simple_switch_CLI`` command list. The real replay, on BMv2, is test_bmv2_replay_e2e.py
(skipped with the reason where the toolchain is missing).
"""

import re
from collections import Counter

import pytest

from atp_pipeline.ina.p4 import bmv2 as br
from atp_pipeline.ina.p4 import control as cp
from atp_pipeline.ina.p4 import traces

from . import TRACE_FILE, V1MODEL_P4

V1 = V1MODEL_P4.read_text()
PS_PORT, UPLINK = 1, 2


@pytest.fixture(scope="module")
def scenarios():
    return br.load_scenarios(traces.load(TRACE_FILE))


def _sc(scenarios, name):
    return next(s for s in scenarios if s.name == name)


def _ideal_outputs(checks):
    """What a BMv2 that matches the trace writes: per port, outputs in step order."""
    out = {}
    for c in checks:
        for p, fs in c.step.expected.items():
            out.setdefault(p, []).extend(fs)
    return out


# -- trace -> steps ---------------------------------------------------------------------------
def test_every_trace_step_is_loaded_in_order(scenarios):
    records = traces.load(TRACE_FILE)
    steps = [r for r in records if "step" in r]
    assert [(s.scenario, s.index) for sc in scenarios for s in sc.steps] == [(r["scenario"], r["step"]) for r in steps]
    for sc in scenarios:
        assert [s.index for s in sc.steps] == list(range(len(sc.steps)))


def test_only_scenarios_without_p4_equivalent_are_skipped(scenarios):
    records = {r["scenario"]: r for r in traces.load(TRACE_FILE) if "step" not in r}
    for sc in scenarios:
        assert (sc.skip is None) == records[sc.name]["p4_replay"], (sc.name, sc.skip)
        if sc.skip:  # the corpus says why
            reason = records[sc.name]["p4_replay_reason"]
            assert reason and sc.skip == f"p4_replay false: {reason}"
        else:
            assert records[sc.name]["p4_replay_reason"] is None


def test_replay_fabric_matches_trace_addresses():
    sw = br.replay_plan([1])
    assert sw.name == br.DUT
    routes = {t.match["hdr.ipv4.dst_addr"]: t.params["port"] for t in sw.tables if t.table == cp.T_IPV4_ROUTE}
    assert routes == {"10.0.1.1/32": PS_PORT, "10.0.0.0/24": UPLINK}
    assert sw.uplink_port == UPLINK
    assert [(c.session, c.port) for c in sw.clone_sessions] == [(cp.ATP_FLUSH_SESSION, PS_PORT)]
    assert [(m.group, m.ports) for m in sw.multicast] == [(2, (UPLINK,))]
    assert br.INJECT_PORT not in {t.params.get("port") for t in sw.tables}


def test_every_python_output_has_a_port_and_every_step_is_accounted(scenarios):
    records = [r for r in traces.load(TRACE_FILE) if "step" in r]
    by_label = {(r["scenario"], r["step"]): r for r in records}
    for sc in scenarios:
        if sc.skip:
            continue
        for s in sc.steps:
            r = by_label[(sc.name, s.index)]
            # one multicast port per parameter packet here, one route per other frame: no loss
            assert Counter(f for fs in s.expected.values() for f in fs) == Counter(bytes.fromhex(o) for o in r["out"])
            assert br.INJECT_PORT not in s.expected


def test_expected_ports_follow_the_program_forwarding(scenarios):
    a = _sc(scenarios, "aggregate_complete_dealloc")
    assert a.steps[0].expected == {}
    assert list(a.steps[1].expected) == [PS_PORT]  # completed aggregate toward the PS
    assert list(a.steps[2].expected) == [UPLINK]  # parameter packet: multicast to the worker rack
    flush = _sc(scenarios, "resend_level1").steps[1]
    assert list(flush.expected) == [PS_PORT] and len(flush.expected[PS_PORT]) == 2  # ⑦ clone + original
    arp = _sc(scenarios, "non_atp").steps[2]
    assert list(arp.expected) == [UPLINK]  # replay extra: broadcast -> uplink
    mal = _sc(scenarios, "malformed_and_service")
    assert mal.steps[4].expected == {}  # unknown job 9: dropped


def test_congested_steps_are_those_the_trace_marked(scenarios):
    cong = [s.label for sc in scenarios for s in sc.steps if s.congested]
    marked = [f"{r['scenario']}[{r['step']}]" for r in traces.load(TRACE_FILE)
              if "step" in r and r["egress"] and r["egress"]["backlog_bytes"] > r["egress"]["threshold_bytes"]]
    assert cong == marked and "ecn[0]" in cong
    s = _sc(scenarios, "ecn").steps[0]
    assert br.atp_field(s.expected[PS_PORT][0], "ecn") == 1
    assert br.atp_field(s.frame, "ecn") == 0


# -- frames ---------------------------------------------------------------------------------------
def test_atp_field_and_ecn_mask(scenarios):
    f = _sc(scenarios, "ecn").steps[0].expected[PS_PORT][0]
    assert br.atp_field(f, "job") == 1 and br.atp_field(f, "seq") == 11 and br.atp_field(f, "ecn") == 1
    m = br.mask_ecn(f)
    assert br.atp_field(m, "ecn") == 0 and sum(a != b for a, b in zip(f, m)) == 1
    assert all(br.atp_field(m, n) == br.atp_field(f, n) for n in br._LAYOUT if n != "ecn")
    arp = _sc(scenarios, "non_atp").steps[2].frame
    assert br.mask_ecn(arp) == arp and br.atp_field(arp, "job") is None


def test_filler_frames_are_distinct_non_ip_and_routed_by_l2():
    f = br.filler_frame(1, 3)
    assert br.is_filler(f) and f[:6] == br.mac_bytes(br.filler_mac(1)) and len(f) >= 60
    assert f != br.filler_frame(1, 4) and not br.is_filler(br.filler_frame(1, 0)[:12])
    sw = br.replay_plan([1])
    extra = [cp.TableEntry(cp.T_L2_FORWARD, {"hdr.ethernet.dst_addr": br.filler_mac(1)}, cp.A_SET_PORT, {"port": 1})]
    assert br.forward_ports(f, sw, extra) == [1]
    assert br.forward_ports(f, sw) == []  # no entry: dropped


# -- comparison -----------------------------------------------------------------------------------
def _main_run(scenarios, name):
    return br.plan_runs(_sc(scenarios, name))[0]


def test_ideal_outputs_match_every_run(scenarios):
    for sc in scenarios:
        if sc.skip:
            continue
        for run in br.plan_runs(sc):
            res = br.compare(run.checks, _ideal_outputs(run.checks))
            assert res.mismatches == [], (run.name, res.mismatches[0].describe())
            assert res.checked_frames == sum(c.step.n_expected() for c in run.checks if c.check)


def test_outputs_of_one_input_may_come_in_any_order(scenarios):
    run = _main_run(scenarios, "resend_level1")
    out = _ideal_outputs(run.checks)
    out[PS_PORT] = out[PS_PORT][::-1]
    assert br.compare(run.checks, out).mismatches == []


def test_order_across_inputs_is_checked(scenarios):
    run = _main_run(scenarios, "fan_in_one")  # two steps, one frame each on the PS port
    out = _ideal_outputs(run.checks)
    out[PS_PORT] = out[PS_PORT][::-1]
    res = br.compare(run.checks, out)
    assert [m.label for m in res.mismatches] == ["fan_in_one[0]", "fan_in_one[1]"]


def test_first_mismatch_diff_names_the_field(scenarios):
    run = _main_run(scenarios, "aggregate_complete_dealloc")
    out = _ideal_outputs(run.checks)
    bad = bytearray(out[PS_PORT][0])
    off, _ = br._LAYOUT["bitmap0"]
    bad[br.L2L4 + off // 8 + 3] ^= 0x04  # bitmap0 3 -> 7
    base = br.L2L4 + br.FMT.header_bytes
    bad[base + 3] ^= 0x01  # lane d00
    out[PS_PORT][0] = bytes(bad)
    res = br.compare(run.checks, out)
    assert len(res.mismatches) == 1
    text = res.mismatches[0].describe()
    assert "aggregate_complete_dealloc[1], port 1" in text
    assert "atp.bitmap0: expected 3, got 7" in text
    assert "payload lanes differing: 1 of 62 (d00" in text


def test_missing_extra_and_wrong_port_frames(scenarios):
    run = _main_run(scenarios, "aggregate_complete_dealloc")
    ideal = _ideal_outputs(run.checks)
    missing = {**ideal, UPLINK: []}
    m = br.compare(run.checks, missing).mismatches
    assert [x.label for x in m] == ["aggregate_complete_dealloc[2]"]
    assert "MISSING" in m[0].describe() and "port stream ended early" in m[0].describe()
    wrong = {PS_PORT: ideal[PS_PORT], br.INJECT_PORT: ideal[UPLINK]}  # multicast left on port 0
    labels = [(x.label, x.port) for x in br.compare(run.checks, wrong).mismatches]
    assert labels == [("aggregate_complete_dealloc[2]", UPLINK),
                      ("after aggregate_complete_dealloc[2]", br.INJECT_PORT)]
    extra = {**ideal, PS_PORT: ideal[PS_PORT] * 2}
    m = br.compare(run.checks, extra).mismatches
    assert len(m) == 1 and m[0].port == PS_PORT and "UNEXPECTED" in m[0].describe()


def test_dropped_step_output_mismatch_reports_the_step(scenarios):
    run = _main_run(scenarios, "resend_level1")
    out = _ideal_outputs(run.checks)
    out[PS_PORT] = out[PS_PORT][:1]  # the ⑦ clone lost
    m = br.compare(run.checks, out).mismatches
    assert [x.label for x in m] == ["resend_level1[1]"]


def test_ecn_masked_in_main_run_and_exact_in_ecn_run(scenarios):
    sc = _sc(scenarios, "ecn")
    main, ecn = br.plan_runs(sc)
    unmarked = _ideal_outputs(main.checks)  # BMv2 below its threshold: step 0's frame not marked
    unmarked[PS_PORT][0] = br.mask_ecn(unmarked[PS_PORT][0])
    assert br.compare(main.checks, unmarked).mismatches == []
    unmarked[PS_PORT][1] = br.mask_ecn(unmarked[PS_PORT][1])  # step 2's ECN comes from aggregation
    assert [m.label for m in br.compare(main.checks, unmarked).mismatches] == ["ecn[2]"]
    assert ecn.name == "ecn/ecn@0" and [c.check for c in ecn.checks] == [True]
    fillers = [f for f in ecn.inputs if br.is_filler(f)]
    assert len(fillers) == br.ECN_FILLERS and ecn.inputs[-1] == sc.steps[0].frame
    good = _ideal_outputs(ecn.checks)
    good[PS_PORT] = fillers + good[PS_PORT]  # fillers leave first on the same port; skipped
    assert br.compare(ecn.checks, good).mismatches == []
    bad = {PS_PORT: fillers + [br.mask_ecn(f) for f in _ideal_outputs(ecn.checks)[PS_PORT]]}
    m = br.compare(ecn.checks, bad).mismatches
    assert len(m) == 1 and "atp.ecn: expected 1, got 0" in m[0].describe()
    assert ecn.expected_frames() == 1 + br.ECN_FILLERS


def test_ecn_run_replays_prefix_unchecked():
    """A congested step after other steps: its ECN run replays them for state only."""
    recs = [r for r in traces.load(TRACE_FILE) if r["scenario"] == "aggregate_complete_dealloc"]
    recs[2] = dict(recs[2], egress={"backlog_bytes": 10, "threshold_bytes": 5})  # step 1 congested
    (sc,) = br.load_scenarios(recs)
    runs = br.plan_runs(sc)
    assert [r.name for r in runs] == ["aggregate_complete_dealloc", "aggregate_complete_dealloc/ecn@1"]
    ecn = runs[1]
    assert [c.check for c in ecn.checks] == [False, True]
    assert ecn.inputs[0] == sc.steps[0].frame and ecn.inputs[-1] == sc.steps[1].frame
    assert f"set_queue_rate {br.ECN_QUEUE_RATE_PPS} {PS_PORT}" in ecn.commands
    assert ecn.commands.index("register_write AtpEgress.ecn_threshold 0 0") > \
        ecn.commands.index("register_write AtpEgress.ecn_threshold 0 200")


# -- simple_switch_CLI commands -------------------------------------------------------------------
def test_cli_commands_for_a_two_job_scenario(scenarios):
    sc = _sc(scenarios, "collision")
    assert sc.jobs == [1, 2]
    cmds = br.plan_runs(sc)[0].commands
    assert "table_add AtpIngress.atp_job AtpIngress.set_job 1 => 2" in cmds
    assert "table_add AtpIngress.atp_job AtpIngress.set_job 2 => 3" in cmds
    assert "table_add AtpIngress.ipv4_route AtpIngress.set_port 10.0.1.1/32 => 1" in cmds
    assert "table_add AtpIngress.l2_forward AtpIngress.set_port ff:ff:ff:ff:ff:ff => 2" in cmds
    mc = [c for c in cmds if c.startswith("mc_")]
    assert mc == ["mc_mgrp_create 2", "mc_node_create 0 2", "mc_node_associate 2 0",
                  "mc_mgrp_create 3", "mc_node_create 0 2", "mc_node_associate 3 1"]
    assert "mirroring_add 1 1" in cmds
    assert "register_write AtpEgress.ecn_threshold 0 200" in cmds
    assert {c for c in cmds if c.startswith("register_write AtpIngress.wm")} == \
        {f"register_write AtpIngress.wm {(j << 2) | p} 0" for j in (1, 2) for p in range(4)}


def test_cli_command_names_exist_in_the_v1model_source(scenarios):
    src = re.sub(r"//[^\n]*", "", V1)
    for sc in scenarios:
        if sc.skip:
            continue
        for run in br.plan_runs(sc):
            for c in run.commands:
                w = c.split()
                if w[0] == "table_add":
                    for qual in (w[1], w[2]):
                        ctl, name = qual.split(".")
                        assert f"control {ctl}(" in src and re.search(rf"\b(table|action) {name}\b", src), qual
                    assert w[-2] == "=>" or w[-1] == "=>"
                elif w[0] == "register_write":
                    ctl, name = w[1].split(".")
                    assert re.search(rf"register<[^;]*\)\s*{name};", src) or name.startswith("lane_"), w[1]
                else:
                    assert w[0] in {"mc_mgrp_create", "mc_node_create", "mc_node_associate", "mirroring_add",
                                    "set_queue_rate"}, c


def test_cli_output_checks():
    cmds = ["table_add AtpIngress.atp_job AtpIngress.set_job 1 => 2", "mc_mgrp_create 2", "mc_node_create 0 2",
            "mc_node_associate 2 0"]
    ok = ("RuntimeCmd: Adding entry to exact match table AtpIngress.atp_job\nmatch key: EXACT-00:01\n"
          "action: AtpIngress.set_job\nruntime data: 00:02\nEntry has been added with handle 0\n"
          "RuntimeCmd: Creating multicast group 2\nRuntimeCmd: Creating node with rid 0 , port map 100 and lag map \n"
          "node was created with handle 0\nRuntimeCmd: Associating node 0 to multicast group 2\nRuntimeCmd: ")
    br.check_cli_output(cmds, ok)
    br.check_cli_output(cmds, ok.replace("created with handle 0", "created with handle 3"))  # any handle
    with pytest.raises(br.ReplayError, match="confirmed 0 of 1 mc_node_create"):
        br.check_cli_output(cmds, ok.replace("node was created with handle 0", ""))
    with pytest.raises(br.ReplayError, match="confirmed 0 of 1 table_add"):
        br.check_cli_output(cmds, ok.replace("Entry has been added with handle 0", ""))
    with pytest.raises(br.ReplayError, match="Invalid table operation \\(BAD_MATCH_KEY\\)"):
        br.check_cli_output(cmds, "RuntimeCmd: Invalid table operation (BAD_MATCH_KEY)\n" + ok)
    with pytest.raises(br.ReplayError, match="Error: Table"):
        br.check_cli_output(cmds, ok + "RuntimeCmd: RuntimeCmd: Error: Table 'AtpIngress.nope' not found\n")


# -- command line ---------------------------------------------------------------------------------
def test_dry_run_needs_no_tools(capsys):
    assert br.main(["--dry-run", "--scenario", "ecn", "--trace", str(TRACE_FILE)]) == 0
    out = capsys.readouterr().out
    assert "# run ecn/ecn@0" in out and "set_queue_rate 10 1" in out and "(ECN bit ignored)" in out


def test_missing_tools_exit_2_with_reason(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("ATP_P4TOOLS", "/nonexistent")  # nor in the toolchain's prefix
    assert br.main(["--scenario", "ecn", "--trace", str(TRACE_FILE), "--p4", str(V1MODEL_P4)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: P4 toolchain not found: simple_switch, simple_switch_CLI, p4c-bm2-ss (neither "
                          "on PATH nor in /nonexistent/bin;"), err
    assert br.main(["--scenario", "nope", "--trace", str(TRACE_FILE)]) == 2
