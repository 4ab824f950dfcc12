"""The package's shape: which layer may import which, and which modules start without torch."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "dedloc_pipeline"

# Each subpackage and what it may import (besides itself): a layer never reaches upward.
ALLOWED = {
    "storage": set(),
    "trust": {"storage"},
    "model": {"storage"},
    "protocol": {"storage", "trust", "model"},
    "monitoring": {"storage", "trust", "model", "protocol"},
    "evaluation": {"storage", "model", "protocol"},
}
TORCH_FREE = ["storage.layout", "storage.bucket", "storage.codec", "protocol.config", "protocol.shard",
              "protocol.run", "monitoring.status", "monitoring.cost", "trust.identity", "trust.policy",
              "model.presets", "cli", "protocol.heartbeat", "protocol.upload_policy", "protocol.transfers",
              "storage.part"]


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


def test_the_model_still_loads_torch_when_asked():
    """The other side: the worker's module does need torch (so the check above is not vacuous)."""
    code = "import sys, dedloc_pipeline.protocol.worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_keys_are_spelled_and_parsed_only_in_the_layout():
    """No module builds a key by appending to a layout key, or takes one apart by hand: the layout
    (storage/layout.py) owns both directions. The bucket's own path handling and the policy's
    IAM wildcards (checked key by key in test_policy) are the exceptions."""
    import re
    hand_made = re.compile(r'rsplit\("/"|split\("/"\)|f"\{[a-z_.]*keys\.[a-z_]+(\([^)]*\))?\}/[^*]'
                           r'|removesuffix\("\.json"\)')
    exempt = {"storage/layout.py", "storage/bucket.py", "trust/policy.py"}
    found = [f"{p.relative_to(PKG)}:{i}: {line.strip()}" for p in sorted(PKG.rglob("*.py"))
             if str(p.relative_to(PKG)) not in exempt
             for i, line in enumerate(p.read_text().splitlines(), 1) if hand_made.search(line)]
    assert not found, "keys made or parsed outside layout.py:\n" + "\n".join(found)
