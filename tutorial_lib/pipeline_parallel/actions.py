"""Pipeline schedules as plain data: who computes what, who sends what to whom, and when.

A pipeline cuts the model into ``pp_size`` stages, one per rank of a pipeline group
(``pp_size * V`` model stages, ``V`` chunks per rank, with interleaving), and cuts the
batch into ``num_microbatches`` microbatches.  A *schedule* is the
ordered list of :class:`Action` one rank performs in one training step: forwards and
backwards of microbatches, and the point-to-point messages between them.  Nothing
here imports torch or starts a process, so chapters, widgets and tests read the
lists directly, and :func:`~.simulator.simulate` plays them on paper.

This module holds what every schedule is made of: the :class:`Action` and its kinds,
the schedules' names, where each schedule places its model stages (:data:`PLACEMENTS`,
:func:`model_stage`), the checks on a schedule's arguments, and the building blocks
(:func:`forward_actions`, :func:`backward_actions`, :func:`weight_actions`): one
compute with the messages around it.  The schedules are built from them in
:mod:`~tutorial_lib.pipeline_parallel.schedules` (chapter 6) and
:mod:`~tutorial_lib.pipeline_parallel.zero_bubble` (chapter 11).

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
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError

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
chapter 11's (:mod:`~tutorial_lib.pipeline_parallel.zero_bubble`)."""

ALL_SCHEDULES = SCHEDULE_NAMES + SPLIT_BACKWARD_SCHEDULES
"""Every schedule :func:`~tutorial_lib.pipeline_parallel.build_schedules` builds."""

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


def check_positive(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("malformed", f"{name} ({value!r}) must be an integer >= 1: {what}")


def check_pipeline(pp_size: int, num_microbatches: int, rank: int, virtual_pipeline_size: int = 1,
           microbatch_group_size_per_vp_stage: int | None = None) -> None:
    check_positive("pp_size", pp_size, "a pipeline has at least one stage")
    check_positive("num_microbatches", num_microbatches, "a step runs at least one microbatch")
    check_positive("virtual_pipeline_size", virtual_pipeline_size,
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

def check_microbatch_groups(pp_size: int, num_microbatches: int,
                            microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """The interleaved schedule's rules on ``M``; returns the group size ``N`` it uses.

    The interleaved schedule takes the microbatches through each chunk in groups of
    ``N = microbatch_group_size_per_vp_stage`` consecutive microbatches
    (:func:`~.schedules.get_schedule_table`); ``None`` means ``N = PP``, Megatron's default (a
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
    check_positive("microbatch_group_size_per_vp_stage", n,
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


def forward_actions(rank: int, pp: int, v: int, microbatch: int, chunk: int, placement: str = "loop",
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


def backward_actions(rank: int, pp: int, v: int, microbatch: int, chunk: int,
              grad_from: int | None = None, placement: str = "loop",
              overlapped: bool = False) -> list[Action]:
    """Receive the output's gradient, run chunk ``chunk``'s backward, send the input's gradient.

    ``grad_from`` overrides the peer the gradient is received from: only the
    deliberately wrong variant of :func:`~.schedules.one_f_one_b` uses it.  In a schedule that
    splits this backward the ``weight`` comes later, on its own (:func:`weight_actions`).
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


def weight_actions(microbatch: int, chunk: int, placement: str = "loop") -> list[Action]:
    """W: the weight gradient of a backward split earlier; no message."""
    return [Action("weight", microbatch, chunk, placement=placement)]
