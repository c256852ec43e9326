"""Checkers for chapter 6, pipeline parallelism in the 4D grid.

* :func:`check_one_f_one_b`: the student's ``fn(pp_size, num_microbatches, rank) -> [Action]``
  writes one rank's non-interleaved 1F1B list.  The checker compares every rank's list
  with :func:`tutorial_lib.pipeline_parallel.schedules.one_f_one_b` for PP = 1 .. 5 (most cases at
  PP >= 3, where a wrong peer shows), then plays the student's lists of all ranks together
  in :func:`~tutorial_lib.pipeline_parallel.simulator.simulate`.  It names the classic mistakes: a
  wrong warm-up count, a wrong peer, a backward before its forward, missing labels.
* :func:`check_bubble`: the student's ``fn(pp, m, v)`` predicts the bubble, as the idle
  fraction of the step (a number), or under a stated definition, ``("step", x)`` or
  ``("ideal", x)`` (idle time over the ideal, bubble-free time: the Megatron paper's); the
  checker compares it with that definition's closed form and with the simulated schedule.
* :func:`check_stage_holdings`: the student's ``fn(num_layers, pp, v, rank) -> dict`` says
  which layers a rank holds (all its chunks), whether it holds the embedding and the head,
  and what it does with the labels.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Callable

from ..deepseek import layer_range
from ..pipeline_parallel import build_schedules
from ..pipeline_parallel.actions import Action
from ..pipeline_parallel.formulas import expected_bubble
from ..pipeline_parallel.schedules import gpipe, num_warmup_microbatches, one_f_one_b
from ..pipeline_parallel.simulator import (DeadlockError, SimulationError, bubble_fraction,
                                           simulate)
from .kit import Case, Checking, CheckResult, Mistakes, as_number

# --- exercise 6.1: one rank's 1F1B list ------------------------------------------------------

#: (PP, M) of the cases: PP = 1 and 2 for the edges, most at PP >= 3 where peers differ.
ONE_F_ONE_B_CASES = [(1, 3), (2, 1), (2, 4), (3, 2), (3, 6), (4, 3), (4, 8), (5, 2), (5, 7)]

HINT_WARMUP = (
    "the warm-up count is wrong: rank r runs min(PP - r - 1, M) forwards before its first "
    "backward (num_warmup_microbatches). The last stage has none, it alternates from the "
    "start; rank 0 fills the PP - 1 stages after it; and never more forwards than there are "
    "microbatches."
)
HINT_BACKWARD_FIRST = (
    "a backward runs before the forward of the same microbatch. In the steady state each "
    "pair is: forward of microbatch warmup + i, THEN backward of microbatch i. On the last "
    "stage (no warm-up) that means F0 B0 F1 B1 ..."
)
HINT_PEER = (
    "a message goes to or comes from the wrong rank. Activations go r -> r + 1 and their "
    "gradients come back r + 1 -> r: so recv_grad is FROM the next rank (receiving it from "
    "the previous one is the classic bug), send_grad TO the previous one. Labels go from rank 0 "
    "to rank PP - 1."
)
HINT_LABELS = (
    "the labels are missing or in the wrong place: with PP > 1, rank 0 sends microbatch k's "
    "labels to rank PP - 1 just before forward k (send_labels), and rank PP - 1 receives them "
    "just before its forward k (recv_labels), which computes the loss."
)
HINT_MESSAGES = (
    "the compute order is right but the messages are not: before a forward, receive the "
    "activation from the previous rank (not on rank 0); after it, send the output to the next "
    "rank (not on the last). Before a backward, receive the gradient from the next rank (not "
    "on the last); after it, send the input's gradient to the previous rank (not on rank 0)."
)
HINT_ORDER = (
    "the order of forwards and backwards differs from 1F1B: warm-up forwards 0 .. w - 1, then "
    "M - w pairs (forward w + i, backward i), then the remaining w backwards."
)
HINT_TYPE = ("return a list of tutorial_lib.pipeline_parallel.actions.Action, e.g. "
             "[Action('recv_activation', 0, peer=0), Action('forward', 0), ...].")
HINT_DEADLOCK = (
    "every rank has the library's computes and messages, but played together the ranks block: inside "
    "one gap between two computes, post the send before the receive (a send never waits, a "
    "receive does)."
)


def _gaps(actions: list[Action]) -> list[tuple[str, Counter]]:
    """Each compute with the multiset of messages just before it; the last entry: after the end."""
    out, pending = [], Counter()
    for a in actions:
        if a.is_compute:
            out.append((a.label, pending))
            pending = Counter()
        else:
            pending[(a.kind, a.microbatch, a.chunk, a.peer)] += 1
    out.append(("end", pending))
    return out


def _diagnose(got: list[Action], want: list[Action], pp: int, m: int, rank: int) -> tuple[str | None, str]:
    """(mistake name, one-line detail) for a rank whose list differs from the reference.

    ``(None, "")`` when only the order of messages inside a gap between two computes
    differs: that may be fine, and the simulation of all ranks decides.
    """
    if not isinstance(got, (list, tuple)) or not all(isinstance(a, Action) for a in got):
        return "type", f"rank {rank}: got {type(got).__name__}, not a list of Action"
    computes = [a for a in got if a.is_compute]
    forwards = [a for a in computes if a.kind == "forward"]
    stray = [a for a in computes if not 0 <= a.microbatch < m]
    if stray:
        name = "warmup" if len(forwards) > m else "order"
        return name, (f"rank {rank}: {stray[0].label} runs microbatch {stray[0].microbatch}, but the "
                      f"microbatches are 0 .. {m - 1}")
    seen = set()
    for a in computes:
        if a.kind == "backward" and a.microbatch not in seen:
            return "backward_first", f"rank {rank}: backward {a.microbatch} comes before forward {a.microbatch}"
        if a.kind == "forward":
            seen.add(a.microbatch)
    if [a.label for a in computes] != [a.label for a in want if a.is_compute]:
        kinds = [a.kind for a in computes]
        before = kinds.index("backward") if "backward" in kinds else len(kinds)
        warmup = num_warmup_microbatches(pp, m, rank)
        # warm-up forwards, then the first steady pair's forward, then the first backward
        if before != min(warmup + 1, m):
            return "warmup", (f"rank {rank}: {before} forwards before the first backward, not "
                              f"the 1F1B count (computes {' '.join(a.label for a in computes)})")
        return "order", (f"rank {rank}: computes {' '.join(a.label for a in computes)}: the "
                         "warm-up is right, the order after it is not")
    by_key = {(a.kind, a.microbatch): a.peer for a in want if not a.is_compute}
    for a in got:
        if not a.is_compute and (a.kind, a.microbatch) in by_key and by_key[(a.kind, a.microbatch)] != a.peer:
            return "peer", (f"rank {rank}: {a.kind} of microbatch {a.microbatch} with rank {a.peer}, "
                            "the wrong neighbour")
    for (label, mine), (_, ref) in zip(_gaps(got), _gaps(want)):
        if mine != ref:
            missing, extra = ref - mine, mine - ref
            what = "labels" if any(k[0].endswith("labels") for k in missing + extra) else "messages"
            parts = []
            if missing:  # named by kind only: which microbatch and peer is the answer
                kinds = sorted({k[0] for k in missing})
                parts.append(f"a {' and a '.join(kinds)} is missing")
            if extra:
                parts.append("unexpected " + ", ".join(f"{k[0]} {k[1]} (peer {k[3]})" for k in extra))
            where = "after the last compute" if label == "end" else f"before {label}"
            return what, f"rank {rank}, {where}: {'; '.join(parts)}"
    return None, ""  # the same messages around the same computes, in another order: simulate


#: The mistakes of exercise 6.1, in order of preference: the first rank whose list
#: differs names one (see ``_diagnose``), and any case's mistake is reported.
ONE_F_ONE_B_HINTS = Mistakes(
    HINT_ORDER, any_case=True, single=True, type=HINT_TYPE, backward_first=HINT_BACKWARD_FIRST,
    warmup=HINT_WARMUP, order=HINT_ORDER, peer=HINT_PEER, labels=HINT_LABELS,
    messages=HINT_MESSAGES, deadlock=HINT_DEADLOCK)


def check_one_f_one_b(fn: Callable[[int, int, int], list]) -> CheckResult:
    """Compare ``fn(pp_size, num_microbatches, rank)`` with the library's 1F1B; simulate it."""
    check = Checking("Exercise 6.1: one rank's 1F1B action list", ONE_F_ONE_B_HINTS)
    for pp, m in ONE_F_ONE_B_CASES:
        name = f"PP={pp}, M={m}"
        lists, failed = {}, None
        for rank in range(pp):
            want = one_f_one_b(pp, m, rank)
            case, got = check.attempt(name, lambda r=rank: fn(pp, m, r), want,
                                      compare=lambda g, w: isinstance(g, (list, tuple)) and list(g) == w)
            if isinstance(got, Exception):
                failed = case
                break
            lists[rank] = got
            if not case.passed:
                kind, detail = _diagnose(got, want, pp, m, rank)
                if kind is not None:
                    check.shows({kind})
                    failed = Case(name, False, detail)
                    break
        if failed is None:
            try:
                simulate({r: list(acts) for r, acts in lists.items()})
            except SimulationError as err:  # only reachable if the lists differ within a gap
                check.shows({"deadlock"})
                failed = Case(name, False, f"simulating every rank's list: {str(err).splitlines()[0]}")
        check.add(failed or Case(name, True))
    return check.verdict()


# --- exercise 6.2: predict the bubble --------------------------------------------------------

BUBBLE_CASES = [(1, 4, 1), (2, 2, 1), (3, 6, 1), (4, 4, 1), (4, 8, 1), (8, 16, 1), (4, 8, 2),
                (2, 4, 3), (3, 9, 3)]

#: The two definitions of the bubble in use, as closed forms of (PP, M, V), equal stages and
#: free messages.  ``step``: the idle fraction of the step, this course's (what
#: :func:`tutorial_lib.viz.timeline.bubble_fraction` measures).  ``ideal``: the idle time
#: over the ideal time ``M (t_f + t_b)``, the Megatron paper's "bubble time fraction"
#: (Narayanan et al., SC 2021, sections 2.2.1 and 2.2.2): ``(PP - 1) / M``, and
#: ``(PP - 1) / (V M)`` interleaved.  The two name the same idle time:
#: ``step = ideal / (1 + ideal)``.
BUBBLE_DEFINITIONS = {
    "step": lambda pp, m, v: (pp - 1) / (v * m + pp - 1),
    "ideal": lambda pp, m, v: (pp - 1) / (v * m),
}

HINT_IDLE_OVER_WORK = (
    "you divided the idle time by the useful work, (PP - 1) / (V M): that is the Megatron "
    "paper's bubble time fraction, idle time over the ideal time. If you meant it, say so: "
    "return (\"ideal\", value). A bare number is read as the fraction of the whole step, "
    "which is the work plus the idle time: (PP - 1) / (V M + PP - 1)."
)
HINT_WRONG_DEFINITION = (
    "your value is the other definition's. \"step\": idle time over the whole step, "
    "(PP - 1) / (V M + PP - 1); \"ideal\": idle time over the ideal, bubble-free time, "
    "(PP - 1) / (V M). They name the same idle time: step = ideal / (1 + ideal)."
)
HINT_FORGOT_V = (
    "with V chunks per rank each fill and drain step costs one chunk, 1/V of a stage: the "
    "bubble is (PP - 1) / (V * M + PP - 1) of the step ((PP - 1) / (V M) of the ideal time)."
)
HINT_BUBBLE_FORMAT = (
    "return a number (the idle fraction of the step) or a pair (definition, number) with "
    "definition \"step\" or \"ideal\", e.g. (\"ideal\", 0.75)."
)
HINT_BUBBLE_NUDGE = (
    "count in units of one microbatch's forward + backward on one stage: how many of them "
    "does a rank work, and how many does it wait while the pipeline fills and drains? The "
    "bubble is the waiting over the whole step (or, stated as (\"ideal\", x), over the work)."
)
HINT_BUBBLE_GENERIC = (
    "count in units of one microbatch's forward + backward on one stage: each rank works M of "
    "them and waits PP - 1 (the fill before its first forward and the drain after its last "
    "backward), so the idle fraction of the step is (PP - 1) / (M + PP - 1); with "
    "interleaving the wait shrinks to (PP - 1) / V."
)
#: The mistakes of exercise 6.2: named only when they explain every wrong prediction.
BUBBLE_HINTS = Mistakes((HINT_BUBBLE_NUDGE, HINT_BUBBLE_GENERIC), any_case={"format"}, format=HINT_BUBBLE_FORMAT,
                        idle_over_work=HINT_IDLE_OVER_WORK,
                        wrong_definition=HINT_WRONG_DEFINITION, forgot_v=HINT_FORGOT_V)


def stated_bubble(answer) -> tuple[str | None, float | None]:
    """``(definition, value)`` of a student's answer: a bare number is the fraction of the
    step; ``("step", x)`` and ``("ideal", x)`` state theirs; anything else ``(None, None)``."""
    if isinstance(answer, (tuple, list)) and len(answer) == 2 and isinstance(answer[0], str):
        definition = answer[0].strip().lower()
        if definition in BUBBLE_DEFINITIONS:
            return definition, as_number(answer[1])
        return None, None
    value = as_number(answer)
    return ("step", value) if value is not None else (None, None)


def check_bubble(fn: Callable[[int, int, int], float]) -> CheckResult:
    """Compare ``fn(pp, m, v)`` with the closed form of the definition it states (a bare
    number: the fraction of the step) and with the simulated schedule."""
    check = Checking("Exercise 6.2: predict the bubble", BUBBLE_HINTS)
    for pp, m, v in BUBBLE_CASES:
        schedule = "interleaved" if v > 1 else "1f1b"
        simulated = float(bubble_fraction(simulate(build_schedules(schedule, pp, m, v), Fraction(1, v),
                                                   Fraction(2, v))))
        formula = expected_bubble(pp, m, v)
        assert abs(simulated - formula) < 1e-12  # the library's own claim, checked here too
        # the simulated idle time over the simulated work: the paper's definition
        over_ideal = simulated / (1 - simulated)
        assert abs(over_ideal - BUBBLE_DEFINITIONS["ideal"](pp, m, v)) < 1e-12

        def judge(got, _want, pp=pp, m=m, v=v):
            definition, value = stated_bubble(got)
            return (definition is not None and value is not None
                    and abs(value - BUBBLE_DEFINITIONS[definition](pp, m, v)) < 1e-9)

        case, got = check.run(f"PP={pp}, M={m}, V={v}", lambda: fn(pp, m, v), formula,
                              compare=judge)
        if case.passed or isinstance(got, Exception):
            continue
        definition, value = stated_bubble(got)
        if definition is None or value is None:
            case.detail = f"got {got!r}: not a number, nor (\"step\" or \"ideal\", number)"
            check.shows({"format"})
            continue
        case.detail = (f"got {got!r}: not the bubble of the simulated {schedule} schedule under "
                       f"the {definition} definition")
        other = "ideal" if definition == "step" else "step"
        if pp > 1 and abs(value - BUBBLE_DEFINITIONS[other](pp, m, v)) < 1e-9:
            stated = isinstance(got, (tuple, list))
            check.shows({"wrong_definition" if stated or other == "step" else "idle_over_work"})
        elif abs(value - BUBBLE_DEFINITIONS[definition](pp, m, 1)) < 1e-9:
            check.shows({"forgot_v"})
        else:
            check.shows()
    return check.verdict()


# --- exercise 6.3: who holds what --------------------------------------------------------------

HOLDINGS_CASES = [(4, 1, 1, 0), (8, 2, 1, 0), (8, 2, 1, 1), (12, 3, 1, 1), (8, 2, 2, 0), (8, 2, 2, 1),
                  (12, 3, 2, 2), (12, 2, 3, 0), (16, 4, 2, 3)]

HINT_CONTIGUOUS = (
    "with interleaving a rank's chunks are NOT neighbours: chunk c of rank r is model stage "
    "c * PP + r (layer_range(num_layers, PP * V, c * PP + r)), so rank 0 holds stages 0, PP, "
    "2 PP, ...: the pipeline visits every rank V times."
)
HINT_HEAD = (
    "the head (final norm, LM head, loss) sits on the LAST model stage, V * PP - 1, which is "
    "chunk V - 1 of rank PP - 1; the embedding on model stage 0, chunk 0 of rank 0. The "
    "labels follow: rank 0 sends them, the rank with the head receives them (nobody moves "
    "labels when PP = 1)."
)
HINT_HOLDINGS_TYPE = ("return a dict with keys 'layers' (list of global layer indices, chunk by "
                      "chunk), 'embedding' (bool), 'head' (bool) and 'labels' ('send', 'recv' or None).")
HINT_HOLDINGS_NUDGE = (
    "number the model stages 0 .. PP * V - 1, each a block of consecutive layers; which model "
    "stages does rank r run, in which order, and which of them holds the embedding, the head?"
)
HINT_HOLDINGS_GENERIC = (
    "model stage s holds layers [s L / (PP V), (s + 1) L / (PP V)); rank r runs model stages "
    "r, PP + r, 2 PP + r, ... in that order."
)
#: The mistakes of exercise 6.3, in order of preference; any case's mistake is reported.
HOLDINGS_HINTS = Mistakes(
    (HINT_HOLDINGS_NUDGE, HINT_HOLDINGS_GENERIC), any_case=True, type=HINT_HOLDINGS_TYPE, contiguous=HINT_CONTIGUOUS,
    ends=HINT_HEAD)


def stage_holdings(num_layers: int, pp: int, v: int, rank: int) -> dict:
    """The reference: what pipeline rank ``rank`` holds with ``V = v`` chunks per rank."""
    stages = [c * pp + rank for c in range(v)]
    layers = [i for s in stages for i in layer_range(num_layers, pp * v, s)]
    labels = None if pp == 1 else "send" if rank == 0 else "recv" if rank == pp - 1 else None
    return {"layers": layers, "embedding": 0 in stages, "head": pp * v - 1 in stages, "labels": labels}


def _iterable(value) -> bool:
    return hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict))


def check_stage_holdings(fn: Callable[[int, int, int, int], dict]) -> CheckResult:
    """Compare ``fn(num_layers, pp, v, rank)`` with :func:`stage_holdings`."""
    check = Checking("Exercise 6.3: which rank holds which layers, and the label path", HOLDINGS_HINTS)
    for layers, pp, v, rank in HOLDINGS_CASES:
        want = stage_holdings(layers, pp, v, rank)

        def same(got, expected):
            return isinstance(got, dict) and {k: (list(got[k]) if k == "layers" else got[k])
                                              for k in expected if k in got} == expected

        case, got = check.run(f"L={layers}, PP={pp}, V={v}, rank {rank}", lambda: fn(layers, pp, v, rank),
                              want, compare=same)
        if not case.passed and not isinstance(got, Exception):
            if not isinstance(got, dict) or set(want) - set(got):
                case.detail = f"got {got!r}, not a dict with keys {sorted(want)}"
                check.shows({"type"})
                continue
            wrong = [k for k in want if (list(got[k]) if k == "layers" and _iterable(got[k])
                                         else got[k]) != want[k]]
            case.detail = f"got {got!r}: wrong {', '.join(repr(k) for k in wrong)}"
            per = layers // (pp * v)
            contiguous = list(range(rank * v * per, (rank + 1) * v * per))
            shown = set()
            if (_iterable(got["layers"]) and list(got["layers"]) == contiguous
                    and contiguous != want["layers"]):
                shown.add("contiguous")
            if (got["embedding"], got["head"], got["labels"]) != (want["embedding"], want["head"],
                                                                   want["labels"]):
                shown.add("ends")
            check.shows(shown)
    return check.verdict()


# --- exercise 6.4: mix GPipe and 1F1B, predict the deadlock ----------------------------------

#: Exercise 6.4's pipelines: name -> (what the student reads, PP, M, the ranks that run
#: GPipe; every other rank runs 1F1B).
MIXED_SCENARIOS = {
    "A": ("PP = 4, M = 4: rank 3 runs GPipe, ranks 0 to 2 run 1F1B", 4, 4, (3,)),
    "B": ("PP = 4, M = 4: rank 1 runs GPipe, ranks 0, 2 and 3 run 1F1B", 4, 4, (1,)),
    "C": ("PP = 4, M = 8: rank 1 runs GPipe, ranks 0, 2 and 3 run 1F1B", 4, 8, (1,)),
    "D": ("PP = 4, M = 6: rank 2 runs 1F1B, ranks 0, 1 and 3 run GPipe", 4, 6, (0, 1, 3)),
    "E": ("PP = 4, M = 2: rank 3 runs GPipe, ranks 0 to 2 run 1F1B", 4, 2, (3,)),
}

HINT_MIXED_FORMAT = (
    "return a dict from each scenario name in MIXED_SCENARIOS ('A' .. 'E') to None when the "
    "step completes, or to the two ranks that end up waiting on each other, e.g. {1, 2}."
)
HINT_MIXED_NEVER = (
    "sends never wait in this simulator (they are buffered), so no rank can block in a "
    "send; but a receive waits for a message its peer may only send after it has received "
    "something itself. Follow the first gradient: when does each rank send it, and what "
    "does it need before that?",
    "a 1F1B rank r sends min(PP - r, M) activations, then waits for the gradient of "
    "microbatch 0 before sending the next one. A GPipe rank sends the gradient of "
    "microbatch 0 only after all M forwards. Put the two side by side, rank r before rank "
    "r + 1.",
)
HINT_MIXED_COUNT = (
    "whether a mixed pipeline deadlocks depends on the counts: work out, rank by rank, how many activations a rank sends "
    "before it waits for its first gradient (min(PP - r, M) on a 1F1B rank r, all M on a "
    "GPipe rank), and how many its next rank must receive before it sends that gradient.",
)
HINT_MIXED_PAIR = (
    "the two ranks of a deadlock here are neighbours, one waiting for an activation, the "
    "other for a gradient: find the first rank r that stops sending activations before "
    "rank r + 1 has received all it needs to send its first gradient back.",
)
HINT_MIXED_GENERIC = (
    "for each pair of neighbours r, r + 1: how many activations does r send before it "
    "needs its first gradient, and how many must r + 1 receive before it sends one?"
)

#: The mistakes of exercise 6.4, in order of preference.
MIXED_MISTAKES = Mistakes(HINT_MIXED_GENERIC, any_case={"format"}, format=HINT_MIXED_FORMAT,
                          never=HINT_MIXED_NEVER, count=HINT_MIXED_COUNT, pair=HINT_MIXED_PAIR)


def mixed_schedules(pp: int, m: int, gpipe_ranks) -> dict[int, list[Action]]:
    """Every rank's list: GPipe on ``gpipe_ranks``, 1F1B on the others."""
    return {r: gpipe(pp, m, r) if r in gpipe_ranks else one_f_one_b(pp, m, r)
            for r in range(pp)}


def simulated_deadlock(pp: int, m: int, gpipe_ranks) -> frozenset | None:
    """Play the mixed pipeline in :func:`~tutorial_lib.pipeline_parallel.simulator.simulate`: None
    when it completes, else the ranks blocked on each other (each waits for the other)."""
    try:
        simulate(mixed_schedules(pp, m, gpipe_ranks))
    except DeadlockError as err:
        waiting = err.waiting
        return frozenset(r for r, a in waiting.items()
                         if a.peer in waiting and waiting[a.peer].peer == r)
    return None


_NO_DEADLOCK = ("none", "no", "ok", "completes", "finishes", "")


def _read_prediction(value):
    """None (no deadlock), a frozenset of ranks, or ``...`` when unreadable."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        return None if value.strip().lower() in _NO_DEADLOCK else ...
    if isinstance(value, (set, frozenset, list, tuple)):
        if not value:
            return None
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return frozenset(value)
    return ...


def check_mixed_deadlock(fn: Callable) -> CheckResult:
    """Check ``fn() -> {scenario: None or two ranks}`` against the lockstep simulator run on
    every pipeline of :data:`MIXED_SCENARIOS`.  A wrong prediction is shown as given; the
    simulator's outcome is not printed."""
    check = Checking("Exercise 6.4: mixed_deadlock", MIXED_MISTAKES)
    opened = check.prediction(fn)
    if opened is None:
        return check.verdict()
    got, _ = opened
    for name, (_, pp, m, gpipe_ranks) in MIXED_SCENARIOS.items():
        given = _read_prediction(got[name]) if name in got else ...
        if given is ...:
            check.add(Case(name, False, "missing from the dict" if name not in got else
                           f"got {got[name]!r}: neither None nor a set of ranks"))
            check.shows({"format"})
            continue
        want = simulated_deadlock(pp, m, gpipe_ranks)
        if given == want:
            check.add(Case(name, True))
            continue
        check.add(Case(name, False, f"got {sorted(given) if given else None}: not what the "
                                    "simulated step did"))
        check.shows({"never"} if given is None else {"count"} if want is None else {"pair"})
    return check.verdict()
