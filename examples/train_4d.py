"""Train a small DeepSeek-style model on any valid TP x PP x EP x DP grid.

    python examples/train_4d.py --world-size 8 --pipeline-model-parallel-size 2 \\
        --tensor-model-parallel-size 2 --num-microbatches 4
    python examples/train_4d.py --world-size 4 --pipeline-model-parallel-size 4 --schedule gpipe --json
    torchrun --standalone --nproc-per-node 4 examples/train_4d.py --pipeline-model-parallel-size 2

Without torchrun it starts ``--world-size`` workers itself: ``--device auto`` (the
default) runs them on the GPUs over NCCL when every rank has its own GPU (rank r on
``cuda:r``), else on the CPU over gloo, saying why when there are GPUs but too few;
``--device cuda`` insists on the GPUs and exits with status 2 before starting anything
when there are too few; ``--device cpu`` stays on gloo.  Under torchrun ``LOCAL_RANK``
picks each process's GPU.  Under torchrun (one node, or ``--nnodes`` nodes) torchrun's world is
used and ``--world-size`` is ignored.  Flags carry Megatron's names and are built from the
fields of the config dataclasses (``tutorial_lib.config.add_arguments``): ``--help`` prints
each field's docstring and its default.  ``--config FILE``
reads the same options from a JSON or TOML file (keys spelled like the flags, with
``-`` or ``_``); flags given on the command line win.  Any invalid value (the grid, the
batch, the model's shapes, the seed, learning rate, clipping, timeout, a config file that
is not an object of options, a run that would not fit in this machine's memory) exits
with status 2 and the validator's message (the rule, the value, a fix) before torch is
loaded or any worker starts.

Every layout trains the same model on the same data: the per-step losses agree with the
one-rank run (``--world-size 1``) to fp32 rounding.  A run first prints a banner: the
layout, the schedule, the P2P mode, the precision recipe and the iterations (and, with
experts, what ``seq-balance`` and ``MaxVio`` are).  Then one line per step, ``iteration
3/5  loss ...``; with ``--json`` one JSON object per step instead, numbered the same way
(``"iteration": 3``; Megatron counts iterations from 1, and the checkpoint saved after
iteration 3 is ``iter_0000003``), with ``loss`` = the language-model loss over the global
batch, the balance loss and MaxVio under their own keys, ``grad_norm`` and timings
(``--help`` lists every key).  Under ``--json`` stdout holds the JSON lines and nothing
else: the banner and the checkpoint lines go to stderr.

``--precision-recipe bf16`` or ``deepseek_v3`` (or a recipe file, chapter 8) trains with
simulated BF16 / FP8 matmuls and BF16 / FP8 MoE communication; the default ``fp32`` changes
nothing.  With bf16 or FP8 the layouts agree at the first step and drift apart by rounding
(about 1e-3 in 5 steps; ``tutorial_lib.train_4d``).  An unknown name or unreadable file
exits with status 2 before any worker starts.

Checkpoints (Megatron's flags, ``torch.distributed.checkpoint`` underneath)::

    python examples/train_4d.py --world-size 8 --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --steps 10 --save ckpt --save-interval 5
    python examples/train_4d.py --world-size 8 --pipeline-model-parallel-size 4 \
        --use-distributed-optimizer --steps 10 --load ckpt --ckpt-step 5   # another layout, ZeRO-1
    python examples/train_4d.py --world-size 1 --steps 10 --load ckpt    # the latest, on one rank

``--save DIR`` writes ``DIR/iter_0000005`` (committed atomically) and points
``DIR/latest_checkpointed_iteration.txt`` at it; ``--load DIR`` continues from there up to
``--steps`` on any layout, with the losses of the uninterrupted run.  A missing, empty or
half-written ``--load`` directory, or a checkpoint of another model (``--hidden-size`` ...),
exits with status 2 before any worker starts.  Ctrl-C prints one line: the step it stopped
at, the last checkpoint and the command that resumes from it (exit status 130).

Load only checkpoints you trust: DCP's ``.metadata`` is a pickle.  It is read with an
unpickler that admits DCP's own metadata classes only, and every file is checked against
the sizes and SHA-256 digests ``common.json`` records and the chunks ``.metadata`` places in
it, before any worker starts: a crafted or damaged checkpoint exits with status 2 naming
the file.

What a cluster does to a run::

    python examples/train_4d.py ... --save ckpt --save-interval 100 --max-restarts 3
    torchrun --max-restarts 3 --nproc-per-node 8 examples/train_4d.py ... --save ckpt

``--max-restarts N``: when a worker dies (killed, out of memory) the world starts again from
the last committed checkpoint of ``--save``, at most N times, saying why on stderr; the
losses are an uninterrupted run's.  Under torchrun, torchrun's own ``--max-restarts`` starts
the workers again and they resume from ``--save`` the same way.  ``SIGTERM`` (a scheduler's
notice before preemption): the ranks finish the step they are in, save it and the run
exits 0 with the command that resumes.  ``--async-save`` writes checkpoints in the
background (``torch.distributed.checkpoint.async_save``; a kill meanwhile keeps the previous
one); ``--keep-last N`` keeps the newest N.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
from dataclasses import fields, replace

# Only torch-free modules until the arguments are valid: a bad value exits with status 2
# before torch is loaded (tutorial_lib.arguments); tutorial_lib.train_4d comes in main().
from tutorial_lib import checkpointing
from tutorial_lib.arguments import (CONFIG_FIELDS, DEVICES, LOG_KEYS, TrainingArgs,
                                    args_from_dict, describe_run, load_config_file,
                                    validate_args)
from tutorial_lib.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, add_arguments
from tutorial_lib.launch import (LaunchTimeout, WorkerError, is_torchrun, make_run_dir,
                                run_under_torchrun, start_forkserver)

#: The command line's own fix for --device cuda where the GPUs are too few.
CPU_FIX = "  on the command line: --device cpu (or --device auto) runs on the CPU over gloo"
INTERRUPTED_EARLY = "train_4d.py: interrupted before training started"


def build_parser() -> argparse.ArgumentParser:
    """The options of :class:`TrainingArgs`, each with its field's docstring and default."""
    parser = argparse.ArgumentParser(
        description=f"{__doc__.splitlines()[0]}  Under torchrun, torchrun's world is used and "
                    f"--world-size is ignored.")
    for title, cls in (("parallelism", ParallelConfig), ("batch", TrainConfig), ("model", ModelConfig)):
        group = parser.add_argument_group(f"{title} (tutorial_lib.config.{cls.__name__})")
        add_arguments(group, TrainingArgs, CONFIG_FIELDS[cls])
    taken = {name for names in CONFIG_FIELDS.values() for name in names}
    add_arguments(parser.add_argument_group("run (tutorial_lib.train_4d.TrainingArgs)"), TrainingArgs,
                  [f.name for f in fields(TrainingArgs) if f.name not in taken])
    parser.add_argument("--config", metavar="FILE",
                        help="JSON or TOML file with any of the options above (keys spelled like the "
                             "flags, with - or _); flags given on the command line win")
    keys = "; ".join(f"{key}: {meaning}" for key, meaning in LOG_KEYS.items())
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per step on stdout, and nothing else there "
                             "(the banner and checkpoint lines go to stderr). Keys (the text "
                             f"lines' names in brackets): {keys}".replace("%", "%%"))
    return parser


def parse_args(argv=None) -> tuple[TrainingArgs, bool]:
    """The run's options: the config file's (if any), then the flags given, which win."""
    given = vars(build_parser().parse_args(argv))  # TrainingArgs' options only when given
    config, as_json = given.pop("config"), given.pop("json")
    values = load_config_file(config) if config else {}
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    values.update(given)
    return args_from_dict(values, source=f"--config {config}" if config else None), as_json


def _resume(args: TrainingArgs, argv=None) -> str:
    """``; last checkpoint: ... (iteration N); resume: <the same command with --load>``."""
    latest = checkpointing.latest_checkpoint(args.save)
    if latest is None:
        return "; no checkpoint saved (--save DIR --save-interval N keeps one)"
    kept, skip = [], False
    for word in sys.argv[1:] if argv is None else argv:  # the same command, loading the checkpoint
        if skip:
            skip = False
        elif word.split("=")[0] in ("--load", "--ckpt-step"):
            skip = "=" not in word
        else:
            kept.append(word)
    command = shlex.join(["python", sys.argv[0], *kept, "--load", args.save])
    return f"; last checkpoint: {latest.path} (iteration {latest.iteration}); resume: {command}"


def interrupted(args: TrainingArgs, steps_done: int, argv=None) -> str:
    """One line for Ctrl-C: the step, the last checkpoint and the command that resumes from it."""
    resumed = checkpointing.latest_checkpoint(args.load) if args.load and args.ckpt_step is None else None
    done = max(steps_done, resumed.iteration if resumed else args.ckpt_step or 0)
    return (f"train_4d.py: interrupted in iteration {done + 1}/{args.steps} ({done} finished)"
            + _resume(args, argv))


def stopped(args: TrainingArgs, steps_done: int, argv=None) -> str:
    """One line for SIGTERM: the iteration it stopped after, the checkpoint saved there and
    the command that resumes from it."""
    return (f"train_4d.py: SIGTERM: stopped after iteration {steps_done}/{args.steps}"
            + _resume(args, argv))


def failed(error: Exception, args: TrainingArgs, argv=None) -> str:
    """The run failed: the launcher's report, then the last checkpoint and how to resume."""
    return f"train_4d.py: the run failed:\n{error}\ntrain_4d.py: {_resume(args, argv)[2:]}"


def restarting(error: WorkerError, restart: int, args: TrainingArgs) -> tuple[str, TrainingArgs]:
    """The line saying why the world starts again, and the arguments it starts with: from
    the last committed checkpoint of ``--save``, else from the run's own start."""
    latest = checkpointing.latest_checkpoint(args.save)
    where = (f"from {latest.path} (iteration {latest.iteration})" if latest is not None
             else "from the start (no checkpoint committed yet)")
    line = (f"train_4d.py: rank {error.rank}: {error.summary}; restart {restart} of "
            f"{args.max_restarts}, {where}")
    return line, (replace(args, load=args.save, ckpt_step=None) if latest is not None else args)


def torchrun_restart(args: TrainingArgs) -> TrainingArgs:
    """Under ``torchrun --max-restarts N`` torchrun starts every worker again after one dies,
    counting in ``TORCHELASTIC_RESTART_COUNT``: a restarted world resumes from the last
    committed checkpoint of ``--save`` (from the run's own start without one)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    latest = checkpointing.latest_checkpoint(args.save) if restart else None
    if latest is None:
        return args
    if int(os.environ["RANK"]) == 0:
        print(f"train_4d.py: torchrun restart {restart}: resuming from {latest.path} "
              f"(iteration {latest.iteration})", file=sys.stderr, flush=True)
    return replace(args, load=args.save, ckpt_step=None)


def main(argv=None) -> int:
    try:
        args, as_json = parse_args(argv)
        local_ranks = None
        if is_torchrun():
            if args.max_restarts:
                raise ConfigError("checkpoint", f"--max-restarts {args.max_restarts} is the "
                                                f"launcher's; under torchrun give it to "
                                                f"torchrun: torchrun --max-restarts "
                                                f"{args.max_restarts} ... examples/train_4d.py "
                                                f"--save DIR")
            args.world_size = int(os.environ["WORLD_SIZE"])
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
            args = torchrun_restart(args)
        validate_args(args, local_ranks=local_ranks)
    except (ConfigError, OSError, ValueError) as error:
        print(f"train_4d.py: error: {error}", file=sys.stderr)
        return 2
    if not is_torchrun() or int(os.environ.get("RANK", "0")) == 0:
        # the banner: on stdout with the progress lines; under --json on stderr, since
        # stdout then holds the JSON lines only (and they say what each key is in --help)
        print(describe_run(args, legend=not as_json), file=sys.stderr if as_json else sys.stdout,
              flush=True)
    if not is_torchrun() and args.device != "cuda":  # (too few GPUs exits 2 in train())
        try:  # the workers' server imports torch while this process does, below
            start_forkserver()
        except ConfigError as error:  # a temporary folder too long for its socket
            print(f"train_4d.py: error: {error}", file=sys.stderr)
            return 2
    try:  # loads torch; Ctrl-C meanwhile: one line, no traceback
        from tutorial_lib.train_4d import (StopRequest, format_progress, format_saved,
                                           read_progress, train, train_worker)
    except KeyboardInterrupt:
        print(INTERRUPTED_EARLY, file=sys.stderr)
        return 130

    done = [0]  # iterations finished, for the message on Ctrl-C (under torchrun)

    def show(record):
        done[0] = record["iteration"]
        print(json.dumps(record) if as_json else format_progress(record, args.steps), flush=True)

    def saved(iteration, directory):  # to stderr under --json: stdout holds one object per line
        print(format_saved(iteration, directory), file=sys.stderr if as_json else sys.stdout, flush=True)

    if is_torchrun():
        rank = int(os.environ["RANK"])
        try:  # SIGTERM (torchrun passes a scheduler's on): finish the step, save, return
            records, _ = run_under_torchrun(
                train_worker, args=(args, show if rank == 0 else None,
                                    saved if rank == 0 else None, StopRequest()),
                trace=False, backend=DEVICES[args.device])
        except ConfigError as error:  # --device cuda without a GPU per local rank
            print(f"train_4d.py: error: {error}\n{CPU_FIX}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if rank == 0:
                print(interrupted(args, done[0], argv), file=sys.stderr)
            return 130
        if rank == 0 and records and records[-1]["iteration"] < args.steps:
            print(stopped(args, records[-1]["iteration"], argv), file=sys.stderr)
        return 0
    scratch = make_run_dir("tutorial_lib_train4d_")
    progress_file = os.path.join(scratch, "records.jsonl")
    stop_file = os.path.join(scratch, "stop")
    # SIGTERM (a scheduler's notice): the workers finish the step, save and return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: open(stop_file, "w").close())
    run_args, restarts = args, 0
    try:
        while True:
            try:
                # Progress lines come from rank 0 as it trains; JSON is printed once all are done.
                result = train(run_args, progress=not as_json, progress_file=progress_file,
                               stop_file=stop_file)
                break
            except ConfigError as error:  # nothing started: --device cuda with fewer GPUs
                print(f"train_4d.py: error: {error}"  # than ranks, or too long a TMPDIR
                      + (f"\n{CPU_FIX}" if error.rule == "backend" else ""), file=sys.stderr)
                return 2
            except KeyboardInterrupt:  # Ctrl-C: the launcher has ended the workers
                print(interrupted(args, max(read_progress(progress_file), default=0), argv),
                      file=sys.stderr)
                return 130
            except WorkerError as error:  # a worker that raised is a bug: no restart
                if error.exitcode is None or restarts >= args.max_restarts:
                    print(failed(error, args, argv), file=sys.stderr)
                    return 1
                restarts += 1
                line, run_args = restarting(error, restarts, args)
                print(line, file=sys.stderr, flush=True)
            except LaunchTimeout as error:
                print(failed(error, args, argv), file=sys.stderr)
                return 1
        # after a restart, each iteration's record from the world that last ran it
        records = (list(read_progress(progress_file).values()) if restarts
                   else result.results[0])
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(scratch, ignore_errors=True)
    if as_json:
        for record in records:
            show(record)
    if records and records[-1]["iteration"] < args.steps:
        print(stopped(args, records[-1]["iteration"], argv), file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the launch (parsing, validation)
        print(INTERRUPTED_EARLY, file=sys.stderr)
        sys.exit(130)
