"""The documentation stays true to the code and the README stays a front door.

- ``docs/configuration.md``'s table lists every variable declared in
  ``mmshm.config.VARIABLES`` once, with the declaration's default, and names no
  variable that is not declared.
- ``README.md`` is at most 150 lines, and every link it gives into ``docs/`` (and
  every relative link inside ``docs/``) names a file that exists, and a heading of
  that file when it names one (``file.md#heading``).

Cheap: it reads text files only.
"""

from __future__ import annotations

import re
from pathlib import Path

from mmshm import config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 150

#: A markdown link's target: ``[text](target)``; images included.
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def config_table_rows(text: str) -> list[list[str]]:
    """The cells of each ``| `MMSHM_...` |`` row of a markdown table in ``text``."""
    return [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in text.splitlines() if ln.startswith("| `MMSHM_")]


def config_table_problems(text: str) -> list[str]:
    """What is wrong with the configuration table in ``text`` against the
    declarations (``mmshm.config.VARIABLES``): one line per problem, [] if none."""
    rows = config_table_rows(text)
    names = [r[0].strip("`") for r in rows]
    declared = {v.name: v.shown_default for v in config.VARIABLES}
    problems = [f"{n}: declared, missing from the table" for n in declared if n not in names]
    problems += [f"{n}: in the table, not declared" for n in names if n not in declared]
    problems += [f"{n}: listed {names.count(n)} times" for n in sorted(set(names))
                 if names.count(n) > 1]
    for r in rows:
        name = r[0].strip("`")
        shown = r[1].replace("`", "") if len(r) > 1 else ""
        if name in declared and shown != declared[name]:
            problems.append(f"{name}: default {shown!r} in the table, {declared[name]!r} declared")
    return problems


def test_the_configuration_table_matches_the_declarations():
    text = (DOCS / "configuration.md").read_text()
    assert config_table_rows(text) and config.VARIABLES
    assert config_table_problems(text) == []


def test_the_table_check_catches_a_missing_and_an_unknown_variable():
    """The check above can fail: a row taken out, a row for a variable that does
    not exist, a row given twice, a wrong default."""
    text = (DOCS / "configuration.md").read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| `MMSHM_DIR` |"))
    assert config_table_problems(text.replace(row + "\n", "")) == [
        "MMSHM_DIR: declared, missing from the table"]
    bogus = "| `MMSHM_NO_SUCH_THING` | 1 | nothing |"
    assert config_table_problems(text.replace(row, row + "\n" + bogus)) == [
        "MMSHM_NO_SUCH_THING: in the table, not declared"]
    assert config_table_problems(text.replace(row, row + "\n" + row)) == [
        "MMSHM_DIR: listed 2 times"]
    assert config_table_problems(text.replace(row, row.replace("/dev/shm", "/tmp"))) == [
        "MMSHM_DIR: default '/tmp' in the table, '/dev/shm' declared"]


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", path.read_text(), re.M)}


def _broken_links(page: Path, only_docs: bool) -> list[str]:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or a heading of the same page
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve()
        if only_docs and not path.is_relative_to(DOCS):
            continue
        if not path.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def test_readme_links_into_docs_resolve():
    text = README.read_text()
    named = set(re.findall(r"docs/[\w./-]*\w", text))  # links, and paths in the text
    assert named  # the map of docs/
    assert sorted(n for n in named if not (ROOT / n).exists()) == []
    assert _broken_links(README, only_docs=False) == []


def test_links_inside_docs_resolve():
    pages = sorted(DOCS.glob("*.md"))
    assert pages
    assert [b for p in pages for b in _broken_links(p, only_docs=False)] == []
