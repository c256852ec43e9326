"""A pre-LayerNorm GPT block with tensor parallelism and optional sequence parallelism.

Read it like nanoGPT's ``Block``: ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.  The only
differences are which linear layers are split, and the four places where TP ranks talk.

Which projection is which, and where the collectives land (per block, per rank;
activations ``[s, b, h]``, ``T`` TP ranks, fp32 so 4 bytes an element)::

    layer                          split          forward                    backward
    -----------------------------  -------------  -------------------------  -------------------------
    input_layernorm                replicated     -                          -
    self_attention.linear_qkv      column (heads) (enter: copy_to, nothing)  all-reduce dX   [s,b,h]
    self_attention.linear_proj     row (heads)    all-reduce Y    [s,b,h]    (identity)
    pre_mlp_layernorm              replicated     -                          -
    mlp.linear_fc1                 column (ffn)   (enter: copy_to, nothing)  all-reduce dX   [s,b,h]
    mlp.linear_fc2                 row (ffn)      all-reduce Y    [s,b,h]    (identity)

Without sequence parallelism: **2 all-reduces forward and 2 backward**, each of
``s*b*h`` elements.  With sequence parallelism (``sequence_parallel=True``) the block's input
and output are ``[s/T, b, h]`` and each all-reduce splits into its two halves: an
all-gather before each column-parallel layer (forward; its backward is a reduce-scatter)
and a reduce-scatter after each row-parallel layer (forward; its backward an all-gather).
Forward: 2 all-gathers + 2 reduce-scatters, the same bytes on the wire as the 2
all-reduces.  Backward: the same 2 reduce-scatters + 2 all-gathers, plus one more
all-gather per column-parallel layer, because ``linear_qkv`` and ``linear_fc1`` keep only
this rank's ``[s/T, b, h]`` input for backward and gather it again for their weight
gradient (Megatron's way, :func:`~tutorial_lib.tensor_parallel.linear_with_sequence_parallel_all_gather`).
So a block sends 5/4 of the bytes it sends without sequence parallelism, and every
activation it stores for backward is ``1/T`` of the tokens or of the features: the
LayerNorms, residuals (and any dropout) run on ``1/T`` of the tokens, and the
column-parallel inputs are kept as ``1/T`` shards.  Then one more all-reduce after
backward: see :func:`allreduce_sequence_parallel_grads`.  :func:`block_collectives` lists
all of this.

Why the LayerNorm gradients need that all-reduce: the LayerNorm weights are *replicated*
on every TP rank, but with sequence parallelism each rank normalises only its own
``s/T`` tokens.  ``dgamma = sum over tokens of dy * x_hat``, so each rank holds the sum
over its tokens only: a partial sum.  Summing over the TP group gives the full gradient
(and keeps the replicas identical).  The row-parallel biases, added after the
reduce-scatter, are in the same situation.  Such parameters carry
``param.sequence_parallel = True``.

**QKV layout.**  ``linear_qkv`` is ONE column-parallel layer of ``3h`` outputs whose rows
are ordered head by head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (Megatron's layout), not
``[Q | K | V]`` (nanoGPT's ``c_attn``).  A contiguous slice of the rows is then a whole
number of heads *with* their q, k and v, so cutting it T ways gives each rank complete
heads; with ``[Q | K | V]`` rank 0 would get only queries.  The serial block (``tp_group=None``,
or TP=1) is this same code with the same layout, so TP=N reproduces its numbers (to fp32
rounding); a test checks the serial block against nanoGPT's ``[Q | K | V]`` formulation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import parallel_state
from .context_parallel import context_parallel_attention
from .devices import resolve_device
from .recompute import checkpoint
from .tensor_parallel import (
    SP_LINEAR,
    derive_seed,
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    divide,
)

__all__ = ["SelfAttention", "MLP", "TransformerBlock", "allreduce_sequence_parallel_grads",
           "block_collectives"]


# Which sublayer of a block a derived seed belongs to (tensor_parallel.derive_seed).
QKV, PROJ, FC1, FC2 = 0, 1, 2, 3


class SelfAttention(torch.nn.Module):
    """Causal self-attention; each TP rank owns ``num_attention_heads / T`` whole heads.

    ``cp_group`` / ``cp_comm_type``: with context parallelism (a ``cp`` group of more than
    one rank) the input holds this CP rank's tokens only (the load-balanced chunks of
    :mod:`tutorial_lib.context_parallel`), and the attention core exchanges keys and
    values over the group in the given way (``p2p``, ``all_gather`` or ``a2a``); the
    projections are token-wise and need nothing.  ``cp_group=None`` (the default): serial.
    ``device``: where the weights live (``None``: torch's default device).
    ``checkpoint_core_attention``: while training, recompute :meth:`core_attention` in
    backward instead of keeping its output and log-sum-exp (Megatron's selective
    recomputation, ``--recompute-granularity selective``; :mod:`tutorial_lib.recompute`).
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, sequence_parallel: bool = False,
                 seed: int = 0, tp_group: str | None = "tp", cp_group: str | None = None,
                 cp_comm_type: str = "p2p", device=None, checkpoint_core_attention: bool = False):
        super().__init__()
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        self.checkpoint_core_attention = checkpoint_core_attention
        tp = parallel_state.group_size(tp_group)
        self.head_dim = divide(hidden_size, num_attention_heads, "hidden_size", by="num_attention_heads")
        self.heads_per_rank = divide(num_attention_heads, tp, "num_attention_heads")
        self.linear_qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size,
                                               sequence_parallel=sequence_parallel,
                                               seed=derive_seed(seed, QKV), tp_group=tp_group,
                                               device=device)
        self.linear_proj = RowParallelLinear(hidden_size, hidden_size, input_is_parallel=True,
                                             sequence_parallel=sequence_parallel,
                                             seed=derive_seed(seed, PROJ), tp_group=tp_group,
                                             device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [s, b, heads_per_rank * 3 * head_dim]; s is the full sequence
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.heads_per_rank, 3, self.head_dim)
        q, k, v = qkv.permute(3, 1, 2, 0, 4).unbind(0)  # each [b, heads_per_rank, s, head_dim]
        if self.checkpoint_core_attention and self.training:
            y = checkpoint(self.core_attention, q, k, v)  # keeps q, k, v only
        else:
            y = self.core_attention(q, k, v)
        y = y.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        return self.linear_proj(y)  # partial sums over heads, reduced across TP

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``softmax(q k^T / sqrt(d)) v``, causal, on ``[b, heads, s, head_dim]`` (Megatron's
        ``core_attention``): what selective recomputation runs again."""
        if parallel_state.group_size(self.cp_group) > 1:  # my tokens; K/V from the CP ranks
            return context_parallel_attention(q, k, v, self.cp_comm_type, True, self.cp_group)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(torch.nn.Module):
    """``fc2(gelu(fc1(x)))``: fc1 split by output (column), fc2 by input (row); GELU stays local."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, sequence_parallel: bool = False,
                 seed: int = 0, tp_group: str | None = "tp", device=None):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size,
                                               sequence_parallel=sequence_parallel,
                                               seed=derive_seed(seed, FC1), tp_group=tp_group,
                                               device=device)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, input_is_parallel=True,
                                            sequence_parallel=sequence_parallel,
                                            seed=derive_seed(seed, FC2), tp_group=tp_group,
                                            device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerBlock(torch.nn.Module):
    """LayerNorm -> attention -> residual -> LayerNorm -> MLP -> residual, on ``[s, b, h]``.

    ``sequence_parallel``: input and output are this rank's ``[s/T, b, h]`` slice of the
    sequence; call :func:`allreduce_sequence_parallel_grads` after backward.
    ``tp_group=None`` builds the serial block (also what you get when no groups exist).
    No dropout: with TP, ranks would draw different masks for one tensor (rule 7).
    ``device``: where the weights live (``None``: torch's default device).
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, ffn_hidden_size: int | None = None,
                 sequence_parallel: bool = False, seed: int = 0, tp_group: str | None = "tp",
                 layernorm_epsilon: float = 1e-5, device=None):
        super().__init__()
        ffn_hidden_size = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        self.sequence_parallel = sequence_parallel
        device = resolve_device(device)
        self.input_layernorm = torch.nn.LayerNorm(hidden_size, eps=layernorm_epsilon, device=device)
        self.self_attention = SelfAttention(hidden_size, num_attention_heads, sequence_parallel,
                                            seed, tp_group, device=device)
        self.pre_mlp_layernorm = torch.nn.LayerNorm(hidden_size, eps=layernorm_epsilon,
                                                    device=device)
        self.mlp = MLP(hidden_size, ffn_hidden_size, sequence_parallel, seed, tp_group, device)
        for layernorm in (self.input_layernorm, self.pre_mlp_layernorm):
            for param in layernorm.parameters():
                param.sequence_parallel = sequence_parallel  # partial grads under SP: see module doc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        x = x + self.mlp(self.pre_mlp_layernorm(x))
        return x


def block_collectives(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int,
                      sequence_parallel: bool = False, bytes_per_element: int = 4) -> list[dict]:
    """Every TP collective of one block's forward + backward on one rank, in issue order.

    Each row: ``phase``, ``op_name`` (the conjugate function), ``op`` (the collective) and
    ``bytes`` in :mod:`tutorial_lib.comm`'s convention (all-reduce: the tensor;
    reduce-scatter: the full input; all-gather: this rank's shard).
    """
    if tp_size == 1:
        return []
    full = seq_length * micro_batch_size * hidden_size * bytes_per_element
    if not sequence_parallel:
        forward = [("forward", "reduce_from_tensor_model_parallel_region", "all_reduce", full)] * 2
        backward = [("backward", "copy_to_tensor_model_parallel_region", "all_reduce", full)] * 2
        rows = forward + backward
    else:
        tokens_per_rank = divide(seq_length, tp_size, "seq_length")
        shard = tokens_per_rank * micro_batch_size * hidden_size * bytes_per_element
        column = SP_LINEAR
        scatter = "reduce_scatter_to_sequence_parallel_region"
        layer = [("forward", column, "all_gather", shard), ("forward", scatter, "reduce_scatter", full)]
        # Backward, row-parallel layer first: gather dY; then the column-parallel layer gathers
        # its saved input shard again (for dW) and reduce-scatters dX.
        undo = [("backward", scatter, "all_gather", shard), ("backward", column, "all_gather", shard),
                ("backward", column, "reduce_scatter", full)]
        # 2 LayerNorms (weight + bias) and 2 row-parallel biases: 6h gradient elements in one buffer.
        sync = [("grad_sync", "allreduce_sequence_parallel_grads", "all_reduce",
                 6 * hidden_size * bytes_per_element)]
        rows = layer * 2 + undo * 2 + sync
    return [dict(zip(("phase", "op_name", "op", "bytes"), row)) for row in rows]
