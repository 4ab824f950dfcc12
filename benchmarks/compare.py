"""`make bench-compare REF=...`: the same benchmarks for another commit beside the working tree,
in one run on this machine, and the ratio of every number they both report.

The other commit is checked out in a worktree of its own (``.dedloc/compare/SHA``, made once) and
run as its own package: a subprocess whose import path starts at that worktree (checked: its
``dedloc_pipeline`` must load from there), with this tree's dependencies (``.venv``), so what
differs is the code. Each benchmark runs for the other commit, then for the working tree, one
after the other, so a machine busy for a while weighs on both alike. Ratios are working tree
over the other commit; which direction is better depends on the number (seconds: lower;
samples/s: higher), so every pair is shown. ``python -m benchmarks.compare REF [NAMES...]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
console = Console()


def worktree(ref: str) -> tuple[str, Path]:
    """The commit ``ref`` names and a worktree of it (made once, detached)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise typer.BadParameter(f"{ref!r} names no commit here ({sha.stderr.strip()})")
    sha_ = sha.stdout.strip()
    path = ROOT / ".dedloc" / "compare" / sha_[:12]
    if not (path / "dedloc_pipeline").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), sha_], cwd=ROOT, check=True,
                       capture_output=True)
    return sha_, path


def run(tree: Path, name: str, out_dir: Path) -> dict:
    """Benchmark ``name`` of the code in ``tree``, in a process of its own; its results."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    check = subprocess.run([sys.executable, "-c", "import dedloc_pipeline, benchmarks; "
                            "print(dedloc_pipeline.__file__); print(benchmarks.__file__)"],
                           cwd=tree, env=env, capture_output=True, text=True, check=True)
    if any(not Path(p).resolve().is_relative_to(tree.resolve()) for p in check.stdout.split()):
        raise RuntimeError(f"the code run for {tree} loads from elsewhere: {check.stdout.split()}")
    subprocess.run([sys.executable, "-m", "benchmarks.run", name, "--out-dir", str(out_dir)], cwd=tree, env=env,
                   check=True)
    return json.loads((out_dir / "results.json").read_text())[name]


def numbers(found, path: str = "") -> dict[str, float]:
    """Every number in a benchmark's results, by its path (lists of more than 8 left out: series)."""
    if isinstance(found, bool):
        return {}
    if isinstance(found, (int, float)):
        return {path: float(found)}
    if isinstance(found, dict):
        return {k: v for key, value in found.items()
                for k, v in numbers(value, f"{path}.{key}" if path else key).items()}
    if isinstance(found, list) and len(found) <= 8:
        return {k: v for i, value in enumerate(found) for k, v in numbers(value, f"{path}[{i}]").items()}
    return {}


def ratios(theirs: dict, ours: dict) -> list[tuple[str, float, float, float | None]]:
    """(path, the other commit's, the working tree's, ours / theirs) of every number both report."""
    a, b = numbers(theirs), numbers(ours)
    return [(k, a[k], b[k], b[k] / a[k] if a[k] else None) for k in sorted(set(a) & set(b))]


def main(ref: str = typer.Argument(..., help="the commit to compare with: a tag (a release), a branch, a SHA"),
         only: Optional[list[str]] = typer.Argument(None, help="benchmarks (benchmarks.run's names); default: "
                                                    "aggregation"),
         out_dir: Path = typer.Option(Path(".dedloc/bench-compare"), help="where compare.json goes")):
    """Run benchmarks for REF and for the working tree, one after the other, and print the ratios."""
    sha, tree = worktree(ref)
    out_dir = out_dir.resolve()
    report: dict = {"ref": ref, "sha": sha, "benchmarks": {}}
    for name in only or ["aggregation"]:
        theirs = run(tree, name, out_dir / "ref")
        ours = run(ROOT, name, out_dir / "tree")
        rows = ratios(theirs, ours)
        report["benchmarks"][name] = {"ref": theirs, "tree": ours,
                                      "ratios": {k: r for k, _, _, r in rows if r is not None}}
        table = Table(title=f"{name}: the working tree against {ref} ({sha[:10]})", title_justify="left")
        for column in ("number", ref, "working tree", "tree / ref"):
            table.add_column(column, justify="left" if column == "number" else "right")
        for k, a, b, r in rows:
            table.add_row(k, f"{a:.4g}", f"{b:.4g}", "" if r is None else f"{r:.3f}")
        console.print(table)
        (out_dir / "compare.json").write_text(json.dumps(report, indent=1))
    console.print(f"results: {out_dir / 'compare.json'}")


if __name__ == "__main__":
    typer.run(main)
