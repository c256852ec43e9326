"""Run a pipeline schedule with real stages: the executor.

:mod:`tutorial_lib.pipeline_schedules` says, for each pipeline rank, the ordered list of
actions of one training step; :mod:`tutorial_lib.p2p` moves tensors between neighbours.
This module walks one rank's list and does each action for real::

    recv_activation mb c   -> a tensor [s, b, h] from the previous stage (it will need a gradient)
    recv_labels mb         -> the last stage receives mb's labels from the first stage
    forward mb c           -> chunk c's forward_stage on that input; the last stage: loss / M
    send_activation mb c   -> the output to the next stage
    recv_grad mb c         -> the gradient of that output, from the next stage
    backward mb c          -> autograd from the output (with that gradient, or from the loss)
    send_grad mb c         -> the gradient of the input, to the previous stage
    send_labels mb         -> the first stage sends mb's labels to the last stage

Consecutive sends and receives of activations and gradients are one communication
call, named after the Megatron helper it is (``send_forward_recv_backward`` and so
on), run in the chosen P2P mode.  GPipe is the exception: each message is its own
call.  The combined helpers (and the sequential mode's parity rule inside them) are
made for 1F1B, where rank ``r``'s ``send_forward_recv_backward`` always meets rank
``r + 1``'s ``send_backward_recv_forward``.  At GPipe's turn from forwards to
backwards a rank would combine "send my last activation, receive the first
gradient" while its neighbour is still receiving activations: with blocking sends
(sequential mode) the receive-first half waits for a gradient that cannot come yet.  Labels are different: the first stage sends a
microbatch's labels *before* its forward, and the last stage receives them only
after that microbatch's activation has crossed the whole pipeline.  A blocking send
would wait for that receive, and the activation it waits for can never be computed:
so labels always go with ``isend``, waited on at the end of the step.  (Megatron
avoids the message altogether: its first and last stages both read the batch from
the data loader.  This course sends them to show the path.)

After the last backward every parameter gradient is complete; the caller syncs them
once over the data-parallel groups (:class:`~tutorial_lib.data_parallel.DataParallel`
with every backward inside ``no_sync``).

Trace: each forward and backward is a ``compute`` span named ``forward``/``backward``
tagged ``microbatch`` and ``chunk``; every P2P op carries ``p2p_op`` (the helper
name), ``p2p_mode``, ``microbatch`` and ``chunk``.  That is what the chapter's
timeline draws next to the planned schedule.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import comm, parallel_state
from .config import ConfigError
from .model import Microbatch
from .p2p import MODES, _communicate
from .pipeline_schedules import PAYLOAD, SCHEDULE_NAMES, Action, build_schedules
from .trace import get_tracer

__all__ = ["StepOutput", "forward_backward_pipelining", "helper_name", "group_actions",
           "check_schedule_and_mode", "SyntheticStage", "synthetic_microbatches",
           "synthetic_run_name", "measure_synthetic_schedules"]

LABEL_KINDS = ("send_labels", "recv_labels")

#: One message stream per payload: gloo and NCCL match messages between two ranks in
#: order (per tag), so activations, gradients and labels that share a pair of ranks
#: (PP = 2, or the interleaved schedule's wrap-around) must not queue behind each other.
TAGS = {"activation": 1, "grad": 2, "labels": 3}

_HELPERS = {
    (("send", "activation"),): "send_forward",
    (("recv", "activation"),): "recv_forward",
    (("send", "grad"),): "send_backward",
    (("recv", "grad"),): "recv_backward",
    (("send", "activation"), ("recv", "grad")): "send_forward_recv_backward",
    (("send", "grad"), ("recv", "activation")): "send_backward_recv_forward",
    (("send", "activation"), ("recv", "activation")): "send_forward_recv_forward",
    (("send", "grad"), ("recv", "grad")): "send_backward_recv_backward",
}


def check_schedule_and_mode(schedule: str, p2p_mode: str) -> None:
    """Refuse names we do not know, and the one pairing that cannot run: interleaved + sequential."""
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError("malformed", f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, "
                                       f"got {schedule!r}")
    if p2p_mode not in MODES:
        raise ConfigError("malformed", f"p2p_mode must be one of {', '.join(MODES)}, got {p2p_mode!r}")
    if schedule == "interleaved" and p2p_mode == "sequential":
        raise ConfigError(
            "interleaved schedule",
            "the interleaved schedule needs sends that do not block (p2p_mode 'overlapped' or "
            "'batched'): with V chunks per rank, neighbours exchange activations of one chunk "
            "and gradients of another in both directions at once, and two blocking sends "
            "towards each other deadlock whatever the order.  Megatron runs interleaving with "
            "overlap_p2p_comm; use --p2p-mode overlapped")


def helper_name(run: list[Action]) -> str:
    """The Megatron P2P helper a run of consecutive sends/receives amounts to."""
    key = tuple((a.kind.split("_")[0], a.kind.split("_")[1]) for a in run)
    if key not in _HELPERS:
        raise ValueError(f"no P2P helper sends/receives {[a.label for a in run]}: a run holds at "
                         f"most one send followed by at most one receive")
    return _HELPERS[key]


def group_actions(actions: list[Action], combine: bool = True) -> list[list[Action]]:
    """Split a rank's list into steps: one compute, one label message, or one P2P run.

    ``combine=False`` makes every message its own step (what GPipe uses).
    """
    steps: list[list[Action]] = []
    for a in actions:
        joinable = (combine and steps and not a.is_compute and a.kind not in LABEL_KINDS
                    and not steps[-1][0].is_compute and steps[-1][0].kind not in LABEL_KINDS)
        if joinable:
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps


@dataclass
class StepOutput:
    """What one pipeline step leaves on this rank."""

    losses: dict[int, float] = field(default_factory=dict)
    """Microbatch -> its mean language-model loss (last stage only; empty elsewhere)."""
    peak_activations: int = 0
    """Most (microbatch, chunk) activations this rank held at once."""
    actions: int = 0
    """Actions executed (the schedule's length on this rank)."""


def forward_backward_pipelining(chunks: list, microbatches: list[Microbatch], schedule: str = "1f1b",
                                p2p_mode: str = "batched", tensor_shape: tuple | None = None,
                                dtype: torch.dtype = torch.float32) -> StepOutput:
    """Run one step's forwards and backwards on this pipeline rank; every rank calls it.

    ``chunks``: this rank's model chunks (``DeepSeekModel`` stages): one, or ``V`` for the
    interleaved schedule, chunk ``c`` being model stage ``c * PP + rank``.
    ``microbatches``: the ``M`` microbatches in order (``input_ids`` and ``labels`` on the
    first stage, ``None`` elsewhere; ``sample_ids`` and ``step`` everywhere).
    ``tensor_shape``: the activation ``[s, b, h]`` that crosses stage boundaries.
    Gradients accumulate in the parameters (each loss is divided by ``M``).
    """
    check_schedule_and_mode(schedule, p2p_mode)
    pp = parallel_state.get_size("pp") if parallel_state.is_initialized() else 1
    rank = parallel_state.get_rank_in("pp") if pp > 1 else 0
    pp_ranks = parallel_state.get_group_ranks("pp") if pp > 1 else [0]
    v, m = len(chunks), len(microbatches)
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"{schedule!r} runs one chunk per rank, got {v}; use schedule='interleaved'")
    if schedule == "interleaved" and v < 2:
        raise ValueError("the interleaved schedule needs at least 2 chunks per rank "
                         "(virtual_pipeline_model_parallel_size >= 2)")
    if pp > 1 and tensor_shape is None:
        raise ValueError("tensor_shape ([s, b, h] of the activations between stages) is needed with PP > 1")
    actions = build_schedules(schedule, pp, m, v if schedule == "interleaved" else 1)[rank]
    last_stage = pp * v - 1
    tracer = get_tracer()

    inputs: dict[tuple, torch.Tensor | None] = {}    # (mb, chunk) -> the forward's input
    outputs: dict[tuple, torch.Tensor] = {}          # (mb, chunk) -> output (last stage: loss / M)
    output_grads: dict[tuple, torch.Tensor] = {}     # (mb, chunk) -> gradient received for it
    input_grads: dict[tuple, torch.Tensor] = {}      # (mb, chunk) -> gradient to send back
    labels = {i: mb.labels for i, mb in enumerate(microbatches)}
    unwaited_labels = []  # label isends: waited at the end of the step
    # The interleaved schedule posts each send as soon as its tensor exists and waits
    # for it only at the end (Megatron runs it with overlap_p2p_comm): waiting at once,
    # rank r's send to r + 1 and rank r + 1's send to r (another chunk's tensor) can
    # each wait for a receive the other posts only later.  1F1B and GPipe wait at once.
    unwaited = [] if schedule == "interleaved" else None
    keep_alive = []
    result = StepOutput(actions=len(actions))

    def stage_of(a: Action) -> int:
        return a.stage * pp + rank

    def forward(a: Action) -> None:
        key, mb = (a.microbatch, a.stage), microbatches[a.microbatch]
        if stage_of(a) == last_stage:
            mb = mb._replace(labels=labels[a.microbatch])
        with tracer.tags(microbatch=a.microbatch, chunk=a.stage), \
                tracer.span("forward", microbatch=a.microbatch, chunk=a.stage):
            out = chunks[a.stage].forward_stage(inputs.get(key), mb)
        if stage_of(a) == last_stage:
            result.losses[a.microbatch] = float(out.detach())
            out = out / m
        outputs[key] = out
        result.peak_activations = max(result.peak_activations, len(outputs))

    def backward(a: Action) -> None:
        key = (a.microbatch, a.stage)
        out, inp = outputs.pop(key), inputs.pop(key, None)
        with tracer.tags(microbatch=a.microbatch, chunk=a.stage), \
                tracer.span("backward", microbatch=a.microbatch, chunk=a.stage):
            if stage_of(a) == last_stage:
                torch.autograd.backward(out)
            else:
                torch.autograd.backward(out, grad_tensors=output_grads.pop(key))
        if stage_of(a) > 0:
            input_grads[key] = inp.grad

    def p2p(run: list[Action]) -> None:
        name = helper_name(run)
        send = recv = None
        send_tag = recv_tag = 0
        for a in run:
            key, peer = (a.microbatch, a.stage), pp_ranks[a.peer]
            if a.kind == "send_activation":
                send, send_tag = (outputs[key].detach(), peer), TAGS["activation"]
            elif a.kind == "send_grad":
                send, send_tag = (input_grads.pop(key), peer), TAGS["grad"]
            else:
                recv, recv_tag = (tuple(tensor_shape), dtype, peer), TAGS[PAYLOAD[a.kind]]
        recv_key = (run[-1].microbatch, run[-1].stage)
        with tracer.tags(microbatch=run[0].microbatch, chunk=run[0].stage):
            received = _communicate(name, p2p_mode, send=send, recv=recv, send_tag=send_tag,
                                    recv_tag=recv_tag, unwaited_sends=unwaited)
        if unwaited is not None and send is not None:
            keep_alive.append(send[0])  # the buffer must outlive its isend
        if run[-1].kind == "recv_activation":
            inputs[recv_key] = received.requires_grad_()
        elif run[-1].kind == "recv_grad":
            output_grads[recv_key] = received

    def move_labels(a: Action) -> None:
        peer = pp_ranks[a.peer]
        with tracer.tags(microbatch=a.microbatch, p2p_op=a.kind, p2p_mode="isend"):
            if a.kind == "send_labels":
                unwaited_labels.append(comm.isend(labels[a.microbatch], peer, group="pp",
                                              tag=TAGS["labels"]))
            else:
                s = microbatches[a.microbatch].sample_ids.shape[0]
                buffer = torch.empty((s, tensor_shape[0]), dtype=torch.int64)
                labels[a.microbatch] = comm.recv(buffer, peer, group="pp", tag=TAGS["labels"])

    for step in group_actions(actions, combine=schedule != "gpipe"):
        first = step[0]
        if first.kind == "forward":
            forward(first)
        elif first.kind == "backward":
            backward(first)
        elif first.kind in LABEL_KINDS:
            move_labels(first)
        else:
            p2p(step)
    comm.wait_all(unwaited_labels + (unwaited or []))
    return result


# --- a stage with a known cost, for measuring schedules ------------------------------------


class _Busy(torch.autograd.Function):
    """Identity that takes ``forward_seconds`` forward and ``backward_seconds`` backward."""

    @staticmethod
    def forward(ctx, x, forward_seconds, backward_seconds):
        time.sleep(forward_seconds)
        ctx.backward_seconds = backward_seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_seconds)
        return grad, None, None


class SyntheticStage(torch.nn.Module):
    """A stand-in stage whose forward takes ``forward_seconds`` and backward ``backward_seconds``.

    To see a schedule's bubble, every stage must cost the same, and on a laptop the
    ranks share a few cores, so real layers slow each other down.  This stage waits
    instead of computing (a sleep frees the core), while the executor, the P2P
    messages and the labels are the real ones: the recorded timeline is the
    schedule's, not the CPU scheduler's.  It has one weight so that autograd has a
    backward to run, and the same ``forward_stage`` interface as
    :class:`~tutorial_lib.model.DeepSeekModel`.
    """

    def __init__(self, stage: int, num_stages: int, tensor_shape: tuple,
                 forward_seconds: float = 0.01, backward_seconds: float = 0.02):
        super().__init__()
        self.stage, self.num_stages, self.tensor_shape = stage, num_stages, tuple(tensor_shape)
        self.forward_seconds, self.backward_seconds = forward_seconds, backward_seconds
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward_stage(self, hidden: torch.Tensor | None, batch: Microbatch) -> torch.Tensor:
        x = self.weight.expand(self.tensor_shape) if hidden is None else hidden * self.weight
        y = _Busy.apply(x, self.forward_seconds, self.backward_seconds)
        return y.mean() if self.stage == self.num_stages - 1 else y


def synthetic_microbatches(num_microbatches: int, first_stage: bool, rows: int = 2,
                           seq_length: int = 4) -> list[Microbatch]:
    """``M`` microbatches of zeros for :class:`SyntheticStage` (ids and labels on the first stage only)."""
    out = []
    for i in range(num_microbatches):
        tokens = torch.zeros(rows, seq_length, dtype=torch.int64) if first_stage else None
        out.append(Microbatch(tokens, tokens, torch.arange(i * rows, (i + 1) * rows)))
    return out


def synthetic_run_name(schedule: str, num_microbatches: int, virtual_pipeline_size: int = 1) -> str:
    """The ``run`` tag of one measured schedule: ``"1f1b M=8"``, ``"interleaved M=8 V=2"``."""
    chunks = f" V={virtual_pipeline_size}" if schedule == "interleaved" else ""
    return f"{schedule} M={num_microbatches}{chunks}"


def measure_synthetic_schedules(ctx, runs: list[tuple], forward_seconds: float = 0.01,
                                backward_seconds: float = 0.02, repeats: int = 1,
                                p2p_mode: str | None = None) -> dict:
    """Worker: run each ``(schedule, M, V)`` of ``runs`` on a pure pipeline of :class:`SyntheticStage`.

    Every rank of the launch is one pipeline stage (``PP = world size``).  With ``V``
    chunks a chunk costs ``1/V`` of a stage, so every schedule does the same work.
    One untraced interleaved step first opens every connection (neighbours, the
    wrap-around, the labels); then each run is traced ``repeats`` times, its events
    tagged ``run=synthetic_run_name(schedule, M, V)`` and ``repeat``, with a barrier
    before each step.  ``p2p_mode``: one mode for every run (default: overlapped for the
    interleaved schedule, as Megatron runs it, batched for the others).  Returns
    ``{run name: [the executor's peak_activations, per repeat]}``.
    """
    import torch.distributed as dist

    from .config import ParallelConfig

    pp = ctx.world_size
    parallel_state.initialize_model_parallel(ParallelConfig(pp, pipeline_model_parallel_size=pp))
    rank = parallel_state.get_rank_in("pp")
    shape = (4, 2, 8)  # [s, b, h]: small, the messages cost little next to the stage

    def step(schedule, m, v):
        chunks = [SyntheticStage(c * pp + rank, pp * v, shape, forward_seconds / v,
                                 backward_seconds / v) for c in range(v)]
        mode = p2p_mode or ("overlapped" if schedule == "interleaved" else "batched")
        return forward_backward_pipelining(chunks, synthetic_microbatches(m, rank == 0, shape[1],
                                                                          shape[0]), schedule, mode, shape)

    tracer = get_tracer()
    enabled, tracer.enabled = tracer.enabled, False
    if pp > 1:
        step("interleaved", pp, 2)
    tracer.enabled = enabled
    peaks: dict = {}
    for schedule, m, v in runs:
        for repeat in range(repeats):
            dist.barrier()
            name = synthetic_run_name(schedule, m, v)
            with tracer.tags(run=name, repeat=repeat):
                peaks.setdefault(name, []).append(step(schedule, m, v).peak_activations)
    return peaks
