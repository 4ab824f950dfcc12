"""The package's shape: which layer may import which, what flows/ and benchmarks/ may import, no
import cycle anywhere, and which modules start without torch."""

from __future__ import annotations

import ast
import collections
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "dedloc_pipeline"

# Each subpackage and what it may import (besides itself): a layer never reaches upward. A shard's
# life reads bottom to top: the records both sides read (protocol), the numerics both run bit for
# bit (compute), the judgements of a volunteer's work (checks), then the two sides, which never
# import each other (volunteer, organizer), and what watches, plans and evaluates a run.
BELOW_SIDES = {"storage", "trust", "model", "protocol", "compute", "checks"}
ALLOWED = {
    "storage": set(),
    "trust": {"storage"},
    "model": {"storage"},
    "protocol": {"storage", "trust", "model"},
    "compute": {"storage", "trust", "model", "protocol"},
    "checks": {"storage", "trust", "model", "protocol", "compute"},
    "volunteer": BELOW_SIDES,
    "organizer": BELOW_SIDES,
    "monitoring": BELOW_SIDES | {"volunteer", "organizer"},
    "planning": BELOW_SIDES | {"volunteer", "organizer"},
    "evaluation": {"storage", "model", "protocol"},
    "dataset": {"storage", "model"},  # the organizer's corpus made into a data set
}
ALLOWED["cli"] = set(ALLOWED)  # the command line, on top: every layer
TORCH_FREE = ["storage.layout", "storage.bucket", "storage.retry", "storage.s3", "storage.stats", "storage.codec",
              "storage.vector", "storage.part", "protocol.config", "protocol.shard", "protocol.run",
              "protocol.heartbeat", "volunteer.upload_policy", "volunteer.transfers", "monitoring.status",
              "planning.prices", "planning.planned", "planning.requests", "planning.estimate", "planning.display",
              "trust.identity", "trust.policy", "model.presets", "cli"]


def _imports(path: pathlib.Path) -> set[str]:
    """Every dedloc_pipeline subpackage this file imports, at the top or inside a function."""
    sub = path.relative_to(PKG).parts[0] if path.parent != PKG else None
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "dedloc_pipeline" and len(parts) > 1:
                    found.add(parts[1])
            elif node.level == 1 and sub is not None:
                found.add(sub)
            else:  # from ..x import y (inside a subpackage), from .x import y (at the top)
                target = (node.module or "").split(".")[0]
                found.add(target if target else node.names[0].name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "dedloc_pipeline" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of the package, flows/ and benchmarks/ by its dotted name (a package by its __init__)."""
    found = {}
    for top in ("dedloc_pipeline", "flows", "benchmarks"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: pathlib.Path) -> set[str]:
    """The dotted names a module imports, at the top or inside a function (a cycle closed inside a
    function is still a cycle), relative ones resolved; ``from a import b`` gives ``a.b``, which
    may be a module or a name in ``a``. Imports under ``if TYPE_CHECKING:`` never run: left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (the longest known prefix of each imported name)."""
    modules = _modules(root)

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    return {name: {m for i in _imported(name, path) if (m := module_of(i)) not in (None, name)}
            for name, path in modules.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A shortest chain of imports from ``start`` back to itself, or None."""
    came_from = {m: start for m in graph[start]}
    queue = collections.deque(graph[start])
    while queue and start not in came_from:
        m = queue.popleft()
        for n in graph[m] - came_from.keys():
            came_from[n] = m
            queue.append(n)
    if start not in came_from:
        return None
    chain, m = [start], came_from[start]
    while m != start:
        chain.append(m)
        m = came_from[m]
    return [start, *reversed(chain)]


def _cycles(root: pathlib.Path = ROOT) -> list[list[str]]:
    graph = _graph(root)
    found: dict[frozenset, list[str]] = {}
    for name in graph:
        chain = _cycle_through(graph, name)
        if chain is not None:
            found.setdefault(frozenset(chain), chain)
    return list(found.values())


# What flows/ and benchmarks/ may import of the project besides themselves: the package (the
# benchmarks also its in-process driver, dedloc_pipeline.testing); never tests/, and flows never
# the benchmarks. The package itself imports neither benchmarks/ nor tests/.
FIRST_PARTY = {"dedloc_pipeline", "flows", "benchmarks", "tests"}
TOP_ALLOWED = {"flows": ("dedloc_pipeline.",), "benchmarks": ("dedloc_pipeline.",),
               "dedloc_pipeline": ("flows.",)}
TOP_FORBIDDEN = {"flows": ("dedloc_pipeline.testing",)}


@pytest.mark.parametrize("top", sorted(TOP_ALLOWED))
def test_flows_and_benchmarks_import_only_the_package_below_them(top):
    bad = {}
    for name, path in _modules().items():
        if name.split(".")[0] != top:
            continue
        reached = sorted(i for i in _imported(name, path)
                         if i.split(".")[0] in FIRST_PARTY - {top}
                         and (not i.startswith(TOP_ALLOWED[top]) or i.startswith(TOP_FORBIDDEN.get(top, ()))))
        if reached:
            bad[name] = reached
    assert not bad, f"{top} reaches {bad}"


def test_no_import_cycle_anywhere():
    """Among the package's, flows' and benchmarks' modules, counting imports inside functions."""
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path):
    """The check itself: a relative import at the top and an absolute one inside a function."""
    for top in ("dedloc_pipeline", "flows", "benchmarks"):
        (tmp_path / top).mkdir()
        (tmp_path / top / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "a.py").write_text("from . import b\n")
    (tmp_path / "benchmarks" / "b.py").write_text("def f():\n    from benchmarks.a import g\n")
    (tmp_path / "benchmarks" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                                  "if TYPE_CHECKING:\n    from benchmarks import a\n")
    (tmp_path / "benchmarks" / "d.py").write_text("from benchmarks import c\n")
    assert _cycles(tmp_path) == [["benchmarks.a", "benchmarks.b", "benchmarks.a"]]


def test_every_subpackage_has_a_floor():
    """A new folder states which layers it may import, so none escapes the check below."""
    assert {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()} == set(ALLOWED)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    bad = {}
    for path in sorted((PKG / layer).glob("*.py")):
        reached = _imports(path) - ALLOWED[layer] - {layer}
        if reached:
            bad[path.name] = sorted(reached)
    assert not bad, f"{layer} reaches {bad}: allowed are {sorted(ALLOWED[layer])}"


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: an import of monitoring from the protocol is found, relative or absolute."""
    probe = PKG / "protocol" / "_probe_for_test.py"
    probe.write_text("from ..monitoring import status\nfrom dedloc_pipeline.evaluation.export import export\n")
    try:
        assert _imports(probe) == {"monitoring", "evaluation"}
    finally:
        probe.unlink()


def test_light_commands_start_without_torch():
    """``dedloc status``, ``keygen``, ``policy`` and ``stop`` load none of torch or transformers."""
    code = ("import sys\n" + "".join(f"import dedloc_pipeline.{m}\n" for m in TORCH_FREE)
            + "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"torch-free modules loaded {out.stdout.strip()}"


@pytest.mark.slow
def test_the_model_still_loads_torch_when_asked():
    """The other side: the worker's module does need torch (so the check above is not vacuous)."""
    code = "import sys, dedloc_pipeline.volunteer.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_keys_are_spelled_and_parsed_only_in_the_layout():
    """No module builds a key by appending to a layout key, or takes one apart by hand: the layout
    (storage/layout/) owns both directions. The bucket's own path handling and the policy's
    IAM wildcards (checked key by key in test_policy) are the exceptions."""
    import re
    hand_made = re.compile(r'rsplit\("/"|split\("/"\)|f"\{[a-z_.]*keys\.[a-z_]+(\([^)]*\))?\}/[^*]'
                           r'|removesuffix\("\.json"\)')
    exempt = {"storage/bucket.py", "trust/policy.py"}
    found = [f"{p.relative_to(PKG)}:{i}: {line.strip()}" for p in sorted(PKG.rglob("*.py"))
             if str(p.relative_to(PKG)) not in exempt and p.parent != PKG / "storage" / "layout"
             for i, line in enumerate(p.read_text().splitlines(), 1) if hand_made.search(line)]
    assert not found, "keys made or parsed outside storage/layout/:\n" + "\n".join(found)
