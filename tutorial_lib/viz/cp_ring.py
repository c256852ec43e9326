"""The ring of context-parallel attention, replayed from a recorded trace (chapter 9).

    out = launch(work, 4)                           # work calls context_parallel.ring_attention
    animate_ring_attention(out.trace)               # the first ring call's forward pass

Each frame is one step of the ring.  A row per CP rank shows the query chunks it owns
(always the same), the K/V block it attends to at that step (the rank whose block it is,
and that rank's chunks), which pairs of its query chunks and the block's key chunks it
computes (whole, through the causal triangle, or skipped), how many (query, key) pairs
that was, and the block it passes on to the next rank while it computes.  The last frame
shows what each rank has merged: every rank's block.  The step, the block held, the pairs
and the messages come from the trace (the ``ring_attention`` compute spans and the
``send`` events of :class:`tutorial_lib.context_parallel.RingAttention`); the chunk ids from
:func:`~tutorial_lib.context_parallel.held_chunks`.  A colour is a rank: its queries, and
its K/V block wherever the block travels.  Self-contained HTML (the course's player), so it
plays in the static book.
"""
from __future__ import annotations

from ..trace import Trace, TraceEvent
from . import draw
from .draw import INK, LINE, MUTED
from .widget import Animation

__all__ = ["RingAttentionAnimation", "animate_ring_attention", "ring_steps"]

ROW_H, TOP, LEFT = 64, 44, 16
KIND_FILL = {"full": 1.0, "diagonal": 0.55, "skip": 0.0}


class RingAttentionAnimation(Animation):
    """The player of :func:`animate_ring_attention` (the course's :class:`Animation`)."""


def _first_call(trace: Trace, phase: str) -> dict[int, list[TraceEvent]]:
    """Per global rank: the ``ring_attention`` spans of its first ring call, step by step."""
    spans: dict[int, list[TraceEvent]] = {}
    for e in trace.filter(op="compute", phase=phase):
        if e.tags.get("name") != "ring_attention":
            continue
        mine = spans.setdefault(e.rank, [])
        if not mine or e.tags["cp_step"] > mine[-1].tags["cp_step"]:
            mine.append(e)
    if not spans:
        raise ValueError(f"the trace holds no ring_attention spans of the {phase} pass: launch "
                         f"with trace=True and run context_parallel.ring_attention "
                         f"(cp_comm_type='p2p') inside the workers")
    return spans


def ring_steps(trace: Trace, phase: str = "forward") -> dict:
    """What the animation draws, read from the trace: the CP group (global ranks, ring
    order), and per step each rank's block (``holds``), pairs attended (``pairs``) and the
    messages sent (``sends``: ``[from, to, block]``, CP positions)."""
    spans = _first_call(trace, phase)
    sends = {rank: [e for e in trace.filter(op="send", phase=phase, payload="kv", rank=rank)]
             for rank in spans}
    group = next((tuple(e.group_ranks) for mine in sends.values() for e in mine),
                 tuple(sorted(spans)))
    size = len(group)
    position = {r: i for i, r in enumerate(group)}
    steps = []
    for t in range(size):
        holds, pairs, moved = {}, {}, []
        for rank, mine in spans.items():
            holds[position[rank]] = mine[t].tags["kv_block"]
            pairs[position[rank]] = mine[t].tags.get("pairs", 0)
            first_call = sends[rank][:size - 1]  # a call sends CP - 1 blocks, one a step
            if t < len(first_call):
                send = first_call[t]
                moved.append([position[rank], position[send.peer], send.tags["kv_block"]])
        steps.append({"step": t, "holds": holds, "pairs": pairs, "sends": sorted(moved)})
    first = next(iter(spans.values()))[0].tags
    return {"ranks": list(group), "size": size, "steps": steps,
            "load_balanced": bool(first.get("load_balanced", True)),
            "causal": bool(first.get("causal", True))}


def _block(x, y, w, label, color, sub="") -> list[str]:
    parts = [draw.rect(x, y, w, 34, draw.mix(color, 0.85), stroke=draw.darken(color), width=1.2),
             draw.text(x + w / 2, y + 15, label, size=12, fill=draw.text_color(draw.mix(color, 0.85)),
                       weight="600")]
    if sub:
        parts.append(draw.text(x + w / 2, y + 29, sub, size=10, fill=draw.text_color(draw.mix(color, 0.85))))
    return parts


def _kinds_grid(x, y, mine, theirs, causal) -> list[str]:
    from ..context_parallel import pair_kind  # when drawing: see animate_ring_attention
    parts = []
    for a, qc in enumerate(mine):
        for b, kc in enumerate(theirs):
            kind = pair_kind(qc, kc, causal) if causal else "full"
            fill = draw.mix("#4e79a7", KIND_FILL[kind]) if kind != "skip" else "#ffffff"
            parts.append(draw.rect(x + b * 17, y + a * 17, 15, 15, fill, stroke=LINE, width=1, rx=2))
            if kind == "diagonal":
                parts.append(f'<polygon points="{x + b * 17:.1f},{y + a * 17:.1f} '
                             f'{x + b * 17:.1f},{y + a * 17 + 15:.1f} {x + b * 17 + 15:.1f},'
                             f'{y + a * 17 + 15:.1f}" fill="#4e79a7"/>')
    return parts


def _frame(data: dict, t: int | None, chunks: list[tuple[int, ...]], causal: bool) -> str:
    size = data["size"]
    width, height = 820, TOP + size * ROW_H + 10
    q_x, kv_x, grid_x, pairs_x, send_x = 120, 260, 440, 560, 640
    body = [draw.text(LEFT, 20, "rank", size=11, anchor="start", fill=MUTED),
            draw.text(q_x + 55, 20, "queries it owns", size=11, fill=MUTED),
            draw.text(kv_x + 75, 20, "K/V block it holds" if t is not None else "K/V merged",
                      size=11, fill=MUTED),
            draw.text(grid_x + 17, 20, "q x k chunks", size=11, fill=MUTED),
            draw.text(pairs_x, 20, "pairs", size=11, fill=MUTED),
            draw.text(send_x, 20, "passes its block on to", size=11, anchor="start", fill=MUTED)]
    step = data["steps"][t] if t is not None else None
    for p in range(size):
        y = TOP + p * ROW_H
        color = draw.palette_color(p)
        body.append(draw.text(LEFT, y + 15, f"rank {data['ranks'][p]}", size=12, anchor="start",
                              weight="600"))
        body.append(draw.text(LEFT, y + 30, f"CP {p}", size=11, anchor="start", fill=MUTED))
        body += _block(q_x, y, 110, "Q " + ", ".join(map(str, chunks[p])), color, "chunks")
        if step is None:
            for owner in range(size):
                body.append(draw.rect(kv_x + owner * (150 / size), y, 150 / size - 3, 34,
                                      draw.mix(draw.palette_color(owner), 0.85),
                                      stroke=draw.darken(draw.palette_color(owner)), width=1))
            body.append(draw.text(kv_x + 75, y + 48, "every rank's block: all keys seen",
                                  size=10, fill=MUTED))
            continue
        owner = step["holds"][p]
        body += _block(kv_x, y, 150, f"K/V of CP {owner}", draw.palette_color(owner),
                       "chunks " + ", ".join(map(str, chunks[owner])))
        body += _kinds_grid(grid_x, y + 1, chunks[p], chunks[owner], causal)
        body.append(draw.text(pairs_x, y + 22, f"{step['pairs'][p]:,}", size=13, mono=True))
    if step is not None:
        for src, dst, block in step["sends"]:
            y0, y1 = TOP + src * ROW_H + 10, TOP + dst * ROW_H + 26
            lane = send_x + 70 + 16 * src  # one vertical lane per sender: no two arrows overlap
            color = draw.darken(draw.palette_color(block), 0.15)
            body.append(draw.arrow([(send_x, y0), (lane, y0), (lane, y1), (send_x, y1)], color))
            body.append(draw.text(send_x + 2, y0 - 3, f"K/V {block}", size=10, anchor="start",
                                  fill=INK))
    return draw.svg(width, height, body)


def animate_ring_attention(trace: Trace, phase: str = "forward", title: str = "") -> RingAttentionAnimation:
    """Replay the first ring-attention call of ``trace`` (its forward pass by default).

    ``trace`` may hold other work: only the ``ring_attention`` spans and the K/V sends of
    ``phase`` are read (filter it first, ``trace.filter(layer=0)``, to pick a call).
    ``data`` of the widget holds :func:`ring_steps`' steps, one per frame.
    """
    # The ring's own chunk ids, read when a ring is drawn: importing this module loads no
    # torch (context_parallel talks to processes; viz never imports torch.distributed).
    from ..context_parallel import held_chunks
    data = ring_steps(trace, phase)
    size, balanced = data["size"], data["load_balanced"]
    chunks = [held_chunks(p, size, balanced) for p in range(size)]
    causal = data["causal"]
    frames, captions, states = [], [], []
    for t, step in enumerate(data["steps"]):
        frames.append(_frame(data, t, chunks, causal))
        moving = ("each rank sends the block it holds to the next rank while it computes"
                  if step["sends"] else "the last step: nothing left to send")
        captions.append(f"step {t + 1}/{size}: rank at CP position p attends to the K/V of "
                        f"CP {'p' if t == 0 else f'p - {t}'} (mod {size}); {moving}")
        states.append(step)
    frames.append(_frame(data, None, chunks, causal))
    captions.append(f"after {size} steps every query has been merged with every rank's keys: "
                    f"the result equals serial attention")
    states.append({"step": size, "holds": None, "pairs": None, "sends": []})
    note = ("A colour is a CP rank. The small grid: each query chunk (row) against each key "
            "chunk of the block (column): filled = attended whole, triangle = the causal "
            "diagonal, white = skipped (keys after every query of the chunk).")
    return RingAttentionAnimation(frames, captions, title or f"Ring attention over {size} CP ranks",
                                  data=states, note=note, interval_ms=1600)
