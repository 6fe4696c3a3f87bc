"""Shared fixtures: compose the repository's config tree with Hydra's compose API."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from atp_pipeline.config import register_mesh_source, register_schemas

from .zygote import Zygote

register_schemas()
register_mesh_source()

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Modules that must not run beside each other under pytest-xdist (``-n 2 --dist loadgroup``):
# tests/test_live_aggregation.py asserts that no aggregation role process or socket is left
# anywhere on the host, and the documented ``aggregation=...`` commands start such roles.
SAME_WORKER = {"test_live_aggregation.py": "test_docs_commands.py"}
# The longest module groups, longest first (seconds alone on a 2-core host, 2026-11-27): they
# are handed out first so that the two workers end together (docs+live ~590, then ~130..50).
LONGEST_FIRST = ["test_docs_commands.py", "test_training.py", "test_hf_models.py", "test_data_parallel.py",
                 "test_sbp_exec.py", "test_overlap.py", "test_cli.py", "test_parallel.py"]


def pytest_report_header(config) -> str:
    """The versions this run resolved (a fresh machine resolves the newest pyproject allows)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"
    names = ("torch", "transformers", "lightning", "pytorch-lightning", "hydra-core")
    return "atp-pipeline resolved: " + ", ".join(f"{n} {v(n)}" for n in names)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """One xdist group per test module (its module-scoped launches run once, on one worker),
    modules of :data:`SAME_WORKER` sharing one; groups of :data:`LONGEST_FIRST` first.
    Without ``-n`` the marks change nothing and only the order of modules moves."""
    def group(item) -> str:
        name = item.path.relative_to(ROOT / "tests").as_posix()
        return SAME_WORKER.get(name, name)

    rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """``compose_cfg("topology=ic1", ...)`` -> the composed, typed config."""

    def _compose(*overrides: str) -> DictConfig:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
                return compose(config_name="config", overrides=list(overrides))
        finally:
            GlobalHydra.instance().clear()

    return _compose


def run_train(args: List[str], cwd: Optional[Path] = None, timeout: float = 120, fresh: bool = False
              ) -> subprocess.CompletedProcess:
    """Run ``python train.py args`` as a user would; output lands under ``cwd``."""
    return finish_train(start_train(args, cwd, fresh), timeout)


#: the suite's ``python train.py`` runs fork from a warm interpreter (:mod:`tests.zygote`, one per
#: pytest process): a fresh one imports torch, DTensor, Hydra and the package (~3 s of CPU on the 2-core
#: CI host) and a fit starts the ranks' fork server (~8 s) before it does anything. 0: every run its own
ZYGOTE = os.environ.get("ATP_TRAIN_ZYGOTE", "1") not in ("", "0")
_ZYGOTE: List[Any] = []  # [the zygote] once started, [None] where it did not start
_ZYGOTE_LOCK = threading.Lock()


def _train_env() -> Dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def _zygote() -> Optional[Zygote]:
    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            try:
                z: Optional[Zygote] = Zygote(_train_env(), ROOT)
            except (RuntimeError, OSError):
                z = None
            _ZYGOTE.append(z)
            if z is not None:
                atexit.register(z.close)
        return _ZYGOTE[0]


class ZygoteRun:
    """A ``python train.py`` forked from the zygote, as :func:`finish_train` uses a
    :class:`subprocess.Popen`: ``args``, ``pid``, ``returncode``, ``poll``, ``wait``, ``kill``
    (its session: the child is a session leader) and ``communicate`` (its stdout and stderr)."""

    def __init__(self, z: Zygote, args: List[str], cwd: Path, env: Dict[str, str]) -> None:
        fd, out = tempfile.mkstemp(prefix="train-", suffix=".out")
        os.close(fd)
        fd, err = tempfile.mkstemp(prefix="train-", suffix=".err")
        os.close(fd)
        self.args, self._out, self._err = args, Path(out), Path(err)
        try:
            self._child = z.start(args[1:], cwd, env, self._out, self._err)
        except RuntimeError:
            self._out.unlink(missing_ok=True)
            self._err.unlink(missing_ok=True)
            raise
        self.pid = self._child.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._child.returncode

    def poll(self) -> Optional[int]:
        return self._child.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._child.wait(timeout)

    def kill(self) -> None:
        if self._child.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def communicate(self, timeout: Optional[float] = None) -> Tuple[str, str]:
        self._child.wait(timeout)
        try:
            return (self._out.read_text(errors="replace"), self._err.read_text(errors="replace"))
        finally:
            self._out.unlink(missing_ok=True)
            self._err.unlink(missing_ok=True)


def start_train(args: List[str], cwd: Optional[Path] = None, fresh: bool = False) -> Any:
    """Start ``python train.py args`` (:func:`finish_train` waits for it): runs side by side,
    where most of each is starting up. Forked from the zygote (:data:`ZYGOTE`) unless ``fresh``:
    a test of what a fresh interpreter prints or imports asks for one."""
    argv = [sys.executable, str(ROOT / "train.py"), *args]
    z = _zygote() if ZYGOTE and not fresh else None
    if z is not None:
        try:
            return ZygoteRun(z, argv, cwd or ROOT, _train_env())
        except RuntimeError:  # the zygote is gone: this run starts on its own
            pass
    return subprocess.Popen(argv, cwd=cwd or ROOT, env=_train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_side_by_side(tmp: Path, cases: List[List[str]], conf: Optional[Path] = None
                     ) -> List[Tuple[subprocess.CompletedProcess, Path]]:
    """``python train.py`` for every case at once, each in a directory of its own under ``tmp``
    (``+USERCONF`` in a case: ``hydra.searchpath`` of ``conf``); per case, in order, its result
    and its run directory. For cases that end during start-up (bad input), which is mostly
    importing, so they share the cores."""
    started = []
    for i, args in enumerate(cases):
        cwd = tmp / f"case{i}"
        cwd.mkdir()
        args = [f"hydra.searchpath=[file://{conf}]" if a == "+USERCONF" else a for a in args]
        started.append((start_train([*args, f"hydra.run.dir={cwd / 'run'}"], cwd), cwd / "run"))
    return [(finish_train(p, 300), run) for p, run in started]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one that exited, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def finish_train(p: Any, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(autouse=True)
def _cores_are_given_back():
    """A test (or the benchmark it calls) that pins this process to fewer cores must give
    them back: every later rank would inherit the pinning and the suite would run on one core."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    if before is not None:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            pytest.fail(f"this test left the test process pinned to CPUs {sorted(after)} "
                        f"(it had {sorted(before)})")


def live_processes() -> Dict[int, Tuple[int, int]]:
    """Every live (not zombie) process: pid -> (parent pid, session id)."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(d.name)] = (int(fields[1]), int(fields[3]))
    return out


def session_pids(sid: int) -> List[int]:
    """Live (not zombie) processes of session ``sid``: a run started with ``start_new_session``."""
    return [pid for pid, (_, s) in live_processes().items() if s == sid]


def descendants(root: int) -> Set[int]:
    """Live processes below ``root``."""
    children: Dict[int, List[int]] = {}
    for pid, (parent, _) in live_processes().items():
        children.setdefault(parent, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out
