"""The control channel's framing: length-prefixed JSON objects over a stream socket.

A frame is a 4-byte big-endian length ``n`` followed by ``n`` bytes of UTF-8 JSON whose top
level is an object. Both ends of the control channel (:mod:`.rpc`, :mod:`.auth`) read and
write frames only through this module. Nothing here evaluates, imports or unpickles what it
receives: a frame decodes to ``dict``/``list``/``str``/``int``/``float``/``bool``/``None`` or is
refused. Refused with :class:`FrameError` (the caller closes the connection): a length of 0
or above the reader's limit (checked before anything is allocated), bytes that are not
UTF-8, not JSON, JSON whose top level is not an object, ``NaN``/``Infinity``, or nesting too
deep to decode. What is sent is checked by :func:`plain` first: only JSON's own types (a
tuple is sent as a list), string keys, finite floats — a numpy scalar or an ``int`` key is a
bug of the sender and raises :class:`TypeError` instead of changing type on the way.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from typing import Any, Dict

#: the largest frame either end reads (1 MiB: a role's statistics for thousands of jobs)
MAX_FRAME = 1 << 20
HEADER = struct.Struct("!I")


class FrameError(ValueError):
    """A malformed or oversized frame: the connection it came on is closed."""


def plain(value: Any, where: str = "value") -> Any:
    """``value`` as JSON's own types (tuples become lists); :class:`TypeError` naming the
    place of anything else (a numpy scalar, bytes, a non-string key, a non-finite float)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value) is int:
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise TypeError(f"{where}: {value} is not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}, not a string")
            out[k] = plain(v, f"{where}[{k!r}]")
        return out
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__name__} is not a JSON value")


def encode(message: Dict[str, Any]) -> bytes:
    """One frame holding ``message`` (checked by :func:`plain`); :class:`FrameError` if it
    would exceed :data:`MAX_FRAME`."""
    if not isinstance(message, dict):
        raise TypeError(f"a frame holds a JSON object, not a {type(message).__name__}")
    body = json.dumps(plain(message, "message"), separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME:
        raise FrameError(f"a {len(body)}-byte message exceeds the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: Dict[str, Any]) -> None:
    sock.sendall(encode(message))


def _reject_constant(name: str) -> Any:
    raise FrameError(f"{name} is not a JSON number")


def decode(body: bytes) -> Dict[str, Any]:
    """The object a frame's body holds; :class:`FrameError` if it is not one."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FrameError(f"not a JSON frame ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise FrameError(f"a frame holds a JSON object, not a {type(value).__name__}")
    return value


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError(f"connection closed {got} bytes into a {n}-byte read")
        got += k
    return bytes(buf)


def recv(sock: socket.socket, limit: int = MAX_FRAME) -> Dict[str, Any]:
    """The next frame's object. :class:`EOFError` when the peer closed (between frames or in
    one), :class:`FrameError` for a frame longer than ``limit`` or malformed, ``OSError``
    (``socket.timeout`` included) from the socket."""
    (n,) = HEADER.unpack(_read(sock, HEADER.size))
    if not 0 < n <= limit:
        raise FrameError(f"a frame of {n} bytes (1..{limit} accepted)")
    return decode(_read(sock, n))
