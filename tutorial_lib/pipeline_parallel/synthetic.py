"""A stage with a known cost, to measure a schedule's bubble with real processes.

:class:`SyntheticStage` waits instead of computing; :func:`measure_synthetic_schedules`
(a worker) runs schedules on a pipeline of them through the real executor, P2P
messages and labels, so the recorded timeline is the schedule's (chapters 6 and 11).
"""
from __future__ import annotations

import time

import torch

from .. import parallel_state
from ..deepseek import Microbatch
from ..devices import resolve_device
from ..trace import get_tracer
from .actions import SCHEDULE_PLACEMENT, TWO_CHUNK_SCHEDULES, model_stage, num_model_stages
from .executor import forward_backward_pipelining

class _Busy(torch.autograd.Function):
    """Identity taking ``forward_seconds`` forward and ``backward_seconds`` backward."""

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
    """A stand-in for model stage ``stage`` of ``num_stages``: its forward takes
    ``forward_seconds``, its backward ``backward_seconds``, of which ``weight_seconds``
    are the weight gradient (W) and the rest the input gradient (B).

    To see a schedule's bubble, every stage must cost the same, and on a laptop the
    ranks share a few cores, so real layers slow each other down.  This stage waits
    instead of computing (a sleep frees the core), while the executor, the P2P
    messages and the labels are the real ones: the recorded timeline is the
    schedule's, not the CPU scheduler's.  It has one weight so that autograd has a
    backward to run, and the same ``forward_stage`` interface as
    :class:`~tutorial_lib.deepseek.DeepSeekModel`.  The input's path waits in the
    backward of an identity on the activation, the weight's path in the backward of an
    identity on the weight: :func:`~.backward_split.backward_input` runs only the first,
    :func:`~.backward_split.backward_weight` only the second (on the first stage, which has no input
    gradient, W runs both).  ``ep_group`` (of more than one rank): halfway through the
    forward, a dispatch and a combine all-to-all over it, as a MoE layer's (their
    reverses halfway through B): what DualPipe's overlapped pairs hide.
    """

    def __init__(self, stage: int, num_stages: int, tensor_shape: tuple,
                 forward_seconds: float = 0.01, backward_seconds: float = 0.02,
                 weight_seconds: float = 0.0, ep_group: str | None = None, device=None):
        super().__init__()
        self.ep_group = ep_group
        if not 0 <= weight_seconds <= backward_seconds:
            raise ValueError(f"weight_seconds ({weight_seconds}) is part of the backward: "
                             f"it must be in 0..backward_seconds ({backward_seconds})")
        self.stage, self.num_stages = stage, num_stages
        self.tensor_shape = tuple(tensor_shape)
        self.forward_seconds, self.backward_seconds = forward_seconds, backward_seconds
        self.weight_seconds = weight_seconds
        self.weight = torch.nn.Parameter(torch.ones((), device=resolve_device(device)))

    def forward_stage(self, hidden: torch.Tensor | None,
                      batch: Microbatch) -> torch.Tensor:
        weight = _Busy.apply(self.weight, 0.0, self.weight_seconds)
        if hidden is None:
            x = weight.expand(self.tensor_shape)
        else:
            x = hidden * weight
        forward, backward = self.forward_seconds, self.backward_seconds - self.weight_seconds
        if parallel_state.group_size(self.ep_group) > 1:  # a MoE layer's two all-to-alls
            x = _Busy.apply(x, forward / 2, backward / 2)
            x = self._exchange(self._exchange(x, "dispatch"), "combine")
            y = _Busy.apply(x, forward / 2, backward / 2)
        else:
            y = _Busy.apply(x, forward, backward)
        return y.mean() if self.stage == self.num_stages - 1 else y

    def _exchange(self, x: torch.Tensor, op_name: str) -> torch.Tensor:
        """An all-to-all over ``ep_group`` that swaps equal shares of the rows (its
        backward: the reverse one), as a MoE layer's dispatch and combine."""
        from ..moe import all_to_all
        n = parallel_state.group_size(self.ep_group)
        rows = x.reshape(-1, x.shape[-1])
        splits = [rows.shape[0] // n] * n
        return all_to_all(rows, self.ep_group, splits, splits, op_name).view_as(x)


def synthetic_microbatches(num_microbatches: int, first_stage: bool, rows: int = 2,
                           seq_length: int = 4, device=None) -> list[Microbatch]:
    """``M`` microbatches of zeros for :class:`SyntheticStage` (ids and labels on the
    first stage only), on ``device`` (``None``: torch's default device)."""
    device = resolve_device(device)
    out = []
    for i in range(num_microbatches):
        tokens = (torch.zeros(rows, seq_length, dtype=torch.int64, device=device)
                  if first_stage else None)
        out.append(Microbatch(tokens, tokens,
                              torch.arange(i * rows, (i + 1) * rows, device=device)))
    return out


def synthetic_run_name(schedule: str, num_microbatches: int,
                       virtual_pipeline_size: int = 1) -> str:
    """A measured schedule's ``run`` tag: ``"1f1b M=8"``, ``"interleaved M=8 V=2"``."""
    chunks = f" V={virtual_pipeline_size}" if schedule == "interleaved" else ""
    return f"{schedule} M={num_microbatches}{chunks}"


def synthetic_chunks(schedule: str, rank: int, pp: int, tensor_shape: tuple,
                     forward_seconds: float, backward_seconds: float,
                     weight_seconds: float | None = None, virtual_pipeline_size: int = 1,
                     ep_group: str | None = None, device=None) -> list[SyntheticStage]:
    """Pipeline rank ``rank``'s :class:`SyntheticStage` chunks for ``schedule``, placed as
    the schedule places its stages (:func:`~.actions.model_stage`).

    The costs are one stage's (``PP`` ranks each running ``1 / PP`` of the model): a
    chunk of ``V`` per rank (interleaved: ``V``; ZBV and DualPipeV: 2) costs ``1/V`` of
    them, a chunk of DualPipe (a whole stage of one of its two model copies) all of them.
    ``weight_seconds``: the W part of the backward (``None``: half of it, the course's
    costs ``F 1, B 2, W 1``).
    """
    v = 2 if schedule in TWO_CHUNK_SCHEDULES else virtual_pipeline_size
    placement = SCHEDULE_PLACEMENT.get(schedule, "loop")
    stages = num_model_stages(placement, pp, v)
    scale = pp / stages  # the share of one of PP stages' work each chunk runs
    weight = backward_seconds / 2 if weight_seconds is None else weight_seconds
    return [SyntheticStage(model_stage(placement, rank, c, pp), stages, tensor_shape,
                           forward_seconds * scale, backward_seconds * scale, weight * scale,
                           ep_group=ep_group, device=device)
            for c in range(v)]


def measure_synthetic_schedules(ctx, runs: list[tuple], forward_seconds: float = 0.01,
                                backward_seconds: float = 0.02, repeats: int = 1,
                                p2p_mode: str | None = None,
                                weight_seconds: float | None = None,
                                expert_parallel_size: int = 1) -> dict:
    """Worker: run each ``(schedule, M, V)`` of ``runs`` on a pure pipeline of
    :class:`SyntheticStage`.

    Every rank of the launch is one pipeline stage (``PP = world size``; with
    ``expert_parallel_size = E > 1``, ``PP = world size / E`` and ``E`` pipelines side by
    side, data-parallel, whose stages exchange rows with two all-to-alls over the EP
    group in every forward and B, as a MoE layer: :class:`SyntheticStage`).  With ``V``
    chunks a chunk costs ``1/V`` of a stage, so every schedule does the same work
    (:func:`synthetic_chunks`; ZBV and DualPipeV have 2 chunks in a V, DualPipe two model
    copies of ``PP`` stages: ``V`` is ignored for them).  ``weight_seconds``: the W part
    of ``backward_seconds`` where a schedule splits the backward (``None``: half).
    One untraced interleaved step first opens every connection (neighbours, the
    wrap-around, the labels); then each run is traced ``repeats`` times, its events
    tagged ``run=synthetic_run_name(schedule, M, V)`` and ``repeat``, with a barrier
    before each step.  ``p2p_mode``: one mode for every run (default: overlapped for the
    interleaved schedule, as Megatron runs it, batched for the others).  Returns
    ``{run name: [the executor's peak_activations, per repeat]}``; with ``trace=True``
    the launch's trace holds every run's compute spans, named by their action's kind
    (``forward``, ``backward``: B, tagged ``part="input"``, where the schedule splits
    it, ``weight``: W) and tagged ``microbatch`` and ``chunk``, and its messages.
    """
    import torch.distributed as dist

    from ..config import ParallelConfig

    ep = expert_parallel_size
    pp = ctx.world_size // ep
    config = ParallelConfig(ctx.world_size, pipeline_model_parallel_size=pp,
                            expert_model_parallel_size=ep)
    parallel_state.initialize_model_parallel(config)
    rank = parallel_state.get_rank_in("pp")
    shape = (4, 2, 8)  # [s, b, h]: small, the messages cost little next to the stage

    def step(schedule, m, v):
        chunks = synthetic_chunks(schedule, rank, pp, shape, forward_seconds,
                                  backward_seconds, weight_seconds, v,
                                  "ep" if ep > 1 else None, ctx.device)
        mode = p2p_mode or ("overlapped" if schedule == "interleaved" else "batched")
        first = any(c.stage == 0 for c in chunks)  # DualPipe: both ends read a batch
        microbatches = synthetic_microbatches(m, first, shape[1], shape[0], ctx.device)
        return forward_backward_pipelining(chunks, microbatches, schedule, mode, shape)

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
