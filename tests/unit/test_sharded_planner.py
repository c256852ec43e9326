"""ZeRO-2 and ZeRO-3 (Megatron-FSDP's ``optim_grads`` and ``optim_grads_params``) in the
planner: their exposed communication by hand, their memory the memory model's, the
command line's ``--data-parallel-sharding-strategy``; for dense models and for MoE models,
whose layers are two units (dense over DP x CP, routed experts over expert-DP)."""
import json

import pytest

from tutorial_lib import plan as planner
from tutorial_lib.config import ModelConfig, ParallelConfig, TrainConfig
from tutorial_lib.costs.alpha_beta import AlphaBeta
from tutorial_lib.costs.hardware import cluster
from tutorial_lib.costs.memory_model import expert_parameters, layer_parameters, memory_per_rank
from tutorial_lib.costs.model_flops import MODEL_PRESETS, gpt
from tutorial_lib.costs.step_time import (Layout, check_layout, chunk_costs, layout_memory,
                                          memory_lower_bound, predict_step, rank_parameter_counts,
                                          sharded_exposure, state_bytes_floor)

ALPHA, BW = 1e-5, 1e10
LINK = AlphaBeta(ALPHA, 1 / BW)


def _gather(n, s=4):   # ring all-gather of s bf16 slices of ceil(n / s): (s-1) steps
    return (s - 1) * ALPHA + (s - 1) * -(-n // s) * 2 / BW


def _scatter(n, s=4):  # ring reduce-scatter of the padded fp32 gradient
    return (s - 1) * ALPHA + (s - 1) / s * (-(-n // s) * s * 4) / BW


def test_zero3_exposes_only_the_first_gather_and_the_last_scatter_when_compute_hides_the_rest():
    units, root = [1000, 1003], 500
    forward, backward = sharded_exposure("optim_grads_params", units, root, 4, LINK, 1.0, 1.0)
    assert forward == pytest.approx(_gather(root))                  # the root's, first
    # backward: the last layer gathered again (the root stayed), the root's scatter last
    assert backward == pytest.approx(_gather(1003) + _scatter(root))


def test_zero3_exposes_everything_when_there_is_no_compute_to_hide_it():
    units, root = [1000, 1003], 500
    forward, backward = sharded_exposure("optim_grads_params", units, root, 4, LINK, 0.0, 0.0)
    assert forward == pytest.approx(_gather(500) + _gather(1000) + _gather(1003))
    assert backward == pytest.approx(_gather(1003) + _gather(1000)
                                     + _scatter(500) + _scatter(1000) + _scatter(1003))


def test_zero2_only_reduce_scatters_and_plain_strategies_add_nothing_per_microbatch():
    forward, backward = sharded_exposure("optim_grads", [1000, 1003], 0, 4, LINK, 0.0, 0.0)
    assert forward == 0 and backward == pytest.approx(_scatter(1000) + _scatter(1003))
    assert sharded_exposure("optim", [1000], 0, 4, LINK, 0.0, 0.0) == (0.0, 0.0)
    assert sharded_exposure("optim_grads_params", [1000], 0, 1, LINK, 0.0, 0.0) == (0.0, 0.0)


def test_a_step_counts_the_exposure_every_chunk_microbatch():
    model = gpt(2, 256, 4, seq_length=64, vocab_size=128)
    where = cluster("h100-sxm")
    layout = Layout(dp=4, sharding="optim_grads_params")
    costs = chunk_costs(model, where, layout, 0.5)
    layers = [layer_parameters(model, i) for i in range(2)]
    expected = sharded_exposure("optim_grads_params", layers, 2 * 128 * 256, 4,
                                where.intra_node, costs.forward_compute, costs.backward_compute)
    assert (costs.dp_forward, costs.dp_backward) == pytest.approx(expected)
    step = predict_step(model, where, layout, 8, 0.5)
    assert step.dp_s == pytest.approx(2 * sum(expected))           # M = 8 / 4 = 2, no tail


def test_memory_is_the_memory_model_s_and_falls_with_each_stage():
    model = gpt(4, 1024, 16, seq_length=512, vocab_size=1000)
    used = {}
    for sharding in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        layout = Layout(dp=8, sharding=sharding)
        used[sharding] = layout_memory(model, layout, 16)
        assert memory_lower_bound(model, layout, 16) <= used[sharding]
    assert used["no_shard"] > used["optim"] > used["optim_grads"] > used["optim_grads_params"]


# A MoE model on a small grid: EP 2 x DP 4 on 4 GPUs, so expert-DP 2; its first layer
# dense, the other three MoE (8 routed experts of width 128, none shared).
MOE = ModelConfig(4, 256, 4, 64, 128, num_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=128, num_shared_experts=0, first_k_dense_replace=1)
ROUTED = 3 * (8 // 2) * 128 * 256    # one MoE layer's experts on an EP rank: gate, up, down
SLOW = AlphaBeta(3e-5, 1 / 4e9)      # the experts' link in the pure cases below


def _on(link, op, n, s):  # one unit's ring collective on ``link``, s ranks
    piece = -(-n // s)
    wire = piece * 2 if op == "gather" else piece * s * 4        # bf16 slices, fp32 padded
    return (s - 1) * link.alpha + (s - 1) / (s if op == "scatter" else 1) * wire * link.beta


def test_a_moe_layer_is_two_units_each_on_its_own_group_and_link():
    """Layer 2 holds 2001 routed-expert parameters besides its 1003 dense ones: the dense
    unit sliced over DP 4 on ``LINK``, the experts over expert-DP 2 on ``SLOW``, the two
    collectives of a layer back to back (root 500, layer 1 dense).  A layer's two units
    are prefetched together, as torchtitan does (pytorch/torchtitan, commit 2645c02d,
    torchtitan/models/llama4/infra/parallelize.py, ``apply_fsdp``: under EP the routed
    experts are ``fully_shard``-ed over ``dp_mod_ep_mesh``, the router and shared experts
    with their block, and each block's forward prefetch lists the next block and its
    ``moe.experts``, its backward prefetch the previous block and its experts): with
    compute to hide them, no expert gather shows but the last layer's, the backward's first."""
    units, experts, root = [1000, 1003], [0, 2001], 500
    args = dict(experts=experts, expert_shard=2, expert_link=SLOW)
    forward, backward = sharded_exposure("optim_grads_params", units, root, 4, LINK, 0.0, 0.0,
                                         **args)
    dense = lambda op, n: _on(LINK, op, n, 4)  # noqa: E731
    routed = _on(SLOW, "gather", 2001, 2), _on(SLOW, "scatter", 2001, 2)
    assert forward == pytest.approx(dense("gather", 500) + dense("gather", 1000)
                                    + dense("gather", 1003) + routed[0])
    assert backward == pytest.approx(dense("gather", 1003) + routed[0] + dense("gather", 1000)
                                     + dense("scatter", 500) + dense("scatter", 1000)
                                     + dense("scatter", 1003) + routed[1])
    # compute hides all but the first gather of each pass and the last reduce-scatter: the
    # last layer's pair gathered again first in backward, the root's scatter last
    forward, backward = sharded_exposure("optim_grads_params", units, root, 4, LINK, 1.0, 1.0,
                                         **args)
    assert forward == pytest.approx(dense("gather", 500))
    assert backward == pytest.approx(dense("gather", 1003) + routed[0] + dense("scatter", 500))
    _, zero2 = sharded_exposure("optim_grads", units, 0, 4, LINK, 0.0, 0.0, **args)
    assert zero2 == pytest.approx(dense("scatter", 1000) + dense("scatter", 1003) + routed[1])
    # expert-DP 1 (EP as large as DP): the experts are not sharded and move nothing
    assert sharded_exposure("optim_grads", units, 0, 4, LINK, 0.0, 0.0, experts=experts,
                            expert_shard=1, expert_link=SLOW)[1] == pytest.approx(
        dense("scatter", 1000) + dense("scatter", 1003))
    with pytest.raises(ValueError, match="one routed-expert count"):
        sharded_exposure("optim_grads", units, 0, 4, LINK, 0.0, 0.0, experts=[0])


@pytest.mark.parametrize("sharding", ["optim_grads", "optim_grads_params"])
def test_a_moe_step_shards_the_experts_over_expert_dp_on_its_link(sharding):
    """EP 2 x DP 4 on nodes of two GPUs: the DP x CP group (4 ranks) and the expert-DP
    group (2) both leave the node, EP's stays inside.  Each chunk-microbatch exposes what
    :func:`sharded_exposure` says of the dense units over 4 ranks and the experts over 2,
    on the network; ZeRO-2 adds the step's all-gather of both domains' updated slices."""
    where = cluster("h100-sxm", gpus_per_node=2)
    layout = Layout(dp=4, ep=2, sharding=sharding)
    assert layout.expert_data_parallel_size == 2
    assert expert_parameters(MOE, 2) == ROUTED
    net = where.inter_node
    costs = chunk_costs(MOE, where, layout, 0.5)
    dense = [layer_parameters(MOE, 0, 1, 2)] + [layer_parameters(MOE, i, 1, 2) - ROUTED
                                                 for i in (1, 2, 3)]
    root = 2 * 128 * 256                                   # embedding and output layer
    gathers = [_on(net, "gather", root, 4)] + [
        _on(net, "gather", d, 4) + (_on(net, "gather", ROUTED, 2) if i else 0)
        for i, d in enumerate(dense)]
    scatters = [_on(net, "scatter", root, 4)] + [
        _on(net, "scatter", d, 4) + (_on(net, "scatter", ROUTED, 2) if i else 0)
        for i, d in enumerate(dense)]
    f, b = costs.forward_compute, costs.backward_compute
    if sharding == "optim_grads_params":
        forward = gathers[0] + max(0.0, sum(gathers[1:]) - f)
        again = gathers[:0:-1]                              # the layers, last first
        backward = again[0] + scatters[0] + max(0.0, sum(again[1:]) + sum(scatters[1:]) - b)
    else:
        forward, backward = 0.0, scatters[0] + max(0.0, sum(scatters[1:]) - b)
    assert (costs.dp_forward, costs.dp_backward) == pytest.approx((forward, backward))
    step = predict_step(MOE, where, layout, 8, 0.5)        # M = 8 / 4 = 2
    after = 0.0
    if sharding == "optim_grads":  # each domain's updated slices, one bucket: all exposed
        after = _on(net, "gather", sum(dense) + root, 4) + _on(net, "gather", 3 * ROUTED, 2)
    assert step.dp_s == pytest.approx(2 * (forward + backward) + after)


@pytest.mark.parametrize("sharding", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_moe_state_bytes_are_the_memory_model_s_experts_over_expert_dp(sharding):
    """The rank's weights, gradients and optimizer state (bf16, Adam) counted by hand, unit
    by unit (dense parts over DP 4, routed experts over expert-DP 2, each slice padded),
    equal the memory model's, which the planner's memory check calls; the planner's quick
    floor (:func:`state_bytes_floor`) stays under them, and so does :func:`memory_lower_bound`
    under :func:`layout_memory`."""
    layout = Layout(dp=4, ep=2, sharding=sharding)
    rank = memory_per_rank(MOE, ParallelConfig(4, expert_model_parallel_size=2),
                           TrainConfig(8, 2), precision="bf16", runtime=0,
                           data_parallel_sharding_strategy=sharding)[0]
    dense = [layer_parameters(MOE, 0, 1, 2)] + [layer_parameters(MOE, i, 1, 2) - ROUTED
                                                 for i in (1, 2, 3)]
    root = 128 * 256 + 64 * 256 + 2 * 256 + 128 * 256      # word, position, final LN, head
    params = root + sum(dense) + 3 * ROUTED
    mine = -(-root // 4) + sum(-(-d // 4) for d in dense) + 3 * (ROUTED // 2)
    if sharding == "optim":                                # one flat buffer per domain
        mine = -(-(root + sum(dense)) // 4) + 3 * ROUTED // 2
    expected = {"no_shard": 18 * params, "optim": 6 * params + 16 * mine,
                "optim_grads": 2 * params + 16 * mine, "optim_grads_params": 16 * mine}
    assert rank.weights + rank.gradients + rank.optimizer == expected[sharding]
    floor = state_bytes_floor(layout, *rank_parameter_counts(MOE, layout, 0))
    assert floor <= expected[sharding]
    assert memory_lower_bound(MOE, layout, 8) <= layout_memory(MOE, layout, 8)
    assert layout_memory(MOE, layout, 8) == rank.total    # the planner's check: this rank


def test_moe_models_take_zero_2_and_3_in_the_layout_check_and_the_search():
    """The layout check accepts ZeRO-2 and ZeRO-3 with routed experts, and the planner's
    search over the MoE model returns layouts of both, every one valid and fitting."""
    for sharding in ("optim_grads", "optim_grads_params"):
        check_layout(MOE, Layout(dp=4, ep=2, sharding=sharding), 8)
    found = planner.plan(MOE, cluster("a100-40gb", gpus_per_node=2), 4, 8, efficiency=0.5,
                         top=None)
    sharded = [r for r in found.layouts if r.layout.sharding.startswith("optim_grads")]
    assert {r.layout.sharding for r in sharded} == {"optim_grads", "optim_grads_params"}
    assert {r.layout.ep for r in sharded} == {1, 2, 4}
    for r in found.layouts:
        check_layout(MOE, r.layout, 8, 4)
        assert r.fits and r.memory_bytes == layout_memory(MOE, r.layout, 8)


def test_command_line_takes_the_strategy(capsys):
    argv = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "1024", "--vocab-size", "1000", "--gpu", "a100-80gb", "--gpus", "8",
            "--global-batch-size", "32", "--json", "--data-parallel-sharding-strategy",
            "optim_grads_params"]
    assert planner.main(argv) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts and {r["sharding"] for r in layouts} == {"optim_grads_params"}


def test_command_line_takes_zero_3_for_a_moe_model(capsys):
    """``python -m tutorial_lib.plan`` with ``--num-experts``, EP 2 and ZeRO-3: layouts, not a
    refusal."""
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "64", "--vocab-size", "128", "--num-experts", "8",
            "--moe-ffn-hidden-size", "128", "--gpu", "a100-40gb", "--gpus", "4",
            "--global-batch-size", "8", "--json", "--ep", "2",
            "--data-parallel-sharding-strategy", "optim_grads_params"]
    assert planner.main(argv) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts and {r["sharding"] for r in layouts} == {"optim_grads_params"}
    assert {r["ep"] for r in layouts} == {2}


def test_the_deepseek_v3_preset_is_searched_under_zero_2_and_3():
    """DeepSeek-V3 (256 routed experts, MLA) on 2048 H800 at TP 2 x PP 16: the candidates
    hold all four strategies, and the fastest ZeRO-2 and ZeRO-3 layouts the planner returns
    are valid on 2048 GPUs and fit, by the memory model."""
    model, where = MODEL_PRESETS["deepseek-v3"], cluster("h800")
    fixed = {"tp": 2, "pp": 16}
    shardings = {l.sharding for l in planner.candidate_layouts(model, 2048, 15360, fixed)}
    assert shardings == {"no_shard", "optim", "optim_grads", "optim_grads_params"}
    for sharding in ("optim_grads", "optim_grads_params"):
        found = planner.plan(model, where, 2048, 15360, fixed={**fixed, "sharding": sharding},
                             top=3).layouts
        assert len(found) == 3
        for r in found:
            assert r.layout.sharding == sharding and r.layout.ep > 1
            check_layout(model, r.layout, 15360, 2048)
            assert r.fits and r.memory_bytes == layout_memory(model, r.layout, 15360)
