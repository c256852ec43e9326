"""Chapter 7's Megatron-mode checker names the classic mistakes; the two checkers that launch
gloo workers are tested in tests/dist/test_exercises_ch07.py."""
from __future__ import annotations

from tutorial_lib.exercises import ch07
from tutorial_lib.exercises.ch07 import check_megatron_p2p_mode

from ..notebook_cells import assert_hint, hint_cases


# --- exercise 7.3: Megatron's mode ---------------------------------------------------------------


def test_reference_follows_megatrons_script():
    assert ch07.megatron_training_mode(False, False) == "batched"
    assert ch07.megatron_training_mode(True, False) == "overlapped"
    assert ch07.megatron_training_mode(True, True) == "batched"
    assert ch07.megatron_training_mode(False, True) == "batched"


@hint_cases([
    (lambda i, f, n: "overlapped" if n else "batched", ch07.HINT_NVLINK_RULE),
    (lambda i, f, n: "batched", ch07.HINT_OVERLAP_IS_DEFAULT),
    (lambda i, f, n: "batched" if f else "overlapped", ch07.HINT_OVERLAP_WITHOUT_INTERLEAVING),
    (lambda i, f, n: "overlapped" if i else "batched", ch07.HINT_FLAG_TURNS_OVERLAP_OFF),
    (lambda i, f, n: "overlapped" if i and not f else "sequential", ch07.HINT_NEVER_SEQUENTIAL),
    (lambda i, f, n: "NCCL", ch07.HINT_MODE_FORMAT),
    (lambda i, f, n: 1 / 0, ch07.HINT_MODE_GENERIC),
], ids=["nvlink_rule", "always_batched", "ignores_schedule", "ignores_flag", "sequential",
          "not_a_mode", "raises"])
def test_mode_mistake_gets_its_hint(wrong, hint):
    assert_hint(check_megatron_p2p_mode(wrong), hint)


def test_mode_spellings_are_accepted():
    spelled = {"overlapped": "Overlap", "batched": " BATCH "}
    assert check_megatron_p2p_mode(lambda i, f, n: spelled[ch07.megatron_training_mode(i, f)])
