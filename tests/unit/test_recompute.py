"""Activation recomputation (chapter 10), the rule (pure) and the serial model (no process).

The pipeline with TP is in tests/dist/test_recompute.py.
"""
import functools
from dataclasses import replace

import pytest
import torch

from tutorial_lib.arguments import TrainingArgs, validate_args
from tutorial_lib.config import ConfigError, ModelConfig, add_arguments
from tutorial_lib.data import synthetic_batch
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.recompute import (KEEP_ALL, KEEP_ALL_BUT_CORE_ATTENTION, KEEP_INPUT, KEEP_NOTHING,
                                    Recompute, check_recompute, kept_per_layer, recompute_groups,
                                    recomputed_at_once)
from tutorial_lib.saved_activations import saved_bytes_by_layer
from tests.asserts import every

FULL_UNIFORM = Recompute("full", "uniform", 2)
FULL_BLOCK = Recompute("full", "block", 1)
SELECTIVE = Recompute("selective")


@pytest.mark.parametrize("recompute,fragments", [
    (Recompute("full"), ["needs recompute_method 'uniform' or 'block'"]),
    (Recompute("full", "uniform"), ["needs recompute_num_layers between 1 and "
                                    "num_layers_per_pipeline_rank (4)"]),
    (Recompute("selective", "uniform"), ["recompute_method ('uniform') is not supported",
                                         "drop --recompute-method"]),
    (Recompute("selective", None, 2), ["recompute_num_layers must be unset", "got 2"]),
    (Recompute("partial", "uniform", 1), ["'full' or 'selective'", "'partial'"]),
    (Recompute("full", "every", 1), ["'uniform' or 'block'", "'every'"]),
    (Recompute("full", "block", 0), ["between 1 and num_layers_per_pipeline_rank (4), got 0"]),
    (Recompute("full", "block", 5), ["between 1 and num_layers_per_pipeline_rank (4), got 5"]),
    (Recompute(None, "block", 1), ["recompute_method ('block') and recompute_num_layers (1) "
                                   "without recompute_granularity", "Megatron ignores it"]),
])
def test_the_recompute_flags_follow_megatrons_rules(recompute, fragments):
    """Megatron-Core 0.20.0 (NVIDIA/Megatron-LM d98e8a64): ``TransformerConfig.__post_init__``
    in megatron/core/transformer/transformer_config.py requires a method (``block`` or
    ``uniform``) and ``recompute_num_layers`` with ``full`` granularity ("must be between 1
    and num_layers_per_pipeline_rank") and no ``recompute_num_layers`` with ``selective``;
    ``validate_args`` in megatron/training/arguments.py asserts no method with ``selective``.
    The course also refuses a method or N without a granularity, which Megatron ignores."""
    with pytest.raises(ConfigError) as info:
        check_recompute(recompute, num_layers=8, pipeline_size=2)
    assert info.value.rule == "recompute"
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    for fine in (Recompute(), SELECTIVE, FULL_UNIFORM, FULL_BLOCK, Recompute("full", "block", 4)):
        check_recompute(fine, num_layers=8, pipeline_size=2)


def test_train_4d_takes_megatrons_recompute_flags_and_refuses_bad_ones_before_starting():
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainingArgs, ["recompute_granularity", "recompute_method",
                                         "recompute_num_layers"])
    parsed = vars(parser.parse_args("--recompute-granularity full --recompute-method block "
                                    "--recompute-num-layers 1".split()))
    args = TrainingArgs(world_size=2, pipeline_model_parallel_size=2, **parsed)
    assert args.recompute == FULL_BLOCK
    validate_args(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["--recompute-granularity", "partial"])
    with pytest.raises(ConfigError, match=r"num_layers_per_pipeline_rank \(2\), got 3"):
        validate_args(replace(args, recompute_num_layers=3))
    # chapter 11's split backward (B, then W) would recompute a region in each pass
    for schedule in ("zb-h1", "zbv"):
        with pytest.raises(ConfigError, match=f"does not run with --schedule {schedule}"):
            validate_args(replace(args, schedule=schedule))


def test_the_layers_recomputed_follow_megatrons_checkpointed_forward():
    """Megatron-Core 0.20.0 (d98e8a64), megatron/core/recompute.py ``checkpointed_forward``
    over a block's ``num_layers_per_pipeline_rank = len(self.layers)`` layers: ``uniform``
    checkpoints ``[0, N)``, ``[N, 2N)``, ..., the last group cut at the chunk's end;
    ``block`` runs each layer alone and checkpoints the first N of them."""
    assert recompute_groups(5, FULL_UNIFORM) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert recompute_groups(3, Recompute("full", "uniform", 4)) == [(0, 3, True)]
    assert recompute_groups(3, FULL_BLOCK) == [(0, 1, True), (1, 2, False), (2, 3, False)]
    assert recompute_groups(2, Recompute("full", "block", 3)) == [(0, 1, True), (1, 2, True)]
    assert recompute_groups(3, SELECTIVE) == recompute_groups(3, Recompute()) == [(0, 3, False)]
    assert kept_per_layer(5, FULL_UNIFORM) == (KEEP_INPUT, KEEP_NOTHING) * 2 + (KEEP_INPUT,)
    assert kept_per_layer(3, FULL_BLOCK) == (KEEP_INPUT, KEEP_ALL, KEEP_ALL)
    assert kept_per_layer(2, SELECTIVE) == (KEEP_ALL_BUT_CORE_ATTENTION,) * 2
    assert kept_per_layer(2, Recompute()) == (KEEP_ALL,) * 2
    assert [recomputed_at_once(5, r) for r in (FULL_UNIFORM, FULL_BLOCK, SELECTIVE)] == [2, 1, 0]


#: A small model: 3 layers (a dense one, then two MoE), 4 sequences of 8 tokens.
MODEL = ModelConfig(seq_length=8, num_layers=3, hidden_size=16, num_attention_heads=4,
                    vocab_size=32, num_experts=4, moe_router_topk=2)
ROWS = 4


@functools.lru_cache(maxsize=None)
def _step(recompute):
    """One serial forward and backward: loss, gradients, bytes kept per layer."""
    model = DeepSeekModel(MODEL, seed=1234, recompute=recompute)
    ids, labels = synthetic_batch(1234, 0, ROWS, MODEL.seq_length, MODEL.vocab_size)
    with saved_bytes_by_layer(model.parameters()) as kept:
        loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, dict(kept)


def predicted_kept(plain: dict, recompute: Recompute, layers: int, input_bytes: int,
                   core_attention_bytes: int) -> dict:
    """Bytes per layer under ``recompute``, from the plain run's per-layer bytes and the rule."""
    bytes_of = {KEEP_ALL: lambda b: b, KEEP_INPUT: lambda b: input_bytes, KEEP_NOTHING: lambda b: 0,
                KEEP_ALL_BUT_CORE_ATTENTION: lambda b: b - core_attention_bytes}
    kept = {layer: bytes_of[keep](plain[layer])
            for layer, keep in enumerate(kept_per_layer(layers, recompute))}
    return {None: plain[None], **{layer: b for layer, b in kept.items() if b}}


@pytest.mark.parametrize("recompute", [FULL_UNIFORM, FULL_BLOCK, SELECTIVE,
                                       Recompute("full", "uniform", 1)],
                         ids=["full-uniform-2", "full-block-1", "selective", "full-uniform-1"])
def test_recomputation_changes_no_number_and_keeps_what_the_rule_says(recompute):
    """The serial model under each setting: the loss and every gradient are bit for bit the
    plain run's (the same operations on the same values, run twice), and the bytes autograd
    keeps (``saved_tensors_hooks``, per layer) are the plain run's where a layer keeps all,
    one ``[s, b, h]`` fp32 input per checkpointed group, nothing inside a group, and under
    selective recomputation the plain bytes less the fused attention's log-sum-exp
    (``b x heads x s`` fp32 values a layer: torch 2.13's CPU flash attention keeps q, k, v,
    its output and that; the output stays, ``linear_proj``'s input)."""
    loss0, grads0, plain = _step(None)
    loss, grads, kept = _step(recompute)
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    assert every(torch.equal(grads[n], grads0[n]) for n in grads0)
    s, h, heads = MODEL.seq_length, MODEL.hidden_size, MODEL.num_attention_heads
    want = predicted_kept(plain, recompute, MODEL.num_layers, input_bytes=s * ROWS * h * 4,
                          core_attention_bytes=ROWS * heads * s * 4)
    assert kept == want
    assert sum(kept.values()) < sum(plain.values())


def test_recomputation_is_off_outside_training():
    """Megatron recomputes only ``if self.training`` (``TransformerBlock.forward``,
    ``Attention.forward``): in eval mode nothing is checkpointed (and under no_grad nothing
    is kept at all)."""
    model = DeepSeekModel(MODEL, seed=1234, recompute=FULL_UNIFORM).eval()
    ids, labels = synthetic_batch(1234, 0, ROWS, MODEL.seq_length, MODEL.vocab_size)
    with saved_bytes_by_layer(model.parameters()) as kept:
        model(ids, labels)
    plain = DeepSeekModel(MODEL, seed=1234).eval()
    with saved_bytes_by_layer(plain.parameters()) as kept_plain:
        plain(ids, labels)
    assert kept == kept_plain
