"""ZeRO-2 and ZeRO-3 (Megatron-FSDP's ``optim_grads`` and ``optim_grads_params``) in the
planner: their exposed communication by hand, their memory the memory model's, the
command line's ``--data-parallel-sharding-strategy``."""
import json

import pytest

from tutorial_lib import plan as planner
from tutorial_lib.config import ConfigError, ModelConfig
from tutorial_lib.costs.alpha_beta import AlphaBeta
from tutorial_lib.costs.hardware import cluster
from tutorial_lib.costs.memory_model import layer_parameters
from tutorial_lib.costs.model_flops import gpt
from tutorial_lib.costs.step_time import (Layout, check_layout, chunk_costs, layout_memory,
                                          memory_lower_bound, predict_step, sharded_exposure)

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


def test_routed_experts_refuse_zero_2_and_3():
    model = ModelConfig(4, 256, 4, 64, 128, num_experts=8, moe_router_topk=2,
                        moe_ffn_hidden_size=128, num_shared_experts=0,
                        first_k_dense_replace=0)
    with pytest.raises(ConfigError, match=r"\[sharding\].*8 routed experts: use optim"):
        check_layout(model, Layout(dp=4, sharding="optim_grads"), 8)
    check_layout(model, Layout(dp=4, ep=4, sharding="optim"), 8)


def test_command_line_takes_the_strategy(capsys):
    argv = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "1024", "--vocab-size", "1000", "--gpu", "a100-80gb", "--gpus", "8",
            "--global-batch-size", "32", "--json", "--data-parallel-sharding-strategy",
            "optim_grads_params"]
    assert planner.main(argv) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts and {r["sharding"] for r in layouts} == {"optim_grads_params"}
