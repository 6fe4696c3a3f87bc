"""Every relative link in the documentation resolves, and so does every source path it names.

In-process and instant: the documents of :func:`tests.test_docs_commands.doc_files`
(``README.md``, ``docs/**/*.md``, ``p4/README.md``). A Markdown link ``[text](target)`` outside
code must name an existing file or directory (relative to the document), and its ``#anchor``
a heading of the target (GitHub's slugs). A code span that names a repository file by its path
(``atp_pipeline/planning/steptime.py``, ``models/hf/layout.py``, ``tests/data/step_calibration.yaml``)
must name one that exists, relative to the repository, the package or the document. ``docs/``
holds documentation only: pages, the figures they show and small result files they cite.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

from tests.test_docs_commands import ROOT, doc_files

_FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
#: a code span naming a file of the repository: dirs/name.ext (no placeholders, globs or outputs)
_PATH = re.compile(r"^(?:\.\./)?[\w.-]+(?:/[\w.-]+)+\.(?:py|md|yaml|yml|json|csv|png|p4|jsonl|txt|toml|log)$")
_NOT_IN_REPO = ("outputs/", "/", "~", "http")


def prose_lines(path: Path) -> Iterator[Tuple[int, str]]:
    """``(line number, text)`` of the lines outside fenced code blocks."""
    fence = ""
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if m and (not fence or m.group(1).startswith(fence)):
            fence = "" if fence else m.group(1)[:3]
            continue
        if not fence:
            yield no, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (letters, digits, ``_``
    and ``-`` kept), spaces to ``-``."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path, cache: Dict[Path, Set[str]]) -> Set[str]:
    if path not in cache:
        seen: Dict[str, int] = {}
        out: Set[str] = set()
        for _, line in prose_lines(path):
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                out.add(s if n == 0 else f"{s}-{n}")
        cache[path] = out
    return cache[path]


def links(path: Path) -> Iterator[Tuple[int, str]]:
    for no, line in prose_lines(path):
        stripped = _CODE_SPAN.sub("", line)
        for m in _LINK.finditer(stripped):
            yield no, m.group(1)


def broken_links(files: List[Path]) -> Tuple[int, List[str]]:
    checked, bad = 0, []
    cache: Dict[Path, Set[str]] = {}
    for doc in files:
        rel = doc.relative_to(ROOT)
        for no, target in links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                bad.append(f"{rel}:{no}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest, cache):
                bad.append(f"{rel}:{no}: {target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    return checked, bad


def missing_paths(files: List[Path]) -> Tuple[int, List[str]]:
    """Code spans naming a path whose first directory is one of ours (the repository's, the
    package's or the document's: not another project's ``tensor_parallel/random.py``)."""
    checked, bad = 0, []
    bases = [ROOT, ROOT / "atp_pipeline"]
    for doc in files:
        rel = doc.relative_to(ROOT)
        for no, line in prose_lines(doc):
            for m in _CODE_SPAN.finditer(_LINK.sub("", line)):  # a link's text is the link's
                span = m.group(1).split("::")[0].strip()
                if not _PATH.match(span) or span.startswith(_NOT_IN_REPO):
                    continue
                first = span.split("/")[0]
                if not any((b / first).is_dir() for b in [doc.parent, *bases]):
                    continue
                checked += 1
                if not any((b / span).exists() for b in [doc.parent, *bases]):
                    bad.append(f"{rel}:{no}: `{span}` names no file of the repository")
    return checked, bad


def test_every_relative_link_and_anchor_resolves():
    checked, bad = broken_links(doc_files())
    assert checked >= 50, f"only {checked} links found: the extraction is broken"
    assert not bad, "\n".join(bad)


def test_every_source_path_the_docs_name_exists():
    checked, bad = missing_paths(doc_files())
    assert checked >= 50, f"only {checked} paths found: the extraction is broken"
    assert not bad, "\n".join(bad)


#: what docs/ may hold: pages, the figures they show, small result files (JSON/CSV) they cite
DOCS_SUFFIXES = {".md", ".png", ".json", ".csv"}
DOCS_MAX_BYTES = 5 * 2**20
DOCS_MAX_FILE_BYTES = 2**20


def test_docs_hold_documentation_only():
    """Research data (logs, scripts, patches, per-run directories) lives outside the tree; experiments
    write to ``outputs/``."""
    files = [f for f in (ROOT / "docs").rglob("*") if f.is_file()]
    odd = [str(f.relative_to(ROOT)) for f in files if f.suffix not in DOCS_SUFFIXES]
    assert not odd, f"not documentation ({', '.join(sorted(DOCS_SUFFIXES))}): {odd}"
    big = [f"{f.relative_to(ROOT)} ({f.stat().st_size} B)" for f in files if f.stat().st_size > DOCS_MAX_FILE_BYTES]
    assert not big, f"files over {DOCS_MAX_FILE_BYTES} B in docs/: {big}"
    total = sum(f.stat().st_size for f in files)
    assert total <= DOCS_MAX_BYTES, f"docs/ holds {total} B, over {DOCS_MAX_BYTES}"


def test_slugs_follow_github():
    assert slug("Calibrating α and β on your machine (§3.2)") == "calibrating-α-and-β-on-your-machine-32"
    assert slug("Live in-network aggregation (`aggregation=atp`, `atp_pipeline.ina.live`)") == \
        "live-in-network-aggregation-aggregationatp-atp_pipelineinalive"
    assert slug("Config groups (`conf/`)") == "config-groups-conf"


if __name__ == "__main__":
    for name, (n, bad) in (("links", broken_links(doc_files())), ("paths", missing_paths(doc_files()))):
        print(f"{n} {name} checked, {len(bad)} broken")
        print("\n".join(bad))
