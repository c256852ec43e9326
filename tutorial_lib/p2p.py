"""Pipeline point-to-point communication: the six helpers Megatron's schedules call.

A pipeline schedule (:mod:`tutorial_lib.pipeline_parallel`) says *what* moves; this
module moves it, with real ``torch.distributed`` sends and receives between adjacent
ranks of the ``"pp"`` group.  Activations go forward (rank ``r`` to ``r + 1``),
gradients go backward (``r + 1`` to ``r``).  The six helpers, named as in Megatron's
``megatron/core/pipeline_parallel/p2p_communication.py``:

================================  ========================  ==========================
helper                            sends                     receives
================================  ========================  ==========================
``send_forward(tensor)``          activation to next        --
``recv_forward(shape, dtype)``    --                        activation from previous
``send_backward(grad)``           gradient to previous      --
``recv_backward(shape, dtype)``   --                        gradient from next
``send_forward_recv_backward``    activation to **next**    gradient from **next**
``send_backward_recv_forward``    gradient to **previous**  activation from **prev.**
================================  ========================  ==========================

The two combined helpers are the 1F1B steady state: rank ``r``'s
``send_forward_recv_backward`` is matched by rank ``r + 1``'s
``send_backward_recv_forward``; both messages of one call go to and come from the
*same* neighbour.  A helper with no peer (sending forward from the last stage,
receiving forward on the first...) does nothing and returns ``None``.

Each helper runs in one of three **modes** (argument ``mode``).  Two are Megatron's;
one is a teaching construct that Megatron does not have:

``"batched"``
    Megatron's default (``batch_p2p_comm=True``, ``_batched_p2p_ops``): the send and
    the receive handed to ``batch_isend_irecv`` as one group, then waited on.  On NCCL
    that is one grouped launch whose operations progress together; on gloo it is a
    loop of isend / irecv, so no speed-up here.
``"overlapped"``
    Megatron's unbatched path (``batch_p2p_comm=False``, ``_p2p_ops``): ``isend`` and
    ``irecv`` posted one by one in a fixed order that depends on the stage's parity
    (:func:`unbatched_order`), then waited on.  Megatron-LM's training script takes
    this path only together with ``overlap_p2p_comm``, hence the name; what
    ``overlap_p2p_comm`` adds is *overlap with compute*: some helpers of the
    interleaved schedule return their handles un-waited (``wait_on_reqs=False``) and
    the schedule computes the next chunk while the messages fly.  Here the helpers
    wait before returning, except for the sends the executor collects in
    ``unwaited_sends`` (:func:`communicate`).
``"sequential"``
    a blocking ``send``, then a blocking ``recv`` (or the other way round), as a
    reader would first write it.  **Megatron has no such mode**: both of its paths
    post every operation before waiting for any.  It is here to be timed against the
    two others and to show the deadlock its naive order produces: on gloo a blocking
    send returns only once the peer has posted the matching receive, even for one
    float, so "send, then receive" on both ends of a link hangs.  The library orders
    by **stage parity** (even stages send first, odd stages receive first), which
    gives the two ends of every link opposite orders.  Chapter 7 only: a training run
    refuses it (:func:`tutorial_lib.pipeline_parallel.modes.check_schedule_and_mode`).

Why Megatron still cares about the order of non-blocking operations: on NCCL an
``isend`` or ``irecv`` does not block the host, it enqueues a kernel on a CUDA stream
and returns.  PyTorch's NCCL backend runs the unbatched operations between two ranks
of one process group on one communicator and one stream, so they execute one after
the other, in the order posted, and NCCL documents each ``ncclSend`` / ``ncclRecv``
as blocking *for the GPU* until its partner runs.  If both ends of a link post their
send first, both streams sit in a send whose receive is queued behind the other
side's send: a deadlock on the GPUs while the hosts keep going.  ``_p2p_ops``
therefore posts in an order that gives the two ends of every link opposite orders,
and at ``PP = 2`` (where previous and next are the same rank) it sends one direction
over the world group, a second communicator with its own stream, so the two
directions can run at the same time.  :func:`simulate_streams` replays that model
without a GPU.  (Batching avoids the question: a grouped launch lets its operations
progress together.)

What Megatron-LM's training script runs (Megatron-Core 0.20.0): ``overlap_p2p_comm``
is on unless ``--no-overlap-p2p-communication`` is given, is turned off for every
schedule but the interleaved one, and ``batch_p2p_comm = not overlap_p2p_comm``.  So:
batched without interleaving, overlapped with it (batched if the flag is given, which
needs ``PP > 2``).  :func:`mode_from_megatron_flags` maps the two flags to a mode and
:func:`suggest_p2p_mode` applies the rule; :func:`parse_topology` reads
``nvidia-smi topo -m`` to *describe* the links, not to pick the mode.

Every op is recorded with the tags ``p2p_mode`` and ``p2p_op`` (the helper's name).
``send_forward_recv_backward(..., wrong_recv_backward_peer=True)`` reproduces a
classic batched-mode bug (receiving the gradient from the *previous* rank): with
``PP = 2`` previous and next are the same rank and nothing shows; with ``PP >= 3``
the pipeline hangs.  Not always where you would look: stage 0 waits for a gradient
from the last stage (the previous rank wraps around), but stage 1's misdirected
receive *succeeds*, because messages are matched by peer, not by meaning: it takes
stage 0's activation as its gradient, and it is stage 1's next receive of an
activation that waits forever.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

import torch

from . import comm, parallel_state
from .devices import resolve_device
from .pipeline_parallel.modes import P2P_MODES
from .trace import get_tracer

MODES = P2P_MODES
"""``sequential``, ``overlapped``, ``batched``
(:data:`tutorial_lib.pipeline_parallel.modes.P2P_MODES`)."""
DEFAULT_MODE = "batched"
"""Megatron's default: ``batch_p2p_comm = not overlap_p2p_comm`` with overlap off."""


# --- where the neighbours are -------------------------------------------------


def _stage() -> tuple[int, int, list[int]]:
    """(this rank's stage, number of stages, global ranks of the pipeline group)."""
    ranks = parallel_state.get_group_ranks("pp")
    return parallel_state.get_rank_in("pp"), len(ranks), ranks


def next_rank(wrap: bool = False) -> int | None:
    """Global rank of the next stage; ``None`` on the last stage.

    ``wrap=True``: the pipeline seen as a ring, as Megatron's ``P2PCommunicator``
    stores it (its ``next_rank`` of the last stage is the first stage)."""
    stage, size, ranks = _stage()
    if wrap:
        return ranks[(stage + 1) % size]
    return ranks[stage + 1] if stage + 1 < size else None


def prev_rank(wrap: bool = False) -> int | None:
    """Global rank of the previous stage; ``None`` on the first stage.

    ``wrap=True``: the ring, as Megatron stores it (and as its
    ``get_pipeline_model_parallel_prev_rank`` returns it): the first stage's previous
    rank is the last stage."""
    stage, size, ranks = _stage()
    if wrap:
        return ranks[(stage - 1) % size]
    return ranks[stage - 1] if stage > 0 else None


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"p2p mode must be one of {', '.join(MODES)}; got {mode!r}")


# --- the order Megatron posts unbatched operations in (pure) ------------------------

#: What each part of a helper's name does: (operation, neighbour).
_HELPER_PARTS = {"send_forward": ("send", "next"), "send_backward": ("send", "prev"),
                 "recv_forward": ("recv", "prev"), "recv_backward": ("recv", "next")}

#: Megatron-Core's ``_p2p_ops`` (0.20.0) posts the four possible operations of one
#: call in one order on even stages and another on odd ones; a call posts the ones it
#: has.
_UNBATCHED_ORDER = {
    0: (("send", "next"), ("recv", "prev"), ("send", "prev"), ("recv", "next")),
    1: (("recv", "prev"), ("send", "next"), ("recv", "next"), ("send", "prev")),
}


def helper_ops(name: str) -> tuple[tuple[str, str], ...]:
    """The ``(operation, neighbour)`` pairs helper ``name`` does, in the name's order.

    ``helper_ops("send_forward_recv_backward")`` is
    ``(("send", "next"), ("recv", "next"))``.
    """
    parts = re.fullmatch(r"((?:send|recv)_(?:forward|backward))"
                         r"(?:_((?:send|recv)_(?:forward|backward)))?", name or "")
    if parts is None:
        raise ValueError(f"{name!r} is not a P2P helper: names are send_forward, "
                         f"recv_backward, send_forward_recv_backward, ... "
                         f"(see tutorial_lib.p2p)")
    return tuple(_HELPER_PARTS[p] for p in parts.groups() if p is not None)


def unbatched_order(name: str, stage: int) -> tuple[tuple[str, str], ...]:
    """The order Megatron's unbatched ``_p2p_ops`` posts helper ``name``'s operations in
    on pipeline stage ``stage``: ``(operation, neighbour)`` pairs.

    Even stages: send to next, receive from previous, send to previous, receive from
    next; odd stages: receive from previous, send to next, receive from next, send to
    previous.  For the two steady-state helpers, whose messages share one neighbour,
    the forward sender posts its send first on either parity; for
    ``send_forward_recv_forward`` (interleaving), even stages send first and odd
    stages receive first.  Either way the two ends of a link post in opposite orders.
    """
    wanted = set(helper_ops(name))
    return tuple(op for op in _UNBATCHED_ORDER[stage % 2] if op in wanted)


# --- NCCL's unbatched operations: one stream per pair of ranks, simulated (pure) ----


@dataclass
class StreamRun:
    """What :func:`simulate_streams` found: each step's transfers, or where it stuck."""

    steps: list[list[tuple[int, int, str]]] = field(default_factory=list)
    """Step by step, the ``(sender, receiver, group)`` transfers that ran together."""
    stuck: dict[int, list[str]] = field(default_factory=dict)
    """Rank -> the operations at the head of its streams when nothing could move
    (empty when every operation completed)."""

    @property
    def deadlocked(self) -> bool:
        return bool(self.stuck)


def posted_ops(stage: int, pp: int, helpers: list[str], order: str = "megatron",
               world_at_pp2: bool = True) -> list[tuple[str, int, str]]:
    """What ``stage`` of ``pp`` stages posts, unbatched, calling ``helpers`` in turn.

    Returns ``(operation, peer stage, group)`` triples.  A helper whose neighbour does
    not exist (the first stage has no previous one, the last no next) posts nothing,
    as Megatron's helpers return early there.  ``order``: ``"megatron"``
    (:func:`unbatched_order`) or ``"send_first"`` (every send before every receive,
    the order a reader would first write).  ``world_at_pp2``: at ``PP = 2``, what
    ``_p2p_ops`` does: messages from the odd stage to the even one travel over the
    world group, the others over the pipeline group.
    """
    if order not in ("megatron", "send_first"):
        raise ValueError(f"order must be 'megatron' or 'send_first', got {order!r}")
    peer = {"next": stage + 1 if stage + 1 < pp else None,
            "prev": stage - 1 if stage > 0 else None}
    posted = []
    for name in helpers:
        ops = unbatched_order(name, stage) if order == "megatron" else \
            tuple(sorted(helper_ops(name), key=lambda op: op[0] != "send"))
        if any(peer[side] is None for _, side in ops):
            continue
        for kind, side in ops:
            sender = stage if kind == "send" else peer[side]
            group = "world" if world_at_pp2 and pp == 2 and sender % 2 == 1 else "pp"
            posted.append((kind, peer[side], group))
    return posted


def simulate_streams(posted: dict[int, list[tuple[str, int, str]]]) -> StreamRun:
    """Run every rank's posted operations the way NCCL runs unbatched ones.

    ``posted``: rank -> ``(operation, peer, group)`` in the order posted (the host
    posts them all without waiting: an NCCL send does not block the host).  Each
    rank has one stream per ``(group, peer)``, as PyTorch's NCCL backend gives the
    unbatched operations between two ranks of a group one communicator; a stream runs
    its operations one at a time, in order, and a send and its receive complete
    together, only when each is at the head of its stream (NCCL's send and receive
    block the GPU until the partner runs).  Every step completes all the pairs that
    can meet.  Deterministic; no process is started.
    """
    streams: dict[tuple[int, str, int], list[str]] = {}
    for rank, ops in posted.items():
        for kind, peer, group in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"an operation is 'send' or 'recv', got {kind!r}")
            streams.setdefault((rank, group, peer), []).append(kind)
    run = StreamRun()
    while any(streams.values()):
        step = []
        for (rank, group, peer), ops in sorted(streams.items()):
            partner = streams.get((peer, group, rank), [])
            if ops and ops[0] == "send" and partner and partner[0] == "recv":
                step.append((rank, peer, group))
        if not step:
            for (rank, group, peer), ops in sorted(streams.items()):
                if ops:
                    word = "send to" if ops[0] == "send" else "recv from"
                    run.stuck.setdefault(rank, []).append(f"{word} {peer} ({group})")
            return run
        for sender, receiver, group in step:
            streams[(sender, group, receiver)].pop(0)
            streams[(receiver, group, sender)].pop(0)
        run.steps.append(step)
    return run


# --- the one routine every helper uses ------------------------------------------


def communicate(name: str, mode: str, send: tuple[torch.Tensor, int] | None = None,
                recv: tuple[tuple, torch.dtype, int] | None = None,
                send_tag: int = 0, recv_tag: int = 0,
                unwaited_sends: list | None = None, device=None) -> torch.Tensor | None:
    """Send ``send = (tensor, peer)`` and/or receive ``recv = (shape, dtype, peer)``.

    ``name`` is the helper (``send_forward_recv_backward``...): it is the trace's
    ``p2p_op`` and, in overlapped mode, decides the posting order
    (:func:`unbatched_order`).  Returns the received tensor (or ``None`` when nothing
    is received).  The tags keep separate streams between the same two ranks apart
    (the executor in :mod:`tutorial_lib.pipeline_parallel.executor` gives activations and gradients
    their own).  ``unwaited_sends``: a list to append the send's handle to instead of
    waiting on it (the sender moves on, and waits later, as the interleaved schedule
    does with ``overlap_p2p_comm``); not possible in sequential mode, whose send
    blocks by definition.  ``device``: where the receive buffer is made (``None``: the
    sent tensor's device, else torch's default).
    """
    _check_mode(mode)
    if unwaited_sends is not None and mode == "sequential":
        raise ValueError("sequential mode blocks in every send; unwaited sends need "
                         "the overlapped or batched mode")
    stage = parallel_state.get_rank_in("pp")
    order = [op for op, _ in unbatched_order(name, stage)]
    if sorted(order) != [op for op, given in (("recv", recv), ("send", send)) if given]:
        raise ValueError(f"{name} does {' and '.join(order)}; got "
                         f"send={send is not None}, recv={recv is not None}")
    if device is None and send is not None:
        device = send[0].device
    received = (torch.empty(recv[0], dtype=recv[1], device=resolve_device(device))
                if recv is not None else None)
    with get_tracer().tags(p2p_mode=mode, p2p_op=name):
        if mode == "sequential":
            send_first = stage % 2 == 0  # parity: the two ends of a link differ
            if send is not None and (send_first or recv is None):
                comm.send(send[0], send[1], group="pp", tag=send_tag)
            if recv is not None:
                comm.recv(received, recv[2], group="pp", tag=recv_tag)
            if send is not None and not (send_first or recv is None):
                comm.send(send[0], send[1], group="pp", tag=send_tag)
            return received

        if mode == "overlapped":  # Megatron's _p2p_ops: one by one, in its order
            posted = {}
            for op in order:
                if op == "send":
                    posted[op] = comm.isend(send[0], send[1], group="pp", tag=send_tag)
                else:
                    posted[op] = comm.irecv(received, recv[2], group="pp", tag=recv_tag)
            send_works = [posted["send"]] if "send" in posted else []
            recv_works = [posted["recv"]] if "recv" in posted else []
        else:  # batched: Megatron's _batched_p2p_ops, one group
            ops = [("send", send[0], send[1], send_tag)] if send is not None else []
            ops += [("recv", received, recv[2], recv_tag)] if recv is not None else []
            works = comm.batch_isend_irecv(ops, group="pp")
            send_works = works[:1] if send is not None else []
            recv_works = works[-1:] if recv is not None else []
        # All ops are already posted, so the wait order does not matter for progress;
        # waiting on the receive first makes a hang show up as "recv from rank k".
        if unwaited_sends is not None:
            unwaited_sends.extend(send_works)
            send_works = []
        comm.wait_all(recv_works + send_works)
        return received


# --- the six helpers ------------------------------------------------------------------


def _with_neighbour(name: str, peer: int | None, mode: str, send: torch.Tensor | None = None,
                    recv: tuple | None = None, device=None) -> torch.Tensor | None:
    """``communicate(name, ...)`` with the neighbouring stage ``peer``: sends ``send``,
    receives a ``recv = (shape, dtype)`` buffer on ``device``.  Nothing at all (``None``)
    where that neighbour does not exist (the first stage has no previous one, the last no
    next one): the rule every helper below follows."""
    if peer is None:
        return None
    return communicate(name, mode, send=None if send is None else (send, peer),
                       recv=None if recv is None else (tuple(recv[0]), recv[1], peer),
                       device=device)


def send_forward(tensor: torch.Tensor, mode: str = DEFAULT_MODE) -> None:
    """Send this stage's output activation to the next stage (no-op on the last)."""
    _with_neighbour("send_forward", next_rank(), mode, send=tensor)


def recv_forward(shape, dtype: torch.dtype = torch.float32,
                 mode: str = DEFAULT_MODE, device=None) -> torch.Tensor | None:
    """Receive this stage's input activation from the previous stage (``None`` on
    the first), into a buffer on ``device`` (``None``: torch's default device)."""
    return _with_neighbour("recv_forward", prev_rank(), mode, recv=(shape, dtype), device=device)


def send_backward(grad: torch.Tensor, mode: str = DEFAULT_MODE) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the
    first)."""
    _with_neighbour("send_backward", prev_rank(), mode, send=grad)


def recv_backward(shape, dtype: torch.dtype = torch.float32,
                  mode: str = DEFAULT_MODE, device=None) -> torch.Tensor | None:
    """Receive the gradient of this stage's output from the next stage (``None`` on
    the last), into a buffer on ``device`` (``None``: torch's default device)."""
    return _with_neighbour("recv_backward", next_rank(), mode, recv=(shape, dtype), device=device)


def send_forward_recv_backward(tensor: torch.Tensor, shape,
                               dtype: torch.dtype = torch.float32,
                               mode: str = DEFAULT_MODE,
                               wrong_recv_backward_peer: bool = False
                               ) -> torch.Tensor | None:
    """Send the activation to the next stage and receive its gradient from that
    same next stage.

    ``wrong_recv_backward_peer=True`` is a classic bug, kept for teaching: the
    gradient is received from the previous rank (wrapping like Megatron's
    ``get_pipeline_model_parallel_prev_rank``).  Harmless-looking with ``PP = 2``,
    a deadlock with ``PP >= 3``.
    """
    peer = next_rank()
    if peer is None:
        return None
    grad_from = prev_rank(wrap=True) if wrong_recv_backward_peer else peer
    return communicate("send_forward_recv_backward", mode, send=(tensor, peer),
                        recv=(tuple(shape), dtype, grad_from))


def send_backward_recv_forward(grad: torch.Tensor, shape,
                               dtype: torch.dtype = torch.float32,
                               mode: str = DEFAULT_MODE) -> torch.Tensor | None:
    """Send the gradient to the previous stage and receive the next activation from
    it."""
    return _with_neighbour("send_backward_recv_forward", prev_rank(), mode, send=grad,
                           recv=(shape, dtype))


# --- choosing a mode -----------------------------------------------------------------


def mode_from_megatron_flags(overlap_p2p_comm: bool,
                             batch_p2p_comm: bool | None = None) -> str:
    """The mode Megatron-Core runs for its two flags: ``batched`` or ``overlapped``,
    never ``sequential``.

    ``batch_p2p_comm`` defaults to ``not overlap_p2p_comm`` (what Megatron-LM's
    training script passes).  ``batch_p2p_comm=True`` is ``_batched_p2p_ops``;
    ``False`` is ``_p2p_ops``, non-blocking operations posted in parity order, whether
    or not ``overlap_p2p_comm`` also leaves some of them un-waited.  Both ``True`` is
    refused, as Megatron's interleaved schedule refuses it.
    """
    if batch_p2p_comm is None:
        batch_p2p_comm = not overlap_p2p_comm
    if overlap_p2p_comm and batch_p2p_comm:
        raise ValueError("overlap_p2p_comm and batch_p2p_comm cannot both be True: "
                         "Megatron sets batch_p2p_comm = not overlap_p2p_comm; "
                         "turn one off")
    return "batched" if batch_p2p_comm else "overlapped"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")


def parse_topology(text: str) -> dict:
    """Parse ``nvidia-smi topo -m`` into ``{"devices": [...], "links": {...}}``.

    ``links`` maps a pair of devices ``(a, b)`` to its kind.

    ``kind`` is the matrix cell: ``NV12`` (12 bonded NVLinks), ``PIX``, ``PXB``,
    ``PHB``, ``NODE`` or ``SYS`` (PCIe / host paths, best to worst).  Self cells
    (``X``) and the affinity columns are dropped.  Pure: no process is run.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"]),
                  None)
    if header is None:
        raise ValueError("parse_topology: no header row starting with GPU0; pass the "
                         "output of `nvidia-smi topo -m`")
    devices = []
    for name in header:  # device columns come first, then "CPU Affinity" and the like
        if not _DEVICE.match(name):
            break
        devices.append(name)
    links = {}
    for line in lines:
        cells = line.split()
        if not cells or cells[0] not in devices or cells == header:
            continue
        for other, kind in zip(devices, cells[1:1 + len(devices)]):
            if other != cells[0] and kind != "X":
                links[(cells[0], other)] = kind
    return {"devices": devices, "links": links}


def suggest_p2p_mode(topology_text: str | None = None, interleaved: bool = False,
                     overlap_p2p_comm: bool = False) -> tuple[str, str]:
    """(mode, reason) by Megatron's rule: batched, unless overlapping with the
    interleaved schedule.

    The topology (read from ``nvidia-smi topo -m`` when it exists and no text is
    given) only goes into the reason: NVLink does not make Megatron pick a mode.
    """
    if interleaved and overlap_p2p_comm:
        mode, rule = "overlapped", ("overlap_p2p_comm with the interleaved schedule: "
                                    "batch_p2p_comm = not overlap_p2p_comm = False")
    else:
        mode, rule = "batched", ("Megatron's default: batch_p2p_comm = not "
                                 "overlap_p2p_comm, and overlap is only kept with the "
                                 "interleaved schedule")
    if topology_text is None:
        if shutil.which("nvidia-smi") is None:
            return mode, f"{rule}; nvidia-smi not found, so no GPU topology was read"
        try:
            topology_text = subprocess.run(["nvidia-smi", "topo", "-m"],
                                           capture_output=True, text=True,
                                           timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return mode, f"{rule}; nvidia-smi topo -m failed ({exc})"
    try:
        topology = parse_topology(topology_text)
    except ValueError as exc:
        return mode, f"{rule}; topology not understood ({exc})"
    gpu_links = [k for (a, b), k in topology["links"].items()
                 if a.startswith("GPU") and b.startswith("GPU")]
    nvlink = sum(k.startswith("NV") for k in gpu_links)
    gpus = sum(d.startswith("GPU") for d in topology["devices"])
    return mode, (f"{rule}; topology: {gpus} GPUs, {nvlink} of {len(gpu_links)} GPU "
                  f"pairs on NVLink (describes the links; it does not change the mode)")
