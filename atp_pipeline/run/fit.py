"""Launch -> collect: ``stage=fit`` of a resolved run.

The parent has resolved and reported the plan; it starts the live aggregation roles when
the run needs them (so they outlive any worker), then the worker processes with torchrun's
environment (Lightning treats them as externally launched, so nothing re-executes
``sys.argv``), and collects rank 0's logs. Under ``torchrun`` itself (multi-node) every
process runs its worker in place, with the run directory given on the command line.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from atp_pipeline.errors import ConfigError
from atp_pipeline.launch import LaunchError, spawn
from atp_pipeline.run.checkpoints import checkpoint_step, newest_complete
from atp_pipeline.run.console import to_log
from atp_pipeline.run.report import read_metrics, report_fit, report_plan
from atp_pipeline.run.resolve import RunSpec
from atp_pipeline.run.worker import fit_worker


def _role_report(services: Any) -> Dict[str, Any]:
    """What the switch and the PS counted for this run (printed, and kept in summary.json)."""
    try:
        st = services.stats()
    except Exception as e:  # noqa: BLE001 - a role that died: say so, do not mask the run's error
        line = f"aggregation: could not read the roles' counters ({e})"
        if services.dead_role() is None:
            print(line)
        else:  # the run failed because a role died: its one line says so, this goes to train.log
            to_log(line)
        return {"error": str(e)}
    sw = st["switch"]
    rep = {"switch_allocated_after": sw["allocated"], "switch_jobs": sw["jobs"],
           "injected_loss": sw["injected_loss"], "injected_dup": sw["injected_dup"],
           "socket_drops": sw["socket_drops"] + sum(p["socket_drops"] for p in st["ps"]),
           "ecn_marked": sw["ecn_marked"], "ps_jobs": [p["jobs"] for p in st["ps"]]}
    print(f"aggregation: switch allocated {sum(j['allocs'] for j in sw['jobs'].values())} aggregators over "
          f"{len(sw['jobs'])} job(s), {sw['allocated']} still allocated after teardown; injected loss "
          f"{sw['injected_loss']}, duplicates {sw['injected_dup']}, socket drops {rep['socket_drops']}")
    if st.get("racks"):  # two-level aggregation (§4.1): the sequences each level completed
        from atp_pipeline.ina.live.services import level_report

        lv = rep["levels"] = level_report(st)
        lv["injected_loss_racks"] = [r["injected_loss"] for r in st["racks"]]  # the rest: injected_loss above
        rep["switch_allocated_after"] = lv["allocated_after"]
        print(f"aggregation: {lv['racks']} rack switches completed {lv['level1_frac']:.2%} of their sequences "
              f"(level 1), the second-level switch {lv['level2_frac']:.2%} (level 2), of {lv['sequences']}")
    if "bmv2" in sw:  # the P4 program's own counters, read with simple_switch_CLI
        done = sum(j["complete"] for j in sw["jobs"].values())
        seqs = sum(j["params"] for j in sw["jobs"].values())
        rep["bmv2"] = {**sw["bmv2"], "stats": sw["switch"], "sequences": seqs, "completed_in_switch": done,
                       "in_switch_frac": done / seqs if seqs else 0.0}
        if st.get("racks"):  # two levels on BMv2: every rack switch is a BMv2 of its own
            rep["bmv2"]["racks"] = [{**r["bmv2"], "stats": r["switch"],
                                     "complete": sum(j["complete"] for j in r["jobs"].values())} for r in st["racks"]]
            print(f"aggregation: BMv2 runs both levels ({len(st['racks'])} rack switches and the second level, "
                  f"{sw['bmv2']['json']}); the level fractions above are the program's job_complete counters")
        else:
            print(f"aggregation: BMv2 running {sw['bmv2']['json']}: {done} of {seqs} sequences completed in the switch "
                  f"({rep['bmv2']['in_switch_frac']:.2%}; counters job_complete / job_params)")
    return rep


def _full_disk(e: LaunchError, out: Path) -> None:
    """A checkpoint writer that met a full disk does not always say so (torch.save's archive writer
    reports a short write as "unexpected pos"): name it when the checkpoint directory has no space left."""
    ck = out / "checkpoints"
    if "No space left on device" in e.cause or not ck.exists() or "checkpoint" not in str(e).lower():
        return
    try:
        st = os.statvfs(ck)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < 64 * 1024:
        e.cause = f"No space left on device of {ck} while saving a checkpoint ({e.cause})"


def _step_of(ckpt: Optional[Path]) -> int:
    """The step a checkpoint resumes at (0: none)."""
    return checkpoint_step(ckpt) if ckpt is not None else 0


def _keep_metrics(out: Path, earlier: Dict[int, Dict[str, float]], upto: Optional[int]) -> None:
    """Across relaunches, rank 0's ``metrics.csv`` (Lightning's logger starts it again): with ``upto``,
    keep the rows of the attempt that failed before the step it is relaunched from; without, write
    those rows back in front of the last attempt's."""
    path = out / "lightning_logs" / "metrics.csv"
    if not path.exists():
        return
    rows = {int(r["step"]): r for r in read_metrics(path)}
    if upto is not None:
        earlier.update({s: r for s, r in rows.items() if s < upto})
        for s in [s for s in earlier if s >= upto]:
            del earlier[s]
        return
    merged = [earlier[s] for s in sorted(earlier) if s not in rows] + [rows[s] for s in sorted(rows)]
    merged.sort(key=lambda r: r["step"])
    keys = ["step", *sorted({k for r in merged for k in r if k != "step"})]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in merged:
            w.writerow({**r, "step": int(r["step"])})


def _launch(spec: RunSpec, out: Path, extra: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One launch of the ranks (and of the live aggregation roles the run needs, which end with it)."""
    services = None
    if spec.live_aggregation:
        from atp_pipeline.ina.live.services import Services

        services = Services.start(spec.config.aggregation)
        spec = dataclasses.replace(spec, services=services.to_dict())
    try:
        return spawn(fit_worker, spec.devices, spec, str(out), init=False,
                     timeout=max(600.0, 10.0 * spec.config.trainer.max_steps),
                     watch=services.dead_role if services is not None else None)
    finally:
        if services is not None:
            dead = services.dead_role()  # (its counters are gone with it: no waiting on a dead peer)
            extra["aggregation_roles"] = _role_report(services) if dead is None else {"error": dead}
            services.stop()


def fit(spec: RunSpec, out: Path) -> Dict[str, Any]:
    """Train the resolved run; the summary row (with ``_results``: every rank's result)."""
    torchrun = bool(os.environ.get("TORCHELASTIC_RUN_ID"))
    lead = not torchrun or os.environ.get("RANK", "0") == "0"
    if lead:
        report_plan(spec, out)
        dp, d1, d2 = spec.mesh
        print(f"fit: {spec.devices} processes, mesh dp x d1 x d2 = {dp} x {d1} x {d2}, "
              f"chunks={spec.config.overlap.chunks}, "
              f"{spec.config.trainer.max_steps} steps -> {out}")
    extra: Dict[str, Any] = {}
    if torchrun:  # e.g. one process per GPU on every node: run in place
        world = int(os.environ["WORLD_SIZE"])
        if world != spec.devices:
            raise ConfigError(f"torchrun started {world} processes but the run needs trainer.devices={spec.devices}")
        mine = fit_worker(int(os.environ["RANK"]), world, spec, str(out))
        if mine["rank"] != 0:
            return {"rank": mine["rank"]}
        results: List[Dict[str, Any]] = [mine]
    else:
        restarts = spec.config.trainer.max_restarts
        earlier: Dict[int, Dict[str, float]] = {}  # metrics rows of failed attempts, by step
        for attempt in range(restarts + 1):
            try:
                results = _launch(spec, out, extra)
                break
            except LaunchError as e:  # the console gets the cause (cli); the log every rank's report
                _full_disk(e, out)
                e.log = to_log(f"error: {e.cause}\n--- every rank's report ---\n{e}")
                if attempt == restarts:
                    raise
                ckpt, _ = newest_complete(out)
                _keep_metrics(out, earlier, _step_of(ckpt))
                print(f"restart {attempt + 1} of {restarts}: {e.cause}; launching again from "
                      + (f"{ckpt}" if ckpt else "step 0 (no complete checkpoint yet)"))
                spec = dataclasses.replace(spec, config=dataclasses.replace(
                    spec.config, resume=str(ckpt) if ckpt else spec.config.resume))
        if restarts and attempt:
            extra["restarts"] = attempt
            _keep_metrics(out, earlier, None)  # the relaunch's rows after the failed attempts' earlier ones
    row = report_fit(spec, out, results[0], extra)
    if results[0].get("exported") and lead:
        print(f"exported the trained model in its family's format to {results[0]['exported']}")
    row["_results"] = results
    return row
