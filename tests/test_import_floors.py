"""Imports flow downward: every qkvlab import (module level and inside functions) goes to the same
floor or a lower one, and no imports form a cycle. The floors are the ```floors block of
docs/architecture.md, the one place they are written.

`python tests/test_import_floors.py [SRC]` prints the graph's numbers (cycles, upward imports,
imports inside functions) for a source tree (default: this checkout's src/).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx  # a torch dependency

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"


def read_floors(doc: Path = DOC) -> list[list[str]]:
    """The floors, top first, from the ```floors block."""
    m = re.search(r"```floors\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    assert m, f"{doc}: no ```floors block"
    return [line.split() for line in m.group(1).splitlines() if line.strip()]


def module_names(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for f in sorted((src / "qkvlab").rglob("*.py")):
        parts = f.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool
    kind: str  # "import" or "string" (a module named for importlib)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks (annotations only, never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(package + ([base] if base else []))
        # `from P import M` imports module P.M when it is one, else a name of P
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
        return [node.value]
    return []


@functools.lru_cache
def import_edges(src: Path = SRC) -> list[Edge]:
    modules = module_names(src)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        in_function = {
            id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for target in _targets(node, module, path.name == "__init__.py", modules):
                while target and target not in modules:  # qkvlab.io.atomic_write -> qkvlab.io
                    target = target.rpartition(".")[0]
                if target.startswith("qkvlab") and target != module:
                    kind = "string" if isinstance(node, ast.Constant) else "import"
                    edges.append(Edge(module, target, node.lineno, id(node) in in_function, kind))
    return edges


def floor_of(module: str, floors: list[list[str]]) -> int | None:
    """The index (0 = top) of the longest floor entry covering `module`; the bare `qkvlab` entry
    covers only the package itself."""
    best, best_len = None, -1
    for i, names in enumerate(floors):
        for name in names:
            covers = module == name or (name != "qkvlab" and module.startswith(name + "."))
            if covers and len(name) > best_len:
                best, best_len = i, len(name)
    return best


# Upward imports waiting for a move another change of issue 19 makes: delete the entry when it lands.
PENDING: dict[tuple[str, str], str] = {}  # (importer, imported): why an upward import is allowed for now


def upward(edges: list[Edge], floors: list[list[str]]) -> list[Edge]:
    """Imports that climb a floor (modules without a floor are test_every_module_has_a_floor's)."""
    bottom = len(floors)
    at = {m: floor_of(m, floors) for e in edges for m in (e.source, e.target)}
    return [
        e
        for e in edges
        if (bottom if at[e.target] is None else at[e.target]) < (bottom if at[e.source] is None else at[e.source])
        and (e.source, e.target) not in PENDING
    ]


def cycles(edges: list[Edge]) -> list[list[str]]:
    graph = nx.DiGraph((e.source, e.target) for e in edges)
    return [list(c) for c in nx.simple_cycles(graph)]


# ---- the tests ------------------------------------------------------------------------------------
def test_every_module_has_a_floor():
    floors = read_floors()
    names = [n for floor in floors for n in floor]
    assert len(names) == len(set(names)), "a name is on two floors"
    modules = module_names()
    assert [m for m in modules if floor_of(m, floors) is None] == []
    stale = [n for n in names if not any(m == n or m.startswith(n + ".") for m in modules)]
    assert stale == [], f"floors name modules that do not exist: {stale}"


def test_imports_only_go_down():
    floors = read_floors()
    bad = [
        f"{e.source}:{e.line} imports {e.target} ({'in a function' if e.in_function else 'module level'}, {e.kind})"
        for e in upward(import_edges(), floors)
    ]
    assert bad == [], "imports that climb a floor (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycles():
    assert cycles(import_edges()) == []


def test_the_checker_sees_what_it_must():
    """The parts the rules rest on: function-level imports, relative imports, `from P import M`,
    importlib strings and TYPE_CHECKING blocks."""
    edges = {(e.source, e.target, e.in_function, e.kind) for e in import_edges()}
    assert ("qkvlab.tasks", "qkvlab.tasks.lm", False, "string") in edges  # the task registry
    assert (
        "qkvlab.train.loop",
        "qkvlab.train.checkpoint",
        False,
        "import",
    ) in edges  # from qkvlab.train import checkpoint
    assert not any(s == "qkvlab.accounting" and t == "qkvlab.config" for s, t, _, _ in edges)  # TYPE_CHECKING only
    assert any(in_function for _, _, in_function, _ in edges)
    assert floor_of("qkvlab.convert.retrofit", read_floors()) < floor_of("qkvlab.convert.hf", read_floors())


def test_train_package_exports_resolve_lazily():
    import importlib
    import subprocess

    train = importlib.import_module("qkvlab.train")
    for name in train.__all__:
        assert getattr(train, name) is not None
    code = "import sys, qkvlab.train.checkpoint; print('qkvlab.train.loop' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # the package imports nothing of its own


def test_every_module_imports_on_its_own():
    """No module works only because another was imported first: each is imported into a process
    whose qkvlab modules were all dropped (torch stays loaded, to keep this quick)."""
    import subprocess

    code = (
        "import importlib, sys, torch\n"
        "for name in sys.argv[1:]:\n"
        "    for m in [m for m in sys.modules if m == 'qkvlab' or m.startswith('qkvlab.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if (e.name or '').startswith('qkvlab'):\n"
        "            raise\n"  # an optional dependency missing is not an order problem
    )
    subprocess.run([sys.executable, "-c", code, *module_names()], check=True)


def test_writing_files_needs_no_torch():
    import subprocess

    code = (
        "import sys, qkvlab.files, qkvlab.data.tokenizer, qkvlab.data.text, qkvlab.units; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def function_imports(src: Path = SRC) -> int:
    """Import statements inside functions, of any module (stdlib, optional dependencies, qkvlab)."""
    n = 0
    for path in module_names(src).values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside = {
            id(x) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in ast.walk(f)
        }
        n += sum(isinstance(x, (ast.Import, ast.ImportFrom)) and id(x) in inside for x in ast.walk(tree))
    return n


def main(src: Path = SRC) -> None:
    edges = import_edges(src)
    cyc = cycles(edges)
    print(f"{src}: {len(module_names(src))} modules, {len(edges)} qkvlab imports")
    inner = sum(e.in_function and e.kind == "import" for e in edges)
    print(f"  imports inside functions: {function_imports(src)} in all, {inner} of qkvlab modules")
    print(f"  cycles: {len(cyc)}" + "".join(f"\n    {' -> '.join(c)}" for c in cyc))
    if DOC.is_file():
        up = upward(edges, read_floors())
        print(f"  upward imports (floors of {DOC.relative_to(ROOT)}): {len(up)}")
        for e in up:
            print(f"    {e.source}:{e.line} -> {e.target}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC)
