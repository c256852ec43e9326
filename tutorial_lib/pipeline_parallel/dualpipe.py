"""DualPipe's two pieces that run on processes: overlapped pairs and two model copies.

DualPipe's two chunks are two copies of the model: after the last backward each weight's
gradient is summed with its twin's (:func:`sum_model_copy_gradients`).  An overlapped
pair (DualPipe's ``F&B``: a forward directly followed by a backward, both marked
``overlapped``) runs in two threads that take turns at every all-to-all
(:class:`Turns`): one half's MoE dispatch or combine is in flight while the other half
computes.
:func:`overlapped_all_to_alls` reads from a trace how much of each overlapped all-to-all
the other half hid.  The schedules themselves are pure lists
(:func:`~.zero_bubble.dualpipe`).
"""
from __future__ import annotations

import threading
import time

import torch

from .. import comm, parallel_state
from ..trace import TraceEvent, get_tracer
from .modes import TAGS

class Turns:
    """Two halves of an overlapped pair (0: the forward, 1: the backward), one thread
    each, of which exactly one runs at any time.

    A half runs until it issues an all-to-all (:func:`tutorial_lib.comm.overlap_switch`),
    then :meth:`switch` hands the turn to the other half and waits for it to come back;
    the all-to-all proceeds on gloo's own threads (NCCL: its own stream) meanwhile, and is
    waited on only when the turn returns.  The order of everything a rank issues is then
    fixed (forward first; then each half up to its next all-to-all, in turn), the same on
    every rank of an EP group, so their collectives pair up as without overlap.  Each
    stretch a half holds the turn is recorded as a ``compute`` span named ``turn``
    (tagged ``half``: ``forward`` / ``backward``, ``microbatch``, ``chunk``, ``piece``,
    and, as every event of the pair, ``pair``: ``"F5.1&B2.0"``).
    """

    def __init__(self, actions: tuple):
        self.actions = actions
        self.pair = f"{actions[0].label}&{actions[1].label}"
        self.condition = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.pieces = [0, 0]
        self.started: list = [None, None]
        self.tracer = get_tracer()

    def _begin(self, me: int) -> None:
        self.started[me] = time.time()

    def _end(self, me: int) -> None:
        action = self.actions[me]
        event = TraceEvent(rank=self.tracer.rank, op="compute", t_start=self.started[me],
                           t_end=time.time(),
                           tags={**self.tracer.current_tags(), "name": "turn",
                                 "half": ("forward", "backward")[me],
                                 "microbatch": action.microbatch, "chunk": action.chunk,
                                 "pair": self.pair, "piece": self.pieces[me]})
        self.pieces[me] += 1
        if self.tracer.enabled:
            self.tracer.events.append(event)

    def wait_for_turn(self, me: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == me)
        self._begin(me)

    def switch(self, me: int) -> None:
        """Give the turn to the other half (unless it has finished) and wait for it back."""
        with self.condition:
            if self.done[1 - me]:
                return
            self._end(me)
            self.turn = 1 - me
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == me)
        self._begin(me)

    def finish(self, me: int) -> None:
        with self.condition:
            self._end(me)
            self.done[me] = True
            self.turn = 1 - me
            self.condition.notify_all()


def overlapped_all_to_alls(events) -> list[dict]:
    """Each all-to-all run inside an overlapped pair, from a recorded trace (pure).

    ``events``: a :class:`~tutorial_lib.trace.Trace` or its events.  One row per
    all-to-all tagged ``overlapped``: ``rank``, ``pair``, ``half`` (whose it is),
    ``op_name`` (``dispatch`` / ``combine``, ...), ``microbatch``, ``chunk``, ``seconds``
    (issue to wait) and ``hidden_seconds``: the part of that interval during which the
    pair's other half was computing (its ``turn`` spans on the same rank), the time the
    all-to-all cost nobody.  The other tags that tell steps and runs apart (``run``,
    ``repeat``, ``step``) must match too.
    """
    def key(e):
        return (e.rank, e.tags.get("run"), e.tags.get("repeat"), e.tags.get("step"),
                e.tags.get("pair"))

    turns: dict = {}
    for e in events:
        if e.op == "compute" and e.tags.get("name") == "turn":
            turns.setdefault((key(e), e.tags["half"]), []).append(e)
    rows = []
    for e in events:
        if e.op != "all_to_all" or not e.tags.get("overlapped"):
            continue
        other = "backward" if e.tags["half"] == "forward" else "forward"
        hidden = sum(max(0.0, min(e.t_end, t.t_end) - max(e.t_start, t.t_start))
                     for t in turns.get((key(e), other), ()))
        rows.append({"rank": e.rank, "pair": e.tags["pair"], "half": e.tags["half"],
                     "op_name": e.tags.get("op_name"), "microbatch": e.tags.get("microbatch"),
                     "chunk": e.tags.get("chunk"), "seconds": e.t_end - e.t_start,
                     "hidden_seconds": hidden})
    return rows


# --- DualPipe's two model copies --------------------------------------------------------


#: The attribute that marks the parameters of DualPipe's second model copy: the clip's
#: global norm leaves them out (:func:`~tutorial_lib.data_parallel.counts_in_grad_norm`),
#: since their twins in the first copy hold the same gradient.
MODEL_COPY_ATTR = "model_copy"


def mark_model_copies(chunks: list) -> None:
    """Tag each parameter of DualPipe's two chunks with its copy (0 or 1): chunk ``c``
    of every rank is copy ``c`` (:data:`MODEL_COPY_ATTR`)."""
    for copy, chunk in enumerate(chunks):
        for p in chunk.parameters():
            setattr(p, MODEL_COPY_ATTR, copy)


def sum_model_copy_gradients(chunks: list, expert_loads: bool = True) -> None:
    """DualPipe: add each weight's gradient from its twin in the other model copy.

    Rank ``r``'s chunk 0 (stage ``r`` of copy 0) and rank ``PP - 1 - r``'s chunk 1
    (stage ``r`` of copy 1) are the same layers, fed different halves of the
    microbatches; after the step's last backward both take the sum of the two
    gradients, so the copies, equal at the start, stay equal after every optimizer step.
    DeepSeek's DualPipe does the same in its example (deepseek-ai/DualPipe,
    examples/example_dualpipe.py, ``main``, "Check grads": each copy's gradient plus the
    twin's, from rank ``PP - 1 - rank``; 3da1bbea).  Here the pair exchanges its
    gradients with one batched send and receive over the pipeline group (the gradient
    of the step so far: ``main_grad`` inside :class:`~tutorial_lib.data_parallel.DataParallel`,
    before its data-parallel sync).  ``expert_loads``: also add the MoE layers' expert
    loads of the step (:class:`~tutorial_lib.deepseek.DeepSeekModel`), so both copies'
    expert biases take the same auxiliary-loss-free update.  The two sums are the
    same floating-point additions on both ranks of a pair, so the copies stay equal bit
    for bit.
    """
    from ..data_parallel import main_grad_of

    pp = parallel_state.group_size("pp")
    rank = parallel_state.get_rank_in("pp")
    partner = parallel_state.get_group_ranks("pp")[pp - 1 - rank]

    def flat(chunk):
        parts = [main_grad_of(p) for p in chunk.parameters()]
        parts = [torch.zeros_like(p) if g is None else g
                 for p, g in zip(chunk.parameters(), parts)]
        if expert_loads and hasattr(chunk, "expert_loads"):
            parts += [chunk.expert_loads[i].to(parts[0].dtype) for i in sorted(chunk.expert_loads)]
        return torch.cat([t.reshape(-1) for t in parts])

    mine = [flat(chunk) for chunk in chunks]
    # theirs[c]: the partner's copy c (its own tag), the twin of my copy 1 - c
    theirs = [torch.empty_like(mine[1]), torch.empty_like(mine[0])]
    tags = (TAGS["model_copy"], TAGS["model_copy"] + 1)
    with get_tracer().tags(phase="model_copies"):
        works = comm.batch_isend_irecv(
            [("send", mine[0], partner, tags[0]), ("send", mine[1], partner, tags[1]),
             ("recv", theirs[0], partner, tags[0]), ("recv", theirs[1], partner, tags[1])],
            group="pp")
        comm.wait_all(works)
    for copy, chunk in enumerate(chunks):
        total = mine[copy] + theirs[1 - copy]
        offset = 0
        targets = [main_grad_of(p) for p in chunk.parameters()]
        for p, g in zip(chunk.parameters(), targets):
            piece = total[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if g is None:
                p.grad = piece.clone()
            else:
                g.copy_(piece)
        if expert_loads and hasattr(chunk, "expert_loads"):
            for i in sorted(chunk.expert_loads):
                load = chunk.expert_loads[i]
                load.copy_(total[offset:offset + load.numel()].round().to(load.dtype))
                offset += load.numel()
