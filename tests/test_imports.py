"""The package's import graph: every module imports on its own, no two modules import
each other, directly or round a longer loop, and the folders stand in layers: a module
imports from its own folder or from folders below its own, never from one beside or above.

A circle works by accident of import order (whichever module is imported first sees
the other half-built), and it leaves no bottom layer to start reading from. Every
import counts as an edge: those inside functions (they only put the circle off until
the first call) and those under ``if TYPE_CHECKING:`` too (they never run, but a
module that names another's types depends on it as much as one that calls it).
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ndjax

ROOT = Path(ndjax.__file__).parent
PACKAGE = "ndjax"

# ndjax's folders and top-level modules, bottom first. Those on one line are neighbours
# that import neither each other nor anything on their line or above; docs/architecture.md
# draws the same picture. A new folder or top-level module takes its place here.
LAYERS = (
    ("runtime",),     # the process: one-line errors, console, flags, XLA's options
    ("parallel",),    # the mesh, the rule tables, collectives, processes, platforms
    ("ops",),         # kernels: attention, grouped matmuls, cross-entropy, layer scan
    ("models",),      # families, layers, LoRA and quantization, the sampler
    ("config", "hardware", "rewards"),  # the typed config; GPUs' figures; GRPO's rewards
    ("data",),        # documents -> packed rows, handed the config's data section
    ("axolotl",),     # Axolotl's fields, read into the config's and the data's names
    ("step",),        # the train state and the jitted step
    ("runs",),        # a run on disk: directory, lock, checkpoints, Hugging Face files
    ("experiment",),  # the config checked and built into mesh, model, state and step
    ("planning",),    # layouts ranked before renting GPUs
    ("training",),    # the loop and what runs around each step
    ("verbs",),       # the commands
    ("__init__", "__main__"),  # the package's names; ``python -m ndjax <verb>``
)


def module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    files = {PACKAGE: ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix=PACKAGE + "."):
        path = ROOT.joinpath(*info.name.split(".")[1:])
        files[info.name] = path / "__init__.py" if info.ispkg else path.with_suffix(".py")
    return files


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth: top level, functions, classes, try and if
    blocks (``if TYPE_CHECKING:`` included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _source(node: ast.ImportFrom, importer: str, is_package: bool) -> str | None:
    """The absolute module a ``from ... import`` names (relative forms included)."""
    if not node.level:
        return node.module
    parts = importer.split(".")
    parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` (source at ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = _source(node, name, path.name == "__init__.py")
            if source is None:
                continue
            # A submodule where the name is one (`from ndjax.runs import hf`), else the
            # module that defines the name (`from ndjax.config import Settings`).
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        for target in targets:
            # The deepest of the package's modules the name reaches.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports. Only the edges the source writes:
    that importing ndjax.data.loader runs ndjax/data/__init__.py first is Python's
    doing, and counting it would make every package that re-exports one of its
    modules a circle."""
    files = module_files()
    modules = set(files)
    return {name: imported_modules(name, path, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the modules round it (the first repeated last), or None."""
    state: dict[str, str] = {}  # "open": on the current path; "done": no cycle through it
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def find_cycles(graph: dict[str, set[str]], limit: int = 20) -> list[list[str]]:
    """Cycles until none is left, each found with the edge that closed the one before
    it taken out, so that every circle is reported, not only the first."""
    graph = {node: set(edges) for node, edges in graph.items()}
    cycles = []
    while len(cycles) < limit and (cycle := find_cycle(graph)):
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain, top down (for an acyclic graph)."""
    best: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in best:
            best[node] = [node] + max((chain(nxt) for nxt in sorted(graph[node])),
                                      key=len, default=[])
        return best[node]

    return max((chain(name) for name in sorted(graph)), key=len)


def test_every_module_imports_in_a_fresh_interpreter():
    # All in one interpreter, each module's first import being what runs its top-level
    # code; a verb defining its absl flags on import would clash here with another's
    # (DuplicateFlagError), which is why they define them in main().
    names = sorted(module_files())
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], capture_output=True,
                            text=True, cwd=ROOT.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def layer_of(module: str) -> str:
    """The folder of a module, or its own name at the top of the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that reaches a folder beside or above the importer's own."""
    rank = {name: i for i, line in enumerate(LAYERS) for name in line}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if layer_of(a) != layer_of(b)
                  and rank.get(layer_of(b), len(LAYERS)) >= rank.get(layer_of(a), -1))


def test_every_folder_and_top_level_module_has_a_layer():
    placed = {name for line in LAYERS for name in line}
    assert {layer_of(name) for name in module_files()} == placed


def test_the_folders_stand_in_layers():
    violations = layering_violations(import_graph())
    assert not violations, "imports beside or up the layers:\n" + "\n".join(violations)


def test_the_layering_check_refuses_sideways_and_upward_imports():
    graph = {"ndjax.models.moe": {"ndjax.ops.attention", "ndjax.models.layers"},
             "ndjax.ops.attention": {"ndjax.models.layers"},
             "ndjax.config": {"ndjax.hardware.roofline"},
             "ndjax.planning.planner": {"ndjax.experiment"}}
    assert layering_violations(graph) == ["ndjax.config -> ndjax.hardware.roofline",
                                          "ndjax.ops.attention -> ndjax.models.layers"]
    # A module outside every layer is below nothing and above nothing.
    assert layering_violations({"ndjax.newfolder.x": {"ndjax.runtime.errors"}}) == \
        ["ndjax.newfolder.x -> ndjax.runtime.errors"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("source, expected", [
    ("from ndjax.runs import hf", {"ndjax.runs.hf"}),
    ("from ndjax.runs import hf as hf_lib, lock", {"ndjax.runs.hf", "ndjax.runs.lock"}),
    ("from ndjax import config", {"ndjax.config"}),
    ("from ndjax.training import hooks as hooks_lib, sinks",
     {"ndjax.training.hooks", "ndjax.training.sinks"}),
    ("from ndjax.data.loader import make_loader", {"ndjax.data.loader"}),
    ("from ndjax.data import BATCH_FIELDS, loader", {"ndjax.data", "ndjax.data.loader"}),
    ("import ndjax.models.decoder as d", {"ndjax.models.decoder"}),
    ("def f():\n    from ndjax.training import hooks", {"ndjax.training.hooks"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ndjax.training import loop",
     {"ndjax.training.loop"}),
    ("from . import registry", {"ndjax.models.registry"}),
    ("import numpy, jax", set()),
])
def test_the_graph_sees_each_form_of_import(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert imported_modules("ndjax.models.probe", path, set(module_files())) == expected


def test_the_cycle_finder_reports_every_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]
