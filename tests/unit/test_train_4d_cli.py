"""The command line of ``examples/train_4d.py``, built from the config dataclasses' field docstrings.

Parsing and validation only: nothing here starts a process (the runs are in
tests/dist/test_pipeline_training.py, the command line's refusals as a user meets them in
tests/dist/test_train_4d_validation.py).
"""
import argparse
import json
import pickle
import re
from dataclasses import astuple, dataclass, field, fields, replace

import pytest
import torch

from tutorial_lib import costs
from tutorial_lib.arguments import args_from_dict, check_memory, describe_run, validate_args
from tutorial_lib.config import (ConfigError, ModelConfig, ParallelConfig, TrainConfig, add_arguments,
                                 field_docs)
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.train_4d import CONFIG_FIELDS, RUN_DEFAULTS, TrainingArgs, pipeline_tensor_shape
from tests.asserts import every


#: The command line's defaults before it was built from the dataclasses: they must not move.
DEFAULTS = dict(world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=1,
                num_microbatches=4, global_batch_size=16, seq_length=16, num_layers=4,
                hidden_size=32, num_attention_heads=4, vocab_size=64, num_experts=4,
                moe_router_topk=2, first_k_dense_replace=1, num_shared_experts=1, dropout=0.0,
                steps=5, seed=1234, lr=3e-3, clip_grad=1.0, schedule="1f1b", p2p_mode="batched",
                precision_recipe="fp32", timeout=600.0, save=None, save_interval=None, load=None,
                ckpt_step=None, use_distributed_optimizer=False,
                data_parallel_sharding_strategy=None,  # Megatron-FSDP's flag: not set
                keep_last=None, async_save=False, max_restarts=0,  # a cluster's faults: off
                context_parallel_size=1, cp_comm_type="p2p",  # chapter 9: CP, off by default
                sequence_parallel=False,  # Megatron's --sequence-parallel: off by default
                expert_tensor_parallel_size=None,  # TP x EP: unset means TP, as Megatron
                recompute_granularity=None, recompute_method=None,  # chapter 10: no recomputation
                recompute_num_layers=None,
                device="auto")  # the GPUs when every rank has one


def test_every_config_field_has_a_docstring():
    for cls in (ParallelConfig, ModelConfig, TrainConfig):
        docs = field_docs(cls)
        assert list(docs) == [f.name for f in fields(cls)], cls
        assert every(doc.strip() for doc in docs.values()), cls
    assert field_docs(ModelConfig)["dropout"].startswith("Dropout probability")


def test_training_args_keeps_its_fields_and_defaults():
    assert {f.name: f.default for f in fields(TrainingArgs)} == DEFAULTS
    assert TrainingArgs() == TrainingArgs(**DEFAULTS)


def test_the_config_fields_are_the_dataclasses_own_not_copies():
    docs = field_docs(TrainingArgs)
    for cls, names in CONFIG_FIELDS.items():
        own = {f.name: f for f in fields(cls)}
        for name in names:
            mine = next(f for f in fields(TrainingArgs) if f.name == name)
            assert mine.metadata["config"] is cls
            assert docs[name] == field_docs(cls)[name]  # one docstring, on the dataclass
            if name not in RUN_DEFAULTS:
                assert mine.default == own[name].default
    # the run's own fields are documented in TrainingArgs
    assert docs["steps"].startswith("Optimizer steps: the run logs iterations 1 to ``steps``")
    taken = {name for names in CONFIG_FIELDS.values() for name in names}
    assert taken.isdisjoint(f.name for f in fields(TrainingArgs) if "config" not in f.metadata)


def test_configs_builds_the_three_dataclasses_from_the_flat_fields():
    args = TrainingArgs(world_size=8, tensor_model_parallel_size=2, num_layers=8, num_microbatches=2,
                        dropout=0.0, num_experts=0)
    parallel, model, train = args.configs()
    assert parallel == ParallelConfig(8, tensor_model_parallel_size=2)
    assert model == ModelConfig(num_layers=8, num_experts=0, hidden_size=32, seq_length=16)
    assert train == TrainConfig(global_batch_size=16, num_microbatches=2)


def test_training_args_stays_a_flat_dataclass():
    args = replace(TrainingArgs(), world_size=4, pipeline_model_parallel_size=2, steps=2)
    assert (args.world_size, args.pipeline_model_parallel_size, args.steps) == (4, 2, 2)
    assert len(astuple(args)) == len(DEFAULTS)
    assert pickle.loads(pickle.dumps(args)) == args  # the launcher sends it to the workers


def test_help_prints_each_default_once(train_4d_script, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = train_4d_script.build_parser().format_help()
    assert "default: None" not in text and "(default 1)" not in text
    # one block per option: its first line starts with "  --"
    blocks = re.split(r"\n(?=  --)", text)
    for f in fields(TrainingArgs):
        flag = "--" + f.name.replace("_", "-")
        block = next(b for b in blocks if any(b.startswith(f"  {flag}{end}") for end in " \n,"))
        help_text = " ".join(block.split())
        assert help_text.count("(default") == 1, block
        shown = "not set" if f.default is None else f.default
        assert f"(default: {shown})" in help_text, block
    assert "Dropout probability; must be 0 with TP or EP > 1 (rule 7)." in " ".join(text.split())


def test_fixed_sets_are_choices(train_4d_script, capsys):
    parser = train_4d_script.build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--schedule", "zigzag"])
    assert exit_.value.code == 2
    assert "invalid choice: 'zigzag'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--p2p-mode", "telepathy"])
    assert "{fp32,bf16,deepseek_v3,FILE}" in parser.format_help()
    # a recipe file is not one of the names: the validator, not argparse, judges it
    args, _ = train_4d_script.parse_args(["--precision-recipe", "my_recipe.toml"])
    assert args.precision_recipe == "my_recipe.toml"


def test_no_flags_give_the_default_args(train_4d_script):
    args, as_json = train_4d_script.parse_args([])
    assert args == TrainingArgs() and as_json is False


def test_flags_parse_to_their_field_types(train_4d_script):
    args, as_json = train_4d_script.parse_args(["--world-size", "8", "--tensor-model-parallel-size", "2",
                                       "--dropout", "0.1", "--lr", "1e-3", "--schedule", "gpipe",
                                       "--json"])
    assert args == TrainingArgs(world_size=8, tensor_model_parallel_size=2, dropout=0.1, lr=1e-3,
                                schedule="gpipe")
    assert as_json is True


def test_a_config_file_is_read_and_flags_given_win(train_4d_script, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"world-size": 4, "pipeline_model_parallel_size": 2,
                                                   "steps": 3}))
    (tmp_path / "run.toml").write_text("world_size = 4\npipeline-model-parallel-size = 2\nsteps = 3\n")
    for name in ("run.json", "run.toml"):
        args, _ = train_4d_script.parse_args(["--config", str(tmp_path / name)])
        assert (args.world_size, args.pipeline_model_parallel_size, args.steps) == (4, 2, 3)
        # a flag beats the file even when it names the default value
        args, _ = train_4d_script.parse_args(["--config", str(tmp_path / name), "--steps", "5",
                                     "--num-layers", "8"])
        assert (args.world_size, args.steps, args.num_layers) == (4, 5, 8)


def test_an_unknown_key_in_the_config_file_is_refused(train_4d_script, tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"num-layer": 4}))
    with pytest.raises(ConfigError, match="unknown training options"):
        train_4d_script.parse_args(["--config", str(tmp_path / "bad.json")])


def test_add_arguments_reads_types_docstrings_and_defaults():
    @dataclass
    class Options:
        size: int
        """How many; 100% required."""
        width: int | None = None
        """Optional width."""
        fast: bool = False
        """Go fast."""
        mode: str = field(default="a", metadata={"choices": ("a", "b")})
        """One of two."""

    parser = argparse.ArgumentParser()
    add_arguments(parser, Options)
    assert vars(parser.parse_args(["--size", "3"])) == {"size": 3}  # defaults stay out
    given = parser.parse_args(["--size", "3", "--width", "7", "--fast", "--mode", "b"])
    assert (given.size, given.width, given.fast, given.mode) == (3, 7, True, "b")
    assert parser.parse_args(["--size", "1", "--no-fast"]).fast is False
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a field without a default is required
    text = " ".join(parser.format_help().split())
    assert "How many; 100% required." in text
    assert "Optional width. (default: not set)" in text and "Go fast. (default: False)" in text
    assert text.count("(default") == 3


# --- every bad value refused before any worker starts ---------------------------------

def test_the_expert_tensor_parallel_flag_defaults_to_tp_and_checks_the_expert_width(train_4d_script):
    """TP and EP together: ``--expert-tensor-parallel-size`` is Megatron-LM's flag, and left unset it
    becomes TP (Megatron-Core 0.20.0, d98e8a64, ``megatron/training/arguments.py``,
    ``validate_args``: ``if args.expert_tensor_parallel_size is None: ... =
    args.tensor_model_parallel_size``); 1 and 2 both run with TP 2 x EP 2, and an expert
    width that does not split over the ETP ranks is refused (rule 5) before any worker starts."""
    layout = ["--world-size", "4", "--tensor-model-parallel-size", "2",
              "--expert-model-parallel-size", "2", "--seq-length", "8"]
    args, _ = train_4d_script.parse_args(layout)
    assert TrainingArgs().expert_tensor_parallel_size is None
    assert args.configs()[0].expert_tensor_parallel_size == 2  # unset: TP
    validate_args(args)
    args, _ = train_4d_script.parse_args(layout + ["--expert-tensor-parallel-size", "1"])
    assert args.configs()[0].expert_tensor_parallel_size == 1
    validate_args(args)
    args, _ = train_4d_script.parse_args(["--world-size", "8", "--tensor-model-parallel-size", "4",
                                 "--expert-model-parallel-size", "2", "--seq-length", "8",
                                 "--hidden-size", "30", "--num-attention-heads", "2"])
    with pytest.raises(ConfigError) as info:
        validate_args(args)
    assert info.value.rule == "rule 5" and "expert_tensor_parallel_size (4)" in str(info.value)


BAD_RUN_VALUES = [  # (changes, rule, fragments of the message: the rule, the value, the fix)
    (dict(world_size=2, tensor_model_parallel_size=2, vocab_size=63), "rule 10", ["vocab_size (63)", "62 or 64"]),
    (dict(hidden_size=30), "rule 11", ["hidden_size (30)", "28 or 32"]),
    (dict(num_shared_experts=-1), "malformed", ["num_shared_experts must be >= 0, got -1"]),
    (dict(first_k_dense_replace=-1), "malformed", ["first_k_dense_replace must be >= 0, got -1"]),
    (dict(seed=2**70), "malformed", [f"got {2**70}", "e.g. --seed 1234"]),
    (dict(seed=0), "malformed", ["seed must be from 1 to 4294967295", "got 0"]),
    (dict(lr=-1.0), "malformed", ["lr must be a finite number >= 0, got -1.0", "e.g. --lr 3e-3"]),
    (dict(lr=float("nan")), "malformed", ["got nan"]),
    (dict(lr=float("inf")), "malformed", ["got inf"]),
    (dict(clip_grad=-1.0), "malformed", ["clip_grad must be a finite number >= 0, got -1.0", "0 turns clipping off"]),
    (dict(clip_grad=float("nan")), "malformed", ["clip_grad", "got nan"]),
    (dict(timeout=0.0), "malformed", ["timeout must be a finite number > 0, got 0.0", "--timeout 600"]),
    (dict(timeout=-5.0), "malformed", ["got -5.0"]),
    (dict(timeout=float("inf")), "malformed", ["timeout", "got inf"]),
    (dict(timeout=float("nan")), "malformed", ["timeout", "got nan"]),
    (dict(lr="fast"), "malformed", ["lr must be a number, got 'fast' (str)"]),
    (dict(steps=2.0), "malformed", ["steps must be a whole number, got 2.0", "write 2 instead of 2.0"]),
    (dict(world_size=2, tensor_model_parallel_size=2, seq_length=15), "rule 6", ["seq_length (15)"]),
    (dict(hidden_size=2**16, num_layers=64), "memory", ["pipeline rank 0 (1 rank, each", "Fix:"]),
    (dict(data_parallel_sharding_strategy="optim_grads_params", schedule="zbv", world_size=2,
          pipeline_model_parallel_size=2, num_layers=4), "sharding strategy",
     ["optim_grads_params does not run with --schedule zbv", "in W, a later pass",
      "use --schedule 1f1b", "--data-parallel-sharding-strategy optim_grads"]),
    (dict(data_parallel_sharding_strategy="optim_grads_params", recompute_granularity="selective"),
     "sharding strategy", ["optim_grads_params does not run with --recompute-granularity selective",
                           "frees its weights after it", "drop the recomputation"]),
    (dict(data_parallel_sharding_strategy="optim_grads", schedule="dualpipe", world_size=2,
          pipeline_model_parallel_size=2, num_layers=4), "sharding strategy",
     ["optim_grads does not run with --schedule dualpipe", "sum_model_copy_gradients",
      "use --schedule dualpipev"]),
    (dict(data_parallel_sharding_strategy="no_shard", use_distributed_optimizer=True),
     "sharding strategy", ["--data-parallel-sharding-strategy is no_shard",
                           "give one of the two"]),
]


@pytest.mark.parametrize("changes,rule,fragments", BAD_RUN_VALUES, ids=lambda v: str(v)[:40])
def test_validate_args_refuses_every_bad_value_with_the_rule_the_value_and_a_fix(changes, rule, fragments):
    """Hardening: these used to start workers and fail 15-67 s later with a worker traceback,
    or train silently (``lr`` nan / inf trained to NaN and exited 0; ``clip_grad`` -1 or nan
    turned clipping off).  The rules and their upstream sources: the seed as Megatron-LM's
    ``_set_random_seed`` (megatron/training/initialize.py: a seed <= 0 raises, and numpy's
    seeds end at 2**32 - 1); the learning rate as ``OptimizerParamScheduler`` (megatron/core/
    optimizer_param_scheduler.py asserts 0 <= min_lr <= max_lr); clipping: Megatron-Core
    clips only when ``clip_grad > 0`` (megatron/core/optimizer/optimizer.py), so the course
    asks for 0 to say "off"; the timeout as the course's launcher (finite, > 0); the memory
    as ``report_theoretical_memory`` estimates it (megatron/training/theoretical_memory_usage.py)
    -- all Megatron-Core 0.20.0, d98e8a64.  The model's rules: tests/unit/test_config.py."""
    with pytest.raises(ConfigError) as info:
        validate_args(replace(TrainingArgs(), **changes))
    assert info.value.rule == rule, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


P2P_PAIR_LAYOUT = dict(world_size=4, num_layers=8, num_microbatches=4, global_batch_size=16)


@pytest.mark.parametrize("changes,rule,fragments", [
    (dict(pipeline_model_parallel_size=4, p2p_mode="sequential"), "p2p mode",
     ["p2p_mode 'sequential'", "not a mode Megatron has", "--p2p-mode batched"]),
    (dict(pipeline_model_parallel_size=2, schedule="interleaved", p2p_mode="sequential"),
     "p2p mode", ["teaching construct"]),
    (dict(pipeline_model_parallel_size=2, schedule="interleaved", p2p_mode="batched"),
     "interleaved schedule", ["needs pipeline_model_parallel_size > 2, got 2",
                              "--p2p-mode overlapped"]),
], ids=["1f1b-sequential", "interleaved-sequential", "interleaved-batched-pp2"])
def test_validate_args_refuses_the_p2p_mode_pairs_megatron_does_not_run(changes, rule, fragments):
    """Chapter 7's (schedule, P2P mode) table, through the run's validator.  Megatron-Core
    0.20.0 (d98e8a64): its P2P layer posts every op before waiting, batched or not
    (megatron/core/pipeline_parallel/p2p_communication.py, ``_communicate`` choosing
    ``_batched_p2p_ops`` or ``_p2p_ops``), so the blocking mode is no Megatron mode; and
    megatron/training/arguments.py ``validate_args`` asserts PP > 2 for the interleaved
    schedule with ``overlap_p2p_comm`` off.  An earlier version accepted both."""
    with pytest.raises(ConfigError) as info:
        validate_args(replace(TrainingArgs(**P2P_PAIR_LAYOUT), **changes))
    assert info.value.rule == rule, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("changes", [
    dict(pipeline_model_parallel_size=4, p2p_mode="batched"),
    dict(pipeline_model_parallel_size=4, p2p_mode="overlapped"),
    dict(pipeline_model_parallel_size=2, schedule="interleaved", p2p_mode="overlapped"),
    dict(pipeline_model_parallel_size=4, schedule="interleaved", p2p_mode="batched"),
], ids=["1f1b-batched", "1f1b-overlapped", "interleaved-overlapped-pp2", "interleaved-batched-pp4"])
def test_validate_args_takes_the_p2p_mode_pairs_megatron_runs(changes):
    validate_args(replace(TrainingArgs(**P2P_PAIR_LAYOUT), **changes))


def test_the_p2p_mode_flag_offers_megatrons_two_modes(train_4d_script, capsys):
    parser = train_4d_script.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--p2p-mode", "sequential"])
    assert "invalid choice: 'sequential'" in capsys.readouterr().err
    assert "{batched,overlapped}" in parser.format_help()


def test_validate_args_takes_the_limits_themselves():
    for changes in (dict(seed=1), dict(seed=2**32 - 1), dict(lr=0.0), dict(clip_grad=0.0), dict(timeout=0.5),
                    dict(num_shared_experts=0, first_k_dense_replace=0), dict(lr=1)):
        validate_args(replace(TrainingArgs(), **changes))
    with pytest.raises(ConfigError, match="validate_args takes a TrainingArgs, got None"):
        validate_args(None)


@pytest.mark.parametrize("name,content,fragment", [
    ("list.json", b"[1, 2]", "holds an array ([1, 2]), not an object of options"),
    ("string.json", b'"fast"', "holds a string (\"fast\"), not an object of options"),
    ("empty.json", b"", "is empty"),
    ("blank.toml", b"  \n", "is empty"),
    ("run.yaml", b"lr: 0.1\n", "is YAML, which train_4d does not read"),
    ("run.json", b"lr: 0.1\n", "is not valid JSON (Expecting value at line 1 column 1)"),
    ("run.toml", b"lr = = 1\n", "is not valid TOML"),
    ("binary.json", bytes(range(128, 256)), "is not text"),
    ("fast.json", b'{"lr": "fast"}', "fast.json: lr must be a number, got 'fast' (str)"),
    ("fast.toml", b'lr = "fast"\n', "fast.toml: lr must be a number, got 'fast' (str)"),
    ("float.json", b'{"world_size": 4.0}', "world_size must be a whole number, got 4.0 (float); write 4"),
])
def test_a_config_file_that_is_not_an_object_of_options_is_named_and_refused(train_4d_script, tmp_path, name,
                                                                          content, fragment):
    """Hardening: a JSON list or string gave an AttributeError traceback; an empty, YAML or
    binary file said "Expecting value: line 1 column 1" without naming the file; ``"lr":
    "fast"`` reached the optimizer.  (Megatron-LM's ``--yaml-cfg`` likewise reads one mapping
    of options, megatron/training/yaml_arguments.py, Megatron-Core 0.20.0.)"""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        train_4d_script.parse_args(["--config", str(path)])
    assert str(path) in str(info.value) and fragment in str(info.value), str(info.value)
    assert train_4d_script.main(["--config", str(path)]) == 2  # refused before a worker could start


def test_a_missing_config_file_is_named(train_4d_script, tmp_path, capsys):
    assert train_4d_script.main(["--config", str(tmp_path / "nope.json")]) == 2
    assert f"cannot read the config file '{tmp_path / 'nope.json'}': No such file" in capsys.readouterr().err


def test_args_from_dict_names_its_source():
    with pytest.raises(ConfigError, match=r"^\[malformed\] run.json: unknown training options \['num_layer'\]"):
        args_from_dict({"num-layer": 4}, source="run.json")
    with pytest.raises(ConfigError, match="run.json: dropout must be a number, got None"):
        args_from_dict({"dropout": None}, source="run.json")


# --- the memory estimate ------------------------------------------------------------------


MODELS = [ModelConfig(num_experts=4), ModelConfig(num_experts=0, ffn_hidden_size=40),
          ModelConfig(num_layers=6, num_experts=6, moe_ffn_hidden_size=12, num_shared_experts=2,
                      first_k_dense_replace=0, hidden_size=24, num_attention_heads=3, vocab_size=50,
                      seq_length=10),
          ModelConfig(num_experts=2, first_k_dense_replace=3)]


@pytest.mark.parametrize("model", MODELS, ids=range(len(MODELS)))
def test_the_estimate_counts_the_parameters_each_pipeline_stage_builds(model):
    """``costs.memory_per_rank`` counts a rank's parameters from the shapes alone; here against
    ``DeepSeekModel`` built for every stage of PP 1, 2 and (interleaved) 2 x V 2 (serial: TP =
    EP = 1; the TP and EP splits: tests/dist/test_train_4d_validation.py)."""
    for pp, v in ((1, 1), (2, 1), (2, 2)):
        if model.num_layers % (pp * v):
            continue
        estimate = costs.memory_per_rank(model, ParallelConfig(pp, pipeline_model_parallel_size=pp),
                                         TrainConfig(8, 2), "interleaved" if v > 1 else "1f1b", v)
        for rank in range(pp):
            built = sum(p.numel() for c in range(v)
                        for p in DeepSeekModel(model, stage=c * pp + rank, num_stages=pp * v).parameters())
            assert estimate[rank].parameters == built, (pp, v, rank)
            assert estimate[rank].weights == 4 * built and estimate[rank].optimizer == 8 * built


def test_the_estimate_counts_one_gradient_and_the_schedules_microbatches():
    model, train = ModelConfig(num_experts=4), TrainConfig(16, 4)
    alone = costs.memory_per_rank(model, ParallelConfig(1), train)[0]
    replicas = costs.memory_per_rank(model, ParallelConfig(2), TrainConfig(16, 4))[0]  # DP 2
    # one gradient per parameter: .grad alone, or DataParallel's bucket (.grad a view of it)
    assert alone.gradients == alone.weights and replicas.gradients == replicas.weights
    gpipe = costs.memory_per_rank(model, ParallelConfig(4, pipeline_model_parallel_size=4), train, "gpipe")
    one_f_one_b = costs.memory_per_rank(model, ParallelConfig(4, pipeline_model_parallel_size=4), train)
    assert [r.chunk_microbatches for r in gpipe] == [4, 4, 4, 4]
    assert [r.chunk_microbatches for r in one_f_one_b] == [4, 3, 2, 1]  # min(PP - rank, M)
    assert gpipe[1].activations == 4 * one_f_one_b[1].activations / 3
    assert costs.memory_on_this_machine(one_f_one_b) == sum(r.total for r in one_f_one_b)
    assert costs.memory_on_this_machine(one_f_one_b, local_ranks=2) == 2 * max(r.total for r in one_f_one_b)


def test_check_memory_refuses_with_a_per_rank_breakdown():
    args = TrainingArgs(world_size=4, pipeline_model_parallel_size=4)
    estimate = check_memory(args, available=2**40)
    need = costs.memory_on_this_machine(estimate)
    with pytest.raises(ConfigError) as info:
        check_memory(args, available=need - 1)
    message = str(info.value)
    assert info.value.rule == "memory" and f"about {costs.format_bytes(need)}" in message
    assert message.count("pipeline rank ") == 4 and "optimizer" in message and "activations" in message
    # a world whose processes alone cannot fit is refused without adding up every rank
    huge = TrainingArgs(world_size=10**6, pipeline_model_parallel_size=10**6, num_layers=10**6)
    with pytest.raises(ConfigError, match=r"(?s)the worker processes alone.*pipeline rank 999999"):
        check_memory(huge, available=2**40)


# --- what a run prints -----------------------------------------------------------


def test_help_lists_the_choices_of_every_fixed_set(train_4d_script, monkeypatch):
    """Found reading the book: ``--help`` listed no choices.  argparse shows them as ``{a,b,c}`` beside the
    flag and refuses any other value (Megatron-LM's ``megatron/training/arguments.py`` gives
    its fixed sets ``choices=`` the same way, Megatron-Core 0.20.0, d98e8a64)."""
    monkeypatch.setenv("COLUMNS", "100")
    text = train_4d_script.build_parser().format_help()
    with_choices = [f for f in fields(TrainingArgs) if "choices" in f.metadata]
    assert {f.name for f in with_choices} == {"schedule", "p2p_mode", "cp_comm_type",
                                              "device",  # --device
                                              "recompute_granularity", "recompute_method",
                                              "data_parallel_sharding_strategy"}
    for f in with_choices:
        flag = "--" + f.name.replace("_", "-")
        assert f"{flag} {{{','.join(f.metadata['choices'])}}}" in text, flag
    assert "--precision-recipe {fp32,bf16,deepseek_v3,FILE}" in text
    # --json says what each key of a record is, MaxVio and the balance loss included
    flat = "".join(text.split())  # argparse wraps lines at spaces and hyphens
    for key in ("iteration", "loss", "sequence_balance_loss", "max_violation", "grad_norm"):
        assert f"{key}:" in flat, key
    assert "[MaxVio](loadofthebusiestexpert-meanload)/meanload" in flat
    assert "[seq-balance]DeepSeek-V3'scomplementarysequence-wisebalanceloss" in flat


def test_the_banner_names_layout_schedule_p2p_mode_and_recipe():
    args = TrainingArgs(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        schedule="gpipe", p2p_mode="overlapped", precision_recipe="bf16")
    lines = describe_run(args).splitlines()
    assert every(line.startswith("train_4d: ") for line in lines)
    text = "\n".join(lines)
    assert ("layout      TP2 x PP2 x EP1 x DP2 = 8 ranks (experts: ETP2 x EP1 x EDP2); "
            "Megatron's rank order tp-cp-ep-dp-pp") in text
    assert "schedule    gpipe, M = 4 microbatches per replica" in text
    assert "P2P mode    overlapped" in text and "recipe      bf16" in text
    assert "iterations  1 to 5" in text
    assert "MaxVio" in text and "seq-balance" in text  # a MoE model: the legend
    dense = describe_run(replace(args, num_experts=0))
    assert "experts" not in dense and "MaxVio" not in dense
    assert "TP2 (sequence parallel) x PP2" in describe_run(replace(args, sequence_parallel=True))
    assert "sequence parallel" not in text
    assert "MaxVio" not in describe_run(args, legend=False)
    interleaved = describe_run(replace(args, schedule="interleaved", world_size=4,
                                       tensor_model_parallel_size=1, save="ck",
                                       save_interval=2))
    assert "V = 2 chunks per rank" in interleaved
    assert "iterations  1 to 5; saves to ck every 2 and after the last" in interleaved


def test_progress_lines_number_iterations_like_the_json_records():
    """Found reading the book: "step 1/5" in text, ``"step": 0`` in --json; both now say iteration 1."""
    from tutorial_lib.train_4d import format_progress
    record = {"iteration": 1, "loss": 3.5, "sequence_balance_loss": 3e-4, "max_violation": 0.25,
              "grad_norm": 0.5, "tokens_per_s": 1000.0}
    assert format_progress(record, 5).startswith("iteration 1/5  loss 3.5000  seq-balance ")
    assert "MaxVio 0.250" in format_progress(record, 5)


class _FakeRun:
    def __init__(self, records):
        self.results = [records]


def test_json_stdout_holds_json_lines_only_and_the_banner_goes_to_stderr(train_4d_script, monkeypatch,
                                                                         capsys):
    records = [{"iteration": i, "loss": 4.0 - i, "tokens_per_s": 1.0} for i in (1, 2)]

    def fake_train(args, progress=False, progress_file=None, **kwargs):
        if progress:  # as the workers print them
            from tutorial_lib.train_4d import format_progress
            for record in records:
                print(format_progress(record, args.steps))
        return _FakeRun(records)
    monkeypatch.setattr("tutorial_lib.train_4d.train", fake_train)
    assert train_4d_script.main(["--steps", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["iteration"] for line in out.splitlines()] == [1, 2]
    assert err.startswith("train_4d: layout ") and "recipe      fp32" in err
    assert "MaxVio" not in err  # the keys are explained in --help
    assert train_4d_script.main(["--steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("train_4d: layout ") and "MaxVio      (load" in out
    assert out.index("P2P mode") < out.index("iteration 1/2") and err == ""


def test_a_missing_recipe_file_says_file_not_found(train_4d_script, tmp_path, capsys):
    """Found reading the book: ``--precision-recipe my.json`` for a file that is not there said "unknown
    precision_recipe", as if it were a misspelt name."""
    missing = tmp_path / "my_recipe.json"
    with pytest.raises(ConfigError, match="file not found") as error:
        validate_args(TrainingArgs(precision_recipe=str(missing)))
    assert str(missing) in str(error.value) and error.value.rule == "precision recipe"
    for value in ("recipes/v3.toml", str(tmp_path / "sub" / "recipe")):
        with pytest.raises(ConfigError, match="file not found"):
            validate_args(TrainingArgs(precision_recipe=value))
    with pytest.raises(ConfigError, match="unknown precision_recipe 'fp16'"):
        validate_args(TrainingArgs(precision_recipe="fp16"))  # a name, not a file
    assert train_4d_script.main(["--precision-recipe", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "precision_recipe file not found" in err and "train_4d: layout" not in err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_device_cuda_without_a_gpu_per_rank_exits_2_before_any_worker_starts(train_4d_script, capsys):
    """``--device cuda`` where the ranks cannot each have a GPU is refused with
    the rule and a fix, exit status 2, and no process started (this directory's conftest
    fails any test that starts one)."""
    assert train_4d_script.main(["--world-size", "2", "--pipeline-model-parallel-size", "2",
                        "--steps", "1", "--device", "cuda"]) == 2
    error = capsys.readouterr().err
    assert "one GPU per rank" in error and "train_4d.py: error:" in error
    assert "--device cpu" in error


#: Chapter 11's layouts: 8 layers so that a V of PP 4 has 8 stages.
SPLIT_LAYOUT = dict(num_layers=8, global_batch_size=16)


@pytest.mark.parametrize("changes,rule,fragments", [
    (dict(world_size=3, pipeline_model_parallel_size=3, num_microbatches=6, num_layers=6,
          global_batch_size=6, schedule="dualpipe"),
     "dualpipe schedule", ["even pipeline_model_parallel_size", "got PP = 3 and M = 6",
                           "--pipeline-model-parallel-size 4 --num-microbatches 8"]),
    (dict(world_size=2, pipeline_model_parallel_size=2, num_microbatches=5, schedule="dualpipe",
          global_batch_size=10), "dualpipe schedule", ["M = 5", "--num-microbatches 6"]),
    (dict(world_size=4, pipeline_model_parallel_size=4, num_microbatches=4, schedule="dualpipe"),
     "dualpipe schedule", ["at least 2 x PP", "M = 4", "--num-microbatches 8"]),
    (dict(world_size=4, pipeline_model_parallel_size=4, num_microbatches=4, schedule="dualpipev"),
     "dualpipev schedule", ["num_microbatches >= 2 x PP, got M = 4 with PP = 4",
                            "--num-microbatches 8"]),
    (dict(schedule="zbv"), "zbv schedule", ["pipeline_model_parallel_size >= 2, got 1"]),
    (dict(world_size=2, pipeline_model_parallel_size=2, num_microbatches=4, schedule="dualpipe",
          save="ckpt"), "dualpipe schedule", ["two copies of every weight", "--schedule dualpipev"]),
    (dict(world_size=4, pipeline_model_parallel_size=4, num_microbatches=4, num_layers=4,
          schedule="zbv"), "rule 9", ["8"]),
], ids=["dualpipe-odd-pp", "dualpipe-odd-m", "dualpipe-few-m", "dualpipev-few-m", "zbv-pp1",
        "dualpipe-save", "zbv-layers"])
def test_validate_args_refuses_what_the_split_backward_schedules_cannot_run(changes, rule, fragments):
    """Chapter 11's schedules: ``--schedule zb-h1 | zbv | dualpipev | dualpipe`` with the layouts their
    schedules refuse, before any worker starts.  DeepSeek's rules (deepseek-ai/DualPipe,
    3da1bbea): ``DualPipe.step`` (dualpipe/dualpipe.py) asserts an even number of
    microbatches, at least twice the ranks, and its ranks pair up as ``r`` and
    ``PP - 1 - r`` (an even PP); ``DualPipeV.step`` (dualpipe/dualpipev.py) asserts at
    least twice the ranks.  A V of ``PP`` ranks has ``2 PP`` stages, so the layers divide
    by ``2 PP`` (rule 9)."""
    with pytest.raises(ConfigError) as info:
        validate_args(replace(TrainingArgs(**SPLIT_LAYOUT), **changes))
    assert info.value.rule == rule, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev", "dualpipe"])
def test_the_split_backward_schedules_are_accepted_on_the_tested_layouts(schedule):
    args = TrainingArgs(**SPLIT_LAYOUT, world_size=8, pipeline_model_parallel_size=4,
                        num_microbatches=8, expert_model_parallel_size=2, num_experts=4)
    validate_args(replace(args, schedule=schedule))
    assert args.chunks_per_rank == 1
    assert replace(args, schedule=schedule).chunks_per_rank == (1 if schedule == "zb-h1" else 2)


def _died(rank=1, exitcode=-9):
    from tutorial_lib.launch import WorkerError, describe_exit
    return WorkerError(rank, f"process {describe_exit(exitcode)} before returning a result",
                       "(no Python traceback)", exitcode=exitcode)


@pytest.mark.parametrize("max_restarts", [0, 2])
def test_a_dead_worker_restarts_the_world_at_most_max_restarts_times(train_4d_script, monkeypatch, capsys,
                                                                    max_restarts):
    """The command line's restart loop with a ``train`` whose worker always dies (the real
    restarts: tests/dist/test_train_4d_faults.py): ``max_restarts`` restarts, each said on
    stderr, then exit 1 naming the rank, its signal and how to resume; a worker that raised
    is a bug, never restarted."""
    from tutorial_lib.launch import WorkerError
    calls = []

    def dies(args, **kwargs):
        calls.append(args)
        raise _died()
    monkeypatch.setattr("tutorial_lib.train_4d.train", dies)
    assert train_4d_script.main(["--steps", "2", "--max-restarts", str(max_restarts)]) == 1
    err = capsys.readouterr().err
    assert len(calls) == 1 + max_restarts
    restarts = [line for line in err.splitlines() if "; restart " in line]
    assert restarts == [f"train_4d.py: rank 1: process was killed by signal SIGKILL (exit code "
                        f"-9) before returning a result; restart {i} of {max_restarts}, from the "
                        f"start (no checkpoint committed yet)" for i in range(1, max_restarts + 1)]
    assert "train_4d.py: the run failed:\nrank 1 failed: process was killed by signal SIGKILL" in err
    assert err.rstrip().endswith("train_4d.py: no checkpoint saved (--save DIR --save-interval N "
                                 "keeps one)")

    def raises(args, **kwargs):
        calls.append(args)
        raise WorkerError(0, "ValueError: a bug", "Traceback ...")
    calls.clear()
    monkeypatch.setattr("tutorial_lib.train_4d.train", raises)
    assert train_4d_script.main(["--steps", "2", "--max-restarts", "2"]) == 1
    assert len(calls) == 1


def test_max_restarts_under_torchrun_belongs_to_torchrun(train_4d_script, monkeypatch, capsys):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "localhost")):
        monkeypatch.setenv(name, value)
    assert train_4d_script.main(["--max-restarts", "2"]) == 2
    assert "under torchrun give it to torchrun: torchrun --max-restarts 2" in capsys.readouterr().err


def test_sequence_parallelism_is_a_flag_off_by_default_as_megatrons():
    """Megatron-LM d98e8a64: ``--sequence-parallel`` (``ModelParallelConfig.sequence_parallel``,
    ``megatron/core/model_parallel_config.py``, default False); ``validate_args``
    (``megatron/training/arguments.py``) turns it off at TP 1, and the model does the same."""
    assert TrainingArgs().sequence_parallel is False
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainingArgs)  # the command line's flags, from the fields
    parsed = parser.parse_args(["--world-size", "2", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"])
    args = TrainingArgs(**vars(parsed))
    assert args == TrainingArgs(world_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    validate_args(args)
    _, model_config, _ = replace(args, world_size=1, tensor_model_parallel_size=1).configs()
    serial = DeepSeekModel(model_config, seed=3)  # TP 1: nothing to split
    assert serial.sequence_parallel is False
    assert not any(getattr(p, "sequence_parallel", False) for p in serial.parameters())


def test_the_pipeline_messages_are_split_over_tp_under_sequence_parallelism():
    """Megatron-Core d98e8a64 (``megatron/core/pipeline_parallel/schedules.py``,
    ``get_tensor_shapes``): ``seq_length // cp``, then ``// tp`` with ``sequence_parallel``."""
    args = TrainingArgs(world_size=8, tensor_model_parallel_size=2, context_parallel_size=2,
                        seq_length=16, hidden_size=32)
    assert pipeline_tensor_shape(args, 3) == (8, 3, 32)
    assert pipeline_tensor_shape(replace(args, sequence_parallel=True), 3) == (4, 3, 32)
    assert pipeline_tensor_shape(replace(args, context_parallel_size=1, sequence_parallel=True),
                                 5) == (8, 5, 32)


def test_the_sharding_strategy_flag_takes_megatron_fsdps_names(train_4d_script, capsys):
    """``--data-parallel-sharding-strategy``, Megatron-FSDP's flag (Megatron-LM 82a1d0eb,
    megatron/core/distributed/fsdp/src/megatron_fsdp/distributed_data_parallel_config.py,
    ``data_parallel_sharding_strategy``): ``optim`` is ZeRO-1, the distributed optimizer
    ``--use-distributed-optimizer`` turns on; ``no_shard`` plain data parallelism; an unknown
    name is refused by the parser with the four choices."""
    for flags, zero1 in (([], False), (["--use-distributed-optimizer"], True),
                         (["--data-parallel-sharding-strategy", "optim"], True),
                         (["--data-parallel-sharding-strategy", "optim",
                           "--use-distributed-optimizer"], True),
                         (["--data-parallel-sharding-strategy", "no_shard"], False),
                         (["--data-parallel-sharding-strategy", "optim_grads"], False),
                         (["--data-parallel-sharding-strategy", "optim_grads_params"], False)):
        args, _ = train_4d_script.parse_args(["--world-size", "2", *flags])
        validate_args(args)
        assert args.distributed_optimizer is zero1, flags
        assert ("ZeRO-1" in describe_run(args)) is zero1, flags
        for stage, name in ((2, "optim_grads"), (3, "optim_grads_params")):
            assert (f"ZeRO-{stage}" in describe_run(args)) is (name in flags), flags
    with pytest.raises(SystemExit) as exit_:
        train_4d_script.parse_args(["--data-parallel-sharding-strategy", "zero3"])
    assert exit_.value.code == 2
    assert "'no_shard', 'optim', 'optim_grads', 'optim_grads_params'" in capsys.readouterr().err
