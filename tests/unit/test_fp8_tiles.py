"""The FP8 tile widget: its numbers are the library's quantizer's and it is self-contained.
In chromium (buttons change the tile, the scaling and the numbers shown): tests/book/test_widgets.py."""
import json
import re

import pytest
import torch

from tutorial_lib import fp8
from tutorial_lib.viz.fp8_tiles import tile_data, tile_explorer


def outlier_tokens() -> torch.Tensor:
    """Two tokens of two tiles each."""
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    x[1, 10] = 300.0  # an outlier channel in token 1's first tile
    return x


@pytest.fixture(scope="module")
def tokens():
    return outlier_tokens()


def test_the_numbers_are_the_library_quantizers(tokens):
    data = tile_data(tokens)
    q, scales = fp8.quantize_1x128(tokens)
    q2, scales2 = fp8.quantize_1x128(tokens, pow2=True)
    qt, scale_t = fp8.quantize_per_tensor(tokens)
    for t in range(2):
        for j in range(2):
            cell = data["cells"][f"{t},{j}"]
            cols = slice(128 * j, 128 * (j + 1))
            assert cell["1x128"]["scale"] == pytest.approx(scales[t, j].item(), rel=1e-6)
            assert cell["1x128"]["q"] == q[t, cols].float().tolist()
            assert cell["1x128_pow2"]["scale"] == pytest.approx(scales2[t, j].item(), rel=1e-6)
            assert cell["per_tensor"]["q"] == qt[t, cols].float().tolist()
            assert cell["per_tensor"]["scale"] == pytest.approx(scale_t.item(), rel=1e-6)
    # the outlier tile: its scale is 300 / 448, and its small values lose precision
    outlier = data["cells"]["1,0"]["1x128"]
    assert outlier["scale"] == pytest.approx(300 / 448)
    assert outlier["rel_fro"] < data["cells"]["1,1"]["per_tensor"]["rel_fro"]


def test_the_html_is_self_contained_and_each_instance_has_its_own_id(tokens):
    a, b = tile_explorer(tokens).to_html(), tile_explorer(tokens).to_html()
    ids = [re.search(r'id="(tl-fp8-[0-9a-f]+)"', h).group(1) for h in (a, b)]
    assert ids[0] != ids[1]
    assert "http://" not in a.replace("http://www.w3.org/2000/svg", "") and "https://" not in a
    assert "<script src" not in a and 'class="tl-fp8-tiles"' in a
    payload = re.search(r'<script type="application/json" class="tl-fp8-data">(.*?)</script>', a, re.S)
    assert json.loads(payload.group(1))["tiles"] == 2


def test_refusals_name_the_limit():
    with pytest.raises(ValueError, match="hidden size 100 is not a multiple of the 128-wide tile"):
        tile_data(torch.randn(2, 100))
    with pytest.raises(ValueError, match="at most 6 tokens"):
        tile_data(torch.randn(7, 128))
