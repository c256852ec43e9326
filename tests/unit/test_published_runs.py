"""The published-run table: the cited rows, the fitted efficiency, the printed predictions."""
import pytest

from tests.asserts import every
from tutorial_lib import plan
from tutorial_lib.published_runs import (FITTED_ON, MACHINE_REFERENCE, PUBLISHED_RUNS,
                                         fit_efficiency, machine_table,
                                         format_table, predict_run, published_rank,
                                         published_table)


def test_every_row_is_cited_and_narayanans_columns_agree():
    assert every(run.source for run in PUBLISHED_RUNS)
    for run in PUBLISHED_RUNS:
        assert run.gpus % (run.tp * run.pp) == 0
        if run.aggregate_pflops is not None:  # per-GPU TFLOP/s x GPUs = the aggregate column
            assert run.value * run.gpus / 1000 == pytest.approx(run.aggregate_pflops, rel=0.01)


def test_the_planners_efficiency_is_the_fit():
    efficiency = fit_efficiency()
    assert round(efficiency, 3) == plan.MATMUL_EFFICIENCY
    fitted = next(r for r in PUBLISHED_RUNS if r.name == FITTED_ON)
    assert predict_run(fitted, efficiency)[1] == pytest.approx(fitted.value, rel=1e-4)


def test_printed_table_is_the_computed_one():
    rows = published_table(plan.MATMUL_EFFICIENCY)
    text = format_table(rows).splitlines()
    assert len(text) == 1 + len(PUBLISHED_RUNS)
    for run, row, line in zip(PUBLISHED_RUNS, rows, text[1:]):
        _, figure = predict_run(run, plan.MATMUL_EFFICIENCY)
        assert row["published"] == run.value and row["predicted"] == figure
        assert row["error"] == pytest.approx(figure / run.value - 1)
        shown = f"{figure:.1%}" if run.metric == "mfu" else f"{figure:.0f}"
        assert line.startswith(run.name) and f" {shown} " in line


def test_published_rank_counts_faster_fitting_layouts():
    run = next(r for r in PUBLISHED_RUNS if r.gpus == 8)
    result, _ = predict_run(run, plan.MATMUL_EFFICIENCY)
    rank = published_rank(run, plan.MATMUL_EFFICIENCY, result)
    found = plan.plan(run.model(), plan.cluster("a100-80gb"), run.gpus, run.global_batch_size,
                      efficiency=plan.MATMUL_EFFICIENCY, top=None)
    assert rank == 1 + sum(r.step_time_s < result.step_time_s for r in found.layouts)


def test_machine_table_by_hand():
    from tutorial_lib.reference import Reference
    ref = Reference("ch13_planner_cpu", rows=[
        {"layout": "TP 1 PP 1 DP 4", "predicted_s": 2.0, "measured_s": 4.0},
        {"layout": "TP 2 PP 1 DP 2", "predicted_s": 3.0, "measured_s": 5.0}])
    rows = machine_table(ref)
    assert rows[0] == {"layout": "TP 1 PP 1 DP 4", "predicted_ratio": 1.0,
                       "measured_ratio": 1.0, "error": 0.0}
    assert rows[1]["predicted_ratio"] == 1.5 and rows[1]["measured_ratio"] == 1.25
    assert rows[1]["error"] == pytest.approx(1.5 / 1.25 - 1)
    ref.rows[0]["predicted_ch02_s"], ref.rows[1]["predicted_ch02_s"] = 1.0, 1.25
    rows = machine_table(ref)
    assert rows[1]["predicted_ch02_ratio"] == 1.25 and rows[1]["error_ch02"] == 0.0
    assert rows[1]["predicted_ratio"] == 1.5  # the run link's prediction is unchanged


def test_machine_table_is_computed_from_the_stored_reference():
    import json

    from tutorial_lib.reference import REFERENCE_DIR
    path = REFERENCE_DIR / f"{MACHINE_REFERENCE}.json"
    if not path.exists():
        pytest.skip(f"{MACHINE_REFERENCE} is not stored yet: `python bench/bench_planner_cpu.py "
                    f"--save` measures it on an idle machine (scripts/measure_references.py)")
    stored = json.loads(path.read_text())["rows"]
    rows = machine_table()
    assert [r["layout"] for r in rows] == [s["layout"] for s in stored]
    for row, s in zip(rows, stored):
        assert row["predicted_ratio"] == s["predicted_s"] / stored[0]["predicted_s"]
        assert row["measured_ratio"] == s["measured_s"] / stored[0]["measured_s"]
        assert row["predicted_ch02_ratio"] == (s["predicted_ch02_s"]
                                               / stored[0]["predicted_ch02_s"])
