"""Configuration dataclasses, the validator that teaches, and the command line built from them.

Every distributed run in this course starts from three small dataclasses:

* :class:`ParallelConfig` says how the world is cut into tensor, pipeline,
  context, expert and data parallel pieces (Megatron's field names);
* :class:`ModelConfig` says what model is trained (the one description of a model's
  shape, read by the cost models too);
* :class:`TrainConfig` says how a global batch is split into microbatches.

Each field is documented once, by the string literal under it; :func:`add_arguments`
turns those fields and docstrings into ``--name-with-dashes`` options, as Megatron builds
its command line from its config dataclasses (``examples/train_4d.py``).

:func:`validate` checks them, before any process starts, against the rules a layout
must satisfy, plus malformed input (zero, negative or non-integer sizes).  Each broken
rule raises :class:`ConfigError` whose message names the rule, the numbers that broke
it, and a fix.  The numbers are the same in every chapter (chapters 1, 4 and 6 break
them on purpose):

1. the world divides into the model-parallel grid;
2. (lifted) this course's former guard, which refused TP > 1 together with EP > 1; the
   method allows it and so does the course: each TP rank routes its own sequence-parallel
   tokens over the expert grid's EP group, and the experts may be split over ETP ranks;
3. microbatches: ``num_microbatches >= 1`` and they divide the batch;
4. routed experts divide evenly over expert-parallel ranks;
5. each routed expert's width (``moe_ffn_hidden_size``, default ``hidden_size``) divides
   over the expert-tensor-parallel ranks (its gate and up projections are split by output
   channels, its down projection by input channels);
6. the sequence divides over TP ranks when sequence parallelism is on, and in a model
   with MoE layers under TP (each MoE layer splits the sequence over the TP ranks);
7. no dropout with tensor or expert parallelism;
8. attention heads divide over TP ranks;
9. layers divide over pipeline stages (times the virtual stages of the
   interleaved schedule): :func:`check_pipeline_layers`; or, where the first and the last
   pipeline rank hold their own counts (Megatron's uneven split), the layers left divide
   over the middle ranks: :func:`layers_per_pipeline_stage`;
10. the vocabulary divides over TP ranks (the embedding and LM head are split by rows);
11. attention heads divide the hidden size (each head gets ``hidden_size / heads`` channels);
12. with context parallelism the sequence splits into ``2 x CP`` equal chunks (the
    load-balanced split of :mod:`tutorial_lib.context_parallel`);
13. with ``cp_comm_type="a2a"`` (Ulysses) each TP rank's attention heads divide over the CP
    ranks.

Before any rule, every field must hold a value of its type (:func:`check_field_types`:
``"8"`` is not a world size, ``True`` is not 1), and :func:`validate` must be given the
dataclasses themselves, in their order.

The grid alone (what ``python -m tutorial_lib.grid`` draws) only needs the
structural rules: :func:`check_grid`.
"""
from __future__ import annotations

import argparse
import ast
import functools
import inspect
import math
import numbers
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, make_dataclass

#: The layouts a grid can be built in; see :mod:`tutorial_lib.grid`.
LAYOUTS = ("megatron", "course", "visualizer")

#: How attention exchanges keys and values between context-parallel ranks: the values of
#: Megatron-Core's ``TransformerConfig.cp_comm_type`` that this course implements
#: (:mod:`tutorial_lib.context_parallel`; Megatron's fourth, ``a2a+p2p``, is not here).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")

#: Megatron's ``--position-embedding-type`` values the cost models count: a learned table
#: (the course's layers) or rotary embeddings (no table).
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")

#: The :class:`ModelConfig` fields only the cost models read (published models' shapes):
#: a run keeps their defaults (:func:`validate`); the memory model's presets set them
#: (``validate(..., cost_model=True)``).
COST_MODEL_FIELDS = ("num_query_groups", "kv_channels", "swiglu", "multi_latent_attention",
                     "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                     "v_head_dim", "position_embedding_type")

#: What data parallelism shards, Megatron-FSDP's ``--data-parallel-sharding-strategy``
#: (Megatron-LM 82a1d0eb, megatron/core/distributed/fsdp/src/megatron_fsdp/
#: distributed_data_parallel_config.py, ``data_parallel_sharding_strategy``), with its ZeRO
#: stage: nothing, the optimizer state, and the gradients, and the parameters
#: (:mod:`tutorial_lib.fully_sharded_data_parallel`).
ZERO_STAGE = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
SHARDING_STRATEGIES = tuple(ZERO_STAGE)


class ConfigError(ValueError):
    """A configuration broke a rule.  ``rule`` is a short id like ``"rule 4"``."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message


@dataclass
class ParallelConfig:
    """How ``world_size`` ranks are split into parallel dimensions (Megatron names)."""

    world_size: int
    """Total number of ranks (processes, one per GPU or CPU worker)."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that split each dense/attention weight matrix; innermost, fastest links."""

    pipeline_model_parallel_size: int = 1
    """PP: number of pipeline stages; each stage owns a contiguous range of layers."""

    expert_model_parallel_size: int = 1
    """EP: ranks that split the routed experts of every MoE layer between them."""

    context_parallel_size: int = 1
    """CP: ranks that split every sequence; attention exchanges keys and values between them,
    the other layers work on each rank's own tokens (rule 12; :mod:`tutorial_lib.context_parallel`)."""

    expert_tensor_parallel_size: int | None = None
    """ETP: ranks that split each routed expert's weights (rule 5); 1 keeps experts whole.

    Not set: TP, as Megatron-LM 0.20.0 (``validate_args`` in ``megatron/training/arguments.py``
    sets an unset ``expert_tensor_parallel_size`` to ``tensor_model_parallel_size``), and as
    :func:`~tutorial_lib.grid.build_grid` and ``python -m tutorial_lib.grid`` in the megatron
    layout; the dataclass fills it in when it is built.
    """

    def __post_init__(self):
        if self.expert_tensor_parallel_size is None:  # Megatron's default: ETP = TP
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """DP, derived: replicas of each dense shard, ``world / (TP * CP * PP)`` as in Megatron.

        Ranks with different expert-parallel coordinates see different tokens, so
        they count as data-parallel replicas of the dense weights.
        """
        return self.world_size // (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP, derived: replicas of each expert shard, ``world / (ETP * EP * PP)``."""
        return self.world_size // (
            self.expert_tensor_parallel_size
            * self.expert_model_parallel_size
            * self.pipeline_model_parallel_size
        )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer's shape, by Megatron's flag names: the one description of a
    model in the course.

    The workers train it as a small DeepSeek-style decoder (:mod:`tutorial_lib.deepseek`,
    :mod:`tutorial_lib.gpt`); the cost models also count published models with it
    (:data:`tutorial_lib.costs.model_flops.MODEL_PRESETS`: grouped-query and latent
    attention, SwiGLU, rotary positions), fields the course's layers do not build
    (:data:`COST_MODEL_FIELDS`).  Frozen: a model is a value (the FLOP counts cache per
    model); :func:`dataclasses.replace` makes a changed copy."""

    num_layers: int = 4
    """Decoder blocks; pipeline stages split them into contiguous ranges of equal length (rule 9)."""

    hidden_size: int = 32
    """Width of the residual stream (H)."""

    num_attention_heads: int = 4
    """Attention heads; tensor parallelism gives each TP rank a whole number of heads (rule 8)."""

    seq_length: int = 16
    """Tokens per sequence (S)."""

    vocab_size: int = 64
    """Vocabulary size; the embedding and LM head are split over TP by vocabulary."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0 means dense MLPs only."""

    moe_router_topk: int = 2
    """Experts each token is sent to (K)."""

    dropout: float = 0.0
    """Dropout probability; must be 0 with TP or EP > 1 (rule 7)."""

    sequence_parallel: bool = False
    """Split activations along the sequence between TP ranks outside the matmuls (Megatron's
    ``--sequence-parallel``): LayerNorms, residuals and the pipeline's messages hold ``s/TP``
    tokens (rule 6); nothing to split at TP 1."""

    ffn_hidden_size: int | None = None
    """Width of the dense MLPs (``None``: ``4 * hidden_size``)."""

    moe_ffn_hidden_size: int | None = None
    """Width of each routed and shared expert (``None``: ``hidden_size``, fine-grained experts)."""

    num_shared_experts: int = 1
    """Always-on experts per MoE layer (DeepSeekMoE's shared experts; 0 for none)."""

    first_k_dense_replace: int = 1
    """The first this-many layers keep a dense MLP even when ``num_experts > 0`` (DeepSeek-V3: 3)."""

    cp_comm_type: str = field(default="p2p", metadata={"choices": CP_COMM_TYPES})
    """How attention exchanges keys and values between CP ranks: ``p2p`` (a ring of K/V
    blocks), ``all_gather`` (every rank gathers all K/V) or ``a2a`` (Ulysses: heads
    all-to-all); Megatron's ``--cp-comm-type``.  Ignored at CP = 1."""

    # The fields below describe published models for the cost models (chapter 13's
    # planner, :mod:`tutorial_lib.costs.model_flops`); the course's layers build none of
    # them, so :func:`validate` refuses a run whose value differs from the default.

    num_query_groups: int | None = None
    """Key/value heads under grouped-query attention (``None``: one per query head);
    cost models only."""

    kv_channels: int | None = None
    """Width of one attention head (``None``: ``hidden_size / num_attention_heads``); cost
    models only."""

    swiglu: bool = False
    """A gated MLP (SwiGLU): gate and up matrices ``2 * ffn_hidden_size`` wide, then the down
    matrix; cost models only (the course's MLP is GELU)."""

    multi_latent_attention: bool = False
    """DeepSeek's multi-head latent attention (the ``*_lora_rank`` and ``*_head_dim`` fields
    below); cost models only."""

    q_lora_rank: int | None = None
    """Under latent attention, the queries' compressed width (``None``: queries not
    compressed)."""

    kv_lora_rank: int = 512
    """Under latent attention, the keys' and values' compressed width."""

    qk_head_dim: int = 128
    """Under latent attention, a query / key head's width without its rotary part."""

    qk_pos_emb_head_dim: int = 64
    """Under latent attention, the rotary part of a query / key head."""

    v_head_dim: int = 128
    """Under latent attention, a value head's width."""

    position_embedding_type: str = field(default="learned_absolute",
                                         metadata={"choices": POSITION_EMBEDDING_TYPES})
    """``learned_absolute`` (a position table, the course's) or ``rope`` (rotary: no table);
    Megatron's ``--position-embedding-type``."""

    name: str = ""
    """A label for tables (the planner's presets); not part of the shape."""

    source: str = ""
    """Where the shapes come from (a published model's paper or config); not part of the
    shape."""


@dataclass
class TrainConfig:
    """How one optimizer step's batch is cut up."""

    global_batch_size: int = 8
    """Sequences per optimizer step, summed over all data-parallel replicas."""

    num_microbatches: int = 1
    """Microbatches each replica's batch is split into (the pipeline's M)."""


# --- malformed input -------------------------------------------------------


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = ""
        if isinstance(value, numbers.Real) and float(value).is_integer():
            hint = f"; write {int(value)} instead of {value!r}"
        raise ConfigError(
            "malformed",
            f"{name} must be a whole number, got {value!r} ({type(value).__name__}){hint}",
        )
    if value < 1:
        raise ConfigError(
            "malformed",
            f"{name} must be at least 1, got {value}; a parallel size of 1 means 'not split'",
        )


#: The largest number whose divisors a message lists (trial division up to its square root
#: stays under a second); above it a message says "a divisor of n" instead.
LISTED_DIVISORS_UP_TO = 10**12


def _divisors(n: int, up_to: int | None = None) -> list[int] | None:
    """The divisors of ``n`` (those ``<= up_to`` if given), ascending; ``None`` above
    :data:`LISTED_DIVISORS_UP_TO`."""
    if n > LISTED_DIVISORS_UP_TO:
        return None
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = sorted(set(small + [n // d for d in small]))
    return [d for d in found if up_to is None or d <= up_to]


def _one_of_divisors(n: int, up_to: int | None = None) -> str:
    listed = _divisors(n, up_to)
    return f"one of {listed}" if listed is not None else f"a divisor of {n}"


_TYPE_NAMES = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
               type(None): "None"}


def _has_type(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False  # True is an int to Python, never a size or a rate here
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    """The resolved annotations of dataclass ``cls``, read once per class (resolving them
    evaluates every annotation string, the slowest part of a check)."""
    return typing.get_type_hints(cls)


def check_field_types(config) -> None:
    """:class:`ConfigError` ``"malformed"`` unless every field of dataclass ``config`` holds its type.

    ``int`` fields take whole numbers (not ``True``, not ``8.0``), ``float`` fields any real
    number, ``bool`` fields ``True`` / ``False``, ``str`` fields strings, ``X | None`` either.
    Ranges are checked by the rules; this only stops ``"8"`` or ``"fast"`` from reaching them.
    """
    hints = _type_hints(type(config))
    for f in fields(config):
        value, kind = getattr(config, f.name), hints[f.name]
        allowed = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) \
            else (kind,)
        if any(_has_type(value, t) for t in allowed):
            continue
        wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in allowed)
        hint = ""
        if int in allowed and isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and math.isfinite(value) and float(value).is_integer():
            hint = f"; write {int(value)} instead of {value!r}"
        elif isinstance(value, str) and (int in allowed or float in allowed):
            hint = "; write the number without quotes"
        raise ConfigError("malformed", f"{f.name} must be {wanted}, got {value!r} "
                                       f"({type(value).__name__}){hint}")


def check_number(name: str, value, *, minimum: float = 0.0, above_minimum: bool = False,
                 meaning: str = "") -> None:
    """:class:`ConfigError` ``"malformed"`` unless ``value`` is a finite real ``>= minimum``
    (``> minimum`` with ``above_minimum``); NaN and infinities are refused.  ``meaning`` ends
    the message (what the number is for, and a value that works)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > minimum if above_minimum else value >= minimum)
    if not ok:
        bound = f"> {minimum:g}" if above_minimum else f">= {minimum:g}"
        raise ConfigError("malformed", f"{name} must be a finite number {bound}, got {value!r}"
                                       + (f"; {meaning}" if meaning else ""))


def _nearest_multiples(value: int, base: int) -> str:
    lower = (value // base) * base
    upper = lower + base
    return f"{lower} or {upper}" if lower > 0 else f"{upper}"


def _check_config_type(name: str, value, cls: type, call: str, optional: bool = False) -> None:
    """:class:`ConfigError` unless ``value`` is a ``cls`` (or ``None`` when ``optional``)."""
    if isinstance(value, cls) or (optional and value is None):
        return
    wanted = f"a {cls.__name__}" + (" or None" if optional else "")
    if type(value) in (ParallelConfig, ModelConfig, TrainConfig):
        got = f"a {type(value).__name__}; the arguments look swapped: {call} takes them in that order"
    else:
        got = f"{value!r} ({type(value).__name__}); build one, e.g. {cls.__name__}(" + \
            ("world_size=8, tensor_model_parallel_size=2)" if cls is ParallelConfig else ")")
    raise ConfigError("malformed", f"{name} must be {wanted}, got {got}")


# --- structural rules (the grid) -------------------------------------------


def check_grid(config: ParallelConfig, layout: str = "megatron") -> None:
    """Check that ``config`` describes a grid that exists (malformed input, rule 1).

    ``layout`` decides what must divide the world: in Megatron's folded layout the
    dense grid (TP, CP, PP) and the expert grid (ETP, EP, PP) must each divide it;
    in the single-grid layouts (``course``, ``visualizer``, and ``custom``: one grid
    in a given order) EP is a dimension of its own, so TP * CP * EP * PP must divide
    it, and experts can only be split along TP.
    """
    _check_config_type("config", config, ParallelConfig, "check_grid(config, layout)")
    for f in fields(config):
        _check_positive_int(f.name, getattr(config, f.name))
    if not isinstance(layout, str):
        raise ConfigError("malformed", f"layout must be a string, one of {', '.join(LAYOUTS)}; "
                                       f"got {layout!r} ({type(layout).__name__})")
    if layout not in LAYOUTS + ("custom",):
        raise ConfigError(
            "malformed", f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}"
        )
    w = config.world_size
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    ep, cp = config.expert_model_parallel_size, config.context_parallel_size
    etp = config.expert_tensor_parallel_size
    if layout == "megatron":
        grids = [("dense", "TP * CP * PP", tp * cp * pp), ("expert", "ETP * EP * PP", etp * ep * pp)]
    else:
        grids = [("whole", "TP * CP * EP * PP", tp * cp * ep * pp)]
        if etp not in (1, tp):
            raise ConfigError(
                "rule 1",
                f"expert_tensor_parallel_size ({etp}) must be 1 or equal "
                f"tensor_model_parallel_size ({tp}) in the {layout!r} layout, where experts "
                f"can only be split along the TP dimension; use layout 'megatron' for "
                f"an independent expert grid",
            )
    for grid_name, formula, product in grids:
        if w % product:
            raise ConfigError(
                "rule 1",
                f"world_size ({w}) must be divisible by {formula} = {product} "
                f"(the {grid_name} grid of the {layout!r} layout); "
                f"use a world size of {_nearest_multiples(w, product)}, or make {formula} "
                f"{_one_of_divisors(w, product)}",
            )


# --- the checklist ----------------------------------------------------------


def validate(
    parallel: ParallelConfig,
    model: ModelConfig | None = None,
    train: TrainConfig | None = None,
    layout: str = "megatron",
    *,
    cost_model: bool = False,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
) -> None:
    """Raise :class:`ConfigError` for the first broken rule; return ``None`` if all hold.

    Anything else that goes wrong is a :class:`ConfigError` too: an argument that is not
    its dataclass (``None``, swapped arguments), a field of the wrong type.

    ``cost_model=True``: the config is only counted (the memory model's prediction of a
    published model), so the :data:`COST_MODEL_FIELDS` the course's layers do not build
    are accepted.  ``num_layers_in_first_pipeline_stage`` /
    ``num_layers_in_last_pipeline_stage``: Megatron's uneven first and last pipeline
    ranks, checked by :func:`layers_per_pipeline_stage` in place of rule 9's equal stages.
    """
    call = "validate(parallel, model=None, train=None, layout='megatron')"
    _check_config_type("parallel", parallel, ParallelConfig, call)
    _check_config_type("model", model, ModelConfig, call, optional=True)
    _check_config_type("train", train, TrainConfig, call, optional=True)
    for config in (parallel, model, train):
        if config is not None:
            check_field_types(config)
    check_grid(parallel, layout)
    tp, ep = parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size

    # Rule 2, the course's guard against TP > 1 with EP > 1, is lifted: Megatron runs both
    # on its folded grids, and so does the course (each TP rank routes its own
    # sequence-parallel tokens; the all-to-all runs over the expert grid's EP group, the
    # expert shards over its expert-TP group).  The number stays retired so that the other
    # rules keep theirs.

    if train is not None:
        _check_positive_int("global_batch_size", train.global_batch_size)
        m = train.num_microbatches
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ConfigError(
                "rule 3",
                f"num_microbatches must be a whole number >= 1, got {m!r}",
            )
        dp = parallel.data_parallel_size
        if train.global_batch_size % dp:
            raise ConfigError(
                "rule 3",
                f"global_batch_size ({train.global_batch_size}) must be divisible by the "
                f"data-parallel size ({dp}) so every replica gets the same number of "
                f"sequences; try {_nearest_multiples(train.global_batch_size, dp)}",
            )
        per_replica = train.global_batch_size // dp
        if per_replica % m:
            raise ConfigError(
                "rule 3",
                f"each data-parallel replica's batch ({train.global_batch_size} / {dp} = "
                f"{per_replica} sequences) must be divisible by num_microbatches ({m}); "
                f"make num_microbatches {_one_of_divisors(per_replica)}",
            )

    if model is None:
        return
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
        _check_positive_int(name, getattr(model, name))
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    for name in () if cost_model else COST_MODEL_FIELDS:
        if getattr(model, name) != defaults[name]:
            raise ConfigError("model", f"{name} ({getattr(model, name)!r}) is counted by the cost "
                                       f"models only (the memory model's presets, chapter 13's "
                                       f"planner): the course's layers do not build it; leave it "
                                       f"at {defaults[name]!r} to train")
    for name in ("num_shared_experts", "first_k_dense_replace"):
        value = getattr(model, name)
        if value < 0:
            raise ConfigError("malformed", f"{name} must be >= 0, got {value}; "
                                           f"0 means {_ZERO_MEANS[name]}")
    for name in ("ffn_hidden_size", "moe_ffn_hidden_size"):
        if getattr(model, name) is not None:
            _check_positive_int(name, getattr(model, name))
    if model.num_experts < 0:
        raise ConfigError("malformed", f"num_experts must be >= 0, got {model.num_experts}; "
                                       f"0 means a dense model")
    if ep > 1 and not model.num_experts:
        raise ConfigError(
            "rule 4",
            f"expert_model_parallel_size ({ep}) splits routed experts over ranks, but the "
            f"model is dense (num_experts 0); use expert_model_parallel_size 1, or "
            f"num_experts {_nearest_multiples(ep, ep)}",
        )
    if model.num_experts:
        _check_positive_int("num_experts", model.num_experts)
        _check_positive_int("moe_router_topk", model.moe_router_topk)
        if model.num_experts % ep:
            raise ConfigError(
                "rule 4",
                f"num_experts ({model.num_experts}) must be divisible by "
                f"expert_model_parallel_size ({ep}) so every EP rank holds the same number "
                f"of experts; try {_nearest_multiples(model.num_experts, ep)} experts",
            )
        width = model.moe_ffn_hidden_size or model.hidden_size
        if width % etp:
            raise ConfigError(
                "rule 5",
                f"each routed expert's width (moe_ffn_hidden_size {width}"
                f"{'' if model.moe_ffn_hidden_size else ', from hidden_size'}) must be "
                f"divisible by expert_tensor_parallel_size ({etp}): its gate and up projections "
                f"are split over the ETP ranks by output channels and its down projection by "
                f"input channels, the same number on each; use expert_tensor_parallel_size "
                f"{_one_of_divisors(width, etp)}, or moe_ffn_hidden_size "
                f"{_nearest_multiples(width, etp)}",
            )
        shared = model.num_shared_experts * width
        if shared and shared % tp:
            raise ConfigError(
                "rule 5",
                f"the shared experts' width (num_shared_experts {model.num_shared_experts} x "
                f"{width} = {shared}) must be divisible by tensor_model_parallel_size ({tp}): "
                f"they are split over TP like a dense MLP (Megatron-Core's SharedExpertMLP), "
                f"the same number of channels on each rank; use moe_ffn_hidden_size "
                f"{_nearest_multiples(width, tp)}, or a TP size dividing {shared}",
            )
        if model.moe_router_topk > model.num_experts:
            raise ConfigError(
                "malformed",
                f"moe_router_topk ({model.moe_router_topk}) cannot exceed num_experts "
                f"({model.num_experts})",
            )
    if not 0.0 <= model.dropout < 1.0:
        raise ConfigError("malformed", f"dropout must be in [0, 1), got {model.dropout}")
    if model.dropout > 0 and (tp > 1 or ep > 1):
        raise ConfigError(
            "rule 7",
            f"dropout ({model.dropout}) must be 0.0 when tensor_model_parallel_size ({tp}) "
            f"or expert_model_parallel_size ({ep}) is > 1: ranks would draw different "
            f"masks for what must be one tensor; set dropout=0.0",
        )
    layers_per_pipeline_stage(model.num_layers, parallel.pipeline_model_parallel_size, 1,
                              num_layers_in_first_pipeline_stage,
                              num_layers_in_last_pipeline_stage)
    if model.num_attention_heads % tp:
        raise ConfigError(
            "rule 8",
            f"num_attention_heads ({model.num_attention_heads}) must be divisible by "
            f"tensor_model_parallel_size ({tp}) so each TP rank owns whole heads; try "
            f"{_nearest_multiples(model.num_attention_heads, tp)} heads",
        )
    if model.vocab_size % tp:
        raise ConfigError(
            "rule 10",
            f"vocab_size ({model.vocab_size}) must be divisible by tensor_model_parallel_size "
            f"({tp}): the embedding table and the LM head are split over TP ranks by vocabulary "
            f"rows, the same number on each. Use vocab_size "
            f"{_nearest_multiples(model.vocab_size, tp)} (Megatron pads the vocabulary up to a "
            f"multiple of make_vocab_size_divisible_by x TP instead; this course does not pad)",
        )
    if model.hidden_size % model.num_attention_heads:
        h, a = model.hidden_size, model.num_attention_heads
        raise ConfigError(
            "rule 11",
            f"hidden_size ({h}) must be divisible by num_attention_heads ({a}): each head "
            f"attends over hidden_size / num_attention_heads channels; use hidden_size "
            f"{_nearest_multiples(h, a)}, or a number of heads that divides {h}",
        )
    _check_context_parallel(parallel, model)
    moe_layers = model.num_experts > 0 and model.first_k_dense_replace < model.num_layers
    cp = parallel.context_parallel_size
    if (moe_layers or model.sequence_parallel) and tp > 1 and (model.seq_length // cp) % tp:
        mine = (f"each CP rank's {model.seq_length} / {cp} = {model.seq_length // cp} tokens"
                if cp > 1 else f"seq_length ({model.seq_length})")
        why = ("when sequence parallelism is on, so each TP rank gets an equal slice of tokens"
               if model.sequence_parallel else
               "in a model with MoE layers: with TP > 1 each MoE layer splits the sequence "
               "over the TP ranks (Megatron-Core's MoE layer refuses to train under TP without "
               "sequence parallelism)")
        raise ConfigError(
            "rule 6",
            f"{mine} must be divisible by tensor_model_parallel_size ({tp}) {why}; "
            f"try seq_length {_nearest_multiples(model.seq_length, tp * cp)}",
        )


def _check_context_parallel(parallel: ParallelConfig, model: ModelConfig) -> None:
    """The comm type's name (malformed), rule 12 (the 2 x CP chunks) and rule 13 (Ulysses heads).

    Megatron-LM's ``validate_args`` asserts ``seq_length % (2 * context_parallel_size) == 0``
    when CP > 1 (``megatron/training/arguments.py``, Megatron-Core 0.20.0, d98e8a64), and
    Transformer Engine's all-to-all attention asserts that the heads it is given divide by
    the CP size (``AttnFuncWithCPAndQKVOA2A``, TransformerEngine d0067d0d).
    """
    cp, tp = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    if model.cp_comm_type not in CP_COMM_TYPES:
        extra = (" (Megatron's hierarchical a2a+p2p is not implemented in this course)"
                 if model.cp_comm_type == "a2a+p2p" else "")
        raise ConfigError(
            "malformed",
            f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got "
            f"{model.cp_comm_type!r}{extra}; e.g. --cp-comm-type p2p",
        )
    if cp == 1:
        return
    if model.seq_length % (2 * cp):
        raise ConfigError(
            "rule 12",
            f"seq_length ({model.seq_length}) must be divisible by 2 x context_parallel_size "
            f"(2 x {cp} = {2 * cp}): the sequence is cut into {2 * cp} equal chunks and CP "
            f"rank r keeps chunks r and {2 * cp - 1} - r, so that causal attention costs every "
            f"rank the same (Megatron asserts the same); try seq_length "
            f"{_nearest_multiples(model.seq_length, 2 * cp)}",
        )
    heads = model.num_attention_heads // tp if model.num_attention_heads % tp == 0 else None
    if model.cp_comm_type == "a2a" and heads is not None and heads % cp:
        raise ConfigError(
            "rule 13",
            f"cp_comm_type 'a2a' (Ulysses) gives each CP rank whole attention heads: the "
            f"{heads} heads of each TP rank (num_attention_heads {model.num_attention_heads} / "
            f"TP {tp}) must be divisible by context_parallel_size ({cp}); use "
            f"{_one_of_divisors(heads)} CP ranks, {_nearest_multiples(heads, cp) if heads >= cp else cp}"
            f" heads per TP rank, or --cp-comm-type p2p or all_gather, which split no heads",
        )


_ZERO_MEANS = {"num_shared_experts": "no shared expert",
               "first_k_dense_replace": "every layer is an MoE layer"}


def check_sharding_flags(use_distributed_optimizer: bool, strategy: str | None) -> None:
    """``--use-distributed-optimizer`` is the ``optim`` strategy by its older name: given
    beside ``--data-parallel-sharding-strategy``, the two must agree."""
    if use_distributed_optimizer and strategy not in (None, "optim"):
        raise ConfigError("sharding strategy",
                          f"--use-distributed-optimizer is the optim strategy, but "
                          f"--data-parallel-sharding-strategy is {strategy}; give one of the two")


def check_pipeline_layers(num_layers: int, pipeline_model_parallel_size: int,
                          virtual_pipeline_model_parallel_size: int = 1) -> int:
    """Rule 9: ``num_layers`` splits evenly into ``PP * V`` model stages; returns layers per stage.

    Each of the ``PP`` ranks holds ``V`` chunks (``V = 1`` without interleaving), and
    every chunk the same number of consecutive layers, so stages cost the same.
    """
    _check_positive_int("num_layers", num_layers)
    _check_positive_int("pipeline_model_parallel_size", pipeline_model_parallel_size)
    _check_positive_int("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size)
    stages = pipeline_model_parallel_size * virtual_pipeline_model_parallel_size
    if num_layers % stages:
        what = (f"pipeline_model_parallel_size ({pipeline_model_parallel_size})"
                if virtual_pipeline_model_parallel_size == 1 else
                f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size "
                f"({pipeline_model_parallel_size} x {virtual_pipeline_model_parallel_size} = {stages})")
        raise ConfigError(
            "rule 9",
            f"num_layers ({num_layers}) must be divisible by {what} so every pipeline stage "
            f"holds the same number of layers; try num_layers {_nearest_multiples(num_layers, stages)}",
        )
    return num_layers // stages


def layers_per_pipeline_stage(num_layers: int, pipeline_model_parallel_size: int,
                              virtual_pipeline_model_parallel_size: int = 1,
                              num_layers_in_first_pipeline_stage: int | None = None,
                              num_layers_in_last_pipeline_stage: int | None = None) -> list[int]:
    """Layers of each model stage, in model order (stage ``v PP + r`` is chunk ``v`` of
    pipeline rank ``r``), under rule 9 or Megatron's uneven first and last stages.

    Without the two counts it is rule 9 (:func:`check_pipeline_layers`): every stage the
    same.  With them, as Megatron-Core splits a decoder (``--decoder-first-pipeline-num-layers``,
    ``--decoder-last-pipeline-num-layers``; ``TransformerConfig.__post_init__`` and
    ``transformer_block.get_num_layers_to_build``): the first (last) pipeline rank holds
    that many layers, each count at least 1 and divisible by ``V``; the layers left divide
    equally over the middle ranks, each rank's share divisible by ``V``; with two ranks and
    both counts given they must add up to the layers.  A rank's layers are cut into its
    ``V`` chunks equally.  :class:`ConfigError` names the rule, the numbers and a fix."""
    pp, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    if first is None and last is None:
        return [check_pipeline_layers(num_layers, pp, v)] * (pp * v)
    _check_positive_int("num_layers", num_layers)
    _check_positive_int("pipeline_model_parallel_size", pp)
    _check_positive_int("virtual_pipeline_model_parallel_size", v)
    fix = ("choose the first and last counts so the layers left divide equally over the "
           "middle ranks, or leave both out for equal stages")
    if pp < 2:
        raise ConfigError("uneven pipeline", f"--decoder-first/last-pipeline-num-layers need "
                                             f"PP >= 2, got PP {pp}; leave them out")
    middle_layers, middle_ranks = num_layers, pp
    for flag, count in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError("uneven pipeline", f"{flag} must be a whole number >= 1, got "
                                                 f"{count!r}")
        if count % v:
            raise ConfigError("uneven pipeline", f"{flag} ({count}) must divide by the virtual "
                                                 f"pipeline size ({v}): each of the rank's "
                                                 f"{v} chunks holds an equal share; {fix}")
        middle_layers, middle_ranks = middle_layers - count, middle_ranks - 1
    if middle_layers < 0 or bool(middle_layers) != bool(middle_ranks):
        raise ConfigError("uneven pipeline", f"{middle_layers} layers are left for {middle_ranks} "
                                             f"middle pipeline ranks (--num-layers {num_layers}, "
                                             f"first {first}, last {last}); {fix}")
    if middle_ranks and middle_layers % (middle_ranks * v):
        raise ConfigError("uneven pipeline", f"the {middle_layers} layers left must divide "
                                             f"equally over {middle_ranks} middle ranks x {v} "
                                             f"chunks; {fix}")
    per_rank = [middle_layers // middle_ranks if middle_ranks else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return [per_rank[r] // v for _ in range(v) for r in range(pp)]


def uneven_split(num_layers: int, pp: int,
                 virtual_pipeline_size: int = 1) -> tuple[int, int] | None:
    """``(first, last)``: the most even uneven split Megatron accepts
    (:func:`layers_per_pipeline_stage`), for a PP that does not divide the layers: every
    middle rank holds ``ceil(L / PP)`` layers (rounded up to a multiple of ``V``), the
    first and last rank share the rest, the first the smaller half (Llama 3 405B's 126
    layers on 16 ranks: 7, then 14 x 8, then 7; Meta took one layer off the first and the
    last stage, Llama 3 report section 3.3.2).  ``None`` where no such split exists."""
    v = virtual_pipeline_size
    if pp < 2:
        return None
    middle = 0 if pp == 2 else -(-num_layers // pp)
    middle = -(-middle // v) * v
    rest = num_layers - middle * (pp - 2)
    first = rest // 2 // v * v
    last = rest - first
    if first < v or last % v or (pp > 2 and last > middle):
        return None
    return first, last


def default_pipeline_split(num_layers: int, pp: int,
                           virtual_pipeline_size: int = 1) -> tuple[int | None, int | None]:
    """The first and last pipeline ranks' layers when none are given: ``(None, None)``
    (equal stages) where ``PP x V`` divides the layers or no uneven split exists (rule 9
    then names the numbers), else :func:`uneven_split`'s most even one.  The planner and
    the memory model's presets both take it."""
    if num_layers % (pp * virtual_pipeline_size) == 0:
        return None, None
    return uneven_split(num_layers, pp, virtual_pipeline_size) or (None, None)


# --- the command line, built from the dataclasses ---------------------------


def field_docs(cls) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls``: the string literal under the field.

    Read from the source of ``cls`` and its bases with :mod:`ast`.  A field made by
    :func:`config_fields` has no source of its own: it takes the docstring of the field
    it copies, found through ``metadata["config"]``.
    """
    return dict(_field_docs(cls))


@functools.lru_cache(maxsize=None)
def _field_docs(cls) -> dict[str, str]:
    docs = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # a builtin, or a class made at run time
            continue
        body = tree.body[0].body
        for statement, after in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[statement.target.id] = inspect.cleandoc(after.value.value)
    for f in fields(cls):
        if "config" in f.metadata:
            docs[f.name] = field_docs(f.metadata["config"])[f.name]
    return {f.name: docs[f.name] for f in fields(cls) if f.name in docs}


def config_fields(sources: dict, defaults: dict | None = None) -> type:
    """A dataclass holding, flat, the fields named in ``sources`` (``{config class: names}``).

    Each field keeps the type, the default and the metadata (``choices``) of the config
    dataclass it comes from, unless ``defaults`` gives another default, and names that class in
    ``metadata["config"]``, so its docstring stays the one documentation
    (:func:`field_docs`).  A dataclass that inherits from the result takes those fields
    as keyword arguments and attributes of its own (``TrainingArgs(num_layers=8)``).
    """
    defaults = defaults or {}
    copied = []
    for cls, names in sources.items():
        types, known = typing.get_type_hints(cls), {f.name: f for f in fields(cls)}
        for name in names:
            default = defaults.get(name, known[name].default)
            metadata = {**known[name].metadata, "config": cls}  # e.g. the field's "choices"
            copied.append((name, types[name], field(default=default, metadata=metadata)))
    return make_dataclass("ConfigFields", copied)


def _help_text(doc: str) -> str:
    """A docstring as one line of ``--help``: no reST markup, no ``%`` for argparse to expand."""
    for role in (":class:", ":func:", ":mod:", ":data:", ":meth:"):
        doc = doc.replace(role + "`~", "`").replace(role, "")
    return " ".join(doc.replace("``", "").replace("`", "").split()).replace("%", "%%")


def add_arguments(parser, cls, names=None) -> None:
    """Add one ``--name-with-dashes`` option per field of dataclass ``cls`` (or per name in ``names``).

    The type comes from the annotation (``int | None`` parses an ``int``; ``bool`` gives
    ``--flag`` / ``--no-flag``), the help from the field's docstring followed by its default
    (``not set`` for ``None``),
    ``choices`` and ``metavar`` from the field's metadata.  An option left out of the
    command line is left out of the parsed namespace too (``argparse.SUPPRESS``), so the
    caller can tell it from one given with the default value.
    """
    types, docs = typing.get_type_hints(cls), field_docs(cls)
    known = {f.name: f for f in fields(cls)}
    for name in names if names is not None else list(known):
        f, kind = known[name], types[name]
        kind = next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)
        options = {"dest": name, "default": argparse.SUPPRESS, "help": _help_text(docs.get(name, ""))}
        if f.default is MISSING:
            options["required"] = True
        else:  # a None default is an option left unset (e.g. a directory)
            shown = "not set" if f.default is None else f.default
            options["help"] += f" (default: {shown})".replace("%", "%%")
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind
        if "choices" in f.metadata:
            options["choices"] = f.metadata["choices"]
        elif kind is not bool:
            options["metavar"] = f.metadata.get("metavar", {int: "N", float: "X"}.get(kind, "VALUE"))
        parser.add_argument("--" + name.replace("_", "-"), **options)
