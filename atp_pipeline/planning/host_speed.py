"""The host's speed now against when it was calibrated (:class:`HostSpeed`), and the probe steps it is timed on."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from atp_pipeline.errors import ConfigError

Mesh = Tuple[int, int]


#: the reference's group of the probes' whole training steps: label (:func:`step_label`) -> the
#: step's wall time at calibration (in one launch of their own); which steps the host's speed times
#: again, against the calibrated model's time for them (:func:`steps_speed`)
STEPS_GROUP = "steps"


@dataclass(frozen=True)
class HostSpeed:
    """How fast the host runs now against when it was calibrated (what ``calibration.retime``
    uses): the calibration's probe models' whole training steps (forward, backward with
    collectives, optimizer, a closing barrier: what the step model's residual is fitted over; the
    ones :data:`STEPS_GROUP` of :attr:`ComputeProfile.reference` names) timed again on
    ``processes`` processes, over the calibrated step model's time for them (not their wall times
    in the one short launch that recorded them), one ratio for ``compute`` and ``overhead`` alike —
    the step's prices scale by it whole (:func:`steps_speed`). :meth:`ComputeProfile.at_speed`
    scales the profile's kernel prices by ``compute`` and its per-kernel, per-collective and
    backend CPU prices by ``overhead``."""

    compute: float
    overhead: float
    measured: str = ""  # when the steps were timed again (UTC)
    processes: int = 0  # the process count the steps ran on

    def __post_init__(self) -> None:
        if not (self.compute > 0 and self.overhead > 0):
            raise ConfigError(f"host speed: ratios > 0 (got {self.compute}, {self.overhead})")

    def describe(self) -> str:
        return (f"host speed re-timed {self.measured or '?'}: the probes' whole steps on {self.processes} "
                f"processes ran x{self.compute:.3f} the calibrated model's time for them")

    def to_dict(self) -> Dict[str, Any]:
        return {"compute": self.compute, "overhead": self.overhead, "measured": self.measured, "basis": "steps",
                "processes": self.processes}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "HostSpeed":
        """The inverse of :meth:`to_dict`."""
        return HostSpeed(float(data["compute"]), float(data["overhead"]), str(data.get("measured", "")),
                         int(data.get("processes", 0)))

    @staticmethod
    def over(speeds: Sequence["HostSpeed"]) -> "HostSpeed":
        """The host's speed over the spans ``speeds`` were timed across (in time order; each
        launch's speed where a point is measured in several): the geometric mean per ratio,
        measured from the first one's start to the last one's end."""
        first, last = speeds[0], speeds[-1]
        if len(speeds) == 1:
            return first
        if any(s.processes != first.processes for s in speeds):
            raise ConfigError(f"host speed: a span between two probes on different process counts "
                              f"({'; '.join(s.describe() for s in speeds)})")
        return HostSpeed(statistics.geometric_mean(s.compute for s in speeds),
                         statistics.geometric_mean(s.overhead for s in speeds),
                         f"{first.measured.split(' .. ')[0]} .. {last.measured.split(' .. ')[-1]}",
                         first.processes)


def step_label(probe: str, mesh: Mesh, chunks: int, processes: int) -> str:
    """A probe's whole step in the reference's :data:`STEPS_GROUP`: ``"<probe> 2x1/c1 on 2"``."""
    return f"{probe} {mesh[0]}x{mesh[1]}/c{chunks} on {processes}"


def parse_step_label(label: str) -> Tuple[str, Mesh, int, int]:
    """``(probe, mesh, chunks, processes)`` of a :func:`step_label`."""
    try:
        probe, cell, on, count = label.split(" ")
        mesh, chunks = cell.split("/c")
        d1, d2 = mesh.split("x")
        if on != "on":
            raise ValueError(label)
        return probe, (int(d1), int(d2)), int(chunks), int(count)
    except ValueError:
        raise ConfigError(f"probe step label '{label}': '<probe> <d1>x<d2>/c<chunks> on <processes>'") from None


def step_processes(recorded: Mapping[str, float]) -> List[int]:
    """The process counts :data:`STEPS_GROUP` labels were timed on."""
    return sorted({parse_step_label(k)[3] for k in recorded})


def steps_count(recorded: Mapping[str, float], processes: int) -> int:
    """The recorded process count the host's speed for ``processes`` is timed on: the nearest
    (ties: the larger)."""
    return min(step_processes(recorded), key=lambda c: (abs(c - processes), -c))


def steps_speed(then: Mapping[str, float], now: Mapping[str, float], processes: int,
                measured: str = "") -> HostSpeed:
    """The probes' whole steps on ``processes`` processes now over ``then`` (labels of
    :func:`step_label`; the calibrated step model's time for them,
    :func:`atp_pipeline.run.retime.retime_steps`): the geometric mean of
    ``now[label] / then[label]`` over the labels both have, as a :class:`HostSpeed`."""
    common = sorted(k for k in set(then) & set(now) if parse_step_label(k)[3] == processes)
    if not common:
        raise ConfigError(f"host speed: no probe step on {processes} processes timed both at calibration and now "
                          f"(calibrated on {step_processes(then)}; calibrate again: python train.py stage=calibrate)")
    r = statistics.geometric_mean(now[k] / then[k] for k in common)
    return HostSpeed(r, r, measured, processes)
