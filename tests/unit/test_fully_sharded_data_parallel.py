"""What ``fully_sharded_data_parallel`` refuses, before it builds anything (no processes: the
runs are tests/dist/test_fully_sharded_data_parallel.py)."""
import pytest
import torch

from tutorial_lib.config import ModelConfig
from tutorial_lib.fully_sharded_data_parallel import (FullyShardedDataParallel,
                                                      MixedPrecisionPolicy,
                                                      check_sharding_strategy)
from tutorial_lib.gpt import GPTModel

CONFIG = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=8,
                     vocab_size=32)


def test_an_unknown_strategy_is_named_with_the_four():
    with pytest.raises(ValueError, match="'zero3'.*no_shard, optim, optim_grads, "
                                         "optim_grads_params"):
        check_sharding_strategy("zero3")
    assert check_sharding_strategy("optim_grads") == "optim_grads"


@pytest.mark.parametrize("strategy,helper", [("no_shard", "DataParallel"),
                                             ("optim", "DistributedOptimizer")])
def test_the_stages_it_does_not_run_point_to_the_class_that_does(strategy, helper):
    model = GPTModel(CONFIG, tp_group=None)
    with pytest.raises(ValueError, match=f"{helper}.*shard_data_parallel"):
        FullyShardedDataParallel(model, model.layers, strategy)


def test_a_mixed_precision_policy_is_zero3s():
    model = GPTModel(CONFIG, tp_group=None)
    with pytest.raises(ValueError, match="model.bfloat16"):
        FullyShardedDataParallel(model, model.layers, "optim_grads",
                                 mp_policy=MixedPrecisionPolicy(torch.bfloat16))
