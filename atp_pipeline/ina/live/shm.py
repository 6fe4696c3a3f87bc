"""The shared-memory transport of the live SwitchML path (``aggregation.transport=shm``).

On one host, every byte a datagram carries is copied twice by the kernel (into the socket,
out of it), and the switch role sends each result once per worker: a sync moves 16 times the
gradient through loopback for 4 workers, against ring's 12. With this
transport the packets still travel as UDP datagrams between the processes — the same
headers, the same protocol, loss and retransmission — but a packet's lanes stay in shared
memory:

* each worker owns a segment of ``2 × pool × K`` int32 lanes (:func:`create_lanes`): the chunk
  it sends through slot ``s`` in version ``v`` is quantized straight into ``lanes[v, s]``;
* the switch keeps the job's registers (its ``2 × pool × K`` slot sums) in a segment of its
  own (:class:`SharedLanes`), and a result is its header: every worker reads the sum from
  ``registers[v, s]`` — the multicast costs no copy.

SwitchML's shadow copies make the sharing safe (:class:`~atp_pipeline.ina.switchml.SMLFloatWorker`):
a slot-version is rewritten only after every worker has read what it held. UDP stays the
default live transport; this one is explicit and SwitchML's only (ATP's aggregators are
allocated per packet and freed by parameter packets that may be lost: a lane a packet
pointed to could be gone when a retransmission needs it).

Segments are POSIX shared memory (``/dev/shm``), created by their owner, which unlinks them
at teardown; a process that only attaches one never unlinks it. Each segment is known to one
resource tracker exactly once: its owner's (registered at creation, unregistered by the
unlink). An attaching process never registers it (:func:`attach`): Python < 3.13 registers
attached segments too, and processes started from one parent share one tracker, so the ranks
attaching the switch's registers and dropping them again made the tracker unregister a name
twice — a ``KeyError`` traceback from ``resource_tracker.py`` on every run.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, List, Optional, Tuple

import numpy as np


def create_lanes(pool: int, k: int) -> Tuple[SharedMemory, np.ndarray]:
    """A new segment of ``(2, pool, k)`` int32 lanes (zeros) and the array over it."""
    shm = SharedMemory(create=True, size=max(1, 2 * pool * k * 4))
    return shm, np.ndarray((2, pool, k), dtype=np.int32, buffer=shm.buf)


_ATTACH = threading.Lock()  # (attach's registration filter is process-wide while it is in place)


def attach(name: str) -> SharedMemory:
    """Map the segment ``name`` created by another process, without registering it with this
    process's resource tracker (module docstring): never unlinked from here, not even at exit."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    register = resource_tracker.register
    want = name if name.startswith("/") else "/" + name  # (the name the tracker would be given)

    def skip_ours(n: Any, rtype: str) -> None:
        if not (rtype == "shared_memory" and n == want):
            register(n, rtype)

    with _ATTACH:  # Python < 3.13: SharedMemory(name=...) registers; this one call does not
        resource_tracker.register = skip_ours
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def lanes_of(shm: SharedMemory, pool: int, k: int) -> np.ndarray:
    """The ``(2, pool, k)`` int32 array over an attached segment (checked to be large enough)."""
    need = 2 * pool * k * 4
    if shm.size < need:
        raise ValueError(f"shared-memory segment {shm.name} has {shm.size} bytes, {need} needed (pool {pool}, K {k})")
    return np.ndarray((2, pool, k), dtype=np.int32, buffer=shm.buf)


def release(shm: Optional[SharedMemory], unlink: bool) -> None:
    """Unmap ``shm`` (where no array still points into it) and, for its owner, unlink it."""
    if shm is None:
        return
    try:
        shm.close()
    except BufferError:  # an array still uses the mapping: it goes with the process
        pass
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class SharedLanes:
    """The switch's side of one job: the workers' lane segments (attached, worker-id order) and
    the job's registers in a segment of its own (:attr:`name`)."""

    def __init__(self, worker_segments: List[str], pool: int, k: int) -> None:
        self.pool, self.k = pool, k
        self._attached: List[SharedMemory] = []
        self._own: Optional[SharedMemory] = None
        try:
            for name in worker_segments:
                self._attached.append(attach(name))
            self.lanes = [lanes_of(s, pool, k) for s in self._attached]
            self._own, self.registers = create_lanes(pool, k)
        except BaseException:
            self.close()
            raise
        self.name = self._own.name

    def close(self) -> None:
        """Detach the workers' segments, unlink the registers' (arrays over them dropped first)."""
        self.lanes, self.registers = [], np.zeros((2, self.pool, self.k), dtype=np.int32)
        for s in self._attached:
            release(s, unlink=False)
        release(self._own, unlink=True)
        self._attached, self._own = [], None
