"""``train_4d`` checkpoints (``--save`` / ``--load``, DCP), reshards, ZeRO-1, kills, Ctrl-C.

Real gloo ranks throughout.  One small model (12 layers so that PP = 3 and 4 divide them,
4 routed experts) and one chain of runs, each launched once and shared by the tests:

    reference        world 1, plain Adam, 4 steps                        (no checkpoint)
    tp2_pp2_dp2      8 ranks, plain Adam, 4 steps, --save-interval 2  -> iter 2, 4
    resume_same      8 ranks, TP2 x PP2 x DP2, --load iter 2           -> steps 2, 3
    to_pp4           8 ranks, PP4 x DP2, ZeRO-1, --load iter 2, 3 steps -> step 2, iter 3
    to_world_1       world 1, plain Adam, --load to_pp4's iter 3       -> step 3
    ep_zero          8 ranks, PP2 x EP2 x DP4 (EDP 2), ZeRO-1 (--data-parallel-sharding-strategy
                     optim), --save-interval 2
    ep_to_world_1    world 1, plain Adam, --load ep_zero's iter 2      -> steps 2, 3
    pp3_zero         6 ranks, PP3 x DP2, ZeRO-1, --save-interval 2; then resumed at iter 2
    pp3_zero3        6 ranks, PP3 x DP2, ZeRO-3 (optim_grads_params), --save-interval 2
    zero3_to_pp4     8 ranks, PP4 x DP2, ZeRO-1 (optim), --load pp3_zero3's iter 2 -> steps 2, 3
    zero2_tp2        4 ranks, TP2 x DP2 (experts over ETP = TP = 2, EDP 2), ZeRO-2, 1 step
                     -> iter 1
    zero3_tp2_ep2    4 ranks, TP2 x EP2 x DP2 (ETP 1, EDP 2), ZeRO-3, traced, --load
                     zero2_tp2's iter 1                                -> step 1, iter 2
    zero3_to_world_1 world 1, plain Adam, --load zero3_tp2_ep2's iter 2 -> steps 2, 3

Tolerances: the same layout resumed gives **identical bits** (the same sums in the same
order from the same state).  Another layout gives the uninterrupted losses to fp32
rounding, ``atol = 1e-5`` as in ``test_pipeline_training.py`` (measured: ~3e-7), and so
does ZeRO-1 against plain Adam: the gradient is reduce-scattered instead of all-reduced
and the clipping norm summed in another order.

Upstream: the checkpoint is PyTorch Distributed Checkpoint (torch 2.13,
``torch.distributed.checkpoint.save`` / ``load``, tensors described as ``DTensor``); the
names and rules are Megatron-LM's (d98e8a64, megatron-core 0.20.0):
``megatron/training/checkpointing.py`` (``iter_{:07d}``, the tracker, ``ckpt_step``, RNG
loaded only under the same TP and PP) and ``--use-distributed-optimizer``
(``megatron/core/optimizer/__init__.py``, ``get_megatron_optimizer``: the dense parameters'
DistributedOptimizer shards over the data-parallel group, the experts' over the
expert-data-parallel group; ``distrib_optimizer.py``'s ``get_parameter_state_dp_zero``
gathers the shards per parameter for a checkpoint).
"""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tutorial_lib import checkpointing
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.dist_checkpointing import PAUSE_BEFORE_COMMIT_ENV
from tutorial_lib.launch import descendants, launch
from tutorial_lib.config import ConfigError
from tutorial_lib.train_4d import TrainingArgs, train, train_worker, validate_args

from .conftest import wait_for_line, wait_until_gone
from .launch_once import launch_once
from tests.asserts import every

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
TRAIN_4D = ROOT / "examples" / "train_4d.py"
ATOL = 1e-5
BASE = TrainingArgs(steps=4, num_layers=12, hidden_size=16, num_attention_heads=4, vocab_size=32,
                    seq_length=8, num_experts=4, global_batch_size=8, num_microbatches=2, timeout=180)
TP2_PP2_DP2 = dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
PP4_DP2 = dict(world_size=8, pipeline_model_parallel_size=4)
PP2_EP2 = dict(world_size=8, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
PP3_DP2 = dict(world_size=6, pipeline_model_parallel_size=3)
TP2_DP2 = dict(world_size=4, tensor_model_parallel_size=2)
TP2_EP2 = dict(world_size=4, tensor_model_parallel_size=2, expert_model_parallel_size=2,
               expert_tensor_parallel_size=1)


def losses(result) -> dict[int, float]:
    """Step (0-based: the batch it draws, ``iteration - 1``) -> loss."""
    by_rank = [{r["iteration"] - 1: r["loss"] for r in records} for records in result.results]
    assert every(mine == by_rank[0] for mine in by_rank)  # every rank logs the same losses
    return by_rank[0]


def assert_close(got: dict, expected: dict, steps) -> None:
    assert sorted(got) == list(steps), got
    worst = max(abs(got[s] - expected[s]) for s in steps)
    assert worst < ATOL, (got, {s: expected[s] for s in steps}, worst)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@launch_once
def run(name: str, root: str):
    """The chain of runs of the module docstring; each once per session."""
    d = Path(root)
    if name == "reference":
        return train(BASE)
    if name == "tp2_pp2_dp2":
        return train(replace(BASE, **TP2_PP2_DP2, save=str(d / "a"), save_interval=2))
    if name == "resume_same":
        run("tp2_pp2_dp2", root)
        return train(replace(BASE, **TP2_PP2_DP2, load=str(d / "a"), ckpt_step=2))
    if name == "to_pp4":
        run("tp2_pp2_dp2", root)
        return train(replace(BASE, **PP4_DP2, use_distributed_optimizer=True, steps=3,
                             load=str(d / "a"), ckpt_step=2, save=str(d / "b")))
    if name == "to_world_1":
        run("to_pp4", root)
        return train(replace(BASE, load=str(d / "b")))
    if name == "ep_zero":
        # ZeRO-1 by Megatron-FSDP's name: the trace test below sees its reduce-scatter
        return train(replace(BASE, **PP2_EP2, data_parallel_sharding_strategy="optim",
                             save=str(d / "c"), save_interval=2), trace=True)
    if name == "ep_to_world_1":
        run("ep_zero", root)
        return train(replace(BASE, load=str(d / "c"), ckpt_step=2))
    if name == "pp3_zero":
        return train(replace(BASE, **PP3_DP2, use_distributed_optimizer=True, save=str(d / "e"),
                             save_interval=2))
    if name == "pp3_zero3":
        return train(replace(BASE, **PP3_DP2, data_parallel_sharding_strategy="optim_grads_params",
                             save=str(d / "z"), save_interval=2))
    if name == "zero3_to_pp4":
        run("pp3_zero3", root)
        return train(replace(BASE, **PP4_DP2, data_parallel_sharding_strategy="optim",
                             load=str(d / "z"), ckpt_step=2))
    if name == "zero2_tp2":
        return train(replace(BASE, **TP2_DP2, steps=1, data_parallel_sharding_strategy="optim_grads",
                             save=str(d / "g")))
    if name == "zero3_tp2_ep2":
        run("zero2_tp2", root)
        return train(replace(BASE, **TP2_EP2, steps=2, data_parallel_sharding_strategy="optim_grads_params",
                             load=str(d / "g"), save=str(d / "h")), trace=True)
    if name == "zero3_to_world_1":
        run("zero3_tp2_ep2", root)
        return train(replace(BASE, load=str(d / "h")))
    if name == "pp3_zero_resumed":
        run("pp3_zero", root)
        return train(replace(BASE, **PP3_DP2, use_distributed_optimizer=True, load=str(d / "e"),
                             ckpt_step=2))
    raise KeyError(name)


# --- resume and reshard ------------------------------------------------------------------


def test_saving_changes_nothing_and_the_checkpoints_are_committed(ckpt_root):
    reference = losses(run("reference", ckpt_root))
    saving = losses(run("tp2_pp2_dp2", ckpt_root))
    assert_close(saving, reference, range(4))
    root = ckpt_root / "a"
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", checkpointing.TRACKER_FILENAME]
    assert (root / checkpointing.TRACKER_FILENAME).read_text().strip() == "4"
    common = checkpointing.read_common_state(str(root / "iter_0000002"))
    assert common["iteration"] == 2 and common["consumed_train_samples"] == 2 * BASE.global_batch_size
    assert common["args"]["tensor_model_parallel_size"] == 2


def test_a_run_resumed_on_its_own_layout_gives_identical_bits(ckpt_root):
    """Resuming from iteration 2 (``--ckpt-step 2``; the tracker names 4) must replay steps 2
    and 3 exactly: the model, Adam's moments and step count, and the expert biases all come
    back bit for bit."""
    saving = losses(run("tp2_pp2_dp2", ckpt_root))
    resumed = losses(run("resume_same", ckpt_root))
    assert resumed == {2: saving[2], 3: saving[3]}


def test_a_checkpoint_reshards_tp2_pp2_dp2_to_pp4_dp2_to_one_rank(ckpt_root):
    """TP2 x PP2 x DP2 (plain Adam) -> PP4 x DP2 (ZeRO-1) -> world 1 (plain Adam): each hop
    loads the previous hop's checkpoint and continues with the uninterrupted losses."""
    saving = losses(run("tp2_pp2_dp2", ckpt_root))
    assert_close(losses(run("to_pp4", ckpt_root)), saving, [2])
    one = run("to_world_1", ckpt_root)
    assert_close(losses(one), saving, [3])
    said = [line for _, line in one.output[0]]
    assert any("the RNG state is ignored" in line for line in said), said  # TP, PP changed


def test_experts_reshard_from_pp2_ep2_with_zero1_to_one_rank(ckpt_root):
    reference = losses(run("reference", ckpt_root))
    assert_close(losses(run("ep_zero", ckpt_root)), reference, range(4))
    assert_close(losses(run("ep_to_world_1", ckpt_root)), reference, [2, 3])


def test_the_distributed_optimizer_really_shards_each_domain(ckpt_root):
    """ZeRO-1 replaces the DP all-reduce: the gradients are reduce-scattered over ``dp``
    (dense) and ``expert_dp`` (experts), the parameters all-gathered, and no bucket
    all-reduce runs during backward (Megatron-Core: DistributedOptimizer)."""
    trace = run("ep_zero", ckpt_root).trace.filter(step=1)
    scattered = {e.group_kind for e in trace.filter(op="reduce_scatter") if e.tags.get("zero") == 1}
    gathered = {e.group_kind for e in trace.filter(op="all_gather") if e.tags.get("zero") == 1}
    assert scattered == gathered == {"dp", "expert_dp"}
    assert not trace.filter(op="all_reduce", phase="backward").events


def test_zero1_with_three_stages_trains_and_resumes_like_plain_adam(ckpt_root):
    reference = losses(run("reference", ckpt_root))
    zero = losses(run("pp3_zero", ckpt_root))
    assert_close(zero, reference, range(4))
    assert losses(run("pp3_zero_resumed", ckpt_root)) == {2: zero[2], 3: zero[3]}  # same bits


def test_zero3_in_the_4d_run_saves_slices_that_resume_under_zero1_on_another_layout(ckpt_root):
    """train_4d under ZeRO-3 on PP3 x DP2 writes each unit's fp32 slices and Adam moments as
    boxes of the parameters' global names (``dist_checkpointing.unit_piece``, nothing
    gathered); PP4 x DP2 under ZeRO-1 loads iteration 2 and trains steps 2 and 3 with the
    uninterrupted plain-Adam losses (``ATOL``: the sums run in another order)."""
    reference = losses(run("reference", ckpt_root))
    assert_close(losses(run("pp3_zero3", ckpt_root)), reference, range(4))
    assert_close(losses(run("zero3_to_pp4", ckpt_root)), reference, [2, 3])


def test_zero2_and_zero3_checkpoints_beside_tp_and_ep_reshard_to_any_strategy(ckpt_root):
    """The slices of ZeRO-2 and ZeRO-3 beside TP and EP are saved as boxes of the whole
    parameters (a TP shard's, an expert's and an ETP shard's offsets added:
    ``dist_checkpointing.unit_piece``): ZeRO-2 on TP2 x DP2 (ETP 2) trains step 0 and saves;
    ZeRO-3 on TP2 x EP2 (ETP 1) loads it, trains step 1 and saves; plain Adam on one rank
    loads that and trains steps 2 and 3 (step 3 reads the Adam moments ZeRO-3 wrote).  Each
    leg gives the uninterrupted world-size-1 losses to ``ATOL``: the layouts sum the
    gradients in other orders, the loads themselves copy values."""
    reference = losses(run("reference", ckpt_root))
    assert_close(losses(run("zero2_tp2", ckpt_root)), reference, [0])
    assert_close(losses(run("zero3_tp2_ep2", ckpt_root)), reference, [1])
    assert_close(losses(run("zero3_to_world_1", ckpt_root)), reference, [2, 3])


def test_zero3_in_the_4d_run_prefetches_within_each_chunk(ckpt_root):
    """ZeRO-3 in train_4d prefetches inside a chunk, whose order every microbatch repeats:
    its forward runs the layers in order, so each layer but the first (its dense unit and
    its routed experts' unit alike) has its all-gather issued ahead (``prefetch=True``)
    before the previous layer's compute starts; its backward runs them in reverse, so each
    layer but the last is gathered ahead by the one after it.  Every unit is gathered once
    per microbatch and phase.  (The losses under prefetch: the chain above, and
    test_pipeline_training.py's ZeRO-3 layouts on PP 3, interleaved included.)"""
    trace = run("zero3_tp2_ep2", ckpt_root).trace.filter(step=1)
    last = BASE.num_layers - 1

    def layer(unit: str) -> int:
        return int(re.search(r"layers\.(\d+)", unit).group(1))

    for rank in range(TP2_EP2["world_size"]):
        for microbatch in range(BASE.num_microbatches):
            events = trace.filter(rank=rank, microbatch=microbatch)
            spans = {e.tags["name"]: e for e in events.filter(op="compute") if "unit" in e.tags}
            for phase, unprefetched, before in (("forward", 0, -1), ("backward", last, 1)):
                gathers = events.filter(op="all_gather", phase=phase, op_name="FSDPUnit.unshard")
                units = [e.tags["unit"] for e in gathers.events]
                assert len(units) == len(set(units)), units  # each unit once
                layers = [e for e in gathers.events if "layers." in e.tags["unit"]]
                assert {layer(e.tags["unit"]) for e in layers} == set(range(BASE.num_layers))
                assert not any(e.tags["prefetch"] for e in gathers.events if e not in layers)
                for gather in layers:  # the root is gathered by its own modules' hooks
                    unit = gather.tags["unit"]
                    assert gather.tags["prefetch"] == (layer(unit) != unprefetched), (phase, unit)
                    if layer(unit) != unprefetched:  # issued before the neighbour computes
                        neighbour = unit.split("[")[0].replace(f"layers.{layer(unit)}",
                                                               f"layers.{layer(unit) + before}")
                        assert gather.t_start <= spans[f"{phase} {neighbour}"].t_start, (phase, unit)


# --- what each rank wrote ----------------------------------------------------------------


def serial_model() -> DeepSeekModel:
    _, model, _ = BASE.configs()
    return DeepSeekModel(model, seed=BASE.seed)  # no groups: the whole model, global shapes


@pytest.mark.parametrize("name,sizes", [("a", {"tp": 2, "ep": 1, "etp": 2}),
                                        ("c", {"tp": 1, "ep": 2, "etp": 1})],
                         ids=["tp2_pp2_dp2", "pp2_ep2"])
def test_every_tensor_is_saved_once_under_its_global_name_and_shape(ckpt_root, name, sizes):
    """DCP's index holds every tensor of the whole model under its global name and shape,
    whatever layout saved it, in the chunks the layout's split predicts
    (checkpointing.tensor_sharding / local_chunk; under TP 2 the experts are split over ETP =
    TP = 2 too: expert_tp_sharding), each chunk stored once."""
    run("tp2_pp2_dp2" if name == "a" else "ep_zero", ckpt_root)
    metadata = FileSystemReader(str(ckpt_root / name / "iter_0000002")).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith("rng_state")}
    model = serial_model()
    params = dict(model.named_parameters())
    expected = {f"model.{n}" for n in model.state_dict()}
    expected |= {f"optimizer.state.{n}.{k}" for n in params for k in ("exp_avg", "exp_avg_sq", "step")}
    assert set(tensors) == expected
    stored = [index for index in metadata.storage_data if not index.fqn.startswith("rng_state")]
    assert len(stored) == len({(i.fqn, tuple(i.offset)) for i in stored})  # no chunk twice
    for name_, tensor in model.state_dict(keep_vars=True).items():
        for key in [f"model.{name_}"] + ([f"optimizer.state.{name_}.exp_avg"] if name_ in params else []):
            saved = tensors[key]
            assert tuple(saved.size) == tuple(tensor.shape), key
            sharding = checkpointing.tensor_sharding(
                getattr(tensor, "tensor_model_parallel", False), getattr(tensor, "partition_dim", None),
                getattr(tensor, "allreduce_group", "dp"))
            parts = sizes[sharding[0]] if sharding else 1
            predicted = {checkpointing.local_chunk(tuple(tensor.shape), sharding and sharding[1], i, parts)
                         for i in range(parts)}
            if sharding and sharding[0] == "ep" and sizes["etp"] > 1:  # TP x EP: ETP = TP
                dim = {"weight_down": 2}.get(name_.rsplit(".", 1)[1], 1)  # the serial model's
                assert checkpointing.expert_tp_sharding(True, dim, "expert_dp") == ("expert_tp", dim)
                predicted = {(offsets[:dim] + (offsets[dim] + inner[dim],) + offsets[dim + 1:],
                              sizes_[:dim] + (inner_sizes[dim],) + sizes_[dim + 1:])
                             for offsets, sizes_ in predicted
                             for inner, inner_sizes in (checkpointing.local_chunk(
                                 sizes_, dim, j, sizes["etp"]) for j in range(sizes["etp"]))}
            assert {(tuple(c.offsets), tuple(c.sizes)) for c in saved.chunks} == predicted, key
    if name == "a":
        qkv = tensors["model.layers.0.self_attention.linear_qkv.weight"]
        assert len(qkv.chunks) == 2  # TP2: two halves of the rows
    else:
        experts = tensors["model.layers.5.mlp.experts.weight_gate"]
        assert [tuple(c.offsets)[0] for c in sorted(experts.chunks, key=lambda c: c.offsets[0])] == [0, 2]


@pytest.mark.parametrize("name,iteration", [("g", 1), ("h", 2)], ids=["zero2_tp2", "zero3_tp2_ep2"])
def test_zero_slices_beside_tp_and_ep_are_boxes_that_tile_each_whole_tensor(ckpt_root, name, iteration):
    """DCP's index of a ZeRO-2 / ZeRO-3 checkpoint under TP (and EP) holds every tensor of
    the whole model under its global shape, and the boxes the ranks' slices wrote cover each
    tensor exactly once (counted element by element: none missing, none twice)."""
    run("zero2_tp2" if name == "g" else "zero3_tp2_ep2", ckpt_root)
    metadata = FileSystemReader(str(ckpt_root / name / f"iter_{iteration:07d}")).read_metadata()
    model = serial_model()
    for name_, tensor in model.state_dict(keep_vars=True).items():
        keys = [f"model.{name_}"]
        if isinstance(tensor, torch.nn.Parameter):
            keys += [f"optimizer.state.{name_}.exp_avg", f"optimizer.state.{name_}.exp_avg_sq"]
        for key in keys:
            saved = metadata.state_dict_metadata[key]
            assert tuple(saved.size) == tuple(tensor.shape), key
            covered = torch.zeros(tensor.shape, dtype=torch.int32)
            for chunk in saved.chunks:
                covered[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] += 1
            assert bool((covered == 1).all()), (key, covered.unique())


# --- RNG ---------------------------------------------------------------------------------


def _train_drawing_from_the_rng(ctx, args):
    """``train_worker`` whose ``on_step`` draws from torch's RNG (as code using the global RNG
    would), after noting its state; returns the notes."""
    seen = {}

    def on_step(record):
        seen[record["iteration"] - 1] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()
        torch.rand(7)
    train_worker(ctx, args, on_step)
    return seen


def test_the_rng_state_comes_back_on_the_same_tp_and_pp(tmp_path):
    """Megatron-LM saves the RNG state per (PP rank, TP rank) and loads it when TP and PP are
    the checkpoint's (checkpointing.get_rng_state / load_checkpoint)."""
    args = replace(BASE, num_layers=4, world_size=2, pipeline_model_parallel_size=2,
                   save=str(tmp_path), save_interval=2)
    first = launch(_train_drawing_from_the_rng, 2, args=(args,), trace=False).results
    again = launch(_train_drawing_from_the_rng, 2, trace=False,
                   args=(replace(args, save=None, load=str(tmp_path), ckpt_step=2),)).results
    for rank in range(2):
        assert again[rank] == {2: first[rank][2], 3: first[rank][3]}
    assert first[0][2] != first[0][0]  # the draws did move the state


# --- a kill during a save, and Ctrl-C, on the command line ------------------------------

CLI = ["--num-layers", "4", "--hidden-size", "16", "--vocab-size", "32", "--seq-length", "8",
       "--global-batch-size", "8", "--num-microbatches", "2", "--world-size", "2"]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


@contextmanager
def started(flags, **env):
    """``examples/train_4d.py FLAGS`` in a session of its own (as a terminal's foreground job);
    whatever is left of it is killed when the block ends."""
    process = subprocess.Popen([sys.executable, str(TRAIN_4D), *flags], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, env=_env(**env))
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


def _wait_for(predicate, process, seconds=180):
    """Wait until ``predicate()`` (a process appeared: one that prints nothing, found in
    /proc); fails when ``process`` ends or ``seconds`` pass first."""
    deadline = time.time() + seconds
    while not predicate():
        if process.poll() is not None or time.time() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"the run ended or stalled (rc {process.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.02)  # /proc has no wake-up for a new process: look again


def test_a_run_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    """SIGKILL while iteration 4 is written but not committed: the tracker still names
    iteration 2, ``--load`` resumes there with the uninterrupted bits (ZeRO-1 on DP2), and
    the half-written directory alone is refused (exit status 2 on the command line:
    tests/unit/test_checkpointing.py)."""
    save = tmp_path / "ckpt"
    flags = [*CLI, "--use-distributed-optimizer", "--steps", "4", "--save", str(save),
             "--save-interval", "2", "--json"]
    half = save / "iter_0000004.tmp"
    # without --json the ranks' output reaches the terminal, the save hook's line with it
    with started(flags[:-1], **{PAUSE_BEFORE_COMMIT_ENV: "4"}) as killed:
        # printed by rank 0 after the barrier that follows every rank's writes
        wait_for_line(killed.stderr, "test hook: iteration 4 is written", seconds=600)
        processes = descendants(killed.pid)
        os.killpg(killed.pid, signal.SIGKILL)  # the launcher and its forkserver
        killed.communicate()
    assert wait_until_gone(processes, 10) == []  # the workers follow their launcher
    assert (save / checkpointing.TRACKER_FILENAME).read_text().strip() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004.tmp", checkpointing.TRACKER_FILENAME]
    assert (half / ".metadata").exists()  # complete on disk, yet never committed
    only_half = tmp_path / "first_save_killed"  # as if the killed save had been the first
    shutil.copytree(half, only_half / half.name)

    reference = train(replace(BASE, num_layers=4, world_size=2, steps=4, use_distributed_optimizer=True))
    resumed = subprocess.run([sys.executable, str(TRAIN_4D), *flags, "--load", str(save)], text=True,
                             capture_output=True, timeout=300, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith("{")]
    assert {r["iteration"] - 1: r["loss"] for r in records} == {s: losses(reference)[s] for s in (2, 3)}
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", checkpointing.TRACKER_FILENAME]

    with pytest.raises(ConfigError, match=r"only interrupted saves \(iter_0000004.tmp\)"):
        validate_args(replace(BASE, num_layers=4, world_size=2, load=str(only_half)))


QUIET = ("Traceback", "KeyboardInterrupt", "leaked semaphore", "resource_tracker")


def test_ctrl_c_prints_one_line_with_the_step_and_the_command_to_resume(tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group: the launcher and its
    forkserver (the workers lead groups of their own and are ended by the launcher)."""
    save = tmp_path / "ckpt"
    flags = [*CLI, "--pipeline-model-parallel-size", "2", "--steps", "1000", "--save", str(save),
             "--save-interval", "1"]
    with started(flags) as run_:
        wait_for_line(run_.stdout, "saved checkpoint of iteration 2")
        processes = descendants(run_.pid)
        os.killpg(run_.pid, signal.SIGINT)
        out, err = run_.communicate(timeout=60)
    assert run_.returncode == 130, err[-3000:]
    assert wait_until_gone(processes, 10) == []
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("train_4d.py: interrupted in iteration ")
    latest = checkpointing.latest_checkpoint(str(save))
    assert latest is not None and latest.iteration >= 2
    assert f"last checkpoint: {latest.path} (iteration {latest.iteration})" in line
    assert line.endswith(f"--save-interval 1 --load {save}")
    assert not any(noise in err + out for noise in QUIET), err


def test_ctrl_c_while_the_workers_start_is_one_line_too(tmp_path):
    """Ctrl-C while the launcher's forkserver still imports torch: CPython's forkserver
    ignores SIGINT only after its imports, so it printed a KeyboardInterrupt traceback of
    its own; started with SIGINT ignored, it stays quiet."""
    with started([*CLI, "--pipeline-model-parallel-size", "2", "--steps", "1000"]) as run_:
        def forkserver_started():
            for pid in descendants(run_.pid):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"forkserver" in f.read():
                            return True
                except OSError:
                    pass
            return False
        _wait_for(forkserver_started, run_)
        os.killpg(run_.pid, signal.SIGINT)  # the forkserver is importing torch (seconds)
        out, err = run_.communicate(timeout=120)
    assert run_.returncode == 130, err[-3000:]
    assert err.strip().startswith("train_4d.py: interrupted") and len(err.strip().splitlines()) == 1, err
    assert not any(noise in err + out for noise in QUIET), err
