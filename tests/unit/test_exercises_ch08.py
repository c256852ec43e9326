"""Chapter 8's checkers name the classic mistakes (all pure: no processes; the notebook's
exercise cells: tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tutorial_lib import fp8
from tutorial_lib.exercises import ch08
from tutorial_lib.exercises.ch08 import check_keep_ends_in_bf16, check_payload_bytes, check_quantize_1x128


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
    """Issue 14: without the clamp a quantizer passed (this CPU build's cast saturates). The
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
        assert torch.tensor([500.0, 1.0]).to(torch.float8_e4m3fn).float().isnan().tolist() == [True, False]


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


# --- 8.3 -------------------------------------------------------------------------------------


def _with_rules(rules_of):
    """The student's rules after the base's non-FP8 rules (router, norms) and before the rest."""
    def recipe(base, n):
        kept = [rule for rule in base.rules if not rule[1].startswith("fp8")]
        return dataclasses.replace(base, rules=kept + rules_of(n) + list(base.rules))
    return recipe


def test_the_ends_in_bf16_after_the_non_fp8_rules_pass():
    assert not check_keep_ends_in_bf16(_with_rules(lambda n: []))
    assert check_keep_ends_in_bf16(_with_rules(lambda n: [("layers.0.*", "bf16"),
                                                          (f"layers.{n - 1}.*", "bf16")]))


def test_first_match_wins_rules_after_an_fp8_rule_never_decide():
    """Issue 14: first-match-wins was never tested. Under deepseek_v3 no rule names a linear,
    so rules appended after the base's would pass; the last case's base names the experts'
    FP8 in a rule, and end rules placed after it lose there (and only there)."""
    appended = lambda base, n: dataclasses.replace(  # noqa: E731
        base, rules=list(base.rules) + [("layers.0.*", "bf16"), (f"layers.{n - 1}.*", "bf16")])
    result = check_keep_ends_in_bf16(appended)
    assert [c.name for c in result.cases if not c.passed] == [ch08.ENDS_CASES[-1][0]]
    assert result.hint == ch08.HINT_ENDS_SHADOWED
    assert ch08.EXPLICIT_EXPERTS_RULE in ch08.ends_base(ch08.ENDS_CASES[-1][0]).rules


def test_demoting_the_fp32_router_of_an_end_layer_is_rejected():
    """Issue 14: the checker accepted a recipe that put the end layers' router (fp32 in
    deepseek_v3) in BF16, e.g. ('layers.N-1.*', 'bf16') placed before ('*.router', 'fp32')."""
    ends_first = lambda base, n: dataclasses.replace(  # noqa: E731
        base, rules=[("layers.0.*", "bf16"), (f"layers.{n - 1}.*", "bf16")] + list(base.rules))
    result = check_keep_ends_in_bf16(ends_first)
    assert not any(c.passed for c in result.cases) and result.hint == ch08.HINT_ENDS_DEMOTED
    right = _with_rules(lambda n: [("layers.0.*", "bf16"), (f"layers.{n - 1}.*", "bf16")])
    router_only = lambda base, n: dataclasses.replace(  # noqa: E731
        base, rules=[(f"layers.{n - 1}.mlp.router", "bf16")] + right(base, n).rules)
    result = check_keep_ends_in_bf16(router_only)
    assert not result.passed and result.hint == ch08.HINT_ENDS_DEMOTED, str(result)
    assert all(c.detail.startswith("1 module(s) wrong") and "mlp.router -> bf16" in c.detail
               for c in result.cases if not c.passed)


def _mutating(base, n):
    base.rules[:0] = [("layers.0.*", "bf16"), (f"layers.{n - 1}.*", "bf16")]
    return base


@pytest.mark.parametrize("wrong,hint", [
    (_with_rules(lambda n: [("layers.0.*", "bf16"), (f"layers.{n}.*", "bf16")]), ch08.HINT_ENDS_LAST),
    (_with_rules(lambda n: [(f"layers.{n - 1}.*", "bf16")]), ch08.HINT_ENDS_FIRST),
    (_with_rules(lambda n: [("layers.0.*", "bf16"), (f"layers.{n - 1}.self_attention.*", "bf16"),
                            (f"layers.{n - 1}.mlp.linear_fc*", "bf16")]), ch08.HINT_ENDS_MOE),
    (_with_rules(lambda n: [("layers.0.*", "bf16"), ("layers.60.*", "bf16")]), ch08.HINT_ENDS_LAST),
    (lambda base, n: dataclasses.replace(base, default="bf16"), ch08.HINT_ENDS_TOO_MUCH),
    (_with_rules(lambda n: [("layers.*", "bf16")]), ch08.HINT_ENDS_TOO_MUCH),
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
    assert names[0] == "embedding.word_embeddings" and names[-1] == "output_layer"
