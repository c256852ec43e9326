"""Checkers for chapter 5, DeepSeekMoE auxiliary losses.

* :func:`check_expert_balance_loss`: the student's ``fn(probs, topk_idx, num_experts,
  topk)`` is DeepSeekMoE's expert-level balance loss (coefficient 1).  The checker
  compares the value *and* the gradient with respect to ``probs`` with
  :func:`tutorial_lib.moe_balance.expert_balance_loss` on random routings, perfect balance,
  a collapse onto K' experts and a routing that is not the top-k of ``probs`` (DeepSeek-V2's
  device-limited routing, whose picks V2's ``f_i`` counts).  Forgetting the ``N'/K'`` scaling, dividing by the tokens instead of the
  assignments, using the top-k gates instead of the full probabilities, re-running top-k
  instead of counting ``topk_idx``, and a loss cut off from autograd each get a hint.
* :func:`check_biased_topk`: ``fn(scores, topk, bias) -> (topk_idx, gates)`` is DeepSeek-V3's
  biased selection: choose by ``scores + bias``, gate with the unbiased ``scores``.  Biased
  gates, an ignored or subtracted bias, normalised gates and gates without a gradient each
  get a hint.
* :func:`check_update_bias`: ``fn(bias, load, gamma)`` is V3's bias step.  The checker
  tries it on a few loads (an expert exactly at the mean included), on a bias that is a
  leaf requiring grad, and in a 200-step simulation of a skewed router balanced with the
  library's :func:`reference_topk`: the trajectory must be the
  library's and MaxVio must fall.  A flipped sign, a step proportional to the imbalance,
  moving experts at the mean, an integer mean and an update that builds a graph each get
  a hint.
* :func:`check_blind_routing` (5.4): build a device-limited routing whose device loss is 1
  and whose communication loss is D/M, judged by the library's two losses.
* :func:`check_predicted_balance` (5.5, predict then run): the student predicts the
  expert-level loss, the MaxVio and each expert's bias direction after one V3 step for
  three small routings (:data:`BALANCE_ROUTINGS`); the checker computes them with
  :mod:`tutorial_lib.moe_balance` and names the classic slips (the N'/K' scaling, tokens
  instead of picks, the collapse value recalled instead of computed, max/mean for MaxVio,
  the bias's sign, an expert at the mean).

Everything runs in this process (no workers): a checker takes well under a second.
Student code never makes a checker raise: exceptions and stubs become failed cases with
a hint.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import torch

from .. import moe, moe_balance
from .kit import (Case, Checking, CheckResult, Mistakes, as_number, as_whole_numbers,
                  run_case)

# --- hints (tests look for these exact strings) ---------------------------------------

HINT_LOSS_NO_SCALE = (
    "your loss is K'/N' times too small: f_i is the count of tokens choosing expert i "
    "scaled by N'/(K'T), not divided by T alone. The scaling makes f_i = 1 for every "
    "expert at perfect balance, so the loss is exactly 1 there."
)
HINT_LOSS_ASSIGNMENTS = (
    "your loss is N' times too small: either f_i = count_i / (K'T), the fraction of the "
    "K'T assignments (it is that fraction times N'), or you averaged f_i P_i over the "
    "experts instead of summing. At perfect balance the loss must be exactly 1."
)
HINT_LOSS_PER_TOKEN = (
    "your loss is K' times too large: divide the counts by the K'T assignments, not by "
    "the T tokens. Each token makes K' picks, so balanced counts are K'T/N' per expert "
    "and f_i = N'/(K'T) * count_i is then 1."
)
HINT_LOSS_GATES = (
    'P_i must average the router probability of expert i over ALL T tokens, the '
    'probabilities s_{i,t} of every expert, not only the top-k gates of the experts each '
    "token chose. The unchosen experts' probabilities are what the gradient lowers or "
    'raises.'
)
HINT_LOSS_OWN_TOPK = (
    "count the experts in topk_idx, the experts the tokens were really sent to. With "
    "DeepSeek-V2's device-limited routing they are not torch.topk(probs, K'): one case "
    "keeps each token on a single device, and your counts followed probs instead."
)
HINT_LOSS_NO_GRAD = (
    "the value is right but no gradient reaches probs: the loss must stay in autograd "
    "(no .item(), float(), .detach() or torch.no_grad() on the P part), because its whole "
    "purpose is the gradient it sends into the router."
)
HINT_LOSS_WRONG_GRAD = (
    "the value is right but the gradient with respect to probs is not the library's "
    "alpha * f_i / T: the gradient must flow through P_i only. f_i comes from counts "
    "(torch.bincount of topk_idx), a constant that carries no gradient."
)
HINT_LOSS_FORMAT = (
    "return the loss as a scalar torch tensor (shape ()), computed from probs so that "
    "autograd can differentiate it."
)
HINT_LOSS_NUDGE = (
    "two factors per expert: f_i, how often expert i was chosen (counted in topk_idx and "
    "scaled so that perfect balance gives f_i = 1), and P_i, its mean router probability "
    "over all tokens. Which of the two carries the gradient?"
)
HINT_LOSS_GENERIC = (
    "L = sum_i f_i P_i with f_i = N'/(K'T) * (number of times expert i appears in topk_idx) "
    "and P_i = (1/T) * sum_t probs[t, i]. torch.bincount(topk_idx.reshape(-1), "
    "minlength=N') gives the counts."
)

HINT_TOPK_BIASED_GATES = (
    "your gates include the bias. The bias only decides WHICH experts a token goes to; "
    "the gate that weights an expert's output is its unbiased score s_{i,t}: "
    "scores.gather(-1, topk_idx). Otherwise the bias would leak into the model's output "
    "and into the gradients."
)
HINT_TOPK_IGNORES_BIAS = (
    "your selection ignores the bias: choose the k largest scores + bias (the bias is "
    "what steers tokens away from overloaded experts), then gate with the scores alone."
)
HINT_TOPK_SUBTRACTED = (
    "add the bias, do not subtract it: an underloaded expert gets a positive bias so that "
    "it is chosen more often. Select by scores + bias."
)
HINT_TOPK_NORMALISED = (
    "return the raw affinities scores.gather(-1, topk_idx) as gates. DeepSeek-V3 "
    "normalises them to sum to 1 afterwards, in the router (gates_from_scores), not here."
)
HINT_TOPK_NO_GRAD = (
    "the gates carry no gradient to scores: the router learns through the gates, so take "
    "them from scores with gather (only the selection, through the bias, has no gradient)."
)
HINT_TOPK_FORMAT = (
    "return a pair (topk_idx, gates): topk_idx an int64 tensor [T, k] of expert indices, "
    "gates a float tensor [T, k] with the gate of each chosen expert."
)
HINT_TOPK_NUDGE = (
    "the bias has one job: deciding which experts a token goes to. Which tensor do you rank "
    "to choose the experts, and which one do you read the gates from?"
)
HINT_TOPK_GENERIC = (
    "topk_idx = torch.topk(scores + bias, topk, dim=-1).indices and gates = "
    "scores.gather(-1, topk_idx)."
)

HINT_BIAS_FLIPPED = (
    "the sign is flipped: an OVERLOADED expert (load above the mean) must get a LOWER "
    "bias so fewer tokens choose it: b_i <- b_i + gamma * sign(mean load - load_i). With "
    "your sign the busiest expert attracts even more tokens and MaxVio grows."
)
HINT_BIAS_PROPORTIONAL = (
    "the rule moves every bias by exactly gamma, in the direction of the sign: gamma * "
    "sign(mean - load_i), not a step proportional to the imbalance. The size of the "
    "imbalance does not matter, only its direction."
)
HINT_BIAS_AT_MEAN = (
    "an expert at exactly the mean load must keep its bias: sign(0) = 0. torch.sign does "
    "this for you; a two-way choice (where(load > mean, -gamma, +gamma)) moves it anyway."
)
HINT_BIAS_INT_MEAN = (
    "load is an int64 tensor of token counts: .mean() is not defined for integers. Convert "
    "it first, load.float().mean() (or .double())."
)
HINT_BIAS_GRAPH = (
    "the update built an autograd graph (or tried to, on a leaf that requires grad). The "
    "bias is not learned by backpropagation: it is set by a rule outside autograd. Wrap "
    "the update in torch.no_grad() (and update in place, or return a tensor without "
    "grad_fn)."
)
HINT_BIAS_FORMAT = (
    "update the bias in place and return it (or return the new bias): a float tensor of "
    "shape [N'], the same shape and dtype as bias."
)
HINT_BIAS_NUDGE = (
    "the rule looks only at the direction of each expert's imbalance: an expert above the "
    "mean load gets a lower bias, one below a higher bias, by a fixed step gamma; and it runs "
    "outside autograd."
)
HINT_BIAS_GENERIC = (
    "b_i <- b_i + gamma * sign(mean_j load_j - load_i), inside torch.no_grad(): "
    "bias.add_(gamma * torch.sign(load.float().mean() - load))."
)

#: The mistakes of exercise 5.1, in order of preference (the wrong losses: :func:`expert_loss_variant`).
LOSS_HINTS = Mistakes(
    (HINT_LOSS_NUDGE, HINT_LOSS_GENERIC), own_topk=HINT_LOSS_OWN_TOPK, gates=HINT_LOSS_GATES,
    no_scale=HINT_LOSS_NO_SCALE, assignments=HINT_LOSS_ASSIGNMENTS, per_token=HINT_LOSS_PER_TOKEN,
    no_grad=HINT_LOSS_NO_GRAD, wrong_grad=HINT_LOSS_WRONG_GRAD, format=HINT_LOSS_FORMAT)
#: The mistakes of exercise 5.2, in order of preference (the wrong choices: :func:`topk_variant`).
TOPK_HINTS = Mistakes(
    (HINT_TOPK_NUDGE, HINT_TOPK_GENERIC), format=HINT_TOPK_FORMAT, biased_gates=HINT_TOPK_BIASED_GATES,
    ignores_bias=HINT_TOPK_IGNORES_BIAS, subtracted=HINT_TOPK_SUBTRACTED,
    normalised=HINT_TOPK_NORMALISED, no_grad=HINT_TOPK_NO_GRAD)
#: The mistakes of exercise 5.3, in order of preference (the wrong steps: :func:`update_variant`).
UPDATE_HINTS = Mistakes(
    (HINT_BIAS_NUDGE, HINT_BIAS_GENERIC), format=HINT_BIAS_FORMAT, int_mean=HINT_BIAS_INT_MEAN,
    flipped=HINT_BIAS_FLIPPED, proportional=HINT_BIAS_PROPORTIONAL, relative=HINT_BIAS_PROPORTIONAL,
    at_mean=HINT_BIAS_AT_MEAN, graph=HINT_BIAS_GRAPH)


# --- exercise 5.1: the expert-level balance loss -----------------------------------------


def _balanced_routing(num_tokens: int, num_experts: int, topk: int) -> torch.Tensor:
    """Token t picks experts (t + j N'/K') mod N': every expert equally often."""
    t = torch.arange(num_tokens).unsqueeze(1)
    j = torch.arange(topk).unsqueeze(0)
    return (t + j * (num_experts // topk)) % num_experts


def loss_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int, int]]:
    """``(name, probs [T, N'] float64, topk_idx [T, K'], N', K')`` for the expert-loss checker."""
    cases = []
    g = torch.Generator().manual_seed(5)
    for N, K, T in ((8, 2, 32), (16, 4, 50)):
        probs = torch.softmax(2 * torch.randn(T, N, generator=g, dtype=torch.float64), dim=-1)
        cases.append((f"random routing: N'={N}, K'={K}, T={T}", probs,
                      torch.topk(probs, K, dim=-1).indices, N, K))
    N, K, T = 8, 2, 16
    cases.append((f"perfect balance: N'={N}, K'={K}, T={T}, uniform probabilities",
                  torch.full((T, N), 1.0 / N, dtype=torch.float64), _balanced_routing(T, N, K), N, K))
    N, K, T = 8, 2, 12
    logits = torch.randn(T, N, generator=g, dtype=torch.float64)
    logits[:, :K] += 6.0  # nearly all the probability on experts 0 and 1
    collapse = torch.softmax(logits, dim=-1)
    cases.append((f"collapse: every token picks experts 0 and 1, N'={N}, K'={K}",
                  collapse, torch.arange(K).expand(T, K).clone(), N, K))
    N, K, T, D, M = 8, 2, 24, 4, 1
    probs = torch.softmax(torch.randn(T, N, generator=g, dtype=torch.float64), dim=-1)
    limited = moe.select_experts(probs, K, device_limit=M, num_devices=D)  # off the top-k
    cases.append((f"device-limited routing, M={M} of D={D} devices (topk_idx is not the top-k "
                  f"of probs): N'={N}, K'={K}, T={T}", probs, limited, N, K))
    return cases


def _counts(topk_idx, num_experts, dtype):
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts).to(dtype)


def expert_loss_variant(probs, topk_idx, num_experts, topk, mistake: str | None = None):
    """The expert-level loss, or one classic mistake in it (for hints and tests).

    ``mistake``: ``None`` (right), ``"no_scale"`` (f = count / T), ``"assignments"``
    (f = count / (K'T), the same as averaging over experts), ``"per_token"``
    (f = N' count / T), ``"gates"`` (P from the top-k gates only), ``"own_topk"``
    (counts of ``torch.topk(probs, K')`` instead of ``topk_idx``).
    """
    T = probs.shape[0]
    if mistake == "own_topk":
        topk_idx = torch.topk(probs.detach(), topk, dim=-1).indices
    counts = _counts(topk_idx, num_experts, probs.dtype)
    scale = {None: num_experts / (topk * T), "own_topk": num_experts / (topk * T),
             "gates": num_experts / (topk * T), "no_scale": 1.0 / T,
             "assignments": 1.0 / (topk * T), "per_token": num_experts / T}[mistake]
    f = counts * scale
    if mistake == "gates":
        chosen = torch.zeros_like(probs).scatter(1, topk_idx, 1.0)
        P = (probs * chosen).sum(dim=0) / T
    else:
        P = probs.sum(dim=0) / T
    return (f * P).sum()


def _variant_grad(probs, topk_idx, num_experts, topk, mistake):
    probs = probs.clone().requires_grad_(True)
    expert_loss_variant(probs, topk_idx, num_experts, topk, mistake).backward()
    return probs.grad


LOSS_MISTAKES = ("no_scale", "assignments", "per_token", "gates", "own_topk")


def _same_value(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def check_expert_balance_loss(fn: Callable) -> CheckResult:
    """Check ``fn(probs, topk_idx, num_experts, topk) -> loss`` (coefficient 1).

    ``probs`` is ``[T, N']`` float64 and requires grad; ``topk_idx`` is ``[T, K']`` int64.
    The value must equal :func:`moe_balance.expert_balance_loss`'s (relative 1e-9) and so
    must the gradient of the loss with respect to ``probs``.
    """
    check = Checking("Exercise 5.1: expert_balance_loss", LOSS_HINTS)
    for name, probs, topk_idx, N, K in loss_cases():
        want = float(moe_balance.expert_balance_loss(probs, topk_idx, N, K))
        reference = probs.clone().requires_grad_(True)
        moe_balance.expert_balance_loss(reference, topk_idx, N, K).backward()
        mine = probs.clone().requires_grad_(True)
        case, got = check.run(name, lambda: fn(mine, topk_idx.clone(), N, K), want,
                              compare=lambda *_: False)
        if check.stub:
            break
        if isinstance(got, BaseException):
            check.shows()
            continue
        if isinstance(got, torch.Tensor):
            value = as_number(got.detach()) if got.numel() == 1 else None
        else:
            value = as_number(got)
        if value is None:
            case.detail = f"returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, expected a scalar"
            check.shows({"format"})
            continue
        if not _same_value(value, want):
            case.detail = f"loss {value:.6g}, not the reference's value"
            check.shows({m for m in LOSS_MISTAKES
                         if _same_value(value, float(expert_loss_variant(probs, topk_idx, N, K, m)))})
            continue
        if not isinstance(got, torch.Tensor) or got.grad_fn is None:
            case.detail = f"loss {value:.6g} is right, but it carries no gradient to probs"
            check.shows({"no_grad"})
            continue
        try:
            got.backward()
        except Exception as err:  # noqa: BLE001 - the student's graph, not ours
            case.detail = f"the loss's backward raised {type(err).__name__}: {err}"
            check.shows({"wrong_grad"})
            continue
        if mine.grad is None or not torch.allclose(mine.grad, reference.grad, rtol=1e-9, atol=1e-12):
            worst = "no gradient" if mine.grad is None else \
                f"differs by up to {(mine.grad - reference.grad).abs().max().item():.3g}"
            case.detail = f"loss {value:.6g} is right, but d loss / d probs {worst}"
            if mine.grad is None:
                check.shows({"no_grad"})
            else:  # a mistake whose value happens to be right here shows in the gradient
                check.shows({"wrong_grad"} | {m for m in LOSS_MISTAKES if torch.allclose(
                    mine.grad, _variant_grad(probs, topk_idx, N, K, m), rtol=1e-9, atol=1e-12)})
            continue
        case.passed, case.detail = True, ""
    return check.verdict()


# --- exercise 5.2: biased top-k selection -------------------------------------------------


def topk_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """``(name, scores [T, N'], bias [N'], k)`` for the biased-selection checker."""
    cases = [("the chapter's example: a bias of 1 pushes expert 2 in",
              torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.3, 0.7, 0.6, 0.5]]),
              torch.tensor([0.0, 0.0, 1.0, 0.0]), 2)]
    g = torch.Generator().manual_seed(11)
    scores = torch.sigmoid(torch.randn(20, 8, generator=g))
    cases.append(("zero bias: plain top-k of the scores", scores, torch.zeros(8), 2))
    scores = torch.sigmoid(torch.randn(32, 16, generator=g) + torch.linspace(1.5, -1.5, 16))
    cases.append(("sigmoid scores, a bias that changes many choices, k=4", scores,
                  torch.linspace(-0.3, 0.3, 16), 4))
    scores = torch.sigmoid(torch.randn(12, 8, generator=g))
    cases.append(("a bias that is a leaf requiring grad (it must get none)", scores,
                  torch.linspace(0.2, -0.2, 8).requires_grad_(True), 3))
    return cases


def topk_variant(scores, topk, bias, mistake: str | None = None):
    """Biased top-k, or one classic mistake (for hints and tests)."""
    b = bias.detach()
    selection = {None: scores + b, "biased_gates": scores + b, "normalised": scores + b,
                 "ignores_bias": scores, "subtracted": scores - b}[mistake]
    topk_idx = torch.topk(selection.detach(), topk, dim=-1).indices
    gates = (scores + b if mistake == "biased_gates" else scores).gather(-1, topk_idx)
    if mistake == "normalised":
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return topk_idx, gates


TOPK_MISTAKES = ("biased_gates", "ignores_bias", "subtracted", "normalised")


def _by_expert(topk_idx, gates):
    """Rows sorted by expert index, so any order of the k picks compares equal."""
    order = torch.argsort(topk_idx, dim=-1)
    return topk_idx.gather(-1, order), gates.detach().to(torch.float64).gather(-1, order)


def _same_routing(got, want) -> bool:
    (gi, gg), (wi, wg) = _by_expert(*got), _by_expert(*want)
    return torch.equal(gi, wi) and torch.allclose(gg, wg, rtol=1e-6, atol=1e-7)


def _valid_pair(got, scores, k) -> bool:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return False
    idx, gates = got
    return (isinstance(idx, torch.Tensor) and isinstance(gates, torch.Tensor)
            and idx.shape == (scores.shape[0], k) and gates.shape == (scores.shape[0], k)
            and not idx.is_floating_point() and not idx.is_complex())


def reference_topk(scores, topk, bias):
    """Exercise 5.2's answer from the router's own pieces: pick by ``scores + bias``
    (:func:`tutorial_lib.moe.select_experts`), gate with the unbiased scores."""
    topk_idx = moe.select_experts(scores.detach(), topk, bias)
    return topk_idx, moe.gates_from_scores(scores, topk_idx, normalize=False)


def check_biased_topk(fn: Callable) -> CheckResult:
    """Check ``fn(scores, topk, bias) -> (topk_idx, gates)`` against the library's choice and gates.

    The k picks of a token may come in any order (gates in the same order).  ``scores``
    requires grad: ``gates.sum().backward()`` must give the library's ``scores.grad``, and
    a bias that requires grad must get no gradient.
    """
    check = Checking("Exercise 5.2: biased_topk", TOPK_HINTS)
    for name, scores, bias, k in topk_cases():
        want = reference_topk(scores, k, bias.detach())
        mine_scores = scores.clone().requires_grad_(True)
        mine_bias = bias.detach().clone().requires_grad_(bias.requires_grad)
        case, got = check.run(name, lambda: fn(mine_scores, k, mine_bias), want, compare=lambda *_: False)
        if check.stub:
            break
        if isinstance(got, BaseException):
            check.shows()
            continue
        if not _valid_pair(got, scores, k):
            case.detail = f"returned {type(got).__name__}, not a pair (topk_idx [T, {k}], gates [T, {k}])"
            check.shows({"format"})
            continue
        if not _same_routing(got, want):
            wrong = int((~(_by_expert(*got)[0] == _by_expert(*want)[0]).all(dim=-1)).sum())
            case.detail = (f"{wrong} of {scores.shape[0]} tokens chose other experts" if wrong else
                           "the same experts, but other gate values")
            check.shows({m for m in TOPK_MISTAKES if _same_routing(got, topk_variant(scores, k, bias, m))})
            continue
        gates = got[1]
        if gates.grad_fn is None:
            case.detail = "right experts and gates, but the gates carry no gradient to scores"
            check.shows({"no_grad"})
            continue
        try:
            gates.sum().backward()
        except Exception as err:  # noqa: BLE001
            case.detail = f"gates.sum().backward() raised {type(err).__name__}: {err}"
            check.shows()
            continue
        reference = scores.clone().requires_grad_(True)
        reference_topk(reference, k, bias.detach())[1].sum().backward()
        if mine_scores.grad is None or not torch.allclose(mine_scores.grad, reference.grad):
            case.detail = "right experts and gates, but d gates / d scores differs from the library's"
            check.shows({"no_grad"} if mine_scores.grad is None else set())
            continue
        if mine_bias.grad is not None and bool(mine_bias.grad.abs().sum() > 0):
            case.detail = "the bias received a gradient: it must only steer the choice"
            check.shows({"biased_gates"})
            continue
        case.passed, case.detail = True, ""
    return check.verdict()


# --- exercise 5.3: the bias update ---------------------------------------------------------

SIM_EXPERTS, SIM_TOPK, SIM_TOKENS, SIM_STEPS, SIM_GAMMA = 16, 2, 512, 200, 0.005
SIM_MAX_VIOLATION = 0.15
"""The simulation passes when the last 20 steps' summed load has MaxVio below this (and the
bias follows the library's trajectory); at step 0 it is about 3."""


def update_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """``(name, bias, load, gamma)`` for the direct cases of the bias-update checker."""
    return [
        ("load [3, 1, 2, 2] (mean 2), gamma 0.01",
         torch.zeros(4), torch.tensor([3, 1, 2, 2]), 0.01),
        ("a bias that already moved; loads of 8 experts, two exactly at the mean",
         torch.linspace(-0.05, 0.05, 8), torch.tensor([40, 10, 25, 25, 31, 19, 30, 20]), 0.001),
        ("a bias that is a leaf requiring grad (no graph may be built)",
         torch.zeros(6, requires_grad=True), torch.tensor([9, 1, 5, 6, 4, 5]), 0.01),
    ]


def update_variant(bias, load, gamma, mistake: str | None = None):
    """A new bias tensor: the right rule or one classic mistake (for hints and tests)."""
    with torch.no_grad():
        load = load.to(torch.float64)
        mean = load.mean()
        if mistake == "flipped":
            step = gamma * torch.sign(load - mean)
        elif mistake == "proportional":
            step = gamma * (mean - load)
        elif mistake == "relative":
            step = gamma * (mean - load) / mean
        elif mistake == "at_mean":
            step = torch.where(load > mean, -gamma, gamma).to(torch.float64)
        else:
            step = gamma * torch.sign(mean - load)
        return bias.detach() + step.to(bias.dtype)


UPDATE_MISTAKES = ("flipped", "proportional", "relative", "at_mean")


class _NotABias(TypeError):
    """The update returned something that is not a bias (raised by the simulation)."""


def _explain_error(err: BaseException) -> set:
    """The mistake an exception from the student's update points to, if any."""
    if isinstance(err, _NotABias):
        return {"format"}
    text = str(err)
    if "mean" in text and ("Long" in text or "dtype" in text):
        return {"int_mean"}
    if "leaf Variable that requires grad" in text:
        return {"graph"}
    return set()


def _apply_update(fn, bias, load, gamma):
    """The student's new bias: the returned tensor, or ``bias`` itself if None was returned."""
    out = fn(bias, load, gamma)
    return bias if out is None else out


def simulate_bias_balancing(update: Callable, steps: int = SIM_STEPS, gamma: float = SIM_GAMMA):
    """A skewed sigmoid router balanced by ``update``: ``(MaxVio at step 0, MaxVio of the
    last 20 steps' summed load, final bias)``.

    Expert i's affinity is ``sigmoid(2 - 4 i / (N'-1) + noise)``: expert 0 is strongly
    preferred.  Each step routes ``SIM_TOKENS`` tokens with :func:`reference_topk`
    and calls ``update(bias, load, gamma)`` (in place, or returning the new bias).
    """
    g = torch.Generator().manual_seed(0)
    preference = torch.linspace(2.0, -2.0, SIM_EXPERTS)
    bias = torch.zeros(SIM_EXPERTS)
    recent = torch.zeros(SIM_EXPERTS, dtype=torch.int64)
    first = None
    for step in range(steps):
        scores = torch.sigmoid(preference + torch.randn(SIM_TOKENS, SIM_EXPERTS, generator=g))
        topk_idx, gates = reference_topk(scores, SIM_TOPK, bias.detach())
        load = moe_balance.expert_load(topk_idx, SIM_EXPERTS)
        if first is None:
            first = moe_balance.max_violation(load)
        if step >= steps - 20:
            recent += load
        new = _apply_update(update, bias, load.clone(), gamma)
        if not isinstance(new, torch.Tensor) or new.shape != bias.shape:
            raise _NotABias(f"the update returned {type(new).__name__}, expected a tensor of shape "
                            f"{tuple(bias.shape)}")
        bias = new.detach().to(torch.float32)
    return first, moe_balance.max_violation(recent), bias


@lru_cache(maxsize=None)
def _simulated(mistake: str | None):
    return simulate_bias_balancing(lambda b, load, gamma: update_variant(b, load, gamma, mistake))


def check_update_bias(fn: Callable) -> CheckResult:
    """Check ``fn(bias, load, gamma)``: in place (returning the bias or None) or returning a
    new bias; ``load`` is int64 token counts.  Direct cases, then the simulation."""
    check = Checking("Exercise 5.3: update_bias", UPDATE_HINTS)
    for name, bias, load, gamma in update_cases():
        want = update_variant(bias, load, gamma)
        start = bias.detach().clone().requires_grad_(bias.requires_grad)
        case, got = check.run(name, lambda: _apply_update(fn, start, load.clone(), gamma), want,
                              compare=lambda *_: False)
        if check.stub:
            return check.verdict()
        if isinstance(got, BaseException):
            check.shows(_explain_error(got))
            continue
        if not isinstance(got, torch.Tensor) or got.shape != bias.shape:
            case.detail = f"returned {type(got).__name__}, expected the new bias (shape {tuple(bias.shape)})"
            check.shows({"format"})
            continue
        if not torch.allclose(got.detach().double(), want.double(), atol=1e-7, rtol=0):
            moved = [i for i, (g, w) in enumerate(zip(got.detach().double().tolist(), want.double().tolist()))
                     if abs(g - w) > 1e-7]
            case.detail = (f"bias {[round(v, 6) for v in got.detach().tolist()]}: the bias of "
                           f"expert{'s' if len(moved) > 1 else ''} {moved} is not where the rule puts it")
            check.shows({m for m in UPDATE_MISTAKES if torch.allclose(
                got.detach().double(), update_variant(bias, load, gamma, m).double(), atol=1e-7, rtol=0)})
            continue
        if got.grad_fn is not None:
            case.detail = "right values, but the new bias has a grad_fn: the update built a graph"
            check.shows({"graph"})
            continue
        case.passed, case.detail = True, ""
    name = (f"simulation: {SIM_STEPS} steps of {SIM_TOKENS} tokens, N'={SIM_EXPERTS}, "
            f"K'={SIM_TOPK}, gamma={SIM_GAMMA}, a router that prefers expert 0")
    first, _, want_bias = _simulated(None)
    # run_case, not check.run: a stub was caught above, and the simulation's error is explained below
    case, got = run_case(name, lambda: simulate_bias_balancing(fn), None, compare=lambda *_: False)
    check.add(case)
    if isinstance(got, BaseException):
        check.shows(_explain_error(got))
    else:
        _, got_settled, got_bias = got
        if got_settled < SIM_MAX_VIOLATION and torch.allclose(got_bias, want_bias, atol=1e-5, rtol=0):
            case.passed, case.detail = True, ""
        else:
            case.detail = (f"MaxVio {first:.2f} at the start, {got_settled:.2f} over the last 20 steps"
                           + (f" (it must end below {SIM_MAX_VIOLATION})" if got_settled >= SIM_MAX_VIOLATION
                              else "") + "; the bias does not follow the rule's trajectory")
            check.shows({m for m in UPDATE_MISTAKES
                         if torch.allclose(got_bias, _simulated(m)[2], atol=1e-5, rtol=0)})
    return check.verdict()


__all__ = ["check_expert_balance_loss", "check_biased_topk", "check_update_bias",
           "expert_loss_variant", "topk_variant", "update_variant", "simulate_bias_balancing",
           "loss_cases", "topk_cases", "update_cases"]


# --- exercise 4: a routing the device loss cannot see -------------------------------------

#: Exercise 5.4's cases: (T tokens, N' experts, K' per token, D devices, M devices a token
#: may reach).  Every one has K' >= D: the device loss can only be 1 there.
BLIND_CASES = [(8, 16, 4, 4, 2), (6, 12, 6, 3, 2), (5, 32, 8, 4, 3)]

HINT_BLIND_FORMAT = (
    "return (probs, topk_idx): probs a float tensor [T, N'] of non-negative router "
    "probabilities whose every row sums to 1, topk_idx an integer tensor [T, K'] of "
    "distinct experts per row, each in 0 .. N'-1."
)
HINT_BLIND_REACH = (
    "a token in your routing reaches more than M devices: device-limited routing lets a "
    "token's K' experts live on at most M of the D devices. (Spreading every token over all "
    "D devices gives both values, and breaks the limit the communication loss is about.)"
)
HINT_BLIND_COMM = (
    "your communication loss is below D/M, its largest value. Every device's f'' is at most "
    "D/M, since a device receives each token at most once, and the P'' sum to 1: where must "
    "the router's probability lie for the loss to reach that bound?",
    "put all of the router's probability on a device that every token reaches: its f'' is "
    "then D/M, and so is the loss.",
)
HINT_BLIND_DEVICE_HIGH = (
    "your device loss is above 1: a device that carries the router's probability receives "
    "more than its share, K'T/D, of the T*K' picks (f'_d is 1 exactly at that share).",
    "each token may send only K'/D of its K' picks to the device that holds the "
    "probability; its other picks must go to devices with no probability on them, and "
    "no token may reach more than M devices.",
)
HINT_BLIND_DEVICE_LOW = (
    "your device loss is below 1: the devices that carry the router's probability receive "
    "less than their share, K'T/D, of the picks. (A device every token reaches gets at "
    "least T picks, which is its share only when K' = D: with K' > D it needs more than one "
    "pick per token.)"
)

HINT_BLIND_GENERIC = (
    "build it in two steps: first a routing whose communication loss is D/M (where must "
    "the probability lie?), then count the picks the device carrying the probability "
    "receives, against its share K'T/D."
)

#: The mistakes of exercise 5.4; every one is named whenever a case shows it.
BLIND_MISTAKES = Mistakes(HINT_BLIND_GENERIC, any_case=True, format=HINT_BLIND_FORMAT,
                          reach=HINT_BLIND_REACH, device_high=HINT_BLIND_DEVICE_HIGH,
                          device_low=HINT_BLIND_DEVICE_LOW, comm=HINT_BLIND_COMM)


def _read_routing(answer, tokens: int, experts: int, topk: int):
    """``(probs as float64, topk_idx as int64)`` if ``answer`` is a valid routing, else None."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return None
    probs, idx = answer
    if not (isinstance(probs, torch.Tensor) and isinstance(idx, torch.Tensor)):
        return None
    if tuple(probs.shape) != (tokens, experts) or tuple(idx.shape) != (tokens, topk):
        return None
    if idx.is_floating_point() or idx.is_complex() or not probs.is_floating_point():
        return None
    probs, idx = probs.detach().to(torch.float64), idx.detach().to(torch.int64)
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        return None
    if not torch.allclose(probs.sum(dim=1), torch.ones(tokens, dtype=torch.float64),
                          atol=1e-6):
        return None
    if bool((idx < 0).any()) or bool((idx >= experts).any()):
        return None
    if any(len(set(row)) != topk for row in idx.tolist()):
        return None
    return probs, idx


def blind_losses(probs, topk_idx, experts: int, topk: int, devices: int, reach: int):
    """The device and communication balance losses of a routing (coefficient 1)."""
    return (float(moe_balance.device_balance_loss(probs, topk_idx, experts, topk, devices)),
            float(moe_balance.communication_balance_loss(probs, topk_idx, experts, devices,
                                                         reach)))


def check_blind_routing(fn: Callable) -> CheckResult:
    """Check ``fn(T, N', K', D, M) -> (probs, topk_idx)``: a device-limited routing whose
    device balance loss is 1 and whose communication balance loss is ``D / M``, computed
    by :mod:`tutorial_lib.moe_balance` on every case of :data:`BLIND_CASES`."""
    check = Checking("Exercise 5.4: blind_routing", BLIND_MISTAKES)
    for tokens, experts, topk, devices, reach in BLIND_CASES:
        name = f"T={tokens}, N'={experts}, K'={topk}, D={devices}, M={reach}"
        case, got = check.attempt(name, lambda: fn(tokens, experts, topk, devices, reach))
        if check.stub:
            check.add(case)
            break
        if isinstance(got, BaseException):
            check.add(case)
            check.shows()
            continue
        routing = _read_routing(got, tokens, experts, topk)
        if routing is None:
            check.add(Case(name, False, "not a routing of this case's shape (see the hint)"))
            check.shows({"format"})
            continue
        probs, idx = routing
        per_device = experts // devices
        most = max(len({e // per_device for e in row}) for row in idx.tolist())
        device, comm = blind_losses(probs, idx, experts, topk, devices, reach)
        shown = set()
        if most > reach:
            shown.add("reach")
        if device > 1 + 1e-9:
            shown.add("device_high")
        elif device < 1 - 1e-9:
            shown.add("device_low")
        if comm < devices / reach - 1e-9:
            shown.add("comm")
        if not shown:
            check.add(Case(name, True))
            continue
        check.add(Case(name, False, f"your routing: device loss {device:.4f}, communication "
                                    f"loss {comm:.4f}; its tokens reach up to {most} of the "
                                    f"{devices} devices"))
        check.shows(shown)
    return check.verdict()


__all__ += ["check_blind_routing", "blind_losses", "BLIND_CASES"]


# --- exercise 5.5: predict the balance numbers ----------------------------------------------

#: Exercise 5.5's routings: name -> (N' experts, K' per token, each token's picks, the
#: router probabilities of every token over experts 0 .. N'-1, the same for all tokens).
BALANCE_ROUTINGS = {
    "A": (8, 2, ((0, 1), (0, 1), (0, 1), (0, 1)), (1 / 8,) * 8),
    "B": (4, 2, ((0, 1), (0, 2), (0, 3), (0, 1)), (0.4, 0.3, 0.2, 0.1)),
    "C": (4, 2, ((1, 2), (1, 3), (2, 3), (1, 2)), (0.6, 0.1, 0.2, 0.1)),
}
#: What is predicted of each routing: the expert-level loss (coefficient 1), the MaxVio of
#: the expert load, and the direction (-1, 0 or +1) of each expert's bias after one V3 step.
BALANCE_QUANTITIES = ("loss", "maxvio", "bias")
BALANCE_GAMMA = 0.001

HINT_PREDICT_FORMAT = (
    "return a dict with nine entries keyed (routing, quantity), routing 'A', 'B' or 'C' "
    "and quantity 'loss', 'maxvio' or 'bias': a number for 'loss' and 'maxvio', and for "
    "'bias' a list with one direction per expert (N' of them), each -1, 0 or +1."
)
HINT_PREDICT_NO_SCALE = (
    "your loss looks like f_i = count_i / T: a factor N'/K' is missing. Which factor makes "
    "f_i equal 1 for an expert that gets exactly its share of the picks?",
    "f_i = N'/(K'T) * count_i: the count scaled so that a balanced expert has f_i = 1. "
    "Multiply each f_i by P_i, the mean probability of expert i, and sum.",
)
HINT_PREDICT_ASSIGNMENTS = (
    "your loss is N' times too small: f_i is not the fraction of the K'T picks that went to "
    "expert i, but that fraction times N' (or you averaged f_i P_i over the experts instead "
    "of summing).",
    "f_i = N'/(K'T) * count_i, and L = sum over ALL experts of f_i P_i, not their mean.",
)
HINT_PREDICT_PER_TOKEN = (
    "your loss is K' times too large: the counts are divided by the K'T picks, not by the "
    "T tokens. Each token picks K' experts.",
    "f_i = N'/(K'T) * count_i: with balanced counts K'T/N' per expert, f_i is then 1.",
)
HINT_PREDICT_GATES = (
    "P_i averages expert i's probability over ALL T tokens, also the tokens that did not "
    "pick it: here every token gives every expert the probability listed.",
    "P_i = (1/T) * sum_t s_{i,t}: in these routings every token has the same probabilities, "
    "so P_i is simply the listed probability of expert i.",
)
HINT_PREDICT_OWN_TOPK = (
    "count the picks the routing lists, not the top-K' of the probabilities: a bias or a "
    "device limit may send a token elsewhere, and f_i counts where it went.",
)
HINT_PREDICT_CLOSED_FORM = (
    "N'/K' is the loss only when the picks AND the probability both sit on the same K' "
    "experts. The loss is a product: where is the router's probability in this routing?",
    "compute it rather than recall it: f_i from the picks, P_i from the probabilities, "
    "L = sum_i f_i P_i.",
)
HINT_PREDICT_ONE = (
    "1 is the loss of a perfectly balanced routing (and of any routing whose probabilities "
    "are uniform). Is that the case here?",
    "compute it rather than recall it: f_i = N'/(K'T) * count_i from the picks, P_i from "
    "the probabilities, L = sum_i f_i P_i. It can be above or below 1.",
)
HINT_PREDICT_RATIO = (
    "MaxVio subtracts the mean before dividing by it: (max load - mean load) / mean load. "
    "Your value reads like max / mean, which is 1 at perfect balance instead of 0.",
)
HINT_PREDICT_MEAN_TOKENS = (
    "the mean load is the K'T picks over the N' experts, K'T/N', not T/N': a token is "
    "counted once for every expert it picks.",
)
HINT_PREDICT_FLIPPED = (
    "the bias moves against the imbalance: an expert above the mean load gets a LOWER "
    "bias, so fewer tokens choose it next step; one below the mean gets a higher one.",
    "direction = sign(mean load - load_i): negative for an overloaded expert.",
)
HINT_PREDICT_AT_MEAN = (
    "an expert whose load is exactly the mean keeps its bias: sign(0) = 0. Which experts "
    "are exactly at the mean here?",
)
HINT_PREDICT_GENERIC = (
    "for each routing, count the load of every expert from the picks first, and its mean "
    "K'T/N'; MaxVio, f_i and the bias directions all come from those counts.",
    "loads from the picks; MaxVio = (max - mean) / mean; f_i = N'/(K'T) * count_i and "
    "P_i = the mean probability, L = sum_i f_i P_i; bias direction = sign(mean - load_i).",
)

#: The mistakes of exercise 5.5; every one a failing case shows is named.
PREDICT_MISTAKES = Mistakes(
    HINT_PREDICT_GENERIC, any_case=True, format=HINT_PREDICT_FORMAT,
    no_scale=HINT_PREDICT_NO_SCALE, assignments=HINT_PREDICT_ASSIGNMENTS,
    per_token=HINT_PREDICT_PER_TOKEN, gates=HINT_PREDICT_GATES, own_topk=HINT_PREDICT_OWN_TOPK,
    closed_form=HINT_PREDICT_CLOSED_FORM, one=HINT_PREDICT_ONE, ratio=HINT_PREDICT_RATIO,
    mean_tokens=HINT_PREDICT_MEAN_TOKENS, flipped=HINT_PREDICT_FLIPPED,
    at_mean=HINT_PREDICT_AT_MEAN)


def balance_routing(name: str):
    """``(probs [T, N'] float64, topk_idx [T, K'] int64, N', K')`` of one of
    :data:`BALANCE_ROUTINGS`."""
    experts, topk, picks, row = BALANCE_ROUTINGS[name]
    probs = torch.tensor([row] * len(picks), dtype=torch.float64)
    return probs, torch.tensor(picks, dtype=torch.int64), experts, topk


def library_balance(name: str) -> dict:
    """What the library computes for routing ``name``: ``{"loss": float, "maxvio": float,
    "bias": [direction per expert]}``, from :func:`moe_balance.expert_balance_loss`,
    :func:`moe_balance.max_violation` of :func:`moe_balance.expert_load`, and the sign of
    the change :func:`moe_balance.update_expert_bias` makes to a zero bias."""
    probs, topk_idx, experts, topk = balance_routing(name)
    load = moe_balance.expert_load(topk_idx, experts)
    bias = moe_balance.update_expert_bias(torch.zeros(experts), load, BALANCE_GAMMA)
    return {"loss": float(moe_balance.expert_balance_loss(probs, topk_idx, experts, topk)),
            "maxvio": moe_balance.max_violation(load),
            "bias": [int(v) for v in torch.sign(bias).tolist()]}


def balance_variants(name: str, quantity: str) -> dict:
    """The value each classic mistake predicts for one quantity of routing ``name``."""
    probs, topk_idx, experts, topk = balance_routing(name)
    load = moe_balance.expert_load(topk_idx, experts).double()
    mean = float(load.mean())
    if quantity == "loss":
        out = {m: float(expert_loss_variant(probs, topk_idx, experts, topk, m))
               for m in ("no_scale", "assignments", "per_token", "gates", "own_topk")}
        return {**out, "closed_form": experts / topk, "one": 1.0}
    if quantity == "maxvio":
        tokens_mean = len(topk_idx) / experts
        return {"ratio": float(load.max()) / mean,
                "mean_tokens": (float(load.max()) - tokens_mean) / tokens_mean}
    return {"flipped": [int(v) for v in torch.sign(load - mean).tolist()],
            "at_mean": [-1 if v > mean else 1 for v in load.tolist()]}


def _read_directions(value, experts: int) -> list[int] | None:
    numbers = as_whole_numbers(value)
    if numbers is None or len(numbers) != experts or any(v not in (-1, 0, 1) for v in numbers):
        return None
    return numbers


def check_predicted_balance(fn: Callable) -> CheckResult:
    """Check ``fn() -> {(routing, quantity): prediction}`` against what
    :mod:`tutorial_lib.moe_balance` computes for every routing of :data:`BALANCE_ROUTINGS`
    (:func:`library_balance`).  A wrong prediction is shown as given; the library's value
    is not printed."""
    check = Checking("Exercise 5.5: predicted_balance", PREDICT_MISTAKES)
    opened = check.prediction(fn)
    if opened is None:
        return check.verdict()
    got, _ = opened
    for routing in BALANCE_ROUTINGS:
        truth = library_balance(routing)
        experts = BALANCE_ROUTINGS[routing][0]
        for quantity in BALANCE_QUANTITIES:
            name = f"{routing}, {quantity}"
            given = got.get((routing, quantity))
            if quantity == "bias":
                mine = _read_directions(given, experts)
                same = mine is not None and mine == truth["bias"]
            else:
                mine = as_number(given)
                same = mine is not None and math.isclose(mine, truth[quantity],
                                                         rel_tol=1e-6, abs_tol=1e-9)
            if mine is None:
                check.add(Case(name, False, "missing from the dict" if given is None else
                               f"got {given!r}: not readable as a "
                               + ("list of directions" if quantity == "bias" else "number")))
                check.shows({"format"})
                continue
            if same:
                check.add(Case(name, True))
                continue
            check.add(Case(name, False, f"got {mine!r}: not what the library computes"))
            variants = balance_variants(routing, quantity)
            if quantity == "bias":
                check.shows({m for m, v in variants.items() if v == mine})
            else:
                check.shows({m for m, v in variants.items()
                             if not math.isclose(v, truth[quantity], rel_tol=1e-6, abs_tol=1e-9)
                             and math.isclose(mine, v, rel_tol=1e-6, abs_tol=1e-9)})
    return check.verdict()


__all__ += ["check_predicted_balance", "library_balance", "balance_variants",
            "balance_routing", "BALANCE_ROUTINGS", "BALANCE_QUANTITIES"]
