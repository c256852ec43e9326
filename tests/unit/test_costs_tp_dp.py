"""``costs.tp_dp_step_collectives`` against numbers worked out by hand.

The config: h = 16, 2 layers, s = 8, V = 32, TP = 2, DP = 2, micro-batch 2, M = 2, fp32.
One ``[s, b, h]`` activation is 8 * 2 * 16 * 4 = 1024 bytes, a rank's sequence slice
``[s/2, b, h]`` 512 bytes, one number per token ``[s, b]`` 8 * 2 * 4 = 64 bytes.

The parameters one TP rank holds (floats): word table 16 x 16 = 256, position table
8 x 16 = 128, each block 1688 (LayerNorms 2 x 32, qkv 24 x 16 + 24, proj 16 x 8 + 16,
fc1 32 x 16 + 32, fc2 16 x 32 + 16), final LayerNorm 32, output layer 16 x 16 = 256:
256 + 128 + 2 x 1688 + 32 + 256 = 4048 floats = 16192 bytes.  The dist test
``tests/dist/test_tp_dp_training.py`` checks the same function against real traces.
"""
import math
from collections import Counter

import pytest
import torch

from tutorial_lib import costs
from tutorial_lib.config import ModelConfig
from tutorial_lib.data_parallel import DEFAULT_BUCKET_SIZE_BYTES, build_buckets
from tutorial_lib.gpt import GPTModel

CONFIG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=32)


def _table(rows):
    """``{(op, group, phase, bytes): count}``: what a trace of the step would add up to."""
    out = Counter()
    for r in rows:
        out[(r.op, r.group_kind, r.phase, r.bytes_each)] += r.count
    return dict(out)


def _step(**overrides):
    args = dict(tp=2, dp=2, micro_batch_size=2, num_microbatches=2, sequence_parallel=False,
                zero1=False, bucket_size_bytes=4096, clip_grad=False)
    args.update(overrides)
    return costs.tp_dp_step_collectives(CONFIG, **args)


def test_parameter_shapes_are_the_models():
    serial = GPTModel(CONFIG, tp_group=None)
    shapes = [(name, tuple(p.shape)) for name, p in serial.named_parameters()]
    assert costs.gpt_parameter_shapes(CONFIG, 1) == shapes
    assert sum(math.prod(shape) for _, shape in costs.gpt_parameter_shapes(CONFIG, 2)) == 4048


#: DP's gradient buckets at TP = 2 (with or without sequence parallelism): buckets of
#: >= 4096 bytes, filled from the output layer backwards: 5440, 4576, 4512, and the
#: remainder 1664 (= 16192 bytes, the 4048 floats of a rank's parameters).
DP_BUCKETS = {("all_reduce", "dp", "backward", size): 1 for size in (5440, 4576, 4512, 1664)}


def test_tensor_parallel_without_sequence_parallel():
    # Per microbatch: forward 1 embedding + 2 x 2 block all-reduces of 1024 bytes and
    # the loss's 3 of 64; backward 1 output-layer + 2 x 2 block all-reduces of 1024.
    # x M = 2.  Then DP's buckets and the logged loss.
    assert _table(_step()) == {
        ("all_reduce", "tp", "forward", 1024): 10,
        ("all_reduce", "tp", "forward", 64): 6,
        ("all_reduce", "tp", "backward", 1024): 10,
        **DP_BUCKETS,
        ("all_reduce", "dp", "logging", 4): 1,
    }


def test_sequence_parallel_with_clipping():
    # Forward: the embedding still all-reduces (1024); 2 blocks x (2 all-gathers of my 512-byte
    # slice + 2 reduce-scatters of 1024); the output layer's all-gather (512); the loss (3 x 64).
    # Backward mirrors it, and each column-parallel layer (the output layer, 2 blocks x qkv and
    # fc1) all-gathers its saved 512-byte input shard once more for dW (Megatron-Core 0.20.0,
    # d98e8a64, layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward): 1 + 2 x 4
    # gathers; the embedding's split gathers its gradient (512).  Then the sequence-parallel
    # gradients: 2 blocks x 6h + the final LayerNorm's 2h = 224 floats = 896 bytes; the clip's
    # 4-byte norm over TP; the logged loss over DP.
    rows = _step(sequence_parallel=True, clip_grad=True)
    assert _table(rows) == {
        ("all_reduce", "tp", "forward", 1024): 2,
        ("all_gather", "tp", "forward", 512): 2 * (4 + 1),
        ("reduce_scatter", "tp", "forward", 1024): 2 * 4,
        ("all_reduce", "tp", "forward", 64): 2 * 3,
        ("reduce_scatter", "tp", "backward", 1024): 2 * (1 + 4),
        ("all_gather", "tp", "backward", 512): 2 * (1 + 2 * 4 + 1),
        ("all_reduce", "tp", "grad_sync", 896): 1,
        **DP_BUCKETS,
        ("all_reduce", "tp", "clip_grad", 4): 1,
        ("all_reduce", "dp", "logging", 4): 1,
    }
    # 2048 + 5120 + 8192 + 384 (forward) + 10240 + 10240 (backward) + 896 + 4 = 37124 on TP;
    # 16192 + 4 on DP: with this tiny model TP moves more than twice DP's bytes.
    assert costs.step_bytes_by_group(rows) == {"tp": 37124, "dp": 16196}


def test_zero1_replaces_the_buckets_by_a_reduce_scatter_and_an_all_gather():
    # 4048 floats split over DP = 2 (no padding needed): reduce-scatter the whole 16192
    # bytes, all-gather my 2024-float slice (8096 bytes); the norm is summed over DP and TP.
    table = _table(_step(zero1=True, clip_grad=True))
    dp_and_clip = {k: v for k, v in table.items() if k[1] == "dp" or k[2] == "clip_grad"}
    assert dp_and_clip == {
        ("reduce_scatter", "dp", "optimizer", 16192): 1,
        ("all_reduce", "dp", "clip_grad", 4): 1,
        ("all_reduce", "tp", "clip_grad", 4): 1,
        ("all_gather", "dp", "optimizer", 8096): 1,
        ("all_reduce", "dp", "logging", 4): 1,
    }
    # DP = 3 pads 4048 to 4050 floats: 16200 bytes in, a 1350-float (5400-byte) slice out.
    table = _table(_step(zero1=True, dp=3))
    assert table[("reduce_scatter", "dp", "optimizer", 16200)] == 1
    assert table[("all_gather", "dp", "optimizer", 5400)] == 1


def test_bf16_zero1_gathers_bf16_parameters_and_scatters_fp32_gradients():
    """A bf16 model with an fp32 master: Megatron-Core 0.20.0 (d98e8a64) reduces the
    gradients in fp32 (``megatron/training/arguments.py``, ``validate_args``: ``--bf16``
    turns on ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16``) and
    all-gathers the parameters in their own dtype (``megatron/core/distributed/
    param_and_grad_buffer.py``: ``start_param_sync`` gathers ``param_data``, allocated in
    ``param_dtype``).  4048 parameters over DP = 2: the reduce-scatter takes 4048 fp32
    gradients (16192 bytes), the all-gather sends a 2024-element bf16 slice (4048 bytes)."""
    table = _table(_step(zero1=True, bytes_per_element=2))
    assert table[("reduce_scatter", "dp", "optimizer", 16192)] == 1
    assert table[("all_gather", "dp", "optimizer", 4048)] == 1
    # Plain DP in bf16 with fp32 buckets: the buckets hold the same parameters as bf16
    # buckets of the same byte budget would, at 4 bytes each (4048 floats in all).
    def buckets(**overrides):
        return sorted(b for r in _step(bytes_per_element=2, **overrides)
                      if (r.op, r.group_kind, r.phase) == ("all_reduce", "dp", "backward")
                      for b in [r.bytes_each] * r.count)
    assert buckets(grad_reduce_in_fp32=True) == [2 * b for b in buckets()]
    assert sum(buckets(grad_reduce_in_fp32=True)) == 16192 and sum(buckets()) == 8096


def test_one_rank_groups_the_wrappers_still_call_and_the_rest_skip():
    # TP = 1, DP = 1: no TP collective at all; DataParallel still all-reduces its buckets on
    # its one-rank group (as the trace shows), but nothing is logged and the clip is local.
    table = _table(_step(tp=1, dp=1, micro_batch_size=4, clip_grad=True, bucket_size_bytes=math.inf))
    total = 4 * sum(math.prod(shape) for _, shape in costs.gpt_parameter_shapes(CONFIG, 1))
    assert table == {("all_reduce", "dp", "backward", total): 1}


def test_buckets_follow_data_parallel_build_buckets():
    assert costs.DATA_PARALLEL_BUCKET_SIZE_BYTES == DEFAULT_BUCKET_SIZE_BYTES
    params = [torch.nn.Parameter(torch.zeros(shape)) for _, shape in costs.gpt_parameter_shapes(CONFIG, 2)]
    for size in (0, 1000, 4096, 20000, math.inf):
        expected = [sum(p.numel() * 4 for p in bucket) for bucket in build_buckets(params, size)]
        assert costs.data_parallel_bucket_bytes([p.numel() * 4 for p in params], size) == expected


def test_errors_name_the_rule():
    rule = "must be divisible by the tensor-parallel size"
    with pytest.raises(ValueError, match=rf"vocab_size \(32\) {rule} \(3\)"):
        _step(tp=3)
    with pytest.raises(ValueError, match=r"seq_length \(8\) must be divisible"):
        costs.tp_dp_step_collectives(ModelConfig(num_layers=1, hidden_size=24, num_attention_heads=3,
                                                 seq_length=8, vocab_size=48),
                                     3, 1, 1, 1, sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"num_attention_heads \(4\) {rule} \(8\)"):
        _step(tp=8)
    with pytest.raises(ValueError, match="num_microbatches must be a whole number"):
        _step(num_microbatches=0)


def test_megatrons_distributed_optimizer_buffer_is_padded_more_than_the_courses():
    """Megatron-Core 0.20.0 (d98e8a64) lays the distributed optimizer's buffer out last
    parameter first, each at a multiple of 64 elements, and pads the bucket to a multiple of
    lcm(DP, 128) (megatron/core/optimizer/distrib_optimizer.py
    ``_compute_per_buffer_param_layout``, param_layout.py ``pad_param_start`` and
    ``pad_bucket_end``); the course pads to a multiple of DP only.  Worked by hand for
    parameters of 100, 10 and 64 elements on DP 3: 64 at 0, 10 at 64 (ends 74), 100 at 128
    (ends 228), padded to 384 (= lcm(3, 128)); the course's buffer is 174 -> 174."""
    assert costs.megatron_distributed_optimizer_numel([100, 10, 64], 3) == 384
    assert costs.megatron_distributed_optimizer_numel([100, 10, 64], 3, True) == 3 * 2**16
    rs, ag = costs.distributed_optimizer_collectives(174, 3)
    assert (rs.bytes_each, ag.bytes_each) == (174 * 4, 58 * 4)
