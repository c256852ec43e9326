"""Tensor parallelism on real gloo workers: conjugate pairs, parallel layers, vocab-parallel loss.

Every configuration runs at TP in {1, 2, 4}, alone (world = TP) and beside data
parallelism (world = TP x DP=2, Megatron layout, so TP groups are {0,1},{2,3} or
{0..3},{4..7}).  Inputs are filled with the rank id and gradients with ``2**rank``:
the sum of ``2**rank`` over a set of ranks names that set, so a reduction over the
wrong group (the world, the DP group) gives a sum no TP group can give.

Tolerances: closed-form sums and weight shards are compared exactly (``torch.equal``);
layer outputs and gradients against the serial ``nn.Linear`` / ``nn.Embedding`` /
``F.cross_entropy`` in fp32 with ``atol=1e-5, rtol=1e-5``.  The cross-entropy of bf16
logits is compared with ``F.cross_entropy`` in fp64 of the same bf16 values: the loss at
``rtol=1e-6`` (fp32 rounding), its bf16 gradient at ``atol=2**-8`` (bf16 rounding of
values below 1).
"""
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import parallel_state
from tutorial_lib import tensor_parallel as tp
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import launch
from tutorial_lib.saved_activations import saved_activation_bytes

from .worker_checks import backward as _backward, check as _check, close as _close
from tutorial_lib.transformer import TransformerBlock

pytestmark = pytest.mark.dist

# The workers get the functions below by value, so they never import this module (and
# pytest with it: 0.2 s a rank).  Code that runs in a worker therefore checks with
# _check, not a bare assert, which pytest would rewrite into a call into pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


CONFIGS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]  # (TP, DP)
S, B, H = 8, 3, 8  # sequence, batch, hidden: divisible by every TP size tested


def _init(ctx, tp_size):
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp_size), layout="megatron")
    return parallel_state.get_group_ranks("tp"), parallel_state.get_rank_in("tp")


def _exact(actual, expected, what):
    _check(torch.equal(actual, expected),
           f"{what}: got {actual.flatten()[:8].tolist()}..., expected {expected.flatten()[:8].tolist()}...")


# --- the conjugate pairs: closed forms ----------------------------------------------------


def _conjugate_pairs(ctx, tp_size):
    group, i = _init(ctx, tp_size)
    r, T = ctx.rank, len(group)
    tags = ctx.tracer.tags
    pow2 = float(2 ** r)
    sum_ranks, sum_pow2 = float(sum(group)), float(sum(2 ** g for g in group))
    hs, ss = H // T, S // T  # my share of the hidden / sequence dim
    per_hidden = torch.tensor([float(group[j // hs]) for j in range(H)])  # owner of each column
    per_token = torch.tensor([float(group[j // ss]) for j in range(S)])  # owner of each token
    hidden_ramp = 1.0 + torch.arange(float(H))
    seq_ramp = (1.0 + torch.arange(float(S)))[:, None, None]

    with tags(case="copy_to"):
        x = torch.full((S, B, H), float(r), requires_grad=True)
        y = tp.copy_to_tensor_model_parallel_region(x)
        _exact(y, torch.full((S, B, H), float(r)), "copy_to forward is the identity")
        _backward(y, torch.full((S, B, H), pow2))
        _exact(x.grad, torch.full((S, B, H), sum_pow2), "copy_to backward all-reduces over TP")

    with tags(case="reduce_from"):
        x = torch.full((S, B, H), float(r), requires_grad=True)
        y = tp.reduce_from_tensor_model_parallel_region(x)
        _exact(y, torch.full((S, B, H), sum_ranks), "reduce_from forward all-reduces over TP")
        _backward(y, torch.full((S, B, H), pow2))
        _exact(x.grad, torch.full((S, B, H), pow2), "reduce_from backward is the identity")

    with tags(case="scatter_to"):
        x = hidden_ramp.expand(S, B, H).clone().requires_grad_()
        y = tp.scatter_to_tensor_model_parallel_region(x)
        _exact(y, hidden_ramp[i * hs:(i + 1) * hs].expand(S, B, hs), "scatter_to keeps my columns")
        _backward(y, torch.full((S, B, hs), pow2))
        _exact(x.grad, (2.0 ** per_hidden).expand(S, B, H), "scatter_to backward all-gathers columns")

    with tags(case="gather_from"):
        x = torch.full((S, B, hs), float(r), requires_grad=True)
        y = tp.gather_from_tensor_model_parallel_region(x)
        _exact(y, per_hidden.expand(S, B, H), "gather_from concatenates the TP ranks' columns")
        _backward(y, pow2 * hidden_ramp.expand(S, B, H))
        _exact(x.grad, pow2 * hidden_ramp[i * hs:(i + 1) * hs].expand(S, B, hs), "gather_from backward splits")

    with tags(case="scatter_to_sequence"):
        x = seq_ramp.expand(S, B, H).clone().requires_grad_()
        y = tp.scatter_to_sequence_parallel_region(x)
        _exact(y, seq_ramp[i * ss:(i + 1) * ss].expand(ss, B, H), "scatter_to_sequence keeps my tokens")
        _backward(y, torch.full((ss, B, H), pow2))
        _exact(x.grad, (2.0 ** per_token)[:, None, None].expand(S, B, H), "its backward all-gathers tokens")

    with tags(case="gather_from_sequence"):
        x = torch.full((ss, B, H), float(r), requires_grad=True)
        y = tp.gather_from_sequence_parallel_region(x)
        _exact(y, per_token[:, None, None].expand(S, B, H), "gather_from_sequence concatenates tokens")
        _backward(y, pow2 * seq_ramp.expand(S, B, H))
        _exact(x.grad, sum_pow2 * seq_ramp[i * ss:(i + 1) * ss].expand(ss, B, H),
               "gather_from_sequence backward reduce-scatters over TP")

    with tags(case="gather_from_sequence_replicated_grad"):
        x = torch.full((ss, B, H), float(r), requires_grad=True)
        y = tp.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        _backward(y, pow2 * seq_ramp.expand(S, B, H))
        _exact(x.grad, pow2 * seq_ramp[i * ss:(i + 1) * ss].expand(ss, B, H),
               "with tensor_parallel_output_grad=False the backward only splits")

    with tags(case="reduce_scatter_to_sequence"):
        x = (float(r) * seq_ramp).expand(S, B, H).clone().requires_grad_()
        y = tp.reduce_scatter_to_sequence_parallel_region(x)
        _exact(y, sum_ranks * seq_ramp[i * ss:(i + 1) * ss].expand(ss, B, H),
               "reduce_scatter_to_sequence sums over TP and keeps my tokens")
        _backward(y, torch.full((ss, B, H), pow2))
        _exact(x.grad, (2.0 ** per_token)[:, None, None].expand(S, B, H), "its backward all-gathers tokens")
    return group


def _expected_conjugate_events(T):
    """(case) -> [(phase, op_name, op, bytes)] on every rank."""
    if T == 1:
        return {}
    full, hidden_shard, seq_shard = S * B * H * 4, S * B * (H // T) * 4, (S // T) * B * H * 4
    return {
        "copy_to": [("backward", "copy_to_tensor_model_parallel_region", "all_reduce", full)],
        "reduce_from": [("forward", "reduce_from_tensor_model_parallel_region", "all_reduce", full)],
        "scatter_to": [("backward", "scatter_to_tensor_model_parallel_region", "all_gather", hidden_shard)],
        "gather_from": [("forward", "gather_from_tensor_model_parallel_region", "all_gather", hidden_shard)],
        "scatter_to_sequence": [("backward", "scatter_to_sequence_parallel_region", "all_gather", seq_shard)],
        "gather_from_sequence": [("forward", "gather_from_sequence_parallel_region", "all_gather", seq_shard),
                                 ("backward", "gather_from_sequence_parallel_region", "reduce_scatter", full)],
        "gather_from_sequence_replicated_grad": [
            ("forward", "gather_from_sequence_parallel_region", "all_gather", seq_shard)],
        "reduce_scatter_to_sequence": [
            ("forward", "reduce_scatter_to_sequence_parallel_region", "reduce_scatter", full),
            ("backward", "reduce_scatter_to_sequence_parallel_region", "all_gather", seq_shard)],
    }


def _events_by_case(trace, rank):
    out = {}
    for e in trace.filter(rank=rank, comm_only=True):
        out.setdefault(e.tags["case"], []).append((e.tags["phase"], e.tags["op_name"], e.op, e.bytes))
    return out


@pytest.mark.parametrize("tp_size,dp_size", CONFIGS)
def test_conjugate_pairs_closed_forms_and_trace(tp_size, dp_size):
    res = launch(_conjugate_pairs, tp_size * dp_size, args=(tp_size,), timeout=60)
    for rank, group in enumerate(res.results):
        assert _events_by_case(res.trace, rank) == _expected_conjugate_events(tp_size)
        for e in res.trace.filter(rank=rank):
            assert e.group_kind == "tp" and list(e.group_ranks) == group


# --- the layers against their serial counterparts -----------------------------------------


IN, OUT, VOCAB = 8, 12, 16


def _layers(ctx, tp_size):
    """Each parallel layer next to its serial twin from the same seed: values, grads, shards."""
    group, i = _init(ctx, tp_size)
    T = len(group)
    g = torch.Generator().manual_seed(42)  # the same data on every rank (DP replicas included)
    x_full = torch.randn(S, B, IN, generator=g)
    dy_full = torch.randn(S, B, OUT, generator=g)
    rows = slice(i * S // T, (i + 1) * S // T)  # my tokens under sequence parallelism
    tags = ctx.tracer.tags

    def serial_twin(seed):
        """The serial layer drawn from ``seed``, its output and input gradient on the full data."""
        ref = tp.serial_linear(IN, OUT, seed=seed)
        x = x_full.clone().requires_grad_()
        y = ref(x)
        _backward(y, dy_full)
        return ref, y.detach(), x.grad

    def column(name, gather_output=False, sequence_parallel=False):
        ref, ref_y, ref_dx = serial_twin(7)
        layer = tp.ColumnParallelLinear(IN, OUT, gather_output=gather_output,
                                        sequence_parallel=sequence_parallel, seed=7)
        _exact(layer.weight, ref.weight.detach().chunk(T, 0)[i], f"{name}: weight shard is my rows")
        _exact(layer.bias, ref.bias.detach().chunk(T, 0)[i], f"{name}: bias shard")
        x = (x_full[rows] if sequence_parallel else x_full).clone().requires_grad_()
        with tags(layer=name), saved_activation_bytes({name: layer}) as saved:
            y = layer(x)
        # Kept for dW: the input this rank was given, [s/T, b, in] under SP (not the gathered one).
        want_saved = (S // T if sequence_parallel else S) * B * IN * 4
        _check(saved[name] == want_saved, f"{name}: autograd saved {saved[name]} bytes, not {want_saved}")
        with tags(layer=name):
            want_y = ref_y if gather_output else ref_y.chunk(T, -1)[i]
            _close(y, want_y, f"{name}: output")
            _backward(y, dy_full if gather_output else dy_full.chunk(T, -1)[i])
        _close(x.grad, ref_dx[rows] if sequence_parallel else ref_dx, f"{name}: input grad")
        _close(layer.weight.grad, ref.weight.grad.chunk(T, 0)[i], f"{name}: weight grad")
        _close(layer.bias.grad, ref.bias.grad.chunk(T, 0)[i], f"{name}: bias grad")

    def row(name, input_is_parallel=True, sequence_parallel=False):
        ref, ref_y, ref_dx = serial_twin(9)
        layer = tp.RowParallelLinear(IN, OUT, input_is_parallel=input_is_parallel,
                                     sequence_parallel=sequence_parallel, seed=9)
        _exact(layer.weight, ref.weight.detach().chunk(T, 1)[i], f"{name}: weight shard is my columns")
        _exact(layer.bias, ref.bias.detach(), f"{name}: bias is replicated")
        x = (x_full.chunk(T, -1)[i] if input_is_parallel else x_full).clone().requires_grad_()
        with tags(layer=name):
            y = layer(x)
            _close(y, ref_y[rows] if sequence_parallel else ref_y, f"{name}: output")
            _backward(y, dy_full[rows] if sequence_parallel else dy_full)
            if sequence_parallel:
                tp.allreduce_sequence_parallel_grads(layer)
        _close(x.grad, ref_dx.chunk(T, -1)[i] if input_is_parallel else ref_dx, f"{name}: input grad")
        _close(layer.weight.grad, ref.weight.grad.chunk(T, 1)[i], f"{name}: weight grad")
        _close(layer.bias.grad, ref.bias.grad, f"{name}: bias grad (added after the reduction)")

    column("column")
    column("column_gather_output", gather_output=True)
    column("column_sequence_parallel", sequence_parallel=True)
    row("row")
    row("row_scatter_input", input_is_parallel=False)
    row("row_sequence_parallel", sequence_parallel=True)

    # Embedding: every id 0..V-1 appears (so every range boundary is crossed), some twice.
    ids = (torch.arange(S * B) % VOCAB)[torch.randperm(S * B, generator=g)].view(S, B)
    for name, sequence_parallel in (("embedding", False), ("embedding_sequence_parallel", True)):
        ref = tp.serial_embedding(VOCAB, H, seed=11)
        ref_y = ref(ids)
        dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
        _backward(ref_y, dy)
        layer = tp.VocabParallelEmbedding(VOCAB, H, seed=11, sequence_parallel=sequence_parallel)
        _check((layer.vocab_start_index, layer.vocab_end_index) == (i * VOCAB // T, (i + 1) * VOCAB // T),
               f"{name}: vocabulary range")
        _exact(layer.weight, ref.weight.detach().chunk(T, 0)[i], f"{name}: my vocabulary rows")
        with tags(layer=name):
            y = layer(ids)
            want = ref_y.detach()[rows] if sequence_parallel else ref_y.detach()
            _close(y, want, f"{name}: output")
            _backward(y, dy[rows] if sequence_parallel else dy)
        _close(layer.weight.grad, ref.weight.grad.chunk(T, 0)[i], f"{name}: weight grad")

    # Cross-entropy over a split vocabulary, targets on both sides of every boundary; plain,
    # label-smoothed (torch's convention, the same loss on every rank at every TP), and of
    # bf16 logits (computed in fp32: compared with fp64).
    logits_full = 3 * torch.randn(S, B, VOCAB, generator=g)
    target = (torch.arange(S * B) % VOCAB)[torch.randperm(S * B, generator=g)].view(S, B)
    dloss = torch.rand(S, B, generator=g)
    cases = {"cross_entropy": (logits_full, 0.0, torch.float32),
             "cross_entropy_smoothed": (logits_full, 0.1, torch.float32),
             "cross_entropy_bf16": (logits_full.bfloat16(), 0.0, torch.float64)}
    for name, (logits, smoothing, ref_dtype) in cases.items():
        ref_logits = logits.to(ref_dtype, copy=True).requires_grad_()
        ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                                   label_smoothing=smoothing).view(S, B)
        _backward(ref_loss, dloss.to(ref_dtype))
        shard = logits.chunk(T, -1)[i].clone().requires_grad_()
        smoothed = {"label_smoothing": smoothing} if smoothing else {}
        with tags(layer=name):
            loss = tp.vocab_parallel_cross_entropy(shard, target, **smoothed)
            _backward(loss, dloss)
        if logits.dtype == torch.bfloat16:
            _close(loss.double(), ref_loss.detach(), f"{name}: per-token loss", atol=0, rtol=1e-6)
            _check(loss.dtype == torch.float32 and shard.grad.dtype == torch.bfloat16, f"{name}: dtypes")
            _close(shard.grad.double(), ref_logits.grad.chunk(T, -1)[i], f"{name}: grad of my logits",
                   atol=2 ** -8, rtol=0)
        else:
            _close(loss, ref_loss.detach(), f"{name}: per-token loss")
            _close(shard.grad, ref_logits.grad.chunk(T, -1)[i], f"{name}: grad of my logits")
    return group


def _expected_layer_events(T):
    """layer -> [(phase, op_name, op, bytes)], per rank, for one forward + backward."""
    if T == 1:
        return {}
    x, y, e = S * B * IN * 4, S * B * OUT * 4, S * B * H * 4  # full [s, b, *] tensors
    y_shard = S * B * (OUT // T) * 4
    x_seq, y_seq, e_seq = x // T, y // T, e // T  # [s/T, b, *]
    per_token = S * B * 4
    return {
        "column": [("backward", "copy_to_tensor_model_parallel_region", "all_reduce", x)],
        "column_gather_output": [
            ("forward", "gather_from_tensor_model_parallel_region", "all_gather", y_shard),
            ("backward", "copy_to_tensor_model_parallel_region", "all_reduce", x)],
        # Megatron-Core 0.20.0 (d98e8a64), layers.py, LinearWithGradAccumulationAndAsyncCommunication:
        # under SP the column-parallel layer saves its input shard and all-gathers it again in
        # backward (for dW), then reduce-scatters dX.
        "column_sequence_parallel": [
            ("forward", "linear_with_sequence_parallel_all_gather", "all_gather", x_seq),
            ("backward", "linear_with_sequence_parallel_all_gather", "all_gather", x_seq),
            ("backward", "linear_with_sequence_parallel_all_gather", "reduce_scatter", x)],
        "row": [("forward", "reduce_from_tensor_model_parallel_region", "all_reduce", y)],
        "row_scatter_input": [
            ("forward", "reduce_from_tensor_model_parallel_region", "all_reduce", y),
            ("backward", "scatter_to_tensor_model_parallel_region", "all_gather", S * B * (IN // T) * 4)],
        "row_sequence_parallel": [
            ("forward", "reduce_scatter_to_sequence_parallel_region", "reduce_scatter", y),
            ("backward", "reduce_scatter_to_sequence_parallel_region", "all_gather", y_seq),
            ("grad_sync", "allreduce_sequence_parallel_grads", "all_reduce", OUT * 4)],
        "embedding": [("forward", "reduce_from_tensor_model_parallel_region", "all_reduce", e)],
        "embedding_sequence_parallel": [
            ("forward", "reduce_scatter_to_sequence_parallel_region", "reduce_scatter", e),
            ("backward", "reduce_scatter_to_sequence_parallel_region", "all_gather", e_seq)],
        "cross_entropy": [("forward", "vocab_parallel_cross_entropy", "all_reduce", per_token)] * 3,
        # Smoothing rides on the target-logit all-reduce: no fourth collective.
        "cross_entropy_smoothed": [("forward", "vocab_parallel_cross_entropy", "all_reduce", per_token)] * 3,
        # bf16 logits, fp32 reductions: 4 bytes a token, not 2.
        "cross_entropy_bf16": [("forward", "vocab_parallel_cross_entropy", "all_reduce", per_token)] * 3,
    }


@pytest.mark.parametrize("tp_size,dp_size", CONFIGS)
def test_parallel_layers_equal_the_serial_layer_and_issue_the_expected_collectives(tp_size, dp_size):
    """Every layer against its serial twin, and its collectives.  Two upstream rules shape it.

    * Megatron-Core 0.20.0 (d98e8a64), ``megatron/core/tensor_parallel/layers.py``,
      ``LinearWithGradAccumulationAndAsyncCommunication``: under sequence parallelism a
      column-parallel layer saves its ``[s/T, b, in]`` input shard (checked in the worker
      with ``saved_activation_bytes``) and all-gathers it again in backward before the
      reduce-scatter of dX (the expected events).
    * ``megatron/core/tensor_parallel/cross_entropy.py``, ``VocabParallelCrossEntropy``:
      the logits are upcast to fp32 (bf16 logits: loss within fp32 rounding of fp64, fp32
      all-reduces).  Its label smoothing, which takes the slice width for the vocabulary
      size and averages the log-probabilities over the rank's slice (Megatron-LM issues
      #737, #7464), is *not* followed: the smoothed loss and its gradient must equal serial
      ``F.cross_entropy(label_smoothing=0.1)`` on every rank at TP 2 and 4.
    """
    res = launch(_layers, tp_size * dp_size, args=(tp_size,), timeout=60)
    expected = _expected_layer_events(tp_size)
    for rank, group in enumerate(res.results):
        got = {}
        for e in res.trace.filter(rank=rank, comm_only=True):
            assert e.group_kind == "tp" and list(e.group_ranks) == group
            got.setdefault(e.tags["layer"], []).append((e.tags["phase"], e.tags["op_name"], e.op, e.bytes))
        assert got == expected
    if tp_size > 1:  # the three cross-entropy reductions: max first, then two sums
        for name in ("cross_entropy", "cross_entropy_smoothed", "cross_entropy_bf16"):
            ops = [e.tags["reduce_op"] for e in res.trace.filter(rank=0, layer=name)]
            assert ops == ["max", "sum", "sum"]
            assert {e.dtype for e in res.trace.filter(rank=0, layer=name)} == {"float32"}


# --- errors that teach ---------------------------------------------------------------------


def _bad_sizes(ctx):
    _init(ctx, 4)
    attempts = {
        "column": lambda: tp.ColumnParallelLinear(8, 10),
        "row": lambda: tp.RowParallelLinear(10, 8),
        "embedding": lambda: tp.VocabParallelEmbedding(10, 8),
        "row_sp": lambda: tp.RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True),
        "sequence": lambda: tp.scatter_to_sequence_parallel_region(torch.ones(6, 2, 8)),
        "heads": lambda: TransformerBlock(24, 6),
        "target": lambda: tp.vocab_parallel_cross_entropy(torch.zeros(2, 1, 4), torch.tensor([[3], [16]])),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    return messages


def test_bad_sizes_raise_errors_that_name_the_numbers():
    messages = launch(_bad_sizes, 4, timeout=60).results[0]
    assert messages["column"] == ("output_size (10) must be divisible by tensor_model_parallel_size (4); "
                                  "try output_size = 8 or 12")
    assert messages["row"].startswith("input_size (10) must be divisible by tensor_model_parallel_size (4)")
    assert messages["embedding"].startswith("num_embeddings (10) must be divisible by "
                                            "tensor_model_parallel_size (4)")
    assert "needs input_is_parallel=True" in messages["row_sp"]
    assert messages["sequence"] == ("seq_length (6) must be divisible by tensor_model_parallel_size (4); "
                                    "try seq_length = 4 or 8")
    assert messages["heads"] == ("num_attention_heads (6) must be divisible by tensor_model_parallel_size (4); "
                                 "try num_attention_heads = 4 or 8")
    assert messages["target"] == "target ids must lie in [0, 16) (the vocabulary size), got ids from 3 to 16"
