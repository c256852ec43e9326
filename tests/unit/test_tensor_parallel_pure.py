"""Tensor-parallel layers and the Transformer block in one process (no groups: TP = 1).

Outside a launch every parallel layer is its serial self; here it is checked against
plain torch (``nn.Linear``, ``nn.Embedding``, ``F.cross_entropy``, a nanoGPT-style
attention written out by hand).  fp32 comparisons use ``atol=1e-5, rtol=1e-5``; the
cross-entropy backward is also gradchecked in float64, and its bf16 path is compared with
an fp64 reference at fp32 rounding.
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


def test_cross_entropy_of_bf16_logits_is_computed_in_fp32():
    """bf16 logits, fp64 reference: off by fp32 rounding, not by bf16 rounding.

    Megatron-Core 0.20.0 (d98e8a64), ``megatron/core/tensor_parallel/cross_entropy.py``,
    ``VocabParallelCrossEntropy.calculate_logits_max``: the logits are upcast to fp32
    before the max, the exponentials, their sum and the log (Megatron-Core >= 0.8).  A
    loss computed in bf16 keeps 8 bits of mantissa: computed in the logits' dtype, these
    losses were off by 4.5e-3 relative (6e-2 absolute).  The reference is
    ``F.cross_entropy`` in fp64 of the very same bf16 values,
    so the only error left is the computation's: fp32 rounding, measured <= 1.3e-7
    relative (tolerance 1e-6), with and without label smoothing.  The gradient comes
    back in bf16, the logits' dtype, within bf16 rounding of the fp64 one.
    """
    g = torch.Generator().manual_seed(0)
    V = 1000
    logits = (4 * torch.randn(16, 3, V, generator=g)).bfloat16()
    target = torch.randint(0, V, (16, 3), generator=g)
    for smoothing in (0.0, 0.1):
        z = logits.clone().requires_grad_()
        smoothed = {"label_smoothing": smoothing} if smoothing else {}
        loss = tp.vocab_parallel_cross_entropy(z, target, **smoothed)
        z64 = logits.double().requires_grad_()
        ref = F.cross_entropy(z64.reshape(-1, V), target.reshape(-1), reduction="none",
                              label_smoothing=smoothing).view(16, 3)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0)
        assert loss.dtype == torch.float32
        loss.sum().backward()
        ref.sum().backward()
        assert z.grad.dtype == torch.bfloat16
        torch.testing.assert_close(z.grad.double(), z64.grad, rtol=0, atol=2 ** -8)


def test_label_smoothing_matches_torch_and_its_backward_is_exact():
    """``label_smoothing=eps`` is ``F.cross_entropy``'s: target ``(1 - eps) one_hot + eps / V``."""
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(4, 2, 11, generator=g)).requires_grad_()
    target = torch.randint(0, 11, (4, 2), generator=g)
    loss = tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.2)
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1), reduction="none",
                          label_smoothing=0.2).view(4, 2)
    _close(loss, ref)
    z = logits.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: tp.vocab_parallel_cross_entropy(z, target, label_smoothing=0.2), (z,))
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0, 1\).*got 1.0; try 0.1"):
        tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)


def test_megatron_label_smoothing_depends_on_the_tp_size():
    """The teaching model of Megatron-Core 0.20.0's smoothing (d98e8a64,
    ``_VocabParallelCrossEntropy.forward`` in ``megatron/core/tensor_parallel/cross_entropy.py``;
    Megatron-LM issues #737 and #7464): the coefficient uses the rank's slice width and the
    mean log-probability runs over the rank's slice, so ranks disagree.

    Checked against formulas written out here: at T = 1 it is the "eps / (V - 1) on every
    other id" target; at T = 2 each rank's loss uses its own half of the vocabulary.
    """
    g = torch.Generator().manual_seed(4)
    V, eps = 8, 0.1
    logits = torch.randn(6, V, generator=g)
    target = torch.randint(0, V, (6,), generator=g)
    log_p = logits.log_softmax(-1)
    one_hot = F.one_hot(target, V).float()
    others = (1 - one_hot) * eps / (V - 1) + one_hot * (1 - eps)
    _close(tp.megatron_label_smoothing_losses(logits, target, eps, 1)[0], -(others * log_p).sum(-1))
    nll = F.cross_entropy(logits, target, reduction="none")
    per_rank = tp.megatron_label_smoothing_losses(logits, target, eps, 2)
    for rank, half in enumerate(log_p.chunk(2, -1)):
        c = eps * (V // 2) / (V // 2 - 1)
        _close(per_rank[rank], (1 - c) * nll - c * half.mean(-1))
    assert (per_rank[0] - per_rank[1]).abs().max() > 1e-2  # the two ranks disagree
    torch_loss = F.cross_entropy(logits, target, reduction="none", label_smoothing=eps)
    assert (per_rank - torch_loss).abs().max() > 1e-2       # and neither is torch's loss


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
    # Backward, per sublayer: the row-parallel layer gathers dY, then the column-parallel
    # layer gathers its saved input shard again (for dW) and reduce-scatters dX.
    assert [(r["phase"], r["op"], r["bytes"]) for r in sp] == (
        [("forward", "all_gather", 256), ("forward", "reduce_scatter", 1024)] * 2
        + [("backward", "all_gather", 256), ("backward", "all_gather", 256),
           ("backward", "reduce_scatter", 1024)] * 2
        + [("grad_sync", "all_reduce", 6 * 16 * 4)])


def test_divide_names_the_rule_and_a_fix():
    assert tp.divide(12, 4, "output_size") == 3
    with pytest.raises(ValueError, match=r"^output_size \(10\) must be divisible by "
                                         r"tensor_model_parallel_size \(4\); try output_size = 8 or 12$"):
        tp.divide(10, 4, "output_size")
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"):
        TransformerBlock(30, 4)
