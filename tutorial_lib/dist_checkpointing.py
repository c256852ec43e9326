"""Save and load the 4D run's state with ``torch.distributed.checkpoint`` (DCP), inside the workers.

Where checkpoints live, the atomic commit and the checks on load are in
:mod:`tutorial_lib.checkpointing` (no torch); this module builds the state dict every rank
hands to DCP, and calls DCP.  What a checkpoint holds, under global names::

    model.<name>                        every parameter and buffer (expert biases included),
                                        named with GLOBAL layer indices (layers.5.mlp...)
    optimizer.state.<name>.exp_avg      Adam's moments, sharded like the parameter
    optimizer.state.<name>.exp_avg_sq
    optimizer.state.<name>.step         Adam's step count (a scalar)
    rng_state.pp<p>.tp<t>               torch's RNG state of the ranks at (pp, tp) (Megatron's key)
    common.json (beside the DCP files)  iteration, consumed samples, arguments

**How each tensor is described to DCP: DTensor.**  A tensor split over a group is handed
over as a :class:`~torch.distributed.tensor.DTensor` on a one-dimensional
:class:`~torch.distributed.device_mesh.DeviceMesh` made from that live group
(``DeviceMesh.from_group``, no new process group), placed ``Shard(dim)``: TP shards over
``tp`` along their ``partition_dim`` (:func:`~tutorial_lib.data_parallel.mark_tensor_parallel`),
routed experts over ``ep`` along dim 0 (each EP rank stacks its ``N/EP`` experts), and with
ETP > 1 over a two-dimensional ``ep`` x ``expert_tp`` mesh, also along their channels.  DCP
computes each piece's offset from the mesh coordinate and records ``(offsets, sizes)`` in
``.metadata`` (:func:`tutorial_lib.checkpointing.tensor_sharding` and
:func:`~tutorial_lib.checkpointing.local_chunk` predict them).  A tensor every holder has
whole is handed over as a plain tensor, which DCP reads as "the whole tensor, the same on
every rank that has it".  Replicas (the DP copies of a TP shard, the expert-DP copies of an
expert, the TP copies of a LayerNorm) hand over the same chunk under the same key: DCP's
planner keeps one writer per chunk, spreading them over the ranks, so each byte of the
model is written once.  On load every rank asks for the chunks its own layout needs, in
its own placement, and DCP reads the overlapping pieces of the saved chunks: a checkpoint
saved under TP2 x PP2 x DP2 loads under PP4 x DP2 or on one rank.  This works on gloo and
on CPU tensors (DCP only gathers its plans over the world group; a mesh made from a group
is never used to communicate here).

The pipeline needs nothing of DCP: a layer's name carries its global index, so every
layout asks for the same keys, and a stage simply asks only for its own layers.

**The optimizer.**  Plain Adam holds its state per parameter, so its tensors are sharded
like the parameter.  ZeRO-1 (:class:`~tutorial_lib.data_parallel.DistributedOptimizer`)
holds slices of flat per-domain buffers, a cut that depends on the DP size; it gathers
them back into per-parameter tensors (``get_parameter_state``) before the save and keeps
its own slices after the load (``load_parameter_state``).  Both write the same keys, so a
ZeRO-1 checkpoint loads into plain Adam and the other way round.

**ZeRO-2 and ZeRO-3** (:class:`~tutorial_lib.fully_sharded_data_parallel.FullyShardedOptimizer`).
A rank holds the truth of its units only as slices: the fp32 slice of each unit's flat
vector (``main_param``, under ZeRO-3 the only copy of the weights between steps) and Adam's
moments of it; nothing is gathered to save or load them.  Of each parameter a rank holds a
run of elements, which :func:`~tutorial_lib.checkpointing.flat_range_chunks` cuts into
at most a few boxes; they are handed to DCP as a ``ShardedTensor``
(``torch.distributed._shard.sharded_tensor``, the form whose pieces may be any boxes, several
per rank or none: a DTensor's ``Shard`` placement cuts only even pieces along one dim),
views of the slices, so a load writes straight into them.  A TP shard or an expert is
itself a piece of a whole tensor, so each box is moved to where the rank's tensor sits in
it (the same splits as the DTensors above: :func:`~tutorial_lib.checkpointing.global_placement`),
and the ShardedTensor lists the boxes of every rank that holds one: the unit's DP group
times the ``tp`` group (or ``ep``, ``expert_tp``) the parameter is split over, computed on
each rank with no collective (:func:`unit_piece`).  The keys and global shapes are the ones
above (the weights as ``model.<name>``, read from the fp32 slices), so DCP reshards in both
directions: a ZeRO-3 checkpoint of TP 2 x EP 2 loads into plain Adam on one rank, a ZeRO-2
one of TP 2 under ZeRO-3, a ZeRO-3 one on 4 ranks under ZeRO-1 on 2, and back.

**RNG** (Megatron-LM's rule, d98e8a64 / megatron-core 0.20.0, ``load_checkpoint``): saved
per (pipeline rank, TP rank), loaded only when the checkpoint's TP and PP sizes equal the
run's; otherwise rank 0 says it is ignored.  The
4D run draws nothing from torch's global RNG once built (weights, data and dropout masks
come from seeded generators), so its losses never depend on it.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from . import checkpointing, parallel_state
from .data_parallel import DistributedOptimizer, grad_domain, is_tensor_parallel
from .fully_sharded_data_parallel import FullyShardedOptimizer

__all__ = ["ADAM_STATE", "PAUSE_BEFORE_COMMIT_ENV", "CheckedFileSystemReader", "model_tensors",
           "unit_piece", "sharded_state_dict", "Save", "start_save", "save_checkpoint", "load_checkpoint"]

# DCP reads the ZeRO-2 / ZeRO-3 boxes through ShardedTensor, the one form with several pieces
# per rank; torch 2.13 warns on each of its attribute reads that DTensor replaces it, and
# DTensor has no form for them.
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating "
                        "ShardedTensor", category=FutureWarning)

ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")
"""The optimizer state a checkpoint holds per parameter (the 4D run's optimizer is Adam)."""

PAUSE_BEFORE_COMMIT_ENV = "TUTORIAL_LIB_PAUSE_BEFORE_COMMIT"
"""Test hook: when this environment variable holds an iteration, the save of that iteration
stops (rank 0 prints a line and sleeps) after every rank has written and before the
commit, so a test can kill the run in the middle of a save."""


class CheckedFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with the restricted unpickler
    (:func:`tutorial_lib.checkpointing.read_dcp_metadata`) instead of ``pickle.load``: every
    worker reads it again after the launcher's check, and a file swapped in between must not
    run code either."""

    def read_metadata(self, *args, **kwargs):
        metadata = checkpointing.read_dcp_metadata(str(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own reader does
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def model_tensors(chunks) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of this rank's chunks, by global name.

    A chunk's ``state_dict`` names its layers with their global indices (``layers.5...``),
    so the chunks of one rank never collide and every layout uses the same names.
    """
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if name in tensors:
                raise ValueError(f"two model chunks of this rank both hold {name!r}")
            tensors[name] = tensor
    return tensors


def _meshes(device_type: str) -> dict[str, DeviceMesh]:
    """A one-dimensional mesh per group a tensor can be split over, made from the live group,
    of the tensors' device type (``cpu``, or ``cuda`` under NCCL)."""
    meshes = {}
    for kind in ("tp", "ep"):
        ranks = parallel_state.get_group_ranks(kind)
        meshes[kind] = DeviceMesh.from_group(parallel_state.get_group(kind), device_type,
                                             mesh=torch.tensor(ranks, device="cpu"),
                                             mesh_dim_names=(kind,))
    if parallel_state.group_size("expert_tp") > 1:
        # experts split over EP and ETP: a two-dimensional mesh, row i the ETP group of my
        # EP group's i-th rank
        meshes["ep", "expert_tp"] = DeviceMesh.from_group(
            [parallel_state.get_group("ep"), parallel_state.get_group("expert_tp")], device_type,
            mesh=_rank_grid(("ep", "expert_tp")), mesh_dim_names=("ep", "expert_tp"))
    return meshes


def _rank_grid(kinds) -> torch.Tensor:
    """The global ranks of my groups of ``kinds`` spanned together, one axis per kind:
    entry ``[i, j, ...]`` is the rank at position ``i`` of my ``kinds[0]`` group, ``j`` of my
    ``kinds[1]`` group, ..., every other coordinate mine.  Ranks are sums of coordinate x
    stride in every layout (the dense grid and the expert grid alike) and each kind moves
    other coordinates, so that rank is the sum of those positions' ranks, less ``me`` once
    per kind but one."""
    me = dist.get_rank()
    grid = torch.zeros((), dtype=torch.long)
    for kind in kinds:
        grid = grid.unsqueeze(-1) + torch.tensor(parallel_state.get_group_ranks(kind)) - me
    return grid + me


def _sharding(tensor: torch.Tensor) -> list[tuple[str, int]]:
    """The ``(group kind, dim)`` splits of ``tensor``: none, one, or two (experts under ETP)."""
    domain = grad_domain(tensor) if isinstance(tensor, torch.nn.Parameter) else "dp"
    found = [sharding(is_tensor_parallel(tensor), getattr(tensor, "partition_dim", None), domain)
             for sharding in (checkpointing.tensor_sharding, checkpointing.expert_tp_sharding)]
    return [split for split in found if split is not None]


def _describe(local: torch.Tensor, shardings, meshes):
    """``local`` as DCP should see it: a DTensor if split over groups, else the plain tensor."""
    if not shardings:
        return local
    kinds = tuple(kind for kind, _ in shardings)
    mesh = meshes[kinds[0] if len(kinds) == 1 else kinds]
    return DTensor.from_local(local, mesh, [Shard(dim) for _, dim in shardings], run_check=False)


def _optimizer_state(optimizer, params: dict[str, torch.Tensor]) -> dict[str, dict]:
    """``{name: {state: tensor}}`` for each parameter, whichever optimizer holds it."""
    if isinstance(optimizer, DistributedOptimizer):
        by_param = optimizer.get_parameter_state()
    else:
        by_param = optimizer.state
    out = {}
    for name, param in params.items():
        state = by_param.get(param) or _empty_state(param)  # empty before the first step
        if set(ADAM_STATE) - set(state):
            raise ValueError(f"{name}'s optimizer state has {sorted(state)}; a checkpoint holds "
                             f"Adam's {ADAM_STATE}")
        out[name] = {key: state[key] for key in ADAM_STATE}
    return out


def _empty_state(param: torch.Tensor) -> dict:
    """Adam's state before its first step (also what a load fills in); the step count on the
    CPU, where ``torch.optim.Adam`` keeps it."""
    return {"exp_avg": torch.zeros_like(param.detach()), "exp_avg_sq": torch.zeros_like(param.detach()),
            "step": torch.zeros((), dtype=torch.float32, device="cpu")}


def _rng_key() -> str:
    return f"rng_state.pp{parallel_state.group_rank('pp')}.tp{parallel_state.group_rank('tp')}"


def _state_dict(tensors: dict, moments: dict, rng_state: torch.Tensor | None) -> dict:
    """The flat dict handed to DCP: each tensor as a DTensor (split) or plain (whole), by key."""
    meshes = _meshes(next(iter(tensors.values())).device.type) if tensors else {}
    state: dict = {}
    for name, tensor in tensors.items():
        state[f"model.{name}"] = _describe(tensor.detach(), _sharding(tensor), meshes)
    for name, values in moments.items():
        for key, value in values.items():  # the moments are split like their parameter
            state[f"optimizer.state.{name}.{key}"] = (value if key == "step" else
                                                      _describe(value, _sharding(tensors[name]), meshes))
    if rng_state is not None:
        state[_rng_key()] = rng_state
    return state


def unit_piece(unit, index: int, values: torch.Tensor) -> sharded_tensor.ShardedTensor:
    """This rank's elements of parameter ``index`` of ``unit``, cut from ``values`` (laid out
    as the unit's slice: ``main_param`` or one of its Adam moments), as a ``ShardedTensor``
    of the whole parameter's shape; its pieces are views of ``values``.

    Every rank that holds a piece of the parameter is listed with its boxes: the unit's DP
    group times the groups the parameter is split over (:func:`_sharding`: a TP shard's
    ``tp``; a routed expert's ``ep``, and ``expert_tp`` under ETP > 1), each rank's slice
    cut by :func:`~tutorial_lib.checkpointing.slice_chunks` and placed by
    :func:`~tutorial_lib.checkpointing.global_placement`.  All of it is computed here, with
    no collective (torch's ``_init_from_local_shards_and_global_metadata``, as DCP builds its
    own ShardedTensors); torch checks that the boxes do not overlap and fill the tensor.
    The copies of that set (a LayerNorm's TP copies) list the same boxes under the same key:
    DCP writes one.
    """
    param = unit.params[index]
    splits = _sharding(param)
    holders = _rank_grid((unit.group, *(kind for kind, _ in splits)))
    me, mine, listed = dist.get_rank(), [], []
    for position in itertools.product(*map(range, holders.shape)):
        dp_rank, holder = position[0], int(holders[position])
        global_shape, offsets = checkpointing.global_placement(
            tuple(param.shape), [(dim, i, parts) for (_, dim), i, parts
                                 in zip(splits, position[1:], holders.shape[1:])])
        # another rank's device is named by its type: DCP reads offsets and sizes only
        device = values.device if holder == me else values.device.type
        held = (dp_rank * unit.shard_numel, (dp_rank + 1) * unit.shard_numel)
        for box, sizes in checkpointing.slice_chunks(tuple(param.shape), unit.ranges[index],
                                                     held, offsets):
            listed.append(ShardMetadata(list(box), list(sizes), f"rank:{holder}/{device}"))
            if holder == me:
                mine.append(listed[-1])
    shards, at = [], max(unit.ranges[index][0] - unit.shard_start, 0)
    for box in mine:  # my boxes, in the order of my slice
        numel = math.prod(box.shard_sizes)
        shards.append(sharded_tensor.Shard(values[at:at + numel].view(box.shard_sizes), box))
        at += numel
    metadata = ShardedTensorMetadata(listed, torch.Size(global_shape),
                                     TensorProperties(dtype=values.dtype))
    return sharded_tensor.ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def _fully_sharded_state_dict(tensors: dict, optimizer: FullyShardedOptimizer,
                              rng_state: torch.Tensor | None) -> dict:
    """The flat dict of a ZeRO-2 / ZeRO-3 rank: the units' weights and Adam moments as this
    rank's boxes of each parameter (:func:`unit_piece`), views of its fp32 slices, so that
    ``dcp.save`` reads them and ``dcp.load`` writes into them; the rest as :func:`_state_dict`."""
    names = {id(tensor): name for name, tensor in tensors.items()}
    rest, state = dict(tensors), {}
    for unit in optimizer.buffers:
        adam = optimizer.optimizer.state[unit.main_param]
        if not adam:  # before the first step, or before a load: Adam's state at step 0
            adam.update(_empty_state(unit.main_param))
        for index, param in enumerate(unit.params):
            name = names[id(param)]
            del rest[name]
            state[f"model.{name}"] = unit_piece(unit, index, unit.main_param.detach())
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"optimizer.state.{name}.{key}"] = unit_piece(unit, index, adam[key])
            state[f"optimizer.state.{name}.step"] = adam["step"]  # one count per unit
    state.update(_state_dict(rest, {}, rng_state))  # buffers; parameters outside the units are frozen
    return state


def sharded_state_dict(chunks, optimizer) -> dict:
    """The flat dict this rank hands to ``dcp.save``: its pieces of every tensor, by global key.

    ``optimizer``: ``torch.optim.Adam`` over the chunks' parameters, a
    :class:`~tutorial_lib.data_parallel.DistributedOptimizer` (then this is collective
    over its DP groups: it gathers the state), or a
    :class:`~tutorial_lib.fully_sharded_data_parallel.FullyShardedOptimizer` (collective over
    DP too: the ranks tell each other which boxes they hold; nothing is gathered).
    """
    tensors = model_tensors(chunks)
    if isinstance(optimizer, FullyShardedOptimizer):
        return _fully_sharded_state_dict(tensors, optimizer, torch.get_rng_state())
    params = {n: t for n, t in tensors.items() if isinstance(t, torch.nn.Parameter)}
    return _state_dict(tensors, _optimizer_state(optimizer, params), torch.get_rng_state())


def _log(message: str) -> None:
    """A line from rank 0, on stderr (under torchrun --json, stdout holds the records)."""
    if dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


class Save:
    """A checkpoint whose files are being written (in the background with ``async_save``);
    :meth:`finish` waits for them and commits it.  Every rank calls :meth:`finish`, at the
    same point of training."""

    def __init__(self, checkpoints_path: str, iteration: int, args, future=None):
        self.checkpoints_path, self.iteration, self.args = checkpoints_path, iteration, args
        self.future = future
        self.temporary = (checkpointing.get_checkpoint_name(checkpoints_path, iteration)
                          + checkpointing.TEMPORARY_SUFFIX)

    def finish(self) -> str:
        """Wait for this rank's writes; rank 0 writes ``common.json`` (with each file's size
        and digest), renames the directory and rewrites the tracker
        (:func:`tutorial_lib.checkpointing.commit_checkpoint`), then removes what
        ``keep_last`` no longer keeps.  Returns the committed directory."""
        if self.future is not None:
            self.future.result()  # DCP's coordinator (rank 0) has written .metadata by then
        rank, iteration = dist.get_rank(), self.iteration
        if rank == 0:  # DCP's coordinator writes .metadata once every rank's files are written
            common = checkpointing.common_state(self.args, iteration)
            common["files"] = checkpointing.file_digests(self.temporary)
            checkpointing.write_common_state(self.temporary, common)
        dist.barrier()  # every rank has written: the checkpoint is complete, not yet committed
        if rank == 0 and os.environ.get(PAUSE_BEFORE_COMMIT_ENV) == str(iteration):
            print(f"test hook: iteration {iteration} is written to {self.temporary}, pausing "
                  f"before the commit", file=sys.stderr, flush=True)
            time.sleep(600)
        final = checkpointing.get_checkpoint_name(self.checkpoints_path, iteration)
        if rank == 0:
            checkpointing.commit_checkpoint(self.checkpoints_path, iteration)
            if self.args.keep_last:
                checkpointing.remove_old_checkpoints(self.checkpoints_path, self.args.keep_last)
        dist.barrier()  # when finish returns, the tracker names iteration N on every rank
        return final


_ASYNC_GROUP = None


def _async_group():
    """A gloo group of the whole world for DCP's background writes: its collectives run in a
    thread while training's own run on the default group, and two threads must not share
    one group's sequence of collectives (made once, collectively, at the first async save)."""
    global _ASYNC_GROUP
    if _ASYNC_GROUP is None:
        _ASYNC_GROUP = dist.new_group(backend="gloo")
    return _ASYNC_GROUP


def start_save(checkpoints_path: str, iteration: int, chunks, optimizer, args,
               async_save: bool = False) -> Save:
    """Start writing the state after ``iteration`` steps into ``iter_N.tmp``; every rank calls it.

    Rank 0 makes the directory; every rank hands its chunks to DCP: ``dcp.save`` (done when
    it returns) or ``dcp.async_save``, which copies the state to CPU memory and writes it
    from a thread while training goes on.  :meth:`Save.finish` commits it.
    """
    if dist.get_rank() == 0:
        os.makedirs(checkpoints_path, exist_ok=True)
        checkpointing.prepare_checkpoint_dir(checkpoints_path, iteration)
    dist.barrier()  # nobody writes before the directory is there (and empty)
    save = Save(checkpoints_path, iteration, args)
    state = sharded_state_dict(chunks, optimizer)
    writer = dcp.FileSystemWriter(save.temporary)
    if async_save:
        save.future = dcp.async_save(state, storage_writer=writer, process_group=_async_group())
    else:
        dcp.save(state, storage_writer=writer)
    return save


def save_checkpoint(checkpoints_path: str, iteration: int, chunks, optimizer, args) -> str:
    """Write the state after ``iteration`` steps to ``checkpoints_path/iter_N`` and commit it
    (:func:`start_save`, then :meth:`Save.finish`); every rank calls it.  Returns ``iter_N``."""
    return start_save(checkpoints_path, iteration, chunks, optimizer, args).finish()


def load_checkpoint(checkpoints_path: str, chunks, optimizer, args, ckpt_step: int | None = None) -> int:
    """Load the tracker's checkpoint (or ``ckpt_step``'s) into this rank's layout; returns its iteration.

    Every rank calls it once its chunks and optimizer are built.  The parameters and
    buffers are loaded in place; the optimizer state is installed afterwards (ZeRO-1 keeps
    its slices of it); ZeRO-2 and ZeRO-3 load the slices of their units and their moments in
    place (then ZeRO-2 all-gathers the weights); the RNG state only when TP and PP are the
    checkpoint's.
    """
    found = checkpointing.find_checkpoint(checkpoints_path, ckpt_step)
    checkpointing.check_checkpoint_args(found.common, args)
    saved = found.common["args"]
    same_tp_pp = (saved["tensor_model_parallel_size"], saved["pipeline_model_parallel_size"]) == \
                 (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    tensors = model_tensors(chunks)  # loaded in place: a DTensor's local part is the tensor itself
    params = {n: t for n, t in tensors.items() if isinstance(t, torch.nn.Parameter)}
    fully_sharded = isinstance(optimizer, FullyShardedOptimizer)
    moments = {} if fully_sharded else {name: _empty_state(param)  # filled by the load
                                        for name, param in params.items()}
    rng_state = torch.empty_like(torch.get_rng_state()) if same_tp_pp else None
    state = (_fully_sharded_state_dict(tensors, optimizer, rng_state) if fully_sharded
             else _state_dict(tensors, moments, rng_state))
    dcp.load(state, storage_reader=CheckedFileSystemReader(found.path))
    by_param = {params[name]: value for name, value in moments.items()}
    if fully_sharded:  # the slices and moments were loaded in place
        optimizer.reload_model_params()
    elif isinstance(optimizer, DistributedOptimizer):
        optimizer.load_parameter_state(by_param)
    else:
        for param, value in by_param.items():
            optimizer.state[param] = value
    if same_tp_pp:
        torch.set_rng_state(rng_state)
    else:
        _log(f"checkpoint {found.path}: saved under TP{saved['tensor_model_parallel_size']} x "
             f"PP{saved['pipeline_model_parallel_size']}, loaded under TP"
             f"{args.tensor_model_parallel_size} x PP{args.pipeline_model_parallel_size}: the "
             f"RNG state is ignored (Megatron's rule)")
    return found.iteration
