"""Chapter 12's checkers: their references agree with the library, and they name the classic
mistakes (pure: no processes; the notebook's exercise cells:
tests/unit/test_exercises_notebooks.py; the backward's gather order on real ranks:
tests/dist/test_fully_sharded_data_parallel.py)."""
from __future__ import annotations

from tutorial_lib import costs
from tutorial_lib.config import ModelConfig, ParallelConfig, TrainConfig
from tutorial_lib.exercises import ch12
from tutorial_lib.exercises.kit import forget_attempts


def test_the_state_reference_is_the_memory_model_on_the_chapters_model():
    """The chapter's GPT (root 1184, blocks 3280) on DP 4: weights + gradients + optimizer of
    :func:`tutorial_lib.costs.memory_per_rank` under each strategy."""
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                         vocab_size=32)
    for strategy in ("optim_grads", "optim_grads_params"):
        rank = costs.memory_per_rank(config, ParallelConfig(4), TrainConfig(8, 1),
                                     data_parallel_sharding_strategy=strategy)[0]
        assert ch12.reference_state_bytes([1184, 3280, 3280], 4, strategy) == \
            rank.weights + rank.gradients + rank.optimizer


def test_state_bytes_passes_the_reference_and_names_each_mistake():
    assert ch12.check_state_bytes(ch12.reference_state_bytes).passed
    result = ch12.check_state_bytes(
        lambda u, dp, s: ch12._state_mistakes(u, dp, s)["padding"])
    assert not result.passed and ch12.HINT_STATE_PADDING in str(result)
    forget_attempts()
    result = ch12.check_state_bytes(lambda u, dp, s: ch12.reference_state_bytes(u, dp, s)
                                    + (4 * sum(u) if s == "optim_grads_params" else 0))
    assert not result.passed and ch12.HINT_STATE_WEIGHTS in str(result)


def test_backward_gathers_passes_the_reference_and_names_each_mistake():
    assert ch12.check_backward_gathers(ch12.reference_backward_gathers).passed
    for mistake, hint in (("forward_order", ch12.HINT_GATHER_FORWARD_ORDER),
                          ("root_last", ch12.HINT_GATHER_ROOT_LAST),
                          ("flags", ch12.HINT_GATHER_FLAGS)):
        forget_attempts()
        result = ch12.check_backward_gathers(
            lambda n, p, r, m=mistake: ch12._gather_mistakes(n, p, r)[m])
        assert not result.passed and hint in str(result), mistake
    forget_attempts()
    result = ch12.check_backward_gathers(lambda n, p, r: "not a list")
    assert not result.passed and ch12.HINT_GATHER_FORMAT in str(result)
