"""The ZeRO stages' formulas (``costs.zero_stages``, the sharded terms of ``costs.memory_model``)
against the ZeRO paper's numbers and numbers worked out by hand.

The units of chapter 3's GPT (h = 16, 2 blocks, s = 8, V = 32): the root (word table
32 x 16, position table 8 x 16, final LayerNorm 2 x 16, output layer 32 x 16) 1184
elements, each block 3280 (LayerNorms 4 x 16, qkv 48 x 16 + 48, proj 16 x 16 + 16,
fc1 64 x 16 + 64, fc2 16 x 64 + 16).  ``tests/dist/test_fully_sharded_data_parallel.py``
checks the same functions against real traces and tensors.
"""
import pytest

from tutorial_lib import costs
from tutorial_lib.config import SHARDING_STRATEGIES, ModelConfig, ParallelConfig, TrainConfig

CONFIG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                     vocab_size=32)
UNITS = [1184, 3280, 3280]


def test_the_strategy_names_are_megatron_fsdps():
    """Megatron-LM 82a1d0eb, megatron/core/distributed/fsdp/src/megatron_fsdp/
    distributed_data_parallel_config.py, ``DistributedDataParallelConfig.
    data_parallel_sharding_strategy``: "Valid values are 'no_shard', 'optim', 'optim_grads',
    'optim_grads_params'"."""
    assert SHARDING_STRATEGIES == ("no_shard", "optim", "optim_grads", "optim_grads_params")


def test_bytes_per_parameter_match_the_zero_papers_example():
    """Rajbhandari et al. 2020, figure 1: a 7.5B-parameter model on 64 GPUs with mixed-precision
    Adam (K = 12) keeps 120 GB per GPU with plain DP, 31.4 GB with ZeRO-1 (P_os), 16.6 GB with
    ZeRO-2 (P_os+g) and 1.9 GB with ZeRO-3 (P_os+g+p)."""
    psi, nd = 7.5e9, 64
    gigabytes = [round(costs.zero_bytes_per_parameter(stage, nd) * psi / 1e9, 1)
                 for stage in range(4)]
    assert gigabytes == [120.0, 31.4, 16.6, 1.9]
    assert costs.zero_bytes_per_parameter(3, 1) == costs.zero_bytes_per_parameter(0, 1) == 16


def test_each_units_collectives_by_hand():
    """DP 4, one microbatch: ZeRO-3 gathers each unit's slice (296 or 820 floats) before its
    forward and again before its backward and reduce-scatters its padded gradients
    (4 x the slice); ZeRO-2 reduce-scatters the same and gathers once, after the step."""
    zero3 = costs.sharded_step_collectives(UNITS, 4, "optim_grads_params",
                                           unit_names=["root", "layers.0", "layers.1"])
    table = {(r.op, r.phase, r.what.split(":")[0]): (r.count, r.bytes_each) for r in zero3}
    assert table == {
        ("all_gather", "forward", "root"): (1, 296 * 4),
        ("all_gather", "backward", "root"): (1, 296 * 4),
        ("reduce_scatter", "backward", "root"): (1, 1184 * 4),
        ("all_gather", "forward", "layers.0"): (1, 820 * 4),
        ("all_gather", "backward", "layers.0"): (1, 820 * 4),
        ("reduce_scatter", "backward", "layers.0"): (1, 3280 * 4),
        ("all_gather", "forward", "layers.1"): (1, 820 * 4),
        ("all_gather", "backward", "layers.1"): (1, 820 * 4),
        ("reduce_scatter", "backward", "layers.1"): (1, 3280 * 4),
    }
    fsdp2_default = costs.sharded_step_collectives(UNITS, 4, "optim_grads_params",
                                                   reshard_after_forward=None)
    assert len(fsdp2_default) == len(zero3) - 1  # the root stays gathered between the passes
    zero2 = costs.sharded_step_collectives(UNITS, 4, "optim_grads", num_microbatches=3)
    assert [(r.op, r.phase, r.count) for r in zero2[:2]] == [
        ("reduce_scatter", "backward", 3), ("all_gather", "optimizer", 1)]


def test_a_moe_layers_routed_experts_are_a_unit_over_expert_dp():
    """Chapter 3's GPT with 2000 routed-expert parameters in its second block (``layers.1``),
    DP 4 and expert-DP 2, two microbatches, FSDP2's default resharding (the root stays
    gathered): the experts are the unit ``layers.1[expert_dp]`` right after their block's,
    sliced in two (1000 each) and reduced over group kind ``expert_dp``, as
    :mod:`tutorial_lib.fully_sharded_data_parallel` names and runs it.  Bytes each rank
    sends, by hand (ring: a gather sends (N-1) slices, a reduce-scatter (N-1)/N of the
    input): the root 2 x 3 x 296 x 4 + 2 x 3/4 x 1184 x 4 = 14,208; each block
    4 x 3 x 820 x 4 + 2 x 3/4 x 3280 x 4 = 59,040; the experts 4 x 1 x 1000 x 4 + 2 x
    1/2 x 2000 x 4 = 24,000."""
    rows = costs.sharded_step_collectives(UNITS, 4, "optim_grads_params", num_microbatches=2,
                                          reshard_after_forward=None,
                                          unit_names=["root", "layers.0", "layers.1"],
                                          expert_numels=[0, 0, 2000], expert_dp=2)
    experts = [(r.op, r.group_kind, r.phase, r.count, r.bytes_each) for r in rows
               if r.what.startswith("layers.1[expert_dp]")]
    assert experts == [("all_gather", "expert_dp", "forward", 2, 1000 * 4),
                       ("all_gather", "expert_dp", "backward", 2, 1000 * 4),
                       ("reduce_scatter", "expert_dp", "backward", 2, 2000 * 4)]
    assert rows[-3:] == [r for r in rows if r.group_kind == "expert_dp"]  # after layers.1
    sizes = {"dp": 4, "expert_dp": 2}
    assert costs.step_bytes_sent(rows, sizes) == 14_208 + 2 * 59_040 + 24_000
    # ZeRO-2 reduce-scatters the unit each microbatch and gathers it after the step; plain
    # DP and ZeRO-1 keep the experts' gradients in a buffer of their own over expert-DP
    zero2 = costs.sharded_step_collectives(UNITS, 4, "optim_grads", num_microbatches=2,
                                           expert_numels=[0, 0, 2000], expert_dp=2)
    assert [(r.op, r.count, r.bytes_each) for r in zero2 if r.group_kind == "expert_dp"] == [
        ("reduce_scatter", 2, 2000 * 4), ("all_gather", 1, 1000 * 4)]
    for strategy, expected in (("no_shard", [("all_reduce", 2000 * 4)]),
                               ("optim", [("reduce_scatter", 2000 * 4),
                                          ("all_gather", 1000 * 4)])):
        rows = costs.sharded_step_collectives(UNITS, 4, strategy, expert_numels=[0, 0, 2000],
                                              expert_dp=2)
        assert [(r.op, r.bytes_each) for r in rows if r.group_kind == "expert_dp"] == expected
    with pytest.raises(ValueError, match="needs expert_dp"):
        costs.sharded_step_collectives(UNITS, 4, "optim_grads", expert_numels=[0, 0, 2000])
    with pytest.raises(ValueError, match="one routed-expert count"):
        costs.sharded_step_collectives(UNITS, 4, "optim_grads", expert_numels=[2000], expert_dp=2)


@pytest.mark.parametrize("dp", [2, 4, 8, 16])
def test_zero3_moves_one_and_a_half_times_plain_dps_bytes(dp):
    """Rajbhandari et al. 2020, section 7.2: plain DP and ZeRO-1/2 move ``2 Psi`` per rank and
    step, ZeRO-3 ``3 Psi``; exactly so when every unit divides by DP (here), a little more
    when the slices are padded."""
    sent = {s: costs.step_bytes_sent(costs.sharded_step_collectives(UNITS, dp, s), {"dp": dp})
            for s in SHARDING_STRATEGIES}
    assert sent["no_shard"] == 2 * (dp - 1) / dp * sum(UNITS) * 4
    assert sent["optim"] == sent["optim_grads"] == sent["no_shard"]
    assert sent["optim_grads_params"] == 1.5 * sent["no_shard"]
    padded = [n + 1 for n in UNITS]
    ratio = (costs.step_bytes_sent(costs.sharded_step_collectives(padded, dp, "optim_grads_params"),
                                   {"dp": dp})
             / costs.step_bytes_sent(costs.sharded_step_collectives(padded, dp, "no_shard"),
                                     {"dp": dp}))
    assert ratio > 1.5


def test_hsdp_reduce_scatters_in_the_group_and_all_reduces_over_the_replicas():
    """HSDP, DP 8 as 2 replicas of a sharding group of 4: each unit's gradients are
    reduce-scattered over 4 ranks, the slice all-reduced over the 2 replicas; fewer bytes
    cross the replica group than a plain all-reduce moves over all 8."""
    rows = costs.sharded_step_collectives(UNITS, 8, "optim_grads_params", shard_size=4)
    replicas = [r for r in rows if r.group_kind == "dp_replicate"]
    assert [(r.op, r.bytes_each) for r in replicas] == [("all_reduce", 296 * 4),
                                                       ("all_reduce", 820 * 4),
                                                       ("all_reduce", 820 * 4)]
    sizes = {"dp": 4, "dp_replicate": 2}
    across = costs.step_bytes_sent(replicas, sizes)
    plain = costs.step_bytes_sent(costs.sharded_step_collectives(UNITS, 8, "no_shard"), {"dp": 8})
    assert across < plain
    with pytest.raises(ValueError, match="must divide the data-parallel size"):
        costs.sharded_step_collectives(UNITS, 8, "optim_grads", shard_size=3)
    with pytest.raises(ValueError, match="one of no_shard, optim"):
        costs.sharded_step_collectives(UNITS, 8, "zero3")


def test_the_peak_of_gathered_parameters_by_hand():
    """Root 10, blocks 5, 5, 5.  With prefetch and FSDP2's default (the root kept): the root
    and two blocks, 20; every unit resharded, no prefetch: the root and one block, 15;
    nothing resharded: everything stays after forward, 25."""
    assert costs.peak_unsharded_numel([10, 5, 5, 5], None, prefetch=True) == 20
    assert costs.peak_unsharded_numel([10, 5, 5, 5], True, prefetch=False) == 15
    assert costs.peak_unsharded_numel([10, 5, 5, 5], False, prefetch=True) == 25
    assert costs.peak_unsharded_numel([5, 5, 5], True, prefetch=True, root=False) == 10


def test_memory_per_rank_under_each_strategy():
    """fp32, DP 4, a slice of each unit per rank (296 + 2 x 820 = 1936 floats): ZeRO-2 keeps
    the whole weights and the slices' gradients, master and moments; ZeRO-3 no whole weight
    between steps, the root and two blocks gathered at the peak (FSDP2's default, prefetch);
    HSDP over 2 optimizer instances shards over 2 ranks instead of 4."""
    parallel, train = ParallelConfig(4), TrainConfig(8, 1)
    params = sum(UNITS)
    mine = 296 + 2 * 820

    def predict(strategy, **options):
        return costs.memory_per_rank(CONFIG, parallel, train,
                                     data_parallel_sharding_strategy=strategy, **options)[0]

    plain, zero2, zero3 = predict("no_shard"), predict("optim_grads"), predict("optim_grads_params")
    assert plain.parameters == params
    assert (plain.weights, plain.gradients, plain.optimizer) == (4 * params, 4 * params, 8 * params)
    assert (zero2.weights, zero2.gradients, zero2.optimizer) == (4 * params, 4 * mine, 12 * mine)
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (0, 4 * mine, 12 * mine)
    assert zero3.gathered == 4 * (1184 + 2 * 3280) and zero3.total > zero3.gathered
    hsdp = predict("optim_grads_params", num_distributed_optimizer_instances=2)
    assert hsdp.optimizer == 12 * (592 + 2 * 1640)
    assert predict("optim") == costs.memory_per_rank(CONFIG, parallel, train,
                                                     use_distributed_optimizer=True)[0]
    with pytest.raises(ValueError, match="must divide DP x CP"):
        predict("optim", num_distributed_optimizer_instances=3)



def test_zero2_and_zero3_slice_a_moe_layers_experts_over_expert_dp():
    """ZeRO-2 and ZeRO-3 in train_4d: a MoE layer is two units, its dense part sliced over
    DP (4 here) and its routed experts over expert-DP (EP 2 on 4 ranks: EDP 2); the root
    (embedding, final LayerNorm, head) over DP.  Both layers are MoE (first_k_dense_replace
    0).  ZeRO-3 keeps the same slices and no whole weight; at its peak (no prefetch, every
    unit but the root freed after its forward) the root and one layer, both units of it."""
    from tutorial_lib.costs.memory_model import expert_parameters, layer_parameters
    moe = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                      vocab_size=32, num_experts=4, first_k_dense_replace=0)
    parallel, train = ParallelConfig(4, expert_model_parallel_size=2), TrainConfig(8, 1)
    zero2 = costs.memory_per_rank(moe, parallel, train,
                                  data_parallel_sharding_strategy="optim_grads")[0]
    layer, experts = layer_parameters(moe, 0, 1, 2), expert_parameters(moe, 2)
    assert experts == 3 * 2 * 16 * 16  # two local experts: gate, up, down of 16 x 16
    root = 32 * 16 + 8 * 16 + 2 * 16 + 32 * 16  # word and position tables, final LN, head
    assert zero2.parameters == root + 2 * layer
    mine = -(-root // 4) + 2 * (-(-(layer - experts) // 4) + experts // 2)
    assert (zero2.weights, zero2.gradients, zero2.optimizer) == (
        4 * zero2.parameters, 4 * mine, 12 * mine)
    zero3 = costs.memory_per_rank(moe, parallel, train, prefetch=False,
                                  data_parallel_sharding_strategy="optim_grads_params")[0]
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (0, 4 * mine, 12 * mine)
    padded = lambda n, s: -(-n // s) * s  # noqa: E731 - a unit's gathered length
    assert zero3.gathered == 4 * (padded(root, 4) + padded(layer - experts, 4) + experts)


def test_the_memory_command_line_takes_the_strategy(capsys):
    """``python -m tutorial_lib.memory --data-parallel-sharding-strategy``: ZeRO-3 on the
    Llama 3.1 405B preset keeps no whole weight and a gathered peak; with
    ``--use-distributed-optimizer`` (which is ``optim``) another strategy exits 2 naming both."""
    import json

    from tutorial_lib import memory
    argv = ["--preset", "llama-3.1-405b", "--json", "--data-parallel-sharding-strategy"]
    assert memory.main(argv + ["optim_grads_params"]) == 0
    zero3 = json.loads(capsys.readouterr().out)["pipeline_ranks"][0]
    assert memory.main(argv + ["optim"]) == 0
    zero1 = json.loads(capsys.readouterr().out)["pipeline_ranks"][0]
    assert zero3["weights"] == 0 < zero3["gathered"] and zero1["gathered"] == 0
    assert zero3["optimizer"] == zero1["optimizer"] and zero3["gradients"] < zero1["gradients"]
    assert memory.main(["--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                        "optim_grads"]) == 2
    assert "give one of the two" in capsys.readouterr().err


def test_sharding_beats_tp_above_the_crossover_worked_by_hand():
    """1000 parameters, 2 blocks of h = 10, 4 ranks, TP 2 x DP 2 against ZeRO-3 on DP 4, per
    element a: ZeRO-3 sends 3 x 3/4 x 1000 = 2250 a; TP's replicas all-reduce 500 gradients
    over 2 ranks, 2 x 1/2 x 500 = 500 a, and each of the x / 2 tokens of a replica costs
    4 all-reduces x 2 blocks x h 10 x ring 2 x 1/2 = 80 a: 40 x + 500 = 2250 at x = 43.75."""
    assert costs.sharding_beats_tp_tokens(1000, 2, 10, 4, 2) == 43.75
    # its ZeRO-3 side is the library's: one unit of 1000 elements (divisible by 4), fp32
    rows = costs.sharded_step_collectives([1000], 4, "optim_grads_params")
    assert costs.step_bytes_sent(rows, {"dp": 4}) == 2250 * 4
    # TP over the whole world (DP 1): no gradient all-reduce, 3 x 7/8 Psi / (8 L h 7/8)
    assert costs.sharding_beats_tp_tokens(8000, 1, 100, 8, 8) == pytest.approx(30.0)
    for bad in ((1000, 2, 10, 4, 1), (1000, 2, 10, 6, 4)):
        with pytest.raises(ValueError, match="must be 2 or more and divide world"):
            costs.sharding_beats_tp_tokens(*bad)
