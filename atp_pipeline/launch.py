"""Run a function on N real processes with a torch.distributed process group.

``spawn(fn, world, *args)`` starts ``world`` processes, initializes gloo
(or NCCL with ``backend="nccl"``) over TCP on a free loopback port, calls
``fn(rank, world, *args)`` in each and returns the per-rank results in rank order. A
failure in any rank raises in the caller with that rank's traceback; no process is left
behind. With ``init=False`` the process group is left to the function (e.g. a Lightning
Trainer): each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_RUN_ID``...), so Lightning treats
the processes as externally launched and never re-executes ``sys.argv``. Results travel
by value (plain pickle), so a rank may return tensors and exit at once.

Processes start from a fork server (multiprocessing's ``forkserver`` context) that has
imported torch and Lightning once: a fresh interpreter per rank would import them again
(Lightning pulls torchmetrics, which pulls transformers: ~9 s of CPU per process), so a
launch of 8 ranks on 2 cores spent ~40 s importing. The server is started fresh by this
process (no threads, no CUDA, no process group) or inherited from the process this one was
forked from; each rank is forked from it and gets this process's environment, working
directory, stdout and stderr as they are at the launch (not the server's, from its start);
``ATP_START_METHOD=spawn`` restores a fresh interpreter per rank. A rank ends when its launcher
has gone, however it went (:func:`_die_with`).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from atp_pipeline.errors import LaunchError  # noqa: F401 - raised here, caught by the entry point

if TYPE_CHECKING:
    import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world: int, port: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "NODE_RANK": "0", "TORCHELASTIC_RUN_ID": f"atp-{port}"}


# imported once by the fork server (missing ones are skipped by multiprocessing)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "pytorch_lightning",
           "atp_pipeline._forkserver_exit"]


def _context() -> Any:
    import torch.multiprocessing as mp  # here: prestart() runs before the launcher imports torch

    method = os.environ.get("ATP_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


_STARTED = (0, 0)  # (this process, the fork server prestart() started in it)


def prestart() -> None:
    """Start the fork server now (it imports :data:`PRELOAD` in the background), so the
    launcher's own work (resolving the run: imports, the plan) overlaps with it;
    :func:`spawn` then finds it running. Needs no torch in this process: the server is the
    standard library's, which ``torch.multiprocessing`` re-exports."""
    global _STARTED
    if os.environ.get("ATP_START_METHOD", "forkserver") == "forkserver" and not os.environ.get("TORCHELASTIC_RUN_ID"):
        import multiprocessing
        from multiprocessing import forkserver

        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        before = forkserver._forkserver._forkserver_pid
        forkserver.ensure_running()
        if forkserver._forkserver._forkserver_pid != before:
            _STARTED = (os.getpid(), forkserver._forkserver._forkserver_pid)


def stop_prestarted() -> None:
    """Stop a fork server :func:`prestart` started when the run turned out not to need it
    (bad input): its preload would otherwise go on for seconds after this process exits. One
    this process did not start (inherited, or serving others) is left running."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the standard library's singleton (no public stop)
    pid = getattr(server, "_forkserver_pid", None)
    if pid and _STARTED == (os.getpid(), pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server._stop()


class _Stdio:
    """The launcher's stdout and stderr, handed to a rank (pickled while the rank starts, the
    descriptors travel as multiprocessing passes a pipe's): a rank forked from a fork server
    would otherwise write where the server's were at its start."""

    def __reduce__(self) -> Any:
        from multiprocessing import reduction

        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (AttributeError, OSError, ValueError):
                pass
        fds = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
                fds.append((fd, reduction.DupFd(fd)))
            except OSError:  # closed in the launcher: the rank keeps what it has
                pass
        return _redirect, (fds,)


def _redirect(fds: List[Any]) -> None:
    """In the rank, while its arguments are unpickled (before :func:`_entry` runs)."""
    for fd, wrapped in fds:
        got = wrapped.detach()
        if got != fd:
            os.dup2(got, fd)
            os.close(got)


def _die_with(launcher: int) -> None:
    """In a rank: end this process (SIGKILL) when the ``launcher`` process has gone. A launcher
    killed outright (``kill -9`` of ``python train.py``) cannot stop its ranks, and they are not its
    children but the fork server's, which may outlive it (a server inherited from the process
    the launcher was forked from); its ranks would go on training for nobody. A daemon thread
    blocked on the launcher's pidfd (Linux): no polling. Elsewhere, or without pidfds, nothing."""
    import select
    import threading

    try:
        fd = os.pidfd_open(launcher)  # type: ignore[attr-defined]
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="atp-launcher-watch", daemon=True).start()


def _entry(rank: int, world: int, port: int, backend: str, threads: int, fn: Callable[..., Any],
           args: tuple, results: "mp.Queue", init: bool = True, env: Optional[dict] = None,
           stdio: Any = None, launcher: int = 0) -> None:
    # (stdio, a _Stdio, redirected this process's stdout and stderr as it was unpickled)
    if launcher:
        _die_with(launcher)
    import torch
    import torch.distributed as dist

    if env is not None:  # the launcher's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # spawn() asks a hung rank for its stacks
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
        # by value: torch.multiprocessing's queue pickler would share a tensor's storage
        # through this process's file-descriptor server, gone once the process exits
        # (the parent then fails with FileNotFoundError while unpickling)
        results.put((rank, True, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dump_stacks(procs: List[Any]) -> None:
    """Ask hung ranks to print every thread's Python stack to their stderr (the launcher's),
    so a report of ranks that gave no result says where they were blocked."""
    for p in procs:
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(1.0)


PORT_TAKEN = ("EADDRINUSE", "address already in use")

# what a rank says when another rank went first (its peer closed the connections, or tore the job down)
AFTER_ANOTHER = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                 "Application timeout caused pair closure", "torn down meanwhile", "gave no result within")


LOST_GRACE_S = 10.0
DEPENDENCY = "the ranks lost what they depend on: "  # a failure that spawn's ``watch`` reported


def _exception_line(report: str) -> str:
    """The last exception line of a traceback (the outermost exception's first line)."""
    lines = [ln for ln in report.splitlines() if ln.strip()]
    head = [ln for ln in lines if ln[:1] not in (" ", "\t") and not ln.startswith(
        ("Traceback", "During handling", "The above exception", "rank "))]
    return (head[-1] if head else lines[-1] if lines else "").strip()


def first_cause(failures: List[str]) -> str:
    """One line naming what failed first: a rank that died without reporting (killed: its peers'
    errors follow from it), else the first rank whose error is not a consequence of another's
    (:data:`AFTER_ANOTHER`), else the first report."""
    if not failures:
        return ""
    lost = [f for f in failures if f.startswith(DEPENDENCY)]
    if lost:
        return lost[0][len(DEPENDENCY):]
    dead = [f for f in failures if "died without reporting" in f]
    if dead:
        return dead[0].splitlines()[0]
    own = [f for f in failures if not any(w in f for w in AFTER_ANOTHER)] or failures
    first = own[0]
    head = first.splitlines()[0]
    if not head.endswith(":"):  # already one line (e.g. ranks that gave no result)
        return head
    if "[Errno 28]" in first or "No space left on device" in first:  # often wrapped (a checkpoint writer's)
        where = " while saving a checkpoint" if "checkpoint" in first.lower() else ""
        return f"{head} OSError: [Errno 28] No space left on device{where}"
    return f"{head} {_exception_line(first)[:400]}"


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", threads: int = 1,
          timeout: float = 600.0, init: bool = True, failure_grace: float = 30.0, port_retries: int = 2,
          watch: Optional[Callable[[], Optional[str]]] = None) -> List[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` computed in ``world`` processes.

    A rank that raises or dies (e.g. killed) is reported with the others' errors: after the
    first failure the remaining ranks get ``failure_grace`` seconds to finish or fail on
    their own (so their own error is reported) before they are terminated.

    The rendezvous port is one the kernel had free a moment before; a process starting
    beside this one (another launch, or a client connection given it as its ephemeral
    port) may take it before rank 0 listens on it. Rank 0 then fails with ``EADDRINUSE``
    before any step: the launch is repeated on a new port, ``port_retries`` times at most.

    ``watch``, polled while the ranks run, returns a line when something the ranks depend on
    failed (e.g. an aggregation role died): it counts as the first failure, and names the cause."""
    for attempt in range(port_retries + 1):
        try:
            return _spawn_once(fn, world, args, backend, threads, timeout, init, failure_grace, watch)
        except RuntimeError as e:
            if attempt == port_retries or not any(w in str(e) for w in PORT_TAKEN):
                raise
            print(f"launch: the rendezvous port was taken before rank 0 listened on it; launching again on "
                  f"another port ({attempt + 1} of {port_retries})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _spawn_once(fn: Callable[..., Any], world: int, args: tuple, backend: str, threads: int, timeout: float,
                init: bool, failure_grace: float, watch: Optional[Callable[[], Optional[str]]] = None
                ) -> List[Any]:
    ctx = _context()
    results: "mp.Queue" = ctx.Queue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, threads, fn, args, results, init, env, _Stdio(),
                                              os.getpid()), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    out: List[Any] = [None] * world
    done: dict = {}  # rank -> (ok, value)
    failures: List[str] = []
    deadline = time.monotonic() + timeout
    first_failure: Optional[float] = None
    try:
        while len(done) < world:
            try:
                rank, ok, value = results.get(timeout=0.5)
                done[rank] = (ok, pickle.loads(value) if ok else value)
                if not ok:
                    failures.append(f"rank {rank} failed:\n{value}")
            except queue.Empty:
                gone = watch() if watch is not None and not any(f.startswith(DEPENDENCY) for f in failures) else None
                if gone:
                    failures.insert(0, f"{DEPENDENCY}{gone}")
                for r, p in enumerate(procs):  # a process that died without reporting (killed)
                    if r not in done and p.exitcode is not None:
                        time.sleep(0.2)  # its result may still be in the pipe
                        if r in done or not results.empty():
                            break
                        done[r] = (False, None)
                        failures.append(f"rank {r} died without reporting (exit code {p.exitcode}"
                                        + (f", signal {-p.exitcode}" if p.exitcode < 0 else "") + ")")
            now = time.monotonic()
            if failures and first_failure is None:
                first_failure = now
            # the port was taken: the others wait for a rank 0 that will never listen
            grace = 0.0 if any(w in f for f in failures for w in PORT_TAKEN) else failure_grace
            lost = any(f.startswith(DEPENDENCY) or "died without reporting" in f for f in failures)
            if lost:
                # nothing left to finish: a rank or a role is gone; the others get a moment to say
                # what they saw, and every rank has exited within 30 s of the failure
                grace = min(grace, LOST_GRACE_S)
            if now > deadline or (first_failure is not None and now - first_failure > grace):
                missing = [r for r in range(world) if r not in done]
                failures.append(f"ranks {missing} gave no result within "
                                + (f"{grace:.0f} s of the first failure; terminated" if first_failure
                                   else f"{timeout:.0f} s")
                                + ("" if lost else " (their Python stacks are on stderr above)"))
                if grace and not lost:  # (blocked because a rank or a role is gone: no mystery to print)
                    _dump_stacks([procs[r] for r in missing])
                break
        if failures:
            raise LaunchError(failures, first_cause(failures))
        for r, (_, value) in done.items():
            out[r] = value
    finally:
        for p in procs:
            p.join(timeout=1 if failures else 10)
        for p in procs:  # a rank blocked in a collective may survive SIGTERM (Lightning handles it)
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out
