"""A timeline drawn from a real launch: a transfer in flight during backward, as recorded."""
import time

import pytest
import torch

from tutorial_lib import comm
from tutorial_lib.launch import launch
from tutorial_lib.viz.timeline import busy_fraction, overlap_fraction, overlap_seconds, timeline

from ..unit.test_timeline import bars_of

pytestmark = pytest.mark.dist


def _overlap_worker(ctx):
    """A p2p transfer issued before backward and waited for after it: in flight throughout."""
    import torch.distributed as dist
    dist.barrier()  # untraced: start together, so the picture is not skewed by process start-up
    tracer = ctx.tracer
    with tracer.tags(microbatch=0):
        with tracer.span("forward"):
            time.sleep(0.01)
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
