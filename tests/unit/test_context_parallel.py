"""Context parallelism's pure parts (chapter 9): the split, the merge, the rules, the flags.

The attention itself on real gloo ranks: tests/dist/test_context_parallel.py; in the 4D run:
tests/dist/test_pipeline_training.py (``test_context_parallel_trains_like_world_size_one``).
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import context_parallel as cp
from tutorial_lib import costs
from tutorial_lib.arguments import describe_run, validate_args
from tutorial_lib.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from tutorial_lib.train_4d import TrainingArgs
from tests.asserts import every


# --- the load-balanced split --------------------------------------------------------------


def megatron_cp_split(val: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1):
    """Megatron-Core's per-sequence balancing, re-derived: view the sequence as ``2 CP``
    chunks, keep chunks ``cp_rank`` and ``2 CP - 1 - cp_rank``, flatten them back.

    ``megatron/core/utils.py``, ``_get_batch_on_this_cp_rank_per_sequence_balancing``
    (called by ``get_batch_on_this_cp_rank`` when there are no ``cu_seqlens``),
    Megatron-Core 0.20.0, d98e8a64.
    """
    s = val.shape[seq_dim]
    val = val.view(*val.shape[:seq_dim], 2 * cp_size, s // (2 * cp_size), *val.shape[seq_dim + 1:])
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])
    val = val.index_select(seq_dim, index)
    return val.reshape(*val.shape[:seq_dim], -1, *val.shape[seq_dim + 2:])


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_the_balanced_split_is_megatrons(cp_size):
    """Rank r keeps chunks r and 2CP-1-r of 2CP (Megatron-Core 0.20.0, d98e8a64,
    ``megatron/core/utils.py`` ``_get_batch_on_this_cp_rank_per_sequence_balancing``):
    the positions, the chunk ids and the split of a [b, s, h] tensor along dim 1."""
    s = 8 * cp_size
    tokens = torch.arange(3 * s * 5).view(3, s, 5)
    pieces = []
    for r in range(cp_size):
        assert cp.held_chunks(r, cp_size) == (r, 2 * cp_size - 1 - r)
        mine = cp.split_for_cp_rank(tokens, 1, cp_size, r)
        assert torch.equal(mine, megatron_cp_split(tokens, cp_size, r))
        assert cp.chunk_positions(s, cp_size, r) == mine[0, :, 0].div(5, rounding_mode="floor").tolist()
        pieces.append(mine)
    assert torch.equal(cp.gather_from_cp_ranks(pieces, 1), tokens)
    every = sorted(p for r in range(cp_size) for p in cp.chunk_positions(s, cp_size, r))
    assert every == list(range(s))  # every token on exactly one rank


def test_the_naive_split_keeps_contiguous_pieces():
    assert cp.held_chunks(1, 4, load_balanced=False) == (1,)
    assert cp.chunk_positions(8, 4, 3, load_balanced=False) == [6, 7]
    x = torch.arange(16).view(2, 8)
    pieces = [cp.split_for_cp_rank(x, 1, 2, r, load_balanced=False) for r in range(2)]
    assert torch.equal(pieces[0], x[:, :4]) and torch.equal(cp.gather_from_cp_ranks(pieces, 1, False), x)


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_causal_work_is_even_under_the_balanced_split_and_not_under_the_naive_one(cp_size):
    """Counted by brute force from the causal mask: query p sees keys 0..p."""
    s = 4 * cp_size
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for balanced in (True, False):
        brute = [int(mask[cp.chunk_positions(s, cp_size, r, balanced)].sum()) for r in range(cp_size)]
        assert cp.causal_pairs(s, cp_size, balanced) == brute
        assert sum(brute) == s * (s + 1) // 2
    balanced, naive = cp.causal_pairs(s, cp_size), cp.causal_pairs(s, cp_size, False)
    assert len(set(balanced)) == 1
    assert naive == sorted(naive) and max(naive) / min(naive) > cp_size


def test_the_ring_visits_every_block_once():
    for size in (2, 3, 4):
        steps = cp.ring_schedule(size)
        assert [row[r] for row in steps for r in range(size)].count(0) == size
        for r in range(size):
            assert sorted(row[r] for row in steps) == list(range(size))
            assert steps[0][r] == r
        for t in range(1, size):  # rank r holds at step t what rank r-1 held at step t-1
            assert every(steps[t][r] == steps[t - 1][(r - 1) % size] for r in range(size))


def test_pair_kinds_follow_the_causal_mask():
    c = 3
    mask = torch.ones(4 * c, 4 * c, dtype=torch.bool).tril()
    for a in range(4):
        for b in range(4):
            block = mask[a * c:(a + 1) * c, b * c:(b + 1) * c]
            kind = cp.pair_kind(a, b, causal=True)
            assert kind == ("full" if block.all() else "skip" if not block.any() else "diagonal")
            assert cp.pair_kind(a, b, causal=False) == "full"


# --- the merge ---------------------------------------------------------------------------


def test_merging_block_results_gives_full_attention():
    """Attention over keys split in three blocks, merged by the log-sum-exp rule in any
    order, equals softmax attention over all keys (and the merged lse is the full one)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    scale = 0.5
    want = F.scaled_dot_product_attention(q, k, v, scale=scale)
    full_lse = torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1)
    blocks = [cp.block_attention(q, k[..., i:j, :], v[..., i:j, :], scale) for i, j in ((0, 1), (1, 3), (3, 5))]
    for order in ((0, 1, 2), (2, 0, 1)):
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], -math.inf)
        for i in order:
            out, lse = cp.merge_partials(out, lse, *blocks[i])
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, full_lse, atol=1e-6, rtol=1e-5)


def test_the_diagonal_block_is_causal_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    out, _ = cp.block_attention(q, k, v, 4 ** -0.5, diagonal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_plain_average_of_the_parts_is_not_the_merge():
    """The mistake the merge avoids: averaging two normalised parts weighs them equally,
    whatever share of the softmax sum their keys hold."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=g) for _ in range(3))
    a, b = cp.block_attention(q, k[..., :1, :], v[..., :1, :], 1.0), cp.block_attention(q, k[..., 1:, :], v[..., 1:, :], 1.0)
    right = cp.merge_partials(*a, *b)[0]
    assert not torch.allclose((a[0] + b[0]) / 2, right, atol=1e-3)


# --- the rules and the flags ---------------------------------------------------------------


def _layout(cp_size=2, tp=1, world=None, **model):
    world = world or cp_size * tp
    parallel = ParallelConfig(world, tensor_model_parallel_size=tp, context_parallel_size=cp_size)
    return parallel, ModelConfig(**{"seq_length": 16, "num_attention_heads": 4, **model}), TrainConfig()


def test_rule12_the_sequence_cuts_into_2cp_chunks():
    """Megatron-LM refuses ``seq_length % (2 * context_parallel_size) != 0`` when CP > 1
    (``megatron/training/arguments.py``, ``validate_args``; Megatron-Core 0.20.0, d98e8a64)."""
    validate(*_layout(4, seq_length=16))
    with pytest.raises(ConfigError) as error:
        validate(*_layout(4, seq_length=12))
    assert error.value.rule == "rule 12"
    assert "seq_length (12)" in str(error.value) and "2 x 4 = 8" in str(error.value) and "16" in str(error.value)
    validate(*_layout(1, seq_length=7))  # without CP nothing is cut


def test_rule13_ulysses_needs_heads_divisible_by_cp():
    """Transformer Engine's all-to-all attention asserts ``num_heads % cp_size == 0`` on the
    heads it is given, those of one TP rank (``AttnFuncWithCPAndQKVOA2A.forward``,
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py,
    TransformerEngine d0067d0d)."""
    validate(*_layout(4, cp_comm_type="a2a", num_attention_heads=4))
    validate(*_layout(4, cp_comm_type="p2p", num_attention_heads=2, hidden_size=32))
    with pytest.raises(ConfigError) as error:
        validate(*_layout(2, tp=2, cp_comm_type="a2a", num_attention_heads=2, hidden_size=32))
    assert error.value.rule == "rule 13" and "1 heads of each TP rank" in str(error.value)
    assert "p2p or all_gather" in str(error.value)


def test_cp_comm_type_names_are_megatrons():
    """Megatron-Core 0.20.0's ``TransformerConfig.cp_comm_type`` takes ``p2p``, ``all_gather``,
    ``a2a`` or ``a2a+p2p`` (d98e8a64, megatron/core/transformer/transformer_config.py); the
    last is refused here with its own message."""
    for name in cp.CP_COMM_TYPES:
        validate(*_layout(2, cp_comm_type=name))
    for wrong, fragment in (("a2a+p2p", "hierarchical"), ("ring", "one of p2p, all_gather, a2a")):
        with pytest.raises(ConfigError) as error:
            validate(*_layout(2, cp_comm_type=wrong))
        assert error.value.rule == "malformed" and fragment in str(error.value)


def test_rule6_counts_each_cp_ranks_tokens_under_tp_with_moe():
    """The MoE layer splits each CP rank's s/CP tokens over TP: 24 tokens split over TP 8
    pass, but CP 2 leaves each rank 12, which 8 TP ranks cannot share."""
    parallel = ParallelConfig(8, tensor_model_parallel_size=8)
    model = ModelConfig(seq_length=24, num_experts=4, num_attention_heads=8, vocab_size=64)
    validate(parallel, model)
    with pytest.raises(ConfigError) as error:
        validate(replace(parallel, world_size=16, context_parallel_size=2), model)
    assert error.value.rule == "rule 6" and "24 / 2 = 12 tokens" in str(error.value)


def test_train_4d_takes_megatrons_cp_flags():
    """``--context-parallel-size`` and ``--cp-comm-type`` (megatron/training/arguments.py,
    Megatron-Core 0.20.0, d98e8a64) reach the run's configs and their checks."""
    args = TrainingArgs(world_size=4, context_parallel_size=2, cp_comm_type="a2a", seq_length=16)
    parallel, model, _ = args.configs()
    assert (parallel.context_parallel_size, model.cp_comm_type) == (2, "a2a")
    assert parallel.data_parallel_size == 2
    validate_args(args)
    assert "TP1 x CP2 (a2a) x PP1 x EP1 x DP2 = 4 ranks" in describe_run(args)  # the banner
    with pytest.raises(ConfigError) as error:
        validate_args(replace(args, seq_length=18))
    assert error.value.rule == "rule 12"


def test_the_memory_estimate_splits_activations_over_cp():
    """Each CP rank keeps the activations of s/CP tokens (the weights are whole), and a
    little more than half at CP 2: the ring's attention output reaches the projection head
    by head, which keeps its own reordered copy (chapter 9's first table)."""
    model = ModelConfig(seq_length=64, num_experts=0)
    one, two = (costs.memory_per_rank(model, ParallelConfig(c, context_parallel_size=c),
                                      TrainConfig(global_batch_size=4))[0] for c in (1, 2))
    assert two.weights == one.weights and 0.5 < two.activations / one.activations < 0.6


# --- the bytes: closed forms ---------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 4, 8])
def test_bytes_sent_per_mode(size):
    """Per rank per attention call: p2p 3 (C - 1) kv, all_gather 2 (C - 1) kv, a2a
    4 (C - 1) / C kv, with kv one rank's K and V (checked against the traces in
    tests/dist/test_context_parallel.py)."""
    b, h, s, d = 2, 8, 64, 16
    kv = costs.cp_kv_block_bytes(b, h, s, d, size)
    assert kv == 2 * b * h * (s // size) * d * 4
    sent = {mode: costs.cp_bytes_sent(mode, size, b, h, s, d) for mode in costs.CP_MODES}
    assert sent == {"p2p": 3 * (size - 1) * kv, "all_gather": 2 * (size - 1) * kv,
                    "a2a": 4 * (size - 1) * kv // size}
    assert costs.cp_attention_messages("p2p", 1, b, h, s, d) == []
