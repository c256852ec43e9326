"""What every widget shares: assets shipped as package data, one fragment layout, one JSON island."""
import fnmatch
import json
import re
from pathlib import Path

import pytest

from tutorial_lib.viz import widget
from tutorial_lib.viz.fp8_tiles import TileExplorer
from tutorial_lib.viz.layout_explorer import LayoutExplorer
from tutorial_lib.viz.memory_explorer import MemoryExplorer
from tutorial_lib.viz.moe_flow import TokenFlowAnimation
from tutorial_lib.viz.rank_map import RankMap
from tutorial_lib.viz.timeline import Timeline
from tutorial_lib.viz.widget import Animation, Explorer, Widget
from tests.asserts import every

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "tutorial_lib" / "viz" / "assets"
WIDGETS = (Animation, TokenFlowAnimation, Timeline, RankMap, Explorer, TileExplorer, MemoryExplorer,
           LayoutExplorer)


def test_the_list_holds_every_widget_class_of_the_library():
    """A new widget joins WIDGETS, so that the asset checks below cover its files."""
    import importlib
    import pkgutil

    import tutorial_lib.viz as viz
    for module in pkgutil.iter_modules(viz.__path__):
        importlib.import_module(f"tutorial_lib.viz.{module.name}")

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    library = {cls for cls in subclasses(Widget) if cls.__module__.startswith("tutorial_lib.")}
    named_assets = {cls: set(cls.styles + cls.scripts) for cls in library}
    covered = {cls for cls in library if any(issubclass(cls, w) for w in WIDGETS)
               and named_assets[cls] <= {n for w in WIDGETS for n in w.styles + w.scripts}}
    assert covered == library, sorted(c.__name__ for c in library - covered)


def test_every_asset_a_widget_names_exists_and_ships_in_the_wheel():
    pyproject = (REPO / "pyproject.toml").read_text()
    table = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    globs = json.loads(re.search(r'^"tutorial_lib\.viz" = (\[.*\])$', table, re.M).group(1))
    files = sorted(p.name for p in ASSETS.iterdir())
    for name in files:  # package data: a non-editable install carries every asset
        assert any(fnmatch.fnmatch(f"assets/{name}", g) for g in globs), name
    named = {n for w in WIDGETS for n in ("widget.js", "widget.css") + w.styles + w.scripts}
    assert named == set(files)  # no asset left unused, none missing


@pytest.mark.parametrize("name", sorted(p.name for p in ASSETS.iterdir()))
def test_assets_are_ascii_and_fetch_nothing(name):
    text = widget.asset(name)
    assert text.isascii()  # character references are not decoded inside <script>
    assert not re.search(r"https?://|src=|href=|require|import\(|@import|url\(|<script|<!--", text)


@pytest.mark.parametrize("name", sorted(p.name for p in ASSETS.glob("*.css")))
def test_every_css_rule_is_scoped_to_the_root(name):
    css = widget.scoped_css((name,), "tl-x-1")
    assert "$" not in css and "/*" not in css
    for selector in re.findall(r"([^{}]+)\{", css):
        selector = selector.strip()
        if selector.startswith("@media"):
            continue
        if selector.startswith("@keyframes"):
            assert selector.split()[1].startswith("tl-x-1-")
        elif selector not in ("from", "to"):
            assert every(s.strip().startswith("#tl-x-1") for s in selector.split(",")), selector


class Box(Widget):
    """The smallest widget: a label and its data."""

    scripts = ("animation.js",)
    start = "startAnimation"

    def parts(self, uid):
        return f'class="box" id="{uid}"', "<b>box</b>", {"label": "</script><!-- x", "n": 1}


def test_the_fragment_is_root_style_markup_island_script():
    page = Box().to_html()
    uid = re.match(r'<div class="box" id="(tl-widget-[0-9a-f]{12})">', page).group(1)
    assert page.endswith("</script>\n</div>") and page.count("</script>") == 2
    island = re.search(r'<script type="application/json" class="tl-data">(.*?)</script>', page)
    assert json.loads(island.group(1)) == {"label": "</script><!-- x", "n": 1}
    assert "<" not in island.group(1)  # escaped as \u003c: no value can end the element
    script = page.split("<script>")[1].split("</script>")[0]
    assert script.startswith("(function () {\n")
    assert script.endswith(f'boot("{uid}", startAnimation);\n}})();')
    assert Box().to_html() != page  # a fresh id per render
    assert Box()._repr_html_().startswith('<div class="box" id="tl-widget-')


def test_save_writes_a_standalone_page(tmp_path):
    path = Box().save(str(tmp_path / "box.html"))
    text = open(path, encoding="utf-8").read()
    assert text.startswith("<!doctype html>") and '<div class="box"' in text


def test_every_fragment_starts_with_the_shared_readable_layout():
    """widget.css comes first in every widget's style: drawings scroll in their box on a
    phone instead of shrinking their labels (widget.js sets the SVG's min-width)."""
    page = Box().to_html()
    uid = re.search(r'id="(tl-widget-[0-9a-f]{12})"', page).group(1)
    style = page.split("<style>")[1].split("</style>")[0]
    assert style.startswith(widget.scoped_css(("widget.css",), uid))
    assert f"#{uid} :has(> svg)" in style and "overflow-x: auto" in style
    assert "keepTextReadable(root)" in page and "MIN_TEXT_PX = 9;" in page


def test_live_or_static_picks_by_where_the_code_runs(monkeypatch):
    """A live-only widget (ipywidgets calling Python) is built only where a reader's kernel
    runs; the book build (scripts/build_book.sh sets TUTORIAL_BOOK_BUILD=1) and plain
    Python get the static stand-in, a callable's result or a sentence in a Note."""
    import IPython

    class Shell:
        kernel = object()

    made = []
    live = lambda: made.append("live") or "LIVE"  # noqa: E731
    monkeypatch.delenv(widget.BOOK_BUILD_ENV, raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert widget.live_or_static(live, lambda: "STATIC") == "STATIC" and made == []

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    assert widget.in_live_kernel() and widget.live_or_static(live, "x") == "LIVE"

    monkeypatch.setenv(widget.BOOK_BUILD_ENV, "1")
    note = widget.live_or_static(live, "Run this chapter in Jupyter for the explorer.")
    assert isinstance(note, widget.Note) and made == ["live"]
    assert "Run this chapter in Jupyter" in note._repr_html_() and "<script" not in note._repr_html_()


def test_the_book_build_announces_itself_to_the_kernels():
    script = (REPO / "scripts" / "build_book.sh").read_text()
    assert f"export {widget.BOOK_BUILD_ENV}=1" in script
