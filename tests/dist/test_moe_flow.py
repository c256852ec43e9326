"""The MoE token-flow widget, drawn from all-to-alls that real gloo ranks recorded.

A 4-rank launch exchanges per-expert counts, then tokens with uneven splits (rank 3
receives nothing, rank 1 keeps nothing for itself), then the mirror combine, tagged
the way :mod:`tutorial_lib.moe` tags them; a second launch runs the real MoE layer
forward and backward.  Synthetic traces: tests/unit/test_moe_flow.py.
"""
import html
import re

import pytest
import torch

from tutorial_lib import comm, parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import launch
from tutorial_lib.trace import Trace, TraceEvent
from tutorial_lib.viz.moe_flow import TokenFlowAnimation, animate_token_flow, dispatch_matrix
from tutorial_lib.viz.widget import Animation
from tests.asserts import every

pytestmark = pytest.mark.dist

# SPLITS[i][j]: token copies rank i sends to rank j.  Column 3 is zero: rank 3 gets nothing.
SPLITS = [[2, 4, 6, 0], [3, 0, 5, 0], [1, 7, 2, 0], [4, 2, 3, 0]]
# COUNTS[i][2 j + l]: of those, how many go to rank j's local expert l (2 experts per rank).
COUNTS = [[1, 1, 3, 1, 2, 4, 0, 0], [2, 1, 0, 0, 1, 4, 0, 0],
          [0, 1, 4, 3, 1, 1, 0, 0], [2, 2, 1, 1, 3, 0, 0, 0]]
N = len(SPLITS)
HIDDEN = 3


def _transpose(m):
    return [list(r) for r in zip(*m)]


# --- worker functions ---------------------------------------------------------------------


def _dispatch_worker(ctx):
    """Counts, then tokens, then the mirror: the dispatcher's three all-to-alls, by hand."""
    parallel_state.initialize_model_parallel(ParallelConfig(N, expert_model_parallel_size=N))
    r = ctx.rank
    counts = torch.tensor(COUNTS[r], dtype=torch.int64).view(N, 2)
    with ctx.tracer.tags(op_name="dispatch", phase="forward", payload="counts"):
        got_counts = comm.all_to_all(torch.empty_like(counts), counts, "ep")
    ins = SPLITS[r]
    outs = [SPLITS[j][r] for j in range(N)]
    tokens = torch.arange(sum(ins) * HIDDEN, dtype=torch.float32).view(-1, HIDDEN) + 100 * r
    with ctx.tracer.tags(op_name="dispatch", phase="forward", payload="tokens"):
        arrived = comm.all_to_all(torch.empty(sum(outs), HIDDEN), tokens, "ep",
                                  output_split_sizes=outs, input_split_sizes=ins)
    with ctx.tracer.tags(op_name="combine", phase="forward", payload="tokens"):
        back = comm.all_to_all(torch.empty(sum(ins), HIDDEN), arrived * 2, "ep",
                               output_split_sizes=ins, input_split_sizes=outs)
    return got_counts.tolist(), arrived.shape[0], torch.equal(back, tokens * 2)


def _moe_layer_worker(ctx):
    """The real layer: 8 experts on 4 EP ranks, forward and backward."""
    from tutorial_lib import moe
    parallel_state.initialize_model_parallel(ParallelConfig(N, expert_model_parallel_size=N))
    layer = moe.MoELayer(hidden_size=8, num_experts=8, topk=2, ffn_hidden_size=8, seed=1)
    torch.manual_seed(10 + ctx.rank)
    x = torch.randn(6, 1, 8, requires_grad=True)
    y, info = layer(x)
    y.sum().backward()
    return info["tokens_sent_per_rank"], info["tokens_per_expert"].tolist()


@pytest.fixture(scope="module")
def dispatch_run():
    out = launch(_dispatch_worker, N, capture_values=64, timeout=90)
    return out


@pytest.fixture(scope="module")
def moe_run():
    return launch(_moe_layer_worker, N, capture_values=64, timeout=120)


# --- the matrix ------------------------------------------------------------------------------


def test_the_launch_moved_what_the_splits_say(dispatch_run):
    for r, (got_counts, arrived, returned) in enumerate(dispatch_run.results):
        assert arrived == sum(SPLITS[i][r] for i in range(N))
        assert got_counts == [COUNTS[i][2 * r:2 * r + 2] for i in range(N)]
        assert returned  # the combine brought every row back to its sender


def test_dispatch_matrix_is_the_recorded_send_matrix(dispatch_run):
    trace = dispatch_run.trace
    assert dispatch_matrix(trace) == SPLITS  # the first forward token all-to-all: dispatch
    assert dispatch_matrix(trace, "dispatch") == SPLITS
    assert dispatch_matrix(trace, "combine") == _transpose(SPLITS)
    assert dispatch_matrix(trace, call=1) == _transpose(SPLITS)  # forward call 1: the combine
    with pytest.raises(ValueError, match="call 2 .* holds 2 calls"):
        dispatch_matrix(trace, call=2)
    with pytest.raises(ValueError, match=r"holds 0 calls"):
        dispatch_matrix(trace, "dispatch", phase="backward")


def test_inconsistent_splits_are_refused_with_the_cells(dispatch_run):
    rows = dispatch_run.trace.to_dicts()
    for row in rows:  # rank 2 now claims it expected 5 rows from rank 0, not 6
        if row["rank"] == 2 and row["tags"].get("op_name") == "dispatch" \
                and row["tags"].get("payload") == "tokens":
            row["splits"]["output"][0] = 5
    bad = Trace.from_dicts(rows)
    message = (r"inconsistent all-to-all splits .* rank 0 sends 6 rows to rank 2 .* "
               r"rank 2 expects 5")
    with pytest.raises(ValueError, match=message):
        dispatch_matrix(bad, "dispatch")
    with pytest.raises(ValueError, match="inconsistent all-to-all splits"):
        animate_token_flow(bad)


def test_a_missing_rank_or_a_trace_without_all_to_all_is_explained(dispatch_run):
    partial = Trace(e for e in dispatch_run.trace if e.rank != 1)
    with pytest.raises(ValueError, match="different numbers of .* rank 1: 0"):
        dispatch_matrix(partial)
    with pytest.raises(ValueError, match="no all_to_all events"):
        animate_token_flow(Trace([TraceEvent(rank=0, op="all_reduce")]))


# --- the animation, from the real launch -----------------------------------------------------


def test_frames_are_start_dispatch_per_sender_experts_combine_per_receiver_totals(dispatch_run):
    anim = animate_token_flow(dispatch_run.trace)
    assert isinstance(anim, TokenFlowAnimation) and isinstance(anim, Animation)
    assert len(anim) == 2 * N + 3
    phases = [d["phase"] for d in anim.data]
    assert phases == (["start"] + [f"dispatch:{k}" for k in range(N)] + ["experts"]
                      + [f"combine:{k}" for k in range(N)] + ["totals"])
    assert anim.captions[0].startswith("Start") and anim.captions[-1].startswith("Totals")
    assert every(d["matrix"] == SPLITS for d in anim.data)
    assert anim.flow.dispatch == SPLITS and anim.flow.combine == _transpose(SPLITS)


def test_each_dispatch_frame_moves_one_senders_row_with_labels(dispatch_run):
    anim = animate_token_flow(dispatch_run.trace)
    for k in range(N):
        frame = anim.data[1 + k]
        expected = [(k, j, c) for j, c in enumerate(SPLITS[k]) if c]
        assert frame["moves"] == expected
        assert frame["labels"] == [f"r{k} \u2192 r{j}: {c} cop{'ies' if c != 1 else 'y'}"
                                   for _, j, c in expected]
        # senders up to k have sent everything; the receivers hold what arrived so far
        assert frame["at_senders"] == {i: (0 if i <= k else sum(SPLITS[i])) for i in range(N)}
        assert frame["at_receivers"] == {j: sum(SPLITS[i][j] for i in range(k + 1))
                                         for j in range(N)}
    assert anim.data[1]["labels"] == ["r0 \u2192 r0: 2 copies", "r0 \u2192 r1: 4 copies",
                                      "r0 \u2192 r2: 6 copies"]
    assert "r2 \u2192 r0: 1 copy," in anim.captions[3]  # singular
    page = html.unescape(anim.to_html())
    assert "r0 \u2192 r2: 6 copies" in page and "r3 \u2192 r0: 4 copies" in page


def test_combine_frames_are_the_mirror(dispatch_run):
    anim = animate_token_flow(dispatch_run.trace)
    for k in range(N):
        frame = anim.data[N + 2 + k]
        assert frame["moves"] == [(k, i, SPLITS[i][k]) for i in range(N) if SPLITS[i][k]]
    assert anim.data[-2]["labels"] == []  # rank 3 received nothing, so returns nothing
    assert "nothing (it received no copies)" in anim.captions[-2]
    assert anim.data[-1]["at_senders"] == {i: sum(SPLITS[i]) for i in range(N)}


def test_the_rank_receiving_zero_tokens_is_shown(dispatch_run):
    anim = animate_token_flow(dispatch_run.trace)
    assert anim.data[0]["received"] == {0: 10, 1: 13, 2: 16, 3: 0}
    experts = anim.captions[N + 1]
    assert experts.startswith("Expert compute") and "rank 3 received 0 copies" in experts
    page = html.unescape(anim.to_html())
    assert "receives 0 copies" in page and "r3 receives 0 copies" in page and ">idle<" in page


def test_per_expert_counts_come_from_the_counts_all_to_all(dispatch_run):
    anim = animate_token_flow(dispatch_run.trace)
    assert anim.flow.experts_per_rank == 2 and anim.flow.expert_counts == COUNTS
    assert anim.data[N + 1]["per_local_expert"] == {0: [5, 5], 1: [8, 5], 2: [7, 9], 3: [0, 0]}
    assert "r1 13 (e2 8, e3 5)" in anim.captions[N + 1]
    page = html.unescape(anim.to_html())
    assert "e5: 9" in page and "e7: 0" in page
    with pytest.raises(ValueError, match="experts_per_rank=4 but the recorded counts hold 2"):
        animate_token_flow(dispatch_run.trace, experts_per_rank=4)


def test_without_captured_values_counts_stay_per_rank(dispatch_run):
    rows = dispatch_run.trace.to_dicts()
    for row in rows:
        row["values_in"] = row["values_out"] = None
    anim = animate_token_flow(Trace.from_dicts(rows))
    assert anim.flow.expert_counts is None and anim.flow.experts_per_rank == 2  # from the shape
    assert "capture_values >= 8" in anim.note
    assert "experts e4\u2013e5" in html.unescape(anim.to_html())


def test_an_untagged_trace_pairs_an_all_to_all_with_its_mirror(dispatch_run):
    rows = dispatch_run.trace.to_dicts()
    for row in rows:
        row["tags"] = {}
    plain = Trace.from_dicts(rows)
    # untagged, the counts exchange is just the first all-to-all (one row to every rank)
    assert dispatch_matrix(plain) == [[1] * N] * N
    assert dispatch_matrix(plain, call=1) == SPLITS
    anim = animate_token_flow(plain, call=1)
    assert len(anim) == 2 * N + 3 and anim.flow.combine == _transpose(SPLITS)
    # the call after the combine does not exist: no mirror, no combine frames
    alone = animate_token_flow(plain, call=2)
    assert alone.flow.dispatch == _transpose(SPLITS) and alone.flow.combine is None
    assert len(alone) == N + 3 and "No combine" in alone.note


# --- the real MoE layer ---------------------------------------------------------------------------


def test_the_moe_layers_own_trace_forward_and_backward(moe_run):
    sent = [r[0] for r in moe_run.results]
    per_expert = [r[1] for r in moe_run.results]
    assert dispatch_matrix(moe_run.trace, "dispatch") == sent
    anim = animate_token_flow(moe_run.trace, include_backward=True)
    assert anim.flow.dispatch == sent and anim.flow.expert_counts == per_expert
    assert anim.flow.experts_per_rank == 2
    assert anim.flow.backward == {"combine": sent, "dispatch": _transpose(sent)}
    assert len(anim) == 2 * N + 5
    assert sum(anim.flow.sent) == N * 6 * 2  # 6 tokens per rank, top-2


# --- the HTML ---------------------------------------------------------------------------------


def test_html_is_self_contained_and_two_players_do_not_clash(dispatch_run, tmp_path):
    anim = animate_token_flow(dispatch_run.trace, title="Dispatch & combine <traced>")
    page = anim.to_html()
    assert re.search(r'<div class="tl-animation" id="tl-anim-[0-9a-f]+" data-frame="0"', page)
    assert 'class="tl-play"' in page and 'class="tl-slider"' in page
    assert page.count('class="tl-frame"') == len(anim) == 2 * N + 3
    assert not re.search(r"https?://|src=|@import|url\(", page)  # nothing fetched
    assert "Dispatch &amp; combine &lt;traced&gt;" in page
    script = page.split("<script>")[1].split("</script>")[0]
    assert script.strip().startswith("(function () {") and script.strip().endswith("})();")
    other = anim.to_html()
    ids = re.findall(r'class="tl-animation" id="(tl-anim-[0-9a-f]+)"', page + other)
    assert len(ids) == 2 and ids[0] != ids[1]
    for uid, fragment in zip(ids, (page, other)):  # the flying squares' CSS is scoped per player
        assert f"@keyframes {uid}-fly" in fragment and f"#{uid} .tl-moe-fly" in fragment
    assert "tl-moe-fly" in page.split("</style>")[1]  # the dispatch frames hold flying squares
    saved = anim.save(str(tmp_path / "flow.html"))
    assert open(saved, encoding="utf-8").read().startswith("<!doctype html>")
