"""Checkers for chapter 13, choosing a layout.

* :func:`check_pick_layout`: the student's ``fn(model, where, gpus, global_batch_size) ->
  layout`` (a :class:`~tutorial_lib.costs.step_time.Layout`, or a dict of its field names:
  ``tp``, ``pp``, ``dp`` and optionally ``cp``, ``schedule``, ``virtual_pipeline_size``,
  ``micro_batch_size``, ``recompute_granularity``, ``sharding``) for a model on a number of
  nodes.  It passes when the layout keeps every rule, fits in memory and its predicted
  step time is within :data:`TOLERANCE` of the fastest layout the planner finds.  A layout
  whose sizes do not multiply to the GPUs, one that does not fit, and one whose TP leaves
  the node each get a hint; a slow one gets the generic hint.  No output names the
  planner's best layout or its step time.
* :func:`check_tp_stops_paying`: ``fn(model, where, gpus, global_batch_size) -> int``, the
  smallest TP size (a power of two) whose best step time, PP = CP = 1 and everything else
  searched, is longer than at half that TP.  Returning the fastest TP (one step too early)
  and the first TP that leaves the node each get a hint.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

import functools
from dataclasses import fields
from typing import Callable

from ..config import ConfigError
from ..costs.hardware import cluster
from ..costs.model_flops import gpt
from ..costs.step_time import Layout, check_layout, predict_step
from ..plan import MATMUL_EFFICIENCY, TP_SIZES, plan
from .kit import CheckResult, Checking, Mistakes, as_number

# --- exercise 13.1: pick a layout -------------------------------------------------------

TOLERANCE = 0.10
"""How much slower than the planner's fastest layout an answer may be."""

#: (name, model, GPU, nodes, global batch): a model that needs TP on two A100 nodes, a
#: small one on one H100 node, a 70B model on eight H100 nodes.
PICK_CASES = [("GPT 13B on 2 nodes of A100 80GB", gpt(40, 5120, 40), "a100-80gb", 2, 256),
              ("GPT 1.3B on 1 node of H100", gpt(24, 2048, 16), "h100-sxm", 1, 128),
              ("GPT 70B on 8 nodes of H100", gpt(80, 8192, 64), "h100-sxm", 8, 256)]

HINT_PICK_FORMAT = ("return a Layout, or a dict with at least 'tp', 'pp' and 'dp' (and "
                    "optionally cp, schedule, micro_batch_size, recompute_granularity, sharding).")
HINT_PICK_WORLD = "TP x CP x PP x DP must equal the number of GPUs: every GPU holds one rank."
HINT_PICK_RULES = ("the layout breaks one of the course's rules (check_layout names it): TP "
                   "must divide the heads, PP the layers, DP x micro-batch the global batch.")
HINT_PICK_MEMORY = ("the layout does not fit in memory: ask the memory model "
                    "(layout_memory) first, as the decision flow does, before any timing.")
HINT_PICK_TP_NODE = ("TP's all-reduces cross the network once TP is larger than a node: "
                     "keep TP inside one node and reach further with PP or DP.")
HINT_PICK_NUDGE = ("walk the decision flow: does DP alone fit? else the smallest TP inside a "
                   "node that fits; else PP. Then compare a few candidates with predict_step.")
HINT_PICK_GENERIC = ("the layout fits but is slower than the planner's best by more than the "
                     "tolerance: compare the parts of its step (compute, TP, DP, bubble) with "
                     "those of a neighbouring layout, and try the micro-batch size and the "
                     "distributed optimizer.")

PICK_HINTS = Mistakes((HINT_PICK_NUDGE, HINT_PICK_GENERIC), any_case={"format"},
                      format=HINT_PICK_FORMAT, world=HINT_PICK_WORLD, rules=HINT_PICK_RULES,
                      tp_node=HINT_PICK_TP_NODE, memory=HINT_PICK_MEMORY)

_FIELDS = {f.name for f in fields(Layout)}


def _read_layout(answer) -> Layout | None:
    if isinstance(answer, Layout):
        return answer
    if not isinstance(answer, dict) or not {"tp", "pp", "dp"} <= set(answer) \
            or set(answer) - _FIELDS:
        return None
    try:
        return Layout(**answer)
    except TypeError:
        return None


def _case_cluster(gpu: str, nodes: int):
    where = cluster(gpu)
    return where, nodes * where.gpus_per_node


@functools.lru_cache(maxsize=64)
def _planners_best(model, where, gpus: int, global_batch_size: int):
    """The planner's fastest layout that fits, kept per case: a kernel that checks again,
    and the reference's layout and time asked apart, do not search again."""
    return plan(model, where, gpus, global_batch_size, top=1).layouts[0]


def best_step_time(model, where, gpus: int, global_batch_size: int) -> float:
    """The planner's fastest layout that fits: its predicted step time."""
    return _planners_best(model, where, gpus, global_batch_size).step_time_s


def judge_layout(layout: Layout, model, where, gpus: int, global_batch_size: int,
                 best: float) -> str:
    """``"ok"``, or the first mistake the layout shows (a name of :data:`PICK_HINTS`)."""
    if layout.world_size != gpus:
        return "world"
    try:
        check_layout(model, layout, global_batch_size)
        result = predict_step(model, where, layout, global_batch_size, MATMUL_EFFICIENCY)
    except (ConfigError, TypeError, ValueError, ZeroDivisionError):
        return "rules"
    if not result.fits:
        return "memory"
    if result.step_time_s <= (1 + TOLERANCE) * best:
        return "ok"
    return "tp_node" if layout.tp > where.gpus_per_node else "slow"


def reference_pick_layout(model, where, gpus: int, global_batch_size: int) -> Layout:
    """The planner's fastest layout."""
    return _planners_best(model, where, gpus, global_batch_size).layout


def check_pick_layout(fn: Callable) -> CheckResult:
    """``fn(model, where, gpus, global_batch_size)``; see the module docstring."""
    check = Checking("Exercise 13.1: pick a layout", PICK_HINTS)
    for name, model, gpu, nodes, batch in PICK_CASES:
        where, gpus = _case_cluster(gpu, nodes)
        best = best_step_time(model, where, gpus, batch)
        verdicts = {}

        def verdict(answer, _=None, args=(model, where, gpus, batch, best)):
            layout = _read_layout(answer)
            if layout is None:
                return False
            verdicts["last"] = judge_layout(layout, *args)
            return verdicts["last"] == "ok"

        case, got = check.run(name, lambda: fn(model, where, gpus, batch), None,
                              compare=verdict)
        if not case.passed and not isinstance(got, BaseException):
            layout = _read_layout(got)
            if layout is not None:
                case.detail = (f"got {layout.describe()}: "
                               + {"world": "its sizes do not multiply to the GPUs",
                                  "rules": "it breaks a rule of the grid",
                                  "memory": "it does not fit in memory",
                                  "tp_node": "it fits, but is too slow",
                                  "slow": "it fits, but is too slow"}[verdicts["last"]])
        check.judge(case, got, _read_layout,
                    lambda layout: set() if verdicts.get("last") == "slow"
                    else {verdicts.get("last", "format")}, exceptions=False)
    return check.verdict()


# --- exercise 13.2: where TP stops paying -----------------------------------------------

#: (name, model, GPU, GPUs per node, GPUs, global batch): one model of 64 heads, TP up to 32.
TP_CASES = [("GPT 20B, 64 A100 80GB, 8 per node", gpt(44, 6144, 64), "a100-80gb", 8, 64, 256),
            ("GPT 20B, 64 A100 80GB, 4 per node", gpt(44, 6144, 64), "a100-80gb", 4, 64, 256),
            ("GPT 20B, 64 A100 80GB, 2 per node", gpt(44, 6144, 64), "a100-80gb", 2, 64, 256),
            ("GPT 20B, 64 H100, 16 per node", gpt(44, 6144, 64), "h100-sxm", 16, 64, 256)]

HINT_TP_FORMAT = "return one whole number: a TP size."
HINT_TP_FASTEST = ("that is the fastest TP, the last one that still pays: the answer is the "
                   "first TP whose step is longer than the TP before it.")
HINT_TP_LEAVES = ("the step time can already rise inside a node: each doubling of TP also "
                  "doubles the microbatches per rank and the share of bytes each ring moves.")
HINT_TP_NUDGE = ("for each TP (1, 2, 4, ...) ask the planner for its best step with that TP "
                 "and PP and CP held at 1; a TP with no layout that fits has no step time, so "
                 "it cannot be where the time rises.")
HINT_TP_GENERIC = ("re-read 'Rooflines: NVLink against the network': compare each TP's step "
                   "time with the one at half its size, from the smallest TP that fits.")

TP_HINTS = Mistakes((HINT_TP_NUDGE, HINT_TP_GENERIC), any_case={"format"},
                    format=HINT_TP_FORMAT, fastest=HINT_TP_FASTEST, leaves=HINT_TP_LEAVES)


def tp_step_times(model, where, gpus: int, global_batch_size: int) -> dict[int, float]:
    """TP size -> the planner's best step time with PP = CP = 1 (only the TPs that fit)."""
    return dict(_tp_step_times(model, where, gpus, global_batch_size))


@functools.lru_cache(maxsize=64)
def _tp_step_times(model, where, gpus, global_batch_size) -> tuple:
    times = {}
    for tp in TP_SIZES:
        if tp > gpus:
            break
        try:
            best = plan(model, where, gpus, global_batch_size,
                        fixed={"tp": tp, "pp": 1, "cp": 1}, top=1).layouts[0]
        except ConfigError:
            continue
        times[tp] = best.step_time_s
    return tuple(times.items())


def reference_tp_stops_paying(model, where, gpus: int, global_batch_size: int) -> int | None:
    """The smallest TP whose best step is longer than at half that TP (``None``: never)."""
    times = tp_step_times(model, where, gpus, global_batch_size)
    for tp, seconds in times.items():
        if tp // 2 in times and seconds > times[tp // 2]:
            return tp
    return None


def _tp_mistakes(model, where, gpus, batch) -> dict[str, int]:
    times = tp_step_times(model, where, gpus, batch)
    return {"fastest": min(times, key=times.get), "leaves": 2 * where.gpus_per_node}


def check_tp_stops_paying(fn: Callable) -> CheckResult:
    """``fn(model, where, gpus, global_batch_size)``; see the module docstring."""
    check = Checking("Exercise 13.2: where TP stops paying", TP_HINTS)
    for name, model, gpu, per_node, gpus, batch in TP_CASES:
        where = cluster(gpu, gpus_per_node=per_node)
        want = reference_tp_stops_paying(model, where, gpus, batch)
        case, got = check.run(name, lambda: fn(model, where, gpus, batch), want,
                              compare=lambda g, w: as_number(g) == w)
        if not case.passed and not isinstance(got, BaseException) and as_number(got) is not None:
            case.detail = f"got TP {as_number(got):g}; the step time rises at another TP"

        def explain(number, args=(model, where, gpus, batch), want=want):
            return {m for m, v in _tp_mistakes(*args).items() if number == v and v != want}
        check.judge(case, got, as_number, explain, exceptions=False)
    return check.verdict()


__all__ = ["check_pick_layout", "check_tp_stops_paying", "reference_pick_layout",
           "reference_tp_stops_paying", "judge_layout", "best_step_time", "tp_step_times",
           "PICK_CASES", "TP_CASES", "TOLERANCE"]
