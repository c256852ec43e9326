"""Text in the course's figures reads at WCAG AA's 4.5:1, in light and in dark mode.

Figures are drawn on white (``draw.BACKGROUND``); in dark mode the theme would put HTML
outputs on its light grey, and _static/course.css gives them the white box back. So the
labels are checked against both backgrounds a reader meets: light mode's page and dark
mode's output box, as course.css sets it. Before this, chapter 8's FP8 legs figure wrote
its FP8 label in the EP orange: 2.4:1 on white, 1.65:1 on the dark mode's grey.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tutorial_lib.viz import draw
from tutorial_lib.viz.fp8_legs import dispatch_combine_figure

REPO = Path(__file__).resolve().parents[2]
LIGHT_PAGE = "#ffffff"  # pydata-sphinx-theme's light background
COLORS = sorted({*draw.PALETTE, *draw.KIND_COLORS.values(), draw.SINGLETON_COLOR})


def dark_mode_output_background() -> str:
    css = (REPO / "_static" / "course.css").read_text()
    rule = re.search(r"html\[data-theme=dark\] \.bd-content div\.cell_output \.text_html"
                     r"[^{]*\{([^}]*)\}", css)
    assert rule, "course.css gives dark mode's outputs no background of their own"
    return re.search(r"background-color:\s*(#[0-9a-f]{6})", rule.group(1)).group(1)


BACKGROUNDS = {"light": LIGHT_PAGE, "dark": dark_mode_output_background()}


def test_the_contrast_ratio_is_wcags():
    assert draw.contrast_ratio("#000000", "#ffffff") == pytest.approx(21)
    assert draw.contrast_ratio("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)
    assert draw.contrast_ratio("#f28e2b", "#ffffff") == pytest.approx(2.42, abs=0.01)
    assert draw.contrast_ratio("#f28e2b", "#ced6dd") == pytest.approx(1.63, abs=0.02)


@pytest.mark.parametrize("mode", BACKGROUNDS)
def test_plain_text_colours_read_on_both_backgrounds(mode):
    for ink in (draw.INK, draw.MUTED):
        assert draw.contrast_ratio(ink, BACKGROUNDS[mode]) >= 4.5, (mode, ink)


@pytest.mark.parametrize("mode", BACKGROUNDS)
def test_a_label_in_its_series_colour_reads_on_both_backgrounds(mode):
    for color in COLORS:
        ratio = draw.contrast_ratio(draw.readable(color), BACKGROUNDS[mode])
        assert ratio >= draw.MIN_CONTRAST, (mode, color, draw.readable(color), ratio)


def test_readable_changes_only_colours_that_need_it():
    assert draw.readable(draw.INK) == draw.INK and draw.readable("#4e79a7") == "#4e79a7"
    assert draw.readable("#f28e2b") != "#f28e2b"


def test_a_label_on_a_coloured_box_reads_on_every_colour_of_the_palettes():
    for color in COLORS:
        ratio = draw.contrast_ratio(draw.text_color(color), color)
        assert ratio >= draw.MIN_CONTRAST, (color, draw.text_color(color), ratio)


@pytest.mark.parametrize("mode", BACKGROUNDS)
def test_every_label_of_the_fp8_legs_figure_reads(mode):
    figure = dispatch_combine_figure().svg
    fills = re.findall(r'<text [^>]*fill="(#[0-9a-f]{6})"', figure)
    assert len(fills) >= 14  # 3 headings, the backward-pass line, 4 legs x 3 labels
    for fill in set(fills):
        assert draw.contrast_ratio(fill, BACKGROUNDS[mode]) >= 4.5, (mode, fill)
