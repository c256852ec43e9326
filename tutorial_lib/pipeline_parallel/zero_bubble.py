"""Chapter 11's schedules: the backward split into B and W, stages in a V or in two copies.

Each of these schedules splits a backward in two: B, the gradient of the stage's
input, which the previous stage waits for, and W, the gradient of its weights, which
nobody waits for and which can run any time later (an action of kind ``weight``).

:func:`zb_h1`
    ZB-H1 (Qi et al., 2024): 1F1B's order of forwards and B's, the W's deferred to
    fill the cool-down.  1F1B's memory, a bubble of ``(PP - 1)(F + B - 2W)``.
:func:`zbv`
    ZBV: two chunks per rank folded in a V (rank ``r`` runs stages ``r`` and
    ``2 PP - 1 - r``), W's filling the gaps; 1F1B's memory, half of ZB-H1's bubble.
:func:`dualpipev`
    DualPipeV: the same V, in DualPipe's order, which overlaps the forward of one
    chunk with the backward of the other (``F&B`` pairs, :attr:`Action.overlapped`).
:func:`dualpipe`
    DualPipe (DeepSeek-V3): two copies of the model, one per direction, microbatches
    entering at both ends; the same steps as DualPipeV, each half of the ranks
    mirroring the other.  Twice the parameters, ``PP + 1`` activations.

Where each stage lives is the actions' :attr:`Action.placement` (:data:`~.actions.PLACEMENTS`,
:func:`~.actions.model_stage`): a stage whose neighbour runs on the same rank (the bottom of a V;
the first and the last stage on rank 0 of a V) hands its tensor over without a message.
:func:`~.formulas.expected_bubble_time` holds the DualPipe README's table of bubbles.
"""
from __future__ import annotations

from collections import defaultdict

from ..config import ConfigError
from .actions import (Action, backward_actions, check_pipeline, forward_actions,
                      weight_actions)
from .schedules import num_warmup_microbatches


def zb_h1(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B with each backward split into B and W, and the W's deferred.

    The zero-bubble schedule of Qi et al. (2024, "Zero Bubble Pipeline Parallelism",
    section 3) that keeps 1F1B's memory.  The forwards and the B's run in 1F1B's order
    (:func:`~.schedules.one_f_one_b`: ``PP - rank - 1`` warm-up forwards, then a forward and a B in
    turn, then the B's left).  W's run in microbatch order, one right after each B from
    the ``rank``-th B on (B number ``rank``, ``rank + 1``, ...), and the ``rank`` W's
    still owed run at the end.  The last rank defers the most: its B's, and so the
    gradients the other ranks wait for, come ``W`` sooner than in 1F1B, every time, and
    the W's fill what was the cool-down's bubble.  The bubble shrinks from
    ``(PP - 1)(F + B)`` to ``(PP - 1)(F + B - 2W)`` (``B`` the whole backward:
    :func:`~.formulas.expected_bubble_time`).

    The order is torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank
    (torch 2.13.0), which its docstring calls the paper's ZB1P.
    """
    check_pipeline(pp_size, num_microbatches, rank)
    pp, m = pp_size, num_microbatches
    warmup = num_warmup_microbatches(pp, m, rank)
    actions, owed = [], []

    def backward(i):
        out = backward_actions(rank, pp, 1, i, 0)
        owed.append(i)
        if i >= rank:
            out += weight_actions(owed.pop(0), 0)
        return out

    for i in range(warmup):
        actions += forward_actions(rank, pp, 1, i, 0)
    for i in range(m - warmup):
        actions += forward_actions(rank, pp, 1, warmup + i, 0) + backward(i)
    for i in range(m - warmup, m):
        actions += backward(i)
    for i in owed:
        actions += weight_actions(i, 0)
    return actions


def _check_v(pp_size: int, num_microbatches: int, rank: int, name: str, minimum: int = 1,
             even: bool = False) -> None:
    check_pipeline(pp_size, num_microbatches, rank)
    if num_microbatches < minimum:
        raise ConfigError(name, f"num_microbatches ({num_microbatches}) must be at least "
                                f"{minimum} for {name} with pp_size {pp_size}: the schedule's "
                                f"steady state needs that many; run {minimum} or more")
    if even and pp_size % 2:
        fixes = " or ".join(str(k) for k in (pp_size - 1, pp_size + 1) if k > 0)
        raise ConfigError(name, f"pp_size ({pp_size}) must be even for {name}: each half of "
                                f"the ranks mirrors the other; try {fixes}")
    if even and num_microbatches % 2:
        raise ConfigError(name, f"num_microbatches ({num_microbatches}) must be even for "
                                f"{name}: half enter from each end; try {num_microbatches + 1}")


class _Program:
    """Turns a rank's sequence of compute steps into actions, numbering the microbatches.

    Each stream of computes (forwards of chunk 0, B's of chunk 1, ...) takes its
    microbatches in order, as the DualPipe and torch schedules count them; a W takes
    the oldest backward still owing one."""

    def __init__(self, rank: int, pp: int, placement: str, first_microbatch=lambda chunk: 0,
                 num_microbatches: int | None = None):
        self.rank, self.pp, self.placement = rank, pp, placement
        self.first, self.m = first_microbatch, num_microbatches
        self.count: dict[tuple[str, int], int] = defaultdict(int)
        self.owed: list[tuple[int, int]] = []
        self.actions: list[Action] = []

    def _next(self, kind: str, chunk: int) -> int:
        i = self.count[(kind, chunk)]
        self.count[(kind, chunk)] += 1
        return self.first(chunk) + i

    def _keep(self, microbatch: int) -> bool:
        return self.m is None or microbatch < self.m

    def forward(self, chunk: int, overlapped: bool = False) -> list[Action]:
        i = self._next("forward", chunk)
        return forward_actions(self.rank, self.pp, 2, i, chunk, self.placement, overlapped) \
            if self._keep(i) else []

    def backward(self, chunk: int, split: bool, overlapped: bool = False) -> list[Action]:
        i = self._next("backward", chunk)
        if split:
            self.owed.append((i, chunk))
        return backward_actions(self.rank, self.pp, 2, i, chunk, None, self.placement, overlapped) \
            if self._keep(i) else []

    def weight(self, chunk: int | None = None) -> list[Action]:
        """The oldest W owed (of ``chunk`` only, if given); nothing if none is owed."""
        for k, (i, c) in enumerate(self.owed):
            if chunk is None or c == chunk:
                del self.owed[k]
                return weight_actions(i, c, self.placement) if self._keep(i) else []
        return []

    def pair(self, forward_chunk: int, backward_chunk: int) -> list[Action]:
        """An overlapped ``F&B``: both receives, the two computes, both sends."""
        f = self.forward(forward_chunk, overlapped=True)
        b = self.backward(backward_chunk, split=False, overlapped=True)
        fi = next(k for k, a in enumerate(f) if a.is_compute)
        bi = next(k for k, a in enumerate(b) if a.is_compute)
        return f[:fi] + b[:bi] + [f[fi], b[bi]] + f[fi + 1:] + b[bi + 1:]

    def run(self, *steps: list[Action]) -> None:
        for step in steps:
            self.actions += step


def zbv(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """ZBV: the V-shaped zero-bubble schedule (Qi et al., 2024, section 6), two chunks
    per rank.

    Rank ``r`` runs model stages ``r`` (chunk 0) and ``2 PP - 1 - r`` (chunk 1), the
    ``v`` placement: the last rank turns the V, so a microbatch's forward runs down
    the ranks and back up, and the loss (and the first backward) lands on rank 0,
    where the batch entered.  Each backward is split into B and W.  Counting ``n =
    max(M, 2 PP - 1)`` microbatches (fewer cannot fill the V; the ones past ``M`` are
    dropped at the end), rank ``r`` runs:

    1. ``2 (PP - r) - 1`` forwards of chunk 0;
    2. ``r`` times: a forward of chunk 1, a forward of chunk 0;
    3. ``PP - r`` times: forward, B, W of chunk 1;
    4. until every forward has run: a forward of chunk 0 (while any is left), B and W
       of chunk 0, forward, B and W of chunk 1;
    5. ``r`` times: B of chunk 0, B of chunk 1 (their W's wait);
    6. ``PP - r`` times: B of chunk 0 and the oldest W owed by chunk 0;
    7. the W's still owed, chunk 1's first.

    With ``F = B = W`` (input backward and weight part equal, forward as long) the
    steady state has no bubble at all.  The order is torch's ``ScheduleZBVZeroBubble``
    (torch 2.13.0).
    """
    _check_v(pp_size, num_microbatches, rank, "zbv")
    pp, r = pp_size, rank
    n = max(num_microbatches, 2 * pp - 1)
    go = _Program(r, pp, "v", num_microbatches=num_microbatches)
    for _ in range(2 * (pp - r) - 1):
        go.run(go.forward(0))
    for _ in range(r):
        go.run(go.forward(1), go.forward(0))
    for _ in range(pp - r):
        go.run(go.forward(1), go.backward(1, split=True), go.weight(1))
    while go.count[("forward", 1)] < go.count[("forward", 0)] or go.count[("forward", 0)] < n:
        if go.count[("forward", 0)] < n:
            go.run(go.forward(0))
        go.run(go.backward(0, split=True), go.weight(0),
               go.forward(1), go.backward(1, split=True), go.weight(1))
    for _ in range(r):
        go.run(go.backward(0, split=True), go.backward(1, split=True))
    for _ in range(pp - r):
        go.run(go.backward(0, split=True), go.weight(0))
    for chunk in (1, 0):
        while any(c == chunk for _, c in go.owed):
            go.run(go.weight(chunk))
    return go.actions


def _dualpipe_program(go: _Program, ranks: int, rank: int, microbatches: int,
                      chunk_of_phase, turning: bool) -> list[Action]:
    """The step sequence DualPipe's and DualPipeV's ``step`` share.

    ``ranks``, ``rank``, ``microbatches``: DualPipeV's ``PP``, ``r``, ``M``; for DualPipe
    the half of the pipeline a rank is in: ``PP / 2``, ``min(r, PP - 1 - r)``, ``M / 2``.
    A *phase* is 0 for the chunk that is nearer the start of its pipe (DualPipeV: the
    way down; DualPipe: the direction that enters on this rank's side), 1 for the
    other; ``chunk_of_phase`` maps it.  ``turning``: the rank where the two phases
    meet (DualPipeV's last rank, DualPipe's two middle ranks)."""
    n, h, c0, c1 = ranks, rank, chunk_of_phase(0), chunk_of_phase(1)
    for _ in range(2 * (n - h - 1)):                         # 1: forwards of phase 0
        go.run(go.forward(c0))
    for _ in range(h + 1):                                   # 2: F0 F1
        go.run(go.forward(c0), go.forward(c1))
    for _ in range(n - h - 1):                               # 3: B1 W1 F1, zero bubble
        go.run(go.backward(c1, split=True), go.weight(), go.forward(c1))
    for i in range(microbatches - 2 * n + h + 1):            # 4: F0&B1, F1&B0
        if i == 0 and turning:  # the first pair runs apart: it shortens the bubble
            go.run(go.forward(c0), go.backward(c1, split=False))
        else:
            go.run(go.pair(c0, c1))
        go.run(go.pair(c1, c0))
    for _ in range(n - h - 1):                               # 5: B1, F1&B0
        go.run(go.backward(c1, split=False), go.pair(c1, c0))
    split = False
    for i in range(h + 1):                                   # 6: B1 B0, split from the middle
        if i == (h + 1) // 2 and h % 2 == 1:
            split = True
        go.run(go.backward(c1, split=split))
        if i == (h + 1) // 2 and h % 2 == 0:
            split = True
        go.run(go.backward(c0, split=split))
    for _ in range(n - h - 1):                               # 7: W, B0
        go.run(go.weight(), go.backward(c0, split=split))
    for _ in range(h + 1):                                   # 8: the W's left
        go.run(go.weight())
    assert not go.owed
    return go.actions


def dualpipev(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """DualPipeV: DualPipe cut in half (Sea AI Lab's "cut-in-half"), one model copy in a V.

    ``PP`` ranks hold ``2 PP`` stages in the ``v`` placement (as :func:`zbv`): chunk 0
    on the way down, chunk 1 on the way back up.  It is DualPipe's schedule for the
    first half of DualPipe's ranks, with the other direction folded onto the same
    ranks: where DualPipe's rank ``r`` overlaps a forward of one direction with a
    backward of the other, DualPipeV's overlaps chunk 0 with chunk 1.  Rank ``r``
    (``n = PP``, ``M >= 2 PP``):

    1. ``2 (n - r - 1)`` forwards of chunk 0;
    2. ``r + 1`` times: F of chunk 0, F of chunk 1;
    3. ``n - r - 1`` times: B (split) of chunk 1, a W, F of chunk 1;
    4. ``M - 2n + r + 1`` times: the pairs ``F0&B1`` and ``F1&B0`` (overlapped, whole
       backwards; the last rank runs its very first pair one after the other);
    5. ``n - r - 1`` times: B of chunk 1, the pair ``F1&B0``;
    6. ``r + 1`` times: B of chunk 1, B of chunk 0, split from the middle on;
    7. ``n - r - 1`` times: a W, B of chunk 0;
    8. the ``r + 1`` W's left.

    A W is always the oldest one owed.  deepseek-ai/DualPipe, dualpipe/dualpipev.py
    (``DualPipeV.step``, commit 3da1bbea); the order is torch's ``ScheduleDualPipeV``
    (torch 2.13.0).
    """
    _check_v(pp_size, num_microbatches, rank, "dualpipev", minimum=2 * pp_size)
    go = _Program(rank, pp_size, "v")
    return _dualpipe_program(go, pp_size, rank, num_microbatches, lambda phase: phase,
                             turning=rank == pp_size - 1)


def dualpipe(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """DualPipe (DeepSeek-V3 technical report, section 3.2.1): two model copies, the
    microbatches entering from both ends.

    The ``dual`` placement: chunk 0 of rank ``r`` is stage ``r`` of copy 0, whose
    microbatches ``0 .. M/2 - 1`` enter on rank 0 and go down; chunk 1 is stage
    ``PP - 1 - r`` of copy 1, whose microbatches ``M/2 .. M - 1`` enter on rank
    ``PP - 1`` and go up.  Each stage exists twice (on ranks ``r`` and ``PP - 1 - r``),
    so a rank holds twice the parameters, and the two copies' gradients are summed
    before the optimizer step.  Rank ``r`` runs DualPipeV's steps
    (:func:`dualpipev`) for its half of the pipeline: ``n = PP / 2`` ranks, position
    ``h = min(r, PP - 1 - r)``, ``M / 2`` microbatches per direction; its phase 0 is
    the direction that enters on its side (copy 0 for the first half, copy 1 for the
    second), and the two middle ranks are where the directions meet.  ``PP`` and
    ``M`` even, ``M >= 2 PP``.  deepseek-ai/DualPipe, dualpipe/dualpipe.py
    (``DualPipe.step``, commit 3da1bbea).
    """
    _check_v(pp_size, num_microbatches, rank, "dualpipe", minimum=2 * pp_size, even=True)
    pp, m = pp_size, num_microbatches
    second_half = rank >= pp // 2
    go = _Program(rank, pp, "dual", first_microbatch=lambda chunk: chunk * (m // 2))
    return _dualpipe_program(go, pp // 2, min(rank, pp - 1 - rank), m // 2,
                             lambda phase: phase ^ second_half,
                             turning=rank in (pp // 2 - 1, pp // 2))
