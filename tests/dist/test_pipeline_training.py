"""The proof that 4D training (TP x PP x EP x DP, any schedule, any P2P mode) equals serial.

Two references, both fp32:

* **the plain loop**, in this test process: the whole :class:`DeepSeekModel` (one stage),
  the whole global batch in one forward, ``torch.nn.utils.clip_grad_norm_``,
  ``torch.optim.Adam`` and the bias step on the batch's expert load.  It shares only the
  model and the data with the code under test: no executor, no microbatches, no groups.
* **the world-size-1 run** of :func:`tutorial_lib.train_4d.train` (what
  ``python examples/train_4d.py --world-size 1`` prints), which must equal the plain loop.

Then every layout of at most 8 ranks with PP in {2, 3, 4} that the rules allow (TP in
{1, 2, 4}, EP dividing the 4 experts and the data-parallel size, TP and EP not both > 1:
the sweep predates TP and EP together, whose runs have their own section below), plus a few
without PP, trains 2 steps (the second on the weights the first updated: Adam, clipping
and the bias step included) with the default 1F1B schedule and batched P2P; and two
layouts (PP = 3 with EP, PP = 4 with DP) run every schedule in both of Megatron's P2P modes, batched and overlapped (chapter 7's sequential mode is refused by the
validator: see :func:`tutorial_lib.pipeline_parallel.modes.check_schedule_and_mode`).  Each run's per-step losses must
equal the world-size-1 run's: ``atol = 1e-5`` on losses of about 4.2.  What differs
between layouts is only the order of fp32 sums (all-reduces, microbatch accumulation),
measured at most ~3e-7.  The same holds with dropout (layouts without TP and EP: rule 7),
because each row's masks are drawn from its index in the global batch.  The runs of one
world size, the world-size-1 references included, train one after the other in one launch
(:func:`trained`: a launch per world size, not per test); ``train`` itself launches one of
them alone and gives the same losses.  Sequence
parallelism through the whole model (``SP_RUNS``) runs inside the TP x EP sweep's
launches, with PP 3, and with CP 2 and PP 2.
"""
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import astuple, fields, replace
from pathlib import Path

import pytest
import torch

from tutorial_lib.config import ConfigError
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.moe_balance import update_expert_bias
from tutorial_lib.data import synthetic_batch
from tutorial_lib.train_4d import TrainingArgs, train, validate_args

from .launch_once import launch_once
from .memory_checks import assert_memory_as_predicted
from .worker_checks import pipeline_backward
from tests.asserts import every

pytestmark = pytest.mark.dist

TRAIN_4D = Path(__file__).resolve().parents[2] / "examples" / "train_4d.py"
ATOL = 1e-5
BASE = TrainingArgs(steps=2, num_layers=12, global_batch_size=24, num_microbatches=2,
                    seq_length=8, hidden_size=16, num_attention_heads=4, vocab_size=32,
                    num_experts=4, moe_router_topk=2, timeout=180)


def plain_serial_losses(args: TrainingArgs) -> list[float]:
    """The reference: the whole model, the whole batch, torch's clip and Adam, no groups."""
    _, model_config, _ = args.configs()
    model = DeepSeekModel(model_config, seed=args.seed)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        input_ids, labels = synthetic_batch(args.seed, step, args.global_batch_size,
                                            args.seq_length, args.vocab_size)
        model.reset_step_stats()
        optimizer.zero_grad()
        loss = model(input_ids, labels, sample_ids=torch.arange(args.global_batch_size), step=step)
        loss.backward()
        if args.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        for index, layer in model.moe_layers().items():
            update_expert_bias(layer.router.expert_bias, model.expert_loads[index], layer.balance.gamma)
        losses.append(loss.item())
    return losses


def world_one_args(args: TrainingArgs) -> TrainingArgs:
    """The world-size-1 run of ``args``'s model and batch, with plain Adam (no sharding
    strategy: what ``--world-size 1`` runs)."""
    return replace(args, world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                   expert_model_parallel_size=1, expert_tensor_parallel_size=None,
                   context_parallel_size=1, cp_comm_type="p2p", sequence_parallel=False,
                   schedule="1f1b", p2p_mode="batched", use_distributed_optimizer=False,
                   data_parallel_sharding_strategy=None)


def _train_each(ctx, runs: list[TrainingArgs]) -> list[list[dict]]:
    """train_4d's worker on each run of ``runs``, one after the other on these ranks: the
    records each returns (what ``train(args).results[rank]`` holds)."""
    from tutorial_lib.train_4d import train_worker
    return [train_worker(ctx, args) for args in runs]


@launch_once
def trained(world: int) -> dict:
    """Every run of this world size that the tests below compare (:func:`every_run`), trained
    in one launch rather than one launch each: ``{astuple(args): every rank's records}``.
    Each run is checked as ``train`` checks it before it launches, and the launch's timeout is
    the sum of the runs' own.  ``test_the_record_holds_...`` launches one run by ``train``
    itself and finds the same losses here."""
    from tutorial_lib.launch import launch
    runs = list({astuple(args): args for args in every_run() if args.world_size == world}.values())
    for args in runs:
        validate_args(args)
    result = launch(_train_each, world, args=(runs,), timeout=sum(a.timeout for a in runs),
                    trace=False, print_output=False)
    return {astuple(args): [ranks[i] for ranks in result.results] for i, args in enumerate(runs)}


def records_of(args: TrainingArgs) -> list[list[dict]]:
    """Every rank's records of the run; on the way, every rank's memory against the
    prediction (chapter 10)."""
    results = trained(args.world_size)[astuple(args)]
    assert_memory_as_predicted(args, results)
    return results


def world_one_losses(args: TrainingArgs) -> list[float]:
    """The world-size-1 run of the same model and batch."""
    return [r["loss"] for r in records_of(world_one_args(args))[0]]


def losses_of(args: TrainingArgs) -> list[float]:
    """The run's losses (rank 0's records)."""
    return [r["loss"] for r in records_of(args)[0]]


def assert_same_losses(args: TrainingArgs) -> None:
    expected, got = world_one_losses(args), losses_of(args)
    assert len(got) == args.steps
    worst = max(abs(a - b) for a, b in zip(got, expected))
    assert worst < ATOL, (f"layout TP{args.tensor_model_parallel_size} PP{args.pipeline_model_parallel_size} "
                          f"EP{args.expert_model_parallel_size} W{args.world_size} {args.schedule}/"
                          f"{args.p2p_mode}: losses {got} vs world-size-1 {expected} (max |delta| {worst:.2e})")


def valid_layouts(max_world: int = 8, pipeline_sizes=(2, 3, 4)):
    """(TP, PP, EP, world) for every grid the rules accept with BASE's model."""
    for pp, tp in itertools.product(pipeline_sizes, (1, 2, 4)):
        for world in range(tp * pp, max_world + 1, tp * pp):
            dp = world // (tp * pp)
            for ep in (1, 2, 4):
                if (ep > 1 and tp > 1) or dp % ep or BASE.num_experts % ep:
                    continue
                if BASE.global_batch_size % (dp * BASE.num_microbatches):
                    continue
                yield tp, pp, ep, world


LAYOUTS = list(valid_layouts()) + [(1, 1, 2, 2), (2, 1, 1, 4), (1, 1, 4, 4)]


def layout_args(tp, pp, ep, world, **changes) -> TrainingArgs:
    """BASE on this grid.  Without EP, two layers per pipeline stage (four without PP)
    unless ``changes`` says otherwise: a run costs about its number of layers, and two
    layers a stage still pass activations between layers and stages (the first layer
    dense, the rest MoE).  With EP, BASE's 12: a rank's saved activations follow its
    experts' routed load, and :data:`memory_checks.ACTIVATION_RTOL` was measured on runs
    with several MoE layers a stage (with one, a fresh router's imbalance reached 13 %)."""
    changes.setdefault("num_layers", 2 * max(pp, 2) if ep == 1 else BASE.num_layers)
    return replace(BASE, world_size=world, tensor_model_parallel_size=tp,
                   pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, **changes)


def test_the_world_size_one_run_equals_the_plain_serial_loop():
    expected = plain_serial_losses(BASE)
    got = world_one_losses(BASE)
    assert max(abs(a - b) for a, b in zip(got, expected)) < ATOL, (got, expected)
    assert got[-1] < got[0], "the synthetic data is learnable: the loss must fall"


def test_the_layouts_cover_every_pipeline_size_and_dimension():
    assert {pp for _, pp, _, _ in LAYOUTS} >= {2, 3, 4}
    assert any(tp > 1 and pp > 1 for tp, pp, _, _ in LAYOUTS)
    assert any(ep > 1 and pp > 1 for _, pp, ep, _ in LAYOUTS)
    assert any(w // (tp * pp) > 1 and pp > 1 for tp, pp, _, w in LAYOUTS)  # DP with PP
    assert len(LAYOUTS) >= 18


@pytest.mark.parametrize("tp,pp,ep,world", LAYOUTS,
                         ids=[f"tp{t}-pp{p}-ep{e}-w{w}" for t, p, e, w in LAYOUTS])
def test_every_layout_trains_like_world_size_one(tp, pp, ep, world):
    args = layout_args(tp, pp, ep, world)
    validate_args(args)
    assert_same_losses(args)


SCHEDULE_MODES = [(s, m) for s in ("gpipe", "1f1b", "interleaved") for m in ("overlapped", "batched")]
SCHEDULE_LAYOUTS = [(1, 3, 2, 6), (1, 4, 1, 8)]


def schedule_args(schedule, mode, tp, pp, ep, world) -> TrainingArgs:
    # interleaving needs num_layers divisible by PP * V (V = 2) and M by PP: 4 x PP layers,
    # two per model chunk, M = PP
    return layout_args(tp, pp, ep, world, schedule=schedule, p2p_mode=mode, num_layers=4 * pp,
                       num_microbatches=pp, global_batch_size=2 * pp * 2)


@pytest.mark.parametrize("schedule,mode", SCHEDULE_MODES, ids=[f"{s}-{m}" for s, m in SCHEDULE_MODES])
@pytest.mark.parametrize("tp,pp,ep,world", SCHEDULE_LAYOUTS, ids=["pp3-ep2-dp2", "pp4-dp2"])
def test_every_schedule_and_p2p_mode_trains_like_world_size_one(schedule, mode, tp, pp, ep, world):
    assert_same_losses(schedule_args(schedule, mode, tp, pp, ep, world))


DROPOUT_LAYOUTS = [(2, 4), (3, 3)]


def dropout_args(pp, world) -> TrainingArgs:
    return layout_args(1, pp, 1, world, dropout=0.2)


@pytest.mark.parametrize("pp,world", DROPOUT_LAYOUTS)
def test_dropout_is_the_same_on_every_layout(pp, world):
    args = dropout_args(pp, world)
    expected = plain_serial_losses(args)
    got = losses_of(args)
    assert max(abs(a - b) for a, b in zip(got, expected)) < ATOL, (got, expected)
    no_dropout = world_one_losses(replace(args, dropout=0.0))
    assert min(abs(a - b) for a, b in zip(got, no_dropout)) > 1e-3, "dropout must change the losses"


#: (TP, PP, EP, CP, world, cp_comm_type): CP 2 alone in each mode, with TP 2, with PP 2 and 3,
#: with EP 2 (the EP group is the CP group: Megatron's expert grid folds CP into EP / EDP),
#: with EP 2 and DP 2 (dp_cp of 4 ranks), and CP 4.
CP_LAYOUTS = [(1, 1, 1, 2, 2, "p2p"), (1, 1, 1, 2, 2, "all_gather"), (1, 1, 1, 2, 2, "a2a"),
              (2, 1, 1, 2, 4, "p2p"), (1, 2, 1, 2, 4, "a2a"), (1, 3, 1, 2, 6, "all_gather"),
              (1, 1, 2, 2, 2, "p2p"), (1, 1, 2, 2, 4, "a2a"), (1, 1, 1, 4, 4, "p2p")]


def cp_args(tp, pp, ep, cp, world, mode) -> TrainingArgs:
    return layout_args(tp, pp, ep, world, context_parallel_size=cp, cp_comm_type=mode)


@pytest.mark.parametrize("tp,pp,ep,cp,world,mode", CP_LAYOUTS,
                         ids=[f"tp{t}-pp{p}-ep{e}-cp{c}-w{w}-{m}" for t, p, e, c, w, m in CP_LAYOUTS])
def test_context_parallel_trains_like_world_size_one(tp, pp, ep, cp, world, mode):
    """Chapter 9: ``--context-parallel-size C --cp-comm-type mode`` gives the world-size-1
    losses (``ATOL``).  Each CP rank holds chunks r and 2C-1-r of every row (Megatron-Core
    0.20.0, d98e8a64, ``megatron/core/utils.py`` ``get_batch_on_this_cp_rank``), its loss is
    the mean over its tokens and the dense gradients are averaged over ``dp_cp``
    (``distributed_data_parallel.py``: ``gradient_scaling_factor = 1 / dp_cp size``)."""
    args = cp_args(tp, pp, ep, cp, world, mode)
    validate_args(args)
    assert args.configs()[0].data_parallel_size == world // (tp * pp * cp)
    assert_same_losses(args)


CP_ZERO1 = layout_args(1, 1, 2, 4, context_parallel_size=2, use_distributed_optimizer=True)


def test_context_parallel_with_the_distributed_optimizer_trains_like_world_size_one():
    """ZeRO-1 under CP shards the dense gradients over ``dp_cp`` (DP 2 x CP 2 here), as
    Megatron-Core's distributed optimizer uses the data-parallel group with context
    parallelism (0.20.0, d98e8a64, ``distributed_data_parallel.py``: ``dp_cp_group``)."""
    assert_same_losses(CP_ZERO1)


DENSE = layout_args(2, 2, 1, 8, num_experts=0)


def test_a_dense_model_trains_like_world_size_one_too():
    assert_same_losses(DENSE)


#: ZeRO-2 (``--data-parallel-sharding-strategy optim_grads``) in the launches above: PP 3 x
#: EP 2 x DP 2 under 1F1B and under ZBV (chapter 11's W fills the gradients the hooks
#: reduce), EP 2 x CP 2 (dense units sharded over DP x CP = 4, experts over EDP 2), and TP 2
#: x PP 2 x DP 2 on the dense model (clipping over TP and DP); TP 2 x EP 2 x PP 3 with
#: sequence parallelism runs in the TP x EP sweep (``SP_RUNS``).
ZERO2 = dict(data_parallel_sharding_strategy="optim_grads")
ZERO2_RUNS = {"pp3-ep2-dp2": layout_args(1, 3, 2, 6, **ZERO2),
              "pp3-ep2-dp2-zbv": replace(schedule_args("zbv", "batched", 1, 3, 2, 6), **ZERO2),
              "ep2-cp2-dp2": layout_args(1, 1, 2, 4, context_parallel_size=2, **ZERO2),
              "tp2-pp2-dp2-dense": layout_args(2, 2, 1, 8, num_experts=0, **ZERO2)}


#: ZeRO-3 (``optim_grads_params``) in the same launches: PP 3 x EP 2 x DP 2 under 1F1B and
#: under the interleaved schedule (two chunks per rank, microbatches in flight: each layer
#: gathered and freed once per microbatch's forward and again per backward), EP 2 x CP 2,
#: and TP 2 x PP 2 x DP 2 on the dense model.
ZERO3 = dict(data_parallel_sharding_strategy="optim_grads_params")
ZERO3_RUNS = {"pp3-ep2-dp2": layout_args(1, 3, 2, 6, **ZERO3),
              "pp3-ep2-dp2-interleaved": replace(schedule_args("interleaved", "batched", 1, 3, 2, 6),
                                                 **ZERO3),
              "ep2-cp2-dp2": layout_args(1, 1, 2, 4, context_parallel_size=2, **ZERO3),
              "tp2-pp2-dp2-dense": layout_args(2, 2, 1, 8, num_experts=0, **ZERO3)}


@pytest.mark.parametrize("name", sorted(ZERO3_RUNS))
def test_zero3_trains_like_world_size_one(name):
    """ZeRO-3 in the 4D run gives the world-size-1 losses (plain Adam, ``ATOL``): the
    pipeline executor calls each layer module, whose hooks gather the unit before every
    microbatch's forward and, through the block's output, before its backward; the root
    is gathered by the hooks of the embedding, final LayerNorm and output layer.  Gathering
    copies values, so only the order of fp32 sums differs, as under ZeRO-2.  After each
    step every rank holds no whole weight (every unit freed) and the slices the memory
    model predicts, to the byte (:func:`records_of`), saved activations included: a
    gathered weight that autograd keeps is a parameter's storage, not an activation."""
    args = ZERO3_RUNS[name]
    validate_args(args)
    assert args.zero_stage == 3
    assert_same_losses(args)
    for rank in records_of(args):
        assert every(r["memory"]["weights"] == 0 for r in rank)


@pytest.mark.parametrize("name", sorted(ZERO2_RUNS))
def test_zero2_trains_like_world_size_one(name):
    """ZeRO-2 in the 4D run gives the world-size-1 losses (plain Adam, ``ATOL``): each
    unit's gradients reduce-scattered in every microbatch's backward and summed into its
    fp32 slice (FSDP2's default, torch 2.13.0 ``FSDPParamGroup.post_backward``), dense units
    over ``dp`` (``dp_cp`` under CP), a MoE layer's experts over ``expert_dp``.  Only the
    order of fp32 sums differs from the other strategies, so their tolerance holds.  Every
    rank's weights, gradients (its slices' only) and optimizer state equal the memory
    model's ZeRO-2 to the byte (:func:`records_of`)."""
    args = ZERO2_RUNS[name]
    validate_args(args)
    assert args.zero_stage == 2
    assert_same_losses(args)
    for rank in records_of(args):  # the whole gradients were freed: only fp32 slices remain
        assert every(r["memory"]["gradients"] * 3 == r["memory"]["optimizer"] for r in rank)


#: Megatron-FSDP's ``--data-parallel-sharding-strategy`` values beyond ``no_shard`` (the
#: sweep above): ZeRO-1, ZeRO-2 and ZeRO-3.
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
#: The sweep under every strategy runs on at most :data:`STRATEGY_WORLD` ranks by default
#: (9 layouts, 27 runs: about 30 s more on 2 cores, measured 2026-11-29); on 6 and 8 ranks
#: it is opt-in: those 36 runs add about 205 s to the 8-rank launch alone (28 s -> 233 s),
#: and the README command is over its time budget already.  ``TUTORIAL_EVERY_STRATEGY=1
#: python -m pytest tests/dist/test_pipeline_training.py`` runs all 63 (all passed at f59f286).
EVERY_STRATEGY = os.environ.get("TUTORIAL_EVERY_STRATEGY") == "1"
STRATEGY_WORLD = 4


def strategy_layouts() -> list:
    """The layouts the every-strategy sweep runs in this session (see :data:`STRATEGY_WORLD`)."""
    return [layout for layout in LAYOUTS if EVERY_STRATEGY or layout[-1] <= STRATEGY_WORLD]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tp,pp,ep,world", [
    pytest.param(*layout, marks=() if layout in strategy_layouts() else pytest.mark.skip(
        reason=f"opt-in on {layout[-1]} ranks (36 runs, minutes): set TUTORIAL_EVERY_STRATEGY=1"))
    for layout in LAYOUTS], ids=[f"tp{t}-pp{p}-ep{e}-w{w}" for t, p, e, w in LAYOUTS])
def test_every_layout_trains_like_world_size_one_under_every_strategy(tp, pp, ep, world, strategy):
    """Every layout of the sweep, sharded: the world-size-1 losses (plain Adam, ``ATOL``),
    and every rank's weights, gradients and optimizer state as the memory model predicts
    for the strategy, to the byte (:func:`records_of`).  On a layout with one data-parallel
    rank the strategies shard over a group of one and must still change nothing."""
    args = layout_args(tp, pp, ep, world, data_parallel_sharding_strategy=strategy)
    validate_args(args)
    assert_same_losses(args)


def every_run() -> list[TrainingArgs]:
    """Every run the equivalence tests above compare (those of a world size train in one
    launch: :func:`trained`), and the world-size-1 run of each, the TP x EP sweep's included."""
    runs = [layout_args(*layout) for layout in LAYOUTS]
    runs += [schedule_args(s, m, *layout) for s, m in SCHEDULE_MODES for layout in SCHEDULE_LAYOUTS]
    runs += [cp_args(*layout) for layout in CP_LAYOUTS] + [CP_ZERO1, DENSE]
    runs += list(ZERO2_RUNS.values()) + list(ZERO3_RUNS.values())
    runs += [layout_args(*layout, data_parallel_sharding_strategy=strategy)
             for layout in strategy_layouts() for strategy in STRATEGIES]
    sweep = [args for world in TP_EP_WORLDS for args in tp_ep_runs(world).values()]
    dropout = [dropout_args(*layout) for layout in DROPOUT_LAYOUTS]  # against the plain loop
    return runs + dropout + [world_one_args(args) for args in [BASE] + runs + sweep]


def test_the_record_holds_the_lm_loss_and_the_balance_terms_under_their_own_keys():
    """``train`` itself (its checks, its own launch): the records, and the losses the shared
    launch of the same run (:func:`trained`) gave, so the runs trained together train as
    one run alone does."""
    args = layout_args(1, 2, 2, 4)
    records = train(args).results[0]
    assert [r["loss"] for r in records] == losses_of(args)
    for step, record in enumerate(records):
        assert record["iteration"] == step + 1  # Megatron's count, from 1
        assert {"loss", "sequence_balance_loss", "max_violation", "grad_norm", "tokens_per_s"} <= set(record)
        assert 0 < record["sequence_balance_loss"] < 0.01 < record["loss"]  # alpha = 1e-4: tiny


@pytest.mark.parametrize("changes,rule", [
    (dict(world_size=6, pipeline_model_parallel_size=4), "rule 1"),
    (dict(world_size=4, tensor_model_parallel_size=4, hidden_size=18, num_attention_heads=2),
     "rule 5"),  # TP x EP: each expert's width 18 does not split over ETP = TP = 4
    (dict(world_size=2, pipeline_model_parallel_size=2, num_microbatches=5), "rule 3"),
    (dict(world_size=8, pipeline_model_parallel_size=2, expert_model_parallel_size=4, num_experts=6), "rule 4"),
    (dict(world_size=2, tensor_model_parallel_size=2, dropout=0.1), "rule 7"),
    (dict(world_size=4, pipeline_model_parallel_size=4, num_layers=6), "rule 9"),
    (dict(world_size=2, pipeline_model_parallel_size=2, schedule="interleaved", num_layers=6,
          p2p_mode="overlapped"), "rule 9"),
    (dict(world_size=2, pipeline_model_parallel_size=2, schedule="interleaved", p2p_mode="sequential"),
     "p2p mode"),
    (dict(world_size=3, pipeline_model_parallel_size=3, p2p_mode="sequential"), "p2p mode"),
    (dict(world_size=2, pipeline_model_parallel_size=2, schedule="interleaved", p2p_mode="batched"),
     "interleaved schedule"),  # Megatron-LM: interleaving without overlap needs PP > 2
    (dict(world_size=3, pipeline_model_parallel_size=3, schedule="interleaved", p2p_mode="overlapped",
          num_microbatches=4), "interleaved schedule"),  # M not a multiple of PP
])
def test_invalid_grids_are_refused_with_the_rule(changes, rule):
    with pytest.raises(ConfigError) as error:
        validate_args(replace(BASE, **changes))
    assert error.value.rule == rule, str(error.value)


# --- TP and EP together on Megatron's folded grids, ETP 1 and ETP = TP --------------
#
# Megatron-Core 0.20.0 (d98e8a64) runs TP > 1 with EP > 1: the dense layers use the
# tp-cp-dp-pp grid and the experts the etp-ep-edp-pp grid over the same ranks
# (megatron/core/parallel_state.py, initialize_model_parallel: two RankGenerators, each of
# whose products must divide the world).  The MoE layer gets each TP rank's own
# sequence-parallel tokens; MoEAlltoAllTokenDispatcher (megatron/core/transformer/moe/
# token_dispatcher.py) runs its all-to-all over the expert grid's EP group, then, with
# ETP > 1, all-gathers the received rows over the expert-TP group (dispatch_postprocess:
# gather_from_sequence_parallel_region with output_split_sizes) and reduce-scatters the
# experts' partial outputs over it before the combine all-to-all (combine_preprocess:
# reduce_scatter_to_sequence_parallel_region with input_split_sizes); each expert's fc1 is
# column-parallel and fc2 row-parallel over that group (experts.py, TEGroupedMLP /
# SequentialMLP with pg_collection.expt_tp).  The course's old rule 2 refused every run
# below, and its rule 5 every ETP > 1.


def tp_ep_layouts(max_world: int = 8):
    """(TP, PP, EP, ETP, world): every layout of at most ``max_world`` ranks with TP > 1 and
    EP > 1, ETP 1 or TP, that ``validate_args`` accepts with BASE's model (PP 1 to 4)."""
    for pp, tp, ep in itertools.product((1, 2, 3, 4), (2, 4), (2, 4)):
        for etp in (1, tp):
            for world in range(tp * pp, max_world + 1, tp * pp):
                try:
                    validate_args(layout_args(tp, pp, ep, world, expert_tensor_parallel_size=etp))
                except ConfigError:
                    continue
                yield tp, pp, ep, etp, world


TP_EP_LAYOUTS = list(tp_ep_layouts())
TP_EP_WORLDS = sorted({layout[-1] for layout in TP_EP_LAYOUTS})
#: Every schedule, at one TP x EP x PP layout (TP 2 x EP 2 x ETP 2 x PP 2 on 8 ranks; 1F1B is
#: the sweep's own): interleaving at PP 2 needs Megatron's overlapped P2P (see
#: test_invalid_grids...); chapter 11's split-backward schedules run M = 4 microbatches
#: (DualPipe's M >= 2 PP, even) and are checked on their losses only (their executor holds
#: the chunks differently from the gradient helper below; test_pipeline_zero_bubble.py).
TP_EP_SCHEDULES = [("gpipe", "batched"), ("interleaved", "overlapped"), ("zb-h1", "batched"),
                   ("zbv", "batched"), ("dualpipev", "batched"), ("dualpipe", "batched")]
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev", "dualpipe")
TP_EP_SCHEDULE_LAYOUT = (2, 2, 2, 2, 8)
#: Which parameters the gradient check compares: router, shared experts, routed experts,
#: and the LayerNorms (whole on every rank; under sequence parallelism each TP rank's
#: gradient is a partial sum until allreduce_sequence_parallel_grads).
GRAD_PARTS = ("mlp.router.", "mlp.shared_experts.", "mlp.experts.", "layernorm.")


def _tp_ep_args(tp, pp, ep, etp, world, schedule="1f1b", mode="batched", **changes) -> TrainingArgs:
    """BASE's model cut to 4 layers (6 at PP 3) to keep the sweep cheap; no clipping, so
    that one step's gradients are the serial ones as they are."""
    return layout_args(tp, pp, ep, world, expert_tensor_parallel_size=etp, schedule=schedule,
                       p2p_mode=mode, clip_grad=0.0, num_layers=6 if pp == 3 else 4,
                       num_microbatches=4 if schedule in SPLIT_BACKWARD else 2, **changes)


#: Sequence parallelism through the whole model (Megatron's --sequence-parallel), run in
#: the sweep's launches: TP 2 x EP 2 x PP 3 beside the same layout without it, and with
#: CP 2 and PP 2 (TP 2 x CP 2 x PP 2 x EP 2 on 8 ranks: messages of s / (CP TP) tokens,
#: labels of s / CP).  Name suffix -> (layout, changes).
SP_RUNS = {"sp": ((2, 3, 2, 1, 6), dict(sequence_parallel=True)),
           "sp-cp2": ((2, 2, 2, 1, 8), dict(sequence_parallel=True, context_parallel_size=2)),
           "sp-zero2": ((2, 3, 2, 1, 6), dict(sequence_parallel=True,
                                              data_parallel_sharding_strategy="optim_grads"))}


def _wants_gradients(args: TrainingArgs) -> bool:
    """The gradient check's helper runs train_4d's step without CP (its aux-loss scale and
    dp group are CP-free), with one backward per microbatch and DataParallel's whole
    gradients (not ZeRO-2's slices)."""
    return (args.schedule not in SPLIT_BACKWARD and args.context_parallel_size == 1
            and args.zero_stage < 2)


def _tp_ep_gradients(ctx, args: TrainingArgs) -> dict:
    """One step's synced gradients of every MoE parameter this rank holds, as train_4d makes
    them (its chunks, microbatches, schedule, DataParallel and finish_step; SGD at lr 0), with
    what is needed to cut the serial gradient to this rank's piece."""
    from tutorial_lib import parallel_state
    from tutorial_lib.tp_dp_step import finish_step
    chunks, modules, model, _ = pipeline_backward(args)
    finish_step(model, torch.optim.SGD(modules.parameters(), lr=0.0), None)
    grads = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if any(part in name for part in GRAD_PARTS):
                grads[name] = (p.grad.clone(), getattr(p, "partition_dim", None))
    first = {index: layer.experts.first_expert for chunk in chunks
             for index, layer in chunk.moe_layers().items()}
    groups = {kind: parallel_state.get_group_ranks(kind)
              for kind in ("tp", "dp", "ep", "expert_tp", "expert_dp")}
    return {"grads": grads, "first_expert": first, "groups": groups,
            "etp_rank": parallel_state.group_rank("expert_tp")}


def _tp_ep_sweep(ctx, runs):
    """Every run of ``runs`` (name -> args) on these ranks, one after the other in one launch:
    the losses of train_4d's steps (BASE's 2) and, for PP = 1 and the schedule runs, the gradients."""
    from tutorial_lib.train_4d import train_worker
    out = {}
    for name, args in runs.items():
        ctx.tracer.enabled = False  # only the gradient step is traced: cheaper
        records = train_worker(ctx, args)
        ctx.tracer.enabled = True
        with ctx.tracer.tags(layout=name):
            out[name] = {"losses": [r["loss"] for r in records], "records": records, "grads": _tp_ep_gradients(ctx, args)
                         if _wants_gradients(args) else None}
    return out


def _name(tp, pp, ep, etp, world, schedule="1f1b", mode="batched"):
    return f"tp{tp}-pp{pp}-ep{ep}-etp{etp}-w{world}-{schedule}-{mode}"


def tp_ep_runs(world: int) -> dict[str, TrainingArgs]:
    """Every TP x EP layout of this world size (and, on 8 ranks, the schedule runs), by name."""
    runs = {_name(*layout): _tp_ep_args(*layout) for layout in TP_EP_LAYOUTS if layout[-1] == world}
    if world == TP_EP_SCHEDULE_LAYOUT[-1]:
        runs.update({_name(*TP_EP_SCHEDULE_LAYOUT, s, m): _tp_ep_args(*TP_EP_SCHEDULE_LAYOUT, s, m)
                     for s, m in TP_EP_SCHEDULES})
    runs.update({f"{_name(*layout)}-{suffix}": _tp_ep_args(*layout, **changes)
                 for suffix, (layout, changes) in SP_RUNS.items() if layout[-1] == world})
    return runs


@launch_once
def tp_ep_sweep(world: int):
    """One launch per world size running every run of :func:`tp_ep_runs`."""
    from tutorial_lib.launch import launch
    runs = tp_ep_runs(world)
    return runs, launch(_tp_ep_sweep, world, args=(runs,), timeout=300, trace=True)


def test_the_tp_ep_sweep_holds_every_tp_ep_layout_the_rules_accept_up_to_8_ranks():
    """The rules (validate_args) accept these TP x EP layouts of at most 8 ranks: with and
    without PP, ETP 1 and ETP = TP, EP groups inside and across TP groups."""
    names = set(map(tuple, TP_EP_LAYOUTS))
    assert {(2, 1, 2, 1, 4), (2, 1, 2, 2, 4), (2, 1, 4, 1, 8), (2, 1, 4, 2, 8), (4, 1, 2, 4, 8),
            (2, 2, 2, 1, 8), (2, 2, 2, 2, 8), (2, 3, 2, 1, 6), (2, 4, 2, 1, 8)} <= names
    assert every(tp > 1 and ep > 1 and etp in (1, tp) for tp, _, ep, etp, _ in TP_EP_LAYOUTS)
    assert (2, 1, 2, 2, 6) not in names  # ETP 2 x EP 2 = 4 does not divide 6 ranks (rule 1)
    assert TP_EP_SCHEDULE_LAYOUT in names


@pytest.mark.parametrize("world", TP_EP_WORLDS)
def test_tp_and_ep_together_train_like_world_size_one(world):
    """TP and EP together: every TP x EP layout of this world size (ETP 1 and ETP = TP, with and without
    PP; on 8 ranks also every other schedule at TP 2 x EP 2 x ETP 2 x PP 2) gives the
    world-size-1 losses over BASE's 2 steps (``ATOL``, the tolerance of every other layout here).
    Megatron-Core 0.20.0, d98e8a64: parallel_state.py ``initialize_model_parallel`` (folded
    grids), token_dispatcher.py ``MoEAlltoAllTokenDispatcher`` (``dispatch_postprocess`` /
    ``combine_preprocess``: the expert-TP all-gather and reduce-scatter), experts.py
    ``TEGroupedMLP`` (fc1 column-, fc2 row-parallel over the expert-TP group)."""
    runs, result = tp_ep_sweep(world)
    for name, args in runs.items():
        expected = world_one_losses(args)
        got = result.results[0][name]["losses"]
        assert every(r[name]["losses"] == got for r in result.results)
        worst = max(abs(a - b) for a, b in zip(got, expected))
        assert len(got) == args.steps and worst < ATOL, (name, got, expected, worst)


@pytest.mark.parametrize("world", TP_EP_WORLDS)
def test_tp_and_ep_together_give_the_serial_router_shared_and_expert_gradients(world):
    """TP and EP together: in every run of the sweep the router, shared-expert and routed-expert
    gradients after train_4d's sync equal the serial model's on the whole batch (fp32,
    ``atol = 1e-6``, ``rtol = 1e-5``); each rank's expert gradient is its slice of the serial
    stack (its EP rank's experts, and with ETP > 1 its ETP rank's channels), each shared
    expert's its TP rank's channels (Megatron-Core's ``SharedExpertMLP``, an ``MLP`` split
    over TP).  The router sees each TP rank's own tokens and is summed over TP after the DP
    average, and so are the LayerNorms under sequence parallelism (``finalize_model_grads``'
    ``sequence_parallel`` branch in ``megatron/core/distributed/finalize_model_grads.py``);
    each expert's gradient is summed over expert-DP and divided by DP x CP, Megatron-Core
    0.20.0's ``expert_gradient_scaling_factor`` (d98e8a64, megatron/core/distributed/
    distributed_data_parallel.py), whatever ETP is.  The trace shows each dispatch all-to-all
    on the expert grid's EP group carrying this rank's own s/TP tokens' K copies, and with
    ETP > 1 a gather of the rows over the expert-TP group (token_dispatcher.py,
    ``MoEAlltoAllTokenDispatcher.dispatch_postprocess``)."""
    runs, result = tp_ep_sweep(world)
    for name, args in runs.items():
        if not _wants_gradients(args):
            continue
        serial = _serial_gradients(args)
        tp, etp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size
        for rank, res in enumerate(result.results):
            mine = res[name]["grads"]
            if not mine["first_expert"]:  # a pipeline stage of dense layers only
                continue
            parts = {part for part in GRAD_PARTS if any(part in n for n in mine["grads"])}
            assert {"mlp.experts.", "mlp.router.", "layernorm."} <= parts, (name, rank)
            for param, (grad, dim) in mine["grads"].items():
                want = serial[param]
                if ".mlp.experts." in param:  # my EP rank's experts (and ETP rank's channels)
                    first = mine["first_expert"][int(param.split(".")[1])]
                    want = want[first:first + grad.shape[0]]
                    if etp > 1:
                        width = grad.shape[dim]
                        want = want.narrow(dim, mine["etp_rank"] * width, width)
                elif ".mlp.shared_experts." in param and tp > 1:  # my TP rank's channels
                    width = grad.shape[dim]
                    tp_rank = mine["groups"]["tp"].index(rank)
                    want = want.narrow(dim, tp_rank * width, width)
                torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{name} rank {rank} {param}: {m}")
            groups = mine["groups"]
            assert len(groups["expert_tp"]) == etp
            events = [e for e in result.trace.filter(rank=rank, layout=name)
                      if e.tags.get("phase") == "forward" and e.tags.get("payload") != "counts"]
            dispatch = [e for e in events if e.op == "all_to_all" and e.tags.get("op_name") == "dispatch"]
            rows = args.global_batch_size // len(groups["dp"]) // args.num_microbatches
            assert dispatch and all(e.group_kind == "ep" and list(e.group_ranks) == groups["ep"]
                                    for e in dispatch)
            sent = {sum(e.splits["input"]) for e in dispatch}
            assert sent == {args.seq_length // tp * rows * args.moe_router_topk}, (name, sent)
            gathers = [e for e in events if e.op == "all_gather" and e.group_kind == "expert_tp"]
            assert len(gathers) == (len(dispatch) if etp > 1 else 0), (name, len(gathers))


def _tp_collectives(trace, rank: int, layout: str, layer: int) -> dict:
    """Sorted ``(op, op_name)`` of one layer's forward TP collectives in the first
    microbatch of the traced gradient step (the aux losses' sums over TP, untagged by
    phase, left out: the same in both runs; backward events carry no layer number)."""
    return sorted((e.op, e.tags.get("op_name"))
                  for e in trace.filter(rank=rank, layout=layout, comm_only=True)
                  if e.group_kind == "tp" and e.tags.get("layer_number") == layer
                  and e.tags.get("microbatch") == 0 and e.tags.get("phase") == "forward")


def test_sequence_parallelism_swaps_each_moe_layers_all_reduce_for_a_reduce_scatter():
    """With sequence parallelism through the whole model (TP 2 x EP 2 x PP 3, the sweep's
    run beside the same layout without it) each MoE layer's forward pays a reduce-scatter
    (the attention's row-parallel output) and an all-gather (before the column-parallel
    qkv) where the model that keeps the whole sequence pays an all-reduce (the attention's
    output) and an all-gather (the MoE layer's own gather of its s/TP result); the shared
    experts' all-gather and reduce-scatter are the same in both.  Megatron-Core d98e8a64:
    ``RowParallelLinear.forward`` reduce-scatters under ``sequence_parallel``, the MoE
    layer takes the sharded hidden states (``MoELayer.forward``, which raises while
    training with TP > 1 and no sequence parallelism), ``ColumnParallelLinear`` gathers
    (``megatron/core/tensor_parallel/layers.py``).  The pipeline's messages are then
    ``[s/TP, b, h]`` (``schedules.py``, ``get_tensor_shapes``), and the labels keep ``s``."""
    layout, _ = SP_RUNS["sp"]
    runs, result = tp_ep_sweep(layout[-1])
    plain, sp = _name(*layout), f"{_name(*layout)}-sp"
    args = runs[sp]
    row_parallel = "reduce_from_tensor_model_parallel_region"
    gather, scatter = "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region"
    column = "linear_with_sequence_parallel_all_gather"
    for rank, res in enumerate(result.results):
        for layer in res[sp]["grads"]["first_expert"]:  # this rank's MoE layers
            before, after = (_tp_collectives(result.trace, rank, name, layer) for name in (plain, sp))
            shared = [("all_gather", gather), ("reduce_scatter", scatter)]
            assert before == sorted(shared + [("all_reduce", row_parallel),
                                                         ("all_gather", gather)]), (rank, before)
            assert after == sorted(shared + [("reduce_scatter", scatter),
                                                        ("all_gather", column)]), (rank, after)
        rows = args.global_batch_size // len(res[sp]["grads"]["groups"]["dp"]) // args.num_microbatches
        for name, tokens in ((plain, args.seq_length), (sp, args.seq_length // 2)):
            moved = {e.bytes for e in result.trace.filter(rank=rank, layout=name, comm_only=True)
                     if e.group_kind == "pp" and e.tags.get("p2p_op") not in ("send_labels", "recv_labels")}
            assert moved == {tokens * rows * args.hidden_size * 4}, (name, rank, moved)


@pytest.mark.parametrize("suffix", sorted(SP_RUNS))
def test_sequence_parallel_runs_keep_the_memory_the_model_predicts(suffix):
    """Every rank of the sweep's sequence-parallel runs holds the weights, gradients,
    optimizer state and saved activations ``costs.memory_model`` predicts (the LayerNorms
    on ``s/TP`` tokens; the embedding's scattered output cloned, as Megatron-Core's
    ``clone_scatter_output_in_embedding`` defaults to, so no whole ``[s, b, h]`` stays alive)."""
    layout, _ = SP_RUNS[suffix]
    runs, result = tp_ep_sweep(layout[-1])
    name = f"{_name(*layout)}-{suffix}"
    assert_memory_as_predicted(runs[name], [res[name]["records"] for res in result.results])


_SERIAL_GRADIENTS: dict = {}


def _serial_gradients(args: TrainingArgs) -> dict:
    """The whole model on the whole batch of step 0, one backward, no groups (once per model)."""
    _, model_config, _ = args.configs()
    key = (astuple(model_config), args.seed, args.global_batch_size)
    if key not in _SERIAL_GRADIENTS:
        model = DeepSeekModel(model_config, seed=args.seed)
        input_ids, labels = synthetic_batch(args.seed, 0, args.global_batch_size, args.seq_length,
                                            args.vocab_size)
        model(input_ids, labels, sample_ids=torch.arange(args.global_batch_size), step=0).backward()
        _SERIAL_GRADIENTS[key] = {name: p.grad for name, p in model.named_parameters()}
    return _SERIAL_GRADIENTS[key]


# --- the command line -----------------------------------------------------------------------

SMALL = ["--steps", "3", "--num-layers", "4", "--global-batch-size", "8", "--num-microbatches", "2",
         "--seq-length", "8", "--hidden-size", "16", "--vocab-size", "32"]


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _run(cmd, timeout=240, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_train_4d_refuses_an_invalid_grid_before_starting_workers():
    started = time.time()
    done = _run([sys.executable, str(TRAIN_4D), "--world-size", "6", "--pipeline-model-parallel-size", "4"])
    assert done.returncode == 2
    assert "[rule 1]" in done.stderr and "world_size (6)" in done.stderr
    assert "rank" not in done.stdout  # no worker said anything
    assert time.time() - started < 30


def test_train_4d_help_prints_each_default_once():
    done = _run([sys.executable, str(TRAIN_4D), "--help"], timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "default: None" not in done.stdout
    assert " ".join(done.stdout.split()).count("(default: ") == len(fields(TrainingArgs))
    assert "--tensor-model-parallel-size N" in done.stdout and "--num-layers N" in done.stdout


TORCHRUN_LAYOUT = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--json", *SMALL]


@launch_once
def launcher_run() -> subprocess.CompletedProcess:
    """``train_4d.py --world-size 4`` on PP 2 x EP 2 with ``--json`` (:data:`TORCHRUN_LAYOUT`),
    run once: the JSON test reads its lines and banner, the torchrun test its losses."""
    return _run([sys.executable, str(TRAIN_4D), "--world-size", "4", *TORCHRUN_LAYOUT])


def test_train_4d_json_and_progress_lines():
    """Found reading the book: the text said "step 1/5" where --json said "step": 0, and a run named
    neither its layout, schedule, P2P mode nor recipe.  Both now count iterations from 1,
    as Megatron-LM's training log does (NVIDIA/Megatron-LM, megatron/training/training.py,
    ``training_log``: "iteration {iteration}/{train_iters}", the counter incremented after
    each step, Megatron-Core 0.20.0, d98e8a64); the banner goes to stdout, or to stderr
    under --json so that every line of stdout stays one JSON object."""
    as_json = launcher_run()
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    assert every(line.startswith("{") for line in as_json.stdout.splitlines())  # JSON only
    records = _records(as_json.stdout)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    banner = as_json.stderr
    assert "layout      TP1 x PP2 x EP2 x DP2 = 4 ranks" in banner
    assert "P2P mode    batched" in banner and "recipe      fp32" in banner
    assert "schedule    1f1b" in banner
    serial = _run([sys.executable, str(TRAIN_4D), "--world-size", "1", "--json", *SMALL])
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(records, _records(serial.stdout))) < ATOL
    progress = _run([sys.executable, str(TRAIN_4D), "--world-size", "2", "--pipeline-model-parallel-size",
                     "2", *SMALL])
    assert progress.returncode == 0, progress.stderr[-3000:]
    text = progress.stdout
    assert text.index("train_4d: layout      TP1 x PP2") < text.index("iteration 1/3")
    assert "MaxVio      (load of the busiest expert" in text  # the legend of the line
    numbers = [int(n) for n in re.findall(r"iteration (\d+)/3  loss", text)]
    assert numbers == [r["iteration"] for r in records]  # the same numbers as --json


def test_train_4d_reads_a_config_file(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"world-size": 2, "pipeline_model_parallel_size": 2, "steps": 2,
                                  "num-layers": 4, "global_batch_size": 8, "num_microbatches": 2}))
    done = _run([sys.executable, str(TRAIN_4D), "--config", str(config), "--json", "--steps", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_records(done.stdout)) == 1  # the flag beat the file


def _torchrun():
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_4d_under_torchrun_one_node_and_two_nodes_gives_the_launchers_losses():
    launcher = launcher_run()  # the same command line the JSON test reads
    assert launcher.returncode == 0, launcher.stderr[-3000:]
    expected = _records(launcher.stdout)

    one_node = _run(_torchrun() + ["--standalone", "--nproc-per-node", "4", str(TRAIN_4D), *TORCHRUN_LAYOUT])
    assert one_node.returncode == 0, one_node.stderr[-3000:]

    port = _free_port()
    nodes = [subprocess.Popen(_torchrun() + ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                                             "--master-addr", "127.0.0.1", "--master-port", str(port),
                                             str(TRAIN_4D), *TORCHRUN_LAYOUT],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert every(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    # global rank 0 lives on node 0, and only rank 0 prints
    two_nodes, silent = _records(outputs[0][0]), _records(outputs[1][0])
    assert silent == []
    for got in (_records(one_node.stdout), two_nodes):
        assert [r["iteration"] for r in got] == [1, 2, 3]
        # torchrun sets OMP_NUM_THREADS=1, the launcher shares the cores: sums may round differently
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, expected)) < ATOL
