"""The built book as a reader meets it: on a phone (390 x 844) and a desktop (1440 x 900).

A walk through the book in chromium at both sizes found: the visible sidebar toggles
did nothing on a phone; pages scrolled sideways on a phone; code cells scrolled sideways
on a desktop; widget labels shrank to 4 px on a phone; every page carried Font Awesome's
1.5 MB script, and chapter 1 3.6 MB of a dead ipywidgets explorer; folded solutions were
labelled like any other folded cell, and an unfilled exercise's check read as an error.
Each test here checks one of those on the real built book (built once per session, or
``TUTORIAL_BOOK_HTML=_build/html``; see conftest.py).  The page weights are printed at
the end of the run.

Run: ``python -m pytest tests/book/test_reader.py``.
"""
from __future__ import annotations

import gzip
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.browser

PHONE = {"width": 390, "height": 844}
"""A phone's CSS viewport (iPhone 12 to 15)."""
DESKTOP = {"width": 1440, "height": 900}

CHAPTER = "notebooks/03_tp_dp"
MIN_TEXT_PX = 9.0
PAGE_BUDGET = 4_000_000
"""Raw bytes a page may load (everything: HTML, CSS, scripts, fonts, images).  Before
that walk a chapter loaded 4.2 to 4.9 MB, chapter 1 8.3 MB."""


@pytest.fixture
def page_at(open_book_page, book_server):
    """``page_at(viewport) -> BookPage`` on the served real book."""
    return lambda viewport: open_book_page(book_server, viewport)


def is_chapter(docname: str) -> bool:
    return docname.startswith("notebooks/")


# --- the menus ---------------------------------------------------------------------------

_OPEN = "sel => { const d = document.querySelector(sel); return d !== null && d.open; }"
_SHUT = "sel => { const d = document.querySelector(sel); return d !== null && !d.open; }"


def test_menus_open_on_a_phone(page_at):
    """At 390 px the visible chapter-list and "On this page" buttons open their panels."""
    view = page_at(PHONE)
    view.open(f"{CHAPTER}.html")
    page = view.page
    for toggle, dialog, link in (
            (".primary-toggle", "#pst-primary-sidebar-modal", "a[href$='07_p2p_modes.html']"),
            (".secondary-toggle", "#pst-secondary-sidebar-modal", "a.nav-link[href^='#']")):
        buttons = page.locator(f"{toggle}:visible")
        assert buttons.count() == 1, f"{buttons.count()} visible {toggle} buttons at 390 px"
        buttons.click()
        page.wait_for_function(_OPEN, arg=dialog, timeout=3000)
        target = page.locator(f"{dialog} {link}").first
        assert target.is_visible(), f"{dialog} opened without a visible {link}"
        page.keyboard.press("Escape")
        page.wait_for_function(_SHUT, arg=dialog, timeout=3000)

    # and the chapter list leads somewhere
    page.locator(".primary-toggle:visible").click()
    page.wait_for_function(_OPEN, arg="#pst-primary-sidebar-modal", timeout=3000)
    page.locator("#pst-primary-sidebar-modal a[href$='07_p2p_modes.html']").first.click()
    page.wait_for_url("**/07_p2p_modes.html", timeout=10_000)
    view.assert_clean(f"{CHAPTER}.html and 07_p2p_modes.html at 390 px")


def test_the_chapter_list_folds_away_on_a_desktop(page_at):
    """At 1440 px the same button hides and shows the chapter list beside the page."""
    view = page_at(DESKTOP)
    view.open(f"{CHAPTER}.html")
    page, sidebar = view.page, view.page.locator("#pst-primary-sidebar")
    assert sidebar.is_visible()
    page.locator(".primary-toggle:visible").click()
    page.wait_for_function("() => document.querySelector('#pst-primary-sidebar')"
                           ".classList.contains('pst-sidebar-hidden')", timeout=3000)
    page.locator(".primary-toggle:visible").click()
    page.wait_for_function("() => !document.querySelector('#pst-primary-sidebar')"
                           ".classList.contains('pst-sidebar-hidden')", timeout=3000)
    view.assert_clean()


# --- nothing wider than the screen ---------------------------------------------------------

_STICKING_OUT = """() => {
    const W = document.documentElement.clientWidth;
    const scrolls = e => ["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(e).overflowX);
    const out = [];
    for (const el of document.querySelectorAll("article *")) {
        const box = el.getBoundingClientRect();
        if (box.right <= W + 1 || box.width === 0) continue;
        let p = el.parentElement, inside = false;
        while (p && p !== document.body) { if (scrolls(p)) { inside = true; break; } p = p.parentElement; }
        if (!inside) out.push(el.tagName.toLowerCase() + "." + String(el.className).slice(0, 40)
                              + " right=" + Math.round(box.right) + ": "
                              + (el.textContent || "").trim().slice(0, 60));
    }
    return [document.documentElement.scrollWidth, W, out.slice(0, 8)];
}"""


def test_no_page_scrolls_sideways_on_a_phone(book_view, toc_docname):
    view = book_view(toc_docname, PHONE)
    width, screen, culprits = view.page.evaluate(_STICKING_OUT)
    assert width <= screen, (f"{toc_docname}.html is {width} px wide on a {screen} px screen; "
                             "sticking out:\n  " + "\n  ".join(culprits))


_WIDE_CODE = """() => {
    const shut = [...document.querySelectorAll("details")].filter(d => !d.open);
    shut.forEach(d => { d.open = true; });  // solutions too
    const out = [];
    const check = (what, pre, i) => {
        if (pre.scrollWidth > pre.clientWidth + 1) {
            const longest = Math.max(...pre.textContent.split("\\n").map(l => l.length));
            out.push(what + " " + i + ": " + longest + " characters, " + pre.scrollWidth
                     + " px in a " + pre.clientWidth + " px column: "
                     + pre.textContent.trim().slice(0, 60));
        }
    };
    document.querySelectorAll(".cell_input pre").forEach((pre, i) => check("code cell", pre, i));
    // printed text and shown source in the outputs wrap at the column (_static/course.css)
    document.querySelectorAll(".cell_output pre").forEach((pre, i) => check("output", pre, i));
    shut.forEach(d => { d.open = false; });  // as they were, for the next test
    return [document.querySelectorAll(".cell_input pre").length, out];
}"""


def test_shown_code_fits_the_column_on_a_desktop(book_view, toc_docname):
    """No code cell (solutions unfolded) scrolls sideways at 1440 px (~89 characters fit;
    tests/unit/test_notebook_code_width.py holds the notebooks to 88), and no printed output
    either (shown source, a validator's message: they wrap at the column)."""
    if not is_chapter(toc_docname):
        pytest.skip("no code cells")
    view = book_view(toc_docname, DESKTOP)
    cells, wide = view.page.evaluate(_WIDE_CODE)
    assert cells > 0
    assert not wide, (f"{toc_docname}.html: {len(wide)} code cells or outputs ({cells} code "
                      "cells) scroll sideways:\n  " + "\n  ".join(wide[:12]))


# --- widgets readable ------------------------------------------------------------------------

_SMALL_TEXT = """(minPx) => {
    const roots = [...document.querySelectorAll("[data-ready='1']")];
    const frames = roots.flatMap(r => [...r.querySelectorAll(".tl-frame")]);
    const shown = frames.map(f => f.style.display);
    frames.forEach(f => { f.style.display = ""; });
    const small = [];
    let texts = 0;
    for (const root of roots) {
        for (const t of root.querySelectorAll("svg text")) {
            const m = t.getScreenCTM();
            if (!m || !t.textContent.trim()) continue;
            texts++;
            const px = parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b);
            if (px < minPx - 0.05) small.push(px.toFixed(1) + " px '" + t.textContent.trim().slice(0, 20)
                                       + "' in " + root.id);
        }
        for (const el of root.querySelectorAll("*")) {
            if (el.closest("svg") || !el.getClientRects().length) continue;
            const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
            if (!own) continue;
            texts++;
            const px = parseFloat(getComputedStyle(el).fontSize);
            if (px < minPx - 0.05) small.push(px.toFixed(1) + " px '" + el.textContent.trim().slice(0, 20)
                                       + "' in " + root.id);
        }
    }
    frames.forEach((f, i) => { f.style.display = shown[i]; });  // as they were
    return [roots.length, texts, small];
}"""


def assert_widget_text_is_readable(view, toc_docname) -> None:
    roots, texts, small = view.page.evaluate(_SMALL_TEXT, MIN_TEXT_PX)
    width = view.page.viewport_size["width"]
    assert not small, (f"{toc_docname}.html at {width} px: {len(small)} of {texts} "
                       f"labels in {roots} widgets are under {MIN_TEXT_PX:g} px:\n  "
                       + "\n  ".join(small[:10]))


def test_widget_text_is_readable_on_a_phone(book_view, toc_docname):
    """Every label of every course widget (every frame shown) is at least 9 px on screen."""
    if not is_chapter(toc_docname):
        pytest.skip("no widgets")
    assert_widget_text_is_readable(book_view(toc_docname, PHONE), toc_docname)


def test_widget_text_is_readable_on_a_desktop(book_view, toc_docname):
    """The same at 1440 px (a separate test, not a parameter: pytest then keeps every
    test of a document together, and they share its two loaded pages)."""
    if not is_chapter(toc_docname):
        pytest.skip("no widgets")
    assert_widget_text_is_readable(book_view(toc_docname, DESKTOP), toc_docname)


# --- page weight -------------------------------------------------------------------------------


def test_page_weight(book_view, book_server, page_weights, toc_docname):
    """Weigh what a page loads (printed at the end of the run), and what it must not load:
    Font Awesome's script (the theme's web font draws the icons), MathJax on a page without
    math, the widget manager on a page without saved widget state."""
    view = book_view(toc_docname, DESKTOP)
    files = {}
    for response in view.responses:
        path = urlsplit(response.url).path
        if response.status >= 300 or not response.url.startswith(book_server):
            continue
        try:
            files[path] = response.body()
        except Exception:  # noqa: BLE001 - a body the browser did not keep (none here)
            continue
    raw = sum(len(b) for b in files.values())
    page_weights[toc_docname] = {
        "requests": len(files), "bytes": raw,
        "gzip_bytes": sum(len(gzip.compress(b, 6)) for b in files.values()),
        "largest": [(p.rsplit("/", 1)[-1], len(b)) for p, b in
                    sorted(files.items(), key=lambda kv: -len(kv[1]))[:3]],
    }
    names = [p.rsplit("/", 1)[-1] for p in files]
    page = view.page
    assert "fontawesome.js" not in names
    has_math = page.locator("article .math").count() > 0
    assert any("/vendor/mathjax/" in p for p in files) == has_math, \
        f"MathJax loaded: {not has_math}, the page has math: {has_math}"
    has_widgets = page.locator("script[type='application/vnd.jupyter.widget-state+json']").count() > 0
    assert ("embed-amd.mjs" in names) == has_widgets
    assert "favicon.svg" in names, "no favicon: the browser asks for /favicon.ico and gets a 404"
    assert raw <= PAGE_BUDGET, f"{toc_docname}.html loads {raw:,} bytes (budget {PAGE_BUDGET:,})"
    view.assert_clean()


def test_math_typesets_with_the_lean_mathjax(book_view, toc_docname):
    """Every formula of the page is typeset by the components _config.yml loads: none left
    as TeX source, none an error, no macro unknown (noundefined would show it in red)."""
    view = book_view(toc_docname, DESKTOP)
    page = view.page
    formulas = page.locator("article .math").count()
    if not formulas:
        pytest.skip("no math")
    page.wait_for_function("n => document.querySelectorAll('article .math mjx-container')"
                           ".length >= n", arg=formulas, timeout=15_000)
    assert page.locator("mjx-merror").count() == 0
    red = page.locator("mjx-container [style*='color: red']").all_text_contents()
    assert not red, f"{toc_docname}.html: unknown TeX macros: {red[:5]}"
    view.assert_clean()


# --- exercises -----------------------------------------------------------------------------------


def test_solutions_are_labelled_and_checks_invite(book_view, toc_docname):
    """A folded solution says "Show solution"; an unfilled exercise's check invites."""
    if not is_chapter(toc_docname):
        pytest.skip("no exercises")
    view = book_view(toc_docname, DESKTOP)
    page = view.page
    labels = page.locator(".cell.tag_solution > details summary .collapsed").all_text_contents()
    assert labels and all(label.strip() == "Show solution" for label in labels), labels
    others = page.locator(".cell:not(.tag_solution) > details summary .collapsed").all_text_contents()
    assert "Show solution" not in [o.strip() for o in others]
    checks = page.locator(".tl-check[data-passed='false']")
    for text in checks.all_text_contents():
        assert text.startswith("Your turn") and "NOT YET" not in text, text[:120]
