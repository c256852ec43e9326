"""Train a small DeepSeek-style model on any valid TP x PP x EP x DP grid.

    python examples/train_4d.py --world-size 8 --pipeline-model-parallel-size 2 \\
        --tensor-model-parallel-size 2 --num-microbatches 4
    python examples/train_4d.py --world-size 4 --pipeline-model-parallel-size 4 --schedule gpipe --json
    torchrun --standalone --nproc-per-node 4 examples/train_4d.py --pipeline-model-parallel-size 2

Without torchrun it starts ``--world-size`` workers itself (gloo on CPU, NCCL when every
rank has a GPU).  Under torchrun (one node, or ``--nnodes`` nodes) torchrun's world is
used and ``--world-size`` is ignored.  Flags carry Megatron's names.  ``--config FILE``
reads the same options from a JSON or TOML file (keys spelled like the flags, with
``-`` or ``_``); flags given on the command line win.  An invalid grid or batch exits
with status 2 and the validator's message before any worker starts.

Every layout trains the same model on the same data: the per-step losses agree with the
one-rank run (``--world-size 1``) to fp32 rounding.  ``--json`` prints one JSON object per
step (``step``, ``loss`` = the language-model loss over the global batch, the balance
loss and MaxVio under their own keys, ``grad_norm``, timings); otherwise one line per step.

``--precision-recipe bf16`` or ``deepseek_v3`` (or a recipe file, chapter 8) trains with
simulated BF16 / FP8 matmuls and BF16 / FP8 MoE communication; the default ``fp32`` changes
nothing.  With bf16 or FP8 the layouts agree at the first step and drift apart by rounding
(about 1e-3 in 5 steps; ``tutorial_lib.training``).  An unknown name or unreadable file
exits with status 2 before any worker starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

from tutorial_lib.config import ConfigError
from tutorial_lib.launch import LaunchTimeout, WorkerError, is_torchrun, run_under_torchrun
from tutorial_lib.training import TrainingArgs, args_from_dict, format_progress, train, train_worker, validate_args

HELP = {
    "world_size": "ranks to start (ignored under torchrun)",
    "tensor_model_parallel_size": "TP: ranks splitting each attention / dense MLP weight",
    "pipeline_model_parallel_size": "PP: pipeline stages",
    "virtual_pipeline_model_parallel_size": "model chunks per rank with --schedule interleaved",
    "expert_model_parallel_size": "EP: ranks splitting the routed experts",
    "num_microbatches": "microbatches per data-parallel replica per step",
    "global_batch_size": "sequences per step, split over DP replicas, then microbatches",
    "seq_length": "tokens per sequence",
    "num_layers": "decoder layers",
    "hidden_size": "residual width",
    "num_attention_heads": "attention heads",
    "vocab_size": "vocabulary size",
    "num_experts": "routed experts per MoE layer (0: dense model)",
    "moe_router_topk": "experts per token",
    "first_k_dense_replace": "leading layers with a dense MLP",
    "num_shared_experts": "shared experts per MoE layer",
    "dropout": "dropout probability (0 with TP or EP > 1)",
    "steps": "optimizer steps",
    "seed": "seeds weights, data and dropout",
    "lr": "Adam learning rate",
    "clip_grad": "clip the global gradient norm (0: off)",
    "schedule": "pipeline schedule: 1f1b, gpipe or interleaved",
    "p2p_mode": "P2P mode: sequential, overlapped or batched",
    "precision_recipe": "precision recipe: fp32, bf16, deepseek_v3 or a .json / .toml recipe file",
    "timeout": "seconds before a hang is reported and the workers are stopped",
}


def _load_config_file(path: str) -> dict:
    with open(path, "rb") as handle:
        if path.endswith(".toml"):
            import tomllib
            return tomllib.load(handle)
        return json.load(handle)


def parse_args(argv=None) -> tuple[TrainingArgs, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = TrainingArgs()
    for f in fields(TrainingArgs):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, f.name)), default=None,
                            help=f"{HELP[f.name]} (default {getattr(defaults, f.name)})")
    parser.add_argument("--config", help="JSON or TOML file with any of the options above")
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    namespace = parser.parse_args(argv)
    values = _load_config_file(namespace.config) if namespace.config else {}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    values.update({f.name: getattr(namespace, f.name) for f in fields(TrainingArgs)
                   if getattr(namespace, f.name) is not None})
    return args_from_dict(values), namespace.json


def main(argv=None) -> int:
    try:
        args, as_json = parse_args(argv)
        if is_torchrun():
            args.world_size = int(os.environ["WORLD_SIZE"])
        validate_args(args)
    except (ConfigError, OSError, ValueError) as error:
        print(f"train_4d.py: error: {error}", file=sys.stderr)
        return 2

    def show(record):
        print(json.dumps(record) if as_json else format_progress(record, args.steps), flush=True)

    if is_torchrun():
        rank = int(os.environ["RANK"])
        run_under_torchrun(train_worker, args=(args, show if rank == 0 else None), trace=False)
        return 0
    try:
        # Progress lines come from rank 0 as it trains; JSON is printed once all are done.
        result = train(args, progress=not as_json)
    except (WorkerError, LaunchTimeout) as error:
        print(f"train_4d.py: the run failed:\n{error}", file=sys.stderr)
        return 1
    if as_json:
        for record in result.results[0]:
            show(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
