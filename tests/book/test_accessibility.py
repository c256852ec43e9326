"""Accessibility of the built book, checked by axe-core in chromium.

axe-core is Deque's rules engine (the one behind Lighthouse's and the browsers' own
accessibility audits); the copy used is the one the PyPI package ``axe-playwright-python``
ships (pinned in requirements.txt; its ``axe.min.js`` is axe-core 4.12.1), injected into the
page already loaded for the other tests of the document (``book_view``: no extra page
load). Every page, at 1440 x 900 and at 390 x 844, may have no violation that axe rates
"serious" or "critical" (missing names on buttons and links, text under 4.5:1 contrast,
broken ARIA, ...). Minor and moderate findings are printed, not failed.

Run: ``TUTORIAL_BOOK_HTML=_build/html python -m pytest tests/book/test_accessibility.py``.
"""
from __future__ import annotations

from functools import lru_cache

import pytest

from test_reader import DESKTOP, PHONE  # tests/book is on sys.path (no package)

pytestmark = pytest.mark.browser

FAILING_IMPACTS = ("serious", "critical")


@lru_cache(maxsize=1)
def axe_source() -> str:
    from axe_playwright_python.base import AXE_FILE_PATH

    return AXE_FILE_PATH.read_text(encoding="utf-8")


# Colour contrast is axe's slowest rule by far (on chapter 4, 51 of 66 s: 14,000 of the
# page's 26,000 elements are the highlighted code's tokens).  A token's contrast depends only
# on its colour, its code box's background, its size, weight and opacity; so in the code
# boxes axe checks the first token with text of each such combination on the page and skips
# the other tokens that repeat it exactly (every rule but colour contrast still sees them all).
_SAMPLE_CODE_TOKENS = """() => {
    const seen = new Set();
    let skipped = 0;
    for (const box of document.querySelectorAll("div.highlight")) {
        const background = getComputedStyle(box).backgroundColor;
        for (const el of box.querySelectorAll("*")) {
            const own = [...el.childNodes].some(
                n => n.nodeType === Node.TEXT_NODE && n.textContent.trim());
            if (!own) { continue; }
            const s = getComputedStyle(el);
            const key = [s.color, background, s.fontSize, s.fontWeight, s.opacity].join("|");
            if (seen.has(key)) { el.setAttribute("data-axe-same-contrast", ""); skipped++; }
            else { seen.add(key); }
        }
    }
    axe.configure({rules: [{id: "color-contrast",
                            selector: "*:not([data-axe-same-contrast])"}]});
    return {checked: seen.size, skipped: skipped};
}"""

_UNSAMPLE_CODE_TOKENS = """() => {
    for (const el of document.querySelectorAll("[data-axe-same-contrast]")) {
        el.removeAttribute("data-axe-same-contrast");
    }
    axe.reset();
}"""

# Runs axe on the page as the reader sees it (folded solutions stay folded); returns each
# violation with up to 4 of its elements.  WCAG 2.x A and AA rules plus axe's best practices.
_RUN_AXE = """async () => {
    // preload false: axe would fetch every stylesheet again for its CSSOM, and a theme's
    // relative @import resolves against the page's root (a 404 the browser walk refuses)
    const result = await axe.run(document, {resultTypes: ["violations"], preload: false,
        runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa",
                                        "best-practice"]}});
    return result.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
        nodes: v.nodes.length,
        where: v.nodes.slice(0, 4).map(n => n.target.join(" ") + " :: "
                                       + (n.failureSummary || "").replace(/\\s+/g, " ").slice(0, 160))}));
}"""


def axe_violations(view) -> list[dict]:
    page = view.page
    # the page as a reader meets it: MathJax done, fonts in (its own too), and
    # _static/scroll-focus.js's marks redone after the last change (MathJax, a widget's
    # drawing, an unfolded cell, a font that finished loading)
    page.evaluate("""async () => {
        if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
            await MathJax.startup.promise;
        }
        await document.fonts.ready;
        return null;
    }""")
    page.wait_for_function("() => !window.scrollFocusPending || !window.scrollFocusPending()",
                           timeout=30_000)
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(axe_source())  # defines window.axe; fetches nothing
    page.evaluate(_SAMPLE_CODE_TOKENS)
    try:
        return page.evaluate(_RUN_AXE)
    finally:  # the page is shared with the document's other tests: leave it as found
        page.evaluate(_UNSAMPLE_CODE_TOKENS)


def assert_no_serious_violation(view, docname: str) -> None:
    found = axe_violations(view)
    width = view.page.viewport_size["width"]
    serious = [v for v in found if v["impact"] in FAILING_IMPACTS]
    for v in found:
        if v["impact"] not in FAILING_IMPACTS:
            print(f"axe ({v['impact']}) {docname} at {width} px: {v['id']} x{v['nodes']}")
    assert not serious, (f"{docname}.html at {width} px: " + "\n".join(
        f"{v['impact']} {v['id']} ({v['help']}) on {v['nodes']} elements:\n    "
        + "\n    ".join(v["where"]) for v in serious))


def test_axe_finds_nothing_serious_on_a_desktop(book_view, toc_docname):
    assert_no_serious_violation(book_view(toc_docname, DESKTOP), toc_docname)


def test_axe_finds_nothing_serious_on_a_phone(book_view, toc_docname):
    """The same at 390 px (a separate test, not a parameter: pytest keeps the tests of one
    document together, and they share its two loaded pages)."""
    assert_no_serious_violation(book_view(toc_docname, PHONE), toc_docname)


def test_axe_reports_what_it_must(fragment_page):
    """The check can fail: a nameless button (critical) and orange text on white (2.3:1, serious) are reported."""
    view = fragment_page('<main><h1>t</h1><button></button>'
                         '<p style="color:#f28e2b;background:#ffffff">orange words</p></main>')
    found = {v["id"]: v["impact"] for v in axe_violations(view)}
    assert found.get("button-name") == "critical", found
    assert found.get("color-contrast") == "serious", found


def test_sampling_the_code_tokens_still_finds_a_faint_colour(chromium_browser):
    """The colour-contrast sampling above keeps one token per colour and background: a
    faint colour repeated many times across two code boxes is still reported (once), and
    the sampling leaves no mark on the page afterwards."""
    tokens = "".join('<span style="color:#ddd">faint</span> <span style="color:#111">dark</span> '
                     for _ in range(25))
    box = f'<div class="highlight" style="background:#fff"><pre>{tokens}</pre></div>'
    context = chromium_browser.new_context()
    try:
        page = context.new_page()
        page.set_content(f'<html lang="en"><head><title>t</title></head><body><main>'
                         f'<h1>t</h1>{box}{box}</main></body></html>')
        page.evaluate(axe_source())
        assert page.evaluate(_SAMPLE_CODE_TOKENS) == {"checked": 2, "skipped": 98}
        try:
            found = page.evaluate(_RUN_AXE)
        finally:
            page.evaluate(_UNSAMPLE_CODE_TOKENS)
        contrast = [v for v in found if v["id"] == "color-contrast"]
        assert len(contrast) == 1 and contrast[0]["nodes"] == 1, found
        assert page.evaluate("() => document.querySelectorAll("
                             "'[data-axe-same-contrast]').length") == 0
    finally:
        context.close()
