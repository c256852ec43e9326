"""Chapter 6's checkers name the classic mistakes (all pure: no processes; the notebook's
exercise cells: tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

import pytest

from tutorial_lib.deepseek import layer_range
from tutorial_lib.exercises import ch06
from tutorial_lib.exercises.ch06 import (check_bubble, check_one_f_one_b, check_stage_holdings,
                                         stage_holdings)
from tutorial_lib.pipeline_parallel.actions import Action
from tutorial_lib.pipeline_parallel.schedules import one_f_one_b
from tests.asserts import every


# --- exercise 6.1: the 1F1B list ---------------------------------------------------------------


def one_f_one_b_variant(warmup=lambda pp, m, r: min(pp - r - 1, m), grad_peer=lambda r, pp: r + 1,
                        backward_first=False, labels=True, recv_before_send=False):
    """A student's 1F1B with one knob per classic mistake."""
    def fn(pp, m, rank):
        def forward(mb):
            out = [Action("recv_activation", mb, peer=rank - 1)] if rank > 0 else []
            if labels and pp > 1 and rank == 0:
                out.append(Action("send_labels", mb, peer=pp - 1))
            if labels and pp > 1 and rank == pp - 1:
                out.append(Action("recv_labels", mb, peer=0))
            out.append(Action("forward", mb))
            return out + ([Action("send_activation", mb, peer=rank + 1)] if rank < pp - 1 else [])

        def backward(mb):
            out = [Action("recv_grad", mb, peer=grad_peer(rank, pp) % pp)] if rank < pp - 1 else []
            out.append(Action("backward", mb))
            return out + ([Action("send_grad", mb, peer=rank - 1)] if rank > 0 else [])

        w = warmup(pp, m, rank)
        actions = []
        for mb in range(w):
            actions += forward(mb)
        for i in range(m - w):
            f, b = forward(w + i), backward(i)
            if recv_before_send and b[0].kind == "recv_grad" and f[-1].kind == "send_activation":
                f, b = f[:-1] + [b[0]], [f[-1]] + b[1:]  # the gap's receive posted before its send
            actions += (b + f) if backward_first else (f + b)
        for mb in range(m - w, m):
            actions += backward(mb)
        return actions
    return fn


def test_the_reference_itself_passes():
    assert check_one_f_one_b(one_f_one_b)
    assert check_one_f_one_b(one_f_one_b_variant())


@pytest.mark.parametrize("warmup", [lambda pp, m, r: min(pp - r, m), lambda pp, m, r: min(pp - 1, m)],
                         ids=["one-too-many", "same-on-every-rank"])
def test_wrong_warmup_count_is_named(warmup):
    result = check_one_f_one_b(one_f_one_b_variant(warmup=warmup))
    assert not result.passed and result.hint == ch06.HINT_WARMUP
    assert "forwards before the first backward" in str(result)


def test_unclamped_warmup_runs_microbatches_that_do_not_exist():
    result = check_one_f_one_b(one_f_one_b_variant(warmup=lambda pp, m, r: pp - r - 1))
    assert not result.passed and result.hint == ch06.HINT_WARMUP
    assert "but the microbatches are" in str(result)


def test_a_grad_received_from_the_previous_rank_is_named_and_hidden_at_pp_2():
    result = check_one_f_one_b(one_f_one_b_variant(grad_peer=lambda r, pp: r - 1))
    assert not result.passed and result.hint == ch06.HINT_PEER
    failing = {c.name for c in result.cases if not c.passed}
    assert failing and all(not name.startswith(("PP=1", "PP=2")) for name in failing)  # PP = 2 hides it
    assert "recv_grad of microbatch 0 with rank 2, the wrong neighbour" in str(result)
    assert "expected" not in str(result)  # the right peer is the answer: never shown


def test_backward_before_forward_is_named():
    result = check_one_f_one_b(one_f_one_b_variant(backward_first=True))
    assert not result.passed and result.hint == ch06.HINT_BACKWARD_FIRST
    assert "backward 0 comes before forward 0" in str(result)


def test_missing_labels_are_named():
    result = check_one_f_one_b(one_f_one_b_variant(labels=False))
    assert not result.passed and result.hint == ch06.HINT_LABELS
    assert "a send_labels is missing" in str(result)


def test_messages_reordered_inside_one_gap_pass_when_every_rank_still_runs():
    # receive the gradient before sending the activation: buffered sends make it harmless,
    # and the checker accepts it because the simulation of all ranks completes
    result = check_one_f_one_b(one_f_one_b_variant(recv_before_send=True))
    assert result.passed, str(result)


def test_not_a_list_of_actions():
    result = check_one_f_one_b(lambda pp, m, r: ["F0", "B0"])
    assert not result.passed and result.hint == ch06.HINT_TYPE


def test_a_raising_attempt_is_a_failed_case_not_an_error():
    result = check_one_f_one_b(lambda pp, m, r: 1 / 0)
    assert not result.passed and "ZeroDivisionError" in str(result)


# --- exercise 6.2: the bubble -------------------------------------------------------------------


def test_bubble_mistakes_are_named():
    assert check_bubble(lambda pp, m, v: (pp - 1) / (v * m + pp - 1))
    idle_over_work = check_bubble(lambda pp, m, v: (pp - 1) / (v * m))
    assert not idle_over_work.passed and idle_over_work.hint == ch06.HINT_IDLE_OVER_WORK
    forgot_v = check_bubble(lambda pp, m, v: (pp - 1) / (m + pp - 1))
    assert not forgot_v.passed and forgot_v.hint == ch06.HINT_FORGOT_V
    assert every(c.passed for c in forgot_v.cases if ", V=1" in c.name)
    other = check_bubble(lambda pp, m, v: 0.5)
    assert not other.passed and other.hint == ch06.HINT_BUBBLE_GENERIC
    assert not check_bubble(lambda pp, m, v: "a lot").passed
    assert check_bubble(lambda pp, m, v: "a lot").hint == ch06.HINT_BUBBLE_FORMAT


def test_either_definition_of_the_bubble_passes_when_stated():
    """Found reading the book: the Megatron paper's bubble is the idle time over the ideal time,
    (p - 1) / m, and (p - 1) / (v m) interleaved (Narayanan et al., "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, sections 2.2.1 and
    2.2.2); the chapter's is the idle fraction of the step, (p - 1) / (v m + p - 1).  The
    checker refused the paper's even when the student meant it."""
    assert check_bubble(lambda pp, m, v: ("ideal", (pp - 1) / (v * m)))
    assert check_bubble(lambda pp, m, v: ("step", (pp - 1) / (v * m + pp - 1)))
    assert check_bubble(lambda pp, m, v: ["Ideal", (pp - 1) / (v * m)])
    # a definition stated, the other's value given
    swapped = check_bubble(lambda pp, m, v: ("ideal", (pp - 1) / (v * m + pp - 1)))
    assert not swapped.passed and swapped.hint == ch06.HINT_WRONG_DEFINITION
    assert every(c.passed for c in swapped.cases if c.name.startswith("PP=1,"))  # both are 0
    swapped = check_bubble(lambda pp, m, v: ("step", (pp - 1) / (v * m)))
    assert not swapped.passed and swapped.hint == ch06.HINT_WRONG_DEFINITION
    forgot_v = check_bubble(lambda pp, m, v: ("ideal", (pp - 1) / m))
    assert not forgot_v.passed and forgot_v.hint == ch06.HINT_FORGOT_V
    unknown = check_bubble(lambda pp, m, v: ("paper", (pp - 1) / (v * m)))
    assert not unknown.passed and unknown.hint == ch06.HINT_BUBBLE_FORMAT
    # the two definitions name the same idle time
    for pp, m, v in ch06.BUBBLE_CASES:
        ideal = ch06.BUBBLE_DEFINITIONS["ideal"](pp, m, v)
        assert abs(ch06.BUBBLE_DEFINITIONS["step"](pp, m, v) - ideal / (1 + ideal)) < 1e-12


# --- exercise 6.3: holdings ----------------------------------------------------------------------


def test_reference_holdings():
    assert stage_holdings(8, 2, 2, 0) == {"layers": [0, 1, 4, 5], "embedding": True, "head": False,
                                          "labels": "send"}
    assert stage_holdings(8, 2, 2, 1)["head"] and stage_holdings(4, 1, 1, 0)["labels"] is None
    assert stage_holdings(12, 3, 1, 1) == {"layers": [4, 5, 6, 7], "embedding": False, "head": False,
                                           "labels": None}


def test_contiguous_chunks_are_named():
    def contiguous(layers, pp, v, rank):
        per = layers // (pp * v)
        return {**stage_holdings(layers, pp, v, rank), "layers": list(range(rank * v * per, (rank + 1) * v * per))}

    result = check_stage_holdings(contiguous)
    assert not result.passed and result.hint == ch06.HINT_CONTIGUOUS
    assert every(c.passed for c in result.cases if ", V=1," in c.name)


def test_head_on_the_wrong_rank_is_named():
    def head_on_rank_0(layers, pp, v, rank):
        return {**stage_holdings(layers, pp, v, rank), "head": rank == 0}

    result = check_stage_holdings(head_on_rank_0)
    assert not result.passed and result.hint == ch06.HINT_HEAD


def test_missing_keys_are_named():
    result = check_stage_holdings(lambda layers, pp, v, rank: list(layer_range(layers, pp, rank)))
    assert not result.passed and result.hint == ch06.HINT_HOLDINGS_TYPE
