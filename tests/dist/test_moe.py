"""The MoE layer on real gloo workers: EP x DP and TP (sequence parallel) against the serial layer.

Two launches, each running several parallel configurations one after the other (Megatron
layout; DP is Megatron's dense data-parallel size, EP ranks included):

* world 4: EP 1 (DP 4); EP 2 x EDP 2 (DP 4); TP 2 with sequence parallelism (DP 2);
  and TP 2 x EP 2 with sequence parallelism (DP 2), which the course's old rule 2 refused
  (lifted since: ``train_4d`` runs it end to end in test_pipeline_training.py);
* world 8: EP 4 x EDP 2 (DP 8); TP 4 with sequence parallelism (DP 2).

Every DP replica gets its own tokens; TP ranks of one replica share them.  The shared
experts are split over TP like Megatron-Core's ``SharedExpertMLP`` (each TP rank's shard
and its gradient checked against the serial expert's slice, its all-gather and
reduce-scatter in the trace).  The serial
reference is the same ``MoELayer`` with ``ep_group=tp_group=None``, run on each replica's
tokens: its summed loss's gradients, divided by DP, are what :class:`DataParallel` (experts divided by the dense DP size)
must leave on every rank.  Two routings per configuration: softmax with shared experts,
the V2 balance losses and the z-loss (dropless), and sigmoid with a bias, device-limited
routing (M = 2 of D = 4), the V3 sequence loss, the z-loss and capacity factor 1.0
(capacity only at TP = 1: it is computed per rank, and a TP rank holds s/TP of the
replica's tokens).  Every loss runs at every TP size: under sequence parallelism each TP
rank routes s/TP of its replica's tokens, and the losses' values and the router gradient
(after the sequence-parallel sum over TP) must still be the serial layer's.  Megatron-Core
0.20.0 (d98e8a64) gets this by summing tokens-per-expert over the TP x CP group and
dividing by the group's token count (megatron/core/transformer/moe/router.py,
``TopKRouter._apply_aux_loss`` / ``_apply_seq_aux_loss``, through moe_utils.py
``get_tokens_per_expert_and_token_count`` and ``switch_load_balancing_loss_func``), and
its z-loss divides the coefficient by the TP x CP size (``TopKRouter.apply_z_loss``).
Losses computed on each rank's s/TP tokens alone gave several times the serial router
gradient (chapter 5 measures 2.4 at TP 2 and 8.5 at TP 4 for the expert loss) and exactly
TP times for the z-loss; this test then failed on the input and router gradients.
At every TP > 1 the layer is also fed the TP rank's s/TP tokens directly
(``input_is_sequence_parallel``, a model with sequence parallelism throughout): the same
slices, and no sequence collective but the shared experts'.

Tolerances: outputs, gradients and aux losses against the serial layer in fp32 with
``atol = rtol = 1e-5`` (only summation order differs); routing decisions, the dispatch
round trip, the ``2**rank`` sums and every byte and split count exactly.
"""
import sys

import cloudpickle
import pytest
import torch

from tutorial_lib import costs, moe, parallel_state
from tutorial_lib.config import ConfigError, ParallelConfig
from tutorial_lib.data_parallel import DataParallel
from tutorial_lib.launch import launch
from tutorial_lib.moe_balance import BalanceConfig
from tutorial_lib.tensor_parallel import allreduce_sequence_parallel_grads

from .worker_checks import check as _check, close as _close
from tests.asserts import every

pytestmark = pytest.mark.dist

# Workers get these functions by value and never import pytest (see test_tensor_parallel.py).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S, B, H = 4, 2, 8          # sequence, batch, hidden: T = 8 tokens per replica
N, K, FFN = 8, 2, 4        # routed experts, top-k, each expert's ffn size
CASES = {
    "softmax": dict(score_function="softmax", num_shared_experts=1, num_devices=4),
    "sigmoid": dict(score_function="sigmoid", routed_scaling_factor=2.5, device_limit=2,
                    num_devices=4, num_shared_experts=1),
}
WORLD4 = [("ep1", 1, 1), ("ep2", 1, 2), ("tp2_sp", 2, 1), ("tp2_ep2_sp", 2, 2)]  # (name, TP, EP)
WORLD8 = [("ep4", 1, 4), ("tp4_sp", 4, 1)]


def _balance(case):
    if case == "softmax":
        return BalanceConfig(use_z_loss=True)  # V2: expert, device, communication (+ z-loss)
    return BalanceConfig(use_expert_loss=False, use_device_loss=False, use_communication_loss=False,
                         use_sequence_loss=True, use_bias_balancing=True, use_z_loss=True)  # V3


def _replica_data(d):
    g = torch.Generator().manual_seed(100 + d)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _loss(y, dy, info):
    """``(y * dy).sum()`` (a scalar backward: no sympy import in the workers) + the aux losses."""
    return (y * dy).sum() + sum(info["aux_losses"].values(), torch.zeros(()))


def _layer_and_serial(case, tp):
    kwargs = dict(CASES[case], capacity_factor=1.0 if case == "sigmoid" and tp == 1 else None,
                  balance=_balance(case), sequence_parallel=tp > 1, seed=7)
    layer = moe.MoELayer(H, N, K, FFN, **kwargs)
    serial = moe.MoELayer(H, N, K, FFN, ep_group=None, tp_group=None, **kwargs)
    for m in (layer, serial):
        if m.router.expert_bias is not None:  # a bias that really changes some choices
            m.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, N))
    return layer, serial


def _brute_force_dropped(topk_idx, gates, capacity):
    dropped = 0
    for e in range(N):
        gs = sorted((gates[topk_idx == e]).tolist(), reverse=True)
        dropped += max(0, len(gs) - capacity)
    return dropped


def _sync_grads(layer):
    """The library's one way to sync gradients: DataParallel by domain, then SP's TP sum."""
    model = DataParallel(layer, bucket_size_bytes=0, overlap=False)
    model.finish_grad_sync()
    allreduce_sequence_parallel_grads(layer)
    model.remove_hooks()


def _compare_with_serial(ctx, case, tp, data, d):
    layer, serial = _layer_and_serial(case, tp)
    dp = len(data)
    x_mine, dy_mine = data[d]
    with ctx.tracer.tags(case=case):
        x = x_mine.clone().requires_grad_()
        y, info = layer(x)
        _loss(y, dy_mine, info).backward()
        _sync_grads(layer)
    for i, (xs, dys) in enumerate(data):  # serial, replica by replica; grads accumulate
        xs = xs.clone().requires_grad_()
        ys, info_s = serial(xs)
        _loss(ys, dys, info_s).backward()
        if i == d:
            mine = ys.detach(), xs.grad, info_s
    ys, xs_grad, info_s = mine
    what = f"{case} TP={tp} EP={layer.dispatcher.ep_size} rank {ctx.rank}"
    _close(y, ys, f"{what}: output")
    _close(x.grad, xs_grad, f"{what}: input gradient")
    _check(sorted(info["aux_losses"]) == sorted(info_s["aux_losses"]) and info["aux_losses"],
           f"{what}: aux losses {sorted(info['aux_losses'])} vs {sorted(info_s['aux_losses'])}")
    for name, value in info["aux_losses"].items():
        _close(value.detach(), info_s["aux_losses"][name].detach(), f"{what}: aux loss {name}")
    # gradients after the sync: those of the mean loss over the DP replicas (x DP is exact)
    _close(layer.router.weight.grad * dp, serial.router.weight.grad, f"{what}: router grad")
    tp_rank = parallel_state.group_rank("tp")
    for (name, p), ps in zip(layer.shared_experts.named_parameters(), serial.shared_experts.parameters()):
        # Megatron's SharedExpertMLP: gate / up column-parallel, down row-parallel over TP
        dim = {"weight_gate": 0, "weight_up": 0, "weight_down": 1}[name]
        _check(not getattr(p, "sequence_parallel", False) and p.tensor_model_parallel
               and p.partition_dim == dim and p.shape[dim] == ps.shape[dim] // tp,
               f"{what}: shared expert {name} shard")
        _close(p.grad * dp, ps.grad.chunk(tp, dim)[tp_rank], f"{what}: shared expert {name} grad")
    mine_experts = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
    for (name, p), ps in zip(layer.experts.named_parameters(), serial.experts.parameters()):
        _close(p.grad * dp, ps.grad[mine_experts], f"{what}: routed expert {name} grad")
    if layer.capacity_factor is None:
        _check(info["num_dropped"] == 0, f"{what}: dropless layer dropped copies")
    else:  # capacity is per rank; here a rank's tokens are its replica's, as in the serial run
        expected = _brute_force_dropped(info["topk_idx"], info["gates"], info["capacity"])
        _check(info["num_dropped"] == info_s["num_dropped"] == expected > 0,
               f"{what}: dropped {info['num_dropped']}, serial {info_s['num_dropped']}, "
               f"brute force {expected} (capacity {info['capacity']})")
    if layer.router.device_limit is not None:
        devices = (info["topk_idx"] // (N // 4)).tolist()
        _check(all(len(set(row)) <= 2 for row in devices), f"{what}: a token reached > M devices")
    return {"tokens_per_expert": info["tokens_per_expert"].tolist(),
            "sent": info["tokens_sent_per_rank"], "received": info["tokens_received_per_rank"]}


def _split_input(ctx, tp, data, d):
    """A model with sequence parallelism throughout hands the layer this TP rank's ``s/TP``
    tokens (``input_is_sequence_parallel``; Megatron-Core d98e8a64's ``MoELayer.forward``
    takes the sharded hidden states as they come): its output, input gradient and router
    gradient are the slices of the layer that splits the sequence itself, fed the whole
    sequence; the collectives it issues are checked in the test process."""
    x_mine, dy_mine = data[d]
    rank = parallel_state.group_rank("tp")
    mine = slice(rank * S // tp, (rank + 1) * S // tp)
    got = {}
    for split in (False, True):
        layer = moe.MoELayer(H, N, K, FFN, **CASES["softmax"], sequence_parallel=True, seed=7,
                             input_is_sequence_parallel=split)
        x = (x_mine[mine] if split else x_mine).clone().requires_grad_()
        with ctx.tracer.tags(case=f"input split {split}"):
            y, _ = layer(x)
            (y * (dy_mine[mine] if split else dy_mine)).sum().backward()
        got[split] = (y.detach(), x.grad, layer.router.weight.grad)
    (y, dx, router), (y_split, dx_split, router_split) = got[False], got[True]
    _close(y_split, y[mine], f"rank {ctx.rank}: split input's output")
    _close(dx_split, dx[mine], f"rank {ctx.rank}: split input's gradient")
    _close(router_split, router, f"rank {ctx.rank}: split input's router gradient")


def _powers_of_two(ctx, tp):
    """Fill every gradient with 2**rank: the synced sums name the groups that were summed."""
    layer, _ = _layer_and_serial("softmax", tp)
    for p in layer.parameters():
        p.grad = torch.full_like(p, 2.0 ** ctx.rank)
    with ctx.tracer.tags(case="powers_of_two"):
        _sync_grads(layer)
    router, expert = layer.router.weight.grad, layer.experts.weight_gate.grad
    _check(torch.equal(router, torch.full_like(router, router.flatten()[0].item())), "router grad uniform")
    _check(torch.equal(expert, torch.full_like(expert, expert.flatten()[0].item())), "expert grad uniform")
    return {"router": router.flatten()[0].item(), "expert": expert.flatten()[0].item()}


def _round_trip(ctx, ep):
    """Dispatch then combine: identity experts give back the input exactly, and its gradient.

    The last EP rank's experts get no tokens and EP rank 1 has no tokens of its own.
    A second pass scales each row by (its global expert id + 1) inside the "expert":
    every copy must come back multiplied by the id it was routed to.
    """
    dispatcher = moe.AllToAllDispatcher(N, "ep")
    ep_rank, local = parallel_state.get_rank_in("ep"), N // ep
    tokens = 0 if ep > 1 and ep_rank == 1 else 6
    reachable = N - local if ep > 1 else N  # never the last EP rank's experts
    g = torch.Generator().manual_seed(ctx.rank)
    topk_idx = torch.stack([torch.randperm(reachable, generator=g)[:K] for _ in range(tokens)]
                           ) if tokens else torch.zeros(0, K, dtype=torch.int64)
    for scaled in (False, True):
        x = (100.0 * ctx.rank + torch.arange(float(tokens * H)).view(tokens, H)).requires_grad_()
        with ctx.tracer.tags(case="round_trip"):
            rows, per_expert, state = dispatcher.dispatch(x, topk_idx)
            if scaled:
                ids = torch.repeat_interleave(torch.arange(local) + ep_rank * local + 1.0,
                                              torch.tensor(per_expert))
                rows = rows * ids[:, None]
            copies = dispatcher.combine(rows, state)
            factor = (topk_idx + 1.0)[..., None] if scaled else torch.ones(tokens, K, 1)
            _check(torch.equal(copies, x.detach()[:, None, :] * factor),
                   f"round trip (scaled={scaled}) is not exact on rank {ctx.rank}")
            weights = 2.0 ** ctx.rank * torch.arange(1.0, K + 1)[None, :, None]
            (copies * weights).sum().backward()
        _check(torch.equal(x.grad, (weights * factor).sum(1).expand(tokens, H)),
               f"round-trip gradient (scaled={scaled}) is not exact on rank {ctx.rank}")
        if ep > 1 and ep_rank == ep - 1:
            _check(rows.shape == (0, H) and per_expert == [0] * local,
                   f"the last EP rank should receive nothing, got {per_expert}")
    return tokens


def _moe_world(ctx, configs):
    out = {}
    for name, tp, ep in configs:
        with ctx.tracer.tags(config=name):
            # whole experts (ETP 1): this module checks the layer against the serial one
            # expert by expert; ETP = TP is test_pipeline_training's TP x EP sweep
            parallel_state.initialize_model_parallel(ParallelConfig(
                ctx.world_size, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1))
            dp, d = parallel_state.get_size("dp"), parallel_state.get_rank_in("dp")
            data = [_replica_data(i) for i in range(dp)]
            res = {"groups": {k: parallel_state.get_group_ranks(k) for k in ("tp", "ep", "dp", "expert_dp")}}
            for case in CASES:
                res[case] = _compare_with_serial(ctx, case, tp, data, d)
            res["powers_of_two"] = _powers_of_two(ctx, tp)
            res["round_trip_tokens"] = _round_trip(ctx, ep)
            if tp > 1:  # without sequence parallelism every TP rank would route the same tokens
                _split_input(ctx, tp, data, d)
                try:
                    moe.MoELayer(H, N, K, FFN, sequence_parallel=False)
                    res["refused_without_sp"] = ""
                except ConfigError as error:
                    res["refused_without_sp"] = str(error)
            out[name] = res
    return out


# --- checks in the test process ----------------------------------------------------------------


def _events(trace, rank, config, case):
    return [e for e in trace.filter(rank=rank, op="all_to_all", config=config, case=case)]


def _check_all_to_alls(res, trace, name, tp, ep, world):
    results = [r[name] for r in res]
    for case in CASES:
        for rank in range(world):
            group = results[rank]["groups"]["ep"]
            loads = [results[g][case]["tokens_per_expert"] for g in group]
            counts = costs.moe_send_counts(loads)
            i = group.index(rank)
            predicted = costs.moe_rank_all_to_alls(counts, i, H, N, bytes_per_element=4)
            got = [(e.tags["phase"], e.tags["op_name"], e.tags["payload"], e.bytes,
                    tuple(e.splits["input"]), tuple(e.splits["output"]))
                   for e in _events(trace, rank, name, case)]
            want = [(p.phase, p.op_name, p.payload, p.bytes, p.input_splits, p.output_splits)
                    for p in predicted]
            assert got == want, f"{name} {case} rank {rank}"
            for e in _events(trace, rank, name, case):
                assert e.group_kind == "ep" and list(e.group_ranks) == group
                assert e.dtype == ("int64" if e.tags["payload"] == "counts" else "float32")
            # the splits are the routing's counts, as the layer reported them
            assert list(counts[i]) == results[rank][case]["sent"]
            assert [counts[j][i] for j in range(len(group))] == results[rank][case]["received"]
            if ep > 1 and case == "softmax":  # dropless: T * K * h * 4 bytes dispatched
                tokens = S * B // tp
                assert want[1][3] == costs.moe_all_to_all_bytes(tokens, K, H, 4)
    for rank in range(world):  # the round trip's all-to-alls: 2 passes x (counts, 2 fwd, 2 bwd)
        assert len(_events(trace, rank, name, "round_trip")) == (10 if ep > 1 else 0)


def _check_powers_of_two(res, name, tp):
    for rank, r in enumerate(res):
        groups = r[name]["groups"]
        dp = len(groups["dp"])
        tp_sum = lambda g: sum(2.0 ** t for t in res[g][name]["groups"]["tp"]) if tp > 1 else 2.0 ** g
        router = sum(tp_sum(g) for g in groups["dp"]) / dp  # SP sum over TP, then DP mean
        expert = sum(2.0 ** g for g in groups["expert_dp"]) / dp  # expert-DP sum / DP
        assert r[name]["powers_of_two"] == {"router": router, "expert": expert}, (name, rank)


#: A layer fed the TP rank's s/TP tokens issues its shared experts' two collectives and
#: their backwards over TP, nothing else: no scatter's all-gather, no gather of the output.
SHARED_EXPERTS_ONLY = {
    ("all_gather", "forward", "gather_from_sequence_parallel_region"): 1,
    ("reduce_scatter", "forward", "reduce_scatter_to_sequence_parallel_region"): 1,
    ("all_gather", "backward", "reduce_scatter_to_sequence_parallel_region"): 1,
    ("reduce_scatter", "backward", "gather_from_sequence_parallel_region"): 1,
}


def _check_sequence_parallel_trace(trace, name, world):
    """The layer's own scatter / gather of the sequence, and the shared experts' two
    collectives as Megatron-Core's ``SharedExpertMLP`` issues them under sequence
    parallelism (megatron/core/transformer/moe/shared_experts.py at d98e8a64:
    ``pre_forward_comm`` all-gathers the TP ranks' tokens with
    ``gather_from_sequence_parallel_region``, ``post_forward_comm`` reduce-scatters the
    shards' partial outputs with ``reduce_scatter_to_sequence_parallel_region``); the
    backward of each is the other one, over the ``tp`` group."""
    from collections import Counter
    for rank in range(world):
        for case in CASES:
            events = trace.filter(rank=rank, config=name, case=case)
            sp = Counter((e.op, e.tags["phase"], e.tags["op_name"]) for e in events
                         if e.op in ("all_gather", "reduce_scatter"))
            assert sp == Counter({
                ("all_gather", "forward", "gather_from_sequence_parallel_region"): 2,
                ("reduce_scatter", "forward", "reduce_scatter_to_sequence_parallel_region"): 1,
                ("all_gather", "backward", "scatter_to_sequence_parallel_region"): 1,
                ("all_gather", "backward", "reduce_scatter_to_sequence_parallel_region"): 1,
                ("reduce_scatter", "backward", "gather_from_sequence_parallel_region"): 1,
            }), (name, rank, sp)
            assert every(e.group_kind == "tp" for e in events
                       if e.op in ("all_gather", "reduce_scatter")), (name, rank)
        split = Counter((e.op, e.tags["phase"], e.tags["op_name"])
                        for e in trace.filter(rank=rank, config=name, case="input split True")
                        if e.group_kind == "tp")
        assert split == Counter(SHARED_EXPERTS_ONLY), (name, rank, split)


@pytest.fixture(scope="module")
def world4():
    return launch(_moe_world, 4, args=(WORLD4,), timeout=120)


def test_ep_tp_dp_equal_the_serial_layer_world4(world4):
    # every equality was checked inside the workers; here the traces and group sums
    for name, tp, ep in WORLD4:
        _check_all_to_alls(world4.results, world4.trace, name, tp, ep, 4)
        _check_powers_of_two(world4.results, name, tp)
        if tp > 1:
            _check_sequence_parallel_trace(world4.trace, name, 4)
    # EP 2 in the Megatron layout: EP groups {0,1},{2,3}; expert-DP {0,2},{1,3}; DP all four
    groups = world4.results[0]["ep2"]["groups"]
    assert groups["ep"] == [0, 1] and groups["expert_dp"] == [0, 2] and groups["dp"] == [0, 1, 2, 3]
    assert world4.results[1]["ep2"]["round_trip_tokens"] == 0  # a rank with no tokens took part
    message = world4.results[0]["tp2_sp"]["refused_without_sp"]
    assert "tensor_model_parallel_size (2)" in message and "sequence_parallel=True" in message


def test_ep4_dp2_and_tp4_equal_the_serial_layer_world8():
    res = launch(_moe_world, 8, args=(WORLD8,), timeout=120)
    for name, tp, ep in WORLD8:
        _check_all_to_alls(res.results, res.trace, name, tp, ep, 8)
        _check_powers_of_two(res.results, name, tp)
        if tp > 1:
            _check_sequence_parallel_trace(res.trace, name, 8)
    assert res.results[0]["ep4"]["groups"]["expert_dp"] == [0, 4]
    assert res.results[0]["tp4_sp"]["groups"]["tp"] == [0, 1, 2, 3]


def _bias_load_under_sequence_parallel(ctx):
    parallel_state.initialize_model_parallel(ParallelConfig(4, tensor_model_parallel_size=2))
    balance = BalanceConfig(use_bias_balancing=True, gamma=0.01)
    layer = moe.MoELayer(H, N, K, FFN, score_function="sigmoid", balance=balance,
                         sequence_parallel=True, seed=5)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(100 + ctx.rank // 2))
    _, info = layer(x)  # each TP rank routes its half of the sequence
    load = layer.global_load(info["topk_idx"])
    layer.update_expert_bias(load)
    return info["tokens_per_expert"].tolist(), load.tolist(), layer.router.expert_bias.tolist()


def test_bias_load_is_summed_over_every_rank_that_routed_tokens_under_sequence_parallel():
    results = launch(_bias_load_under_sequence_parallel, 4).results
    local_loads = [r[0] for r in results]
    total = [sum(col) for col in zip(*local_loads)]
    assert every(r[1] == total for r in results)  # TP and DP ranks all counted
    assert local_loads[0] != local_loads[1]  # the two TP ranks routed different tokens
    assert every(r[2] == results[0][2] for r in results)  # so every bias moved alike
