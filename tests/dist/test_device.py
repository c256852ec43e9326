"""Nothing the course runs relies on torch's default device (the device rule), proven on the CPU.

Every chapter's worker functions (read from the notebooks themselves,
:mod:`tests.dist.notebook_code`, with smaller sizes where a chapter's are large), the
library's timing workers the chapters start, and ``train_4d`` steps (on 8 ranks TP2 x PP2
x DP2, PP2 x EP2 x DP4 and a dense DP 8; on 4 CP2 x TP2 under the ``deepseek_v3`` FP8
recipe, and PP2 x EP2 x DP2 under ZeRO-1 with a DCP save and a resume) run twice in the
same gloo worker: once as usual, once with torch's default device set to ``meta`` while
the code is still told ``device="cpu"``.  A tensor made without an explicit device
(``torch.zeros(n)``) lands on ``meta`` in the second run, and that run fails (a meta
tensor has no values: ``.item()``, a collective or a mix with a CPU tensor raises) or
returns something else.  The results of the two runs must be equal.  This is how a GPU
run is known to keep every tensor on the rank's GPU without a GPU: ``ctx.device`` would
be ``cuda:r`` there, and the default device the CPU.

The 2-rank launch turns ``meta`` on with the launcher's own switch
(``TUTORIAL_LIB_DEFAULT_DEVICE``, :data:`tutorial_lib.launch.STRICT_DEVICE_VARIABLE`), so
the switch is tested too; the others set it in the worker.  Not run here: the chapters'
deadlock demonstrations (they only hang), their exercises (the reader's code, checked on
the CPU) and the cells that run the train_4d command line (the steps below run its worker).
"""
import sys

import cloudpickle
import pytest
import torch

from tutorial_lib import launch as launch_module
from tutorial_lib.chapters import CHAPTERS
from tutorial_lib.launch import launch
from tutorial_lib.train_4d import TrainingArgs, train_worker, validate_args

from .notebook_code import chapter_namespace
from .worker_checks import check as _check

pytestmark = pytest.mark.dist
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMING_KEYS = ("step_time_s", "tokens_per_s")


# --- in the worker ---------------------------------------------------------------------


def _same(a, b) -> bool:
    """Equal values, recursively; tensors bit for bit (and on the same device)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        try:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return False
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # both NaN
    return a == b


def _run(ctx, fn, args, keep):
    from tutorial_lib import parallel_state
    parallel_state.destroy_model_parallel()
    torch.manual_seed(1234)  # the same global RNG state in both runs
    result = fn(ctx, *args)
    parallel_state.destroy_model_parallel()
    return keep(result) if keep is not None else result


def run_strict_and_plain(ctx, jobs, strict="meta"):
    """Each job ``(label, fn, args, keep)`` twice: with the CPU, then ``strict``, as torch's
    default device (``ctx.device`` is ``cpu`` both times); ``keep`` reduces a result to
    what must be equal (timings removed).  Returns ``{label: (plain, strict) or error}``."""
    import torch.distributed as dist
    strict = str(torch.get_default_device()) if strict is None else strict
    _check(ctx.device == "cpu", f"the test runs on the CPU, got {ctx.device}")
    out = {}
    for label, fn, args, keep in jobs:
        torch.set_default_device("cpu")
        plain = _run(ctx, fn, args, keep)
        torch.set_default_device(strict)
        try:
            _check(torch.empty(1).device.type == strict, "the strict default is not set")
            out[label] = (plain, _run(ctx, fn, args, keep))
        except BaseException as error:  # noqa: BLE001 - DCP raises a BaseException
            if isinstance(error, KeyboardInterrupt):
                raise
            out[label] = f"{type(error).__name__}: {error}"[:2000]
        finally:
            torch.set_default_device("cpu")
        dist.barrier()
    return out


# --- what runs -------------------------------------------------------------------------


def _no_timings(result):
    """A timing worker's result minus its numbers: only the run itself is compared."""
    return None


CONTROL = "control: a tensor made without a device"


def _relies_on_the_default_device(ctx):
    """The bug the strict run is for (the control that shows the check can fail)."""
    from tutorial_lib import comm
    return comm.all_reduce(torch.ones(3)).tolist()


def _train_records(records):
    """The records but their timings, and the memory record but the CUDA allocator's peak
    (only a GPU run has one)."""
    out = []
    for record in records:
        record = {k: v for k, v in record.items() if k not in TIMING_KEYS}
        if "memory" in record:
            record["memory"] = {k: v for k, v in record["memory"].items()
                                if k != "cuda_max_memory_allocated"}
        out.append(record)
    return out


def _chapters() -> dict[str, dict]:
    """The definitions of every chapter that launches ranks (``tutorial_lib.chapters``: its
    ``device_runs``), by its two-digit number.  Chapters 10 and 13 launch none, and reading
    theirs took three quarters of the time (23 of 31 s here)."""
    return {entry.key: chapter_namespace(entry.path, f"chapter_{entry.key}_under_test")
            for entry in CHAPTERS if entry.device_runs}


def _save_then_resume(ctx, args, root):
    """Chapter 6's checkpoint cells in one job: train and save (DCP), then load the
    checkpoint and train one step more; a directory per default device."""
    import os
    from dataclasses import replace

    import torch.distributed.checkpoint as dcp
    where = os.path.join(root, torch.get_default_device().type)
    # torch's own DCP planner makes tensors on the default device (as it may: on a GPU
    # run the default is the CPU), so dcp.save / dcp.load run with the CPU as default;
    # the library's code around them, state dicts and DTensors included, stays strict
    calls = dcp.save, dcp.load
    dcp.save, dcp.load = (_with_cpu_default(call) for call in calls)
    try:
        first = train_worker(ctx, replace(args, save=where))
        resumed = train_worker(ctx, replace(args, load=where, steps=args.steps + 1))
    finally:
        dcp.save, dcp.load = calls
    return _train_records(first) + _train_records(resumed)


def _with_cpu_default(call):
    def on_the_cpu(*args, **kwargs):
        with torch.device("cpu"):
            return call(*args, **kwargs)
    return on_the_cpu


TRAIN_LAYOUTS = {
    "train_4d TP2 x PP2 x DP2": dict(tensor_model_parallel_size=2,
                                     pipeline_model_parallel_size=2),
    "train_4d PP2 x EP2 x DP4": dict(pipeline_model_parallel_size=2,
                                     expert_model_parallel_size=2),
    "train_4d dense DP8": dict(num_experts=0),
}
TRAIN_EXTRAS = {  # what chapters 6, 8 and 9 add to a run, on 4 ranks (see jobs_by_world)
    "train_4d CP2 x TP2, deepseek_v3 recipe": dict(
        context_parallel_size=2, tensor_model_parallel_size=2,
        precision_recipe="deepseek_v3"),
    "train_4d PP2 x EP2 x DP2, ZeRO-1, save then resume": dict(
        pipeline_model_parallel_size=2, expert_model_parallel_size=2,
        use_distributed_optimizer=True),
}
EXTRAS_WORLD = 4
"""The extras' world size.  On 8 ranks these two took 45 of the 8-rank launch's 58 s (a
gloo collective costs about 25 ms on 8 ranks sharing 2 cores, 6 ms on 4): the recipe's code
and DCP's save and load run the same on 4, and the data-parallel gradient sync they would
add is the layouts' above, whatever the recipe."""
TRAIN_BASE = dict(world_size=8, steps=1, num_layers=4, global_batch_size=16,
                  num_microbatches=2, seq_length=8, hidden_size=16,
                  num_attention_heads=4, vocab_size=32, num_experts=4,
                  moe_router_topk=2)


def jobs_by_world(ch, checkpoints: str | None = None) -> dict[int, list]:
    """``{world size: [(label, fn, args, keep)]}``: every chapter's launched functions
    (``checkpoints``: a directory for the save-then-resume run, left out without one)."""
    from tutorial_lib.pipeline_parallel import synthetic
    from tutorial_lib.timing import alpha_beta, cp_attention, fp8_all_to_all, p2p_modes

    # smaller than the chapters' own sizes, the same code
    ch["05"].update(STEPS=2)
    ch["09"].update(S=64, BLOCK=ch["09"]["BLOCK"].__class__(
        hidden_size=ch["09"]["H"], num_attention_heads=4, seq_length=64, num_experts=0))
    two = [("02 tp_mlp", ch["02"]["tp_mlp"], (), None),
           ("02 matched_pair", ch["02"]["matched_pair"], (), None),
           ("03 column_parallel_demo", ch["03"]["column_parallel_demo"], (), None),
           ("03 row_parallel_demo", ch["03"]["row_parallel_demo"], (), None),
           ("03 block_demo", ch["03"]["block_demo"], (), None),
           ("03 block_demo SP", ch["03"]["block_demo"], (True,), None),
           ("03 loss_demo", ch["03"]["loss_demo"], (), None),
           ("05 split_over_tp", ch["05"]["split_over_tp"], (ch["05"]["tp_tokens"],), None),
           ("07 round_with_the_guides_peer", ch["07"]["round_with_the_guides_peer"],
            (False,), None),
           ("12 all_stages", ch["12"]["all_stages"], (), None),
           ("02 measure_alpha_beta's worker", alpha_beta._measure_worker,
            (alpha_beta.ALPHA_BETA_OPS, {op: [64, 4096] for op in alpha_beta.ALPHA_BETA_OPS},
             1, 0), _no_timings)]
    w = ch["02"]["WORLD"]
    _check(w == 4, f"chapter 2 runs its demos on 4 ranks, got {w}")
    four = [(f"02 {name}", ch["02"][name], (), None)
            for name in ("all_reduce_demo", "reduce_scatter_demo", "all_gather_demo",
                         "broadcast_demo", "moe_dispatch_demo", "pipeline_demo",
                         "ring_demo")]
    four += [("03 tp_dp_mlp_demo", ch["03"]["tp_dp_mlp_demo"], (), None),
             ("12 tp_or_zero3, TP 4", ch["12"]["tp_or_zero3"], (4,), None),
             ("03 step_demo", ch["03"]["step_demo"], (), None),
             ("04 dispatch_demo", ch["04"]["dispatch_demo"], (), None),
             ("04 dedup_demo", ch["04"]["dedup_demo"], (), None),
             ("04 sequence_parallel_demo", ch["04"]["sequence_parallel_demo"],
              (ch["04"]["SP_CONFIGS"],), None),
             ("04 one_step", ch["04"]["one_step"], (), None),
             ("05 train", ch["05"]["train"], ({k: v for k, v in ch["05"]["RUNS"].items()},),
              None),
             ("06 measure_synthetic_schedules", synthetic.measure_synthetic_schedules,
              ([("1f1b", 4, 1), ("interleaved", 8, 2)], 0.001, 0.002, 1), _no_timings),
             ("07 one_round_per_mode", ch["07"]["one_round_per_mode"], (64,), None),
             ("11 measure_synthetic_schedules", synthetic.measure_synthetic_schedules,
              ([("zb-h1", 4, 1), ("zbv", 4, 1), ("dualpipe", 8, 1)], 0.001, 0.002, 1),
              _no_timings),
             ("11 measure_synthetic_schedules, PP2 x EP2", synthetic.measure_synthetic_schedules,
              ([("dualpipe", 4, 1)], 0.001, 0.002, 1, None, None, 2), _no_timings),
             ("07 measure_p2p_modes' worker", p2p_modes._timing_worker,
              (("sequential", "overlapped", "batched"), (64, 1024), 1, 0), None),
             ("08 moe_in_every_precision", ch["08"]["moe_in_every_precision"], (), None),
             ("08 time_all_to_all's worker", fp8_all_to_all._timing_worker, ((128,), 8, 1),
              _no_timings),
             ("09 kept_per_rank", ch["09"]["kept_per_rank"], (), None),
             ("09 measure_ring_work's worker", cp_attention._ring_work_worker,
              (1, 2, 64, 8), _no_timings),
             ("09 measure_cp_modes' worker", cp_attention._modes_worker,
              (4, 1, 4, 64, 8, 1, True), _no_timings)]
    eight = [("01 live_groups " + layout, ch["01"]["live_groups"],
              (ch["01"]["live_config"], layout), None)
             for layout in ("megatron", "course")]
    eight += [("04 read_domains", ch["04"]["read_domains"], (ch["04"]["DOMAIN_CONFIGS"],),
               None),
              ("04 gradient_demo", ch["04"]["gradient_demo"], (ch["04"]["GRAD_CONFIGS"],),
               None)]
    eight += [("06 live_groups " + name, ch["06"]["live_groups"], (config,), None)
              for name, config in ch["06"]["LAYOUTS"].items()]
    for label, layout in TRAIN_LAYOUTS.items():
        args = TrainingArgs(**{**TRAIN_BASE, **layout})
        validate_args(args)  # what train() checks before it launches
        eight.append((label, train_worker, (args,), _train_records))
    for label, extra in TRAIN_EXTRAS.items():
        args = TrainingArgs(**{**TRAIN_BASE, **extra, "world_size": EXTRAS_WORLD})
        validate_args(args)
        if "save" not in label:
            four.append((label, train_worker, (args,), _train_records))
        elif checkpoints is not None:
            four.append((label, _save_then_resume, (args, checkpoints), None))
    return {2: two, 4: four, 8: eight}


LAUNCH_TIMEOUT = {2: 300, 4: 450, 8: 900}
"""Seconds after every rank joined: a guard against a hang, never a measure of speed.  Each
launch runs every job of its world size twice; the 8-rank one took 119 s at load 17 and
went past the former 180 s beside a second test run (a deadlock still reports each rank's
wait and stack, only later)."""


@pytest.fixture(scope="module")
def strict_runs(tmp_path_factory):
    """One launch per world size (2, 4, 8 ranks), each running all of its jobs twice."""
    jobs = jobs_by_world(_chapters(), str(tmp_path_factory.mktemp("checkpoints")))
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        # the launcher's switch: every worker of this launch starts with meta as default
        patch.setenv(launch_module.STRICT_DEVICE_VARIABLE, "meta")
        runs[2] = launch(run_strict_and_plain, 2, args=(jobs[2], None),
                         timeout=LAUNCH_TIMEOUT[2], trace=False, backend="gloo").results
    for world in (4, 8):
        runs[world] = launch(run_strict_and_plain, world, args=(jobs[world],),
                             timeout=LAUNCH_TIMEOUT[world], trace=False,
                             backend="gloo").results
    return jobs, runs


def test_every_chapter_function_and_train_4d_step_keeps_its_tensors_on_ctx_device(
        strict_runs):
    """Every job, on every rank: the run with ``meta`` as torch's default device succeeds
    and returns what the plain run returns."""
    jobs, runs = strict_runs
    failures = []
    for world, results in runs.items():
        for label, *_ in jobs[world]:
            for rank, per_label in enumerate(results):
                got = per_label[label]
                if label == CONTROL:
                    if not isinstance(got, str):
                        failures.append(f"{label}: the strict run did not fail: {got}")
                elif isinstance(got, str):
                    failures.append(f"{label} (rank {rank} of {world}): {got}")
                elif not _same(*got):
                    failures.append(f"{label} (rank {rank} of {world}): the run with a "
                                    f"meta default device returned something else")
    assert not failures, "\n".join(failures)


def test_the_strict_runs_are_each_chapter_s_listed_runs_and_the_train_4d_layouts(
        strict_runs):
    """Each chapter's jobs are the runs its entry in ``tutorial_lib.chapters`` lists
    (``device_runs``: none missing, none unlisted), every chapter but 10 and 13 has some
    (chapter 10 launches only train_4d, whose runs log the memory it reads; chapter 13's
    planner launches nothing), and train_4d runs its layouts."""
    jobs, _ = strict_runs
    labels = [label for world in jobs.values() for label, *_ in world]
    for entry in CHAPTERS:
        ran = sorted(label for label in labels if label.startswith(f"{entry.key} "))
        assert ran == sorted(f"{entry.key} {run}" for run in entry.device_runs), entry.stem
    assert [entry.number for entry in CHAPTERS if not entry.device_runs] == [10, 13]
    assert sorted(label for label in labels if label.startswith("train_4d")) == sorted(
        [*TRAIN_LAYOUTS, *TRAIN_EXTRAS])
    assert [label for label, *_ in jobs[EXTRAS_WORLD] if label in TRAIN_EXTRAS] == [
        *TRAIN_EXTRAS]
