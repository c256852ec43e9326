"""Pipeline schedules as plain data: who computes what, who sends what to whom, and when.

A pipeline cuts the model into ``pp_size`` stages, one per rank of a pipeline group
(``pp_size * V`` model stages, ``V`` chunks per rank, with interleaving), and cuts the
batch into ``num_microbatches`` microbatches.  A *schedule* is the
ordered list of :class:`Action` one rank performs in one training step: forwards and
backwards of microbatches, and the point-to-point messages between them.  Nothing
here imports torch or starts a process, so chapters, widgets and tests read the
lists directly, and :func:`simulate` plays them on paper.

Three schedules are built, each for one ``rank`` of the pipeline group:

:func:`gpipe`
    every forward, then every backward.  Simple, but a rank holds the
    activations of all ``M`` microbatches at once.
:func:`one_f_one_b`
    non-interleaved 1F1B (Megatron's ``forward_backward_pipelining_without_interleaving``):
    ``min(PP - rank - 1, M)`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards.  Same bubble as GPipe, but at most
    ``min(PP - rank, M)`` microbatches in flight.
:func:`interleaved_one_f_one_b`
    Megatron's interleaved 1F1B: each rank holds ``V`` model chunks; chunk ``c`` of
    rank ``r`` is model stage ``c * PP + r``.  The bubble shrinks by ``V``.  The
    order is Megatron-Core 0.20.0's (the schedule table of 0.10 and later, for every
    ``M`` it accepts, ``M == PP`` included).

Four more split each backward in two (chapter 11): B, the gradient of the stage's
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

Where each stage lives is the actions' :attr:`Action.placement` (:data:`PLACEMENTS`,
:func:`model_stage`): a stage whose neighbour runs on the same rank (the bottom of a V;
the first and the last stage on rank 0 of a V) hands its tensor over without a message.
:func:`expected_bubble_time` holds the DualPipe README's table of bubbles.

Messages (the ``peer`` is a rank of the pipeline group):

* activations go forward, from model stage ``s`` to ``s + 1``: rank ``r`` sends to
  ``r + 1``; with interleaving the last rank's chunk ``c`` sends to rank 0's chunk
  ``c + 1`` (the ring wraps);
* activation gradients go the other way, ``s + 1`` to ``s``;
* labels go from the first model stage (which reads the batch) to the last (which
  computes the loss), one message per microbatch: the first model stage sends them
  just before its forward, the last receives them just before its forward (the loss).

Each message sits next to the compute that needs it: a send right after the
forward or backward that produced it, a receive right before the compute that
consumes it.  For non-interleaved 1F1B that *is* Megatron's order: the steady
state's ``send_forward_recv_backward`` is ``send_activation`` then ``recv_grad``,
both with the **next** rank, and ``send_backward_recv_forward`` is ``send_grad``
then ``recv_activation``, both with the previous rank.  For the interleaved
schedule it is Megatron's compute order with overlapped P2P (``overlap_p2p_comm``,
what Megatron uses with interleaving): sends posted as soon as their tensor exists,
receives waited on just before use.

The simulator executes every rank's list at once.  Sends are *buffered*: a send
never waits for its receiver (an ``isend`` into a buffer, the way a batched or
overlapped op lets the partner's send and receive proceed together); a receive
blocks until the matching send has happened.  Messages are matched in order per
``(sender, receiver, payload)``.  If no rank can move, that is a deadlock and
:class:`DeadlockError` says what each rank is waiting for.  A batched-mode bug that
is easy to write, ``send_forward_recv_backward`` receiving the gradient from the
*previous* rank (``get_pipeline_model_parallel_prev_rank``) instead of the next, is
available as ``one_f_one_b(..., wrong_recv_backward_peer=True)`` so a chapter can
show it deadlock with ``PP >= 3`` and look fine with ``PP = 2``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction

from .config import ConfigError

COMPUTE_KINDS = ("forward", "backward", "weight")
SEND_KINDS = ("send_activation", "send_grad", "send_labels")
RECV_KINDS = ("recv_activation", "recv_grad", "recv_labels")
ACTION_KINDS = COMPUTE_KINDS + SEND_KINDS + RECV_KINDS

#: What a send or receive carries: the key messages are matched on.
PAYLOAD = {"send_activation": "activation", "recv_activation": "activation",
           "send_grad": "grad", "recv_grad": "grad",
           "send_labels": "labels", "recv_labels": "labels"}

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
"""The schedules a training run takes (``train_4d --schedule``)."""

SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zbv", "dualpipev", "dualpipe")
"""The schedules that split a backward into B (input gradient) and W (weight gradient):
built and simulated here (:func:`build_schedules`); chapter 11."""

ALL_SCHEDULES = SCHEDULE_NAMES + SPLIT_BACKWARD_SCHEDULES
"""Every schedule :func:`build_schedules` builds."""

PLACEMENTS = ("loop", "v", "dual")
"""How a schedule places model stages on ranks (:func:`model_stage`): ``loop`` (chunk
``c`` of rank ``r`` runs stage ``c * PP + r``: one chunk per rank, or Megatron's
interleaving), ``v`` (two chunks per rank folded in a V: rank ``r`` runs stages ``r``
and ``2 PP - 1 - r``; ZBV, DualPipeV), ``dual`` (two model copies, one per chunk, in
opposite directions: chunk 0 of rank ``r`` runs stage ``r`` of copy 0, chunk 1 runs
stage ``PP - 1 - r`` of copy 1; DualPipe)."""

SCHEDULE_PLACEMENT = {"zbv": "v", "dualpipev": "v", "dualpipe": "dual"}
"""Where each schedule places its stages (:data:`PLACEMENTS`); every other schedule: ``loop``."""

TWO_CHUNK_SCHEDULES = tuple(SCHEDULE_PLACEMENT)
"""The schedules whose ranks hold two chunks, placed in a V or as two model copies."""

P2P_MODES = ("sequential", "overlapped", "batched")
"""How :mod:`tutorial_lib.p2p` issues a step's sends and receives (``p2p.MODES``); named here,
without torch, so that a run's arguments can be checked before torch is loaded."""

TRAINING_P2P_MODES = ("batched", "overlapped")
"""The modes a training run takes: Megatron's two (``batch_p2p_comm`` on or off).
``sequential`` (blocking send, then blocking receive) is chapter 7's teaching construct:
Megatron has no such mode."""


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule."""

    kind: str
    """What happens: ``forward``, ``backward``, ``weight``, or a ``send_``/``recv_`` of
    ``activation``, ``grad`` or ``labels`` (see :data:`ACTION_KINDS`).

    ``backward`` is the whole backward of the chunk (input and weight gradients), unless
    the same rank's list also holds a ``weight`` for the same microbatch and chunk: then
    the schedule has split that backward, ``backward`` is B (the gradient of the input
    only, the one the previous stage waits for) and ``weight`` is W (the gradient of the
    weights, which nobody waits for and which may run any time after B).  A schedule may
    split some backwards and not others (DualPipe does): :func:`split_backwards` lists
    the split ones."""

    microbatch: int
    """Which microbatch (0-based) is computed, or whose tensor the message carries."""

    chunk: int = 0
    """The model chunk on this rank it belongs to (Megatron's virtual pipeline rank,
    ``0 .. V-1``; always 0 without interleaving).  Which model stage the chunk runs
    depends on the :attr:`placement`: see :meth:`model_stage`."""

    peer: int | None = None
    """For a send or receive, the pipeline-group rank at the other end; ``None`` for compute."""

    placement: str = "loop"
    """How the schedule places stages on ranks (:data:`PLACEMENTS`): ``loop`` for GPipe,
    1F1B, interleaved 1F1B and ZB-H1, ``v`` for ZBV and DualPipeV, ``dual`` for DualPipe
    (where the chunk is the model copy)."""

    overlapped: bool = False
    """``True`` for the two halves of an overlapped pair (DualPipe's ``F&B``): a
    ``forward`` directly followed, in the list, by a ``backward`` of another
    microbatch (and chunk), both marked.  The pair runs as one: while one half
    computes, the other's communication (the MoE all-to-alls) proceeds.  The
    simulator gives the pair one cost, ``overlapped_cost``."""

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; kinds are {', '.join(ACTION_KINDS)}")
        if (self.peer is None) != (self.kind in COMPUTE_KINDS):
            raise ValueError(f"{self.kind} needs peer=None for compute and a peer rank for "
                             f"sends/receives; got peer={self.peer!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}; placements are "
                             f"{', '.join(PLACEMENTS)}")
        if self.placement != "loop" and self.chunk not in (0, 1):
            raise ValueError(f"placement {self.placement!r} has two chunks per rank, 0 and 1; "
                             f"got chunk {self.chunk}")
        if self.overlapped and self.kind not in ("forward", "backward"):
            raise ValueError(f"only a forward and a backward can be overlapped, not a {self.kind}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def model_stage(self, rank: int, pp_size: int) -> int:
        """The model stage this action's chunk runs on ``rank`` (:func:`model_stage`):
        ``chunk * pp_size + rank`` in the ``loop`` placement."""
        return model_stage(self.placement, rank, self.chunk, pp_size)

    @property
    def label(self) -> str:
        """Short name for a bar: ``F3``, ``B3``, ``W3`` (``F3.1``: chunk 1), ``send_grad 3 -> 0``."""
        chunk = f".{self.chunk}" if self.chunk else ""
        if self.is_compute:
            return f"{self.kind[0].upper()}{self.microbatch}{chunk}"
        arrow = "->" if self.kind.startswith("send") else "<-"
        return f"{self.kind} {self.microbatch}{chunk} {arrow} {self.peer}"


# --- where the stages live -----------------------------------------------------------------


def model_stage(placement: str, rank: int, chunk: int, pp_size: int) -> int:
    """The model stage that ``chunk`` of ``rank`` runs under ``placement`` (:data:`PLACEMENTS`).

    ``loop``: ``chunk * PP + rank``.  ``v``: ``rank`` for chunk 0, ``2 PP - 1 - rank``
    for chunk 1 (the last rank holds the V's two middle stages, rank 0 the first and the
    last).  ``dual``: stage ``rank`` of copy 0 for chunk 0, stage ``PP - 1 - rank`` of
    copy 1 for chunk 1 (each copy has ``PP`` stages; the chunk says which copy).
    """
    if placement == "loop":
        return chunk * pp_size + rank
    if placement == "v":
        return rank if chunk == 0 else 2 * pp_size - 1 - rank
    if placement == "dual":
        return rank if chunk == 0 else pp_size - 1 - rank
    raise ValueError(f"unknown placement {placement!r}; placements are {', '.join(PLACEMENTS)}")


def stage_holder(placement: str, stage: int, pp_size: int, copy: int = 0) -> tuple[int, int]:
    """The ``(rank, chunk)`` that runs model ``stage`` (of model ``copy``, for ``dual``):
    the inverse of :func:`model_stage`."""
    if placement == "loop":
        return stage % pp_size, stage // pp_size
    if placement == "v":
        return (stage, 0) if stage < pp_size else (2 * pp_size - 1 - stage, 1)
    if placement == "dual":
        return (stage, 0) if copy == 0 else (pp_size - 1 - stage, 1)
    raise ValueError(f"unknown placement {placement!r}; placements are {', '.join(PLACEMENTS)}")


def num_model_stages(placement: str, pp_size: int, chunks_per_rank: int = 1) -> int:
    """Model stages of one model copy: ``V * PP`` (``loop``), ``2 PP`` (``v``), ``PP`` (``dual``,
    whose ranks hold ``2 PP`` stages in all, two copies of the ``PP`` stages)."""
    return {"loop": chunks_per_rank * pp_size, "v": 2 * pp_size, "dual": pp_size}[placement]


def split_backwards(actions: list[Action]) -> set[tuple[int, int]]:
    """The ``(microbatch, chunk)`` pairs whose backward this list splits into B and W:
    those with a ``weight`` action.  Their ``backward`` computes the input's gradient
    only; every other ``backward`` computes both gradients at once."""
    return {(a.microbatch, a.chunk) for a in actions if a.kind == "weight"}


# --- validation --------------------------------------------------------------------------


def _check_positive(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("malformed", f"{name} ({value!r}) must be an integer >= 1: {what}")


def _check(pp_size: int, num_microbatches: int, rank: int, virtual_pipeline_size: int = 1,
           microbatch_group_size_per_vp_stage: int | None = None) -> None:
    _check_positive("pp_size", pp_size, "a pipeline has at least one stage")
    _check_positive("num_microbatches", num_microbatches, "a step runs at least one microbatch")
    _check_positive("virtual_pipeline_size", virtual_pipeline_size,
                    "each rank holds at least one model chunk")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp_size:
        raise ConfigError("malformed", f"rank ({rank!r}) must be a pipeline rank in 0..{pp_size - 1} "
                                       f"for pp_size {pp_size}")
    if virtual_pipeline_size > 1 and pp_size < 2:
        raise ConfigError("interleaved schedule",
                          f"virtual_pipeline_size ({virtual_pipeline_size}) > 1 needs pp_size >= 2, "
                          f"got pp_size {pp_size}: with one stage there is nothing to interleave; "
                          f"use virtual_pipeline_size=1")
    if virtual_pipeline_size > 1:
        check_microbatch_groups(pp_size, num_microbatches, microbatch_group_size_per_vp_stage)
    elif microbatch_group_size_per_vp_stage is not None:
        raise ConfigError("interleaved schedule",
                          f"microbatch_group_size_per_vp_stage ({microbatch_group_size_per_vp_stage}) "
                          f"only applies to the interleaved schedule (virtual_pipeline_size >= 2), "
                          f"got virtual_pipeline_size {virtual_pipeline_size}; leave it None")


def check_schedule_and_mode(schedule: str, p2p_mode: str, pp_size: int | None = None) -> None:
    """Refuse unknown names and every (schedule, P2P mode) pair Megatron does not run.

    What Megatron-Core 0.20.0 allows, and so what a run here accepts:

    * ``sequential`` with any schedule: refused.  Megatron's P2P layer has two paths,
      ``_batched_p2p_ops`` and ``_p2p_ops``, and both post every send and receive of
      a call before waiting for any; nothing sends, blocks, then receives.
    * ``1f1b`` with ``batched`` (Megatron-LM's only choice without interleaving: its
      argument check turns ``overlap_p2p_comm`` off, and ``batch_p2p_comm = not
      overlap_p2p_comm``) or ``overlapped`` (Megatron-Core's ``batch_p2p_comm=False``:
      the unbatched ``_p2p_ops``, every helper waiting before it returns).
    * ``interleaved`` with ``overlapped`` (Megatron-LM's default with interleaving) at
      any ``PP >= 2``, or with ``batched`` (``--no-overlap-p2p-communication``) only at
      ``PP > 2``: Megatron-LM's ``validate_args`` asserts it, because at ``PP = 2`` one
      batch would hold two sends and two receives between the same two ranks.
    * ``gpipe`` is the course's schedule (Megatron has none); it runs with Megatron's
      two modes.  So do issue 20's (:data:`SPLIT_BACKWARD_SCHEDULES`; Megatron has none
      of them either): the executor posts every one of their sends at once and waits
      for it at the end of the step, in either mode.

    ``pp_size``: the pipeline size, for the last rule (``None``: not checked).
    """
    if schedule not in ALL_SCHEDULES:
        raise ConfigError("malformed", f"schedule must be one of "
                                       f"{', '.join(ALL_SCHEDULES)}, got {schedule!r}")
    if p2p_mode not in P2P_MODES:
        raise ConfigError("malformed", f"p2p_mode must be one of {', '.join(P2P_MODES)}, "
                                       f"got {p2p_mode!r}")
    if p2p_mode not in TRAINING_P2P_MODES:
        raise ConfigError(
            "p2p mode",
            f"p2p_mode {p2p_mode!r} (a blocking send, then a blocking receive) is chapter 7's "
            f"teaching construct, not a mode Megatron has: its batched and unbatched paths "
            f"both post every send and receive before waiting.  Use --p2p-mode batched "
            f"(Megatron's default) or overlapped (batch_p2p_comm=False)")
    if schedule == "interleaved" and p2p_mode == "batched" and pp_size is not None \
            and pp_size <= 2:
        raise ConfigError(
            "interleaved schedule",
            f"the interleaved schedule with batched P2P (overlap_p2p_comm off) needs "
            f"pipeline_model_parallel_size > 2, got {pp_size}: at PP = 2 the previous and "
            f"the next rank are the same, and one batch would send and receive twice "
            f"between the same two ranks (Megatron-LM's validate_args refuses it).  Use "
            f"--p2p-mode overlapped (Megatron's default with interleaving) or PP >= 3")


def check_microbatch_groups(pp_size: int, num_microbatches: int,
                            microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """The interleaved schedule's rules on ``M``; returns the group size ``N`` it uses.

    The interleaved schedule takes the microbatches through each chunk in groups of
    ``N = microbatch_group_size_per_vp_stage`` consecutive microbatches
    (:func:`get_schedule_table`); ``None`` means ``N = PP``, Megatron's default (a
    depth-first schedule).  Megatron-Core 0.20.0
    (``forward_backward_pipelining_with_interleaving``) refuses two cases, and so
    does this function, with a :class:`ConfigError`:

    * ``N < PP`` or ``N > M``: a group must fill the pipeline and fit in the step;
    * a last, shorter group of ``0 < M mod N < PP`` microbatches: it cannot fill the
      pipeline either (Megatron calls it a dependency bubble).

    With the default ``N = PP`` both say: ``M`` must be a multiple of ``PP``.
    """
    pp, m, n = pp_size, num_microbatches, microbatch_group_size_per_vp_stage
    if n is None:
        if m % pp:
            lower = m // pp * pp
            fixes = " or ".join(str(k) for k in (lower, lower + pp) if k > 0)
            raise ConfigError(
                "interleaved schedule",
                f"num_microbatches ({m}) must be divisible by pp_size ({pp}) for the interleaved "
                f"schedule: the microbatches go through each chunk in groups of "
                f"microbatch_group_size_per_vp_stage, pp_size by default, and a group (the last "
                f"one too) needs at least pp_size microbatches to fill the pipeline; try {fixes} "
                f"microbatches")
        return pp
    _check_positive("microbatch_group_size_per_vp_stage", n,
                    "a group holds at least one microbatch")
    if not pp <= n <= m:
        fix = (f"try a group size from {pp} to {m}" if pp <= m else
               f"run at least {pp} microbatches")
        raise ConfigError(
            "interleaved schedule",
            f"microbatch_group_size_per_vp_stage ({n}) must lie between pp_size ({pp}) and "
            f"num_microbatches ({m}): a group must fill the pipeline and fit in the step; {fix}")
    if 0 < m % n < pp:
        lower, left = m // n * n, m % n
        raise ConfigError(
            "interleaved schedule",
            f"num_microbatches ({m}) in groups of microbatch_group_size_per_vp_stage ({n}) "
            f"leaves a last group of {left} microbatch{'es' if left > 1 else ''}, fewer than "
            f"pp_size ({pp}): it cannot fill the pipeline; try {lower} or {lower + pp} "
            f"microbatches (a multiple of {n}, or at least {pp} left over)")
    return n


# --- the building blocks: one forward or backward with its messages ------------------------


def _forward(rank: int, pp: int, v: int, microbatch: int, chunk: int, placement: str = "loop",
             overlapped: bool = False) -> list[Action]:
    """Receive the input, move the labels, run chunk ``chunk``'s forward, send the output.

    A neighbouring stage on the same rank (the V's turn) hands its tensor over without
    a message; so do the first and the last stage when one rank holds both (the labels).
    """
    stage, last = model_stage(placement, rank, chunk, pp), num_model_stages(placement, pp, v) - 1
    copy = chunk if placement == "dual" else 0
    first_rank = stage_holder(placement, 0, pp, copy)[0]
    last_rank = stage_holder(placement, last, pp, copy)[0]

    def act(kind, peer=None):
        return Action(kind, microbatch, chunk, peer, placement,
                      overlapped and kind == "forward")

    out = []
    if stage > 0 and (src := stage_holder(placement, stage - 1, pp, copy)[0]) != rank:
        out.append(act("recv_activation", src))
    if first_rank != last_rank and stage == 0:
        out.append(act("send_labels", last_rank))
    if first_rank != last_rank and stage == last:
        out.append(act("recv_labels", first_rank))  # the loss needs them
    out.append(act("forward"))
    if stage < last and (dst := stage_holder(placement, stage + 1, pp, copy)[0]) != rank:
        out.append(act("send_activation", dst))
    return out


def _backward(rank: int, pp: int, v: int, microbatch: int, chunk: int,
              grad_from: int | None = None, placement: str = "loop",
              overlapped: bool = False) -> list[Action]:
    """Receive the output's gradient, run chunk ``chunk``'s backward, send the input's gradient.

    ``grad_from`` overrides the peer the gradient is received from: only the
    deliberately wrong variant of :func:`one_f_one_b` uses it.  In a schedule that
    splits this backward the ``weight`` comes later, on its own (:func:`_weight`).
    """
    stage, last = model_stage(placement, rank, chunk, pp), num_model_stages(placement, pp, v) - 1
    copy = chunk if placement == "dual" else 0

    def act(kind, peer=None):
        return Action(kind, microbatch, chunk, peer, placement,
                      overlapped and kind == "backward")

    out = []
    if stage < last and (src := stage_holder(placement, stage + 1, pp, copy)[0]) != rank:
        out.append(act("recv_grad", src if grad_from is None else grad_from))
    out.append(act("backward"))
    if stage > 0 and (dst := stage_holder(placement, stage - 1, pp, copy)[0]) != rank:
        out.append(act("send_grad", dst))
    return out


def _weight(microbatch: int, chunk: int, placement: str = "loop") -> list[Action]:
    """W: the weight gradient of a backward split earlier; no message."""
    return [Action("weight", microbatch, chunk, placement=placement)]


# --- the schedules ------------------------------------------------------------------------


def gpipe(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """GPipe: all ``M`` forwards, then all ``M`` backwards (in microbatch order)."""
    _check(pp_size, num_microbatches, rank)
    actions = []
    for i in range(num_microbatches):
        actions += _forward(rank, pp_size, 1, i, 0)
    for i in range(num_microbatches):
        actions += _backward(rank, pp_size, 1, i, 0)
    return actions


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> list[tuple[int, int]]:
    """The interleaved schedule's forwards in order, as ``(microbatch, chunk)`` pairs.

    The microbatches are cut into groups of ``N = microbatch_group_size_per_vp_stage``
    consecutive ones (the last group holds what is left, at most ``N``).  Group by
    group, the whole group goes through chunk 0, then through chunk 1, ..., then
    chunk ``V - 1``.  Megatron-Core >= 0.10 builds this table (same name) and drives
    the interleaved schedule with it for every ``M``; the backwards run the same
    table with the chunks reversed (chunk ``c`` -> ``V - 1 - c``).

    >>> get_schedule_table(5, 2, 3)   # PP = 2, N = 3: microbatches 0-2, then 3-4
    [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    """
    for name, value in (("num_microbatches", num_microbatches), ("num_model_chunks", num_model_chunks),
                        ("microbatch_group_size_per_vp_stage", microbatch_group_size_per_vp_stage)):
        _check_positive(name, value, "the schedule table counts from 1")
    n = microbatch_group_size_per_vp_stage
    table = []
    for first in range(0, num_microbatches, n):
        group = range(first, min(first + n, num_microbatches))
        table += [(i, c) for c in range(num_model_chunks) for i in group]
    return table


def num_warmup_microbatches(pp_size: int, num_microbatches: int, rank: int,
                            virtual_pipeline_size: int = 1,
                            microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """Forwards a rank runs before its first 1F1B pair (Megatron's count).

    Non-interleaved: ``min(PP - rank - 1, M)``: rank ``r`` must fill the
    ``PP - r - 1`` stages after it before the first gradient can come back.
    Interleaved (``V > 1``, counted in chunk-microbatches out of ``V * M``):
    ``min(2 * (PP - rank - 1) + (V - 1) * N, V * M)`` with ``N`` the group size of
    :func:`check_microbatch_groups` (``PP`` by default), the rule of Megatron-Core
    >= 0.10 (``get_pp_rank_microbatches``, 0.20.0).  When it reaches ``V * M`` every
    forward runs before any backward.  (Up to Megatron-Core 0.9 that was also
    forced whenever ``M == PP``; since 0.10 ``M == PP`` follows the same count.)
    """
    _check(pp_size, num_microbatches, rank, virtual_pipeline_size, microbatch_group_size_per_vp_stage)
    pp, m, v = pp_size, num_microbatches, virtual_pipeline_size
    if v == 1:
        return min(pp - rank - 1, m)
    n = check_microbatch_groups(pp, m, microbatch_group_size_per_vp_stage)
    return min(2 * (pp - rank - 1) + (v - 1) * n, v * m)


def one_f_one_b(pp_size: int, num_microbatches: int, rank: int, *,
                wrong_recv_backward_peer: bool = False) -> list[Action]:
    """Non-interleaved 1F1B: warm-up forwards, steady 1F1B pairs, cool-down backwards.

    ``wrong_recv_backward_peer=True`` reproduces a batched-mode bug for teaching: in
    the steady state, ``send_forward_recv_backward`` receives the gradient from the
    *previous* rank instead of the next one.  With ``PP = 2`` the two are the same
    rank and nothing shows; with ``PP >= 3`` (and ``M >= 2``, so that a steady state
    exists before the last stage) :func:`simulate` deadlocks.
    """
    _check(pp_size, num_microbatches, rank)
    pp, m = pp_size, num_microbatches
    warmup = num_warmup_microbatches(pp, m, rank)
    steady = m - warmup
    wrong_peer = (rank - 1) % pp if wrong_recv_backward_peer else None
    actions = []
    for i in range(warmup):
        actions += _forward(rank, pp, 1, i, 0)
    for i in range(steady):  # F's send, B's receive: one send_forward_recv_backward
        actions += _forward(rank, pp, 1, warmup + i, 0)
        actions += _backward(rank, pp, 1, i, 0, grad_from=wrong_peer)
    for i in range(steady, m):
        actions += _backward(rank, pp, 1, i, 0)
    return actions


def interleaved_one_f_one_b(pp_size: int, num_microbatches: int, rank: int,
                            virtual_pipeline_size: int,
                            microbatch_group_size_per_vp_stage: int | None = None) -> list[Action]:
    """Megatron's interleaved 1F1B with ``V = virtual_pipeline_size`` chunks per rank.

    Follows Megatron-Core 0.20.0 (``forward_backward_pipelining_with_interleaving``,
    the same order since 0.10).  The ``V * M`` chunk-microbatches are numbered
    ``k = 0, 1, ...`` by :func:`get_schedule_table`: with the default group size
    ``N = PP``, ``PP`` microbatches go through chunk 0, then the same ``PP`` through
    chunk 1, and so on; backward ``k`` is the same entry with the chunk reversed.
    A rank runs ``w`` = :func:`num_warmup_microbatches` forwards, then forward
    ``k + w`` and backward ``k`` in turn, then the remaining backwards.  This holds
    for every accepted ``M``, ``M == PP`` included (Megatron up to 0.9 ran every
    forward first there).  ``V = 1`` is plain :func:`one_f_one_b`.
    """
    _check(pp_size, num_microbatches, rank, virtual_pipeline_size, microbatch_group_size_per_vp_stage)
    pp, m, v = pp_size, num_microbatches, virtual_pipeline_size
    if v == 1:
        return one_f_one_b(pp, m, rank)
    n = check_microbatch_groups(pp, m, microbatch_group_size_per_vp_stage)
    table = get_schedule_table(m, v, n)
    warmup = num_warmup_microbatches(pp, m, rank, v, n)

    def forward(k: int) -> list[Action]:
        microbatch, chunk = table[k]
        return _forward(rank, pp, v, microbatch, chunk)

    def backward(k: int) -> list[Action]:
        microbatch, chunk = table[k]
        return _backward(rank, pp, v, microbatch, v - 1 - chunk)

    actions = []
    for k in range(warmup):
        actions += forward(k)
    for k in range(len(table) - warmup):
        actions += forward(k + warmup) + backward(k)
    for k in range(len(table) - warmup, len(table)):
        actions += backward(k)
    return actions


def zb_h1(pp_size: int, num_microbatches: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B with each backward split into B and W, and the W's deferred.

    The zero-bubble schedule of Qi et al. (2024, "Zero Bubble Pipeline Parallelism",
    section 3) that keeps 1F1B's memory.  The forwards and the B's run in 1F1B's order
    (:func:`one_f_one_b`: ``PP - rank - 1`` warm-up forwards, then a forward and a B in
    turn, then the B's left).  W's run in microbatch order, one right after each B from
    the ``rank``-th B on (B number ``rank``, ``rank + 1``, ...), and the ``rank`` W's
    still owed run at the end.  The last rank defers the most: its B's, and so the
    gradients the other ranks wait for, come ``W`` sooner than in 1F1B, every time, and
    the W's fill what was the cool-down's bubble.  The bubble shrinks from
    ``(PP - 1)(F + B)`` to ``(PP - 1)(F + B - 2W)`` (``B`` the whole backward:
    :func:`expected_bubble_time`).

    The order is torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank
    (torch 2.13.0), which its docstring calls the paper's ZB1P.
    """
    _check(pp_size, num_microbatches, rank)
    pp, m = pp_size, num_microbatches
    warmup = num_warmup_microbatches(pp, m, rank)
    actions, owed = [], []

    def backward(i):
        out = _backward(rank, pp, 1, i, 0)
        owed.append(i)
        if i >= rank:
            out += _weight(owed.pop(0), 0)
        return out

    for i in range(warmup):
        actions += _forward(rank, pp, 1, i, 0)
    for i in range(m - warmup):
        actions += _forward(rank, pp, 1, warmup + i, 0) + backward(i)
    for i in range(m - warmup, m):
        actions += backward(i)
    for i in owed:
        actions += _weight(i, 0)
    return actions


def _check_v(pp_size: int, num_microbatches: int, rank: int, name: str, minimum: int = 1,
             even: bool = False) -> None:
    _check(pp_size, num_microbatches, rank)
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
        return _forward(self.rank, self.pp, 2, i, chunk, self.placement, overlapped) \
            if self._keep(i) else []

    def backward(self, chunk: int, split: bool, overlapped: bool = False) -> list[Action]:
        i = self._next("backward", chunk)
        if split:
            self.owed.append((i, chunk))
        return _backward(self.rank, self.pp, 2, i, chunk, None, self.placement, overlapped) \
            if self._keep(i) else []

    def weight(self, chunk: int | None = None) -> list[Action]:
        """The oldest W owed (of ``chunk`` only, if given); nothing if none is owed."""
        for k, (i, c) in enumerate(self.owed):
            if chunk is None or c == chunk:
                del self.owed[k]
                return _weight(i, c, self.placement) if self._keep(i) else []
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


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zbv": zbv,
            "dualpipev": dualpipev, "dualpipe": dualpipe}
"""Each one-rank builder by schedule name (the interleaved one takes ``V`` too)."""


def build_schedules(name: str, pp_size: int, num_microbatches: int, virtual_pipeline_size: int = 1,
                    **options) -> dict[int, list[Action]]:
    """Every rank's list: ``build_schedules("1f1b", 4, 8)`` -> ``{0: [...], ..., 3: [...]}``.

    ``name`` is one of :data:`ALL_SCHEDULES`.  ``options`` go to the schedule's builder:
    ``wrong_recv_backward_peer`` for ``1f1b``, ``microbatch_group_size_per_vp_stage``
    for ``interleaved``.  The V-shaped and DualPipe schedules fix their own chunks
    (two per rank); ``virtual_pipeline_size`` is for ``interleaved`` only.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    if name != "interleaved" and virtual_pipeline_size != 1:
        raise ValueError(f"virtual_pipeline_size ({virtual_pipeline_size}) needs the interleaved "
                         f"schedule, not {name!r}")
    _check(pp_size, num_microbatches, 0, virtual_pipeline_size,
           options.get("microbatch_group_size_per_vp_stage") if name == "interleaved" else None)
    if name == "interleaved":
        return {r: interleaved_one_f_one_b(pp_size, num_microbatches, r, virtual_pipeline_size, **options)
                for r in range(pp_size)}
    build = BUILDERS[name]
    return {r: build(pp_size, num_microbatches, r, **options) for r in range(pp_size)}


# --- the simulator -------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedAction:
    """An action with the time it started and ended in a simulated step."""

    rank: int
    """The pipeline rank that ran it."""

    action: Action
    """What it ran."""

    start: float
    """When the rank reached it (its previous action ended)."""

    end: float
    """When it finished; for a receive, when the message was there (``end - start`` is time blocked)."""


class SimulationError(RuntimeError):
    """The schedules cannot run as written."""


class MismatchError(SimulationError):
    """A receive matched a send carrying something else, or a send was never received."""


class DeadlockError(SimulationError):
    """No rank can move: ``waiting`` maps each stuck rank to the receive it blocks on."""

    def __init__(self, message: str, waiting: dict[int, Action], partial: dict[int, list[TimedAction]]):
        super().__init__(message)
        self.waiting = waiting
        """Rank -> the receive it is blocked on."""
        self.partial = partial
        """What each rank completed before the deadlock (drawable like a full timeline)."""


class OrderError(SimulationError):
    """A rank's own list runs a compute before one it depends on: a backward before its
    forward, a W before its B, or a stage before the stage on the same rank that feeds it."""


def _check_match(src: int, dst: int, sent: Action, recv: Action, pp: int, last_stage: int) -> None:
    placement = sent.placement
    src_stage = sent.model_stage(src, pp)
    copy = sent.chunk if placement == "dual" else 0
    expected = {"activation": src_stage + 1, "grad": src_stage - 1, "labels": last_stage}[PAYLOAD[sent.kind]]
    want = stage_holder(placement, expected, pp, copy) if 0 <= expected <= last_stage else None
    if sent.microbatch != recv.microbatch or (dst, recv.chunk) != want:
        raise MismatchError(
            f"rank {dst}'s {recv.kind} (microbatch {recv.microbatch}, model stage "
            f"{recv.model_stage(dst, pp)}) received rank {src}'s {sent.kind} (microbatch "
            f"{sent.microbatch}, model stage {src_stage}): the message belongs to microbatch "
            f"{sent.microbatch} at model stage {expected}; messages are matched in order per "
            f"(sender, receiver, payload)")


def _placement_of(schedules: dict[int, list[Action]]) -> tuple[str, int]:
    """The one placement the lists share, and the model stages of a copy."""
    placements = {a.placement for acts in schedules.values() for a in acts}
    if len(placements) > 1:
        raise ValueError(f"the ranks' actions mix placements {sorted(placements)}: one schedule "
                         f"places its stages one way")
    placement = placements.pop() if placements else "loop"
    chunks = 1 + max((a.chunk for acts in schedules.values() for a in acts), default=0)
    return placement, num_model_stages(placement, len(schedules), chunks)


def _local_prerequisites(a: Action, rank: int, pp: int, placement: str,
                         num_stages: int) -> list[tuple[str, int, int]]:
    """The computes on ``rank`` that must come before compute ``a``, as ``(kind,
    microbatch, chunk)``.

    A backward needs its forward, a W its B; where the neighbouring stage lives on the
    same rank (the V's turn) a forward needs that stage's forward and a backward that
    stage's backward, handed over without a message."""
    if a.kind == "weight":
        return [("backward", a.microbatch, a.chunk)]
    needs = [("forward", a.microbatch, a.chunk)] if a.kind == "backward" else []
    stage = a.model_stage(rank, pp)
    neighbour = stage - 1 if a.kind == "forward" else stage + 1
    if 0 <= neighbour < num_stages:
        holder, chunk = stage_holder(placement, neighbour, pp, a.chunk if placement == "dual" else 0)
        if holder == rank:
            needs.append((a.kind, a.microbatch, chunk))
    return needs


def _check_pairs(rank: int, actions: list[Action]) -> None:
    """An overlapped forward is directly followed by an overlapped backward, and vice versa."""
    for i, a in enumerate(actions):
        if a.overlapped and a.kind == "forward":
            after = actions[i + 1] if i + 1 < len(actions) else None
            if after is None or after.kind != "backward" or not after.overlapped:
                raise OrderError(f"rank {rank}'s overlapped {a.label} must be directly followed "
                                 f"by the overlapped backward it runs with")
        if a.overlapped and a.kind == "backward":
            before = actions[i - 1] if i else None
            if before is None or before.kind != "forward" or not before.overlapped:
                raise OrderError(f"rank {rank}'s overlapped {a.label} must directly follow "
                                 f"the overlapped forward it runs with")


def compute_costs(actions: list[Action], forward_cost: float = 1.0, backward_cost: float = 2.0,
                  weight_cost: float | None = None) -> list[float]:
    """Each compute's cost in one rank's list (0 for a message): F ``forward_cost``; a
    whole backward ``backward_cost``; a split one B ``backward_cost - weight_cost`` and
    W ``weight_cost`` (default: half the backward, see :data:`COSTS`)."""
    w = backward_cost / 2 if weight_cost is None else weight_cost
    split = split_backwards(actions)
    out = []
    for a in actions:
        if a.kind == "forward":
            out.append(forward_cost)
        elif a.kind == "backward":
            out.append(backward_cost - w if (a.microbatch, a.chunk) in split else backward_cost)
        elif a.kind == "weight":
            out.append(w)
        else:
            out.append(0)
    return out


COSTS = {"F": 1, "B": 2, "W": 1}
"""The course's costs of one chunk's compute: forward 1, whole backward 2, of which W
(the weight gradient) 1, so a split backward's B (input gradient) costs 1 too.  A
linear layer's backward is two matmuls of the forward's size: ``dX = dY W^T`` (B) and
``dW = X^T dY`` (W); attention's score matmuls have no weights, so real W's are a bit
cheaper."""


def simulate(schedules: dict[int, list[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0,
             p2p_cost: float = 0.0, weight_cost: float | None = None,
             overlapped_cost: float | None = None) -> dict[int, list[TimedAction]]:
    """Run every rank's list at once; return each action's start and end, per rank.

    Every rank starts at time 0 and runs its actions in order.  A forward takes
    ``forward_cost``, a backward ``backward_cost`` (per chunk: divide by ``V`` to
    model the same model cut finer); a backward split into B and W takes
    ``backward_cost - weight_cost`` and its W ``weight_cost`` (:func:`compute_costs`;
    default half the backward).  An overlapped pair (:attr:`Action.overlapped`,
    DualPipe's ``F&B``) takes ``overlapped_cost`` in all (default: the sum of its two
    halves), shared between the halves in proportion to their costs.  A send occupies
    its rank for ``p2p_cost`` and never waits for the receiver (buffered, see the module
    docstring); a receive ends when the matching send has ended, or at once if it
    already has.  Sends and receives are matched in order per ``(sender, receiver,
    payload)``; a match must agree on the microbatch and on adjacent model stages (in
    the lists' placement, :data:`PLACEMENTS`), or :class:`MismatchError`.  A compute
    that comes before one it depends on in its own rank's list (a B before its F, a W
    before its B, the V's turn taken out of order): :class:`OrderError`.  When no rank
    can move, :class:`DeadlockError`.  The result depends only on the dependencies, not
    on the order ranks are visited.
    """
    pp = len(schedules)
    if sorted(schedules) != list(range(pp)):
        raise ValueError(f"schedules must be keyed by the pipeline ranks 0..{pp - 1}, "
                         f"got {sorted(schedules)}")
    for r, actions in schedules.items():
        for a in actions:
            if not a.is_compute and (a.peer == r or not 0 <= a.peer < pp):
                raise ValueError(f"rank {r}'s {a.label}: the peer must be another rank in 0..{pp - 1}")
        _check_pairs(r, actions)
    placement, num_stages = _placement_of(schedules)
    last_stage = num_stages - 1
    costs = {r: compute_costs(actions, forward_cost, backward_cost, weight_cost)
             for r, actions in schedules.items()}
    sent: dict[tuple, list[tuple[Action, float]]] = defaultdict(list)  # (src, dst, payload) -> sends
    received: dict[tuple, int] = defaultdict(int)  # (src, dst, payload) -> receives matched so far
    clock = {r: 0 for r in schedules}  # exact with int/Fraction costs
    done: dict[int, list[TimedAction]] = {r: [] for r in schedules}
    computed: dict[int, set] = {r: set() for r in schedules}  # (kind, microbatch, chunk) run so far

    moved = True
    while moved:  # sweep over the ranks, each running until it blocks, until nobody moves
        moved = False
        for r, actions in schedules.items():
            while len(done[r]) < len(actions):
                i = len(done[r])
                a = actions[i]
                start = clock[r]
                if a.is_compute:
                    for need in _local_prerequisites(a, r, pp, placement, num_stages):
                        if need not in computed[r]:
                            raise OrderError(
                                f"rank {r} runs {a.label} (action {i}) before "
                                f"{Action(need[0], need[1], need[2], placement=placement).label}, "
                                f"which it needs and which this rank runs")
                    cost = costs[r][i]
                    if a.overlapped and overlapped_cost is not None:
                        pair = (costs[r][i] + costs[r][i + 1] if a.kind == "forward"
                                else costs[r][i - 1] + costs[r][i])
                        exact = all(isinstance(x, (int, Fraction)) for x in (overlapped_cost, pair))
                        ratio = (Fraction(overlapped_cost) / pair if exact else overlapped_cost / pair) \
                            if pair else 0
                        cost = cost * ratio
                    end = start + cost
                    computed[r].add((a.kind, a.microbatch, a.chunk))
                elif a.kind in SEND_KINDS:
                    end = start + p2p_cost
                    sent[(r, a.peer, PAYLOAD[a.kind])].append((a, end))
                else:
                    key = (a.peer, r, PAYLOAD[a.kind])
                    if received[key] == len(sent[key]):
                        break  # blocked: the matching send has not happened yet
                    message, sent_at = sent[key][received[key]]
                    _check_match(a.peer, r, message, a, pp, last_stage)
                    received[key] += 1
                    end = max(start, sent_at)
                done[r].append(TimedAction(r, a, start, end))
                clock[r] = end
                moved = True

    waiting = {r: acts[len(done[r])] for r, acts in schedules.items() if len(done[r]) < len(acts)}
    if waiting:
        raise DeadlockError(_deadlock_report(schedules, done, waiting, sent, received), waiting, done)
    for (src, dst, payload), messages in sent.items():
        if received[(src, dst, payload)] < len(messages):
            left = messages[received[(src, dst, payload)]][0]
            raise MismatchError(f"rank {src} sent {len(messages) - received[(src, dst, payload)]} "
                                f"{payload} message(s) to rank {dst} that were never received, "
                                f"the first for microbatch {left.microbatch}")
    return done


def _deadlock_report(schedules, done, waiting, sent, received) -> str:
    lines = ["deadlock: every unfinished rank is blocked in a receive whose send never comes"]
    for r in schedules:
        if r not in waiting:
            lines.append(f"  rank {r}: finished all {len(schedules[r])} actions")
            continue
        a = waiting[r]
        key = (a.peer, r, PAYLOAD[a.kind])
        peer_state = (f"rank {a.peer} is itself blocked at {waiting[a.peer].label}" if a.peer in waiting
                      else f"rank {a.peer} has finished")
        lines.append(f"  rank {r}: blocked at action {len(done[r])} ({a.label}): waits for "
                     f"{PAYLOAD[a.kind]} message #{received[key]} from rank {a.peer}, which has sent "
                     f"{len(sent[key])} to rank {r}; {peer_state}")
    return "\n".join(lines)


# --- what the timelines say ------------------------------------------------------------------


def makespan(timelines: dict[int, list[TimedAction]]) -> float:
    """The step's length: the last end over all ranks (every rank starts at 0)."""
    return max((t.end for ts in timelines.values() for t in ts), default=0)


def bubble_fraction(timelines: dict[int, list[TimedAction]], rank: int | None = None) -> float:
    """The idle fraction of the step: ``1 - compute time / (ranks * makespan)``.

    Idle is everything that is not a forward or backward: blocked receives and
    sends count as idle.  ``rank`` restricts it to one rank.
    """
    total = makespan(timelines)
    ranks = list(timelines) if rank is None else [rank]
    busy = sum(t.end - t.start for r in ranks for t in timelines[r] if t.action.is_compute)
    return 1 - busy / (len(ranks) * total) if total > 0 else 0.0


def expected_bubble(pp: int, m: int, v: int = 1) -> float:
    """The closed form: ``(PP - 1) / (V * M + PP - 1)``; for ``V = 1``: ``(PP - 1) / (M + PP - 1)``.

    Each rank computes ``M (f + b)`` and waits ``(PP - 1)(f + b)``: the fill at the
    start and the drain at the end.  Interleaving cuts each wait to one chunk's worth,
    ``(PP - 1)(f + b) / V`` (Narayanan et al., 2021).  :func:`simulate` reproduces it
    exactly, on every rank, for all three schedules whenever ``p2p_cost = 0`` and
    every stage costs the same: the ratio ``backward_cost / forward_cost`` does not
    matter (``b = 2f`` is only the usual estimate), because the fill and the drain
    each cost ``(PP - 1)`` forwards plus ``(PP - 1)`` backwards.  A positive
    ``p2p_cost`` adds to the bubble; the formula then is a lower bound.
    """
    for name, value in (("pp", pp), ("m", m), ("v", v)):
        _check_positive(name, value, "pipeline stages, microbatches and chunks are counted from 1")
    return (pp - 1) / (v * m + pp - 1)


def idle_time(timelines: dict[int, list[TimedAction]], rank: int | None = None) -> float:
    """A rank's idle time in the step: the makespan minus its compute (forwards, B's and
    W's).  ``rank=None``: the largest over the ranks, the idle time of the rank that
    computes least, the step's *bubble* in the sense of the DualPipe table
    (:func:`expected_bubble_time`).  In every schedule here each rank computes as much,
    so every rank idles that long."""
    total = makespan(timelines)
    ranks = list(timelines) if rank is None else [rank]
    return max(total - sum(t.end - t.start for t in timelines[r] if t.action.is_compute)
               for r in ranks)


def expected_bubble_time(name: str, pp_size: int, forward_cost: float = 1.0,
                         backward_cost: float = 2.0, weight_cost: float | None = None,
                         overlapped_cost: float | None = None) -> float:
    """The bubble (:func:`idle_time`) as a formula of the chunk costs ``F``, ``B`` (the
    whole backward), ``W`` (its weight part; default ``B / 2``) and ``F&B``
    (``overlapped_cost``, default ``F + B``).

    The rows of deepseek-ai/DualPipe's README table, with its ``PP`` the number of
    pipeline *stages* (``pp_size`` ranks hold ``pp_size`` stages, ``2 pp_size`` for
    the V's; DualPipe holds two copies of ``pp_size`` stages):

    ==================  ====================================  ==========================
    ``gpipe``, ``1f1b``  ``(PP - 1)(F + B)``                  any costs
    ``interleaved``      ``(PP - 1)(F + B)``, F, B per chunk  any costs
    ``zb-h1``            ``(PP - 1)(F + B - 2W)``             ``M >= PP``, ``W <= F``,
                                                               ``W <= B - W``
    ``zbv``              ``(PP - 1)(F + B - 2W)``, ``PP``     ``M >= 2 PP - 1``,
                         ranks                                 ``F = B - W = W``
    ``dualpipev``        ``(PP/2 - 1)(F&B + B - 3W)``,        ``M >= 2 PP``,
                         ``PP = 2 pp_size`` stages             ``F = B - W``, ``W <= F``
    ``dualpipe``         ``(PP/2 - 1)(F&B + B - 3W)``         the same
    ==================  ====================================  ==========================

    Each holds exactly under :func:`simulate` (free messages) where its last column
    says; outside, the schedule's fixed order no longer fits the costs and the
    simulated bubble differs (the DualPipe figure draws ``F`` and ``B - W`` equal).
    The ZBV row is not in the DualPipe table: it is ZB-H1's expression over ``PP``
    ranks of two chunks each, checked by simulation where ZBV's paper draws it (all
    three costs equal: ``(PP - 1) F``, a rate of ``(PP - 1) / 6M`` of the step, where
    sail-sg's README rounds ZBV's rate to 0).  The ZB paper's ``(p - 1)(T_F + T_B - T_W)``
    is the ZB-H1 row with its ``T_B`` the backward's input part, ``B - W`` here.
    ``F&B`` below ``F + B`` models communication hidden behind the other half's compute;
    with overlapped pairs the ranks compute unequally, and the formula is the largest
    idle time (:func:`idle_time`), the turning rank's, which runs the most pairs.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    _check_positive("pp_size", pp_size, "a pipeline has at least one stage")
    f, b = forward_cost, backward_cost
    w = b / 2 if weight_cost is None else weight_cost
    fb = f + b if overlapped_cost is None else overlapped_cost
    if name in ("gpipe", "1f1b", "interleaved"):
        return (pp_size - 1) * (f + b)
    if name in ("zb-h1", "zbv"):
        return (pp_size - 1) * (f + b - 2 * w)
    if name == "dualpipe" and pp_size % 2:
        raise ConfigError("dualpipe", f"pp_size ({pp_size}) must be even for dualpipe")
    stages = 2 * pp_size if name == "dualpipev" else pp_size
    return (stages // 2 - 1) * (fb + b - 3 * w)


PARAMETER_COPIES = {name: 1 for name in ALL_SCHEDULES} | {"dualpipe": 2}
"""How many copies of its stages' parameters a rank holds (DualPipe: both directions'),
counted on the same ``pp_size`` ranks.  The DualPipe table's "2x" for DualPipeV compares
it with 1F1B at the same number of *stages* (DualPipeV puts them on half as many ranks);
on the same ranks, each of DualPipeV's ranks holds ``1 / pp_size`` of the model, as 1F1B's."""


def peak_activations_in_flight(actions: list[Action], chunk_weights=None) -> int:
    """The most (microbatch, chunk) pairs whose forward ran and whose backward has not
    yet, counting a split backward as done only at its W.

    Each holds one chunk's stashed activations: with ``V`` chunks, a pair is ``1/V``
    of a full stage's activations for one microbatch.  B frees what only the input's
    gradient needed, but W still needs each layer's input (``dW = X^T dY``): the
    count keeps the pair until its W, the way the DualPipe table counts.  An
    overlapped pair counts in the list's order: its forward's activations join
    before its backward's leave.

    ``chunk_weights``: what one microbatch of each chunk holds (``chunk_weights[c]``,
    e.g. its bytes: :func:`tutorial_lib.costs.memory_per_rank`); the peak of their sum
    instead of the count.  The executor counts its saved bytes in the same order
    (:class:`tutorial_lib.pipeline.PipelineExecutor`).
    """
    split = split_backwards(actions)
    live = peak = 0
    for a in actions:
        weight = 1 if chunk_weights is None else chunk_weights[a.chunk]
        if a.kind == "forward":
            live += weight
        elif a.kind == ("weight" if (a.microbatch, a.chunk) in split else "backward"):
            live -= weight
        peak = max(peak, live)
    return peak


def expected_peak_activations(name: str, pp_size: int, num_microbatches: int, rank: int,
                              virtual_pipeline_size: int = 1,
                              microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """The formula for :func:`peak_activations_in_flight`, per schedule, in chunks.

    * GPipe: ``M``.
    * 1F1B: ``min(PP - rank, M)``: the warm-up forwards plus the steady state's one.
    * interleaved: ``min(warmup + 1, V * M)`` chunk-microbatches with Megatron's
      warm-up ``2 (PP - rank - 1) + (V - 1) N`` (:func:`num_warmup_microbatches`,
      group size ``N = PP`` by default).  With ``M >= 2 PP`` rank 0 holds
      ``V PP + PP - 1`` chunks, i.e. ``PP (1 + (PP - 1) / (V PP))`` full stages: the
      factor of Korthikanti et al. (2022) for interleaving.  With ``M == PP`` the
      cap ``V M`` binds on the first ranks only: at ``PP = 8, V = 2`` the ranks hold
      ``16, 16, 16, 16, 15, 13, 11, 9`` (Megatron-Core >= 0.10; up to 0.9, 16 each).
    * ZB-H1: ``min(PP, M)`` on every rank (held until the W: the deferred W's keep the
      last ranks' activations as long as rank 0's).
    * ZBV: ``min(M + rank + 1, 2 M, 2 PP)`` chunks of half a stage: ``2 PP`` on every
      rank once ``M >= 2 PP - 1``, 1F1B's ``PP`` stages.
    * DualPipeV: ``2 PP + 1`` chunks of half a stage; DualPipe: ``PP + 1`` chunks (of
      a whole stage, of either copy): the table's ``PP + 1``.
    """
    if name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    if name in SPLIT_BACKWARD_SCHEDULES:
        _check(pp_size, num_microbatches, rank)
        pp, m = pp_size, num_microbatches
        return {"zb-h1": min(pp, m), "zbv": min(m + rank + 1, 2 * m, 2 * pp),
                "dualpipev": 2 * pp + 1, "dualpipe": pp + 1}[name]
    _check(pp_size, num_microbatches, rank, virtual_pipeline_size, microbatch_group_size_per_vp_stage)
    if name == "gpipe":
        return num_microbatches
    warmup = num_warmup_microbatches(pp_size, num_microbatches, rank, virtual_pipeline_size,
                                     microbatch_group_size_per_vp_stage)
    return min(warmup + 1, virtual_pipeline_size * num_microbatches)


def planned_spans(timelines: dict[int, list[TimedAction]], lane: str = "planned",
                  p2p: bool = False) -> list[tuple]:
    """Bars for :func:`tutorial_lib.viz.timeline.timeline_from_spans`: compute, and sends/receives if ``p2p``.

    Each is ``(rank, start, end, label, kind, lane)``; kind ``compute`` or ``pp``.  For the
    schedule's own colours (forwards and backwards apart, a shade per chunk, the bubble
    marked) use :func:`tutorial_lib.viz.timeline.plan_spans`, as chapter 6 does.
    """
    return [(t.rank, t.start, t.end, t.action.label, "compute" if t.action.is_compute else "pp", lane)
            for ts in timelines.values() for t in ts if p2p or t.action.is_compute]
