"""Entry-point guard: bad input -> one clear line on stderr and exit code 2, no traceback.

Hydra prints composition errors over several lines (a missing option lists every
available one; a schema error adds ``full_key``/``object_type`` lines). ``guarded`` runs
the Hydra app with ``HYDRA_FULL_ERROR=1`` so those exceptions reach it, and condenses
them. Real bugs keep their traceback. A user who sets ``HYDRA_FULL_ERROR`` gets Hydra's
own full output instead.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from typing import Any, Callable, NoReturn

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf.errors import OmegaConfBaseException

from atp_pipeline.errors import ConfigError, LaunchError, describe_omegaconf, first_line

EXIT_BAD_INPUT = 2


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_BAD_INPUT)


_FILE_LIKE = re.compile(r"^(?P<group>[\w-]+)/(?P<path>(?:\.{1,2}/|/|~).*|.*\.ya?ml)$")


def _file_as_option(group: str, path: str) -> str:
    """A config file given where a group takes an option name: how Hydra finds it instead."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return (f"{group}={path}: {group} takes a name, not a file path; put the file at <dir>/{group}/{stem}.yaml and "
            f"run with hydra.searchpath=[file://<dir>] {group}={stem}")


def describe_missing(exc: MissingConfigException) -> str:
    raw = (exc.missing_cfg_file or "").lstrip("/")
    file_like = _FILE_LIKE.match(raw)
    if file_like:  # topology=./my_topology.yaml, topology=/abs/my.yaml
        path = file_like.group("path")
        if not re.search(r"\.ya?ml$", path):
            path += ".yaml"  # Hydra drops the extension it adds
        return _file_as_option(file_like.group("group"), path)
    missing = raw.strip("/")
    group, _, option = missing.rpartition("/")
    options = sorted(exc.options or [])
    if group and options:
        hint = difflib.get_close_matches(option, options, n=1)
        suggestion = f"; did you mean '{hint[0]}'?" if hint else ""
        shown = ", ".join(options[:24]) + (", ..." if len(options) > 24 else "")
        return f"unknown {group} '{option}' (available: {shown}){suggestion}"
    return first_line(str(exc))


def describe_composition(exc: Exception) -> str:
    # Override errors chain the OmegaConf error as __cause__; errors inside a config file
    # (a typo in a user's topology YAML) only as __context__, with "In '<file>':" in front.
    cause = exc.__cause__ or exc.__context__
    head = first_line(str(exc))
    where = re.match(r"^In '([^']+)'", head)
    prefix = f"in {where.group(1)}: " if where else ""
    if isinstance(cause, OmegaConfBaseException):
        return prefix + describe_omegaconf(cause)
    if isinstance(cause, MissingConfigException):
        return describe_missing(cause)
    return head if not cause else f"{head.rstrip('.:')}: {first_line(str(cause))}"


EXIT_FAILED = 1


def _multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # noqa: BLE001 - no Hydra app around (a test calling the task itself)
        return False


def report_failure(exc: LaunchError) -> NoReturn:
    """A run whose ranks failed: one line naming the cause, then where every rank's report is (not
    Hydra's "Error executing job", nor the survivors' tracebacks: they are in ``train.log``)."""
    sys.stderr.write(f"error: {exc.cause}\n")
    if exc.log:
        sys.stderr.write(f"every rank's report: {exc.log}\n")
    else:
        sys.stderr.write(f"{exc}\n")  # no log to point to: the reports here
    sys.stderr.flush()
    raise SystemExit(EXIT_FAILED)


def exits_on_bad_input(task: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Hydra task function: a :class:`ConfigError` inside it exits like one at compose
    time (Hydra would otherwise add an "Error executing job" line and, in a multirun, go on)."""

    @functools.wraps(task)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except ConfigError as exc:
            _fail(str(exc))
        except LaunchError as exc:  # the ranks failed: the cause first, the ranks' reports in train.log
            if _multirun():  # a sweep goes on to its next point (Hydra reports the failed one at the end)
                sys.stderr.write(f"error: {exc.cause}" + (f" (every rank's report: {exc.log})" if exc.log else "")
                                 + "\n")
                raise
            report_failure(exc)

    return wrapper


def guarded(app: Callable[[], Any]) -> Any:
    """Run a Hydra app, turning input errors into one line and exit code 2."""
    if os.environ.get("HYDRA_FULL_ERROR"):
        return app()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        return app()
    except ConfigError as exc:
        _fail(str(exc))
    except MissingConfigException as exc:
        _fail(describe_missing(exc))
    except (ConfigCompositionException, OverrideParseException) as exc:
        _fail(describe_composition(exc))
    except OmegaConfBaseException as exc:
        _fail(describe_omegaconf(exc))
