"""Chapter 11: a stage's backward split into B (input gradient) and W (weights).

B then W must give the plain backward's gradients bit for bit (the same autograd nodes
run on the same tensors, only at other times); B must leave every weight untouched, so
a schedule may put W anywhere after it; W must accumulate through the parameters'
gradient accumulators, so the hooks that data parallelism hangs there
(``register_post_accumulate_grad_hook``: DataParallel's ``main_grad`` buckets, ZeRO-1's
fp32 accumulation) fire in W as in a plain backward.  In-process, serial stages: no
groups, the MoE layers' all-to-alls are identities.
"""
import pytest
import torch

from tutorial_lib.config import ModelConfig
from tutorial_lib.deepseek import DeepSeekModel, Microbatch
from tutorial_lib.pipeline_parallel.backward_split import backward_input, backward_weight
from tutorial_lib.pipeline_parallel.synthetic import SyntheticStage
from tests.asserts import every

CONFIG = ModelConfig(num_layers=6, hidden_size=16, num_attention_heads=4, seq_length=8,
                     vocab_size=32, num_experts=4, moe_router_topk=2, dropout=0.1)
ROWS = 3


def _batch(step=0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (ROWS, CONFIG.seq_length), generator=generator)
    labels = torch.randint(0, CONFIG.vocab_size, (ROWS, CONFIG.seq_length), generator=generator)
    return Microbatch(ids, labels, torch.arange(ROWS) + ROWS * seed, step)


def _stage_and_input(stage, seed):
    model = DeepSeekModel(CONFIG, stage=stage, num_stages=3, seed=7)
    model.train()
    hidden = None
    if stage > 0:
        generator = torch.Generator().manual_seed(100 + seed)
        hidden = torch.randn(CONFIG.seq_length, ROWS, CONFIG.hidden_size, generator=generator)
    return model, hidden


def _output_grad(stage, seed):
    if stage == 2:
        return None  # the loss
    generator = torch.Generator().manual_seed(200 + seed)
    return torch.randn(CONFIG.seq_length, ROWS, CONFIG.hidden_size, generator=generator)


def _plain(stage, microbatches=2):
    """Every microbatch's forward and plain backward, one after the other."""
    model, _ = _stage_and_input(stage, 0)
    input_grads = []
    for mb in range(microbatches):
        _, hidden = _stage_and_input(stage, mb)
        if hidden is not None:
            hidden.requires_grad_()
        out = model.forward_stage(hidden, _batch(seed=mb))
        torch.autograd.backward(out, _output_grad(stage, mb))
        input_grads.append(None if hidden is None else hidden.grad)
    return model, input_grads


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_b_then_a_deferred_w_gives_the_plain_backwards_gradients_bit_for_bit(stage):
    """Two microbatches, both B's before both W's (the most deferred order): the input
    gradients and the accumulated weight gradients equal the plain backward's exactly."""
    reference, reference_input_grads = _plain(stage)
    model, _ = _stage_and_input(stage, 0)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    works, input_grads = [], []
    for mb in range(2):
        _, hidden = _stage_and_input(stage, mb)
        if hidden is not None:
            hidden.requires_grad_()
        out = model.forward_stage(hidden, _batch(seed=mb))
        input_grad, work = backward_input(out, _output_grad(stage, mb), hidden)
        input_grads.append(input_grad)
        works.append(work)
    assert fired == [] and all(p.grad is None for p in model.parameters()), \
        "B must leave every weight gradient to W"
    for mb in range(2):
        if stage > 0:
            assert torch.equal(input_grads[mb], reference_input_grads[mb])
        else:
            assert input_grads[mb] is None  # the first stage sends no gradient back
    for work in works:
        backward_weight(work)
    with_grad = [name for name, p in reference.named_parameters() if p.grad is not None]
    assert len(with_grad) > 10
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    # every parameter with a gradient got its accumulate hook once per microbatch's W
    assert len(fired) == 2 * len(with_grad)


def test_b_runs_no_weight_gradient_node_and_w_runs_no_input_gradient_node():
    """With a SyntheticStage whose input path and weight path each wait in their own
    backward: B waits only the input path's time, W only the weight's."""
    stage = SyntheticStage(1, 3, (2, 2, 2), forward_seconds=0.0, backward_seconds=0.5,
                           weight_seconds=0.3)
    hidden = torch.ones(2, 2, 2, requires_grad=True)
    out = stage.forward_stage(hidden, None)
    waited = []
    import tutorial_lib.pipeline_parallel.synthetic as synthetic
    real_sleep = synthetic.time.sleep
    synthetic.time.sleep = waited.append
    try:
        input_grad, work = backward_input(out, torch.ones(2, 2, 2), hidden)
        after_b = list(waited)
        backward_weight(work)
    finally:
        synthetic.time.sleep = real_sleep
    assert after_b == [pytest.approx(0.2)] and waited[1:] == [0.3]
    assert torch.equal(input_grad, torch.ones(2, 2, 2))
    assert stage.weight.grad.item() == 8.0


def test_a_synthetic_weight_cost_must_fit_in_the_backward():
    with pytest.raises(ValueError, match="weight_seconds"):
        SyntheticStage(0, 2, (2, 2, 2), backward_seconds=0.1, weight_seconds=0.2)


def test_synthetic_chunks_sit_where_each_schedule_places_its_stages_and_share_the_work():
    """The chapter's SyntheticStage runs (pipeline.measure_synthetic_schedules): a V's two
    chunks are stages r and 2PP-1-r at half a stage's cost, DualPipe's two chunks are
    stage r of copy 0 and PP-1-r of copy 1 at a whole stage's cost (each copy is the
    whole model), W half the backward unless told."""
    from tutorial_lib.pipeline_parallel.synthetic import synthetic_chunks
    shape = (2, 2, 2)
    v = synthetic_chunks("zbv", 1, 4, shape, 0.1, 0.2)
    assert [(c.stage, c.num_stages) for c in v] == [(1, 8), (6, 8)]
    assert [(c.forward_seconds, c.backward_seconds, c.weight_seconds) for c in v] == \
        [(0.05, 0.1, 0.05)] * 2
    dual = synthetic_chunks("dualpipe", 1, 4, shape, 0.1, 0.2, weight_seconds=0.08)
    assert [(c.stage, c.num_stages) for c in dual] == [(1, 4), (2, 4)]
    assert [(c.forward_seconds, c.backward_seconds, c.weight_seconds) for c in dual] == \
        [(0.1, 0.2, 0.08)] * 2
    loop = synthetic_chunks("interleaved", 3, 4, shape, 0.1, 0.2, virtual_pipeline_size=2)
    assert [(c.stage, c.num_stages) for c in loop] == [(3, 8), (7, 8)]


def test_the_split_works_under_non_reentrant_activation_checkpointing():
    """Chapter 10 recomputes layers with ``torch.utils.checkpoint``: its non-reentrant form
    (torch's default advice; the reentrant one refuses ``autograd.grad``, so B) re-runs
    the layer's forward when B, then W, unpack what it did not keep; the gradients are
    still the plain backward's bit for bit."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x, g = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    torch.autograd.backward(checkpoint(net, x, use_reentrant=False), g)
    reference = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    input_grad, work = backward_input(checkpoint(net, x2, use_reentrant=False), g, x2)
    assert every(p.grad is None for p in net.parameters())
    backward_weight(work)
    assert torch.equal(input_grad, x.grad)
    assert every(torch.equal(a, p.grad) for a, p in zip(reference, net.parameters()))


def test_overlapped_all_to_alls_counts_the_time_the_other_half_computed():
    """pipeline.overlapped_all_to_alls on a hand-made trace: an all-to-all of the forward
    half from 1.0 to 2.0 s, while the backward half computed from 1.2 to 1.5 and from 1.8
    to 2.4 (and the forward itself, which hides nothing, from 0.5 to 1.0): 0.3 + 0.2 s
    hidden.  A turn of another pair or another step hides nothing."""
    from tutorial_lib.pipeline_parallel.dualpipe import overlapped_all_to_alls
    from tutorial_lib.trace import TraceEvent

    def turn(half, start, end, pair="F1&B0", step=0):
        return TraceEvent(0, "compute", t_start=start, t_end=end,
                          tags={"name": "turn", "half": half, "pair": pair, "step": step})

    a2a = TraceEvent(0, "all_to_all", t_start=1.0, t_end=2.0,
                     tags={"overlapped": True, "half": "forward", "pair": "F1&B0", "step": 0,
                           "op_name": "dispatch", "microbatch": 1, "chunk": 0})
    events = [turn("forward", 0.5, 1.0), a2a, turn("backward", 1.2, 1.5),
              turn("backward", 1.8, 2.4), turn("backward", 1.0, 2.0, pair="F2&B1"),
              turn("backward", 1.0, 2.0, step=1),
              TraceEvent(0, "all_to_all", t_start=0.0, t_end=3.0)]  # not in a pair
    (row,) = overlapped_all_to_alls(events)
    assert row["hidden_seconds"] == pytest.approx(0.5)
    assert row["seconds"] == 1.0 and row["op_name"] == "dispatch" and row["half"] == "forward"
