"""A rank's memory (chapter 10), predicted (``tutorial_lib.costs.memory_model``) and measured in a run.

The equivalence tests (``test_pipeline_training.py``) check every run they launch with
:func:`memory_checks.assert_memory_as_predicted`; this file holds one layout of its own
(PP 3 x DP 2, 1F1B; EP 2 with ZeRO-1, or EP 1 with plain Adam and recomputation), so that the check can be run alone, and
what the record carries.
"""
from dataclasses import replace

import pytest

from tutorial_lib.train_4d import TrainingArgs, train

from .launch_once import launch_once
from .memory_checks import assert_memory_as_predicted, predicted_memory
from tests.asserts import every

pytestmark = pytest.mark.dist

ARGS = TrainingArgs(world_size=6, pipeline_model_parallel_size=3, expert_model_parallel_size=2,
                    steps=2, num_layers=6, global_batch_size=24, num_microbatches=2, seq_length=8,
                    hidden_size=16, num_attention_heads=4, vocab_size=32, num_experts=4,
                    moe_router_topk=2, use_distributed_optimizer=True, timeout=120)


@launch_once
def run(zero1: bool):
    """ZeRO-1 (EP 2); or plain Adam, EP 1, with each chunk's first layer recomputed
    (``--recompute-granularity full --recompute-method block --recompute-num-layers 1``):
    without EP every byte is predicted exactly."""
    changes = ({"use_distributed_optimizer": True} if zero1 else
               {"use_distributed_optimizer": False, "expert_model_parallel_size": 1,
                "recompute_granularity": "full", "recompute_method": "block",
                "recompute_num_layers": 1})
    args = replace(ARGS, **changes)
    return args, train(args).results


@pytest.mark.parametrize("zero1", [True, False], ids=["zero1", "plain-adam-recompute"])
def test_every_rank_holds_what_the_model_predicts(zero1):
    args, results = run(zero1)
    assert_memory_as_predicted(args, results)


def test_the_last_stage_holds_the_least_activations():
    (_, sharded), (_, plain) = run(True), run(False)
    peaks = [r[-1]["memory"]["peak_activations"] for r in sharded]
    # ranks 4, 5 are pipeline rank 2: 1F1B holds min(PP - rank, M) = 2, 2, 1 microbatches
    assert max(peaks[4:]) < min(peaks[:4]), peaks
    # Adam's two fp32 moments per parameter, the weights fp32: optimizer = 2 x weights
    assert every(r[-1]["memory"]["optimizer"] == 2 * r[-1]["memory"]["weights"] for r in plain)
    expected = predicted_memory(replace(ARGS, use_distributed_optimizer=False))
    assert [r.chunk_microbatches for r in expected] == [2, 2, 1]
