"""The bubble claim, measured: the real executor with stages of known cost (SyntheticStage).

For GPipe and 1F1B at PP = 3 and 4 and several M, the idle fraction of the recorded compute
spans is close to (PP - 1) / (M + PP - 1): never more than 0.02 below it, at most 0.08 above
(real messages and wake-ups from a sleep only add idle time).  Interleaving (V = 2) idles less
than 1F1B at the same PP and M.  And the executor's count of activations in flight equals
``expected_peak_activations`` on every rank, for interleaving at M = PP (Megatron-Core >= 0.10's
warm-up, fewer than all V M chunks on the later ranks) and M = 2 PP.  Each run is measured 3 times and the smallest
bubble kept (measured again if still above the band): other processes can only add idle time.
"""
from __future__ import annotations

import pytest

from tutorial_lib.launch import launch
from tutorial_lib.pipeline_parallel.synthetic import (measure_synthetic_schedules,
                                                      synthetic_run_name)
from tutorial_lib.pipeline_parallel.formulas import expected_bubble, expected_peak_activations
from tutorial_lib.viz.timeline import bubble_fraction

pytestmark = pytest.mark.dist

FORWARD, BACKWARD, REPEATS = 0.020, 0.040, 3
ABOVE, BELOW = 0.08, 0.02


def runs_for(pp):
    return ([(schedule, m, 1) for schedule in ("gpipe", "1f1b") for m in (2, pp, 2 * pp)]
            + [("interleaved", m, 2) for m in (pp, 2 * pp)])


def measure(pp, runs):
    """(launch result, {run name: smallest mean bubble over the repeats})."""
    result = launch(measure_synthetic_schedules, pp, args=(runs, FORWARD, BACKWARD, REPEATS), timeout=120)
    bubbles = {}
    for schedule, m, v in runs:
        name = synthetic_run_name(schedule, m, v)
        per_repeat = []
        for repeat in range(REPEATS):
            per_rank = bubble_fraction(result.trace.filter(run=name, repeat=repeat), count="compute")
            assert sorted(per_rank) == list(range(pp))
            per_repeat.append(sum(per_rank.values()) / pp)
        bubbles[name] = min(per_repeat)
    return result, bubbles


@pytest.fixture(scope="module", params=[3, 4], ids=["pp3", "pp4"])
def measured(request):
    pp = request.param
    result, bubbles = measure(pp, runs_for(pp))
    # On a loaded machine a run can be disturbed in every repeat; noise only adds idle time,
    # so a run above the band is measured again (at most twice) and the smallest value kept.
    for _ in range(2):
        noisy = [(s, m, v) for s, m, v in runs_for(pp)
                 if bubbles[synthetic_run_name(s, m, v)] > expected_bubble(pp, m, v) + ABOVE]
        if not noisy:
            break
        _, again = measure(pp, noisy)
        for name, value in again.items():
            bubbles[name] = min(bubbles[name], value)
    return pp, result, bubbles


def test_gpipe_and_1f1b_bubbles_match_the_formula(measured):
    pp, _, bubbles = measured
    report = []
    for schedule, m, v in runs_for(pp):
        if schedule == "interleaved":
            continue
        name, formula = synthetic_run_name(schedule, m, v), expected_bubble(pp, m)
        report.append(f"{name}: measured {bubbles[name]:.3f}, formula {formula:.3f}")
        assert formula - BELOW <= bubbles[name] <= formula + ABOVE, "\n".join(report)


def test_interleaving_idles_less_than_1f1b(measured):
    pp, _, bubbles = measured
    interleaved, plain = bubbles[synthetic_run_name("interleaved", 2 * pp, 2)], bubbles[f"1f1b M={2 * pp}"]
    assert interleaved < plain, (interleaved, plain)
    assert interleaved >= expected_bubble(pp, 2 * pp, 2) - BELOW


def test_executor_peak_activations_equal_the_formula_on_every_rank(measured):
    pp, result, _ = measured
    for schedule, m, v in runs_for(pp):
        name = synthetic_run_name(schedule, m, v)
        for rank in range(pp):
            expected = expected_peak_activations(schedule, pp, m, rank, v)
            assert result.results[rank][name] == [expected] * REPEATS, (name, rank)
