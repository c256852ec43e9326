"""The chapter manifest (``tutorial_lib.chapters``) agrees with everything it registers.

``_toc.yml`` is the book's, so it is checked here rather than read: it lists the manifest's
notebooks in the manifest's order.  A notebook in ``notebooks/`` that the manifest lacks
fails, and so does an entry whose notebook, title, checkers, key table, stored timings or
exercises do not match what is on disk.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from tutorial_lib import chapters, reference
from tutorial_lib.chapters import CHAPTERS

REPO = Path(__file__).resolve().parents[2]


def toc_notebooks(toc: str) -> list[str]:
    """The notebooks a jb-book ``_toc.yml`` lists, in its order (``01_x.ipynb``)."""
    return [f"{Path(name).name}.ipynb" for name in
            re.findall(r"^\s*-\s*file:\s*notebooks/(\S+?)(?:\.ipynb)?\s*$", toc, re.M)]


def test_the_toc_lists_the_manifest_s_chapters_in_its_order():
    assert toc_notebooks((REPO / "_toc.yml").read_text()) == [c.notebook for c in CHAPTERS]


def test_the_toc_reader_sees_a_chapter_left_out_or_moved():
    """The check above can fail: a toc without chapter 2, or with 2 before 1, differs."""
    toc = (REPO / "_toc.yml").read_text()
    listed = toc_notebooks(toc)
    assert len(listed) == len(CHAPTERS) >= 2
    dropped = toc.replace("      - file: notebooks/02_collectives\n", "")
    assert toc_notebooks(dropped) == listed[:1] + listed[2:]
    swapped = toc.replace("notebooks/01_communicator_groups", "TMP").replace(
        "notebooks/02_collectives", "notebooks/01_communicator_groups").replace(
        "TMP", "notebooks/02_collectives")
    assert toc_notebooks(swapped)[:2] == listed[1::-1]


def test_the_intro_s_chapter_table_has_a_row_per_chapter_in_order():
    intro = (REPO / "book" / "intro.md").read_text(encoding="utf-8")
    table = intro.split("## What the chapters cover", 1)[1].split("\n\n")[1]
    numbers = re.findall(r"^\| (\d+) \|", table, re.M)
    assert [int(n) for n in numbers] == [c.number for c in CHAPTERS]


def test_numbers_run_from_1_in_order_and_name_the_notebooks():
    assert [c.number for c in CHAPTERS] == list(range(1, len(CHAPTERS) + 1))
    for entry in CHAPTERS:
        assert re.fullmatch(rf"{entry.key}_[a-z0-9_]+\.ipynb", entry.notebook), entry
        assert entry.path.is_file(), f"{entry.notebook} is registered but not in notebooks/"


def test_every_notebook_in_the_folder_is_registered():
    assert chapters.unregistered_notebooks() == []


def test_a_notebook_missing_from_the_manifest_is_found(tmp_path):
    """A chapter added to notebooks/ without its entry is named (and only it)."""
    for entry in CHAPTERS[:2]:
        shutil.copy(entry.path, tmp_path / entry.notebook)
    (tmp_path / "99_unregistered_chapter.ipynb").write_text("{}")
    (tmp_path / "scratch.ipynb").write_text("{}")  # not a chapter's name: not a chapter
    assert chapters.unregistered_notebooks(tmp_path) == ["99_unregistered_chapter.ipynb"]


@pytest.mark.parametrize("entry", CHAPTERS, ids=lambda c: c.key)
def test_the_title_is_the_notebook_s_heading(entry):
    first = nbformat.read(entry.path, as_version=4).cells[0].source.splitlines()[0]
    assert first == f"# {entry.number}. {entry.title}"


def test_lookup_by_number_stem_file_or_prefix_and_a_clear_error():
    third = CHAPTERS[2]
    assert {chapters.chapter(w) for w in (3, third.stem, third.notebook, "03")} == {third}
    with pytest.raises(KeyError, match=r"no chapter 99 .*1 \(01_communicator_groups\).*"
                                       r"Adding a chapter"):
        chapters.chapter(99)


def test_each_checkers_module_exists_and_checks_the_chapter_s_exercises():
    """The checkers module of each entry exists, and the exercise list of the tests
    (tests/notebook_cells.py) has one entry per chapter with checkers, whose checkers all
    come from that module."""
    from ..notebook_cells import CHAPTERS as EXERCISES

    exercises = {c.number: c for c in EXERCISES}
    assert sorted(exercises) == [c.number for c in CHAPTERS if c.checkers]
    for entry in CHAPTERS:
        if entry.checkers is None:
            continue
        assert (REPO / "tutorial_lib" / "exercises" / f"{entry.checkers}.py").is_file()
        modules = {e.checker.__module__ for e in exercises[entry.number].exercises}
        assert modules == {entry.checkers_module}, entry.stem


def test_each_key_table_is_the_cheat_sheet_s():
    from tutorial_lib.viz import cheatsheet

    assert sorted(cheatsheet.KEY_TABLES) == [c.number for c in CHAPTERS]
    for entry in CHAPTERS:
        assert cheatsheet.KEY_TABLES[entry.number] is getattr(cheatsheet, entry.key_table)


def test_every_stored_timing_belongs_to_the_chapters_that_show_it():
    """Each reference an entry lists is stored and loaded by its notebook, and every stored
    reference but the run times of all chapters is listed by some chapter."""
    stored = {p.stem for p in reference.REFERENCE_DIR.glob("*.json")}
    listed = {name for c in CHAPTERS for name in c.references}
    assert stored - listed == {"chapter_times"}
    for entry in CHAPTERS:
        source = entry.path.read_text(encoding="utf-8")
        for name in entry.references:
            assert name in stored and name in source, (entry.stem, name)
    times = json.loads((reference.REFERENCE_DIR / "chapter_times.json").read_text())
    assert [row["chapter"] for row in times["rows"]] == chapters.stems()


def test_the_manifest_imports_nothing_of_the_library_nor_torch():
    tree = ast.parse((REPO / "tutorial_lib" / "chapters.py").read_text())
    imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    imports |= {f"{'.' * node.level}{node.module or ''}" for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)}
    assert imports == {"__future__", "dataclasses", "pathlib"}, imports
