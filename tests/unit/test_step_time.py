"""The planner's parts against hand computations: GPUs as data, a model's FLOPs and
parameters (GQA, SwiGLU, MoE, MLA), the time of one step of a layout, its groups' links."""
import pytest

from tutorial_lib.config import ConfigError, ModelConfig
from tutorial_lib.costs.alpha_beta import AlphaBeta, predict_time
from tutorial_lib.costs.hardware import FIGURES, GPUS, cluster, figure_sources
from tutorial_lib.costs.memory_model import (attention_parameters, layer_activation_bytes,
                                             layer_parameters)
from tutorial_lib.costs.model_flops import (MODEL_PRESETS, active_parameter_count,
                                            gpt, hardware_flops_per_step,
                                            model_flops_per_step, parameter_count)
from tutorial_lib.costs.step_time import (Layout, chunk_costs, group_crosses_nodes,
                                          predict_step, schedule_times)
from tutorial_lib.pipeline_parallel.formulas import expected_bubble_time
from tests.asserts import every


def test_gpus_dense_peaks_are_half_the_sparse_datasheet_figures():
    # H100 SXM datasheet: BF16 1,979 and FP8 3,958 TFLOPS "with sparsity"
    assert GPUS["h100-sxm"].bf16_flops == pytest.approx(1979e12 / 2, rel=1e-3)
    assert GPUS["h100-sxm"].fp8_flops == pytest.approx(3958e12 / 2, rel=1e-3)
    assert GPUS["a100-80gb"].bf16_flops == 312e12 and GPUS["a100-80gb"].fp8_flops is None
    assert GPUS["h100-sxm"].nvlink_bandwidth == 900e9 / 2          # 900 GB/s both ways


def test_every_gpu_figure_is_cited_or_said_unsourced():
    for key, gpu in GPUS.items():
        cited = {c.figure for c in gpu.citations}
        unsourced = {figure for figure, _ in gpu.unsourced}
        assert cited | unsourced == set(FIGURES) and not cited & unsourced, key
        assert every(c.url.startswith("https://") and c.line and c.document
                     for c in gpu.citations), key  # each GPU has a datasheet
    # the lines say what the values are: Gb/s are bits one way, NVLink both ways together
    assert "200Gb/s" in GPUS["a100-80gb"].source("network_bandwidth").line
    assert GPUS["a100-80gb"].network_bandwidth == 200e9 / 8
    assert "400 Gb/s" in GPUS["h100-sxm"].source("network_bandwidth").line
    assert GPUS["h100-sxm"].network_bandwidth == 400e9 / 8
    assert "600 GB/s" in GPUS["a100-40gb"].source("nvlink_bandwidth").line
    assert GPUS["a100-40gb"].nvlink_bandwidth == 600e9 / 2
    assert "36 PFLOPS" in GPUS["b200"].source("bf16_flops").line   # 8 GPUs, sparse
    assert GPUS["b200"].bf16_flops == 36e15 / 8 / 2
    # the H800's operator gives its links (DeepSeek-V3, 3.2.2); no NVIDIA datasheet its peaks
    assert "160 GB/s" in GPUS["h800"].source("nvlink_bandwidth").line
    assert GPUS["h800"].nvlink_bandwidth == 160e9 and GPUS["h800"].network_bandwidth == 50e9
    assert "no NVIDIA datasheet" in GPUS["h800"].source("bf16_flops")
    rows = figure_sources()
    assert len(rows) == len(GPUS) * len(FIGURES)
    assert sum("unsourced" in r for r in rows) == sum(len(g.unsourced) for g in GPUS.values())


def test_cluster_overrides_and_refusals():
    c = cluster("h100-sxm", gpus_per_node=4, intra_node_bandwidth=100, inter_node_bandwidth=10)
    assert c.gpus_per_node == 4
    assert c.intra_node.bandwidth == pytest.approx(100e9)
    assert c.link(True).bandwidth == pytest.approx(10e9)
    with pytest.raises(ConfigError, match="unknown GPU 'v100'"):
        cluster("v100")
    with pytest.raises(ConfigError, match="--inter-node-bandwidth must be > 0"):
        cluster("h100-sxm", inter_node_bandwidth=0)
    with pytest.raises(ConfigError, match="no fp8"):
        GPUS["a100-40gb"].peak_flops("fp8")


def test_gpt_flops_are_the_megatron_papers_formulas():
    B, s, L, h, V = 3072, 2048, 128, 25600, 51200
    model = gpt(L, h, 160)
    # Narayanan et al. 2021, eq. 3 (full recomputation) and Korthikanti et al. 2022 (model FLOPs)
    assert hardware_flops_per_step(model, B, "full") == pytest.approx(
        96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-12)
    assert model_flops_per_step(model, B) == pytest.approx(
        72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)), rel=1e-12)
    # selective recomputation runs QK^T and the mix again: 4 s h per token and layer
    assert hardware_flops_per_step(model, B, "selective") - model_flops_per_step(model, B) \
        == pytest.approx(B * s * L * 4 * s * h, rel=1e-12)


def test_gqa_swiglu_parameters_by_hand():
    # h 8, 4 heads of 2, 2 key/value groups: q 8, k 4, v 4 wide; output projection 8 -> 8
    model = ModelConfig(1, 8, 4, 16, 32, ffn_hidden_size=12, num_query_groups=2, swiglu=True,
                      position_embedding_type="rope")
    assert attention_parameters(model) == (8 * 16 + 16) + 8 * 8 + 8
    mlp = (2 * 12 * 8 + 2 * 12) + 12 * 8 + 8          # gate and up (column), down (row)
    assert layer_parameters(model, 0) == 2 * 2 * 8 + attention_parameters(model) + mlp
    assert parameter_count(model) == layer_parameters(model, 0) + 2 * 32 * 8 + 2 * 8


def test_mla_and_moe_parameters_of_deepseek_v3_match_its_report():
    model = MODEL_PRESETS["deepseek-v3"]
    # the report: 671B parameters in all, 37B activated per token (its MTP module apart)
    assert parameter_count(model) / 1e9 == pytest.approx(671, rel=0.002)
    assert active_parameter_count(model) / 1e9 == pytest.approx(37, rel=0.02)
    assert parameter_count(MODEL_PRESETS["llama-3.1-405b"]) / 1e9 == pytest.approx(405, rel=0.005)


def test_memory_model_counts_the_course_model_as_before_and_swiglu_activations():
    course = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                         vocab_size=32)
    # plain multi-head attention, GELU MLP: qkv (column) with bias, proj, fc1, fc2, 2 norms
    assert layer_parameters(course, 0) == 4 * 16 + (3 * 256 + 48) + 256 + 16 \
        + (64 * 16 + 64) + 16 * 64 + 16
    gelu = ModelConfig(1, 16, 4, 8, 32)
    swiglu = ModelConfig(1, 16, 4, 8, 32, swiglu=True)
    extra = layer_activation_bytes(swiglu, 0, 1)["mlp"] - layer_activation_bytes(gelu, 0, 1)["mlp"]
    assert extra == 4 * 8 * 64                          # the up output, f wide, fp32, 8 tokens


def test_groups_cross_nodes_where_the_grid_puts_them():
    # tp-cp-ep-dp-pp, fastest first: TP 8 fills a node of 8; DP then leaves it
    crosses = group_crosses_nodes(Layout(tp=8, dp=4), 8)
    assert crosses["tp"] is False and crosses["dp_cp"] is True
    assert group_crosses_nodes(Layout(tp=16, dp=2), 8)["tp"] is True
    crosses = group_crosses_nodes(Layout(tp=2, cp=4, pp=2), 8)   # CP stride 2, 4 ranks: 8
    assert crosses["cp"] is False and crosses["pp"] is True
    assert group_crosses_nodes(Layout(tp=2, cp=4), 4)["cp"] is True


def test_one_gpu_step_is_the_model_flops_at_the_efficiency():
    """No communication, no bubble: the step is the FLOPs over peak x efficiency, and MFU
    is the efficiency itself."""
    model = gpt(4, 256, 4, seq_length=128, vocab_size=1000)
    c = cluster("a100-80gb")
    result = predict_step(model, c, Layout(micro_batch_size=2), 8, 0.5)
    assert result.step_time_s == pytest.approx(model_flops_per_step(model, 8) / (312e12 * 0.5))
    assert result.mfu == pytest.approx(0.5)
    assert result.tp_s == result.dp_s == result.pp_s == result.bubble_s == 0
    full = predict_step(model, c, Layout(micro_batch_size=2, recompute_granularity="full"), 8, 0.5)
    assert full.hardware_tflops_per_gpu == pytest.approx(result.hardware_tflops_per_gpu)
    assert full.tflops_per_gpu < result.tflops_per_gpu


def test_tp_all_reduces_by_hand():
    model = gpt(2, 64, 4, seq_length=32, vocab_size=100)
    c = cluster("h100-sxm")
    costs = chunk_costs(model, c, Layout(tp=2), 1.0)
    nvlink = AlphaBeta(c.intra_node.alpha, c.intra_node.beta)
    # two layers, two all-reduces of the activation (32 tokens x 64 x bf16) each way
    assert costs.tp == pytest.approx(2 * 4 * predict_time("all_reduce", 32 * 64 * 2, 2, nvlink))
    recomputing = chunk_costs(model, c, Layout(tp=2, recompute_granularity="full"), 1.0)
    assert recomputing.tp == pytest.approx(costs.tp * 6 / 4)
    across = chunk_costs(model, cluster("h100-sxm", gpus_per_node=1), Layout(tp=2), 1.0)
    assert across.tp > costs.tp                         # the same ring on the network


def test_bubble_closed_form_agrees_with_the_simulator_on_either_side_of_its_threshold():
    f, b = 0.3, 0.7
    for schedule, pp, m, v in (("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                               ("1f1b", 8, 200, 1)):
        busy, bubble = schedule_times(schedule, pp, m, v, f, b)
        assert busy == pytest.approx(m * v * (f + b))
        assert bubble == pytest.approx(expected_bubble_time(schedule, pp, f, b), rel=1e-9)


def test_layout_rules_name_the_rule():
    model = gpt(6, 64, 4, seq_length=32, vocab_size=100)
    c = cluster("h100-sxm")
    with pytest.raises(ConfigError, match="rule 9"):
        predict_step(model, c, Layout(pp=4), 8, 0.5)
    with pytest.raises(ConfigError, match="rule tp"):
        predict_step(model, c, Layout(tp=3), 8, 0.5)
    with pytest.raises(ConfigError, match="sharding"):
        predict_step(model, c, Layout(sharding="zero_4"), 8, 0.5)


def test_tp_roofline_by_hand_bound_on_the_network_not_on_nvlink():
    from tutorial_lib.costs.rooflines import rooflines

    L, h, s, V, tp = 4, 4096, 256, 1000, 8
    model = gpt(L, h, 32, seq_length=s, vocab_size=V)
    where, efficiency = cluster("h100-sxm"), 0.5
    (tp_line,) = rooflines(model, where, Layout(tp=tp), 1, efficiency)
    # per rank: three passes of L (24 h^2 + 4 s h) + 2 h V per token, over TP; sent: four
    # all-reduces a layer of the s h activation in bf16, 2 (TP - 1) / TP of it each
    flops = 3 * s * (L * (24 * h * h + 4 * s * h) + 2 * h * V) / tp
    sent = L * 4 * 2 * (tp - 1) / tp * s * h * 2
    assert tp_line.intensity == pytest.approx(flops / sent)
    assert tp_line.ridge_nvlink == pytest.approx(1979e12 / 2 * efficiency / 450e9)
    assert tp_line.ridge_network == pytest.approx(1979e12 / 2 * efficiency / 50e9)
    assert not tp_line.bound_on_nvlink and tp_line.bound_on_network
