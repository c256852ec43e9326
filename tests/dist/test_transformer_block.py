"""The tensor-parallel Transformer block on real gloo workers, against the serial block.

The serial block is the same class built with ``tp_group=None`` from the same seed.
TP in {1, 2, 4}, alone (world = TP) and beside DP=2 (world = TP x 2, the same data on
both DP replicas), with and without sequence parallelism.  Compared: the output, the
input gradient and every parameter (shard == slice of the serial weight, exactly) and
its gradient (shard vs slice; replicated LayerNorm and row-parallel-bias gradients in
full, after the sequence-parallel all-reduce).  fp32, ``atol=1e-5, rtol=1e-5``.  The
same launches also measure the bytes autograd saves for the column-parallel layers.
"""
import sys

import cloudpickle
import pytest
import torch

from tutorial_lib import parallel_state
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import launch

from .launch_once import launch_once
from .worker_checks import backward as _backward, check as _check, close as _close
from tutorial_lib.saved_activations import saved_activation_bytes
from tutorial_lib.transformer import TransformerBlock, allreduce_sequence_parallel_grads, block_collectives
from tests.asserts import every

pytestmark = pytest.mark.dist

# The workers get the functions below by value, so they never import this module (and
# pytest with it: 0.2 s a rank).  Code that runs in a worker therefore checks with
# _check, not a bare assert, which pytest would rewrite into a call into pytest.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


S, B, H, HEADS = 8, 2, 16, 4


def _shard_of(full, param, i, T):
    """The slice of a serial tensor that ``param`` holds on TP rank ``i``."""
    return full.chunk(T, param.partition_dim)[i] if getattr(param, "tensor_model_parallel", False) else full


def _run_block(ctx, tp_size, sequence_parallel, sync_sequence_parallel_grads=True, saved=None):
    """One forward + backward of the TP block and of the serial block; returns both.

    ``saved``: a dict that receives the bytes autograd saved for ``linear_qkv`` and
    ``linear_fc1`` in the forward pass (:func:`saved_activation_bytes`).
    """
    parallel_state.initialize_model_parallel(
        ParallelConfig(ctx.world_size, tensor_model_parallel_size=tp_size), layout="megatron")
    T, i = parallel_state.get_size("tp"), parallel_state.get_rank_in("tp")
    g = torch.Generator().manual_seed(2024)  # the same batch on every rank, DP replicas included
    x_full, dy_full = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)

    serial = TransformerBlock(H, HEADS, seed=3, tp_group=None)
    x_serial = x_full.clone().requires_grad_()
    y_serial = serial(x_serial)
    _backward(y_serial, dy_full)

    block = TransformerBlock(H, HEADS, sequence_parallel=sequence_parallel, seed=3)
    tokens = slice(i * S // T, (i + 1) * S // T) if sequence_parallel else slice(None)
    x = x_full[tokens].clone().requires_grad_()
    column_layers = {"linear_qkv": block.self_attention.linear_qkv, "linear_fc1": block.mlp.linear_fc1}
    with ctx.tracer.tags(layer="block"):
        with saved_activation_bytes(column_layers) as saved_bytes:
            y = block(x)
        if saved is not None:
            saved.update(saved_bytes)
        _backward(y, dy_full[tokens])
        if sync_sequence_parallel_grads:
            allreduce_sequence_parallel_grads(block)
    return serial, block, (x, y), (x_serial.grad, y_serial.detach()), tokens, T, i


def _block_equals_serial(ctx, tp_size, sequence_parallel):
    saved = {}
    serial, block, (x, y), (serial_dx, serial_y), tokens, T, i = _run_block(
        ctx, tp_size, sequence_parallel, saved=saved)
    _close(y, serial_y[tokens], "block output")
    _close(x.grad, serial_dx[tokens], "block input grad")
    serial_params = dict(serial.named_parameters())
    for name, p in block.named_parameters():
        ref = serial_params[name]
        _check(torch.equal(p.detach(), _shard_of(ref.detach(), p, i, T)), f"{name}: shard is not my slice")
        _close(p.grad, _shard_of(ref.grad, p, i, T), f"{name}: grad")
    return {"group": parallel_state.get_group_ranks("tp"), "saved": saved}


CONFIGS = [(tp, dp, sp) for sp in (False, True) for tp in (1, 2, 4) for dp in (1, 2)]


@launch_once
def _block_run(tp_size, dp_size, sequence_parallel):
    """One launch per configuration, shared by the tests below."""
    return launch(_block_equals_serial, tp_size * dp_size, args=(tp_size, sequence_parallel), timeout=60)


@pytest.mark.parametrize("tp_size,dp_size,sequence_parallel", CONFIGS)
def test_block_equals_the_serial_block_and_issues_the_expected_collectives(tp_size, dp_size, sequence_parallel):
    res = _block_run(tp_size, dp_size, sequence_parallel)
    expected = block_collectives(S, B, H, tp_size, sequence_parallel)
    for rank, result in enumerate(res.results):
        group = result["group"]
        events = res.trace.filter(rank=rank, layer="block", comm_only=True)
        # none outside the rank's TP group (at TP 1 there are none at all: got == expected)
        assert [e for e in events if not (e.group_kind == "tp" and list(e.group_ranks) == group)
                ] == []
        got = [{"phase": e.tags["phase"], "op_name": e.tags["op_name"], "op": e.op, "bytes": e.bytes}
               for e in events]
        assert got == expected
        # The same, as numbers a reader can check: s*b*h*4 = 8*2*16*4 = 1024 bytes.
        ops = [(e["op"], e["bytes"]) for e in got]
        if tp_size == 1:
            assert ops == []
        elif not sequence_parallel:
            assert ops == [("all_reduce", 1024)] * 4  # 2 forward + 2 backward
        else:
            shard = 1024 // tp_size  # all-gather bytes count this rank's [s/T, b, h] input
            # forward: gather, scatter per sublayer; backward: gather dY, gather the saved
            # input again, reduce-scatter dX per sublayer; then the grad sync
            assert ops == ([("all_gather", shard), ("reduce_scatter", 1024)] * 2
                           + [("all_gather", shard), ("all_gather", shard), ("reduce_scatter", 1024)] * 2
                           + [("all_reduce", 6 * H * 4)])


@pytest.mark.parametrize("tp_size,dp_size,sequence_parallel", CONFIGS)
def test_column_parallel_layers_save_one_tp_share_of_their_input_under_sequence_parallelism(
        tp_size, dp_size, sequence_parallel):
    """Bytes autograd keeps for ``linear_qkv`` and ``linear_fc1`` on each rank, measured with
    ``saved_tensors_hooks``: their input, ``s/T * b * h * 4`` under sequence parallelism
    (this rank's shard), ``s * b * h * 4`` without (the whole input, on every TP rank).

    Megatron-Core 0.20.0 (d98e8a64), ``megatron/core/tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication.forward`` saves the input it was given
    (the shard), not the all-gathered one, and ``backward`` all-gathers it again for dW.
    Keeping the gathered input instead would keep ``s * b * h * 4`` at every TP size, so
    sequence parallelism would not cut these two activations by T.
    """
    res = _block_run(tp_size, dp_size, sequence_parallel)
    tokens = S // tp_size if sequence_parallel else S
    for rank, result in enumerate(res.results):
        assert result["saved"] == {"linear_qkv": tokens * B * H * 4, "linear_fc1": tokens * B * H * 4}, rank


def _partial_layernorm_grads(ctx, tp_size):
    serial, block, *_ = _run_block(ctx, tp_size, True, sync_sequence_parallel_grads=False)
    serial_params = dict(serial.named_parameters())
    return {name: (p.grad.clone(), serial_params[name].grad.clone())
            for name, p in block.named_parameters() if getattr(p, "sequence_parallel", False)}


def test_without_the_allreduce_sequence_parallel_layernorm_grads_are_partial_sums():
    """Each TP rank saw only its s/T tokens: its LayerNorm gradient is a partial sum."""
    tp_size = 2
    res = launch(_partial_layernorm_grads, tp_size, args=(tp_size,), timeout=60)
    partials = res.results
    names = sorted(partials[0])
    assert names == ["input_layernorm.bias", "input_layernorm.weight", "mlp.linear_fc2.bias",
                     "pre_mlp_layernorm.bias", "pre_mlp_layernorm.weight", "self_attention.linear_proj.bias"]
    for name in names:
        full = partials[0][name][1]
        for rank in range(tp_size):
            wrong = partials[rank][name][0]
            assert (wrong - full).abs().max() > 1e-2, f"{name} on rank {rank} should differ without the all-reduce"
        summed = sum(partials[rank][name][0] for rank in range(tp_size))
        _close(summed, full, f"{name}: the sum of the partial gradients")


def _sp_grads_before_finish(ctx):
    from tutorial_lib.data_parallel import DataParallel
    parallel_state.initialize_model_parallel(ParallelConfig(2, tensor_model_parallel_size=2))
    model = DataParallel(TransformerBlock(H, HEADS, sequence_parallel=True, seed=3))
    x = torch.randn(S // 2, B, H, generator=torch.Generator().manual_seed(ctx.rank))
    model(x).sum().backward()
    try:
        allreduce_sequence_parallel_grads(model.module)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_sequence_parallel_grad_sync_refuses_to_run_before_data_parallel_has_finished():
    messages = launch(_sp_grads_before_finish, 2).results
    assert every("call model.finish_grad_sync() first" in m for m in messages), messages
