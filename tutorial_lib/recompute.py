"""Activation recomputation: keep less for backward, run part of the forward again.

Backward needs tensors that forward made (a linear layer's input, a LayerNorm's input and
statistics, attention's output and log-sum-exp ...).  Autograd keeps them from a layer's
forward until that layer's backward, so a pipeline stage that holds several microbatches
in flight holds several copies of every layer's activations.  Recomputation keeps only a
few tensors (a checkpointed region's inputs), drops the rest, and runs the region's
forward again inside backward to rebuild them.  Megatron's flags, and what they mean here
(Megatron-Core 0.20.0, d98e8a64)::

    --recompute-granularity full      whole layers, chosen by the method:
        --recompute-method uniform    the chunk's layers in groups of N, each group one
                                      checkpoint (only its input is kept)
        --recompute-method block      the first N layers of the chunk, each its own
                                      checkpoint; the other layers keep everything
        --recompute-num-layers N
    --recompute-granularity selective only the core attention (softmax(QK^T)V) of every
                                      layer; the projections, MLP and norms keep theirs

"Chunk" is what Megatron's ``TransformerBlock`` holds: a pipeline stage's layers, or one
model chunk's under the interleaved schedule (``num_layers_per_pipeline_rank =
len(self.layers)``).  The rule is pure data here (:func:`recompute_groups`,
:func:`kept_per_layer`), read by :class:`tutorial_lib.deepseek.DeepSeekModel` to run it
and by the memory model to count it; :func:`checkpoint` runs one region.

**The cost.**  A recomputed region runs its forward twice, and so issues every collective
of its forward twice: a tensor-parallel layer's all-reduces (and, in a MoE layer, the
all-gather and the expert all-to-alls) come back during backward, tagged ``recompute=True``
in the trace.  Selective recomputation of the core attention repeats no collective (the
attention core is local to a TP rank's heads; under context parallelism its K/V exchange
is repeated).  :func:`checkpoint` turns off torch's early stop so that the whole region is
recomputed, as Megatron's ``tensor_parallel.checkpoint`` does: with early stop torch
halts the recomputation once it has rebuilt the last tensor backward needs, and a layer's
final all-reduce would not be repeated.

Not with a backward split into B and W (chapter 11's zero-bubble schedules):
:func:`tutorial_lib.arguments.validate_args` refuses the pair, since each autograd pass
that reaches a checkpointed region recomputes it, and W's passes do so out of step
between the ranks whose collectives the recomputation repeats.

A measurement of saved tensors must wrap a region from outside (around a whole stage's
forward, say): ``torch.autograd.graph.saved_tensors_hooks`` entered *inside* a
checkpointed region takes precedence over the checkpoint's own hooks and would keep every
tensor there, recomputation silently off.  From outside, the hooks see exactly what is
kept: the checkpoint's saved inputs (torch 2.13 saves them through the same hooks) and
the tensors of the layers not recomputed.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from .config import ConfigError

__all__ = ["RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "KEEP_ALL", "KEEP_INPUT",
           "KEEP_NOTHING", "KEEP_ALL_BUT_CORE_ATTENTION", "Recompute", "check_recompute",
           "recompute_groups", "kept_per_layer", "recomputed_at_once", "checkpoint"]

RECOMPUTE_GRANULARITIES = ("full", "selective")
"""``--recompute-granularity``: whole layers, or the core attention only."""
RECOMPUTE_METHODS = ("uniform", "block")
"""``--recompute-method`` (full granularity only): groups of N layers, or the first N."""

KEEP_ALL = "all"
"""The layer keeps every tensor its backward needs (no recomputation)."""
KEEP_INPUT = "input"
"""The layer starts a checkpointed region: it keeps its input ``[s, b, h]`` only."""
KEEP_NOTHING = "nothing"
"""Inside a uniform group, after its first layer: nothing (the group's input suffices)."""
KEEP_ALL_BUT_CORE_ATTENTION = "all_but_core_attention"
"""Selective: everything but what only the core attention keeps.  q, k and v stay (the
checkpoint's inputs), and so does the attention's output (``linear_proj`` keeps it as its
input); with torch's fused attention (the CPU's flash kernel in torch 2.13, flash or
memory-efficient on a GPU) that leaves its log-sum-exp, ``[b, heads / TP, s]`` values
per layer.  An unfused attention would drop its ``s x s`` probabilities here, the case
selective recomputation was made for (Korthikanti et al., 2022); Megatron-Core 0.20.0
warns that a fused attention has no need of it."""


@dataclass(frozen=True)
class Recompute:
    """Megatron's three recomputation settings (``TransformerConfig`` fields of the same
    names); the default recomputes nothing."""

    granularity: str | None = None
    """``None`` (keep everything), ``"full"`` (whole layers) or ``"selective"`` (core attention)."""
    method: str | None = None
    """``"uniform"`` or ``"block"``, with ``"full"`` only."""
    num_layers: int | None = None
    """N: layers per group (uniform) or layers recomputed per chunk (block); ``"full"`` only."""


def check_recompute(recompute: Recompute, num_layers: int = 0, pipeline_size: int = 1) -> None:
    """Megatron's rules for the three settings, as :class:`ConfigError` ``"recompute"``.

    From Megatron-Core 0.20.0 (d98e8a64): ``TransformerConfig.__post_init__``
    (megatron/core/transformer/transformer_config.py) wants a method and a number of layers
    with ``full`` and no number with ``selective``; ``validate_args``
    (megatron/training/arguments.py) wants no method with ``selective``.  Megatron's message
    asks for N between 1 and the layers per pipeline rank (``num_layers`` / ``pipeline_size``,
    checked here when ``num_layers`` is given) and silently ignores a method or N given
    without a granularity; this refuses that, since it recomputes nothing.
    """
    granularity, method, n = recompute.granularity, recompute.method, recompute.num_layers
    flags = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    if granularity is None:
        if method is not None or n is not None:
            given = " and ".join(f"{name} ({value!r})" for name, value in
                                 (("recompute_method", method), ("recompute_num_layers", n))
                                 if value is not None)
            raise ConfigError("recompute", f"{given} without recompute_granularity recomputes "
                                           f"nothing (Megatron ignores it); add "
                                           f"--recompute-granularity full, or drop it")
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError("recompute", f"recompute_granularity must be 'full' or 'selective', "
                                       f"got {granularity!r}")
    if method is not None and method not in RECOMPUTE_METHODS:
        raise ConfigError("recompute", f"recompute_method must be 'uniform' or 'block', got "
                                       f"{method!r}")
    if granularity == "selective":
        if method is not None:
            raise ConfigError("recompute", f"recompute_method ({method!r}) is not supported with "
                                           f"recompute_granularity 'selective' (it recomputes the "
                                           f"core attention of every layer); drop "
                                           f"--recompute-method")
        if n is not None:
            raise ConfigError("recompute", f"recompute_num_layers must be unset with "
                                           f"recompute_granularity 'selective', got {n}; drop "
                                           f"--recompute-num-layers")
        return
    per_rank = num_layers // pipeline_size if num_layers else None
    span = f"1 and num_layers_per_pipeline_rank ({per_rank})" if per_rank else "1 and the " \
        "layers per pipeline rank"
    if method is None:
        raise ConfigError("recompute", f"recompute_granularity 'full' needs recompute_method "
                                       f"'uniform' or 'block'; e.g. {flags}")
    if n is None:
        raise ConfigError("recompute", f"recompute_granularity 'full' needs recompute_num_layers "
                                       f"between {span}; e.g. {flags}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (per_rank and n > per_rank):
        raise ConfigError("recompute", f"recompute_num_layers must be between {span}, got {n!r}; "
                                       f"e.g. --recompute-num-layers 1")


def recompute_groups(layers: int, recompute: Recompute) -> list[tuple[int, int, bool]]:
    """How a chunk of ``layers`` layers runs: ``(start, end, checkpointed)`` runs of layers.

    Megatron-Core 0.20.0 (d98e8a64), megatron/core/recompute.py ``checkpointed_forward``
    (``TransformerBlock._checkpointed_forward`` until commit 118933a8, May 2026):
    *uniform* checkpoints layers ``[0, N)``, ``[N, 2N)``, ... (the last group may be
    shorter); *block* runs each layer alone and checkpoints the first N (all of them when
    N >= ``layers``).  Without full granularity the chunk is one run, not checkpointed
    (selective works inside layers).
    """
    if recompute.granularity != "full":
        return [(0, layers, False)] if layers else []
    n = recompute.num_layers
    if recompute.method == "uniform":
        return [(start, min(start + n, layers), True) for start in range(0, layers, n)]
    return [(index, index + 1, index < n) for index in range(layers)]


def kept_per_layer(layers: int, recompute: Recompute) -> tuple[str, ...]:
    """What each of a chunk's ``layers`` layers keeps for backward between its forward and
    its backward: one of :data:`KEEP_ALL`, :data:`KEEP_INPUT`, :data:`KEEP_NOTHING`,
    :data:`KEEP_ALL_BUT_CORE_ATTENTION` per layer, first to last.

    ``KEEP_INPUT`` is the layer's input hidden state (``[s, b, h]`` on this rank; under
    context parallelism ``s / CP`` tokens); a memory model turns the rest into bytes with
    its own per-layer counts.  While a checkpointed group's backward runs, its layers'
    full activations exist again, briefly (:func:`recomputed_at_once`).
    """
    if recompute.granularity == "selective":
        return (KEEP_ALL_BUT_CORE_ATTENTION,) * layers
    kept: list[str] = []
    for start, end, checkpointed in recompute_groups(layers, recompute):
        if checkpointed:
            kept += [KEEP_INPUT] + [KEEP_NOTHING] * (end - start - 1)
        else:
            kept += [KEEP_ALL] * (end - start)
    return tuple(kept)


def recomputed_at_once(layers: int, recompute: Recompute) -> int:
    """The most layers whose full activations one backward rebuilds at once (the largest
    checkpointed group; 0 without full recomputation): the transient on top of what is kept."""
    return max((end - start for start, end, checkpointed in recompute_groups(layers, recompute)
                if checkpointed), default=0)


# --- running a region ----------------------------------------------------------------------


def checkpoint(function, *args):
    """``function(*args)``, its tensors dropped and recomputed in backward.

    ``torch.utils.checkpoint.checkpoint`` in its non-reentrant form (``use_reentrant=False``,
    torch's recommendation; Megatron's own ``tensor_parallel.checkpoint`` is the reentrant
    kind), with early stop off so the whole region runs again (see the module doc), and the
    recomputation's trace events tagged as the forward's were (its layer, say), plus
    ``recompute=True``.  ``function`` must compute the
    same thing twice: here every random choice (dropout masks) is drawn from the batch's
    row indices, not from a generator's state.  Non-tensor arguments are held, not saved.
    """
    import torch.utils.checkpoint

    from .trace import get_tracer

    def contexts():  # called by the forward; the second context wraps each recomputation
        return nullcontext(), _RecomputeTags(get_tracer().current_tags())

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=contexts, early_stop=False)



class _RecomputeTags:
    """The forward's trace tags plus ``recompute=True``, around each recomputation of a
    region: entered again for every backward pass that needs its tensors (a split
    backward's B and W are two passes, and each recomputes)."""

    def __init__(self, tags: dict):
        self.tags, self.entered = tags, []

    def __enter__(self):
        from .trace import get_tracer
        self.entered.append(get_tracer().tags(**self.tags, recompute=True))
        self.entered[-1].__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)
