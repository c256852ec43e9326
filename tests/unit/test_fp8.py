"""FP8 quantization in 1x128 tiles, packed rows and the byte formulas, without processes.

The error bounds are measured on Gaussian data (seeded): E4M3 rounds to nearest with 3
mantissa bits, so a value in the normal range (``|x| / scale >= 2**-6``) is off by at most
1/17 of itself; the relative Frobenius error of N(0, 1) data is about 0.026.  Outliers are a
few channels multiplied by 1e4 and 1e5.
"""
import math

import pytest
import torch

from tutorial_lib import fp8

TOKENS, HIDDEN = 2048, 1024


@pytest.fixture(scope="module")
def gaussian():
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(0))


def _round_trip(x, pow2=False):
    q, scales = fp8.quantize_1x128(x, pow2=pow2)
    return fp8.dequantize_1x128(q, scales), scales


def _rel_fro(a, b):
    return ((a - b).norm() / b.norm()).item()


# --- the error bounds -------------------------------------------------------------------


@pytest.mark.parametrize("pow2", [False, True])
def test_elementwise_error_of_normal_values_is_at_most_one_seventeenth(gaussian, pow2):
    x_hat, scales = _round_trip(gaussian, pow2)
    scaled = gaussian.abs() / scales.repeat_interleave(fp8.TILE, dim=-1)
    normal = scaled >= fp8.E4M3_MIN_NORMAL
    assert normal.float().mean() > 0.99
    rel = ((x_hat - gaussian).abs() / gaussian.abs())[normal]
    assert rel.max().item() <= 1 / 17 + 1e-6
    assert rel.max().item() > 1 / 17 * 0.95  # the bound is reached, not loose
    # below the normal range the spacing is fixed (2**-9 x scale): relative error can be larger
    assert ((x_hat - gaussian).abs() / gaussian.abs())[~normal].max() > 1 / 17


def test_relative_frobenius_error_is_about_0_026_and_pow2_is_slightly_worse(gaussian):
    tiles = _rel_fro(_round_trip(gaussian)[0], gaussian)
    pow2 = _rel_fro(_round_trip(gaussian, pow2=True)[0], gaussian)
    assert 0.024 < tiles < 0.028, tiles
    assert tiles < pow2 < tiles * 1.1, (tiles, pow2)


def test_per_tensor_scaling_is_worse_even_without_outliers(gaussian):
    per_tensor = fp8.dequantize_per_tensor(*fp8.quantize_per_tensor(gaussian))
    assert _rel_fro(per_tensor, gaussian) > _rel_fro(_round_trip(gaussian)[0], gaussian)


def test_outlier_channels_hurt_per_tensor_scaling_far_more_than_tiles(gaussian):
    outliers = [5, 300, 700]
    ordinary = torch.ones(HIDDEN, dtype=torch.bool)
    ordinary[outliers] = False
    clean_tiles = torch.ones(HIDDEN, dtype=torch.bool)
    for c in outliers:  # tiles that hold no outlier channel
        clean_tiles[c // 128 * 128:(c // 128 + 1) * 128] = False
    errors = {}
    for factor in (1e4, 1e5):
        x = gaussian.clone()
        x[:, outliers] *= factor
        tiles = _round_trip(x)[0]
        per_tensor = fp8.dequantize_per_tensor(*fp8.quantize_per_tensor(x))
        errors[factor] = (_rel_fro(tiles[:, ordinary], x[:, ordinary]),
                          _rel_fro(per_tensor[:, ordinary], x[:, ordinary]))
        # tiles without an outlier do not notice it
        assert _rel_fro(tiles[:, clean_tiles], x[:, clean_tiles]) < 0.028
        # per-tensor: ordinary values sink below the normal range or flush to zero
        flushed = (per_tensor[:, ordinary] == 0).float().mean().item()
        assert flushed > 10 * max((tiles[:, ordinary] == 0).float().mean().item(), 1e-4)
    assert errors[1e4][1] > 1.5 * errors[1e4][0], errors
    assert errors[1e5][1] > 5 * errors[1e5][0], errors


# --- scales, clamping, zeros ------------------------------------------------------------


def test_scale_is_tile_amax_over_448_with_a_floor():
    x = torch.zeros(3, 256)
    x[0, :128] = torch.linspace(-3, 2, 128)
    x[1, 200] = 1e-6  # amax below the floor
    scales = fp8.tile_scales(x)
    assert scales.shape == (3, 2)
    assert scales[0, 0].item() == pytest.approx(3 / 448)
    assert torch.all(scales[0, 1:] == torch.tensor(fp8.AMAX_FLOOR) / 448)
    assert scales[1, 1].item() == pytest.approx(fp8.AMAX_FLOOR / 448)
    q, s = fp8.quantize_1x128(x)
    assert torch.isfinite(fp8.dequantize_1x128(q, s)).all()
    assert torch.equal(fp8.dequantize_1x128(q, s)[2], torch.zeros(256))  # zeros stay zeros
    assert q[0, 0].float().item() == -448  # the amax lands on the largest E4M3 value


def test_pow2_scales_are_powers_of_two_at_least_the_exact_scale(gaussian):
    exact = fp8.tile_scales(gaussian)
    pow2 = fp8.tile_scales(gaussian, pow2=True)
    log = torch.log2(pow2)
    assert torch.equal(log, log.round())
    assert torch.all(pow2 >= exact) and torch.all(pow2 < 2 * exact)
    q, _ = fp8.quantize_1x128(gaussian, pow2=True)
    assert q.float().abs().max() <= 448


def test_out_of_range_values_are_clamped_explicitly_not_left_to_the_cast():
    x = torch.tensor([[1.0] * 127 + [-2.0]])
    big = fp8._to_e4m3(torch.tensor([500.0, -1e6, 448.0, float("inf")]))
    assert big.float().tolist() == [448.0, -448.0, 448.0, 448.0]
    # a scale forced smaller than amax / 448: every value would overflow without the clamp
    q = fp8._to_e4m3(x / (0.5 / 448))
    assert q.float().abs().max().item() == 448 and torch.isfinite(q.float()).all()


def test_dequantize_happens_in_float32_and_returns_the_asked_dtype(gaussian):
    q, s = fp8.quantize_1x128(gaussian[:4])
    assert fp8.dequantize_1x128(q, s).dtype == torch.float32
    bf = fp8.dequantize_1x128(q, s, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, fp8.dequantize_1x128(q, s).bfloat16())


def test_bad_hidden_sizes_are_refused_with_the_rule_and_a_fix():
    with pytest.raises(ValueError, match=r"hidden size 100 is not a multiple of the 128-wide tile.*pad=True"):
        fp8.quantize_1x128(torch.randn(2, 100))
    with pytest.raises(ValueError, match="300 = 2 x 128 \\+ 44"):
        fp8.quantize_1x128(torch.randn(2, 300))


def test_pad_makes_a_shorter_last_tile(gaussian):
    x = gaussian[:5, :300]
    q, s = fp8.quantize_1x128(x, pad=True)
    assert q.shape == (5, 300) and s.shape == (5, 3)
    assert torch.allclose(s[:, 2], x[:, 256:].abs().amax(dim=1) / 448)
    assert _rel_fro(fp8.dequantize_1x128(q, s), x) < 0.03


def test_unknown_precision_names_are_refused():
    with pytest.raises(ValueError, match="fp16.*fp32, bf16, fp8, fp8_pow2, fp8_ue8m0"):
        fp8.check_precision("fp16")
    with pytest.raises(ValueError, match=r"\(forward, backward\) pair"):
        fp8.check_precision_pair(("fp8", "bf16", "fp32"))
    assert fp8.check_precision_pair("bf16") == ("bf16", "bf16")


# --- packed rows --------------------------------------------------------------------------


@pytest.mark.parametrize("hidden,precision", [(256, "fp8"), (256, "fp8_ue8m0"), (7168, "fp8"),
                                              (300, "fp8_ue8m0"), (8, "fp8"), (300, "fp8_pow2")])
def test_pack_unpack_is_bit_exact(hidden, precision):
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(hidden)) * 3
    x[0] = 0  # an all-zero token: the floor scale must survive the trip
    pow2, ue8m0 = fp8.has_pow2_scales(precision), precision == "fp8_ue8m0"
    q, s = fp8.quantize_1x128(x, pow2=pow2, pad=True)
    rows = fp8.pack_rows(q, s, ue8m0=ue8m0)
    assert rows.dtype == torch.uint8 and rows.shape == (6, fp8.row_bytes(hidden, ue8m0))
    q2, s2 = fp8.unpack_rows(rows, hidden, ue8m0=ue8m0)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(s2, s)
    assert torch.equal(fp8.decode(fp8.encode(x, precision), precision, hidden, torch.float32),
                       fp8.dequantize_1x128(q, s))


@pytest.mark.parametrize("p", fp8.PRECISIONS)
def test_no_rows_is_fine(p):
    """A rank whose experts receive nothing still takes part: zero rows encode and decode."""
    empty = torch.zeros(0, 300)
    wire = fp8.encode(empty, p)
    assert wire.shape[0] == 0
    assert fp8.decode(wire, p, 300, torch.float32).shape == (0, 300)


def test_pack_refuses_scales_that_are_not_powers_of_two_for_one_byte_exponents():
    q, s = fp8.quantize_1x128(torch.randn(2, 128))
    with pytest.raises(ValueError, match="power of two"):
        fp8.pack_rows(q, s, ue8m0=True)
    with pytest.raises(ValueError, match=r"unpack_rows expects \[T, 129\]"):
        fp8.unpack_rows(fp8.pack_rows(q, s), 128, ue8m0=True)


# --- the formulas -------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [128, 1024, 7168])
def test_wire_bytes_formulas(hidden):
    assert fp8.wire_bytes_per_row(hidden, "fp32") == 4 * hidden
    assert fp8.wire_bytes_per_row(hidden, "bf16") == 2 * hidden
    assert fp8.wire_bytes_per_row(hidden, "fp8") == hidden + 4 * hidden // 128
    assert fp8.wire_bytes_per_row(hidden, "fp8_pow2") == hidden + 4 * hidden // 128
    assert fp8.wire_bytes_per_row(hidden, "fp8_ue8m0") == hidden + hidden // 128
    # the formula is what encode really produces
    x = torch.randn(3, hidden)
    for p in fp8.PRECISIONS:
        wire = fp8.encode(x, p)
        assert wire.numel() * wire.element_size() == 3 * fp8.wire_bytes_per_row(hidden, p)


def test_fp8_with_fp32_scales_is_51_6_percent_of_bf16():
    ratio = fp8.wire_bytes_per_row(7168, "fp8") / fp8.wire_bytes_per_row(7168, "bf16")
    assert math.isclose(ratio, 0.515625)
    assert math.isclose(fp8.wire_bytes_per_row(7168, "fp8_ue8m0") / (2 * 7168), 129 / 256)
    assert fp8.wire_bytes_per_row(300, "fp8") == 300 + 3 * 4  # a short last tile, no padding sent


def test_all_to_all_on_one_rank_still_rounds_and_passes_gradients_in_their_own_precision():
    x = torch.randn(5, 256, requires_grad=True)
    y = fp8.all_to_all(x, None, [5], [5], "dispatch", precision=("fp8", "bf16"))
    assert torch.equal(y, fp8.fake_quantize_1x128(x.detach()))
    g = torch.randn(5, 256)
    y.backward(g)
    assert torch.equal(x.grad, fp8.round_to_bf16(g))


def test_pow2_scales_round_up_at_every_exponent_edge():
    """A power-of-two scale is the smallest power of two at or above amax / 448.

    DeepGEMM (deepseek-ai/DeepGEMM, deep_gemm/utils/math.py, ``ceil_to_ue8m0`` as used by
    ``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8``, commit 54e22612409371d6364144b6
    9086735beb54e98b) rounds the float32 scale up by its exponent bits: a scale that is
    exactly a power of two stays, anything above it (by one ulp) goes to the next power.
    Checked on the edge values of every exponent the amax floor allows, not on random data.
    """
    powers = [2.0 ** k for k in range(-20, 21)]
    edges = []
    for p in powers:
        amax = torch.tensor(p * fp8.E4M3_MAX, dtype=torch.float32)
        edges += [amax, torch.nextafter(amax, torch.tensor(float("inf"))),
                  torch.nextafter(amax, torch.tensor(0.0))]
    amax = torch.stack(edges)
    scale = fp8.scale_from_amax(amax, pow2=True)
    exact = fp8.scale_from_amax(amax, pow2=False)
    mantissa, _ = torch.frexp(scale)
    assert bool((mantissa == 0.5).all())                 # every scale is a power of two
    assert bool((scale >= exact).all()), (amax[scale < exact], scale[scale < exact])
    assert bool((scale / 2 < exact).all())               # ... and the smallest such one
    assert bool(((amax / scale) <= fp8.E4M3_MAX).all())   # nothing above 448 after dividing


def test_the_stored_timing_reference_is_chapter_8s_measurement():
    """The reference chapter 8 prints beside the reader's timing
    (``bench/bench_fp8.py --save-reference``): the same sizes, the same traced bytes, and
    where it was measured."""
    from tutorial_lib import reference
    ref = reference.load("ch08_fp8_all_to_all")
    assert [r["hidden"] for r in ref.rows] == [1024, 4096]
    for r in ref.rows:
        assert r["bf16_bytes"] == 2048 * fp8.wire_bytes_per_row(r["hidden"], "bf16")
        assert r["fp8_bytes"] == 2048 * fp8.wire_bytes_per_row(r["hidden"], "fp8")
        assert r["bf16_ms"] > 0 and r["fp8_ms"] > 0
    assert "cores" in ref.machine and ref.date and ref.load is not None
    assert ref.command == "python bench/bench_fp8.py --save-reference"
