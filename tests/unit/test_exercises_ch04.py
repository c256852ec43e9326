"""Chapter 4's send-splits and gradient-domain checkers name the classic mistakes, and the
layer-bytes cases cover the edges; the layer-bytes checker, which launches 4 gloo workers,
is tested in tests/dist/test_exercises_ch04.py."""
from __future__ import annotations

import pytest
import torch

from tutorial_lib import moe
from tutorial_lib.config import ParallelConfig
from tutorial_lib.exercises import ch04
from tutorial_lib.exercises.ch04 import (GRADIENT_DOMAIN_CASES, GRADIENT_DOMAIN_GRIDS, check_gradient_domains,
                                         check_send_splits, reference_send_splits, send_splits_cases)
from tutorial_lib.data_parallel import DOMAINS, grad_domain

from ..answer_keys import DOMAINS_KEY
from ..notebook_cells import answers_checker_tests, assert_hint, assert_reason


# --- exercise 4.1: the dispatch splits ------------------------------------------------------


def splits_right(topk_idx, num_experts, ep_size):
    return torch.bincount(topk_idx.flatten() // (num_experts // ep_size), minlength=ep_size)


def splits_tokens(topk_idx, num_experts, ep_size):
    ranks = topk_idx // (num_experts // ep_size)
    return [int((ranks == j).any(dim=1).sum()) for j in range(ep_size)]


def splits_round_robin(topk_idx, num_experts, ep_size):
    return torch.bincount(topk_idx.flatten() % ep_size, minlength=ep_size).tolist()


def splits_divided_by_ep(topk_idx, num_experts, ep_size):
    return torch.bincount(topk_idx.flatten() // ep_size, minlength=ep_size).tolist()


def splits_per_expert(topk_idx, num_experts, ep_size):
    return torch.bincount(topk_idx.flatten(), minlength=num_experts).tolist()


def splits_no_minlength(topk_idx, num_experts, ep_size):
    return torch.bincount(topk_idx.flatten() // (num_experts // ep_size)).tolist()


def splits_first_choice(topk_idx, num_experts, ep_size):
    return torch.bincount(topk_idx[:, 0] // (num_experts // ep_size), minlength=ep_size).tolist()


def test_the_reference_is_what_the_dispatcher_sends():
    """The library's send counts equal the splits the dispatcher computes (serial pieces)."""
    for name, topk_idx, num_experts, ep_size in send_splits_cases():
        load = torch.bincount(topk_idx.reshape(-1), minlength=num_experts)
        dispatcher_rule = load.view(ep_size, num_experts // ep_size).sum(dim=1).tolist()
        assert reference_send_splits(topk_idx, num_experts, ep_size) == dispatcher_rule, name


def test_the_cases_cover_the_edges():
    cases = send_splits_cases()
    assert {ep for *_, ep in cases} >= {1, 2, 4, 8}
    assert any(0 in reference_send_splits(t, n, e) for _, t, n, e in cases)      # an idle rank
    assert any(t.shape[0] == 0 for _, t, _, _ in cases)                          # no tokens
    assert any(n != e * e and n != e for _, t, n, e in cases)   # e // ep differs from e // (N / ep)
    for name, (wrong, hint) in _SPLITS_MISTAKES.items():  # every mistake fails somewhere
        assert any(_norm(wrong(t, n, e)) != reference_send_splits(t, n, e) for _, t, n, e in cases), name


def _norm(value):
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


_SPLITS_MISTAKES = {
    "tokens": (splits_tokens, ch04.HINT_SPLITS_TOKENS),
    "round_robin": (splits_round_robin, ch04.HINT_SPLITS_ROUND_ROBIN),
    "divided_by_ep": (splits_divided_by_ep, ch04.HINT_SPLITS_DIVIDED_BY_EP),
    "per_expert": (splits_per_expert, ch04.HINT_SPLITS_PER_EXPERT),
    "no_minlength": (splits_no_minlength, ch04.HINT_SPLITS_MISSING_ZEROS),
    "first_choice": (splits_first_choice, ch04.HINT_SPLITS_FIRST_CHOICE),
}


def test_right_splits_pass_as_tensor_list_or_tuple():
    assert check_send_splits(splits_right)
    assert check_send_splits(lambda *a: splits_right(*a).tolist())
    assert check_send_splits(lambda *a: tuple(splits_right(*a).tolist()))
    assert check_send_splits(lambda *a: splits_right(*a).float())  # whole numbers as floats are fine


@pytest.mark.parametrize("mistake", list(_SPLITS_MISTAKES))
def test_each_splits_mistake_gets_its_hint(mistake):
    wrong, hint = _SPLITS_MISTAKES[mistake]
    assert_hint(check_send_splits(wrong), hint)


def test_no_minlength_fails_only_where_the_last_ranks_get_nothing():
    result = check_send_splits(splits_no_minlength)
    for case, (_, t, n, e) in zip(result.cases, send_splits_cases()):
        want = reference_send_splits(t, n, e)
        assert case.passed == (want[-1] != 0), case.name


@pytest.mark.parametrize("garbage", [None, 3, "1,2", [1.5, 2], torch.zeros(2, 2), {"a": 1}])
def test_splits_checker_never_raises_on_garbage(garbage):
    result = check_send_splits(lambda *a: garbage)
    assert not result.passed and result.hint == ch04.HINT_SPLITS_FORMAT


def test_splits_checker_turns_an_exception_into_a_case():
    def broken(topk_idx, num_experts, ep_size):
        return [1 // (ep_size - 1)] * ep_size  # ZeroDivisionError at EP = 1

    result = check_send_splits(broken)
    failed = [c for c in result.cases if not c.passed]
    assert failed and any("raised ZeroDivisionError" in c.detail for c in failed)
    assert result.hint


# --- exercise 4.2: groups and divisors --------------------------------------------------------


def _domains(**changes):
    right = {name: (set(groups), divisor) for name, (groups, divisor) in DOMAINS_KEY.items()}
    right.update(changes)
    return lambda: right


def test_the_answers_follow_the_library():
    """Each case's answer is what the layer's attributes and DataParallel's domains say."""
    for name, (groups, divisor) in DOMAINS_KEY.items():
        tp, ep, dp, edp = GRADIENT_DOMAIN_GRIDS[name]
        config = ParallelConfig(8, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=1)  # the exercise: ETP = 1
        assert (config.data_parallel_size, config.expert_data_parallel_size) == (dp, edp)
        layer = moe.MoELayer(8, 8, 2, 4, num_shared_experts=1, sequence_parallel=tp > 1,
                             ep_group=None, tp_group=None)
        # the shared experts are TP shards, never flagged sequence_parallel (their split
        # over TP is pinned against Megatron's SharedExpertMLP in tests/dist/test_moe.py)
        param = {"router_weight": layer.router.weight,
                 "shared_expert_weight": layer.shared_experts.weight_up,
                 "routed_expert_weight": layer.experts.weight_up}[name.removesuffix("_sp")]
        domain = grad_domain(param)
        expected = {DOMAINS[domain].data_parallel_group}
        if getattr(param, "sequence_parallel", False) and tp > 1:
            expected.add("tp")  # allreduce_sequence_parallel_grads
        assert expected == set(groups), name
        averaging = DOMAINS[domain].averaging_group  # dp_cp = DP with CP = 1
        assert averaging in ("dp", "dp_cp") and divisor == dp, name


def test_correct_domains_pass_in_any_spelling():
    assert check_gradient_domains(_domains())
    spelled = {name: {"groups": "+".join(sorted(g)), "divisor": float(d)}
               for name, (g, d) in DOMAINS_KEY.items()}
    assert check_gradient_domains(lambda: spelled)
    assert check_gradient_domains(lambda: {name: [list(g), d] for name, (g, d) in DOMAINS_KEY.items()})


@pytest.mark.parametrize("case,answer,reason", [
    ("routed_expert_weight", ({"expert_dp"}, 2), "EP * ETP / TP times too large"),
    ("routed_expert_weight_sp", ({"expert_dp"}, 2), "EP * ETP / TP times too large"),
    ("routed_expert_weight", ({"dp"}, 8), "other experts"),
    ("routed_expert_weight", ({"ep"}, 8), "different experts"),
    ("routed_expert_weight_sp", ({"tp", "expert_dp"}, 4), "EP folds onto TP"),
    ("router_weight", ({"expert_dp"}, 8), "drift apart"),
    ("router_weight", ({"dp", "ep"}, 8), "already contains the EP ranks"),
    ("router_weight_sp", ({"dp"}, 4), "partial sum"),
    ("shared_expert_weight_sp", ({"tp", "dp"}, 4), "different rows"),
    ("router_weight_sp", ({"tp", "dp"}, 8), "not replicas of each other"),
    ("shared_expert_weight", ({"dp"}, 1), "is not the gradient of the mean loss"),
    ("router_weight", ({"world"}, 8), "mixes everything"),
    ("router_weight", (set(), 8), "drift apart"),
    ("router_weight", ({"dp"}, 2), "each token of the global batch has contributed once"),
    ("router_weight", ({"pipeline"}, 8), "unknown group kind"),
])
def test_each_wrong_domain_gets_its_reason(case, answer, reason):
    assert_reason(check_gradient_domains(_domains(**{case: answer})), case, reason)


@pytest.mark.parametrize("case,answer,first,then", [
    ("routed_expert_weight", ({"dp"}, 8), "Which ranks hold a copy",
     "only on the ranks with the same EP rank"),
    ("router_weight", ({"dp"}, 1), "is not the gradient of the mean loss",
     "re-read 'Gradient domains'"),
])
def test_a_reason_says_what_is_wrong_first_and_what_to_do_when_it_fails_again(case, answer, first,
                                                                                then):
    """Staged hints. A first wrong answer gets the reason; the same situation wrong again
    gets the section to re-read and the quantity to reconsider; neither names the group or
    the number."""
    wrong = _domains(**{case: answer})
    assert_reason(check_gradient_domains(wrong), case, first)
    again = check_gradient_domains(wrong)
    assert_reason(again, case, then)
    assert "8" not in again.hint and "expected" not in str(again)


def test_every_wrong_situation_gets_its_reason_at_once():
    """Exercises that teach: a checker of answers per situation shows the hint of every wrong one."""
    wrong = _domains(router_weight=({"world"}, 8), routed_expert_weight=({"ep"}, 8))
    result = check_gradient_domains(wrong)
    assert [h.split(":")[0] for h in result.hints] == ["router_weight", "routed_expert_weight"]


test_domains_checker_never_raises_on_garbage, test_domains_checker_turns_an_exception_into_a_case = \
    answers_checker_tests(check_gradient_domains,
                          [None, "dp", [1, 2], {"router_weight": 3},
                           {name: ({"dp"}, "eight") for name in GRADIENT_DOMAIN_CASES}],
                          KeyError("expert_dp"))


# --- exercise 4.3: the bytes of one layer ------------------------------------------------------


def test_the_bytes_cases_cover_the_edges():
    matrices = [ch04.send_count_matrix(r) for _, r in ch04.bytes_cases()]
    assert any(all(row[3] == 0 for row in m) for m in matrices)          # rank 3 receives nothing
    assert any(sum(m[1]) == 0 for m in matrices)                         # rank 1 sends nothing
    assert any(m[0][0] == sum(m[0]) > 0 for m in matrices)               # rank 0 keeps everything
