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
    assert all(len(m._forward_pre_hooks) <= 1 for m in model.modules())
    remove_recipe(model)
    assert torch.equal(model(IDS), plain)
    assert all(m.dispatcher.dispatch_precision is None for m in model.modules()
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
