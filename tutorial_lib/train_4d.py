"""Train the DeepSeek-style model on any valid grid: TP x CP x PP x EP x DP.

``examples/train_4d.py`` is a command line around this module; chapters and tests call
it directly.  One step on every rank::

    global batch (synthetic, from the seed)  -> my DP replica's rows -> M microbatches
        (CP > 1: each row cut to my CP rank's chunks)                 context_parallel.split_for_cp_rank
    pipeline schedule (GPipe / 1F1B / interleaved; ZB-H1 / ZBV / DualPipeV / DualPipe, whose
        backwards split into B and W) over my chunks                 pipeline.forward_backward_pipelining
    DualPipe: each weight's gradient summed with its twin's in the other model copy
                                                                      pipeline.sum_model_copy_gradients
        activations and gradients between stages                     P2P in the chosen mode
        labels from the first stage to the last                      isend / recv
        TP collectives inside each layer, EP all-to-alls in each MoE layer,
        K/V exchanges over CP in each attention (--cp-comm-type)
    gradients: dense over DP (x CP), experts over expert-DP (divided by DP x CP)
                                                                      DataParallel.finish_grad_sync
    router (and, with --sequence-parallel, LayerNorm) gradients summed over TP: each TP rank
        routes (normalises) its own s/TP tokens                      allreduce_sequence_parallel_grads
    TP and EP together: each TP rank's own tokens cross the expert grid's EP all-to-all,
        every routed expert whole on its EP rank (ETP = 1: config rule 5)
    clip by the global norm (reduced over TP, PP, EP)                data_parallel.clip_grad_norm_
    Adam
    expert bias: the step's expert load summed over every rank that routed tokens, then
        each bias moves by gamma towards balance (DeepSeek-V3)       one all-reduce per group
    log: LM loss and aux losses summed over PP, averaged over DP (x CP)  one small all-reduce each

**Layout independence.**  The same arguments give the same model, data and updates on
every grid, so the per-step losses agree with the one-rank run to fp32 rounding:
weights are drawn from seeds of their global layer index (:class:`~tutorial_lib.deepseek.DeepSeekModel`),
the batch from ``(seed, step)``, dropout masks from each row's global index, and the
balancing is DeepSeek-V3's, which has no per-rank term: the sequence-wise loss counts
whole sequences (each sequence lives on one DP replica; under TP its tokens are split
and the counts are summed over TP), and the expert bias moves on the *global* load.
(DeepSeek-V2-style losses computed per microbatch and per rank would change with M
and DP: their means of products are not products of means.)

The logged ``loss`` is the language-model loss alone, the mean over every token of the
global batch; the balance losses are logged under their own keys (:data:`LOG_KEYS` says
what each key means).  Each record is numbered by ``iteration``, the steps done counted
from 1 as Megatron logs them: the step that draws batch ``i`` (trace tag ``step=i``) is
iteration ``i + 1``, and a checkpoint saved after it is ``iter_<i + 1>``.

**Context parallelism** (``context_parallel_size`` C > 1, ``cp_comm_type``): each row of
a microbatch is cut into ``2 C`` chunks and CP rank ``r`` keeps chunks ``r`` and
``2 C - 1 - r`` (ids and labels alike, :func:`tutorial_lib.context_parallel.split_for_cp_rank`),
so every stage holds ``[s / C, b, h]``.  Each rank's loss is the mean over its own tokens,
and the dense gradients are summed over the ``dp_cp`` group and divided by its size
``DP x C``: the mean of the CP ranks' means, which is the sequence's mean because every CP
rank holds as many tokens (Megatron-Core's ``DistributedDataParallel`` scales by ``1 /
dp_cp`` size the same way).  The MoE balance losses are whole-sequence values on every CP
rank whose gradient covers the rank's own tokens; the ``dp_cp`` average would divide their
sum by C, so their gradient is scaled by ``C / M`` instead of ``1 / M``, as Megatron's
``forward_step_calc_loss`` sets ``MoEAuxLossAutoScaler``'s scale.  Routed experts see each
CP rank's tokens through the EP all-to-all, and the expert grid folds CP into expert-DP as
Megatron's does (:func:`tutorial_lib.grid.megatron_grids`).

**Sequence parallelism** (``sequence_parallel``, Megatron's ``--sequence-parallel``; TP > 1):
every layer works on this TP rank's ``s / TP`` tokens (:class:`~tutorial_lib.deepseek.DeepSeekModel`),
so the activations between stages are ``[s / (C TP), b, h]`` (:func:`pipeline_tensor_shape`)
and the LayerNorm gradients join the router's in the sum over TP.  In fp32 the losses are
the same as without it.  Under a precision recipe the column-parallel layers' two backward
matmuls run unrounded (:class:`~tutorial_lib.tensor_parallel.LinearWithSequenceParallelAllGather`
rounds only its forward), so from the second step the losses differ from the run without
sequence parallelism by about as much as layouts do (measured at TP 2, 2 layers, 3 steps:
2.6e-5 with bf16, 3.1e-4 with deepseek_v3).

**Precision.**  ``precision_recipe`` (``fp32``, ``bf16``, ``deepseek_v3`` or a recipe file)
is applied to every model chunk by :func:`tutorial_lib.precision.apply_recipe`: simulated
BF16 / FP8 matmuls and the MoE dispatch / combine precisions (chapter 8).  The default,
``fp32``, applies nothing.  Module names carry global layer indices, so a rule such as
``layers.0.*`` means the same layer on every grid.  Layout independence then holds to
rounding only while the weights are equal: the first step's loss matches the one-rank run
(except FP8 with TP > 1, where each weight shard gets its own scale); after an update the
fp32 rounding of the gradient sums differs by layout, a BF16 / FP8 rounding flips here and
there, and the losses drift apart by about 1e-4 (bf16) to 1e-3 (deepseek_v3) in 5 steps.

**ZeRO-1** (``use_distributed_optimizer``, Megatron's ``--use-distributed-optimizer``): the
model is not wrapped in :class:`~tutorial_lib.data_parallel.DataParallel`; a
:class:`~tutorial_lib.data_parallel.DistributedOptimizer` reduce-scatters each gradient
domain over its own group (dense over ``dp``, routed experts over ``expert_dp``, both
divided by the dense DP size), clips, updates its slice with Adam and all-gathers the
parameters.  The losses are plain Adam's to fp32 rounding on every layout.

**ZeRO-2** (``data_parallel_sharding_strategy="optim_grads"``, Megatron-FSDP's name): each
chunk's decoder layers are units of :mod:`tutorial_lib.fully_sharded_data_parallel`, one
per gradient domain (a MoE layer's routed experts apart, sharded over ``expert_dp``),
beside a root unit of the rank's other parameters.  Each unit's gradients are
reduce-scattered from the gradient hooks as soon as a microbatch's backward through it
ends, added into its fp32 slice and freed (FSDP2's default under gradient accumulation);
the step clips the slices by the global norm, updates them with Adam and all-gathers each
unit's weights.  The losses are plain Adam's to fp32 rounding on every layout.

**ZeRO-3** (``optim_grads_params``): the same units, whose weights exist only as slices
between uses.  The executor calls each layer module, so the units' hooks gather a layer
before every microbatch's forward through it and free it after; the backward gathers it
again through a hook on the block's output and frees it once its gradients are in.  The
root unit is gathered by its modules' hooks (embedding, final LayerNorm, output layer)
and kept until its backward.  Each microbatch's forward runs a chunk's layers in order and
its backward in reverse, so the next layer's all-gather is prefetched under this one's
compute (forward), and the previous layer's (backward), within the chunk (trace tag
``prefetch=True``).  Not with chapter 11's split backwards (B and
W are separate passes) nor with recomputation (the recomputed forward would free the
weights its backward needs): :func:`tutorial_lib.arguments.validate_args`.

**Activation recomputation** (``recompute_granularity``, ``recompute_method``,
``recompute_num_layers``, Megatron's flags): each chunk recomputes the layers or the core
attention :mod:`tutorial_lib.recompute` says, in backward; the losses and gradients are
the same, less is kept between forward and backward, and the recomputed forward's
collectives appear a second time in the trace (tagged ``recompute=True``).

**Checkpoints** (``save``, ``save_interval``, ``load``, ``ckpt_step``): after every
``save_interval`` steps and after the last, every rank writes its pieces of the model, of
Adam's state (ZeRO-1 gathers its slices back per parameter), of the expert biases and its
RNG state with ``torch.distributed.checkpoint`` under global names; ``common.json`` holds
the iteration (the data position: step ``i`` draws its batch from ``(seed, i)``).  A run
with ``load`` starts at the checkpoint's iteration and trains up to ``steps``: on the same
layout the losses are the uninterrupted run's bit for bit, on any other layout (or with
the other optimizer) to fp32 rounding.  :mod:`tutorial_lib.checkpointing` (names, the
atomic commit, the checks) and :mod:`tutorial_lib.dist_checkpointing` (the DCP calls).
"""
from __future__ import annotations

import json
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import replace

import torch

from . import checkpointing, comm, parallel_state, precision
from .arguments import (CONFIG_FIELDS, DEVICES, LOG_KEYS, RUN_DEFAULTS, TrainingArgs, args_from_dict,
                        check_memory, describe_run, load_config_file, resolve_precision_recipe,
                        validate_args)
from .data import split_global_batch, split_microbatches, synthetic_batch
from .context_parallel import split_for_cp_rank
from .data_parallel import DataParallel, DistributedOptimizer
from .deepseek import DeepSeekModel, Microbatch
from .fully_sharded_data_parallel import FullyShardedDataParallel, FullyShardedOptimizer
from .devices import synchronize
from .memory import measure_state_bytes
from .moe_balance import max_violation, update_expert_bias
from .pipeline_parallel.actions import SCHEDULE_PLACEMENT
from .pipeline_parallel.dualpipe import mark_model_copies, sum_model_copy_gradients
from .pipeline_parallel.executor import forward_backward_pipelining
from .pipeline_parallel.actions import model_stage, num_model_stages
from .tp_dp_step import finish_step
from .trace import get_tracer

__all__ = ["CONFIG_FIELDS", "RUN_DEFAULTS", "TrainingArgs", "validate_args", "args_from_dict",
           "load_config_file", "check_memory", "describe_run", "LOG_KEYS", "build_chunks",
           "train_worker", "train", "format_progress", "format_saved",
           "write_progress", "read_progress", "moe_aux_loss_scale", "pipeline_tensor_shape",
           "StopRequest",
           "DIE_AFTER_ENV"]

# TrainingArgs, validate_args and the config file live in tutorial_lib.arguments, without
# torch, so that examples/train_4d.py refuses a bad value before it loads torch; they are
# imported above and belong to this module's API as well.


def build_chunks(args: TrainingArgs, device=None) -> list[DeepSeekModel]:
    """This rank's model chunks on ``device``: chunk ``c`` is model stage ``c * PP + pp_rank``
    (chapter 11's V: stages ``pp_rank`` and ``2 PP - 1 - pp_rank``; DualPipe: stage
    ``pp_rank`` of copy 0 and ``PP - 1 - pp_rank`` of copy 1, each copy the whole model
    with the same weights)."""
    _, model, _ = args.configs()
    pp, v = args.pipeline_model_parallel_size, args.chunks_per_rank
    rank = parallel_state.group_rank("pp")
    placement = SCHEDULE_PLACEMENT.get(args.schedule, "loop")  # chapter 11: a V, two copies
    chunks = [DeepSeekModel(model, stage=model_stage(placement, rank, c, pp),
                            num_stages=num_model_stages(placement, pp, v), seed=args.seed,
                            device=device, recompute=args.recompute)
              for c in range(v)]
    if placement == "dual":
        mark_model_copies(chunks)
    if args.precision_recipe != "fp32":  # fp32: the model exactly as built
        recipe = resolve_precision_recipe(args.precision_recipe)
        for chunk in chunks:
            precision.apply_recipe(chunk, recipe)
    return chunks


def _microbatches(args: TrainingArgs, step: int, first_stage: bool, device) -> list[Microbatch]:
    """My replica's microbatches of this step on ``device``; ids and labels only on the first
    stage."""
    input_ids, labels = synthetic_batch(args.seed, step, args.global_batch_size, args.seq_length,
                                        args.vocab_size, device=device)
    rows = torch.arange(args.global_batch_size, device=device)  # each row's global index
    mine = split_global_batch((input_ids, labels, rows), parallel_state.get_rank_in("dp"),
                              parallel_state.get_size("dp"))
    cp = parallel_state.get_size("cp")
    if cp > 1:  # my CP rank's chunks of every row (Megatron's get_batch_on_this_cp_rank)
        cp_rank = parallel_state.get_rank_in("cp")
        mine = tuple(split_for_cp_rank(t, 1, cp, cp_rank) for t in mine[:2]) + mine[2:]
    return [Microbatch(ids if first_stage else None, targets if first_stage else None, sample_ids, step)
            for ids, targets, sample_ids in split_microbatches(mine, args.num_microbatches)]


def pipeline_tensor_shape(args: TrainingArgs, rows: int) -> tuple[int, int, int]:
    """``[s, b, h]`` of the activation that crosses a stage boundary: this CP rank's
    ``s / CP`` tokens of ``rows`` sequences, split over TP under sequence parallelism
    (Megatron-Core's ``get_tensor_shapes`` and ``forward_backward_pipelining_with_interleaving``,
    ``megatron/core/pipeline_parallel/schedules.py`` at d98e8a64: ``seq_length // cp``,
    then ``// tp`` when ``config.sequence_parallel``).  The labels the first stage sends the
    last keep ``s / CP`` tokens a row whatever the TP size."""
    tokens = args.seq_length // args.context_parallel_size
    if args.sequence_parallel:
        tokens //= args.tensor_model_parallel_size
    return tokens, rows, args.hidden_size


def moe_aux_loss_scale(num_microbatches: int, context_parallel_size: int = 1) -> float:
    """What each MoE balance loss's gradient is scaled by: ``C / M``.

    ``1 / M`` averages the ``M`` microbatches like the LM loss.  Under context parallelism
    each CP rank backpropagates its own tokens' part of the whole-sequence balance loss,
    and the ``dp_cp`` gradient average divides the parts' sum by ``C``: the factor ``C``
    undoes that (Megatron-Core 0.20.0, d98e8a64, ``schedules.forward_step_calc_loss``: the
    aux-loss scale is ``loss_scale * cp_group_size / num_microbatches``).
    """
    return context_parallel_size / num_microbatches


def _sum_over(tensor: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if parallel_state.get_size(group) > 1:
            comm.all_reduce(tensor, group=group)
    return tensor


def _update_expert_biases(chunks: list[DeepSeekModel], args: TrainingArgs) -> list[float]:
    """V3's bias step on the global load of each of my MoE layers; returns their MaxVio."""
    layers = [(chunk.expert_loads[i], layer) for chunk in chunks for i, layer in chunk.moe_layers().items()]
    if not layers:
        return []
    loads = torch.stack([load for load, _ in layers])               # [my MoE layers, N]
    groups = ["dp_cp"] + (["tp"] if args.tensor_model_parallel_size > 1 else [])
    with get_tracer().tags(phase="expert_bias"):
        _sum_over(loads, groups)  # every rank that routed its own tokens
    violations = []
    for load, (_, layer) in zip(loads, layers):
        update_expert_bias(layer.router.expert_bias, load, layer.balance.gamma)
        violations.append(max_violation(load))
    return violations


def _data_parallel(args: TrainingArgs, chunks, modules, dense_group: str):
    """``(model, optimizer, sync)`` for the run's sharding strategy
    (:attr:`~tutorial_lib.arguments.TrainingArgs.zero_stage`); ``sync``: ``model`` is a
    :class:`~tutorial_lib.data_parallel.DataParallel` whose all-reduce waits for the last
    microbatch (``no_sync`` around the schedule).

    ZeRO 0: ``DataParallel`` (when a domain has replicas) and Adam; ZeRO-1: the bare
    chunks and a :class:`~tutorial_lib.data_parallel.DistributedOptimizer` that
    reduce-scatters in its step; ZeRO-2: the chunks sharded in place, one unit per decoder
    layer and gradient domain plus the root
    (:class:`~tutorial_lib.fully_sharded_data_parallel.FullyShardedDataParallel`), their
    reduce-scatters issued from the gradient hooks in every microbatch's backward, and a
    :class:`~tutorial_lib.fully_sharded_data_parallel.FullyShardedOptimizer`; ZeRO-3 the
    same units, each gathered by its module's hooks before every microbatch's forward and
    backward and freed after (the root, kept from its first forward to its backward, by
    the hooks of the embedding, final LayerNorm and output layer), the next layer of the
    chunk prefetched in the forward and the previous one in the backward.
    """
    stage = args.zero_stage
    if stage >= 2:
        units = [layer for chunk in chunks for layer in chunk.layers.values()]
        roots = [getattr(chunk, name) for chunk in chunks  # what gathers the root (ZeRO-3)
                 for name in ("embedding", "final_layernorm", "output_layer")
                 if getattr(chunk, name, None) is not None]
        fsdp = FullyShardedDataParallel(modules, units, args.sharding_strategy, prefetch=True,
                                        group=dense_group, root_modules=roots,
                                        chunks=[list(chunk.layers.values()) for chunk in chunks])
        return modules, FullyShardedOptimizer(fsdp, torch.optim.Adam, lr=args.lr), False
    if stage == 1:
        return modules, DistributedOptimizer(modules.parameters(), torch.optim.Adam,
                                             group=dense_group, lr=args.lr), False
    sync = (parallel_state.get_size(dense_group) > 1
            or parallel_state.get_size("expert_dp") > 1)
    model = DataParallel(modules, group=dense_group) if sync else modules
    return model, torch.optim.Adam(modules.parameters(), lr=args.lr), sync


def _measured_memory(modules, optimizer, out, device) -> dict:
    """This rank's bytes after the step (chapter 10): weights, gradients and optimizer state
    from the tensors, the saved activations per ``"microbatch,chunk"`` and their peak from
    the executor, and on CUDA the allocator's peak."""
    measured = measure_state_bytes(modules, optimizer)
    measured["activations_per_microbatch"] = {f"{i},{c}": n for (i, c), n in
                                              sorted(out.activation_bytes.items())}
    measured["peak_activations"] = out.peak_activation_bytes
    if torch.device(device).type == "cuda":
        measured["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    return measured


DIE_AFTER_ENV = "TUTORIAL_LIB_DIE_AFTER"
"""Test hook: ``"RANK:ITERATION:MARKER"`` makes that rank kill itself with ``SIGKILL`` after
that iteration (and its save), once: it first creates the file ``MARKER``, and does nothing
when the file is there (so the restarted world trains on)."""


def _die_if_asked(rank: int, iteration: int) -> None:
    asked = os.environ.get(DIE_AFTER_ENV)
    if not asked:
        return
    who, when, marker = asked.split(":", 2)
    if (int(who), int(when)) == (rank, iteration) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


class StopRequest:
    """A request to stop training at the end of the current step: ``SIGTERM`` to this process
    (what a scheduler sends before it preempts a job; torchrun passes it on to its workers),
    or the file ``stop_file`` (what ``examples/train_4d.py`` writes when it gets one).
    Megatron-LM's ``--exit-signal-handler`` is the same idea: every rank checks, the ranks
    agree (one all-reduce per step), then save and exit."""

    def __init__(self, stop_file: str | None = None):
        self.stop_file = stop_file
        self.received = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def __call__(self) -> bool:
        return self.received or bool(self.stop_file and os.path.exists(self.stop_file))


def _agreed(flag: bool, device) -> bool:
    """True on every rank when it is true on any (not traced: not part of the step)."""
    import torch.distributed as dist
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def train_worker(ctx, args: TrainingArgs, on_step=None, on_save=None, stop=None) -> list[dict]:
    """Train on this rank; every rank returns the same per-step records but for ``memory``,
    its own.

    ``on_step(record)`` is called on every rank after each step (rank 0 prints);
    ``on_save(iteration, directory)`` after each checkpoint is committed.  Records are
    numbered by ``iteration`` (from 1); with ``args.load`` they start at the iteration
    after the checkpoint's.  Every tensor lives on ``ctx.device`` (a GPU under NCCL).
    ``stop``: a :class:`StopRequest` (or any callable) asked after each step; when it is
    true on some rank, every rank saves (with ``args.save``) and returns the records so far.
    With ``args.async_save`` a save is written in the background and committed at the next
    save or at the end.
    """
    parallel, _, _ = args.configs()
    parallel.world_size = ctx.world_size
    parallel_state.initialize_model_parallel(parallel)
    tracer = get_tracer()
    torch.manual_seed(args.seed)
    device = ctx.device
    chunks = build_chunks(args, device)
    modules = torch.nn.ModuleList(chunks)
    cp = parallel_state.get_size("cp")
    dense_group = "dp_cp" if cp > 1 else "dp"  # the dense weights' replicas: DP, times CP
    model, optimizer, sync = _data_parallel(args, chunks, modules, dense_group)
    first_step = 0
    if args.load:  # imported here: DCP and DTensor cost every worker ~0.6 s to import
        from .dist_checkpointing import load_checkpoint
        first_step = load_checkpoint(args.load, chunks, optimizer, args, args.ckpt_step)
    m, dp = args.num_microbatches, parallel_state.get_size("dp")
    rows = args.global_batch_size // dp // m
    shape = pipeline_tensor_shape(args, rows)
    records = []
    pending = None  # an asynchronous save still being written

    def finish(save) -> None:
        if save is not None:
            directory = save.finish()
            if on_save is not None:
                on_save(save.iteration, directory)
    for step in range(first_step, args.steps):
        started = time.perf_counter()
        model.zero_grad()
        optimizer.zero_grad()
        for chunk in chunks:
            chunk.reset_step_stats()
            chunk.aux_loss_scale = moe_aux_loss_scale(m, cp)
        with tracer.tags(step=step):
            with model.no_sync() if sync else nullcontext():  # sync once, after the last backward
                first_stage = any(chunk.pre_process for chunk in chunks)  # DualPipe: 2 ends
                out = forward_backward_pipelining(
                    chunks, _microbatches(args, step, first_stage, device), args.schedule,
                    args.p2p_mode, shape, device=device, label_length=args.seq_length // cp)
            if args.schedule == "dualpipe":  # the two copies' gradients and loads, summed
                sum_model_copy_gradients(chunks)
            grad_norm = finish_step(model, optimizer, args.clip_grad if args.clip_grad > 0 else None)
            violations = _update_expert_biases(chunks, args)
            # the log: LM loss (last stage), aux losses and MaxVio (every stage), over PP then
            # DP (x CP: the CP ranks' LM losses are means over their tokens, the rest equal)
            aux_names = ["sequence"]
            local = [sum(out.losses.values()) / m]
            local += [sum(c.aux_loss_sums.get(name, 0.0) for c in chunks) / m for name in aux_names]
            local += [sum(violations), len(violations)]
            logged = torch.tensor(local, dtype=torch.float64, device=device)
            with tracer.tags(phase="logging"):
                _sum_over(logged, ["pp"])
                _sum_over(logged, [dense_group])
            logged /= dp * cp  # the replicas' mean (MaxVio and the layer count are equal on all)
        synchronize(device)  # on a GPU: the step's work done, not just queued
        elapsed = time.perf_counter() - started
        record = {"iteration": step + 1, "loss": float(logged[0])}
        if args.num_experts:
            record.update({f"{name}_balance_loss": float(logged[1 + i]) for i, name in enumerate(aux_names)})
            layers = float(logged[-1])
            record["max_violation"] = float(logged[-2]) / layers if layers else 0.0
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        record.update({"step_time_s": elapsed,
                       "tokens_per_s": args.global_batch_size * args.seq_length / elapsed,
                       "peak_activations": out.peak_activations,
                       "memory": _measured_memory(modules, optimizer, out, device)})
        records.append(record)
        if on_step is not None:
            on_step(record)
        stopping = stop is not None and _agreed(stop(), device)
        if args.save and (stopping or checkpointing.is_save_iteration(step + 1, args.steps, args.save,
                                                                      args.save_interval)):
            from .dist_checkpointing import start_save
            finish(pending)  # the save before: written by now, committed here
            pending = start_save(args.save, step + 1, chunks, optimizer, args,
                                 async_save=args.async_save and not stopping)
            if not args.async_save or stopping:
                finish(pending)
                pending = None
        _die_if_asked(ctx.rank, step + 1)
        if stopping:
            break
    finish(pending)
    return records


def format_progress(record: dict, steps: int) -> str:
    """One human line per step: ``iteration 3/10  loss 3.9512  ...``, numbered like the
    record's ``iteration`` (what ``--json`` prints)."""
    parts = [f"iteration {record['iteration']}/{steps}", f"loss {record['loss']:.4f}"]
    if "sequence_balance_loss" in record:
        parts.append(f"seq-balance {record['sequence_balance_loss']:.2e}")
        parts.append(f"MaxVio {record['max_violation']:.3f}")
    if "grad_norm" in record:
        parts.append(f"grad-norm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    return "  ".join(parts)


def _print_on_rank_0(ctx, args):
    def on_step(record):
        if ctx.rank == 0:
            print(format_progress(record, args.steps), flush=True)
    return on_step


def format_saved(iteration: int, directory: str) -> str:
    """The line printed when a checkpoint is committed."""
    return f"saved checkpoint of iteration {iteration} to {directory}"


def _print_saved_on_rank_0(ctx):
    def on_save(iteration, directory):
        if ctx.rank == 0:
            print(format_saved(iteration, directory), flush=True)
    return on_save


def write_progress(path: str, record: dict) -> None:
    """Append ``record`` to ``path`` as one JSON line (rank 0, after each step): what
    ``examples/train_4d.py`` reports when interrupted, and the records of a world that died
    before it returned them (:func:`read_progress`)."""
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def read_progress(path: str) -> dict[int, dict]:
    """The records :func:`write_progress` appended, by iteration (a later one of the same
    iteration, from a restarted world, wins); a line cut by a kill is skipped."""
    records = {}
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        records[record["iteration"]] = record
    return records


def train(args: TrainingArgs, progress: bool = False, trace: bool = False,
          progress_file: str | None = None, stop_file: str | None = None, **launch_kwargs):
    """Validate, launch ``args.world_size`` gloo/NCCL workers, train; returns the ``LaunchResult``.

    ``result.results[0]`` is the list of per-step records.  Raises :class:`ConfigError`
    before starting anything when the grid or the batch breaks a rule, or when
    ``args.device`` is ``cuda`` and this machine has fewer GPUs than ranks.  ``progress_file``:
    rank 0 appends each step's record there (:func:`write_progress`).  ``stop_file``: the
    workers stop at the end of the step during which this file appears (or they get
    ``SIGTERM``), saving first (:class:`StopRequest`).
    """
    from .launch import launch
    validate_args(args)
    # the workers fork from a long-lived server whose working directory may not be ours
    args = replace(args, **{name: os.path.abspath(getattr(args, name)) for name in ("save", "load")
                            if getattr(args, name)})
    launch_kwargs.setdefault("timeout", args.timeout)
    launch_kwargs.setdefault("backend", DEVICES[args.device])
    return launch(_worker, args.world_size, args=(args, progress, progress_file, stop_file),
                  trace=trace, print_output=progress, **launch_kwargs)


def _worker(ctx, args, progress, progress_file=None, stop_file=None):
    printer = _print_on_rank_0(ctx, args) if progress else None

    def on_step(record):
        if printer is not None:
            printer(record)
        if progress_file and ctx.rank == 0:
            write_progress(progress_file, record)
    stop = StopRequest(stop_file) if stop_file else None
    return train_worker(ctx, args, on_step, _print_saved_on_rank_0(ctx) if progress else None, stop)
