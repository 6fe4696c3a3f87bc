"""The checkpoints of a run directory (``<run>/checkpoints/step<N>.ckpt``, written every
``trainer.checkpoint_every_n_steps``): which are complete, and the newest of them, for
``resume=auto`` and ``trainer.max_restarts``.

A sharded checkpoint (a ``torch.distributed.checkpoint`` directory) is complete once its
``.metadata`` (the coordinator writes it after every rank's shards) and then Lightning's ``meta.pt``
(the loop's and optimizer's other state, written by rank 0 last) are written. A single file
(``torch.save``: a zip archive, as ``meta.pt`` is) is complete when its archive's directory, written
last, reads.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import List, Optional, Tuple

from atp_pipeline.errors import ConfigError

_STEP = re.compile(r"^step(\d+)\.ckpt$")


def is_complete(path: Path) -> bool:
    if path.is_dir():
        return (path / ".metadata").is_file() and is_complete(path / "meta.pt")
    return path.is_file() and zipfile.is_zipfile(path)


def step_checkpoints(run_dir: Path) -> List[Tuple[int, Path]]:
    """``(step, path)`` of every ``step<N>.ckpt`` of ``run_dir``, oldest first."""
    d = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP.match(p.name))] if d.is_dir() else []
    return sorted(found)


def newest_complete(run_dir: Path) -> Tuple[Optional[Path], List[Path]]:
    """The newest complete checkpoint of ``run_dir`` (None if none) and the partial ones newer than it."""
    partial: List[Path] = []
    for _, path in reversed(step_checkpoints(run_dir)):
        if is_complete(path):
            return path, partial
        partial.append(path)
    return None, partial


def resolve_resume(resume: Optional[str], run_dir: Path) -> Optional[str]:
    """``resume=`` as the checkpoint to load: ``auto`` is the newest complete one of the run
    directory; a path must be a complete checkpoint. One line (:class:`ConfigError`) otherwise."""
    if not resume:
        return None
    if resume == "auto":
        path, partial = newest_complete(run_dir)
        if path is None:
            why = f" ({', '.join(p.name for p in partial)}: partial)" if partial else ""
            raise ConfigError(f"resume=auto: no complete checkpoint in {Path(run_dir) / 'checkpoints'}{why}; "
                              f"set hydra.run.dir=<the run directory to continue> (checkpoints every "
                              f"trainer.checkpoint_every_n_steps) or leave resume unset")
        if partial:
            print(f"resume=auto: skipping {', '.join(p.name for p in partial)} (partial: written by a run that "
                  f"failed while saving it)")
        print(f"resume=auto: continuing from {path}")
        return str(path)
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"resume={resume}: no such checkpoint")
    if not is_complete(path):
        raise ConfigError(f"resume={resume}: not a complete checkpoint (" + ("no .metadata or meta.pt: partial, "
                          "e.g. its run failed while writing it" if path.is_dir() else "not a complete archive")
                          + "); resume=auto takes the newest complete one of a run directory")
    return str(path)
