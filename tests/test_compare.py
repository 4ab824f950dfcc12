"""`make bench-compare`: another commit's benchmarks beside the working tree's (benchmarks/compare.py)."""

from __future__ import annotations

import subprocess

import pytest
import typer

from benchmarks import compare


def test_the_ratios_pair_every_number_both_report():
    theirs = {"seconds": 2.0, "io": {"get": 10, "put": 0}, "series": list(range(20)), "ok": True, "runs": [1.0, 3.0]}
    ours = {"seconds": 1.0, "io": {"get": 10, "put": 1}, "series": list(range(20)), "ok": True, "new": 5.0,
            "runs": [2.0, 3.0]}
    assert compare.ratios(theirs, ours) == [("io.get", 10.0, 10.0, 1.0), ("io.put", 0.0, 1.0, None),
                                            ("runs[0]", 1.0, 2.0, 2.0), ("runs[1]", 3.0, 3.0, 1.0),
                                            ("seconds", 2.0, 1.0, 0.5)]


def test_another_commit_runs_from_its_own_worktree(tmp_path, monkeypatch):
    """The other commit is checked out once, detached, in a worktree of its own (a name that is
    no commit is a clear error)."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(compare.ROOT), str(repo)], check=True)
    monkeypatch.setattr(compare, "ROOT", repo)
    sha, tree = compare.worktree("HEAD~1")
    head = subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert sha == head and (tree / "dedloc_pipeline").is_dir() and tree.is_relative_to(repo / ".dedloc")
    assert compare.worktree("HEAD~1") == (sha, tree)  # made once
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    assert found == head
    with pytest.raises(typer.BadParameter, match="names no commit"):
        compare.worktree("no-such-release")
