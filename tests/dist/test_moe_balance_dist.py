"""DeepSeekMoE balancing across real gloo workers: reductions equal the serial answer.

* ``global_expert_load`` summed over a group equals the load of those ranks' tokens
  concatenated (and, with rank r sending its one token to expert r, the load over a group
  is the indicator of its members: no wrong group gives the same vector).
* The sequence-wise loss of sequences split over ranks (Megatron's zigzag CP split, or
  uneven contiguous pieces) equals the loss of the whole sequences on every rank, and each
  rank's gradient is the matching slice of the serial gradient.
* So do DeepSeek-V2's expert, device and communication losses and the z-loss, on uneven
  pieces: the counts and the token count are the group's, the probabilities each rank's
  own (Megatron-Core 0.20.0, d98e8a64, megatron/core/transformer/moe/router.py
  ``TopKRouter._apply_aux_loss``, via moe_utils.py ``get_tokens_per_expert_and_token_count``
  over the TP x CP group).

float64 throughout: values agree to ``rtol=1e-12``; loads exactly.
"""
import pytest
import torch

from tutorial_lib import moe_balance
from tutorial_lib import parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import launch
from tests.asserts import every

pytestmark = pytest.mark.dist

N, K, B, COEFF = 8, 2, 2, 1e-4
D, M = 4, 2  # the V2 losses: devices, and devices a token may reach


def _batch(seed, seq_length):
    """Sigmoid affinities and their top-k picks for B sequences, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(B, seq_length, N, generator=g, dtype=torch.float64))
    return scores, torch.topk(scores, K, dim=-1).indices


def _serial(scores, topk_idx):
    scores = scores.clone().requires_grad_(True)
    loss = moe_balance.sequence_balance_loss(scores, topk_idx, N, K, COEFF)
    loss.backward()
    return loss.item(), scores.grad


def _zigzag(seq_length, cp_size, cp_rank):
    """Token positions Megatron's context parallelism gives a CP rank: chunks r and 2cp-1-r."""
    chunk = seq_length // (2 * cp_size)
    chunks = (cp_rank, 2 * cp_size - 1 - cp_rank)
    return [p for c in chunks for p in range(c * chunk, (c + 1) * chunk)]


def _split_loss_and_load(ctx, positions, group, seed, seq_length):
    scores, topk_idx = _batch(seed, seq_length)
    local = scores[:, positions].clone().requires_grad_(True)
    local_idx = topk_idx[:, positions]
    loss = moe_balance.sequence_balance_loss(local, local_idx, N, K, COEFF, group=group)
    loss.backward()
    loads = {kind: moe_balance.global_expert_load(local_idx, N, group=kind).tolist()
             for kind in (None, group, "world")}
    return loss.item(), local.grad, loads


def _cp_dp_worker(ctx, seq_length):
    parallel_state.initialize_model_parallel(ParallelConfig(4, context_parallel_size=2))
    dp_rank, cp_rank = parallel_state.get_rank_in("dp"), parallel_state.get_rank_in("cp")
    positions = _zigzag(seq_length, 2, cp_rank)
    # each dp replica has its own sequences, split over its cp pair
    loss, grad, loads = _split_loss_and_load(ctx, positions, "cp", 100 + dp_rank, seq_length)
    # rank r sends its one token to expert r: the load over dp is the indicator of dp's members
    marker = moe_balance.global_expert_load(torch.tensor([[ctx.rank]]), N, group="dp").tolist()
    return dict(dp_rank=dp_rank, positions=positions, loss=loss, grad=grad, loads=loads,
                marker=marker, dp_ranks=parallel_state.get_group_ranks("dp"))


def test_sequence_loss_over_context_parallel_ranks_equals_the_whole_sequence():
    seq_length = 8
    res = launch(_cp_dp_worker, 4, args=(seq_length,), timeout=90)
    all_tokens = []
    for r, out in enumerate(res.results):
        scores, topk_idx = _batch(100 + out["dp_rank"], seq_length)
        loss, grad = _serial(scores, topk_idx)
        assert out["loss"] == pytest.approx(loss, rel=1e-12), r
        torch.testing.assert_close(out["grad"], grad[:, out["positions"]], rtol=1e-12, atol=1e-18)
        local_idx = topk_idx[:, out["positions"]]
        all_tokens.append(local_idx)
        assert out["loads"][None] == moe_balance.expert_load(local_idx, N).tolist()
        assert out["loads"]["cp"] == moe_balance.expert_load(topk_idx, N).tolist()   # the whole sequences
        assert out["marker"] == [int(i in out["dp_ranks"]) for i in range(N)]
    world_load = moe_balance.expert_load(torch.cat(all_tokens, dim=1), N).tolist()
    assert every(out["loads"]["world"] == world_load for out in res.results)
    # on the cp group: the loss's two all-reduces (counts + length, then the value), then
    # global_expert_load's; nothing of the loss leaks onto another group
    cp_reduces = res.trace.filter(op="all_reduce", group_kind="cp", rank=0)
    assert [e.shape for e in cp_reduces] == [(B * N + 1,), (), (N,)]


def _v2_losses(probs, topk_idx, logits, group=None):
    """The V2 losses and the z-loss of ``[B, S, N]`` tokens, with V2's coefficients."""
    p, idx, z = probs.reshape(-1, N), topk_idx.reshape(-1, K), logits.reshape(-1, N)
    return {"expert": moe_balance.expert_balance_loss(p, idx, N, K, 0.003, group),
            "device": moe_balance.device_balance_loss(p, idx, N, K, D, 0.05, group),
            "communication": moe_balance.communication_balance_loss(p, idx, N, D, M, 0.02, group),
            "z": moe_balance.router_z_loss(z, 0.001, group)}


def _v2_values_and_grads(logits, positions=slice(None), group=None):
    """Each loss's value and its gradient with respect to the logits of ``positions``."""
    out = {}
    for name in ("expert", "device", "communication", "z"):
        mine = logits[:, positions].clone().requires_grad_(True)
        probs = torch.softmax(mine, dim=-1)
        loss = _v2_losses(probs, torch.topk(probs.detach(), K, dim=-1).indices, mine, group)[name]
        loss.backward()
        out[name] = (loss.item(), mine.grad)
    return out


def _v2_logits(seq_length):
    return torch.randn(B, seq_length, N, generator=torch.Generator().manual_seed(9),
                       dtype=torch.float64)


def _uneven_worker(ctx, pieces, seq_length):
    start = sum(pieces[:ctx.rank])
    positions = list(range(start, start + pieces[ctx.rank]))
    v2 = _v2_values_and_grads(_v2_logits(seq_length), positions, "world")
    return _split_loss_and_load(ctx, positions, "world", 7, seq_length) + (v2,)


def test_uneven_pieces_over_world_equal_the_whole_batch_for_every_loss_and_load():
    pieces = [5, 3, 4]
    seq_length = sum(pieces)
    res = launch(_uneven_worker, 3, args=(pieces, seq_length), timeout=60)
    scores, topk_idx = _batch(7, seq_length)
    loss, grad = _serial(scores, topk_idx)
    start = 0
    for rank, (value, local_grad, loads, _) in enumerate(res.results):
        assert value == pytest.approx(loss, rel=1e-12), rank
        torch.testing.assert_close(local_grad, grad[:, start:start + pieces[rank]],
                                   rtol=1e-12, atol=1e-18)
        assert loads["world"] == moe_balance.expert_load(topk_idx, N).tolist()
        start += pieces[rank]
    # the V2 losses and the z-loss: the whole batch's value on every rank, and each rank's
    # gradient the slice of the serial one (so their sum over the ranks is the serial gradient)
    serial = _v2_values_and_grads(_v2_logits(seq_length))
    for name, (whole, whole_grad) in serial.items():
        start = 0
        for rank, (*_, v2) in enumerate(res.results):
            value, local_grad = v2[name]
            assert value == pytest.approx(whole, rel=1e-12), (name, rank)
            torch.testing.assert_close(local_grad, whole_grad[:, start:start + pieces[rank]],
                                       rtol=1e-12, atol=1e-18, msg=f"{name}, rank {rank}")
            start += pieces[rank]
