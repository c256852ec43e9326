"""Tensor-parallel layers and the Transformer block in one process (no groups: TP = 1).

Outside a launch every parallel layer is its serial self; here it is checked against
plain torch (``nn.Linear``, ``nn.Embedding``, ``F.cross_entropy``, a nanoGPT-style
attention written out by hand).  fp32 comparisons use ``atol=1e-5, rtol=1e-5``; the
cross-entropy backward is also gradchecked in float64.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import parallel_state
from tutorial_lib import tensor_parallel as tp
from tutorial_lib.transformer import TransformerBlock, block_collectives

ATOL = RTOL = 1e-5


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def test_conjugate_functions_are_the_identity_without_groups():
    x = torch.randn(4, 2, 8, requires_grad=True)
    for fn in (tp.copy_to_tensor_model_parallel_region, tp.reduce_from_tensor_model_parallel_region,
               tp.scatter_to_tensor_model_parallel_region, tp.gather_from_tensor_model_parallel_region,
               tp.scatter_to_sequence_parallel_region, tp.gather_from_sequence_parallel_region,
               tp.reduce_scatter_to_sequence_parallel_region):
        assert fn(x) is x, fn.__name__  # no Function, so no collective can be issued
    assert parallel_state.group_size("tp") == 1 and parallel_state.group_rank("tp") == 0


def test_linear_layers_at_tp1_are_nn_linear_from_the_same_seed():
    x = torch.randn(5, 3, 8)
    ref = tp.serial_linear(8, 12, seed=4)
    for layer in (tp.ColumnParallelLinear(8, 12, seed=4), tp.RowParallelLinear(8, 12, seed=4)):
        assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
        _close(layer(x), ref(x))
    assert not torch.equal(tp.serial_linear(8, 12, seed=5).weight, ref.weight)
    bound = 1 / math.sqrt(8)
    assert ref.weight.abs().max() <= bound and ref.weight.std() > bound / 3  # nn.Linear's U(-1/sqrt(in), ..)


def test_embedding_at_tp1_is_nn_embedding():
    ids = torch.arange(10).view(5, 2)
    ref = tp.serial_embedding(10, 4, seed=2)
    layer = tp.VocabParallelEmbedding(10, 4, seed=2)
    assert (layer.vocab_start_index, layer.vocab_end_index) == (0, 10)
    assert torch.equal(layer(ids), ref(ids))


def test_cross_entropy_matches_torch_and_its_local_backward_is_exact():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 2, 11, generator=g)).requires_grad_()
    target = torch.randint(0, 11, (4, 2), generator=g)
    loss = tp.vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="none").view(4, 2)
    _close(loss, ref)
    z = logits.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: tp.vocab_parallel_cross_entropy(z, target), (z,))


def _nanogpt_reference(block: TransformerBlock, x: torch.Tensor, heads: int) -> torch.Tensor:
    """The same block written like nanoGPT: [Q | K | V] weights, explicit causal softmax, [b, s, h]."""
    attn, mlp = block.self_attention, block.mlp
    s, b, h = x.shape
    hd = h // heads
    # Megatron's rows are [q0 k0 v0 | q1 k1 v1 | ...]; nanoGPT's c_attn is [Q | K | V].
    w = attn.linear_qkv.weight.view(heads, 3, hd, h).transpose(0, 1).reshape(3 * h, h)
    bias = attn.linear_qkv.bias.view(heads, 3, hd).transpose(0, 1).reshape(3 * h)
    xb = x.transpose(0, 1)
    q, k, v = F.linear(F.layer_norm(xb, (h,)), w, bias).split(h, dim=-1)
    q, k, v = (t.view(b, s, heads, hd).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, s, h)
    xb = xb + attn.linear_proj(y)
    xb = xb + mlp.linear_fc2(F.gelu(mlp.linear_fc1(F.layer_norm(xb, (h,)))))
    return xb.transpose(0, 1)


def test_serial_block_equals_a_nanogpt_style_block():
    block = TransformerBlock(16, 4, seed=1)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = block(x1), _nanogpt_reference(block, x2, heads=4)
    _close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    _close(x1.grad, x2.grad)
    weights = [block.self_attention.linear_qkv.weight, block.self_attention.linear_proj.weight,
               block.mlp.linear_fc1.weight, block.mlp.linear_fc2.weight]
    assert [tuple(w.shape) for w in weights] == [(48, 16), (16, 16), (64, 16), (16, 64)]
    assert not torch.equal(weights[1], weights[0][:16])  # every sublayer has its own seed


def test_block_collectives_table():
    assert block_collectives(8, 2, 16, tp_size=1) == []
    no_sp = block_collectives(8, 2, 16, tp_size=2)
    assert [(r["phase"], r["op"], r["bytes"]) for r in no_sp] == \
        [("forward", "all_reduce", 1024)] * 2 + [("backward", "all_reduce", 1024)] * 2
    sp = block_collectives(8, 2, 16, tp_size=4, sequence_parallel=True)
    assert [(r["phase"], r["op"], r["bytes"]) for r in sp] == (
        [("forward", "all_gather", 256), ("forward", "reduce_scatter", 1024)] * 2
        + [("backward", "all_gather", 256), ("backward", "reduce_scatter", 1024)] * 2
        + [("grad_sync", "all_reduce", 6 * 16 * 4)])


def test_divide_names_the_rule_and_a_fix():
    assert tp.divide(12, 4, "output_size") == 3
    with pytest.raises(ValueError, match=r"^output_size \(10\) must be divisible by "
                                         r"tensor_model_parallel_size \(4\); try output_size = 8 or 12$"):
        tp.divide(10, 4, "output_size")
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"):
        TransformerBlock(30, 4)
