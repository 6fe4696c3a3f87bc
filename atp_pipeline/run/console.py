"""``train.log`` in the run directory: what the launcher printed (the plan, the fit header, the
summary; not the ranks' progress bar, which rank 0 draws on the terminal itself), and, when the run
fails, every rank's report in full. The console then gets one line naming the cause and a pointer to
the log (:func:`atp_pipeline.cli.exits_on_bad_input`)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator, List, Optional, TextIO

_LOG: List[TextIO] = []  # the open train.log while a run is logged (innermost last)


class _Tee:
    """A text stream that writes to ``stream`` and to ``log``; everything else is ``stream``'s."""

    def __init__(self, stream: Any, log: TextIO) -> None:
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        try:
            self._log.write(text)
        except (OSError, ValueError):  # a full disk or a closed log never fails the console
            pass
        return self._stream.write(text)

    def flush(self) -> None:
        for f in (self._log, self._stream):
            try:
                f.flush()
            except (OSError, ValueError):
                pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def logged_console(path: Path) -> Iterator[Path]:
    """While inside: what this process prints to stdout and stderr also goes to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", buffering=1, encoding="utf-8")
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)  # type: ignore[assignment]
    _LOG.append(log)
    try:
        yield path
    finally:
        _LOG.remove(log)
        sys.stdout, sys.stderr = out, err
        with contextlib.suppress(OSError, ValueError):
            log.close()


def to_log(text: str) -> Optional[str]:
    """Write ``text`` to the open ``train.log`` only (not the console); its path, or None if none is open."""
    if not _LOG:
        return None
    log = _LOG[-1]
    try:
        log.write(text if text.endswith("\n") else text + "\n")
        log.flush()
    except (OSError, ValueError):
        return None
    return log.name
