"""Chapter 13's checkers: their references agree with the planner, and they name the classic
mistakes (pure: no processes; the notebook's exercise cells:
tests/unit/test_exercises_notebooks.py)."""
from __future__ import annotations

from tutorial_lib.costs.hardware import cluster
from tutorial_lib.costs.step_time import Layout
from tutorial_lib.exercises import ch13
from tutorial_lib.exercises.kit import forget_attempts
from tutorial_lib.plan import plan


def test_pick_layout_passes_the_planners_best_and_refuses_what_it_should():
    assert ch13.check_pick_layout(ch13.reference_pick_layout).passed
    name, model, gpu, nodes, batch = ch13.PICK_CASES[0]
    where, gpus = cluster(gpu), 2 * cluster(gpu).gpus_per_node
    best = ch13.best_step_time(model, where, gpus, batch)
    # DP alone does not fit a 13B model in 80 GB; TP 2 x DP 8 fits and is near the best
    assert ch13.judge_layout(Layout(dp=16), model, where, gpus, batch, best) == "memory"
    assert ch13.judge_layout(Layout(tp=2, dp=8, sharding="optim"), model, where, gpus,
                             batch, best) == "ok"
    assert ch13.judge_layout(Layout(tp=2, dp=4), model, where, gpus, batch, best) == "world"
    assert ch13.judge_layout(Layout(tp=16, dp=1), model, where, gpus, batch, best) == "rules"


def test_pick_layout_names_each_mistake():
    for answer, hint in ((lambda m, w, g, b: {"tp": 1, "pp": 1, "dp": g}, ch13.HINT_PICK_MEMORY),
                         (lambda m, w, g, b: {"tp": 1, "pp": 1, "dp": g // 2},
                          ch13.HINT_PICK_WORLD),
                         (lambda m, w, g, b: "TP 2", ch13.HINT_PICK_FORMAT)):
        forget_attempts()
        result = ch13.check_pick_layout(answer)
        assert not result.passed and hint in str(result)


def test_a_tp_that_leaves_the_node_gets_its_hint():
    """A layout that fits but spreads TP over two nodes is slower than the tolerance allows."""
    name, model, gpu, nodes, batch = ch13.PICK_CASES[2]  # 70B on 8 H100 nodes: TP 16 valid
    where, gpus = cluster(gpu), nodes * cluster(gpu).gpus_per_node
    slow = plan(model, where, gpus, batch, fixed={"tp": 16}, top=1).layouts[0].layout
    best = ch13.best_step_time(model, where, gpus, batch)
    assert ch13.judge_layout(slow, model, where, gpus, batch, best) == "tp_node"


def test_tp_stops_paying_is_the_first_rise_of_the_planners_times():
    assert ch13.check_tp_stops_paying(ch13.reference_tp_stops_paying).passed
    for name, model, gpu, per_node, gpus, batch in ch13.TP_CASES:
        where = cluster(gpu, gpus_per_node=per_node)
        times = ch13.tp_step_times(model, where, gpus, batch)
        answer = ch13.reference_tp_stops_paying(model, where, gpus, batch)
        rises = [t for t in sorted(times) if t // 2 in times and times[t] > times[t // 2]]
        assert rises[:1] == [answer], (name, times)  # the first TP slower than its half
        assert answer <= 2 * per_node  # never past the first TP that leaves the node


def test_tp_stops_paying_names_each_mistake():
    for mistake, hint in (("fastest", ch13.HINT_TP_FASTEST), ("leaves", ch13.HINT_TP_LEAVES)):
        forget_attempts()
        result = ch13.check_tp_stops_paying(
            lambda m, w, g, b, k=mistake: ch13._tp_mistakes(m, w, g, b)[k])
        assert not result.passed and hint in str(result), mistake
    forget_attempts()
    result = ch13.check_tp_stops_paying(lambda *a: "eight")
    assert not result.passed and ch13.HINT_TP_FORMAT in str(result)
