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
    ("expert_tensor_parallel_size", True, "must be a whole number or None, got True"),
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


def test_rule2_is_lifted_tp_and_ep_together_pass_with_whole_experts():
    """TP and EP together: the course's guard (old rule 2: TP > 1 with EP > 1 refused) is gone.

    Megatron-Core 0.20.0 (d98e8a64) builds the dense grid (tp-cp-dp-pp) and the expert grid
    (etp-ep-edp-pp) over the same ranks and only asks that each divide the world
    (``megatron/core/parallel_state.py``, ``initialize_model_parallel``); its all-to-all
    dispatcher takes its EP group from the expert grid (``MoEAlltoAllTokenDispatcher.__init__``
    and ``token_dispatch`` in ``megatron/core/transformer/moe/token_dispatcher.py``) and gathers
    over the expert-TP group only when that has more than one rank (``dispatch_postprocess``).
    The course trains both: ETP = 1 (whole experts) and ETP = TP (split experts)."""
    model = ModelConfig(num_experts=4, seq_length=16, sequence_parallel=False)
    train = TrainConfig(global_batch_size=8, num_microbatches=2)
    for config in (pc(4, tp=2, ep=2), pc(8, tp=2, ep=2, pp=2), pc(8, tp=2, ep=4),
                   pc(8, tp=4, ep=2), pc(8, tp=2, ep=2, cp=2), pc(4, tp=2, ep=2, etp=2),
                   pc(8, tp=2, ep=2, pp=2, etp=2), pc(8, tp=2, ep=4, etp=2)):
        assert validate(config, model, train) is None, config
    # the expert grid must still divide the world (rule 1): 6 = TP 2 x DP 3, ETP 1 x EP 4 = 4
    expect("rule 1", "ETP * EP * PP = 4", "expert grid", parallel=pc(6, tp=2, ep=4))


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


def test_rule4_expert_parallelism_needs_routed_experts():
    """Megatron-LM 0.20.0 (d98e8a64, ``megatron/training/arguments.py``, ``validate_args``,
    the expert-parallelism check) refuses expert_model_parallel_size > 1 without
    ``num_experts``; a dense model with EP 1 passes."""
    expect("rule 4", "expert_model_parallel_size (2)", "dense (num_experts 0)",
           "expert_model_parallel_size 1", parallel=pc(4, ep=2), model=ModelConfig(num_experts=0))
    validate(pc(4, tp=2), ModelConfig(num_experts=0))


def test_rule5_each_expert_width_divides_over_etp():
    """TP and EP together: rule 5 is no longer "ETP must be 1" but what splitting an expert needs: its
    width (``moe_ffn_hidden_size``, default ``hidden_size``) divides over the ETP ranks.
    Megatron-Core 0.20.0 (d98e8a64, ``megatron/core/transformer/moe/experts.py``,
    ``TEGroupedMLP.__init__`` / ``SequentialMLP``: ``linear_fc1`` column-parallel and
    ``linear_fc2`` row-parallel over ``pg_collection.expt_tp``) divides the width by the
    expert-TP size the same way (``megatron/core/utils.py`` ``divide`` asserts it)."""
    moe = dict(num_experts=4, hidden_size=32, num_attention_heads=4)
    message = expect("rule 5", "moe_ffn_hidden_size 6", "expert_tensor_parallel_size (4)",
                     "one of [1, 2, 3]", "moe_ffn_hidden_size 4 or 8",
                     parallel=pc(4, tp=4, etp=4), model=ModelConfig(moe_ffn_hidden_size=6, **moe))
    assert "not implemented" not in message
    expect("rule 5", "moe_ffn_hidden_size 30, from hidden_size", "(4)",
           parallel=pc(8, tp=4, ep=2, etp=4),
           model=ModelConfig(num_experts=4, hidden_size=30, num_attention_heads=2))
    # the same width splits over 2 ranks; a dense model has no expert to split
    validate(pc(4, tp=2, ep=2, etp=2), ModelConfig(moe_ffn_hidden_size=6, **moe))
    validate(pc(4, tp=4, etp=4), ModelConfig(moe_ffn_hidden_size=6, num_experts=0))


def test_etp_defaults_to_tp_as_megatron():
    """Megatron-LM 0.20.0 (d98e8a64, ``megatron/training/arguments.py``, ``validate_args``)
    sets an unset ``expert_tensor_parallel_size`` to ``tensor_model_parallel_size``, and so
    does :class:`ParallelConfig`; 1 given keeps experts whole."""
    config = ParallelConfig(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert config.expert_tensor_parallel_size == 2 and config.expert_data_parallel_size == 2
    assert pc(8, tp=2, ep=2, etp=1).expert_data_parallel_size == 4


def test_rule6_sequence_parallel_needs_divisible_sequence():
    expect("rule 6", "seq_length (15)", "tensor_model_parallel_size (2)", "14 or 16",
           parallel=pc(4, tp=2), model=ModelConfig(seq_length=15, sequence_parallel=True))
    # Without sequence parallelism the same sequence is fine.
    validate(pc(4, tp=2), ModelConfig(seq_length=15, sequence_parallel=False))
    # under CP each CP rank's tokens split over TP: 12 / 2 = 6 does not divide by 4
    expect("rule 6", "each CP rank's 12 / 2 = 6 tokens", "tensor_model_parallel_size (4)",
           "8 or 16", parallel=ParallelConfig(8, tensor_model_parallel_size=4, context_parallel_size=2),
           model=ModelConfig(seq_length=12, sequence_parallel=True, num_experts=0))


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


# --- every bad value is a ConfigError ------------------------------------------------


@pytest.mark.parametrize("call,fragment", [
    (lambda: validate(None), "parallel must be a ParallelConfig, got None"),
    (lambda: validate(ModelConfig(), ParallelConfig(2)), "the arguments look swapped"),
    (lambda: validate(ParallelConfig(2), TrainConfig()), "model must be a ModelConfig or None, got a TrainConfig"),
    (lambda: validate(ParallelConfig(2), None, ModelConfig()), "train must be a TrainConfig or None"),
    (lambda: validate(ParallelConfig("8")), "world_size must be a whole number, got '8' (str)"),
    (lambda: validate(ParallelConfig(8.0)), "write 8 instead of 8.0"),
    (lambda: validate(ParallelConfig(2), ModelConfig(dropout="0.1")), "dropout must be a number, got '0.1'"),
    (lambda: validate(ParallelConfig(2), ModelConfig(num_shared_experts="1")), "num_shared_experts must be a whole number"),
    (lambda: validate(ParallelConfig(2), ModelConfig(ffn_hidden_size="64")), "ffn_hidden_size must be a whole number or None"),
    (lambda: validate(ParallelConfig(2), ModelConfig(sequence_parallel="yes")), "sequence_parallel must be true or false"),
    (lambda: validate(ParallelConfig(2), ModelConfig(num_layers=True)), "num_layers must be a whole number, got True"),
    (lambda: validate(ParallelConfig(2), layout=3), "layout must be a string"),
    (lambda: check_grid(None), "config must be a ParallelConfig, got None"),
])
def test_the_validator_api_answers_bad_arguments_with_config_errors(call, fragment):
    """Hardening: ``validate(None)``, swapped arguments and a string where a number belongs
    raised a raw AttributeError / TypeError.  No upstream counterpart (Megatron-Core's
    dataclasses fail with raw errors too, e.g. ``TransformerConfig.__post_init__`` compares
    whatever it is given); the course's rule is CONTRIBUTING's: a ConfigError naming the
    rule, the value and a fix."""
    with pytest.raises(ConfigError) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def test_rule10_the_vocabulary_divides_over_tp():
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by *
    tensor_model_parallel_size`` (NVIDIA/Megatron-LM, megatron/training/vocab_utils.py,
    ``_calculate_padded_vocab_size_cached``, Megatron-Core 0.20.0, d98e8a64) because the
    vocab-parallel embedding and LM head give each TP rank the same number of rows.  The
    course does not pad, so it refuses and names the padded size.  (63 with TP 2 used to
    fail in a worker, 15-67 s in.)"""
    expect("rule 10", "vocab_size (63)", "tensor_model_parallel_size (2)", "62 or 64",
           parallel=pc(2, tp=2), model=ModelConfig(vocab_size=63))
    validate(pc(2, tp=2), ModelConfig(vocab_size=62))
    validate(pc(1), ModelConfig(vocab_size=63))  # serial: any vocabulary


def test_rule11_heads_divide_the_hidden_size():
    """Megatron-LM's ``validate_args`` (megatron/training/arguments.py, Megatron-Core 0.20.0,
    d98e8a64) asserts ``hidden_size % num_attention_heads == 0`` when ``kv_channels`` is not
    given, and sets ``kv_channels = hidden_size // num_attention_heads``."""
    expect("rule 11", "hidden_size (30)", "num_attention_heads (4)", "28 or 32",
           parallel=pc(1), model=ModelConfig(hidden_size=30))
    # rule 8 (heads over TP) keeps its place before it: the chapters break rule 8 this way
    expect("rule 8", parallel=pc(4, tp=4), model=ModelConfig(num_attention_heads=6))


@pytest.mark.parametrize("name,fix", [("num_shared_experts", "0 means no shared expert"),
                                      ("first_k_dense_replace", "0 means every layer is an MoE layer")])
def test_negative_moe_counts_are_refused(name, fix):
    """Megatron-Core 0.20.0 (d98e8a64): ``TransformerConfig.__post_init__`` refuses a shared
    expert size <= 0 (``moe_shared_expert_intermediate_size`` is ``num_shared_experts`` times
    the expert width, or None for none), and ``gpt_layer_specs.py`` takes DeepSeek's
    ``first_k_dense_replace`` as a ``moe_layer_freq`` list of 0 / 1 whose length must be
    ``num_layers``: a count of leading dense layers is >= 0.  -1 used to build silently or
    fail in a worker."""
    expect("malformed", f"{name} must be >= 0, got -1", fix,
           parallel=pc(1), model=ModelConfig(num_experts=4, **{name: -1}))


def test_rule6_moe_layers_under_tp_need_a_divisible_sequence():
    """Megatron-Core 0.20.0 (d98e8a64, megatron/core/transformer/moe/moe_layer.py,
    ``MoELayer.forward``) refuses to train MoE with TP > 1 without sequence parallelism, whose
    split (``tensor_parallel/mappings.py``, ``_split_along_first_dim``) asserts the sequence
    divides by TP.  The course's MoE layers always split the sequence under TP, so a model
    with an MoE layer needs ``seq_length % TP == 0`` even with ``sequence_parallel=False``."""
    expect("rule 6", "seq_length (15)", "in a model with MoE layers",
           parallel=pc(2, tp=2), model=ModelConfig(seq_length=15, num_experts=4))
    # no MoE layer (dense, or every layer below first_k_dense_replace): no split
    validate(pc(2, tp=2), ModelConfig(seq_length=15, num_experts=4, first_k_dense_replace=4))
    validate(pc(2, tp=2), ModelConfig(seq_length=15))


def test_divisor_hints_do_not_scan_huge_numbers():
    """A rule 1 or rule 3 message listed every divisor by trial division up to n: a world of
    10**12 + 1 never answered.  Now divisors are listed up to 10**12 (by trial division up to
    the square root) and named in words above it."""
    small = expect("rule 1", "one of [1, 2, 3, 4, 6]", parallel=pc(12, tp=8))
    assert "world_size (12)" in small
    huge = expect("rule 1", "a divisor of 1000000000001", parallel=pc(10**12 + 1, tp=3))
    assert "999999999999 or 1000000000002" in huge
    expect("rule 1", "a divisor of 10000000000000000000000000000", parallel=pc(10**28, tp=3))
    expect("rule 3", "make num_microbatches a divisor of 1649267441664",
           parallel=pc(2), train=TrainConfig(global_batch_size=3 * 2**40, num_microbatches=2**41))


@pytest.mark.parametrize("name,value", [("swiglu", True), ("num_query_groups", 2),
                                        ("multi_latent_attention", True),
                                        ("position_embedding_type", "rope")])
def test_shapes_only_the_cost_models_count_are_refused_in_a_run(name, value):
    """One ``ModelConfig`` describes both the course's model and the published ones the
    planner counts; a field the course's layers do not build is refused before a run, not
    ignored by it."""
    expect("model", f"{name} ({value!r}) is counted by the cost models only", "leave it at",
           parallel=pc(1), model=ModelConfig(**{name: value}))


def test_a_counted_config_takes_published_shapes_and_megatrons_uneven_stages():
    """``validate(..., cost_model=True)``, the memory model's presets: the fields only the
    cost models count are accepted; the first and last pipeline ranks' own layer counts
    replace rule 9's equal stages, and the layers left must still divide over the middle
    ranks (Megatron's uneven split)."""
    model = ModelConfig(num_layers=7, swiglu=True, num_query_groups=2)
    uneven = {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 1}
    assert validate(pc(4, pp=4), model, cost_model=True, **uneven) is None  # 2, 2, 2, 1
    expect("rule 9", "num_layers (7) must be divisible", parallel=pc(4, pp=4), model=model,
           cost_model=True)
    expect("uneven pipeline", "the 3 layers left must divide equally over 2 middle ranks",
           parallel=pc(4, pp=4), model=model, cost_model=True,
           num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    expect("model", "num_query_groups (2) is counted by the cost models only",
           parallel=pc(4, pp=4), model=model, **uneven)


def test_a_model_config_is_a_value():
    """Frozen and hashable: the FLOP counts cache per model, so a model cannot change
    under them."""
    model = ModelConfig(num_layers=2)
    assert hash(model) == hash(ModelConfig(num_layers=2)) and model != ModelConfig()
    with pytest.raises(AttributeError):
        model.num_layers = 4
