"""Checkers for chapter 11, zero-bubble schedules and DualPipe.

* :func:`check_place_weights`: the student's ``fn(pp_size, num_microbatches, rank) ->
  [Action]`` takes 1F1B's list of one rank (:func:`~tutorial_lib.pipeline_parallel.schedules.one_f_one_b`,
  each backward now B, the input's gradient) and adds one ``Action("weight", i)`` per
  microbatch.  The checker plays every rank's list in
  :func:`~tutorial_lib.pipeline_parallel.simulator.simulate` with the course's costs (F 1, B 2 of
  which W 1) and asks for ZB-H1's two properties: the bubble ``(PP - 1)(F + B - 2W)``
  and at most ``PP`` microbatches held (counted until their W).  Any placement with both
  passes, ZB-H1's own or another.  It names the mistakes: a W right after its B (1F1B's
  bubble), the W's all saved for the end (the memory of GPipe), a W before its B.
* :func:`check_idle_times`: the student's ``fn(pp, f, b, w)`` returns the idle time per
  rank of 1F1B, ZB-H1, DualPipeV and DualPipe running the same model on ``pp`` ranks;
  the checker compares each with the simulated schedules.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable

from ..pipeline_parallel import build_schedules
from ..pipeline_parallel.actions import Action
from ..pipeline_parallel.formulas import peak_activations_in_flight
from ..pipeline_parallel.schedules import one_f_one_b
from ..pipeline_parallel.simulator import COSTS, SimulationError, idle_time, simulate
from .kit import Case, Checking, CheckResult, Mistakes, as_number

F, B, W = COSTS["F"], COSTS["B"], COSTS["W"]

# --- exercise 11.1: place the W's ----------------------------------------------------------

#: (PP, M) of the cases: a full pipeline (M >= PP), PP 2 to 5.
PLACE_CASES = [(2, 4), (3, 3), (3, 6), (4, 8), (5, 7)]

HINT_PLACE_TYPE = ("return a list of tutorial_lib.pipeline_parallel.actions.Action: 1F1B's list "
                   "(one_f_one_b(pp, m, rank)) with one Action('weight', i) added for each "
                   "microbatch i.")
HINT_NOT_1F1B = (
    "keep 1F1B's forwards, backwards and messages as they are, in their order "
    "(one_f_one_b(pp, m, rank)): the exercise only adds the W's, one Action('weight', i) "
    "per microbatch, somewhere after backward i."
)
HINT_W_BEFORE_B = (
    "a W runs before its B: the weight gradient dW = X^T dY needs dY, the gradient that "
    "arrives for B. Put weight i somewhere after backward i."
)
HINT_W_COUNT = "each microbatch needs exactly one W: one Action('weight', i) for i in 0 .. M - 1."
HINT_RIGHT_AFTER = (
    ("the bubble is still 1F1B's. A W placed right after its B runs while the rank the "
     "gradient went to is waiting for the next one: it delays this rank's next B, and so "
     "the whole chain of B's back to rank 0.",
     "the last ranks must hurry their B's: re-read 'ZB-H1: 1F1B with the W's deferred' and "
     "reconsider how many W's rank r can defer, and where the W's still owed go.")
)
HINT_HOARDING = (
    "the W's wait too long. Saved for the end, they leave the cool-down's gaps idle (the "
    "B's there still wait for each other) and keep microbatches alive: a microbatch's "
    "activations stay until its W (dW = X^T dY needs each layer's input X), so a rank may "
    "end up holding more than PP of them. Run the oldest W owed after each B once the rank "
    "has deferred enough."
)
HINT_PLACE_NUDGE = (
    "a W may wait, but not forever: where is this rank idle in 1F1B (the warm-up, the "
    "cool-down), and which W's could fill those gaps without delaying a B?"
)
HINT_PLACE_GENERIC = (
    "re-read 'ZB-H1: 1F1B with the W's deferred': reconsider how many W's a rank may "
    "defer before its B's stop delaying the ranks downstream, and where the W's owed at "
    'the end go.'
)
#: The mistakes of exercise 11.1, in order of preference.
PLACE_HINTS = Mistakes(
    (HINT_PLACE_NUDGE, HINT_PLACE_GENERIC), any_case={"type", "not_1f1b", "w_before_b", "count"},
    single=True, type=HINT_PLACE_TYPE, not_1f1b=HINT_NOT_1F1B, w_before_b=HINT_W_BEFORE_B,
    count=HINT_W_COUNT, right_after=HINT_RIGHT_AFTER, hoarding=HINT_HOARDING)


def _read_list(got, pp: int, m: int, rank: int) -> tuple[str | None, str]:
    """(mistake, detail) for one rank's list, or (None, "") when its shape is right."""
    if not isinstance(got, (list, tuple)) or not all(isinstance(a, Action) for a in got):
        return "type", f"rank {rank}: got {type(got).__name__}, not a list of Action"
    if [a for a in got if a.kind != "weight"] != one_f_one_b(pp, m, rank):
        return "not_1f1b", f"rank {rank}: without its W's the list is not 1F1B's"
    weights = sorted(a.microbatch for a in got if a.kind == "weight")
    if weights != list(range(m)) or any(a.chunk for a in got if a.kind == "weight"):
        return "count", f"rank {rank}: W's for microbatches {weights}, not one per microbatch"
    done = set()
    for a in got:
        if a.kind == "backward":
            done.add(a.microbatch)
        if a.kind == "weight" and a.microbatch not in done:
            return "w_before_b", f"rank {rank}: W{a.microbatch} comes before B{a.microbatch}"
    return None, ""


def _weights_last(actions: list[Action]) -> bool:
    """Whether every W of the list comes after its last B (saved for the end)."""
    kinds = [a.kind for a in actions if a.is_compute]
    last_b = max((i for i, k in enumerate(kinds) if k == "backward"), default=-1)
    return all(i > last_b for i, k in enumerate(kinds) if k == "weight")


def check_place_weights(fn: Callable[[int, int, int], list]) -> CheckResult:
    """Play ``fn(pp_size, num_microbatches, rank)`` for every rank: ZB-H1's bubble and memory."""
    check = Checking("Exercise 11.1: place the W's", PLACE_HINTS)
    for pp, m in PLACE_CASES:
        name = f"PP={pp}, M={m}"
        lists, failed = {}, None
        for rank in range(pp):
            case, got = check.attempt(name, lambda r=rank: fn(pp, m, r))
            if isinstance(got, Exception):
                failed = case
                break
            mistake, detail = _read_list(got, pp, m, rank)
            if mistake is not None:
                check.shows({mistake})
                failed = Case(name, False, detail)
                break
            lists[rank] = list(got)
        if failed is None:
            try:
                timed = simulate(lists, Fraction(F), Fraction(B), 0, Fraction(W))
            except SimulationError as err:
                check.shows()
                failed = Case(name, False, f"simulating every rank: {str(err).splitlines()[0]}")
        if failed is None:
            idle = idle_time(timed)
            peaks = [peak_activations_in_flight(lists[r]) for r in range(pp)]
            at_end = all(_weights_last(lists[r]) for r in range(pp))
            if idle == (pp - 1) * (F + B):
                check.shows({"right_after"})
                failed = Case(name, False, f"each rank idles {idle}: as long as in 1F1B")
            elif idle != (pp - 1) * (F + B - 2 * W):
                check.shows({"hoarding"} if at_end else set())
                failed = Case(name, False, f"a rank idles {idle} time units, more "
                                           f"than ZB-H1's placement leaves")
            elif max(peaks) > pp:
                check.shows({"hoarding"})
                failed = Case(name, False, f"the bubble is right; the ranks hold up to "
                                           f"{max(peaks)} microbatches, more than PP = {pp}")
        check.add(failed or Case(name, True))
    return check.verdict()


# --- exercise 11.2: the idle time of four schedules ------------------------------------------

#: (pp ranks, F, B, W) of the cases: even pp (DualPipe), the DualPipe table's premise
#: F = B - W and W <= F.
IDLE_CASES = [(2, 1, 2, 1), (4, 1, 2, 1), (4, 2, 3, 1), (6, 1, 2, 1), (8, 2, 4, 2),
              (4, 1, Fraction(3, 2), Fraction(1, 2))]
IDLE_SCHEDULES = ("1f1b", "zb-h1", "dualpipev", "dualpipe")

HINT_IDLE_FORMAT = ('return a dict with a number for each of "1f1b", "zb-h1", "dualpipev" '
                    'and "dualpipe": the most any rank idles (every rank computes as '
                    'much), in the units of f, b and w.')
HINT_V_RANKS = (
    "DualPipeV's table row counts stages, not ranks: pp ranks hold 2 pp stages, so its "
    "(PP/2 - 1) is (pp - 1) here; and each of those stages is half of one of 1F1B's, so "
    "its F, B and W are f/2, b/2 and w/2 (F&B = F + B)."
)
HINT_V_HALVES = (
    "each of DualPipeV's 2 pp stages holds half as many layers as a 1F1B stage on the same "
    "pp ranks: put f/2, b/2 and w/2 (and F&B = (f + b)/2) into its row."
)
HINT_DUAL_STAGES = (
    "DualPipe on pp ranks has pp stages per copy (each rank holds one stage of each copy): "
    "its (PP/2 - 1) is (pp/2 - 1), with the whole stage's f, b, w and F&B = f + b."
)
HINT_ZB = (
    "ZB-H1 keeps 1F1B's bubble minus what the W's take off the B chain: re-read 'The "
    "table of bubbles and memory' and reconsider how many W's leave each hop."
)
HINT_IDLE_NUDGE = (
    "count stages and chunk costs per schedule before using the table: 1F1B and ZB-H1 "
    "have pp stages of cost f, b, w; DualPipeV 2 pp stages of half that; DualPipe pp "
    "stages per copy, whole."
)
HINT_IDLE_GENERIC = (
    "re-read 'The table of bubbles and memory': reconsider, for each schedule, how many "
    "stages the pp ranks hold and what one stage's F, B and W cost in f, b and w before "
    'using its row.'
)
IDLE_HINTS = Mistakes((HINT_IDLE_NUDGE, HINT_IDLE_GENERIC), any_case={"format"},
                      format=HINT_IDLE_FORMAT, v_ranks=HINT_V_RANKS, v_halves=HINT_V_HALVES,
                      dual_stages=HINT_DUAL_STAGES, zb=HINT_ZB)


def simulated_idle_times(pp: int, f, b, w) -> dict:
    """The reference: each schedule simulated with free messages, the same model on ``pp``
    ranks (the V's chunks cost half a stage), the most any rank idles."""
    out = {}
    for name in IDLE_SCHEDULES:
        m = 2 * pp + 2
        scale = Fraction(1, 2) if name == "dualpipev" else 1
        timed = simulate(build_schedules(name, pp, m), Fraction(f) * scale,
                         Fraction(b) * scale, 0, Fraction(w) * scale)
        out[name] = idle_time(timed)
    return out


def _idle_mistakes(name: str, value: float, pp: int, f, b, w) -> set[str]:
    wrong = {"dualpipev": {"v_ranks": (pp / 2 - 1) * (f / 2 + b / 2 + b / 2 - 3 * w / 2),
                           "v_halves": (pp - 1) * (f + b + b - 3 * w)},
             "dualpipe": {"dual_stages": (pp - 1) * (f + b + b - 3 * w)},
             "zb-h1": {"zb": (pp - 1) * (f + b)}}.get(name, {})
    return {mistake for mistake, x in wrong.items() if abs(value - float(x)) < 1e-9}


def check_idle_times(fn: Callable) -> CheckResult:
    """Compare ``fn(pp, f, b, w)``'s four idle times with the simulated schedules."""
    check = Checking("Exercise 11.2: the idle time of four schedules", IDLE_HINTS)
    for pp, f, b, w in IDLE_CASES:
        want = simulated_idle_times(pp, f, b, w)
        label = f"pp={pp}, f={f}, b={b}, w={w}"
        case, got = check.attempt(label, lambda: fn(pp, f, b, w))
        if isinstance(got, Exception):
            check.add(case)
            if not check.stub:
                check.shows()
            continue
        if not isinstance(got, dict):
            check.add(Case(label, False, f"got {type(got).__name__}, not a dict"))
            check.shows({"format"})
            continue
        for name in IDLE_SCHEDULES:
            value = as_number(got.get(name))
            if value is None:
                check.add(Case(f"{label}: {name}", False, "missing, or not a number"))
                check.shows({"format"})
            elif abs(value - float(want[name])) < 1e-9:
                check.add(Case(f"{label}: {name}", True))
            else:
                check.add(Case(f"{label}: {name}", False,
                               f"got {value:g}: not the simulated {name}'s idle time"))
                check.shows(_idle_mistakes(name, value, pp, f, b, w))
    return check.verdict()


__all__ = ["check_place_weights", "check_idle_times", "simulated_idle_times", "PLACE_HINTS",
           "IDLE_HINTS", "PLACE_CASES", "IDLE_CASES"]
