"""Control channel of the live roles: job setup and teardown (ATP §5.1), statistics, shutdown.

The data plane is UDP (:mod:`.nodes`); control is a request/response protocol over TCP whose
messages are JSON objects in length-prefixed frames (:mod:`.wire`: 4-byte big-endian length,
UTF-8 JSON, at most :data:`~.wire.MAX_FRAME` bytes). Nothing received is unpickled or
evaluated. A connection starts with the mutual HMAC challenge-response of :mod:`.auth` (the
role's secret: no default); then each request frame gets one reply frame:

* request ``{"op": OP, "args": {NAME: VALUE, ...}, "token": TOKEN or null}``
* reply ``{"ok": true, "value": VALUE}`` or ``{"ok": false, "error": "Type: one line"}``

``TOKEN`` is a hex string of 32 to 128 characters. Each ``OP`` has an access rule
(:data:`OPS`) that the role enforces (:mod:`.tenancy`): ``any`` authenticated client;
``setup`` binds the new job to the token presented (the tenant's: one per training run,
:attr:`.services.Services.tenant`); ``job``: only with the token the job was set up with;
``stats``: a tenant sees its own jobs, the role's owner all; ``owner``: only with the token
the role printed in its start line (the process that started it).

============  ========  ====================================================  ======================
op            access    args                                                  value
============  ========  ====================================================  ======================
info          any       —                                                     role, data, control,
                                                                              pid, payload_k, ...
add_job       setup     switch: up, down, job, [two_level] | SwitchML: down,  the job id (int)
                        job, pool, [shm] | PS: job, workers, switch, n_ps,
                        racks
remove_job    job       job                                                   aggregators freed
                                                                              (int) | bool (PS)
aggregator    job       job, seq                                              bitmap (int) or null
missing       job       job, seq (PS)                                         {installed, missing}
shm           job       job (SwitchML over shm)                               segment name (str)
stats         stats     —                                                     {..., jobs: {"<id>":
                                                                              {...}}, control: ...}
cpu           owner     —                                                     CPU seconds (float)
shutdown      owner     —                                                     true
============  ========  ====================================================  ======================

Argument types (:data:`ARGS`; anything else is refused before the role sees it): ``job`` an
int 0..65535 (``null`` in ``add_job``: the switch picks a free id), ``seq`` 0..2^32-1, an
address ``[host, port]`` (``switch``), lists of at most 1,024 addresses (``up``, ``down``,
``workers``), ``pool`` 1..65536, ``n_ps`` 1..4, ``racks`` 1..1024, ``two_level`` a bool,
``shm`` ``null`` or at most 255 segment names. JSON object keys are strings: per-job
statistics are keyed by the job id in decimal.

A role closes a connection that fails the handshake, sends a malformed or oversized frame,
or a request that breaks this schema (it replies with the error first where the frame was
readable) and keeps serving the others; it serves at most :data:`MAX_CONNECTIONS` at once.
The same server class serves the switch emulator, BMv2 switch and the parameter server; a
Tofino deployment replaces the switch's side by the BFRuntime control plane
(:mod:`atp_pipeline.ina.p4.control`).
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from atp_pipeline.ina.live import auth, wire

Addr = Tuple[str, int]

#: op -> access rule (see the module docstring)
OPS: Dict[str, str] = {"info": "any", "add_job": "setup", "remove_job": "job", "aggregator": "job",
                       "missing": "job", "shm": "job", "stats": "stats", "cpu": "owner", "shutdown": "owner"}
MAX_CONNECTIONS = 32  # connections a role serves at once; more are closed at once
HANDSHAKE_S = 5.0  # a client that has not authenticated by then is dropped
IDLE_S = 60.0  # an authenticated connection idle this long is closed
MAX_ADDRS = 1024
_TOKEN = re.compile(r"[0-9a-fA-F]{32,128}")
_SEGMENT = re.compile(r"/?[A-Za-z0-9_.-]{1,64}")


class AggregationError(RuntimeError):
    """The live aggregation backend failed (a role unreachable, a job stalled, overflow)."""


class RequestError(ValueError):
    """A request that breaks the message schema (the connection is closed after the reply)."""


def parse_addr(text: str) -> Addr:
    """``"host:port"`` → ``(host, port)`` with a clear error."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r} is not host:port")
    return host, int(port)


def _int(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and lo <= v <= hi


def _addr(v: Any) -> bool:
    return (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and 0 < len(v[0]) <= 255
            and type(v[1]) is int and 0 <= v[1] <= 0xFFFF)


def _addrs(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_ADDRS and all(_addr(a) for a in v)


def _segments(v: Any) -> bool:
    return v is None or (isinstance(v, list) and len(v) <= 255
                         and all(isinstance(s, str) and _SEGMENT.fullmatch(s) for s in v))


#: argument name -> its type check (the module docstring's "Argument types")
ARGS: Dict[str, Callable[[Any], bool]] = {
    "job": lambda v: v is None or _int(0, 0xFFFF)(v), "seq": _int(0, (1 << 32) - 1), "up": _addrs,
    "down": _addrs, "workers": _addrs, "switch": _addr, "pool": _int(1, 1 << 16), "n_ps": _int(1, 4),
    "racks": _int(1, MAX_ADDRS), "two_level": lambda v: isinstance(v, bool), "shm": _segments,
}


def check_request(msg: Dict[str, Any]) -> Tuple[str, Dict[str, Any], Optional[str]]:
    """``(op, args, token)`` of a request frame; :class:`RequestError` naming what breaks the schema."""
    extra = set(msg) - {"op", "args", "token"}
    if extra:
        raise RequestError(f"unknown request fields {sorted(extra)}")
    op, args, token = msg.get("op"), msg.get("args", {}), msg.get("token")
    if not isinstance(op, str) or op not in OPS:
        raise RequestError(f"unknown control operation {op!r}" if isinstance(op, str) else "no operation")
    if not isinstance(args, dict):
        raise RequestError("args must be an object")
    for name, value in args.items():
        check = ARGS.get(name)
        if check is None:
            raise RequestError(f"{op}: unknown argument {name!r}")
        if not check(value):
            raise RequestError(f"{op}: argument {name}={str(value)[:80]} has the wrong type or range")
    if OPS[op] != "setup" and args.get("job", 0) is None:
        raise RequestError(f"{op}: job must be a job id")
    if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
        raise RequestError("token must be 32..128 hex characters")
    return op, args, token


Handler = Callable[[str, Dict[str, Any], Optional[str]], Any]


class ControlServer:
    """Serves ``handler(op, args, token)`` (args and token checked against the schema) to
    authenticated clients, one thread per connection; counts what it refused."""

    def __init__(self, handler: Handler, secret: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler, self._secret = handler, secret
        self.sock = socket.create_server((host, port))
        self.address: Addr = self.sock.getsockname()[:2]
        self.rejected = 0  # connections that failed the handshake
        self.malformed = 0  # connections closed for a malformed/oversized frame or request
        self.busy = 0  # connections refused at MAX_CONNECTIONS
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        threading.Thread(target=self._accept, name="atp-control", daemon=True).start()

    def counters(self) -> Dict[str, int]:
        return {"rejected": self.rejected, "malformed": self.malformed, "busy": self.busy}

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if not self._slots.acquire(blocking=False):
                self.busy += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(HANDSHAKE_S)
                try:
                    auth.serve_handshake(conn, self._secret)
                except (auth.AuthError, wire.FrameError, EOFError, OSError):
                    self.rejected += 1
                    return
                conn.settimeout(IDLE_S)
                while self._request(conn):
                    pass
        finally:
            self._slots.release()

    def _request(self, conn: socket.socket) -> bool:
        """Serve one request; False when the connection is to be closed."""
        try:
            msg = wire.recv(conn)
        except (EOFError, OSError):
            return False
        except wire.FrameError:
            self.malformed += 1
            return False
        try:
            op, args, token = check_request(msg)
        except RequestError as e:
            self.malformed += 1
            self._reply(conn, {"ok": False, "error": f"RequestError: {e}"})
            return False
        try:
            reply = {"ok": True, "value": self.handler(op, args, token)}
        except Exception as e:  # noqa: BLE001 - reported to the caller
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return self._reply(conn, reply)

    @staticmethod
    def _reply(conn: socket.socket, reply: Dict[str, Any]) -> bool:
        try:
            data = wire.encode(reply)
        except (TypeError, wire.FrameError) as e:  # the role's answer is not JSON: its bug, said so
            data = wire.encode({"ok": False, "error": f"the role's reply is not JSON-representable: {e}"})
        try:
            conn.sendall(data)
        except OSError:
            return False
        return True

    def close(self) -> None:
        self._closed = True
        for fn in (lambda: self.sock.shutdown(socket.SHUT_RDWR), self.sock.close):  # (wakes accept)
            try:
                fn()
            except OSError:
                pass


def call(addr: Addr, op: str, *, secret: str, token: Optional[str] = None, timeout: float = 10.0,
         what: str = "role", **args: Any) -> Any:
    """One request to a role's control server; :class:`AggregationError` naming the role and
    address when it is unreachable, refuses the secret, does not answer within ``timeout``,
    or fails."""
    where = f"ATP {what} at {addr[0]}:{addr[1]}"
    try:
        conn = socket.create_connection(tuple(addr), timeout=timeout)
    except OSError as e:
        raise AggregationError(f"{where} is unreachable ({e.__class__.__name__}: {e}); did it stop?") from None
    with conn:
        try:
            auth.join_handshake(conn, secret)
            wire.send(conn, {"op": op, "args": args, "token": token})
            reply = wire.recv(conn)
        except auth.AuthError as e:
            raise AggregationError(f"{where} refused the control channel's secret ({e}): set {auth.ENV} "
                                   f"to the secret it was started with") from None
        except socket.timeout:
            raise AggregationError(f"{where} did not answer {op!r} within {timeout:.0f} s") from None
        except (OSError, EOFError, wire.FrameError) as e:
            raise AggregationError(f"{where} closed the control connection during {op!r} "
                                   f"({e.__class__.__name__})") from None
    if reply.get("ok") is not True:
        raise AggregationError(f"{where}: {op} failed: {reply.get('error')}")
    return reply.get("value")


@dataclass(frozen=True)
class Peer:
    """How this process reaches one role's control channel: the address, the channel's
    secret, the token it presents (its tenant's, or the role's owner token) and the role's
    name in error messages."""

    addr: Addr
    secret: str
    token: Optional[str] = None
    what: str = "role"

    def call(self, op: str, timeout: float = 10.0, **args: Any) -> Any:
        return call(self.addr, op, secret=self.secret, token=self.token, timeout=timeout, what=self.what, **args)
