"""``train_4d`` under the precision recipes fp32 / bf16 / deepseek_v3, on real gloo ranks.

One module fixture trains the default model (``TrainingArgs()``: 4 layers, hidden 32, 4
experts top-2, 5 steps) in every recipe on world 1, PP2 x EP2 (DP2), PP2 x TP2, and PP3
(6 layers, with a 6-layer world-1 reference), tracing every run.  Then:

* **The same collectives.**  On every rank, step 0 issues the same sequence of collectives
  and P2P ops under every recipe (op, group kind, group, peer, tags, order); shapes and bytes
  change only on the MoE all-to-alls' token rows, whose bytes are ``rows x
  fp8.wire_bytes_per_row(H, precision)`` with V3's precisions (dispatch FP8 forward, combine
  FP8 backward, both with power-of-two scales sent as fp32, the other two BF16).
* **The cost of the recipe.**  Measured (max |loss difference| over the 5 steps, per
  layout): bf16 vs fp32 1.8e-4 .. 6.9e-4, deepseek_v3 vs bf16 1.3e-3 .. 2.3e-3.  Limits:
  0.005 and 0.02.  Each recipe must also *change* the losses (bf16 vs fp32 > 2e-5,
  deepseek_v3 vs bf16 > 2e-4), or the recipe was not applied.
* **Layout independence under reduced precision** holds to rounding where the weights are
  equal, not beyond.  At step 0 (identical weights) every layout's loss equals world 1's to
  1e-5 under bf16 (rounding is elementwise; measured <= 2e-7), and under deepseek_v3 when
  TP = 1 (1x128 tiles are per token and experts are blocked one by one, so PP, EP and DP do
  not regroup anything; measured <= 2e-7).  With TP = 2 FP8's first loss differs, measured
  7.5e-4 (PP2 x TP2 and TP2 alone alike): each TP shard of a weight gets its own
  128x128-block scale, each row-parallel input its own 1x128 tile scales.  Held to the band
  3e-4 .. 1.5e-3 that chapter 8 states and asserts (:data:`TP_FP8_FIRST_STEP`).  After an update, DP and TP sum gradients in another order;
  the fp32 difference (~1e-7) moves a weight across a BF16 / FP8 rounding boundary now
  and then, so the losses drift apart: measured max over 5 steps bf16 1.0e-4, deepseek_v3
  7.8e-4 (fp32: 3e-7).  Limit: 0.005 for every layout and recipe.
* ``examples/train_4d.py``: an unknown ``--precision-recipe`` exits with status 2 before a
  worker starts; a JSON recipe file works from the flag and from a ``--config`` file.

About 45 s on 2 cores.
"""
import json
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest

from tutorial_lib import fp8, precision
from tutorial_lib.config import ConfigError
from tutorial_lib.deepseek import DeepSeekModel
from tutorial_lib.moe import MoELayer
from tutorial_lib.launch import launch
from tutorial_lib.train_4d import TrainingArgs, build_chunks, validate_args
from tests.asserts import every

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_4d.py"
RECIPES = ("fp32", "bf16", "deepseek_v3")
LAYOUTS = {  # name -> (TrainingArgs overrides, the world-1 reference layout)
    "world 1": (dict(world_size=1), "world 1"),
    "PP2 x EP2": (dict(world_size=4, pipeline_model_parallel_size=2, expert_model_parallel_size=2),
                  "world 1"),
    "PP2 x TP2": (dict(world_size=4, pipeline_model_parallel_size=2, tensor_model_parallel_size=2),
                  "world 1"),
    "world 1, 6 layers": (dict(world_size=1, num_layers=6), "world 1, 6 layers"),
    "PP3": (dict(world_size=3, pipeline_model_parallel_size=3, num_layers=6), "world 1, 6 layers"),
}
BF16_VS_FP32, V3_VS_BF16, ACROSS_LAYOUTS, SAME_WEIGHTS = 0.005, 0.02, 0.005, 1e-5
TP_FP8_FIRST_STEP = (3e-4, 1.5e-3)
"""|first loss, TP = 2 - first loss, world 1| under deepseek_v3 (measured 7.5e-4); the band
chapter 8 asserts for its own TP = 2 run: per-shard scales move the loss by this much,
deterministically for a given machine (the band leaves room for another CPU's matmul
rounding)."""
V3_WIRE = {("dispatch", "forward"): "fp8_pow2", ("combine", "forward"): "bf16",
           ("combine", "backward"): "fp8_pow2", ("dispatch", "backward"): "bf16"}


def _each_recipe(ctx, layouts):
    """train_4d's worker on each layout of ``layouts`` (name -> args) under each recipe, one
    after the other on these ranks, each run's events tagged with its layout and recipe."""
    from tutorial_lib.train_4d import train_worker
    out = {}
    for layout, args in layouts.items():
        for recipe in RECIPES:
            with ctx.tracer.tags(layout=layout, recipe=recipe):
                out[layout, recipe] = train_worker(ctx, replace(args, precision_recipe=recipe))
    return out


@pytest.fixture(scope="module")
def runs():
    """``(layout, recipe) -> (rank 0's losses, the run's trace)``: one launch per world size
    trains its layouts' three recipes one after the other (3 launches for 5 layouts), each
    run checked first as ``train`` checks it before it launches."""
    by_world: dict[int, dict[str, TrainingArgs]] = {}
    for layout, (overrides, _) in LAYOUTS.items():
        args = TrainingArgs(**overrides)
        for recipe in RECIPES:
            validate_args(replace(args, precision_recipe=recipe))
        by_world.setdefault(args.world_size, {})[layout] = args
    out = {}
    for world, layouts in by_world.items():
        result = launch(_each_recipe, world, args=(layouts,), trace=True,
                        timeout=300 * len(RECIPES) * len(layouts), print_output=False)
        for layout in layouts:
            for recipe in RECIPES:
                out[layout, recipe] = ([r["loss"] for r in result.results[0][layout, recipe]],
                                       result.trace.filter(layout=layout, recipe=recipe))
    return out


def _losses(runs, layout, recipe):
    return runs[layout, recipe][0]


def _max_gap(a, b):
    assert len(a) == len(b) == TrainingArgs().steps
    return max(abs(x - y) for x, y in zip(a, b))


# --- the same collectives ----------------------------------------------------------------

_SIGNATURE_TAGS = ("op_name", "phase", "payload", "p2p_op", "microbatch", "chunk")


def _is_token_rows(e):
    return e.op == "all_to_all" and e.tags.get("payload") == "tokens"


def _step_0(trace, rank):
    return [e for e in trace.filter(rank=rank, step=0, comm_only=True)]


@pytest.mark.parametrize("layout", ["PP2 x EP2", "PP2 x TP2", "PP3"])
def test_every_rank_issues_the_same_collectives_under_every_recipe(runs, layout):
    world = LAYOUTS[layout][0]["world_size"]
    hidden = TrainingArgs().hidden_size
    for rank in range(world):
        reference = _step_0(runs[layout, "bf16"][1], rank)
        assert reference, (layout, rank)
        for recipe in ("fp32", "deepseek_v3"):
            events = _step_0(runs[layout, recipe][1], rank)
            assert [(e.op, e.group_kind, e.group_ranks, e.peer, *(e.tags.get(t) for t in _SIGNATURE_TAGS))
                    for e in events] == \
                   [(e.op, e.group_kind, e.group_ranks, e.peer, *(e.tags.get(t) for t in _SIGNATURE_TAGS))
                    for e in reference], (layout, rank, recipe)
            for e, ref in zip(events, reference):
                if not _is_token_rows(e):  # everything but the MoE token rows is untouched
                    assert (e.shape, e.dtype, e.bytes) == (ref.shape, ref.dtype, ref.bytes), (layout, rank, e)
        # the token rows travel as the recipe says, bytes by the formula
        for recipe in ("bf16", "deepseek_v3"):
            token_rows = [e for e in _step_0(runs[layout, recipe][1], rank) if _is_token_rows(e)]
            for e in token_rows:
                wire = "bf16" if recipe == "bf16" else V3_WIRE[e.tags["op_name"], e.tags["phase"]]
                assert e.tags["precision"] == wire, (layout, rank, e)
                assert e.bytes == sum(e.splits["input"]) * fp8.wire_bytes_per_row(hidden, wire)
            if LAYOUTS[layout][0].get("expert_model_parallel_size", 1) > 1:
                assert len({e.tags["precision"] for e in token_rows}) == (2 if recipe == "deepseek_v3" else 1)


def test_the_layout_with_ep_really_moves_fp8_rows(runs):
    """The check above is not vacuous: PP2 x EP2 sends token rows, and V3 sends half in FP8."""
    trace = runs["PP2 x EP2", "deepseek_v3"][1]
    rows = [e for e in trace.filter(step=0, op="all_to_all", payload="tokens")]
    assert len(rows) >= 4 * 4 and {e.dtype for e in rows} == {"uint8", "bfloat16"}


# --- the cost of the recipe ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["world 1", "PP2 x EP2", "PP2 x TP2", "PP3"])
def test_recipes_stay_within_the_stated_distance_and_change_the_losses(runs, layout):
    fp32, bf16, v3 = (_losses(runs, layout, r) for r in RECIPES)
    assert 2e-5 < _max_gap(bf16, fp32) < BF16_VS_FP32, (layout, fp32, bf16)
    assert 2e-4 < _max_gap(v3, bf16) < V3_VS_BF16, (layout, bf16, v3)
    assert fp32[-1] < fp32[0] and v3[-1] < v3[0]  # it still learns


# --- layout independence --------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", ["PP2 x EP2", "PP2 x TP2", "PP3"])
def test_layouts_agree_to_rounding_at_step_0_and_closely_after(runs, layout, recipe):
    reference = _losses(runs, LAYOUTS[layout][1], recipe)
    losses = _losses(runs, layout, recipe)
    first = abs(losses[0] - reference[0])
    if recipe == "deepseek_v3" and LAYOUTS[layout][0].get("tensor_model_parallel_size", 1) > 1:
        low, high = TP_FP8_FIRST_STEP  # per-shard FP8 scales (see above)
        assert low < first < high, first
    else:
        assert first < SAME_WEIGHTS, (layout, recipe, first)
    limit = 1e-5 if recipe == "fp32" else ACROSS_LAYOUTS
    assert _max_gap(losses, reference) < limit, (layout, recipe, losses, reference)


# --- build_chunks ---------------------------------------------------------------------------


def test_fp32_leaves_the_chunks_as_built_and_a_recipe_reaches_every_chunk():
    def simulated(chunks):
        return {name for c in chunks for name, m in c.named_modules() if hasattr(m, "matmul_precision")}

    def wires(chunks):
        return [m.dispatcher.dispatch_precision for c in chunks for m in c.modules() if isinstance(m, MoELayer)]

    plain = build_chunks(TrainingArgs())
    assert simulated(plain) == set() and wires(plain) == [None, None, None]
    assert every(not m._forward_hooks and not m._forward_pre_hooks for m in plain[0].modules())
    # two chunks per rank (interleaved), so a recipe applied to the first only would show here
    args = TrainingArgs(precision_recipe="deepseek_v3", schedule="interleaved",
                        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2)
    chunks = build_chunks(args)
    assert len(chunks) == 2 and all(isinstance(c, DeepSeekModel) for c in chunks)
    names = simulated(chunks)
    assert "layers.0.self_attention.linear_qkv" in names and "layers.3.mlp.experts" in names
    assert "layers.3.mlp.router" not in names  # the router stays fp32
    assert wires(chunks) == [fp8.DEEPSEEK_V3_DISPATCH] * 3


# --- validation and the command line --------------------------------------------------------


def test_unknown_or_broken_recipes_are_refused_before_any_worker_starts(tmp_path, monkeypatch, capsys,
                                                                      train_4d_script):
    with pytest.raises(ConfigError, match="fp32, bf16, deepseek_v3"):
        validate_args(TrainingArgs(precision_recipe="nope"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"base": "deepseek_v3", "rules": [["layers.0.*", "fp4"]]}')
    with pytest.raises(ConfigError, match="fp4"):
        validate_args(TrainingArgs(precision_recipe=str(broken)))
    train_4d = train_4d_script

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")
    # the command line takes train() from tutorial_lib.train_4d once the arguments are valid
    monkeypatch.setattr("tutorial_lib.train_4d.train", no_workers)
    monkeypatch.setattr(train_4d, "run_under_torchrun", no_workers)
    for value in ("nope", str(broken), str(tmp_path)):
        assert train_4d.main(["--precision-recipe", value]) == 2
        assert "precision recipe" in capsys.readouterr().err


def test_the_config_file_can_carry_the_recipe(tmp_path, train_4d_script):
    train_4d = train_4d_script
    for name, text in (("c.json", '{"precision-recipe": "bf16"}'), ("c.toml", 'precision_recipe = "bf16"')):
        (tmp_path / name).write_text(text)
        args, _ = train_4d.parse_args(["--config", str(tmp_path / name)])
        assert args.precision_recipe == "bf16"
        args, _ = train_4d.parse_args(["--config", str(tmp_path / name), "--precision-recipe", "fp32"])
        assert args.precision_recipe == "fp32"  # the command line wins


def test_train_4d_exits_2_on_an_unknown_recipe():
    done = subprocess.run([sys.executable, str(SCRIPT), "--precision-recipe", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "unknown precision_recipe 'nope'" in done.stderr and "fp32, bf16, deepseek_v3" in done.stderr
    assert "step" not in done.stdout


def test_train_4d_trains_with_a_json_recipe_file(runs, tmp_path):
    """deepseek_v3 from a file, named in a --config file: the losses of the named recipe."""
    recipe = tmp_path / "v3.json"
    recipe.write_text(json.dumps({"base": "deepseek_v3", "name": "v3_from_a_file"}))
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"world_size": 1, "steps": 3, "precision_recipe": str(recipe)}))
    assert precision.recipe_from_file(str(recipe)).rules == precision.RECIPES["deepseek_v3"].rules
    done = subprocess.run([sys.executable, str(SCRIPT), "--config", str(config), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [json.loads(line)["loss"] for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(losses) == 3  # the first 3 of the fixture's 5 steps (a constant learning rate)
    named, fp32 = _losses(runs, "world 1", "deepseek_v3")[:3], _losses(runs, "world 1", "fp32")[:3]
    assert max(abs(a - b) for a, b in zip(losses, named)) < 1e-6
    assert max(abs(a - b) for a, b in zip(losses, fp32)) > 2e-4  # the file really applied FP8
