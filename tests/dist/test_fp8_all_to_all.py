"""FP8 all-to-all and the MoE layer with FP8 communication, on 4 real gloo ranks.

One launch (EP = 4, Megatron layout) runs three parts; the checks run in the test process:

* ``fp8.all_to_all`` of rows with uneven splits (a zero split included) in every precision,
  forward and backward: the bytes each traced event reports equal ``rows x
  wire_bytes_per_row`` (``H + 4H/128`` for ``fp8`` and ``fp8_pow2``, ``H + H/128`` for
  ``fp8_ue8m0``), and what
  arrives is bit for bit the sender's rows encoded and decoded;
* the MoE layer with row precisions fp32 (the default), bf16, DeepSeek-V3's and all-FP8:
  every rank issues the same collectives in the same order (op, group, tags, splits) in
  every setting; only dtype and bytes change, and the counts stay int64.  Outputs and
  gradients against the serial layer of the same precision (the numbers do not depend on
  EP) and against the fp32 layer (the cost of FP8 communication);
* a small model named like ``DeepSeekModel`` (EP = 2 inside the world of 4) under the
  ``bf16`` and ``deepseek_v3`` recipes: the same sequence of collectives.

Tolerances, stated: same precision, EP 4 vs serial: relative Frobenius difference
< 1e-3 (the experts batch their rows differently, so a value can land on the other side of a
rounding boundary now and then: one BF16 or FP8 step on a few elements); FP8 communication
vs fp32: relative Frobenius error of the output and input gradient < 0.025 (measured about
0.012 with V3's setting), BF16 communication vs fp32 < 0.002; an expert's weight gradient
multiplies two rounded tensors (its input rows and the gradients sent to it), so it gets 3x
those limits (measured about 0.045 with FP8, 0.003 with BF16).
"""
import sys

import cloudpickle
import pytest
import torch

from tutorial_lib import fp8, moe, parallel_state, precision, timing
from tutorial_lib.config import ParallelConfig
from tutorial_lib.launch import launch

from ..tiny_deepseek import TinyDeepSeek

pytestmark = pytest.mark.dist

cloudpickle.register_pickle_by_value(sys.modules[__name__])

EP = 4
H, N, K, FFN = 256, 8, 2, 64
SPLITS = [[3, 0, 5, 2], [1, 4, 0, 6], [2, 2, 2, 2], [0, 7, 1, 0]]  # rows rank i sends to rank j
SETTINGS = {
    "fp32": (None, None),
    "bf16": (("bf16", "bf16"), ("bf16", "bf16")),
    "deepseek_v3": (fp8.DEEPSEEK_V3_DISPATCH, fp8.DEEPSEEK_V3_COMBINE),
    "all_fp8": (fp8.FP8_DISPATCH, fp8.FP8_COMBINE),
}


def _rows(rank, hidden, what):
    g = torch.Generator().manual_seed(1000 * rank + hidden + (7 if what == "grad" else 0))
    n = sum(SPLITS[rank]) if what == "x" else sum(SPLITS[j][rank] for j in range(EP))
    return torch.randn(n, hidden, generator=g) * 2


def _raw_all_to_all(ctx):
    out = {}
    rank = ctx.rank
    ins, outs = SPLITS[rank], [SPLITS[j][rank] for j in range(EP)]
    for hidden in (256, 384):
        for p in fp8.PRECISIONS:
            x = _rows(rank, hidden, "x").requires_grad_()
            with ctx.tracer.tags(part="raw", hidden=hidden):
                y = fp8.all_to_all(x, "ep", outs, ins, "dispatch", precision=(p, p))
                y.backward(_rows(rank, hidden, "grad"))
            out[(hidden, p)] = (y.detach(), x.grad)
    return out


def _moe_layers(ctx):
    g = torch.Generator().manual_seed(ctx.rank)
    x0, dy = torch.randn(8, 2, H, generator=g), torch.randn(8, 2, H, generator=g)
    out = {}
    for name, (dispatch, combine) in SETTINGS.items():
        res = {}
        for serial in (False, True):
            extra = dict(ep_group=None, tp_group=None) if serial else {}
            layer = moe.MoELayer(H, N, K, FFN, num_shared_experts=1, seed=3,
                                 dispatch_precision=dispatch, combine_precision=combine, **extra)
            x = x0.clone().requires_grad_()
            with ctx.tracer.tags(part="moe", setting=name, serial=serial):
                y, info = layer(x)
                (y * dy).sum().backward()
            res["serial" if serial else "ep"] = {
                "y": y.detach(), "dx": x.grad, "gates": info["gates"],
                "expert_grad": layer.experts.weight_up.grad.clone()}
        out[name] = res
    return out


def _tiny_model(ctx):
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (6, 2), generator=torch.Generator().manual_seed(ctx.rank))
    losses = {}
    for recipe in ("bf16", "deepseek_v3"):
        torch.manual_seed(0)
        model = TinyDeepSeek(num_layers=2, ep_group="ep", moe_seed=5)
        precision.apply_recipe(model, recipe)
        with ctx.tracer.tags(part="model", recipe=recipe):
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
        losses[recipe] = loss.item()
    return losses


def _work(ctx):
    parallel_state.initialize_model_parallel(ParallelConfig(EP, expert_model_parallel_size=EP))
    results = {"raw": _raw_all_to_all(ctx), "moe": _moe_layers(ctx)}
    parallel_state.initialize_model_parallel(ParallelConfig(EP, expert_model_parallel_size=2))
    results["model"] = _tiny_model(ctx)
    return results


@pytest.fixture(scope="module")
def run():
    return launch(_work, EP, timeout=120)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# --- the raw all-to-all -----------------------------------------------------------------


@pytest.mark.parametrize("p", fp8.PRECISIONS)
@pytest.mark.parametrize("hidden", [256, 384])
def test_bytes_on_the_wire_equal_the_formula(run, p, hidden):
    per_row = {"fp32": 4 * hidden, "bf16": 2 * hidden, "fp8": hidden + 4 * hidden // 128,
               "fp8_pow2": hidden + 4 * hidden // 128, "fp8_ue8m0": hidden + hidden // 128}[p]
    events = run.trace.filter(op="all_to_all", part="raw", hidden=hidden, precision=p)
    assert len(events) == 2 * EP  # one forward and one backward per rank
    for e in events:
        sent = SPLITS[e.rank] if e.tags["phase"] == "forward" else [SPLITS[j][e.rank] for j in range(EP)]
        assert e.splits["input"] == sent
        assert e.bytes == sum(sent) * per_row == sum(sent) * fp8.wire_bytes_per_row(hidden, p)
        assert e.dtype == {"fp32": "float32", "bf16": "bfloat16"}.get(p, "uint8")
    if p == "fp8":
        assert per_row / (2 * hidden) == pytest.approx(0.515625)


@pytest.mark.parametrize("p", fp8.PRECISIONS)
def test_what_arrives_is_the_senders_rows_encoded_and_decoded(run, p):
    hidden = 384
    for rank in range(EP):
        y, dx = run.results[rank]["raw"][(hidden, p)]
        expected = []
        for src in range(EP):
            rows = _rows(src, hidden, "x")
            start = sum(SPLITS[src][:rank])
            expected.append(rows[start:start + SPLITS[src][rank]])
        expected = fp8.decode(fp8.encode(torch.cat(expected), p), p, hidden, torch.float32)
        assert torch.equal(y, expected), (rank, p)
        # backward: my rows' gradients come back from where they went, in the backward precision
        back = []
        for dst in range(EP):
            grad = _rows(dst, hidden, "grad")
            start = sum(SPLITS[j][dst] for j in range(rank))
            back.append(grad[start:start + SPLITS[rank][dst]])
        assert torch.equal(dx, fp8.decode(fp8.encode(torch.cat(back), p), p, hidden, torch.float32))


# --- the MoE layer ----------------------------------------------------------------------


def _signature(trace, rank, setting):
    """What must not change with the precision: every collective's op, group, tags and splits."""
    out = []
    for e in trace.filter(rank=rank, part="moe", setting=setting, serial=False, comm_only=True):
        out.append((e.op, e.group_kind, e.group_ranks, e.tags.get("op_name"), e.tags.get("phase"),
                    e.tags.get("payload"), tuple(e.splits["input"]) if e.splits else None,
                    tuple(e.splits["output"]) if e.splits else None))
    return out


def test_every_rank_issues_the_same_collectives_in_every_precision(run):
    for rank in range(EP):
        reference = _signature(run.trace, rank, "bf16")
        assert len(reference) == 5  # counts, dispatch, combine, combine's and dispatch's backward
        for setting in SETTINGS:
            assert _signature(run.trace, rank, setting) == reference, (rank, setting)


def test_deepseek_v3_default_precisions_on_the_wire(run):
    """V3's FP8 legs carry power-of-two scales as fp32 (see tests/unit/test_precision.py's
    test_deepseek_v3_sends_fp8_legs_with_power_of_two_scales_as_fp32_numbers for the sources):
    uint8 rows of H + 4H/128 bytes on every rank."""
    assert fp8.DEEPSEEK_V3_DISPATCH == ("fp8_pow2", "bf16")
    assert fp8.DEEPSEEK_V3_COMBINE == ("bf16", "fp8_pow2")
    for rank in range(EP):
        events = run.trace.filter(rank=rank, part="moe", setting="deepseek_v3", serial=False,
                                  op="all_to_all")
        got = {(e.tags["op_name"], e.tags["phase"], e.tags["payload"]): (e.dtype, e.tags.get("precision"))
               for e in events}
        assert got == {("dispatch", "forward", "counts"): ("int64", None),
                       ("dispatch", "forward", "tokens"): ("uint8", "fp8_pow2"),
                       ("combine", "forward", "tokens"): ("bfloat16", "bf16"),
                       ("combine", "backward", "tokens"): ("uint8", "fp8_pow2"),
                       ("dispatch", "backward", "tokens"): ("bfloat16", "bf16")}, rank
        for e in events:
            rows = sum(e.splits["input"])
            if e.tags["payload"] == "tokens":
                assert e.bytes == rows * fp8.wire_bytes_per_row(H, e.tags["precision"])
                if e.dtype == "uint8":
                    assert e.bytes == rows * (H + 4 * H // 128)


def test_fp32_default_is_untouched(run):
    """The default moves fp32 rows through the old path: no precision tag, 4H bytes per row."""
    for e in run.trace.filter(part="moe", setting="fp32", op="all_to_all", payload="tokens"):
        assert e.dtype == "float32" and "precision" not in e.tags
        assert e.bytes == sum(e.splits["input"]) * 4 * H


def test_ep_layer_equals_the_serial_layer_of_the_same_precision(run):
    for rank in range(EP):
        for setting in SETTINGS:
            ep, serial = run.results[rank]["moe"][setting]["ep"], run.results[rank]["moe"][setting]["serial"]
            limit = 1e-5 if setting == "fp32" else 1e-3
            assert _rel(ep["y"], serial["y"]) < limit, (rank, setting)
            assert _rel(ep["dx"], serial["dx"]) < limit, (rank, setting)


def test_fp8_communication_stays_close_to_fp32_and_gates_are_never_quantized(run):
    errors = {}
    for rank in range(EP):
        moe_run = run.results[rank]["moe"]
        ref = moe_run["fp32"]["ep"]
        for setting, limit in (("bf16", 0.002), ("deepseek_v3", 0.025), ("all_fp8", 0.025)):
            got = moe_run[setting]["ep"]
            errors[(rank, setting)] = (_rel(got["y"], ref["y"]), _rel(got["dx"], ref["dx"]),
                                       _rel(got["expert_grad"], ref["expert_grad"]))
            y_err, dx_err, weight_err = errors[(rank, setting)]
            assert max(y_err, dx_err) < limit and weight_err < 3 * limit, (rank, setting, errors[(rank, setting)])
            assert got["gates"].dtype == torch.float32
            assert torch.equal(got["gates"], ref["gates"])  # the router never sees the wire
        # FP8 really changed the numbers (the test could fail): more than BF16 did
        assert errors[(rank, "deepseek_v3")][0] > 3 * errors[(rank, "bf16")][0]
        # sending the combine in FP8 too adds error on top of V3's setting
        assert errors[(rank, "all_fp8")][0] > errors[(rank, "deepseek_v3")][0]


# --- a model under a recipe ---------------------------------------------------------------


def test_a_recipe_does_not_change_the_collectives_of_a_model(run):
    for rank in range(EP):
        sig = {}
        for recipe in ("bf16", "deepseek_v3"):
            events = run.trace.filter(rank=rank, part="model", recipe=recipe, comm_only=True)
            sig[recipe] = [(e.op, e.group_kind, e.group_ranks, e.tags.get("op_name"),
                            e.tags.get("phase"), e.tags.get("payload"),
                            tuple(e.splits["input"]) if e.splits else None) for e in events]
        assert len(sig["bf16"]) == 5 and sig["bf16"] == sig["deepseek_v3"], rank
        v3 = run.trace.filter(rank=rank, part="model", recipe="deepseek_v3", op="all_to_all",
                              payload="tokens")
        assert sorted(e.dtype for e in v3) == ["bfloat16", "bfloat16", "uint8", "uint8"]
        losses = run.results[rank]["model"]
        assert abs(losses["bf16"] - losses["deepseek_v3"]) < 0.05 * losses["bf16"], losses


# --- timing.time_all_to_all: chapter 8's timing (its numbers are not asserted: only its bytes)


def test_the_chapters_timing_reports_the_traced_bytes_of_both_precisions():
    rows = timing.time_all_to_all(hiddens=(128, 384), rows_per_rank=32, ranks=4, repeats=1)
    assert [r["hidden"] for r in rows] == [128, 384]
    for r in rows:
        assert r["bf16_bytes"] == 32 * fp8.wire_bytes_per_row(r["hidden"], "bf16")
        assert r["fp8_bytes"] == 32 * fp8.wire_bytes_per_row(r["hidden"], "fp8")
        assert r["bf16_ms"] > 0 and r["fp8_ms"] > 0
    with pytest.raises(ValueError, match="multiple of ranks"):
        timing.time_all_to_all(rows_per_rank=30)
