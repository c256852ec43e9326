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

from .config import ConfigError

COMPUTE_KINDS = ("forward", "backward")
SEND_KINDS = ("send_activation", "send_grad", "send_labels")
RECV_KINDS = ("recv_activation", "recv_grad", "recv_labels")
ACTION_KINDS = COMPUTE_KINDS + SEND_KINDS + RECV_KINDS

#: What a send or receive carries: the key messages are matched on.
PAYLOAD = {"send_activation": "activation", "recv_activation": "activation",
           "send_grad": "grad", "recv_grad": "grad",
           "send_labels": "labels", "recv_labels": "labels"}

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")

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
    """What happens: ``forward``, ``backward``, or a ``send_``/``recv_`` of ``activation``,
    ``grad`` or ``labels`` (see :data:`ACTION_KINDS`)."""

    microbatch: int
    """Which microbatch (0-based) is computed, or whose tensor the message carries."""

    chunk: int = 0
    """The model chunk on this rank it belongs to (Megatron's virtual pipeline rank,
    ``0 .. V-1``; always 0 without interleaving).  Rank ``r``'s chunk ``c`` runs model
    stage ``c * pp_size + r``: see :meth:`model_stage`."""

    peer: int | None = None
    """For a send or receive, the pipeline-group rank at the other end; ``None`` for compute."""

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; kinds are {', '.join(ACTION_KINDS)}")
        if (self.peer is None) != (self.kind in COMPUTE_KINDS):
            raise ValueError(f"{self.kind} needs peer=None for compute and a peer rank for "
                             f"sends/receives; got peer={self.peer!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def model_stage(self, rank: int, pp_size: int) -> int:
        """The model stage this action's chunk runs on ``rank``: ``chunk * pp_size + rank``."""
        return self.chunk * pp_size + rank

    @property
    def label(self) -> str:
        """Short name for a bar: ``F3``, ``B3`` (``F3.1``: chunk 1), ``send_grad 3 -> 0``."""
        chunk = f".{self.chunk}" if self.chunk else ""
        if self.is_compute:
            return f"{self.kind[0].upper()}{self.microbatch}{chunk}"
        arrow = "->" if self.kind.startswith("send") else "<-"
        return f"{self.kind} {self.microbatch}{chunk} {arrow} {self.peer}"


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
      two modes.

    ``pp_size``: the pipeline size, for the last rule (``None``: not checked).
    """
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError("malformed", f"schedule must be one of "
                                       f"{', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
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


def _forward(rank: int, pp: int, v: int, microbatch: int, chunk: int) -> list[Action]:
    """Receive the input, move the labels, run chunk ``chunk``'s forward, send the output."""
    stage, last = chunk * pp + rank, v * pp - 1  # model stages
    prev, nxt = (rank - 1) % pp, (rank + 1) % pp
    out = []
    if stage > 0:
        out.append(Action("recv_activation", microbatch, chunk, prev))
    if pp > 1 and stage == 0:
        out.append(Action("send_labels", microbatch, chunk, pp - 1))
    if pp > 1 and stage == last:
        out.append(Action("recv_labels", microbatch, chunk, 0))  # the loss needs them
    out.append(Action("forward", microbatch, chunk))
    if stage < last:
        out.append(Action("send_activation", microbatch, chunk, nxt))
    return out


def _backward(rank: int, pp: int, v: int, microbatch: int, chunk: int,
              grad_from: int | None = None) -> list[Action]:
    """Receive the output's gradient, run chunk ``chunk``'s backward, send the input's gradient.

    ``grad_from`` overrides the peer the gradient is received from: only the
    deliberately wrong variant of :func:`one_f_one_b` uses it.
    """
    stage, last = chunk * pp + rank, v * pp - 1  # model stages
    prev, nxt = (rank - 1) % pp, (rank + 1) % pp
    out = []
    if stage < last:
        out.append(Action("recv_grad", microbatch, chunk, nxt if grad_from is None else grad_from))
    out.append(Action("backward", microbatch, chunk))
    if stage > 0:
        out.append(Action("send_grad", microbatch, chunk, prev))
    return out


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


def build_schedules(name: str, pp_size: int, num_microbatches: int, virtual_pipeline_size: int = 1,
                    **options) -> dict[int, list[Action]]:
    """Every rank's list: ``build_schedules("1f1b", 4, 8)`` -> ``{0: [...], ..., 3: [...]}``.

    ``options`` go to the schedule's builder: ``wrong_recv_backward_peer`` for
    ``1f1b``, ``microbatch_group_size_per_vp_stage`` for ``interleaved``.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(SCHEDULE_NAMES)}")
    if name != "interleaved" and virtual_pipeline_size != 1:
        raise ValueError(f"virtual_pipeline_size ({virtual_pipeline_size}) needs the interleaved "
                         f"schedule, not {name!r}")
    _check(pp_size, num_microbatches, 0, virtual_pipeline_size,
           options.get("microbatch_group_size_per_vp_stage") if name == "interleaved" else None)
    if name == "interleaved":
        return {r: interleaved_one_f_one_b(pp_size, num_microbatches, r, virtual_pipeline_size, **options)
                for r in range(pp_size)}
    build = gpipe if name == "gpipe" else one_f_one_b
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


def _check_match(src: int, dst: int, sent: Action, recv: Action, pp: int, last_stage: int) -> None:
    src_stage, dst_stage = sent.model_stage(src, pp), recv.model_stage(dst, pp)
    expected = {"activation": src_stage + 1, "grad": src_stage - 1, "labels": last_stage}[PAYLOAD[sent.kind]]
    if sent.microbatch != recv.microbatch or dst_stage != expected:
        raise MismatchError(
            f"rank {dst}'s {recv.kind} (microbatch {recv.microbatch}, model stage {dst_stage}) "
            f"received rank {src}'s {sent.kind} (microbatch {sent.microbatch}, model stage "
            f"{src_stage}): the message belongs to microbatch {sent.microbatch} at model stage "
            f"{expected}; messages are matched in order per (sender, receiver, payload)")


def simulate(schedules: dict[int, list[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0,
             p2p_cost: float = 0.0) -> dict[int, list[TimedAction]]:
    """Run every rank's list at once; return each action's start and end, per rank.

    Every rank starts at time 0 and runs its actions in order.  A forward takes
    ``forward_cost``, a backward ``backward_cost`` (per chunk: divide by ``V`` to
    model the same model cut finer).  A send occupies its rank for ``p2p_cost`` and
    never waits for the receiver (buffered, see the module docstring); a receive
    ends when the matching send has ended, or at once if it already has.  Sends and
    receives are matched in order per ``(sender, receiver, payload)``; a match
    must agree on the microbatch and on adjacent model stages, or
    :class:`MismatchError`.  When no rank can move, :class:`DeadlockError`.
    The result depends only on the dependencies, not on the order ranks are visited.
    """
    pp = len(schedules)
    if sorted(schedules) != list(range(pp)):
        raise ValueError(f"schedules must be keyed by the pipeline ranks 0..{pp - 1}, "
                         f"got {sorted(schedules)}")
    for r, actions in schedules.items():
        for a in actions:
            if not a.is_compute and (a.peer == r or not 0 <= a.peer < pp):
                raise ValueError(f"rank {r}'s {a.label}: the peer must be another rank in 0..{pp - 1}")
    cost = {"forward": forward_cost, "backward": backward_cost}
    last_stage = pp * (1 + max((a.chunk for acts in schedules.values() for a in acts), default=0)) - 1
    sent: dict[tuple, list[tuple[Action, float]]] = defaultdict(list)  # (src, dst, payload) -> sends
    received: dict[tuple, int] = defaultdict(int)  # (src, dst, payload) -> receives matched so far
    clock = {r: 0 for r in schedules}  # exact with int/Fraction costs
    done: dict[int, list[TimedAction]] = {r: [] for r in schedules}

    moved = True
    while moved:  # sweep over the ranks, each running until it blocks, until nobody moves
        moved = False
        for r, actions in schedules.items():
            while len(done[r]) < len(actions):
                a = actions[len(done[r])]
                start = clock[r]
                if a.is_compute:
                    end = start + cost[a.kind]
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


def peak_activations_in_flight(actions: list[Action]) -> int:
    """The most (microbatch, chunk) pairs whose forward ran and whose backward has not yet.

    Each holds one chunk's stashed activations: with ``V`` chunks, a pair is ``1/V``
    of a full stage's activations for one microbatch.
    """
    live = peak = 0
    for a in actions:
        live += {"forward": 1, "backward": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


def expected_peak_activations(name: str, pp_size: int, num_microbatches: int, rank: int,
                              virtual_pipeline_size: int = 1,
                              microbatch_group_size_per_vp_stage: int | None = None) -> int:
    """The formula for :func:`peak_activations_in_flight`, per schedule.

    * GPipe: ``M``.
    * 1F1B: ``min(PP - rank, M)``: the warm-up forwards plus the steady state's one.
    * interleaved: ``min(warmup + 1, V * M)`` chunk-microbatches with Megatron's
      warm-up ``2 (PP - rank - 1) + (V - 1) N`` (:func:`num_warmup_microbatches`,
      group size ``N = PP`` by default).  With ``M >= 2 PP`` rank 0 holds
      ``V PP + PP - 1`` chunks, i.e. ``PP (1 + (PP - 1) / (V PP))`` full stages: the
      factor of Korthikanti et al. (2022) for interleaving.  With ``M == PP`` the
      cap ``V M`` binds on the first ranks only: at ``PP = 8, V = 2`` the ranks hold
      ``16, 16, 16, 16, 15, 13, 11, 9`` (Megatron-Core >= 0.10; up to 0.9, 16 each).
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; schedules are {', '.join(SCHEDULE_NAMES)}")
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
