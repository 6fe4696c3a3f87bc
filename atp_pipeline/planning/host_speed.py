"""The host's speed now against when it was calibrated (:class:`HostSpeed`), and the probe steps it is timed on."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from atp_pipeline.errors import ConfigError

Mesh = Tuple[int, int]


REFERENCE_GROUPS = ("compute", "overhead")
#: the reference's group of the probes' whole training steps: label (:func:`step_label`) -> the
#: step's wall time at calibration (in one launch of their own); which steps the host's speed times
#: again, against the calibrated model's time for them (:func:`steps_speed`)
STEPS_GROUP = "steps"
SPEED_BASES = ("kernels", "steps")


@dataclass(frozen=True)
class HostSpeed:
    """How fast the host runs now against when it was calibrated, on one of two bases.
    ``"steps"`` (what ``calibration.retime`` uses): the calibration's probe models' whole
    training steps (forward, backward with collectives, optimizer, a closing barrier: what the step
    model's residual is fitted over; the ones :data:`STEPS_GROUP` of :attr:`ComputeProfile.reference`
    names) timed again on ``processes`` processes, over the calibrated step model's time for them
    (not their wall times in the one short launch that recorded them), one ratio for
    ``compute`` and ``overhead`` alike — the step's prices scale by it whole (:func:`steps_speed`).
    ``"kernels"`` (the step validation's ``--retime bracket|group|once``): the *reference probe*
    (a fixed synthetic set of the calibration's
    own kernel runners and one probe model's collective-free step,
    :data:`atp_pipeline.run.retime.REFERENCE`) timed again (:func:`host_speed`):
    ``compute`` the geometric mean of the ratio over the rate-bound kernels (GEMMs, norms,
    elementwise over 64 K elements), ``overhead`` over the per-call-bound ones (tiny kernels, the
    probe step of a small model); it can read the host slower while whole steps run at their
    calibration's speed, so ``stage=plan`` times steps. :meth:`ComputeProfile.at_speed`
    scales the profile's kernel prices by ``compute`` and its per-kernel, per-collective and
    backend CPU prices by ``overhead``."""

    compute: float
    overhead: float
    measured: str = ""  # when the probe was timed again (UTC)
    basis: str = "kernels"  # one of SPEED_BASES
    processes: int = 0  # "steps": the process count the steps ran on

    def __post_init__(self) -> None:
        if self.basis not in SPEED_BASES or not (self.compute > 0 and self.overhead > 0):
            raise ConfigError(f"host speed: basis '{self.basis}' (one of {', '.join(SPEED_BASES)}), "
                              f"ratios > 0 (got {self.compute}, {self.overhead})")

    def describe(self) -> str:
        if self.basis == "steps":
            return (f"host speed re-timed {self.measured or '?'}: the probes' whole steps on {self.processes} "
                    f"processes ran x{self.compute:.3f} the calibrated model's time for them")
        return (f"host speed re-timed {self.measured or '?'}: the reference probe ran x{self.compute:.3f} "
                f"(kernels) and x{self.overhead:.3f} (per-call work) its time at calibration")

    def to_dict(self) -> Dict[str, Any]:
        return {"compute": self.compute, "overhead": self.overhead, "measured": self.measured,
                **({"basis": self.basis, "processes": self.processes} if self.basis == "steps" else {})}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "HostSpeed":
        """The inverse of :meth:`to_dict` (a dict without ``basis``: the kernels')."""
        return HostSpeed(float(data["compute"]), float(data["overhead"]), str(data.get("measured", "")),
                         str(data.get("basis", "kernels")), int(data.get("processes", 0)))

    def until(self, after: "HostSpeed") -> "HostSpeed":
        """The host's speed over a span this probe opened and ``after`` closed: the geometric
        mean of the two, per group (a launch bracketed by two probes; on a shared host the
        speed drifts within minutes)."""
        return HostSpeed.over([self, after])

    @staticmethod
    def over(speeds: Sequence["HostSpeed"]) -> "HostSpeed":
        """The host's speed over the spans ``speeds`` were timed across (in time order; the probes
        around one launch, or each launch's speed where a point is measured in several): the
        geometric mean per group, measured from the first one's start to the last one's end."""
        first, last = speeds[0], speeds[-1]
        if len(speeds) == 1:
            return first
        if any((s.basis, s.processes) != (first.basis, first.processes) for s in speeds):
            raise ConfigError(f"host speed: a span between two probes of different kinds "
                              f"({'; '.join(s.describe() for s in speeds)})")
        return HostSpeed(statistics.geometric_mean(s.compute for s in speeds),
                         statistics.geometric_mean(s.overhead for s in speeds),
                         f"{first.measured.split(' .. ')[0]} .. {last.measured.split(' .. ')[-1]}",
                         first.basis, first.processes)


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
    ``now[label] / then[label]`` over the labels both have, as a :class:`HostSpeed` of basis ``"steps"``."""
    common = sorted(k for k in set(then) & set(now) if parse_step_label(k)[3] == processes)
    if not common:
        raise ConfigError(f"host speed: no probe step on {processes} processes timed both at calibration and now "
                          f"(calibrated on {step_processes(then)}; calibrate again: python train.py stage=calibrate)")
    r = statistics.geometric_mean(now[k] / then[k] for k in common)
    return HostSpeed(r, r, measured, "steps", processes)


def host_speed(recorded: Mapping[str, Mapping[str, float]], now: Mapping[str, Mapping[str, float]],
               measured: str = "") -> HostSpeed:
    """The reference probe's ratio now over at calibration, per group of :data:`REFERENCE_GROUPS`:
    the geometric mean of ``now[g][label] / recorded[g][label]`` over the labels both have."""
    ratios = []
    for g in REFERENCE_GROUPS:
        common = sorted(set(recorded.get(g) or {}) & set(now.get(g) or {}))
        if not common:
            raise ConfigError(f"reference probe: no '{g}' timing both at calibration and now "
                              f"(calibrate again: python train.py stage=calibrate)")
        ratios.append(statistics.geometric_mean(now[g][k] / recorded[g][k] for k in common))
    return HostSpeed(ratios[0], ratios[1], measured)
