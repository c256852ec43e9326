"""The deduplicating dispatcher on real gloo ranks: the same layer, fewer bytes.

DeepEP (deepseek-ai/DeepEP, ``deep_ep/buffers/legacy.py`` ``Buffer.dispatch`` /
``Buffer.combine`` and ``tests/legacy/test_internode.py``, commit dd758ca) sends a token
once over RDMA to each node that holds one of its experts (``num_tokens_per_rdma_rank``),
forwards it once over NVLink to each rank there (``is_token_in_rank``), and its combine
adds, *without weights*, the rows each rank returns: the ranks weigh their own experts'
outputs first.  ``AllToAllDispatcher(deduplicate=True)`` does the same with two uneven
all-to-alls on the EP group (one per hop); the copy dispatcher (Megatron-Core 0.20.0's
``MoEAlltoAllTokenDispatcher``) sends one row per (token, k).

Checked on 4 ranks (EP 4 = DP 4): for a softmax router with V2 device-limited routing
(M = 2 of 4 devices) and a sigmoid router with V3 node-limited routing (1 of 2 nodes,
with a bias and capacity factor 1.0), the deduplicated layer, one node or two nodes of
two ranks, gives the copy layer's output, input gradient and every parameter gradient
(fp32, ``atol = rtol = 1e-5``: only the order of the sums differs).  Every all-to-all's
bytes and splits equal :func:`tutorial_lib.costs.moe_dedup_rank_all_to_alls` (forward in
issue order, backward as a collection), and device-limited routing leaves the copy
dispatcher's bytes exactly ``T * K * h * 4`` while it bounds the deduplicated rows by
``M`` per token.  Before the deduplicating dispatcher existed the chapter's claim that
device-limited routing "shrinks the dispatch traffic" had nothing to measure.
"""
import sys

import cloudpickle
import pytest
import torch

from tutorial_lib import costs, moe, parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import launch

from .worker_checks import check as _check, close as _close

pytestmark = pytest.mark.dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])

S, B, H = 4, 2, 8          # T = 8 tokens per rank
N, K, FFN = 16, 4, 4       # 4 experts per EP rank, top-4
ROUTINGS = {
    "v2_devices": dict(score_function="softmax", device_limit=2, num_devices=4),
    "v3_nodes": dict(score_function="sigmoid", device_limit=1, num_devices=2,
                     capacity_factor=1.0),
}
DISPATCHERS = {"copies": {}, "one_node": dict(deduplicate=True),
               "two_nodes": dict(deduplicate=True, ranks_per_node=2)}


def _layer(routing, dispatcher):
    layer = moe.MoELayer(H, N, K, FFN, num_shared_experts=1, seed=11, **ROUTINGS[routing],
                         **DISPATCHERS[dispatcher])
    if routing == "v3_nodes":  # a bias, as V3 routes with one: it steers the node choice too
        layer.router.expert_bias = torch.linspace(-0.1, 0.1, N)
    return layer


def _worker(ctx):
    parallel_state.initialize_model_parallel(ParallelConfig(4, expert_model_parallel_size=4))
    g = torch.Generator().manual_seed(40 + ctx.rank)
    x0, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    out = {}
    for routing in ROUTINGS:
        runs = {}
        for dispatcher in DISPATCHERS:
            layer = _layer(routing, dispatcher)
            x = x0.clone().requires_grad_()
            with ctx.tracer.tags(case=f"{routing}/{dispatcher}"):
                y, info = layer(x)
                (y * dy).sum().backward()
            grads = {name: p.grad for name, p in layer.named_parameters()}
            runs[dispatcher] = (y.detach(), x.grad, grads, info)
        y0, dx0, grads0, info0 = runs["copies"]
        for dispatcher in ("one_node", "two_nodes"):
            y, dx, grads, info = runs[dispatcher]
            what = f"{routing}/{dispatcher} rank {ctx.rank}"
            _check(torch.equal(info["topk_idx"], info0["topk_idx"]), f"{what}: routing")
            _close(y, y0, f"{what}: output")
            _close(dx, dx0, f"{what}: input gradient")
            for name, grad in grads.items():
                _close(grad, grads0[name], f"{what}: {name} gradient")
        keep = torch.ones(S * B, K, dtype=torch.bool)
        if ROUTINGS[routing].get("capacity_factor"):
            keep = moe.capacity_keep_mask(info0["topk_idx"], info0["gates"], N, 1.0)
        out[routing] = {"routed": info0["topk_idx"].masked_fill(~keep, -1).tolist(),
                        "dropped": info0["num_dropped"],
                        "legs": {d: runs[d][3]["rows_per_leg"] for d in DISPATCHERS}}
    # Experts split over expert-TP ranks are refused: the node-level scheme sends each
    # token's partial sums of whole experts (rule 5's message)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(ParallelConfig(
        4, tensor_model_parallel_size=2, expert_model_parallel_size=2))
    try:
        moe.AllToAllDispatcher(N, etp_group="expert_tp", deduplicate=True)
        out["etp_refusal"] = None
    except Exception as error:  # noqa: BLE001 - the test reads type and message
        out["etp_refusal"] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def run():
    return launch(_worker, 4, timeout=120)


def _key(e):
    return (e.tags["phase"], e.tags["op_name"], e.tags["payload"], e.tags.get("leg", ""),
            e.bytes, tuple(e.splits["input"]), tuple(e.splits["output"]))


def _predicted_key(p):
    return (p.phase, p.op_name, p.payload, p.leg, p.bytes, p.input_splits, p.output_splits)


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_every_all_to_all_is_the_formulas(run, routing):
    routed = [r[routing]["routed"] for r in run.results]
    for dispatcher, per_node in (("one_node", None), ("two_nodes", 2)):
        rows = costs.moe_dedup_rows(routed, N, per_node)
        assert list(rows) == (["rank"] if per_node is None else ["node", "rank"])
        for rank in range(4):
            events = run.trace.filter(rank=rank, op="all_to_all",
                                      case=f"{routing}/{dispatcher}")
            predicted = costs.moe_dedup_rank_all_to_alls(rows, rank, H, K, 4)
            forward = [_key(e) for e in events if e.tags["phase"] == "forward"]
            backward = [_key(e) for e in events if e.tags["phase"] == "backward"]
            assert forward == [_predicted_key(p) for p in predicted if p.phase == "forward"]
            assert sorted(backward) == sorted(_predicted_key(p) for p in predicted
                                              if p.phase == "backward")
            layer_legs = run.results[rank][routing]["legs"][dispatcher]
            assert [(name, sent) for name, sent, _ in layer_legs] == \
                [(leg, rows[leg][rank]) for leg in rows]


def test_limited_routing_saves_bytes_only_when_deduplicated(run):
    for routing in ROUTINGS:
        dropped = sum(r[routing]["dropped"] for r in run.results)
        copies = [e.bytes for e in run.trace.filter(
            op="all_to_all", case=f"{routing}/copies", phase="forward", op_name="dispatch",
            payload="tokens")]
        # the copy dispatcher: K rows per token, limited or not (minus dropped copies)
        assert sum(copies) == (4 * S * B * K - dropped) * H * 4
        for dispatcher in ("one_node", "two_nodes"):
            events = run.trace.filter(op="all_to_all", case=f"{routing}/{dispatcher}",
                                      phase="forward", op_name="dispatch", payload="tokens")
            first = [e for e in events if e.tags["leg"] == events[0].tags["leg"]]
            # the first hop: at most M = 2 ranks per token under V2's limit; under V3's,
            # 1 node (its 2 ranks, when the node is not a hop of its own)
            per_token = 1 if (routing, dispatcher) == ("v3_nodes", "two_nodes") else 2
            assert sum(e.bytes for e in first) <= 4 * S * B * per_token * H * 4
            assert sum(e.bytes for e in first) < sum(copies)


def test_the_deduplicating_dispatcher_refuses_experts_split_over_etp(run):
    """ETP 2 (TP 2 on 4 ranks, ETP defaulting to TP): a ConfigError naming rule 5, the
    value and both fixes, on every rank."""
    for rank_out in run.results:
        refusal = rank_out["etp_refusal"]
        assert refusal is not None and refusal.startswith("ConfigError"), refusal
        for part in ("rule 5", "expert_tensor_parallel_size is 2",
                     "expert_tensor_parallel_size=1", "deduplicate=False"):
            assert part in refusal, (part, refusal)
