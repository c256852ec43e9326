"""Checkers for chapter 12, sharded data parallelism.

* :func:`check_state_bytes`: the student's ``fn(unit_numels, dp, strategy) -> bytes``, what
  one rank keeps between steps for weights, gradients and optimizer state (fp32, Adam)
  under ``optim_grads`` (ZeRO-2) or ``optim_grads_params`` (ZeRO-3), as
  :mod:`tutorial_lib.fully_sharded_data_parallel` holds it: each unit's flat vector padded
  to a multiple of ``dp``, one slice of ``ceil(n / dp)`` per rank.  Forgetting the padding,
  keeping the whole gradients under ZeRO-2, keeping the whole weights under ZeRO-3 and
  leaving out the fp32 master slice each get a hint.
* :func:`check_backward_gathers`: ``fn(num_blocks, prefetch, reshard_root) -> [(unit,
  prefetched), ...]``, the all-gathers one backward issues under ZeRO-3, in order, units
  named ``"root"`` and ``"layers.i"``.  The forward's order, the root last, a root gathered
  that stayed gathered and wrong prefetch flags each get a hint.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

from typing import Callable

from ..costs.memory_model import unit_slice_numel
from .kit import CheckResult, Checking, Mistakes, as_number, check_formula

# --- exercise 12.1: what a rank keeps under ZeRO-2 and ZeRO-3 -----------------------------

#: (unit sizes, root first; DP; strategy): the chapter's model, then padded and larger ones.
STATE_CASES = [((1184, 3280, 3280), 4, "optim_grads"), ((1184, 3280, 3280), 4, "optim_grads_params"),
               ((1001, 2050, 2050, 2050), 8, "optim_grads"),
               ((1001, 2050, 2050, 2050), 8, "optim_grads_params"),
               ((524_288_000,) + (201_359_360,) * 32, 64, "optim_grads_params"),
               ((7, 5), 3, "optim_grads")]

HINT_STATE_FORMAT = "return one number: the bytes one rank keeps between steps."
HINT_STATE_PADDING = (
    "each unit's flat vector is padded to a multiple of DP before it is cut, so a rank's "
    "slice of a unit is ceil(n / DP) elements, unit by unit."
)
HINT_STATE_WHOLE_GRADS = (
    "under optim_grads the whole gradients are freed once a unit's reduce-scatter has them: "
    "between steps only the fp32 gradient of the rank's slices remains."
)
HINT_STATE_WEIGHTS = (
    "under optim_grads_params no whole weight stays between steps: the unsharded buffers are "
    "freed after each unit's backward; the fp32 slice the optimizer steps is the weight."
)
HINT_STATE_MASTER = (
    "the optimizer steps an fp32 slice of its own (main_param, 4 bytes per element) besides "
    "Adam's two moments (8 bytes)."
)
HINT_STATE_NUDGE = (
    "count per element of the rank's slices: its gradient, the fp32 slice itself and "
    "Adam's two moments; then add the whole weights where the strategy keeps them."
)
HINT_STATE_GENERIC = (
    "re-read 'What each stage keeps': reconsider, for the strategy of the case, which of "
    "the weights, their gradients and the optimizer's state a rank holds whole and which "
    "only as its slice."
)

STATE_HINTS = Mistakes((HINT_STATE_NUDGE, HINT_STATE_GENERIC), any_case={"format"},
                       format=HINT_STATE_FORMAT, padding=HINT_STATE_PADDING,
                       whole_grads=HINT_STATE_WHOLE_GRADS, weights=HINT_STATE_WEIGHTS,
                       master=HINT_STATE_MASTER)


def reference_state_bytes(unit_numels, dp: int, strategy: str) -> int:
    """Weights + gradients + optimizer bytes of one rank between steps (fp32 Adam)."""
    mine = sum(unit_slice_numel(n, dp) for n in unit_numels)
    whole = 4 * sum(unit_numels) if strategy == "optim_grads" else 0
    return whole + (4 + 4 + 8) * mine


def _state_mistakes(unit_numels, dp, strategy) -> dict[str, int]:
    want = reference_state_bytes(unit_numels, dp, strategy)
    mine = sum(unit_slice_numel(n, dp) for n in unit_numels)
    whole = 4 * sum(unit_numels)
    return {"padding": want - 16 * mine + 16 * sum(unit_numels) / dp,
            "whole_grads": want + whole if strategy == "optim_grads" else -1,
            "weights": want + whole if strategy == "optim_grads_params" else -1,
            "master": want - 4 * mine}


def check_state_bytes(fn: Callable) -> CheckResult:
    """``fn(unit_numels, dp, strategy)``; see the module docstring."""
    cases = {f"{len(units)} units, DP {dp}, {strategy}": (list(units), dp, strategy)
             for units, dp, strategy in STATE_CASES}
    return check_formula("Exercise 12.1: what a rank keeps under ZeRO-2 and ZeRO-3",
                         STATE_HINTS, fn, cases, reference_state_bytes, _state_mistakes,
                         "bytes; the rank keeps another amount")


# --- exercise 12.2: the all-gathers of a backward ------------------------------------------

#: (num_blocks, prefetch, reshard_root)
GATHER_CASES = [(2, True, True), (3, True, True), (3, False, True), (4, True, False),
                (1, True, True), (5, False, False)]

HINT_GATHER_FORMAT = ("return a list of (unit, prefetched) pairs, units named 'root' and "
                      "'layers.0', 'layers.1', ...")
HINT_GATHER_FORWARD_ORDER = (
    "the blocks come in the forward's order: in which order does backward reach them?"
)
HINT_GATHER_ROOT_LAST = (
    "the root's gather is not where it belongs: which layer's backward runs first, and in "
    "which unit does that layer live?"
)
HINT_GATHER_ROOT_KEPT = (
    "with the root not resharded after forward: is anything of it still to gather when "
    "backward starts?"
)
HINT_GATHER_FLAGS = (
    "the prefetched flags are off: with prefetch on, which unit issues each gather, and is "
    "that ahead of the unit's own backward? And without prefetch?"
)
HINT_GATHER_NUDGE = (
    "walk the backward: which unit's backward starts first, which next, and who issues the "
    "next unit's gather when prefetch is on?"
)
HINT_GATHER_GENERIC = (
    "re-read 'Prefetch on the timeline': reconsider in which order backward reaches the "
    "units, which of them are still gathered when it starts, and which unit issues each "
    "gather."
)

GATHER_HINTS = Mistakes((HINT_GATHER_NUDGE, HINT_GATHER_GENERIC), any_case={"format"},
                        format=HINT_GATHER_FORMAT, forward_order=HINT_GATHER_FORWARD_ORDER,
                        root_last=HINT_GATHER_ROOT_LAST, root_kept=HINT_GATHER_ROOT_KEPT,
                        flags=HINT_GATHER_FLAGS)


def reference_backward_gathers(num_blocks: int, prefetch: bool, reshard_root: bool) -> list:
    """The backward's all-gathers in issue order, under the hooks' rules."""
    blocks = [(f"layers.{i}", prefetch) for i in reversed(range(num_blocks))]
    return ([("root", False)] if reshard_root else []) + blocks


def _read_gathers(answer):
    try:
        pairs = [(str(unit), bool(flag)) for unit, flag in answer]
    except (TypeError, ValueError):
        return None
    return pairs


def _gather_mistakes(num_blocks, prefetch, reshard_root) -> dict[str, list]:
    want = reference_backward_gathers(num_blocks, prefetch, reshard_root)
    root = want[:1] if reshard_root else []
    blocks = want[len(root):]
    return {"forward_order": root + blocks[::-1],
            "root_last": blocks + root,
            "root_kept": [("root", False)] + blocks if not reshard_root else None,
            "flags": root + [(unit, not flag) for unit, flag in blocks]}


def check_backward_gathers(fn: Callable) -> CheckResult:
    """``fn(num_blocks, prefetch, reshard_root)``; see the module docstring."""
    check = Checking("Exercise 12.2: the all-gathers of a backward", GATHER_HINTS)
    for blocks, prefetch, reshard_root in GATHER_CASES:
        want = reference_backward_gathers(blocks, prefetch, reshard_root)
        name = f"{blocks} blocks, prefetch={prefetch}, reshard_root={reshard_root}"
        case, got = check.run(name, lambda: fn(blocks, prefetch, reshard_root), want,
                              compare=lambda g, w: _read_gathers(g) == w)
        if not case.passed and not isinstance(got, BaseException) and _read_gathers(got):
            case.detail = f"got {len(_read_gathers(got))} gathers; the backward issues others"

        def explain(pairs, args=(blocks, prefetch, reshard_root), want=want):
            return {m for m, v in _gather_mistakes(*args).items() if v is not None
                    and v != want and pairs == v}
        check.judge(case, got, _read_gathers, explain, exceptions=False)
    return check.verdict()


__all__ = ["check_state_bytes", "check_backward_gathers", "reference_state_bytes",
           "reference_backward_gathers", "STATE_CASES", "GATHER_CASES"]
