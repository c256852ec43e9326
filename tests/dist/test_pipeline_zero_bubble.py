"""The backward split into B and W (chapter 11), and the zero-bubble schedules, run for real.

Item 1 (the split changes nothing but the order of work): on PP = 3 x DP = 2 x EP = 2
(6 gloo ranks; the MoE all-to-alls sit on B's path), one 1F1B step as train_4d makes it
(its chunks, microbatches, ``DataParallel`` with every backward inside ``no_sync``, the
sync after the last) runs twice, once with the plain backward and once with each backward
as B then W at once (``split_backward``).  The synced gradients of every parameter, dense
and expert (the ``dp`` and ``expert_dp`` domains), must be equal bit for bit: the same
autograd nodes run on the same tensors and the gradients reach the buckets in the same
order.  The plain run is itself tested equal to serial (test_pipeline_training.py).

The memory check on these schedules: item 2's runs also check every rank's memory against
``tutorial_lib.costs.memory_per_rank`` (``memory_checks.assert_memory_as_predicted``).
"""
from dataclasses import replace

import pytest
import torch

from tutorial_lib.launch import launch
from tutorial_lib.train_4d import TrainingArgs

from .launch_once import launch_once
from .memory_checks import assert_memory_as_predicted
from .worker_checks import pipeline_backward
from tests.asserts import every

pytestmark = pytest.mark.dist

SPLIT_ARGS = TrainingArgs(num_layers=6, global_batch_size=24, num_microbatches=4, seq_length=8,
                          hidden_size=16, num_attention_heads=4, vocab_size=32, num_experts=4,
                          moe_router_topk=2, world_size=6, pipeline_model_parallel_size=3,
                          expert_model_parallel_size=2, timeout=180)


def _synced_gradients(ctx, args, split_backward):
    from tutorial_lib.data_parallel import grad_domain
    args = replace(args, schedule="1f1b", p2p_mode="batched")
    _, modules, model, out = pipeline_backward(args, split_backward)
    model.finish_grad_sync()
    grads = {name: p.grad.clone() for name, p in modules.named_parameters()}
    domains = {name: grad_domain(p) for name, p in modules.named_parameters()}
    model.remove_hooks()
    return grads, domains, out.losses


def _split_worker(ctx, args):
    plain, domains, plain_losses = _synced_gradients(ctx, args, False)
    split, _, split_losses = _synced_gradients(ctx, args, True)
    return {"plain": plain, "split": split, "domains": domains,
            "losses": (plain_losses, split_losses)}


@launch_once
def split_run():
    return launch(_split_worker, SPLIT_ARGS.world_size, args=(SPLIT_ARGS,), timeout=180)


def test_b_then_w_gives_the_plain_backwards_synced_gradients_bit_for_bit():
    result = split_run()
    kinds = set()
    for rank, out in enumerate(result.results):
        assert out["plain"].keys() == out["split"].keys()
        for name, grad in out["plain"].items():
            assert torch.equal(grad, out["split"][name]), (rank, name)
        kinds |= set(out["domains"].values())
        assert out["losses"][0] == out["losses"][1]
    assert kinds == {"dp", "expert_dp"}  # both gradient domains were compared


# --- item 2: train_4d --schedule zb-h1 | zbv | dualpipev | dualpipe ----------------------

#: The schedules that split the backward, each run by train_4d on every layout below.
NEW_SCHEDULES = ("zb-h1", "zbv", "dualpipev", "dualpipe")
#: The model: 8 layers (7 MoE) on PP 2; PP 4 runs it with 16 (:data:`NUM_LAYERS`).
SCHEDULE_ARGS = TrainingArgs(steps=2, num_layers=8, global_batch_size=16, seq_length=8,
                             hidden_size=16, num_attention_heads=4, vocab_size=32, num_experts=4,
                             moe_router_topk=2, expert_model_parallel_size=2, timeout=240)
#: (PP, world, M): PP 2 and PP 4, each x DP 2 with EP 2; M >= 2 PP, even (DualPipe's rule).
SCHEDULE_LAYOUTS = [(2, 4, 4), (4, 8, 8)]
#: Layers per PP: 16 (15 MoE) on PP 4, so that its V has 8 stages of two layers, as PP 2's
#: V with 8.  Two, not one: the memory check below holds each EP rank's saved activations
#: within ``memory_checks.ACTIVATION_RTOL`` (7 %) of the balanced routing the model
#: assumes, and a chunk of a single MoE layer carries that one fresh router's imbalance.
#: Measured, worst chunk mean over a step's microbatches / worst peak: PP 2 (8 layers)
#: 5.6 % / 3.8 %, PP 4 (16 layers) 6.1 % / 6.3 % (with 8 layers at PP 4, one per chunk:
#: 9.4 % / 7.7 %).  The EP group's mean per microbatch stays exact, and each peak is
#: checked exactly below.
NUM_LAYERS = {2: 8, 4: 16}


def _layout(pp, world, m):
    return replace(SCHEDULE_ARGS, pipeline_model_parallel_size=pp, world_size=world,
                   num_microbatches=m, num_layers=NUM_LAYERS[pp])


def _schedules_worker(ctx, args, schedules):
    from tutorial_lib.train_4d import train_worker
    out = {}
    for name in schedules:
        with ctx.tracer.tags(run=name):
            out[name] = train_worker(ctx, replace(args, schedule=name))
    return out


@launch_once
def serial_losses(num_layers):
    """The plain loop's losses: the whole model on the whole batch (no PP, no M), the same
    for every layout of ``num_layers`` here."""
    from .test_pipeline_training import plain_serial_losses
    return plain_serial_losses(replace(SCHEDULE_ARGS, num_layers=num_layers))


@launch_once
def schedules_run(pp, world, m):
    from tutorial_lib.train_4d import validate_args
    args = _layout(pp, world, m)
    for name in NEW_SCHEDULES:
        validate_args(replace(args, schedule=name))
    return launch(_schedules_worker, world, args=(args, NEW_SCHEDULES), timeout=args.timeout)


@pytest.mark.parametrize("pp,world,m", SCHEDULE_LAYOUTS)
@pytest.mark.parametrize("schedule", NEW_SCHEDULES)
def test_each_split_backward_schedule_trains_like_world_size_one(schedule, pp, world, m):
    """train_4d with ``--schedule zb-h1 / zbv / dualpipev / dualpipe`` on PP 2 and PP 4
    (x DP 2, EP 2) gives the plain serial loop's losses over 2 steps, the loop
    test_pipeline_training.py shows equal to the world-size-1 run (``ATOL`` 1e-5 there
    too: only the order of fp32 sums differs)."""
    from .test_pipeline_training import ATOL
    expected = serial_losses(NUM_LAYERS[pp])
    got = [r["loss"] for r in schedules_run(pp, world, m).results[0][schedule]]
    assert len(got) == SCHEDULE_ARGS.steps
    assert max(abs(a - b) for a, b in zip(got, expected)) < ATOL, (got, expected)


@pytest.mark.parametrize("pp,world,m", SCHEDULE_LAYOUTS)
@pytest.mark.parametrize("schedule", NEW_SCHEDULES)
def test_each_split_backward_schedule_uses_the_memory_the_model_predicts(schedule, pp, world, m):
    """The memory check on chapter 11's schedules (the runs above, no launch of its own): every
    rank's weights, gradients and optimizer state equal ``costs.memory_per_rank``'s to the
    byte, with the stages where the schedule puts them (the V's two stages per rank,
    DualPipe's two model copies: twice the parameters); its saved activations per
    microbatch and their peak (a split backward's held until its W) within
    7 % (``memory_checks.ACTIVATION_RTOL``), the EP group's mean exact (``memory_checks``).  Exact besides,
    whatever the routing: each rank's measured peak is the one its action list gives with
    its measured bytes per microbatch, counted here (a forward's bytes held until its
    backward, or until its W where the list has one; an overlapped pair's forward in
    before its backward out), the order the model's walk assumes."""
    from tutorial_lib.grid import megatron_grids
    from tutorial_lib.pipeline_parallel import build_schedules
    args = replace(_layout(pp, world, m), schedule=schedule)
    results = [by_schedule[schedule] for by_schedule in schedules_run(pp, world, m).results]
    assert_memory_as_predicted(args, results)
    lists = build_schedules(schedule, pp, m)
    parallel = args.configs()[0]
    parallel.world_size = world
    dense, _ = megatron_grids(parallel)
    for rank, records in enumerate(results):
        actions = lists[dense.coords(rank)["pp"]]
        weights = {(a.microbatch, a.chunk) for a in actions if a.kind == "weight"}
        for record in records:
            saved = {tuple(map(int, key.split(","))): n for key, n in
                     record["memory"]["activations_per_microbatch"].items()}
            held = peak = 0
            for a in actions:
                key = (a.microbatch, a.chunk)
                if a.kind == "forward":
                    held += saved[key]
                    peak = max(peak, held)
                elif a.kind == ("weight" if key in weights else "backward"):
                    held -= saved[key]
            assert record["memory"]["peak_activations"] == peak, (schedule, rank)


# --- item 3: DualPipe's overlapped pairs hide each all-to-all behind the other half -------


def _hidden_and_exposed(events, run=None):
    """Each overlapped all-to-all of ``events`` (one run), sorted: hidden (its interval,
    from issue to wait, holds a whole ``turn`` of the other half of its pair, on its rank)
    or exposed, which it may only be when every turn of the other half had ended before
    it was issued (nothing was left to hide it behind)."""
    if run is not None:
        events = [e for e in events if e.tags.get("run") == run]

    def key(e):
        return (e.rank, e.tags.get("repeat"), e.tags.get("step"), e.tags["pair"])

    turns = [e for e in events if e.op == "compute" and e.tags.get("name") == "turn"]
    hidden, exposed = [], []
    for a in (e for e in events if e.op == "all_to_all" and e.tags.get("overlapped")):
        others = [t for t in turns if key(t) == key(a) and t.tags["half"] != a.tags["half"]]
        assert others, a  # the other half computed at least once
        if any(a.t_start <= t.t_start and t.t_end <= a.t_end for t in others):
            hidden.append(a)
        else:
            assert every(t.t_end <= a.t_start for t in others), a
            exposed.append(a)
    assert hidden, "no all-to-all ran under the other microbatch's compute"
    return hidden, exposed


def test_dualpipe_runs_the_real_models_all_to_alls_under_the_other_microbatchs_compute():
    """Item 3 with the real model (the PP 2 x DP 2, EP 2 run above): in DualPipe's and
    DualPipeV's overlapped pairs each MoE dispatch / combine all-to-all (and the count
    exchange before a dispatch) is issued asynchronously, and from its issue to its wait
    the other microbatch of the pair computes: the recorded interval of the all-to-all
    holds a whole compute turn of the other half.  Deterministic: the turn starts after
    the issue and ends before the wait in program order (pipeline.Turns), whatever the
    timings.  The only exceptions are all-to-alls issued after the other half had
    finished."""
    trace = schedules_run(2, 4, 4).trace
    for run in ("dualpipe", "dualpipev"):
        hidden, exposed = _hidden_and_exposed(list(trace), run)
        assert {a.tags["half"] for a in hidden} == {"forward", "backward"}
        assert {a.tags.get("op_name") for a in hidden} >= {"dispatch", "combine"}
        assert len(hidden) > len(exposed)


#: SyntheticStage runs on PP 2 x EP 2 (two pipelines side by side, exchanging rows with a
#: MoE layer's two all-to-alls in every forward and B), each of the four schedules, M 4.
SYNTHETIC_RUNS = [(name, 4, 1) for name in NEW_SCHEDULES]


@launch_once
def synthetic_run():
    from tutorial_lib.pipeline_parallel.synthetic import measure_synthetic_schedules
    return launch(measure_synthetic_schedules, 4, args=(SYNTHETIC_RUNS,),
                  kwargs={"expert_parallel_size": 2, "forward_seconds": 0.004,
                          "backward_seconds": 0.008}, timeout=120)


def test_dualpipe_with_synthetic_stages_hides_their_all_to_alls_too():
    """Item 3 with SyntheticStage costs (pipeline.measure_synthetic_schedules on PP 2 x EP 2):
    each stage's dispatch and combine all-to-all of an overlapped pair runs under the
    other half's compute."""
    from tutorial_lib.pipeline_parallel.synthetic import synthetic_run_name
    events = list(synthetic_run().trace)
    for name in ("dualpipe", "dualpipev"):
        hidden, _ = _hidden_and_exposed(events, synthetic_run_name(name, 4))
        assert {a.tags.get("op_name") for a in hidden} == {"dispatch", "combine"}
        assert {a.tags["half"] for a in hidden} == {"forward", "backward"}


def test_the_executor_holds_the_activations_the_simulator_counts_on_every_rank():
    """The executor's peak of (microbatch, chunk) activations kept (from the forward to
    the backward, or to the W of a split one) equals the pure count of the same action
    list (pipeline_parallel.formulas.peak_activations_in_flight) on every rank, for each of the
    four schedules: the executor keeps what the schedule says, no more."""
    from tutorial_lib.grid import build_grid
    from tutorial_lib.pipeline_parallel.synthetic import synthetic_run_name
    from tutorial_lib.pipeline_parallel import build_schedules
    from tutorial_lib.pipeline_parallel.formulas import peak_activations_in_flight
    result = synthetic_run()
    for pipeline in build_grid(4, pp=2, ep=2).groups("pp"):
        for name, m, v in SYNTHETIC_RUNS:
            lists = build_schedules(name, 2, m)
            measured = [result.results[rank][synthetic_run_name(name, m, v)]
                        for rank in pipeline]
            assert measured == [[peak_activations_in_flight(lists[r])] for r in range(2)], name
