"""A GPT you can read in one sitting, split over tensor-parallel ranks.

nanoGPT's model, with Megatron's parallel layers swapped in.  Top to bottom::

    input_ids [b, s] --transpose--> [s, b]
      -> GPTEmbedding:    word (vocab-parallel) + position (replicated) = [s, b, h]
                          sequence parallel: keep my [s/T, b, h] slice of the sequence
      -> num_layers x TransformerBlock          (tutorial_lib.transformer)
      -> final LayerNorm
      -> output_layer:    ColumnParallelLinear, h -> V, *not* gathered: [s, b, V/T]
                          (sequence parallel: its input is all-gathered back to [s, b, h])
      -> vocab_parallel_cross_entropy(logits [s, b, V/T], labels [s, b]) -> mean loss

Activations are ``[s, b, h]`` (sequence first) inside the model, as in Megatron: the
sequence dimension is dim 0, the one sequence parallelism splits.  ``forward`` takes
and returns the usual batch-first tensors, so callers never see the transpose.

**Where the TP ranks talk** (``T`` TP ranks; per microbatch; see
:func:`tutorial_lib.costs.tp_dp_step_collectives` for the bytes):

* the word embedding: each rank looks up only its ``V/T`` rows, so the pieces are
  summed (one all-reduce forward; backward none);
* every block: :func:`tutorial_lib.transformer.block_collectives`;
* the output layer: its input enters a column-parallel matmul, so backward all-reduces
  ``dX`` (with sequence parallelism: all-gather forward; backward, all-gather the saved
  input shard again for dW, then reduce-scatter dX);
* the loss: three all-reduces of one fp32 number per token (max, target logit, sum of
  exponentials); the ``[s, b, V]`` logits are never gathered.

**Sequence parallelism** (``ModelConfig.sequence_parallel``) follows Megatron's
``LanguageModelEmbedding`` / ``GPTModel`` with a learned position embedding: the word
embedding is all-reduced, the replicated position embedding added, and then
:func:`~tutorial_lib.tensor_parallel.scatter_to_sequence_parallel_region` keeps this
rank's slice of the sequence (no communication forward; backward all-gathers the
gradient, so the position embedding's gradient is whole on every rank).  (Megatron
reduce-scatters the word embedding directly when there is no learned position
embedding.)  The blocks and the final LayerNorm then run on ``[s/T, b, h]``, and the
output layer's all-gather brings the full sequence back for the vocabulary-parallel
matmul.  The final LayerNorm's weights are flagged ``sequence_parallel`` like the
blocks' LayerNorms: call :func:`~tutorial_lib.tensor_parallel.allreduce_sequence_parallel_grads`
after backward (:func:`tutorial_lib.tp_dp_step.train_step` does).

**One seed, every layout.**  Every parameter is built from a seed derived from the
model's ``seed`` (:func:`~tutorial_lib.tensor_parallel.derive_seed`): the parallel layers draw the *full* master
weight and keep their slice, so the model at TP=N holds exactly the slices of the
model at TP=1.  The same class with no process groups (or ``tp_group=None``) *is* the
serial reference: no second implementation to drift.

Choices, to keep it small: no dropout (rule 7), no weight tying between the embedding
and the output layer (Megatron ties them by default; with pipeline parallelism that
costs an extra all-reduce over the ``embedding`` group), no bias in the output layer
(as in Megatron), dense MLPs only.  The three steps of :meth:`GPTModel.forward`
(embed, blocks, head + loss) are where a pipeline stage cuts in: see
:class:`tutorial_lib.deepseek.DeepSeekModel` (chapter 6).
"""
from __future__ import annotations

import torch

from . import parallel_state
from .config import ModelConfig
from .devices import resolve_device
from .tensor_parallel import (
    derive_seed,
    ColumnParallelLinear,
    VocabParallelEmbedding,
    divide,
    scatter_to_sequence_parallel_region,
    serial_embedding,
    vocab_parallel_cross_entropy,
)
from .transformer import TransformerBlock

__all__ = ["GPTModel", "GPTEmbedding"]

# Which component of the model a derived seed belongs to (tensor_parallel.derive_seed).
WORD_EMBEDDING, POSITION_EMBEDDING, OUTPUT_LAYER, FIRST_BLOCK = 0, 1, 2, 10


class GPTEmbedding(torch.nn.Module):
    """Token ids ``[b, s]`` -> hidden states ``[s, b, h]`` (sequence parallel: ``[s/T, b, h]``).

    ``word_embeddings`` is split over TP by vocabulary (each rank ``V/T`` rows);
    ``position_embeddings`` is replicated: every rank holds all ``seq_length`` rows.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, tp_group: str | None = "tp",
                 device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, config.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, seed=derive_seed(seed, WORD_EMBEDDING),
            sequence_parallel=False, tp_group=tp_group,  # all-reduce; the split comes after the add
            device=device)
        self.position_embeddings = serial_embedding(
            config.seq_length, config.hidden_size, seed=derive_seed(seed, POSITION_EMBEDDING),
            device=device)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids``: the positions of ``input_ids``'s columns (default ``0 .. s-1``);
        under context parallelism, this rank's chunks of the sequence."""
        ids = input_ids.t()                                    # [s, b]: sequence first
        positions = (torch.arange(ids.shape[0], device=ids.device) if position_ids is None
                     else position_ids)
        x = self.word_embeddings(ids) + self.position_embeddings(positions).unsqueeze(1)
        if self.sequence_parallel:
            # my [s/T, b, h]: a slice, cloned so that the whole [s, b, h] it views is not
            # kept alive by the next layer's saved input (Megatron-Core's default,
            # clone_scatter_output_in_embedding=True)
            x = scatter_to_sequence_parallel_region(x, self.tp_group).clone()
        return x


class GPTModel(torch.nn.Module):
    """A decoder-only Transformer whose ``forward(input_ids, labels)`` returns the mean loss.

    ``config``: a :class:`~tutorial_lib.config.ModelConfig` (``hidden_size``,
    ``num_attention_heads``, ``num_layers``, ``seq_length``, ``vocab_size``,
    ``sequence_parallel``; dense, no dropout).  ``seed``: every weight derives from it.
    ``tp_group``: the group kind the layers split over (``"tp"``); ``None``, or no
    process groups at all, builds the serial model.  ``device``: where the weights live
    (``ctx.device`` in a worker; ``None``: torch's default device); its inputs must be there too.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, tp_group: str | None = "tp",
                 device=None):
        super().__init__()
        if config.num_experts:
            raise ValueError(f"GPTModel is dense, but num_experts = {config.num_experts}; "
                             f"set num_experts=0 (mixture-of-experts models come in a later chapter)")
        if config.dropout:
            raise ValueError(f"GPTModel has no dropout, but dropout = {config.dropout}: with TP the "
                             f"ranks would draw different masks for one tensor (rule 7); set dropout=0.0")
        tp = parallel_state.group_size(tp_group)
        divide(config.vocab_size, tp, "vocab_size")
        divide(config.num_attention_heads, tp, "num_attention_heads")
        if config.sequence_parallel:
            divide(config.seq_length, tp, "seq_length")
        self.config, self.tp_group = config, tp_group
        sp, h = config.sequence_parallel, config.hidden_size

        device = resolve_device(device)
        self.embedding = GPTEmbedding(config, seed, tp_group, device)
        self.layers = torch.nn.ModuleList(
            TransformerBlock(h, config.num_attention_heads, sequence_parallel=sp,
                             seed=derive_seed(seed, FIRST_BLOCK + layer), tp_group=tp_group,
                             device=device)
            for layer in range(config.num_layers))
        self.final_layernorm = torch.nn.LayerNorm(h, device=device)
        for param in self.final_layernorm.parameters():
            param.sequence_parallel = sp  # sees only my s/T tokens under SP: partial gradients
        self.output_layer = ColumnParallelLinear(
            h, config.vocab_size, bias=False, gather_output=False, sequence_parallel=sp,
            seed=derive_seed(seed, OUTPUT_LAYER), tp_group=tp_group, device=device)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over the ``[b, s]`` tokens; ``labels[i, t]`` follows ``input_ids[i, t]``.

        The result is the same scalar on every TP rank (the loss's all-reduces saw to it).
        """
        if input_ids.shape != labels.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} "
                             f"must have the same [batch, sequence] shape")
        if input_ids.shape[1] > self.config.seq_length:
            raise ValueError(f"sequences of {input_ids.shape[1]} tokens are longer than seq_length "
                             f"({self.config.seq_length}), the size of the position table")
        hidden = self.embedding(input_ids)                        # [s, b, h] (SP: [s/T, b, h])
        for layer in self.layers:
            hidden = layer(hidden)
        hidden = self.final_layernorm(hidden)
        logits = self.output_layer(hidden)                        # [s, b, V/T]: my vocabulary slice
        losses = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group)  # [s, b]
        return losses.mean()
