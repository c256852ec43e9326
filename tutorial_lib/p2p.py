"""Pipeline point-to-point communication: the six helpers Megatron's schedules call.

A pipeline schedule (:mod:`tutorial_lib.pipeline_schedules`) says *what* moves; this
module moves it, with real ``torch.distributed`` sends and receives between adjacent
ranks of the ``"pp"`` group.  Activations go forward (rank ``r`` to ``r + 1``),
gradients go backward (``r + 1`` to ``r``).  The six helpers, named as in Megatron's
``megatron/core/pipeline_parallel/p2p_communication.py``:

=================================  ========================  ===========================
helper                             sends                     receives
=================================  ========================  ===========================
``send_forward(tensor)``           activation to next        --
``recv_forward(shape, dtype)``     --                        activation from previous
``send_backward(grad)``            gradient to previous      --
``recv_backward(shape, dtype)``    --                        gradient from next
``send_forward_recv_backward``     activation to **next**    gradient from **next**
``send_backward_recv_forward``     gradient to **previous**  activation from **previous**
=================================  ========================  ===========================

The two combined helpers are the 1F1B steady state: rank ``r``'s
``send_forward_recv_backward`` is matched by rank ``r + 1``'s
``send_backward_recv_forward``; both messages of one call go to and come from the
*same* neighbour.  A helper with no peer (sending forward from the last stage,
receiving forward on the first...) does nothing and returns ``None``.

Each helper runs in one of three **modes** (argument ``mode``):

``"sequential"``
    blocking ``send`` and blocking ``recv``, one after the other.  A blocking send
    can wait until the peer posts the matching receive: on gloo it always does
    (even for one float; try it), on NCCL once a message is larger than the
    eager buffer.  So in the steady state, where rank ``r`` sends an activation to
    ``r + 1`` while ``r + 1`` sends a gradient to ``r``, "send, then receive" on
    both ranks deadlocks: each waits in its send for a receive the other never
    reaches.  The fix used here (and by Megatron's unbatched ``_p2p_ops``) is to
    order by **stage parity**: even stages send first, odd stages receive first.
    Neighbours have opposite parity, so one is always receiving while the other
    sends.  (Using ``isend`` for the send half fixes it too: that is the next mode.)
``"overlapped"``
    ``isend`` and ``irecv`` issued together, then both waited on: the two
    directions of the link are used at once and no ordering can deadlock.
``"batched"``
    the same operations handed to ``batch_isend_irecv`` as one group (on NCCL one
    grouped launch; on gloo a loop of isend/irecv, so no speed-up here).

What Megatron really does: the mode is not chosen from the hardware.  Its training
script sets ``batch_p2p_comm = not overlap_p2p_comm``, and ``overlap_p2p_comm`` is
only kept with the *interleaved* schedule (for the non-interleaved one it is turned
off).  So: batched by default, overlapped with interleaving, where the helpers
return the handles un-waited so the schedule computes while the messages fly (here
every helper waits before returning, to keep them comparable).
:func:`suggest_p2p_mode` applies that rule; :func:`parse_topology` reads
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

import torch

from . import comm, parallel_state
from .devices import resolve_device
from .pipeline_schedules import P2P_MODES
from .trace import get_tracer

MODES = P2P_MODES
"""``sequential``, ``overlapped``, ``batched`` (:data:`tutorial_lib.pipeline_schedules.P2P_MODES`)."""
DEFAULT_MODE = "batched"
"""Megatron's default: ``batch_p2p_comm = not overlap_p2p_comm`` with overlap off."""


# --- where the neighbours are -------------------------------------------------


def _stage() -> tuple[int, int, list[int]]:
    """(this rank's stage, number of stages, global ranks of the pipeline group)."""
    ranks = parallel_state.get_group_ranks("pp")
    return parallel_state.get_rank_in("pp"), len(ranks), ranks


def next_rank() -> int | None:
    """Global rank of the next stage; ``None`` on the last stage."""
    stage, size, ranks = _stage()
    return ranks[stage + 1] if stage + 1 < size else None


def prev_rank() -> int | None:
    """Global rank of the previous stage; ``None`` on the first stage."""
    stage, _, ranks = _stage()
    return ranks[stage - 1] if stage > 0 else None


def _prev_rank_wrapping() -> int:
    """What Megatron's ``get_pipeline_model_parallel_prev_rank`` returns: the ring wraps."""
    stage, size, ranks = _stage()
    return ranks[(stage - 1) % size]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"p2p mode must be one of {', '.join(MODES)}; got {mode!r}")


# --- the one routine every helper uses ------------------------------------------


def communicate(name: str, mode: str, send: tuple[torch.Tensor, int] | None = None,
                 recv: tuple[tuple, torch.dtype, int] | None = None,
                 send_tag: int = 0, recv_tag: int = 0,
                 unwaited_sends: list | None = None, device=None) -> torch.Tensor | None:
    """Send ``send = (tensor, peer)`` and/or receive ``recv = (shape, dtype, peer)``.

    Returns the received tensor (or ``None`` when nothing is received).  The tags
    keep separate streams between the same two ranks apart (the executor in
    :mod:`tutorial_lib.pipeline` gives activations and gradients their own).
    ``unwaited_sends``: a list to append the send's handle to instead of waiting on it
    (Megatron's ``overlap_p2p_comm``: the sender moves on, and waits later); not
    possible in sequential mode, whose send blocks by definition.  ``device``: where the
    receive buffer is made (``None``: the sent tensor's device, else torch's default).
    """
    _check_mode(mode)
    if unwaited_sends is not None and mode == "sequential":
        raise ValueError("sequential mode blocks in every send; unwaited sends need the "
                         "overlapped or batched mode")
    if device is None and send is not None:
        device = send[0].device
    received = (torch.empty(recv[0], dtype=recv[1], device=resolve_device(device))
                if recv is not None else None)
    with get_tracer().tags(p2p_mode=mode, p2p_op=name):
        if mode == "sequential":
            send_first = parallel_state.get_rank_in("pp") % 2 == 0  # parity breaks the cycle
            if send is not None and (send_first or recv is None):
                comm.send(send[0], send[1], group="pp", tag=send_tag)
            if recv is not None:
                comm.recv(received, recv[2], group="pp", tag=recv_tag)
            if send is not None and not (send_first or recv is None):
                comm.send(send[0], send[1], group="pp", tag=send_tag)
            return received

        sends = [("send", send[0], send[1], send_tag)] if send is not None else []
        recvs = [("recv", received, recv[2], recv_tag)] if recv is not None else []
        if mode == "overlapped":
            send_works = [comm.isend(t, peer, group="pp", tag=tag) for _, t, peer, tag in sends]
            recv_works = [comm.irecv(t, peer, group="pp", tag=tag) for _, t, peer, tag in recvs]
        else:  # batched
            works = comm.batch_isend_irecv(sends + recvs, group="pp")
            send_works, recv_works = works[:len(sends)], works[len(sends):]
        # All ops are already posted, so the wait order does not matter for progress;
        # waiting on the receive first makes a hang show up as "recv from rank k".
        if unwaited_sends is not None:
            unwaited_sends.extend(send_works)
            send_works = []
        comm.wait_all(recv_works + send_works)
        return received


# --- the six helpers ------------------------------------------------------------------


def send_forward(tensor: torch.Tensor, mode: str = DEFAULT_MODE) -> None:
    """Send this stage's output activation to the next stage (no-op on the last stage)."""
    peer = next_rank()
    if peer is not None:
        communicate("send_forward", mode, send=(tensor, peer))
    return None


def recv_forward(shape, dtype: torch.dtype = torch.float32,
                 mode: str = DEFAULT_MODE, device=None) -> torch.Tensor | None:
    """Receive this stage's input activation from the previous stage (``None`` on the first),
    into a buffer on ``device`` (``None``: torch's default device)."""
    peer = prev_rank()
    if peer is None:
        return None
    return communicate("recv_forward", mode, recv=(tuple(shape), dtype, peer), device=device)


def send_backward(grad: torch.Tensor, mode: str = DEFAULT_MODE) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first)."""
    peer = prev_rank()
    if peer is not None:
        communicate("send_backward", mode, send=(grad, peer))
    return None


def recv_backward(shape, dtype: torch.dtype = torch.float32,
                  mode: str = DEFAULT_MODE, device=None) -> torch.Tensor | None:
    """Receive the gradient of this stage's output from the next stage (``None`` on the last),
    into a buffer on ``device`` (``None``: torch's default device)."""
    peer = next_rank()
    if peer is None:
        return None
    return communicate("recv_backward", mode, recv=(tuple(shape), dtype, peer), device=device)


def send_forward_recv_backward(tensor: torch.Tensor, shape, dtype: torch.dtype = torch.float32,
                               mode: str = DEFAULT_MODE,
                               wrong_recv_backward_peer: bool = False) -> torch.Tensor | None:
    """Send the activation to the next stage and receive its gradient from the same next stage.

    ``wrong_recv_backward_peer=True`` is a classic bug, kept for teaching: the
    gradient is received from the previous rank (wrapping like Megatron's
    ``get_pipeline_model_parallel_prev_rank``).  Harmless-looking with ``PP = 2``,
    a deadlock with ``PP >= 3``.
    """
    peer = next_rank()
    if peer is None:
        return None
    grad_from = _prev_rank_wrapping() if wrong_recv_backward_peer else peer
    return communicate("send_forward_recv_backward", mode, send=(tensor, peer),
                        recv=(tuple(shape), dtype, grad_from))


def send_backward_recv_forward(grad: torch.Tensor, shape, dtype: torch.dtype = torch.float32,
                               mode: str = DEFAULT_MODE) -> torch.Tensor | None:
    """Send the gradient to the previous stage and receive the next activation from it."""
    peer = prev_rank()
    if peer is None:
        return None
    return communicate("send_backward_recv_forward", mode, send=(grad, peer),
                        recv=(tuple(shape), dtype, peer))


# --- choosing a mode --------------------------------------------------------------------


def mode_from_megatron_flags(overlap_p2p_comm: bool, batch_p2p_comm: bool | None = None) -> str:
    """Megatron's two flags as one mode; ``batch_p2p_comm`` defaults to ``not overlap_p2p_comm``."""
    if batch_p2p_comm is None:
        batch_p2p_comm = not overlap_p2p_comm
    if overlap_p2p_comm and batch_p2p_comm:
        raise ValueError("overlap_p2p_comm and batch_p2p_comm cannot both be True: Megatron "
                         "sets batch_p2p_comm = not overlap_p2p_comm; turn one off")
    if overlap_p2p_comm:
        return "overlapped"
    return "batched" if batch_p2p_comm else "sequential"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"^(GPU|NIC)\d+$")


def parse_topology(text: str) -> dict:
    """Parse ``nvidia-smi topo -m`` into ``{"devices": [...], "links": {(a, b): kind}}``.

    ``kind`` is the matrix cell: ``NV12`` (12 bonded NVLinks), ``PIX``, ``PXB``,
    ``PHB``, ``NODE`` or ``SYS`` (PCIe / host paths, best to worst).  Self cells
    (``X``) and the affinity columns are dropped.  Pure: no process is run.
    """
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        raise ValueError("parse_topology: no header row starting with GPU0; pass the output "
                         "of `nvidia-smi topo -m`")
    devices = []
    for name in header:  # the device columns come first, then "CPU Affinity" and the like
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
    """(mode, reason) by Megatron's rule: batched, unless overlapping with the interleaved schedule.

    The topology (read from ``nvidia-smi topo -m`` when it exists and no text is
    given) only goes into the reason: NVLink does not make Megatron pick a mode.
    """
    if interleaved and overlap_p2p_comm:
        mode, rule = "overlapped", ("overlap_p2p_comm with the interleaved schedule: "
                                    "batch_p2p_comm = not overlap_p2p_comm = False")
    else:
        mode, rule = "batched", ("Megatron's default: batch_p2p_comm = not overlap_p2p_comm, and "
                                 "overlap is only kept with the interleaved schedule")
    if topology_text is None:
        if shutil.which("nvidia-smi") is None:
            return mode, f"{rule}; nvidia-smi not found, so no GPU topology was read"
        try:
            topology_text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                           text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return mode, f"{rule}; nvidia-smi topo -m failed ({exc})"
    try:
        topology = parse_topology(topology_text)
    except ValueError as exc:
        return mode, f"{rule}; topology not understood ({exc})"
    gpu_links = [k for (a, b), k in topology["links"].items() if a.startswith("GPU") and b.startswith("GPU")]
    nvlink = sum(k.startswith("NV") for k in gpu_links)
    gpus = sum(d.startswith("GPU") for d in topology["devices"])
    return mode, (f"{rule}; topology: {gpus} GPUs, {nvlink} of {len(gpu_links)} GPU pairs on "
                  f"NVLink (describes the links; it does not change the mode)")
