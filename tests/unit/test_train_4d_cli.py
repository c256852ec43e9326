"""The command line of ``examples/train_4d.py``, built from the config dataclasses' field docstrings.

Parsing only: nothing here starts a process (the runs are in tests/dist/test_pipeline_training.py).
"""
import argparse
import importlib.util
import json
import pickle
import re
from dataclasses import astuple, dataclass, field, fields, replace
from pathlib import Path

import pytest

from tutorial_lib.config import (ConfigError, ModelConfig, ParallelConfig, TrainConfig, add_arguments,
                                 field_docs)
from tutorial_lib.train_4d import CONFIG_FIELDS, RUN_DEFAULTS, TrainingArgs

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_4d.py"

#: The command line's defaults before it was built from the dataclasses: they must not move.
DEFAULTS = dict(world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=1,
                num_microbatches=4, global_batch_size=16, seq_length=16, num_layers=4,
                hidden_size=32, num_attention_heads=4, vocab_size=64, num_experts=4,
                moe_router_topk=2, first_k_dense_replace=1, num_shared_experts=1, dropout=0.0,
                steps=5, seed=1234, lr=3e-3, clip_grad=1.0, schedule="1f1b", p2p_mode="batched",
                precision_recipe="fp32", timeout=600.0, save=None, save_interval=None, load=None,
                ckpt_step=None, use_distributed_optimizer=False)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_4d_cli_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_field_has_a_docstring():
    for cls in (ParallelConfig, ModelConfig, TrainConfig):
        docs = field_docs(cls)
        assert list(docs) == [f.name for f in fields(cls)], cls
        assert all(doc.strip() for doc in docs.values()), cls
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
    assert docs["steps"] == "Optimizer steps."
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


def test_help_prints_each_default_once(script, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = script.build_parser().format_help()
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


def test_fixed_sets_are_choices(script, capsys):
    parser = script.build_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--schedule", "zigzag"])
    assert exit_.value.code == 2
    assert "invalid choice: 'zigzag'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--p2p-mode", "telepathy"])
    assert "{fp32,bf16,deepseek_v3,FILE}" in parser.format_help()
    # a recipe file is not one of the names: the validator, not argparse, judges it
    args, _ = script.parse_args(["--precision-recipe", "my_recipe.toml"])
    assert args.precision_recipe == "my_recipe.toml"


def test_no_flags_give_the_default_args(script):
    args, as_json = script.parse_args([])
    assert args == TrainingArgs() and as_json is False


def test_flags_parse_to_their_field_types(script):
    args, as_json = script.parse_args(["--world-size", "8", "--tensor-model-parallel-size", "2",
                                       "--dropout", "0.1", "--lr", "1e-3", "--schedule", "gpipe",
                                       "--json"])
    assert args == TrainingArgs(world_size=8, tensor_model_parallel_size=2, dropout=0.1, lr=1e-3,
                                schedule="gpipe")
    assert as_json is True


def test_a_config_file_is_read_and_flags_given_win(script, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"world-size": 4, "pipeline_model_parallel_size": 2,
                                                   "steps": 3}))
    (tmp_path / "run.toml").write_text("world_size = 4\npipeline-model-parallel-size = 2\nsteps = 3\n")
    for name in ("run.json", "run.toml"):
        args, _ = script.parse_args(["--config", str(tmp_path / name)])
        assert (args.world_size, args.pipeline_model_parallel_size, args.steps) == (4, 2, 3)
        # a flag beats the file even when it names the default value
        args, _ = script.parse_args(["--config", str(tmp_path / name), "--steps", "5",
                                     "--num-layers", "8"])
        assert (args.world_size, args.steps, args.num_layers) == (4, 5, 8)


def test_an_unknown_key_in_the_config_file_is_refused(script, tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"num-layer": 4}))
    with pytest.raises(ConfigError, match="unknown training options"):
        script.parse_args(["--config", str(tmp_path / "bad.json")])


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
