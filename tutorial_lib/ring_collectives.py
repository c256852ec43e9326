"""Ring all-reduce, built by hand from point-to-point sends and receives.

``torch.distributed.all_reduce`` is one call, but inside NCCL and gloo it is
(for large tensors) a *ring*: every rank talks only to its two neighbours, and
the work is split into two phases.

1. **Reduce-scatter.**  Cut the tensor into N chunks along dim 0.  In each of
   N-1 steps every rank sends one chunk to the next rank and adds the chunk it
   receives from the previous rank to its own copy.  Afterwards each rank holds
   one chunk that is the sum over all ranks.
2. **All-gather.**  In N-1 more steps every rank forwards the finished chunk it
   got last, until every rank holds every finished chunk.

Why a ring: each rank sends ``2 (N-1) / N`` of the tensor in ``2 (N-1)`` steps.
That is almost independent of N (at most twice the tensor), so the bandwidth
cost of an all-reduce barely grows with the number of GPUs; what grows is the
number of steps, i.e. the latency.

Conventions (the same in every function here):

* The ring is the group's ranks in group order: the rank at position ``i``
  sends to ``ranks[(i + 1) % N]`` and receives from ``ranks[(i - 1) % N]``.
  Chunk indices are positions in the group (chunk ``c`` is rows
  ``c*k:(c+1)*k`` of dim 0, ``k = rows / N``).
* **Rank at position i owns chunk i** after the reduce-scatter, exactly like
  ``torch.distributed.reduce_scatter``.  To get there, at reduce-scatter step
  ``s`` (``s = 0 .. N-2``) position ``i`` sends chunk ``(i - s - 1) mod N`` and
  receives chunk ``(i - s - 2) mod N``.  (The textbook schedule sends chunk
  ``(i - s)`` and leaves rank i owning chunk ``(i + 1)``; ours is the same ring
  shifted by one chunk, so the result is a drop-in reduce-scatter.)
* At all-gather step ``s`` position ``i`` sends chunk ``(i - s) mod N`` (its
  own chunk first) and receives chunk ``(i - s - 1) mod N``.

Every step is recorded by the traced ops of :mod:`tutorial_lib.comm`, with tags
(see :data:`TAGS`), so the animations in :mod:`tutorial_lib.viz.collective_animation`
replay what really moved.  Launch with ``capture_values`` at least the number
of elements of the tensor to record the values too.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from . import comm, parallel_state
from .trace import get_tracer

#: Tags on the events these functions record.  Every send and recv carries all of
#: ``algorithm``, ``call``, ``phase``, ``step`` and ``chunk``.  Two kinds of
#: zero-cost ``compute`` events (on the ring's group, like the sends) hold values:
#: ``name="ring_buffer"`` (``phase="start"``, ``held``; ``values_in``: the chunks
#: this rank starts with) and ``name="ring_reduce"`` (one per reduce-scatter step:
#: ``values_in`` the local chunk, ``values_out`` it plus what arrived).
TAGS = {
    "algorithm": "ring_all_reduce, ring_reduce_scatter or ring_all_gather: the function called",
    "call": "how many ring calls this rank made on this group before (0, 1, ...)",
    "phase": "reduce_scatter or all_gather ('start' on the ring_buffer event)",
    "step": "step within the phase, 0 .. N-2",
    "chunk": "index of the chunk sent (send), received (recv) or added to (ring_reduce)",
    "held": "ring_buffer only: the chunk indices this rank starts with, in values_in order",
}

# Ring calls made per group by this process: tags "call" so that several calls in one
# trace can be told apart (every rank of a group makes the same calls in the same order).
_CALLS: dict[tuple[int, ...], int] = {}


# --- the ring -------------------------------------------------------------------


class _Ring:
    """This rank's place in the ring formed by a group's ranks, in group order."""

    def __init__(self, group):
        self.group = group
        if group is None or isinstance(group, str):
            self.kind = group or "world"
            self.ranks = tuple(parallel_state.get_group_ranks(self.kind))
        else:  # a live ProcessGroup, recorded as kind "custom" like comm does
            self.kind = "custom"
            self.ranks = tuple(dist.get_process_group_ranks(group))
        self.size = len(self.ranks)
        self.index = self.ranks.index(dist.get_rank())
        self.next = self.ranks[(self.index + 1) % self.size]
        self.prev = self.ranks[(self.index - 1) % self.size]

    def new_call(self) -> int:
        call = _CALLS.get(self.ranks, 0)
        _CALLS[self.ranks] = call + 1
        return call

    @contextmanager
    def span(self, name: str, **tags):
        """A ``compute`` event for local work, labelled with the ring's group like the sends."""
        with get_tracer().span(name, **tags) as event:
            event.group_kind, event.group_ranks = self.kind, self.ranks
            yield event


def _split(tensor: torch.Tensor, n: int, name: str) -> list[torch.Tensor]:
    """The N chunks of dim 0, as independent copies (the caller's tensor stays untouched)."""
    if tensor.dim() == 0:
        raise ValueError(f"{name}: needs a tensor with at least one dimension to split "
                         f"into {n} chunks, got a scalar")
    rows = tensor.shape[0]
    if rows % n != 0:
        raise ValueError(f"{name}: dim 0 of the tensor ({rows}) must be divisible by the "
                         f"ring size ({n}); shape {tuple(tensor.shape)} cannot be cut into "
                         f"{n} equal chunks (pad it to a multiple of {n})")
    return [c.clone() for c in tensor.chunk(n, dim=0)]


def _values(t: torch.Tensor) -> list | None:
    """Values for the trace, if capture is on and the tensor is small enough."""
    if not get_tracer().wants_values(t.numel()):
        return None
    return t.detach().float().flatten().cpu().tolist()


def _record_start(buffer: list[torch.Tensor | None], ring: _Ring) -> None:
    """A zero-length ``compute`` event with the values each chunk starts with.

    The sends and receives show what moved; this shows what was there before
    anything moved.  ``held`` lists the chunk indices present (all of them for
    a reduce-scatter, only this rank's own for an all-gather).
    """
    held = [c for c, t in enumerate(buffer) if t is not None]
    with ring.span("ring_buffer", phase="start", held=held) as event:
        event.shape = tuple(buffer[held[0]].shape)  # the shape of one chunk
        event.dtype = str(buffer[held[0]].dtype).replace("torch.", "")
        event.values_in = _values(torch.stack([buffer[c] for c in held]))


def ring_exchange(send_chunk: int, send: torch.Tensor, recv_chunk: int, ring: _Ring,
              group) -> torch.Tensor:
    """One ring step: send a chunk to the next rank while receiving one from the previous.

    Both are posted before either is waited on: with a blocking send first, every
    rank would wait in ``send`` for a neighbour that is also sending, and (for
    large tensors) nobody would ever reach ``recv``.
    """
    incoming = torch.empty_like(send)
    tracer = get_tracer()
    with tracer.tags(chunk=send_chunk):
        out = comm.isend(send, ring.next, group)
    with tracer.tags(chunk=recv_chunk):
        into = comm.irecv(incoming, ring.prev, group)
    comm.wait_all([out, into])
    return incoming


# --- the two phases -----------------------------------------------------------------


def reduce_scatter_steps(buffer: list[torch.Tensor], ring: _Ring, group) -> None:
    """N-1 steps, in place on ``buffer``: afterwards ``buffer[ring.index]`` is the full sum."""
    n, i = ring.size, ring.index
    tracer = get_tracer()
    for s in range(n - 1):
        send_c, recv_c = (i - s - 1) % n, (i - s - 2) % n
        with tracer.tags(phase="reduce_scatter", step=s):
            incoming = ring_exchange(send_c, buffer[send_c], recv_c, ring, group)
            # The local add is recorded too: its values_out is the new partial sum.
            with ring.span("ring_reduce", chunk=recv_c) as event:
                event.values_in = _values(buffer[recv_c])
                buffer[recv_c] += incoming
                event.values_out = _values(buffer[recv_c])


def all_gather_steps(buffer: list[torch.Tensor | None], ring: _Ring, group) -> None:
    """N-1 steps, in place on ``buffer``: each rank forwards the chunk it got last."""
    n, i = ring.size, ring.index
    tracer = get_tracer()
    for s in range(n - 1):
        send_c, recv_c = (i - s) % n, (i - s - 1) % n
        with tracer.tags(phase="all_gather", step=s):
            buffer[recv_c] = ring_exchange(send_c, buffer[send_c], recv_c, ring, group)


# --- the public functions ------------------------------------------------------------


def ring_reduce_scatter(tensor: torch.Tensor, group="world") -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``; return the chunk this rank owns.

    The tensor is cut into N chunks along dim 0 (dim 0 must be divisible by N).
    The rank at position ``i`` of the group gets chunk ``i`` of the sum, like
    ``torch.distributed.reduce_scatter``.  N-1 steps; each rank sends
    ``(N-1)/N`` of the tensor's bytes.  ``tensor`` is not modified.
    """
    return _ring(tensor, group, "ring_reduce_scatter", gather=False)


def ring_all_gather(chunk: torch.Tensor, group="world") -> torch.Tensor:
    """Concatenate every rank's ``chunk`` along dim 0, in group order, on every rank.

    The inverse of :func:`ring_reduce_scatter`'s split: position ``i`` contributes
    rows ``i*k:(i+1)*k`` of the result.  N-1 steps; each rank sends ``N-1`` chunks.
    """
    ring = _Ring(group)
    tracer = get_tracer()
    with tracer.tags(algorithm="ring_all_gather", call=ring.new_call()):
        buffer: list[torch.Tensor | None] = [None] * ring.size
        buffer[ring.index] = chunk.detach().clone()
        _record_start(buffer, ring)
        all_gather_steps(buffer, ring, group)
    return torch.cat(buffer, dim=0)


def ring_all_reduce(tensor: torch.Tensor, group="world") -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``: a reduce-scatter, then an all-gather.

    Returns a new tensor equal to what ``torch.distributed.all_reduce`` leaves in
    place (``tensor`` itself is not modified).  Dim 0 must be divisible by N.

    Cost, the classic result: ``2 (N-1)`` steps, and in each step every rank
    sends one chunk of ``bytes / N``, so each rank sends ``2 (N-1) / N`` times
    the tensor's bytes in total (and receives as much).
    """
    return _ring(tensor, group, "ring_all_reduce", gather=True)


def _ring(tensor: torch.Tensor, group, algorithm: str, gather: bool) -> torch.Tensor:
    comm._refuse_float8_reduction(tensor, algorithm)
    ring = _Ring(group)
    buffer = _split(tensor, ring.size, algorithm)
    tracer = get_tracer()
    with tracer.tags(algorithm=algorithm, call=ring.new_call()):
        _record_start(buffer, ring)
        reduce_scatter_steps(buffer, ring, group)
        if not gather:
            return buffer[ring.index]
        all_gather_steps(buffer, ring, group)
    return torch.cat(buffer, dim=0)


def ring_cost(nbytes: int, n: int) -> dict:
    """Closed-form cost of a ring all-reduce of ``nbytes`` over ``n`` ranks, per rank."""
    steps = 2 * (n - 1)
    return {"steps": steps, "bytes_per_step": nbytes // n if n else 0,
            "bytes_sent": steps * nbytes // n if n else 0}
