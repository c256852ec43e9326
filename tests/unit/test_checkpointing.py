"""Checkpoints on disk: names, the atomic commit, and what ``--load`` refuses.

Pure: directories made in ``tmp_path``, no worker.  The saves and loads of real runs are in
``tests/dist/test_checkpoint.py``.  Upstream: Megatron-LM d98e8a64 (megatron-core 0.20.0),
``megatron/training/checkpointing.py`` (``get_checkpoint_name``,
``get_checkpoint_tracker_filename``, ``read_metadata``, ``check_checkpoint_args``,
``load_checkpoint``'s ``ckpt_step``) and ``megatron/training/config/training_config.py``
(``CheckpointConfig``: ``save``, ``save_interval``, ``load``, ``ckpt_step``).
"""
import json
import math
import os
import pickle
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tutorial_lib import checkpointing
from tutorial_lib.checkpointing import (CKPT_FORMAT, TRACKER_FILENAME, check_checkpoint_args,
                                        check_save_args, commit_checkpoint, common_state,
                                        find_checkpoint, get_checkpoint_name, is_save_iteration,
                                        expert_tp_sharding, flat_range_chunks, global_placement,
                                        latest_checkpoint,
                                        local_chunk,
                                        prepare_checkpoint_dir,
                                        slice_chunks, tensor_sharding)
from tutorial_lib.config import ConfigError
from tutorial_lib.train_4d import TrainingArgs, validate_args

ARGS = TrainingArgs(steps=6, num_layers=4, hidden_size=16, vocab_size=32, seq_length=8,
                    global_batch_size=8, num_microbatches=2)


def fake_save(root, iteration, args=ARGS, commit=True) -> str:
    """What a save leaves on disk: DCP's files (one small tensor, saved by this process
    alone) and the common state with their digests."""
    temporary = prepare_checkpoint_dir(str(root), iteration)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group: "a single process"
        dcp.save({"w": torch.arange(64.0)}, storage_writer=dcp.FileSystemWriter(temporary))
    state = common_state(args, iteration)
    state["files"] = checkpointing.file_digests(temporary)
    checkpointing.write_common_state(temporary, state)
    return commit_checkpoint(str(root), iteration) if commit else temporary


def test_names_are_megatrons():
    """Megatron-LM (d98e8a64) names a save ``iter_{:07d}`` and its tracker
    ``latest_checkpointed_iteration.txt`` (checkpointing.get_checkpoint_name,
    get_checkpoint_tracker_filename)."""
    assert get_checkpoint_name("/ckpt", 4) == "/ckpt/iter_0000004"
    assert checkpointing.get_checkpoint_tracker_filename("/ckpt") == "/ckpt/latest_checkpointed_iteration.txt"
    assert TRACKER_FILENAME == "latest_checkpointed_iteration.txt"


def test_save_every_interval_and_after_the_last_step():
    """Megatron-LM (d98e8a64) saves every ``save_interval`` iterations
    (training.py, checkpoint_and_decide_exit) and once more after the loop when the last
    iteration is not a multiple of it (training.py, pretrain)."""
    assert [i for i in range(1, 8) if is_save_iteration(i, 7, "d", 3)] == [3, 6, 7]
    assert [i for i in range(1, 7) if is_save_iteration(i, 6, "d", 3)] == [3, 6]
    assert [i for i in range(1, 5) if is_save_iteration(i, 4, "d", None)] == [4]
    assert not any(is_save_iteration(i, 4, None, 1) for i in range(1, 5))


def test_commit_renames_the_directory_then_points_the_tracker(tmp_path):
    temporary = fake_save(tmp_path, 2, commit=False)
    assert temporary.endswith("iter_0000002.tmp")
    assert not (tmp_path / TRACKER_FILENAME).exists()  # written, not committed: nothing to load
    final = commit_checkpoint(str(tmp_path), 2)
    assert final == str(tmp_path / "iter_0000002") and not os.path.exists(temporary)
    assert (tmp_path / TRACKER_FILENAME).read_text() == "2\n"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", TRACKER_FILENAME]  # no temporary left
    fake_save(tmp_path, 4)
    assert find_checkpoint(str(tmp_path)).iteration == 4


def test_saving_an_iteration_again_replaces_it_whole(tmp_path):
    fake_save(tmp_path, 2)
    (tmp_path / "iter_0000002" / "__7_0.distcp").write_bytes(b"old")  # a larger world's
    fake_save(tmp_path, 2)  # a later run that saves iteration 2 again
    assert not (tmp_path / "iter_0000002" / "__7_0.distcp").exists()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", TRACKER_FILENAME]


def test_commit_refuses_a_directory_dcp_did_not_finish(tmp_path):
    prepare_checkpoint_dir(str(tmp_path), 2)  # no .metadata: DCP never finished
    with pytest.raises(RuntimeError, match=".metadata"):
        commit_checkpoint(str(tmp_path), 2)
    assert not (tmp_path / TRACKER_FILENAME).exists()


def test_a_stale_temporary_directory_is_emptied_before_a_save(tmp_path):
    temporary = Path(prepare_checkpoint_dir(str(tmp_path), 2))
    (temporary / "__3_0.distcp").write_bytes(b"from a killed run")
    assert os.listdir(prepare_checkpoint_dir(str(tmp_path), 2)) == []


def test_load_uses_the_tracker_or_ckpt_step(tmp_path):
    """Megatron-LM's load_checkpoint reads the tracker, unless ``ckpt_step`` names the iteration."""
    fake_save(tmp_path, 2)
    fake_save(tmp_path, 4)
    found = find_checkpoint(str(tmp_path))
    assert (found.iteration, found.path) == (4, str(tmp_path / "iter_0000004"))
    assert found.common["args"]["hidden_size"] == 16 and found.common["ckpt_format"] == CKPT_FORMAT
    assert find_checkpoint(str(tmp_path), ckpt_step=2).iteration == 2
    assert latest_checkpoint(str(tmp_path)).iteration == 4 and latest_checkpoint(None) is None


@pytest.mark.parametrize("case", ["missing", "empty", "only interrupted", "garbage tracker",
                                  "tracker names a missing directory", "no such ckpt_step",
                                  "not ours"])
def test_load_refuses_what_is_not_a_complete_checkpoint(tmp_path, case):
    """A missing, empty or half-written ``--load`` directory is refused with the rule, the value
    and a fix (Megatron-LM starts from random weights when the tracker is missing, unless
    ``--exit-on-missing-checkpoint``; here a typo in --load must not train from scratch)."""
    root, ckpt_step = tmp_path / "ckpt", None
    expected = {"missing": "does not exist", "empty": "no checkpoint",
                "only interrupted": "only interrupted saves (iter_0000002.tmp)",
                "garbage tracker": "not an iteration number",
                "tracker names a missing directory": "iteration 6, but",
                "no such ckpt_step": "--ckpt-step names iteration 3",
                "not ours": "is not a torch_dcp checkpoint"}[case]
    if case != "missing":
        root.mkdir()
    if case == "only interrupted":
        fake_save(root, 2, commit=False)
    if case in ("garbage tracker", "tracker names a missing directory", "no such ckpt_step",
                "not ours"):
        fake_save(root, 2)
    if case == "garbage tracker":
        (root / TRACKER_FILENAME).write_text("")  # what a kill during a plain rewrite leaves
    if case == "tracker names a missing directory":
        (root / TRACKER_FILENAME).write_text("6")
    if case == "no such ckpt_step":
        ckpt_step = 3
    if case == "not ours":
        state = json.loads((root / "iter_0000002" / "common.json").read_text())
        (root / "iter_0000002" / "common.json").write_text(json.dumps({**state, "ckpt_format": "torch"}))
    with pytest.raises(ConfigError, match="checkpoint") as error:
        find_checkpoint(str(root), ckpt_step)
    assert expected in str(error.value)
    assert str(root) in str(error.value) or case in ("garbage tracker",)
    assert latest_checkpoint(str(root)) is None or case == "no such ckpt_step"


@pytest.mark.parametrize("name,value", [("hidden_size", 32), ("num_layers", 8), ("num_experts", 8),
                                        ("num_attention_heads", 2), ("vocab_size", 64)])
def test_a_checkpoint_of_another_model_is_refused_naming_the_field(tmp_path, name, value):
    """Megatron-LM's check_checkpoint_args compares num_layers, hidden_size and
    num_attention_heads with the checkpoint's; here every field that fixes a tensor's shape."""
    fake_save(tmp_path, 2)
    common = find_checkpoint(str(tmp_path)).common
    check_checkpoint_args(common, ARGS)  # the same model: fine
    check_checkpoint_args(common, replace(ARGS, world_size=8, pipeline_model_parallel_size=4,
                                          moe_router_topk=1, lr=1e-3))  # layout, routing, lr: fine
    with pytest.raises(ConfigError) as error:
        check_checkpoint_args(common, replace(ARGS, **{name: value}))
    message = str(error.value)
    assert f"{name} ({value}) differs from the checkpoint's ({getattr(ARGS, name)})" in message
    assert f"--{name.replace('_', '-')} {getattr(ARGS, name)}" in message  # the fix


def test_a_checkpoint_at_or_past_the_last_step_leaves_nothing_to_train(tmp_path):
    fake_save(tmp_path, 6)
    with pytest.raises(ConfigError, match=r"iteration 6 and steps is 6.*--steps 7"):
        check_checkpoint_args(find_checkpoint(str(tmp_path)).common, ARGS)


@pytest.mark.parametrize("interval", [0, -2, 2.5, True, "3"])
def test_save_interval_must_be_a_whole_number_of_at_least_one(tmp_path, interval):
    with pytest.raises(ConfigError, match=r"\[checkpoint\] save_interval must be a whole number >= 1"):
        check_save_args(str(tmp_path), interval)


def test_save_interval_needs_a_directory_and_save_cannot_be_a_file(tmp_path):
    with pytest.raises(ConfigError, match="add --save DIR"):
        check_save_args(None, 2)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_save_args(str(tmp_path / "file"), None)
    check_save_args(str(tmp_path / "new"), 2)  # created by the first save


def test_validate_args_checks_the_checkpoint_before_any_worker(tmp_path):
    fake_save(tmp_path, 2)
    validate_args(replace(ARGS, load=str(tmp_path)))
    validate_args(replace(ARGS, world_size=2, pipeline_model_parallel_size=2, load=str(tmp_path),
                          use_distributed_optimizer=True))
    for changes, match in [({"ckpt_step": 2}, "add --load DIR"),
                           ({"load": str(tmp_path), "ckpt_step": 0}, "ckpt_step must be"),
                           ({"load": str(tmp_path), "hidden_size": 32}, "hidden_size"),
                           ({"load": str(tmp_path / "nope")}, "does not exist"),
                           ({"save_interval": 0, "save": str(tmp_path)}, "save_interval")]:
        with pytest.raises(ConfigError, match=match):
            validate_args(replace(ARGS, **changes))


def test_the_command_line_exits_2_on_a_bad_checkpoint_flag(train_4d_script, tmp_path, monkeypatch, capsys):
    def no_workers(*args, **kwargs):
        raise AssertionError("a worker would have started")
    import tutorial_lib.train_4d
    monkeypatch.setattr(tutorial_lib.train_4d, "train", no_workers)  # main() imports it late
    monkeypatch.setattr(train_4d_script, "run_under_torchrun", no_workers)
    fake_save(tmp_path / "half", 2, commit=False)  # a first save that was killed
    for argv, said in [(["--save-interval", "0", "--save", str(tmp_path)], "save_interval must be"),
                       (["--save-interval", "2"], "add --save DIR"),
                       (["--load", str(tmp_path / "nope")], "does not exist"),
                       (["--load", str(tmp_path / "half")], "only interrupted saves (iter_0000002.tmp)")]:
        assert train_4d_script.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("train_4d.py: error: [checkpoint]") and said in err, err


def test_the_checkpoint_flags_are_megatrons(train_4d_script):
    """CheckpointConfig (Megatron-LM d98e8a64) names them save, save_interval, load, ckpt_step;
    the distributed optimizer is --use-distributed-optimizer (megatron/training/arguments.py)."""
    args, _ = train_4d_script.parse_args(["--save", "a", "--save-interval", "3", "--load", "b", "--ckpt-step", "2",
                                 "--use-distributed-optimizer"])
    assert (args.save, args.save_interval, args.load, args.ckpt_step) == ("a", 3, "b", 2)
    assert args.use_distributed_optimizer is True
    text = " ".join(train_4d_script.build_parser().format_help().split())
    assert "--save DIR" in text and "--load DIR" in text and "--save-interval N" in text


def test_the_interrupted_line_names_the_step_the_checkpoint_and_the_resume_command(train_4d_script, tmp_path):
    args = replace(ARGS, save=str(tmp_path), save_interval=2, load=str(tmp_path / "old"))
    line = train_4d_script.interrupted(args, 3, ["--steps", "6", "--save", str(tmp_path), "--load",
                                         str(tmp_path / "old"), "--ckpt-step=1"])
    assert line == ("train_4d.py: interrupted in iteration 4/6 (3 finished); no checkpoint saved "
                    "(--save DIR --save-interval N keeps one)")
    fake_save(tmp_path, 2)
    line = train_4d_script.interrupted(args, 3, ["--steps", "6", "--save", str(tmp_path), "--load",
                                         str(tmp_path / "old"), "--ckpt-step=1"])
    assert "\n" not in line
    assert f"last checkpoint: {tmp_path / 'iter_0000002'} (iteration 2)" in line
    assert line.endswith(f"--steps 6 --save {tmp_path} --load {tmp_path}")  # the old --load dropped


def test_which_group_splits_a_tensor_and_the_chunks_dcp_records():
    """What each rank hands to DCP: TP shards split over ``tp`` along their partition dim,
    routed experts over ``ep`` along dim 0, the rest whole (DCP keeps one copy)."""
    assert tensor_sharding(True, 1, "dp") == ("tp", 1)
    assert tensor_sharding(False, None, "expert_dp") == ("ep", 0)
    assert tensor_sharding(False, None, "dp") is None
    # TP x EP: experts split over ETP > 1 ranks are marked tensor-parallel; their second split
    assert tensor_sharding(True, 2, "expert_dp") == ("ep", 0)
    assert expert_tp_sharding(True, 2, "expert_dp") == ("expert_tp", 2)
    assert expert_tp_sharding(False, None, "expert_dp") is None
    assert expert_tp_sharding(True, 0, "dp") is None
    assert local_chunk((48, 16), 0, 1, 2) == ((24, 0), (24, 16))
    assert local_chunk((16, 64), 1, 3, 4) == ((0, 48), (16, 16))
    assert local_chunk((4, 16, 16), None, 0, 1) == ((0, 0, 0), (4, 16, 16))
    with pytest.raises(ValueError):
        local_chunk((6, 4), 0, 0, 4)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5)])
def test_a_flat_run_of_elements_is_cut_into_boxes_that_cover_it_in_order(shape):
    """A ZeRO-2 / ZeRO-3 rank's run of a parameter's elements, as the boxes DCP records:
    every run of every tensor, box by box, gives back exactly the elements of the run, in
    row-major order (numbered here by their flat index)."""
    numbered = torch.arange(math.prod(shape)).reshape(shape)
    for start in range(numbered.numel() + 1):
        for end in range(start, numbered.numel() + 1):
            chunks = flat_range_chunks(shape, start, end)
            pieces = [numbered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                      for offsets, sizes in chunks]
            assert torch.cat([torch.arange(0), *pieces]).tolist() == list(range(start, end))
            assert len(chunks) <= 2 * len(shape) - 1  # a partial row each side, per dimension


def test_flat_range_chunks_by_hand():
    """Elements 2 to 10 of a 3 x 4 matrix: the end of row 0, all of row 1, the start of row 2."""
    assert flat_range_chunks((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)),
                                                ((2, 0), (1, 3))]
    assert flat_range_chunks((3, 4), 4, 12) == [((1, 0), (2, 4))]
    assert flat_range_chunks((2, 2, 3), 4, 5) == [((0, 1, 1), (1, 1, 1))]
    assert flat_range_chunks((5,), 3, 3) == []
    with pytest.raises(ValueError, match="not a range"):
        flat_range_chunks((3, 4), 5, 13)


def test_global_placement_by_hand():
    """A TP shard: rows 24-47 of 48.  An expert weight under EP 2 x ETP 2: this EP rank's
    2 experts of 4 (dim 0), this ETP rank's half of the down projection's 16 input channels
    (dim 2).  No split: the tensor is the whole one."""
    assert global_placement((24, 16), [(0, 1, 2)]) == ((48, 16), (24, 0))
    assert global_placement((2, 16, 8), [(0, 1, 2), (2, 1, 2)]) == ((4, 16, 16), (2, 0, 8))
    assert global_placement((5,), []) == ((5,), (0,))


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_the_slices_of_every_dp_and_tp_rank_tile_each_whole_tensor_in_their_order(dp):
    """A ZeRO-2 / ZeRO-3 unit of three parameters split over TP 2 (a column shard, a row
    shard, a copy), cut into ``dp`` slices (padded): every (DP rank, TP rank) hands the boxes
    of :func:`slice_chunks`, placed by :func:`global_placement`.  Read in order, a rank's
    boxes of the whole tensor are exactly its slice's run of its local tensor, and over every
    rank that holds a piece each element of the whole tensor is in one box (the copy's once
    per TP rank: DCP keeps one)."""
    wholes = [torch.arange(8 * 6).reshape(8, 6), torch.arange(4 * 10).reshape(4, 10) + 100,
              torch.arange(7) + 200]
    splits = [0, 1, None]  # partition dim over TP 2, or whole on every TP rank
    tp = 2
    local_shapes = [tuple(w.shape[d] // tp if d == dim else w.shape[d] for d in range(w.dim()))
                    if dim is not None else tuple(w.shape) for w, dim in zip(wholes, splits)]
    ranges, at = [], 0
    for shape in local_shapes:
        ranges.append((at, at + math.prod(shape)))
        at += math.prod(shape)
    shard_numel = math.ceil(at / dp)
    covered = [torch.zeros_like(w) for w in wholes]
    for tp_rank in range(tp):
        for whole, dim, shape, (start, end), count in zip(wholes, splits, local_shapes, ranges, covered):
            placed = [] if dim is None else [(dim, tp_rank, tp)]
            global_shape, offsets = global_placement(shape, placed)
            assert global_shape == tuple(whole.shape)
            local = whole[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].reshape(-1)
            for dp_rank in range(dp):
                held = (dp_rank * shard_numel, (dp_rank + 1) * shard_numel)
                boxes = slice_chunks(shape, (start, end), held, offsets)
                read = [whole[tuple(slice(o, o + n) for o, n in zip(box, sizes))].reshape(-1)
                        for box, sizes in boxes]
                first, last = max(start, held[0]), min(end, held[1])
                assert torch.cat([torch.zeros(0, dtype=whole.dtype), *read]).tolist() == \
                    local[max(first - start, 0):max(last - start, 0)].tolist()
                for box, sizes in boxes:
                    count[tuple(slice(o, o + n) for o, n in zip(box, sizes))] += 1
    for count, dim in zip(covered, splits):
        assert bool((count == (1 if dim is not None else tp)).all())


def test_a_slice_that_holds_none_of_a_parameter_has_no_boxes():
    assert slice_chunks((3, 4), (12, 24), (0, 12)) == []
    assert slice_chunks((3, 4), (12, 24), (10, 14), (6, 0)) == [((6, 0), (1, 2))]


# --- checkpoints from elsewhere: untrusted and damaged ----------------------------------------


class _RunsACommand:
    """What a crafted ``.metadata`` holds: unpickling it calls ``os.system``."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _damage(root: Path, case: str) -> Path:
    """Damage the committed checkpoint of iteration 2 in ``root``; returns the file named."""
    ckpt = root / "iter_0000002"
    shard = next(ckpt.glob("*.distcp"))
    if case == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-40])
        return shard
    if case == "flipped bytes":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return shard
    common = ckpt / "common.json"
    if case == "common.json not JSON":
        common.write_text(common.read_text()[:-30])
    elif case == "common.json of another model":
        state = json.loads(common.read_text())
        state["args"]["hidden_size"] = 32
        common.write_text(json.dumps(state))
    elif case == "shard missing, no digests":  # an older save: only .metadata's offsets
        state = json.loads(common.read_text())
        del state["files"]
        common.write_text(json.dumps(state))
        shard.unlink()
        return shard
    elif case == "truncated, no digests":
        state = json.loads(common.read_text())
        del state["files"]
        common.write_text(json.dumps(state))
        shard.write_bytes(shard.read_bytes()[:100])
        return shard
    return common


DAMAGE = {"truncated shard": "bytes, common.json records", "flipped bytes": "does not match the SHA-256 digest",
          "common.json not JSON": "is not JSON", "common.json of another model":
          "hidden_size (16) differs from the checkpoint's (32) in",
          "shard missing, no digests": "is missing (.metadata records chunks in it)",
          "truncated, no digests": "(a truncated file)"}


def test_a_crafted_metadata_never_runs_and_exits_2_naming_the_file(train_4d_script, tmp_path, monkeypatch,
                                                                     capsys):
    """A ``.metadata`` holding a pickled ``os.system`` call: DCP's ``pickle.load`` would run it
    in every worker; the restricted unpickler refuses it before any worker starts, and the
    workers' own reader (``CheckedFileSystemReader``) refuses it too."""
    from tutorial_lib.dist_checkpointing import CheckedFileSystemReader
    import tutorial_lib.train_4d

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker would have started")
    monkeypatch.setattr(tutorial_lib.train_4d, "train", no_workers)
    fake_save(tmp_path, 2)
    marker = tmp_path / "the command ran"
    metadata = tmp_path / "iter_0000002" / ".metadata"
    metadata.write_bytes(pickle.dumps(_RunsACommand(f"touch '{marker}'")))
    state = json.loads((tmp_path / "iter_0000002" / "common.json").read_text())
    state["files"] = checkpointing.file_digests(str(tmp_path / "iter_0000002"))  # a consistent forgery
    (tmp_path / "iter_0000002" / "common.json").write_text(json.dumps(state))
    assert train_4d_script.main(["--load", str(tmp_path), "--num-layers", "4", "--hidden-size", "16",
                        "--vocab-size", "32", "--seq-length", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train_4d.py: error: [checkpoint] {metadata} names posix.system"), err
    assert "Load only checkpoints you trust" in err
    with pytest.raises(ConfigError, match="names posix.system"):
        CheckedFileSystemReader(str(tmp_path / "iter_0000002")).read_metadata()
    assert not marker.exists()
    # what the unpickler admits is what DCP writes: a real save reads back whole
    fake_save(tmp_path, 4)
    found = checkpointing.verify_checkpoint(find_checkpoint(str(tmp_path)))
    assert [key for key in found.state_dict_metadata] == ["w"]


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_exits_2_naming_the_file(train_4d_script, tmp_path, monkeypatch, capsys, case):
    import tutorial_lib.train_4d

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker would have started")
    monkeypatch.setattr(tutorial_lib.train_4d, "train", no_workers)
    fake_save(tmp_path, 2)
    named = _damage(tmp_path, case)
    assert train_4d_script.main(["--load", str(tmp_path), "--num-layers", "4", "--hidden-size", "16",
                        "--vocab-size", "32", "--seq-length", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train_4d.py: error: [checkpoint]") and str(named) in err, err
    assert DAMAGE[case] in err, err
    assert "Traceback" not in err


def test_a_file_outside_the_checkpoint_is_refused(tmp_path):
    """``.metadata`` names the file of each chunk: a name with a folder in it would read
    outside the checkpoint."""
    fake_save(tmp_path, 2)
    found = find_checkpoint(str(tmp_path))
    metadata = checkpointing.read_dcp_metadata(os.path.join(found.path, ".metadata"))
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(os.path.join(found.path, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)
    state = dict(found.common)
    del state["files"]
    with pytest.raises(ConfigError, match=r"names the file '../../etc/passwd', outside"):
        checkpointing.verify_checkpoint(found._replace(common=state))


def test_keep_last_removes_older_committed_checkpoints_but_never_the_trackers(tmp_path):
    for iteration in (1, 2, 3):
        fake_save(tmp_path, iteration)
    fake_save(tmp_path, 4, commit=False)  # being written: not committed, not counted
    assert checkpointing.remove_old_checkpoints(str(tmp_path), 2) == [1]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000004.tmp",
                                            TRACKER_FILENAME]
    (tmp_path / TRACKER_FILENAME).write_text("2\n")  # --ckpt-step's world, say
    assert checkpointing.remove_old_checkpoints(str(tmp_path), 1) == []  # 2 is the tracker's
    assert checkpointing.remove_old_checkpoints(str(tmp_path), 3) == []


def test_the_sigterm_line_names_the_iteration_the_checkpoint_and_the_resume_command(train_4d_script,
                                                                                    tmp_path):
    args = replace(ARGS, save=str(tmp_path))
    fake_save(tmp_path, 3)
    line = train_4d_script.stopped(args, 3, ["--steps", "6", "--save", str(tmp_path)])
    assert line.startswith(f"train_4d.py: SIGTERM: stopped after iteration 3/6; last checkpoint: "
                           f"{tmp_path / 'iter_0000003'} (iteration 3); resume: python ")
    assert line.endswith(f"--steps 6 --save {tmp_path} --load {tmp_path}") and "\n" not in line
