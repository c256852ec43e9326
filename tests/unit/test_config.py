"""Every rule of the checklist, and malformed input, with the message it gives."""
import pytest

from tutorial_lib.config import (ConfigError, ModelConfig, ParallelConfig, TrainConfig,
                                 check_grid, validate)


def pc(world, tp=1, pp=1, ep=1, cp=1, etp=1):
    return ParallelConfig(world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, context_parallel_size=cp,
                          expert_tensor_parallel_size=etp)


def expect(rule, *fragments, **kwargs):
    with pytest.raises(ConfigError) as info:
        validate(**kwargs)
    assert info.value.rule == rule, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return str(info.value)


def test_a_valid_4d_layout_passes_and_derives_dp():
    config = pc(16, tp=2, pp=2, ep=1)
    validate(config, ModelConfig(num_experts=4), TrainConfig(global_batch_size=8, num_microbatches=2))
    assert config.data_parallel_size == 4
    assert pc(16, pp=2, ep=4).expert_data_parallel_size == 2


@pytest.mark.parametrize("field,value,fragment", [
    ("world_size", 0, "world_size must be at least 1, got 0"),
    ("tensor_model_parallel_size", -2, "tensor_model_parallel_size must be at least 1, got -2"),
    ("pipeline_model_parallel_size", 2.5, "must be a whole number, got 2.5"),
    ("expert_model_parallel_size", 2.0, "write 2 instead of 2.0"),
    ("context_parallel_size", "2", "must be a whole number, got '2'"),
    ("expert_tensor_parallel_size", True, "must be a whole number, got True"),
])
def test_malformed_sizes(field, value, fragment):
    config = pc(8)
    setattr(config, field, value)
    expect("malformed", fragment, parallel=config)


def test_rule1_world_not_divisible_names_numbers_and_fix():
    message = expect("rule 1", "world_size (6)", "TP * CP * PP = 4", "4 or 8",
                     parallel=pc(6, tp=2, pp=2), layout="megatron")
    assert "dense grid" in message
    # In the single-grid layouts EP counts too.
    expect("rule 1", "TP * CP * EP * PP = 8", parallel=pc(12, tp=2, pp=2, ep=2), layout="course")
    # Megatron folds EP into DP: 12 = 2 (TP) * 2 (PP) * 3 (DP) is a valid dense grid, but the
    # expert grid (ETP * EP * PP = 8) must also divide 12.
    expect("rule 1", "ETP * EP * PP = 8", "expert grid", parallel=pc(12, tp=2, pp=2, ep=4))


def test_rule2_tutorial_guard_explains_itself():
    message = expect("rule 2", "tensor_model_parallel_size (2)", "expert_model_parallel_size (2)",
                     parallel=pc(8, tp=2, ep=2))
    assert "Megatron combines them" in message and "set one of them to 1" in message


def test_rule3_microbatches():
    expect("rule 3", "num_microbatches must be a whole number >= 1, got 0",
           parallel=pc(4), train=TrainConfig(global_batch_size=8, num_microbatches=0))
    expect("rule 3", "global_batch_size (6)", "data-parallel size (4)", "4 or 8",
           parallel=pc(4), train=TrainConfig(global_batch_size=6, num_microbatches=1))
    expect("rule 3", "8 / 2 = 4 sequences", "num_microbatches (3)", "[1, 2, 4]",
           parallel=pc(4, tp=2), train=TrainConfig(global_batch_size=8, num_microbatches=3))


def test_rule4_experts_divide_over_ep():
    expect("rule 4", "num_experts (6)", "expert_model_parallel_size (4)", "4 or 8 experts",
           parallel=pc(8, ep=4), model=ModelConfig(num_experts=6))


def test_rule5_expert_tensor_parallel():
    expect("rule 5", "expert_tensor_parallel_size must be 1", "got 2",
           parallel=pc(8, tp=2, etp=2), layout="course")


def test_rule6_sequence_parallel_needs_divisible_sequence():
    expect("rule 6", "seq_length (15)", "tensor_model_parallel_size (2)", "14 or 16",
           parallel=pc(4, tp=2), model=ModelConfig(seq_length=15, sequence_parallel=True))
    # Without sequence parallelism the same sequence is fine.
    validate(pc(4, tp=2), ModelConfig(seq_length=15, sequence_parallel=False))


def test_rule7_dropout_with_model_parallelism():
    expect("rule 7", "dropout (0.1)", "set dropout=0.0",
           parallel=pc(4, ep=2), model=ModelConfig(dropout=0.1, num_experts=4))
    validate(pc(4), ModelConfig(dropout=0.1))  # pure data parallel may use dropout


def test_rule8_heads_divide_over_tp():
    expect("rule 8", "num_attention_heads (6)", "tensor_model_parallel_size (4)",
           parallel=pc(4, tp=4), model=ModelConfig(num_attention_heads=6))


def test_topk_cannot_exceed_experts():
    expect("malformed", "moe_router_topk (4) cannot exceed num_experts (2)",
           parallel=pc(2), model=ModelConfig(num_experts=2, moe_router_topk=4))


def test_unknown_layout():
    with pytest.raises(ConfigError, match="unknown layout 'zigzag'"):
        check_grid(pc(4), layout="zigzag")


def test_single_grid_layouts_only_split_experts_along_tp():
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel_size \(2\) must be 1 or equal"):
        check_grid(pc(16, tp=4, etp=2), layout="visualizer")
    check_grid(pc(16, tp=4, etp=2), layout="megatron")  # an independent expert grid may


def test_custom_layout_is_one_grid():
    # one grid in a given order (python -m tutorial_lib.grid --order ...): EP is a dimension
    expect("rule 1", "TP * CP * EP * PP = 8", "'custom' layout",
           parallel=pc(12, tp=2, pp=2, ep=2), layout="custom")
    check_grid(pc(16, tp=2, pp=2, ep=2), layout="custom")
