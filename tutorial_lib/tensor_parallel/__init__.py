"""Tensor parallelism, split by concern as Megatron-Core splits ``megatron/core/tensor_parallel/``.

Read it in this order, like chapter 3:

1. :mod:`.mappings`: the conjugate pairs.  Each communication is an ``autograd.Function``
   named after what its forward does, its backward the conjugate (identity / all-reduce,
   split / all-gather, all-gather / reduce-scatter), on the ``tp`` group or any group kind
   (``None``: serial).  Outside a launch every layer is its own serial self, so the TP = 1
   reference is this same code.
2. :mod:`.random`: :func:`derive_seed`, the one way a part's seed is derived, and the full
   master weights every rank draws before keeping its slice.
3. :mod:`.layers`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
   :class:`VocabParallelEmbedding`, the column-parallel matmul under sequence parallelism
   (:func:`linear_with_sequence_parallel_all_gather`: it keeps only its input shard for
   backward and gathers it again there) and sequence parallelism's extra gradient sync
   (:func:`allreduce_sequence_parallel_grads`).
4. :mod:`.cross_entropy`: :func:`vocab_parallel_cross_entropy` (fp32, label smoothing).

Every public name is re-exported here: ``tensor_parallel.ColumnParallelLinear``.  What a
layer keeps for backward is measured by :mod:`tutorial_lib.saved_activations`.
"""
from .cross_entropy import (VocabParallelCrossEntropy, megatron_label_smoothing_losses,
                            vocab_parallel_cross_entropy)
from .layers import (SP_LINEAR, ColumnParallelLinear, LinearWithSequenceParallelAllGather,
                     RowParallelLinear, VocabParallelEmbedding,
                     allreduce_sequence_parallel_grads, linear_with_sequence_parallel_all_gather,
                     serial_embedding, serial_linear)
from .mappings import (CopyToTensorModelParallelRegion, GatherFromSequenceParallelRegion,
                       GatherFromTensorModelParallelRegion, ReduceFromTensorModelParallelRegion,
                       ReduceScatterToSequenceParallelRegion, ScatterToSequenceParallelRegion,
                       ScatterToTensorModelParallelRegion, copy_to_tensor_model_parallel_region,
                       divide, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)
from .random import derive_seed, init_embedding_master, init_linear_master

from . import cross_entropy, layers, mappings, random

__all__ = [*mappings.__all__, *random.__all__, *layers.__all__, *cross_entropy.__all__]
