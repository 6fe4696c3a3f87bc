#!/usr/bin/env python3
"""Install the ATP control plane (atp_pipeline/ina/p4/control.py) on one BMv2 switch.

ATP §5.1 job setup / §5.3: applies one ToR's ``SwitchPlan`` — ``ipv4_route``, ``l2_forward``,
``atp_job`` table entries, the per-job multicast groups (parameter packets to the job's
workers), the ⑦ flush clone session, and the ``ecn_threshold`` / ``wm`` registers — to a
``simple_switch_grpc`` running ``p4/v1model/atp.p4``, through p4runtime-shell (``p4runtime_sh``,
``pip install p4runtime-shell``; optional, never imported by the tests).

Register writes go through ``simple_switch_CLI`` (Thrift ``register_write``), because BMv2's
P4Runtime server does not accept register writes on every release.

    python -m atp_pipeline.ina.p4.control --topology conf/topology/fig7a.yaml \
        --jobs p4/control/jobs.example.yaml --out plan.json
    p4c-bm2-ss --p4runtime-files atp.p4info.txt -o atp.json p4/v1model/atp.p4
    python p4/control/bmv2_install.py --plan plan.json --switch tor0 \
        --grpc-addr 127.0.0.1:9559 --p4info atp.p4info.txt --config atp.json --thrift-port 9090

``--dry-run`` prints every operation without connecting (no p4runtime_sh needed).
Not run in this repository: no BMv2 or p4c was available where it was written.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any, Dict, List


def operations(plan: Dict[str, Any], switch: str) -> List[str]:
    """Human-readable list of what will be installed on ``switch`` (also the dry-run output)."""
    sw = next((s for s in plan["switches"] if s["name"] == switch), None)
    if sw is None:
        raise SystemExit(f"error: no switch '{switch}' in the plan "
                         f"(have: {', '.join(s['name'] for s in plan['switches'])})")
    ops = [f"table {t['control']}.{t['table']} {t['match']} -> {t['control']}.{t['action']}{t['params']}"
           for t in sw["tables"]]
    ops += [f"multicast group {m['group']} (job {m['job']}) ports {m['ports']}" for m in sw["multicast"]]
    ops += [f"clone session {c['session']} -> port {c['port']} ({c['why']})" for c in sw["clone_sessions"]]
    ops += [f"register_write {r['control']}.{r['register']} {r['index']} {r['value']}" for r in sw["registers"]]
    return ops


def install(plan: Dict[str, Any], switch: str, args: argparse.Namespace) -> None:
    try:
        import p4runtime_sh.shell as sh  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit("error: p4runtime_sh is not installed; `pip install p4runtime-shell` "
                         "(or use --dry-run to list the entries)") from None
    sw = next(s for s in plan["switches"] if s["name"] == switch)
    sh.setup(device_id=args.device_id, grpc_addr=args.grpc_addr, election_id=(0, 1),
             config=sh.FwdPipeConfig(args.p4info, args.config))
    try:
        for t in sw["tables"]:
            te = sh.TableEntry(f"{t['control']}.{t['table']}")(action=f"{t['control']}.{t['action']}")
            for k, v in t["match"].items():
                te.match[k] = str(v)
            for k, v in t["params"].items():
                te.action[k] = str(v)
            te.insert()
        for m in sw["multicast"]:
            g = sh.MulticastGroupEntry(m["group"])
            for port in m["ports"]:
                g.add(port, 0)
            g.insert()
        for c in sw["clone_sessions"]:
            sh.CloneSessionEntry(c["session"]).add(c["port"], 0).insert()
    finally:
        sh.teardown()
    cmds = "".join(f"register_write {r['control']}.{r['register']} {r['index']} {r['value']}\n"
                   for r in sw["registers"])
    r = subprocess.run(["simple_switch_CLI", "--thrift-port", str(args.thrift_port)], input=cmds,
                       capture_output=True, text=True)
    if r.returncode != 0 or "Error" in r.stdout:
        raise SystemExit(f"error: simple_switch_CLI register writes failed: {r.stdout.strip()} {r.stderr.strip()}")


def main() -> int:
    ap = argparse.ArgumentParser(description="Install an ATP control plan on a BMv2 switch (p4runtime-shell).")
    ap.add_argument("--plan", required=True, help="JSON from python -m atp_pipeline.ina.p4.control")
    ap.add_argument("--switch", required=True, help="ToR name in the plan, e.g. tor0")
    ap.add_argument("--grpc-addr", default="127.0.0.1:9559")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--p4info", default="atp.p4info.txt")
    ap.add_argument("--config", default="atp.json", help="BMv2 JSON from p4c-bm2-ss")
    ap.add_argument("--thrift-port", type=int, default=9090)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    ops = operations(plan, args.switch)
    if args.dry_run:
        print("\n".join(ops))
        return 0
    install(plan, args.switch, args)
    print(f"{args.switch}: installed {len(ops)} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
