"""A small DeepSeek-style decoder that a pipeline can cut into stages (chapters 6-8).

Chapter 3's GPT (:mod:`tutorial_lib.gpt`) runs whole on every rank.  With pipeline
parallelism each rank holds a *stage*: a contiguous range of layers, plus the embedding on the first stage and the
final norm, LM head and loss on the last (Megatron's ``pre_process`` / ``post_process``).
One class serves every cut: ``DeepSeekModel(config, stage=s, num_stages=n)`` builds
only stage s's modules, with the same weights the whole model (``num_stages=1``) has
there, because every weight is drawn from a seed derived from its *global* layer index::

    stage 0:        input_ids [b, s] -> embedding -> layers [0, L/n)        -> hidden [s, b, h]
    middle stage:   hidden [s, b, h] -> layers [k L/n, (k+1) L/n)          -> hidden [s, b, h]
    last stage:     hidden [s, b, h] -> its layers -> final norm -> head -> loss (scalar)

What crosses a stage boundary is one activation tensor [s, b, h] forward and its
gradient backward: :mod:`tutorial_lib.pipeline_parallel.executor` moves them with :mod:`tutorial_lib.p2p`.

**Sequence parallelism** (``ModelConfig.sequence_parallel`` with TP > 1) runs through the
whole model, as in Megatron-Core's ``GPTModel``: the embedding's output is split over the
TP ranks (``scatter_to_sequence_parallel_region``, as chapter 3's
:class:`~tutorial_lib.gpt.GPTEmbedding`), every block takes and returns this rank's
``[s/T, b, h]`` (each attention and dense MLP gathers before its column-parallel layer and
reduce-scatters after its row-parallel one; each MoE layer routes the tokens it is given,
:class:`~tutorial_lib.moe.MoELayer` with ``input_is_sequence_parallel``), the final
LayerNorm runs on the shard, and the LM head gathers the sequence back before its
vocabulary-parallel matmul.  So the pipeline's messages are ``[s/T, b, h]`` (Megatron's
``tensor_shape[0] // tp`` in ``forward_backward_pipelining_with_interleaving``), and the
LayerNorms and routers, which see one TP rank's tokens each, are flagged
``sequence_parallel`` for :func:`~tutorial_lib.tensor_parallel.allreduce_sequence_parallel_grads`.
Without it (the default, as Megatron's ``--sequence-parallel`` is off by default) the
blocks keep the whole ``[s, b, h]`` on every TP rank and each MoE layer splits the
sequence over TP itself.  At TP = 1 the flag changes nothing (Megatron turns it off).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from . import parallel_state
from .config import ModelConfig, check_pipeline_layers
from .context_parallel import chunk_positions
from .devices import cpu_generator, module_device, resolve_device
from .gpt import FIRST_BLOCK, OUTPUT_LAYER, GPTEmbedding
from .moe import MoELayer
from .moe_balance import BalanceConfig
from .recompute import Recompute, check_recompute, checkpoint, recompute_groups
from .tensor_parallel import (
    derive_seed,
    ColumnParallelLinear,
    divide,
    vocab_parallel_cross_entropy,
)
from .trace import get_tracer
from .transformer import MLP, SelfAttention

__all__ = ["DeepSeekModel", "DeepSeekBlock", "Microbatch", "layer_range", "attach_aux_loss"]


class Microbatch(NamedTuple):
    """What a stage may need to know about the microbatch it is running.

    Every rank can compute ``sample_ids`` and ``step`` from the schedule alone; only the
    first stage holds ``input_ids``, and only the last stage ``labels`` (they travel from
    the first stage along the pipeline group).
    """

    input_ids: torch.Tensor | None
    """``[b, s]`` token ids (first stage only)."""
    labels: torch.Tensor | None
    """``[b, s]`` next-token targets (last stage only)."""
    sample_ids: torch.Tensor
    """``[b]`` each row's index in the global batch: it seeds that row's dropout masks."""
    step: int = 0
    """The optimizer step: a new step draws new dropout masks."""


def layer_range(num_layers: int, num_stages: int, stage: int) -> range:
    """The global indices of the layers model stage ``stage`` of ``num_stages`` holds.

    Contiguous and equal (rule 9): stage ``k`` holds ``[k L/n, (k+1) L/n)``.  With the
    interleaved schedule, rank ``r``'s chunk ``c`` is model stage ``c * PP + r``.
    """
    per_stage = check_pipeline_layers(num_layers, num_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage ({stage}) must be in 0..{num_stages - 1} for {num_stages} stages")
    return range(stage * per_stage, (stage + 1) * per_stage)


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: return ``hidden`` unchanged.  Backward: also send ``scale`` into ``aux_loss``.

    A MoE layer's balance loss is computed in the middle of the network, on whatever
    stage holds that layer, but the pipeline only backpropagates from the last stage's
    loss.  Tying the aux loss to the activation that flows on means that when the
    gradient of that activation arrives, the aux loss gets its own gradient too, as if
    it had been added to the final loss (Megatron's ``MoEAuxLossAutoScaler``).
    """

    @staticmethod
    def forward(ctx, hidden, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(hidden: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``hidden``, with ``aux_loss`` backpropagated (times ``scale``) whenever ``hidden`` is."""
    return _AttachAuxLoss.apply(hidden, aux_loss, scale)


def _dropout_mask(shape, p: float, sample_ids: torch.Tensor, seed: int, step: int, layer: int,
                  site: int, positions: torch.Tensor | None = None,
                  seq_length: int | None = None, device=None) -> torch.Tensor:
    """``[s, b, h]`` keep-mask scaled by ``1/(1-p)``; column ``j`` drawn from sample ``sample_ids[j]``.

    Each row of the global batch gets its own generator, seeded by (model seed, step,
    row, layer, site), so the mask does not depend on which rank, microbatch or stage
    runs the row: every layout drops the same activations.  (Megatron draws masks from
    a per-rank CUDA RNG state instead; its runs then differ between layouts.)  Under
    context parallelism ``positions`` are the ``s`` positions this rank holds: the whole
    sequence's mask (``seq_length`` rows) is drawn and those rows kept.  The masks are drawn
    on the CPU (every device gets the same ones) and returned on ``device``.
    """
    s, b, h = shape
    columns = []
    rows = positions.tolist() if positions is not None else None
    for row in sample_ids.tolist():
        key = (((seed * 1_000_003 + step) * 1_000_003 + row) * 1009 + layer) * 7 + site
        generator = cpu_generator(key % (2 ** 63))
        if positions is None:
            columns.append(torch.rand(s, h, generator=generator, device="cpu") >= p)
        else:
            columns.append(torch.rand(seq_length, h, generator=generator, device="cpu")[rows] >= p)
    mask = torch.stack(columns, dim=1).float() / (1.0 - p)
    return mask.to(resolve_device(device))


class DeepSeekBlock(torch.nn.Module):
    """``x + drop(attn(ln(x)))``, then ``+ drop(mlp(ln(x)))`` with a dense MLP or a DeepSeekMoE layer.

    ``layer_number``: the global index; layers below ``first_k_dense_replace`` (or all of
    them when ``num_experts == 0``) are dense.  A MoE layer uses DeepSeek-V3's routing
    (sigmoid scores, top-k normalised) and balancing (bias on the global load plus the
    sequence-wise loss).  With TP > 1 and ``sequence_parallel`` the block's input and
    output are this TP rank's ``[s/T, b, h]``: attention and dense MLP gather the
    sequence before their column-parallel layers and reduce-scatter after their
    row-parallel ones, the MoE layer routes the shard it is given, and the LayerNorms
    (flagged ``sequence_parallel``) normalise the shard.  With TP > 1 and no
    ``sequence_parallel`` attention and dense MLP are tensor-parallel on the whole sequence
    (all-reduces), and the MoE layer splits the sequence over TP itself (see
    :class:`~tutorial_lib.moe.MoELayer`), so the block's input and output are the full
    ``[s, b, h]`` on every TP rank.  With context parallelism (``cp_group`` of more than
    one rank) ``s`` is this CP rank's tokens, ``positions`` their places in the sequence:
    attention exchanges keys and values over the CP group (``config.cp_comm_type``) and
    every other part of the block works on the local tokens alone.  ``device``: where the
    weights live (``None``: torch's default device).
    """

    def __init__(self, config: ModelConfig, layer_number: int, seed: int = 0,
                 tp_group: str | None = "tp", ep_group: str | None = "ep",
                 cp_group: str | None = None, positions: torch.Tensor | None = None,
                 device=None, checkpoint_core_attention: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        h, block_seed = config.hidden_size, derive_seed(seed, FIRST_BLOCK + layer_number)
        self.layer_number, self.dropout, self.seed = layer_number, config.dropout, seed
        self.positions, self.seq_length = positions, config.seq_length
        device = resolve_device(device)
        self.input_layernorm = torch.nn.LayerNorm(h, device=device)
        self.self_attention = SelfAttention(h, config.num_attention_heads, sequence_parallel,
                                            block_seed, tp_group,
                                            cp_group, config.cp_comm_type, device=device,
                                            checkpoint_core_attention=checkpoint_core_attention)
        self.pre_mlp_layernorm = torch.nn.LayerNorm(h, device=device)
        for layernorm in (self.input_layernorm, self.pre_mlp_layernorm):
            for param in layernorm.parameters():
                param.sequence_parallel = sequence_parallel  # my s/T tokens: partial grads
        self.is_moe = bool(config.num_experts) and layer_number >= config.first_k_dense_replace
        if self.is_moe:
            self.mlp = MoELayer(
                h, config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size or h,
                num_shared_experts=config.num_shared_experts, score_function="sigmoid",
                balance=BalanceConfig.deepseek_v3(),
                sequence_parallel=parallel_state.group_size(tp_group) > 1, seed=block_seed,
                ep_group=ep_group, tp_group=tp_group, cp_group=cp_group, device=device,
                input_is_sequence_parallel=sequence_parallel)
        else:
            self.mlp = MLP(h, config.ffn_hidden_size or 4 * h, sequence_parallel, block_seed,
                           tp_group, device=device)

    def _drop(self, x: torch.Tensor, batch: Microbatch | None, site: int) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        if batch is None:
            raise ValueError("dropout > 0 needs the Microbatch (its sample_ids seed the masks)")
        return x * _dropout_mask(x.shape, self.dropout, batch.sample_ids, self.seed, batch.step,
                                 self.layer_number, site, self.positions, self.seq_length,
                                 device=x.device)

    def forward(self, x: torch.Tensor, batch: Microbatch | None = None):
        """``[s, b, h]`` -> ``([s, b, h], info)``; ``info`` is the MoE layer's (``{}`` if dense)."""
        x = x + self._drop(self.self_attention(self.input_layernorm(x)), batch, 0)
        info = {}
        if self.is_moe:
            y, info = self.mlp(self.pre_mlp_layernorm(x))
        else:
            y = self.mlp(self.pre_mlp_layernorm(x))
        return x + self._drop(y, batch, 1), info


class DeepSeekModel(torch.nn.Module):
    """One pipeline stage of a small DeepSeek-style decoder (all of it when ``num_stages=1``).

    ``config``: a :class:`~tutorial_lib.config.ModelConfig` (``num_experts > 0`` makes
    layers from ``first_k_dense_replace`` on MoE layers).  ``stage`` / ``num_stages``: which
    model stage this is; the first holds the embedding, the last the final LayerNorm,
    LM head and loss.  ``seed``: every weight derives from it and from its global layer
    index, so all cuts of the model hold the same numbers.  ``tp_group`` / ``ep_group`` /
    ``cp_group``: group kinds (``None`` or no process groups: serial).

    **Context parallelism** (a ``cp_group`` of more than one rank): every stage sees this CP
    rank's tokens only, the load-balanced chunks of
    :func:`~tutorial_lib.context_parallel.chunk_positions` (``position_ids``): the first
    stage takes ``input_ids`` already split (Megatron's ``get_batch_on_this_cp_rank``)
    and adds their positions' embeddings, the last stage returns the mean loss over its
    tokens (equal counts on every CP rank, so the CP ranks' mean of it is the sequence's).

    Module names follow Megatron and keep global layer indices (``layers.5.mlp.router``
    is the same module on every layout), so a precision recipe can name layers.

    ``device``: where the stage's weights and its per-step statistics live (``ctx.device``
    in a worker; ``None``: torch's default device); the microbatches must be there too.

    ``recompute``: activation recomputation (:class:`~tutorial_lib.recompute.Recompute`,
    Megatron's ``--recompute-*`` flags) while training: whole layers in the groups of
    :func:`~tutorial_lib.recompute.recompute_groups` (full), or every layer's core
    attention (selective).  The numbers are the same; what is kept for backward shrinks.
    Trace events inside a layer carry ``layer_number`` (its global index).
    """

    def __init__(self, config: ModelConfig, stage: int = 0, num_stages: int = 1, seed: int = 0,
                 tp_group: str | None = "tp", ep_group: str | None = "ep",
                 cp_group: str | None = "cp", device=None, recompute: Recompute | None = None):
        super().__init__()
        self.recompute = Recompute() if recompute is None else recompute
        check_recompute(self.recompute)
        if config.dropout and (parallel_state.group_size(tp_group) > 1):
            raise ValueError(f"dropout ({config.dropout}) with tensor parallelism breaks rule 7; "
                             f"set dropout=0.0")
        tp = parallel_state.group_size(tp_group)
        divide(config.vocab_size, tp, "vocab_size")
        divide(config.num_attention_heads, tp, "num_attention_heads")
        cp = parallel_state.group_size(cp_group)
        # Megatron turns sequence parallelism off at TP = 1 (validate_args): nothing to split
        self.sequence_parallel = sp = config.sequence_parallel and tp > 1
        if sp:
            divide(config.seq_length // cp, tp, "seq_length / context_parallel_size")
        self.config, self.tp_group, self.ep_group = config, tp_group, ep_group
        device = resolve_device(device)
        self.cp_group = cp_group if cp > 1 else None
        self.position_ids = None
        """This CP rank's positions in the sequence (``None`` without context parallelism)."""
        if cp > 1:
            self.position_ids = torch.tensor(chunk_positions(
                config.seq_length, cp, parallel_state.group_rank(cp_group)), device=device)
        self.stage, self.num_stages = stage, num_stages
        self.pre_process, self.post_process = stage == 0, stage == num_stages - 1
        self.aux_loss_scale = 1.0
        """What each aux loss's gradient is scaled by: ``1/M`` with ``M`` microbatches."""
        h = config.hidden_size
        if self.pre_process:
            self.embedding = GPTEmbedding(replace(config, sequence_parallel=sp), seed, tp_group,
                                          device)
        self.layers = torch.nn.ModuleDict(
            {str(i): DeepSeekBlock(config, i, seed, tp_group, ep_group, self.cp_group,
                                   self.position_ids, device,
                                   checkpoint_core_attention=self.recompute.granularity == "selective",
                                   sequence_parallel=sp)
             for i in layer_range(config.num_layers, num_stages, stage)})
        if self.post_process:
            self.final_layernorm = torch.nn.LayerNorm(h, device=device)
            for param in self.final_layernorm.parameters():
                param.sequence_parallel = sp  # my s/T tokens: partial grads
            self.output_layer = ColumnParallelLinear(  # SP: gathers the sequence first
                h, config.vocab_size, bias=False, gather_output=False, sequence_parallel=sp,
                seed=derive_seed(seed, OUTPUT_LAYER), tp_group=tp_group, device=device)
        self.reset_step_stats()

    # --- per-step statistics the trainer reads ---------------------------------------

    def moe_layers(self) -> dict[int, torch.nn.Module]:
        """Global layer index -> the MoE layer, for this stage's MoE blocks."""
        return {block.layer_number: block.mlp for block in self.layers.values() if block.is_moe}

    def reset_step_stats(self) -> None:
        """Forget the aux-loss sums and expert loads of the last step."""
        self.aux_loss_sums: dict[str, float] = {}
        self.expert_loads = {i: torch.zeros(self.config.num_experts, dtype=torch.int64,
                                            device=module_device(self))
                             for i in self.moe_layers()}

    # --- the stage -----------------------------------------------------------------

    def forward_stage(self, hidden: torch.Tensor | None, batch: Microbatch) -> torch.Tensor:
        """Run this stage on one microbatch.

        First stage: ``hidden`` is ignored, ``batch.input_ids`` are embedded.  Every stage:
        its layers.  Last stage: returns the mean next-token loss over the microbatch's
        tokens (a scalar, the same on every TP rank); the others return ``[s, b, h]``
        (``[s/T, b, h]`` under sequence parallelism, as ``hidden`` is then).
        Each MoE layer's balance losses are attached to the activations (their gradient
        is ``aux_loss_scale``) and summed into ``aux_loss_sums`` for the log.  While
        training, the layers run in the groups of
        :func:`~tutorial_lib.recompute.recompute_groups`, each checkpointed group through
        :func:`~tutorial_lib.recompute.checkpoint` (Megatron's ``checkpointed_forward``).
        """
        if self.pre_process:
            if batch.input_ids is None:
                raise ValueError("the first stage needs batch.input_ids")
            hidden = self.embedding(batch.input_ids, self.position_ids)  # [s, b, h]
        elif hidden is None:
            raise ValueError(f"stage {self.stage} needs the previous stage's activation")
        blocks = list(self.layers.values())
        for start, end, checkpointed in recompute_groups(len(blocks), self.recompute):
            if checkpointed and self.training:  # Megatron recomputes only while training
                # the group's saved input is its first layer's (layer_number tag)
                with get_tracer().tags(layer_number=blocks[start].layer_number):
                    hidden, stats = checkpoint(self._run_layers, blocks[start:end], hidden, batch)
            else:
                hidden, stats = self._run_layers(blocks[start:end], hidden, batch)
            # the statistics of the forward, added once (a recomputation's are thrown away)
            for layer_number, topk_idx, aux_losses in stats:
                self.expert_loads[layer_number] += torch.bincount(
                    topk_idx.reshape(-1), minlength=self.config.num_experts)
                for name, value in aux_losses.items():
                    self.aux_loss_sums[name] = self.aux_loss_sums.get(name, 0.0) + value
        if not self.post_process:
            return hidden
        if batch.labels is None:
            raise ValueError("the last stage needs batch.labels (sent from the first stage)")
        logits = self.output_layer(self.final_layernorm(hidden))  # [s, b, V/T]
        return vocab_parallel_cross_entropy(logits, batch.labels.t(), self.tp_group).mean()

    def _run_layers(self, blocks, hidden: torch.Tensor, batch: Microbatch):
        """``blocks`` in order on ``hidden`` -> ``(hidden, stats)``, one recomputable region.

        Each MoE layer's balance losses are attached to the activations inside the region;
        ``stats`` holds ``(layer_number, topk_idx, {name: loss value})`` per MoE layer for
        :meth:`forward_stage` to add up, outside, once.
        """
        stats = []
        for block in blocks:
            with get_tracer().tags(layer_number=block.layer_number):
                hidden, info = block(hidden, batch)
                for value in info.get("aux_losses", {}).values():
                    hidden = attach_aux_loss(hidden, value, self.aux_loss_scale)
            if info:
                stats.append((block.layer_number, info["topk_idx"].detach(),
                              {name: float(value.detach()) for name, value in info["aux_losses"].items()}))
        return hidden, stats

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, sample_ids=None, step: int = 0):
        """The whole model (``num_stages=1``): mean loss of ``[b, s]`` ids and labels (under
        context parallelism this CP rank's ``[b, s/CP]``, from
        :func:`~tutorial_lib.context_parallel.split_for_cp_rank`)."""
        if not (self.pre_process and self.post_process):
            raise ValueError("forward() runs the whole model; a pipeline stage uses forward_stage()")
        if sample_ids is None:
            sample_ids = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.forward_stage(None, Microbatch(input_ids, labels, sample_ids, step))
