"""The ATP control plane: entries computed from the Hydra configs, named as in the P4."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.p4 import control as cp
from atp_pipeline.ina.packet import ATP_UDP_PORT

ROOT = Path(__file__).resolve().parents[2]
V1 = (ROOT / "p4" / "v1model" / "atp.p4").read_text()
TNA = (ROOT / "p4" / "tna" / "atp.p4").read_text()
FIG7A = OmegaConf.load(ROOT / "conf" / "topology" / "fig7a.yaml")  # 4 racks x 4 hosts
AGG = OmegaConf.load(ROOT / "conf" / "aggregation" / "atp.yaml")
JOBS = [  # job 7: two-level, PS on host 0 (rack 0); job 8: single-level, PS in rack 3
    {"job": 7, "worker_hosts": [1, 4, 5, 6, 8, 9], "ps_hosts": [0], "two_level": True},
    {"job": 8, "worker_hosts": [12, 13, 14, 10], "ps_hosts": [15, 15]},
]


def _control_body(src: str, name: str) -> str:
    src = re.sub(r"//[^\n]*", "", src)  # comments may sit between a table's name and its key
    start = src.index(f"control {name}(")
    nxt = src.find("\ncontrol ", start + 1)
    return src[start:nxt if nxt > 0 else len(src)]


def _p4_names(src: str, control: str):
    body = _control_body(src, control)
    tables = {m.group(1): m.group(2) for m in re.finditer(r"table\s+(\w+)\s*\{\s*key\s*=\s*\{([^}]*)\}", body)}
    actions = {m.group(1): [p.split()[-1] for p in m.group(2).split(",") if p.strip()]
               for m in re.finditer(r"action\s+(\w+)\s*\(([^)]*)\)", body)}
    registers = set(re.findall(r"register<(?:[^<>]|<[^<>]*>)*>\([^)]*\)\s*(\w+);", body))
    return tables, actions, registers


@pytest.fixture(scope="module")
def plan():
    return cp.compute_plan(FIG7A, AGG, JOBS)


def test_entry_names_match_v1model_source(plan):
    for sw in plan.switches:
        for t in sw.tables:
            tables, actions, _ = _p4_names(V1, t.control)
            assert t.table in tables, f"table {t.table} not in {t.control}"
            for key in t.match:
                assert re.search(rf"{re.escape(key)}\s*:\s*(lpm|exact)", tables[t.table]), (t.table, key)
            assert re.search(rf"actions\s*=\s*\{{[^}}]*\b{t.action}\b", _control_body(V1, t.control))
            assert sorted(t.params) == sorted(actions[t.action]), (t.action, actions[t.action])
        for r in sw.registers:
            assert r.register in _p4_names(V1, r.control)[2], f"register {r.register} not in {r.control}"
    m = re.search(r"const bit<32> ATP_FLUSH_SESSION = 32w(\d+);", V1)
    assert m and int(m.group(1)) == cp.ATP_FLUSH_SESSION


def test_tna_names_match_tna_source(plan):
    tables, actions, _ = _p4_names(TNA, "Eg")
    assert "ecn_threshold" in tables and "eg_md.egress_port" in tables["ecn_threshold"]
    assert actions[cp.TNA_ECN_ACTION] == ["t"]
    assert f"egress_port[6:0] == {cp.TNA_RECIRC_PORT}" in TNA
    for t in plan.switches[0].tna_ecn_threshold:
        assert list(t.params) == ["t"] and list(t.match) == ["eg_md.egress_port"]
    for name in (cp.T_IPV4_ROUTE, cp.T_L2_FORWARD, cp.T_ATP_JOB):
        assert re.search(rf"table {name} \{{", TNA)


def test_atp_udp_port_matches_generated_header(plan):
    gen = (ROOT / "p4" / "generated" / "atp_headers.p4").read_text()
    m = re.search(r"ATP_UDP_PORT = 16w(\d+);", gen)
    assert m and int(m.group(1)) == plan.atp_udp_port == ATP_UDP_PORT


def test_forwarding_for_every_host(plan):
    assert len(plan.hosts) == 16 and len(plan.switches) == 4
    for sw in plan.switches:
        routes = {t.match["hdr.ipv4.dst_addr"]: t.params["port"] for t in sw.tables if t.table == "ipv4_route"}
        macs = {t.match["hdr.ethernet.dst_addr"]: t.params["port"] for t in sw.tables if t.table == "l2_forward"}
        assert len(macs) == 16
        for h in plan.hosts:
            want = h.port if h.rack == sw.rack else sw.uplink_port
            assert macs[h.mac] == want
            if h.rack == sw.rack:
                assert routes[f"{h.ipv4}/32"] == h.port
            else:
                assert routes[f"10.0.{h.rack}.0/24"] == sw.uplink_port
        assert len(routes) == 4 + 3  # 4 local /32, 3 remote racks


def test_one_multicast_group_per_job_with_exactly_its_workers(plan):
    host = {h.index: h for h in plan.hosts}
    for spec in JOBS:
        jp = next(j for j in plan.jobs if j.job == spec["job"])
        ps_rack = host[spec["ps_hosts"][0]].rack
        on = {}
        for sw in plan.switches:
            groups = [m for m in sw.multicast if m.job == spec["job"]]
            entries = [t for t in sw.tables if t.table == "atp_job" and t.match["hdr.atp.job"] == spec["job"]]
            assert len(groups) == len(entries) <= 1
            if groups:
                assert groups[0].group == jp.group and entries[0].params == {"grp": jp.group}
                on[sw.rack] = set(groups[0].ports)
        racks = {host[h].rack for h in spec["worker_hosts"]} | {ps_rack}
        assert set(on) == racks
        for r, ports in on.items():
            local = {host[h].port for h in spec["worker_hosts"] if host[h].rack == r}
            remote = any(host[h].rack != ps_rack for h in spec["worker_hosts"])
            assert ports == local | ({plan.switches[r].uplink_port} if r == ps_rack and remote else set())
    assert len({j.group for j in plan.jobs}) == len(JOBS)
    assert plan.spine_mcast == {7: [1, 2], 8: [2]}


def test_two_level_fan_ins_match_job_layout(plan):
    layout = cp.job_layout(cp._job_spec(JOBS[0]), plan.hosts)
    jp = plan.jobs[0]
    # groups: worker 0 (host 1, PS rack) singleton at level 1; rack 1 = workers 1-3; rack 2 = 4-5
    assert layout.groups == [[0], [1, 2, 3], [4, 5]] and layout.group_start_edge == [1, 0, 0]
    assert jp.fan_in1 == layout.fan_in1 == 3
    assert jp.fan_in0 == [1, 3, 3, 3, 2, 2]
    assert jp.bitmap0 == [1 << layout.child0[w] for w in range(6)] == [1, 1, 2, 4, 1, 2]
    assert jp.bitmap1 == [1, 2, 2, 2, 4, 4] and jp.start_edge == [1, 0, 0, 0, 0, 0]
    assert jp.level0_switches == ["tor1", "tor2"] and jp.level1_switch == "tor0"
    assert layout.content_mask(1, 0, 0, 0b111) == 0b111111  # the PS sees every worker
    single = plan.jobs[1]
    assert single.fan_in1 == 0 and single.level1_switch is None and single.fan_in0 == [3, 3, 3, 1]


def test_flush_session_ecn_and_watermark(plan):
    tor0 = plan.switches[0]
    assert [(c.session, c.port) for c in tor0.clone_sessions] == [(1, 1)]  # PS host 0 = tor0 port 1
    assert all(not s.clone_sessions for s in plan.switches[1:])  # job 8 is single-level
    # 64,000 B over 319-byte frames: mark above 200 packets
    assert plan.ecn_threshold_pkts == 200
    for sw in plan.switches:
        assert [r.value for r in sw.registers if r.register == "ecn_threshold"] == [200]
        assert {t.match["eg_md.egress_port"] for t in sw.tna_ecn_threshold} == {1, 2, 3, 4, 5}
    wm0 = sorted(r.index for r in tor0.registers if r.register == "wm")
    assert wm0 == [(7 << 2) | p for p in range(4)]


def test_single_level_topology_is_one_rack_without_uplink():
    p = cp.compute_plan(OmegaConf.load(ROOT / "conf" / "topology" / "local.yaml"), {"mode": "atp"},
                        [{"job": 1, "worker_hosts": [0, 1, 2], "ps_hosts": [3]}])
    assert len(p.switches) == 1 and p.switches[0].uplink_port is None
    assert p.switches[0].multicast[0].ports == (1, 2, 3)
    assert all("/32" in t.match["hdr.ipv4.dst_addr"] for t in p.switches[0].tables if t.table == "ipv4_route")


@pytest.mark.parametrize("agg, jobs, fabric, msg", [
    ({"mode": "ring"}, JOBS, None, "needs mode 'atp'"),
    (AGG, [{"job": 1, "worker_hosts": [0, 99], "ps_hosts": [2]}], None, "host 99 does not exist"),
    (AGG, [{"job": 1, "worker_hosts": [1, 1], "ps_hosts": [2]}], None, "one worker per host"),
    (AGG, [JOBS[0], JOBS[0]], None, "listed twice"),
    (AGG, [{"job": 1, "worker_hosts": [1], "ps_hosts": [0, 4]}], None, "one ToR"),
    (AGG, [{"job": 1, "worker_hosts": [4], "ps_hosts": [0], "two_level": True},
           {"job": 2, "worker_hosts": [5], "ps_hosts": [2], "two_level": True}], None, "one port"),
    (AGG, [{"job": 1, "worker_hosts": [1]}], None, "needs job, worker_hosts, ps_hosts"),
    (AGG, JOBS, cp.FabricConfig(uplink_port=2), "collides with a host port"),
    (AGG, JOBS, cp.FabricConfig(host_level=5), "host_level=5"),
    (AGG, [{"job": 70000, "worker_hosts": [1], "ps_hosts": [0]}], None, "does not fit"),
])
def test_bad_inputs_give_one_line_config_error(agg, jobs, fabric, msg):
    with pytest.raises(ConfigError) as e:
        cp.compute_plan(FIG7A, agg, jobs, fabric)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_cli_writes_json_plan(tmp_path):
    out = tmp_path / "plan.json"
    rc = cp.main(["--topology", str(ROOT / "conf/topology/fig7a.yaml"), "--aggregation",
                  str(ROOT / "conf/aggregation/atp.yaml"), "--jobs", str(ROOT / "p4/control/jobs.example.yaml"),
                  "--out", str(out)])
    import json
    data = json.loads(out.read_text())
    assert rc == 0 and [s["name"] for s in data["switches"]] == ["tor0", "tor1", "tor2", "tor3"]
    assert data["atp_udp_port"] == ATP_UDP_PORT
