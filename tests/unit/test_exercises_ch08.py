"""Chapter 8's checkers name the classic mistakes (all pure: no processes; the notebook's
exercise cells: tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tutorial_lib import fp8
from tutorial_lib.exercises import ch08
from tutorial_lib.exercises.ch08 import check_keep_ends_in_bf16, check_payload_bytes, check_quantize_1x128
from tests.asserts import every


# --- 8.1 -------------------------------------------------------------------------------------


def _tiles(x):
    return x.float().view(x.shape[0], x.shape[1] // 128, 128)


def q_right_multiplying(x):
    """x * (448 / amax) instead of x / (amax / 448): one E4M3 step of slack covers it."""
    tiles = _tiles(x)
    amax = tiles.abs().amax(-1).clamp(min=1e-4)
    q = (tiles * (448 / amax)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(x.shape), amax / 448


def q_per_tensor(x):
    scale = x.float().abs().max().clamp(min=1e-4) / 448
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.expand(x.shape[0], x.shape[1] // 128)


def q_per_token(x):
    scale = x.float().abs().amax(1, keepdim=True).clamp(min=1e-4) / 448
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.expand(x.shape[0], x.shape[1] // 128)


def q_inverted(x):
    tiles = _tiles(x)
    scale = 448 / tiles.abs().amax(-1).clamp(min=1e-4)
    return (tiles * scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape), scale


def q_no_floor(x):
    tiles = _tiles(x)
    scale = tiles.abs().amax(-1) / 448
    return (tiles / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape), scale


def q_integers(x):
    tiles = _tiles(x)
    scale = tiles.abs().amax(-1).clamp(min=1e-4) / 448
    return torch.round(tiles / scale[..., None]).view(x.shape), scale


def q_flat_scales(x):
    q, s = fp8.quantize_1x128(x)
    return q, s.flatten()


def test_an_equivalent_formula_passes():
    assert check_quantize_1x128(q_right_multiplying)
    assert check_quantize_1x128(lambda x: (lambda q, s: (q.float(), s))(*fp8.quantize_1x128(x)))


@pytest.mark.parametrize("wrong,hint", [
    (q_per_tensor, ch08.HINT_Q_PER_TENSOR), (q_per_token, ch08.HINT_Q_PER_TOKEN),
    (q_inverted, ch08.HINT_Q_INVERTED), (q_no_floor, ch08.HINT_Q_NO_FLOOR),
    (q_integers, ch08.HINT_Q_INTEGERS), (q_flat_scales, ch08.HINT_Q_FORMAT),
    (lambda x: x, ch08.HINT_Q_FORMAT), (lambda x: None, ch08.HINT_Q_FORMAT),
])
def test_each_quantize_mistake_gets_its_hint(wrong, hint):
    result = check_quantize_1x128(wrong)
    assert not result.passed and result.hint == hint, str(result)


def test_no_floor_fails_only_on_the_zero_and_tiny_cases():
    result = check_quantize_1x128(q_no_floor)
    failed = {c.name for c in result.cases if not c.passed}
    assert failed == {"4 tokens x 256, token 2 all zeros", "2 tokens x 128, tiny values (amax 1e-6)"}


def q_no_clamp(x):
    tiles = _tiles(x)
    scale = tiles.abs().amax(-1).clamp(min=1e-4) / 448
    return (tiles / scale[..., None]).to(torch.float8_e4m3fn).view(x.shape), scale


def test_a_quantizer_without_the_clamp_is_caught_by_a_tile_that_rounds_above_448():
    """Exercises that teach: without the clamp a quantizer passed (this CPU build's cast saturates). The
    checker casts as the non-saturating builds do, and one case's tile divides to just above
    448 in float32."""
    v = torch.tensor(ch08.ROUNDS_ABOVE_448)
    assert (v / (v / 448)).item() > 448
    assert torch.tensor(500.0).to(torch.float8_e4m3fn).float().item() == 448  # saturates here
    result = check_quantize_1x128(q_no_clamp)
    assert not result.passed and result.hint == ch08.HINT_Q_NO_CLAMP, str(result)
    assert "2 tokens x 256, a tile whose amax divides to just above 448" in {
        c.name for c in result.cases if not c.passed}
    with ch08.NonSaturatingCast():
        cast = torch.tensor([500.0, 1.0]).to(torch.float8_e4m3fn).float()
    assert cast.isnan().tolist() == [True, False]


def test_a_quantizer_that_raises_is_a_case_not_a_crash():
    result = check_quantize_1x128(lambda x: 1 / 0)
    assert not result.passed and all("ZeroDivisionError" in c.detail for c in result.cases)


# --- 8.2 -------------------------------------------------------------------------------------


def _right(t, k, h, p):
    return ch08.reference_payload_bytes(t, k, h, p)


def test_the_reference_is_the_wire_formula_and_the_encoded_size():
    for _, t, k, h, p in ch08.payload_cases():
        wire = fp8.encode(torch.zeros(1, h), p)
        assert _right(t, k, h, p) == t * k * wire.numel() * wire.element_size()
    assert _right(4096, 8, 7168, "fp8") == 4096 * 8 * 7392


@pytest.mark.parametrize("wrong,hint", [
    (lambda t, k, h, p: t * k * h * {"fp32": 4, "bf16": 2}.get(p, 1), ch08.HINT_BYTES_NO_SCALES),
    (lambda t, k, h, p: t * k * {"fp32": 4 * h, "bf16": 2 * h, "fp8": h + 4, "fp8_pow2": h + 4,
                                 "fp8_ue8m0": h + 1}[p], ch08.HINT_BYTES_ONE_SCALE),
    (lambda t, k, h, p: t * k * {"fp32": 4 * h, "bf16": 2 * h, "fp8": h + h // 128,
                                 "fp8_pow2": h + 4 * h // 128, "fp8_ue8m0": h + 4 * h // 128}[p],
     ch08.HINT_BYTES_SCALE_SIZE),
    (lambda t, k, h, p: t * k * {"fp32": 4 * h, "bf16": 2 * h, "fp8": h + 4 * h // 128,
                                 "fp8_pow2": h + h // 128, "fp8_ue8m0": h + h // 128}[p],
     ch08.HINT_BYTES_POW2_AS_ONE_BYTE),
    (lambda t, k, h, p: _right(t, k, h, p) // k, ch08.HINT_BYTES_TOKENS),
    (lambda t, k, h, p: 8 * _right(t, k, h, p), ch08.HINT_BYTES_BITS),
    (lambda t, k, h, p: "lots", ch08.HINT_BYTES_FORMAT),
    (lambda t, k, h, p: _right(t, k, h, p) + 1, ch08.HINT_BYTES_GENERIC),
])
def test_each_payload_mistake_gets_its_hint(wrong, hint):
    result = check_payload_bytes(wrong)
    assert not result.passed and result.hint == hint, str(result)


def test_bf16_at_four_bytes_fails_only_the_bf16_cases():
    wrong = lambda t, k, h, p: t * k * 4 * h if p == "bf16" else _right(t, k, h, p)  # noqa: E731
    result = check_payload_bytes(wrong)
    assert {c.name for c in result.cases if not c.passed} == {
        name for name, *_, p in ch08.payload_cases() if p == "bf16"}
    assert result.hint == ch08.HINT_BYTES_ELEMENT


# --- 8.3 ---------------------------------------------------------------------------------------


def _after_base(rules_of):
    """The student's rules appended after the base recipe's rules."""
    return lambda base, n: dataclasses.replace(base, rules=list(base.rules) + rules_of(n))


def _before_base(rules_of):
    """The student's rules put before the base recipe's rules (they win every match)."""
    return lambda base, n: dataclasses.replace(base, rules=rules_of(n) + list(base.rules))


def _ends(n):
    return [("layers.0.*", "bf16"), (f"layers.{n - 1}.*", "bf16")]


def _fp8_modules_of_the_ends(n):
    """Only the modules deepseek_v3 runs in FP8, named one by one: safe before the base."""
    return [(f"layers.{i}.{part}", "bf16") for i in (0, n - 1)
            for part in ("self_attention.linear_*", "mlp.linear_fc*", "mlp.experts",
                         "mlp.shared_experts", "mlp.dispatcher")]


def test_the_ends_after_the_base_rules_pass_and_keep_the_router_and_norms_fp32():
    """First match wins: appended after the base's rules, ``layers.0.*`` only gets what the
    base leaves to its fp8 default, so the router and the layernorms stay fp32.

    The rule being taught is DeepSeek-V3's: the report (arXiv:2412.19437v2, section 3.3.1)
    keeps the MoE gating modules and the normalization operators in their original
    precision while the linears run in FP8; the library's ``deepseek_v3`` recipe keeps them
    in fp32 (``*.router``, ``*layernorm``), and a recipe that moves the ends to BF16 must
    not move those down to BF16.
    """
    assert not check_keep_ends_in_bf16(_after_base(lambda n: []))  # nothing changed: fails
    assert check_keep_ends_in_bf16(_after_base(_ends))
    assert check_keep_ends_in_bf16(_before_base(_fp8_modules_of_the_ends))
    recipe = _after_base(_ends)(fp8_recipe(), 61)
    for layer in (0, 60):
        assert recipe.precision_of(f"layers.{layer}.mlp.experts") == "bf16"
        assert recipe.precision_of(f"layers.{layer}.input_layernorm") == "fp32"
    assert recipe.precision_of("layers.60.mlp.router") == "fp32"
    assert recipe.communication_of("layers.60.mlp") == (("bf16", "bf16"), ("bf16", "bf16"))


def test_end_rules_before_the_base_rules_demote_the_router_and_norms_and_fail():
    """The chapter's old solution: ``layers.<i>.*`` first, so it wins over ``*.router`` and
    ``*layernorm`` and turns them bf16.  The checker used to accept that; it must name it."""
    result = check_keep_ends_in_bf16(_before_base(_ends))
    assert not result.passed and result.hint == ch08.HINT_ENDS_DEMOTED, str(result)
    assert every(not c.passed for c in result.cases)
    assert "layers.0.input_layernorm -> bf16" in result.cases[0].detail
    assert "wanted" not in result.cases[0].detail  # the student's value, not the key
    last = result.cases[-1]  # 61 layers: layer 60 is MoE, its router was demoted
    assert "61 layers" in last.name and not last.passed
    recipe = _before_base(_ends)(fp8_recipe(), 61)
    assert recipe.precision_of("layers.60.mlp.router") == "bf16"  # what the hint explains


def test_only_the_last_router_in_bf16_fails_on_every_model():
    """Right everywhere but one module: the last layer's router in bf16 instead of fp32."""
    def one_router_down(base, n):
        return dataclasses.replace(base, rules=[(f"layers.{n - 1}.mlp.router", "bf16")]
                                   + list(base.rules) + _ends(n))
    result = check_keep_ends_in_bf16(one_router_down)
    assert not result.passed and result.hint == ch08.HINT_ENDS_DEMOTED, str(result)
    assert [c.passed for c in result.cases] == [False] * len(ch08.ENDS_CASES)
    assert every("1 module(s) wrong" in c.detail and ".mlp.router -> bf16" in c.detail
               for c in result.cases)


def fp8_recipe():
    from tutorial_lib.precision import get_recipe
    return get_recipe("deepseek_v3")


def _mutating(base, n):
    base.rules[len(base.rules):] = _ends(n)
    return base


@pytest.mark.parametrize("wrong,hint", [
    (_after_base(lambda n: [("layers.0.*", "bf16"), (f"layers.{n}.*", "bf16")]), ch08.HINT_ENDS_LAST),
    (_after_base(lambda n: [(f"layers.{n - 1}.*", "bf16")]), ch08.HINT_ENDS_FIRST),
    (_after_base(lambda n: [("layers.0.*", "bf16"), (f"layers.{n - 1}.self_attention.*", "bf16"),
                            (f"layers.{n - 1}.mlp.linear_fc*", "bf16")]), ch08.HINT_ENDS_MOE),
    (_after_base(lambda n: [("layers.0.*", "bf16"), ("layers.60.*", "bf16")]), ch08.HINT_ENDS_LAST),
    (lambda base, n: dataclasses.replace(base, default="bf16"), ch08.HINT_ENDS_TOO_MUCH),
    (_after_base(lambda n: [("layers.*", "bf16")]), ch08.HINT_ENDS_TOO_MUCH),
    (_before_base(_ends), ch08.HINT_ENDS_DEMOTED),
    (_mutating, ch08.HINT_ENDS_MUTATED),
    (lambda base, n: [("layers.0.*", "bf16")], ch08.HINT_ENDS_FORMAT),
])
def test_each_recipe_mistake_gets_its_hint(wrong, hint):
    result = check_keep_ends_in_bf16(wrong)
    assert not result.passed and result.hint == hint, str(result)


def test_the_cases_include_deepseek_v3_depth_and_names_like_the_model():
    assert any(n == 61 for _, n, _ in ch08.ENDS_CASES)
    names = ch08.deepseek_module_names(4, 1)
    assert "layers.3.mlp.dispatcher" in names and "layers.0.mlp.linear_fc1" in names
    assert "layers.0.input_layernorm" in names and "layers.3.mlp.router" in names
    assert names[0] == "embedding.word_embeddings" and names[-1] == "output_layer"
