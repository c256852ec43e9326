"""A model as the planner sees it (chapter 13): shapes with Megatron's names, parameters, FLOPs.

:class:`~tutorial_lib.config.ModelConfig`, the course's one description of a model, counts
real models too: grouped-query attention (``num_query_groups``), SwiGLU (``swiglu``: three
MLP matrices), mixture of experts with shared experts (``num_experts``, ``moe_router_topk``,
``moe_ffn_hidden_size``, ``num_shared_experts``, the first ``first_k_dense_replace``
layers dense) and DeepSeek's multi-head latent attention (``multi_latent_attention`` with
``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``,
``v_head_dim``).  It carries every attribute :mod:`tutorial_lib.costs.memory_model` reads,
so the memory model counts these models too (its weights and saved activations learn
the three widths from :func:`~tutorial_lib.costs.memory_model.attention_widths`).

FLOPs count the matmuls, two per multiply-add, as the Megatron papers do (Narayanan et al.
2021, appendix; Korthikanti et al. 2022, section 6):

* per token and layer, forward: the attention projections, the scores ``Q K^T`` and
  ``softmax(.) V`` over the whole sequence (``2 s q + 2 s v``, not halved for the causal
  mask, as those papers count), the MLP (or the router, ``k`` routed experts and the
  shared ones); the LM head's ``2 h V`` per token once;
* a training step is three forwards (the backward is two: gradients of inputs and of
  weights): the **model FLOPs**, what MFU divides;
* recomputation adds what it runs again: full recomputation one more forward of every
  layer (not the head), selective recomputation the core attention's scores and mix:
  the **hardware FLOPs** (Megatron's "HFU").

For GPT (``f = 4h``, plain attention, no MoE) these are ``72 B s L h^2 (1 + s/6h +
V/12Lh)`` and, with full recomputation, Narayanan et al.'s ``96 B s L h^2 (1 + s/6h +
V/16Lh)`` exactly (checked in the tests).  Pure Python, no torch.
"""
from __future__ import annotations

import functools

from ..config import ConfigError, ModelConfig
from .memory_model import attention_output_width, attention_widths, layer_parameters

__all__ = ["gpt", "MODEL_PRESETS", "layer_flops", "model_flops_per_step",
           "hardware_flops_per_step", "parameter_count", "active_parameter_count",
           "check_model"]


def gpt(num_layers: int, hidden_size: int, num_attention_heads: int, *, seq_length: int = 2048,
        vocab_size: int = 51200, name: str = "", source: str = "") -> ModelConfig:
    """The Megatron papers' GPT: ``f = 4 h``, GELU, learned positions, vocabulary 51,200,
    sequence 2,048 (Narayanan et al. 2021, Korthikanti et al. 2022)."""
    return ModelConfig(num_layers, hidden_size, num_attention_heads, seq_length, vocab_size,
                       name=name, source=source)


MODEL_PRESETS: dict[str, ModelConfig] = {
    "gpt-175b": gpt(96, 12288, 96, name="gpt-175b",
                    source="GPT-3 175B shapes as Korthikanti et al. 2022 (Table 3) train it"),
    "llama-3.1-405b": ModelConfig(
        126, 16384, 128, 8192, 128256, ffn_hidden_size=53248, num_query_groups=8, swiglu=True,
        position_embedding_type="rope", name="llama-3.1-405b",
        source="Llama 3 herd of models (arXiv 2407.21783), Table 3: 126 layers, model "
               "dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads, vocabulary "
               "128,000 (128,256 in the released tokenizer), sequence 8,192"),
    "deepseek-v3": ModelConfig(
        61, 7168, 128, 4096, 129280, ffn_hidden_size=18432, swiglu=True, num_experts=256,
        moe_router_topk=8, moe_ffn_hidden_size=2048, num_shared_experts=1,
        first_k_dense_replace=3, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, position_embedding_type="rope",
        name="deepseek-v3",
        source="DeepSeek-V3 technical report (arXiv 2412.19437), section 4.2: 61 layers, "
               "hidden 7,168, 128 heads of 128, KV compression 512, query compression 1,536, "
               "rotary 64 per head, first 3 layers dense, 1 shared + 256 routed experts of "
               "2,048, 8 activated, sequence 4,096; vocabulary and dense FFN 129,280 and "
               "18,432 from its released config.json"),
}
"""Published models, exact shapes: the one table of them.  The planner's ``--preset``
reads it, and :data:`tutorial_lib.memory.PRESETS` (the memory model's ``--preset``,
chapter 10) adds to two of them, under the same names, the batch and the layout they were
trained on.  Their layer counts (126, 61) divide by few pipeline sizes; for the others
the planner and the memory model put fewer layers on the first and last pipeline ranks,
as Megatron's ``--decoder-first-pipeline-num-layers`` and
``--decoder-last-pipeline-num-layers`` do (:func:`~tutorial_lib.config.uneven_split`:
Llama 3 405B's 126 layers on 16 ranks: 7, 14 x 8, 7, one layer fewer on the first and the
last stage, Meta's balance in the Llama 3 report, section 3.3.2)."""



def check_model(model: ModelConfig) -> None:
    """:class:`ConfigError` for shapes that do not make a model (before any count)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
        value = getattr(model, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("model", f"--{name.replace('_', '-')} must be a whole number >= 1, "
                                       f"got {value!r}")
    n, g = model.num_attention_heads, model.num_query_groups
    if not model.multi_latent_attention and model.kv_channels is None \
            and model.hidden_size % n:
        raise ConfigError("model", f"--hidden-size ({model.hidden_size}) must divide by "
                                   f"--num-attention-heads ({n}), or give --kv-channels")
    if g is not None and (g < 1 or n % g):
        raise ConfigError("model", f"--num-query-groups ({g}) must divide --num-attention-heads "
                                   f"({n}): each key/value head serves n / g query heads")
    if model.num_experts and not 1 <= model.moe_router_topk <= model.num_experts:
        raise ConfigError("model", f"--moe-router-topk ({model.moe_router_topk}) must be in "
                                   f"1..--num-experts ({model.num_experts})")
    if model.first_k_dense_replace > model.num_layers:
        raise ConfigError("model", f"first_k_dense_replace ({model.first_k_dense_replace}) "
                                   f"exceeds --num-layers ({model.num_layers})")


def _is_moe_layer(model, layer: int) -> bool:
    return model.num_experts > 0 and layer >= model.first_k_dense_replace


def layer_flops(model: ModelConfig, layer: int) -> dict[str, float]:
    """Forward FLOPs of decoder layer ``layer`` for one token, by part: ``projections``
    (attention's matmuls with weights), ``core_attention`` (scores and mix over the
    sequence), ``mlp`` (or ``moe``: router, routed and shared experts)."""
    return dict(_layer_flops(model, _is_moe_layer(model, layer)))


@functools.lru_cache(maxsize=1024)
def _layer_flops(model: ModelConfig, moe: bool) -> tuple:
    h, s = model.hidden_size, model.seq_length
    q, k, v = attention_widths(model)
    out = attention_output_width(model)
    if model.multi_latent_attention:
        n, rope, kv_lora = model.num_attention_heads, model.qk_pos_emb_head_dim, model.kv_lora_rank
        q_lora = model.q_lora_rank
        weights = h * (kv_lora + rope) + kv_lora * n * (model.qk_head_dim + model.v_head_dim)
        weights += h * q_lora + q_lora * q if q_lora else h * q
        weights += out * h
    else:
        weights = h * (q + k + v) + out * h
    parts = {"projections": 2.0 * weights, "core_attention": 2.0 * s * q + 2.0 * s * out}
    if moe:
        f = model.moe_ffn_hidden_size or h
        experts = model.moe_router_topk + model.num_shared_experts
        parts["moe"] = 2.0 * h * model.num_experts + experts * 2.0 * 3 * h * f
    else:
        f = model.ffn_hidden_size or 4 * h
        parts["mlp"] = 2.0 * h * (2 * f if model.swiglu else f) + 2.0 * f * h
    return tuple(parts.items())


@functools.lru_cache(maxsize=1024)
def _forward_per_token(model: ModelConfig) -> tuple[float, float]:
    """``(every layer's forward FLOPs, of which core attention)`` per token."""
    total = attention = 0.0
    for layer in range(model.num_layers):
        parts = layer_flops(model, layer)
        total += sum(parts.values())
        attention += parts["core_attention"]
    return total, attention


def model_flops_per_step(model: ModelConfig, global_batch_size: int) -> float:
    """The model's FLOPs in one step of ``global_batch_size`` sequences: three forwards of
    every layer and of the LM head (what MFU counts, whatever is recomputed)."""
    layers, _ = _forward_per_token(model)
    tokens = global_batch_size * model.seq_length
    return 3.0 * tokens * (layers + 2.0 * model.hidden_size * model.vocab_size)


def recompute_flops_per_step(model: ModelConfig, global_batch_size: int,
                             recompute_granularity: str | None) -> float:
    """FLOPs recomputation adds to a step: ``full`` one forward of every layer,
    ``selective`` core attention's forward, ``None`` nothing."""
    if recompute_granularity not in (None, "full", "selective"):
        raise ConfigError("recompute", f"--recompute-granularity {recompute_granularity!r}: "
                                       f"full or selective, or leave it out")
    if recompute_granularity is None:
        return 0.0
    layers, attention = _forward_per_token(model)
    tokens = global_batch_size * model.seq_length
    return tokens * (layers if recompute_granularity == "full" else attention)


def hardware_flops_per_step(model: ModelConfig, global_batch_size: int,
                            recompute_granularity: str | None = None) -> float:
    """What the GPUs compute in one step: the model's FLOPs plus the recomputation's
    (:func:`recompute_flops_per_step`), as the Megatron papers count achieved TFLOP/s."""
    return model_flops_per_step(model, global_batch_size) \
        + recompute_flops_per_step(model, global_batch_size, recompute_granularity)


def parameter_count(model: ModelConfig) -> int:
    """Every parameter: the layers (:func:`~tutorial_lib.costs.memory_model.layer_parameters`
    at TP = EP = 1), the embedding (and a position table unless rotary), the final
    LayerNorm and an untied LM head."""
    h = model.hidden_size
    count = sum(layer_parameters(model, i) for i in range(model.num_layers))
    positions = 0 if model.position_embedding_type == "rope" else model.seq_length * h
    return count + 2 * model.vocab_size * h + positions + 2 * h


def active_parameter_count(model: ModelConfig) -> int:
    """Parameters one token meets: :func:`parameter_count` less the routed experts it is
    not sent to."""
    if not model.num_experts:
        return parameter_count(model)
    f = model.moe_ffn_hidden_size or model.hidden_size
    idle = model.num_experts - model.moe_router_topk
    moe_layers = model.num_layers - model.first_k_dense_replace
    return parameter_count(model) - moe_layers * idle * 3 * f * model.hidden_size
