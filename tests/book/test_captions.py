"""Captions and citations on the built book (its HTML read as text; no browser).

A chapter's caption is a markdown line in one style, ``*Figure 8.1. ...*`` or
``*Table 4.2. ...*``, under the cell whose output it describes; the book's extension
(``_ext/course_book.py``, ``NumberedCaptions``) wraps that cell and the caption in one
``<figure class="course-figure" id="figure-8-1">`` with a ``<figcaption>``. Chapter 8 once
lost the cell that drew its tile explorer and kept the caption, which then described
nothing: here every caption must sit in such a figure, under an output that rendered
something, and the numbers of a chapter run 1, 2, 3, ... for figures and for tables.

The citations: every chapter cites the bibliography (``{cite}``) and ends with "Further
reading"; the bibliography page lists every entry of ``references.bib``.

Run: ``python -m pytest tests/book/test_captions.py`` (builds the book once), or
``TUTORIAL_BOOK_HTML=_build/html python -m pytest tests/book/test_captions.py``.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from bs4 import BeautifulSoup

REPO = Path(__file__).resolve().parents[2]
CAPTION = re.compile(r"^(Figure|Table) (\d+)\.(\d+)\. ")
CHAPTERS = sorted(f"notebooks/{path.stem}"
                  for path in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DRAWN = ("img", "svg", "canvas", "table", "iframe", "video")
"""Elements that show something even without text."""


def page(book_html, docname: str) -> BeautifulSoup:
    return BeautifulSoup((book_html / f"{docname}.html").read_text(encoding="utf-8"),
                         "html.parser")


def captions(soup: BeautifulSoup) -> list:
    """Every paragraph that is a caption: all of it one emphasis starting "Figure N.M. "."""
    found = []
    for paragraph in soup.select("article p"):
        children = [c for c in paragraph.children if getattr(c, "name", None)
                    or str(c).strip()]
        if (len(children) == 1 and getattr(children[0], "name", None) == "em"
                and CAPTION.match(paragraph.get_text(" ", strip=True))):
            found.append(paragraph)
    return found


def shows_something(output) -> bool:
    """Whether a cell's output area rendered a figure, a widget, a table or text."""
    if "traceback" in output.get_text(" ", strip=True).lower():
        return False
    return bool(output.get_text(strip=True)) or output.find(DRAWN) is not None


def chapter_number(docname: str) -> int:
    return int(docname.split("/")[-1][:2])


@pytest.mark.parametrize("docname", CHAPTERS)
def test_every_caption_follows_a_rendered_output(book_html, docname):
    soup = page(book_html, docname)
    found = captions(soup)
    assert found, f"{docname}: no caption at all"
    for paragraph in found:
        label = CAPTION.match(paragraph.get_text(" ", strip=True)).group(0).strip()
        figcaption = paragraph.find_parent("figcaption")
        assert figcaption is not None, f"{docname}: {label!r} is not a figure's caption"
        figure = figcaption.find_parent("figure")
        assert figure is not None and "course-figure" in figure.get("class", []), label
        cell = figure.find("div", class_="cell")
        assert cell is not None and cell.sourceline < figcaption.sourceline, (
            f"{docname}: {label!r} has no cell above it")
        outputs = cell.find_all("div", class_="cell_output")
        assert any(shows_something(o) for o in outputs), (
            f"{docname}: {label!r} follows a cell that rendered nothing")


@pytest.mark.parametrize("docname", CHAPTERS)
def test_captions_are_numbered_in_order_and_can_be_linked(book_html, docname):
    soup = page(book_html, docname)
    number = chapter_number(docname)
    seen = {"Figure": 0, "Table": 0}
    for paragraph in captions(soup):
        kind, chapter, index = CAPTION.match(paragraph.get_text(" ", strip=True)).groups()
        seen[kind] += 1
        assert (int(chapter), int(index)) == (number, seen[kind]), (
            f"{docname}: {kind} {chapter}.{index} where {kind} {number}.{seen[kind]} "
            f"comes next")
        figure = paragraph.find_parent("figure")
        assert f"{kind.lower()}-{number}-{index}" in figure.get("id", "").split(), figure


def test_the_bibliography_lists_every_entry(book_html):
    keys = re.findall(r"^@\w+\{([^,]+),", (REPO / "references.bib").read_text(), re.M)
    soup = page(book_html, "book/bibliography")
    entries = soup.select("div.citation, dl.citation > dt, .footnote-list .citation")
    assert len(keys) >= 20 and len(entries) >= len(keys), (len(keys), len(entries))


@pytest.mark.parametrize("docname", CHAPTERS)
def test_each_chapter_cites_and_ends_with_further_reading(book_html, docname):
    soup = page(book_html, docname)
    cites = [a for a in soup.select("span.bibtex-citation a")
             if "bibliography.html" in a.get("href", "")]
    assert cites, f"{docname}: no citation of the bibliography"
    headings = [h.get_text(" ", strip=True).rstrip("#").strip()
                for h in soup.select("article h2")]
    assert headings and headings[-1] == "Further reading", headings[-3:]
