"""Shared fixtures: compose the repository's config tree with Hydra's compose API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from atp_pipeline.config import register_mesh_source, register_schemas

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


def run_train(args: List[str], cwd: Optional[Path] = None, timeout: float = 120
              ) -> subprocess.CompletedProcess:
    """Run ``python train.py args`` as a user would; output lands under ``cwd``."""
    return finish_train(start_train(args, cwd), timeout)


def start_train(args: List[str], cwd: Optional[Path] = None) -> subprocess.Popen:
    """Start ``python train.py args`` (:func:`finish_train` waits for it): runs side by side,
    where most of each is starting up."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd or ROOT, env=env,
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


def finish_train(p: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
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
