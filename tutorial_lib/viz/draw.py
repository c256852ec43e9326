"""Colours and SVG primitives shared by every widget of the course.

Two palettes, so that a colour always means the same thing from chapter to chapter:

* :data:`KIND_COLORS` gives each *kind* of communicator (tp, pp, ep, ...) one
  fixed colour; timelines and traces colour an op by the group it ran on.
* :data:`PALETTE` tells *groups of one kind* apart (tp group 0, tp group 1, ...)
  in the rank map, and chunks or ranks in the animations.  It is qualitative:
  neighbouring entries differ strongly in hue and lightness, so adjacent groups
  never look alike.

Everything is a plain ``#rrggbb`` string, usable from matplotlib and from HTML.
The SVG primitives (:func:`rect`, :func:`text`, :func:`arrow`, :func:`svg`)
return markup strings that the widgets join into one picture per frame.
"""
from __future__ import annotations

import html
import math

#: One colour per communicator kind (Tableau 10 hues; close kinds get related hues:
#: dense data parallel greens, expert kinds warm).
KIND_COLORS = {
    "tp": "#4e79a7",         # blue: the innermost, fastest group
    "cp": "#76b7b2",         # teal: splits the sequence, next to TP
    "dp": "#59a14f",         # green: gradient all-reduce replicas
    "dp_cp": "#8cd17d",      # light green: DP and CP together (gradient reduction with CP)
    "pp": "#b07aa1",         # purple: point-to-point between stages
    "mp": "#9c755f",         # brown: the whole model-parallel slice (TP x PP)
    "embedding": "#ff9da7",  # pink: first and last stage tie their embeddings
    "ep": "#f28e2b",         # orange: the token all-to-all
    "expert_tp": "#e15759",  # red: splits one expert's weights
    "expert_dp": "#edc948",  # yellow: expert-gradient replicas
    "world": "#7f7f7f",      # grey: every rank
    "compute": "#bab0ac",    # warm grey: local work in timelines
}

#: Qualitative palette for telling groups of one kind apart (Tableau 20, reordered
#: so consecutive groups alternate dark and light and change hue).
PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#edc948",
    "#76b7b2", "#ff9da7", "#9c755f", "#bab0ac", "#a0cbe8", "#ffbe7d",
    "#8cd17d", "#ff9d9a", "#d4a6c8", "#f1ce63", "#86bcb6", "#fabfd2",
    "#d7b5a6", "#79706e",
)

#: Colour of a group of one rank: it has nobody to talk to, so it stays neutral.
SINGLETON_COLOR = "#e4e7eb"

INK = "#1b1f24"    # text and highlight outlines
MUTED = "#57606a"  # secondary text
LINE = "#c4cbd3"   # empty-buffer outlines, separators

SANS = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
"""The font stack of every widget."""
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'Liberation Mono', monospace"
"""The font stack of numbers written in cells."""


# --- colours --------------------------------------------------------------------------


def kind_color(kind: str) -> str:
    """The fixed colour of a communicator kind; unknown kinds are grey."""
    return KIND_COLORS.get(kind, KIND_COLORS["world"])


def palette_color(index: int) -> str:
    """The ``index``-th colour of :data:`PALETTE`, cycling: chunk ``c``, rank position ``p``."""
    return PALETTE[index % len(PALETTE)]


def group_color(index: int, size: int = 2) -> str:
    """Colour of the ``index``-th group of a kind; groups of ``size`` 1 stay neutral."""
    if size <= 1:
        return SINGLETON_COLOR
    return palette_color(index)


BACKGROUND = "#ffffff"
"""What every figure is drawn on, in light and in dark mode alike (a widget's box, and in
dark mode the book's CSS gives a figure the same white box: _static/course.css)."""
MIN_CONTRAST = 4.5
"""WCAG 2 AA's least contrast ratio for text (success criterion 1.4.3)."""


def luminance(color: str) -> float:
    """WCAG's relative luminance of ``#rrggbb``: 0 for black, 1 for white."""
    channels = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    # sRGB to linear light, then the luminance weights of the eye.
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast_ratio(one: str, other: str) -> float:
    """WCAG's contrast ratio of two colours, from 1 (the same) to 21 (black on white)."""
    light, dark = sorted((luminance(one), luminance(other)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def text_color(background: str) -> str:
    """The text colour for a label on ``background``: :data:`INK` or white, whichever
    contrasts more; black where neither reaches :data:`MIN_CONTRAST` (mid-tones such as
    the TP blue, where INK gives 3.6:1 and white 4.5:1 just short)."""
    best = max((INK, "#ffffff"), key=lambda ink: contrast_ratio(ink, background))
    return best if contrast_ratio(best, background) >= MIN_CONTRAST else "#000000"


def readable(color: str, background: str = BACKGROUND) -> str:
    """``color`` darkened just enough to be read as text on ``background`` (at least
    :data:`MIN_CONTRAST`): a label written in its series' colour (chapter 8's FP8 legs)."""
    amount = 0.0
    while contrast_ratio(darken(color, amount), background) < MIN_CONTRAST and amount < 1:
        amount = round(amount + 0.02, 2)
    return darken(color, amount)


def mix(color: str, amount: float) -> str:
    """``color`` mixed with white: ``amount`` 1 is the colour itself, 0 is white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * amount):02x}" for c in rgb)


def darken(color: str, amount: float = 0.35) -> str:
    """``color`` mixed with black: ``amount`` 0 is the colour itself, 1 is black."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * (1 - amount)):02x}" for c in rgb)


# --- SVG primitives -------------------------------------------------------------------


def rect(x, y, w, h, fill, stroke="none", width=0.0, dash=None, rx=5) -> str:
    """A rectangle with rounded corners ``rx``; ``dash`` e.g. ``"4 3"`` for a dashed outline."""
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{width}"{extra}/>')


def text(x, y, s, size=12, anchor="middle", fill=INK, weight=None, mono=False) -> str:
    """Text ``s`` (escaped) at ``x, y``; ``mono`` writes it in :data:`MONO`."""
    font = f' font-family="{MONO}"' if mono else ""
    bold = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{font}{bold}>{html.escape(s)}</text>')


def arrow(points: list[tuple[float, float]], color: str, width: float = 2.2) -> str:
    """A polyline with a filled arrowhead at its last point."""
    (x0, y0), (x1, y1) = points[-2], points[-1]
    length = math.hypot(x1 - x0, y1 - y0) or 1.0
    ux, uy = (x1 - x0) / length, (y1 - y0) / length
    head, half = 9.0, 5.0
    bx, by = x1 - ux * head, y1 - uy * head  # the base of the head: the line stops there
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in points[:-1] + [(bx, by)])
    tip = [(x1, y1), (bx - uy * half, by + ux * half), (bx + uy * half, by - ux * half)]
    return (f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="{width}" '
            f'stroke-linejoin="round" stroke-linecap="round"/>'
            f'<polygon points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in tip)}" fill="{color}"/>')


def svg(width: float, height: float, body: list[str], label: str = "") -> str:
    """One picture: ``body`` (markup strings) in a ``width`` x ``height`` SVG. With a
    ``label`` it is an image of that name to a screen reader; without one, a screen reader
    reads the labels drawn in it (an unnamed ``role="img"`` would hide them and name
    nothing: axe-core's rule svg-img-alt)."""
    role = f' role="img" aria-label="{html.escape(label, quote=True)}"' if label else ""
    return (f'<svg viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'height="{height:.0f}" font-family="{SANS}"{role}>{"".join(body)}</svg>')


__all__ = ["KIND_COLORS", "PALETTE", "SINGLETON_COLOR", "INK", "MUTED", "LINE", "SANS", "MONO",
           "BACKGROUND", "MIN_CONTRAST", "kind_color", "palette_color", "group_color",
           "luminance", "contrast_ratio", "text_color", "readable", "mix", "darken",
           "rect", "text", "arrow", "svg"]
