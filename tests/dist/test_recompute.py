"""Activation recomputation (chapter 10) on a pipeline with tensor parallelism (real gloo).

One launch of 6 ranks, TP 2 x PP 3 (3 layers a stage: a dense one, then MoE layers whose
sequence is split over TP), runs one 1F1B step of 3 microbatches under four settings,
the way ``train_4d`` builds and steps its chunks: no recomputation, ``full`` / ``uniform``
N = 2, ``full`` / ``block`` N = 1, and ``selective``.  Each setting is checked against the
serial model (the whole model on the whole batch, one backward, no groups), against the
rule of :mod:`tutorial_lib.recompute` for what is kept, and against the trace for the
collectives the recomputed forward issues again.
"""
from collections import Counter
from dataclasses import replace

import pytest
import torch

from tests.dist.launch_once import launch_once
from tests.unit.test_recompute import predicted_kept
from tutorial_lib.arguments import TrainingArgs
from tutorial_lib.data import synthetic_batch
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.recompute import Recompute

pytestmark = pytest.mark.dist

ARGS = TrainingArgs(world_size=6, tensor_model_parallel_size=2, pipeline_model_parallel_size=3,
                    num_layers=9, global_batch_size=6, num_microbatches=3, seq_length=8,
                    hidden_size=16, num_attention_heads=4, vocab_size=32, num_experts=4,
                    moe_router_topk=2, clip_grad=0.0, timeout=180)
SETTINGS = {"none": Recompute(), "full-uniform-2": Recompute("full", "uniform", 2),
            "full-block-1": Recompute("full", "block", 1), "selective": Recompute("selective")}
ROWS = ARGS.global_batch_size // ARGS.num_microbatches  # rows of a microbatch (DP = 1)
#: The same model on CP 2 x PP 3, with and without selective recomputation.
CP_ARGS = replace(ARGS, tensor_model_parallel_size=1, context_parallel_size=2)
CP_SETTINGS = {"cp/none": Recompute(), "cp/selective": Recompute("selective")}


def _step_under_each_setting(ctx):
    """One step per setting, as ``train_4d`` runs it (DataParallel sums the experts'
    gradients over expert-DP, here the TP pair; SGD at lr 0 leaves the gradients):
    per-microbatch losses, gradients, bytes kept per microbatch."""
    from tutorial_lib import parallel_state
    from tutorial_lib.data_parallel import DataParallel
    from tutorial_lib.pipeline_parallel.executor import forward_backward_pipelining
    from tutorial_lib.saved_activations import saved_bytes_by_layer
    from tutorial_lib.tp_dp_step import finish_step
    from tutorial_lib.train_4d import _microbatches, build_chunks, moe_aux_loss_scale
    out = {}
    runs = [(ARGS, name, r) for name, r in SETTINGS.items()]
    runs += [(CP_ARGS, name, r) for name, r in CP_SETTINGS.items()]
    for base, name, recompute in runs:
        args = replace(base, recompute_granularity=recompute.granularity,
                       recompute_method=recompute.method, recompute_num_layers=recompute.num_layers)
        cp = args.context_parallel_size
        with ctx.tracer.tags(setting=name):
            parallel_state.initialize_model_parallel(args.configs()[0])
            chunks = build_chunks(args)
            kept = {}
            for chunk in chunks:
                def measured(hidden, batch, chunk=chunk, forward=chunk.forward_stage):
                    with saved_bytes_by_layer(chunk.parameters()) as saved:
                        result = forward(hidden, batch)
                    kept[int(batch.sample_ids[0]) // ROWS] = dict(saved)
                    return result
                chunk.forward_stage = measured
                chunk.reset_step_stats()
                chunk.aux_loss_scale = moe_aux_loss_scale(args.num_microbatches, cp)
            first = parallel_state.get_rank_in("pp") == 0
            shape = (args.seq_length // cp, ROWS, args.hidden_size)
            modules = torch.nn.ModuleList(chunks)
            # experts: summed over expert-DP (the TP pair; under CP the CP pair)
            model = DataParallel(modules, group="dp_cp" if cp > 1 else "dp")
            with model.no_sync():
                step = forward_backward_pipelining(chunks, _microbatches(args, 0, first, None),
                                                   args.schedule, args.p2p_mode, shape)
            finish_step(model, torch.optim.SGD(modules.parameters(), lr=0.0), None)
            out[name] = {
                "losses": dict(step.losses), "kept": kept,
                "layers": [int(i) for i in chunks[0].layers],
                "grads": {n: p.grad.clone() for n, p in chunks[0].named_parameters()},
                "split": {n: getattr(p, "partition_dim", 0) for n, p in chunks[0].named_parameters()
                          if getattr(p, "tensor_model_parallel", False)},
                "tp_rank": parallel_state.get_rank_in("tp")}
    return out


@launch_once
def run():
    from tutorial_lib.launch import launch
    return launch(_step_under_each_setting, ARGS.world_size, trace=True, timeout=180)


def _serial():
    """The whole model on the whole batch: each microbatch's loss, and the gradients of the
    mean over the microbatches (what the pipeline's ``loss / M`` backward gives)."""
    _, model_config, _ = ARGS.configs()
    model = DeepSeekModel(model_config, seed=ARGS.seed)
    ids, labels = synthetic_batch(ARGS.seed, 0, ARGS.global_batch_size, ARGS.seq_length,
                                  ARGS.vocab_size)
    model(ids, labels, sample_ids=torch.arange(ARGS.global_batch_size), step=0).backward()
    losses = {}
    with torch.no_grad():
        for i in range(ARGS.num_microbatches):
            rows = slice(i * ROWS, (i + 1) * ROWS)
            losses[i] = float(model(ids[rows], labels[rows],
                                    sample_ids=torch.arange(ARGS.global_batch_size)[rows]))
    return losses, {n: p.grad for n, p in model.named_parameters()}


def test_recomputation_gives_the_serial_losses_and_gradients():
    """Under every setting each microbatch's loss (last stage) and every gradient of every
    rank (after the expert-DP sum of the experts' gradients and ``finish_step``'s TP sum of
    the router and shared-expert gradients; a TP shard compared with its slice) equal the serial model's, ``atol = 1e-6``,
    ``rtol = 1e-5`` (fp32, different summation orders); and each recomputing setting's
    are bit for bit those of the run without recomputation on the same layout, since the
    same operations run on the same values.  Megatron-Core 0.20.0 (d98e8a64) recomputes
    with ``tensor_parallel.checkpoint`` (megatron/core/tensor_parallel/random.py,
    ``CheckpointFunction``) and likewise changes no number."""
    serial_losses, serial_grads = _serial()
    results = run().results
    for rank, res in enumerate(results):
        for name in SETTINGS:
            mine = res[name]
            if mine["losses"]:  # the last stage
                assert mine["losses"].keys() == serial_losses.keys()
                for i, loss in mine["losses"].items():
                    assert abs(loss - serial_losses[i]) < 1e-5, (name, rank, i)
            for param, grad in mine["grads"].items():
                want = serial_grads[param]
                if param in mine["split"]:
                    want = want.chunk(ARGS.tensor_model_parallel_size,
                                      mine["split"][param])[mine["tp_rank"]]
                torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{name} rank {rank} {param}: {m}")
                assert torch.equal(grad, res["none"]["grads"][param]), (name, rank, param)


def test_recomputation_keeps_what_the_rule_predicts_on_every_rank_and_microbatch():
    """The bytes each rank's chunk keeps for backward per microbatch, per layer, measured
    with ``saved_tensors_hooks`` around the stage's forward: under each setting, the plain
    run's bytes of a layer that keeps everything, one ``[s, b, h]`` fp32 input per
    checkpointed group (:func:`tutorial_lib.recompute.kept_per_layer`, after Megatron-Core
    0.20.0's megatron/core/recompute.py ``checkpointed_forward``, d98e8a64), nothing for the
    rest of a group, and under selective recomputation the plain bytes less the attention's
    log-sum-exp, ``b x heads/TP x s`` fp32 values a layer.  ``full`` / ``uniform`` N = 2 on
    3 layers keeps 2 inputs a microbatch where the plain run keeps 3 layers' activations."""
    s, h = ARGS.seq_length, ARGS.hidden_size
    heads = ARGS.num_attention_heads // ARGS.tensor_model_parallel_size
    for rank, res in enumerate(run().results):
        plain = res["none"]["kept"]
        assert sorted(plain) == list(range(ARGS.num_microbatches))
        layers = res["none"]["layers"]
        for name, recompute in SETTINGS.items():
            for microbatch, kept in res[name]["kept"].items():
                local = {None: plain[microbatch].get(None, 0),
                         **{i: plain[microbatch][layer] for i, layer in enumerate(layers)}}
                want = predicted_kept(local, recompute, len(layers), s * ROWS * h * 4,
                                      ROWS * heads * s * 4)
                want = {None if k is None else layers[k]: v for k, v in want.items() if v}
                assert kept == want, (name, rank, microbatch)
        saved = sum(res["full-uniform-2"]["kept"][0].values())
        assert saved < sum(plain[0].values()) / 3, rank


def _in_layers(events):
    """(microbatch, layer, op, op_name, group, bytes) of each collective issued inside a layer."""
    return Counter((e.tags["microbatch"], e.tags["layer_number"], e.op, e.tags.get("op_name"),
                    e.group_kind, e.bytes)
                   for e in events if "layer_number" in e.tags and e.tags.get("phase") != "backward")


def test_the_trace_shows_each_recomputed_layers_collectives_a_second_time():
    """What recomputing a tensor-parallel layer costs in communication: every collective its
    forward issued (the attention and dense MLP's TP all-reduces, the MoE layer's TP
    all-gather of its split sequence, the TP sums of its balance loss, and with expert
    tensor parallelism (ETP = TP = 2, Megatron's default, as here) the expert-TP
    all-gathers of the dispatched counts and rows and the reduce-scatter of the experts'
    partial outputs) is issued again in
    backward, tagged ``recompute=True``, with the same group and bytes, once for each
    microbatch and recomputed layer: under ``full`` / ``uniform`` every layer, under
    ``full`` / ``block`` N = 1 the first layer of each stage only, under ``selective`` none
    (the core attention is local to a rank's heads).  As Megatron-Core 0.20.0's
    ``CheckpointFunction`` (d98e8a64, megatron/core/tensor_parallel/random.py) reruns the
    whole layer forward, so does ``tutorial_lib.recompute.checkpoint`` (early stop off)."""
    result = run()
    for rank in range(ARGS.world_size):
        layers = result.results[rank]["none"]["layers"]
        first = {layers[0]}
        for name, recomputed_layers in (("full-uniform-2", set(layers)), ("full-block-1", first),
                                        ("selective", set())):
            events = result.trace.filter(rank=rank, comm_only=True, setting=name)
            again = _in_layers(e for e in events if e.tags.get("recompute"))
            once = _in_layers(e for e in events if not e.tags.get("recompute"))
            assert once == _in_layers(result.trace.filter(rank=rank, comm_only=True, setting="none"))
            want = Counter({key: n for key, n in once.items() if key[1] in recomputed_layers})
            assert again == want, (name, rank)
            # counted by hand, per microbatch: a dense layer all-reduces its attention and MLP
            # outputs; a MoE layer its attention output and the two sums of its sequence-wise
            # balance loss over the TP ranks' tokens, all-gathers its output, all-gathers the
            # shared experts' input and reduce-scatters their output over TP, and over the
            # expert-TP group (ETP = TP) all-gathers the dispatched counts and rows and
            # reduce-scatters the experts' partial outputs
            ops = Counter()
            for (_, _, op, _, group, _), n in again.items():
                ops[op, group] += n
            dense = sum(layer < ARGS.first_k_dense_replace for layer in recomputed_layers)
            moe = len(recomputed_layers) - dense
            m = ARGS.num_microbatches
            want_ops = {("all_reduce", "tp"): m * (2 * dense + 3 * moe),
                        ("all_gather", "tp"): 2 * m * moe, ("reduce_scatter", "tp"): m * moe,
                        ("all_gather", "expert_tp"): 2 * m * moe,
                        ("reduce_scatter", "expert_tp"): m * moe}
            assert ops == Counter({k: v for k, v in want_ops.items() if v}), (name, rank, ops)


def test_selective_recomputation_under_context_parallelism_repeats_the_kv_ring():
    """Under context parallelism the core attention is where the CP ranks talk (the K/V ring
    of ``cp_comm_type="p2p"``, Megatron-Core 0.20.0's ``AttnFuncWithCPAndKVP2P``, d98e8a64,
    megatron/core/extensions/transformer_engine.py via TE): selective recomputation reruns
    it, so every ring message of a layer's forward is sent a second time in backward,
    tagged ``recompute=True``, and nothing else is.  The gradients are bit for bit those of
    the run without recomputation on CP 2 x PP 3."""
    result = run()
    for rank, res in enumerate(result.results):
        for param, grad in res["cp/selective"]["grads"].items():
            assert torch.equal(grad, res["cp/none"]["grads"][param]), (rank, param)
        events = result.trace.filter(rank=rank, comm_only=True, setting="cp/selective")
        again = _in_layers(e for e in events if e.tags.get("recompute"))
        ring = _in_layers(e for e in events if not e.tags.get("recompute")
                          and e.group_kind == "cp" and e.op in ("send", "recv"))
        assert again == ring and sum(ring.values()) > 0, rank
