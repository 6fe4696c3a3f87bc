"""Every command line the documentation shows runs, in a cheap form: a documented command that
breaks fails CI.

**Discovery** (nothing here is a copy of a command: add one to the docs and it is covered).
Documents: ``README.md``, ``docs/**/*.md`` and every ``<top-level dir>/README.md``
(``p4/README.md``). Commands come from

* fenced code blocks (``` or ~~~): in a shell block (``bash``, ``sh``, ``shell``, ``console``,
  ``zsh``) every line that is not a comment; in an unlabeled block the lines that start with a
  command word (``python``, ``pip``, ``pytest``, ``torchrun``, ``bash``, the P4 tools, ...).
  A block with ``$ `` prompts: only the prompted lines are commands, the lines after one are its
  documented output (an ``error: ...`` line there means the command must fail, printing it);
* indented code blocks (4 spaces after a blank line or a heading; ``p4/README.md``): lines that
  start with a command word;
* inline code spans in prose that hold a whole command (they may wrap over lines).

Backslash continuations are joined, ``$ `` prompts and trailing ``# comments`` stripped,
``a && b`` split into two commands, ``[--optional flags]`` dropped, a trailing ``&`` makes a
background service. A fenced block whose first line is ``# <path>`` is a file the following
commands use (``~/myconf/topology/theirs.yaml``): it is written under the run's temporary HOME.

**Cheap forms** (generic rules, :func:`plan_command`): ``python train.py`` fits get
``trainer.max_steps=2`` (a resume 4) ``trainer.progress_bar=false planner.plot=false``;
``stage=plan`` stays; a live in-network aggregation fit (``aggregation=atp|ps|switchml``, Python
switch) packs :data:`LIVE_FIT_PAYLOAD` values a packet unless it sets ``aggregation.payload_k`` or
joins a running switch. A fit plans instead (``stage=plan``: compose, resolve, plan, report — what a
doc change breaks) when it is of a paper-size model (no CPU can train it), when another test of
the suite already runs that very fit (found by reading the suite's tests: one run spec with the same
overrides; the note names the test), or when it is a multirun (all its points planned, and
``summary.csv`` must be written) — unless a later documented command uses its output (a resume,
an HF export): that one always fits. ``ATP_DOCS_ALL_FITS=1`` runs every documented fit as a fit
(a fit multirun then shrinks to two points).
``python -m <module>`` gets the module's own smallest flags (:data:`MODULE_RULES`; a module
without a rule fails, so a new one is decided on, not run at full size). Every output goes into
pytest's tmp directory: ``hydra.run.dir``/``hydra.sweep.dir``, ``outputs/...`` paths and the
modules' ``--out``, bare file names (``-o atp.json``), ``~``. Placeholders are satisfied by a real
earlier run (``outputs/runs/<date>/<time>/checkpoints/last.ckpt``: a 2-step fit; ``model.pretrained=<dir>``:
the HF export of a documented HF fit). Commands that need what CI lacks (GPU, SLURM, several
nodes, a package install, a P4Runtime server) are skipped with the reason. Commands whose cheap
forms are equal run once.

Commands run with ``cwd`` = the repository root, ``ATP_DOCS_JOBS`` (default 2) at a time, in
document order with producers before their consumers. A plain ``python <script>`` / ``python -m <module>`` command
(no shell syntax, no HOME of its own) is forked from one warm interpreter that imported torch,
DTensor, Hydra and the package once (:mod:`tests.zygote`; the child is what ``python <argv>``
would be); ``ATP_DOCS_ZYGOTE=0`` starts each as its own interpreter through bash. ``python -m tests.test_docs_commands
--list`` prints the table: each command, and what runs for it or why it is skipped.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import pytest

from tests.conftest import running
from tests.zygote import Zygote, argv_of

ROOT = Path(__file__).resolve().parents[1]
TMP = "@TMP@"  # the run's temporary root in a cheap form; '$TMP' in the --list table
PORT = "@PORT@"  # a free port chosen when the job runs
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh", "shell-session", "shellsession"}
COMMAND_WORDS = {"python", "python3", "pip", "pip3", "pytest", "torchrun", "bash", "sh",
                 "p4c", "p4c-bm2-ss", "p4test", "simple_switch", "simple_switch_CLI"}
FIT_STEPS = 2
#: models a CPU fit can train (the others are paper-size and plan on the meta device)
CPU_MODELS = {"tiny", "small", "hf_pretrained"}
MIN_COMMANDS = 60  # the docs show ~80 commands today: extraction that finds fewer is broken
DEFAULT_TIMEOUT = 300.0
#: live in-network aggregation modes (a Python switch role over UDP): their documented fits run
#: with this many values a packet unless the command sets aggregation.payload_k
LIVE_AGGREGATION = {"atp", "ps", "switchml"}
LIVE_FIT_PAYLOAD = 2048
#: plain ``python`` commands fork from one warm interpreter (tests/zygote.py); 0: each its own
ZYGOTE = os.environ.get("ATP_DOCS_ZYGOTE", "1") not in ("", "0")


# ------------------------------------------------------------------------------ discovery
@dataclass
class DocCommand:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the command's first line
    text: str  # the command as documented: continuations joined, prompt and comment stripped
    block: str  # "<doc>:<first line of its block>"
    kind: str  # fenced | indented | inline
    expected: List[str] = field(default_factory=list)  # documented output (console blocks)
    part: int = 0  # position in an `a && b` chain (0: not in one)
    fails: bool = False  # documented to be refused (inline: its sentence says it refuses / fails)
    quiet: bool = False  # its comment says "no output": it must print nothing

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}" + (f"#{self.part}" if self.part else "")


@dataclass
class FileBlock:
    doc: str
    line: int
    path: str  # as documented, e.g. ~/myconf/topology/theirs.yaml
    content: str


def doc_files(root: Path = ROOT) -> List[Path]:
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    if (root / "docs").is_dir():
        files += sorted((root / "docs").rglob("*.md"))
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and d.name not in ("docs", "outputs", "tests") \
                and not d.name.endswith(".egg-info") and (d / "README.md").is_file():
            files.append(d / "README.md")
    return files


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def split_chain(text: str) -> List[str]:
    """``a && b`` -> [a, b] (outside quotes)."""
    parts, cur, quote, i = [], "", None, 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif text.startswith("&&", i):
            parts.append(cur.strip())
            cur, i = "", i + 2
            continue
        cur += ch
        i += 1
    parts.append(cur.strip())
    return [p for p in parts if p]


def _first_word(s: str) -> str:
    return s.split(None, 1)[0] if s.split() else ""


def _is_command_start(s: str) -> bool:
    """``s`` reads as a command line: a command word, then a flag or a plain word/path (not prose
    such as ``torchrun environment), each ...``)."""
    words = s.split()
    if not words or not (words[0] in COMMAND_WORDS or words[0].startswith("./")):
        return False
    return len(words) == 1 or re.match(r"^(-{1,2}[\w-]|[\w./:=+@$'\"-]+$)", words[1]) is not None


def _join_continuations(lines: List[Tuple[int, str]]) -> List[Tuple[int, str]]:
    out: List[Tuple[int, str]] = []
    pending: Optional[Tuple[int, str]] = None
    for no, raw in lines:
        s = raw.strip()
        if pending is not None:
            start, acc = pending
            acc = acc + " " + s
        else:
            start, acc = no, s
        if acc.endswith("\\"):
            pending = (start, acc[:-1].rstrip())
        else:
            pending = None
            out.append((start, acc))
    if pending is not None:
        out.append(pending)
    return out


def _commands_of_block(doc: str, start: int, body: List[Tuple[int, str]], kind: str, shell: bool
                       ) -> List[DocCommand]:
    block = f"{doc}:{start}"
    prompted = any(s.lstrip().startswith("$ ") for _, s in body)
    cmds: List[DocCommand] = []
    if prompted:
        cur: Optional[DocCommand] = None
        for no, s in body:
            st = s.strip()
            if st.startswith("$ "):
                cur = DocCommand(doc, no, strip_comment(st[2:].strip()), block, kind)
                cmds.append(cur)
            elif cur is not None and st:
                cur.expected.append(st)
        return cmds
    for no, s in _join_continuations(body):
        if not s or s.startswith("#"):
            continue
        if not shell and not _is_command_start(s):
            continue
        text = strip_comment(s)
        cmds.append(DocCommand(doc, no, text, block, kind, quiet="no output" in s[len(text):]))
    return cmds


_FENCE = re.compile(r"^( {0,3})(```+|~~~+)\s*([\w+-]*)")
_FILE_HEADER = re.compile(r"^#\s+(~?/?[\w./-]+\.(?:ya?ml|json|txt|toml|cfg))\s*$")


def extract(path: Path, root: Path = ROOT) -> Tuple[List[DocCommand], List[FileBlock]]:
    """The commands and file blocks of one Markdown document."""
    doc = str(path.relative_to(root))
    lines = path.read_text(encoding="utf-8").splitlines()
    cmds: List[DocCommand] = []
    files: List[FileBlock] = []
    prose = list(lines)  # lines outside code blocks (code blanked) for the inline spans
    i = 0
    prev_blank_or_heading = True
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m:
            fence, lang = m.group(2), m.group(3).lower()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence[:3]):
                j += 1
            body = [(k + 1, lines[k]) for k in range(i + 1, min(j, len(lines)))]
            for k in range(i, min(j + 1, len(lines))):
                prose[k] = ""
            header = _FILE_HEADER.match(body[0][1].strip()) if body else None
            if header and lang not in SHELL_LANGS:
                files.append(FileBlock(doc, i + 1, header.group(1),
                                       "\n".join(s for _, s in body[1:]) + "\n"))
            elif lang in SHELL_LANGS or lang == "":
                cmds += _commands_of_block(doc, i + 1, body, "fenced", lang in SHELL_LANGS)
            i = j + 1
            prev_blank_or_heading = True
            continue
        if lines[i].startswith("    ") and lines[i].strip() and prev_blank_or_heading:
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [(k + 1, lines[k][4:]) for k in range(i, j)]
            for k in range(i, j):
                prose[k] = ""
            cmds += _commands_of_block(doc, i + 1, body, "indented", False)
            i = j
            prev_blank_or_heading = True
            continue
        st = lines[i].strip()
        prev_blank_or_heading = not st or st.startswith("#")
        i += 1
    # inline code spans holding a whole command (possibly wrapped over lines)
    text = "\n".join(prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(m.group(1).split())
        if _is_command_start(span) and len(span.split()) >= 2:
            no = text.count("\n", 0, m.start()) + 1
            rest = " ".join(text[m.end():m.end() + 300].split())
            sentence = re.split(r"[.;:](?:\s|$)|`", rest, maxsplit=1)[0]
            fails = re.search(r"\b(refuse[sd]?|reject(s|ed)?|fail(s|ed)?|errors?|exits? (with )?(status )?[12])\b",
                              sentence) is not None
            cmds.append(DocCommand(doc, no, span, f"{doc}:{no}", "inline", fails=fails))
    # a && b -> two commands
    out: List[DocCommand] = []
    for c in cmds:
        parts = split_chain(c.text)
        if len(parts) == 1:
            out.append(c)
        else:
            for k, p in enumerate(parts, 1):
                out.append(DocCommand(c.doc, c.line, p, c.block, c.kind, list(c.expected), part=k, fails=c.fails))
    return out, files


def discover(root: Path = ROOT) -> Tuple[List[DocCommand], List[FileBlock]]:
    cmds: List[DocCommand] = []
    files: List[FileBlock] = []
    for p in doc_files(root):
        c, f = extract(p, root)
        cmds += sorted(c, key=lambda d: (d.line, d.part))  # document order (inline spans among blocks)
        files += f
    return cmds, files


# ------------------------------------------------------------------------------ cheap forms
@dataclass
class Plan:
    cmd: DocCommand
    action: str  # run | skip | dup
    shell: str = ""  # the cheap form (bash), with @TMP@ / @PORT@ / @RUNDIR:<where>@ placeholders
    note: str = ""  # how it was made cheap (run), or why it is skipped (skip)
    requires: Set[str] = field(default_factory=set)  # cuda | root | p4:<tool> ...
    home: bool = False  # runs with HOME = <tmp>/home (it uses ~ or $HOME)
    service: bool = False  # a background command (`... &`)
    producers: List[str] = field(default_factory=list)  # `where` of commands whose output it uses
    preludes: List["Plan"] = field(default_factory=list)  # services it needs while it runs
    run_dir: str = ""  # train.py: "run" or "sweep" (the hydra dir to point into tmp)
    checks: List[str] = field(default_factory=list)  # files (relative to its run dir) that must exist
    timeout: float = DEFAULT_TIMEOUT
    key: str = ""  # dedupe key (the cheap form without its run directory)
    job: str = ""  # the job slug that runs it
    dup_of: str = ""


class Skip(Exception):
    pass


def _has_opt(text: str, flag: str) -> bool:
    return re.search(rf"(?<!\S){re.escape(flag)}(?=[\s=]|$)", text) is not None


def _opt(flag: str) -> str:
    """The pattern of ``flag value`` (``flag=value``; a quoted value whole), the value a group."""
    return rf"(?<!\S){re.escape(flag)}(?:=|\s+)('[^']*'|\"[^\"]*\"|\S+)"


def set_opt(text: str, flag: str, value: Optional[str] = None) -> str:
    """``flag value`` replaced in ``text``, or appended (``value=None``: a switch)."""
    if value is None:
        return text if _has_opt(text, flag) else f"{text} {flag}"
    pat = re.compile(_opt(flag))
    if pat.search(text):
        return pat.sub(lambda _: f"{flag} {value}", text, count=1)
    return f"{text} {flag} {value}"


def drop_opt(text: str, flag: str) -> str:
    """``flag value`` removed from ``text``."""
    return re.sub(rf"\s*{_opt(flag)}", "", text, count=1)


def get_opt(text: str, flag: str) -> Optional[str]:
    m = re.search(_opt(flag), text)
    return m.group(1).strip("'\"") if m else None


def set_override(text: str, key: str, value: str) -> str:
    """Hydra ``key=value`` replaced in ``text``, or appended."""
    pat = re.compile(rf"(?<!\S){re.escape(key)}=\S+")
    if pat.search(text):
        return pat.sub(lambda _: f"{key}={value}", text, count=1)
    return f"{text} {key}={value}"


def _overrides(text: str) -> Dict[str, str]:
    try:
        toks = shlex.split(text)
    except ValueError:
        toks = text.split()
    return {t.split("=", 1)[0]: t.split("=", 1)[1] for t in toks if "=" in t and not t.startswith("-")}


def _redirect_paths(text: str) -> Tuple[str, bool]:
    """outputs/ -> <tmp>/outputs/, $PWD/outputs -> <tmp>/outputs, bare output file names -> <tmp>/scratch;
    returns (text, uses_home)."""
    text = re.sub(r"(?<![\w./~$@-])outputs/", f"{TMP}/outputs/", text)
    text = re.sub(r"\$PWD(?='?/outputs)", TMP, text)
    text = re.sub(r"\$\{PWD\}(?='?/outputs)", TMP, text)

    def scratch(m: "re.Match[str]") -> str:
        name = m.group(2)
        return m.group(1) + (name if (ROOT / name).exists() else f"{TMP}/scratch/{name}")

    text = re.sub(r"(^|\s|>)([\w-]+(?:\.[\w-]+)*\.(?:json|jsonl|txt|yaml|yml|csv|log))(?=\s|$)", scratch, text)
    uses_home = bool(re.search(r"(?<![\w/])~/|\$HOME\b|\$\{HOME\}", text))
    return text, uses_home


# ---- python -m <module> / python <script>: the module's own smallest flags
ModuleRule = Callable[[str], Tuple[str, str]]  # text -> (cheap text, note); raises Skip


def _out(text: str, default_rel: str) -> str:
    return text if _has_opt(text, "--out") else set_opt(text, "--out", f"{TMP}/outputs/{default_rel}")


def _docs_commands(t: str) -> Tuple[str, str]:
    return t, "as documented (--list builds the table; nothing runs)"


def _dp_exactness(t: str) -> Tuple[str, str]:
    t = re.sub(r"(?<!\S)--bmv2(?!\S)", "", t)
    for flag, v in (("--steps", "2"), ("--dtypes", "fp32"), ("--cases", "'dp2 ring'"), ("--fsdp-models", "''"),
                    ("--fsdp-steps", "2"), ("--out", f"{TMP}/outputs/benchmarks/dp_exactness")):
        t = set_opt(t, flag, v)
    return " ".join(t.split()), ("2 float32 steps: one data-parallel case (with its resume); no FSDP (its runs against "
                                 "one process: tests/test_data_parallel.py), no BMv2 (tests/test_live_aggregation.py "
                                 "trains through BMv2)")


def _ina_experiments(t: str) -> Tuple[str, str]:
    note = "--quick"
    if re.search(r"(?<!\S)all(?!\S)", t):
        t = re.sub(r"(?<!\S)all(?!\S)", "two_level", t, count=1)
        note = ("`all` runs seven experiments, ~30 s even with --quick: the entry point runs "
                "`two_level --quick` here; every experiment runs in tests/ina/test_trends.py")
    return _out(set_opt(t, "--quick"), "ina"), note


def _ina_sim_speed(t: str) -> Tuple[str, str]:
    return _out(set_opt(t, "--repeat", "1"), "ina/sim_speed.json"), "--repeat 1"


def _live_sync(t: str) -> Tuple[str, str]:
    t = set_opt(set_opt(t, "--steps", "1"), "--repeats", "1")
    note = "1 step, 1 repeat"
    payloads = (get_opt(t, "--payloads") or "62,2048").split(",")  # 62,2048: the module's default
    t = set_opt(t, "--payloads", ",".join(payloads[:2]))  # spelled out: the default's form is the same run
    if len(payloads) > 2:
        note += (f"; payloads {','.join(payloads[:2])} of {','.join(payloads)} "
                 f"(larger ones: the same code, bigger datagrams)")
    return _out(t, "benchmarks/live_sync"), note


def _calibrate(t: str) -> Tuple[str, str]:
    name = get_opt(t, "--name") or "calib_local"
    t = set_opt(t, "--sizes", "4K")
    t = set_opt(set_opt(set_opt(t, "--passes", "1"), "--warmup", "0"), "--batch-ms", "1")
    if not _has_opt(t, "--out"):
        t = set_opt(t, "--out", f"{TMP}/outputs/conf/topology/{name}.yaml")
    if not _has_opt(t, "--report-dir"):
        t = set_opt(t, "--report-dir", f"{TMP}/outputs/calibration")
    return t, "one message size, 1 pass, no warm-up"


def _step_validation(t: str) -> Tuple[str, str]:
    t = set_opt(set_opt(set_opt(t, "--models", "gpt2_tiny"), "--variants", "2x32"), "--worlds", "2")
    t = set_opt(set_opt(set_opt(set_opt(t, "--chunks", "1"), "--steps", "1"), "--warmup", "0"), "--repeats", "1")
    t = set_opt(t, "--launches", "1")
    t = set_opt(t, "--out", f"{TMP}/outputs/benchmarks/step_validation")
    # the tests' golden calibration (stage=calibrate is planned here): a YAML that carries its own
    # calibration makes --calibration-dir moot, and the tag only names the output files, so every
    # documented run shares one cheap form (run once); it records the probes' steps that the default
    # --retime launch times inside the launch
    t = set_opt(drop_opt(t, "--calibration-dir"), "--topology", "tests/data/step_calibration.yaml")
    # the suite's other worker never lets the host go quiet
    t = set_opt(set_opt(t, "--tag", "steps"), "--quiet-wait", "0")
    return t, ("gpt2_tiny at batch 2 x 32 tokens, 2 processes (meshes 2x1, 1x2), chunks 1, 1 step, one launch, "
               "from the tests' calibration tests/data/step_calibration.yaml (the probes' steps timed again inside "
               "the launch), no wait for a quiet host")


def _sbp_calibration(t: str) -> Tuple[str, str]:
    for flag, v in (("--strategies", "3"), ("--sizes", "4K"), ("--passes", "1"), ("--strategy-passes", "1"),
                    ("--hidden", "64"), ("--seq", "16"), ("--micro-batch", "1")):
        t = set_opt(t, flag, v)
    return _out(t, "benchmarks/sbp_calibration"), "3 strategies of a 64-wide layer, one message size, 1 pass"


def _tp_step(t: str) -> Tuple[str, str]:
    world = get_opt(t, "--world") or "4"
    t = set_opt(set_opt(t, "--meshes", f"{world}x1"), "--chunks", "1")
    t = set_opt(set_opt(set_opt(t, "--steps", "1"), "--warmup", "0"), "--repeats", "1")
    t = set_opt(t, "--out", f"{TMP}/outputs/benchmarks/tp_step")  # never over a committed run
    return t, f"mesh {world}x1 (+ native TP, DDP), chunks 1, 1 step"


def _hf_tp(t: str) -> Tuple[str, str]:
    for flag, v in (("--repeats", "1"), ("--warmup", "0"), ("--hidden", "64"), ("--heads", "4"),
                    ("--layers", "1"), ("--vocab", "128"), ("--seq", "16"), ("--batch", "4")):
        t = set_opt(t, flag, v)
    return set_opt(t, "--out", f"{TMP}/outputs/benchmarks/hf_tp"), "a 1-layer 64-wide model, 1 repeat"


def _hf_gpu(t: str) -> Tuple[str, str]:
    for flag, v in (("--layers", "1"), ("--batch", "1"), ("--seq", "128"), ("--warmup", "1"),
                    ("--repeats", "2"), ("--steps", "2")):
        t = set_opt(t, flag, v)
    return _out(t, "benchmarks/hf_gpu"), "1 layer, batch 1 x 128, 2 repeats"


def _plan_scale(t: str) -> Tuple[str, str]:
    return _out(set_opt(t, "--repeats", "1"), "benchmarks/plan_scale.json"), "--repeats 1"


def _sbp_search(t: str) -> Tuple[str, str]:
    t = set_opt(set_opt(t, "--seeds", "1"), "--budget-s", "1")
    return _out(t, "benchmarks/sbp_search.json"), "1 seed, 1 s budget"


def _hf_coverage(t: str) -> Tuple[str, str]:
    t = set_opt(set_opt(t, "--types", "mamba"), "--out", f"{TMP}/outputs/benchmarks/hf_coverage")
    if _has_opt(t, "--doc"):
        # never over the committed table
        t = set_opt(t, "--doc", f"{TMP}/outputs/benchmarks/hf_coverage/hf_coverage.md")
    return t, "one type, refused before any step (the whole sweep is ~30 min; its subset: tests/test_hf_coverage.py)"


def _vocab_loss_memory(t: str) -> Tuple[str, str]:
    for flag, v in (("--vocab", "512"), ("--seq", "32"), ("--batch", "2")):
        t = set_opt(t, flag, v)
    return set_opt(t, "--out", f"{TMP}/outputs/benchmarks/vocab_loss_memory"), "a 512-word vocabulary, 2 x 32 tokens"


def _builders(t: str) -> Tuple[str, str]:
    return t, "as documented (instant)"


def _codegen_or_traces(default_rel: str) -> ModuleRule:
    def rule(t: str) -> Tuple[str, str]:
        if _has_opt(t, "--check"):
            return t, "as documented (read-only check of the checked-in files)"
        if _has_opt(t, "--out") or _has_opt(t, "--out-dir") or _has_opt(t, "--trace"):
            return t, "as documented"
        return set_opt(t, "--out", f"{TMP}/scratch/{default_rel}"), "written into tmp, not over the checked-in files"
    return rule


def _bmv2_replay(t: str) -> Tuple[str, str]:
    if _has_opt(t, "--dry-run"):
        return t, "as documented (no BMv2)"
    note = "as documented"
    if not _has_opt(t, "--scenario"):
        t = set_opt(t, "--scenario", "aggregate_complete_dealloc")
        note = ("one scenario (the whole corpus, ~12 s, replays in tests/p4/test_bmv2_replay_e2e.py)")
    if not _has_opt(t, "--workdir"):
        t = set_opt(t, "--workdir", f"{TMP}/scratch/bmv2_work")
    return t, note


def _p4_control(t: str) -> Tuple[str, str]:
    return t, "as documented (instant)"


def _bmv2_install(t: str) -> Tuple[str, str]:
    if not _has_opt(t, "--dry-run"):
        raise Skip("installs through P4Runtime: needs simple_switch_grpc (BMv2's P4Runtime server), "
                   "which ../shared/p4tools does not ship (p4/README.md: 'Not run here')")
    return t, "as documented (--dry-run)"


def _live_nodes(t: str) -> Tuple[str, str]:
    return t, "started, ready (its first line), stopped; its tenants run beside it"


MODULE_RULES: Dict[str, ModuleRule] = {
    "benchmarks.dp_exactness": _dp_exactness,
    "tests.test_docs_commands": _docs_commands,
    "benchmarks.ina_experiments": _ina_experiments,
    "benchmarks.ina_sim_speed": _ina_sim_speed,
    "benchmarks.live_sync": _live_sync,
    "benchmarks.sbp_calibration": _sbp_calibration,
    "benchmarks.step_validation": _step_validation,
    "benchmarks.tp_step": _tp_step,
    "benchmarks.hf_tp": _hf_tp,
    "benchmarks.hf_gpu": _hf_gpu,
    "benchmarks.plan_scale": _plan_scale,
    "benchmarks.sbp_search": _sbp_search,
    "benchmarks.hf_coverage": _hf_coverage,
    "benchmarks.vocab_loss_memory": _vocab_loss_memory,
    "atp_pipeline.run.calibrate": _calibrate,
    "atp_pipeline.topology.builders": _builders,
    "atp_pipeline.ina.p4.codegen": _codegen_or_traces("generated"),
    "atp_pipeline.ina.p4.traces": _codegen_or_traces("atp.jsonl"),
    "atp_pipeline.ina.p4.bmv2": _bmv2_replay,
    "atp_pipeline.ina.p4.control": _p4_control,
    "atp_pipeline.ina.live.nodes": _live_nodes,
    "p4/control/bmv2_install.py": _bmv2_install,
}

#: what a module needs beyond CPU and Python (checked when it runs; skipped with the reason if absent)
MODULE_NEEDS: Dict[str, Callable[[str], Set[str]]] = {
    "benchmarks.hf_gpu": lambda t: set() if get_opt(t, "--device") == "cpu" else {"cuda"},
    "atp_pipeline.ina.p4.bmv2": lambda t: set() if _has_opt(t, "--dry-run") else {"bmv2"},
    "atp_pipeline.ina.live.nodes": lambda t: {"bmv2"} if get_opt(t, "--impl") == "bmv2" else set(),
}


# ---- fits another test of the suite already runs (those plan here: a fit would add nothing new)
ALL_FITS = os.environ.get("ATP_DOCS_ALL_FITS", "") not in ("", "0")  # run every documented fit as a fit
_IGNORED_KEYS = {"trainer.max_steps", "trainer.progress_bar", "planner.plot", "trainer.checkpoint_every_n_steps",
                 "seed", "hydra.run.dir", "hydra.sweep.dir", "trainer.export"}
_FITS = re.compile(r"\b(run_train|_fit|fit|train)\(|train\.py")
_EXPECTS_FAILURE = re.compile(r"pytest\.raises|returncode\s*!=\s*0|returncode\s*==\s*[12]\b|startswith\(\s*[\"']error"
                              r"|SIGKILL|os\.kill\(|killpg\(")
#: a test's own speed knobs: a run spec with them still runs the documented fit
_TEST_KNOBS = {"model.seq_len", "model.hidden", "model.heads", "model.layers", "model.batch_size", "trainer.lr",
               "trainer.export", "trainer.collective_timeout_s"}


@dataclass
class _RunSpec:
    test: str  # tests/<file>::<function>
    exact: Set[str]
    prefixes: Set[str]  # f"k={...}" -> "k="


_SUITE_FITS: Optional[List[_RunSpec]] = None


def suite_fit_specs() -> List[_RunSpec]:
    """Every override list (a list/tuple literal or a call's arguments, with the module constants it
    splices in) of every test function of the suite that runs train.py fits and expects them to pass."""
    global _SUITE_FITS
    if _SUITE_FITS is not None:
        return _SUITE_FITS
    specs: List[_RunSpec] = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        src = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        consts = _list_constants(tree.body, {})
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        for fn in funcs:
            body = ast.get_source_segment(src, fn) or ""
            if not _FITS.search(body) or _EXPECTS_FAILURE.search(body):
                continue
            rel = f"{path.relative_to(ROOT)}::{fn.name}"
            local = _list_constants(fn.body, consts)  # the function's own override lists too
            for node in ast.walk(fn):
                elts = node.elts if isinstance(node, (ast.List, ast.Tuple)) else \
                    node.args if isinstance(node, ast.Call) else None
                if not elts:
                    continue
                spec = _RunSpec(rel, set(), set())
                for e in elts:
                    if isinstance(e, ast.JoinedStr) and e.values and isinstance(e.values[0], ast.Constant):
                        spec.prefixes.add(str(e.values[0].value))
                    else:
                        spec.exact.update(_strings(e, local))
                if any("=" in x for x in spec.exact | spec.prefixes):
                    specs.append(spec)
    _SUITE_FITS = specs
    return specs


def _strings(e: ast.expr, consts: Dict[str, List[str]]) -> List[str]:
    """The strings an element of an override list stands for: a literal, or a named list's (spread)."""
    if isinstance(e, ast.Constant) and isinstance(e.value, str):
        return [e.value]
    name = e.value if isinstance(e, ast.Starred) else e
    return list(consts.get(name.id, [])) if isinstance(name, ast.Name) else []


def _list_constants(body: Sequence[ast.stmt], outer: Dict[str, List[str]]) -> Dict[str, List[str]]:
    """``NAME = [...]`` assignments of ``body`` (in order, spreading names assigned before)."""
    consts = dict(outer)
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
            vals = [v for e in node.value.elts for v in _strings(e, consts)]
            for t in node.targets:
                if isinstance(t, ast.Name):
                    consts[t.id] = vals
    return consts


def fit_run_elsewhere(ov: Dict[str, str]) -> str:
    """The suite's test that runs a fit with exactly the settings ``ov`` makes (one run spec with
    the same keys and values, up to steps, output and the test's speed knobs), or ``""``."""
    want = {k: v for k, v in ov.items() if k not in _IGNORED_KEYS and k != "stage"}
    for spec in suite_fit_specs():
        if any(x.startswith("stage=") and x != "stage=fit" for x in spec.exact):
            continue
        keys = {x.split("=", 1)[0] for x in spec.exact | spec.prefixes if "=" in x}
        if keys - _IGNORED_KEYS - _TEST_KNOBS - {"stage"} != set(want):
            continue
        def has(k: str, v: str) -> bool:
            if f"{k}={v}" in spec.exact:
                return True
            if re.search(r"[<@$]", v):  # a placeholder / free port: any value of the key
                return any(x.startswith(k + "=") for x in spec.exact | spec.prefixes)
            return False
        if all(has(k, v) for k, v in want.items()):
            return spec.test
    return ""


def _is_hf_fit_model(model: str) -> bool:
    y = ROOT / "conf" / "model" / f"{model}.yaml"
    return model.endswith("_tiny") and y.is_file() and re.search(r"^family:\s*hf\b", y.read_text(), re.M) is not None


def _cpu_trainable(model: str) -> bool:
    return model in CPU_MODELS or model.endswith("_tiny")


def _plan_train(c: DocCommand, text: str, plan: Plan, earlier: Sequence[DocCommand],
                everyone: Sequence[DocCommand], force_fit: bool = False) -> str:
    ov = _overrides(text)
    multirun = bool(re.search(r"(?<!\S)(-m|--multirun)(?!\S)", text))
    launcher = ov.get("hydra/launcher", "")
    if "slurm" in launcher:
        raise Skip(f"SLURM launcher (hydra/launcher={launcher}): needs a SLURM cluster and hydra-submitit-launcher")
    if ov.get("trainer.accelerator", "cpu") in ("gpu", "cuda"):
        plan.requires.add("cuda")
    notes: List[str] = []
    stage = ov.get("stage", "fit")
    model = ov.get("model", "tiny")
    errs = c.fails or any(e.startswith("error") for e in c.expected)
    if stage == "calibrate" and not errs:  # ~1 min of measuring; a fresh interpreter starts the fork server
        text = set_override(text, "stage", "plan")
        stage = "plan"
        notes.append("planned (stage=plan): tests/test_calibration_stage.py runs stage=calibrate (quick, 2 processes) "
                     "and plans from what it wrote")
    if stage == "plan" and "calibration.dir" in ov and not errs:  # a directory under $TMP that nothing wrote: the
        # documented runs' directories (stage=calibrate's and stage=plan's) plan alike, so they share one cheap form
        text = set_override(text, "calibration.dir", f"{TMP}/outputs/calibration/documented")
    if stage == "fit" and not errs and not multirun and not _cpu_trainable(model):
        text = set_override(text, "stage", "plan")
        stage = "plan"
        notes.append(f"planned only: a fit of the paper-size model '{model}' cannot run on this CPU machine "
                     f"(weights of GB per device)")
    # placeholders satisfied by earlier real runs
    if "<date>/<time>" in text:
        prod = _producer(c, ov, earlier, everyone, kind="resume")
        text = re.sub(r"(?<!\S)(resume=)\S*?outputs/runs/<date>/<time>", rf"\1@RUNDIR:{prod.where}@", text)
        text = re.sub(r"\S*?outputs/runs/<date>/<time>", f"@RUNDIR:{prod.where}@", text)
        plan.producers.append(prod.where)
        notes.append(f"resumes the checkpoint of {prod.where}'s 2-step fit")
    if re.search(r"model\.pretrained=<[^>]+>", text):
        prod = _producer(c, ov, earlier, everyone, kind="hf")
        text = re.sub(r"model\.pretrained=<[^>]+>", f"model.pretrained=@RUNDIR:{prod.where}@/hf", text)
        plan.producers.append(prod.where)
        notes.append(f"reads the HF checkpoint exported by {prod.where}'s fit")
    if re.search(r"<[\w /-]+>", text):
        raise Skip("a placeholder no earlier run can satisfy: " + ", ".join(re.findall(r"<[\w /-]+>", text)))
    if stage == "fit" and not errs and not ALL_FITS:
        if force_fit:
            notes.append("a fit: a later documented command uses its output")
        elif multirun:
            points = 1
            for k, v in ov.items():
                if "," in v and not k.startswith("hydra") and not (v.startswith("[") and v.endswith("]")):
                    points *= len(v.split(","))
            text = set_override(text, "stage", "plan")
            stage = "plan"
            notes.append(f"the sweep's {points} points planned (stage=plan): {points} fits are too expensive here "
                         f"(~10 s each); fit sweeps run in tests/test_training.py")
        else:
            other = fit_run_elsewhere(ov)
            if other:
                text = set_override(text, "stage", "plan")
                stage = "plan"
                notes.append(f"planned (stage=plan): {other} runs this fit")
    if stage == "fit":
        steps = 2 * FIT_STEPS if "resume" in ov else FIT_STEPS
        text = set_override(text, "trainer.max_steps", str(steps))
        text = set_override(text, "trainer.progress_bar", "false")
        if not errs:
            notes.append(f"{steps}-step fit" + (" (2 more than the checkpoint)" if "resume" in ov else ""))
        if (ov.get("aggregation") in LIVE_AGGREGATION and "aggregation.payload_k" not in ov
                and "aggregation.switch" not in ov  # a running switch aggregates the payload it was started with
                and ov.get("aggregation.switch_impl", "python") != "bmv2" and not errs):
            text = set_override(text, "aggregation.payload_k", str(LIVE_FIT_PAYLOAD))
            notes.append(f"{LIVE_FIT_PAYLOAD} values a packet (the default 62 is a Tofino frame: the same code, "
                         f"{LIVE_FIT_PAYLOAD // 62}x fewer datagrams, each a Python round trip on loopback)")
    text = set_override(text, "planner.plot", "false")
    if multirun:
        swept = [(k, v) for k, v in ov.items() if "," in v and not k.startswith("hydra")
                 and not (v.startswith("[") and v.endswith("]"))]
        points = 1
        for _, v in swept:
            points *= len(v.split(","))
        if stage == "fit" and points > 2:
            for n, (k, v) in enumerate(swept):
                text = set_override(text, k, ",".join(v.split(",")[:2] if n == 0 else v.split(",")[:1]))
            notes.append(f"sweep shrunk from {points} to 2 fits")
        elif stage == "plan" and not any("planned" in n for n in notes):
            notes.append(f"the whole {points}-point planning sweep")
        plan.run_dir = "sweep"
        plan.checks.append("summary.csv")
    else:
        plan.run_dir = "run"
    if "aggregation.switch_impl=bmv2" in text.replace("'", ""):
        plan.requires.add("bmv2")
    plan.note = "; ".join(notes) or "as documented"
    return text


def _producer(c: DocCommand, ov: Dict[str, str], earlier: Sequence[DocCommand], everyone: Sequence[DocCommand],
              kind: str) -> DocCommand:
    """The documented fit whose output a placeholder of ``c`` stands for."""

    def fit_overrides(d: DocCommand) -> Optional[Dict[str, str]]:
        if _first_word(d.text) not in ("python", "python3") or "train.py" not in d.text.split()[1:2]:
            return None
        if re.search(r"(?<!\S)(-m|--multirun)(?!\S)", d.text) or "<" in d.text or d.expected:
            return None
        o = _overrides(d.text)
        if o.get("trainer.accelerator", "cpu") in ("gpu", "cuda"):
            return None  # a GPU fit skips where there is none: it produces nothing to read
        return o if o.get("stage", "fit") == "fit" else None

    if kind == "resume":
        mine = {k: v for k, v in ov.items() if k not in ("resume", "trainer.max_steps")}
        for d in reversed(earlier):
            o = fit_overrides(d)
            if o is not None and d.doc == c.doc and \
                    all(mine.get(k) == v for k, v in o.items() if k != "trainer.max_steps"):
                return d
        raise Skip("resume=<date>/<time>: no earlier documented fit with the same settings to produce a checkpoint")
    cands = [d for d in list(reversed(earlier)) + list(everyone) if d is not c]
    for d in cands:
        o = fit_overrides(d)
        if o is not None and _is_hf_fit_model(o.get("model", "")) and o.get("trainer.export", "true") == "true":
            return d
    raise Skip("model.pretrained=<dir>: no documented fit of an HF model exports a checkpoint to read")


def plan_command(c: DocCommand, earlier: Sequence[DocCommand] = (), everyone: Sequence[DocCommand] = (),
                 force_fit: bool = False) -> Plan:
    plan = Plan(c, "run")
    try:
        plan.shell = _cheap(c, plan, earlier, everyone, force_fit)
    except Skip as e:
        plan.action, plan.note, plan.shell = "skip", str(e), ""
    return plan


def _cheap(c: DocCommand, plan: Plan, earlier: Sequence[DocCommand], everyone: Sequence[DocCommand],
           force_fit: bool = False) -> str:
    text = c.text.strip()
    if text.endswith("&") and not text.endswith("&&"):
        plan.service = True
        text = text[:-1].rstrip()
    # [--optional flags] are dropped: the base form runs
    text = re.sub(r"\s+\[-[^\]]*\]", "", text)
    if re.search(r"(?<!\S)\.\.\.(?!\S)", text):
        raise Skip("elided ('...') in the docs: not a whole command")
    words = text.split()
    w0 = words[0]
    if w0 in ("pip", "pip3") or (w0 in ("python", "python3") and words[1:3] == ["-m", "pip"]):
        raise Skip("installs packages (set-up; .ci/run does it, the suite runs installed)")
    if w0 in ("bash", "sh") and len(words) > 1 and re.search(r"install[\w-]*\.sh$", words[1]):
        raise Skip("installs the P4 toolchain as root (set-up; .ci/run runs it before the suite)")
    if w0 == "torchrun":
        nn = get_opt(text, "--nnodes")
        if nn and nn.split(":")[-1] != "1":
            raise Skip(f"multi-node torchrun (--nnodes {nn}): needs several hosts")
        raise Skip("torchrun: no cheap-form rule (add one to tests/test_docs_commands.py)")
    if w0 == "pytest" or (w0 in ("python", "python3") and words[1:3] == ["-m", "pytest"]):
        if not any(w.endswith(".py") or w.startswith("tests/") or "::" in w for w in words[1:]):
            raise Skip("the whole suite (this test is part of it): CI runs it (.ci/run)")
        # the suite runs these tests itself: here the command collects them (paths and imports)
        text = set_opt(set_opt(text, "--collect-only"), "-p", "no:cacheprovider")
        plan.note = "collected only (--collect-only): the suite itself runs these tests"
        plan.timeout = 180
        return _finish(text, plan)
    if w0 in ("simple_switch", "simple_switch_CLI"):
        raise Skip(f"{w0} talks to a running BMv2 switch (the replay harness and the live BMv2 switch start "
                   f"and drive it: tests/p4, tests/test_live_aggregation.py)")
    if w0 == "p4test":  # ~10 s of CPU each, the very same lines (asserted there)
        raise Skip("runs in tests/p4/test_compile.py::test_tna_passes_p4test_for_tofino_1_and_2 (these command "
                   "lines, exit 0 and no output)")
    if w0 in ("p4c", "p4c-bm2-ss"):
        plan.requires.add(f"p4:{w0}")
        plan.note = "as documented"
        return _finish(text, plan)
    if w0 in ("python", "python3"):
        if len(words) > 1 and words[1] == "train.py":
            text = _plan_train(c, text, plan, earlier, everyone, force_fit)
            return _finish(text, plan)
        if len(words) > 2 and words[1] == "-m":
            mod = words[2]
        elif len(words) > 1 and words[1].endswith(".py"):
            mod = words[1]
        else:
            raise Skip("not a runnable Python command")
        if re.search(r"<[\w /-]+>", mod):
            raise Skip(f"a pattern ({mod}), not a command: each one's own documented command runs")
        rule = MODULE_RULES.get(mod)
        if rule is None:
            plan.action = "norule"
            plan.note = (f"no cheap-form rule for '{mod}': add one to MODULE_RULES in tests/test_docs_commands.py "
                         f"(its smallest flags; skip only what CI cannot run)")
            return text
        text, plan.note = rule(text)
        plan.requires |= MODULE_NEEDS.get(mod, lambda _t: set())(text)
        if re.search(r"<[\w /-]+>", text):
            raise Skip("a placeholder no earlier run can satisfy: " + ", ".join(re.findall(r"<[\w /-]+>", text)))
        return _finish(text, plan)
    raise Skip(f"'{w0}': not a command this test knows how to run")


def _finish(text: str, plan: Plan) -> str:
    text, plan.home = _redirect_paths(text)
    return text


# ------------------------------------------------------------------------------ the whole table
@dataclass
class Table:
    commands: List[DocCommand]
    files: List[FileBlock]
    plans: List[Plan]
    jobs: Dict[str, Plan]  # slug -> the plan that runs it (its first command)
    order: List[str]  # job slugs in run order (producers first)
    deps: Dict[str, List[str]]  # slug -> slugs that must finish first


def _slug(where: str) -> str:
    return re.sub(r"[^\w.-]+", "_", where)


def _canonical(shell: str) -> str:
    """A cheap form with its options in a canonical order (``--a 1 --b 2`` == ``--b 2 --a 1``)."""
    words = shell.split()
    head = words[:3] if words[:1] and words[0].startswith("python") and words[1:2] == ["-m"] else words[:2]
    rest, units, i = words[len(head):], [], 0
    while i < len(rest):
        if rest[i].startswith("-") and i + 1 < len(rest) and not rest[i + 1].startswith("-") and "=" not in rest[i]:
            units.append(rest[i] + " " + rest[i + 1])
            i += 2
        else:
            units.append(rest[i])
            i += 1
    return " ".join(head + sorted(units))


def build_table(root: Path = ROOT) -> Table:
    cmds, files = discover(root)
    plans: List[Plan] = []
    for i, c in enumerate(cmds):
        plans.append(plan_command(c, cmds[:i], cmds))
    producers = {w for p in plans for w in p.producers}
    producer_texts = {c.text for c in cmds if c.where in producers}
    for i, c in enumerate(cmds):  # a command whose output a later one uses runs as a fit (and its twins)
        if c.text in producer_texts:
            plans[i] = plan_command(c, cmds[:i], cmds, force_fit=True)
    by_where = {p.cmd.where: p for p in plans}
    # background services: their block's later commands that name the service's port run beside it
    for i, p in enumerate(plans):
        if not (p.service and p.action == "run"):
            continue
        m = re.search(r"--(?:control-)?port[ =](\d+)", p.shell)
        if not m:
            continue
        port = m.group(1)
        p.shell = re.sub(rf"(?<!\d){port}(?!\d)", PORT, p.shell)
        for q in plans[i + 1:]:
            if q.cmd.block == p.cmd.block and q.action == "run" and re.search(rf"(?<!\d){port}(?!\d)", q.shell):
                q.shell = re.sub(rf"(?<!\d){port}(?!\d)", PORT, q.shell)
                q.preludes.append(p)
                q.note += f"; beside {p.cmd.where}'s service on a free port"
    # dedupe: equal cheap forms run once
    jobs: Dict[str, Plan] = {}
    seen: Dict[str, Plan] = {}
    for p in plans:
        if p.action != "run":
            continue
        p.key = _canonical(p.shell) + "|" + ",".join(sorted(_canonical(q.shell) for q in p.preludes)) \
            + ("|service" if p.service else "")
        if p.key in seen:
            first = seen[p.key]
            p.action, p.dup_of, p.job = "dup", first.cmd.where, first.job
            p.note = f"same cheap form as {first.cmd.where} (runs once)"
            continue
        seen[p.key] = p
        p.job = _slug(p.cmd.where)
        if p.run_dir == "run":
            p.shell = set_override(p.shell, "hydra.run.dir", f"{TMP}/runs/{p.job}")
        elif p.run_dir == "sweep":
            p.shell = set_override(p.shell, "hydra.sweep.dir", f"{TMP}/sweeps/{p.job}")
        jobs[p.job] = p
    # placeholders naming an earlier command's run -> that command's job
    for p in jobs.values():
        for w in p.producers:
            prod = by_where[w]
            slug = prod.job
            p.shell = p.shell.replace(f"@RUNDIR:{w}@", f"{TMP}/runs/{slug}")
            if prod.action == "skip":
                p.action, p.note = "skip", f"its producer {w} is skipped ({prod.note})"
    jobs = {k: v for k, v in jobs.items() if v.action == "run"}
    # run order: document order, a consumer moved after its producers
    order = list(jobs)
    moved = True
    while moved:
        moved = False
        for slug in list(order):
            p = jobs[slug]
            pos = order.index(slug)
            prods = [order.index(by_where[w].job) for w in p.producers if by_where[w].job in jobs]
            if prods and max(prods) > pos:
                order.remove(slug)
                order.insert(max(prods), slug)
                moved = True
    # dependencies: producers, and the last earlier job touching the same tmp path (or a parent/child of it)
    def resources(p: Plan) -> Set[str]:
        s = p.shell.replace("'", "").replace('"', "")
        if p.home:
            s = re.sub(r"(?<![\w/])~/|\$HOME/|\$\{HOME\}/", f"{TMP}/home/", s)
        return {r.rstrip("/") for r in re.findall(rf"{TMP}/[^\s'\"\],]*", s)}

    res = {slug: resources(jobs[slug]) for slug in order}
    deps: Dict[str, List[str]] = {}
    for i, slug in enumerate(order):
        d = [by_where[w].job for w in jobs[slug].producers if by_where[w].job in jobs]
        for r in res[slug]:
            for prev in reversed(order[:i]):
                if any(r == q or r.startswith(q + "/") or q.startswith(r + "/") for q in res[prev]):
                    d.append(prev)
                    break
        deps[slug] = sorted(set(d) - {slug}, key=order.index)
    return Table(cmds, files, plans, jobs, order, deps)


# ------------------------------------------------------------------------------ what this machine has
_AVAIL: Dict[str, str] = {}


def missing(requirement: str) -> str:
    """Why ``requirement`` is not met here, or ``""``."""
    if requirement not in _AVAIL:
        why = ""
        if requirement == "cuda":
            try:
                import torch
                ok = torch.cuda.is_available()
            except Exception:  # pragma: no cover
                ok = False
            why = "" if ok else "needs a CUDA GPU (none here)"
        elif requirement == "bmv2":
            from atp_pipeline.ina.p4 import toolchain as tc
            why = tc.why_missing()
            if not why and os.geteuid() != 0:
                why = "BMv2 (simple_switch) runs in a network namespace of its own: needs root"
        elif requirement.startswith("p4:"):
            from atp_pipeline.ina.p4 import toolchain as tc
            why = tc.why_missing([requirement[3:]])
        _AVAIL[requirement] = why
    return _AVAIL[requirement]


def why_not_here(p: Plan) -> str:
    reqs = set(p.requires)
    for q in p.preludes:
        reqs |= q.requires
    return "; ".join(w for w in (missing(r) for r in sorted(reqs)) if w)


# ------------------------------------------------------------------------------ running
@dataclass
class Result:
    ok: bool
    rc: Optional[int]
    output: str
    seconds: float
    command: str
    problem: str = ""  # why it failed, one line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    """Runs the jobs of a table, ``jobs`` at a time, each after its dependencies."""

    def __init__(self, table: Table, tmp: Path, jobs: int = 2):
        self.table, self.tmp, self.n = table, tmp, max(1, jobs)
        self.results: Dict[str, Result] = {}
        self.wanted: List[str] = []
        self.started: Set[str] = set()
        self.cv = threading.Condition()
        self.procs: Set[subprocess.Popen] = set()
        self.closed = False
        self.threads: List[threading.Thread] = []
        self._zygote: Optional[Zygote] = None
        self._zygote_failed = not ZYGOTE
        (tmp / "home").mkdir(parents=True, exist_ok=True)
        (tmp / "scratch").mkdir(parents=True, exist_ok=True)
        (tmp / "outputs").mkdir(parents=True, exist_ok=True)
        for f in table.files:  # documented files the commands read (~/myconf/topology/theirs.yaml)
            dest = Path(re.sub(r"^~/", str(tmp / "home") + "/", f.path))
            if not dest.is_absolute():
                dest = tmp / "scratch" / dest
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.content, encoding="utf-8")

    # -- scheduling
    def start(self, slugs: Sequence[str]) -> None:
        need: List[str] = []

        def add(s: str) -> None:
            if s in need:
                return
            for d in self.table.deps[s]:
                add(d)
            need.append(s)

        for s in slugs:
            add(s)
        with self.cv:
            need += self.wanted
            self.wanted = [s for s in self.table.order if s in need]
            self.threads = [t for t in self.threads if t.is_alive()]
            missing_threads = self.n - len(self.threads)
            self.cv.notify_all()
        for _ in range(missing_threads):
            t = threading.Thread(target=self._worker, daemon=True)
            t.start()
            self.threads.append(t)

    def _next(self) -> Optional[str]:
        with self.cv:
            while True:
                if self.closed:
                    return None
                pending = [s for s in self.wanted if s not in self.started]
                if not pending:
                    return None
                for s in pending:
                    if all(d in self.results for d in self.table.deps[s]):
                        self.started.add(s)
                        return s
                self.cv.wait()

    def _worker(self) -> None:
        while True:
            s = self._next()
            if s is None:
                return
            try:
                r = self._run_job(s)
            except Exception as e:  # pragma: no cover - a bug of this file, reported as the job's failure
                r = Result(False, None, repr(e), 0.0, s, f"runner error: {e!r}")
            with self.cv:
                self.results[s] = r
                self.cv.notify_all()

    def result(self, slug: str) -> Result:
        if slug not in self.wanted:
            self.start([slug])  # a command selected alone (pytest -k) with the runner already going
        with self.cv:
            while slug not in self.results:
                if self.closed:
                    raise RuntimeError("runner closed")
                self.cv.wait(timeout=1.0)
            return self.results[slug]

    def close(self) -> None:
        with self.cv:
            if self.results:  # <tmp>/logs/timings.txt: each job's seconds, longest first
                rows = sorted(self.results.items(), key=lambda kv: -kv[1].seconds)
                (self.tmp / "logs").mkdir(exist_ok=True)
                (self.tmp / "logs" / "timings.txt").write_text("".join(
                    f"{r.seconds:7.1f} s  {'ok ' if r.ok else 'BAD'}  {slug}  {r.problem}\n" for slug, r in rows))
            self.closed = True
            self.cv.notify_all()
            procs = list(self.procs)
        for p in procs:
            self._kill(p)
        for t in self.threads:
            t.join(timeout=10)
        if self._zygote is not None:
            self._zygote.close()

    # -- one job
    def concrete(self, shell: str, port: Optional[int]) -> str:
        s = shell.replace(TMP, str(self.tmp))
        return s.replace(PORT, str(port)) if port is not None else s

    def env(self, p: Optional[Plan] = None) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTEST_CURRENT_TEST")}
        path = [str(Path(sys.executable).parent)]
        try:
            from atp_pipeline.ina.p4 import toolchain as tc
            if (tc.prefix() / "bin").is_dir():
                path.append(str(tc.prefix() / "bin"))
        except Exception:  # pragma: no cover
            pass
        env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
        env["MPLBACKEND"] = "Agg"
        if p is not None and (p.home or any(q.home for q in p.preludes)):
            real = Path.home()
            env.setdefault("XDG_CACHE_HOME", str(real / ".cache"))
            env.setdefault("MPLCONFIGDIR", str(real / ".config" / "matplotlib"))
            env["HOME"] = str(self.tmp / "home")
        return env

    def zygote(self) -> Optional[Zygote]:
        """The warm interpreter plain ``python`` commands fork from (:mod:`tests.zygote`), started on
        first use; ``None`` with ``ATP_DOCS_ZYGOTE=0`` or where it did not start (bash runs all)."""
        with self.cv:
            if self._zygote is None and not self._zygote_failed and not self.closed:
                try:
                    self._zygote = Zygote(self.env(), ROOT)
                except (RuntimeError, OSError):
                    self._zygote_failed = True
            return self._zygote

    def _start(self, p: Plan, cmd: str, log: Path, out) -> Any:
        """Start the job's command: forked from the zygote when it is a plain ``python`` command
        with the runner's environment (no ``HOME`` of its own), else ``bash -c``."""
        argv = None if p.home else argv_of(cmd)
        z = self.zygote() if argv else None
        if z is not None and argv is not None:
            try:
                child = z.start(argv, ROOT, self.env(p), log)
            except RuntimeError:
                child = None
            if child is not None:
                with self.cv:
                    self.procs.add(child)
                return child
        return self._popen(cmd, self.env(p), out)

    def _popen(self, cmd: str, env: Dict[str, str], out) -> subprocess.Popen:
        p = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        with self.cv:
            self.procs.add(p)
        return p

    def _kill(self, p: subprocess.Popen) -> None:
        """Stop the process group this runner started for ``p`` (TERM, then KILL)."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait(timeout=10)
        with self.cv:
            self.procs.discard(p)

    def _start_service(self, p: Plan, port: Optional[int], log: Path) -> Tuple[Optional[subprocess.Popen], str]:
        """Start a background command; ready when it prints its first line."""
        cmd = self.concrete(p.shell, port)
        fh = open(log, "w")
        proc = self._popen(cmd, self.env(p), fh)
        deadline = time.time() + 60
        while time.time() < deadline:
            if log.stat().st_size > 0 and "\n" in log.read_text(errors="replace"):
                break
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        fh.flush()
        if proc.poll() is not None:
            return None, f"the background command exited ({proc.returncode}) before it was ready"
        if log.stat().st_size == 0:
            self._kill(proc)
            return None, "the background command printed nothing within 60 s"
        return proc, ""

    def _run_job(self, slug: str) -> Result:
        p = self.table.jobs[slug]
        failed = [d for d in self.table.deps[slug] if not self.results[d].ok]
        port = _free_port() if PORT in p.shell or any(PORT in q.shell for q in p.preludes) else None
        cmd = self.concrete(p.shell, port)
        if failed:
            names = ", ".join(self.table.jobs[d].cmd.where for d in failed)
            return Result(False, None, "", 0.0, cmd, f"a command it depends on failed: {names}")
        why = why_not_here(p)
        if why:
            return Result(True, None, "", 0.0, cmd, f"skip: {why}")
        logs = self.tmp / "logs"
        logs.mkdir(exist_ok=True)
        t0 = time.time()
        services: List[subprocess.Popen] = []
        try:
            for q in p.preludes:
                proc, err = self._start_service(q, port, logs / f"{slug}.service.log")
                if proc is None:
                    return Result(False, None, (logs / f"{slug}.service.log").read_text(errors="replace"),
                                  time.time() - t0, cmd, f"its service {q.cmd.where} did not start: {err}")
                services.append(proc)
            if p.service:
                proc, err = self._start_service(p, port, logs / f"{slug}.log")
                out = (logs / f"{slug}.log").read_text(errors="replace")
                if proc is None:
                    return Result(False, None, out, time.time() - t0, cmd, err)
                self._kill(proc)
                return Result(True, 0, out, time.time() - t0, cmd)
            with open(logs / f"{slug}.log", "w") as fh:
                proc = self._start(p, cmd, logs / f"{slug}.log", fh)
                try:
                    rc = proc.wait(timeout=p.timeout)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    self._kill(proc)
                    rc, timed_out = proc.returncode, True
                with self.cv:
                    self.procs.discard(proc)
            out = (logs / f"{slug}.log").read_text(errors="replace")
            secs = time.time() - t0
            if timed_out:
                return Result(False, rc, out, secs, cmd, f"timed out after {p.timeout:.0f} s")
            if self.closed:
                return Result(False, rc, out, secs, cmd, "interrupted")
            return self._judge(p, rc, out, secs, cmd)
        finally:
            for s in services:
                self._kill(s)

    def _judge(self, p: Plan, rc: int, out: str, secs: float, cmd: str) -> Result:
        c = p.cmd
        norm = " ".join(out.split())
        if c.expected:
            missing_lines = [e for e in c.expected if " ".join(e.split()) not in norm]
            wants_error = any(e.startswith("error") for e in c.expected)
            if wants_error and rc == 0:
                return Result(False, rc, out, secs, cmd, "documented to fail (its output is an error), but exit 0")
            if not wants_error and rc != 0:
                return Result(False, rc, out, secs, cmd, f"exit status {rc}")
            if missing_lines:
                return Result(False, rc, out, secs, cmd, f"documented output not printed: {missing_lines[0]!r}")
            return Result(True, rc, out, secs, cmd)
        if c.fails:  # its sentence says it is refused: one `error:` line and a failing exit status
            if rc == 0:
                return Result(False, rc, out, secs, cmd, "documented to be refused, but exit 0")
            if not any(line.startswith("error:") for line in out.splitlines()):
                return Result(False, rc, out, secs, cmd, f"exit status {rc} without an 'error:' line")
            return Result(True, rc, out, secs, cmd)
        if rc != 0:
            return Result(False, rc, out, secs, cmd, f"exit status {rc}")
        if c.quiet and out.strip():
            return Result(False, rc, out, secs, cmd, f"documented to print nothing, printed {out.strip()[:200]!r}")
        if p.checks:
            base = self.tmp / ("sweeps" if p.run_dir == "sweep" else "runs") / p.job
            gone = [f for f in p.checks if not (base / f).exists()]
            if gone:
                return Result(False, rc, out, secs, cmd, f"did not write {', '.join(gone)} in {base}")
        return Result(True, rc, out, secs, cmd)


# ------------------------------------------------------------------------------ the table as text
def describe(table: Table, tmp: str = "$TMP") -> str:
    rows = []
    counts: Dict[str, int] = {}
    for p in table.plans:
        if p.action == "run":
            why = why_not_here(table.jobs[p.job]) if p.job in table.jobs else ""
            status = "SKIP" if why else "RUN"
            detail = why if why else f"{p.shell.replace(TMP, tmp)}\n      ({p.note}" + \
                ("; documented to be refused: must exit non-zero with an 'error:' line" if p.cmd.fails else "") + \
                (f"; must print its documented output ({len(p.cmd.expected)} line(s))" if p.cmd.expected else "") + ")"
            if p.preludes and not why:
                detail += "".join(f"\n      beside: {q.shell.replace(TMP, tmp)} &" for q in p.preludes)
        elif p.action == "dup":
            status, detail = "DUP", p.note
        elif p.action == "norule":
            status, detail = "NORULE", p.note
        else:
            status, detail = "SKIP", p.note
        counts[status] = counts.get(status, 0) + 1
        rows.append(f"{p.cmd.where:<22} {status:<6} {p.cmd.text}\n      -> {detail}")
    head = (f"{len(table.commands)} documented commands in {len({c.doc for c in table.commands})} documents: "
            + ", ".join(f"{v} {k.lower()}" for k, v in sorted(counts.items()))
            + f"; {len(table.jobs)} distinct runs")
    return head + "\n\n" + "\n".join(rows)


# ------------------------------------------------------------------------------ pytest
TABLE = build_table()


def _id(p: Plan) -> str:
    short = re.sub(r"[^\w.:=,/+-]+", "_", p.cmd.text)[:70]
    return f"{p.cmd.where} {short}"


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs_commands")
    r = Runner(TABLE, tmp, int(os.environ.get("ATP_DOCS_JOBS", "2")))
    # start every selected command's job now, so they run ATP_DOCS_JOBS at a time
    selected = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if item.module is sys.modules[__name__] and cs is not None and "plan" in cs.params:
            p = cs.params["plan"]
            if p.job in TABLE.jobs:
                selected.append(p.job)
    r.start(selected)
    yield r
    r.close()


def test_discovers_the_documented_commands():
    """Discovery works: the docs' commands are found (a floor), in every kind of block."""
    cmds = TABLE.commands
    assert len(cmds) >= MIN_COMMANDS, describe(TABLE)
    docs = {c.doc for c in cmds}
    assert "README.md" in docs and any(d.startswith("p4/") for d in docs), docs
    assert {c.kind for c in cmds} >= {"fenced", "indented", "inline"}
    texts = [c.text for c in cmds]
    assert sum(t.startswith("python train.py") for t in texts) >= 20
    assert any("stage=plan" in t for t in texts) and any(t.startswith("python -m benchmarks.") for t in texts)
    assert any(c.expected for c in cmds), "the console block's documented outputs"
    assert len(TABLE.jobs) >= 40, describe(TABLE)


def test_rules_behave(monkeypatch, tmp_path):
    """The generic rules on made-up commands (independent of today's docs)."""
    (tmp_path / "X.md").write_text(
        "Run `python train.py topology=x` here; `python train.py mesh=9x9`\nrefuses it (no 81 devices).\n\n"
        "```bash\npython -m benchmarks.a \\\n    --b 1   # note\npip install x && python train.py stage=plan\n```\n\n"
        "```\n$ python train.py topology=y\nerror: unknown topology 'y'\n```\n\n## Head\n    python -m m.n --k 2\n"
        "    not a command line\n")
    found, _ = extract(tmp_path / "X.md", tmp_path)
    assert [(c.text, c.kind, c.fails, c.expected, c.part) for c in found] == [
        ("python -m benchmarks.a --b 1", "fenced", False, [], 0),
        ("pip install x", "fenced", False, [], 1), ("python train.py stage=plan", "fenced", False, [], 2),
        ("python train.py topology=y", "fenced", False, ["error: unknown topology 'y'"], 0),
        ("python -m m.n --k 2", "indented", False, [], 0),
        ("python train.py topology=x", "inline", False, [], 0), ("python train.py mesh=9x9", "inline", True, [], 0)]
    c = DocCommand("X.md", 1, "python train.py -m mesh=4x1,2x2,1x4 overlap=chunk1,chunk2 trainer.max_steps=300",
                   "X.md:1", "fenced")
    p = plan_command(c)  # a fit sweep plans all its points
    assert "mesh=4x1,2x2,1x4 " in p.shell and "stage=plan" in p.shell
    assert p.run_dir == "sweep" and p.checks == ["summary.csv"]
    monkeypatch.setattr(sys.modules[__name__], "ALL_FITS", True)  # ATP_DOCS_ALL_FITS=1: two 2-step fits
    p = plan_command(c)
    assert "mesh=4x1,2x2 " in p.shell + " " and "overlap=chunk1 " in p.shell + " " and "trainer.max_steps=2" in p.shell
    assert "stage=plan" not in p.shell
    monkeypatch.setattr(sys.modules[__name__], "ALL_FITS", False)
    p = plan_command(DocCommand("X.md", 1, "python train.py topology=ic4 model=m3", "X.md:1", "fenced"))
    assert "stage=plan" in p.shell and "paper-size" in p.note
    p = plan_command(DocCommand("X.md", 1, "python train.py trainer.accelerator=gpu", "X.md:1", "fenced"))
    assert "cuda" in p.requires
    p = plan_command(DocCommand("X.md", 1, "python -m benchmarks.nosuch --x 1", "X.md:1", "fenced"))
    assert p.action == "norule"
    p = plan_command(DocCommand("X.md", 1, "pip install -e .", "X.md:1", "fenced"))
    assert p.action == "skip"
    p = plan_command(DocCommand("X.md", 1, "python -m atp_pipeline.ina.p4.control --out plan.json "
                                           "--topology conf/topology/fig7a.yaml", "X.md:1", "fenced"))
    assert f"--out {TMP}/scratch/plan.json" in p.shell and "conf/topology/fig7a.yaml" in p.shell
    t, _ = _redirect_paths("python train.py 'hydra.searchpath=[atpmesh://,file://'$PWD'/outputs/conf]' x=outputs/a")
    assert t == f"python train.py 'hydra.searchpath=[atpmesh://,file://'{TMP}'/outputs/conf]' x={TMP}/outputs/a"
    assert strip_comment("python a.py --x '#1'   # note") == "python a.py --x '#1'"
    assert split_chain("pip install -e . && python train.py") == ["pip install -e .", "python train.py"]


def test_zygote_children_behave_as_python(tmp_path):
    """A command forked from the docs zygote is what ``python <argv>`` would be: its argv, cwd,
    environment and ``sys.path[0]``, its output in its log, its exit status (``SystemExit``, 1 after
    an uncaught exception with its traceback — in a file of its own where asked —, ``-15`` when the
    runner's ``killpg`` stops it), atexit
    handlers run; its launches fork ranks from the zygote's fork server, which get its environment,
    cwd and log, and end when it is killed; commands with shell syntax go to bash."""
    assert argv_of("python train.py stage=plan 'hydra.searchpath=[file:///x]'") == [
        "train.py", "stage=plan", "hydra.searchpath=[file:///x]"]
    assert argv_of("python -m benchmarks.x --out /tmp/y") == ["-m", "benchmarks.x", "--out", "/tmp/y"]
    for shell in ("python train.py > log", "python train.py x=$HOME", "python a.py mesh=[1]", "pip install x",
                  "python -c 'print(1)'", "python -m"):
        assert argv_of(shell) is None, shell
    script = tmp_path / "probe.py"
    script.write_text("import atexit, os, sys, time\natexit.register(print, 'bye')\n"
                      "print(sys.argv, os.getcwd(), os.environ['PROBE'], sys.path[0], __name__)\n"
                      "if sys.argv[1] == 'sleep': time.sleep(60)\n"
                      "if sys.argv[1] == 'boom': raise ValueError('boom')\nsys.exit(int(sys.argv[1]))\n")
    # a launch forks its ranks from the zygote's fork server, with the child's environment, cwd and
    # log; a run refused after prestart() leaves that server running
    ranks = tmp_path / "ranks.py"
    ranks.write_text("import os\nfrom multiprocessing import forkserver\n"
                     "from atp_pipeline.launch import prestart, spawn, stop_prestarted\n"
                     "def fn(rank, world):\n"
                     "    os.write(1, f'rank {rank} {os.getcwd()} {os.environ[\"PROBE\"]}\\n'.encode())\n"
                     "    return os.getppid()\n"
                     "if __name__ == '__main__':\n"
                     "    prestart(); stop_prestarted()\n"
                     "    parents = spawn(fn, 2)\n"
                     "    print('SERVER', forkserver._forkserver._forkserver_pid, sorted(set(parents)))\n")
    # a launcher killed outright takes its ranks with it, though they are the zygote's server's
    # children, which outlives it (launch._die_with)
    orphans = tmp_path / "orphans.py"
    orphans.write_text("import os, sys, time\nfrom atp_pipeline.launch import spawn\n"
                       "def fn(rank, world, d):\n"
                       "    open(os.path.join(d, f'{rank}.pid'), 'w').write(str(os.getpid()))\n"
                       "    time.sleep(300)\n"
                       "if __name__ == '__main__':\n"
                       "    spawn(fn, 2, sys.argv[1], init=False)\n")
    env = {**os.environ, "PROBE": "p1"}
    z = Zygote(env, ROOT)
    try:
        launcher = z.start([str(orphans), str(tmp_path)], tmp_path, env, tmp_path / "orphans.log")
        pids = [tmp_path / f"{r}.pid" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks_ = [int(f.read_text()) for f in pids]
        os.killpg(launcher.pid, signal.SIGKILL)
        assert launcher.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while any(running(p) for p in ranks_) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(p) for p in ranks_), f"ranks {ranks_} outlived their killed launcher"
        logs = {a: tmp_path / f"{a}.log" for a in ("3", "boom", "sleep", "ranks")}
        err = tmp_path / "boom.err"  # stderr apart from stdout (tests/conftest.py's train.py runs)
        kids = {a: z.start([str(script), a] if a != "ranks" else [str(ranks)], tmp_path, env, logs[a],
                           err if a == "boom" else None) for a in logs}
        assert kids["3"].wait(timeout=60) == 3 and kids["boom"].wait(timeout=60) == 1
        assert kids["sleep"].poll() is None
        os.killpg(kids["sleep"].pid, signal.SIGTERM)
        assert kids["sleep"].wait(timeout=60) == -signal.SIGTERM
        out = logs["3"].read_text()
        assert out == f"{[str(script), '3']} {tmp_path} p1 {tmp_path} __main__\nbye\n", out
        assert "ValueError: boom" in err.read_text() and "Traceback" not in logs["boom"].read_text()
        assert logs["boom"].read_text().endswith("__main__\nbye\n"), logs["boom"].read_text()
        assert kids["ranks"].wait(timeout=300) == 0, logs["ranks"].read_text()[-3000:]
        lines = logs["ranks"].read_text().splitlines()
        assert sorted(ln for ln in lines if ln.startswith("rank")) == [f"rank {r} {tmp_path} p1" for r in (0, 1)], lines
        server = int(lines[-1].split()[1])
        assert lines[-1] == f"SERVER {server} [{server}]", lines  # both ranks forked from it
        ppid = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid == z.proc.pid, "the ranks' fork server is the zygote's (started once, kept running)"
    finally:
        z.close()
    assert z.proc.returncode == 0


def test_every_command_has_a_rule():
    """A command no rule knows fails here (decide its cheap form; don't run it at full size)."""
    bad = [f"{p.cmd.where}: {p.cmd.text} -- {p.note}" for p in TABLE.plans if p.action == "norule"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("plan", TABLE.plans, ids=[_id(p) for p in TABLE.plans])
def test_documented_command(plan: Plan, runner: Runner):
    c = plan.cmd
    if plan.action == "skip":
        pytest.skip(f"{c.where}: {plan.note}")
    if plan.action == "norule":
        pytest.fail(plan.note)
    res = runner.result(plan.job)
    if res.ok and res.problem.startswith("skip: "):
        pytest.skip(f"{c.where}: {res.problem[6:]}")
    if not res.ok:
        tail = "\n".join(res.output.rstrip().splitlines()[-30:])
        dup = f" (the run of {plan.dup_of}, same cheap form)" if plan.dup_of else ""
        pytest.fail(f"{c.where}: documented command failed{dup}: {res.problem}\n"
                    f"  documented: {c.text}\n  ran:        {res.command}\n"
                    f"  after {res.seconds:.1f} s; last lines of its output:\n{tail}", pytrace=False)


# ------------------------------------------------------------------------------ python -m tests.test_docs_commands
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.test_docs_commands", description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print every documented command and what runs for it")
    ap.parse_args(argv)
    try:
        print(describe(TABLE))  # --list is the only action
    except BrokenPipeError:  # | head
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
