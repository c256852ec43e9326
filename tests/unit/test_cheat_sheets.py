"""For the instructor: a one-page cheat sheet per chapter, suitable for slides,
written by the build (scripts/build_book.sh runs scripts/cheat_sheets.py). Each is a
standalone page (nothing fetched, no script) with the chapter's objectives, its key table
computed by tutorial_lib.viz.cheatsheet, and its takeaways."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tutorial_lib.chapters import stems
from tutorial_lib.viz import cheatsheet
from tests.asserts import every

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = stems()


def script():
    spec = importlib.util.spec_from_file_location("cheat_sheets", ROOT / "scripts" /
                                                  "cheat_sheets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sheets(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("sheets")
    written = script().write_sheets(out)
    return {p.stem: p.read_text(encoding="utf-8") for p in written}


def test_every_chapter_has_a_sheet_and_the_index_links_them(sheets):
    assert sorted(s for s in sheets if s != "index") == CHAPTERS
    for stem in CHAPTERS:
        assert f'href="{stem}.html"' in sheets["index"]


@pytest.mark.parametrize("stem", CHAPTERS)
def test_a_sheet_is_standalone_and_holds_the_chapter(sheets, stem):
    page = sheets[stem]
    number, title, objectives, takeaways = script().chapter_text(
        ROOT / "notebooks" / f"{stem}.ipynb")
    assert page.startswith("<!DOCTYPE html>") and f"Chapter {number}." in page
    # loads nothing: the favicon is inline, the links are the reader's to follow
    assert not re.search(r"<script|src=|https?://(?!www.w3.org/2000/svg)", page)
    assert re.findall(r"<link [^>]*>", page) == [
        f'<link rel="icon" type="image/svg+xml" href="{cheatsheet.FAVICON}">']
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    assert f'<a href="../notebooks/{stem}.html">Chapter {number} in the book</a>' in page
    assert "\\&" not in page  # TeX's F\&B spelled F&amp;B
    assert 3 <= len(objectives) <= 5 and len(takeaways) >= 4
    assert page.count("<li>") == len(objectives) + len(takeaways)
    assert "$" not in page and "\\frac" not in page  # TeX spelled out: no MathJax here
    table = cheatsheet.key_table(number)
    assert page.count("<tr>") == len(table.rows) + 1
    assert every(cheatsheet.plain(cell) in page for row in table.rows for cell in row)


def test_the_key_tables_are_the_library_s():
    """A few numbers the chapters assert, read from the sheets' tables."""
    groups = {row[0]: row for row in cheatsheet.key_table(1).rows}
    assert groups["`pp`"][2:] == ["[5, 13]", "yes"] and groups["`tp`"][3] == "no"
    bubble = {row[0]: row for row in cheatsheet.key_table(6).rows}
    assert bubble["1f1b"][2] == bubble["1f1b"][3] == f"{3 / 11:.3f}"
    assert bubble["gpipe"][4] == "8" and bubble["1f1b"][4] == "4"
    wire = {row[0]: row for row in cheatsheet.key_table(8).rows}
    assert wire["fp8"][1] == "7,392" and wire["fp8"][2] == "51.6 %"
    losses = {row[0]: row[1:3] for row in cheatsheet.key_table(5).rows}
    assert losses == {"expert": ["1", "4"], "device": ["1", "4"], "communication": ["1", "2"]}
    memory = {tuple(row[:2]): row[2:] for row in cheatsheet.key_table(10).rows}
    assert memory["bf16", "plain DP"] == ["18.00"] * 3  # Megatron's 18 bytes per parameter
    zero_bubble = {row[0]: row for row in cheatsheet.key_table(11).rows}
    assert [zero_bubble[n][1] for n in ("1f1b", "zb-h1", "zbv", "dualpipev", "dualpipe")] \
        == ["9", "3", "1.5", "3", "2"]
    assert zero_bubble["dualpipe"][3:] == ["5", "2x"]
    last = len(stems())
    with pytest.raises(ValueError, match=f"chapters are 1 to {last}"):
        cheatsheet.key_table(last + 1)


def test_plain_spells_tex_and_markdown():
    assert cheatsheet.plain(r"$2\frac{N-1}{N}B$ in `ring`, **bold**") == \
        "2(N-1)/(N)B in <code>ring</code>, <b>bold</b>"
    assert cheatsheet.plain(r"$\left(a \le b\right)$ <x>") == "(a ≤ b) &lt;x&gt;"


def test_the_overlapped_pair_reads_f_and_b(sheets):
    assert "overlapped F&amp;B pairs" in sheets["11_zero_bubble_dualpipe"]


def test_the_index_has_the_sheets_head_and_links_back_to_the_book(sheets):
    index = sheets["index"]
    assert index.startswith(cheatsheet.page_head("Cheat sheets"))
    assert '<a href="../intro.html">The book</a>' in index
