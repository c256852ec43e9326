"""A timeline drawn from a real launch: a transfer in flight during backward, as recorded."""
import time

import pytest
import torch

from tutorial_lib import comm
from tutorial_lib.launch import launch
from tutorial_lib.viz.timeline import busy_fraction, overlap_fraction, overlap_seconds, timeline

from ..unit.test_timeline import bars_of
from tests.asserts import every

pytestmark = pytest.mark.dist


def _overlap_worker(ctx):
    """A p2p transfer issued before backward and waited for after it: in flight throughout."""
    import torch.distributed as dist
    dist.barrier()  # untraced: start together, so the picture is not skewed by process start-up
    tracer = ctx.tracer
    with tracer.tags(microbatch=0):
        with tracer.span("forward"):
            time.sleep(0.01)  # stand-ins for compute: spans the drawing must show
        if ctx.rank == 0:
            work = comm.isend(torch.ones(1024), dst=1)
        else:
            work = comm.irecv(torch.zeros(1024), src=0)
        with tracer.span("backward"):
            time.sleep(0.03)
        work.wait()
    comm.all_reduce(torch.ones(16))
    return None


@pytest.fixture(scope="module")
def real_run():
    return launch(_overlap_worker, 2, timeout=60)


def test_drawn_bars_match_the_recorded_events(real_run):
    trace = real_run.trace
    assert sorted((e.rank, e.op) for e in trace) == [
        (0, "all_reduce"), (0, "compute"), (0, "compute"), (0, "send"),
        (1, "all_reduce"), (1, "compute"), (1, "compute"), (1, "recv")]
    tl = timeline(trace)
    rel = trace.relative()
    assert len(tl.data["bars"]) == len(rel)
    drawn = sorted((b["rank"], b["start"], b["end"]) for b in tl.data["bars"])
    assert drawn == sorted((e.rank, e.t_start * 1000, e.t_end * 1000) for e in rel)
    k = tl.data["plot_width"] / (tl.data["domain"][1] - tl.data["domain"][0])
    for b in tl.data["bars"]:
        assert b["x"] == pytest.approx(tl.data["x0"] + (b["start"] - tl.data["domain"][0]) * k)
        assert b["lane"] == ("compute" if b["kind"] == "compute" else "comm")
    assert {b["label"] for b in tl.data["bars"]} == {
        "forward mb0", "backward mb0", "send \u2192 r1 mb0", "recv \u2190 r0 mb0", "all-reduce"}


def test_an_async_op_visibly_overlaps_backward(real_run):
    trace = real_run.trace
    tl = timeline(trace)
    for rank, op in ((0, "send"), (1, "recv")):
        backward = trace.filter(rank=rank, op="compute", name="backward")[0]
        transfer = trace.filter(rank=rank, op=op)[0]
        # Issued before backward started, completed (wait) after it ended ...
        assert transfer.t_start <= backward.t_start and backward.t_end <= transfer.t_end
        # ... so all of backward's time is overlapped, exactly.
        assert overlap_seconds(trace, rank, "backward", op=op) == backward.duration
        assert overlap_seconds(trace, rank, "backward", op="all_reduce") == 0.0
        # (the rest of the transfer's time: issue to backward, and waiting for the peer)
        assert 0.0 < overlap_fraction(trace, rank, "backward", op=op) <= 1.0
        # In the picture: the transfer's bar spans the backward bar, one row below it.
        bw = bars_of(tl, rank=rank, label="backward mb0")[0]
        tr = [b for b in tl.data["bars"] if b["rank"] == rank and b["tip_title"].startswith(op)][0]
        assert tr["x"] <= bw["x"] and bw["x"] + bw["w"] <= tr["x"] + tr["w"] + 1e-9
        assert tr["y"] > bw["y"]
    busy = busy_fraction(trace)
    assert set(busy) == {0, 1} and all(0.0 < v <= 1.0 for v in busy.values())


@pytest.fixture(scope="module")
def pipeline_run():
    """One 1F1B step of 3 synthetic stages (forward 2 ms, backward 4 ms), real P2P and labels."""
    from tutorial_lib.pipeline_parallel.synthetic import measure_synthetic_schedules
    return launch(measure_synthetic_schedules, 3, args=([("1f1b", 3, 1)], 0.002, 0.004, 1),
                  timeout=60)


def test_a_real_pipeline_step_is_drawn_as_its_schedule(pipeline_run):
    """Found reading the book: the labels' isends, posted before each forward and waited on at the end of
    the step, were bars across the whole step (one row each); forward and backward were one
    grey and the bubble was not marked."""
    trace = pipeline_run.trace
    labels = trace.filter(op="send", p2p_op="send_labels").events
    assert len(labels) == 3 and {e.rank for e in labels} == {0}
    plain = timeline(trace, kinds=["compute", "pp"])
    drawn = [b for b in plain.data["bars"] if b["tip_title"].startswith("send") and
             "p2p_op=send_labels" in b["tip"].get("tags", "")]
    assert max(b["row"] for b in drawn) >= 1  # in flight together: stacked rows
    tl = timeline(trace, kinds=["compute", "pp"], pipeline=True)
    ticks = [b for b in tl.data["bars"] if "p2p_op=send_labels" in b["tip"].get("tags", "")]
    rel = trace.relative()
    posted = sorted(e.t_start * 1000 for e in rel.filter(op="send", p2p_op="send_labels"))
    assert sorted(b["start"] for b in ticks) == posted
    assert every(b["end"] == b["start"] and "waited on" in b["tip"] for b in ticks)
    assert {b["row"] for b in ticks} == {0}  # one row, no longer stacked
    computes = [b for b in tl.data["bars"] if b["kind"] in ("forward", "backward")]
    assert sorted(b["label"] for b in computes) == sorted(
        f"{k}{mb}" for k in "FB" for mb in range(3) for _ in range(3))
    idle = [b for b in tl.data["bars"] if b["kind"] == "bubble"]
    assert {b["rank"] for b in idle} == {0, 1, 2}
    for b in idle:  # idle means no forward or backward of that rank runs
        assert not any(c["rank"] == b["rank"] and c["start"] < b["end"] - 1e-9
                       and b["start"] < c["end"] - 1e-9 for c in computes)
