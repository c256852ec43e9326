"""Chapters 1 and 2 as a reader meets them: shown code fits the column, the
guides page is linked where the guides first come up, every figure has a caption, the
ipywidgets explorer only runs where a kernel runs, and chapter 2 asserts no timing."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tutorial_lib.chapters import chapter

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHAPTERS = {number: chapter(number).notebook for number in (1, 2)}
CODE_WIDTH = 88  # characters: what a book page shows without scrolling sideways
INLINE_CODE = 40  # characters an unbreakable run of inline code may take on a 390 px phone
#: Symbols an inline formula may have: MathJax never breaks one. Measured in chromium at
#: 390 px: chapter 1's 34-symbol rank formula, in a list item, ran 118 px off the screen.
INLINE_MATH = 26

#: The last line of a code cell that draws a figure or a widget.
FIGURE = re.compile(r"^(good_map|bad_map|animate_\w+\(.*\)|plt\.show\(\))$")


def cells(chapter: int):
    return nbformat.read(NOTEBOOKS / CHAPTERS[chapter], as_version=4).cells


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_code_line_fits_the_column(chapter):
    long = [(i, len(line)) for i, c in enumerate(cells(chapter)) if c.cell_type == "code"
            for line in c.source.splitlines() if len(line) > CODE_WIDTH]
    assert not long, f"chapter {chapter}: (cell, length) of lines over {CODE_WIDTH}: {long}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_inline_code_forces_a_phone_to_scroll(chapter):
    """The theme breaks inline code only at spaces: a long run without one overflows.  A
    role's argument (``{cite}`key1,key2` ``) is not shown as code: it renders as text."""
    runs = [run for c in cells(chapter) if c.cell_type == "markdown"
            for code in re.findall(r"`([^`]+)`", re.sub(r"\{[\w:-]+\}`[^`]*`", "", c.source)) for run in code.split(" ")
            if len(run) > INLINE_CODE]
    assert not runs, runs


def symbols(tex: str) -> int:
    """Roughly the glyphs a TeX formula renders: commands and braces are not drawn."""
    tex = re.sub(r"\\text\{([^}]*)\}", r"\1", tex)
    tex = re.sub(r"\\(cdot|times|le|ge|lfloor|rfloor|bmod|partial|alpha|beta|to|dots)\b",
                 "x", tex)
    tex = re.sub(r"\\[a-zA-Z]+|\\[,;! ]", "", tex)
    return len(re.sub(r"[{}\s^_]", "", tex))


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_inline_formula_forces_a_phone_to_scroll(chapter):
    wide = [tex for c in cells(chapter) if c.cell_type == "markdown"
            for tex in re.findall(r"(?<![$\\])\$([^$\n]+)\$(?!\$)", c.source)
            if symbols(tex) > INLINE_MATH]
    assert not wide, wide


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_guides_page_is_linked_where_the_guides_first_come_up(chapter):
    prose = [c.source for c in cells(chapter) if c.cell_type == "markdown"]
    first = next((text for text in prose if re.search(r"\bguides?\b", text)), None)
    if first is None:
        pytest.skip(f"chapter {chapter} does not mention the guides")
    mention = re.search(r"\bguides?\b", first).start()
    link = first.find("](../book/guides.md)")
    assert 0 <= link and first.rfind("[", 0, mention) < mention < link, \
        "the first mention of the guides must be the text of a link to book/guides.md"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_figure_has_a_numbered_caption(chapter):
    listed = cells(chapter)
    numbers = []
    for i, c in enumerate(listed):
        if c.cell_type == "code" and FIGURE.match(c.source.strip().splitlines()[-1]):
            caption = listed[i + 1]
            found = re.match(rf"\*Figure {chapter}\.(\d+)\. ", caption.source)
            assert caption.cell_type == "markdown" and found, \
                f"chapter {chapter}, cell {i}: no '*Figure {chapter}.k. ...*' caption after it"
            numbers.append(int(found.group(1)))
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 2


def test_the_ipywidgets_explorer_runs_only_where_a_kernel_runs():
    """The explorer goes through ``live_or_static``: the book build (which announces itself
    to its kernels, scripts/build_book.sh) gets a one-line note and no widget state (3.6 MB
    before); nbval and a reader's kernel get the live explorer."""
    explorer = [c for c in cells(1) if c.cell_type == "code" and "rank_map_explorer(" in c.source]
    assert explorer, "chapter 1 no longer shows the explorer"
    for c in explorer:
        assert re.search(r"live_or_static\(\s*lambda: rank_map_explorer\(", c.source), c.source
    # the static maps, which work in the book, are still there
    assert sum("rank_map(" in c.source for c in cells(1) if c.cell_type == "code") >= 2


def test_chapter_2_asserts_no_timing():
    """Timings are shown beside a stored reference; no assert reads a measured duration."""
    for c in cells(2):
        if c.cell_type != "code":
            continue
        for line in c.source.splitlines():
            if line.strip().startswith("assert"):
                timed = re.sub(r"\.seconds > 0", "", line)  # a sanity check, not a timing
                assert not re.search(r"\.(seconds|duration)\b|measured_in|time\.time",
                                     timed), line
