"""The distributed optimizer in the 4D run (``--use-distributed-optimizer``), real gloo.

One launch of 6 ranks, PP 3 x DP 2 (a dense layer and MoE layers on every stage, so each rank
has two gradient buffers: the dense weights over ``dp``, the routed experts over
``expert_dp``), trains 2 steps with plain data parallelism (DataParallel's all-reduces, then
Adam) and 2 with the distributed optimizer, from the same seed.
"""
from collections import Counter
from dataclasses import replace

import pytest

from tests.dist.launch_once import launch_once
from tutorial_lib import costs
from tutorial_lib.arguments import TrainingArgs

pytestmark = pytest.mark.dist

ARGS = TrainingArgs(world_size=6, pipeline_model_parallel_size=3, num_layers=6,
                    global_batch_size=8, num_microbatches=2, seq_length=8, hidden_size=16,
                    num_attention_heads=4, vocab_size=32, num_experts=4, moe_router_topk=2,
                    steps=2, timeout=180)
SETTINGS = ("plain", "distributed")


def _both_optimizers(ctx):
    """Each setting's records, and the numel of my parameters per gradient domain."""
    from tutorial_lib import parallel_state
    from tutorial_lib.data_parallel import grad_domain
    from tutorial_lib.train_4d import build_chunks, train_worker
    out = {}
    for name in SETTINGS:
        args = replace(ARGS, use_distributed_optimizer=name == "distributed")
        with ctx.tracer.tags(setting=name):
            out[name] = train_worker(ctx, args)
    numels = Counter()
    for chunk in build_chunks(ARGS):
        for p in chunk.parameters():
            numels[grad_domain(p)] += p.numel()
    out["numels"] = dict(numels)
    out["sizes"] = {kind: parallel_state.get_size(kind) for kind in ("dp", "expert_dp")}
    return out


@launch_once
def run():
    from tutorial_lib.launch import launch
    return launch(_both_optimizers, ARGS.world_size, trace=True, timeout=180)


def test_the_distributed_optimizer_trains_like_plain_data_parallelism():
    """Every logged loss and gradient norm of the distributed optimizer's run equals plain
    data parallelism's (DataParallel's all-reduce, then Adam on every parameter) to fp32
    rounding, ``atol = 1e-6`` (the sums run in another order), and the clipped update is the
    same: Megatron-Core 0.20.0 (d98e8a64) makes the same claim for
    megatron/core/optimizer/distrib_optimizer.py ``DistributedOptimizer``, each rank
    stepping Adam on its shard of the fp32 master weights."""
    records = run().results[0]
    plain, distributed = records["plain"], records["distributed"]
    assert len(plain) == len(distributed) == ARGS.steps
    for a, b in zip(plain, distributed):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-6, (a, b)
    assert plain[1]["loss"] != plain[0]["loss"]  # the first step changed the weights


def test_the_trace_holds_the_reduce_scatter_and_all_gather_the_formula_predicts():
    """Per rank and step the distributed optimizer issues, for each gradient buffer, one
    reduce-scatter of the whole padded fp32 gradient buffer and one all-gather of this
    rank's updated slice, over the buffer's own group (dense ``dp``, experts ``expert_dp``),
    with the bytes of :func:`tutorial_lib.costs.distributed_optimizer_collectives` for the
    rank's parameter count in that domain; and no gradient all-reduce over DP, which plain
    data parallelism issues in backward.  Megatron-Core 0.20.0 (d98e8a64): one bucket per
    buffer without ``overlap_grad_reduce`` (megatron/core/distributed/
    distributed_data_parallel.py), reduce-scattered in param_and_grad_buffer.py
    ``start_grad_sync`` and all-gathered in ``start_param_sync``; the bytes a rank sends on
    the ring are those of one all-reduce of its gradients, up to the padding."""
    result = run()
    for rank, res in enumerate(result.results):
        sizes, numels = res["sizes"], res["numels"]
        assert set(numels) == {"dp", "expert_dp"}
        for step in range(ARGS.steps):
            events = result.trace.filter(rank=rank, setting="distributed", step=step)
            got = Counter((e.op, e.group_kind, e.bytes) for e in events.filter(zero=1)
                          if e.tags.get("phase") == "optimizer")
            want = Counter()
            for domain, numel in numels.items():
                for row in costs.distributed_optimizer_collectives(numel, sizes[domain],
                                                                   group_kind=domain):
                    want[row.op, row.group_kind, row.bytes_each] += row.count
            assert got == want, (rank, step)
            assert not [e for e in events if e.op == "all_reduce" and e.group_kind in sizes
                        and e.tags.get("phase") == "backward"]
            plain = result.trace.filter(rank=rank, setting="plain", step=step)
            all_reduced = sum(e.bytes for e in plain if e.op == "all_reduce"
                              and e.tags.get("phase") == "backward")
            assert all_reduced == 4 * sum(numels.values())
            sent = sum(costs.ring_bytes_sent(op, nbytes, sizes[group])
                       for (op, group, nbytes), n in got.items() for _ in range(n))
            dp = sizes["dp"]
            assert 0 <= sent - costs.ring_bytes_sent("all_reduce", all_reduced, dp) < 2 * 4 * 2 * dp

