"""Import-layering contract for ``atp_pipeline``, checked statically (``ast``; nothing is imported).

Layers, lowest first; a module may depend only on its own layer or lower ones::

    errors / config / topology  <  planning  <  parallel  <  models  <  ina
        <  lightning  <  run (run/, training, pipeline, cli, sweep, launch)

Every import counts: top level, in functions/classes, under ``if TYPE_CHECKING``, and
``importlib.import_module("literal")``.  Relative imports are resolved; ``from X import Y`` imports
``X.Y`` if that is a module, else ``X``; ``import a.b.c`` is an edge to ``a.b.c`` only (none to the
parent ``__init__``s).  "Imports P" means the target is P or P.*.  Rules:

1. no import cycle among ``atp_pipeline`` modules (lazy imports included);
2. ``planning/`` imports no torch/hydra/Lightning/transformers, nothing of the layers above it;
3. ``parallel/`` imports no models, lightning, run layer, or hydra;
4. Lightning is imported only in ``lightning/`` and ``run/``; hydra only in ``config/mesh_source``,
   ``cli``, ``sweep``, ``run/`` and, inside a function body only, ``config/schema``;
5. ``atp_pipeline/__init__.py`` imports only the standard library outside function bodies;
6. ``planning/``, ``parallel/``, ``lightning/`` never name the built-in GPT: no import of ``models.gpt``
   (of ``models`` at all for planning/parallel), no identifier matching ``(?i)gpt``, no non-docstring
   string containing it (docstrings and comments may mention GPT as prose).

``test_selftest_*`` runs each checker on a synthetic package that breaks every rule.
"""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import pytest

PKG = "atp_pipeline"
PKG_DIR = Path(__file__).resolve().parents[1] / PKG
GPT = re.compile(r"(?i)gpt")
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric")
BANNED: Dict[str, Tuple[str, ...]] = {  # rules 2 and 3: scope -> forbidden import prefixes
    "planning": ("torch", "hydra", *LIGHTNING, "transformers") + tuple(f"{PKG}.{m}" for m in (
        "parallel", "ina", "models", "lightning", "run", "training", "pipeline", "launch", "cli",
        "sweep", "config.mesh_source")),
    "parallel": ("hydra",) + tuple(f"{PKG}.{m}" for m in (
        "models", "lightning", "run", "training", "pipeline", "cli", "sweep")),
}


@dataclass(frozen=True)
class Source:
    name: str  # dotted module name
    path: str  # as shown in messages
    is_pkg: bool  # an __init__.py
    text: str


@dataclass(frozen=True)
class Import:
    src: Source
    target: str  # resolved dotted name of the imported module
    line: int
    stmt: str  # the statement, as written
    in_function: bool  # inside a def/lambda body: not executed when the module is imported

    def __str__(self) -> str:
        return f"{self.src.path}:{self.line}: {self.src.name} imports {self.target} ({self.stmt})"


Graph = Mapping[str, List[Import]]  # module -> its imports


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def load_sources(files: Mapping[str, str]) -> Dict[str, Source]:
    """``{"atp_pipeline/x/y.py": text}`` -> ``{"atp_pipeline.x.y": Source}``."""
    mods = [(path[: -len(".py")].split("/"), path, text) for path, text in files.items()]
    srcs = [Source(".".join(p[:-1] if p[-1] == "__init__" else p), path, p[-1] == "__init__", text)
            for p, path, text in mods]
    return {s.name: s for s in srcs}


def resolve(src: Source, module: Optional[str], level: int) -> str:
    if level == 0:
        return module or ""
    pkg = src.name.split(".") if src.is_pkg else src.name.split(".")[:-1]
    return ".".join(pkg[: len(pkg) - (level - 1)] + ([module] if module else []))


def imports_of(src: Source, known: Set[str]) -> List[Import]:
    tree = ast.parse(src.text, filename=src.path)
    out: List[Import] = []
    lazy = {id(x) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for b in (f.body if isinstance(f.body, list) else [f.body]) for x in ast.walk(b)}  # runs when called
    for n in ast.walk(tree):
        in_fn = id(n) in lazy
        if isinstance(n, ast.Import):
            out += [Import(src, a.name, n.lineno, f"import {a.name}", in_fn) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = resolve(src, n.module, n.level)
            by_target: Dict[str, List[str]] = {}  # resolved target -> names imported from it
            for a in n.names:
                by_target.setdefault(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, []).append(a.name)
            out += [Import(src, t, n.lineno, f"from {'.' * n.level}{n.module or ''} import {', '.join(names)}",
                           in_fn) for t, names in by_target.items()]
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant) \
                and isinstance(lit := n.args[0].value, str) \
                and (fn := getattr(n.func, "attr", getattr(n.func, "id", ""))) in ("import_module", "__import__"):
            rel = len(lit) - len(lit.lstrip("."))
            target = resolve(src, lit[rel:] or None, rel) if rel else lit
            out.append(Import(src, target, n.lineno, f"{fn}({lit!r})", in_fn))
    return sorted(out, key=lambda i: i.line)


def collect_imports(sources: Mapping[str, Source]) -> Dict[str, List[Import]]:
    return {name: imports_of(src, set(sources)) for name, src in sources.items()}


def check_cycles(imports: Graph) -> List[str]:
    """Rule 1: DFS over the module graph; each back edge closes one cycle, reported as its path."""
    edge = {(m, i.target): i for m, imps in imports.items() for i in reversed(imps)  # first import wins
            if i.target in imports and i.target != m}
    graph = {m: sorted({b for a, b in edge if a == m}) for m in imports}
    done: Set[str] = set()
    path: List[str] = []
    out: List[str] = []

    def dfs(v: str) -> None:
        path.append(v)
        for w in graph[v]:
            if w in path:  # back edge: path[w:] + w is a cycle
                cyc = path[path.index(w):] + [w]
                how = "; ".join(str(edge[x, y]) for x, y in zip(cyc, cyc[1:]))
                out.append(f"cycle {' -> '.join(cyc)}  [{how}]")
            elif w not in done:
                dfs(w)
        path.pop()
        done.add(v)

    for v in sorted(graph):
        if v not in done:
            dfs(v)
    return out


def check_banned(imports: Graph, scope: str, banned: Sequence[str]) -> List[str]:
    """Rules 2, 3 (and 6's import part): nothing under ``atp_pipeline.<scope>`` imports ``banned``."""
    return [str(i) for m, imps in sorted(imports.items()) if under(m, f"{PKG}.{scope}")
            for i in imps if any(under(i.target, b) for b in banned)]


def check_only_in(imports: Graph, libs: Sequence[str], ok: Callable[[Import], bool]) -> List[str]:
    """Rule 4: imports of ``libs`` occur only where ``ok(import)`` holds."""
    return [str(i) for _, imps in sorted(imports.items()) for i in imps
            if any(under(i.target, lib) for lib in libs) and not ok(i)]


CONFINED: Dict[str, Tuple[Tuple[str, ...], Callable[[Import], bool]]] = {
    "lightning": (LIGHTNING, lambda i: under(i.src.name, f"{PKG}.lightning") or under(i.src.name, f"{PKG}.run")),
    "hydra": (("hydra",), lambda i: i.src.name in (f"{PKG}.config.mesh_source", f"{PKG}.cli", f"{PKG}.sweep")
              or under(i.src.name, f"{PKG}.run") or (i.src.name == f"{PKG}.config.schema" and i.in_function)),
}


def check_init_stdlib(imports: Graph) -> List[str]:
    """Rule 5: the package ``__init__`` imports only the stdlib outside function bodies."""
    return [str(i) for i in imports.get(PKG, [])
            if not i.in_function and i.target.split(".")[0] not in sys.stdlib_module_names]


NAMED = {ast.Name: "id", ast.Attribute: "attr", ast.FunctionDef: "name", ast.AsyncFunctionDef: "name",
         ast.ClassDef: "name", ast.arg: "arg", ast.alias: "name asname", ast.ImportFrom: "module",
         ast.keyword: "arg"}


def gpt_mentions(src: Source) -> List[str]:
    """Rule 6: module name, identifiers and non-docstring strings matching ``(?i)gpt``."""
    tree = ast.parse(src.text, filename=src.path)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    hits = [(1, f"module name {src.name!r}")] if GPT.search(src.name.rsplit(".", 1)[-1]) else []
    for n in ast.walk(tree):
        line = getattr(n, "lineno", 0)
        for attr in NAMED.get(type(n), "").split():
            if GPT.search(value := getattr(n, attr) or ""):
                hits.append((line, f"{type(n).__name__}.{attr} {value!r}"))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and GPT.search(n.value):
            hits.append((line, f"string {n.value if len(n.value) < 60 else n.value[:57] + '...'!r}"))
    return [f"{src.path}:{line}: {what}" for line, what in sorted(set(hits))]


def check_no_gpt(sources: Mapping[str, Source], imports: Graph, scope: str) -> List[str]:
    """Rule 6: banned model imports, then GPT mentions on other lines (an import line is reported once)."""
    bad = check_banned(imports, scope, (f"{PKG}.models",) if scope != "lightning" else (f"{PKG}.models.gpt",))
    seen = {v.split(": ", 1)[0] for v in bad}
    return bad + [h for m in sorted(sources) if under(m, f"{PKG}.{scope}")
                  for h in gpt_mentions(sources[m]) if h.split(": ", 1)[0] not in seen]


@lru_cache(maxsize=1)
def _package() -> Tuple[Dict[str, Source], Dict[str, List[Import]]]:
    sources = load_sources({p.relative_to(PKG_DIR.parent).as_posix(): p.read_text(encoding="utf-8")
                            for p in sorted(PKG_DIR.rglob("*.py"))})
    return sources, collect_imports(sources)


def _ok(violations: List[str], rule: str) -> None:
    if violations:
        pytest.fail(f"{len(violations)} violation(s) of {rule}:\n  " + "\n  ".join(violations), pytrace=False)


def test_no_import_cycles() -> None:
    _ok(check_cycles(_package()[1]), "rule 1 (no import cycles)")


@pytest.mark.parametrize("scope", sorted(BANNED))
def test_banned_imports(scope: str) -> None:
    _ok(check_banned(_package()[1], scope, BANNED[scope]), f"rule 2/3 ({scope}/ imports a higher layer)")


@pytest.mark.parametrize("lib", sorted(CONFINED))
def test_framework_confined(lib: str) -> None:
    _ok(check_only_in(_package()[1], *CONFINED[lib]), f"rule 4 ({lib} imported outside its layer)")


def test_package_init_is_stdlib_only() -> None:
    _ok(check_init_stdlib(_package()[1]), "rule 5 (non-stdlib import at top level of atp_pipeline/__init__.py)")


@pytest.mark.parametrize("scope", ["planning", "parallel", "lightning"])
def test_no_builtin_gpt(scope: str) -> None:
    _ok(check_no_gpt(*_package(), scope), f"rule 6 ({scope}/ names the built-in GPT)")


_BAD = load_sources({  # a synthetic package that breaks every rule (and has allowed look-alikes)
    "atp_pipeline/__init__.py": "import os\nimport numpy\ndef __getattr__(n):\n    import torch\n",
    "atp_pipeline/planning/__init__.py": "from ..parallel import mesh\n",
    "atp_pipeline/planning/cost.py": "if TYPE_CHECKING:\n    import torch.distributed as dist\n"
                                     "def f():\n    importlib.import_module('atp_pipeline.models.gpt')\n",
    "atp_pipeline/parallel/mesh.py": "from atp_pipeline import planning\nimport pytorch_lightning\n"
                                     "import hydra.utils\n",
    "atp_pipeline/parallel/x.py": 'def f(n_gpt: int):\n    """A GPT docstring is fine."""\n    return "GPT-2"\n',
    "atp_pipeline/parallel/gpt.py": "",
    "atp_pipeline/config/schema.py": "import hydra\ndef register():\n    from hydra.core import config_store\n",
    "atp_pipeline/config/mesh_source.py": "import hydra\n",
    "atp_pipeline/lightning/module.py": "import lightning.pytorch as pl\nx = model.gpt\n",
    "atp_pipeline/topology/__init__.py": "from atp_pipeline.topology import model\n",
    "atp_pipeline/topology/model.py": "import atp_pipeline.topology.builders\n",  # no edge to the parent
    "atp_pipeline/topology/builders.py": "",
})
_BI = collect_imports(_BAD)
_P, _C, _M = "atp_pipeline/planning/__init__.py", "atp_pipeline/planning/cost.py", "atp_pipeline/parallel/mesh.py"
SELFTEST: Dict[str, Tuple[Callable[[], List[str]], Set[str]]] = {  # rule -> (check, where it must fire)
    "1-cycles": (lambda: check_cycles(_BI),
                 {"cycle atp_pipeline.parallel.mesh -> atp_pipeline.planning -> atp_pipeline.parallel.mesh"}),
    "2-planning": (lambda: check_banned(_BI, "planning", BANNED["planning"]), {f"{_P}:1", f"{_C}:2", f"{_C}:4"}),
    "3-parallel": (lambda: check_banned(_BI, "parallel", BANNED["parallel"]), {f"{_M}:3"}),
    "4-lightning": (lambda: check_only_in(_BI, *CONFINED["lightning"]), {f"{_M}:2"}),
    "4-hydra": (lambda: check_only_in(_BI, *CONFINED["hydra"]), {"atp_pipeline/config/schema.py:1", f"{_M}:3"}),
    "5-init": (lambda: check_init_stdlib(_BI), {"atp_pipeline/__init__.py:2"}),
    "6-planning": (lambda: check_no_gpt(_BAD, _BI, "planning"), {f"{_C}:4"}),
    "6-parallel": (lambda: check_no_gpt(_BAD, _BI, "parallel"), {  # not the docstring on x.py:2
        "atp_pipeline/parallel/gpt.py:1", "atp_pipeline/parallel/x.py:1", "atp_pipeline/parallel/x.py:3"}),
    "6-lightning": (lambda: check_no_gpt(_BAD, _BI, "lightning"), {"atp_pipeline/lightning/module.py:2"}),
}


@pytest.mark.parametrize("rule", sorted(SELFTEST))
def test_selftest_checker_fires(rule: str) -> None:
    check, where = SELFTEST[rule]
    got = check()
    assert {v.split("  [")[0] if v.startswith("cycle ") else v.split(": ")[0] for v in got} == where, got
    assert len(got) == len(where), got  # one report per offending line (or cycle)


def test_selftest_messages_are_precise() -> None:
    assert check_cycles(_BI) == [
        f"cycle atp_pipeline.parallel.mesh -> atp_pipeline.planning -> atp_pipeline.parallel.mesh  [{_M}:1: "
        "atp_pipeline.parallel.mesh imports atp_pipeline.planning (from atp_pipeline import planning); "
        f"{_P}:1: atp_pipeline.planning imports atp_pipeline.parallel.mesh (from ..parallel import mesh)]"]
    assert f"{_C}:4: atp_pipeline.planning.cost imports atp_pipeline.models.gpt " \
           "(import_module('atp_pipeline.models.gpt'))" in check_no_gpt(_BAD, _BI, "planning")
    assert check_no_gpt(_BAD, _BI, "parallel")[1:] == [
        "atp_pipeline/parallel/x.py:1: arg.arg 'n_gpt'", "atp_pipeline/parallel/x.py:3: string 'GPT-2'"]
