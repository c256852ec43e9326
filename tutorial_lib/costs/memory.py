"""Memory per rank of a 4D training run (``tutorial_lib.train_4d``), estimated before it starts.

A rough estimate, made to refuse a layout that cannot fit before any worker starts (an
allocator error a minute into a run teaches nothing).  Everything is fp32 (4 bytes), as in
the course's runs; each rank holds

* **weights**: its parameters, counted layer by layer from the model's shapes (TP splits
  attention, dense MLPs, embedding and LM head; EP splits the routed experts, ETP each
  expert; LayerNorms, routers, shared experts and row-parallel biases are whole on every
  rank);
* **gradients**: one ``.grad`` per parameter, plus the data-parallel bucket buffer
  (``DataParallel``'s ``main_grad``) when DP or expert-DP is > 1;
* **optimizer**: Adam's two moments, ``exp_avg`` and ``exp_avg_sq``;
* **activations**: what autograd keeps for backward in one layer for one microbatch, times
  the layers of a chunk, times the chunk-microbatches the schedule holds at its peak
  (:func:`tutorial_lib.pipeline_schedules.expected_peak_activations`), plus the last
  stage's logits; with context parallelism on this CP rank's ``s / CP`` tokens.  Per layer, in values: LayerNorm inputs and outputs, the TP shard of
  qkv and of the attention output, the attention probabilities ``heads/TP x s x s`` per
  sequence (the CPU attention keeps them), the dense MLP's two ``ffn/TP`` tensors, and for
  an MoE layer the routed copies (``K`` per token on its ``s/TP`` tokens) with their
  expert intermediates, the router scores and the shared experts' intermediates;
* **runtime**: a worker process with torch loaded and a gloo group joined,
  :data:`RUNTIME_BYTES_PER_RANK`.

Megatron-LM makes the same kind of estimate before it trains
(``megatron/training/theoretical_memory_usage.py``, ``report_theoretical_memory``;
Megatron-Core 0.20.0): 18 bytes per parameter in mixed precision (bf16 weight, fp32
gradient, fp32 master copy, two fp32 Adam moments), and activations per layer from
Korthikanti et al. (2022).  In fp32, as here, a parameter costs 16 bytes (20 with the
data-parallel bucket), and the activations are counted from this course's own layers.

Left out: the full master tensors each rank draws once while building the model and
then slices (freed before training starts), allocator slack, the traces.  The numbers are
meant to be right to within a factor of about two, which is enough to refuse a layout
that needs ten times the machine.  No torch here: a command line calls this before it
loads torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..pipeline_schedules import expected_peak_activations

__all__ = ["BYTES_PER_VALUE", "RUNTIME_BYTES_PER_RANK", "RankMemory", "layer_parameters",
           "memory_per_rank", "memory_on_this_machine", "available_memory_bytes",
           "format_bytes"]

BYTES_PER_VALUE = 4
"""fp32: weights, gradients, Adam's moments and activations alike."""

RUNTIME_BYTES_PER_RANK = 200 * 2**20
"""A worker before it builds its model: Python, torch, the library and a gloo process group.
Measured: a worker started by :func:`tutorial_lib.launch.launch` holds about 214 MiB of
private memory (``RssAnon`` in ``/proc/self/status``; torch 2.13, Python 3.11) before it
builds its model, some of it shared copy-on-write with the process it was forked from."""


@dataclass(frozen=True)
class RankMemory:
    """The estimate for the ranks of one pipeline rank (TP, EP and DP ranks hold the same)."""

    pipeline_rank: int
    ranks: int
    """How many ranks of the world are this pipeline rank (world / PP)."""
    parameters: int
    """Parameters one of these ranks holds."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    chunk_microbatches: int
    """Chunk-microbatches whose activations are held at the peak."""
    runtime: int = RUNTIME_BYTES_PER_RANK

    @property
    def total(self) -> int:
        """Bytes of one such rank."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.runtime

    def describe(self) -> str:
        """One line: the breakdown of one rank."""
        held = f"{self.chunk_microbatches} chunk-microbatch{'es' * (self.chunk_microbatches != 1)}"
        return (f"pipeline rank {self.pipeline_rank} ({self.ranks} rank{'s' * (self.ranks > 1)}, each "
                f"{self.parameters:,} parameters): weights {format_bytes(self.weights)} + gradients "
                f"{format_bytes(self.gradients)} + Adam {format_bytes(self.optimizer)} + activations "
                f"{format_bytes(self.activations)} ({held} in flight) + runtime "
                f"{format_bytes(self.runtime)} = {format_bytes(self.total)}")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; powers of 1024, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _is_moe(model, layer: int) -> bool:
    return model.num_experts > 0 and layer >= model.first_k_dense_replace


def layer_parameters(model, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """Parameters one rank holds of decoder layer ``layer`` (a ``DeepSeekBlock``) at TP
    ``tp``, EP ``ep`` and ETP ``etp`` (each routed expert split over ``etp`` ranks)."""
    h = model.hidden_size
    count = 2 * 2 * h                                   # two LayerNorms, weight and bias
    count += (3 * h * h + 3 * h) // tp + h * h // tp + h  # qkv (column), proj (row, whole bias)
    if _is_moe(model, layer):
        f = model.moe_ffn_hidden_size or h
        count += model.num_experts * h                                # the router (whole)
        count += 3 * (model.num_experts // ep) * f * h // etp         # my routed experts' shards
        count += 3 * model.num_shared_experts * f * h                 # shared experts (whole)
    else:
        f = model.ffn_hidden_size or 4 * h
        count += (f * h + f) // tp + h * f // tp + h                  # fc1 (column), fc2 (row)
    return count


def _layer_activation_values(model, layer: int, rows: int, tp: int, cp: int = 1) -> int:
    """Values autograd keeps for backward in ``layer`` for one microbatch of ``rows`` sequences
    (``cp``: context-parallel ranks; each holds ``s / cp`` of every sequence's tokens)."""
    h, s, b = model.hidden_size, model.seq_length, rows
    tokens = s // cp * b
    values = 4 * tokens * h                              # two LayerNorms' inputs and outputs
    values += tokens * (3 * h + h) // tp                 # qkv and the attention output (my heads)
    values += 2 * b * (model.num_attention_heads // tp) * (s // cp) * s  # attention probabilities
    if _is_moe(model, layer):
        f, k = model.moe_ffn_hidden_size or h, model.moe_router_topk
        mine = tokens // tp                              # the MoE layer splits the sequence over TP
        values += mine * 3 * model.num_experts           # router logits, scores, gates
        values += mine * k * (2 * h + 3 * f)             # routed copies in and out, gate/up/product
        values += mine * 3 * model.num_shared_experts * f
    else:
        values += 2 * tokens * (model.ffn_hidden_size or 4 * h) // tp  # fc1 output, GELU output
    return values


def _moe_layers_in(model, layers: range) -> int:
    """How many of ``layers`` are MoE layers (those from ``first_k_dense_replace`` on)."""
    if model.num_experts <= 0:
        return 0
    return max(0, layers.stop - max(layers.start, model.first_k_dense_replace))


def memory_per_rank(model, parallel, train, schedule: str = "1f1b", virtual_pipeline_size: int = 1,
                    pipeline_ranks=None) -> list[RankMemory]:
    """The estimate for each pipeline rank of a run (see the module doc), first to last.

    ``model``, ``parallel``, ``train``: the run's :class:`~tutorial_lib.config.ModelConfig`,
    :class:`~tutorial_lib.config.ParallelConfig`, :class:`~tutorial_lib.config.TrainConfig`,
    already valid (:func:`tutorial_lib.config.validate`).  ``virtual_pipeline_size``: chunks
    per rank (the interleaved schedule's V; 1 otherwise).  ``pipeline_ranks``: only these
    (default: every pipeline rank).  Constant time per rank, whatever the number of layers.
    """
    tp, ep = parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size
    cp = parallel.context_parallel_size  # activations: each CP rank holds s / CP tokens
    pp, v = parallel.pipeline_model_parallel_size, virtual_pipeline_size
    dp, edp = parallel.data_parallel_size, parallel.expert_data_parallel_size
    m = train.num_microbatches
    rows = train.global_batch_size // dp // m
    h, vocab, s = model.hidden_size, model.vocab_size, model.seq_length
    per_stage = model.num_layers // (pp * v)  # stage k holds layers [k per, (k + 1) per) (rule 9)
    first_moe = max(model.first_k_dense_replace, 0)  # a layer index from which layers are MoE
    # layer 0 is dense unless every layer is MoE (then no dense layer uses these two)
    etp = parallel.expert_tensor_parallel_size
    dense_params = layer_parameters(model, 0, tp, ep, etp)
    dense_acts = _layer_activation_values(model, 0, rows, tp, cp)
    moe_params = layer_parameters(model, first_moe, tp, ep, etp)
    moe_acts = _layer_activation_values(model, first_moe, rows, tp, cp)
    out = []
    for rank in (range(pp) if pipeline_ranks is None else pipeline_ranks):
        params = activations = 0
        for stage in (c * pp + rank for c in range(v)):
            layers = range(stage * per_stage, (stage + 1) * per_stage)
            moe = _moe_layers_in(model, layers)
            dense = len(layers) - moe
            params += dense * dense_params + moe * moe_params
            chunk = dense * dense_acts + moe * moe_acts
            if stage == 0:
                params += vocab * h // tp + s * h                    # word and position tables
                chunk += s // cp * rows * h
            if stage == pp * v - 1:
                params += 2 * h + vocab * h // tp                    # final LayerNorm, LM head
                chunk += 3 * s // cp * rows * vocab // tp            # logits, softmax, gradient
            activations = max(activations, chunk)
        in_flight = expected_peak_activations(schedule, pp, m, rank, v)
        weights = BYTES_PER_VALUE * params
        gradients = weights * (2 if dp > 1 or edp > 1 else 1)
        out.append(RankMemory(rank, parallel.world_size // pp, params, weights, gradients,
                              2 * weights, BYTES_PER_VALUE * activations * in_flight, in_flight))
    return out


def memory_on_this_machine(ranks: list[RankMemory], local_ranks: int | None = None) -> int:
    """Bytes the ranks started on this machine need: every rank of ``ranks``, or, under a
    multi-node launcher, ``local_ranks`` ranks of the largest kind."""
    if local_ranks is None:
        return sum(r.ranks * r.total for r in ranks)
    return local_ranks * max(r.total for r in ranks)


def available_memory_bytes() -> tuple[int, str] | None:
    """``(bytes, where from)``: memory this machine can still give, or ``None`` if unknown.

    ``MemAvailable`` in ``/proc/meminfo`` (Linux: free memory plus what the kernel can
    reclaim), else the free physical pages from ``os.sysconf``.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    if pages > 0 and size > 0:
        return pages * size, "free physical pages (os.sysconf)"
    return None
