"""Checkpoints of the 4D run on disk: their names, the atomic commit, and the checks on load.

Nothing here imports torch or starts a process: the command line checks ``--save`` /
``--load`` with it before any worker starts, and tests read it directly.  The sharded
tensors themselves are written and read by :mod:`tutorial_lib.dist_checkpointing` with
PyTorch Distributed Checkpoint (DCP, ``torch.distributed.checkpoint``), the standard
sharded format.  One ``--save`` directory (Megatron-LM's names)::

    SAVE/
      latest_checkpointed_iteration.txt   "4": the last committed checkpoint (the tracker)
      iter_0000002/                       the state after 2 optimizer steps
        .metadata                         DCP's index: every key, its global shape, its
                                          chunks, and the file holding each chunk
        __0_0.distcp ... __7_0.distcp     the chunks rank 0 ... 7 wrote
        common.json                       what is not a tensor: iteration, consumed
                                          samples, the run's arguments, the size and
                                          SHA-256 of each DCP file (rank 0 writes it)
      iter_0000004/
      iter_0000006.tmp/                   a save in progress, or one a kill interrupted

**The atomic commit.**  Every rank writes into ``iter_N.tmp``; DCP writes its
``.metadata`` once every rank's chunks are written; after a barrier rank 0 adds
``common.json``, renames the directory to ``iter_N`` (one ``rename``: under its final name
the directory is complete or absent), then replaces the tracker: it writes
``latest_checkpointed_iteration.txt.tmp`` and renames it over the old tracker, so the
tracker always holds a whole number.  Until that last rename the tracker names the
previous checkpoint, so a run killed anywhere in a save (``SIGKILL``, a lost node) leaves
a loadable checkpoint, or none at all, never half of one; ``--load`` refuses a directory
without a tracker and names the ``.tmp`` directories it found.  Megatron-LM (d98e8a64,
megatron-core 0.20.0, ``megatron/training/checkpointing.py``, ``save_checkpoint``)
writes ``iter_N`` in place and then rewrites the tracker with a plain ``open(..., 'w')``
on rank 0 after a barrier: a kill during the save also leaves the previous iteration in
the tracker, but a kill between truncating the tracker and writing it leaves an empty
tracker, which its ``read_metadata`` refuses.

**A checkpoint from elsewhere** (:func:`verify_checkpoint`, before any worker starts).
``.metadata`` is a pickle, and DCP reads it with ``pickle.load``: a crafted one runs any
code.  Here it is read with an unpickler that admits DCP's metadata classes only
(:data:`DCP_METADATA_GLOBALS`), before the launch and again in every worker; still, load
only checkpoints you trust.  Then every file is checked against the sizes and digests
``common.json`` records and the chunks ``.metadata`` places in it, so a truncated or
altered checkpoint is refused in seconds, naming the file, instead of failing inside DCP.

**What must match on load** (:func:`check_checkpoint_args`): the model's structure,
:data:`MODEL_ARGS`, because it fixes which tensors exist and their global shapes
(Megatron-LM d98e8a64's ``check_checkpoint_args`` compares ``num_layers``, ``hidden_size``
and ``num_attention_heads`` in the same way).  The parallel layout, the schedule, the
microbatches and the optimizer (plain Adam or ZeRO-1) may all change: that is what a
sharded checkpoint is for.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import shutil
from typing import NamedTuple

from .config import ConfigError, ModelConfig

__all__ = ["TRACKER_FILENAME", "COMMON_FILENAME", "TEMPORARY_SUFFIX", "CKPT_FORMAT", "MODEL_ARGS",
           "get_checkpoint_name", "get_checkpoint_tracker_filename", "read_metadata",
           "is_save_iteration", "prepare_checkpoint_dir", "commit_checkpoint", "write_tracker",
           "remove_old_checkpoints",
           "common_state", "read_common_state", "Checkpoint", "find_checkpoint",
           "latest_checkpoint", "check_save_args", "file_digests", "DCP_METADATA_GLOBALS",
           "MetadataUnpickler", "read_dcp_metadata", "verify_checkpoint", "check_load_args", "check_checkpoint_args", "tensor_sharding",
           "expert_tp_sharding", "local_chunk", "global_placement", "flat_range_chunks",
           "slice_chunks"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""The file naming the last committed iteration (Megatron-LM's tracker)."""
COMMON_FILENAME = "common.json"
"""The checkpoint's non-tensor state, written once by rank 0 (Megatron's ``common.pt``, as JSON)."""
TEMPORARY_SUFFIX = ".tmp"
"""A save writes ``iter_N.tmp`` and renames it to ``iter_N`` once every rank has finished."""
CKPT_FORMAT = "torch_dcp"
"""Megatron-LM's ``--ckpt-format`` name for plain ``torch.distributed.checkpoint``."""
DCP_METADATA = ".metadata"
"""The index DCP writes last, once every rank's chunks are on disk."""

MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
              "num_experts", "first_k_dense_replace", "num_shared_experts", "ffn_hidden_size",
              "moe_ffn_hidden_size")
"""The :class:`~tutorial_lib.config.ModelConfig` fields a checkpoint fixes: they decide which
tensors exist and their global shapes (and ``num_attention_heads`` how ``linear_qkv``'s rows
are read).  ``moe_router_topk`` and ``dropout`` change how the model runs, not what it holds,
so a run may resume with other values."""

_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


# --- names ---------------------------------------------------------------------------------


def get_checkpoint_name(checkpoints_path: str, iteration: int) -> str:
    """``checkpoints_path/iter_0000004``: the directory of the checkpoint after ``iteration`` steps."""
    return os.path.join(checkpoints_path, f"iter_{iteration:07d}")


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def read_metadata(tracker_filename: str) -> int:
    """The iteration the tracker names; :class:`ConfigError` if it holds anything else."""
    with open(tracker_filename) as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise ConfigError("checkpoint", f"the tracker {tracker_filename} holds {text!r}, not an "
                                        f"iteration number; write the iteration of a complete "
                                        f"iter_NNNNNNN directory into it, or load another directory")
    return int(text)


def is_save_iteration(iteration: int, steps: int, save: str | None, save_interval: int | None) -> bool:
    """Save after ``iteration`` steps?  Every ``save_interval`` steps, and after the last one."""
    if not save:
        return False
    return iteration == steps or bool(save_interval) and iteration % save_interval == 0


# --- the commit (rank 0) ----------------------------------------------------------------------


def prepare_checkpoint_dir(checkpoints_path: str, iteration: int) -> str:
    """An empty ``iter_N.tmp`` to save into (a stale one, left by a kill, is removed first)."""
    temporary = get_checkpoint_name(checkpoints_path, iteration) + TEMPORARY_SUFFIX
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    return temporary


def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (the directory entry itself is on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(checkpoints_path: str, iteration: int) -> None:
    """Point the tracker at ``iteration``: write a temporary file, then rename it over the tracker."""
    tracker = get_checkpoint_tracker_filename(checkpoints_path)
    with open(tracker + TEMPORARY_SUFFIX, "w") as handle:
        handle.write(f"{iteration}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tracker + TEMPORARY_SUFFIX, tracker)
    _fsync_dir(checkpoints_path)


def commit_checkpoint(checkpoints_path: str, iteration: int) -> str:
    """Rename ``iter_N.tmp`` to ``iter_N``, then point the tracker at it; returns ``iter_N``.

    Call once every rank has finished writing (after a barrier), on one rank.  An older
    ``iter_N`` (a run that saved this iteration before) is moved aside first and deleted
    after the rename; a kill between those two renames, while the tracker names this very
    iteration, leaves the tracker naming a missing directory, which ``--load`` refuses,
    listing the committed iterations (``--ckpt-step`` picks one).
    """
    final = get_checkpoint_name(checkpoints_path, iteration)
    temporary = final + TEMPORARY_SUFFIX
    if not os.path.isfile(os.path.join(temporary, DCP_METADATA)):
        raise RuntimeError(f"{temporary} has no {DCP_METADATA}: DCP did not finish writing it")
    replaced = None
    if os.path.exists(final):
        replaced = final + ".old"
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(temporary, final)
    _fsync_dir(checkpoints_path)
    write_tracker(checkpoints_path, iteration)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def remove_old_checkpoints(checkpoints_path: str, keep_last: int) -> list[int]:
    """Delete the committed iterations of ``checkpoints_path`` but the last ``keep_last``
    (and never the tracker's); returns those deleted.  Each is first renamed out of the
    ``iter_NNNNNNN`` names (``iter_N.old``), so a kill midway leaves no half a checkpoint
    under a loadable name."""
    tracker = get_checkpoint_tracker_filename(checkpoints_path)
    tracked = read_metadata(tracker) if os.path.isfile(tracker) else None
    committed = _committed_iterations(checkpoints_path)
    old = [i for i in committed[:max(0, len(committed) - keep_last)] if i != tracked]
    for iteration in old:
        name = get_checkpoint_name(checkpoints_path, iteration)
        shutil.rmtree(name + ".old", ignore_errors=True)
        os.rename(name, name + ".old")
        shutil.rmtree(name + ".old", ignore_errors=True)
    return old


# --- the common state -------------------------------------------------------------------------


def common_state(args, iteration: int) -> dict:
    """What ``common.json`` holds: the format, the data position and the run's arguments.

    ``args``: the run's :class:`~tutorial_lib.train_4d.TrainingArgs`.  The data position is
    the iteration (the 4D run draws step ``i``'s batch from ``(seed, i)``) and, as in
    Megatron, the samples consumed so far.
    """
    return {"ckpt_format": CKPT_FORMAT, "iteration": iteration,
            "consumed_train_samples": iteration * args.global_batch_size,
            "args": dataclasses.asdict(args)}


def write_common_state(directory: str, state: dict) -> None:
    with open(os.path.join(directory, COMMON_FILENAME), "w") as handle:
        json.dump(state, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def read_common_state(directory: str) -> dict:
    """``common.json`` of ``directory``; :class:`ConfigError` naming the file if it is not a
    JSON object."""
    path = os.path.join(directory, COMMON_FILENAME)
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError("checkpoint", f"{path} is not JSON ({error}): the checkpoint is "
                                        f"damaged; load another iteration (--ckpt-step N) or "
                                        f"save it again") from None
    if not isinstance(state, dict) or not isinstance(state.get("args"), dict):
        raise ConfigError("checkpoint", f"{path} holds no object with the run's 'args': not a "
                                        f"common.json this course's train_4d wrote; load a "
                                        f"directory it saved")
    return state


def file_digests(directory: str) -> dict[str, dict]:
    """``{name: {"bytes": n, "sha256": hex}}`` of DCP's files in ``directory`` (its
    ``.metadata`` and every ``.distcp``): what ``common.json`` records, so that a truncated
    or altered file is found before any worker starts."""
    digests = {}
    for name in sorted(os.listdir(directory)):
        if name == DCP_METADATA or name.endswith(".distcp"):
            with open(os.path.join(directory, name), "rb") as handle:
                digest = hashlib.file_digest(handle, "sha256")
            digests[name] = {"bytes": os.path.getsize(os.path.join(directory, name)),
                             "sha256": digest.hexdigest()}
    return digests


# --- finding a checkpoint to load ---------------------------------------------------------


class Checkpoint(NamedTuple):
    """A committed checkpoint: where it is, after how many steps, its common state."""

    iteration: int
    path: str
    common: dict


def _committed_iterations(checkpoints_path: str) -> list[int]:
    names = os.listdir(checkpoints_path) if os.path.isdir(checkpoints_path) else []
    return sorted(int(m.group(1)) for m in map(_ITERATION_DIR.match, names) if m)


def _unfinished(checkpoints_path: str) -> list[str]:
    names = os.listdir(checkpoints_path) if os.path.isdir(checkpoints_path) else []
    return sorted(n for n in names if n.startswith("iter_") and n.endswith(TEMPORARY_SUFFIX))


def find_checkpoint(load: str, ckpt_step: int | None = None) -> Checkpoint:
    """The checkpoint ``--load load`` resumes from: the tracker's, or iteration ``ckpt_step``.

    Raises :class:`ConfigError` (rule ``"checkpoint"``) for a missing directory, one
    without a tracker (empty, or whose only saves were interrupted: their ``.tmp``
    directories are named), or a checkpoint that is not complete.
    """
    if not os.path.isdir(load):
        raise ConfigError("checkpoint", f"load directory {load!r} does not exist; pass the --save "
                                        f"directory of an earlier run")
    tracker = get_checkpoint_tracker_filename(load)
    committed = _committed_iterations(load)
    if ckpt_step is None:
        if not os.path.isfile(tracker):
            unfinished = _unfinished(load)
            found = (f"only interrupted saves ({', '.join(unfinished)}), never committed"
                     if unfinished else "no checkpoint" if not committed
                     else f"iterations {committed} but no tracker")
            raise ConfigError("checkpoint", f"{load!r} has no {TRACKER_FILENAME}, so no complete "
                                            f"checkpoint to resume from ({found}); pass the --save "
                                            f"directory of a run that saved at least once"
                              + (", or --ckpt-step N for one of those iterations"
                                 if committed else ""))
        iteration = read_metadata(tracker)
    else:
        iteration = ckpt_step
    path = get_checkpoint_name(load, iteration)
    missing = [name for name in (DCP_METADATA, COMMON_FILENAME)
               if not os.path.isfile(os.path.join(path, name))]
    if missing:
        where = "the tracker names" if ckpt_step is None else "--ckpt-step names"
        raise ConfigError("checkpoint", f"{where} iteration {iteration}, but {path} "
                                        f"{'does not exist' if not os.path.isdir(path) else 'lacks ' + ', '.join(missing)}"
                                        f"; committed iterations in {load!r}: {committed or 'none'}"
                                        f" (pick one with --ckpt-step)")
    common = read_common_state(path)
    if common.get("ckpt_format") != CKPT_FORMAT or common.get("iteration") != iteration:
        raise ConfigError("checkpoint", f"{path}/{COMMON_FILENAME} is not a {CKPT_FORMAT} checkpoint "
                                        f"of iteration {iteration} (it says format "
                                        f"{common.get('ckpt_format')!r}, iteration "
                                        f"{common.get('iteration')!r}); load a directory this "
                                        f"course's train_4d saved")
    return Checkpoint(iteration, path, common)


def latest_checkpoint(checkpoints_path: str | None) -> Checkpoint | None:
    """The checkpoint the tracker of ``checkpoints_path`` names, or ``None`` (none committed yet)."""
    try:
        return find_checkpoint(checkpoints_path) if checkpoints_path else None
    except (ConfigError, OSError, ValueError):
        return None


# --- the checks ---------------------------------------------------------------------------


def _check_count(name: str, value, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("checkpoint", f"{name} must be a whole number >= 1, got {value!r}; "
                                        f"e.g. {flag} 2")


def _check_count_of(name: str, value, directory: str | None, directory_flag: str,
                    does: str) -> None:
    """``value`` (unset, or a whole number >= 1) comes with the directory it is about."""
    if value is None:
        return
    _check_count(name, value, "--" + name.replace("_", "-"))
    if not directory:
        raise ConfigError("checkpoint", f"{name} ({value}) {does}; add {directory_flag} DIR")


def _check_directory_flag(flag: str, value: str | None) -> None:
    if value is not None and not value.strip():
        raise ConfigError("checkpoint", f"{flag} {value!r} names no directory (an unset shell "
                                        f"variable, such as {flag} $CKPT?); pass a directory, or "
                                        f"leave {flag} out")


def check_save_args(save: str | None, save_interval: int | None,
                    keep_last: int | None = None) -> None:
    """``save_interval`` and ``keep_last`` are whole numbers >= 1 and come with ``save``;
    ``save`` can be a directory."""
    _check_directory_flag("--save", save)
    _check_count_of("keep_last", keep_last, save, "--save",
                    "keeps the last checkpoints of a save directory")
    _check_count_of("save_interval", save_interval, save, "--save",
                    "needs a directory to save into")
    if save and os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError("checkpoint", f"save directory {save!r} is a file; pass a directory "
                                        f"(it is created if missing)")


def check_load_args(load: str | None, ckpt_step: int | None) -> Checkpoint | None:
    """The checkpoint ``--load`` / ``--ckpt-step`` name (``None`` without ``load``), or :class:`ConfigError`."""
    _check_directory_flag("--load", load)
    _check_count_of("ckpt_step", ckpt_step, load, "--load", "picks an iteration of the load directory")
    return find_checkpoint(load, ckpt_step) if load is not None else None


def check_checkpoint_args(common: dict, args, path: str | None = None) -> None:
    """The checkpoint's model matches ``args`` (:data:`MODEL_ARGS`) and steps remain to train;
    ``path``: the checkpoint's directory, named in the message."""
    saved = common["args"]
    where = f" in {os.path.join(path, COMMON_FILENAME)}" if path else ""
    defaults = dataclasses.asdict(ModelConfig())
    for name in MODEL_ARGS:
        mine = getattr(args, name, defaults[name])
        theirs = saved.get(name, defaults[name])
        if mine != theirs:
            flag = "--" + name.replace("_", "-")
            raise ConfigError("checkpoint", f"{name} ({mine}) differs from the checkpoint's "
                                            f"({theirs}){where}: a checkpoint fixes the model's shapes "
                                            f"({', '.join(MODEL_ARGS)}); pass {flag} {theirs}, "
                                            f"or load a checkpoint of this model")
    iteration = common["iteration"]
    if iteration >= args.steps:
        raise ConfigError("checkpoint", f"the checkpoint{where.replace(' in ', ' ')} is at iteration "
                                        f"{iteration} and steps is "
                                        f"{args.steps}: nothing is left to train (steps counts "
                                        f"from the start, as Megatron's --train-iters); pass "
                                        f"--steps {iteration + 1} or more")


# --- a checkpoint from elsewhere: DCP's index read safely, the files it names checked ------

DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo", "_StoragePrefix"),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "pathlib": ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),
}
"""Every global a DCP ``.metadata`` names (torch 2.13: the dataclasses of
``torch/distributed/checkpoint/metadata.py``, ``_StorageInfo`` of ``filesystem.py``, the
``torch.Size`` of every shape and offset, a layout by name, the checkpoint id's path), besides
torch's dtypes (``torch.float32`` ...).  ``.metadata`` is a pickle: anything else in it
(``os.system``, ``builtins.eval``) would run when DCP's own ``pickle.load`` read it."""


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` admitting only :data:`DCP_METADATA_GLOBALS` and torch's
    dtypes (imports torch when it meets one of them)."""

    def find_class(self, module: str, name: str):
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            import torch
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise _ForbiddenGlobal(f"{module}.{name}")


def read_dcp_metadata(path: str):
    """DCP's ``Metadata`` from the file ``path`` with :class:`MetadataUnpickler`;
    :class:`ConfigError` naming the file if it names any other global or cannot be read."""
    try:
        with open(path, "rb") as handle:
            return MetadataUnpickler(handle).load()
    except _ForbiddenGlobal as error:
        raise ConfigError("checkpoint", f"{path} names {error}, which torch.distributed."
                                        f"checkpoint's metadata never holds: unpickling it could "
                                        f"run any code, so it was not loaded. Load only "
                                        f"checkpoints you trust (this one was not written by "
                                        f"train_4d, or was altered since)") from None
    except Exception as error:  # noqa: BLE001 - truncated or flipped bytes raise anything
        raise ConfigError("checkpoint", f"{path} cannot be read ({type(error).__name__}: "
                                        f"{error}): the checkpoint is damaged; load another "
                                        f"iteration (--ckpt-step N) or save it again") from None


def _damaged(path: str, what: str) -> ConfigError:
    return ConfigError("checkpoint", f"{path} {what}: the checkpoint is damaged; load another "
                                     f"iteration (--ckpt-step N) or save it again")


def verify_checkpoint(found: Checkpoint):
    """Check a checkpoint's files before any worker reads them; returns DCP's metadata.

    The sizes and SHA-256 digests ``common.json`` records (every save since they were
    added: a truncated file, flipped bytes), then ``.metadata`` through
    :func:`read_dcp_metadata`, then that every file it names is in the directory and as
    long as the offsets and lengths it records.  :class:`ConfigError` naming the file.
    """
    files = found.common.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise _damaged(os.path.join(found.path, COMMON_FILENAME), "records its files in an "
                                                                  "unknown form")
    for name, expected in sorted(files.items()):
        path = os.path.join(found.path, name)
        if not os.path.isfile(path):
            raise _damaged(path, "is missing")
        size = os.path.getsize(path)
        if size != expected.get("bytes"):
            raise _damaged(path, f"has {size} bytes, common.json records {expected.get('bytes')}")
        with open(path, "rb") as handle:
            if hashlib.file_digest(handle, "sha256").hexdigest() != expected.get("sha256"):
                raise _damaged(path, "does not match the SHA-256 digest common.json records "
                                     "(its bytes changed)")
    metadata_path = os.path.join(found.path, DCP_METADATA)
    metadata = read_dcp_metadata(metadata_path)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise _damaged(metadata_path, "records no storage data (which file holds each chunk)")
    needed: dict[str, int] = {}
    for info in storage.values():
        name = info.relative_path
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise _damaged(metadata_path, f"names the file {name!r}, outside the checkpoint")
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        path = os.path.join(found.path, name)
        if not os.path.isfile(path):
            raise _damaged(path, f"is missing ({DCP_METADATA} records chunks in it)")
        if os.path.getsize(path) < end:
            raise _damaged(path, f"has {os.path.getsize(path)} bytes, but {DCP_METADATA} records "
                                 f"chunks up to byte {end} (a truncated file)")
    return metadata


# --- which ranks hold which piece of a tensor --------------------------------------------------


def tensor_sharding(tensor_model_parallel: bool, partition_dim: int | None,
                    domain: str) -> tuple[str, int] | None:
    """``(group kind, tensor dim)`` a tensor is split along, or ``None`` if every holder has it whole.

    A routed-expert weight (domain ``expert_dp``) stacks this EP rank's experts along dim 0:
    split over ``ep``.  A tensor-parallel shard (``tensor_model_parallel``) is split over
    ``tp`` along its ``partition_dim`` (the shared experts' too).  Everything else
    (LayerNorms, router, position embeddings, expert biases) is whole on every rank of its
    stage.
    Copies over ``dp`` / ``expert_dp`` (and over PP stages: none, each layer lives on one)
    are the same chunk written by several ranks: DCP keeps one.
    """
    if domain == "expert_dp":
        return ("ep", 0)
    if tensor_model_parallel:
        return ("tp", partition_dim)
    return None


def expert_tp_sharding(tensor_model_parallel: bool, partition_dim: int | None,
                       domain: str) -> tuple[str, int] | None:
    """The second split of a routed-expert weight: ``("expert_tp", partition_dim)`` when the
    experts are split over ETP > 1 ranks (the weight is then marked tensor-parallel), else
    ``None``.

    Such a weight is split over ``ep`` along dim 0 (:func:`tensor_sharding`) *and* over
    ``expert_tp`` along its channels: dim 1 for the gate and up projections, dim 2 for the
    down projection.  Its chunk is :func:`local_chunk` along dim 0, then along that dim.
    """
    if domain == "expert_dp" and tensor_model_parallel:
        return ("expert_tp", partition_dim)
    return None


def local_chunk(global_shape: tuple[int, ...], dim: int | None, index: int,
                parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of piece ``index`` of ``parts`` equal pieces along ``dim``.

    What DCP records for that piece (``dim=None``: the whole tensor, at offset 0).
    """
    offsets, sizes = [0] * len(global_shape), list(global_shape)
    if dim is not None:
        if global_shape[dim] % parts:
            raise ValueError(f"dim {dim} of {global_shape} does not split into {parts} equal pieces")
        sizes[dim] = global_shape[dim] // parts
        offsets[dim] = index * sizes[dim]
    return tuple(offsets), tuple(sizes)


def global_placement(local_shape: tuple[int, ...], splits) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(global shape, offsets)``: where a rank's tensor of ``local_shape`` sits in the whole
    tensor it is a piece of.

    ``splits``: ``(dim, index, parts)`` for each split of the tensor (what
    :func:`tensor_sharding` and :func:`expert_tp_sharding` name, with this rank's index in
    the group and the group's size): a TP shard is piece ``index`` of ``parts`` along its
    partition dim; a routed-expert weight, piece ``EP rank`` along dim 0, and under ETP > 1
    also piece ``ETP rank`` along its channels.  Each split multiplies its dim by ``parts``
    and adds :func:`local_chunk`'s offset: ``global_placement((24, 16), [(0, 1, 2)])`` is
    ``((48, 16), (24, 0))``.
    """
    shape = list(local_shape)
    for dim, _, parts in splits:
        shape[dim] *= parts
    offsets = [0] * len(shape)
    for dim, index, parts in splits:
        offsets[dim] += local_chunk(tuple(shape), dim, index, parts)[0][dim]
    return tuple(shape), tuple(offsets)


def flat_range_chunks(shape: tuple[int, ...], start: int,
                      end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes ``(offsets, sizes)`` that elements ``[start, end)`` of ``shape``, counted in
    row-major order, make, in that order; each box is contiguous in that order.

    A ZeRO-2 / ZeRO-3 rank holds a slice of its unit's flat vector
    (:class:`~tutorial_lib.data_parallel.ShardedBuffer`): of each parameter it holds a run of
    elements, and DCP records a piece of a tensor as a box.  A run is at most a partial
    first row, whole rows, and a partial last row (recursively, for more dimensions):
    ``flat_range_chunks((3, 4), 2, 11)`` is ``[((0, 2), (1, 2)), ((1, 0), (1, 4)),
    ((2, 0), (1, 3))]``.
    """
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"[{start}, {end}) is not a range of the {math.prod(shape)} "
                         f"elements of a tensor of shape {tuple(shape)}")
    if start == end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])  # elements per index of the first dimension
    rest = tuple(0 for _ in shape[1:])

    def within(index: int, begin: int, stop: int) -> list:  # a run inside one row
        return [((index, *offsets), (1, *sizes))
                for offsets, sizes in flat_range_chunks(shape[1:], begin, stop)]

    first, last = start // row, (end - 1) // row
    if first == last:
        return within(first, start - first * row, end - first * row)
    chunks, whole_from, whole_to = [], first, last + 1
    if start % row:
        chunks += within(first, start % row, row)
        whole_from = first + 1
    if end % row:
        whole_to = last
    if whole_to > whole_from:
        chunks.append(((whole_from, *rest), (whole_to - whole_from, *shape[1:])))
    if end % row:
        chunks += within(last, 0, end % row)
    return chunks


def slice_chunks(shape: tuple[int, ...], param_range: tuple[int, int], slice_range: tuple[int, int],
                 offsets: tuple[int, ...] | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes ``(offsets, sizes)`` of a parameter that one rank's slice of a ZeRO-2 /
    ZeRO-3 unit holds, placed in the whole tensor.

    The parameter (of this rank's ``shape``) is elements ``param_range`` of the unit's flat
    vector, the slice elements ``slice_range`` (DP rank ``r`` of a unit whose slices have
    ``n`` elements holds ``[r n, (r + 1) n)``); their overlap is cut by
    :func:`flat_range_chunks`, and each box moved by ``offsets``, where the rank's tensor
    sits in the whole one (:func:`global_placement`: a TP shard, an expert; ``None``: at 0).
    A slice that holds none of the parameter gives ``[]``.
    """
    start, end = param_range
    first, last = max(start, slice_range[0]), min(end, slice_range[1])
    if last <= first:
        return []
    offsets = offsets or (0,) * len(shape)
    return [(tuple(o + at for o, at in zip(box, offsets)), sizes)
            for box, sizes in flat_range_chunks(tuple(shape), first - start, last - start)]
