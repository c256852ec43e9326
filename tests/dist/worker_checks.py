"""Checks that run inside gloo workers, shared by the dist tests.

The tests register their modules (and this one) with cloudpickle by value, so the
workers never import the test modules, and pytest with them (0.2 s a rank).  Code
that runs in a worker therefore checks with :func:`check`, not a bare ``assert``,
which pytest would rewrite into a call into pytest.
"""
import sys

import cloudpickle
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ATOL = RTOL = 1e-5
"""fp32 tolerance of the layer and block comparisons."""


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def backward(y, dy):
    """``y.backward(dy)``, as the scalar ``(y * dy).sum()``: the same gradient, bit for bit."""
    (y * dy).sum().backward()


def close(actual, expected, what, atol=ATOL, rtol=RTOL):
    """Closeness ``|a - b| <= atol + rtol |b|`` (fp32's by default), with a message naming the
    worst difference."""
    check(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        worst = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max |difference| {worst:.3g} exceeds atol={atol}, rtol={rtol}")


def pipeline_backward(args, split_backward: bool = False):
    """Step 0's forwards and backwards on this rank as ``train_4d.train_worker`` runs them
    (its chunks, microbatches, aux-loss scale and schedule, under ``DataParallel(..., "dp")``'s
    no_sync), for tests that read the gradients it leaves: ``(chunks, modules, model, out)``
    with ``out`` the executor's ``StepOutput``; the caller syncs (``finish_step`` or
    ``model.finish_grad_sync()``).  The groups are built unless these already are."""
    from tutorial_lib import parallel_state
    from tutorial_lib.data_parallel import DataParallel
    from tutorial_lib.pipeline_parallel.executor import forward_backward_pipelining
    from tutorial_lib.train_4d import (_microbatches, build_chunks, moe_aux_loss_scale,
                                       pipeline_tensor_shape)
    parallel, _, _ = args.configs()
    if not parallel_state.is_initialized() or parallel_state.get_state().grid.config != parallel:
        parallel_state.initialize_model_parallel(parallel)
    chunks = build_chunks(args)
    modules = torch.nn.ModuleList(chunks)
    model = DataParallel(modules, group="dp")
    m, dp = args.num_microbatches, parallel_state.get_size("dp")
    for chunk in chunks:
        chunk.reset_step_stats()
        chunk.aux_loss_scale = moe_aux_loss_scale(m)
    shape = pipeline_tensor_shape(args, args.global_batch_size // dp // m)
    first_stage = parallel_state.get_rank_in("pp") == 0
    with model.no_sync():
        out = forward_backward_pipelining(chunks, _microbatches(args, 0, first_stage, None),
                                          args.schedule, args.p2p_mode, shape,
                                          split_backward=split_backward,
                                          label_length=args.seq_length // args.context_parallel_size)
    return chunks, modules, model, out
