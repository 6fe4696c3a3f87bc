"""BMv2's packet interface over nanomsg (``simple_switch --packet-in ipc://...``), via ctypes.

``simple_switch`` binds a nanomsg PAIR socket and exchanges frames on it: a message is
``struct.pack("<iii", type, port, length) + frame`` with type 3 (packet in: a frame arriving
on ``port``) or 4 (packet out: a frame the switch sends on ``port``) — BMv2's
``dev_mgr_packet_in.cpp``. Unlike a libpcap capture ring on a veth interface (which loses
every frame of a burst beyond a few dozen here), a nanomsg send blocks while the switch's
receive buffer is full, so the switch takes frames as fast as its ingress runs. The
library is ``libnanomsg.so.5``, which the toolchain's ``install.sh`` installs for BMv2.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import struct
from typing import List, Optional, Tuple

AF_SP = 1
NN_PAIR = 16  # NN_PROTO_PAIR * 16
NN_SOL_SOCKET = 0
NN_LINGER = 1
NN_SNDBUF = 2
NN_RCVBUF = 3
NN_RCVFD = 11
NN_DONTWAIT = 1
MSG_PACKET_IN = 3
MSG_PACKET_OUT = 4
_HDR = struct.Struct("<iii")
MAX_FRAME = 16384


def _lib() -> ctypes.CDLL:
    for name in ("libnanomsg.so.5", ctypes.util.find_library("nanomsg")):
        if name:
            try:
                return ctypes.CDLL(name, use_errno=True)
            except OSError:
                continue
    raise OSError("libnanomsg.so.5 not found (the P4 toolchain's install.sh installs libnanomsg5)")


class PacketSocket:
    """A nanomsg PAIR socket connected to ``simple_switch --packet-in <addr>``."""

    def __init__(self, addr: str, buffer_bytes: int = 4 << 20) -> None:
        self._nn = nn = _lib()
        nn.nn_strerror.restype = ctypes.c_char_p
        nn.nn_send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        nn.nn_recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.s = nn.nn_socket(AF_SP, NN_PAIR)
        if self.s < 0:
            self._raise("nn_socket")
        for opt, val in ((NN_SNDBUF, buffer_bytes), (NN_RCVBUF, buffer_bytes), (NN_LINGER, 0)):
            v = ctypes.c_int(val)
            nn.nn_setsockopt(self.s, NN_SOL_SOCKET, opt, ctypes.byref(v), ctypes.sizeof(v))
        if nn.nn_connect(self.s, addr.encode()) < 0:
            self._raise(f"nn_connect({addr})")
        fd = ctypes.c_int(0)
        size = ctypes.c_size_t(ctypes.sizeof(fd))
        if nn.nn_getsockopt(self.s, NN_SOL_SOCKET, NN_RCVFD, ctypes.byref(fd), ctypes.byref(size)) < 0:
            self._raise("nn_getsockopt(NN_RCVFD)")
        self.rcvfd = fd.value  # readable while a message waits (for select)
        self._buf = ctypes.create_string_buffer(MAX_FRAME + _HDR.size)

    def _raise(self, what: str) -> None:
        e = self._nn.nn_errno()
        raise OSError(e, f"{what}: {self._nn.nn_strerror(e).decode()}")

    def send(self, port: int, frame: bytes) -> None:
        """``frame`` arrives at the switch on ``port`` (blocks while the switch is behind)."""
        msg = _HDR.pack(MSG_PACKET_IN, port, len(frame)) + frame
        while self._nn.nn_send(self.s, msg, len(msg), 0) < 0:
            if self._nn.nn_errno() != errno.EINTR:
                self._raise("nn_send")

    def recv(self) -> Optional[Tuple[int, bytes]]:
        """The next ``(port, frame)`` the switch sent, or ``None`` if none is waiting."""
        while True:
            n = self._nn.nn_recv(self.s, self._buf, len(self._buf), NN_DONTWAIT)
            if n < 0:
                e = self._nn.nn_errno()
                if e in (errno.EAGAIN, errno.EINTR):
                    return None
                self._raise("nn_recv")
            raw = self._buf.raw[:n]
            kind, port, length = _HDR.unpack_from(raw)
            if kind == MSG_PACKET_OUT:  # (port status messages are not frames)
                return port, raw[_HDR.size:_HDR.size + length]

    def recv_all(self) -> List[Tuple[int, bytes]]:
        out = []
        while True:
            got = self.recv()
            if got is None:
                return out
            out.append(got)

    def close(self) -> None:
        if self.s >= 0:
            self._nn.nn_close(self.s)
            self.s = -1
