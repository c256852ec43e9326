"""Uneven first and last pipeline stages, as Megatron-Core splits a decoder, and the
planner's use of them for models whose layers few pipeline sizes divide (Llama 3 405B's
126, DeepSeek-V3's 61).

Upstream: NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553,
``megatron/core/transformer/transformer_config.py`` (``TransformerConfig.__post_init__``,
"Uneven PP": each count > 0 and divisible by the virtual pipeline size, the layers left
divisible by the middle ranks, each middle rank's share by the virtual pipeline size,
middle layers and middle ranks both present or both absent) and
``megatron/core/transformer/transformer_block.py`` (``get_num_layers_to_build``: the
first / last rank builds its count over all its virtual stages, each chunk an equal
share; ``--decoder-first-pipeline-num-layers`` and ``--decoder-last-pipeline-num-layers``
set the two counts).
"""
import pytest

from tutorial_lib import plan as planner
from tutorial_lib.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from tutorial_lib.config import layers_per_pipeline_stage as split
from tutorial_lib.costs.hardware import cluster
from tutorial_lib.costs.memory_model import layer_parameters, memory_per_rank
from tutorial_lib.costs.model_flops import MODEL_PRESETS, gpt, layer_flops
from tutorial_lib.costs.step_time import (Layout, check_layout, chunk_costs, layout_memory,
                                          rank_layers, rank_parameter_counts, rank_parameters,
                                          uneven_split)


def test_equal_stages_without_the_counts_and_rule_9_otherwise():
    assert split(8, 4) == [2, 2, 2, 2]
    assert split(8, 2, 2) == [2, 2, 2, 2]
    with pytest.raises(ConfigError, match="rule 9"):
        split(126, 16)


def test_first_and_last_counts_as_megatron_builds_them():
    # Llama 3 405B on 16 ranks: one layer fewer on the first and the last
    assert split(126, 16, 1, 7, 7) == [7] + [8] * 14 + [7]
    # with V = 2 each rank's count is cut into two chunks; stage v PP + r is chunk v of rank r
    assert split(28, 4, 2, 4, 4) == [2, 5, 5, 2, 2, 5, 5, 2]
    # only the first given: the last rank is a middle rank
    assert split(10, 3, 1, 2) == [2, 4, 4]
    assert split(10, 2, 1, None, 3) == [7, 3]


@pytest.mark.parametrize("args, words", [
    ((28, 4, 2, 3, 4), "must divide by the virtual pipeline size"),   # 3 % V
    ((10, 4, 1, 1, 2), "must divide equally over 2 middle ranks"),    # 7 over 2
    ((10, 2, 1, 3, 3), "4 layers are left for 0 middle"),             # both given, PP 2
    ((10, 4, 1, 0, 2), "must be a whole number >= 1"),
    ((10, 1, 1, 5, None), "need PP >= 2"),
    ((26, 4, 2, 2, 2), "over 2 middle ranks x 2 chunks"),             # 11 a rank, V 2
])
def test_bad_uneven_splits_name_the_rule(args, words):
    with pytest.raises(ConfigError, match="uneven pipeline") as err:
        split(*args)
    assert words in str(err.value)


def test_uneven_split_is_the_most_even_megatron_accepts():
    assert uneven_split(126, 16) == (7, 7)       # Llama 3's balance
    assert uneven_split(61, 16) == (2, 3)        # DeepSeek-V3's 61: middle ranks 4 each
    assert uneven_split(61, 8) == (6, 7)
    assert uneven_split(10, 2) == (5, 5)
    assert uneven_split(5, 4, 2) is None         # middle ranks take 4 of 5: 1 is left
    assert uneven_split(7, 1) is None
    for layers, pp, v in ((126, 16, 1), (61, 16, 1), (61, 8, 1), (62, 4, 2), (127, 6, 3)):
        found = uneven_split(layers, pp, v)
        if found:
            counts = split(layers, pp, v, *found)
            assert sum(counts) == layers and max(counts) - min(counts) <= v * 2


def test_a_middle_rank_heavier_than_the_last_sets_the_chunk_cost_by_hand():
    # 7 layers on PP 3: 2, 3, 2; a tiny vocabulary, so the middle rank's third layer
    # outweighs the head on the last rank
    model = gpt(7, 64, 4, seq_length=32, vocab_size=16)
    layout = Layout(pp=3, num_layers_in_first_pipeline_stage=2,
                    num_layers_in_last_pipeline_stage=2)
    with pytest.raises(ConfigError, match="--decoder-first-pipeline-num-layers 2 "
                                          "--decoder-last-pipeline-num-layers 2"):
        check_layout(model, Layout(pp=3), 6)
    check_layout(model, layout, 6)
    assert rank_layers(model, layout, 0) == ([0, 1], False)
    assert rank_layers(model, layout, 1) == ([2, 3, 4], False)
    assert rank_layers(model, layout, 2) == ([5, 6], True)
    where, efficiency = cluster("h100-sxm"), 0.5
    costs = chunk_costs(model, where, layout, efficiency)
    per_token = sum(layer_flops(model, 0).values())
    rate = 1979e12 / 2 * efficiency
    assert 3 * per_token > 2 * per_token + 2 * 64 * 16
    assert costs.forward_compute == pytest.approx(32 * 3 * per_token / rate, rel=1e-12)
    assert costs.layers == 3
    # parameters: rank 0 the embedding, rank 2 the head, rank 1 the third layer
    layer = layer_parameters(model, 0)
    assert rank_parameter_counts(model, layout, 0) == (2 * layer + 16 * 64, 0)
    assert rank_parameter_counts(model, layout, 1) == (3 * layer, 0)
    assert rank_parameter_counts(model, layout, 2) == (2 * layer + 16 * 64, 0)
    assert rank_parameters(model, layout) == (3 * layer, 0)


def test_memory_model_counts_each_stage_its_own_layers():
    model = ModelConfig(num_layers=7, hidden_size=16, num_attention_heads=4, seq_length=8,
                        vocab_size=32)
    parallel = ParallelConfig(3, pipeline_model_parallel_size=3)
    ranks = memory_per_rank(model, parallel, TrainConfig(6, 6), stage_layers=[2, 3, 2])
    layer = layer_parameters(model, 0)
    assert ranks[1].parameters == 3 * layer
    assert ranks[0].parameters == 2 * layer + 32 * 16 + 8 * 16      # word and position tables
    assert ranks[2].parameters == 2 * layer + 2 * 16 + 32 * 16      # final LayerNorm, head
    with pytest.raises(ValueError, match="adding up to the 7 layers"):
        memory_per_rank(model, parallel, TrainConfig(6, 6), stage_layers=[2, 2, 2])


def test_planner_splits_llama_405b_on_16_pipeline_ranks_as_meta_did():
    model = MODEL_PRESETS["llama-3.1-405b"]
    found = planner.plan(model, cluster("h100-sxm"), 16384, 2048,
                         fixed={"tp": 8, "pp": 16, "schedule": "1f1b", "micro_batch_size": 1,
                                "cp": 1},
                         top=1)
    best = found.layouts[0].layout
    assert (best.num_layers_in_first_pipeline_stage,
            best.num_layers_in_last_pipeline_stage) == (7, 7)
    assert found.layouts[0].fits
    assert found.layouts[0].memory_bytes == layout_memory(model, best, 2048)
    assert "first / last rank 7 / 7" in best.describe()
