"""The 4D run's arguments and their validation, without torch (Megatron's ``arguments.py``).

:class:`TrainingArgs` holds everything ``examples/train_4d.py`` takes; :func:`validate_args`
checks all of it and :func:`load_config_file` / :func:`args_from_dict` read it from a
file.  Nothing here imports torch, so the command line parses and validates its
arguments, and refuses a bad one with exit status 2 and a :class:`ConfigError` naming the
rule, the value and a fix, before it loads torch or starts a worker (Megatron's
``megatron/training/arguments.py`` likewise parses and validates before initializing).
:mod:`tutorial_lib.train_4d` re-exports every name here.

What :func:`validate_args` checks, in order: every field's type, the schedule and P2P
mode, the device's name, the run's own numbers (``steps``, ``seed``, ``lr``, ``clip_grad``, ``timeout``),
the layout and model rules of :func:`tutorial_lib.config.validate`, the interleaved
schedule's rules, the recomputation flags (:func:`tutorial_lib.recompute.check_recompute`),
the precision recipe (a name, or a file that is read and checked), and
last whether the run fits in this machine's memory (:mod:`tutorial_lib.costs.memory_model`).
Whether ``--device cuda`` finds a GPU for every rank needs torch, so it is checked when the
run starts, before any worker does (:func:`tutorial_lib.launch.choose_backend`).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, fields

from . import checkpointing
from .config import (SHARDING_STRATEGIES, ZERO_STAGE, ConfigError, ModelConfig, ParallelConfig,
                     TrainConfig, check_field_types, check_number, check_pipeline_layers,
                     check_sharding_flags, config_fields, validate)
from .costs.memory_model import (RUNTIME_BYTES_PER_RANK, RankMemory, available_memory_bytes, format_bytes,
                           memory_on_this_machine, memory_per_rank)
from .pipeline_parallel.actions import (ALL_SCHEDULES, SPLIT_BACKWARD_SCHEDULES,
                                        TWO_CHUNK_SCHEDULES, check_microbatch_groups)
from .pipeline_parallel.modes import TRAINING_P2P_MODES, check_schedule_and_mode
from .recipes import RECIPES, PrecisionRecipe, resolve_recipe
from .recompute import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, Recompute, check_recompute

__all__ = ["CONFIG_FIELDS", "RUN_DEFAULTS", "SEED_RANGE", "DEVICES", "TrainingArgs", "validate_args",
           "resolve_precision_recipe", "check_memory", "load_config_file", "args_from_dict",
           "describe_run", "LOG_KEYS"]


#: The config dataclasses' fields the 4D run takes, flat in :class:`TrainingArgs`; each is
#: documented once, on its dataclass, and ``examples/train_4d.py --help`` prints that text.
CONFIG_FIELDS = {
    ParallelConfig: ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size", "context_parallel_size",
                     "expert_tensor_parallel_size"),
    TrainConfig: ("global_batch_size", "num_microbatches"),
    ModelConfig: ("seq_length", "num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                  "num_experts", "moe_router_topk", "first_k_dense_replace", "num_shared_experts",
                  "dropout", "cp_comm_type", "sequence_parallel"),
}

#: The 4D run's defaults where they differ from the dataclasses': one rank, a small MoE
#: model (4 routed experts) and a batch of 16 sequences in 4 microbatches.
RUN_DEFAULTS = {"world_size": 1, "num_experts": 4, "global_batch_size": 16, "num_microbatches": 4}

#: Where a run's tensors live, and the backend each means (``auto``: the launcher decides,
#: :func:`tutorial_lib.launch.choose_backend`).
DEVICES = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}

#: The seeds a run takes: Megatron-Core refuses a seed <= 0 and seeds numpy with it, whose
#: seeds end at 2**32 - 1 (``megatron/training/initialize.py``, ``_set_random_seed``).
SEED_RANGE = (1, 2**32 - 1)


@dataclass
class TrainingArgs(config_fields(CONFIG_FIELDS, RUN_DEFAULTS)):
    """Everything ``train_4d.py`` takes; field names are Megatron's flags with ``_`` for ``-``.

    The fields of :data:`CONFIG_FIELDS` come first, flat (``TrainingArgs(num_layers=8)``,
    ``args.num_layers``), with the defaults of :data:`RUN_DEFAULTS`; :meth:`configs` gives
    them back as the three config dataclasses.  The fields below are the run's own.
    """

    virtual_pipeline_model_parallel_size: int = 2
    """V: model chunks per rank for ``schedule="interleaved"`` (ignored by the other schedules)."""
    steps: int = 5
    """Optimizer steps: the run logs iterations 1 to ``steps`` (Megatron counts from 1)."""
    seed: int = 1234
    """Seeds the weights, the data and the dropout masks (1 to 2**32 - 1, as in Megatron)."""
    lr: float = 3e-3
    """Adam learning rate (finite, >= 0)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    schedule: str = field(default="1f1b", metadata={"choices": ALL_SCHEDULES})
    """Pipeline schedule: ``1f1b``, ``gpipe``, ``interleaved``, or one that splits the
    backward into B and W (chapter 11): ``zb-h1``, ``zbv`` and ``dualpipev`` (two chunks
    per rank in a V), ``dualpipe`` (two model copies, even PP and M)."""
    p2p_mode: str = field(default="batched", metadata={"choices": TRAINING_P2P_MODES})
    """P2P mode, one of Megatron's two: ``batched`` (its default, ``batch_p2p_comm``) or
    ``overlapped`` (``batch_p2p_comm=False``; Megatron-LM's default with interleaving). The
    interleaved schedule takes ``batched`` only with PP >= 3."""
    precision_recipe: str = field(default="fp32",
                                  metadata={"metavar": "{%s,FILE}" % ",".join(RECIPES)})
    """Precision recipe: ``fp32`` (nothing changes), ``bf16``, ``deepseek_v3``, or a path to a
    ``.json`` / ``.toml`` recipe file (:func:`tutorial_lib.precision.recipe_from_file`)."""
    timeout: float = 600.0
    """Seconds before the launcher declares a hang and prints what each rank waits in."""
    # --- checkpoints and the distributed optimizer (tutorial_lib.checkpointing) ---
    save: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Directory to save checkpoints in (``torch.distributed.checkpoint``, one ``iter_NNNNNNN``
    directory per save, committed atomically): every ``save_interval`` steps and after the last."""
    save_interval: int | None = None
    """Save every this many steps (needs ``save``; without it, only after the last step)."""
    load: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Directory to resume from, saved under any layout: the checkpoint its
    ``latest_checkpointed_iteration.txt`` names; training continues from that step up to
    ``steps``.  Load only checkpoints you trust: ``.metadata`` is a pickle (read here with
    an unpickler that admits torch.distributed.checkpoint's metadata classes only)."""
    ckpt_step: int | None = None
    """Load this iteration of ``load`` instead of the latest one."""
    keep_last: int | None = None
    """Keep only the last N committed checkpoints of ``save`` (older ones are deleted once a
    newer one is committed); not set: keep every one."""
    async_save: bool = False
    """Write checkpoints with ``torch.distributed.checkpoint.async_save`` (Megatron's
    ``--async-save``): training goes on while a background thread writes; a save waits
    for the one before it, which is committed only then (a kill meanwhile keeps the
    previous committed checkpoint)."""
    max_restarts: int = 0
    """When a worker dies (killed, out of memory), start the world again from the last
    committed checkpoint of ``save`` (from scratch without one), at most this many times
    (torchrun's flag; under torchrun pass it to torchrun instead)."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: shard Adam's state over the data-parallel ranks of each gradient domain (dense
    weights over ``dp``, routed experts over ``expert_dp``); the same losses as plain Adam."""
    data_parallel_sharding_strategy: str | None = field(
        default=None, metadata={"choices": SHARDING_STRATEGIES})
    """What data parallelism shards, by Megatron-FSDP's names: ``no_shard`` (plain data
    parallelism), ``optim`` (ZeRO-1, the same as ``use_distributed_optimizer``) or
    ``optim_grads`` (ZeRO-2: each decoder layer's gradients reduce-scattered in backward,
    routed experts over expert-DP) or ``optim_grads_params`` (ZeRO-3 / FSDP: the layers'
    weights gathered when used; not with a split backward nor recomputation), as chapter 12
    runs them (``tutorial_lib.fully_sharded_data_parallel``); not with dualpipe."""
    recompute_granularity: str | None = field(default=None,
                                              metadata={"choices": RECOMPUTE_GRANULARITIES})
    """Activation recomputation (Megatron's flag): ``full`` recomputes whole layers (with
    ``recompute_method`` and ``recompute_num_layers``), ``selective`` every layer's core
    attention; not set: every activation is kept for backward.  The losses do not change."""
    recompute_method: str | None = field(default=None, metadata={"choices": RECOMPUTE_METHODS})
    """With ``full``: ``uniform`` (each chunk's layers in groups of ``recompute_num_layers``,
    only each group's input kept) or ``block`` (the first ``recompute_num_layers`` layers of
    each chunk recomputed, the others keep everything)."""
    recompute_num_layers: int | None = None
    """With ``full``: N, from 1 to the layers per pipeline rank (``num_layers`` / PP)."""
    device: str = field(default="auto", metadata={"choices": tuple(DEVICES)})
    """Where every rank computes: ``cuda`` (one GPU per rank, NCCL: rank r on ``cuda:r``, or
    under torchrun ``cuda:LOCAL_RANK``), ``cpu`` (gloo), or ``auto``: cuda when every rank on
    this machine has its own GPU, else cpu (saying why when there are GPUs)."""

    def configs(self) -> tuple[ParallelConfig, ModelConfig, TrainConfig]:
        """The three dataclasses the validator and the model take."""
        def build(cls):
            return cls(**{name: getattr(self, name) for name in CONFIG_FIELDS[cls]})
        return build(ParallelConfig), build(ModelConfig), build(TrainConfig)

    @property
    def sharding_strategy(self) -> str:
        """The strategy either flag asks for: ``data_parallel_sharding_strategy``, else
        ``optim`` with ``use_distributed_optimizer``, else ``no_shard`` (``validate_args``
        refuses the two flags disagreeing)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"

    @property
    def zero_stage(self) -> int:
        """ZeRO's stage of :attr:`sharding_strategy`: 0 to 3."""
        return ZERO_STAGE[self.sharding_strategy]

    @property
    def distributed_optimizer(self) -> bool:
        """ZeRO-1, asked for by either flag."""
        return self.zero_stage == 1

    @property
    def recompute(self) -> Recompute:
        """The three ``recompute_*`` flags as the model takes them."""
        return Recompute(self.recompute_granularity, self.recompute_method,
                         self.recompute_num_layers)

    @property
    def chunks_per_rank(self) -> int:
        if self.schedule in TWO_CHUNK_SCHEDULES:  # a V, or DualPipe's two model copies
            return 2
        return self.virtual_pipeline_model_parallel_size if self.schedule == "interleaved" else 1

    @property
    def stages_per_rank(self) -> int:
        """Model stages of one model copy per rank: DualPipe's two chunks are one stage
        of each of its two copies, so its model is cut in ``PP`` stages."""
        return 1 if self.schedule == "dualpipe" else self.chunks_per_rank



def validate_args(args: TrainingArgs, local_ranks: int | None = None) -> None:
    """Every rule, checked before any worker starts; raises :class:`ConfigError`.

    ``local_ranks``: how many of the run's ranks this machine runs (torchrun's
    ``LOCAL_WORLD_SIZE``); ``None``: all of them, as ``train`` starts them here.
    """
    if not isinstance(args, TrainingArgs):
        raise ConfigError("malformed", f"validate_args takes a TrainingArgs, got {args!r} "
                                       f"({type(args).__name__}); build one: TrainingArgs(world_size=4)")
    check_field_types(args)
    check_schedule_and_mode(args.schedule, args.p2p_mode, args.pipeline_model_parallel_size)
    if args.device not in DEVICES:
        raise ConfigError("malformed", f"device must be one of {', '.join(DEVICES)}, got "
                                       f"{args.device!r}; e.g. --device cuda")
    if args.steps < 1:
        raise ConfigError("malformed", f"steps must be a whole number >= 1, got {args.steps}")
    low, high = SEED_RANGE
    if not low <= args.seed <= high:
        raise ConfigError("malformed", f"seed must be from {low} to {high} (2**32 - 1), got {args.seed}: "
                                       f"Megatron refuses a seed <= 0 and seeds numpy with it, "
                                       f"whose seeds stop at 2**32 - 1; e.g. --seed 1234")
    check_number("lr", args.lr, meaning="a NaN or infinite learning rate turns every weight "
                 "into NaN at the first Adam step, a negative one climbs the loss (Megatron "
                 "asserts 0 <= min_lr <= lr); e.g. --lr 3e-3")
    check_number("clip_grad", args.clip_grad, meaning="0 turns clipping off, a positive value is "
                 "the largest global gradient norm allowed (Megatron clips only when clip_grad "
                 "> 0, so a negative or NaN value there means 'off' without a word; say 0); "
                 "e.g. --clip-grad 1.0")
    check_number("timeout", args.timeout, above_minimum=True, meaning="the seconds the launcher "
                 "waits before it declares a hang; e.g. --timeout 600")
    parallel, model, train = args.configs()
    validate(parallel, model, train)
    if args.num_experts and args.first_k_dense_replace > args.num_layers:
        raise ConfigError("malformed", f"first_k_dense_replace ({args.first_k_dense_replace}) "
                                       f"is more than the model's num_layers ({args.num_layers}): "
                                       f"the first k layers are dense, the rest MoE; e.g. "
                                       f"--first-k-dense-replace 1 (--num-experts 0: no MoE)")
    pp, v = args.pipeline_model_parallel_size, args.chunks_per_rank
    if args.schedule == "interleaved":
        if pp < 2 or v < 2:
            raise ConfigError("interleaved schedule",
                              f"the interleaved schedule needs pipeline_model_parallel_size >= 2 and "
                              f"virtual_pipeline_model_parallel_size >= 2, got {pp} and {v}")
        check_microbatch_groups(pp, args.num_microbatches)  # M a multiple of PP (Megatron's default)
    _check_split_backward_schedule(args)
    check_pipeline_layers(args.num_layers, pp, args.stages_per_rank)
    check_recompute(args.recompute, args.num_layers, pp)
    if args.recompute_granularity and args.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError("recompute", f"activation recomputation (--recompute-granularity "
                          f"{args.recompute_granularity}) does not run with --schedule "
                          f"{args.schedule}: its backward is split into B and W, separate "
                          f"autograd passes, and every pass that reaches a checkpointed region "
                          f"recomputes it again, its collectives out of step between the ranks; "
                          f"use --schedule 1f1b, interleaved or gpipe, or no recomputation")
    _check_sharding_strategy(args)
    resolve_precision_recipe(args.precision_recipe)
    _validate_checkpoint_args(args)
    check_memory(args, local_ranks=local_ranks)


RUN_SHARDING_STRATEGIES = SHARDING_STRATEGIES
"""The sharding strategies a 4D run takes: all four, as chapter 12 runs them."""


def _check_sharding_strategy(args: TrainingArgs) -> None:
    """``--data-parallel-sharding-strategy``: agreeing with ``--use-distributed-optimizer``
    (the ``optim`` strategy by its older name); ZeRO-2 and ZeRO-3 only where they run: not
    with DualPipe's two model copies, and ZeRO-3 neither with a split backward nor with
    recomputation.  Their checkpoints save and load under every layout
    (:func:`tutorial_lib.dist_checkpointing.unit_piece`)."""
    strategy = args.data_parallel_sharding_strategy
    if strategy is None:
        return
    check_sharding_flags(args.use_distributed_optimizer, strategy)
    stage = ZERO_STAGE[strategy]
    if stage < 2:
        return
    if args.schedule == "dualpipe":
        raise ConfigError(
            "sharding strategy",
            f"--data-parallel-sharding-strategy {strategy} does not run with --schedule "
            f"dualpipe: its two model copies' gradients are summed after the backward "
            f"(pipeline_parallel.dualpipe.sum_model_copy_gradients), but ZeRO-{stage} has "
            f"reduce-scattered and freed them during it; use --schedule dualpipev (one copy, "
            f"the same V-shaped overlap) or --data-parallel-sharding-strategy optim")
    if stage == 3 and args.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(
            "sharding strategy",
            f"--data-parallel-sharding-strategy {strategy} does not run with --schedule "
            f"{args.schedule}: a unit is gathered for its backward by a hook on its output "
            f"and freed once its weight gradients are in, but this schedule computes them in "
            f"W, a later pass, so each unit would stay gathered from B to W; use --schedule "
            f"1f1b, interleaved or gpipe, or --data-parallel-sharding-strategy optim_grads")
    if stage == 3 and args.recompute_granularity:
        raise ConfigError(
            "sharding strategy",
            f"--data-parallel-sharding-strategy {strategy} does not run with "
            f"--recompute-granularity {args.recompute_granularity}: the recomputed forward, "
            f"inside the backward, fires the unit's hooks again and frees its weights after "
            f"it, before the backward that needs them; drop the recomputation, or use "
            f"--data-parallel-sharding-strategy optim_grads")


def _check_split_backward_schedule(args: TrainingArgs) -> None:
    """Chapter 11's schedules: ZBV and DualPipeV fold ``2 PP`` stages in a V over ``PP >= 2``
    ranks (DualPipeV runs ``M >= 2 PP`` microbatches); DualPipe sends half the microbatches from each end of ``PP`` ranks, paired
    rank ``r`` with ``PP - 1 - r`` (DeepSeek's DualPipe asserts an even ``PP`` and an
    even number of microbatches, at least ``2 PP``: deepseek-ai/DualPipe,
    dualpipe/dualpipe.py, ``DualPipe.step``, 3da1bbea) and holds two copies of the
    weights, which this course does not checkpoint."""
    pp, m, name = args.pipeline_model_parallel_size, args.num_microbatches, args.schedule
    if name in TWO_CHUNK_SCHEDULES and pp < 2:
        raise ConfigError(f"{name} schedule",
                          f"--schedule {name} needs pipeline_model_parallel_size >= 2, got "
                          f"{pp}: it places two chunks per rank across a pipeline; use "
                          f"--pipeline-model-parallel-size 2 or more, or --schedule 1f1b")
    if name == "dualpipev" and m < 2 * pp:
        raise ConfigError("dualpipev schedule",
                          f"--schedule dualpipev needs num_microbatches >= 2 x PP, got M = {m} "
                          f"with PP = {pp}: its steady state pairs a forward with a backward "
                          f"only after 2 PP forwards (deepseek-ai/DualPipe, "
                          f"dualpipe/dualpipev.py, DualPipeV.step); e.g. --num-microbatches "
                          f"{2 * pp}")
    if name == "dualpipe" and (pp % 2 or m % 2 or m < 2 * pp):
        raise ConfigError("dualpipe schedule",
                          f"--schedule dualpipe needs an even pipeline_model_parallel_size "
                          f"and an even num_microbatches of at least 2 x PP, got PP = {pp} "
                          f"and M = {m}: half the microbatches enter at each end and rank r "
                          f"pairs with rank PP - 1 - r; e.g. --pipeline-model-parallel-size "
                          f"{pp + pp % 2} --num-microbatches {max(2 * (pp + pp % 2), m + m % 2)}")
    if name == "dualpipe" and (args.save or args.load):
        raise ConfigError("dualpipe schedule",
                          "--schedule dualpipe holds two copies of every weight; this course "
                          "does not save or load them: drop --save / --load, or train with "
                          "--schedule dualpipev (one copy, the same V-shaped overlap)")


def _validate_checkpoint_args(args: TrainingArgs) -> None:
    """``save`` / ``save_interval`` / ``load`` / ``ckpt_step``: the checkpoint to load must be
    complete and of this model (:mod:`tutorial_lib.checkpointing`), read before any worker starts."""
    checkpointing.check_save_args(args.save, args.save_interval, args.keep_last)
    if args.max_restarts < 0:
        raise ConfigError("checkpoint", f"max_restarts must be a whole number >= 0, got "
                                        f"{args.max_restarts}; e.g. --max-restarts 2")
    found = checkpointing.check_load_args(args.load, args.ckpt_step)
    if found is not None:
        checkpointing.check_checkpoint_args(found.common, args, found.path)
        checkpointing.verify_checkpoint(found)  # before any worker unpickles its .metadata


def _names_a_file(name: str) -> bool:
    """Whether a ``precision_recipe`` that is not a recipe name is meant as a file."""
    return (name.lower().endswith((".json", ".toml")) or os.sep in name
            or (os.altsep is not None and os.altsep in name))


def resolve_precision_recipe(name_or_path: str) -> PrecisionRecipe:
    """The recipe named by ``precision_recipe``, or a :class:`ConfigError` naming the choices.

    A value that names a file (a ``.json`` / ``.toml`` name, or a path) which does not
    exist is refused as "file not found", not as an unknown recipe name.
    """
    choices = f"choose one of {', '.join(RECIPES)} or a .json / .toml recipe file"
    if name_or_path not in RECIPES and not os.path.exists(name_or_path) \
            and _names_a_file(name_or_path):
        raise ConfigError("precision recipe", f"precision_recipe file not found: "
                          f"{name_or_path!r} ({os.path.abspath(name_or_path)} does not exist); "
                          f"give the path of a .json / .toml recipe file, or one of "
                          f"{', '.join(RECIPES)}")
    if name_or_path not in RECIPES and not os.path.isfile(name_or_path):
        raise ConfigError("precision recipe", f"unknown precision_recipe {name_or_path!r}: "
                          f"{choices} (precision.recipe_from_file)")
    try:
        return resolve_recipe(name_or_path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ConfigError("precision recipe", f"the recipe file {name_or_path!r} cannot be used: "
                          f"{error}; {choices}") from None


#: What each key of a step's record means (``examples/train_4d.py --json`` prints one
#: record per line; the text lines abbreviate the keys named in brackets).
LOG_KEYS = {
    "iteration": "the optimizer steps done, counted from 1 (Megatron's iteration; the "
                 "checkpoint saved after it is iter_<iteration>)",
    "loss": "the language-model loss, the mean over every token of the global batch",
    "sequence_balance_loss": "[seq-balance] DeepSeek-V3's complementary sequence-wise "
                             "balance loss (alpha = 1e-4 included), summed over the MoE "
                             "layers, mean over the microbatches",
    "max_violation": "[MaxVio] (load of the busiest expert - mean load) / mean load, the "
                     "step's expert loads over the whole global batch, mean over the MoE "
                     "layers: 0 is perfect balance, 1 a busiest expert with twice its share",
    "grad_norm": "[grad-norm] the global gradient norm before clipping",
    "step_time_s": "wall-clock seconds of the step",
    "tokens_per_s": "[tok/s] tokens of the global batch per second of the step",
    "peak_activations": "the most microbatch activations rank 0 held at once",
    "memory": "this rank's bytes after the step: weights, gradients, optimizer (from the "
              "tensors), activations_per_microbatch (autograd's saved tensors per "
              "'microbatch,chunk'), peak_activations (their most at once), on CUDA "
              "cuda_max_memory_allocated; predicted by tutorial_lib.costs.memory_model",
}


def describe_run(args: TrainingArgs, legend: bool = True) -> str:
    """The banner a run prints before it starts: layout, schedule, P2P mode, recipe.

    ``TP2 x PP2 x EP1 x DP2 = 8 ranks`` with the experts' grid and Megatron's rank
    order (``tutorial_lib.grid``), the schedule with its microbatches (and chunks when
    interleaved), the P2P mode, the precision recipe, and the iterations it will run
    (from the checkpoint's when it loads one).  ``legend``: with experts, add what the
    progress lines' ``seq-balance`` and ``MaxVio`` are (:data:`LOG_KEYS`).
    """
    from .grid import MEGATRON_ORDER

    parallel, _, _ = args.configs()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    world = parallel.world_size
    cp = parallel.context_parallel_size
    cp_part = f"CP{cp} ({args.cp_comm_type}) x " if cp > 1 else ""  # shown when it splits
    sp_part = " (sequence parallel)" if args.sequence_parallel and tp > 1 else ""
    layout = (f"TP{tp}{sp_part} x {cp_part}PP{pp} x EP{ep} x DP{parallel.data_parallel_size} = "
              f"{world} rank{'s' * (world > 1)}")
    if args.num_experts:
        layout += (f" (experts: ETP{etp} x EP{ep} x EDP{parallel.expert_data_parallel_size}"
                   f")")
    layout += f"; Megatron's rank order {MEGATRON_ORDER}"
    schedule = f"{args.schedule}, M = {args.num_microbatches} microbatches per replica"
    if args.schedule == "interleaved":
        schedule += f", V = {args.virtual_pipeline_model_parallel_size} chunks per rank"
    elif args.schedule == "dualpipe":
        schedule += ", two model copies (a stage of each per rank), backwards split in B and W"
    elif args.schedule in TWO_CHUNK_SCHEDULES:
        schedule += ", 2 chunks per rank in a V, backwards split in B and W"
    elif args.schedule == "zb-h1":
        schedule += ", backwards split in B and W"
    if pp == 1:
        schedule += " (one stage: no pipeline)"
    if args.load:
        where = f"iteration {args.ckpt_step}" if args.ckpt_step else "the latest iteration"
        iterations = f"from {where} of {args.load} up to {args.steps}"
    else:
        iterations = f"1 to {args.steps}"
    if args.save:
        every = f"every {args.save_interval} and " if args.save_interval else ""
        iterations += f"; saves to {args.save} {every}after the last"
    device = {"cpu": "cpu (gloo)", "cuda": "cuda (NCCL, one GPU per rank)",
              "auto": "auto (cuda when every rank here has its own GPU, else cpu)"}[args.device]
    rows = [("layout", layout), ("schedule", schedule), ("P2P mode", args.p2p_mode),
            ("recipe", args.precision_recipe), ("device", device), ("iterations", iterations)]
    if args.distributed_optimizer:
        rows.append(("optimizer", "Adam, ZeRO-1 (use_distributed_optimizer)"))
    elif args.zero_stage == 2:
        rows.append(("optimizer", "Adam, ZeRO-2 (optim_grads: gradients and optimizer state "
                                  "sharded per layer)"))
    elif args.zero_stage == 3:
        rows.append(("optimizer", "Adam, ZeRO-3 (optim_grads_params: weights, gradients and "
                                  "optimizer state sharded per layer, gathered when used)"))
    if args.recompute_granularity:
        how = ", ".join(f"{name} {value}" for name, value in
                        (("method", args.recompute_method), ("N =", args.recompute_num_layers))
                        if value is not None)
        rows.append(("recompute", args.recompute_granularity + (f" ({how})" if how else "")))
    if legend and args.num_experts:
        for key in ("sequence_balance_loss", "max_violation"):
            name, meaning = LOG_KEYS[key][1:].split("] ", 1)
            rows.append((name, meaning))
    return "\n".join(f"train_4d: {name:<11} {value}" for name, value in rows)


def check_memory(args: TrainingArgs, available: int | None = None,
                 local_ranks: int | None = None) -> list[RankMemory]:
    """Refuse a run whose estimated memory (:func:`tutorial_lib.costs.memory_per_rank`) exceeds
    ``available`` bytes (default: what this machine has available now); returns the estimate.

    Compared with host memory, where the course's gloo workers keep every tensor.  When
    the worker processes alone cannot fit (``ranks x`` :data:`~tutorial_lib.costs.memory_model.
    RUNTIME_BYTES_PER_RANK`), the run is refused at once, with the first and last pipeline
    ranks' breakdown (a world of a million ranks is not added up rank by rank).
    """
    parallel, model, train = args.configs()
    source = "given"
    if available is None:
        found = available_memory_bytes()
        available, source = found if found is not None else (None, "")
    here = local_ranks if local_ranks is not None else parallel.world_size
    pp = parallel.pipeline_model_parallel_size
    # every schedule's own placement and activations in flight (chapter 11's V and
    # DualPipe's two copies included); ZeRO-3 prefetches the next layer of a chunk, which
    # the model's walk over all of a rank's units counts, or more (across chunks)
    estimate = functools.partial(memory_per_rank, model, parallel, train, args.schedule,
                                 args.chunks_per_rank,
                                 data_parallel_sharding_strategy=args.sharding_strategy,
                                 prefetch=True, recompute=args.recompute)
    if available is not None and here * RUNTIME_BYTES_PER_RANK > available:
        ranks, need = estimate(pipeline_ranks=sorted({0, pp - 1})), None
    else:
        ranks = estimate()
        need = memory_on_this_machine(ranks, local_ranks)
        if available is None or need <= available:
            return ranks
    lines = [r.describe() for r in ranks]
    if len(lines) > 6:
        lines = lines[:3] + [f"... ({len(lines) - 5} more pipeline ranks)"] + lines[-2:]
    elif len(ranks) < pp and pp > 2:
        lines.insert(1, f"... ({pp - 2} more pipeline ranks, not added up)")
    who = (f"{local_ranks} of its ranks" if local_ranks is not None
           else f"its {parallel.world_size} rank{'s' * (parallel.world_size > 1)}")
    amount = (f"about {format_bytes(need)}" if need is not None else
              f"at least {format_bytes(here * RUNTIME_BYTES_PER_RANK)} (the worker processes alone)")
    breakdown = "\n  ".join(lines)
    raise ConfigError(
        "memory",
        f"this run needs {amount} on this machine ({who}), more than the "
        f"{format_bytes(available)} available ({source}). Prediction per rank (fp32, "
        f"tutorial_lib.costs.memory_model; python -m tutorial_lib.memory prints it):\n  {breakdown}\n"
        f"Fix: a smaller model (hidden_size, num_layers, num_experts, vocab_size), fewer "
        f"ranks on this machine, more pipeline stages or TP / EP ranks to split the "
        f"weights, or fewer microbatches in flight (1f1b instead of gpipe, smaller "
        f"global_batch_size or seq_length)")


def load_config_file(path: str) -> dict:
    """The options in a ``--config`` file: a JSON object, or a TOML table for ``.toml``.

    Anything else (a missing, empty, binary or YAML file, a JSON list or string) is a
    :class:`ConfigError` that names the file and says what it holds.
    """
    fix = ('write the options as one JSON object, e.g. {"world_size": 4, "lr": 0.003}, or as '
           'a .toml file of key = value lines')
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise ConfigError("config file", f"cannot read the config file {path!r}: "
                                         f"{error.strerror or error}; {fix}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("config file", f"the config file {path!r} is not text (byte "
                                         f"{raw[:16]!r}... is not UTF-8); {fix}") from None
    if path.lower().endswith((".yaml", ".yml")):
        raise ConfigError("config file", f"the config file {path!r} is YAML, which train_4d does "
                                         f"not read; {fix}")
    if not text.strip():
        raise ConfigError("config file", f"the config file {path!r} is empty; {fix}")
    if path.lower().endswith(".toml"):
        import tomllib
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError("config file", f"the config file {path!r} is not valid TOML: "
                                             f"{error}; {fix}") from None
    else:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError("config file", f"the config file {path!r} is not valid JSON "
                                             f"({error.msg} at line {error.lineno} column "
                                             f"{error.colno}); {fix} (a .toml name reads TOML)") from None
    if not isinstance(values, dict):
        kind = {list: "an array", str: "a string", int: "a number", float: "a number",
                bool: "a boolean", type(None): "null"}.get(type(values), type(values).__name__)
        raise ConfigError("config file", f"the config file {path!r} holds {kind} "
                                         f"({_short(values)}), not an object of options; {fix}")
    return values


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def args_from_dict(values: dict, source: str | None = None) -> TrainingArgs:
    """A :class:`TrainingArgs` from a dict with Megatron flag names (``-`` or ``_``).

    Unknown names and values of the wrong type (``"lr": "fast"``) are a
    :class:`ConfigError`; ``source`` (e.g. the config file's name) starts its message.
    """
    where = f"{source}: " if source else ""
    if not isinstance(values, dict):
        raise ConfigError("malformed", f"{where}training options are a dict of name -> value, "
                                       f"got {type(values).__name__}")
    known = {f.name for f in fields(TrainingArgs)}
    clean = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(clean) - known)
    if unknown:
        raise ConfigError("malformed", f"{where}unknown training options {unknown}; known: {sorted(known)}")
    args = TrainingArgs(**clean)
    try:
        check_field_types(args)
    except ConfigError as error:
        raise ConfigError(error.rule, where + error.message) from None
    return args
