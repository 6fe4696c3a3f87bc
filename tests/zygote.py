"""A warm interpreter that forks one process per documented ``python`` command (the docs test's
launcher, :mod:`tests.test_docs_commands`).

Each ``python train.py ...`` or ``python -m <module> ...`` the docs show starts an interpreter that
imports torch, DTensor, Hydra and the package before it does anything (~3 s of CPU each on the
2-core dev machine, ~70 commands). The zygote imports them once; per command it forks a child
that becomes what ``python <argv>`` would be: its own session (so the runner's ``killpg`` stops it
and what it starts), the command's working directory, environment, ``sys.argv`` and
``sys.path[0]``, stdout and stderr into the command's log, then the script run as ``__main__``
(``runpy``, as the interpreter runs it) and an interpreter's exit: non-daemon threads joined,
``atexit`` handlers, the exit status of ``SystemExit`` (1 after an uncaught exception, its
traceback printed). Whatever the command starts — ranks, services — it starts as it would from a
fresh interpreter, except the ranks' fork server (:mod:`atp_pipeline.launch`): the zygote starts
one at its start and every child's launches fork their ranks from it (a server of their own
would import torch, DTensor and Lightning again: ~8 s of CPU a launch); a rank still gets its
launcher's environment, working directory, stdout and stderr (``launch._entry``), and a child
refused before it launches leaves the shared server running (``launch.stop_prestarted``). The
zygote runs no torch op (a fork after one could inherit a thread pool's state); it forks only.

The suite's own ``python train.py`` runs (``tests/conftest.py``: :func:`start_train`) fork from a
zygote of their own the same way.

Protocol (lines of JSON): the runner writes ``{"id", "argv", "cwd", "env", "log"}`` (and ``"err"``:
stderr into a file of its own, else both into ``log``) to the zygote's stdin; the zygote answers
``{"id", "pid"}`` when the child exists and ``{"id", "rc"}`` when it ended (``rc`` as
:attr:`subprocess.Popen.returncode`: ``-N`` for a signal).
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

#: what every documented command imports first (nothing that reads HOME or a cache path at import)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "hydra", "omegaconf",
           "atp_pipeline.cli", "atp_pipeline.config", "atp_pipeline.run")
_SHELL_CHARS = re.compile(r"[$`|&;<>*?(){}!\\]")


def argv_of(cmd: str) -> Optional[List[str]]:
    """``cmd``'s argv when it is a plain ``python <script> ...`` / ``python -m <module> ...`` a
    zygote child can be (no shell syntax besides quoting), else ``None`` (bash runs it)."""
    if _SHELL_CHARS.search(cmd):
        return None
    try:
        argv = shlex.split(cmd)
    except ValueError:
        return None
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "", cmd)
    if re.search(r"[\[\]~]", unquoted):  # globbing or a home directory: the shell's business
        return None
    if len(argv) >= 2 and argv[0] in ("python", "python3") and (
            argv[1].endswith(".py") or (argv[1] == "-m" and len(argv) >= 3 and not argv[2].startswith("-"))):
        return argv[1:]
    return None


# ------------------------------------------------------------------------------ the zygote itself
def _adopt_fork_server() -> None:
    """In a child: launches use the zygote's fork server. multiprocessing checks its server with
    ``waitpid``, which fails in a process that did not start it (``os.fork`` copied the handle,
    not the parenthood): the check becomes "is it alive", and a new server starts if it is not."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return

    def ensure_running() -> None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # gone: this child starts its own, as a fresh interpreter would
            server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None
            del server.ensure_running
            forkserver.ensure_running = server.ensure_running
            server.ensure_running()
            return
        resource_tracker.ensure_running()

    # the instance's (connect_to_new_process calls it) and the module's alias of it
    server.ensure_running = forkserver.ensure_running = ensure_running  # type: ignore[method-assign]


def _child(req: dict) -> None:
    """In the forked child: become ``python <argv>`` and exit as it would."""
    import atexit
    import runpy
    import traceback

    os.setsid()
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    efd = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND) if req.get("err") else fd
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(efd, 2)
    for f in {fd, efd, null}:
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)  # block-buffered to a file, as `python ... > log`
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    _adopt_fork_server()
    argv = req["argv"]
    code: object = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` calls
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - an uncaught exception, as the interpreter reports it
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit order
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code & 0xFF)


def serve() -> None:
    """The zygote's loop: preload, say ``ready``, fork a child per request, report its end."""
    import importlib

    out = os.fdopen(os.dup(1), "w", buffering=1)  # the answers; stray prints go to stderr
    os.dup2(2, 1)
    for m in PRELOAD:
        importlib.import_module(m)
    from atp_pipeline.launch import prestart

    prestart()  # the ranks' fork server, shared by every child (_adopt_fork_server)
    out.write(json.dumps({"ready": True}) + "\n")
    children: Dict[int, int] = {}
    buf = b""
    stdin_open = True
    while stdin_open or children:
        if stdin_open:
            ready, _, _ = select.select([0], [], [], 0.05)
            if ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    stdin_open = False
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        out.close()
                        _child(req)
                    children[pid] = req["id"]
                    out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
        else:
            select.select([], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            if pid in children:
                out.write(json.dumps({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)}) + "\n")


# ------------------------------------------------------------------------------ the runner's side
class Child:
    """A zygote child as the runner sees it: ``pid`` (its session), ``poll``, ``wait``."""

    def __init__(self, zygote: "Zygote", ident: int, pid: int):
        self.zygote, self.id, self.pid = zygote, ident, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.zygote._rc(self, block=False)

    def wait(self, timeout: Optional[float] = None) -> int:
        rc = self.zygote._rc(self, block=True, timeout=timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
        return rc


class Zygote:
    """Starts ``python -m tests.zygote`` with ``env`` and hands it commands (:meth:`start`)."""

    def __init__(self, env: Dict[str, str], cwd: Path, timeout: float = 120.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.cv = threading.Condition()
        self.pids: Dict[int, int] = {}
        self.rcs: Dict[int, int] = {}
        self.next_id = 0
        self.ready = False
        self.dead = False
        threading.Thread(target=self._read, daemon=True).start()
        with self.cv:
            self.cv.wait_for(lambda: self.ready or self.dead, timeout=timeout)
            if not self.ready:
                self.close()
                raise RuntimeError("the zygote did not start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cv:
                if msg.get("ready"):
                    self.ready = True
                elif "pid" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                elif "rc" in msg:
                    self.rcs[msg["id"]] = msg["rc"]
                self.cv.notify_all()
        with self.cv:
            self.dead = True
            self.cv.notify_all()

    def start(self, argv: List[str], cwd: Path, env: Dict[str, str], log: Path, err: Optional[Path] = None) -> Child:
        with self.cv:
            if self.dead:
                raise RuntimeError("the zygote is gone")
            ident = self.next_id
            self.next_id += 1
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": ident, "argv": argv, "cwd": str(cwd), "env": env,
                                              "log": str(log), "err": str(err) if err else None}) + "\n")
            self.proc.stdin.flush()
            self.cv.wait_for(lambda: ident in self.pids or self.dead)
            if ident not in self.pids:
                raise RuntimeError("the zygote is gone")
            return Child(self, ident, self.pids[ident])

    def _rc(self, child: Child, block: bool, timeout: Optional[float] = None) -> Optional[int]:
        with self.cv:
            if block:
                self.cv.wait_for(lambda: child.id in self.rcs or self.dead, timeout=timeout)
            if child.id in self.rcs:
                child.returncode = self.rcs[child.id]
            elif self.dead:
                child.returncode = -9
            return child.returncode

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    serve()
