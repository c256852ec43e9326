"""The memory model (chapter 10, ``tutorial_lib.costs.memory_model``) and its command line.

Serial activations are checked here against autograd in this process (no workers); every
layout's are checked in real runs by ``tests/dist/test_memory.py`` and the equivalence tests.
"""
import json
import math

import pytest
import torch

from tutorial_lib import costs
from tutorial_lib.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from tutorial_lib.recompute import Recompute, check_recompute
from tutorial_lib.data import synthetic_batch
from tutorial_lib.deepseek import DeepSeekModel, Microbatch
from tutorial_lib.memory import PRESETS, main
from tutorial_lib.saved_activations import SavedTensorBytes

MODELS = [ModelConfig(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=8,
                      vocab_size=32, num_experts=4, moe_router_topk=2),
          ModelConfig(num_layers=2, hidden_size=24, num_attention_heads=3, seq_length=10,
                      vocab_size=50, num_experts=0, dropout=0.1),
          ModelConfig(num_layers=3, hidden_size=16, num_attention_heads=2, seq_length=8,
                      vocab_size=32, num_experts=8, moe_router_topk=3, num_shared_experts=2,
                      moe_ffn_hidden_size=24, first_k_dense_replace=0)]


@pytest.mark.parametrize("model", MODELS, ids=range(len(MODELS)))
def test_a_stage_saves_what_the_model_predicts_to_the_byte(model):
    """Serial (TP = EP = CP = 1, one microbatch of 3 rows): autograd's saved tensors of
    each stage of a 1- and a 2-stage cut equal ``activations_per_microbatch``."""
    rows = 3
    ids, labels = synthetic_batch(1, 0, rows, model.seq_length, model.vocab_size)
    batch = Microbatch(ids, labels, torch.arange(rows), 0)
    for stages in (1, model.num_layers):
        predicted = costs.memory_per_rank(model, ParallelConfig(stages, pipeline_model_parallel_size=stages),
                                          TrainConfig(rows, 1))
        hidden = None
        for stage in range(stages):
            chunk = DeepSeekModel(model, stage=stage, num_stages=stages, seed=1)
            chunk.train()
            with SavedTensorBytes(chunk.parameters()) as saved:
                out = chunk.forward_stage(hidden, batch)
            assert saved.bytes == predicted[stage].activations_per_microbatch[0], (stages, stage)
            hidden = out.detach().requires_grad_()


def test_megatron_bytes_per_parameter_in_mixed_precision():
    """Megatron-Core 0.20.0, d98e8a64, ``megatron/training/theoretical_memory_usage.py``,
    ``compute_weight_and_optimizer_memory``: 18 bytes per parameter in bf16 mixed precision
    without the distributed optimizer, ``6 + 12 / DP`` with it (one dense domain here)."""
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16,
                        vocab_size=128)
    for dp in (1, 2, 4, 8):
        parallel, train = ParallelConfig(dp), TrainConfig(dp, 1)
        plain = costs.memory_per_rank(model, parallel, train, precision="bf16")[0]
        zero = costs.memory_per_rank(model, parallel, train, precision="bf16",
                                     use_distributed_optimizer=True)[0]
        p = plain.parameters
        assert plain.weights + plain.gradients + plain.optimizer == 18 * p
        # the slice's fp32 gradient (4 / DP) is the course's own copy, counted as a gradient
        assert zero.weights + zero.gradients - 4 * math.ceil(p / dp) == 6 * p
        assert zero.optimizer == 12 * math.ceil(p / dp)


def test_one_accounting_of_the_distributed_optimizer_against_megatrons():
    """The course's ``DistributedOptimizer`` keeps, per element of its slice, an fp32 master
    and two moments (optimizer state, 12 bytes) and an fp32 copy of the slice's gradient
    (4, with the gradients): ``w + g + 16 / DP`` per parameter, in fp32 as in bf16.
    Megatron-Core (d98e8a64, ``megatron/core/optimizer/distrib_optimizer.py``) copies
    neither: ``_build_model_and_main_param_groups`` makes an fp32 parameter's slice
    ``model_param.view(-1)[param_range]`` (no master) and ``_copy_model_grads_to_main_grads``
    the slice's gradient a view of ``main_grad``: ``8 + 8 / DP`` in fp32, ``6 + 12 / DP``
    in bf16.  Hence the course saves over plain Adam from DP 3 in fp32 (Megatron from
    DP 2), and both from DP 2 in bf16 (chapter 10)."""
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16,
                        vocab_size=128)

    def state(dp, precision, distributed):
        rank = costs.memory_per_rank(model, ParallelConfig(dp), TrainConfig(dp, 1),
                                     precision=precision,
                                     use_distributed_optimizer=distributed)[0]
        return rank, rank.gradients + rank.optimizer

    for dp in (1, 2, 3, 4, 8):
        for precision, weight in (("fp32", 4), ("bf16", 2)):
            zero, _ = state(dp, precision, True)
            p, mine = zero.parameters, math.ceil(zero.parameters / dp)
            assert zero.weights + zero.gradients + zero.optimizer == (weight + 4) * p + 16 * mine
            assert zero.optimizer == 12 * mine
    saves = {precision: [dp for dp in (2, 3, 4) if state(dp, precision, True)[1]
                         < state(dp, precision, False)[1]] for precision in ("fp32", "bf16")}
    assert saves == {"fp32": [3, 4], "bf16": [2, 3, 4]}


def test_recompute_keeps_only_the_inputs_of_recomputed_layers():
    model, parallel, train = MODELS[0], ParallelConfig(1), TrainConfig(6, 2)
    none = costs.memory_per_rank(model, parallel, train)[0].parts
    full = costs.memory_per_rank(model, parallel, train, recompute=Recompute("full", "uniform", 2))[0].parts
    block = costs.memory_per_rank(model, parallel, train, recompute=Recompute("full", "block", 1))[0].parts
    selective = costs.memory_per_rank(model, parallel, train, recompute=Recompute("selective"))[0].parts
    token_h = 4 * model.seq_length * 3 * model.hidden_size   # one [s, b, h] fp32, b = 3
    assert full["recompute_inputs"] == 2 * token_h and "attention" not in full  # 2 groups of 2
    assert block["recompute_inputs"] == token_h  # layer 0 (dense) recomputed, 1..3 kept
    assert block["attention"] == none["attention"] * 3 // 4 and "mlp" not in block
    # selective drops the log-sum-exp: 4 bytes per token and head in each layer
    assert none["attention"] - selective["attention"] == 4 * 4 * 8 * 3 * model.num_attention_heads


#: A dense model small enough to count by hand: h = 8, 4 layers, 16 tokens, 4 positions.
HAND = ModelConfig(num_layers=4, hidden_size=8, num_attention_heads=2, seq_length=4,
                   vocab_size=16, num_experts=0)
#: One layer by hand: two LayerNorms (2 x 2h), qkv (3h x h + 3h), proj (h x h + h), fc1
#: (4h x h + 4h), fc2 (h x 4h + h) = 32 + 216 + 72 + 288 + 264.
HAND_LAYER = 872
HAND_EMBEDDING = 16 * 8 + 4 * 8    # word and position tables
HAND_HEAD = 2 * 8 + 16 * 8         # final LayerNorm, LM head


def _saved_bytes_per_stage(model, stages: int, rows: int) -> list[int]:
    """Autograd's saved bytes of one microbatch in each stage of a ``stages``-stage cut,
    measured in this process on the real stages (``DeepSeekModel.forward_stage``)."""
    ids, labels = synthetic_batch(1, 0, rows, model.seq_length, model.vocab_size)
    batch, hidden, out = Microbatch(ids, labels, torch.arange(rows), 0), None, []
    for stage in range(stages):
        chunk = DeepSeekModel(model, stage=stage, num_stages=stages, seed=1)
        with SavedTensorBytes(chunk.parameters()) as saved:
            hidden = chunk.forward_stage(hidden, batch).detach().requires_grad_()
        out.append(saved.bytes)
    return out


def test_the_v_and_dualpipe_place_stages_and_copies_as_counted_by_hand():
    """The memory model for chapter 11's placements, counted by hand on a dense 4-layer model (fp32,
    plain Adam: 4 + 4 + 8 bytes per parameter).

    ZBV on PP 2 cuts the model in 4 stages of one layer and folds them in a V: rank 0
    holds stages 0 and 3 (the embedding and the head), rank 1 stages 1 and 2.  DualPipe on
    PP 4 holds two copies of a 4-stage model: rank 1 holds stage 1 of one and stage 2 of
    the other, rank 3 stage 3 of one (the head) and stage 0 of the other (an embedding),
    so its ranks hold every parameter twice.  Each chunk's saved bytes are those the real
    stage saves (autograd, in this process); the peak of a rank whose two chunks are equal
    is the DualPipe table's count times one chunk: ``2 PP`` half-stage chunks for ZBV
    (``M >= 2 PP - 1``), ``PP + 1`` for DualPipe.  ``check_memory`` predicts the same
    (no longer GPipe's every microbatch in flight)."""
    from tutorial_lib.arguments import TrainingArgs, check_memory
    assert sum(p.numel() for p in DeepSeekModel(HAND, stage=0, num_stages=1, seed=1).parameters()) \
        == 4 * HAND_LAYER + HAND_EMBEDDING + HAND_HEAD  # the hand count is the real model's
    rows, m = 2, 8
    four_stages = _saved_bytes_per_stage(HAND, 4, rows)

    zbv = costs.memory_per_rank(HAND, ParallelConfig(2, pipeline_model_parallel_size=2),
                                TrainConfig(rows * m, m), "zbv")
    assert [r.parameters for r in zbv] == [2 * HAND_LAYER + HAND_EMBEDDING + HAND_HEAD,
                                           2 * HAND_LAYER]
    assert zbv[0].activations_per_microbatch == (four_stages[0], four_stages[3])
    assert zbv[1].activations_per_microbatch == (four_stages[1], four_stages[2])
    assert four_stages[1] == four_stages[2] and zbv[1].activations == (2 * 2) * four_stages[1]

    parallel = ParallelConfig(4, pipeline_model_parallel_size=4)
    dual = costs.memory_per_rank(HAND, parallel, TrainConfig(rows * m, m), "dualpipe")
    assert [r.parameters for r in dual] == [2 * HAND_LAYER + HAND_EMBEDDING + HAND_HEAD,
                                            2 * HAND_LAYER, 2 * HAND_LAYER,
                                            2 * HAND_LAYER + HAND_EMBEDDING + HAND_HEAD]
    assert sum(r.parameters for r in dual) == 2 * (4 * HAND_LAYER + HAND_EMBEDDING + HAND_HEAD)
    rank = dual[3]
    assert (rank.weights, rank.gradients, rank.optimizer) == (4 * 2048, 4 * 2048, 8 * 2048)
    assert rank.activations_per_microbatch == (four_stages[3], four_stages[0])
    assert dual[1].activations_per_microbatch == (four_stages[1], four_stages[2])
    assert dual[1].activations == (4 + 1) * four_stages[1]

    args = TrainingArgs(world_size=4, pipeline_model_parallel_size=4, num_layers=4, hidden_size=8,
                        num_attention_heads=2, seq_length=4, vocab_size=16, num_experts=0,
                        global_batch_size=rows * m, num_microbatches=m, schedule="dualpipe")
    checked = check_memory(args, available=2**40)
    assert [r.parameters for r in checked] == [r.parameters for r in dual]
    assert [r.chunk_microbatches for r in checked] == [4 + 1] * 4  # not GPipe's M = 8


def _cli_json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_cli_lists_every_rank_and_the_llama_preset_matches_a_hand_count(capsys):
    """Llama 3.1 405B preset, TP 8 x PP 16 x DP 128 (16384 ranks), bf16, sequence parallel,
    1F1B with 16 microbatches of 1 sequence; 126 layers as 7, 14 x 8, 7 (one layer fewer on
    the first and the last rank, Llama 3 report section 3.3.2).  Pipeline rank 1 (8 layers,
    no embedding or head) counted here per token from the layer's tensors: grouped-query
    attention (128 query heads of 128, 8 key/value heads) and SwiGLU (gate and up, then
    down)."""
    out = _cli_json(capsys, "--preset", "llama-3.1-405b")
    assert len(out["ranks"]) == 16384 == out["world_size"]
    assert [r["rank"] for r in out["ranks"][:3]] == [0, 1, 2]
    assert (out["layout"]["num_layers_in_first_pipeline_stage"],
            out["layout"]["num_layers_in_last_pipeline_stage"]) == (7, 7)
    h, f, t, tp, heads, d, groups = 16384, 53248, 8192, 8, 128, 128, 8
    q, kv = heads * d, groups * d                     # query width; key and value widths
    attention_params = (h * (q + 2 * kv) + q + 2 * kv) // tp + q * h // tp + h
    mlp_params = (2 * f * h + 2 * f) // tp + f * h // tp + h    # gate and up (column), down
    per_layer_params = 4 * h + attention_params + mlp_params    # two LayerNorms
    params = 8 * per_layer_params
    # per layer, bf16 = 2 bytes; LayerNorms on the t / TP tokens sequence parallelism leaves
    norms = 2 * (2 * 2 * (t // tp) * h + 2 * 4 * (t // tp))
    attention = 2 * t * (q + 2 * kv) // tp + 2 * t * q // tp + 4 * t * heads // tp
    mlp = 2 * t * 2 * f // tp + 2 * t * f // tp      # gate and up outputs, the product
    in_flight = 16 - 1  # 1F1B: min(PP - rank, M)
    expected = 18 * params + in_flight * 8 * (norms + attention + mlp)
    rank_one = [r for r in out["ranks"] if r["coords"]["pp"] == 1]
    assert len(rank_one) == 1024 and {r["total"] for r in rank_one} == {expected}
    assert {r["parameters"] for r in rank_one} == {params}
    first = next(r for r in out["pipeline_ranks"] if r["pipeline_rank"] == 0)
    assert first["parameters"] == 7 * per_layer_params + 128256 * h // tp  # no position table


def test_the_deepseek_preset_shards_the_optimizer_state_as_megatron_counts(capsys):
    """DeepSeek-V3 preset, PP 16 x EP 64 on 2048 ranks (DP 128, expert-DP 2), bf16 with the
    distributed optimizer; 61 layers as 2, 14 x 4, 3, so pipeline rank 5 holds layers 18 to
    21, four MoE layers of 4 local experts, with multi-head latent attention.  Its weights,
    gradients and optimizer state by hand (6 + 12 / DP bytes per dense parameter, 6 + 12 /
    EDP per expert parameter, Megatron-Core 0.20.0's rule, plus the course's fp32 slice
    gradient)."""
    out = _cli_json(capsys, "--preset", "deepseek-v3", "--use-distributed-optimizer")
    assert len(out["ranks"]) == 2048
    assert (out["layout"]["num_layers_in_first_pipeline_stage"],
            out["layout"]["num_layers_in_last_pipeline_stage"]) == (2, 3)
    h, f, experts, local, heads = 7168, 2048, 256, 4, 128
    q_lora, kv_lora, nope, rope, v = 1536, 512, 128, 64, 128
    mla = (h * (kv_lora + rope) + kv_lora                 # keys' and values' down, its norm
           + kv_lora * heads * (nope + v)                 # keys' and values' up
           + h * q_lora + q_lora + q_lora * heads * (nope + rope)  # queries: down, norm, up
           + heads * v * h + h)                           # output projection and its bias
    dense = 4 * (4 * h + mla + experts * h + 3 * f * h)  # norms, attention, router, shared
    expert = 4 * local * 3 * f * h
    slices = math.ceil(dense / 128) + math.ceil(expert / 2)
    rank = next(r for r in out["ranks"] if r["coords"]["pp"] == 5)
    assert rank["parameters"] == dense + expert
    assert rank["weights"] == 2 * (dense + expert)
    assert rank["gradients"] == 4 * (dense + expert) + 4 * slices
    assert rank["optimizer"] == 12 * slices
    assert rank["total"] == rank["weights"] + rank["gradients"] + rank["optimizer"] + rank["activations"]


def test_the_presets_are_the_planners_published_models_under_the_same_names():
    """One table of shapes: each memory preset's model is the planner's preset of that name
    (``costs.model_flops.MODEL_PRESETS``), with sequence parallelism switched on for the run."""
    from dataclasses import replace

    from tutorial_lib.costs.model_flops import MODEL_PRESETS
    assert set(PRESETS) <= set(MODEL_PRESETS)
    for name, preset in PRESETS.items():
        assert preset.name == name
        assert replace(preset.model, sequence_parallel=False) == MODEL_PRESETS[name]
        assert "-like" not in preset.note


def test_deepseek_v3_has_671b_parameters_and_37b_active_by_hand():
    """The report's 671B in all and 37B activated per token (its MTP module apart), counted
    here term by term from the published shapes, and the memory preset's ranks hold exactly
    that: each pipeline rank's dense parameters once, its routed experts once per EP rank."""
    from tutorial_lib.costs.model_flops import active_parameter_count, parameter_count
    h, vocab, layers, dense_layers = 7168, 129280, 61, 3
    heads, q_lora, kv_lora, nope, rope, v = 128, 1536, 512, 128, 64, 128
    ffn, expert_ffn, routed, shared, topk = 18432, 2048, 256, 1, 8
    attention = (h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)
                 + h * q_lora + q_lora + q_lora * heads * (nope + rope) + heads * v * h + h)
    norms = 2 * 2 * h
    dense_mlp = 2 * ffn * h + 2 * ffn + ffn * h + h   # SwiGLU gate and up with bias, down
    moe_mlp = routed * h + (routed + shared) * 3 * expert_ffn * h
    total = (dense_layers * (norms + attention + dense_mlp)
             + (layers - dense_layers) * (norms + attention + moe_mlp)
             + vocab * h + 2 * h + vocab * h)           # embedding; final norm and head
    active = total - (layers - dense_layers) * (routed - topk) * 3 * expert_ffn * h
    model = PRESETS["deepseek-v3"].model
    assert parameter_count(model) == total and active_parameter_count(model) == active
    assert round(total / 1e9) == 671            # 671.03B
    assert int(active / 1e9) == 37               # 37.55B, the report's "37B activated"
    out = costs.memory_per_rank(model, ParallelConfig(2048, pipeline_model_parallel_size=16,
                                                      expert_model_parallel_size=64),
                                TrainConfig(15360, 120), stage_layers=[2] + [4] * 14 + [3],
                                precision="bf16", runtime=0)
    assert sum(r.parameters + 63 * r.expert_parameters for r in out) == total


def test_llama_3_1_405b_has_405b_parameters_by_hand():
    """Llama 3.1 405B: 126 layers of grouped-query attention and SwiGLU, untied embedding
    and head, no position table (rotary), counted term by term: 405.9B, the "405B" of its
    name; the memory preset's 16 pipeline ranks of TP 8 hold each layer's split matrices
    once per TP rank and its LayerNorms and row biases whole on every one."""
    from tutorial_lib.costs.model_flops import parameter_count
    h, f, vocab, layers, heads, d, groups = 16384, 53248, 128256, 126, 128, 128, 8
    q, kv = heads * d, groups * d
    attention = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h
    mlp = 2 * f * h + 2 * f + f * h + h
    total = layers * (2 * 2 * h + attention + mlp) + vocab * h + 2 * h + vocab * h
    model = PRESETS["llama-3.1-405b"].model
    assert parameter_count(model) == total and round(total / 1e9, 1) == 405.9
    out = costs.memory_per_rank(model, ParallelConfig(16384, tensor_model_parallel_size=8,
                                                      pipeline_model_parallel_size=16),
                                TrainConfig(2048, 16), stage_layers=[7] + [8] * 14 + [7],
                                precision="bf16", runtime=0)
    whole_per_layer = 2 * 2 * h + h + h               # LayerNorms, two row-parallel biases
    assert sum(8 * r.parameters for r in out) == total + 7 * (layers * whole_per_layer + 2 * h)


def test_the_cli_takes_megatrons_uneven_first_and_last_stages(capsys):
    """``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
    replace the preset's own split (126 layers on 16 ranks as 6, 14 x 8, 8 here); a split
    the middle ranks cannot share, or one with a schedule that places equal stages itself,
    exits 2 naming the rule."""
    def layers(argv):
        ranks = _cli_json(capsys, "--preset", "llama-3.1-405b", *argv)["pipeline_ranks"]
        per_layer = ranks[1]["parameters"] // 8               # a middle rank: 8 layers
        return [r["parameters"] // per_layer for r in ranks]  # the embedding or head < 1 layer
    assert layers([]) == [7] + [8] * 14 + [7]
    assert layers(["--decoder-first-pipeline-num-layers", "6",
                   "--decoder-last-pipeline-num-layers", "8"]) == [6] + [8] * 14 + [8]
    assert main(["--preset", "llama-3.1-405b", "--decoder-first-pipeline-num-layers", "5"]) == 2
    assert "uneven pipeline" in capsys.readouterr().err       # 121 left over 15 ranks
    assert main(["--preset", "deepseek-v3", "--schedule", "dualpipe"]) == 2
    assert "rule 9" in capsys.readouterr().err                # 61 layers, 16 equal stages
    assert main(["--preset", "deepseek-v3", "--schedule", "dualpipe",
                 "--decoder-first-pipeline-num-layers", "1"]) == 2
    assert "uneven pipeline" in capsys.readouterr().err



def test_the_cli_predicts_zero_bubble_and_dualpipe_and_refuses_what_train_4d_refuses(capsys):
    """``--schedule dualpipe`` on PP 2: each rank holds one stage of each copy, i.e. the
    whole model, what 1F1B's two ranks hold together; ZBV folds 2 PP stages, so 4 layers
    do not split over PP 4 (rule 9), and recomputation is refused with a split backward."""
    one_f_one_b = _cli_json(capsys, "--world-size", "2", "--pp", "2")["ranks"]
    dual = _cli_json(capsys, "--world-size", "2", "--pp", "2", "--schedule", "dualpipe")["ranks"]
    whole = sum(r["parameters"] for r in one_f_one_b)
    assert [r["parameters"] for r in dual] == [whole, whole]
    assert main(["--world-size", "4", "--pp", "4", "--schedule", "zbv"]) == 2
    assert "rule 9" in capsys.readouterr().err
    assert main(["--world-size", "2", "--pp", "2", "--schedule", "zbv",
                 "--recompute-granularity", "selective"]) == 2
    assert "recompute" in capsys.readouterr().err


def test_the_cli_refuses_an_invalid_layout_or_recompute_setting(capsys):
    assert main(["--world-size", "4", "--tp", "3"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["--recompute-granularity", "full"]) == 2  # Megatron wants a method and N
    assert "recompute_method" in capsys.readouterr().err


RECOMPUTES = [Recompute("full", "uniform", 1), Recompute("full", "uniform", 3),
              Recompute("full", "block", 2), Recompute("selective")]


@pytest.mark.parametrize("recompute", RECOMPUTES, ids=lambda r: f"{r.granularity}-{r.method}-{r.num_layers}")
def test_recomputation_keeps_what_the_model_predicts_to_the_byte(recompute):
    """With ``DeepSeekModel(recompute=...)`` (torch.utils.checkpoint, the i19-rec side),
    autograd's saved tensors seen from outside the stage equal the prediction, which reads
    the same rule (``tutorial_lib.recompute.kept_per_layer``)."""
    model, rows = MODELS[0], 3
    ids, labels = synthetic_batch(1, 0, rows, model.seq_length, model.vocab_size)
    batch = Microbatch(ids, labels, torch.arange(rows), 0)
    predicted = costs.memory_per_rank(model, ParallelConfig(1), TrainConfig(rows, 1),
                                      recompute=recompute)[0]
    none = costs.memory_per_rank(model, ParallelConfig(1), TrainConfig(rows, 1))[0]
    chunk = DeepSeekModel(model, seed=1, recompute=recompute)
    chunk.train()
    with SavedTensorBytes(chunk.parameters()) as saved:
        chunk.forward_stage(None, batch)
    assert saved.bytes == predicted.activations_per_microbatch[0]
    assert predicted.activations < none.activations
