"""The one exception type for bad user input.

Every check on configs, topologies, meshes and placements raises :class:`ConfigError`
with a single-line message that names the offending key or value. ``train.py`` prints it
as one line and exits non-zero, before any worker process is started.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input: a one-line message naming the key and the problem."""

    def __init__(self, message: str) -> None:
        if "\n" in message:
            message = " ".join(part.strip() for part in message.splitlines() if part.strip())
        super().__init__(message)
