"""A stand-in for BMv2's command-line tools, to test the replay harness's orchestration here.

Not BMv2: it models only what ``atp_pipeline/ina/p4/bmv2.py`` relies on —
``simple_switch --use-files W --thrift-port T -i P@PREFIX ... JSON`` (listens on T, waits W
seconds, reads PREFIX_in.pcap, writes PREFIX_out.pcap with linktype 0 as BMv2 does, runs
until terminated), ``simple_switch_CLI --thrift-port T`` (commands on stdin, recorded in
``$FAKE_BMV2_DIR``; prints BMv2's "node was created with handle N") and ``p4c-bm2-ss -o
OUT SRC``. Packets go through the *Python* switch function, and forwarding is re-derived
from the recorded CLI commands (not from the plan), so the CLI command list is checked
independently. ECN: with ``ecn_threshold`` 0 and a rate-limited port, an ATP frame is
marked when a frame is already queued on that port (the rate-limited queue barely drains).
``FAKE_BMV2_BUG`` injects a divergence: ``drop_clone`` (a step's second output is lost),
``swap_outputs`` (a step's outputs leave in reverse order: must still match),
``flip_bitmap`` (bitmap0 of every forwarded ATP gradient gets bit 4 flipped), ``leak_dropped``
(frames the switch should drop leave on port 0).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path


def _imports():  # heavy (numpy, omegaconf): only the fake switch needs them, not the fake CLI
    global br, traces, SwitchState
    from atp_pipeline.ina.p4 import bmv2 as br
    from atp_pipeline.ina.p4 import traces
    from atp_pipeline.ina.switch import SwitchState


def _state_dir() -> Path:
    return Path(os.environ["FAKE_BMV2_DIR"])


def cli_main() -> int:
    argv = sys.argv[1:]
    port = argv[argv.index("--thrift-port") + 1]
    text = sys.stdin.read()
    handle = 0
    with open(_state_dir() / f"cli-{port}.txt", "a") as f:
        f.write(text)
    for line in text.splitlines():
        if line.startswith("mc_node_create"):
            print(f"Creating node with rid 0 , port map ... and lag map ...\nnode was created with handle {handle}")
            handle += 1
        elif line.startswith("table_add"):
            print(f"RuntimeCmd: Adding entry to match table {line.split()[1]}\nEntry has been added with handle 0")
        elif line.strip():
            print("RuntimeCmd: ", end="")
    return 0


def p4c_main() -> int:
    argv = sys.argv[1:]
    Path(argv[argv.index("-o") + 1]).write_text("{}\n")
    return 0


class _Tables:
    def __init__(self, commands: str) -> None:
        self.routes, self.l2, self.jobs, self.nodes, self.groups = [], {}, {}, {}, {}
        self.ecn_threshold, self.rate_limited = 200, set()
        handle = 0
        for line in commands.splitlines():
            w = line.split()
            if not w:
                continue
            if w[0] == "table_add":
                table, key, arg = w[1], w[3], w[5] if len(w) > 5 else None
                if table.endswith("ipv4_route"):
                    self.routes.append((ipaddress.IPv4Network(key), int(arg)))
                elif table.endswith("l2_forward"):
                    self.l2[br.mac_bytes(key)] = int(arg)
                elif table.endswith("atp_job"):
                    self.jobs[int(key)] = int(arg)
            elif w[0] == "mc_node_create":
                self.nodes[handle] = [int(p) for p in w[2:]]
                handle += 1
            elif w[0] == "mc_node_associate":
                self.groups.setdefault(int(w[1]), []).extend(self.nodes[int(w[2])])
            elif w[0] == "register_write" and w[1].endswith("ecn_threshold"):
                self.ecn_threshold = int(w[3])
            elif w[0] == "set_queue_rate":
                self.rate_limited.add(int(w[2]))

    def ports(self, frame: bytes):
        if frame[12:14] == b"\x08\x00":
            if br.atp_field(frame, "is_param") == 1:
                return self.groups.get(self.jobs.get(br.atp_field(frame, "job"), -1), [])
            dst = ipaddress.IPv4Address(frame[30:34])
            hits = [(n.prefixlen, p) for n, p in self.routes if dst in n]
            return [max(hits)[1]] if hits else []
        p = self.l2.get(frame[:6])
        return [] if p is None else [p]


def _write_out(f, frame: bytes) -> None:
    t = time.time()
    f.write(struct.pack("<IIII", int(t), int((t % 1) * 1e6), len(frame), len(frame)) + frame)
    f.flush()


def switch_main() -> int:
    argv = sys.argv[1:]
    wait = int(argv[argv.index("--use-files") + 1])
    thrift = int(argv[argv.index("--thrift-port") + 1])
    ifaces = {int(argv[i + 1].split("@", 1)[0]): argv[i + 1].split("@", 1)[1] for i, a in enumerate(argv) if a == "-i"}
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", thrift))
    srv.listen(8)
    threading.Thread(target=lambda: [srv.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    t_start = time.monotonic()
    _imports()
    outs = {p: open(prefix + "_out.pcap", "wb") for p, prefix in ifaces.items()}
    for f in outs.values():  # BMv2: pcap_open_dead(0, 0) -> linktype 0, snaplen 0
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 0, 0))
        f.flush()
    time.sleep(max(0.0, wait - (time.monotonic() - t_start)))
    cli = _state_dir() / f"cli-{thrift}.txt"
    tables = _Tables(cli.read_text() if cli.is_file() else "")
    cli.unlink(missing_ok=True)  # a later run may get the same Thrift port
    bug = os.environ.get("FAKE_BMV2_BUG", "")
    st = SwitchState(traces.N_AGGREGATORS, br.FMT.payload_k, br.FMT.bitmap_bits, jobs=sorted(tables.jobs))
    queued = {p: 0 for p in ifaces}
    for p, prefix in sorted(ifaces.items()):
        for frame in br.read_pcap(Path(prefix + "_in.pcap"))[1]:
            if br.is_filler(frame):
                res = [frame]
            elif traces.atp_payload(frame) is not None and br.atp_field(frame, "job") not in tables.jobs:
                res = []  # unknown job: dropped
            else:
                res = traces.run_step(st, frame, None)
            if bug == "drop_clone" and len(res) == 2:
                res = res[:1]
            if bug == "swap_outputs":
                res = res[::-1]
            if bug == "leak_dropped" and not res and 0 in outs:  # as a forgotten egress_spec would
                _write_out(outs[0], frame)
            for o in res:
                if bug == "flip_bitmap" and br.atp_field(o, "is_param") == 0:
                    b = bytearray(o)
                    b[br.L2L4 + br._LAYOUT["bitmap0"][0] // 8 + 3] ^= 0x10
                    o = bytes(b)
                for q in tables.ports(o):
                    if (q in tables.rate_limited and tables.ecn_threshold == 0 and queued.get(q, 0) > 0
                            and traces.atp_payload(o) is not None):
                        b = bytearray(o)
                        i, m = br._ecn_byte_mask()
                        b[i] |= m
                        o = bytes(b)
                    queued[q] = queued.get(q, 0) + 1
                    if q in outs:
                        _write_out(outs[q], o)
    while True:
        time.sleep(1)


def main(tool: str) -> int:
    return {"simple_switch": switch_main, "simple_switch_CLI": cli_main, "p4c-bm2-ss": p4c_main}[tool]()


def install(bindir: Path) -> None:
    """Write the three fake tools into ``bindir`` (run with this interpreter)."""
    here = Path(__file__).resolve().parent
    for tool in ("simple_switch", "simple_switch_CLI", "p4c-bm2-ss"):
        script = bindir / tool
        script.write_text(f"#!{sys.executable}\nimport sys\n"
                          f"sys.path[:0] = [{str(here)!r}, {str(here.parents[1])!r}]\n"
                          f"import fake_bmv2\nsys.exit(fake_bmv2.main({tool!r}))\n")
        script.chmod(0o755)
