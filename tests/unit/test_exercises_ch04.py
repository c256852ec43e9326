"""Chapter 4's exercises: the notebook's stubs fail with a hint, its solutions pass, and
the checkers name the classic mistakes.

Exercises 4.1 and 4.2 are pure. The checker of 4.3 launches 4 gloo workers once per
session (``measured_layer_bytes`` is cached), so the wrong formulas below cost no
further launches.
"""
from __future__ import annotations

import pytest
import torch

from tutorial_lib import costs, moe
from tutorial_lib.config import ParallelConfig
from tutorial_lib.exercises import ch04
from tutorial_lib.exercises.ch04 import (GRADIENT_DOMAIN_CASES, GRADIENT_DOMAIN_GRIDS, check_gradient_domains,
                                         check_layer_bytes_sent, check_send_splits, reference_layer_bytes_sent,
                                         reference_send_splits, send_splits_cases)
from tutorial_lib.data_parallel import DOMAINS, grad_domain
from tutorial_lib.viz.table import table

from ..notebook_cells import NOTEBOOKS, exercise_tests

NOTEBOOK = NOTEBOOKS / "04_moe_ep.ipynb"

#: The exercises in notebook order: (function the stub defines, its checker, solution name).
EXERCISES = [
    ("send_splits", check_send_splits, "send_splits_solution"),
    ("gradient_domains", check_gradient_domains, "gradient_domains_solution"),
    ("layer_bytes_sent", check_layer_bytes_sent, "layer_bytes_sent_solution"),
]

(test_notebook_has_the_three_cells_of_each_exercise, test_stub_fails_with_the_stub_hint,
 test_solution_cell_passes) = exercise_tests(
    NOTEBOOK, EXERCISES, {"torch": torch, "table": table, "GRADIENT_DOMAIN_CASES": GRADIENT_DOMAIN_CASES,
                          "check_send_splits": check_send_splits,
                          "check_gradient_domains": check_gradient_domains,
                          "check_layer_bytes_sent": check_layer_bytes_sent},
    min_cases=6)


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
    result = check_send_splits(wrong)
    assert not result.passed
    assert result.hint == hint, str(result)
    assert hint in str(result)


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
    right = {name: (set(groups), divisor) for name, (_, groups, divisor) in GRADIENT_DOMAIN_CASES.items()}
    right.update(changes)
    return lambda: right


def test_the_answers_follow_the_library():
    """Each case's answer is what the layer's attributes and DataParallel's domains say."""
    for name, (_, groups, divisor) in GRADIENT_DOMAIN_CASES.items():
        tp, ep, dp, edp = GRADIENT_DOMAIN_GRIDS[name]
        config = ParallelConfig(8, tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        assert (config.data_parallel_size, config.expert_data_parallel_size) == (dp, edp)
        layer = moe.MoELayer(8, 8, 2, 4, num_shared_experts=1, sequence_parallel=tp > 1,
                             ep_group=None, tp_group=None)
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
               for name, (_, g, d) in GRADIENT_DOMAIN_CASES.items()}
    assert check_gradient_domains(lambda: spelled)
    assert check_gradient_domains(lambda: {name: [list(g), d] for name, (_, g, d) in GRADIENT_DOMAIN_CASES.items()})


@pytest.mark.parametrize("case,answer,reason", [
    ("routed_expert_weight", ({"expert_dp"}, 2), "4x too large"),
    ("routed_expert_weight_sp", ({"expert_dp"}, 2), "2x too large"),
    ("routed_expert_weight", ({"dp"}, 8), "other experts"),
    ("routed_expert_weight", ({"ep"}, 8), "different experts"),
    ("routed_expert_weight_sp", ({"tp", "expert_dp"}, 4), "EP folds onto TP"),
    ("router_weight", ({"expert_dp"}, 8), "drift apart"),
    ("router_weight", ({"dp", "ep"}, 8), "already contains the EP ranks"),
    ("router_weight_sp", ({"dp"}, 4), "partial sum"),
    ("shared_expert_weight_sp", ({"dp"}, 4), "partial sum"),
    ("router_weight_sp", ({"tp", "dp"}, 8), "not replicas of each other"),
    ("shared_expert_weight", ({"dp"}, 1), "8x the gradient of the mean loss"),
    ("router_weight", ({"world"}, 8), "mixes everything"),
    ("router_weight", (set(), 8), "drift apart"),
    ("router_weight", ({"dp"}, 2), "DP = 8"),
    ("router_weight", ({"pipeline"}, 8), "unknown group kind"),
])
def test_each_wrong_domain_gets_its_reason(case, answer, reason):
    result = check_gradient_domains(_domains(**{case: answer}))
    assert not result.passed
    assert [c.name for c in result.cases if not c.passed] == [case]
    assert result.hint.startswith(f"{case}: ") and reason in result.hint, result.hint


@pytest.mark.parametrize("garbage", [None, "dp", [1, 2], {"router_weight": 3},
                                     {name: ({"dp"}, "eight") for name in GRADIENT_DOMAIN_CASES}])
def test_domains_checker_never_raises_on_garbage(garbage):
    result = check_gradient_domains(lambda: garbage)
    assert not result.passed and result.hint


def test_domains_checker_turns_an_exception_into_a_case():
    def broken():
        raise KeyError("expert_dp")

    result = check_gradient_domains(broken)
    assert not result.passed and "raised KeyError" in result.cases[0].detail


# --- exercise 4.3: the bytes of one layer ------------------------------------------------------


def _right_bytes(counts, rank, hidden, num_experts, bytes_per_element):
    return reference_layer_bytes_sent(counts, rank, hidden, num_experts, bytes_per_element)


def test_the_reference_formula_matches_costs_and_the_trace():
    measured = ch04.measured_layer_bytes()
    for (name, routings), per_rank in zip(ch04.bytes_cases(), measured):
        counts = ch04.send_count_matrix(routings)
        for rank, traced in enumerate(per_rank):
            want = reference_layer_bytes_sent(counts, rank, ch04.BYTES_HIDDEN, ch04.BYTES_EXPERTS)
            assert traced == want, (name, rank)
            # the same from costs: every all-to-all of the rank, minus the rows it keeps
            local = ch04.BYTES_EXPERTS // len(counts)
            from_costs = 0
            for op in costs.moe_rank_all_to_alls(counts, rank, ch04.BYTES_HIDDEN, ch04.BYTES_EXPERTS, 4):
                row_bytes = local * 8 if op.payload == "counts" else ch04.BYTES_HIDDEN * 4
                from_costs += op.bytes - op.input_splits[rank] * row_bytes
            assert from_costs == want, (name, rank)
    assert check_layer_bytes_sent(_right_bytes)


def test_the_bytes_cases_cover_the_edges():
    matrices = [ch04.send_count_matrix(r) for _, r in ch04.bytes_cases()]
    assert any(all(row[3] == 0 for row in m) for m in matrices)          # rank 3 receives nothing
    assert any(sum(m[1]) == 0 for m in matrices)                         # rank 1 sends nothing
    assert any(m[0][0] == sum(m[0]) > 0 for m in matrices)               # rank 0 keeps everything


@pytest.mark.parametrize("mistake", list(ch04.BYTES_MISTAKES))
def test_each_bytes_mistake_gets_its_hint(mistake):
    switches = ch04.BYTES_MISTAKES[mistake]
    result = check_layer_bytes_sent(
        lambda c, r, h, n, d: reference_layer_bytes_sent(c, r, h, n, d, **switches))
    assert not result.passed
    expected = dict((name, hint) for hint, name in ch04._BYTES_HINTS)[mistake]
    assert result.hint == expected, result.hint


@pytest.mark.parametrize("garbage", [None, "lots", [1, 2], {"tp": 1}])
def test_bytes_checker_never_raises_on_garbage(garbage):
    result = check_layer_bytes_sent(lambda *a: garbage)
    assert not result.passed and result.hint == ch04.HINT_BYTES_FORMAT


def test_an_unknown_wrong_formula_gets_the_generic_hint():
    result = check_layer_bytes_sent(lambda *a: _right_bytes(*a) + 1)
    assert result.hint == ch04.HINT_BYTES_GENERIC


def test_a_formula_that_raises_is_reported_per_case():
    def broken(counts, rank, hidden, num_experts, bytes_per_element):
        if sum(counts[rank]) == 0:
            raise ZeroDivisionError("no tokens")
        return _right_bytes(counts, rank, hidden, num_experts, bytes_per_element)

    result = check_layer_bytes_sent(broken)
    failed = [c for c in result.cases if not c.passed]
    assert len(failed) == 1 and "raised ZeroDivisionError" in failed[0].detail
    assert result.hint == ch04.HINT_BYTES_RAISED
