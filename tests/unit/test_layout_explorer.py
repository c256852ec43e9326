"""Chapter 13's explorer and roofline chart show what the planner computed, nothing else."""
from __future__ import annotations

import json
import re

from tests.asserts import every
from tutorial_lib.costs.hardware import cluster
from tutorial_lib.costs.rooflines import rooflines
from tutorial_lib.costs.step_time import Layout
from tutorial_lib.plan import MATMUL_EFFICIENCY, plan
from tutorial_lib.viz import layout_explorer as explorer


def test_each_choice_holds_the_planners_fastest_layouts_or_its_reason():
    data = explorer.explorer_data(sizes=("1.3B", "70B"), gpus=("h100-sxm",), counts=(8,))
    shown = data["results"]["1.3B|h100-sxm|8"]
    found = plan(explorer.SIZES["1.3B"], cluster("h100-sxm"), 8, explorer.GLOBAL_BATCH,
                 top=explorer.SHOWN).layouts
    assert [row[0] for row in shown["rows"]] == [r.layout.describe() for r in found]
    assert [row[1] for row in shown["rows"]] == [f"{r.step_time_s:.2f}" for r in found]
    assert every(row[0] in shown["html"] for row in shown["rows"])
    assert "fits nowhere" in data["results"]["70B|h100-sxm|8"]["refused"]


def test_the_widget_carries_the_data_and_shows_the_first_choice_without_script():
    data = explorer.explorer_data(sizes=("1.3B",), gpus=("h100-sxm",), counts=(8,))
    page = explorer.LayoutExplorer(data).to_html()
    island = re.search(r'<script type="application/json" class="tl-lay-data">(.*?)</script>',
                       page, re.S).group(1)
    assert json.loads(island) == data
    first = data["results"]["1.3B|h100-sxm|8"]["rows"][0][0]
    assert page.index(first) < page.index("tl-lay-data")  # in the markup, before the island


def test_the_roofline_chart_draws_each_technique_and_both_ridges():
    model = explorer.SIZES["13B"]
    lines = rooflines(model, cluster("a100-80gb"), Layout(tp=8, pp=2, dp=4), 256,
                      MATMUL_EFFICIENCY)
    svg = explorer.roofline_chart(lines)._repr_html_()
    for r in lines:
        assert f">{r.technique}<" in svg and f"{r.intensity:,.0f}" in svg
    assert f"NVLink ridge {lines[0].ridge_nvlink:,.0f}" in svg
    assert f"network ridge {lines[0].ridge_network:,.0f}" in svg
