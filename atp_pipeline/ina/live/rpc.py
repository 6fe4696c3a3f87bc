"""Control channel of the live roles: job setup and teardown (§5.1), statistics, shutdown.

The data plane is UDP (:mod:`.nodes`); control is a small request/response protocol over
``multiprocessing.connection`` (TCP, HMAC-authenticated with ``ATP_AUTHKEY``, default
``atp-pipeline``): a request is ``(op, kwargs)``, the answer ``("ok", value)`` or
``("error", message)``. The same server class serves the switch emulator and the
parameter server; a Tofino deployment replaces the switch's side by the BFRuntime control
plane (:mod:`atp_pipeline.ina.p4.control`).
"""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import Client, Listener
from typing import Any, Callable, Dict, Tuple

Addr = Tuple[str, int]


class AggregationError(RuntimeError):
    """The live aggregation backend failed (a role unreachable, a job stalled, overflow)."""


def authkey() -> bytes:
    return os.environ.get("ATP_AUTHKEY", "atp-pipeline").encode()


def parse_addr(text: str) -> Addr:
    """``"host:port"`` → ``(host, port)`` with a clear error."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {text!r} is not host:port")
    return host, int(port)


class ControlServer:
    """Serves ``handler(op, kwargs)`` to any number of clients, one thread per connection."""

    def __init__(self, handler: Callable[[str, Dict[str, Any]], Any], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.handler = handler
        self.listener = Listener((host, port), authkey=authkey())
        self.address: Addr = self.listener.address  # type: ignore[assignment]
        self._closed = False
        threading.Thread(target=self._accept, name="atp-control", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except Exception:  # noqa: BLE001 - closed, or a client that failed authentication
                if self._closed:
                    return
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        with conn:
            while True:
                try:
                    op, kw = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", self.handler(op, kw))
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    reply = ("error", f"{type(e).__name__}: {e}")
                try:
                    conn.send(reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass


def call(addr: Addr, op: str, timeout: float = 10.0, what: str = "role", **kw: Any) -> Any:
    """One request to a role's control server; :class:`AggregationError` naming the role
    and address when it is unreachable, does not answer within ``timeout``, or fails."""
    try:
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            conn = Client(tuple(addr), authkey=authkey())
        finally:
            socket.setdefaulttimeout(old)
    except (OSError, EOFError) as e:
        raise AggregationError(f"ATP {what} at {addr[0]}:{addr[1]} is unreachable ({e.__class__.__name__}: "
                               f"{e}); did it stop?") from None
    with conn:
        try:
            conn.send((op, kw))
            if not conn.poll(timeout):
                raise AggregationError(f"ATP {what} at {addr[0]}:{addr[1]} did not answer {op!r} "
                                       f"within {timeout:.0f} s")
            status, value = conn.recv()
        except (OSError, EOFError) as e:
            raise AggregationError(f"ATP {what} at {addr[0]}:{addr[1]} closed the control connection "
                                   f"during {op!r} ({e.__class__.__name__})") from None
    if status != "ok":
        raise AggregationError(f"ATP {what} at {addr[0]}:{addr[1]}: {op} failed: {value}")
    return value
