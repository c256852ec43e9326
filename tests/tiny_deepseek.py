"""A small module tree named like ``DeepSeekModel``, for the precision tests (unit and dist).

Layer 0 dense, the others MoE; ``forward(ids)`` returns logits, so a test can compare any
recipe's output with the fp32 one without the pipeline or the loss in between.
Registered with cloudpickle by value, so launched workers can build it too.
"""
import sys

import cloudpickle
import torch

from tutorial_lib import moe
from tutorial_lib.transformer import TransformerBlock

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TinyDeepSeek(torch.nn.Module):
    """``num_layers`` blocks named like DeepSeekModel: layer 0 dense, the rest MoE.

    ``moe_seed``: one seed for every MoE layer (``None``: the layer's index).
    ``ep_group``: the MoE layers' expert-parallel group kind (``None``: serial).
    """

    def __init__(self, num_layers=3, hidden=128, vocab=32, ep_group=None, moe_seed=None):
        super().__init__()
        self.embedding = torch.nn.ModuleDict({"word_embeddings": torch.nn.Embedding(vocab, hidden)})
        self.layers = torch.nn.ModuleList([TransformerBlock(hidden, 4, 2 * hidden, seed=i, tp_group=None)
                                           for i in range(num_layers)])
        for i in range(1, num_layers):
            self.layers[i].mlp = moe.MoELayer(hidden, 4, 2, 32, num_shared_experts=1,
                                              seed=i if moe_seed is None else moe_seed,
                                              ep_group=ep_group, tp_group=None)
        self.final_layernorm = torch.nn.LayerNorm(hidden)
        self.output_layer = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embedding["word_embeddings"](ids)
        for block in self.layers:
            x = x + block.self_attention(block.input_layernorm(x))
            y = block.mlp(block.pre_mlp_layernorm(x))
            x = x + (y[0] if isinstance(y, tuple) else y)
        return self.output_layer(self.final_layernorm(x))
