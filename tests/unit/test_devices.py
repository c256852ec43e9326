"""The device rule, the parts a CPU can check without a process: which backend a launch gets,
nccl-tests' bandwidths, the optional real-FP8 GEMM's arithmetic, the trace's clock.

What only a GPU can show is in ``tests/dist/test_gpu.py`` (marked ``gpu``); that nothing
relies on torch's default device is ``tests/dist/test_device.py``.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tutorial_lib import costs, fp8, precision, timing
from tutorial_lib.config import ConfigError, ModelConfig
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.launch import choose_backend
from tutorial_lib.trace import Tracer
from tests.asserts import every


# --- the backend of a launch ---------------------------------------------------------------


@pytest.mark.parametrize("gpus", [0, 2, 8])
def test_gloo_is_gloo_whatever_the_gpus(gpus):
    assert choose_backend("gloo", 8, gpus) == ("gloo", None)


def test_auto_takes_nccl_only_when_every_rank_has_its_own_gpu():
    assert choose_backend("auto", 8, 8) == ("nccl", None)
    assert choose_backend("auto", 4, 8) == ("nccl", None)
    assert choose_backend("auto", 4, 0) == ("gloo", None)  # a CPU machine: nothing to say
    backend, note = choose_backend("auto", 8, 4)           # GPUs, but too few: says why
    assert backend == "gloo" and "8 ranks but 4 GPUs" in note and "at most 4" in note


@pytest.mark.parametrize("gpus, said", [(0, "no GPU"), (2, "only 2 GPUs"), (1, "only 1 GPU ")])
def test_nccl_without_a_gpu_per_rank_is_a_config_error_that_says_what_to_do(gpus, said):
    # before the device rule: ZeroDivisionError from rank % torch.cuda.device_count() in every rank
    with pytest.raises(ConfigError, match="one GPU per rank") as caught:
        choose_backend("nccl", 4, gpus)
    assert said in str(caught.value) and "backend='gloo'" in str(caught.value)
    assert choose_backend("nccl", 4, 4) == ("nccl", None)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_launch_with_nccl_and_too_few_gpus_refuses_before_starting_a_worker():
    """``launch(fn, 2, backend="nccl")`` on this machine: a ConfigError, and no process
    (this directory's conftest fails a test that starts one)."""
    from tutorial_lib.launch import launch
    with pytest.raises(ConfigError, match="backend='nccl' needs one GPU per rank"):
        launch(print, 2, backend="nccl")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="'gloo', 'nccl' or 'auto'"):
        choose_backend("mpi", 2, 0)


# --- nccl-tests' bandwidths ----------------------------------------------------------------


@pytest.mark.parametrize("op, factor", [("all_reduce", 2 * 3 / 4), ("reduce_scatter", 3 / 4),
                                        ("all_gather", 3 / 4), ("all_to_all", 3 / 4),
                                        ("broadcast", 1.0), ("send", 1.0)])
def test_bus_bandwidth_is_nccl_tests_algbw_times_its_factor(op, factor):
    """nccl-tests, doc/PERFORMANCE.md (NVIDIA/nccl-tests, commit 03a204a1): algbw = S / t,
    busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter, all-gather and
    all-to-all, 1 for broadcast; S is the whole array (for all-gather: n shards)."""
    n, nbytes, seconds = 4, 8e6, 2e-3
    size = nbytes * n if op == "all_gather" else nbytes  # the library records the shard
    assert costs.nccl_tests_size(op, nbytes, n) == size
    assert costs.algorithm_bandwidth(op, nbytes, n, seconds) == pytest.approx(size / seconds)
    assert costs.bus_bandwidth(op, nbytes, n, seconds) == pytest.approx(size / seconds * factor)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                "broadcast"])
def test_bus_bandwidth_is_the_ring_bytes_each_rank_sends_per_second(op):
    """Why busbw compares with a link's rating: it is what one rank's link carried."""
    for n in (2, 4, 8):
        sent = costs.ring_bytes_sent(op, 1e6, n)
        assert costs.bus_bandwidth(op, 1e6, n, 1e-3) == pytest.approx(sent / 1e-3)


def test_bandwidth_rows_print_what_nccl_tests_prints():
    rows = timing.bandwidth_rows([costs.Sample("all_gather", 1000, 4, 1e-6),
                                  costs.Sample("all_reduce", 4000, 4, 2e-6)])
    assert rows[0] == {"op": "all_gather", "ranks": 4, "size_bytes": 4000, "time_us": 1.0,
                       "algbw_gb_per_s": pytest.approx(4.0),
                       "busbw_gb_per_s": pytest.approx(3.0)}
    assert rows[1]["algbw_gb_per_s"] == pytest.approx(2.0)
    assert rows[1]["busbw_gb_per_s"] == pytest.approx(3.0)


def test_measure_collective_takes_cpu_or_cuda_only():
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        timing.measure_collective("all_reduce", sizes=[64], device="xla")


# --- the optional real FP8 GEMM ------------------------------------------------------------


def _cpu_fp8_matmul(a, b):
    """A CPU stand-in for torch._scaled_mm with unit scales: float8 in, fp32 product out."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    return a.float() @ b.float()


@pytest.mark.parametrize("pow2", [False, True])
def test_blockwise_fp8_linear_computes_what_the_simulation_computes(pow2):
    """One GEMM per 128-wide slice of K, scaled afterwards by the slice's tile and block
    scales, sums to the simulation's product of dequantized values (fp32 order aside);
    K = 300 and N = 200 leave partial tiles and blocks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 300, generator=g)
    w = 0.05 * torch.randn(200, 300, generator=g)
    bias = torch.randn(200, generator=g)
    got = fp8.blockwise_fp8_linear(x, w, bias, pow2=pow2, matmul=_cpu_fp8_matmul)
    simulated = F.linear(fp8.fake_quantize_1x128(x, pow2=pow2),
                         fp8.fake_quantize_blocks(w, pow2=pow2), bias)
    assert got.shape == (2, 5, 200) and got.dtype == x.dtype
    assert torch.allclose(got, simulated, rtol=1e-5, atol=1e-5)
    assert (F.linear(x, w, bias) - simulated).abs().max() > 1e-2  # FP8 did change it


def test_scaled_mm_is_off_by_default_and_refused_on_the_cpu():
    assert not fp8.scaled_mm_available("cpu")
    model = DeepSeekModel(ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                      seq_length=4, vocab_size=16, num_experts=0), seed=0,
                          device="cpu")
    with pytest.raises(ValueError, match="compute capability 8.9"):
        precision.apply_recipe(model, "deepseek_v3", fp8_gemm="scaled_mm")
    precision.apply_recipe(model, "deepseek_v3")  # the default: the simulation
    assert every(getattr(m, "fp8_gemm", "simulated") == "simulated" for m in model.modules())


# --- the trace's clock -----------------------------------------------------------------------


def test_a_cpu_rank_keeps_the_host_clock():
    tracer = Tracer(0, enabled=True)
    tracer.use_device("cpu")
    assert tracer.cuda_clock is None
    with tracer.span("forward"):
        pass
    event = tracer.end(tracer.begin("all_reduce", on_gpu=False))
    events = tracer.resolved_events()
    assert [e.clock for e in events] == ["host", "host"] and events[1] is event
    assert every(e.t_end >= e.t_start and math.isfinite(e.t_end) for e in events)
