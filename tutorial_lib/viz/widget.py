"""What every widget of the course is made of: one self-contained HTML fragment.

A fragment is a root ``<div>`` with a per-instance id holding, in this order:

* a ``<style>`` whose rules all start with ``#<id>`` (``widget.css``, shared by all,
  then the widget's CSS assets, with ``$root`` written where the id goes, filled in by
  :class:`string.Template`);
* the markup Python drew (readable without JavaScript: the first frame, the
  initial colours);
* ONE JSON island, ``<script type="application/json">``, holding the data the
  script needs (``<`` escaped as ``\\u003c``, so no value can end the element);
* ONE ``<script>``: ``widget.js`` (shared by all), the widget's own assets, and
  a last line ``boot("<id>", startX)`` that finds the root, reads the island
  and calls ``startX(root, data)``, all inside one function, so nothing is global.

The JavaScript and CSS live in ``tutorial_lib/viz/assets/`` as plain files shipped
with the package; no build step, no CDN: their text is inlined into every
fragment, so a page works live in Jupyter and in the static book alike.

Readable on any screen: ``widget.css`` and ``widget.js`` give every SVG a minimum width at
which its smallest label is 9 px, and let the box around a drawing scroll sideways where
the column is narrower than that (a phone), so neither the labels shrink nor the page
scrolls.
"""
from __future__ import annotations

import html
import json
import os
import re
import uuid
from functools import lru_cache
from importlib import resources
from string import Template

__all__ = ["Widget", "Animation", "Explorer", "Note", "asset", "scoped_css", "ascii_html", "write_page",
           "in_live_kernel", "live_or_static", "BOOK_BUILD_ENV"]

BOOK_BUILD_ENV = "TUTORIAL_BOOK_BUILD"
"""Set (to 1) by ``scripts/build_book.sh`` while it executes the chapters for the static book."""


@lru_cache(maxsize=None)
def asset(name: str) -> str:
    """The text of ``tutorial_lib/viz/assets/<name>`` (a ``.js`` or ``.css`` file)."""
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def scoped_css(names: tuple[str, ...], uid: str) -> str:
    """The CSS assets ``names`` for the root ``uid``: comments dropped, ``$root`` filled in."""
    css = "".join(re.sub(r"/\*.*?\*/\s*", "", asset(name), flags=re.S) for name in names)
    return Template(css).substitute(root=uid)


def ascii_html(markup: str) -> str:
    """Non-ASCII as character references: the fragment reads right whatever the page's charset."""
    return markup.encode("ascii", "xmlcharrefreplace").decode("ascii")


def write_page(path: str, title: str, fragment: str) -> str:
    """Write ``fragment`` (a widget's HTML) as a standalone page; returns ``path``."""
    page = (f'<!doctype html>\n<html><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title></head>\n"
            f'<body style="margin:24px;background:#f6f8fa">\n'
            f"{fragment}\n</body></html>\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def in_live_kernel() -> bool:
    """True in a Jupyter kernel that a reader drives; False in plain Python, and False while
    ``scripts/build_book.sh`` executes the chapters for the static book (it sets
    :data:`BOOK_BUILD_ENV`): no Python answers a widget's controls in the built pages."""
    if os.environ.get(BOOK_BUILD_ENV, "") not in ("", "0"):
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Note:
    """A short boxed sentence in a chapter's output (HTML in a notebook, text elsewhere)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return ('<div class="tl-note" style="border-left:4px solid #4e79a7;background:#f6f8fa;'
                'padding:6px 10px;margin:4px 0;font-size:14px;line-height:1.45">'
                f"{html.escape(self.text)}</div>")


def live_or_static(live, static):
    """``live()`` where a kernel runs behind the page (:func:`in_live_kernel`), else ``static``.

    For controls that call Python (ipywidgets): in the built book they would be dead, and
    their saved state weighs megabytes.  ``static`` is what the book shows instead: a
    callable (say, the precomputed widget that works without a kernel), or a sentence,
    shown as a :class:`Note`::

        live_or_static(lambda: rank_map_explorer(16, 8, tp=2, pp=2, ep=2),
                       "In Jupyter, an explorer with dropdowns for every size appears here.")
    """
    if in_live_kernel():
        return live()
    if isinstance(static, str):
        return Note(static)
    return static()


class Widget:
    """The base of every widget: ``to_html()``, ``_repr_html_()`` and ``save(path)``.

    A subclass names its assets and its start function, and draws its parts:

    * ``styles``: CSS assets, in order; ``scripts``: JS assets after ``widget.js``;
    * ``start``: the JS function called as ``start(root, data)``;
    * ``id_prefix``: the start of the root's id (a fresh id per render, so the
      same widget shown twice on one page gives two independent copies);
    * ``data_class``: the class of the JSON island;
    * :meth:`parts`: the root's attributes, the inner markup and the island's data.
    """

    styles: tuple[str, ...] = ()
    scripts: tuple[str, ...] = ()
    start = ""
    id_prefix = "tl-widget-"
    data_class = "tl-data"
    title = ""

    def root_id(self) -> str:
        """The id of the next render's root."""
        return self.id_prefix + uuid.uuid4().hex[:12]

    def parts(self, uid: str) -> tuple[str, str, object]:
        """``(root attributes, markup, island data)`` of one render with root id ``uid``."""
        raise NotImplementedError

    def to_html(self) -> str:
        """The fragment: root, scoped style, markup, JSON island, script."""
        uid = self.root_id()
        attributes, markup, data = self.parts(uid)
        css = scoped_css(("widget.css",) + self.styles, uid)
        island = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
        code = "".join(asset(name) for name in ("widget.js",) + self.scripts)
        script = (f'(function () {{\n"use strict";\n{code}'
                  f"boot({json.dumps(uid)}, {self.start});\n}})();")
        return (f"<div {attributes}>\n<style>{css}</style>\n{markup}"
                f'<script type="application/json" class="{self.data_class}">{island}</script>'
                f"<script>{script}</script>\n</div>")

    def _repr_html_(self) -> str:
        return self.to_html()

    def save(self, path: str) -> str:
        """Write a standalone HTML page holding the widget; returns ``path``."""
        return write_page(path, self.title, self.to_html())


class Explorer(Widget):
    """Buttons over one drawing, every answer computed in Python beforehand (the memory
    explorer, the FP8 tile explorer).  ``explorer.css`` draws the panel and its buttons
    (``button.tl-on``: the one chosen); a subclass adds its own assets, its parts and its
    :attr:`default_title`."""

    styles = ("explorer.css",)
    default_title = ""

    def __init__(self, data: dict, title: str = ""):
        self.data = data
        self.title = title or self.default_title


class Animation(Widget):
    """Precomputed frames plus the course's player, rendered as one HTML fragment.

    ``frames`` are SVG (or HTML) strings, ``captions`` one line each.  ``data``
    holds, per frame, the state the frame draws (rank -> values), so that tests
    and curious readers can check a picture against the numbers.  The player
    (``player.js``): Play/Pause, Back, Next, a slider and a caption.
    """

    styles = ("player.css", "animation.css")
    scripts = ("player.js", "animation.js")
    start = "startAnimation"
    id_prefix = "tl-anim-"

    def __init__(self, frames: list[str], captions: list[str], title: str = "",
                 data: list | None = None, note: str = "", interval_ms: int = 1200):
        if not frames or len(frames) != len(captions):
            raise ValueError(f"need one caption per frame, got {len(frames)} frames and "
                             f"{len(captions)} captions")
        self.frames = list(frames)
        self.captions = list(captions)
        self.title = title
        self.data = list(data) if data is not None else [None] * len(frames)
        self.note = note
        self.interval_ms = interval_ms

    def __len__(self) -> int:
        return len(self.frames)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} frames: {self.title!r})"

    def parts(self, uid: str) -> tuple[str, str, object]:
        """A root ``div.tl-animation`` with its title, caption, frames, controls and note."""
        n = len(self.frames)
        frames = []
        for i, (picture, caption) in enumerate(zip(self.frames, self.captions)):
            hidden = "" if i == 0 else ' style="display:none"'  # without script: frame 0 shows
            frames.append(f'<div class="tl-frame" data-caption="{html.escape(caption, quote=True)}"'
                          f"{hidden}>{picture}</div>")
        frames_html = "\n".join(frames)
        note = f'<div class="tl-anim-note">{html.escape(self.note)}</div>\n' if self.note else ""
        markup = f"""<div class="tl-anim-title">{html.escape(self.title)}</div>
<div class="tl-anim-caption">{html.escape(self.captions[0])}</div>
<div class="tl-anim-stage">
{frames_html}
</div>
<div class="tl-anim-controls">
<button type="button" class="tl-play" aria-label="Play or pause">&#9654;&#xFE0E; Play</button>
<button type="button" class="tl-prev" title="Step back">&#8249; Back</button>
<button type="button" class="tl-next" title="Step forward">Next &#8250;</button>
<input type="range" class="tl-slider" min="0" max="{n - 1}" step="1" value="0" aria-label="Frame">
<span class="tl-anim-counter">1 / {n}</span>
</div>
{note}"""
        attributes = f'class="tl-animation" id="{uid}" data-frame="0" data-frames="{n}"'
        return attributes, ascii_html(markup), {"interval": int(self.interval_ms)}
