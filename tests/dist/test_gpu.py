"""What only GPUs can show: marked ``gpu``, skipped without enough CUDA GPUs.

Run on a machine with GPUs (one per rank: 2, 4 or 8 of them) with
``python -m pytest -m gpu``; on a CPU machine every test here is reported as skipped.
NONE OF THESE TESTS HAS EVER RUN: no GPU machine was available to this project.  What a
CPU can prove about the same code is in ``tests/dist/test_device.py`` (no tensor relies on
torch's default device) and ``tests/unit/test_devices.py``.

* every chapter's launched functions (the jobs of ``test_device.py``) give over NCCL on
  ``cuda:r`` what they give over gloo on the CPU: integers and group lists exactly,
  floating-point values within :data:`RTOL` / :data:`ATOL` (another summation order,
  cuBLAS instead of the CPU's kernels) and, for low-precision values (bf16, float8),
  within :data:`LOW_PRECISION_RTOL`;
* ``train_4d`` on ``cuda`` gives the CPU's losses within :data:`LOSS_RTOL` per step, the
  same weight, gradient and optimizer bytes, and an allocator peak
  (``torch.cuda.max_memory_allocated``) at least what the step held at its activations' peak;
* CUDA-event timings in the trace are positive, ordered on each rank, and measure the GPU's
  work (a compute span around a large matmul lasts longer than its host-side queueing);
* with ``fp8_gemm="scaled_mm"`` (Ada / Hopper and newer) a module's forward equals the
  simulation's within :data:`SCALED_MM_RTOL`.
"""
import sys
import time
from dataclasses import replace

import cloudpickle
import pytest
import torch

from tutorial_lib.launch import launch
from tutorial_lib.train_4d import TrainingArgs, train

from .test_device import TRAIN_BASE, _chapters, jobs_by_world
from tests.asserts import every

pytestmark = [pytest.mark.dist, pytest.mark.gpu]
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RTOL, ATOL = 1e-4, 1e-5
"""fp32 values, NCCL on GPUs against gloo on the CPU (after at most a few Adam steps)."""
LOW_PRECISION_RTOL = 2 ** -6
"""bf16 and float8 values: a few units in the last place of bf16."""
LOSS_RTOL = 1e-4
"""train_4d's logged loss per step, cuda against cpu (fp32 model, 3 steps)."""
SCALED_MM_RTOL = 1e-2
"""torch._scaled_mm's FP8 GEMMs against the simulation of the same quantized numbers."""


def needs_gpus(count: int):
    return pytest.mark.skipif(GPUS < count, reason=f"needs {count} CUDA GPU{'s' * (count > 1)}, "
                                                   f"this machine has {GPUS}")


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not (a.is_floating_point() or a.is_complex()):
            return bool(torch.equal(a, b))
        wide = a.dtype in (torch.float32, torch.float64)
        a, b = a.double(), b.double()
        return bool(torch.allclose(a, b, rtol=RTOL if wide else LOW_PRECISION_RTOL,
                                   atol=ATOL, equal_nan=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= ATOL + RTOL * abs(b) or (a != a and b != b)
    return a == b


def run_jobs(ctx, jobs):
    """Each job once, on ``ctx.device``; ``{label: result}`` (GPU tensors come back on the
    CPU: the launcher copies them)."""
    from tutorial_lib import parallel_state
    out = {}
    for label, fn, args, keep in jobs:
        parallel_state.destroy_model_parallel()
        torch.manual_seed(1234)
        result = fn(ctx, *args)
        out[label] = keep(result) if keep is not None else result
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world", [pytest.param(w, marks=needs_gpus(w)) for w in (2, 4, 8)])
def test_nccl_on_gpus_gives_the_chapters_results_of_gloo_on_the_cpu(world):
    jobs = [job for job in jobs_by_world(_chapters())[world]
            if not job[0].startswith(("control", "train_4d"))]
    on_gpus = launch(run_jobs, world, args=(jobs,), backend="nccl", timeout=300).results
    on_cpu = launch(run_jobs, world, args=(jobs,), backend="gloo", timeout=300).results
    differ = [f"{label} (rank {rank})" for rank, (gpu, cpu) in enumerate(zip(on_gpus, on_cpu))
              for label in cpu if not _close(gpu[label], cpu[label])]
    assert not differ, "NCCL on GPUs differs from gloo on the CPU: " + ", ".join(differ)


@pytest.mark.parametrize("world, layout", [
    pytest.param(2, dict(pipeline_model_parallel_size=2), marks=needs_gpus(2)),
    pytest.param(8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                 marks=needs_gpus(8)),
    pytest.param(8, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
                 marks=needs_gpus(8))])
def test_train_4d_on_cuda_gives_the_cpu_losses(world, layout):
    args = TrainingArgs(**{**TRAIN_BASE, "world_size": world, "steps": 3, **layout})
    cuda_ranks = train(replace(args, device="cuda")).results
    cpu_ranks = train(replace(args, device="cpu")).results
    cuda, cpu = cuda_ranks[0], cpu_ranks[0]
    for on_gpu, on_cpu in zip(cuda, cpu, strict=True):
        assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=LOSS_RTOL), on_gpu
    # chapter 10's memory: the same bytes on the GPU, and the allocator's peak covers what the step held
    # at its activations' peak (from step 2 on Adam's state exists during the forwards)
    for on_gpu, on_cpu in zip(cuda_ranks, cpu_ranks, strict=True):
        gpu, host = on_gpu[-1]["memory"], on_cpu[-1]["memory"]
        assert every(gpu[k] == host[k] for k in ("weights", "gradients", "optimizer"))
        held = gpu["weights"] + gpu["optimizer"] + gpu["peak_activations"]
        assert gpu["cuda_max_memory_allocated"] >= held, gpu


def _timed_work(ctx):
    from tutorial_lib import comm
    x = torch.randn(4096, 4096, device=ctx.device)
    with ctx.tracer.span("matmul"):
        for _ in range(8):
            y = x @ x
    comm.all_reduce(y)
    big = torch.ones(64 * 2 ** 20 // 4, device=ctx.device)
    comm.all_reduce(big)
    torch.cuda.synchronize(ctx.device)
    return y[0, 0].item()


@needs_gpus(2)
def test_cuda_event_timings_are_positive_ordered_and_measure_the_gpu():
    started = time.time()
    run = launch(_timed_work, 2, backend="nccl", timeout=120)
    finished = time.time()
    for rank in range(2):
        events = sorted(run.trace.filter(rank=rank).events, key=lambda e: e.t_start)
        assert [e.op for e in events] == ["compute", "all_reduce", "all_reduce"]
        assert every(e.clock == "cuda" for e in events)
        assert every(e.t_end > e.t_start for e in events)                 # positive
        assert every(a.t_end <= b.t_start + 1e-4 for a, b in zip(events, events[1:]))  # one stream
        assert started <= events[0].t_start and events[-1].t_end <= finished  # wall clock
        # 8 matmuls of 4096^3: ~1 ms each even on the fastest GPU, far above the host's
        # few microseconds of queueing them
        assert events[0].duration > 1e-3
        # 64 MiB over NCCL: not instantaneous, and not longer than the whole launch
        assert 0 < events[2].duration < finished - started


@needs_gpus(1)
def test_scaled_mm_forward_matches_the_simulation_on_a_gpu():
    from tutorial_lib import fp8, precision
    from tutorial_lib.config import ModelConfig
    from tutorial_lib.data import synthetic_batch
    from tutorial_lib.deepseek import DeepSeekModel
    if not fp8.scaled_mm_available("cuda:0"):
        pytest.skip("torch._scaled_mm needs compute capability 8.9 or newer")
    config = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=4,
                         seq_length=16, vocab_size=64, num_experts=0)
    ids, labels = synthetic_batch(0, 0, 2, 16, 64, device="cuda:0")
    losses = {}
    for gemm in ("simulated", "scaled_mm"):
        model = DeepSeekModel(config, seed=0, device="cuda:0")
        precision.apply_recipe(model, "deepseek_v3", fp8_gemm=gemm)
        losses[gemm] = model(ids, labels).item()
    assert losses["scaled_mm"] == pytest.approx(losses["simulated"], rel=SCALED_MM_RTOL)
