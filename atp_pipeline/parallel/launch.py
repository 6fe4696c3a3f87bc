"""Run a function on N real processes with a torch.distributed process group.

``spawn(fn, world, *args)`` starts ``world`` processes (spawn context), initializes gloo
(or NCCL with ``backend="nccl"``) over TCP on a free loopback port, calls
``fn(rank, world, *args)`` in each and returns the per-rank results in rank order. A
failure in any rank raises in the caller with that rank's traceback; no process is left
behind. With ``init=False`` the process group is left to the function (e.g. a Lightning
Trainer): each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_RUN_ID``...), so Lightning treats
the processes as externally launched and never re-executes ``sys.argv``.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable, List

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world: int, port: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "NODE_RANK": "0", "TORCHELASTIC_RUN_ID": f"atp-{port}"}


def _entry(rank: int, world: int, port: int, backend: str, threads: int, fn: Callable[..., Any],
           args: tuple, results: "mp.Queue", init: bool = True) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world)
        else:
            os.environ.update(torchrun_env(rank, world, port))
        out = fn(rank, world, *args)
        if dist.is_initialized():
            dist.barrier()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", threads: int = 1,
          timeout: float = 600.0, init: bool = True) -> List[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` computed in ``world`` processes."""
    ctx = mp.get_context("spawn")
    results: "mp.Queue" = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, threads, fn, args, results, init),
                         daemon=False) for r in range(world)]
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    for p in procs:
        p.start()
    out: List[Any] = [None] * world
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"spawn: no result from {world} workers within {timeout:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
    return out
