"""Colours shared by every widget of the course.

Two palettes, so that a colour always means the same thing from chapter to chapter:

* :data:`KIND_COLORS` gives each *kind* of communicator (tp, pp, ep, ...) one
  fixed colour; timelines and traces colour an op by the group it ran on.
* :data:`PALETTE` tells *groups of one kind* apart (tp group 0, tp group 1, ...)
  in the rank map.  It is qualitative: neighbouring entries differ strongly in
  hue and lightness, so adjacent groups never look alike.

Everything is a plain ``#rrggbb`` string, usable from matplotlib and from HTML.
"""
from __future__ import annotations

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


def kind_color(kind: str) -> str:
    """The fixed colour of a communicator kind; unknown kinds are grey."""
    return KIND_COLORS.get(kind, KIND_COLORS["world"])


def group_color(index: int, size: int = 2) -> str:
    """Colour of the ``index``-th group of a kind; groups of ``size`` 1 stay neutral."""
    if size <= 1:
        return SINGLETON_COLOR
    return PALETTE[index % len(PALETTE)]


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (WCAG relative luminance)."""
    channels = [int(background[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    # sRGB to linear light, then the luminance weights of the eye.
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    # Contrast with black is (L + 0.05) / 0.05, with white 1.05 / (L + 0.05): pick the larger.
    return "#1b1f24" if luminance > 0.179 else "#ffffff"


# --- shared by the players (collective animations, timelines) ---------------------------

SANS = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
"""The font stack of every widget."""

PLAYER_CONTROLS_CSS = """
#UID .tl-anim-controls { display: flex; align-items: center; gap: 6px; margin-top: 8px; }
#UID .tl-anim-controls button { font: inherit; font-size: 12.5px; line-height: 1.2;
  padding: 4px 11px; border: 1px solid #c4cbd3; border-radius: 6px; background: #f6f8fa;
  color: #1b1f24; cursor: pointer; margin: 0; }
#UID .tl-anim-controls button:hover { background: #eaeef2; }
#UID .tl-anim-controls button.tl-play { min-width: 5.8em; background: #1b1f24; color: #ffffff;
  border-color: #1b1f24; }
#UID .tl-anim-controls button.tl-play:hover { background: #3a4048; }
#UID .tl-slider { flex: 1; min-width: 80px; margin: 0 4px; accent-color: #4e79a7; }
"""
"""Play / Back / Next buttons and the frame slider; ``#UID`` is the widget's root id."""


def write_page(path: str, title: str, fragment: str) -> str:
    """Write ``fragment`` (a widget's HTML) as a standalone page; returns ``path``."""
    import html
    page = (f'<!doctype html>\n<html><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title></head>\n"
            f'<body style="margin:24px;background:#f6f8fa">\n'
            f"{fragment}\n</body></html>\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path
