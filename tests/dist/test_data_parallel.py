"""Data parallelism on real gloo workers: DP training equals serial training.

Every run compares with a serial model trained on the whole global batch (same
init seed, loss = mean over the global batch, same optimizer).  Tolerances are
fp32 round-off: parameters and synced gradients agree to ``atol=2e-6, rtol=1e-5``;
gradient norms to ``rtol=1e-6``; closed-form sums (``2**rank``) exactly.

The parallel model is :class:`_TPNet`: plain tensors, sharded by hand over TP
(column-parallel ``fc1``, row-parallel ``fc2``, a replicated ``norm`` layer and a
replicated row-parallel bias), so the tests need no tensor-parallel library.
"""
import functools
import math
from contextlib import nullcontext
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_lib import comm, parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.costs import zero1_state_bytes_per_rank
from tutorial_lib.data_parallel import (DataParallel, DistributedOptimizer, clip_grad_norm_,
                                        gradient_divisor, mark_tensor_parallel, set_grad_domain)
from tutorial_lib.grid import ProcessGrid
from tutorial_lib.launch import launch
from tutorial_lib.trace import get_tracer

from .launch_once import launch_once
from tests.asserts import every

pytestmark = pytest.mark.dist

ATOL, RTOL = 2e-6, 1e-5
STEPS, MICROBATCHES, GLOBAL_BATCH = 3, 4, 16
MAX_NORM = 0.05  # below the gradient norms of these runs, so clipping really scales
BUCKET_BYTES = 128  # 32 floats: several buckets even for this tiny model
# Adam is what matters, but it is blind to a wrong gradient scale (m / sqrt(v)), so SGD
# with momentum runs too: it would catch a sum where an average belongs.
OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 1e-2}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


class Variant(NamedTuple):
    zero: bool = False  # ZeRO-1 DistributedOptimizer instead of DataParallel + optimizer
    bucket_size_bytes: float = BUCKET_BYTES
    overlap: bool = True
    max_norm: float | None = None
    optimizer: str = "adam"


VARIANTS = {
    "per_param_after_backward": Variant(bucket_size_bytes=0, overlap=False),  # the baseline
    "buckets_overlap": Variant(),
    "buckets_after_backward": Variant(overlap=False),
    "one_bucket_overlap": Variant(bucket_size_bytes=math.inf),
    "buckets_overlap_clip": Variant(max_norm=MAX_NORM),
    "buckets_overlap_sgd": Variant(optimizer="sgd"),
    "zero1": Variant(zero=True),
    "zero1_clip": Variant(zero=True, max_norm=MAX_NORM),
    "zero1_sgd": Variant(zero=True, optimizer="sgd"),
}
DATA_PARALLEL_VARIANTS = [name for name, v in VARIANTS.items() if not v.zero]
ZERO_VARIANTS = [name for name, v in VARIANTS.items() if v.zero]


# --- the model: serial reference and its hand-sharded TP version --------------------------


class _SerialNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.Linear(6, 8)  # stands in for a LayerNorm: replicated over TP
        self.fc1 = nn.Linear(8, 12)  # column-parallel under TP
        self.fc2 = nn.Linear(12, 3)  # row-parallel under TP (its bias is replicated)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(torch.tanh(self.norm(x)))))


def _shards(serial_params, tp_rank, tp):
    """The pieces of the serial parameters that TP rank ``tp_rank`` holds."""
    nw, nb, w1, b1, w2, b2 = serial_params
    f = w1.shape[0] // tp
    rows = slice(tp_rank * f, (tp_rank + 1) * f)
    return [nw, nb, w1[rows], b1[rows], w2[:, rows], b2]


class _CopyToTP(torch.autograd.Function):
    """Forward: identity; backward: all-reduce the input gradient over TP."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.clone(), group="tp") if parallel_state.get_size("tp") > 1 else grad


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce the partial outputs over TP; backward: identity."""

    @staticmethod
    def forward(ctx, x):
        return comm.all_reduce(x.clone(), group="tp") if parallel_state.get_size("tp") > 1 else x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _mark_first_layer_reached(grad):
    with get_tracer().span("backward_reaches_first_layer"):
        pass


class _TPNet(nn.Module):
    def __init__(self, tp_rank, tp):
        super().__init__()
        pieces = _shards([p.detach() for p in _SerialNet().parameters()], tp_rank, tp)
        names = ["norm_weight", "norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
        for name, piece in zip(names, pieces):
            setattr(self, name, nn.Parameter(piece.clone()))
        mark_tensor_parallel(self.fc1_weight, 0)
        mark_tensor_parallel(self.fc1_bias, 0)
        mark_tensor_parallel(self.fc2_weight, 1)

    def forward(self, x):
        h = _CopyToTP.apply(torch.tanh(F.linear(x, self.norm_weight, self.norm_bias)))
        if h.requires_grad:  # mark when backward reaches the first layer (its params still to do)
            h.register_hook(_mark_first_layer_reached)
        h = torch.tanh(F.linear(h, self.fc1_weight, self.fc1_bias))
        return _ReduceFromTP.apply(F.linear(h, self.fc2_weight)) + self.fc2_bias


def _global_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


@functools.cache
def _serial_train(max_norm, optimizer_name):
    """The reference: one model, the whole global batch, loss = its mean (cached per setting)."""
    model = _SerialNet()
    optimizer_class, kwargs = OPTIMIZERS[optimizer_name]
    optimizer = optimizer_class(model.parameters(), **kwargs)
    snapshots, grads, norms = [], [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return {"snapshots": snapshots, "grads": grads, "norms": norms}


# --- the worker: every variant, a few steps with gradient accumulation --------------------


def _train_worker(ctx, tp):
    parallel_state.initialize_model_parallel(ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp))
    tracer = ctx.tracer
    dp_rank, dp = parallel_state.get_rank_in("dp"), parallel_state.get_size("dp")
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    out = {}
    for name, variant in VARIANTS.items():
        zero, max_norm = variant.zero, variant.max_norm
        optimizer_class, kwargs = OPTIMIZERS[variant.optimizer]
        model = _TPNet(parallel_state.get_rank_in("tp"), tp)
        if zero:
            wrapped = model
            optimizer = DistributedOptimizer(model.parameters(), optimizer_class,
                                             max_grad_norm=max_norm, **kwargs)
        else:
            wrapped = DataParallel(model, bucket_size_bytes=variant.bucket_size_bytes,
                                   overlap=variant.overlap)
            optimizer = optimizer_class(model.parameters(), **kwargs)
        snapshots, grads, norms = [], [], []
        with tracer.tags(variant=name):
            for step in range(STEPS):
                x, y = (t[rows] for t in _global_batch(step))
                with tracer.tags(step=step):
                    wrapped.zero_grad()
                    optimizer.zero_grad()
                    for m, (xm, ym) in enumerate(zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))):
                        last = m == MICROBATCHES - 1
                        quiet = nullcontext() if zero or last else wrapped.no_sync()
                        with tracer.tags(microbatch=m), quiet:
                            loss = F.mse_loss(wrapped(xm), ym) / MICROBATCHES
                            with tracer.span("backward"):
                                loss.backward()
                    if not zero:
                        wrapped.finish_grad_sync()
                        grads.append([p.grad.clone() for p in model.parameters()])
                        if max_norm is not None:
                            norms.append(float(clip_grad_norm_(model.parameters(), max_norm)))
                    optimizer.step()
                    if zero and max_norm is not None:
                        norms.append(float(optimizer.last_grad_norm))
                snapshots.append([p.detach().clone() for p in model.parameters()])
        meta = {"param_bytes": sum(p.numel() * 4 for p in model.parameters()),
                "numel": sum(p.numel() for p in model.parameters())}
        if zero:
            buffer = optimizer.buffers[0]
            meta.update(padded_numel=buffer.padded_numel, shard_numel=buffer.shard_numel,
                        state_bytes=optimizer.state_bytes())
        else:
            meta.update(num_buckets=len(wrapped.buckets),
                        bucket_bytes=[b.nbytes for b in wrapped.buckets])
        out[name] = {"snapshots": snapshots, "grads": grads, "norms": norms, "meta": meta}
    return {"tp_rank": parallel_state.get_rank_in("tp"), "dp": dp, "variants": out}


# One launch per world; every test below reads from it.
WORLDS = {"dp1": (1, 1), "dp2": (2, 1), "dp4": (4, 1), "tp2_dp2": (4, 2)}


@launch_once
def _run(world_name):
    """The launch of ``world_name`` (once; a failure is remembered, not retried per test)."""
    world, tp = WORLDS[world_name]
    return launch(_train_worker, world, args=(tp,), timeout=90)


def _serial(variant: Variant):
    return _serial_train(variant.max_norm, variant.optimizer)


def _assert_shards_close(got, serial, tp_rank, tp, what):
    for i, (g, e) in enumerate(zip(got, _shards(serial, tp_rank, tp))):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what} param {i}: {m}")


@pytest.mark.parametrize("world_name", list(WORLDS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dp_training_matches_serial_training(world_name, variant):
    res = _run(world_name)
    serial = _serial(VARIANTS[variant])
    tp = WORLDS[world_name][1]
    for rank, result in enumerate(res.results):
        run = result["variants"][variant]
        assert len(run["snapshots"]) == STEPS  # after the first step and after every later one
        for step in range(STEPS):
            _assert_shards_close(run["snapshots"][step], serial["snapshots"][step], result["tp_rank"],
                                 tp, f"rank {rank} step {step}")
            if not VARIANTS[variant].zero:  # the synced gradient itself is the serial one
                _assert_shards_close(run["grads"][step], serial["grads"][step], result["tp_rank"],
                                     tp, f"rank {rank} step {step} grad")
        if VARIANTS[variant].max_norm is not None:
            assert run["norms"] == pytest.approx(serial["norms"], rel=1e-6)
            assert min(serial["norms"]) > VARIANTS[variant].max_norm  # clipping was active


def _step_events(trace, rank, variant, step):
    return trace.filter(rank=rank, variant=variant, step=step)


@pytest.mark.parametrize("world_name", ["dp2", "dp4", "tp2_dp2"])
@pytest.mark.parametrize("variant", DATA_PARALLEL_VARIANTS)
def test_one_gradient_sync_per_step_after_the_last_microbatch(world_name, variant):
    res = _run(world_name)
    overlap = VARIANTS[variant].overlap
    for rank, result in enumerate(res.results):
        meta = result["variants"][variant]["meta"]
        for step in range(STEPS):
            events = _step_events(res.trace, rank, variant, step)
            syncs = events.filter(op="all_reduce", group_kind="dp", phase="backward")
            assert len(syncs) == meta["num_buckets"]
            assert sorted(e.tags["bucket"] for e in syncs) == list(range(meta["num_buckets"]))
            assert syncs.total_bytes() == meta["param_bytes"] == sum(meta["bucket_bytes"])
            # Nothing on DP during the first M-1 microbatches: no DP event at all carries
            # their tag, and every sync starts after the last microbatch's backward began.
            assert not [e for e in events.filter(group_kind="dp")
                        if e.tags.get("microbatch", MICROBATCHES - 1) < MICROBATCHES - 1]
            last_backward = events.filter(op="compute", name="backward",
                                          microbatch=MICROBATCHES - 1)[0]
            assert every(e.t_start >= last_backward.t_start for e in syncs)
            # Overlap: launched from hooks, inside the backward; else after it.
            for e in syncs:
                assert e.tags["overlap"] is overlap
                assert (e.t_start < last_backward.t_end) is overlap
                assert e.t_end >= e.t_start


def test_the_first_bucket_starts_before_backward_ends():
    res = _run("dp2")
    for rank in range(2):
        events = _step_events(res.trace, rank, "buckets_overlap", 0)
        syncs = events.filter(op="all_reduce", group_kind="dp")
        assert len(syncs) >= 3
        first = syncs.filter(bucket=0)[0]
        backward = events.filter(op="compute", name="backward", microbatch=MICROBATCHES - 1)[0]
        assert backward.t_start <= first.t_start < backward.t_end
        # Bucket 0 holds the last layer, whose gradients backward produces first: its
        # all-reduce is under way before backward has even reached the first layer.
        reached = events.filter(op="compute", name="backward_reaches_first_layer",
                                microbatch=MICROBATCHES - 1)[0]
        assert first.t_start < reached.t_start < backward.t_end
        assert first.t_start <= min(e.t_start for e in syncs)


@pytest.mark.parametrize("world_name", ["dp2", "dp4", "tp2_dp2"])
@pytest.mark.parametrize("variant", ZERO_VARIANTS)
def test_zero1_shards_state_and_communicates_once_per_step(world_name, variant):
    res = _run(world_name)
    for rank, result in enumerate(res.results):
        dp = result["dp"]
        meta = result["variants"][variant]["meta"]
        n, padded, shard = meta["numel"], meta["padded_numel"], meta["shard_numel"]
        assert padded % dp == 0 and n <= padded < n + dp and shard * dp == padded
        # Optimizer state per rank: the fp32 master copy and the optimizer's state tensors
        # (Adam: exp_avg, exp_avg_sq) of one shard only, i.e. 1/DP of the unsharded
        # 12 bytes per parameter (Adam) up to the padding.
        per_param = ({"exp_avg": 4, "exp_avg_sq": 4} if VARIANTS[variant].optimizer == "adam"
                     else {"momentum_buffer": 4})
        per_param["master_params"] = 4
        state = meta["state_bytes"]
        assert state == {key: nbytes * shard for key, nbytes in per_param.items()}
        bytes_per_param = sum(per_param.values())
        assert sum(state.values()) == zero1_state_bytes_per_rank(n, dp, bytes_per_param)
        unsharded = bytes_per_param * n
        assert 0 <= sum(state.values()) * dp - unsharded < bytes_per_param * dp  # the padding
        for step in range(STEPS):
            events = _step_events(res.trace, rank, variant, step).filter(zero=1)
            rs = events.filter(op="reduce_scatter")
            ag = events.filter(op="all_gather")
            assert len(rs) == 1 and len(ag) == 1
            assert rs[0].group_kind == ag[0].group_kind == "dp"
            assert rs[0].bytes == padded * 4  # the full padded flat gradient
            assert ag[0].bytes == shard * 4 and ag[0].shape == (shard,)  # comm counts the shard sent
            assert not events.filter(op="all_reduce", phase="optimizer")
            # With clipping the norm's all-reduces are the only others: one scalar each.
            others = events.filter(op="all_reduce")
            assert [e for e in others if e.tags["phase"] != "clip_grad" or e.bytes != 4] == []
            assert bool(others) == (VARIANTS[variant].max_norm is not None and dp > 1)


# --- 2**rank: the sums prove which group each domain reduces over -------------------------


def _powers_of_two_worker(ctx):
    # world 8 = TP 2 x DP 4 for dense weights, EP 4 x EDP 2 for experts (Megatron folding):
    # dp, expert_dp, tp and ep groups all differ.
    config = ParallelConfig(8, tensor_model_parallel_size=2, expert_model_parallel_size=4,
                            expert_tensor_parallel_size=1)  # whole experts
    parallel_state.initialize_model_parallel(config)
    module = nn.Module()
    module.dense_copy = nn.Parameter(torch.zeros(3))
    module.dense_shard = mark_tensor_parallel(nn.Parameter(torch.zeros(2, 2)))
    module.expert = set_grad_domain(nn.Parameter(torch.zeros(5)), "expert_dp")
    module.dense_last = nn.Parameter(torch.zeros(4))
    fill = float(2 ** ctx.rank)
    out = {}
    # 1) through backward and the overlap hooks, one parameter per bucket
    model = DataParallel(module, bucket_size_bytes=0, overlap=True)
    sum((p * fill).sum() for p in module.parameters()).backward()
    model.finish_grad_sync()
    out["hooks"] = _sums(module)
    # 2) gradients filled by hand, synced after the fact
    model.zero_grad()
    for p in module.parameters():
        p.grad = torch.full_like(p, fill)
    model.finish_grad_sync()
    out["by_hand"] = _sums(module)
    out["domains"] = {b.index: b.domain for b in model.buckets}
    model.remove_hooks()
    # 3) ZeRO-1 with SGD(lr=1) from zero: each parameter ends at minus the average gradient
    optimizer = DistributedOptimizer(module.parameters(), torch.optim.SGD, lr=1.0)
    for p in module.parameters():
        p.grad = torch.full_like(p, fill)
    optimizer.step()
    out["zero1"] = {name: [-v for v in vals] for name, vals in _sums(module, from_grad=False).items()}
    return out


def _sums(module, from_grad=True):
    """Each parameter's values times its divisor: the sum of 2**rank over its group."""
    out = {}
    for name, p in module.named_parameters():
        size = gradient_divisor(getattr(p, "allreduce_group", "dp"))
        values = (p.grad if from_grad else p.detach()) * size
        out[name] = sorted(set(values.flatten().tolist()))
    return out


def test_powers_of_two_identify_the_dp_and_expert_dp_groups():
    res = launch(_powers_of_two_worker, 8, timeout=90)
    grid = ProcessGrid(ParallelConfig(8, tensor_model_parallel_size=2, expert_model_parallel_size=4,
                                      expert_tensor_parallel_size=1))
    assert grid.group_of("dp", 0) != grid.group_of("expert_dp", 0)
    for rank, out in enumerate(res.results):
        dp_sum = float(sum(2 ** r for r in grid.group_of("dp", rank)))
        edp_sum = float(sum(2 ** r for r in grid.group_of("expert_dp", rank)))
        expected = {"dense_copy": [dp_sum], "dense_shard": [dp_sum], "dense_last": [dp_sum],
                    "expert": [edp_sum]}
        assert out["hooks"] == expected, rank
        assert out["by_hand"] == expected, rank
        assert out["zero1"] == expected, rank
        assert sorted(out["domains"].values()) == ["dp", "dp", "dp", "expert_dp"]
    kinds = {e.group_kind for e in res.trace.filter(op="all_reduce", phase="backward")}
    assert kinds == {"dp", "expert_dp"}


# --- clipping: the global norm over TP shards, TP copies and experts ----------------------


def _serial_grads():
    g = torch.Generator().manual_seed(7)
    return {"copy": torch.randn(5, generator=g), "shard": torch.randn(4, 6, generator=g),
            "experts": torch.randn(2, 3, 4, generator=g)}


CLIP_NORMS = (1.0, 100.0)  # clipping active / not needed


def _clip_worker(ctx):
    # world 4: TP 2 x DP 2 (dense), EP 2 x EDP 2 (experts, whole: ETP 1); tp = ep = {0,1},{2,3}.
    config = ParallelConfig(4, tensor_model_parallel_size=2, expert_model_parallel_size=2,
                            expert_tensor_parallel_size=1)
    parallel_state.initialize_model_parallel(config)
    tp_rank, ep_rank = parallel_state.get_rank_in("tp"), parallel_state.get_rank_in("ep")
    serial = _serial_grads()  # the DP-synced gradients: the same on every DP rank

    def params():
        copy = nn.Parameter(torch.zeros(5))
        shard = mark_tensor_parallel(nn.Parameter(torch.zeros(2, 6)))
        expert = set_grad_domain(nn.Parameter(torch.zeros(3, 4)), "expert_dp")
        copy.grad = serial["copy"].clone()
        shard.grad = serial["shard"][2 * tp_rank:2 * tp_rank + 2].clone()
        expert.grad = serial["experts"][ep_rank].clone()
        return [copy, shard, expert]

    out = {"tp": tp_rank, "ep": ep_rank}
    for max_norm in CLIP_NORMS:
        with ctx.tracer.tags(case="clip", max_norm=max_norm):
            ps = params()
            norm = clip_grad_norm_(ps, max_norm)
        clipped = [p.grad.clone() for p in ps]
        # ZeRO-1 clips after the reduce-scatter: SGD(lr=1) from zero leaves -clipped grads.
        ps = params()
        optimizer = DistributedOptimizer(ps, torch.optim.SGD, lr=1.0, max_grad_norm=max_norm)
        with ctx.tracer.tags(case="zero1", max_norm=max_norm):
            optimizer.step()
        out[max_norm] = {"norm": float(norm), "clipped": clipped,
                         "zero1_norm": float(optimizer.last_grad_norm),
                         "zero1": [-p.detach().clone() for p in ps]}
    return out


@pytest.fixture(scope="module")
def clip_run():
    return launch(_clip_worker, 4, timeout=90)


@pytest.mark.parametrize("max_norm", CLIP_NORMS)
def test_clip_grad_norm_counts_every_parameter_once(clip_run, max_norm):
    serial = _serial_grads()
    ref = [nn.Parameter(torch.zeros_like(t)) for t in serial.values()]
    for p, g in zip(ref, serial.values()):
        p.grad = g.clone()
    serial_norm = float(torch.nn.utils.clip_grad_norm_(ref, max_norm))
    assert (serial_norm > max_norm) == (max_norm == 1.0)
    copy, shard, experts = (p.grad for p in ref)
    for result in clip_run.results:
        out = result[max_norm]
        expected = [copy, shard[2 * result["tp"]:2 * result["tp"] + 2], experts[result["ep"]]]
        for key in ("clipped", "zero1"):
            for got, want in zip(out[key], expected):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert out["norm"] == pytest.approx(serial_norm, rel=1e-6)
        assert out["zero1_norm"] == pytest.approx(serial_norm, rel=1e-6)
    # The dense norm is summed over TP, the experts' over EP; never over DP.
    trace = clip_run.trace.filter(rank=0, max_norm=max_norm, phase="clip_grad")
    assert sorted(e.group_kind for e in trace.filter(case="clip")) == ["ep", "tp"]
    # ZeRO's shards are disjoint over DP too, so there DP joins the sums.
    zero1 = trace.filter(case="zero1")
    assert sorted(e.group_kind for e in zero1) == ["dp", "ep", "expert_dp", "tp"]


# --- misuse is refused with a message that names the fix ----------------------------------


def _misuse_worker(ctx):
    parallel_state.initialize_model_parallel(ParallelConfig(1))
    model = DataParallel(nn.Linear(3, 2), bucket_size_bytes=0, overlap=True)
    x = torch.randn(4, 3)
    errors = {}
    model(x).sum().backward()  # a first microbatch outside no_sync: its buckets launch
    try:
        model(x).sum().backward()
    except RuntimeError as err:
        errors["second_backward_outside_no_sync"] = str(err)
    model.zero_grad()
    model(x).sum().backward()
    model.finish_grad_sync()
    try:
        model(x).sum().backward()  # the next step, without zeroing the buffers
    except RuntimeError as err:
        errors["backward_without_zero_grad"] = str(err)
    return errors


def test_misuse_names_the_fix():
    errors = launch(_misuse_worker, 1, timeout=60).results[0]
    assert "model.no_sync()" in errors["second_backward_outside_no_sync"]
    assert "model.zero_grad()" in errors["backward_without_zero_grad"]
    with pytest.raises(ValueError, match="expert_dp"):
        set_grad_domain(nn.Parameter(torch.zeros(1)), "experts")
