"""Animations of collectives, built from traces that a real launch recorded."""
import re

import pytest
import torch

from tutorial_lib import comm, ring_collectives
from tutorial_lib.launch import launch
from tutorial_lib.viz.collective_animation import (Animation, animate_collective, animate_ring,
                                          animate_ring_all_reduce)
from tests.asserts import every

pytestmark = pytest.mark.dist

CAPTURE = 256  # record the values of every tensor these workers move


# --- worker functions ---------------------------------------------------------------------


def _ring_worker(ctx, rows):
    torch.manual_seed(ctx.rank)
    x = torch.randn(rows)
    return x, ring_collectives.ring_all_reduce(x)


def _ring_parts_worker(ctx):
    n = ctx.world_size
    x = torch.arange(2 * n, dtype=torch.float32) + 10 * ctx.rank
    return ring_collectives.ring_reduce_scatter(x), ring_collectives.ring_all_gather(x[:2])


def _dp_rings_worker(ctx):
    # 4 ranks, TP=2: two rings run at once, on the dp groups [0, 2] and [1, 3].
    from tutorial_lib import parallel_state
    from tutorial_lib.config import ParallelConfig
    parallel_state.initialize_model_parallel(ParallelConfig(world_size=4,
                                                            tensor_model_parallel_size=2))
    return ring_collectives.ring_all_reduce(torch.arange(4.0) + 10 * ctx.rank, group="dp")


# Uneven all-to-all splits: INPUT_SPLITS[r][j] rows go from rank r to rank j.
INPUT_SPLITS = [[1, 2, 0, 3], [2, 0, 3, 1], [0, 1, 1, 1], [3, 1, 1, 0]]


def _library_worker(ctx):
    n, r = ctx.world_size, ctx.rank
    t = torch.arange(4.0) + 10 * r
    out = {"all_reduce": comm.all_reduce(t.clone())}
    out["reduce_scatter"] = comm.reduce_scatter(torch.empty(4 // n), t.clone())
    out["all_gather"] = comm.all_gather(torch.empty(2 * n), torch.tensor([2.0 * r, 2.0 * r + 1]))
    out["broadcast"] = comm.broadcast(t.clone(), src=1)
    ins = INPUT_SPLITS[r]
    outs = [INPUT_SPLITS[j][r] for j in range(n)]
    x = torch.arange(sum(ins) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r
    out["all_to_all"] = comm.all_to_all(torch.empty(sum(outs), 2), x,
                                        output_split_sizes=outs, input_split_sizes=ins)
    if r == 0:
        comm.send(torch.tensor([1.5, 2.5]), 1)
    elif r == 1:
        out["p2p"] = comm.recv(torch.empty(2), 0)
    return out


# --- recorded traces, one launch each ------------------------------------------------------


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5])
def ring_run(request):
    n = request.param
    return n, launch(_ring_worker, n, args=(2 * n,), capture_values=CAPTURE, timeout=60)


@pytest.fixture(scope="module")
def library_run():
    return launch(_library_worker, 4, capture_values=CAPTURE, timeout=60)


def _flat(chunks):
    return [v for chunk in chunks for v in chunk]


# --- the ring all-reduce -------------------------------------------------------------------


def test_ring_animation_has_a_frame_per_step(ring_run):
    n, out = ring_run
    anim = animate_ring_all_reduce(out.trace)
    assert isinstance(anim, Animation) and len(anim) == 1 + 2 * (n - 1)
    captions = anim.captions
    if n > 1:
        assert captions[1].startswith(f"reduce-scatter step 1/{n - 1}")
        assert captions[n].startswith(f"all-gather step 1/{n - 1}")
        assert captions[-1].startswith(f"all-gather step {n - 1}/{n - 1}")


def test_ring_animation_starts_from_the_inputs_and_ends_at_the_all_reduced_tensor(ring_run):
    n, out = ring_run
    anim = animate_ring_all_reduce(out.trace)
    for rank, (x, reduced) in enumerate(out.results):
        assert _flat(anim.data[0]["buffers"][rank]) == x.tolist()
        # The recorded float32 values, replayed: exactly what the rank returned.
        assert _flat(anim.data[-1]["buffers"][rank]) == reduced.tolist()


def test_every_ring_step_moves_one_chunk_to_the_next_rank(ring_run):
    n, out = ring_run
    anim = animate_ring_all_reduce(out.trace)
    for frame in anim.data[1:]:
        assert sorted((a, b) for a, b, _ in frame["moves"]) == [(r, (r + 1) % n) for r in range(n)]
        # Every chunk index moves exactly once per step.
        assert sorted(c for _, _, c in frame["moves"]) == list(range(n))


def test_ring_animation_html_is_a_self_contained_player(ring_run):
    n, out = ring_run
    page = animate_ring_all_reduce(out.trace).to_html()
    assert re.search(r'<div class="tl-animation" id="tl-anim-[0-9a-f]+" data-frame="0"', page)
    assert 'class="tl-play"' in page and 'class="tl-slider"' in page
    assert page.count('class="tl-frame"') == 1 + 2 * (n - 1)
    assert not re.search(r"https?://|src=|require|import\(", page)  # nothing fetched
    script = page.split("<script>")[1].split("</script>")[0]
    assert script.strip().startswith("(function () {") and script.strip().endswith("})();")
    # A fresh id per render: two copies on one page do not drive each other.
    again = animate_ring_all_reduce(out.trace).to_html()
    ids = re.findall(r'id="(tl-anim-[0-9a-f]+)"', page + again)
    assert len(ids) == 2 and ids[0] != ids[1]


def test_ring_frames_write_the_values_as_numbers():
    out = launch(_ring_parts_worker, 3, capture_values=CAPTURE, timeout=60)
    anim = animate_ring(out.trace, "ring_reduce_scatter")
    assert len(anim) == 1 + 2  # reduce-scatter alone: N-1 steps
    html = anim.to_html()
    assert ">0, 1</text>" in html and ">20, 21</text>" in html  # rank 0 and 2's first chunks
    for rank, (chunk, _) in enumerate(out.results):
        assert anim.data[-1]["buffers"][rank][rank] == chunk.tolist()  # rank i owns chunk i
    gather = animate_ring(out.trace, "ring_all_gather")
    assert len(gather) == 3
    assert gather.data[0]["buffers"][1] == [None, [10.0, 11.0], None]  # only its own chunk
    for rank, (_, full) in enumerate(out.results):
        assert _flat(gather.data[-1]["buffers"][rank]) == full.tolist()


def test_ranks_picks_one_of_several_rings_running_at_once():
    out = launch(_dp_rings_worker, 4, capture_values=CAPTURE, timeout=60)
    for ranks in ([0, 2], [1, 3]):
        anim = animate_ring_all_reduce(out.trace, ranks=ranks)
        assert len(anim) == 3 and f"ranks {ranks} (dp group" in anim.title
        for rank in ranks:
            assert _flat(anim.data[-1]["buffers"][rank]) == out.results[rank].tolist()


def test_missing_values_ask_for_capture_values():
    out = launch(_ring_worker, 2, args=(4,), timeout=60)  # capture_values=0: no values recorded
    with pytest.raises(ValueError, match="capture_values"):
        animate_ring_all_reduce(out.trace)


def test_a_trace_without_ring_events_says_what_it_holds(library_run):
    with pytest.raises(ValueError, match="no ring_all_reduce events"):
        animate_ring_all_reduce(library_run.trace)


# --- library collectives, replayed chunk by chunk --------------------------------------------

#: Frames per op on 4 ranks: the inputs, then one per step (reduce-scatter adds the kept
#: parts; broadcast's chain takes N-1 + chunks-1 steps, here 4 chunks of one value; the
#: all-to-all's step 0 is each rank's own block).
FRAMES = {"all_reduce": 1 + 2 * 3, "reduce_scatter": 1 + 3 + 1, "all_gather": 1 + 3,
          "broadcast": 1 + 3 + 3, "all_to_all": 1 + 1 + 3}


@pytest.mark.parametrize("op", sorted(FRAMES))
def test_collective_animation_moves_the_data_step_by_step(library_run, op):
    """Frame 0 is what every rank handed in, the last frame what it held afterwards (both as
    recorded), and every frame in between moves data: the old player had two frames."""
    anim = animate_collective(library_run.trace, op)
    assert len(anim) == FRAMES[op]
    events = {e.rank: e for e in library_run.trace.filter(op=op)}
    for rank, result in enumerate(library_run.results):
        assert anim.data[0]["values"][rank] == events[rank].values_in
        assert anim.data[-1]["values"][rank] == result[op].flatten().tolist()
    steps = [d for d in anim.data[1:] if d.get("phase") != "after"]
    assert steps and all(d["moves"] for d in steps)
    assert 'class="tl-play"' in anim.to_html()


def _gloo_and_ring_worker(ctx):
    x = torch.arange(8.0) + 10 * ctx.rank  # whole numbers: every partial sum is exact
    comm.all_reduce(x.clone())
    ring_collectives.ring_all_reduce(x)
    comm.reduce_scatter(torch.empty(2), x.clone())
    ring_collectives.ring_reduce_scatter(x)
    comm.all_gather(torch.empty(2 * ctx.world_size), x[:2].clone())
    ring_collectives.ring_all_gather(x[:2])


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_the_replay_of_a_gloo_call_is_the_ring_the_library_runs(op):
    """gloo's one call, replayed from its recorded values, step for step equals the trace of
    tutorial_lib.ring_collectives' ring on the same tensors: the same chunk moves between the
    same ranks, and every buffer holds the same values after every step."""
    out = launch(_gloo_and_ring_worker, 4, capture_values=CAPTURE, timeout=60)
    replay = animate_collective(out.trace, op)
    ring = animate_ring(out.trace, f"ring_{op}")
    steps = [d for d in replay.data if d["phase"] != "after"]
    assert len(steps) == len(ring.data)
    for mine, real in zip(steps, ring.data):
        assert sorted(mine["moves"]) == sorted(real["moves"])
        assert mine["buffers"] == real["buffers"], (mine["phase"], mine["step"])
    if op == "reduce_scatter":  # then every rank keeps only its own part
        kept = replay.data[-1]["buffers"]
        assert every(c == (chunks[r] if j == r else None)
                   for r, chunks in steps[-1]["buffers"].items()
                   for j, c in enumerate(kept[r]))


def test_broadcast_replay_is_a_chain_from_the_root(library_run):
    anim = animate_collective(library_run.trace, "broadcast")  # rank 1 broadcasts 4 values
    chain = [1, 2, 3, 0]
    root = [10.0, 11.0, 12.0, 13.0]
    for t, frame in enumerate(anim.data[1:]):
        # at step t the chunk c crosses hop j = t - c of the chain, from chain[j] to chain[j+1]
        assert sorted(frame["moves"]) == sorted(
            (chain[t - c], chain[t - c + 1], c) for c in range(4) if 0 <= t - c < 3)
        for src, dst, c in frame["moves"]:
            assert frame["buffers"][dst][c] == [root[c]]
    assert "binomial tree" in anim.note


def test_all_to_all_replay_is_a_pairwise_exchange_with_the_uneven_split_counts(library_run):
    anim = animate_collective(library_run.trace, "all_to_all")
    n = len(INPUT_SPLITS)
    labels = anim.data[0]["labels"]
    for r in range(n):
        sent = [f"\u2192 r{j}: {k} row{'' if k == 1 else 's'}" for j, k in enumerate(INPUT_SPLITS[r])]
        got = [f"\u2190 r{j}: {INPUT_SPLITS[j][r]} row{'' if INPUT_SPLITS[j][r] == 1 else 's'}"
               for j in range(n)]
        assert labels["send"][r] == sent and labels["receive"][r] == got
    assert anim.data[1]["moves"] == [(r, r, INPUT_SPLITS[r][r]) for r in range(n)]
    for s in range(1, n):  # step s: every rank sends to the rank s after it
        assert anim.data[1 + s]["moves"] == [(r, (r + s) % n, INPUT_SPLITS[r][(r + s) % n])
                                             for r in range(n)]
    page = anim.to_html()
    assert "r3: 3 rows" in page and "r2: 0 rows" in page  # rank 0 sends 3 rows to rank 3, 0 to 2
    assert "[1, 2, 0, 3]" in anim.captions[0]  # rank 0's input splits


def test_send_recv_pairs_become_messages(library_run):
    anim = animate_collective(library_run.trace, "p2p")
    assert len(anim) == 2  # before, and the one message
    assert anim.data[0]["values"][1] == []  # the receive buffer is still empty
    assert anim.data[1]["values"][1] == [1.5, 2.5]
    assert "rank 0 sends 8 bytes" in anim.captions[1]


def test_an_unknown_op_is_refused(library_run):
    with pytest.raises(ValueError, match="unknown op"):
        animate_collective(library_run.trace, "gather")
