"""Starting, connecting to and stopping the live roles; job setup and teardown (§5.1).

:class:`Services` is the set of role processes one training run talks to: one switch
emulator (or a switch someone else runs — several training runs can share it, each its
own tenant) and ``n_ps`` parameter-server shards. :meth:`Services.start` launches them
as ``python -m atp_pipeline.ina.live.nodes`` processes bound to loopback, tied to the
starting process (they exit if it dies, and :meth:`Services.stop` terminates them);
:meth:`Services.connect` uses running ones by address. :func:`add_job` installs one ATP
job (a data-parallel group) on the switch and the shards — the switch assigns a free job
id, so concurrent runs never collide — and :func:`remove_job` tears it down, freeing any
aggregator the job still holds (e.g. after a worker died mid-round).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from atp_pipeline.config.schema import AggregationConfig, SwitchImpl
from atp_pipeline.ina.live.rpc import Addr, AggregationError, call, parse_addr


@dataclass
class Endpoint:
    role: str
    data: Addr
    control: Addr
    pid: int

    @classmethod
    def from_info(cls, info: Dict[str, Any]) -> "Endpoint":
        return cls(info["role"], tuple(info["data"]), tuple(info["control"]), int(info["pid"]))  # type: ignore[arg-type]


@dataclass
class Services:
    switch: Endpoint
    ps: List[Endpoint]
    payload_k: int
    owned_pids: List[int] = field(default_factory=list)
    _procs: List[Any] = field(default_factory=list, repr=False, compare=False)

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, cfg: AggregationConfig, timeout: float = 120.0) -> "Services":
        """Launch the switch (unless ``cfg.switch`` names a running one) and ``cfg.n_ps`` PS
        shards (``n_ps=0``: a switch only, e.g. one that several runs will share)."""
        procs: List[subprocess.Popen] = []
        shared = None
        if cfg.switch:
            shared = Endpoint.from_info(call(parse_addr(cfg.switch), "info", what="switch"))
        try:
            if shared is None:
                aggs = cfg.aggregators if cfg.mode == "atp" else 0  # ps: every packet to the PS
                impl = ["--impl", "bmv2", "--p4", p4_program(cfg)] if cfg.switch_impl == SwitchImpl.bmv2 else []
                procs.append(_launch(["switch", "--aggregators", str(aggs), "--loss", str(cfg.loss),
                                      "--duplicate", str(cfg.duplicate), "--seed", str(cfg.seed), *impl],
                                     cfg.payload_k))
            for shard in range(cfg.n_ps):
                procs.append(_launch(["ps", "--shard", str(shard)], cfg.payload_k))
            infos = [_read_info(p, timeout) for p in procs]
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            raise
        eps = [Endpoint.from_info(i) for i in infos]
        sw = shared or eps.pop(0)
        svc = cls(switch=sw, ps=eps, payload_k=cfg.payload_k, owned_pids=[p.pid for p in procs])
        svc._procs = procs
        return svc

    def to_dict(self) -> Dict[str, Any]:
        return {"switch": asdict(self.switch), "ps": [asdict(e) for e in self.ps], "payload_k": self.payload_k}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Services":
        ep = lambda e: Endpoint(e["role"], tuple(e["data"]), tuple(e["control"]), e["pid"])  # noqa: E731
        return cls(switch=ep(d["switch"]), ps=[ep(e) for e in d["ps"]], payload_k=d["payload_k"])

    def stop(self, grace: float = 5.0) -> None:
        """Stop the role processes this object started (a shared switch keeps running)."""
        for ep in [self.switch, *self.ps]:
            if ep.pid in self.owned_pids:
                try:
                    call(ep.control, "shutdown", timeout=2.0, what=ep.role)
                except AggregationError:
                    pass
        deadline = time.monotonic() + grace
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self.owned_pids:  # started by another process (e.g. from_dict): by pid
            if not self._procs and _alive(pid):
                os.kill(pid, 15)
        self._procs = []

    def stats(self) -> Dict[str, Any]:
        return {"switch": call(self.switch.control, "stats", what="switch"),
                "ps": [call(e.control, "stats", what="parameter server") for e in self.ps]}


def p4_program(cfg: AggregationConfig) -> str:
    """The v1model program a ``switch_impl=bmv2`` switch compiles: ``cfg.p4_program``, else
    ``p4/v1model/atp.p4`` of the checkout this package is imported from (an editable install)."""
    if cfg.p4_program:
        return str(Path(cfg.p4_program).expanduser().resolve())
    return str(Path(__file__).resolve().parents[3] / "p4" / "v1model" / "atp.p4")


def _launch(args: List[str], payload_k: int) -> subprocess.Popen:
    env = dict(os.environ)  # importing the package is light (numpy here; no Lightning or Hydra)
    # this process's own import path, so the role process imports the very package it runs
    # (a checkout, an installed copy or one put on sys.path by a test runner alike)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    return subprocess.Popen([sys.executable, "-m", "atp_pipeline.ina.live.nodes", *args,
                             "--payload-k", str(payload_k), "--die-with-parent"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def _read_info(p: subprocess.Popen, timeout: float) -> Dict[str, Any]:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line:
        if p.poll() is None:
            raise AggregationError(f"ATP role process {p.args[3]} did not start within {timeout:.0f} s")
        p.wait()
        tail = (p.stderr.read() if p.stderr is not None else "").strip().splitlines()
        raise AggregationError(f"ATP role process {p.args[3]} exited with code {p.returncode} at start"
                               + (f": {tail[-1]}" if tail else ""))
    return json.loads(line)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def add_job(svc: Services, workers: Sequence[Addr], job: Optional[int] = None) -> int:
    """Install one ATP job (its workers' UDP addresses in worker-id order); its id."""
    ps_data = [list(e.data) for e in svc.ps]
    job = call(svc.switch.control, "add_job", what="switch", up=ps_data, down=[list(a) for a in workers], job=job)
    try:
        for e in svc.ps:
            call(e.control, "add_job", what="parameter server", job=job, workers=[list(a) for a in workers],
                 down=list(svc.switch.data), n_ps=len(svc.ps))
    except AggregationError:
        remove_job(svc, job)
        raise
    return int(job)


def remove_job(svc: Services, job: int) -> int:
    """Tear a job down everywhere (idempotent, best effort); aggregators freed at the switch."""
    freed = 0
    try:
        freed = int(call(svc.switch.control, "remove_job", timeout=5.0, what="switch", job=job))
    except AggregationError:
        pass
    for e in svc.ps:
        try:
            call(e.control, "remove_job", timeout=5.0, what="parameter server", job=job)
        except AggregationError:
            pass
    return freed
