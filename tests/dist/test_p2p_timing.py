"""Timing the P2P modes: real gloo rounds, checked for values, bytes and structure (not speed)."""
import pytest

from tutorial_lib import p2p, timing
from tutorial_lib.launch import LaunchTimeout, launch
from tutorial_lib.trace import Trace, TraceEvent
from tests.asserts import every

pytestmark = pytest.mark.dist


def _round(ctx, mode, wrong=False):
    timing.init_pipeline(ctx)
    return timing.steady_state_round(mode, 3, wrong_recv_backward_peer=wrong)


@pytest.mark.parametrize("pp", [2, 3, 5])
@pytest.mark.parametrize("mode", p2p.MODES)
def test_a_round_delivers_every_neighbours_values(mode, pp):
    run = launch(_round, pp, args=(mode,), timeout=30)
    assert run.results == [timing.expected_round(s, pp) for s in range(pp)]
    sends = run.trace.filter(op="send")
    # every link carries one message each way: 2 (PP - 1) sends of 3 float32
    assert sorted((e.rank, e.peer) for e in sends) == sorted(
        [(s, s + 1) for s in range(pp - 1)] + [(s + 1, s) for s in range(pp - 1)])
    assert every(e.bytes == 12 for e in sends)


def test_the_round_with_the_guides_peer_deadlocks_at_pp3():
    with pytest.raises(LaunchTimeout) as caught:
        launch(_round, 3, args=("batched", True), timeout=3)
    report = caught.value.report
    assert "recv from rank 2" in report[0] and "send_forward_recv_backward" in report[0]
    assert "send to rank 0" in report[1] and "recv from rank 1" in report[2]


def test_measure_p2p_modes_times_every_mode_and_size():
    sizes = (4, 4096, 65536)
    timings, run = timing.measure_p2p_modes(sizes=sizes, pp=3, repeats=3, warmup=1)
    assert [(t.nbytes, t.mode) for t in timings] == [(n, m) for n in sizes for m in sorted(p2p.MODES)]
    for t in timings:
        assert t.pp == 3 and t.seconds > 0 and t.quartiles[0] <= t.quartiles[1]
        assert t.messages == 4 and t.bytes_sent == 4 * t.nbytes
    measured = [e for e in run.trace if "measured_mode" in e.tags]
    assert len({(e.tags["measured_mode"], e.tags["size"], e.tags["iteration"]) for e in measured}) \
        == len(sizes) * len(p2p.MODES) * 4
    ratios = timing.ratios_to(timings)
    assert every(ratios[("batched", n, 3)] == 1.0 for n in sizes) and len(ratios) == len(timings)


def test_round_time_is_last_start_to_last_end():
    def event(rank, start, end, iteration=0, op="send"):
        return TraceEvent(rank=rank, op=op, bytes=8, t_start=start, t_end=end,
                          tags={"measured_mode": "batched", "size": 8, "iteration": iteration,
                                "warmup": False})
    # rank 0 starts at 1.0 and issues a second op at 1.5; rank 1 starts at 1.2; last end 2.0
    trace = Trace([event(0, 1.0, 1.4), event(0, 1.5, 2.0, op="recv"), event(1, 1.2, 1.9),
                   event(1, 1.3, 1.8, op="recv")])
    (mode_timing,) = timing.timings_from_trace(trace, 2)
    assert mode_timing.seconds == pytest.approx(0.8) and mode_timing.bytes_sent == 16 \
        and mode_timing.messages == 2


@pytest.mark.parametrize("kwargs,match", [({"pp": 1}, "pp must"), ({"modes": ("eager",)}, "p2p mode"),
                                          ({"sizes": ()}, "sizes"), ({"repeats": 0}, "repeats")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timing.measure_p2p_modes(**kwargs)
