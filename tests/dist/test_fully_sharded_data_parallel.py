"""Sharded data parallelism (ZeRO-0 to ZeRO-3) on real gloo workers, and torch's FSDP2 beside it.

One launch per DP size (2 and 4; TP = 1, so the world is the DP group), shared by every test
below.  In each, chapter 3's ``GPTModel`` (2 blocks, fp32) trains 3 Adam steps of
``M = 2`` microbatches under each of Megatron-FSDP's four strategies
(:func:`tutorial_lib.fully_sharded_data_parallel.shard_data_parallel`: the units are the
two blocks and the root), plus two ZeRO-3 variants (FSDP2's default resharding, and no
prefetch); then the course's ZeRO-3 and torch's ``fully_shard`` train the same model on the
same data with the same Adam, 3 steps of one microbatch, in fp32 and under bf16 mixed
precision.

Tolerances.  Against the serial model (the plainest loop, in this process): losses
``atol = 1e-5``, parameters after 3 steps ``atol = 1e-4``, for the reasons
``test_tp_dp_training.py`` gives (summation order only; Adam with ``eps = 1e-5`` turns a
round-off difference in a near-zero gradient into at most ``lr x noise / eps`` per step).
Against torch's FSDP2: losses equal and parameters within ``1e-6`` (measured: equal bit for
bit at DP 2, fp32 and bf16; at DP 4 the losses equal and the parameters within 2.5e-7:
FSDP2 reduce-scatters with ``ReduceOp.AVG``, summing before it divides, the course
divides first).
"""
import sys
from collections import Counter

import cloudpickle
import pytest
import torch

from tutorial_lib import costs
from tutorial_lib.arguments import TrainingArgs
from tutorial_lib.config import ZERO_STAGE, ModelConfig, ParallelConfig, TrainConfig
from tutorial_lib.data import split_global_batch, synthetic_batch
from tutorial_lib.gpt import GPTModel

from .launch_once import launch_once

pytestmark = pytest.mark.dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                     vocab_size=32)
MODEL_SEED, DATA_SEED = 1, 0
GLOBAL_BATCH, MICROBATCHES, STEPS = 8, 2, 3
LR, EPS = 1e-2, 1e-5
LOSS_ATOL, PARAM_ATOL, TORCH_ATOL = 1e-5, 1e-4, 1e-6
DP_SIZES = (2, 4)
UNIT_NAMES = ["root", "layers.0", "layers.1"]  # the root first, then the blocks in order
#: name: (strategy, FullyShardedDataParallel options); ZeRO-3 reshards every unit (root too)
RUNS = {
    "no_shard": ("no_shard", {}),
    "optim": ("optim", {}),
    "optim_grads": ("optim_grads", {}),
    "optim_grads_params": ("optim_grads_params", {"reshard_after_forward": True}),
    "zero3_fsdp2_default": ("optim_grads_params", {"reshard_after_forward": None}),
    "zero3_no_prefetch": ("optim_grads_params", {"reshard_after_forward": True,
                                                 "prefetch": False}),
}


def _global_batch(step):
    return synthetic_batch(DATA_SEED, step, GLOBAL_BATCH, CONFIG.seq_length, CONFIG.vocab_size)


def _full_params(model, optimizer):
    """``{name: whole parameter}`` on this rank: the model's own, or gathered from the
    units' slices under ZeRO-3 (a collective over DP)."""
    fsdp = getattr(optimizer, "fsdp", None)
    if fsdp is None or fsdp.stage < 3:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for unit in fsdp.units:
        for p, piece in zip(unit.params, unit.unflatten(unit.gather(unit.main_param.detach()))):
            out[names[id(p)]] = piece.clone()
    return out


def _course_run(ctx, name, strategy, options, microbatches=MICROBATCHES, steps=STEPS):
    from tutorial_lib import parallel_state
    from tutorial_lib.fully_sharded_data_parallel import shard_data_parallel
    from tutorial_lib.memory import measure_state_bytes
    from tutorial_lib.tp_dp_step import train_step
    dp_rank, dp = parallel_state.get_rank_in("dp"), parallel_state.get_size("dp")
    model = GPTModel(CONFIG, seed=MODEL_SEED)
    wrapped, optimizer = shard_data_parallel(model, strategy, units=list(model.layers),
                                             fsdp_options=options, lr=LR, eps=EPS)
    fsdp = getattr(optimizer, "fsdp", None)
    run = {"losses": [], "peak_unsharded": []}
    for step in range(steps):
        if fsdp is not None:
            fsdp.reset_peak()
        batch = split_global_batch(_global_batch(step), dp_rank, dp)
        with ctx.tracer.tags(run=name, step=step):
            run["losses"].append(train_step(wrapped, optimizer, batch, microbatches,
                                            log_loss=False).loss)
        if fsdp is not None:
            run["peak_unsharded"].append(fsdp.peak_unsharded_bytes)
    run["memory"] = measure_state_bytes(model, optimizer)
    run["params"] = _full_params(model, optimizer)
    if fsdp is not None:
        run["slices"] = [unit.main_param.detach().clone() for unit in fsdp.units]
        run["unit_numels"] = [unit.numel for unit in fsdp.units]
        run["unit_names"] = [unit.name for unit in fsdp.units]
    return run


def _torch_fsdp2_run(ctx, dp, bf16):
    """torch 2.13.0's FSDP2: ``fully_shard(block)`` per block, then ``fully_shard(model)``, on a
    1-D gloo CPU DeviceMesh over the DP ranks, ``reshard_after_forward=True``, and
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` when
    ``bf16`` (else the default policy, fp32); ``torch.optim.Adam`` on its DTensor shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from tutorial_lib import parallel_state
    dp_rank = parallel_state.get_rank_in("dp")
    model = GPTModel(CONFIG, seed=MODEL_SEED, tp_group=None)
    mesh = init_device_mesh("cpu", (dp,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*split_global_batch(_global_batch(step), dp_rank, dp))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses,
            "local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


def _worker(ctx):
    from tutorial_lib import parallel_state
    from tutorial_lib.fully_sharded_data_parallel import MixedPrecisionPolicy
    parallel_state.initialize_model_parallel(ParallelConfig(ctx.world_size), layout="megatron")
    dp = parallel_state.get_size("dp")
    out = {"runs": {name: _course_run(ctx, name, strategy, options)
                    for name, (strategy, options) in RUNS.items()}}
    for bf16 in (False, True):
        policy = (MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16
                  else MixedPrecisionPolicy())
        key = "bf16" if bf16 else "fp32"
        out["course_" + key] = _course_run(
            ctx, "course_" + key, "optim_grads_params",
            {"reshard_after_forward": True, "mp_policy": policy}, microbatches=1)
        out["torch_" + key] = _torch_fsdp2_run(ctx, dp, bf16)
    return out


@launch_once
def _run(dp):
    from tutorial_lib.launch import launch
    return launch(_worker, dp, timeout=240)


_SERIAL = {}


def _serial(steps=STEPS):
    """The serial model, the whole global batch a step, ``torch.optim.Adam``, ``steps`` steps."""
    if steps not in _SERIAL:
        model = GPTModel(CONFIG, seed=MODEL_SEED, tp_group=None)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        losses = []
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(*_global_batch(step))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        _SERIAL[steps] = {"losses": losses,
                          "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return _SERIAL[steps]


def _replica_losses(results, run):
    """The mean over the DP replicas of each step's loss (each rank logged its own)."""
    return [sum(r["runs"][run]["losses"][s] for r in results) / len(results)
            for s in range(STEPS)]


@pytest.mark.parametrize("dp", DP_SIZES)
def test_every_strategy_trains_like_the_serial_model(dp):
    """Every strategy (and ZeRO-3 with FSDP2's default resharding, and without prefetch)
    gives the serial model's loss at each of 3 steps and its parameters after them, on
    every rank (tolerances: the module docstring)."""
    results = _run(dp).results
    serial = _serial()
    for name in RUNS:
        losses = _replica_losses(results, name)
        assert losses == pytest.approx(serial["losses"], abs=LOSS_ATOL), (name, losses)
        for rank, result in enumerate(results):
            for param_name, value in result["runs"][name]["params"].items():
                expected = serial["params"][param_name]
                assert torch.allclose(value, expected, atol=PARAM_ATOL), (name, rank, param_name)
    assert serial["losses"][1] != serial["losses"][0]


@pytest.mark.parametrize("dp", DP_SIZES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_course_zero3_equals_torch_fully_shard(dp, precision):
    """The course's ZeRO-3 and torch 2.13.0's ``fully_shard`` (per block and the root,
    ``reshard_after_forward=True``, gloo CPU mesh; bf16: ``MixedPrecisionPolicy(param_dtype=
    bfloat16, reduce_dtype=float32)`` on both sides), the same model, data and Adam: the same
    loss at each of 3 steps on every rank, and the same parameter shards after them: FSDP2's
    local shard of each parameter (its rows ``torch.chunk(p, DP)[rank]``) equals those rows of
    the course's parameter, and the course's flat slice of each unit equals that slice of the
    unit's vector made of FSDP2's parameters.  Within ``1e-6`` (module docstring).  FSDP2's
    layout as read in torch 2.13.0's wheel: torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    ``FSDPParam._init_sharded_param`` (``_chunk_with_empty`` along dim 0, the first chunk's
    size the padded one), _fsdp_collectives.py ``foreach_reduce`` (``ReduceOp.AVG`` for fp32
    and bf16, from ``_get_gradient_divide_factors``)."""
    results = _run(dp).results
    for rank, result in enumerate(results):
        ours, theirs = result["course_" + precision], result["torch_" + precision]
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=TORCH_ATOL), rank
        for name, local in theirs["local"].items():  # every dim 0 here divides by DP
            rows = torch.chunk(ours["params"][name], dp)[rank]
            assert torch.allclose(local, rows, atol=TORCH_ATOL), (rank, name)
        for names, numel, flat_slice in zip(_unit_param_names(ours), ours["unit_numels"],
                                            ours["slices"]):
            vector = torch.cat([theirs["full"][n].reshape(-1) for n in names])
            padded = torch.zeros(len(flat_slice) * dp)
            padded[:numel] = vector
            mine = padded[rank * len(flat_slice):(rank + 1) * len(flat_slice)]
            assert torch.allclose(flat_slice, mine, atol=TORCH_ATOL), (rank, names)
    assert results[0]["course_" + precision]["losses"][0] != results[0]["course_" + precision]["losses"][2]


def _unit_param_names(run):
    """The parameter names of each unit, in the unit's flat order (the model's order)."""
    names = list(run["params"])
    layers = [[n for n in names if n.startswith(u + ".")] for u in run["unit_names"][1:]]
    in_layers = {n for group in layers for n in group}
    return [[n for n in names if n not in in_layers]] + layers


def _dp_events(result_trace, rank, run, step=0):
    return [e for e in result_trace.events
            if e.rank == rank and e.op != "compute" and e.tags.get("run") == run
            and e.tags.get("step") == step and e.group_kind == "dp"]


@pytest.mark.parametrize("dp", DP_SIZES)
def test_trace_bytes_per_unit_equal_the_cost_formula(dp):
    """Every data-parallel collective of step 1, on every rank, is a row of
    :func:`tutorial_lib.costs.sharded_step_collectives` (op, phase, unit, bytes, count), and
    so are the bytes put on the wire (ring algorithms); with one microbatch a step they are
    plain DP's for ZeRO-1 and ZeRO-2 and 1.5x plain DP's for ZeRO-3 with every unit
    resharded, as the one-microbatch ZeRO-3 run measures: Rajbhandari et al. 2020, ZeRO,
    section 7.2 (``3 Psi`` against DP's ``2 Psi``)."""
    result = _run(dp)
    numels = result.results[0]["runs"]["optim_grads_params"]["unit_numels"]
    for name, (strategy, options) in RUNS.items():
        rows = costs.sharded_step_collectives(
            numels, dp, strategy, MICROBATCHES, reshard_after_forward=options.get(
                "reshard_after_forward", True), unit_names=UNIT_NAMES)
        expected = Counter()
        for row in rows:
            unit = row.what.split(":")[0] if ZERO_STAGE[strategy] >= 2 else None
            expected[row.op, row.phase, unit, row.bytes_each] += row.count
        for rank in range(dp):
            events = _dp_events(result.trace, rank, name)
            got = Counter((e.op, e.tags["phase"], e.tags.get("unit"), e.bytes) for e in events)
            assert got == expected, (name, rank, got, expected)
            measured = sum(costs.ring_bytes_sent(e.op, e.bytes, dp) for e in events)
            assert measured == costs.step_bytes_sent(rows, {"dp": dp}), (name, rank)
    # One microbatch a step (ZeRO-2 and ZeRO-3 reduce-scatter after every microbatch's
    # backward, plain DP and ZeRO-1 once a step): the paper's comparison.
    sent = {strategy: costs.step_bytes_sent(costs.sharded_step_collectives(
        numels, dp, strategy, 1, unit_names=UNIT_NAMES), {"dp": dp}) for strategy in ZERO_STAGE}
    assert sent["optim"] == sent["optim_grads"] == sent["no_shard"] > 0
    assert sent["optim_grads_params"] == 1.5 * sent["no_shard"]
    for rank in range(dp):  # the fp32 run beside torch's trains one microbatch a step
        events = _dp_events(result.trace, rank, "course_fp32")
        assert sum(costs.ring_bytes_sent(e.op, e.bytes, dp) for e in events) \
            == sent["optim_grads_params"]


@pytest.mark.parametrize("dp", DP_SIZES)
def test_zero3_prefetches_the_next_unit_under_this_units_compute(dp):
    """With prefetch, the all-gathers of one microbatch are issued root, layers.0, layers.1
    in forward (each block's issued by the unit before it) and root, layers.1, layers.0 in
    backward (FSDP2's backward prefetch: the unit whose forward ran before); every
    prefetched all-gather is issued before the previous unit's compute span starts and
    completes after it ends, so it is in flight under that compute.  Without prefetch each
    unit's gather is issued by the unit itself.  FSDP2's backward prefetch, as read in torch
    2.13.0's wheel: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
    ``FSDPParamGroup._backward_prefetch`` unshards ``post_forward_order[index - 1]`` (one
    parameter group per module); its forward prefetch is explicit only
    (``set_modules_to_forward_prefetch``), the course's ``prefetch`` does both."""
    trace = _run(dp).trace
    for rank in range(dp):
        for name, prefetch in (("optim_grads_params", True), ("zero3_no_prefetch", False)):
            events = sorted((e for e in _dp_events(trace, rank, name)
                             if e.op == "all_gather" and e.tags.get("microbatch") == 0),
                            key=lambda e: e.t_start)
            order = {phase: [(e.tags["unit"], e.tags["prefetch"]) for e in events
                             if e.tags["phase"] == phase] for phase in ("forward", "backward")}
            assert order == {
                "forward": [("root", False), ("layers.0", prefetch), ("layers.1", prefetch)],
                "backward": [("root", False), ("layers.1", prefetch), ("layers.0", prefetch)],
            }, (rank, name, order)
        spans = {e.tags["name"]: e for e in trace.events
                 if e.rank == rank and e.op == "compute" and e.tags.get("run") == "optim_grads_params"
                 and e.tags.get("step") == 0 and e.tags.get("microbatch") == 0 and "unit" in e.tags}
        gathers = {(e.tags["phase"], e.tags["unit"]): e for e in _dp_events(trace, rank, "optim_grads_params")
                   if e.op == "all_gather" and e.tags.get("microbatch") == 0 and e.tags["prefetch"]}
        for (phase, unit), under in ((("forward", "layers.1"), "forward layers.0"),
                                     (("backward", "layers.0"), "backward layers.1")):
            gather, span = gathers[phase, unit], spans[under]
            assert gather.t_start <= span.t_start and gather.t_end >= span.t_end, (rank, unit)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_memory_per_rank_equals_the_memory_model(dp):
    """After the last step every rank's weights, gradients and optimizer state, read from its
    tensors (:func:`tutorial_lib.memory.measure_state_bytes`), equal
    :func:`tutorial_lib.costs.memory_per_rank` under each strategy to the byte, and under
    ZeRO-3 the most gathered parameter bytes held at once in each step equal its
    ``gathered`` (prefetch or not, the root resharded or not)."""
    results = _run(dp).results
    parallel, train = ParallelConfig(dp), TrainConfig(GLOBAL_BATCH, MICROBATCHES)
    for name, (strategy, options) in RUNS.items():
        predicted = costs.memory_per_rank(
            CONFIG, parallel, train, data_parallel_sharding_strategy=strategy,
            reshard_after_forward=options.get("reshard_after_forward"),
            prefetch=options.get("prefetch", True))[0]
        for rank, result in enumerate(results):
            run = result["runs"][name]
            for key in ("weights", "gradients", "optimizer"):
                assert run["memory"][key] == getattr(predicted, key), (name, rank, key)
            if ZERO_STAGE[strategy] == 3:
                assert run["peak_unsharded"] == [predicted.gathered] * STEPS, (name, rank)
    plain = costs.memory_per_rank(CONFIG, parallel, train)[0]
    zero3 = costs.memory_per_rank(CONFIG, parallel, train,
                                  data_parallel_sharding_strategy="optim_grads_params")[0]
    assert zero3.weights + zero3.gradients + zero3.optimizer < plain.weights + plain.gradients \
        + plain.optimizer


# --- checkpoints: saved under one strategy and DP size, resumed under another ---------------

LEG_STEPS = 2
"""Steps trained by each leg of the resumed run (three legs, the serial run trains all six)."""
LOADERS = ("optim", "optim_grads", "optim_grads_params", "no_shard")
"""The strategies that load the ZeRO-3 checkpoint on 2 ranks (and save again)."""
CHECKPOINT_ARGS = TrainingArgs(
    num_layers=CONFIG.num_layers, hidden_size=CONFIG.hidden_size,
    num_attention_heads=CONFIG.num_attention_heads, seq_length=CONFIG.seq_length,
    vocab_size=CONFIG.vocab_size, num_experts=0, global_batch_size=GLOBAL_BATCH,
    num_microbatches=1, steps=3 * LEG_STEPS)
"""What a checkpoint records of the run (the model's shapes, the steps; common.json)."""


def _whole_state(model, optimizer):
    """``{name: {"param", "exp_avg", "exp_avg_sq", "step"}}``, every tensor whole, on this rank
    (gathered over DP from the slices under ZeRO-1/2/3: a collective)."""
    params = _full_params(model, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    by_param = (optimizer.get_parameter_state() if hasattr(optimizer, "get_parameter_state")
                else optimizer.state)
    return {names[id(p)]: {"param": params[names[id(p)]],
                           **{key: value.detach().clone() for key, value in state.items()}}
            for p, state in by_param.items()}


def _resume_leg(ctx, strategy, load_dir, save_dir, first_step):
    """Build the model under ``strategy`` (from another seed when it loads, so only the load
    can give it the weights), load ``load_dir``, train steps ``first_step`` on, save."""
    from tutorial_lib import parallel_state
    from tutorial_lib.dist_checkpointing import load_checkpoint, save_checkpoint
    from tutorial_lib.fully_sharded_data_parallel import shard_data_parallel
    from tutorial_lib.tp_dp_step import train_step
    dp_rank, dp = parallel_state.get_rank_in("dp"), parallel_state.get_size("dp")
    model = GPTModel(CONFIG, seed=MODEL_SEED + 6 if load_dir else MODEL_SEED)
    wrapped, optimizer = shard_data_parallel(model, strategy, units=list(model.layers),
                                             lr=LR, eps=EPS)
    out = {"losses": []}
    if load_dir is not None:
        out["iteration"] = load_checkpoint(load_dir, [model], optimizer, CHECKPOINT_ARGS)
        out["loaded"] = _whole_state(model, optimizer)
    for step in range(first_step, first_step + LEG_STEPS):
        batch = split_global_batch(_global_batch(step), dp_rank, dp)
        out["losses"].append(train_step(wrapped, optimizer, batch, 1, log_loss=False).loss)
    out["final"] = _whole_state(model, optimizer)
    if save_dir is not None:
        save_checkpoint(save_dir, first_step + LEG_STEPS, [model], optimizer, CHECKPOINT_ARGS)
    return out


def _resume_worker(ctx, legs):
    from tutorial_lib import parallel_state
    parallel_state.initialize_model_parallel(ParallelConfig(ctx.world_size), layout="megatron")
    return [_resume_leg(ctx, *leg) for leg in legs]


def _mean_losses(results, leg):
    return [sum(r[leg]["losses"][s] for r in results) / len(results) for s in range(LEG_STEPS)]


def _assert_same_state(got, expected, where):
    assert got.keys() == expected.keys(), where
    for name, tensors in expected.items():
        assert got[name].keys() == tensors.keys(), (where, name)
        for key, value in tensors.items():
            assert torch.equal(got[name][key], value), (where, name, key)


def test_a_zero3_checkpoint_resumes_under_every_strategy_then_on_one_rank(tmp_path):
    """ZeRO-3 on 4 ranks trains steps 1-2 and saves (each rank its boxes of each unit's fp32
    slice and Adam moments, nothing gathered); on 2 ranks each strategy (ZeRO-1, ZeRO-2,
    ZeRO-3, plain DP) loads it, trains steps 3-4 and saves; one rank loads each of those and
    trains steps 5-6.  The chain ZeRO-3 x 4 -> ZeRO-1 x 2 -> one rank, and the three others.

    Each load gives back exactly the state that was saved (every weight, Adam moment and
    step count, whole, bit for bit: DCP copies, nothing is recomputed).  The losses of every
    leg equal the serial model's uninterrupted six steps within ``LOSS_ATOL = 1e-5``: the
    legs average over 4, 2 and 1 ranks, which sums the gradients in other orders (module
    docstring)."""
    from tutorial_lib.launch import launch
    zero3 = str(tmp_path / "zero3")
    first = launch(_resume_worker, 4, args=([("optim_grads_params", None, zero3, 0)],),
                   timeout=240).results
    second = launch(_resume_worker, 2, args=(
        [(s, zero3, str(tmp_path / s), LEG_STEPS) for s in LOADERS],), timeout=240).results
    third = launch(_resume_worker, 1, args=(
        [("no_shard", str(tmp_path / s), None, 2 * LEG_STEPS) for s in LOADERS],),
        timeout=240).results
    serial = _serial(3 * LEG_STEPS)["losses"]
    assert _mean_losses(first, 0) == pytest.approx(serial[:LEG_STEPS], abs=LOSS_ATOL)
    saved = first[0][0]["final"]
    assert set(saved) == set(_serial(3 * LEG_STEPS)["params"])
    for index, strategy in enumerate(LOADERS):
        for rank, result in enumerate(second):
            assert result[index]["iteration"] == LEG_STEPS
            _assert_same_state(result[index]["loaded"], saved, (strategy, rank))
        assert _mean_losses(second, index) == pytest.approx(
            serial[LEG_STEPS:2 * LEG_STEPS], abs=LOSS_ATOL), strategy
        assert third[0][index]["iteration"] == 2 * LEG_STEPS
        _assert_same_state(third[0][index]["loaded"], second[0][index]["final"], strategy)
        assert _mean_losses(third, index) == pytest.approx(serial[2 * LEG_STEPS:],
                                                           abs=LOSS_ATOL), strategy
    assert serial[-1] != serial[0]
