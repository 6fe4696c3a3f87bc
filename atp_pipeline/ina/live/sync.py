"""One data-parallel group's gradient synchronization in the network — ATP (one or two levels,
§4.1) or SwitchML (``aggregation=switchml``: :class:`~.engine.SMLEngine`) —; the DDP
communication hook.

:meth:`ATPSync.setup` is collective over the whole world (every rank calls it once):

1. the role processes — given (a shared switch, addresses from the parent process) or
   started by global rank 0 — are made known to every rank;
2. each rank opens its UDP socket; the data-parallel group gathers the addresses in
   data-parallel rank order (worker id = data-parallel rank);
3. the group's first rank installs the group as one ATP job (§5.1) and broadcasts the
   id the switch assigned. With tensor parallelism every (d1, d2) coordinate has its own
   data-parallel group, hence its own job: one training run is already multi-tenant.

:func:`atp_hook` is a DDP communication hook (``ddp.register_comm_hook(sync, atp_hook)``):
each bucket is summed through the protocol and divided by the group size, like the
default all-reduce hook — on CPU as on GPU (a CUDA bucket is staged through host memory).
(No ``from __future__ import annotations`` here: DDP checks the hook's annotations.)
"""

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from atp_pipeline.config.schema import AggregationConfig, AggregationMode, Transport
from atp_pipeline.ina.budget import LIVE_WINDOW_BYTES
from atp_pipeline.ina.live.engine import Engine, EngineConfig, SMLEngine
from atp_pipeline.ina.live.role import udp_socket
from atp_pipeline.ina.live.rpc import AggregationError
from atp_pipeline.ina.live.services import Services, add_job, remove_job
from atp_pipeline.ina.live.shm import attach, create_lanes, release
from atp_pipeline.ina.packet import PacketFormat
from atp_pipeline.ina.switchml import SMLFormat
from atp_pipeline.ina.worker import WorkerConfig


class ATPSync:
    """This rank's member of its data-parallel group's ATP job."""

    def __init__(self, engine: Engine, services: Services, group: Any, owns_services: bool,
                 jobs: List[int]) -> None:
        self.engine, self.services, self.group = engine, services, group
        self.owns_services = owns_services
        self.jobs = jobs  # every job of this run (all data-parallel groups)
        self.size = engine.n_workers
        self.freed_at_teardown = 0
        self._last: Dict[str, float] = {}
        self._last_ps: Dict[int, Dict[str, int]] = {}
        self._last_levels: Dict[str, int] = {}
        self._closed = False

    @property
    def job(self) -> int:
        return self.engine.job

    @classmethod
    def setup(cls, group: Any, cfg: AggregationConfig, services: Optional[Services] = None) -> "ATPSync":
        world_rank = dist.get_rank()
        owns = False
        box: List[Any] = [services.to_dict() if services is not None else None]
        if services is None:
            if world_rank == 0:
                try:
                    services = Services.start(cfg)
                    box = [services.to_dict()]
                except Exception as e:  # noqa: BLE001 - every rank must learn it
                    box = [{"error": str(e)}]
                owns = True
            dist.broadcast_object_list(box, src=0)
            if "error" in box[0]:
                raise AggregationError(box[0]["error"])
            if world_rank != 0:
                services = Services.from_dict(box[0])
        assert services is not None
        if services.payload_k != cfg.payload_k:
            raise AggregationError(f"the ATP roles use {services.payload_k} values per packet, "
                                   f"the run asks for {cfg.payload_k}")
        sml = cfg.mode == AggregationMode.switchml
        shm = sml and cfg.transport == Transport.shm
        sock = udp_socket()
        lanes = create_lanes(cfg.pool, cfg.payload_k) if shm else None  # this worker's lane segment
        members: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, (sock.getsockname(), world_rank, lanes[0].name if lanes else None),
                               group=group)
        addrs = [tuple(m[0]) for m in members]
        ranks = [m[1] for m in members]
        me = dist.get_rank(group)
        jbox: List[Any] = [None, None]
        if me == 0:
            try:
                job = add_job(services, addrs, pool=cfg.pool if sml else 0,
                              shm=[m[2] for m in members] if shm else None)
                jbox = [job, services.peer(services.switch).call("shm", job=job) if shm else None]
            except AggregationError as e:
                jbox = [f"error: {e}", None]
        dist.broadcast_object_list(jbox, src=ranks[0], group=group)
        if isinstance(jbox[0], str):
            release(lanes[0] if lanes else None, unlink=True)
            raise AggregationError(jbox[0][len("error: "):])
        jobs: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(jobs, jbox[0])
        entry = services.entry(me, len(addrs))  # this worker's rack switch (§4.1), or the switch
        fmt, kind = ((SMLFormat(cfg.payload_k, shm=shm), SMLEngine) if sml
                     else (PacketFormat(cfg.payload_k, views=True), Engine))
        # §5.4's window grows by one MTU per ACK in slow start: one packet on hardware, where a
        # packet fills at most an MTU; a live packet may be one 64 KiB loopback datagram, so its
        # window grows by at least a packet per ACK too (1,500 bytes made a window of 8 KiB packets
        # take dozens of round trips to open, and a 68-packet sync several windows)
        ecfg = EngineConfig(stall_timeout_s=cfg.stall_timeout_s,
                            worker=WorkerConfig(rto=cfg.rto_s, max_window_bytes=LIVE_WINDOW_BYTES,
                                                mtu=max(1500, fmt.wire_bytes)),
                            pool=cfg.pool, shm=(lanes[0], attach(jbox[1])) if lanes else None)
        engine = kind(fmt, jbox[0], me, len(addrs), sock, entry.data,
                      services.peer(entry), [services.peer(e) for e in services.ps], n_ps=len(services.ps),
                      ranks=ranks, cfg=ecfg, racks=max(len(services.racks), 1))
        return cls(engine, services, group, owns, sorted(set(jobs)))

    # ------------------------------------------------------------------ use
    def all_reduce_mean_(self, flat: torch.Tensor) -> torch.Tensor:
        """Average ``flat`` over the group in place (CUDA tensors are staged via the host)."""
        if flat.device.type == "cpu":
            self.engine.all_reduce(flat)
        else:
            host = flat.detach().cpu()
            self.engine.all_reduce(host)
            flat.copy_(host)
        return flat.div_(self.size)

    def step_metrics(self, with_roles: bool = False) -> Dict[str, float]:
        """Counters since the previous call: sync time and bytes, GB/s per worker, packets,
        retransmissions, timeouts, window; with ``with_roles`` also, over every job of the
        run, the fraction of sequences aggregated in the switch and of packets forwarded
        to the parameter server (one control request per PS shard)."""
        s = self.engine.stats.as_dict()
        d = {k: s[k] - self._last.get(k, 0.0) for k in ("sync_s", "bytes", "packets", "retransmits",
                                                        "timeouts", "rescales", "rounds")}
        self._last = s
        m = {"atp_sync_s": d["sync_s"], "atp_bytes": d["bytes"],
             "atp_gbps": d["bytes"] / d["sync_s"] / 1e9 if d["sync_s"] > 0 else 0.0,
             "atp_packets": d["packets"], "atp_retransmits": d["retransmits"], "atp_timeouts": d["timeouts"],
             "atp_rescales": d["rescales"], "atp_window_pkts": s["window_bytes"] / self.engine.fmt.wire_bytes}
        if with_roles:
            tot = {"packets": 0, "completed": 0, "in_switch": 0}
            for ep in self.services.ps:
                for job, js in self.services.peer(ep).call("stats")["jobs"].items():
                    if int(job) not in self.jobs:
                        continue
                    prev = self._last_ps.get((ep.pid, int(job)), {})  # type: ignore[call-overload]
                    for k in tot:
                        tot[k] += js[k] - prev.get(k, 0)
                    self._last_ps[(ep.pid, int(job))] = js  # type: ignore[index]
            m["atp_in_switch_frac"] = tot["in_switch"] / tot["completed"] if tot["completed"] else 1.0
            # the counts behind it: every sequence completes once, in the switch or at the PS (a
            # retransmission past the switch); which of the two depends on timing, the sum does not
            m["atp_sequences"], m["atp_completed_in_switch"] = tot["completed"], tot["in_switch"]
            if self.services.racks:  # sequences completed at each level this step (§4.1)
                done = self._level_done()
                for lvl in ("level1", "level2"):
                    got = done[lvl] - self._last_levels.get(lvl, 0)
                    m[f"atp_{lvl}_frac"] = got / (tot["completed"] * (len(self.services.racks) if lvl == "level1"
                                                                    else 1)) if tot["completed"] else 0.0
                self._last_levels = done
            sent = d["packets"] * len(self.jobs) * self.size  # symmetric workers: this rank × all
            # worker packets that reached the PS without being aggregated (ideal: 0)
            m["atp_fallback_frac"] = max(tot["packets"] - tot["in_switch"], 0) / sent if sent else 0.0
        return m

    def _level_done(self) -> Dict[str, int]:
        """Sequences of this run's jobs completed at the rack switches and at the second level."""
        def done(ep: Any) -> int:
            return sum(j.get("complete", 0) for k, j in self.services.peer(ep).call("stats")["jobs"].items()
                       if int(k) in self.jobs)

        return {"level1": sum(done(e) for e in self.services.racks), "level2": done(self.services.switch)}

    # ------------------------------------------------------------------ teardown
    def close(self, ok: bool = True) -> None:
        """Stop the engine; tear the job down (all ranks on failure, the group's first rank
        otherwise) and stop the roles this run started. On success, callers synchronize
        (barrier) first so that no rank is still collecting its last parameter packets."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        if not ok or self.engine.wid == 0:
            self.freed_at_teardown = remove_job(self.services, self.job)
        if self.owns_services:
            self.services.stop()


def atp_hook(state: "ATPSync", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the group, through ATP."""
    buf = bucket.buffer()
    n = state.size
    if buf.device.type == "cpu":
        return state.engine.all_reduce_async(buf).then(lambda f: f.value().div_(n))
    host = buf.detach().cpu()
    return state.engine.all_reduce_async(host).then(lambda f: buf.copy_(f.value()).div_(n))
