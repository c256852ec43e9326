"""Traced communication: every collective and point-to-point op the library issues.

Each wrapper here calls the matching ``torch.distributed`` function and appends a
:class:`~tutorial_lib.trace.TraceEvent` to the rank's tracer: op, group kind and
ranks, shape, dtype, bytes, start and end time, the current tags, and (for small
tensors, when capture is on) the values before and after.

Groups are named by kind (``"tp"``, ``"dp"``, ``"ep"``, ``"pp"``, ``"world"``...),
looked up in :mod:`tutorial_lib.parallel_state`; a live ``ProcessGroup`` works too
and is recorded as kind ``"custom"``.  Peers of send/recv are *global* ranks.

Byte convention (what ``TraceEvent.bytes`` counts, per rank):
all-reduce and broadcast: the tensor; reduce-scatter: the full input;
all-gather: this rank's shard (the input); all-to-all: the rows this rank sends;
send/recv: the tensor sent or received.

**float8 on the wire.**  gloo refuses float8 tensors in every collective except
send/recv, so all-gather, all-to-all and broadcast move them as ``uint8`` views: the same
bytes, bit-exact, under another dtype name.  The view is kept on NCCL too, where it is just
as correct (these ops only copy bytes, never add them) and needs no NCCL float8 support
(only recent NCCL releases have float8 types, for reductions on Hopper).  Reductions of
float8 are refused with an explanation on both backends: summing raw bytes is meaningless,
so float8 values are dequantized before anything adds them (chapter 8's combine does).

**Devices.**  Every op runs on the device of the tensors it is given: on a GPU rank
(``ctx.device`` is ``cuda:N``) those go over NCCL, CPU tensors over gloo (the launcher's
process group has both).  Ops on a GPU tensor are timed with CUDA events, not the host
clock (an NCCL op returns before it has run): see :mod:`tutorial_lib.trace`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from . import parallel_state
from .trace import TraceEvent, get_tracer

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
_FLOAT8 = {d for d in (getattr(torch, n, None) for n in
                       ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"))
           if d is not None}

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _resolve(group, p2p: bool = False):
    """(kind, ProcessGroup, global ranks) for a kind name or a live group; with ``p2p`` the
    group's point-to-point twin while torch's collective check is on
    (:func:`~tutorial_lib.parallel_state.get_p2p_group`)."""
    if group is None or isinstance(group, str):
        kind = group or "world"
        live = parallel_state.get_p2p_group(kind) if p2p else parallel_state.get_group(kind)
        return kind, live, tuple(parallel_state.get_group_ranks(kind))
    return "custom", group, tuple(dist.get_process_group_ranks(group))


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as gloo can move it: float8 viewed as uint8, everything else unchanged
    (the same view on NCCL: byte-for-byte copies need no float8 type)."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def _refuse_float8_reduction(t: torch.Tensor, op: str) -> None:
    if t.dtype in _FLOAT8:
        raise TypeError(f"{op} cannot reduce a {_dtype_name(t)} tensor: float8 values must be "
                        f"dequantized (e.g. to bfloat16 or float32) before they are summed")


def _values(t: torch.Tensor):
    tracer = get_tracer()
    if not tracer.wants_values(t.numel()):
        return None
    return t.detach().float().flatten().cpu().tolist()


def _begin(op, tensor, kind, ranks, peer=None, nbytes=None, **extra) -> TraceEvent:
    return get_tracer().begin(op, group_kind=kind, group_ranks=ranks, peer=peer,
                              on_gpu=tensor.is_cuda,
                              shape=tuple(tensor.shape), dtype=_dtype_name(tensor),
                              bytes=_nbytes(tensor) if nbytes is None else nbytes,
                              values_in=_values(tensor), **extra)


def _finish(event: TraceEvent, result: torch.Tensor | None) -> None:
    if result is not None:
        event.values_out = _values(result)
    get_tracer().end(event)


# --- collectives ------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, group="world", op: str = "sum", async_op: bool = False,
               tags: dict | None = None):
    """In place: every rank of ``group`` ends with the reduction of all ranks' tensors.

    With ``async_op=True`` it returns at once with a :class:`TracedWork`: the event's
    ``t_start`` is when the op was issued and ``t_end`` when ``wait()`` returned, so a
    timeline shows it running under whatever the rank computes meanwhile (gloo runs it
    on a background thread, NCCL on its own stream).  ``tags`` are added to the event.
    """
    _refuse_float8_reduction(tensor, "all_reduce")
    kind, pg, ranks = _resolve(group)
    event = _begin("all_reduce", tensor, kind, ranks, blocking=not async_op,
                   tags={"reduce_op": op, **(tags or {})})
    work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=pg, async_op=async_op)
    if async_op:
        return TracedWork(work, event, tensor)
    _finish(event, tensor)
    return tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group="world",
                   op: str = "sum", async_op: bool = False,
                   input_split_sizes: list[int] | None = None):
    """Rank i of ``group`` receives the reduction of every rank's i-th slice (dim 0) of ``input``.

    ``async_op=True`` returns a :class:`TracedWork` at once, as :func:`all_reduce` does.
    ``input_split_sizes`` (uneven slices, rank i's ``output`` holding
    ``input_split_sizes[i]`` rows; sum only, never async): see :func:`_uneven_exchange`.
    """
    _refuse_float8_reduction(input, "reduce_scatter")
    kind, pg, ranks = _resolve(group)
    if input_split_sizes is not None:
        sizes = list(input_split_sizes)
        me = ranks.index(dist.get_rank())
        if op != "sum" or async_op or len(sizes) != len(ranks) or sum(sizes) != input.shape[0] \
                or output.shape[0] != sizes[me]:
            raise ValueError(f"reduce_scatter: uneven splits {sizes} (sum only, not async) do "
                             f"not match input dim 0 ({input.shape[0]}), output dim 0 "
                             f"({output.shape[0]}) over {len(ranks)} ranks")
        event = _begin("reduce_scatter", input, kind, ranks, tags={"reduce_op": op},
                       splits={"input": sizes})
        pieces = _uneven_exchange(input, pg, sizes, [sizes[me]] * len(ranks))
        torch.sum(pieces.view(len(ranks), *output.shape), dim=0, out=output)
        _finish(event, output)
        return output
    if input.shape[0] != output.shape[0] * len(ranks):
        raise ValueError(f"reduce_scatter: input dim 0 ({input.shape[0]}) must be output dim 0 "
                         f"({output.shape[0]}) x group size ({len(ranks)})")
    event = _begin("reduce_scatter", input, kind, ranks, blocking=not async_op, tags={"reduce_op": op})
    work = _reduce_scatter_single(output, input.contiguous(), op=_REDUCE_OPS[op], group=pg,
                                  async_op=async_op)
    if async_op:
        return TracedWork(work, event, output)
    _finish(event, output)
    return output


def all_gather(output: torch.Tensor, input: torch.Tensor, group="world", async_op: bool = False,
               output_split_sizes: list[int] | None = None):
    """Concatenate every rank's ``input`` along dim 0 into ``output``, on every rank.

    ``async_op=True`` returns a :class:`TracedWork` at once, as :func:`all_reduce` does.
    ``output_split_sizes``: rank i contributes ``output_split_sizes[i]`` rows (uneven, as
    Megatron's ``gather_from_sequence_parallel_region(..., output_split_sizes)``; never
    async): see :func:`_uneven_exchange`.
    """
    kind, pg, ranks = _resolve(group)
    if output_split_sizes is not None:
        sizes = list(output_split_sizes)
        me = ranks.index(dist.get_rank())
        if async_op or len(sizes) != len(ranks) or sum(sizes) != output.shape[0] \
                or input.shape[0] != sizes[me]:
            raise ValueError(f"all_gather: uneven splits {sizes} (not async) do not match "
                             f"input dim 0 ({input.shape[0]}), output dim 0 "
                             f"({output.shape[0]}) over {len(ranks)} ranks")
        event = _begin("all_gather", input, kind, ranks, splits={"output": sizes})
        output.copy_(_uneven_exchange(input.repeat(len(ranks), *[1] * (input.dim() - 1)), pg,
                                      [sizes[me]] * len(ranks), sizes))
        _finish(event, output)
        return output
    if output.shape[0] != input.shape[0] * len(ranks):
        raise ValueError(f"all_gather: output dim 0 ({output.shape[0]}) must be input dim 0 "
                         f"({input.shape[0]}) x group size ({len(ranks)})")
    event = _begin("all_gather", input, kind, ranks, blocking=not async_op)
    work = _all_gather_single(_wire(output), _wire(input.contiguous()), group=pg, async_op=async_op)
    if async_op:
        return TracedWork(work, event, output)
    _finish(event, output)
    return output


def _uneven_exchange(input: torch.Tensor, pg, input_splits: list[int],
                     output_splits: list[int]) -> torch.Tensor:
    """The untraced uneven all-to-all under :func:`all_gather` and :func:`reduce_scatter`
    with uneven splits.

    gloo's all-gather and reduce-scatter need equal pieces (NCCL's grouped sends do not),
    and an uneven all-gather is an all-to-all in which each rank sends its own rows to
    every rank; an uneven reduce-scatter one in which rank i is sent slice i of every
    input, summed on arrival.  The event records the collective it stands for, with that
    collective's byte count (the module's convention).
    """
    out = input.new_empty((sum(output_splits), *input.shape[1:]))
    dist.all_to_all_single(_wire(out), _wire(input.contiguous()), list(output_splits),
                           list(input_splits), group=pg)
    return out


def all_to_all(output: torch.Tensor, input: torch.Tensor, group="world",
               output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> torch.Tensor:
    """Send rows ``input_split_sizes[j]`` of ``input`` to group rank j; receive likewise.

    ``None`` splits mean equal splits.  The recorded event keeps both split lists
    (uneven splits are what MoE dispatch produces) and counts the bytes sent.
    """
    kind, pg, ranks = _resolve(group)
    n = len(ranks)
    row_bytes = _nbytes(input) // max(input.shape[0], 1) if input.dim() else input.element_size()
    ins = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
    outs = list(output_split_sizes) if output_split_sizes is not None else [output.shape[0] // n] * n
    if sum(ins) != input.shape[0] or sum(outs) != output.shape[0] or len(ins) != n or len(outs) != n:
        raise ValueError(f"all_to_all: splits input={ins} output={outs} do not match shapes "
                         f"{tuple(input.shape)} -> {tuple(output.shape)} over {n} ranks")
    switch = getattr(_OVERLAP, "switch", None)
    event = _begin("all_to_all", input, kind, ranks, nbytes=sum(ins) * row_bytes,
                   splits={"input": ins, "output": outs}, blocking=switch is None,
                   **({"tags": {"overlapped": True}} if switch is not None else {}))
    if switch is None:
        dist.all_to_all_single(_wire(output), _wire(input.contiguous()), outs, ins, group=pg)
        _finish(event, output)
        return output
    # inside an overlapped forward-backward pair: issue, let the other half compute, wait
    work = dist.all_to_all_single(_wire(output), _wire(input.contiguous()), outs, ins,
                                  group=pg, async_op=True)
    switch()
    TracedWork(work, event, output).wait()
    return output


#: Per thread: ``switch``, set while the thread runs one half of an overlapped
#: forward-backward pair (:func:`overlap_switch`).
_OVERLAP = threading.local()


@contextmanager
def overlap_switch(switch):
    """Inside the block, :func:`all_to_all` issues each all-to-all asynchronously, calls
    ``switch()`` (which returns when this thread may go on: the pipeline's overlapped
    pair lets the other microbatch compute meanwhile, :class:`tutorial_lib.pipeline_parallel.dualpipe.Turns`),
    and only then waits for it.  Its event is tagged ``overlapped``: from issue to wait."""
    saved = getattr(_OVERLAP, "switch", None)
    _OVERLAP.switch = switch
    try:
        yield
    finally:
        _OVERLAP.switch = saved


def broadcast(tensor: torch.Tensor, src: int, group="world") -> torch.Tensor:
    """Copy global rank ``src``'s tensor into every rank of ``group``."""
    kind, pg, ranks = _resolve(group)
    if src not in ranks:
        raise ValueError(f"broadcast: source rank {src} is not in the {kind} group {list(ranks)}")
    event = _begin("broadcast", tensor, kind, ranks, peer=src)
    dist.broadcast(_wire(tensor), src=src, group=pg)
    _finish(event, tensor)
    return tensor


def barrier(group="world") -> None:
    kind, pg, ranks = _resolve(group)
    event = get_tracer().begin("barrier", group_kind=kind, group_ranks=ranks)
    dist.barrier(group=pg)
    get_tracer().end(event)


# --- point to point ---------------------------------------------------------


def _check_peer(peer: int, ranks, op: str, kind: str) -> None:
    if peer not in ranks:
        raise ValueError(f"{op}: peer rank {peer} is not in this rank's {kind} group {list(ranks)}")
    if peer == dist.get_rank():
        raise ValueError(f"{op}: rank {peer} cannot {op} to or from itself")


def send(tensor: torch.Tensor, dst: int, group="world", tag: int = 0) -> None:
    """Blocking send to global rank ``dst``.

    ``tag``: messages between two ranks are matched in order *per tag*, so two streams
    (say activations and labels) with different tags cannot take each other's place.
    """
    kind, pg, ranks = _resolve(group, p2p=True)
    _check_peer(dst, ranks, "send", kind)
    event = _begin("send", tensor, kind, ranks, peer=dst)
    dist.send(tensor.contiguous(), dst=dst, group=pg, tag=tag)
    _finish(event, None)


def recv(tensor: torch.Tensor, src: int, group="world", tag: int = 0) -> torch.Tensor:
    """Blocking receive from global rank ``src`` into ``tensor`` (``tag``: see :func:`send`)."""
    kind, pg, ranks = _resolve(group, p2p=True)
    _check_peer(src, ranks, "recv", kind)
    event = _begin("recv", tensor, kind, ranks, peer=src)
    event.values_in = None  # the buffer's old contents are not data
    dist.recv(tensor, src=src, group=pg, tag=tag)
    _finish(event, tensor)
    return tensor


class TracedWork:
    """An asynchronous op in flight; ``wait()`` completes it and records the event."""

    def __init__(self, work, event: TraceEvent, tensor: torch.Tensor | None):
        self._work, self.event, self._tensor = work, event, tensor
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        tracer = get_tracer()
        with tracer.waiting(self.event):
            self._work.wait()
        self._done = True
        _finish(self.event, self._tensor)


def _p2p_event(op: str, tensor, peer: int, group) -> tuple:
    kind, pg, ranks = _resolve(group, p2p=True)
    _check_peer(peer, ranks, op, kind)
    event = _begin(op, tensor, kind, ranks, peer=peer, blocking=False)
    if op == "recv":
        event.values_in = None
    return event, pg


def isend(tensor: torch.Tensor, dst: int, group="world", tag: int = 0) -> TracedWork:
    event, pg = _p2p_event("send", tensor, dst, group)
    return TracedWork(dist.isend(tensor.contiguous(), dst=dst, group=pg, tag=tag), event, None)


def irecv(tensor: torch.Tensor, src: int, group="world", tag: int = 0) -> TracedWork:
    event, pg = _p2p_event("recv", tensor, src, group)
    return TracedWork(dist.irecv(tensor, src=src, group=pg, tag=tag), event, tensor)


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int]], group="world") -> list[TracedWork]:
    """Issue several sends/receives as one batch: ``ops`` holds ``("send"|"recv", tensor, peer)``,
    optionally with a fourth element, the ``tag`` (see :func:`send`)."""
    p2p_ops, events = [], []
    for op, tensor, peer, *tag in ops:
        if op not in ("send", "recv"):
            raise ValueError(f"batch_isend_irecv: op must be 'send' or 'recv', got {op!r}")
        event, pg = _p2p_event(op, tensor, peer, group)
        event.tags["batched"] = True
        fn = dist.isend if op == "send" else dist.irecv
        p2p_ops.append(dist.P2POp(fn, tensor, peer, group=pg, tag=tag[0] if tag else 0))
        events.append((event, tensor if op == "recv" else None))
    works = dist.batch_isend_irecv(p2p_ops)
    return [TracedWork(w, e, t) for w, (e, t) in zip(works, events)]


def wait_all(works: list[TracedWork]) -> None:
    for w in works:
        w.wait()
