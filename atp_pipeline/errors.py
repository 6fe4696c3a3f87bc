"""The one exception type for bad user input.

Every check on configs, topologies, meshes and placements raises :class:`ConfigError`
with a single-line message that names the offending key or value. ``train.py`` prints it
as one line and exits non-zero, before any worker process is started.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import List, Optional

from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """Bad user input: a one-line message naming the key and the problem."""

    def __init__(self, message: str) -> None:
        if "\n" in message:
            message = " ".join(part.strip() for part in message.splitlines() if part.strip())
        super().__init__(message)


class LaunchError(RuntimeError):
    """Ranks failed (:func:`atp_pipeline.launch.spawn`). ``str()`` is every rank's report (tracebacks
    included); :attr:`cause` is the one line that names what failed first
    (:func:`atp_pipeline.launch.first_cause`); :attr:`log` where the report was written, once it was
    (``train.py`` prints the cause and that path, nothing else). Here, not in the launcher: the
    entry point catches it without importing the launcher."""

    def __init__(self, failures: List[str], cause: str) -> None:
        super().__init__("\n".join(failures))
        self.failures = list(failures)
        self.cause = cause
        self.log: Optional[str] = None


def first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def describe_omegaconf(exc: OmegaConfBaseException) -> str:
    """One line for an OmegaConf error; unknown keys list the schema's keys and a guess."""
    key = getattr(exc, "full_key", None)
    obj = getattr(exc, "object_type", None)
    if (isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and key and obj is not None
            and dataclasses.is_dataclass(obj)):
        fields = [f.name for f in dataclasses.fields(obj)]
        bad = key.rsplit(".", 1)[-1]
        hint = difflib.get_close_matches(bad, fields, n=1)
        at = f" at {key}" if key != bad else ""
        text = f"unknown key '{bad}'{at} ({obj.__name__} keys: {', '.join(fields)})"
        return text + (f"; did you mean '{hint[0]}'?" if hint else "")
    msg = first_line(getattr(exc, "msg", None) or str(exc))
    return f"{key}: {msg}" if key else msg
