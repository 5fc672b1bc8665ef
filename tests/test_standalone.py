"""The repository stands alone: no file points outside it (the shared spec or fixtures beside a
checkout), and every `docs/<name>.md §N` that the code cites names a file and section that exist."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# written in pieces so that this file does not match itself
SHARED = "shared"
OUTSIDE = re.compile(r"\.\./" + SHARED + r"\b|\b" + SHARED + r"/(?:spec|fixtures|device)\b")
SKIPPED_DIRS = {".git", ".venv", "artifacts", "__pycache__", ".ruff_cache", ".pytest_cache"}
SPECS = ("contract", "model", "engines", "anchors", "wire-formats")
# `docs/contract.md §2.2-2.6, §4.1`: the file, then its section references
CITATION = re.compile(
    r"docs/(" + "|".join(SPECS) + r")\.md((?:,? ?§\d+(?:\.\d+)*(?:-§?\d+(?:\.\d+)*)?)*)"
)
ITEM = re.compile(r"(\d+)\. ")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
DOCS_FILE = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.md)\b")
LINK = re.compile(r"\]\(((?:\.\./)*docs/|(?:\./)?)(" + "|".join(SPECS) + r")\.md#([^)\s]+)\)")


def repository_files() -> list[Path]:
    """Tracked files (git ls-files), or every file under the root outside caches and .git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
        ).stdout
        names = [name for name in out.decode().split("\0") if name]
    except (subprocess.CalledProcessError, FileNotFoundError):
        names = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            names += [str(Path(folder, name).relative_to(ROOT)) for name in files]
    return [ROOT / name for name in names if (ROOT / name).is_file()]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary


def outside_references(text: str) -> list[int]:
    """Line numbers (1-based) of the lines that point at the shared tree outside the repository."""
    return [n for n, line in enumerate(text.split("\n"), 1) if OUTSIDE.search(line)]


def sections_of(doc: str) -> set[str]:
    """Section numbers of a spec file: its headings (`## 2. Request JSON` -> "2") and the
    numbered items of a top-level section (item 4 under `## 0. Decisive facts` -> "0.4")."""
    sections, top = set(), None
    for line in doc.split("\n"):
        heading = HEADING.match(line + " ")
        if heading:
            sections.add(heading[1])
            top = heading[1] if line.startswith("## ") else None
        elif top is not None and (item := ITEM.match(line)):
            sections.add(f"{top}.{item[1]}")
    return sections


def anchors_of(doc: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    anchors = set()
    for line in doc.split("\n"):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def cited_sections(text: str) -> list[tuple[str, str]]:
    """(spec name, section) for each section a `docs/<spec>.md §...` citation names; a range
    names its two ends."""
    cited = []
    for match in CITATION.finditer(text):
        cited += [(match[1], number) for number in SECTION.findall(match[2].replace("-", " §"))]
    return cited


FILES = repository_files()
TEXTS = {path: text for path in FILES if (text := text_of(path)) is not None}


def test_the_scan_sees_a_reference_outside():
    assert outside_references(f"see ../{SHARED}/x\nnothing\n{SHARED}/spec/contract.md") == [1, 3]
    assert outside_references("the shared prefix; shared/specifics") == []


def test_no_file_points_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {text.split(chr(10))[number - 1].strip()[:100]}"
        for path, text in TEXTS.items()
        for number in outside_references(text)
    ]
    assert not found, "files point outside the repository:\n" + "\n".join(found)


def test_the_fixtures_are_in_the_repository():
    from tests.spec import FIXTURES

    assert FIXTURES.is_relative_to(ROOT)
    for name in ("processing.json", "pixels.json", "heads.json", "features.json", "finish.json"):
        assert (FIXTURES / name).is_file(), name
    assert (FIXTURES / "README.md").is_file()


def test_the_scan_reads_citations():
    text = "(docs/contract.md §2.2-2.6, §4.1) and docs/model.md §2-§5; docs/anchors.md"
    assert cited_sections(text) == [
        ("contract", "2.2"),
        ("contract", "2.6"),
        ("contract", "4.1"),
        ("model", "2"),
        ("model", "5"),
    ]


@pytest.mark.parametrize("spec", SPECS)
def test_every_cited_section_exists(spec):
    doc_path = ROOT / "docs" / f"{spec}.md"
    citing = {
        path: [number for name, number in cited_sections(text) if name == spec]
        for path, text in TEXTS.items()
        if f"docs/{spec}.md" in text and path != doc_path
    }
    if not citing:
        pytest.skip(f"nothing cites docs/{spec}.md")
    assert doc_path.is_file(), f"docs/{spec}.md is cited but missing"
    sections = sections_of(doc_path.read_text(encoding="utf-8"))
    missing = [
        f"{path.relative_to(ROOT)}: §{number}"
        for path, numbers in citing.items()
        for number in numbers
        if number not in sections
    ]
    assert not missing, f"sections not in docs/{spec}.md:\n" + "\n".join(missing)


def test_every_docs_file_named_in_code_exists():
    named = {
        (path.relative_to(ROOT), name)
        for path, text in TEXTS.items()
        if path.suffix == ".py"
        for name in DOCS_FILE.findall(text)
    }
    missing = [f"{path}: {name}" for path, name in sorted(named) if not (ROOT / name).is_file()]
    assert not missing, "docs files named in code but missing:\n" + "\n".join(missing)


def test_every_linked_anchor_exists():
    missing = []
    for path, text in TEXTS.items():
        if path.suffix != ".md":
            continue
        for prefix, spec, anchor in LINK.findall(text):
            target = (path.parent / f"{prefix}{spec}.md").resolve()
            if not target.is_file() or anchor not in anchors_of(target.read_text("utf-8")):
                missing.append(f"{path.relative_to(ROOT)}: {prefix}{spec}.md#{anchor}")
    assert not missing, "links to missing files or headings:\n" + "\n".join(missing)
