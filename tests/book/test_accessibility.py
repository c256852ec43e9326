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


# Colour contrast is axe's slowest rule by far: about 5 ms of this machine's CPU per text
# element, and chapter 4 has 16,000 (13,000 of them the highlighted code's tokens).  Whether
# a text passes depends only on what axe feeds its contrast formula: the text's colour,
# size, weight and shadow, and the backgrounds it sits on.  So before axe runs, every element
# with text of its own gets a key of exactly those inputs, the backgrounds read up its
# ancestors to the first opaque one (with their opacities); the first visible element of
# each key with a letter or digit is checked, and the elements that repeat its key exactly
# are skipped.  An element is always checked when its key cannot be read that way: a box on
# its way up is positioned (other than relative), transformed, filtered, blended or has a
# background image, or the text lies over a positioned box that paints a background and is
# not one of its ancestors.  A key whose first element axe did not check (hidden from it,
# say) has all its elements checked in a second pass.  The code boxes' repeated tokens are
# also turned into plain text while axe runs (a bare highlighting span concerns no other
# rule, and axe's set-up costs by element); everything is put back afterwards: the page is
# shared with the document's other tests.
_SAMPLE_CONTRAST = """() => {
    const SAME = "data-axe-same-contrast", KEY = "data-axe-contrast-key";
    const all = [...document.body.querySelectorAll("*")];
    const before = document.querySelectorAll("*").length;  // elements, tokens included
    const paints = s => s.backgroundImage !== "none" || !/^(transparent|rgba\\(.*, 0\\))$/.test(
        s.backgroundColor);
    const covers = all.filter(el => {
        const s = getComputedStyle(el);
        return s.position !== "static" && s.position !== "relative" && paints(s);
    }).map(el => [el, el.getBoundingClientRect()]);
    const plain = s => (s.position === "static" || s.position === "relative")
        && s.transform === "none" && s.filter === "none" && s.mixBlendMode === "normal"
        && s.backdropFilter === "none" && s.backgroundImage === "none";
    const chains = new Map();  // element -> its backgrounds up to an opaque one, or null
    function backgrounds(el) {
        if (el === null) { return "canvas"; }
        if (!chains.has(el)) {
            const s = getComputedStyle(el);
            let chain = null;
            const own = s.backgroundColor + "@" + s.opacity;
            const opaque = /^rgb\\(/.test(s.backgroundColor) && s.opacity === "1";
            const clear = !paints(s) && s.opacity === "1";  // changes nothing under it
            if (plain(s) && opaque) {
                chain = own;  // nothing under it shows
            } else if (plain(s)) {
                const above = backgrounds(el.parentElement);
                if (above !== null) { chain = clear ? above : own + "/" + above; }
            }
            chains.set(el, chain);
        }
        return chains.get(el);
    }
    const ownText = el => [...el.childNodes].filter(n => n.nodeType === Node.TEXT_NODE)
        .map(n => n.textContent).join("");
    const overlaps = (a, b) => a.left < b.right && b.left < a.right
        && a.top < b.bottom && b.top < a.bottom;
    const groups = new Map();  // key -> its elements, in the page's order
    for (const el of all) {
        const text = ownText(el);
        if (!text.trim() || /^(INPUT|SELECT|TEXTAREA|OPTION)$/.test(el.tagName)) { continue; }
        const chain = backgrounds(el);
        if (chain === null) { continue; }
        const rect = el.getBoundingClientRect();
        if (covers.some(([box, r]) => !box.contains(el) && overlaps(r, rect))) { continue; }
        const s = getComputedStyle(el);
        const key = [s.color, s.fontSize, s.fontWeight, s.textShadow, chain].join("|");
        if (!groups.has(key)) { groups.set(key, []); }
        groups.get(key).push([el, text]);
    }
    // a key's checked element: the first visible one with a letter or digit (axe leaves
    // text of punctuation and symbols alone); a key without one is left to axe whole
    let checked = 0, skipped = 0;
    for (const members of groups.values()) {
        const first = members.find(([el, text]) => /[\\p{L}\\p{N}]/u.test(text)
            && el.checkVisibility({checkOpacity: true, checkVisibilityCSS: true}));
        if (first === undefined) { continue; }
        const key = String(checked++);
        for (const [el] of members) {
            el.setAttribute(el === first[0] ? KEY : SAME, key);
        }
        skipped += members.length - 1;
    }
    // each code box's block of code is swapped for a copy whose repeated tokens are plain
    // text, and swapped back afterwards (putting 13,000 spans back one by one after axe's
    // run took half a minute)
    const flat = [];
    for (const pre of document.querySelectorAll(`div.highlight pre:has(span[${SAME}])`)) {
        const copy = pre.cloneNode(true);
        for (const el of copy.querySelectorAll(`span[${SAME}]`)) {
            if (el.children.length === 0 && el.attributes.length === 2
                    && el.hasAttribute("class")) {
                el.replaceWith(document.createTextNode(el.textContent));
            }
        }
        pre.replaceWith(copy);
        flat.push([copy, pre]);
    }
    window.axeFlattened = flat;
    axe.configure({rules: [{id: "color-contrast", selector: `*:not([${SAME}])`}]});
    return {checked: checked, skipped: skipped,
            flattened: before - document.querySelectorAll("*").length};
}"""

_UNSAMPLE_CONTRAST = """() => {
    for (const [copy, pre] of window.axeFlattened || []) { copy.replaceWith(pre); }
    delete window.axeFlattened;
    for (const mark of ["data-axe-same-contrast", "data-axe-contrast-key"]) {
        for (const el of document.querySelectorAll(`[${mark}]`)) { el.removeAttribute(mark); }
    }
    axe.reset();
}"""

# axe's WCAG 2.x A and AA rules plus its best practices, run once on the page as the reader
# sees it (folded solutions stay folded); every node's result is kept for colour contrast, to
# see which keys' first element axe checked, and the elements of a key whose first one it did
# not check go through colour contrast again.  Each violation comes back with up to 4 of its
# elements.  preload false: axe would fetch every stylesheet again for its CSSOM, and a
# theme's relative @import resolves against the page's root (a 404 the browser walk refuses).
_RUN_AXE = """async () => {
    const options = {preload: false, selectors: false, elementRef: true,
                     resultTypes: ["violations", "passes", "incomplete"],
                     runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a",
                                                     "wcag21aa", "best-practice"]}};
    const result = await axe.run(document, options);
    const contrast = kind => result[kind].filter(rule => rule.id === "color-contrast")
        .flatMap(rule => rule.nodes.map(n => n.element));
    const seen = new Set(["passes", "incomplete", "violations"].flatMap(contrast));
    const unseen = [...document.querySelectorAll("[data-axe-contrast-key]")]
        .filter(el => !seen.has(el)).map(el => el.getAttribute("data-axe-contrast-key"));
    let violations = result.violations;
    if (unseen.length) {
        axe.configure({rules: [{id: "color-contrast", selector: unseen.map(
            key => `[data-axe-same-contrast="${key}"]`).join(", ")}]});
        violations = violations.concat((await axe.run(document, {...options,
            runOnly: {type: "rule", values: ["color-contrast"]}})).violations);
    }
    const where = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
        + [...el.classList].map(c => "." + c).join("")
        + ' "' + el.textContent.trim().slice(0, 40) + '"';
    return {unseen: unseen.length, violations: violations.map(v => ({
        id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.length,
        where: v.nodes.slice(0, 4).map(n => where(n.element) + " :: "
            + (n.failureSummary || "").replace(/\\s+/g, " ").slice(0, 160))}))};
}"""


def axe_violations(view) -> list[dict]:
    """axe's serious and lesser violations on the page (colour contrast sampled as above)."""
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
    page.evaluate(_SAMPLE_CONTRAST)
    try:
        return page.evaluate(_RUN_AXE)["violations"]
    finally:  # the page is shared with the document's other tests: leave it as found
        page.evaluate(_UNSAMPLE_CONTRAST)


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


def _sampled_axe(chromium_browser, body: str, style: str = "") -> tuple[dict, dict]:
    """The colour-contrast sampling and axe's run on a page of ``body``: what the sampling
    counted, and what the run returned; fails if the page is not put back as it was."""
    context = chromium_browser.new_context()
    try:
        page = context.new_page()
        page.set_content(f'<html lang="en"><head><title>t</title><style>{style}</style></head>'
                         f'<body><main><h1>t</h1>{body}</main></body></html>')
        page.evaluate(axe_source())
        before = page.evaluate("() => document.body.outerHTML")
        counted = page.evaluate(_SAMPLE_CONTRAST)
        try:
            found = page.evaluate(_RUN_AXE)
        finally:
            page.evaluate(_UNSAMPLE_CONTRAST)
        assert page.evaluate("() => document.body.outerHTML") == before
        return counted, found
    finally:
        context.close()


def _contrast(found: dict) -> list[dict]:
    return [v for v in found["violations"] if v["id"] == "color-contrast"]


def test_sampling_the_code_tokens_still_finds_a_faint_colour(chromium_browser):
    """A faint token colour repeated 50 times across two code boxes is still reported (once:
    the repeats are skipped), the repeated tokens become plain text during the run, and the
    page is put back afterwards."""
    tokens = '<span class="f">faint</span> <span class="d">dark</span> ' * 25
    box = f'<div class="highlight"><pre>{tokens}</pre></div>'
    counted, found = _sampled_axe(chromium_browser, box + box,
                                  ".highlight{background:#fff} .f{color:#ddd} .d{color:#111}")
    assert counted == {"checked": 3, "skipped": 98, "flattened": 98}, counted
    assert [v["nodes"] for v in _contrast(found)] == [1], found


def test_sampling_skips_only_what_repeats_a_checked_element(chromium_browser):
    """Faint paragraphs among many dark ones are reported; so is dark text whose key repeats
    a passing paragraph's but which lies on a positioned dark box (always checked); and a key
    whose first element axe leaves alone (a disabled button) has its other elements checked."""
    dark = '<p style="color:#333">dark words on white</p>' * 40
    faint = '<p style="color:#bbb">faint words on white</p>' * 5
    covered = ('<div style="position:relative"><div style="position:absolute;inset:0;'
               'background:#000"></div><p style="position:relative;color:#333">dark words on '
               'black</p></div>')
    buttons = ('<button disabled style="color:#999;background:#fff">Off</button>'
               '<button style="color:#999;background:#fff">On</button>')
    counted, found = _sampled_axe(chromium_browser, dark + faint + covered + buttons)
    assert counted["skipped"] == 39 + 4 + 1, counted
    assert found["unseen"] == 1, found
    where = [w for v in _contrast(found) for w in v["where"]]
    assert sum(v["nodes"] for v in _contrast(found)) == 3, found
    assert any('"faint words' in w for w in where), where
    assert any('"dark words on black' in w for w in where), where
    assert any('"On"' in w for w in where), where
