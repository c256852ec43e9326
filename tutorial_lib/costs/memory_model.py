"""Memory per rank of a 4D training run, predicted from the config alone (chapter 10).

One pure model (no torch: a command line calls it before it loads torch) for any
config and layout the course accepts, rank by rank.  Each rank holds

* **weights**: its parameters, counted layer by layer from the model's shapes (TP splits
  attention, dense MLPs, embedding and LM head; EP splits the routed experts, ETP each
  expert; the shared experts by TP like a dense MLP; LayerNorms, routers and
  row-parallel biases are whole on every rank);
* **gradients**: one per parameter, in the precision's gradient bytes (the data-parallel
  bucket buffer ``main_grad`` when the model is wrapped in ``DataParallel``, else
  ``.grad``); under the distributed optimizer also the fp32 gradient of this rank's slice
  (``ShardedBuffer.main_param.grad``);
* **optimizer**: Adam's two fp32 moments and, where the weights are not fp32 or the
  optimizer is distributed, an fp32 master copy.  Plain DP keeps them for every parameter;
  the distributed optimizer (ZeRO-1, ``--use-distributed-optimizer``) for its slice of each
  gradient domain's flat buffer, ``ceil(numel / group size)`` values (dense weights over
  ``dp_cp``, routed experts over expert-DP), as :class:`~tutorial_lib.data_parallel.
  ShardedBuffer` pads it;
* **activations**: what autograd keeps for backward, layer by layer (:func:`layer_activation_bytes`:
  attention, dense MLP or MoE with its dispatched copies, LayerNorms, dropout masks), plus
  the embedding on the first model stage and the final LayerNorm, head and loss on the
  last, for one microbatch of each chunk; times the chunk-microbatches the schedule holds
  at its peak (:func:`tutorial_lib.pipeline_parallel.formulas.expected_peak_activations`: GPipe
  ``M``, 1F1B ``PP - rank``, interleaved per chunk; chapter 11's schedules hold a split
  backward's activations until its W: ZB-H1 ``min(PP, M)``, ZBV up to ``2 PP`` half-stage
  chunks, DualPipeV ``2 PP + 1``, DualPipe ``PP + 1``), under a recompute setting.  Where
  a rank's chunks differ (the interleaved schedule, the V, DualPipe's two copies) the peak
  is the walk over the rank's action list with each chunk's bytes, in the executor's
  order (:func:`tutorial_lib.pipeline_parallel.formulas.peak_activations_in_flight`);
* **runtime**: a worker process with torch loaded and a process group joined,
  :data:`RUNTIME_BYTES_PER_RANK` (the course's CPU workers only).

The stages sit where the schedule puts them (:data:`tutorial_lib.pipeline_parallel.actions.
SCHEDULE_PLACEMENT`): chunk ``c`` of rank ``r`` is stage ``c PP + r`` (GPipe, 1F1B,
interleaved, ZB-H1); ZBV and DualPipeV fold ``2 PP`` stages in a V, rank ``r`` holding
stages ``r`` and ``2 PP - 1 - r`` (rank 0 both the embedding and the head); DualPipe holds
two copies of the ``PP``-stage model, rank ``r`` stage ``r`` of one and ``PP - 1 - r`` of
the other, so its ranks together keep two copies of every parameter, its gradient and its
optimizer state (:data:`~tutorial_lib.pipeline_parallel.formulas.PARAMETER_COPIES`), and the
first and the last rank each hold one embedding and one head.

Precision (``precision``): ``"fp32"`` is the course's runs, every value 4 bytes;
``"bf16"`` is mixed precision as Megatron-LM trains at scale: bf16 weights (2 bytes), fp32
gradients (4), an fp32 master and two fp32 moments (12), 18 bytes per parameter with plain
DP, activations in bf16.  The distributed optimizer, counted as the course's
:class:`~tutorial_lib.data_parallel.DistributedOptimizer` holds it (the memory checks
compare to the byte): per element of the slice an fp32 master, two moments and an fp32
copy of the slice's gradient, so ``w + g + 16 / DP`` bytes per parameter, ``6 + 16 / DP``
in bf16 and ``8 + 16 / DP`` in fp32.  Megatron-Core keeps less: its slice's gradient is a
view of the fp32 gradient buffer and an fp32 parameter's slice a view of the parameter
(``megatron/core/optimizer/distrib_optimizer.py``, d98e8a64,
``_build_model_and_main_param_groups`` and ``_copy_model_grads_to_main_grads``), so
``6 + 12 / DP`` in bf16 (``theoretical_memory_usage.py``,
``compute_weight_and_optimizer_memory``) and ``8 + 8 / DP`` in fp32.  ``fp8=True`` keeps each matmul's saved input in FP8, one byte per
value plus one fp32 scale per 128 (DeepSeek-V3's 1x128 tiles, :mod:`tutorial_lib.fp8`).

The activation terms are counted from this course's own layers and checked against
autograd's saved tensors in real runs (``tests/dist/test_memory.py``): equal to the byte
for parameters, gradients and optimizer state, within 5 % for activations.  Megatron's own
activation estimate (Korthikanti et al. 2022) counts its fused kernels instead.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..config import ZERO_STAGE
from ..pipeline_parallel import BUILDERS
from ..pipeline_parallel.actions import (ALL_SCHEDULES, SCHEDULE_PLACEMENT,
                                         SPLIT_BACKWARD_SCHEDULES, model_stage, num_model_stages)
from ..pipeline_parallel.formulas import expected_peak_activations, peak_activations_in_flight
from ..pipeline_parallel.schedules import interleaved_one_f_one_b
from ..recompute import (KEEP_ALL, KEEP_ALL_BUT_CORE_ATTENTION, KEEP_INPUT, Recompute,
                         kept_per_layer)

__all__ = ["BYTES_PER_VALUE", "RUNTIME_BYTES_PER_RANK", "PRECISION_BYTES", "Precision",
           "RankMemory", "layer_parameters", "attention_widths", "attention_output_width",
           "attention_parameters", "expert_parameters", "layer_activation_bytes", "stage_activation_bytes",
           "stage_layer_range", "memory_per_rank", "memory_of_ranks", "memory_on_this_machine",
           "available_memory_bytes", "format_bytes", "unit_slice_numel",
           "zero_bytes_per_parameter", "peak_unsharded_numel"]

BYTES_PER_VALUE = 4
"""fp32: the course's runs keep weights, gradients, Adam's moments and activations in it."""

RUNTIME_BYTES_PER_RANK = 200 * 2**20
"""A worker before it builds its model: Python, torch, the library and a gloo process group.
Measured: a worker started by :func:`tutorial_lib.launch.launch` holds about 214 MiB of
private memory (``RssAnon`` in ``/proc/self/status``; torch 2.13, Python 3.11) before it
builds its model, some of it shared copy-on-write with the process it was forked from."""

INDEX_BYTES = 8
"""int64: token ids, labels, routing indices."""

STATS_BYTES = 4
"""fp32: LayerNorm statistics, attention's log-sum-exp, router scores, the loss's softmax."""


@dataclass(frozen=True)
class Precision:
    """Bytes per value of each kind of state."""

    name: str
    weight: int
    """A parameter as the model computes with it."""
    gradient: int
    """Its gradient (Megatron accumulates bf16 models' gradients in fp32: ``main_grad``)."""
    master: int
    """The fp32 master copy the optimizer updates (0 where the weights are fp32 already
    and the optimizer updates them in place)."""
    moments: int
    """Adam's two moments, together."""
    activation: int
    """A saved activation."""


PRECISION_BYTES = {
    "fp32": Precision("fp32", 4, 4, 0, 8, 4),
    "bf16": Precision("bf16", 2, 4, 4, 8, 2),
}
"""``fp32``: the course's runs.  ``bf16``: Megatron's mixed precision, ``2 + 4 + 4 + 8 = 18``
bytes per parameter with plain DP (Megatron-Core 0.20.0, d98e8a64,
``theoretical_memory_usage.py``).  The distributed optimizer's slice is counted apart
(the module docstring): an fp32 master whatever ``master`` says, and its gradient."""

NO_RECOMPUTE = Recompute()


@dataclass(frozen=True)
class RankMemory:
    """The prediction for the ranks of one pipeline rank (their TP, CP, EP and DP ranks hold
    the same)."""

    pipeline_rank: int
    ranks: int
    """How many ranks of the world are this pipeline rank (world / PP)."""
    parameters: int
    """Parameters one of these ranks holds."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    """Bytes of saved activations at the schedule's peak."""
    chunk_microbatches: int
    """Chunk-microbatches whose activations are held at the peak."""
    runtime: int = RUNTIME_BYTES_PER_RANK
    activations_per_microbatch: tuple = ()
    """Bytes one microbatch keeps for backward in each of this rank's chunks."""
    expert_parameters: int = 0
    """Of :attr:`parameters`, those of routed experts (sharded over expert-DP under ZeRO-1)."""
    parts: dict = field(default_factory=dict, compare=False)
    """Activation bytes of one microbatch by part, summed over the chunks: ``attention``,
    ``mlp``, ``moe``, ``embedding``, ``output``, ``recompute_inputs``."""
    gathered: int = 0
    """ZeRO-3: the most bytes of gathered (unsharded) parameters held at once, at the peak
    of a forward and backward (:func:`peak_unsharded_numel`); between steps its
    :attr:`weights` are 0: each parameter lives as its fp32 slice, in :attr:`optimizer`."""

    @property
    def total(self) -> int:
        """Bytes of one such rank."""
        return (self.weights + self.gathered + self.gradients + self.optimizer + self.activations
                + self.runtime)

    def as_dict(self) -> dict:
        """The breakdown as plain numbers (what ``python -m tutorial_lib.memory --json`` prints)."""
        return {"pipeline_rank": self.pipeline_rank, "parameters": self.parameters,
                "weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "chunk_microbatches": self.chunk_microbatches,
                "activations_per_microbatch": list(self.activations_per_microbatch),
                "gathered": self.gathered, "runtime": self.runtime, "total": self.total,
                "activation_parts": dict(self.parts)}

    def describe(self) -> str:
        """One line: the breakdown of one rank."""
        held = f"{self.chunk_microbatches} chunk-microbatch{'es' * (self.chunk_microbatches != 1)}"
        runtime = f" + runtime {format_bytes(self.runtime)}" if self.runtime else ""
        gathered = f" + gathered {format_bytes(self.gathered)}" if self.gathered else ""
        return (f"pipeline rank {self.pipeline_rank} ({self.ranks} rank{'s' * (self.ranks > 1)}, each "
                f"{self.parameters:,} parameters): weights {format_bytes(self.weights)}{gathered} + gradients "
                f"{format_bytes(self.gradients)} + optimizer {format_bytes(self.optimizer)} + "
                f"activations {format_bytes(self.activations)} ({held} in flight){runtime} = "
                f"{format_bytes(self.total)}")


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
    count += attention_parameters(model, tp)
    if _is_moe(model, layer):
        f = model.moe_ffn_hidden_size or h
        count += model.num_experts * h                                # the router (whole)
        count += expert_parameters(model, ep, etp)                   # my routed experts' shards
        count += 3 * model.num_shared_experts * f * h // tp           # shared experts (TP)
    else:
        f = model.ffn_hidden_size or 4 * h
        up = 2 * f if getattr(model, "swiglu", False) else f         # SwiGLU: gate and up
        count += (up * h + up) // tp + h * f // tp + h                # fc1 (column), fc2 (row)
    return count


def attention_widths(model) -> tuple[int, int, int]:
    """``(q, k, v)``: the widths of one token's queries, keys and values, all heads.

    Plain multi-head attention: ``h`` each.  Grouped-query attention
    (``num_query_groups`` = ``g`` < heads, Megatron's name): queries ``n d``, keys and values
    ``g d`` each (``d`` = ``kv_channels``, default ``h / n``).  DeepSeek's multi-head latent
    attention (``multi_latent_attention``): queries and keys ``n (qk_head_dim +
    qk_pos_emb_head_dim)``, values ``n v_head_dim``.  A model without these attributes (the
    course's :class:`~tutorial_lib.config.ModelConfig`) is plain multi-head attention."""
    h, n = model.hidden_size, model.num_attention_heads
    if getattr(model, "multi_latent_attention", False):
        qk = n * (model.qk_head_dim + model.qk_pos_emb_head_dim)
        return qk, qk, n * model.v_head_dim
    d = getattr(model, "kv_channels", None) or h // n
    g = getattr(model, "num_query_groups", None) or n
    return n * d, g * d, g * d


def attention_output_width(model) -> int:
    """Width of one token's attention output, all heads, before the output projection:
    every query head mixes a value head, ``n d`` (``n v_head_dim`` under MLA)."""
    if getattr(model, "multi_latent_attention", False):
        return model.num_attention_heads * model.v_head_dim
    n = model.num_attention_heads
    return n * (getattr(model, "kv_channels", None) or model.hidden_size // n)


def attention_parameters(model, tp: int = 1) -> int:
    """Parameters one TP rank holds of one layer's attention (its projections; the
    LayerNorms are counted by :func:`layer_parameters`).

    Multi-head and grouped-query: the fused qkv projection (column-parallel, with its bias)
    and the output projection (row-parallel; its bias whole on every rank).  MLA, as
    Megatron-Core's ``MLASelfAttention``: the down-projections of queries (``q_lora_rank``;
    none when it is ``None``: one query projection) and of keys and values (``kv_lora_rank``
    plus the shared rotary key ``qk_pos_emb_head_dim``) whole on every rank with their
    LayerNorms, the up-projections column-parallel, the output row-parallel."""
    h = model.hidden_size
    q, k, v = attention_widths(model)
    out = attention_output_width(model)
    if not getattr(model, "multi_latent_attention", False):
        return (h * (q + k + v) + q + k + v) // tp + out * h // tp + h
    n, rope = model.num_attention_heads, model.qk_pos_emb_head_dim
    q_lora, kv_lora = getattr(model, "q_lora_rank", None), model.kv_lora_rank
    count = h * (kv_lora + rope) + kv_lora                               # kv down, its norm
    count += kv_lora * n * (model.qk_head_dim + model.v_head_dim) // tp  # k and v up
    if q_lora:
        count += h * q_lora + q_lora + q_lora * q // tp                  # q down, norm, up
    else:
        count += h * q // tp
    return count + out * h // tp + h                                     # output projection


def expert_parameters(model, ep: int, etp: int = 1) -> int:
    """One MoE layer's routed-expert parameters on one EP x ETP rank (gate, up, down; no
    bias; each expert's hidden size split over ETP)."""
    return 3 * (model.num_experts // ep) * (model.moe_ffn_hidden_size or model.hidden_size) \
        * model.hidden_size // etp


def _matmul_input(values: int, a: int, fp8: bool) -> int:
    """Bytes of a saved matmul input: ``a`` per value, or FP8 (1 byte + an fp32 scale per 128)."""
    return values + 4 * math.ceil(values / 128) if fp8 else a * values


def layer_activation_bytes(model, layer: int, rows: int, tp: int = 1, cp: int = 1, *,
                           precision: str = "fp32", recompute: str | None = None,
                           moe_capacity_factor: float | None = None, ep: int = 1,
                           fp8: bool = False, etp: int = 1) -> dict[str, int]:
    """Bytes decoder layer ``layer`` keeps for backward for one microbatch of ``rows``
    sequences, by part: ``{"attention": ..., "mlp": ...}`` (``"moe"`` for an MoE layer).

    ``tp`` / ``cp``: each rank's share (TP splits heads and the MLP's hidden size; CP
    keeps ``s / CP`` tokens; ``model.sequence_parallel`` splits the LayerNorms' tokens over
    TP).  ``recompute="selective"`` drops core attention's internals.  Counted from this
    course's layers (``T`` the rank's tokens, ``a`` bytes per activation, ``n`` heads):

    * attention: LayerNorm input and output (``2 T h``, its two statistics in fp32), the
      qkv projection's output that core attention keeps (``3 T h / TP``), the attention
      output the projection keeps (``T h / TP``), the log-sum-exp (``T n / TP``, fp32);
      under CP what each ``cp_comm_type`` keeps besides (:func:`_context_parallel_attention_bytes`);
      a dropout mask (``T h``);
    * dense MLP: LayerNorm as above, fc1's output and GELU's (``2 T f / TP``), a dropout mask;
    * MoE: LayerNorm; on the rank's ``T / TP`` tokens (the MoE layer splits the sequence
      over TP) with ``R = K T / TP`` routed copies (``ceil(cf K T / (TP N))`` per expert,
      padded, under a capacity factor): ``R (3 h + 4 f)`` (the dispatched and combined rows,
      the experts' gate, up, activation and product; under ETP each rank gathers its ETP
      group's rows, ``ETP R`` expert inputs of ``h`` and two int64 orders, each with
      ``f / ETP`` channels), the router's fp32 scores and int64
      indices (``2 N`` and ``5 K x 8 + 2 K x 4`` bytes per token), three fp32 per token and
      ``N`` per sequence for the sequence-wise balance loss, the shared experts' ``4 f / TP``
      per token of the whole sequence (split over TP; with TP > 1 also the input they
      all-gather, ``T h``), the aux loss (one fp32 scalar).
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISION_BYTES)}")
    a = PRECISION_BYTES[precision].activation
    h, s, n = model.hidden_size, model.seq_length // cp, model.num_attention_heads
    tokens = s * rows
    norm_tokens = tokens // tp if model.sequence_parallel else tokens
    norm = 2 * a * norm_tokens * h + 2 * STATS_BYTES * norm_tokens   # input, output; mean, rstd
    if fp8:  # the LayerNorm's output is the next matmul's input
        norm += _matmul_input(norm_tokens * h, a, True) - a * norm_tokens * h
    drop = a * norm_tokens * h if model.dropout else 0
    q, k, v = attention_widths(model)
    out = attention_output_width(model)
    attention = norm + a * tokens * (q + k + v) // tp + _matmul_input(tokens * out // tp, a, fp8) \
        + drop
    if getattr(model, "multi_latent_attention", False):  # the latents the up-projections keep
        attention += a * tokens * (model.kv_lora_rank + (getattr(model, "q_lora_rank", 0) or 0))
    if recompute != "selective":
        attention += STATS_BYTES * tokens * n // tp
    if cp > 1:
        attention += _context_parallel_attention_bytes(model, rows, tp, cp, a)
    if not _is_moe(model, layer):
        f = model.ffn_hidden_size or 4 * h
        up = 2 * f if getattr(model, "swiglu", False) else f   # SwiGLU: gate and up outputs
        mlp = norm + a * tokens * up // tp + _matmul_input(tokens * f // tp, a, fp8) + drop
        return {"attention": attention, "mlp": mlp}
    f, k, experts = model.moe_ffn_hidden_size or h, model.moe_router_topk, model.num_experts
    mine = tokens // tp
    copies = mine * k
    routed = copies
    if moe_capacity_factor is not None:  # each expert's buffer padded to its capacity
        routed = experts * math.ceil(moe_capacity_factor * copies / experts)
    moe = norm + drop
    moe += routed * (a * (2 * h + 3 * f)) + _matmul_input(etp * routed * h, a, fp8) \
        + _matmul_input(routed * f, a, fp8)             # expert inputs, activation products
    moe += 2 * INDEX_BYTES * (etp - 1) * routed         # ETP: the gathered rows' two orders
    moe += STATS_BYTES * 2 * mine * experts + (5 * INDEX_BYTES + 2 * STATS_BYTES) * copies
    moe += STATS_BYTES * (3 * mine + rows * experts) + 4
    moe += a * 4 * f * mine * model.num_shared_experts   # = 4 T (f / TP): split over TP
    if tp > 1 and model.num_shared_experts:  # their input, all-gathered over TP
        moe += a * tokens * h
    return {"attention": attention, "moe": moe}


def _context_parallel_attention_bytes(model, rows, tp, cp, a) -> int:
    """What attention under CP keeps besides the serial layer's tensors, per ``cp_comm_type``.

    Every mode returns the output in pieces (head by head, or chunk by chunk), so the
    projection keeps its own reordered copy (``T h / TP``).  Besides: ``p2p`` keeps the
    last K/V block the forward ring brought (``2 T h / TP``: TransformerEngine's ring
    saves it, its backward starts there); ``a2a`` two int64 position vectors of the
    whole sequence; ``all_gather`` the gathered keys and values of the whole sequence in
    position order (``2 b s h / TP``), that order (``s`` int64) and the causal mask of
    each local chunk over its prefix (``L x (c + 1) L`` for chunk ``c`` of length
    ``L = s / 2CP``, chunks ``r`` and ``2 CP - 1 - r``: ``(2 CP + 1) L^2``, in the
    activations' dtype, as attention turns a boolean mask into an additive one).
    """
    s, h = model.seq_length, model.hidden_size
    tokens = s // cp * rows
    extra = a * tokens * h // tp
    if model.cp_comm_type == "p2p":
        return extra + 2 * a * tokens * h // tp
    if model.cp_comm_type == "all_gather":
        length = s // (2 * cp)
        return extra + 2 * a * rows * s * h // tp + INDEX_BYTES * s \
            + a * (2 * cp + 1) * length * length
    return extra + 2 * INDEX_BYTES * s  # a2a


def stage_layer_range(num_layers: int, stage: int, num_stages: int,
                      stage_layers=None) -> range:
    """The decoder layers of model stage ``stage``: ``num_layers / num_stages`` each, or
    ``stage_layers[s]`` each where given (one count per stage, in model order)."""
    if stage_layers is None:
        per = num_layers // num_stages
        return range(stage * per, (stage + 1) * per)
    if len(stage_layers) != num_stages or sum(stage_layers) != num_layers:
        raise ValueError(f"stage_layers {list(stage_layers)} must give {num_stages} stages "
                         f"adding up to the {num_layers} layers")
    start = sum(stage_layers[:stage])
    return range(start, start + stage_layers[stage])


def stage_activation_bytes(model, stage: int, num_stages: int, rows: int, tp: int = 1,
                           cp: int = 1, *, precision: str = "fp32",
                           recompute: Recompute = NO_RECOMPUTE, stage_layers=None,
                           **layer_options) -> dict[str, int]:
    """Bytes model stage ``stage`` of ``num_stages`` keeps for backward for one microbatch,
    by part (:func:`layer_activation_bytes` per layer; ``embedding``: the ids, a mask and
    the positions; ``output``: the final LayerNorm, the head's input and the loss's fp32
    softmax over ``V / TP``, the labels; ``recompute_inputs``: each checkpointed group's
    input under full recomputation).  Which layers keep what under ``recompute`` is
    :func:`tutorial_lib.recompute.kept_per_layer`'s rule (Megatron's flags).  ``stage_layers``:
    the layers of each stage where they differ (Megatron's uneven first and last stages,
    :func:`tutorial_lib.config.layers_per_pipeline_stage`); ``None``: equal stages."""
    a = PRECISION_BYTES[precision].activation
    layers = stage_layer_range(model.num_layers, stage, num_stages, stage_layers)
    s, h = model.seq_length // cp, model.hidden_size
    tokens = s * rows
    norm_tokens = tokens // tp if model.sequence_parallel else tokens
    parts: dict[str, int] = {}
    kept = kept_per_layer(len(layers), recompute)  # tutorial_lib.recompute's rule, per layer
    for layer, keeps in zip(layers, kept):
        if keeps == KEEP_INPUT:  # a checkpointed group's input [s, b, h]
            parts["recompute_inputs"] = parts.get("recompute_inputs", 0) + a * norm_tokens * h
        if keeps not in (KEEP_ALL, KEEP_ALL_BUT_CORE_ATTENTION):
            continue
        selective = "selective" if keeps == KEEP_ALL_BUT_CORE_ATTENTION else None
        for name, value in layer_activation_bytes(model, layer, rows, tp, cp, precision=precision,
                                                  recompute=selective, **layer_options).items():
            parts[name] = parts.get(name, 0) + value
    if stage == 0:
        parts["embedding"] = (INDEX_BYTES + 1) * tokens + INDEX_BYTES * s
    if stage == num_stages - 1:
        parts["output"] = (2 * a * norm_tokens * h + 2 * STATS_BYTES * norm_tokens
                           + STATS_BYTES * tokens * model.vocab_size // tp
                           + (INDEX_BYTES + 1) * tokens)
    return parts


def _peak_bytes(schedule: str, pp: int, m: int, rank: int, v: int, per_chunk: list[int]) -> int:
    """The most bytes the schedule holds at once on ``rank``: with one chunk (or equal
    chunks) of GPipe, 1F1B or interleaved, the peak count times its bytes; else the walk
    over the rank's actions with each chunk's bytes
    (:func:`~tutorial_lib.pipeline_parallel.formulas.peak_activations_in_flight`, the executor's
    order: a split backward's bytes held until its W, an overlapped pair's forward
    counted before its backward frees)."""
    if schedule not in SPLIT_BACKWARD_SCHEDULES and (v == 1 or len(set(per_chunk)) == 1):
        return expected_peak_activations(schedule, pp, m, rank, v) * per_chunk[0]
    actions = (BUILDERS[schedule](pp, m, rank) if schedule in SPLIT_BACKWARD_SCHEDULES
               else interleaved_one_f_one_b(pp, m, rank, v))
    return peak_activations_in_flight(actions, per_chunk)


def memory_per_rank(model, parallel, train, schedule: str = "1f1b", virtual_pipeline_size: int = 1,
                    pipeline_ranks=None, *, precision: str = "fp32",
                    use_distributed_optimizer: bool = False, recompute: Recompute = NO_RECOMPUTE,
                    moe_capacity_factor: float | None = None, fp8: bool = False,
                    runtime: int = RUNTIME_BYTES_PER_RANK,
                    data_parallel_sharding_strategy: str | None = None,
                    num_distributed_optimizer_instances: int = 1,
                    reshard_after_forward: bool | None = None,
                    prefetch: bool = True, stage_layers=None) -> list[RankMemory]:
    """The prediction for each pipeline rank of a run (see the module doc), first to last.

    ``model``, ``parallel``, ``train``: the run's :class:`~tutorial_lib.config.ModelConfig`,
    :class:`~tutorial_lib.config.ParallelConfig`, :class:`~tutorial_lib.config.TrainConfig`,
    already valid (:func:`tutorial_lib.config.validate`).  ``schedule``: any of
    :data:`~tutorial_lib.pipeline_parallel.actions.ALL_SCHEDULES`.  ``virtual_pipeline_size``:
    chunks per rank (the interleaved schedule's V; ZBV, DualPipeV and DualPipe fix their
    own two, 1 or 2 accepted; 1 otherwise).  ``pipeline_ranks``: only these (default:
    every pipeline rank).  ``runtime``: bytes of the process itself (0 for GPUs).
    ``data_parallel_sharding_strategy``: Megatron-FSDP's ``no_shard``, ``optim`` (the same
    as ``use_distributed_optimizer``), ``optim_grads`` (ZeRO-2) or ``optim_grads_params``
    (ZeRO-3), as :mod:`tutorial_lib.fully_sharded_data_parallel` runs them: one unit per
    decoder layer and a root unit for the rank's other parameters, each unit's slice
    ``ceil(n / S)`` (a MoE layer's routed experts a unit of their own, sliced over
    expert-DP: ``ceil(n / EDP)``, gathered with its layer under ZeRO-3); ZeRO-2 keeps the whole weights, the slices' fp32 gradients, master
    and moments (the whole gradients are freed once reduced); ZeRO-3 keeps no whole
    weight between steps, :attr:`RankMemory.gathered` at the peak
    (``reshard_after_forward``, ``prefetch``: the run's).  ``S`` is the dense sharding
    group, ``DP x CP`` divided by ``num_distributed_optimizer_instances`` (HSDP: replicas
    of a sharded group; Megatron's flag of that name).
    ``stage_layers``: the layers of each model stage where they differ (Megatron's uneven
    first and last stages, :func:`tutorial_lib.config.layers_per_pipeline_stage`).
    Constant time per layer and rank, plus a walk over the rank's ``O(M)`` actions where
    its chunks differ or the schedule splits backwards.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISION_BYTES)}")
    if schedule not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; schedules are {', '.join(ALL_SCHEDULES)}")
    placement = SCHEDULE_PLACEMENT.get(schedule, "loop")
    if placement != "loop":  # a V or DualPipe's two copies: two chunks per rank, always
        if virtual_pipeline_size not in (1, 2):
            raise ValueError(f"{schedule} places two chunks on each rank; virtual_pipeline_size "
                             f"({virtual_pipeline_size}) is for the interleaved schedule")
        virtual_pipeline_size = 2
    bytes_ = PRECISION_BYTES[precision]
    strategy = data_parallel_sharding_strategy or (
        "optim" if use_distributed_optimizer else "no_shard")
    if strategy not in ZERO_STAGE:
        raise ValueError(f"unknown data-parallel sharding strategy {strategy!r}: one of "
                         f"{', '.join(ZERO_STAGE)}")
    zero_stage = ZERO_STAGE[strategy]
    tp, ep = parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size
    cp = parallel.context_parallel_size
    pp, v = parallel.pipeline_model_parallel_size, virtual_pipeline_size
    dp, edp = parallel.data_parallel_size, parallel.expert_data_parallel_size
    instances = _whole("num_distributed_optimizer_instances", num_distributed_optimizer_instances)
    if (dp * cp) % instances:
        raise ValueError(f"num_distributed_optimizer_instances ({instances}) must divide DP x CP "
                         f"({dp * cp}): each instance is a whole sharding group")
    shard = dp * cp // instances
    m = train.num_microbatches
    rows = train.global_batch_size // dp // m
    h, vocab, s = model.hidden_size, model.vocab_size, model.seq_length
    stages = num_model_stages(placement, pp, v)  # of one model copy
    etp = parallel.expert_tensor_parallel_size
    layer_options = {"moe_capacity_factor": moe_capacity_factor, "ep": ep, "fp8": fp8,
                     "etp": etp}
    out = []
    for rank in (range(pp) if pipeline_ranks is None else pipeline_ranks):
        params = experts = 0
        per_chunk, parts, layer_sizes, layer_experts = [], {}, [], []
        for stage in (model_stage(placement, rank, c, pp) for c in range(v)):
            layers = stage_layer_range(model.num_layers, stage, stages, stage_layers)
            layer_sizes += [layer_parameters(model, i, tp, ep, etp) for i in layers]
            layer_experts += [expert_parameters(model, ep, etp) if _is_moe(model, i) else 0
                              for i in layers]
            params += sum(layer_sizes[-len(layers):])
            experts += sum(layer_experts[-len(layers):])
            if stage == 0:
                rope = getattr(model, "position_embedding_type", "learned_absolute") == "rope"
                params += vocab * h // tp + (0 if rope else s * h)   # word and position tables
            if stage == stages - 1:
                params += 2 * h + vocab * h // tp                    # final LayerNorm, LM head
            chunk = stage_activation_bytes(model, stage, stages, rows, tp, cp, precision=precision,
                                           recompute=recompute, stage_layers=stage_layers,
                                           **layer_options)
            per_chunk.append(sum(chunk.values()))
            for name, value in chunk.items():
                parts[name] = parts.get(name, 0) + value
        dense = params - experts
        gradients = bytes_.gradient * params
        weights, gathered = bytes_.weight * params, 0
        if zero_stage == 1:  # each domain's flat buffer, padded to equal slices
            mine = math.ceil(dense / shard) + (math.ceil(experts / edp) if experts else 0)
            optimizer = (4 + bytes_.moments) * mine       # fp32 master of the slice + moments
            gradients += 4 * mine                         # the slice's fp32 gradient
        elif zero_stage >= 2:  # a unit per layer and domain, the root unit first
            rest = params - sum(layer_sizes)
            units = ([rest] if rest else []) + [n - e for n, e in zip(layer_sizes, layer_experts)]
            mine = sum(unit_slice_numel(n, shard) for n in units)
            mine += sum(unit_slice_numel(e, edp) for e in layer_experts if e)  # over expert-DP
            optimizer = (4 + bytes_.moments) * mine
            gradients = 4 * mine                          # the whole gradients are freed
            if zero_stage == 3:  # a MoE layer's two units are gathered together
                weights = 0
                whole = [unit_slice_numel(n, shard) * shard for n in units]
                for i, e in enumerate(layer_experts):
                    whole[i + bool(rest)] += unit_slice_numel(e, edp) * edp if e else 0
                gathered = bytes_.weight * peak_unsharded_numel(
                    whole, reshard_after_forward, prefetch, root=bool(rest))
        else:
            optimizer = (bytes_.master + bytes_.moments) * params
        in_flight = expected_peak_activations(schedule, pp, m, rank, v)
        out.append(RankMemory(rank, parallel.world_size // pp, params, weights,
                              gradients, optimizer, _peak_bytes(schedule, pp, m, rank, v, per_chunk),
                              in_flight, runtime, tuple(per_chunk), experts, parts, gathered))
    return out


def memory_of_ranks(ranks: list[RankMemory], parallel) -> list[tuple[int, dict, RankMemory]]:
    """``(global rank, its coordinates, its prediction)`` for every rank of the world, in
    rank order (Megatron's folded grid, :func:`tutorial_lib.grid.megatron_grids`)."""
    from ..grid import megatron_grids
    dense, expert = megatron_grids(parallel)
    by_stage = {r.pipeline_rank: r for r in ranks}
    out = []
    for rank in range(parallel.world_size):
        coords = dense.coords(rank)
        coords.update({k: val for k, val in expert.coords(rank).items() if k not in coords})
        out.append((rank, coords, by_stage[coords["pp"]]))
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


# --- sharded data parallelism (ZeRO-2, ZeRO-3): slices, the paper's table, the gathered peak ---


def _whole(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def unit_slice_numel(numel: int, shard_size: int) -> int:
    """Elements of one rank's slice of a unit of ``numel`` parameters sharded over
    ``shard_size`` ranks: ``ceil(numel / S)`` (the flat vector padded to a multiple of ``S``)."""
    return math.ceil(_whole("numel", numel) / _whole("shard_size", shard_size))


def zero_bytes_per_parameter(stage: int, dp: int, k: int = 12, weight: int = 2,
                             gradient: int = 2) -> float:
    """Model-state bytes per parameter on one rank at ZeRO stage ``stage`` over ``dp`` ranks.

    Rajbhandari et al. 2020, section 3 and figure 1 (mixed-precision Adam: fp16 weights
    and gradients, ``K = 12`` bytes of fp32 master, momentum and variance): stage 0 keeps
    ``2 + 2 + K``; stage 1 ``2 + 2 + K / Nd``; stage 2 ``2 + (2 + K) / Nd``; stage 3
    ``(2 + 2 + K) / Nd``.  Sharded terms divide exactly (the paper's count, no padding).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    dp = _whole("dp", dp)
    sharded = {0: 0, 1: k, 2: k + gradient, 3: k + gradient + weight}[stage]
    return weight + gradient + k - sharded + sharded / dp


def peak_unsharded_numel(unit_numels, reshard_after_forward: bool | None = None,
                         prefetch: bool = True, root: bool = True) -> int:
    """The most gathered parameter elements ZeRO-3 holds at once in one forward and backward.

    ``unit_numels``: each unit's gathered (padded) size, root first, then in the order
    they run; the root's forward encloses the others' (its parameters are used first and
    last); ``root=False``: the first unit is an ordinary unit (a rank with no root
    parameters), freed as the others.  The walk :class:`~tutorial_lib.fully_sharded_data_parallel.FullyShardedDataParallel`'s
    hooks make: before each unit's forward, gather it (and, with ``prefetch``, the next);
    after it, free it if it reshards; the root is freed after the whole forward if it
    reshards.  Backward runs the units in reverse (root first): gather the unit (and,
    with ``prefetch``, the one whose forward ran before it), free it when its gradients
    are in; the root last.
    """
    sizes = [_whole("numel", n) for n in unit_numels]
    if not sizes:
        return 0
    enclosing = 0 if root else None  # the root's forward and backward enclose the others'
    freed = [reshard_after_forward is True if root else reshard_after_forward is not False]
    freed += [reshard_after_forward is not False] * (len(sizes) - 1)
    held: set[int] = set()
    peak = 0

    def gather(unit: int, ahead: int) -> None:
        nonlocal peak
        held.update(u for u in (unit, ahead if prefetch else -1) if 0 <= u < len(sizes))
        peak = max(peak, sum(sizes[u] for u in held))

    for unit in range(len(sizes)):                       # forward, in order
        gather(unit, unit + 1)
        if unit != enclosing and freed[unit]:
            held.discard(unit)
    if root and freed[0]:
        held.discard(0)
    post_forward = list(range(1, len(sizes))) + [0] if root else list(range(len(sizes)))
    for position in reversed(range(len(post_forward))):  # backward, in reverse
        unit = post_forward[position]
        gather(unit, post_forward[position - 1] if position > 0 else -1)
        if unit != enclosing:
            held.discard(unit)
    return peak
