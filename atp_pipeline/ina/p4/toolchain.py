"""The shipped P4 toolchain: where its tools are, and compiling the two ATP programs.

``../shared/p4tools/install.sh`` puts p4c 1.2.5.5 (``p4test``, ``p4c-bm2-ss``) and BMv2 1.15.5
(``simple_switch``, ``simple_switch_CLI``) under ``/opt/p4tools`` (``$ATP_P4TOOLS`` overrides
the prefix). A tool is taken from ``PATH`` first, then from ``<prefix>/bin``, so nothing needs
``PATH`` to be changed. The programs mirror the switch function of ATP §5.3
(:func:`atp_pipeline.ina.switch.process`); ``p4/README.md`` lists what the compilers report.

* :func:`compile_v1model` — ``p4c-bm2-ss`` on ``p4/v1model/atp.p4`` → BMv2 JSON;
* :func:`check_tna` — ``p4test`` on ``p4/tna/atp.p4`` with the TNA includes and
  ``__TARGET_TOFINO__`` = 1 or 2 (front and mid end only: stages and SALUs need ``bf-p4c``);
* :func:`cached_v1model_json` — the compiled JSON for a set of sources and defines, compiled
  once and kept in a content-addressed cache (the live BMv2 switch starts from it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

DEFAULT_PREFIX = Path("/opt/p4tools")
INSTALL_HINT = "install ../shared/p4tools (install.sh) or set ATP_P4TOOLS to its prefix"
BMV2_TOOLS = ("p4c-bm2-ss", "simple_switch", "simple_switch_CLI")


class P4ToolError(RuntimeError):
    """A P4 tool is missing or failed (the message is one line plus the tool's own output)."""


def prefix() -> Path:
    """The toolchain's install prefix: ``$ATP_P4TOOLS`` or ``/opt/p4tools``."""
    return Path(os.environ.get("ATP_P4TOOLS") or DEFAULT_PREFIX)


def find_tool(name: str) -> Optional[str]:
    """``name`` on ``PATH``, else in ``<prefix>/bin``; ``None`` if in neither."""
    hit = shutil.which(name)
    if hit:
        return hit
    cand = prefix() / "bin" / name
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def missing_tools(names: Sequence[str] = BMV2_TOOLS) -> List[str]:
    return [n for n in names if find_tool(n) is None]


def why_missing(names: Sequence[str] = BMV2_TOOLS) -> str:
    """One line naming the missing tools, or ``""`` when every one is there."""
    gone = missing_tools(names)
    if not gone:
        return ""
    return f"P4 toolchain not found: {', '.join(gone)} (neither on PATH nor in {prefix() / 'bin'}; {INSTALL_HINT})"


def tna_include() -> Path:
    return prefix() / "share" / "p4c" / "tna-include"


def require(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise P4ToolError(why_missing([name]))
    return path


@dataclass
class CompileResult:
    """One compiler run: the command, its status and its diagnostics."""

    cmd: List[str]
    returncode: int
    output: str  # stderr + stdout
    warnings: List[str] = field(default_factory=list)  # the lines naming a warning

    def check(self) -> "CompileResult":
        if self.returncode != 0:
            raise P4ToolError(f"{' '.join(self.cmd)} exited with {self.returncode}:\n{self.output.strip()}")
        return self


def _run(cmd: List[str]) -> CompileResult:
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = (r.stderr or "") + (r.stdout or "")
    return CompileResult(cmd, r.returncode, out, [ln for ln in out.splitlines() if "warning" in ln.lower()])


def _defines(defines: Mapping[str, int]) -> List[str]:
    return [f"-D{k}={v}" for k, v in sorted(defines.items())]


def compile_v1model(source: Path, out_json: Path, defines: Mapping[str, int] = {}) -> CompileResult:
    """``p4c-bm2-ss --std p4-16 [-DX=v] -o out_json source`` (not checked: see ``.check()``)."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    return _run([require("p4c-bm2-ss"), "--std", "p4-16", *_defines(defines), "-o", str(out_json), str(source)])


def check_tna(source: Path, target: int, defines: Mapping[str, int] = {}) -> CompileResult:
    """``p4test`` on a TNA program for Tofino ``target`` (1 or 2) with the shipped includes."""
    if target not in (1, 2):
        raise ValueError(f"Tofino target must be 1 or 2, got {target}")
    return _run([require("p4test"), "--std", "p4-16", "-I", str(tna_include()),
                 f"-D__TARGET_TOFINO__={target}", *_defines(defines), str(source)])


def _sources_digest(source: Path, defines: Mapping[str, int], compiler: str) -> str:
    """A digest of every ``.p4`` file of the checkout's ``p4/`` tree the program can include,
    the defines and the compiler binary's identity."""
    root = source.resolve().parents[1]  # p4/ (v1model/atp.p4 includes ../common, ../generated)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.p4")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    st = os.stat(compiler)
    h.update(repr((sorted(defines.items()), compiler, st.st_size, st.st_mtime_ns)).encode())
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "atp_pipeline" / "bmv2"


def cached_v1model_json(source: Path, defines: Mapping[str, int] = {}) -> Path:
    """The BMv2 JSON of ``source`` with ``defines``: compiled on first use, then reused while
    no ``.p4`` file of the tree, define or compiler changes."""
    compiler = require("p4c-bm2-ss")
    d = cache_dir() / _sources_digest(source, defines, compiler)
    out = d / "atp.json"
    if out.is_file():
        return out
    tmp = d.with_name(d.name + f".tmp{os.getpid()}")
    compile_v1model(source, tmp / "atp.json", defines).check()
    try:
        tmp.rename(d)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def n_agg_defines(n_aggregators: Optional[int]) -> Dict[str, int]:
    """``{"ATP_N_AGG": n}`` to compile the register size ``n`` (a power of two), or ``{}``."""
    return {} if n_aggregators is None else {"ATP_N_AGG": int(n_aggregators)}
