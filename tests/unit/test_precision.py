"""Precision recipes: rule matching, the named recipes, files, and apply_recipe on a module tree
named like ``DeepSeekModel`` (serial: no processes).

The simulated matmul is checked against the same arithmetic written out by hand: the input
quantized in 1x128 tiles, the weight in 128x128 blocks, the output gradient in 1x128 tiles,
and gradients straight through the rounding.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import fp8, moe, precision
from tutorial_lib.precision import (PrecisionRecipe, apply_recipe, get_recipe, recipe_from_file,
                                    remove_recipe, resolve_recipe)

from ..tiny_deepseek import TinyDeepSeek
from tests.asserts import every

HIDDEN, VOCAB = 128, 32


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyDeepSeek(num_layers=3, hidden=HIDDEN, vocab=VOCAB)


IDS = torch.randint(0, VOCAB, (8, 2), generator=torch.Generator().manual_seed(1))


# --- DeepSeek-V3's dispatch scales -----------------------------------------------------------


def test_deepseek_v3_sends_fp8_legs_with_power_of_two_scales_as_fp32_numbers():
    """V3's FP8 legs round every scale up to a power of two, and the scales travel as fp32.

    DeepSeek-V3 Technical Report (arXiv:2412.19437v2), section 3.3.3, "Low-Precision
    Communication": the activations quantized before the dispatch (the MoE up-projection's
    input) use integral-power-of-two scaling factors, and the activation gradients before the
    down-projection (the combine's backward) are treated the same way; the forward combine and
    the dispatch's backward stay BF16.  DeepEP (deepseek-ai/DeepEP, deep_ep/buffers/legacy.py,
    ``Buffer.dispatch`` takes FP8 tokens with a ``[tokens, hidden // 128]`` ``torch.float``
    scale tensor; ``Buffer.low_latency_dispatch`` has ``round_scale`` for power-of-two scales
    and a separate ``use_ue8m0`` to pack them into bytes; commit dd758caf451848bd150e1046af3d0a73e5fff38d)
    keeps the two apart, so the bytes of a row stay ``H + 4H/128`` unless UE8M0 packing is asked for.
    """
    dispatch, combine = get_recipe("deepseek_v3").communication_of("layers.3.mlp")
    assert dispatch == ("fp8_pow2", "bf16") and combine == ("bf16", "fp8_pow2")
    tokens = torch.randn(6, 7168, generator=torch.Generator().manual_seed(0)) * 5
    for precision_name in (dispatch[0], combine[1]):
        wire = fp8.encode(tokens, precision_name)
        assert wire.shape == (6, 7168 + 4 * 7168 // 128)                     # 7392 bytes a row
        q, scales = fp8.unpack_rows(wire, 7168)                                # fp32 scales ...
        mantissa, _ = torch.frexp(scales)
        assert bool((mantissa == 0.5).all())                                  # ... powers of two
        assert torch.equal(scales, fp8.tile_scales(tokens, pow2=True))        # rounded up from amax/448
    # a pow2 or UE8M0 dispatcher rule turns every FP8 leg of the recipe into its flavour
    ue8m0 = PrecisionRecipe(rules=[("*.dispatcher", "fp8_ue8m0")], dispatch=("fp8", "bf16"),
                            combine=("bf16", "fp8"))
    assert ue8m0.communication_of("layers.3.mlp") == (("fp8_ue8m0", "bf16"), ("bf16", "fp8_ue8m0"))


# --- rules ------------------------------------------------------------------------------


def test_first_match_wins_and_globs_respect_the_layer_index():
    recipe = PrecisionRecipe(rules=[("layers.1.*", "bf16"), ("*.router", "fp32"), ("*", "fp8")],
                             default="fp32")
    assert recipe.precision_of("layers.1.mlp.router") == "bf16"   # the earlier rule wins
    assert recipe.precision_of("layers.10.mlp.router") == "fp32"  # layers.1.* is not layers.10
    assert recipe.precision_of("layers.10.mlp.experts") == "fp8"
    assert PrecisionRecipe(default="bf16").precision_of("anything") == "bf16"


def test_named_recipes_follow_deepseek_v3():
    v3 = get_recipe("deepseek_v3")
    assert v3.precision_of("embedding.word_embeddings") == "bf16"
    assert v3.precision_of("output_layer") == "bf16"
    assert v3.precision_of("layers.4.mlp.router") == "fp32"
    assert v3.precision_of("layers.4.input_layernorm") == "fp32"
    assert v3.precision_of("final_layernorm") == "fp32"
    assert v3.precision_of("layers.4.self_attention.core_attention") == "bf16"
    for name in ("layers.4.self_attention.linear_qkv", "layers.4.self_attention.linear_proj",
                 "layers.0.mlp.linear_fc1", "layers.4.mlp.experts", "layers.4.mlp.shared_experts"):
        assert v3.precision_of(name) == "fp8", name
    assert v3.communication_of("layers.4.mlp") == (("fp8_pow2", "bf16"), ("bf16", "fp8_pow2"))
    assert get_recipe("fp32").communication_of("layers.4.mlp") == (None, None)
    assert get_recipe("bf16").communication_of("layers.4.mlp") == (("bf16",) * 2, ("bf16",) * 2)
    get_recipe("deepseek_v3").rules.append(("x", "fp32"))  # a copy: the named one is unchanged
    assert ("x", "fp32") not in get_recipe("deepseek_v3").rules


def test_bad_recipes_are_refused_with_the_rule_that_broke():
    with pytest.raises(ValueError, match=r"rule 1 \('\*\.router'\).*unknown precision 'fp16'"):
        PrecisionRecipe("mine", rules=[("a", "fp8"), ("*.router", "fp16")])
    with pytest.raises(ValueError, match="rule 0: a rule is a \\(glob pattern, precision\\) pair"):
        PrecisionRecipe("mine", rules=[("a",)])
    with pytest.raises(ValueError, match=r"precision recipe 'fp16' is neither a named recipe \(fp32, bf16, deepseek_v3\)"):
        resolve_recipe("fp16")


# --- files ------------------------------------------------------------------------------


def test_recipe_files_in_toml_and_json(tmp_path):
    toml = tmp_path / "ends.toml"
    toml.write_text('base = "deepseek_v3"\nname = "ends"\nrules = [["layers.0.*", "bf16"]]\n'
                    'combine = ["bf16", "bf16"]\n')
    recipe = recipe_from_file(str(toml))
    assert recipe.name == "ends" and recipe.rules[0] == ("layers.0.*", "bf16")
    assert recipe.rules[1:] == get_recipe("deepseek_v3").rules  # user rules come first
    assert recipe.precision_of("layers.0.mlp.linear_fc1") == "bf16"
    assert recipe.precision_of("layers.1.mlp.experts") == "fp8"
    assert recipe.combine == ("bf16", "bf16") and recipe.dispatch == ("fp8_pow2", "bf16")
    js = tmp_path / "plain.json"
    js.write_text(json.dumps({"default": "bf16", "dispatch": "none", "rules": [["*.router", "fp32"]]}))
    plain = resolve_recipe(str(js))
    assert plain.name == "plain.json" and plain.default == "bf16" and plain.dispatch is None
    assert recipe_from_file(str(js)).to_dict() == plain.to_dict()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rule": []}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rule'\]"):
        recipe_from_file(str(bad))
    with pytest.raises(ValueError, match=".json or .toml"):
        recipe_from_file(str(tmp_path / "x.yaml"))


# --- apply_recipe ---------------------------------------------------------------------------


def test_the_plan_names_every_linear_like_module_and_dispatcher(model):
    plan = {e.name: e for e in apply_recipe(model, "deepseek_v3")}
    assert plan["layers.0.self_attention.linear_qkv"].precision == "fp8"
    assert plan["layers.0.mlp.linear_fc2"].precision == "fp8"
    assert plan["layers.1.mlp.router"].precision == "fp32"
    assert plan["layers.1.mlp.router"].rule == "*.router"
    assert plan["layers.2.mlp.experts"].precision == "fp8"
    assert plan["layers.2.mlp.experts"].rule == "default"
    assert plan["output_layer"].precision == "bf16"
    assert plan["layers.1.mlp.dispatcher"].precision == "dispatch fp8_pow2/bf16, combine bf16/fp8_pow2"
    assert "layers.0.mlp.dispatcher" not in plan  # layer 0 is dense
    assert model.layers[1].mlp.dispatcher.dispatch_precision == ("fp8_pow2", "bf16")
    assert model.layers[2].mlp.dispatcher.combine_precision == ("bf16", "fp8_pow2")
    kinds = {e.kind for e in plan.values()}
    assert kinds == {"ColumnParallelLinear", "RowParallelLinear", "Router", "RoutedExperts",
                     "SharedExperts", "Linear", "dispatcher"}


def test_a_rule_for_a_layer_sets_its_communication_too(model):
    recipe = get_recipe("deepseek_v3")
    recipe.rules.insert(0, ("layers.2.*", "bf16"))
    apply_recipe(model, recipe)
    assert model.layers[2].mlp.dispatcher.dispatch_precision == ("bf16", "bf16")
    assert model.layers[1].mlp.dispatcher.dispatch_precision == ("fp8_pow2", "bf16")
    recipe.rules.insert(0, ("layers.1.mlp.dispatcher", "fp32"))
    apply_recipe(model, recipe)
    assert model.layers[1].mlp.dispatcher.dispatch_precision is None


def _simulated_linear(x, w, precision_name, dy):
    """The same matmul written out: rounded input and weight, rounded output gradient."""
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    if precision_name == "bf16":
        xq, wq = fp8.round_to_bf16(xr.detach()), fp8.round_to_bf16(wr.detach())
        dyq = fp8.round_to_bf16(dy)
    else:
        pow2 = fp8.has_pow2_scales(precision_name)
        xq = fp8.fake_quantize_1x128(xr.detach(), pow2=pow2)
        wq = fp8.fake_quantize_blocks(wr.detach(), pow2=pow2)
        dyq = fp8.fake_quantize_1x128(dy, pow2=pow2)
    y = xq @ wq.T
    return y, dyq @ wq, dyq.reshape(-1, dyq.shape[-1]).T @ xq.reshape(-1, xq.shape[-1])


@pytest.mark.parametrize("precision_name", ["bf16", "fp8", "fp8_pow2", "fp8_ue8m0"])
def test_a_linear_sees_rounded_inputs_weights_and_output_gradients(precision_name):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 200, bias=False)
    apply_recipe(layer, PrecisionRecipe(default=precision_name))
    x = torch.randn(3, 5, 256, requires_grad=True)
    dy = torch.randn(3, 5, 200)
    y = layer(x)
    y.backward(dy)
    want_y, want_dx, want_dw = _simulated_linear(x, layer.weight, precision_name, dy)
    assert torch.allclose(y, want_y, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x.grad, want_dx, atol=1e-5, rtol=1e-5)
    assert torch.allclose(layer.weight.grad, want_dw, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y, x.detach() @ layer.weight.detach().T, atol=1e-4)  # it did round


def test_routed_experts_quantize_each_experts_weights_in_blocks():
    torch.manual_seed(0)
    experts = moe.RoutedExperts(4, 128, 160)
    rows = torch.randn(10, 128)
    apply_recipe(experts, "deepseek_v3")
    got = experts(rows, [3, 0, 5, 2])
    want, start = [], 0
    q = fp8.fake_quantize_1x128
    for i, n in enumerate([3, 0, 5, 2]):
        chunk = rows[start:start + n]
        start += n
        g, u, d = (fp8.fake_quantize_blocks(w[i].detach()) for w in
                   (experts.weight_gate, experts.weight_up, experts.weight_down))
        hidden = F.silu(q(chunk) @ g.T) * (q(chunk) @ u.T)
        want.append(q(hidden) @ d.T)
    assert torch.allclose(got, torch.cat(want), atol=1e-5)


def test_fp32_recipe_and_remove_recipe_give_back_the_exact_model(model):
    plain = model(IDS)
    apply_recipe(model, "fp32")
    assert torch.equal(model(IDS), plain)
    apply_recipe(model, "deepseek_v3")
    changed = model(IDS)
    assert not torch.equal(changed, plain)
    apply_recipe(model, "deepseek_v3")  # applying again replaces, it does not stack hooks
    assert torch.equal(model(IDS), changed)
    assert every(len(m._forward_pre_hooks) <= 1 for m in model.modules())
    remove_recipe(model)
    assert torch.equal(model(IDS), plain)
    assert every(m.dispatcher.dispatch_precision is None for m in model.modules()
               if isinstance(m, moe.MoELayer))


def test_recipes_order_the_error_fp32_bf16_deepseek_v3(model):
    reference = model(IDS)
    errors = {}
    for name in ("bf16", "deepseek_v3"):
        apply_recipe(model, name)
        errors[name] = ((model(IDS) - reference).norm() / reference.norm()).item()
    assert 0 < errors["bf16"] < errors["deepseek_v3"] < 0.1, errors


def test_an_exception_inside_a_module_does_not_leave_the_simulation_on():
    layer = torch.nn.Linear(128, 8)
    apply_recipe(layer, "deepseek_v3")
    with pytest.raises(RuntimeError):
        layer(torch.randn(2, 7))  # wrong width
    x, w = torch.randn(4, 128), torch.randn(8, 128)
    assert torch.equal(F.linear(x, w), x @ w.T)  # outside the module: plain arithmetic again


def test_gradients_reach_every_parameter_under_the_recipe(model):
    apply_recipe(model, "deepseek_v3")
    F.cross_entropy(model(IDS).flatten(0, 1), IDS.flatten()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


# --- DeepSeek-V3's FP8 recipe card ---------------------------------------------------------
#
# The card (recipes.DEEPSEEK_V3_FP8_CARD) states, per choice of DeepSeek-V3 Technical Report
# (arXiv:2412.19437v2) section 3.3, what this library does.  Each entry's "here" is checked
# below against the library, so the card cannot drift from the code: an entry without a
# check fails test_every_card_entry_has_a_check.


def _fp8_linear_run(in_features=256, out_features=256, seed=0):
    """A bias-free linear under deepseek_v3's default (fp8), one forward and backward."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    apply_recipe(layer, "deepseek_v3")
    x = torch.randn(130, in_features, requires_grad=True)
    dy = torch.randn(130, out_features)
    y = layer(x)
    y.backward(dy)
    return layer, x, dy, y


def _card_gemms():
    layer, x, dy, y = _fp8_linear_run()
    want_y, want_dx, want_dw = _simulated_linear(x, layer.weight, "fp8", dy)
    # forward, input gradient and weight gradient all see FP8 operands, product in fp32
    assert torch.allclose(y, want_y, atol=1e-5) and torch.allclose(x.grad, want_dx, atol=1e-5)
    assert torch.allclose(layer.weight.grad, want_dw, atol=1e-4)
    assert y.dtype == torch.float32


def _card_format():
    assert fp8.E4M3 is torch.float8_e4m3fn and fp8.E4M3_MAX == 448.0
    assert get_recipe("deepseek_v3").quantize_gradients is True
    layer, x, dy, _ = _fp8_linear_run()
    # the output gradient reached the backward matmul as E4M3 values times 1x128 scales
    dyq = fp8.fake_quantize_1x128(dy)
    assert torch.allclose(x.grad, dyq @ fp8.fake_quantize_blocks(layer.weight.detach()),
                          atol=1e-5)
    assert fp8.quantize_1x128(dy)[0].dtype == torch.float8_e4m3fn


def _card_online_scaling():
    small = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    before = fp8.tile_scales(small)
    fp8.quantize_1x128(small * 1e4)  # a huge tensor quantized in between leaves no trace
    assert torch.equal(fp8.tile_scales(small), before)
    amax = small.view(4, 2, 128).abs().amax(-1).clamp(min=fp8.AMAX_FLOOR)
    assert torch.equal(before, amax / 448)


def _card_activation_tiles():
    assert fp8.TILE == 128
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[1, 200] = 1e3  # token 1, tile 1
    changed = fp8.tile_scales(y) != fp8.tile_scales(x)
    assert changed.shape == (3, 3) and changed.nonzero().tolist() == [[1, 1]]


def _card_wgrad_tiles():
    layer, x, dy, _ = _fp8_linear_run()
    dyq = fp8.fake_quantize_1x128(dy)
    one_by_128 = dyq.T @ fp8.fake_quantize_1x128(x.detach())
    by_128x1 = dyq.T @ fp8.fake_quantize_1x128(x.detach().T).T  # what V3 re-tiles to
    assert torch.allclose(layer.weight.grad, one_by_128, atol=1e-4)  # the forward's tiles
    assert not torch.allclose(layer.weight.grad, by_128x1, atol=1e-4)  # not re-tiled


def _card_activation_cache():
    assert not any("e5m6" in name for name in fp8.PRECISIONS)  # no E5M6 format at all
    layer, x, dy, _ = _fp8_linear_run()
    # what the weight gradient read back is the forward's E4M3 1x128 rounding, in fp32
    cached = fp8.fake_quantize_1x128(x.detach())
    assert cached.dtype == torch.float32
    assert torch.allclose(layer.weight.grad, fp8.fake_quantize_1x128(dy).T @ cached, atol=1e-4)


def _card_weight_blocks():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    spiked = w.clone()
    spiked[10, 200] = 1e3  # block (0, 1)
    moved = (fp8.fake_quantize_blocks(spiked) != fp8.fake_quantize_blocks(w))
    blocks = moved.view(2, 128, 2, 128).any(dim=3).any(dim=1)
    assert blocks.tolist() == [[False, True], [False, False]]


def _card_accumulation():
    layer, x, _, y = _fp8_linear_run(in_features=1024, out_features=8)
    xq, wq = fp8.fake_quantize_1x128(x.detach()), fp8.fake_quantize_blocks(layer.weight.detach())
    exact = (xq.double() @ wq.double().T)
    assert y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= 1e-5 * exact.abs().max()).all()  # fp32 throughout


def _card_kept_precision():
    v3 = get_recipe("deepseek_v3")
    kept = {"embedding.word_embeddings": "bf16", "output_layer": "bf16",
            "layers.4.mlp.router": "fp32", "layers.4.input_layernorm": "fp32",
            "layers.4.pre_mlp_layernorm": "fp32", "final_layernorm": "fp32",
            "layers.4.self_attention.core_attention": "bf16"}
    assert {name: v3.precision_of(name) for name in kept} == kept


def _card_communication():
    assert fp8.DEEPSEEK_V3_DISPATCH == ("fp8_pow2", "bf16")
    assert fp8.DEEPSEEK_V3_COMBINE == ("bf16", "fp8_pow2")
    assert fp8.wire_bytes_per_row(7168, "fp8_pow2") == 7168 + 4 * 7168 // 128  # fp32 scales


def _card_optimizer_moments():
    import inspect

    from tutorial_lib import train_4d
    # train_worker builds its optimizer in _data_parallel (plain, ZeRO-1, ZeRO-2/3): Adam,
    # and nothing in either casts to bf16
    source = (inspect.getsource(train_4d.train_worker)
              + inspect.getsource(train_4d._data_parallel))
    assert "_data_parallel(" in inspect.getsource(train_4d.train_worker)
    assert "torch.optim.Adam" in source and "bfloat16" not in source
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.Adam([param])
    param.grad = torch.ones(4)
    optimizer.step()
    assert {v.dtype for v in optimizer.state[param].values() if v.dim()} == {torch.float32}


def _card_master_weights():
    layer, x, dy, _ = _fp8_linear_run()
    assert layer.weight.dtype == layer.weight.grad.dtype == torch.float32
    # straight through: the gradient is the fp32 product, not itself rounded to FP8 blocks
    assert not torch.equal(layer.weight.grad, fp8.fake_quantize_blocks(layer.weight.grad))


CARD_CHECKS = {
    "gemms": _card_gemms, "format": _card_format, "online_scaling": _card_online_scaling,
    "activation_tiles": _card_activation_tiles, "wgrad_tiles": _card_wgrad_tiles,
    "activation_cache": _card_activation_cache,
    "weight_blocks": _card_weight_blocks, "accumulation": _card_accumulation,
    "kept_precision": _card_kept_precision, "communication": _card_communication,
    "optimizer_moments": _card_optimizer_moments, "master_weights": _card_master_weights,
}


def test_every_card_entry_has_a_check_and_the_card_covers_section_3_3():
    """The card lists DeepSeek-V3's FP8 choices of the V3 report (arXiv:2412.19437v2)
    section 3.3: E4M3 on every tensor (3.3.2), online per-tile/block amax (3.3.2), FP32
    promotion every 128 accumulated elements (3.3.2), 1x128 activation tiles and 128x128
    weight blocks (3.3.2), 128x1 tiles for the weight gradient (3.3.3, 3.5.2), the E5M6
    cache of the attention output projection's input (3.3.3), BF16 AdamW
    moments and FP32 master weights (3.3.3), the kept-precision modules (3.3.1) and the FP8
    dispatch legs (3.3.3)."""
    keys = [e.key for e in precision.DEEPSEEK_V3_FP8_CARD]
    assert len(keys) == len(set(keys)) and set(keys) == set(CARD_CHECKS)
    card = {e.key: e for e in precision.DEEPSEEK_V3_FP8_CARD}
    assert "E4M3" in card["format"].deepseek_v3 and "gradients" in card["format"].deepseek_v3
    assert "1x128" in card["activation_tiles"].deepseek_v3
    assert "128x1" in card["wgrad_tiles"].deepseek_v3
    assert "E5M6" in card["activation_cache"].deepseek_v3
    assert "128x128" in card["weight_blocks"].deepseek_v3
    assert "128 elements" in card["accumulation"].deepseek_v3
    assert "BF16" in card["optimizer_moments"].deepseek_v3
    assert "FP32" in card["master_weights"].deepseek_v3
    assert "amax" in card["online_scaling"].deepseek_v3
    assert every(e.section.startswith("3.") for e in card.values())
    rows = precision.recipe_card_rows()
    assert len(rows) == len(keys) and all(len(r) == 4 and all(r) for r in rows)


@pytest.mark.parametrize("key", sorted(CARD_CHECKS))
def test_each_card_entry_says_what_the_library_does(key):
    entry = {e.key: e for e in precision.DEEPSEEK_V3_FP8_CARD}[key]
    assert entry.here.startswith("not ") == (not entry.simulated), entry
    CARD_CHECKS[key]()
