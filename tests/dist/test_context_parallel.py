"""Context-parallel attention on real gloo ranks equals serial attention (chapter 9).

One launch per CP size (2 and 4) runs every case: the three ``cp_comm_type`` modes
(``p2p`` ring, ``all_gather``, ``a2a`` Ulysses), causal and not, on the load-balanced
split (and the p2p ring on the naive split too).  Each rank compares its output and its
gradients of Q, K and V with the serial ``scaled_dot_product_attention`` of the whole
sequence (the same random tensors on every rank), cut to its own tokens.  fp32,
``atol = 1e-5`` on values of order 1: the ring sums the softmax in another order (measured
differences up to 2e-6); Ulysses runs the serial kernel on whole sequences (exactly 0).
The same launches give the traces: the bytes of every mode equal
:func:`tutorial_lib.costs.cp_attention_messages`, the ring moves the blocks of
:func:`tutorial_lib.context_parallel.ring_schedule` with each exchange posted before the
step's attention, and the causal work per rank is even under the balanced split only.

Then the model: :class:`~tutorial_lib.deepseek.DeepSeekModel` at CP 2 (with dropout) and
TP 2 x CP 2 (a2a), one step with a sequence-balance coefficient 1000 times DeepSeek-V3's
so that the balance loss's gradient counts: every parameter's gradient after the
``dp_cp`` average equals the serial model's.  Last, the ring widget
(:mod:`tutorial_lib.viz.cp_ring`) replays the CP 4 ring's trace.
"""
import sys
from collections import Counter

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import context_parallel as cp
from tutorial_lib import costs, parallel_state
from tutorial_lib.config import ModelConfig, ParallelConfig
from tutorial_lib.launch import launch

from .launch_once import launch_once
from .worker_checks import check as _check

pytestmark = pytest.mark.dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])

S, B, HEADS, D = 16, 2, 4, 8
ATOL = 1e-5
CASES = [(mode, causal, True) for mode in cp.CP_COMM_TYPES for causal in (True, False)]
CASES += [("p2p", True, False), ("p2p", False, False),  # the naive split, for comparison
          ("all_gather", True, False)]


def case_name(mode, causal, balanced):
    return f"{mode}-{'causal' if causal else 'full'}-{'balanced' if balanced else 'naive'}"


def _attention_worker(ctx):
    size = ctx.world_size
    parallel_state.initialize_model_parallel(ParallelConfig(size, context_parallel_size=size))
    rank = parallel_state.get_rank_in("cp")
    g = torch.Generator().manual_seed(18)
    q, k, v, dy = (torch.randn(B, HEADS, S, D, generator=g) for _ in range(4))
    errors = {}
    for mode, causal, balanced in CASES:
        name = case_name(mode, causal, balanced)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        serial = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        (serial * dy).sum().backward()

        def mine(t):
            return cp.split_for_cp_rank(t, 2, size, rank, balanced)

        local = [mine(x).clone().requires_grad_() for x in (q, k, v)]
        with ctx.tracer.tags(case=name):
            out = cp.context_parallel_attention(*local, mode, causal, "cp", balanced)
            (out * mine(dy)).sum().backward()
        errors[name] = {"out": (out - mine(serial.detach())).abs().max().item()}
        for what, a, b in zip(("dq", "dk", "dv"), local, leaves):
            errors[name][what] = (a.grad - mine(b.grad)).abs().max().item()
    return errors


@launch_once
def attention_run(size):
    return launch(_attention_worker, size, timeout=120)


SIZES_AND_CASES = [(size, case) for size in (2, 4) for case in CASES]


@pytest.mark.parametrize("size,case", SIZES_AND_CASES,
                         ids=[f"cp{s}-{case_name(*c)}" for s, c in SIZES_AND_CASES])
def test_attention_and_its_gradients_equal_serial(size, case):
    run = attention_run(size)
    for rank, errors in enumerate(run.results):
        worst = errors[case_name(*case)]
        assert max(worst.values()) < ATOL, (rank, worst)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mode", cp.CP_COMM_TYPES)
def test_every_rank_moves_the_bytes_of_the_formula(size, mode):
    """Per rank, forward and backward: the traced (phase, op, bytes) of the cp group equal
    :func:`costs.cp_attention_messages`, and so do the bytes sent."""
    trace = attention_run(size).trace.filter(group_kind="cp", case=case_name(mode, True, True))
    rows = costs.cp_attention_messages(mode, size, B, HEADS, S, D)
    want = Counter()
    for r in rows:
        want[r["phase"], r["op"], r["bytes"]] += r["count"]
    for rank in range(size):
        events = trace.filter(rank=rank)
        got = Counter((e.tags["phase"], e.op, e.bytes) for e in events)
        assert got == want, (rank, got, want)
        sent = sum(costs.ring_bytes_sent(e.op, e.bytes, size) for e in events)
        assert sent == costs.cp_bytes_sent(mode, size, B, HEADS, S, D)


@pytest.mark.parametrize("size", [2, 4])
def test_the_ring_passes_the_blocks_of_the_schedule_under_the_attention(size):
    """Forward: at step t rank r attends to rank (r - t) mod CP's block, sends that block on
    to r + 1 and receives r - 1's, both posted before the step's attention starts."""
    trace = attention_run(size).trace.filter(case=case_name("p2p", True, True), phase="forward")
    schedule = cp.ring_schedule(size)
    for rank in range(size):
        spans = [e for e in trace.filter(rank=rank, op="compute") if e.tags["name"] == "ring_attention"]
        assert [e.tags["kv_block"] for e in spans] == [schedule[t][rank] for t in range(size)]
        for step, span in enumerate(spans[:-1]):
            send, = trace.filter(rank=rank, op="send", cp_step=step).events
            recv, = trace.filter(rank=rank, op="recv", cp_step=step).events
            assert send.peer == (rank + 1) % size and send.tags["kv_block"] == schedule[step][rank]
            assert recv.peer == (rank - 1) % size and recv.tags["kv_block"] == schedule[step + 1][rank]
            assert send.t_start <= span.t_start and recv.t_start <= span.t_start  # overlapped
        assert not trace.filter(rank=rank, op="send", cp_step=size - 1).events  # nothing after


@pytest.mark.parametrize("size", [2, 4])
def test_the_balanced_split_evens_the_causal_work_and_the_naive_one_does_not(size):
    """The (query, key) pairs each rank's ring steps attended, summed from the trace."""
    for balanced in (True, False):
        trace = attention_run(size).trace.filter(case=case_name("p2p", True, balanced),
                                                 phase="forward", op="compute")
        work = [sum(e.tags["pairs"] for e in trace.filter(rank=r)) for r in range(size)]
        assert work == cp.causal_pairs(S, size, balanced)
        assert (len(set(work)) == 1) == balanced


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_all_gather_attends_each_chunk_to_its_causal_prefix(size, balanced):
    """TransformerEngine (main), ``transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py`` (commit d0067d0d), ``AttnFuncWithCPAndKVAllGather.forward``:
    after the all-gather, local chunk ``c`` attends to the K/V rows ``[0, (c + 1) L)``
    only (``get_kv_seq_info_after_all_gather``: ``seq_end_idx`` is the chunk's end under
    a causal mask), one attention call per local chunk.  From the trace: the products
    each call multiplies are ``L x (c + 1) L``, the pairs its mask lets through add up to
    the rank's causal pairs, and under the balanced split the products are
    ``(2 CP + 1) L^2``, about half the ``s/CP x s`` of attending every query to every
    gathered key."""
    trace = attention_run(size).trace.filter(case=case_name("all_gather", True, balanced),
                                             op="compute")
    length = S // cp.num_chunks(size, balanced)
    for rank in range(size):
        calls = [e for e in trace.filter(rank=rank) if e.tags["name"] == "all_gather_attention"]
        chunks = cp.held_chunks(rank, size, balanced)
        assert [e.tags["query_chunk"] for e in calls] == list(chunks)
        assert [e.tags["products"] for e in calls] == [length * (c + 1) * length for c in chunks]
        assert sum(e.tags["pairs"] for e in calls) == cp.causal_pairs(S, size, balanced)[rank]
        products = sum(e.tags["products"] for e in calls)
        if balanced:  # chunks r and 2 CP - 1 - r: (2 CP + 1) L^2 of the 4 CP L^2
            assert products == (2 * size + 1) * length ** 2 < (S // size) * S
        else:  # chunk r of CP: (r + 1) L^2; only the last rank sees every key
            assert products == (rank + 1) * length ** 2


# --- the model -----------------------------------------------------------------------------


def _model_worker(ctx, tp, mode, dropout):
    from tutorial_lib.data import synthetic_batch
    from tutorial_lib.data_parallel import DataParallel
    from tutorial_lib.deepseek import DeepSeekModel
    from tutorial_lib.moe_balance import BalanceConfig
    from tutorial_lib.tensor_parallel import allreduce_sequence_parallel_grads
    from tutorial_lib.train_4d import moe_aux_loss_scale

    size = ctx.world_size // tp
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=S,
                         vocab_size=32, num_experts=4, first_k_dense_replace=1, dropout=dropout,
                         cp_comm_type=mode)
    strong = BalanceConfig.deepseek_v3(sequence_alpha=0.1)
    ids, labels = synthetic_batch(7, 0, B, S, config.vocab_size)
    rows = torch.arange(B)

    serial = DeepSeekModel(config, seed=5, tp_group=None, ep_group=None, cp_group=None)
    for layer in serial.moe_layers().values():
        layer.balance = strong
    serial(ids, labels, rows, step=1).backward()

    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp, context_parallel_size=size))
    rank = parallel_state.get_rank_in("cp")
    model = DeepSeekModel(config, seed=5)
    for layer in model.moe_layers().values():
        layer.balance = strong
    model.aux_loss_scale = moe_aux_loss_scale(1, size)
    wrapped = DataParallel(model, group="dp_cp")
    loss = wrapped(cp.split_for_cp_rank(ids, 1, size, rank), cp.split_for_cp_rank(labels, 1, size, rank),
                   rows, 1)
    loss.backward()
    wrapped.finish_grad_sync()
    allreduce_sequence_parallel_grads(model, "tp")
    tp_rank, worst = parallel_state.get_rank_in("tp"), {}
    reference = dict(serial.named_parameters())
    for name, param in model.named_parameters():
        full = reference[name].grad
        if getattr(param, "tensor_model_parallel", False):
            full = full.chunk(tp, param.partition_dim)[tp_rank]
        _check(full.shape == param.grad.shape, f"{name}: {tuple(param.grad.shape)} vs {tuple(full.shape)}")
        worst[name] = ((param.grad - full).abs().max() / full.abs().max().clamp(min=1e-12)).item()
    return worst


@launch_once
def model_run(world, tp, mode, dropout):
    return launch(_model_worker, world, args=(tp, mode, dropout), timeout=120)


@pytest.mark.parametrize("world,tp,mode,dropout", [(2, 1, "p2p", 0.2), (4, 2, "a2a", 0.0)],
                         ids=["cp2-p2p-dropout", "tp2-cp2-a2a"])
def test_the_model_under_cp_has_the_serial_gradients(world, tp, mode, dropout):
    """Every parameter (embedding, attention, router, experts, head), relative to its
    largest gradient entry: fp32 rounding (measured ~1e-6).  Needs the load-balanced
    positions, the dropout rows of those positions, the balance-loss counts summed over
    TP x CP and the C / M aux-loss scale; with 1 / M the router's gradient is off by the
    balance loss's part."""
    for rank, worst in enumerate(model_run(world, tp, mode, dropout).results):
        bad = {name: err for name, err in worst.items() if err > 1e-4}
        assert not bad, (rank, bad)


# --- the ring, replayed ---------------------------------------------------------------------


def test_the_ring_widget_replays_the_recorded_ring():
    """The animation's frames come from the trace: one per step plus the merged result,
    each rank's block the schedule's, each message a block passed on to the next rank,
    each rank's pairs the ones its span counted."""
    from tutorial_lib.viz.cp_ring import animate_ring_attention
    trace = attention_run(4).trace.filter(case=case_name("p2p", True, True))
    anim = animate_ring_attention(trace)
    schedule = cp.ring_schedule(4)
    assert len(anim) == 5 and anim.data[-1]["holds"] is None
    for t, state in enumerate(anim.data[:-1]):
        assert [state["holds"][p] for p in range(4)] == schedule[t]
        assert state["sends"] == ([[p, (p + 1) % 4, schedule[t][p]] for p in range(4)]
                                  if t < 3 else [])
        spans = [e for e in trace.filter(op="compute", phase="forward", cp_step=t)]
        assert sorted(state["pairs"].values()) == sorted(e.tags["pairs"] for e in spans)
    html = anim.to_html()
    assert 'class="tl-animation"' in html and "K/V of CP 3" in html
