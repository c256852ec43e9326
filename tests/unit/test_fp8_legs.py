"""The figure of the four MoE all-to-alls: its legs are the library's precision pairs, in
the order a training step runs them, with the wire formula's bytes (in chromium:
tests/book/test_widgets.py)."""
import re

import pytest

from tutorial_lib import fp8
from tutorial_lib.viz.fp8_legs import dispatch_combine_figure, dispatch_combine_legs
from tests.asserts import every


def test_deepseek_v3_legs_are_fp8_out_to_the_experts_and_bf16_back():
    """DeepSeek-V3 Technical Report (arXiv:2412.19437v2), section 3.3.3, "Low-Precision
    Communication": the activations are quantized to FP8 before the dispatch and the
    activation gradients before the MoE down-projection (the combine's backward), with
    power-of-two scales; the forward and backward combine components stay BF16."""
    legs = dispatch_combine_legs()
    assert [(leg["op"], leg["phase"], leg["direction"]) for leg in legs] == [
        ("dispatch", "forward", "to experts"), ("combine", "forward", "to tokens"),
        ("combine", "backward", "to experts"), ("dispatch", "backward", "to tokens")]
    assert [leg["precision"] for leg in legs] == ["fp8_pow2", "bf16", "fp8_pow2", "bf16"]
    assert (legs[0]["precision"], legs[3]["precision"]) == fp8.DEEPSEEK_V3_DISPATCH
    assert (legs[1]["precision"], legs[2]["precision"]) == fp8.DEEPSEEK_V3_COMBINE
    assert [leg["bytes_per_row"] for leg in legs] == [7392, 14336, 7392, 14336]
    assert every(("FP8" in leg["consumer"]) == leg["precision"].startswith("fp8") for leg in legs)


@pytest.mark.parametrize("dispatch,combine", [
    (fp8.FP8_DISPATCH, fp8.FP8_COMBINE), (("bf16", "fp32"), "fp8_ue8m0")])
def test_the_figure_follows_the_pairs_it_is_given(dispatch, combine):
    figure = dispatch_combine_figure(dispatch, combine, hidden=256)
    pairs = {"dispatch": fp8.check_precision_pair(dispatch),
             "combine": fp8.check_precision_pair(combine)}
    drawn = re.findall(r'<g class="tl-fp8-leg" data-op="(\w+)" data-phase="(\w+)" '
                       r'data-precision="(\w+)">', figure.svg)
    assert len(drawn) == 4
    for op, phase, precision in drawn:
        assert precision == pairs[op][phase == "backward"]
        row = fp8.wire_bytes_per_row(256, precision)
        assert f"{precision} · {row:,} B" in figure.svg
    html = figure.to_html()
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    assert 'style="width:100%;height:auto"' in figure.svg  # it scales to the column


def test_unknown_precisions_are_refused():
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        dispatch_combine_legs(("fp4", "bf16"))
