"""Starting, connecting to and stopping the live roles; job setup and teardown (§5.1).

:class:`Services` is the set of role processes one training run talks to: one switch
emulator (or a switch someone else runs — several training runs can share it, each its
own tenant) and ``n_ps`` parameter-server shards. :meth:`Services.start` launches them
as ``python -m atp_pipeline.ina.live.nodes`` processes bound to loopback, tied to the
starting process (they exit if it dies, and :meth:`Services.stop` terminates them), or
uses a running switch by address (``aggregation.switch``). :func:`add_job` installs one ATP
job (a data-parallel group) on the switch and the shards — the switch assigns a free job
id, so concurrent runs never collide — and :func:`remove_job` tears it down, freeing any
aggregator the job still holds (e.g. after a worker died mid-round).

Credentials (:mod:`.auth`, :mod:`.tenancy`): :meth:`Services.start` generates the control
channel's secret for the roles it launches (given to them in their environment, never on a
command line) and the run's tenant token, which every job of the run is set up with and
every later operation on it presents. Both travel to the run's ranks in
:meth:`Services.to_dict` (the launcher's arguments to its workers, or rank 0's broadcast);
a shared switch's secret is the user's (``ATP_AUTHKEY``, or the file a loopback switch wrote:
:func:`~.auth.key_for`). The roles' owner tokens (shutdown, every tenant's statistics) stay
with the process that started them.

Two-level aggregation (ATP §4.1, ``aggregation.racks=R``): :meth:`Services.start` also
launches ``R`` first-level switches (:attr:`Services.racks`), one per rack of workers;
:attr:`Services.switch` is then the second-level switch at the PS's rack. A job's routes
chain them: a rack switch sends gradients up to the second-level switch and multicasts
parameter packets down to its rack's workers; the second-level switch sends gradients to
the PS and parameter packets down to the rack switches. Every switch runs the same switch
function; the packet's ``edge`` bit tells which level it is at. :func:`level_report` reads
how many sequences each level completed.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from atp_pipeline.config.schema import AggregationConfig, SwitchImpl
from atp_pipeline.errors import ConfigError
from atp_pipeline.ina.live import auth
from atp_pipeline.ina.live.rpc import Addr, AggregationError, Peer, call, parse_addr

_NAMES = {"switch": "switch", "ps": "parameter server"}


@dataclass
class Endpoint:
    """One role: its addresses, its control channel's secret and — only where this process
    started it — its owner token."""

    role: str
    data: Addr
    control: Addr
    pid: int
    secret: str = field(repr=False)
    owner: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_info(cls, info: Dict[str, Any], secret: str) -> "Endpoint":
        """From a role's ``info`` (or start line, which adds its ``owner`` token)."""
        return cls(info["role"], tuple(info["data"]), tuple(info["control"]), int(info["pid"]),  # type: ignore[arg-type]
                   secret, info.get("owner"))

    def to_dict(self) -> Dict[str, Any]:
        """What the run's ranks get (the owner token stays here)."""
        return {"role": self.role, "data": list(self.data), "control": list(self.control), "pid": self.pid,
                "secret": self.secret}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Endpoint":
        return cls(d["role"], tuple(d["data"]), tuple(d["control"]), int(d["pid"]), d["secret"])  # type: ignore[arg-type]

    def peer(self, token: Optional[str], what: Optional[str] = None) -> Peer:
        """This role's control channel, presenting ``token``."""
        return Peer(self.control, self.secret, token, what or _NAMES.get(self.role, self.role))


@dataclass
class Services:
    switch: Endpoint  # the only switch, or the second-level switch when ``racks`` is not empty
    ps: List[Endpoint]
    payload_k: int
    tenant: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)  # this run's jobs' token
    racks: List[Endpoint] = field(default_factory=list)  # first-level switches, rack order
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
            addr = parse_addr(cfg.switch)
            key = auth.key_for(addr)
            if key is None:
                raise ConfigError(f"aggregation.switch={cfg.switch}: no secret for its control channel; set "
                                  f"{auth.ENV} to the secret the switch was started with")
            info = call(addr, "info", secret=key, what="switch")
            if info.get("payload_k") != cfg.payload_k:  # its packets would never match this job's
                raise ConfigError(f"aggregation.payload_k={cfg.payload_k} but the switch at {cfg.switch} aggregates "
                                  f"{info.get('payload_k')} values a packet: set aggregation.payload_k="
                                  f"{info.get('payload_k')} (or start it with --payload-k {cfg.payload_k})")
            shared = Endpoint.from_info(info, key)
        n_switches = (0 if shared is not None else 1) + (cfg.racks if cfg.racks > 1 else 0)
        sml = cfg.mode == "switchml"  # SwitchML: its switch is the aggregation endpoint, no PS
        try:
            aggs = cfg.aggregators if cfg.mode == "atp" else 0  # ps: every packet to the PS
            impl = ["--impl", "bmv2", "--p4", p4_program(cfg)] if cfg.switch_impl == SwitchImpl.bmv2 else []
            proto = ["--protocol", "switchml", "--transport", getattr(cfg.transport, "value", str(cfg.transport))
                     ] if sml else ["--aggregators", str(aggs), "--duplicate", str(cfg.duplicate), *impl]
            secret = auth.new_secret()  # this run's roles' (a shared switch keeps its own)
            for i in range(n_switches):  # loss injected at every switch's ingress, each its own seed
                procs.append(_launch(["switch", *proto, "--loss", str(cfg.loss), "--seed", str(cfg.seed + 7919 * i)],
                                     cfg.payload_k, secret, cfg.role_max_bytes))
            for shard in range(0 if sml else cfg.n_ps):
                procs.append(_launch(["ps", "--shard", str(shard)], cfg.payload_k, secret, cfg.role_max_bytes))
            infos = [_read_info(p, timeout) for p in procs]
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            raise
        eps = [Endpoint.from_info(i, secret) for i in infos]
        sw = shared or eps.pop(0)
        racks = [eps.pop(0) for _ in range(cfg.racks)] if cfg.racks > 1 else []
        svc = cls(switch=sw, ps=eps, payload_k=cfg.payload_k, racks=racks, owned_pids=[p.pid for p in procs])
        svc._procs = procs
        return svc

    def to_dict(self) -> Dict[str, Any]:
        """The roles as the run's ranks get them: addresses, secrets, the run's tenant token."""
        return {"switch": self.switch.to_dict(), "ps": [e.to_dict() for e in self.ps], "payload_k": self.payload_k,
                "racks": [e.to_dict() for e in self.racks], "tenant": self.tenant}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Services":
        ep = Endpoint.from_dict
        return cls(switch=ep(d["switch"]), ps=[ep(e) for e in d["ps"]], payload_k=d["payload_k"],
                   tenant=d["tenant"], racks=[ep(e) for e in d.get("racks", [])])

    def peer(self, ep: Endpoint, what: Optional[str] = None) -> Peer:
        """``ep``'s control channel with this run's tenant token."""
        return ep.peer(self.tenant, what)

    def dead_role(self) -> Optional[str]:
        """One line naming a role process this object started that has exited (None: all alive)."""
        for p in self._procs:
            code = p.poll()
            if code is not None:
                role = " ".join(a for a in p.args[3:5] if not a.startswith("-"))  # "switch" or "ps"
                return (f"the aggregation {role} role (pid {p.pid}) died (exit code {code}"
                        + (f", signal {-code}" if code < 0 else "") + ")")
        return None

    def stop(self, grace: float = 5.0) -> None:
        """Stop the role processes this object started (a shared switch keeps running)."""
        for ep in [self.switch, *self.racks, *self.ps]:
            if ep.pid in self.owned_pids and ep.owner:
                try:
                    ep.peer(ep.owner).call("shutdown", timeout=2.0)
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
        """Every role's counters: all its jobs where this process started it (its owner token),
        else this run's jobs only (a shared switch)."""
        def read(ep: Endpoint, what: Optional[str] = None) -> Dict[str, Any]:
            return ep.peer(ep.owner or self.tenant, what).call("stats")

        return {"switch": read(self.switch), "racks": [read(e, "rack switch") for e in self.racks],
                "ps": [read(e) for e in self.ps]}

    def entry(self, worker: int, n_workers: int) -> Endpoint:
        """The switch worker ``worker`` of a job of ``n_workers`` sends to: its rack's (racks of
        ``n_workers / len(racks)`` consecutive workers), or the only switch."""
        if not self.racks:
            return self.switch
        return self.racks[worker // (n_workers // len(self.racks))]


def p4_program(cfg: AggregationConfig) -> str:
    """The v1model program a ``switch_impl=bmv2`` switch compiles: ``cfg.p4_program``, else
    ``p4/v1model/atp.p4`` of the checkout this package is imported from (an editable install)."""
    if cfg.p4_program:
        return str(Path(cfg.p4_program).expanduser().resolve())
    return str(Path(__file__).resolve().parents[3] / "p4" / "v1model" / "atp.p4")


def _launch(args: List[str], payload_k: int, secret: str, max_bytes: int) -> subprocess.Popen:
    """Start one role process; its control channel's ``secret`` in its environment, ``max_bytes``
    its memory bound (:mod:`atp_pipeline.ina.budget`)."""
    env = dict(os.environ)  # importing the package is light (numpy here; no Lightning or Hydra)
    env[auth.ENV] = secret
    # this process's own import path, so the role process imports the very package it runs
    # (a checkout, an installed copy or one put on sys.path by a test runner alike)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    return subprocess.Popen([sys.executable, "-m", "atp_pipeline.ina.live.nodes", *args,
                             "--payload-k", str(payload_k), "--max-bytes", str(max_bytes), "--die-with-parent"],
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


def add_job(svc: Services, workers: Sequence[Addr], job: Optional[int] = None, pool: int = 0,
            shm: Optional[Sequence[str]] = None) -> int:
    """Install one ATP job (its workers' UDP addresses in worker-id order), set up with the run's
    tenant token; its id. With racks, the second-level switch picks the id and every rack
    switch gets the same (§5.1). ``pool > 0``: a SwitchML job, its static partition of ``pool``
    slots at the switch; ``shm``: its workers' lane segments (the shared-memory transport, :mod:`.shm`)."""
    switch = svc.peer(svc.switch)
    addrs = [[str(a[0]), int(a[1])] for a in workers]
    if pool:
        return int(switch.call("add_job", up=[], down=addrs, job=job, pool=pool,
                               **({"shm": list(shm)} if shm is not None else {})))
    ps_data = [list(e.data) for e in svc.ps]
    R = len(svc.racks)
    if R and len(workers) % R:
        raise AggregationError(f"{len(workers)} workers do not split into {R} racks")
    down = [list(e.data) for e in svc.racks] if R else addrs
    # a BMv2 second level installs the two-level plan (its ⑦ flush clone session toward the PS);
    # the emulator needs nothing: the packets' edge bit selects the level
    level2 = {"two_level": True} if R and switch.call("info").get("impl") == "bmv2" else {}
    job = int(switch.call("add_job", up=ps_data, down=down, job=job, **level2))
    try:
        per = len(workers) // R if R else 0
        for i, e in enumerate(svc.racks):
            svc.peer(e, "rack switch").call("add_job", up=[list(svc.switch.data)] * len(ps_data),
                                            down=addrs[i * per:(i + 1) * per], job=job)
        for e in svc.ps:
            svc.peer(e).call("add_job", job=job, workers=addrs, switch=list(svc.switch.data), n_ps=len(svc.ps),
                             racks=max(R, 1))
    except AggregationError:
        remove_job(svc, job)
        raise
    return job


def remove_job(svc: Services, job: int) -> int:
    """Tear a job down everywhere (idempotent, best effort); aggregators freed at the switches."""
    freed = 0
    for e in [svc.switch, *svc.racks]:
        try:
            freed += int(svc.peer(e).call("remove_job", timeout=5.0, job=job))
        except AggregationError:
            pass
    for e in svc.ps:
        try:
            svc.peer(e).call("remove_job", timeout=5.0, job=job)
        except AggregationError:
            pass
    return freed


def level_report(stats: Dict[str, Any], jobs: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Sequences completed at each aggregation level (§4.1), from :meth:`Services.stats`:
    ``level1_frac`` = completions at the rack switches / (sequences × racks) — every rack
    completes each sequence once when nothing is lost —, ``level2_frac`` = completions at the
    second-level switch / sequences (sequences = those the PS shards completed); single-level:
    ``level1_frac`` only (the one switch). ``jobs``: only these jobs (default all)."""
    def done(sw: Dict[str, Any]) -> int:
        return sum(j.get("complete", 0) for k, j in sw["jobs"].items() if jobs is None or int(k) in jobs)

    seqs = sum(j["completed"] for p in stats["ps"] for k, j in p["jobs"].items() if jobs is None or int(k) in jobs)
    racks = stats.get("racks") or []
    out: Dict[str, Any] = {"sequences": seqs, "racks": len(racks)}
    if racks:
        l1 = sum(done(r) for r in racks)
        out.update(level1_complete=l1, level2_complete=done(stats["switch"]),
                   level1_frac=l1 / (seqs * len(racks)) if seqs else 0.0,
                   level2_frac=done(stats["switch"]) / seqs if seqs else 0.0,
                   allocated_after=stats["switch"]["allocated"] + sum(r["allocated"] for r in racks))
    else:
        out.update(level1_complete=done(stats["switch"]),
                   level1_frac=done(stats["switch"]) / seqs if seqs else 0.0,
                   allocated_after=stats["switch"]["allocated"])
    return out
