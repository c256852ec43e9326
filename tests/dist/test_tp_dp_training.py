"""The chapter's proof: TP + DP training on real gloo workers equals serial training.

The reference is the serial model: the same :class:`GPTModel` class and seed with no
process groups (world size 1), trained here in the test process by the plainest loop
there is (the whole global batch at once, ``torch.nn.utils.clip_grad_norm_``,
``torch.optim.Adam``), so it shares none of the code under test beyond the model.

The parallel runs: (TP, DP) in (1, 4), (2, 2), (2, 4), (4, 1), (4, 2), one launch each
(every TP value and every DP value appears), and in every launch four variants,
each trained for 3 optimizer steps with M = 2 microbatches of gradient accumulation:

=================  ==================  ==========  ================================
variant            sequence parallel   ZeRO-1      clipping (max_norm below the norm)
=================  ==================  ==========  ================================
``plain``          no                  no          no
``sp_clip``        yes                 no          yes (DataParallel + clip_grad_norm_)
``zero1``          no                  yes         no
``sp_zero1_clip``  yes                 yes         yes (inside the ZeRO-1 step)
=================  ==================  ==========  ================================

Compared with the serial run, fp32 throughout:

* at initialisation, every parameter: shard == slice of the serial one, exactly (one seed);

* the loss of each of the 3 steps, ``atol = rtol = 1e-5`` (the serial losses are ~3.5;
  the parallel ones differ by summation order only: measured <= 5e-7);
* the global gradient norm of each step when clipping, ``rtol = 1e-5``, and clipping
  really scaled (the serial norms all exceed ``MAX_NORM``);
* after step 1, before the optimizer: every parameter's gradient (shard vs slice of the
  serial gradient; for ZeRO-1 the DP-averaged shards its optimizer holds, reassembled),
  ``atol = 1e-7, rtol = 1e-4``: gradients are ~1e-2 at most and summation order moves
  them by at most ~2e-8 (measured); and the gradient of the embedding output (the first
  block's input), which is DP x the serial one (see :func:`test_tp_dp_training_equals_serial_training`);
* after step 3: every parameter (shard vs slice), ``atol = rtol = 1e-4``.  Why looser:
  Adam moves each weight by about ``lr * g / (|g| + eps)``, i.e. by ``lr`` whatever
  ``|g|`` is, so a round-off difference in a gradient near ``eps`` becomes a difference
  of order ``lr`` in the weight.  One gradient here is pure round-off: the attention's
  key bias shifts every score of a query by the same amount, which softmax ignores, so
  its true gradient is 0 and the computed one is ~5e-10 of noise that each layout draws
  differently.  With torch's default ``eps = 1e-8`` that noise moves the key bias by up
  to ~1e-3 differently per layout (measured); with ``eps = 1e-5`` (``lr = 1e-2``) by at most
  ``lr * 5e-10 / 1e-5`` ~ 5e-7 a step.  Measured worst differences after 3 steps: ~1.5e-6
  (every parameter, every layout), so the tolerance leaves a margin of ~60.

And the trace: the collectives of step 1 on every rank equal, op for op and byte for
byte, :func:`tutorial_lib.costs.tp_dp_step_collectives` (per op, group kind, phase tag
and size), and every TP collective stays inside the rank's TP group, every DP one
inside its DP group: nothing spans the world.

bf16 with an fp32 master copy (:data:`BF16_VARIANTS`, in the same launches): ZeRO-1
(``DistributedOptimizer`` on the bf16 model) against plain DP in bf16
(``DataParallel(grad_reduce_in_fp32=True)`` + ``Float16OptimizerWithFloat16Params``),
with and without clipping.  They run the same fp32 arithmetic on the same numbers (the
gradients add up and are averaged in fp32, each master is updated in fp32 and rounded
to bf16), so the bf16 parameters after 3 steps must be *equal*, bit for bit; what
differs is where the master and Adam's moments live: all of them on every rank, or
1/D of them (:func:`test_bf16_zero1_equals_plain_dp_with_an_fp32_master`).  With
clipping the two sum the norm's squares in another order: the scales differ by fp32
rounding, and a master on the edge between two bf16 values may round the other way, so
there a few values may be one bf16 step apart (:data:`CLIP_ROUNDING_FLIPS`).
"""
import dataclasses
import functools
import sys
from collections import Counter
from typing import NamedTuple

import cloudpickle
import pytest
import torch

from tutorial_lib import costs, parallel_state
from tutorial_lib.config import ModelConfig, ParallelConfig
from tutorial_lib.data_parallel import (DataParallel, DistributedOptimizer,
                                        Float16OptimizerWithFloat16Params)
from tutorial_lib.launch import launch
from tutorial_lib.gpt import GPTModel
from tutorial_lib.data import split_global_batch, synthetic_batch
from tutorial_lib.tp_dp_step import train_step

from .launch_once import launch_once
from .worker_checks import check as _check, close as _close
from tests.asserts import every

pytestmark = pytest.mark.dist

# The workers get the functions below by value, so they never import this module (and
# pytest with it: 0.2 s a rank).  Code that runs in a worker checks with _check, not a
# bare assert, which pytest would rewrite into a call into pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


CONFIG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=32)
MODEL_SEED, DATA_SEED = 1, 0
GLOBAL_BATCH, MICROBATCHES, STEPS = 8, 2, 3
LR, EPS = 1e-2, 1e-5  # eps: see the module docstring
MAX_NORM = 0.05  # below every step's gradient norm (checked), so clipping really scales
BUCKET_BYTES = 4096  # several DataParallel buckets even for this tiny model
LOSS_TOL = 1e-5
NORM_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-7, 1e-4
PARAM_TOL = 1e-4

LAYOUTS = [(1, 4), (2, 2), (2, 4), (4, 1), (4, 2)]  # (TP, DP)


class Variant(NamedTuple):
    sequence_parallel: bool
    zero1: bool
    clip: bool


VARIANTS = {
    "plain": Variant(False, False, False),
    "sp_clip": Variant(True, False, True),
    "zero1": Variant(False, True, False),
    "sp_zero1_clip": Variant(True, True, True),
}


# bf16 parameters with an fp32 master copy: plain DP against ZeRO-1 (not against serial).
BF16_VARIANTS = {
    "bf16_plain": Variant(False, False, False),
    "bf16_zero1": Variant(False, True, False),
    "bf16_plain_clip": Variant(False, False, True),
    "bf16_zero1_clip": Variant(False, True, True),
}
CLIP_ROUNDING_FLIPS = 5  # of a rank's 2,200 to 6,100 bf16 values: at most 1 seen; ZeRO-1
# left unclipped moves thousands, by up to 30,000 bf16 steps (checked)
BF16_LOSS_RTOL = 1e-2  # bf16 run vs the fp32 serial one: measured <= 2.7e-4 (loss), 1.9e-3 (norm)


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each element of ``a`` is from ``b`` (0: equal, +0 and -0
    too; 1: neighbours): their bit patterns, put in the order of the numbers, subtracted."""
    def ordered(x):
        bits = x.view(torch.int16).int()
        return torch.where(bits >= 0, bits, -(bits & 0x7FFF))
    return (ordered(a) - ordered(b)).abs()


def _max_norm(variant):
    return MAX_NORM if variant.clip else None


def _global_batch(step):
    return synthetic_batch(DATA_SEED, step, GLOBAL_BATCH, CONFIG.seq_length, CONFIG.vocab_size)


def _record_embedding_grads(model, store):
    """Keep the gradient of the embedding's output (the first block's input) of each forward."""
    def hook(module, inputs, output):
        output.register_hook(lambda grad: store.append(grad.detach().clone()))
    return model.embedding.register_forward_hook(hook)


# --- the serial reference -------------------------------------------------------------------

@functools.cache
def _serial(clip):
    """Train the serial model on the whole global batch (cached per clip setting)."""
    model = GPTModel(CONFIG, seed=MODEL_SEED, tp_group=None)
    init_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    embedding_grads = []
    handle = _record_embedding_grads(model, embedding_grads)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*_global_batch(step))
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            handle.remove()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if step == 0:
            clipped_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return {"init_params": init_params, "losses": losses, "norms": norms, "clipped_grads": clipped_grads,
            "embedding_grad": embedding_grads[0],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# --- the workers ----------------------------------------------------------------------------


def _train_steps(ctx, name, variant, wrapped, optimizer, run, after_step=lambda step: None):
    """``STEPS`` steps of ``variant`` on this rank's share of each global batch; each step's
    loss and gradient norm appended to ``run``."""
    dp_rank, dp = parallel_state.get_rank_in("dp"), parallel_state.get_size("dp")
    for step in range(STEPS):
        batch = split_global_batch(_global_batch(step), dp_rank, dp)
        with ctx.tracer.tags(variant=name, step=step):
            result = train_step(wrapped, optimizer, batch, MICROBATCHES,
                                max_grad_norm=_max_norm(variant))
        run["losses"].append(result.loss)
        run["norms"].append(result.grad_norm)
        after_step(step)


def _train_worker(ctx, tp_size):
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp_size), layout="megatron")
    dp_rank = parallel_state.get_rank_in("dp")
    out = {"tp_rank": parallel_state.get_rank_in("tp"), "dp_rank": dp_rank,
           "tp_group": parallel_state.get_group_ranks("tp"),
           "dp_group": parallel_state.get_group_ranks("dp"), "variants": {}}
    for name, variant in VARIANTS.items():
        config = dataclasses.replace(CONFIG, sequence_parallel=variant.sequence_parallel)
        model = GPTModel(config, seed=MODEL_SEED)
        if variant.zero1:
            wrapped = model
            optimizer = DistributedOptimizer(model.parameters(), torch.optim.Adam, lr=LR, eps=EPS)
        else:
            wrapped = DataParallel(model, bucket_size_bytes=BUCKET_BYTES)
            optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        embedding_grads = []
        handle = _record_embedding_grads(model, embedding_grads)
        run = {"losses": [], "norms": [],
               "init_params": {n: p.detach().clone() for n, p in model.named_parameters()}}

        def after_step(step):  # called inside this iteration: its names are this variant's
            if step == 0:
                handle.remove()
                run["embedding_grads"] = embedding_grads
                run["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
                if variant.zero1:
                    _check(len(optimizer.buffers) == 1, "one gradient domain expected")
                    run["zero1_grad_shard"] = optimizer.buffers[0].main_param.grad.clone()

        _train_steps(ctx, name, variant, wrapped, optimizer, run, after_step)
        run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        run["partition_dims"] = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False)
                                     else None) for n, p in model.named_parameters()}
        out["variants"][name] = run
    for name, variant in BF16_VARIANTS.items():
        model = GPTModel(CONFIG, seed=MODEL_SEED).bfloat16()
        if variant.zero1:
            wrapped = model
            optimizer = DistributedOptimizer(model.parameters(), torch.optim.Adam, lr=LR, eps=EPS)
        else:
            wrapped = DataParallel(model, bucket_size_bytes=BUCKET_BYTES, grad_reduce_in_fp32=True)
            optimizer = Float16OptimizerWithFloat16Params(model.parameters(), torch.optim.Adam,
                                                          lr=LR, eps=EPS)
        run = {"losses": [], "norms": []}
        _train_steps(ctx, name, variant, wrapped, optimizer, run)
        run["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        run["masters"] = [m.detach().clone() for m in optimizer.main_params]
        run["state_bytes"] = optimizer.state_bytes()
        out["variants"][name] = run
    return out


@launch_once
def _run(layout):
    """One launch per layout, shared by the tests below (a failure is remembered, not retried)."""
    tp, dp = layout
    return launch(_train_worker, tp * dp, args=(tp,), timeout=180)


# --- comparisons ----------------------------------------------------------------------------


def _slice(full, partition_dim, tp_rank, tp):
    """The piece of a serial tensor that TP rank ``tp_rank`` holds (all of it if replicated)."""
    return full if partition_dim is None else full.chunk(tp, partition_dim)[tp_rank]


def _zero1_grads(results, tp_rank, run_name):
    """The DP-averaged gradients of TP rank ``tp_rank``, reassembled from the ZeRO-1 shards."""
    holders = sorted((r for r in results if r["tp_rank"] == tp_rank), key=lambda r: r["dp_rank"])
    flat = torch.cat([r["variants"][run_name]["zero1_grad_shard"] for r in holders])
    grads, offset = {}, 0
    for name, param in holders[0]["variants"][run_name]["params"].items():
        grads[name] = flat[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    return grads


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}_dp{d}" for t, d in LAYOUTS])
def test_tp_dp_training_equals_serial_training(layout, variant):
    """Initial shards, losses, norms, step-1 gradients and step-3 parameters equal the serial run's.

    The gradient of the embedding output is a *replica's* gradient: DP averages only the
    parameter gradients.  Replica r's loss is the mean over its B/D sequences, the serial
    loss the mean over all B, so each of its activations' gradients is D times the
    serial one (a microbatch's mean is over M times fewer sequences; its 1/M scale cancels that).
    """
    tp, dp = layout
    v = VARIANTS[variant]
    serial = _serial(v.clip)
    results = _run(layout).results
    micro = GLOBAL_BATCH // dp // MICROBATCHES
    for rank, result in enumerate(results):
        run, tp_rank, dp_rank = result["variants"][variant], result["tp_rank"], result["dp_rank"]
        where = f"rank {rank} (tp {tp_rank}, dp {dp_rank}), {variant}"
        for name, param in run["init_params"].items():  # one seed: shard == slice, bit for bit
            expected = _slice(serial["init_params"][name], run["partition_dims"][name], tp_rank, tp)
            assert torch.equal(param, expected), f"{where}: initial {name} is not my slice of the serial one"
        assert run["losses"] == pytest.approx(serial["losses"], abs=LOSS_TOL, rel=LOSS_TOL), where
        if v.clip:
            assert run["norms"] == pytest.approx(serial["norms"], rel=NORM_RTOL), where
            assert min(serial["norms"]) > MAX_NORM  # clipping really scaled the gradients
        else:
            assert run["norms"] == [None] * STEPS

        grads = _zero1_grads(results, tp_rank, variant) if v.zero1 else run["grads"]
        expected_grads = serial["clipped_grads"]  # equal to the raw ones when not clipping
        for name, grad in grads.items():
            dim = run["partition_dims"][name]
            _close(grad, _slice(expected_grads[name], dim, tp_rank, tp), f"{where}: step-1 grad {name}",
                   GRAD_ATOL, GRAD_RTOL)

        assert len(run["embedding_grads"]) == MICROBATCHES
        for i, got in enumerate(run["embedding_grads"]):
            first = dp_rank * GLOBAL_BATCH // dp + i * micro
            expected = dp * serial["embedding_grad"][:, first:first + micro]  # [s, b, h]
            if v.sequence_parallel:
                expected = expected.chunk(tp, dim=0)[tp_rank]  # my [s/T, b, h] slice
            _close(got, expected, f"{where}: microbatch {i} embedding-output grad", GRAD_ATOL, GRAD_RTOL)

        for name, param in run["params"].items():
            dim = run["partition_dims"][name]
            _close(param, _slice(serial["params"][name], dim, tp_rank, tp), f"{where}: step-3 param {name}",
                   PARAM_TOL, PARAM_TOL)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}_dp{d}" for t, d in LAYOUTS])
def test_step_collectives_equal_the_prediction(layout, variant):
    tp, dp = layout
    v = VARIANTS[variant]
    res = _run(layout)
    config = dataclasses.replace(CONFIG, sequence_parallel=v.sequence_parallel)
    rows = costs.tp_dp_step_collectives(
        config, tp, dp, micro_batch_size=GLOBAL_BATCH // dp // MICROBATCHES,
        num_microbatches=MICROBATCHES, zero1=v.zero1, bucket_size_bytes=BUCKET_BYTES, clip_grad=v.clip)
    expected = Counter()
    for row in rows:
        expected[(row.op, row.group_kind, row.phase, row.bytes_each)] += row.count
    for rank, result in enumerate(res.results):
        run = result["variants"][variant]
        shapes = [(n, tuple(p.shape)) for n, p in run["params"].items()]
        assert shapes == costs.gpt_parameter_shapes(config, tp)
        events = res.trace.filter(rank=rank, variant=variant, step=0, comm_only=True)
        got = Counter((e.op, e.group_kind, e.tags.get("phase"), e.bytes) for e in events)
        assert got == expected, f"rank {rank}: only traced {got - expected}, only predicted {expected - got}"
        for e in events:  # TP inside a replica, DP across replicas: nothing spans the world
            assert list(e.group_ranks) == result[f"{e.group_kind}_group"], e
        if not v.zero1:  # the first buckets start inside the last microbatch's backward
            buckets = events.filter(group_kind="dp", phase="backward")
            assert any(e.tags["overlap"] for e in buckets)
            assert every(e.tags.get("microbatch", MICROBATCHES - 1) == MICROBATCHES - 1 for e in buckets)


# --- bf16 parameters, fp32 master: ZeRO-1 against plain DP ---------------------------------


@pytest.mark.parametrize("clip", [False, True], ids=["no_clip", "clip"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}_dp{d}" for t, d in LAYOUTS])
def test_bf16_zero1_equals_plain_dp_with_an_fp32_master(layout, clip):
    """ZeRO-1 on bf16 parameters trains exactly as plain DP with an fp32 master, on 1/D of
    the optimizer state, and moves fp32 gradients and bf16 parameters.

    The rule, from Megatron-Core 0.20.0 (NVIDIA/Megatron-LM d98e8a64):
    ``megatron/core/optimizer/distrib_optimizer.py``, ``DistributedOptimizer.
    _build_model_and_main_param_groups``: for a bf16 parameter each rank keeps an fp32
    copy of its shard only (the main parameter the optimizer steps); ``megatron/core/
    optimizer/optimizer.py``, ``Float16OptimizerWithFloat16Params``: without the
    distributed optimizer every rank keeps an fp32 copy of every parameter;
    ``megatron/training/arguments.py``, ``validate_args``: ``--bf16`` accumulates and
    reduces gradients in fp32 unless ``--grad-reduce-in-bf16``; ``megatron/core/
    distributed/param_and_grad_buffer.py``, ``start_param_sync``: the updated parameters
    are all-gathered from the bf16 parameter buffer.
    """
    tp, dp = layout
    res = _run(layout)
    plain_name, zero_name = ("bf16_plain_clip", "bf16_zero1_clip") if clip else ("bf16_plain", "bf16_zero1")
    serial = _serial(clip)
    for rank, result in enumerate(res.results):
        plain, zero = result["variants"][plain_name], result["variants"][zero_name]
        where = f"rank {rank}, {'clip' if clip else 'no clip'}"
        # The same training: the same bf16 parameters after 3 steps, bit for bit ...
        assert every(p.dtype == torch.bfloat16 for p in plain["params"].values()), where
        steps = torch.cat([_bf16_steps_apart(p, zero["params"][name]).flatten()
                           for name, p in plain["params"].items()])
        if not clip:
            assert not steps.any(), f"{where}: {int(steps.count_nonzero())} values differ"
            assert zero["losses"] == plain["losses"], where
        else:  # ... but for the clip: the norm's squares are summed in another order, so the
            # scales differ by fp32 rounding and a master on the edge between two bf16 values
            # may round the other way (1 value in 2,200, measured on an Intel Xeon)
            assert steps.max() <= 1 and steps.count_nonzero() <= CLIP_ROUNDING_FLIPS, (
                f"{where}: {int(steps.count_nonzero())} values differ, by up to "
                f"{int(steps.max())} bf16 steps")
            assert zero["norms"] == pytest.approx(plain["norms"], rel=1e-6), where
            assert zero["losses"] == pytest.approx(plain["losses"], rel=1e-5), where
            assert plain["norms"] == pytest.approx(serial["norms"], rel=BF16_LOSS_RTOL), where
        assert every(m.dtype == torch.float32 for m in plain["masters"] + zero["masters"])
        # ... of the same model as the fp32 serial run, to bf16 precision.
        assert plain["losses"] == pytest.approx(serial["losses"], rel=BF16_LOSS_RTOL), where
        # Optimizer state: 12 bytes a parameter (fp32 master, exp_avg, exp_avg_sq) on every
        # rank with plain DP; the same for ceil(N / D) parameters with ZeRO-1.
        n = sum(p.numel() for p in plain["params"].values())
        assert plain["state_bytes"] == {"master_params": 4 * n, "exp_avg": 4 * n, "exp_avg_sq": 4 * n}
        assert sum(zero["state_bytes"].values()) == costs.zero1_state_bytes_per_rank(n, dp)
        # The wire: fp32 gradient buckets / reduce-scatter, bf16 parameter all-gather, as
        # predicted with bf16 elements and fp32 gradient reduction.
        for name, zero1 in ((plain_name, False), (zero_name, True)):
            events = res.trace.filter(rank=rank, variant=name, step=0, comm_only=True)
            rows = costs.tp_dp_step_collectives(
                CONFIG, tp, dp, micro_batch_size=GLOBAL_BATCH // dp // MICROBATCHES,
                num_microbatches=MICROBATCHES, zero1=zero1, bucket_size_bytes=BUCKET_BYTES,
                clip_grad=clip, bytes_per_element=2, grad_reduce_in_fp32=True)
            expected = Counter()
            for row in rows:
                expected[(row.op, row.group_kind, row.phase, row.bytes_each)] += row.count
            got = Counter((e.op, e.group_kind, e.tags.get("phase"), e.bytes) for e in events)
            assert got == expected, f"{where} {name}: traced {got - expected}, predicted {expected - got}"
            dtypes = {(e.op, e.tags["phase"]): e.dtype for e in events if e.group_kind == "dp"}
            if zero1:
                assert dtypes[("reduce_scatter", "optimizer")] == "float32"
                assert dtypes[("all_gather", "optimizer")] == "bfloat16"
            else:
                assert dtypes[("all_reduce", "backward")] == "float32"


# --- train_step without process groups ----------------------------------------------------


def test_serial_train_step_with_microbatches_equals_the_whole_batch_loop():
    """No groups: train_step is the serial loop, with M = 2 microbatches instead of one batch."""
    model = GPTModel(CONFIG, seed=MODEL_SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    serial = _serial(True)
    losses = [train_step(model, optimizer, _global_batch(step), MICROBATCHES, max_grad_norm=MAX_NORM)
              for step in range(STEPS)]
    assert [r.loss for r in losses] == pytest.approx(serial["losses"], abs=LOSS_TOL, rel=LOSS_TOL)
    assert [r.grad_norm for r in losses] == pytest.approx(serial["norms"], rel=NORM_RTOL)
    for name, param in model.named_parameters():
        _close(param.detach(), serial["params"][name], name, PARAM_TOL, PARAM_TOL)


def test_the_synthetic_data_is_learnable_and_layout_free():
    ids, labels = _global_batch(0)
    assert ids.shape == labels.shape == (GLOBAL_BATCH, CONFIG.seq_length)
    assert torch.equal(ids[:, 1:], labels[:, :-1])  # labels are the next tokens
    stride = (labels - ids) % CONFIG.vocab_size
    assert ((stride >= 1) & (stride <= 3)).all() and (stride == stride[:, :1]).all()
    assert torch.equal(_global_batch(0)[0], ids) and not torch.equal(_global_batch(1)[0], ids)
    shares = [split_global_batch((ids, labels), r, 4) for r in range(4)]
    assert torch.equal(torch.cat([s[0] for s in shares]), ids)


def test_microbatches_must_divide_the_replica_batch():
    model = GPTModel(CONFIG)
    with pytest.raises(ValueError, match=r"\(8 sequences\) must be divisible by num_microbatches \(3\)"):
        train_step(model, torch.optim.Adam(model.parameters()), _global_batch(0), 3)
