"""The package's layering, checked from the source: a lower layer never imports a higher one, no
import cycles between modules, and the torch-free core imports without torch.

The layers, lowest first (a module may import its own layer and any below it):

    0  core/, request, sampling_params, config       plain Python: no tensors, never torch
    1  ops/, distributed/                            tensor functions, TP collectives; no engine imports
    2  forward_context                               the contract between the runner and the layers
    3  layers/
    4  models/
    5  sample/                                       logits -> tokens (no batch state)
    6  worker/, spec_decode/                         the step: batch state, runner, proposers
    7  engine/
    8  server/, bench/
    9  the package root and command-line tools       (cli, */cli.py, spec_decode/train.py, corpus.py)

The package root (backboard/__init__.py) is a lazy facade: its own imports (LLM) are at the top,
but any module may read `__version__` from it.

Function-level (lazy) imports count for the layer rule; the cycle rule looks at module-level
imports only (a lazy import is how a cycle is legitimately broken at run time)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "backboard"

LEVELS = {
    "core": 0, "request": 0, "sampling_params": 0, "config": 0, "constants": 0,
    "ops": 1, "distributed": 1,
    "forward_context": 2,
    "layers": 3,
    "models": 4,
    "sample": 5,
    "worker": 6, "spec_decode": 6,
    "engine": 7,
    "server": 8, "bench": 8,
    "cli": 9, "": 9,
}
# command-line tools drive the whole stack, whatever package they sit in
TOOLS = {"backboard.engine.cli", "backboard.models.cli", "backboard.server.cli", "backboard.spec_decode.cli",
         "backboard.spec_decode.train", "backboard.spec_decode.corpus"}
TORCH_FREE = ("backboard.core", "backboard.core.scheduler", "backboard.core.outputs",
              "backboard.core.kv_cache_manager", "backboard.core.state_pool", "backboard.request",
              "backboard.sampling_params", "backboard.config")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, tree: ast.Module, top_level_only: bool) -> set[str]:
    """Modules of the package that `name` imports ("from a import b" counts b when it is a module)."""
    is_pkg = (PKG / Path(*name.split(".")[1:]) / "__init__.py").exists()
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, name, is_pkg)
            if base:
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        elif top_level_only and isinstance(node, (ast.If, ast.Try)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue                     # imports for annotations only
            out |= _imports(name, ast.Module(body=_flat(node), type_ignores=[]), True)
    return {m for m in out if m == "backboard" or m.startswith("backboard.")}


def _flat(node: ast.stmt) -> list[ast.stmt]:
    body = list(getattr(node, "body", [])) + list(getattr(node, "orelse", []))
    for h in getattr(node, "handlers", []):
        body += h.body
    return body


def level(module: str) -> int:
    if module in TOOLS:
        return LEVELS["cli"]
    parts = module.split(".")
    return LEVELS[parts[1] if len(parts) > 1 else ""]


def test_every_module_has_a_layer():
    for name in _modules():
        parts = name.split(".")
        assert name in TOOLS or (parts[1] if len(parts) > 1 else "") in LEVELS, f"{name}: give it a layer"


def test_no_import_from_a_higher_layer():
    mods = _modules()
    bad = []
    for name, tree in mods.items():
        for dep in _imports(name, tree, top_level_only=False):
            if dep in mods and dep != "backboard" and level(dep) > level(name):
                bad.append(f"{name} (layer {level(name)}) imports {dep} (layer {level(dep)})")
    assert not bad, "\n".join(sorted(bad))


def test_sample_knows_no_batch_state():
    """sample/ turns logits into tokens: it never reads the worker's or the proposers' state."""
    for name, tree in _modules().items():
        if name.startswith("backboard.sample"):
            deps = _imports(name, tree, top_level_only=False)
            assert not any(d.startswith(("backboard.worker", "backboard.spec_decode")) for d in deps), name


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_level_import_cycles():
    mods = _modules()
    graph = {}
    for name, tree in mods.items():
        # a package's own __init__ is imported before its modules: not an edge back to it
        graph[name] = {d for d in _imports(name, tree, top_level_only=True)
                       if d in mods and d != name and not name.startswith(d + ".")}
    assert not _cycles(graph)


def test_cycle_finder_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


_BLOCK_TORCH = """
import sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: this module must not need torch")
        return None

sys.meta_path.insert(0, BlockTorch())
import importlib
for m in sys.argv[1:]:
    importlib.import_module(m)
assert "torch" not in sys.modules
"""


def test_core_imports_without_torch():
    r = subprocess.run([sys.executable, "-c", _BLOCK_TORCH, *TORCH_FREE], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_torch_blocker_can_fail():
    r = subprocess.run([sys.executable, "-c", _BLOCK_TORCH, "backboard.ops.sampling"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "blocked" in r.stderr


@pytest.mark.parametrize("name", [m for m in TORCH_FREE if m != "backboard.config"])
def test_torch_free_modules_never_name_torch(name):
    """Even a lazy import of torch in the core would break the rule on some path. (config.py may
    import torch lazily to resolve device "auto"; it is checked by the import above.)"""
    tree = _modules()[name]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "torch" for a in node.names), name
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert (node.module or "").split(".")[0] != "torch", name
