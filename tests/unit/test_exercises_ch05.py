"""Chapter 5's checkers name the classic mistakes (the notebook's exercise cells:
tests/unit/test_exercises_notebooks.py).

Every checker runs in this process (no workers), so these are unit tests.  Each wrong
answer below is a mistake a student makes; each must get its own hint, and garbage must
never make a checker raise.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import moe_balance
from tutorial_lib.exercises import ch05
from tutorial_lib.exercises.ch05 import check_biased_topk, check_expert_balance_loss, check_update_bias

from ..notebook_cells import assert_hint
from tests.asserts import every


# --- exercise 5.1: the expert-level balance loss ---------------------------------------------


def loss_by_loops(probs, topk_idx, num_experts, topk):
    """The formula token by token: a different way to the right answer."""
    T = probs.shape[0]
    total = probs.new_zeros(())
    for i in range(num_experts):
        count = sum(int(i in row) for row in topk_idx.tolist())
        total = total + num_experts * count / (topk * T) * probs[:, i].sum() / T
    return total


def loss_from_one_hot(probs, topk_idx, num_experts, topk):
    chosen = F.one_hot(topk_idx, num_experts).sum(dim=1).to(probs.dtype)  # [T, N']
    return (chosen.mean(dim=0) * num_experts / topk * probs.mean(dim=0)).sum()


def test_the_cases_include_balance_collapse_and_a_device_limited_routing():
    values = {name: float(moe_balance.expert_balance_loss(p, idx, n, k)) for name, p, idx, n, k in ch05.loss_cases()}
    assert any(v == pytest.approx(1.0, abs=1e-12) for v in values.values())     # perfect balance
    collapse = [v for name, v in values.items() if name.startswith("collapse")]
    assert collapse and 3.5 < collapse[0] < 4.0                                  # near N'/K' = 4
    limited = [(p, idx, k) for name, p, idx, _, k in ch05.loss_cases() if "device-limited" in name]
    p, idx, k = limited[0]
    assert not torch.equal(torch.topk(p, k, dim=-1).indices.sort(-1).values, idx.sort(-1).values)
    assert every(len(set((row // 2).tolist())) == 1 for row in idx)  # one device (of 2 experts) each
    # every mistake changes the answer of at least one case
    for mistake in ch05.LOSS_MISTAKES:
        assert any(float(ch05.expert_loss_variant(p, idx, n, k, mistake)) != pytest.approx(values[name])
                   for name, p, idx, n, k in ch05.loss_cases()), mistake


#: Each named mistake of exercises 5.1 to 5.3, made by the library's variant of the answer
#: (``variant(*args, mistake)``), and the hint its checker must give.
NAMED_MISTAKES = [
    (check_expert_balance_loss, ch05.expert_loss_variant, "no_scale", ch05.HINT_LOSS_NO_SCALE),
    (check_expert_balance_loss, ch05.expert_loss_variant, "assignments",
     ch05.HINT_LOSS_ASSIGNMENTS),
    (check_expert_balance_loss, ch05.expert_loss_variant, "per_token", ch05.HINT_LOSS_PER_TOKEN),
    (check_expert_balance_loss, ch05.expert_loss_variant, "gates", ch05.HINT_LOSS_GATES),
    (check_expert_balance_loss, ch05.expert_loss_variant, "own_topk", ch05.HINT_LOSS_OWN_TOPK),
    (check_biased_topk, ch05.topk_variant, "biased_gates", ch05.HINT_TOPK_BIASED_GATES),
    (check_biased_topk, ch05.topk_variant, "ignores_bias", ch05.HINT_TOPK_IGNORES_BIAS),
    (check_biased_topk, ch05.topk_variant, "subtracted", ch05.HINT_TOPK_SUBTRACTED),
    (check_biased_topk, ch05.topk_variant, "normalised", ch05.HINT_TOPK_NORMALISED),
    (check_update_bias, ch05.update_variant, "flipped", ch05.HINT_BIAS_FLIPPED),
    (check_update_bias, ch05.update_variant, "proportional", ch05.HINT_BIAS_PROPORTIONAL),
    (check_update_bias, ch05.update_variant, "relative", ch05.HINT_BIAS_PROPORTIONAL),
    (check_update_bias, ch05.update_variant, "at_mean", ch05.HINT_BIAS_AT_MEAN),
]


@pytest.mark.parametrize("check,variant,mistake,hint", NAMED_MISTAKES,
                         ids=[mistake for _, _, mistake, _ in NAMED_MISTAKES])
def test_each_named_mistake_gets_its_hint(check, variant, mistake, hint):
    assert_hint(check(lambda *args: variant(*args, mistake)), hint)


def test_averaging_over_experts_gets_the_assignments_hint():
    def mean_not_sum(probs, topk_idx, n, k):
        f = torch.bincount(topk_idx.reshape(-1), minlength=n).to(probs.dtype) * n / (k * probs.shape[0])
        return (f * probs.mean(dim=0)).mean()

    assert check_expert_balance_loss(mean_not_sum).hint == ch05.HINT_LOSS_ASSIGNMENTS


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True")
@pytest.mark.parametrize("detach", [
    lambda loss: float(loss), lambda loss: loss.item(), lambda loss: loss.detach()])
def test_a_loss_without_gradient_gets_the_no_grad_hint(detach):
    result = check_expert_balance_loss(lambda p, idx, n, k: detach(moe_balance.expert_balance_loss(p, idx, n, k)))
    assert not result.passed and result.hint == ch05.HINT_LOSS_NO_GRAD


def test_a_loss_whose_counts_carry_gradient_gets_the_gradient_hint():
    def soft_counts(probs, topk_idx, n, k):
        # right value: the chosen-probability ratio is 1, but its gradient leaks into f
        chosen = F.one_hot(topk_idx, n).sum(dim=1).to(probs.dtype)
        counts = (chosen * probs / probs.detach()).sum(dim=0)
        return (counts * n / (k * probs.shape[0]) * probs.mean(dim=0)).sum()

    result = check_expert_balance_loss(soft_counts)
    assert not result.passed and result.hint == ch05.HINT_LOSS_WRONG_GRAD, str(result)


@pytest.mark.parametrize("garbage", [None, "1.0", torch.ones(3), (1.0, 2.0), float("nan")])
def test_expert_loss_checker_never_raises_on_garbage(garbage):
    result = check_expert_balance_loss(lambda *args: garbage)
    assert not result.passed and result.hint


def test_expert_loss_checker_turns_an_exception_into_a_case():
    def broken(probs, topk_idx, n, k):
        return probs.mean(dim=7)

    result = check_expert_balance_loss(broken)
    assert not result.passed and all("raised IndexError" in c.detail for c in result.cases)
    assert result.hint == ch05.HINT_LOSS_NUDGE  # staged: the formula when it fails again
    assert check_expert_balance_loss(broken).hint == ch05.HINT_LOSS_GENERIC


# --- exercise 5.2: choose with the bias, gate without it -----------------------------------


def topk_in_reverse_order(scores, topk, bias):
    idx = torch.topk(scores + bias.detach(), topk, dim=-1).indices.flip(-1)
    return idx, scores.gather(-1, idx)


def topk_by_sorting(scores, topk, bias):
    idx = torch.argsort((scores + bias).detach(), dim=-1, descending=True)[:, :topk]
    return idx, torch.gather(scores, 1, idx)


def test_ignoring_the_bias_passes_only_the_zero_bias_case():
    result = check_biased_topk(lambda s, k, b: ch05.topk_variant(s, k, b, "ignores_bias"))
    assert [c.passed for c in result.cases] == [name.startswith("zero bias")
                                                for name, *_ in ch05.topk_cases()]


def test_gates_without_gradient_get_the_no_grad_hint():
    result = check_biased_topk(lambda s, k, b: tuple(t.detach() for t in ch05.reference_topk(s, k, b)))
    assert not result.passed and result.hint == ch05.HINT_TOPK_NO_GRAD


@pytest.mark.parametrize("garbage", [None, torch.zeros(2), (torch.zeros(2, 2),), ("a", "b"),
                                     (torch.zeros(4, 2), torch.zeros(4, 2))])
def test_biased_topk_checker_never_raises_on_garbage(garbage):
    result = check_biased_topk(lambda *args: garbage)
    assert not result.passed and result.hint == ch05.HINT_TOPK_FORMAT


# --- exercise 5.3: the bias update ----------------------------------------------------------


def update_returning_new(bias, load, gamma):
    with torch.no_grad():
        return bias + gamma * torch.sign(load.double().mean() - load).float()


def update_in_place_returning_none(bias, load, gamma):
    moe_balance.update_expert_bias(bias, load, gamma)


#: Correct answers to exercises 5.1 to 5.3, written in other ways than the library's, and
#: how many cases their checker runs (5.3's: its cases and the in-place call).
CORRECT_ANSWERS = [
    *[(check_expert_balance_loss, answer, len(ch05.loss_cases()))
      for answer in (moe_balance.expert_balance_loss, loss_by_loops, loss_from_one_hot)],
    *[(check_biased_topk, answer, len(ch05.topk_cases()))
      for answer in (ch05.reference_topk, topk_in_reverse_order, topk_by_sorting)],
    *[(check_update_bias, answer, len(ch05.update_cases()) + 1)
      for answer in (moe_balance.update_expert_bias, update_returning_new,
                     update_in_place_returning_none)],
]


@pytest.mark.parametrize("check,answer,cases", CORRECT_ANSWERS,
                         ids=[answer.__name__ for _, answer, _ in CORRECT_ANSWERS])
def test_correct_answers_pass(check, answer, cases):
    result = check(answer)
    assert result.passed, str(result)
    assert len(result.cases) == cases


def test_the_simulation_really_balances_and_a_flipped_sign_really_does_not():
    first, settled, bias = ch05.simulate_bias_balancing(moe_balance.update_expert_bias)
    assert first > 2.5 and settled < ch05.SIM_MAX_VIOLATION
    assert bias[0] < 0 < bias[-1]  # the preferred expert was pushed down, the shunned one up
    _, flipped, _ = ch05.simulate_bias_balancing(lambda b, load, g: ch05.update_variant(b, load, g, "flipped"))
    assert flipped > first


def test_an_integer_mean_gets_the_dtype_hint():
    result = check_update_bias(lambda b, load, g: b.add_(g * torch.sign(load.mean() - load)))
    assert not result.passed and result.hint == ch05.HINT_BIAS_INT_MEAN


@pytest.mark.parametrize("answer", [
    lambda b, load, g: b.add_(g * torch.sign(load.float().mean() - load)),   # in place, outside no_grad
    lambda b, load, g: b + g * torch.sign(load.float().mean() - load),       # a new tensor with a grad_fn
])
def test_an_update_inside_autograd_gets_the_graph_hint(answer):
    result = check_update_bias(answer)
    assert not result.passed
    assert [c.passed for c in result.cases] == [True, True, False, True]  # only the leaf case fails
    assert result.hint == ch05.HINT_BIAS_GRAPH


@pytest.mark.parametrize("garbage", [None, 0.0, torch.zeros(2), "bias"])
def test_bias_checker_never_raises_on_garbage(garbage):
    def answer(bias, load, gamma):
        return garbage

    result = check_update_bias(answer)
    assert not result.passed and result.hint
    if garbage is not None:  # None means "in place": the untouched bias is then simply wrong
        assert result.hint == ch05.HINT_BIAS_FORMAT


def test_an_update_that_does_nothing_gets_the_generic_hint():
    result = check_update_bias(lambda b, load, g: b)
    assert not result.passed and result.hint == ch05.HINT_BIAS_NUDGE
    assert check_update_bias(lambda b, load, g: b).hint == ch05.HINT_BIAS_GENERIC
