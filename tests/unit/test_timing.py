"""Every timing run refuses bad arguments through the one shared check, before any process
starts (a unit test that started one would fail: ``tests/unit/conftest.py``)."""
import pytest

from tutorial_lib import timing


@pytest.mark.parametrize("run,kwargs,match", [
    (timing.measure_cp_modes, {"cp_size": 1}, r"cp_size must be a whole number >= 2 .*try cp_size=2"),
    (timing.measure_ring_work, {"cp_size": True}, r"cp_size must be a whole number >= 2"),
    (timing.measure_cp_modes, {"repeats": 0}, r"need repeats >= 1 .*try repeats=1"),
    (timing.time_all_to_all, {"ranks": 1}, r"ranks must be a whole number >= 2"),
    (timing.time_all_to_all, {"repeats": 0}, r"need repeats >= 1"),
    (timing.measure_p2p_modes, {"pp": 1}, r"pp must be a whole number >= 2 \(a pipeline"),
    (timing.measure_p2p_modes, {"sizes": [64, 0]}, r"sizes must be a non-empty list .*got \[64, 0\]"),
    (timing.measure_collective, {"op": "all_gather", "sizes": {"all_gather": []}},
     r"got \[\] for all_gather"),
])
def test_a_bad_argument_is_refused_with_the_rule_and_a_fix(run, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(**kwargs)


def test_rounds_by_size_leaves_out_warm_up_rounds_and_untagged_events():
    from tutorial_lib.trace import Trace, TraceEvent

    def event(iteration, warmup, start, end, tags=True):
        return TraceEvent(rank=0, op="send", bytes=8, t_start=start, t_end=end,
                          tags={"measured_op": "send", "size": 8, "iteration": iteration,
                                "warmup": warmup} if tags else {})
    rounds = timing.rounds_by_size(Trace([event(0, True, 0.0, 5.0), event(1, False, 1.0, 1.5),
                                          event(2, False, 2.0, 2.25),
                                          event(3, False, 0.0, 9.0, tags=False)]),
                                   "measured_op")
    (timed,) = rounds.values()
    assert timed.seconds == (0.5, 0.25) and timed.median_seconds == 0.375
