"""What every live role process has (:mod:`.nodes`, :mod:`.bmv2_node`): one UDP socket for ATP
packets (the ATP header and payload as the UDP payload, §5.2), a control server (:mod:`.rpc`:
job setup and teardown §5.1, statistics, shutdown; authenticated with the role's secret,
:mod:`.auth`) whose operations it grants per tenant (:mod:`.tenancy`), a data-plane loop that
hands every datagram to the role, and a watch on the process that started it.

A datagram may hold several packets (:mod:`.frames`): the loop drains what is queued, cuts
each datagram into packets for :meth:`Role.handle`, then sends what the role queued in its
:class:`~.frames.Outbox`, batched per destination."""

from __future__ import annotations

import os
import random
import resource
import secrets
import socket
import struct
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from atp_pipeline.ina.budget import DEFAULT_MAX_BYTES
from atp_pipeline.ina.live.frames import Outbox, drain, keep_freed_memory, poller_for, spin_drain, wait_readable
from atp_pipeline.ina.live.rpc import Addr, ControlServer
from atp_pipeline.ina.live.tenancy import Tenants
from atp_pipeline.ina.packet import PacketFormat

SOCKET_BUFFER = 8 << 20  # requested SO_RCVBUF/SO_SNDBUF; the kernel caps it at rmem_max
SO_MEMINFO = 55  # Linux: u32[9] = rmem_alloc, rcvbuf, wmem_alloc, sndbuf, fwd_alloc, wmem_queued,
#                  optmem, backlog, drops


def meminfo(sock: socket.socket) -> Tuple[int, int]:
    """(bytes queued in the receive buffer, datagrams dropped on a full buffer); (0, 0)
    where the kernel does not report them."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 36)
    except OSError:
        return 0, 0
    v = struct.unpack("9I", raw[:36]) if len(raw) >= 36 else (0,) * 9
    return v[0], v[8]


def udp_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A bound UDP socket with large buffers (a full window of every worker fits)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    s.bind((host, port))
    return s


class Role:
    """Common loop: UDP socket, control server, parent watch, ``stop``."""

    role = "role"

    def __init__(self, fmt: PacketFormat, host: str = "127.0.0.1", port: int = 0, control_port: int = 0,
                 parent_pid: Optional[int] = None, secret: Optional[str] = None,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """``secret``: the control channel's (:mod:`.auth`); ``None``: a random one nobody else
        knows (a role built in-process, driven through its ``op_*`` methods). ``max_bytes``: the
        bound on the state the role stores (:mod:`atp_pipeline.ina.budget`); what would exceed it is
        refused."""
        self.fmt = fmt
        self.max_bytes = int(max_bytes)
        #: job -> the addresses its datagrams may come from (:meth:`admits`)
        self.members: Dict[int, Set[Addr]] = {}
        self.foreign = 0  # datagrams of an installed job from an address that is none of its members
        keep_freed_memory()  # a role process allocates and frees datagram-sized buffers all the time
        self.sock = udp_socket(host, port)
        self.data_addr: Addr = self.sock.getsockname()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.parent_pid = parent_pid
        self.malformed = 0
        self.tenants = Tenants()
        self.control = ControlServer(self._control, secret or secrets.token_hex(32), host, control_port)
        self.outbox = Outbox(self.send)

    def info(self) -> Dict[str, Any]:
        """What any authenticated client may read (the ``info`` operation)."""
        return {"role": self.role, "data": list(self.data_addr), "control": list(self.control.address),
                "pid": os.getpid(), "payload_k": self.fmt.payload_k}

    def start_line(self) -> Dict[str, Any]:
        """The line the role prints when it is ready: :meth:`info` and its owner token (only the
        process that started the role reads it)."""
        return {**self.info(), "owner": self.tenants.owner}

    def new_job_id(self, installed: Any, limit: int = 1 << 16) -> int:
        """A job id for ``add_job(job=None)``: never used on this role, not in ``installed``."""
        return self.tenants.new_id(lambda j: j in installed, limit)

    def _control(self, op: str, args: Dict[str, Any], token: Optional[str]) -> Any:
        """One control request (op and args already checked against :mod:`.rpc`'s schema),
        granted per :meth:`Tenants.authorize`."""
        visible = self.tenants.authorize(op, args, token)
        if op == "info":
            return self.info()
        if op == "shutdown":
            self.stop_event.set()
            return True
        if op == "cpu":  # CPU seconds this role process has used (benchmarks.live_sync's accounting)
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime
        with self.lock:
            if op == "stats":
                if args:
                    raise ValueError("stats takes no arguments")
                return {**self.op_stats(visible), "control": self.control.counters()}
            fn = getattr(self, f"op_{op}", None)
            if fn is None:
                raise ValueError(f"this {self.role} has no {op!r} operation")
            value = fn(**args)
            if op == "add_job":
                assert token is not None  # (authorize: setup needs one)
                self.tenants.bind(int(value), token)
            return value

    def admit(self, job: int, addrs: Any) -> None:
        """Job ``job``'s members: its packets are taken from these addresses only (its workers, the
        switches and the PS it is routed through)."""
        self.members[job] = {(str(a[0]), int(a[1])) for a in addrs}

    def admits(self, job: int, addr: Optional[Addr]) -> bool:
        """Whether a packet of ``job`` from ``addr`` enters the data plane: a job not installed here
        is the protocol's to count (unknown job); an installed job's packet from anyone but its
        members is dropped and counted (``foreign``) — a spoofed or replayed datagram from
        elsewhere can neither add to nor disturb the job's aggregates. A member bound to a wildcard
        address (``0.0.0.0``) is matched by its port."""
        members = self.members.get(job)
        if members is None or addr is None or addr in members or ("0.0.0.0", addr[1]) in members:
            return True
        self.foreign += 1
        return False

    def op_stats(self, jobs: Optional[Set[int]] = None) -> Dict[str, Any]:  # pragma: no cover - abstract
        """The role's counters; per-job entries (keyed by the decimal job id) only of ``jobs`` (None: all)."""
        raise NotImplementedError

    def serve(self) -> None:
        sock = self.sock
        poller = poller_for(sock)
        handle, lock, flush = self.handle_batch, self.lock, self.outbox.flush
        while not self.stop_event.is_set():
            try:  # (a role with cores to spare busy-polls a while first: :attr:`spin_s`)
                got = spin_drain(sock, self.spin_s) if self.spin_s else []
                if not got:
                    if not wait_readable(poller, 0.25):
                        if self.parent_pid is not None and os.getppid() != self.parent_pid:
                            break  # the process that started us is gone: never outlive it
                        continue
                    got = drain(sock)
                got = self.gather(got)
            except OSError:
                break
            with lock:
                handle(got)
                flush()
        self.control.close()
        sock.close()

    def gather(self, got: List[Tuple[bytes, Addr]]) -> List[Tuple[bytes, Addr]]:
        """The batch the data plane handles next, from the datagrams just drained (a role that waits
        for more before deciding overrides this: :class:`~.nodes.SMLSwitchNode`)."""
        return got

    def handle_batch(self, got: List[Tuple[bytes, Addr]]) -> None:
        """Everything drained from the socket: each datagram's packets to :meth:`handle`, in order
        (a role that processes a whole batch at once overrides this)."""
        handle, packets = self.handle, self.packets
        for buf, addr in got:
            for pkt in packets(buf):
                handle(pkt, addr)

    def packets(self, buf: bytes) -> List[bytes]:
        """The packets of one datagram (the format's ``split``)."""
        return self.fmt.split(buf)

    def faults(self, loss: float, duplicate: float, seed: int) -> None:
        """Injected ingress faults (seeded): each arriving packet is lost with probability
        ``loss``, delivered twice with probability ``duplicate``; both counted."""
        if not (0.0 <= loss < 1.0 and 0.0 <= duplicate < 1.0):
            raise ValueError(f"loss and duplicate must be in [0, 1), got {loss}, {duplicate}")
        self.loss, self.duplicate = loss, duplicate
        self.rng = random.Random(seed)
        self.injected_loss = self.injected_dup = 0

    def copies(self) -> int:
        """How many times the arriving packet enters the data plane (0: lost)."""
        if self.loss and self.rng.random() < self.loss:
            self.injected_loss += 1
            return 0
        if self.duplicate and self.rng.random() < self.duplicate:
            self.injected_dup += 1
            return 2
        return 1

    def handle(self, buf: bytes, addr: Optional[Addr] = None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Release what the role holds beyond its sockets (nothing, except the BMv2 switch)."""

    def send(self, data: bytes, addr: Addr) -> None:
        try:
            self.sock.sendto(data, addr)
        except OSError:  # a peer that went away (ICMP unreachable): the protocol recovers
            self.send_errors += 1

    send_errors = 0
    #: seconds the data-plane loop busy-polls the socket before blocking (0: never; a role whose
    #: host has a core for every process of its jobs sets it, :func:`~.frames.spin_budget`)
    spin_s = 0.0
    loss = duplicate = 0.0
    injected_loss = injected_dup = 0


