"""The docs stay true: the configuration reference is what RunConfig generates, every relative
link (and its anchor) resolves inside the repository, and the commands they show exist."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from dedloc_pipeline.protocol import reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "infra" / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside code: links inside code blocks and spans are examples, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _code(text: str) -> str:
    """The text inside code blocks and spans: where commands are shown."""
    return "\n".join([m.group(0) for m in FENCE.finditer(text)] + CODE_SPAN.findall(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*]", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def test_the_configuration_reference_is_what_runconfig_generates():
    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text() == reference.markdown(), (
        "docs/configuration.md: rerun python -m dedloc_pipeline.protocol.reference > docs/configuration.md")


def test_the_table_of_checks_is_the_catalog():
    from dedloc_pipeline.checks import catalog
    text = (ROOT / "docs" / "verification.md").read_text()
    table = text.split("<!-- checks: catalog.markdown() -->\n", 1)[1].split("<!-- end of checks -->", 1)[0]
    assert table == catalog.markdown(), "docs/verification.md: paste catalog.markdown() between its markers"


def test_every_field_of_runconfig_is_in_the_reference():
    text = reference.markdown()
    from dedloc_pipeline.protocol.config import RunConfig
    paths = [name for name in RunConfig.model_fields] + [
        f"{name}.{leaf}" for name, model in reference.nested(RunConfig) for leaf in model.model_fields]
    assert [p for p in paths if f"| `{p}` |" not in text] == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc):
    bad = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.is_relative_to(ROOT) or not path.exists():
            bad.append(f"{target}: no such file in the repository")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert bad == [], f"{doc.relative_to(ROOT)}: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_refers_outside_the_repository(doc):
    assert "../shared" not in doc.read_text() and "DESIGN.md" not in doc.read_text()


def test_the_checks_see_what_they_look_for():
    """The checks themselves: slugs as GitHub makes them, a missing anchor, links in code left out,
    a command's continuation lines read, an unknown option found."""
    assert slug("8. Does pretraining pay? (`benchmarks/quality.py`, `make quality`)") == (
        "8-does-pretraining-pay-benchmarksqualitypy-make-quality")
    assert slug("The local-steps mode: `algorithm: diloco`") == "the-local-steps-mode-algorithm-diloco"
    assert slug("`close.max_parts` and **peers**") == "closemax_parts-and-peers"
    assert "configuration-reference" in anchors(ROOT / "docs" / "configuration.md")
    assert "nowhere" not in anchors(ROOT / "docs" / "configuration.md")
    assert LINK.findall(_prose("see [a](b.md#c) and `[x](y.md)`")) == ["b.md#c"]
    shown = _dedloc_lines(".venv/bin/dedloc worker --bogus 1 \\\n    --key K\nnext --x\n")
    assert shown == [("worker", " --bogus 1 \\     --key K")]
    assert "--key" in _dedloc_commands()["worker"] and "--bogus" not in _dedloc_commands()["worker"]


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def _dedloc_commands() -> dict[str, set[str]]:
    """Each ``dedloc`` command and the options it takes."""
    import typer

    from dedloc_pipeline.cli import app
    found = {}
    for name, cmd in typer.main.get_command(app).commands.items():
        for sub, c in getattr(cmd, "commands", {}).items():  # a group's (dedloc data make)
            found[f"{name} {sub}"] = {o for p in c.params for o in (*p.opts, *p.secondary_opts)}
        found[name] = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    return found


def _dedloc_lines(code: str) -> list[tuple[str, str]]:
    """(command, the rest of its line with its continuation lines) for each ``dedloc COMMAND`` shown."""
    lines = code.splitlines()
    found = []
    for i, line in enumerate(lines):
        for m in re.finditer(r"(?<![\w/.-])(?:\S*/)?dedloc ((?:data )?[a-z][\w-]*)(.*)", line):
            rest, j = m.group(2), i + 1
            while j < len(lines) and (lines[j - 1].rstrip().endswith("\\") or lines[j].startswith(" ")):
                rest, j = rest + " " + lines[j], j + 1
            found.append((m.group(1), rest.split(" dedloc ")[0]))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_the_docs_show_exist(doc):
    """Every `make TARGET` and `dedloc COMMAND --option` in a doc's code is a Makefile target, or a
    CLI command and one of its options."""
    code = _code(doc.read_text())
    makes = set(re.findall(r"(?<![\w-])make ([a-z][\w-]*)", code)) - _makefile_targets()
    known = _dedloc_commands()
    wrong = {f"dedloc {cmd} {opt}" for cmd, rest in _dedloc_lines(code)
             for opt in (re.findall(r"(?<![\w-])--[a-z][\w-]*", rest) if cmd in known else ["(no such command)"])
             if opt not in known.get(cmd, ()) and opt != "--help"}
    assert (makes, wrong) == (set(), set())


PACKAGE_FILE = re.compile(r"(?<![\w/.])(?:dedloc_pipeline/)?((?:protocol|compute|checks|volunteer|organizer|storage|"
                          r"trust|model|monitoring|planning|evaluation|cli)/[\w/]+\.py)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_files_the_docs_name_exist(doc):
    """Every ``checks/catalog.py``-like path a doc names is a file of the package (a module moved
    or renamed leaves no stale map behind)."""
    missing = sorted({f for f in PACKAGE_FILE.findall(doc.read_text()) if not (ROOT / "dedloc_pipeline" / f).exists()})
    assert missing == [], f"{doc.relative_to(ROOT)}: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_tests_the_docs_name_exist(doc):
    """Every ``test_module::test_case`` a doc cites as the check of something is a test there."""
    missing = []
    for module, case in re.findall(r"(test_\w+)(?:\.py)?::(test_\w+)", doc.read_text()):
        path = ROOT / "tests" / f"{module}.py"
        if not path.exists() or not re.search(rf"^def {case}\(", path.read_text(), re.M):
            missing.append(f"{module}::{case}")
    assert missing == [], f"{doc.relative_to(ROOT)}: {missing}"
