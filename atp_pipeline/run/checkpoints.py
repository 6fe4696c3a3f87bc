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
_LAST = re.compile(r"^last(-v\d+)?\.ckpt$")  # Lightning's save_last (a -vN when one was there already)


def is_complete(path: Path) -> bool:
    if path.is_dir():
        return (path / ".metadata").is_file() and is_complete(path / "meta.pt")
    return path.is_file() and zipfile.is_zipfile(path)


def checkpoint_step(path: Path) -> int:
    """The global step a complete checkpoint resumes at: from its name ``step<N>.ckpt``, else from the
    loop state Lightning saved in it (``last.ckpt``)."""
    m = _STEP.match(path.name)
    if m:
        return int(m.group(1))
    import torch

    meta = torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu", weights_only=False)
    return int(meta["global_step"])


def newest_complete(run_dir: Path) -> Tuple[Optional[Path], List[Path]]:
    """The newest complete checkpoint of ``run_dir`` (the highest step; a ``step<N>.ckpt`` before a
    ``last.ckpt`` of the same step; None if none) and the partial ones newer than it (or of unknown step)."""
    d = Path(run_dir) / "checkpoints"
    found = [p for p in d.iterdir() if _STEP.match(p.name) or _LAST.match(p.name)] if d.is_dir() else []
    complete = sorted(((checkpoint_step(p), bool(_STEP.match(p.name)), p) for p in found if is_complete(p)),
                      key=lambda t: (t[0], t[1]))
    best = complete[-1] if complete else None
    partial = sorted(p for p in found if not is_complete(p) and (
        best is None or not _STEP.match(p.name) or checkpoint_step(p) > best[0]))
    return (best[2] if best else None), partial


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
