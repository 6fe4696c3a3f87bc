"""``python train.py stage=calibrate``: calibrate this host for the topology in use, in one
command, and find that calibration again in ``stage=plan`` and ``stage=fit``.

**Measure** (on the topology's ``world`` gloo processes at once, as training runs them; a
progress bar): the collectives of Table 2 on every group layout that tiles the world at three
message sizes, α-β fitted per level and collective (:func:`atp_pipeline.run.calibrate.measure`,
:func:`atp_pipeline.planning.alphabeta_fit.fit_calibration`); then compute
(:func:`atp_pipeline.run.calibrate_compute.calibrate_compute`). No model, batch or sequence length
the user plans is measured: the step-time model predicts them (:mod:`atp_pipeline.planning.steptime`).

**Write** ``<calibration.dir>/<topology>.yaml``: the topology with the fitted ``alpha_beta`` and
``device.compute`` = the profile, the collective fit's report and the probes' whole steps the
step residual was fitted over (``<topology>_probe_steps.json``) beside it.

**Find** (:func:`with_calibration`): a topology with neither ``alpha_beta`` nor
``device.compute`` of its own takes the file's when ``calibration.use`` and the file's levels are
the topology's; the plan's notes name the file, its SHA-256 and date. The host is timed again only
when asked (``calibration.retime``) or when the calibration is stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from omegaconf import DictConfig

from atp_pipeline.errors import ConfigError
from atp_pipeline.topology.model import Topology

COLLECTIVE_SIZES = (4096, 65536, 1048576)  # bytes: latency-, mid- and bandwidth-bound
QUICK_PROBES = ("probe_gpt_s",)


def calibration_file(directory: str, topology: str) -> Path:
    """Where ``stage=calibrate`` writes topology ``topology``'s calibration."""
    return Path(directory) / f"{topology}.yaml"


def file_digest(path: Path) -> str:
    """The first 12 hex digits of the file's SHA-256 (which calibration a prediction used)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _levels(topo: Topology) -> Tuple[Tuple[str, int], ...]:
    return tuple((lv.name, lv.count) for lv in topo.levels)


def with_calibration(topo: Topology, calibration: Any) -> Topology:
    """``topo`` with the calibration ``stage=calibrate`` wrote for it (``calibration``: the
    :class:`~atp_pipeline.config.schema.CalibrationConfig`), if it has none of its own and
    the file is for the same levels; its note names the file (SHA-256, date). Otherwise
    ``topo`` unchanged (with a note where a file exists but does not fit)."""
    if not calibration.use or topo.alpha_beta or topo.device.get("compute"):
        return topo
    path = calibration_file(str(calibration.dir), topo.name)
    if not path.is_file():
        return topo
    import yaml

    from atp_pipeline.planning.compute_profile import ComputeProfile

    try:
        data = yaml.safe_load(path.read_text())
        # the profile is checked by its own reader (a profile of an older format is refused there, in
        # one line naming stage=calibrate), the rest by the topology's schema
        device = dict(data.get("device") or {})
        compute = device.pop("compute", None) or {}
        found = Topology.from_config({**data, "device": device})
    except (ConfigError, yaml.YAMLError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"calibration file {path}: {str(exc).splitlines()[0]} "
                          f"(run `python train.py stage=calibrate topology={topo.name}` again)") from None
    if _levels(found) != _levels(topo):
        note = (f"calibration file {path} is for levels {_levels(found)}, not topology '{topo.name}''s "
                f"{_levels(topo)}: not used (python train.py stage=calibrate topology={topo.name})")
        return dataclasses.replace(topo, note="; ".join(x for x in (topo.note, note) if x))
    if compute:
        ComputeProfile.from_config(compute, f"calibration file {path}: device.compute")
    note = (f"calibration {path} (sha256 {file_digest(path)}, measured {compute.get('date', '?')}): "
            f"alpha-beta per level and collective, compute profile '{compute.get('name', '?')}'")
    device = {**topo.device, **({"compute": compute} if compute else {})}
    retime, said = _retime_why(calibration, compute)
    if retime:
        speed, said = host_speed_now(path, compute, float(getattr(calibration, "retime_s", 0.0)), topo.world_size,
                                     found, said)
        device["host_speed"] = speed.to_dict()  # profile_of prices the calibration at it
    return dataclasses.replace(topo, levels=found.levels, alpha_beta=found.alpha_beta, device=device,
                               note="; ".join(x for x in (topo.note, note, said) if x))


def measured_at(compute: Dict[str, Any]) -> Tuple[str, Optional[float]]:
    """The host a calibration's profile was measured on (its name's ``@host``) and its age in days
    (None where its date does not read)."""
    import datetime as _dt

    host = str(compute.get("name", "")).rpartition("@")[2]
    try:
        when = _dt.datetime.strptime(str(compute.get("date", "")),
                                     "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)
        age = (_dt.datetime.now(_dt.timezone.utc) - when).total_seconds() / 86400.0
    except ValueError:
        age = None
    return host, age


def _retime_why(calibration: Any, compute: Dict[str, Any]) -> Tuple[bool, str]:
    """Whether to time the host's speed again before pricing, and the plan's note: when asked
    (``calibration.retime``), or when the calibration is stale — measured on another host, or more
    than ``calibration.stale_days`` days ago (0: never stale); then a one-line note is printed. Otherwise the
    calibration's own speed, and no process is started."""
    if getattr(calibration, "retime", False):
        return True, ""
    host, age = measured_at(compute)
    stale_days = float(getattr(calibration, "stale_days", 0.0) or 0.0)
    why = ""
    if stale_days <= 0:
        pass
    elif host and host != _host():
        why = f"measured on host '{host}', not '{_host()}'"
    elif age is not None and age > stale_days:
        why = f"measured {age:.1f} days ago (calibration.stale_days={stale_days:g})"
    if why:
        print(f"note: the calibration is stale ({why}): timing the host's speed now; "
              f"`python train.py stage=calibrate` measures it again", flush=True)
        return True, f"stale calibration ({why}): host speed re-timed"
    return False, "predicted at the calibration's host speed (calibration.retime=true times the host again)"


def host_speed_now(path: Path, compute: Dict[str, Any], max_age_s: float, processes: int,
                   calibrated: Topology, why: str = "") -> Tuple[Any, str]:
    """The host's speed now against calibration ``path``'s (:class:`~atp_pipeline.planning.compute_profile.HostSpeed`),
    and the plan's note on it: the probes' whole steps the calibration recorded timed again on the
    recorded process count nearest ``processes``, over the calibrated model's time for them on
    ``calibrated`` (the file's topology; :func:`atp_pipeline.run.retime.retime_steps`). A
    re-timing of the same file (SHA-256) on the same process count younger than ``max_age_s``
    seconds is reused (``<topology>_speed.json`` beside it)."""
    import json

    from atp_pipeline.planning.compute_profile import STEPS_GROUP, ComputeProfile, HostSpeed, steps_count

    steps = dict((compute.get("reference") or {}).get(STEPS_GROUP) or {})
    if not steps:
        raise ConfigError(f"calibration.retime: calibration {path} recorded no probe steps to time again "
                          f"(calibrate again: python train.py stage=calibrate)")
    count = steps_count(steps, processes)
    digest = file_digest(path)
    cache = path.with_name(f"{path.stem}_speed.json")
    lead = f"{why}: " if why else ""
    try:
        got = json.loads(cache.read_text())
        speed = HostSpeed.from_dict(got)
        if (got["sha256"] == digest and 0 <= time.time() - float(got["epoch"]) <= max_age_s
                and speed.processes == count):
            return speed, f"{lead}{speed.describe()} ({cache}, reused for calibration.retime_s={max_age_s:g} s)"
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        pass
    from atp_pipeline.run.retime import retime_steps

    profile = ComputeProfile.from_config(compute, f"{path}: device.compute")
    if not why:  # (a stale calibration's note said so already)
        print(f"timing the host's speed now against calibration {path} (the probes' whole steps on {count} "
              f"processes, ~15 s) ...", flush=True)
    speed = retime_steps(profile, count, calibrated)
    try:
        cache.write_text(json.dumps({"sha256": digest, "epoch": time.time(), **speed.to_dict()}) + "\n")
    except OSError:
        pass
    return speed, lead + speed.describe()


class _Bar:
    """A rich progress bar over the calibration's parts (the compute part advances per
    finished measurement)."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description:<28}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                 transient=False)
        self.tasks: Dict[str, Any] = {}

    def __enter__(self) -> "_Bar":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(self.tasks[phase], completed=done, total=total)


def run_calibrate(cfg: DictConfig) -> Dict[str, Any]:
    """``stage=calibrate``: measure, fit and write the topology's calibration; the summary row."""
    from atp_pipeline.planning.alphabeta_fit import fit_calibration, level_specs, write_report, write_topology
    from atp_pipeline.run import calibrate as coll
    from atp_pipeline.run.calibrate_compute import ComputeRun, calibrate_compute, print_profile
    from atp_pipeline.run.compute_measure import PROBES
    from atp_pipeline.run.hostload import wait_quiet

    topo = Topology.from_config(cfg.topology)
    world = topo.world_size
    cal = cfg.calibration
    if cal.passes < 1:
        raise ConfigError(f"calibration.passes={cal.passes} must be >= 1")
    if str(topo.device.get("name") or "cpu") not in ("cpu", "unknown"):
        raise ConfigError(f"stage=calibrate measures this host's CPU processes (gloo); topology '{topo.name}' "
                          f"describes {topo.device.get('name')} devices")
    if world < 2:
        raise ConfigError(f"stage=calibrate needs a topology of >= 2 devices (collectives); '{topo.name}' has {world}")
    out = calibration_file(str(cal.dir), topo.name)
    levels = level_specs(world, [lv.count for lv in topo.levels], [lv.name for lv in topo.levels])
    spec = coll.SweepSpec(world=world, sizes=COLLECTIVE_SIZES[:2] if cal.quick else COLLECTIVE_SIZES,
                          passes=cal.passes, warmup=1, batch_ms=2.0 if cal.quick else 8.0)
    run = ComputeRun(world, QUICK_PROBES if cal.quick else tuple(PROBES), (1, 2), cal.passes,
                     2.0 if cal.quick else 8.0, quick=cal.quick)
    print(f"calibrating '{topo.name}' on {world} processes of this host: collectives "
          f"({len(spec.group_layouts())} group layouts x 4 collectives x {len(spec.sizes)} sizes), a kernel sweep, "
          f"{len(run.probes)} probe models, compute-then-collective loops, contention; {cal.passes} passes")
    t0 = time.perf_counter()
    with _Bar() as bar:
        bar("collectives (alpha-beta)", 0, 1)
        if not cal.quick:
            wait_quiet(20.0)  # other jobs' load: wait a while for a quiet host (then passes are checked)
        res = fit_calibration(coll.measure(spec), topo.name, levels)
        bar("collectives (alpha-beta)", 1, 1)
        calibrated = dict(res.topology)
        calibrated["description"] = topo.description
        with_ab = Topology.from_config(calibrated)
        out.parent.mkdir(parents=True, exist_ok=True)
        profile = calibrate_compute(run, with_ab, f"{topo.name}@{_host()}", progress=bar,
                                    probe_steps=out.parent / f"{topo.name}_probe_steps.json")
    calibrated["device"] = {**dict(topo.device), "compute": profile.to_config()}
    write_topology(calibrated, out, f"# Calibration of topology '{topo.name}' on {_host()} by `python train.py "
                                    f"stage=calibrate` ({profile.date}); stage=plan and stage=fit read it\n"
                                    f"# for topology={topo.name} (calibration.dir={cal.dir}).\n")
    write_report(res, out.parent, f"{topo.name}_collectives")
    wall = time.perf_counter() - t0
    print(f"collectives: {len(res.samples)} points, held-out median relative error {res.heldout_median_error:.1%}")
    print_profile(profile)
    print(f"wrote {out} (sha256 {file_digest(out)}) in {wall:.0f} s; `python train.py stage=plan` "
          f"(topology={topo.name}) now predicts steps from it")
    sys.stdout.flush()
    return {"stage": "calibrate", "topology": topo.name, "calibration": str(out), "sha256": file_digest(out),
            "wall_s": wall}


def _host() -> str:
    import platform

    return platform.node() or "host"
