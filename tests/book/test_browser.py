"""The built book in a real browser (Debian's chromium): pages load, nothing leaves
127.0.0.1, no JavaScript errors, and the chapters' widgets respond.

Run: ``python -m pytest tests/book -m browser``. The book is built once per session
(or reused from ``TUTORIAL_BOOK_HTML=_build/html``); see conftest.py.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

COMMUNICATOR_GROUPS = "notebooks/01_communicator_groups"
COLLECTIVES = "notebooks/02_collectives"


def wait_for_any(book_page, selector: str, where: str, timeout_ms: int = 10_000):
    """The locator for ``selector``, once at least one such element is in the page."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    found = book_page.page.locator(selector)
    try:
        found.first.wait_for(state="attached", timeout=timeout_ms)
    except PlaywrightTimeout:
        pytest.fail(f"no {selector} element on {where} after {timeout_ms} ms", pytrace=False)
    return found


def test_toc_page_loads_clean(book_view, toc_docname):
    """Every page in _toc.yml: HTTP 200, no page/console errors, no external request (on
    the desktop page test_reader.py's tests of the document share)."""
    docname = toc_docname
    view = book_view(docname, {"width": 1440, "height": 900})
    response = view.response
    assert response is not None and response.status == 200, \
        f"{docname}.html: HTTP {response.status if response else 'no response'}"
    assert view.page.locator("article h1").count() >= 1, f"{docname}.html has no title"
    view.assert_clean(f"{docname}.html")


def test_index_redirects_to_intro(book_page):
    book_page.open("index.html", settle_ms=0)
    book_page.page.wait_for_url("**/book/intro.html", timeout=10_000)
    book_page.assert_clean("index.html")


def test_math_renders_with_local_mathjax(book_page):
    """The glossary has formulas: MathJax (vendored) typesets them, fonts included."""
    book_page.open("book/glossary.html")
    book_page.page.wait_for_selector("mjx-container", timeout=10_000)
    assert book_page.page.locator("mjx-container").count() >= 5
    book_page.assert_clean("book/glossary.html")


def test_collectives_animation_plays(book_page, play_and_expect_advance):
    """Chapter 2: at least one animation; Play advances its frame within 3 s."""
    book_page.open(f"{COLLECTIVES}.html")
    anims = wait_for_any(book_page, ".tl-animation", f"{COLLECTIVES}.html")
    assert anims.count() >= 1
    before, after = play_and_expect_advance(book_page, ".tl-animation", timeout_ms=3000)
    assert after > before
    book_page.assert_clean(f"{COLLECTIVES}.html after Play")


def test_communicator_groups_rank_map_selects(book_page, click_and_expect_change):
    """Chapter 1: clicking a GPU cell of a rank map sets data-selected-rank on the map."""
    book_page.open(f"{COMMUNICATOR_GROUPS}.html")
    wait_for_any(book_page, ".tl-rank-map", f"{COMMUNICATOR_GROUPS}.html")
    cells = ".tl-rank-map >> nth=0 >> .tl-gpu"
    count = book_page.page.locator(cells).count()
    assert count >= 2, f"the first .tl-rank-map has {count} .tl-gpu cells; expected at least 2"
    # Two different cells, so the selection must follow the click, not just appear once.
    for index in (1, 0):
        before, after = click_and_expect_change(
            book_page, cells, nth=index, watch=".tl-rank-map", attribute="data-selected-rank")
        assert after is not None, "data-selected-rank was removed by the click"
        rank = book_page.page.locator(cells).nth(index).get_attribute("data-rank")
        if rank is not None:  # cells that say which rank they are must select that rank
            assert after == rank, f"clicked the cell of rank {rank}, selected rank is {after}"
    book_page.assert_clean(f"{COMMUNICATOR_GROUPS}.html after clicks")


def test_ipywidgets_render_offline(tiny_book_html, serve, open_book_page):
    """Saved ipywidgets state renders from the vendored _static JS: no CDN, fonts found.

    The notebook (test_build.WIDGET_NOTEBOOK, in the session's tiny book) sits in a
    subfolder, like the chapters, so relative paths are exercised.
    """
    page_html = (tiny_book_html / "notebooks" / "widgets.html").read_text()
    assert "application/vnd.jupyter.widget-state+json" in page_html, "widget state not saved"
    assert "_static/vendor/html-manager/embed-amd.mjs" in page_html
    assert "cdn.jsdelivr" not in page_html and "cdnjs" not in page_html

    page = open_book_page(serve(tiny_book_html))
    page.open("notebooks/widgets.html", settle_ms=1000)
    page.page.wait_for_selector(".widget-slider", timeout=10_000)
    assert page.page.locator(".widget-button").count() == 1
    assert page.page.locator(".widget-dropdown").count() == 1
    page.assert_clean("notebooks/widgets.html")
    fonts = [u for u in page.loaded if "/_static/vendor/html-manager/" in u
             and u.split("?")[0].endswith((".woff2", ".woff", ".ttf"))]
    assert fonts, "the button's icon font was not loaded from _static/vendor/html-manager/"
