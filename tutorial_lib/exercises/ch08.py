"""Checkers for chapter 8, FP8 communication on the expert-parallel path.

* :func:`check_quantize_1x128`: the student's ``fn(x)`` returns ``(q, scales)`` for
  ``x [T, H]``: E4M3 values and one scale per token per 128 channels.  Compared with
  :func:`tutorial_lib.fp8.quantize_1x128` after dequantization (one E4M3 step of slack, so
  ``x * (448 / amax)`` and ``x / (amax / 448)`` both pass).  The student's code runs with
  the casts to ``float8_e4m3fn`` made non-saturating (:class:`NonSaturatingCast`: a value
  beyond +-448 becomes NaN, as the cast does on some builds and devices; this CPU build
  saturates), and one case has a tile whose largest value divides to just above 448 in
  float32, so a quantizer without the clamp fails.  Per-tensor or per-token scales, the
  scale turned upside down, no amax floor, no clamp and rounding to integers instead of
  E4M3 each get a hint; scales of the wrong shape (tiles along the tokens, say) get the
  format hint.  A failing case says what is wrong (NaN values, scales that are not their
  tile's amax / 448), never the reference's scales.
* :func:`check_payload_bytes`: bytes of one rank's dispatch all-to-all for ``T`` tokens,
  top-``K``, hidden ``H``, in each precision (the trace's convention: every copy, the
  rank's own included), against :func:`tutorial_lib.fp8.wire_bytes_per_row`.
* :func:`check_keep_ends_in_bf16`: the student's ``fn(base, num_layers)`` returns a recipe
  that runs in BF16 what ``base`` runs in FP8 in the first and the last layer (matmuls and
  the MoE communication) and changes nothing else: the modules ``base`` keeps in higher
  precision keep it, in the end layers too (the router and the layernorms stay fp32).
  Rules are tried in order and the first match wins, so end-layer rules put *before*
  the base's also catch those modules and demote them; that is a named mistake.  Checked
  on the module names of models of 2 to 61 layers.

Student code never makes a checker raise: exceptions and stubs become failed cases.
"""
from __future__ import annotations

import copy

from .kit import Case, Checking, CheckResult, Mistakes, check_formula

# --- hints ----------------------------------------------------------------------------------

HINT_Q_FORMAT = (
    "return a pair (q, scales): q with x's shape (torch.float8_e4m3fn values, or their float "
    "values) and scales of shape [T, H // 128], one per token per 128 channels (a tile is 1 "
    "token x 128 channels, not 128 tokens x 1 channel)."
)
HINT_Q_PER_TENSOR = (
    "you used one scale for the whole tensor. DeepSeek-V3 gives every token its own scale for "
    "each tile of 128 channels: amax over x.view(T, H // 128, 128) along the last dimension."
)
HINT_Q_PER_TOKEN = (
    "you used one scale per token (amax over all H channels). The tile is 1x128: each token "
    "has H // 128 scales, one per block of 128 consecutive channels, so an outlier channel "
    "only coarsens its own tile."
)
HINT_Q_INVERTED = (
    "your scale is upside down (448 / amax). Use scale = amax / 448, q = x / scale, so that "
    "x ~= q * scale and the largest value of each tile lands on 448."
)
HINT_Q_NO_FLOOR = (
    "a token of zeros gave a zero scale, and 0 / 0 = NaN. Clamp amax to at least "
    "fp8.AMAX_FLOOR (1e-4) before dividing by 448."
)
HINT_Q_NO_CLAMP = (
    "a tile's largest value divided by its scale came out just above 448 in float32 "
    "(x / (amax / 448) rounds), and you cast it without clamping: the cast to "
    "float8_e4m3fn saturates on this CPU build but gives NaN on others (this checker casts "
    "as those do). Clamp to +-448 before the cast."
)
HINT_Q_INTEGERS = (
    "your q values are whole numbers: round by casting to torch.float8_e4m3fn (3 mantissa "
    "bits: 0.1171875 is a value, 0.1 is not), after clamping to +-448, not with torch.round."
)
HINT_Q_GENERIC = (
    "re-read 'Tiles and scales' and 'E4M3, and why the library clamps': reconsider which "
    "values share one scale, what that scale maps the tile's largest magnitude to, and what "
    "happens to values beyond E4M3's range."
)

HINT_BYTES_FORMAT = "return one number: the bytes this rank's dispatch all-to-all moves."
HINT_BYTES_NO_SCALES = (
    "you left out the scales: each token copy carries one scale per 128 channels beside its H "
    "FP8 bytes (4 bytes each as fp32, 1 byte each as a power-of-two exponent)."
)
HINT_BYTES_ONE_SCALE = (
    "you counted one scale per token copy. There is one per tile of 128 channels: H / 128 of "
    "them per copy."
)
HINT_BYTES_SCALE_SIZE = (
    "the scale sizes are swapped: 'fp8' sends fp32 scales (4 bytes per tile), 'fp8_ue8m0' a "
    "one-byte exponent per tile."
)
HINT_BYTES_POW2_AS_ONE_BYTE = (
    "'fp8_pow2' rounds each scale to a power of two but still sends it as an fp32 number, 4 "
    "bytes per tile (DeepSeek-V3's dispatch, as DeepEP takes the scales); only 'fp8_ue8m0' "
    "packs the exponent into one byte."
)
HINT_BYTES_TOKENS = (
    "you counted tokens, not token copies: each token goes to K experts, so the dispatch sends "
    "T * K rows."
)
HINT_BYTES_BITS = "you counted bits: divide by 8 (a byte per FP8 value, 2 per BF16, 4 per fp32)."
HINT_BYTES_ELEMENT = (
    "check the bytes per element: fp32 4, bf16 2, FP8 1 (+ scales)."
)
HINT_BYTES_GENERIC = (
    "bytes = T * K * row, with row = 4H (fp32), 2H (bf16), H + 4 H/128 (fp8 and fp8_pow2), "
    "H + H/128 (fp8_ue8m0)."
)

HINT_ENDS_FORMAT = (
    "return a PrecisionRecipe (e.g. dataclasses.replace(base, rules=[...] + base.rules))."
)
HINT_ENDS_MUTATED = (
    "your function changed the recipe it was given. Build a new one: "
    "dataclasses.replace(base, rules=new_rules + list(base.rules))."
)
HINT_ENDS_LAST = (
    "the last layer is still FP8: layers are numbered from 0, so the last one is "
    "layers.{num_layers - 1}."
)
HINT_ENDS_FIRST = "layer 0 is still FP8: keep the first layer (layers.0.*) in BF16 too."
HINT_ENDS_MOE = (
    "the MoE parts of an end layer are still FP8: its experts, shared experts and dispatcher "
    "(the name layers.<i>.mlp.dispatcher decides the dispatch and combine precision). A rule "
    "such as ('layers.<i>.*', 'bf16') after the base's rules covers them all."
)
HINT_ENDS_TOO_MUCH = (
    "you changed layers between the first and the last (or the embedding, head or defaults): "
    "everything but the two end layers must stay exactly as in the base recipe."
)
HINT_ENDS_DEMOTED = (
    "the first matching rule wins, and your end-layer rules come before the base's: "
    "'layers.<i>.*' now also catches that layer's router and layernorms, which the base "
    "keeps in fp32 ('*.router', '*layernorm'), and demotes them to bf16. Put your rules "
    "after the base's (list(base.rules) + yours): the base's exceptions match first, and "
    "only what would fall to the fp8 default reaches your rules."
)
HINT_ENDS_GENERIC = (
    "append ('layers.0.*', 'bf16') and (f'layers.{num_layers - 1}.*', 'bf16') after the base "
    "recipe's rules: the first matching rule wins, so the router, norms and attention core "
    "keep the base's precision and the rest of the two layers (fp8 by default) turns bf16."
)

#: The mistakes of exercise 8.1, in order of preference: a wrong format, an inverted scale
#: or integer values on any case; the wrong scales only when they explain every case.
QUANTIZE_HINTS = Mistakes(
    HINT_Q_GENERIC, any_case={"format", "inverted", "integers"}, format=HINT_Q_FORMAT,
    inverted=HINT_Q_INVERTED, integers=HINT_Q_INTEGERS, no_floor=HINT_Q_NO_FLOOR,
    no_clamp=HINT_Q_NO_CLAMP,
    per_tensor=HINT_Q_PER_TENSOR, per_token=HINT_Q_PER_TOKEN)
#: The mistakes of exercise 8.2, in order of preference (their counts: ``_payload_mistakes``).
PAYLOAD_HINTS = Mistakes(
    HINT_BYTES_GENERIC, any_case={"format"}, format=HINT_BYTES_FORMAT,
    no_scales=HINT_BYTES_NO_SCALES, one_scale=HINT_BYTES_ONE_SCALE,
    scale_size=HINT_BYTES_SCALE_SIZE, pow2_as_one_byte=HINT_BYTES_POW2_AS_ONE_BYTE,
    tokens=HINT_BYTES_TOKENS, bits=HINT_BYTES_BITS,
    element=HINT_BYTES_ELEMENT)
#: The mistakes of exercise 8.3, in order of preference (found by ``_ends_problems``).
ENDS_HINTS = Mistakes(
    HINT_ENDS_GENERIC, any_case={"format"}, format=HINT_ENDS_FORMAT, mutated=HINT_ENDS_MUTATED,
    too_much=HINT_ENDS_TOO_MUCH, demoted=HINT_ENDS_DEMOTED, last=HINT_ENDS_LAST,
    first=HINT_ENDS_FIRST, moe=HINT_ENDS_MOE)


# --- exercise 8.1: 1x128 quantization ------------------------------------------------------


#: A float32 value v for which v / (v / 448) is 448.00003 in float32 arithmetic.
ROUNDS_ABOVE_448 = 7.682218074798584


def quantize_cases():
    """(name, x) for every case the checker tries."""
    import torch
    g = torch.Generator().manual_seed(8)
    above = torch.rand(2, 256, generator=g) * 2 - 1
    above[1, 130] = ROUNDS_ABOVE_448
    outlier = torch.randn(3, 384, generator=g)
    outlier[:, 200] = 1e3
    zeros = torch.randn(4, 256, generator=g)
    zeros[2] = 0
    return [
        ("4 tokens x 256 channels, N(0, 1)", torch.randn(4, 256, generator=g)),
        ("3 tokens x 384, channel 200 is 1000", outlier),
        ("4 tokens x 256, token 2 all zeros", zeros),
        ("2 tokens x 128, tiny values (amax 1e-6)", torch.randn(2, 128, generator=g) * 1e-6),
        ("256 tokens x 128, N(0, 25)", torch.randn(256, 128, generator=g) * 5),
        ("1 token x 1024, bf16", torch.randn(1, 1024, generator=g).bfloat16()),
        ("2 tokens x 256, a tile whose amax divides to just above 448", above),
    ]


def _quantize_mistakes(x):
    """What each classic mistake returns for ``x``: (q, scales)."""
    import torch
    from .. import fp8
    t, h = x.shape
    xf = x.float()
    out = {}
    per_tensor = (xf.abs().max().clamp(min=fp8.AMAX_FLOOR) / 448).expand(t, h // 128)
    per_token = (xf.abs().amax(dim=1, keepdim=True).clamp(min=fp8.AMAX_FLOOR) / 448).expand(t, h // 128)
    for name, scales in (("per_tensor", per_tensor), ("per_token", per_token)):
        full = scales.repeat_interleave(128, dim=1)
        out[name] = ((xf / full).clamp(-448, 448).to(fp8.E4M3), scales)
    tiles = xf.view(t, h // 128, 128)
    amax = tiles.abs().amax(-1)
    with torch.no_grad():
        out["no_floor"] = ((tiles / (amax / 448)[..., None]).clamp(-448, 448).to(fp8.E4M3).view(t, h),
                           amax / 448)
        scale = amax.clamp(min=fp8.AMAX_FLOOR) / 448
        with NonSaturatingCast():
            out["no_clamp"] = ((tiles / scale[..., None]).to(fp8.E4M3).view(t, h), scale)
    return out


def _non_saturating_e4m3(args, out):
    """``out`` with NaN wherever a float source cast to E4M3 was beyond +-448."""
    import torch
    from .. import fp8
    if not (isinstance(out, torch.Tensor) and out.dtype == fp8.E4M3 and args):
        return out
    source = args[0]
    if not (isinstance(source, torch.Tensor) and source.dtype != fp8.E4M3
            and source.is_floating_point() and source.shape == out.shape):
        return out
    beyond = source.detach().float().abs() > fp8.E4M3_MAX
    if not bool(beyond.any()):
        return out
    return torch.where(beyond, torch.full(out.shape, float("nan")), out.float()).to(fp8.E4M3)


def _torch_function_mode():
    from torch.overrides import TorchFunctionMode
    return TorchFunctionMode


class NonSaturatingCast(_torch_function_mode()):
    """A torch function mode under which a cast to ``float8_e4m3fn`` gives NaN for a value
    beyond +-448 (as casts do on some builds and devices) instead of saturating to 448 (as
    this CPU build does), so a quantizer that forgot to clamp shows it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _non_saturating_e4m3(args, func(*args, **(kwargs or {})))


def _dequantize(answer, shape):
    """The student's (q, scales) as x_hat [T, H] float32, or None if the format is wrong."""
    import torch
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return None
    q, scales = answer
    if not (isinstance(q, torch.Tensor) and isinstance(scales, torch.Tensor)):
        return None
    t, h = shape
    if tuple(q.shape) != (t, h) or tuple(scales.shape) != (t, h // 128):
        return None
    return q.float() * scales.float().repeat_interleave(128, dim=1)


def _dequantized_close(got, want, scales) -> bool:
    """Within one E4M3 step of the reference everywhere (ties may round either way)."""
    import torch
    if got is None or not torch.isfinite(got).all():
        return False
    step = want.abs() / 8 + scales.float().repeat_interleave(128, dim=1) * 2.0 ** -9
    return bool(((got - want).abs() <= step * 1.0001).all())


def _quantize_matches(answer, x, mistake_answer) -> bool:
    import torch
    got, mine = _dequantize(answer, x.shape), _dequantize(mistake_answer, x.shape)
    if got is None or mine is None:
        return False
    return bool(torch.equal(torch.nan_to_num(got, 1e30), torch.nan_to_num(mine, 1e30)))


def _what_is_off(q, x_hat, want, scales, s_ref) -> str:
    """What is wrong with a quantization, said without the reference's scales or values."""
    import torch
    said = []
    if not bool(torch.isfinite(q).all()) or not bool(torch.isfinite(scales).all()):
        said.append(f"{int((~torch.isfinite(q)).sum())} q value(s) and "
                    f"{int((~torch.isfinite(scales)).sum())} scale(s) are NaN or infinite")
    elif float(q.abs().max()) > 448:
        said.append(f"q reaches {float(q.abs().max()):g}, beyond E4M3's 448")
    wrong_scales = int((~torch.isclose(scales, s_ref, rtol=1e-5)).sum())
    if wrong_scales:
        said.append(f"{wrong_scales} of {scales.numel()} scales are not amax / 448 of their tile")
    if not said:
        worst = (torch.nan_to_num(x_hat, 1e30) - want).abs().max().item()
        said.append(f"the scales are right but q * scale misses x by up to {worst:.3g}, more "
                    "than one E4M3 step")
    return "; ".join(said)


def check_quantize_1x128(fn) -> CheckResult:
    """Run ``fn(x)`` on every case of :func:`quantize_cases`; see the module docstring."""
    import torch
    from .. import fp8
    check = Checking("Exercise 8.1: quantize in 1x128 tiles", QUANTIZE_HINTS)
    for name, x in quantize_cases():
        q_ref, s_ref = fp8.quantize_1x128(x)
        want = fp8.dequantize_1x128(q_ref, s_ref)
        with NonSaturatingCast():
            case, got = check.attempt(name, lambda: fn(x.clone()), None, compare=lambda a, b: False)
        if isinstance(got, BaseException):
            check.add(case)
            continue
        x_hat = _dequantize(got, x.shape)
        if x_hat is None:
            check.add(Case(name, False, "not a pair (q [T, H], scales [T, H // 128])"))
            check.shows({"format"})
            continue
        scales = got[1].float()
        if _dequantized_close(x_hat, want, s_ref) and torch.allclose(scales, s_ref, rtol=1e-5):
            check.add(Case(name, True))
            continue
        shown = {m for m, ans in _quantize_mistakes(x).items() if _quantize_matches(got, x, ans)}
        if torch.allclose(scales * s_ref, torch.ones_like(s_ref), rtol=1e-4):
            shown.add("inverted")
        q_float = got[0].float()
        if torch.equal(q_float, q_float.round()) and not torch.equal(q_ref.float(), q_ref.float().round()):
            shown.add("integers")
        check.add(Case(name, False, _what_is_off(got[0].float(), x_hat, want, scales, s_ref)))
        check.shows(shown)
    return check.verdict()


# --- exercise 8.2: the payload bytes ------------------------------------------------------


def payload_cases():
    """(name, tokens, topk, hidden, precision)."""
    cases = [(f"DeepSeek-V3: 4096 tokens, top-8, H = 7168, {p}", 4096, 8, 7168, p)
             for p in ("fp32", "bf16", "fp8", "fp8_pow2", "fp8_ue8m0")]
    cases += [("1 token, top-1, H = 128, fp8", 1, 1, 128, "fp8"),
              ("3 tokens, top-2, H = 256, fp8_ue8m0", 3, 2, 256, "fp8_ue8m0"),
              ("10 tokens, top-4, H = 384, bf16", 10, 4, 384, "bf16")]
    return cases


def reference_payload_bytes(tokens, topk, hidden, precision) -> int:
    from .. import fp8
    return tokens * topk * fp8.wire_bytes_per_row(hidden, precision)


def _payload_mistakes(tokens, topk, hidden, precision) -> dict[str, float]:
    copies, tiles = tokens * topk, hidden // 128
    right = reference_payload_bytes(tokens, topk, hidden, precision)
    out = {"tokens": right / topk if topk > 1 else -1, "bits": 8 * right}
    if precision.startswith("fp8"):
        out["no_scales"] = copies * hidden
        one_byte = precision == "fp8_ue8m0"
        out["one_scale"] = copies * (hidden + (1 if one_byte else 4))
        if precision == "fp8_pow2":
            out["pow2_as_one_byte"] = copies * (hidden + tiles)
        else:
            out["scale_size"] = copies * (hidden + tiles * (4 if one_byte else 1))
    else:
        out["element"] = copies * hidden * (4 if precision == "bf16" else 2)
    return out


def check_payload_bytes(fn) -> CheckResult:
    """``fn(tokens, topk, hidden, precision)`` -> bytes; see the module docstring."""
    return check_formula("Exercise 8.2: the bytes of the dispatch", PAYLOAD_HINTS, fn,
                         {name: args for name, *args in payload_cases()},
                         reference_payload_bytes, _payload_mistakes, rel_tol=1e-12)


# --- exercise 8.3: a recipe with BF16 ends --------------------------------------------------


def deepseek_module_names(num_layers: int, first_moe_layer: int = 3) -> list[str]:
    """The names ``DeepSeekModel`` gives its modules (dense layers before ``first_moe_layer``)."""
    names = ["embedding.word_embeddings"]
    for i in range(num_layers):
        p = f"layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.self_attention.linear_qkv",
                  f"{p}.self_attention.core_attention", f"{p}.self_attention.linear_proj",
                  f"{p}.pre_mlp_layernorm"]
        if i < first_moe_layer:
            names += [f"{p}.mlp.linear_fc1", f"{p}.mlp.linear_fc2"]
        else:
            names += [f"{p}.mlp.router", f"{p}.mlp.experts", f"{p}.mlp.shared_experts",
                      f"{p}.mlp.dispatcher"]
    return names + ["final_layernorm", "output_layer"]


ENDS_CASES = [("2 layers, layer 1 MoE", 2, 1), ("4 layers, 1 dense", 4, 1),
              ("12 layers, 3 dense", 12, 3), ("61 layers (DeepSeek-V3: 3 dense, 58 MoE)", 61, 3)]


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def _wanted(name: str, base, num_layers: int) -> str:
    """The precision the exercise asks for: bf16 for an end layer's FP8 modules, else base's."""
    want = base.precision_of(name)
    if _layer_of(name) in (0, num_layers - 1) and want.startswith("fp8"):
        return "bf16"
    return want


def _ends_problems(recipe, base, num_layers, first_moe) -> set[str]:
    """Which rules the student's recipe breaks on one model: a set of mistake names."""
    problems = set()
    for name in deepseek_module_names(num_layers, first_moe):
        layer, want_base = _layer_of(name), base.precision_of(name)
        got = recipe.precision_of(name)
        if layer in (0, num_layers - 1):
            if not want_base.startswith("fp8"):
                if got != want_base:  # the router, a norm, the attention core: untouched
                    problems.add("demoted")
            elif got != "bf16":
                moe_part = ".mlp." in name and "linear_fc" not in name
                problems.add("moe" if moe_part else "first" if layer == 0 else "last")
        elif got != want_base:
            problems.add("too_much")
    if (recipe.default, recipe.dispatch, recipe.combine) != (base.default, base.dispatch, base.combine):
        problems.add("too_much")
    return problems


def check_keep_ends_in_bf16(fn) -> CheckResult:
    """``fn(base, num_layers)`` -> a recipe; see the module docstring."""
    from ..precision import PrecisionRecipe, get_recipe
    check = Checking("Exercise 8.3: a recipe that keeps the first and last layers in BF16", ENDS_HINTS)
    for name, num_layers, first_moe in ENDS_CASES:
        base = get_recipe("deepseek_v3")
        pristine = copy.deepcopy(base)
        case, got = check.attempt(name, lambda: fn(base, num_layers), None, compare=lambda a, b: False)
        if isinstance(got, BaseException):
            check.add(case)
            continue
        if not isinstance(got, PrecisionRecipe):
            check.add(Case(name, False, f"got {type(got).__name__}, not a PrecisionRecipe"))
            check.shows({"format"})
            continue
        problems = _ends_problems(got, pristine, num_layers, first_moe)
        if base.to_dict() != pristine.to_dict():
            problems.add("mutated")
        if not problems:
            check.add(Case(name, True))
            continue
        wrong = [n for n in deepseek_module_names(num_layers, first_moe)
                 if got.precision_of(n) != _wanted(n, pristine, num_layers)]
        shown = ", ".join(f"{n} -> {got.precision_of(n)}" for n in wrong[:3])
        check.add(Case(name, False, f"{len(wrong)} module(s) wrong, e.g. {shown}"
                       if wrong else "the recipe's default or communication changed"
                       if "too_much" in problems else "it changed the base recipe"))
        check.shows(problems)
    return check.verdict()


__all__ = ["check_quantize_1x128", "check_payload_bytes", "check_keep_ends_in_bf16",
           "quantize_cases", "payload_cases", "reference_payload_bytes", "deepseek_module_names",
           "ENDS_CASES", "NonSaturatingCast", "ROUNDS_ABOVE_448"]


# --- exercise 8.4: predict what an outlier erases ------------------------------------------

#: Exercise 8.4's tensor: 2 tokens of 256 channels (two 1x128 tiles each), every value 1.0
#: but channel 0 of token 0, the outlier; its sizes, and the scalings asked about.
OUTLIER_SHAPE = (2, 256)
OUTLIERS = (1e4, 3e5, 1e6)
SCALINGS = ("tile", "tensor")

HINT_FLUSH_FORMAT = (
    "return a dict with one whole number per (scaling, outlier) pair, e.g. "
    "{('tile', 1e4): ..., ('tensor', 1e4): ..., ...}, scaling 'tile' or 'tensor', the "
    "outlier 1e4, 3e5 or 1e6: how many of the 511 ordinary values come back as exactly 0."
)
HINT_FLUSH_NONE = (
    "an ordinary value can come back as 0: divided by the scale, 1.0 becomes 448 / A, and "
    "a number closer to 0 than to E4M3's smallest positive value (2^-9) rounds to 0.",
)
HINT_FLUSH_NORMAL = (
    "below its smallest normal value, 2^-6, E4M3 still has subnormals, down to 2^-9: a "
    "scaled value rounds to 0 only when it is nearer 0 than 2^-9, below 2^-10.",
)
HINT_FLUSH_TILES = (
    "with 1x128 tiles each tile has its own scale, its own amax / 448: the outlier sets "
    "the scale of its tile only, and every other tile of 1.0s keeps a scale of 1/448.",
)
HINT_FLUSH_COUNT = (
    "count the ordinary values only: the outlier itself lands on 448 exactly and never "
    "becomes 0, and the question is about the other values of the tensor.",
)
HINT_FLUSH_GENERIC = (
    "for each scaling, ask which values share the outlier's scale (amax / 448), what 1.0 "
    "becomes once divided by it, and whether that is nearer 0 than 2^-9.",
)

#: The mistakes of exercise 8.4, in order of preference.
FLUSH_MISTAKES = Mistakes(HINT_FLUSH_GENERIC, any_case={"format"}, format=HINT_FLUSH_FORMAT,
                          count=HINT_FLUSH_COUNT, tiles=HINT_FLUSH_TILES,
                          normal=HINT_FLUSH_NORMAL, none=HINT_FLUSH_NONE)


def outlier_tensor(outlier: float) -> torch.Tensor:
    """Exercise 8.4's tensor: ones, and ``outlier`` at token 0, channel 0."""
    import torch
    x = torch.ones(OUTLIER_SHAPE)
    x[0, 0] = outlier
    return x


def flushed_ordinary_values(outlier: float, scaling: str) -> int:
    """How many of the tensor's ordinary values (all but the outlier) come back as exactly 0
    from the library's quantizer: :func:`~tutorial_lib.fp8.quantize_1x128` (``"tile"``) or
    :func:`~tutorial_lib.fp8.quantize_per_tensor` (``"tensor"``), then dequantized."""
    import torch

    from .. import fp8
    x = outlier_tensor(outlier)
    if scaling == "tile":
        back = fp8.dequantize_1x128(*fp8.quantize_1x128(x))
    else:
        back = fp8.dequantize_per_tensor(*fp8.quantize_per_tensor(x))
    ordinary = torch.ones(OUTLIER_SHAPE, dtype=torch.bool)
    ordinary[0, 0] = False
    return int((back[ordinary] == 0).sum())


def _flush_variant(outlier: float, scaling: str, *, smallest: float = 2.0 ** -10,
                   tiles: bool = True, outlier_counts: bool = False) -> int:
    """A student's count under a rule: flush below ``smallest``, tiles or not, the outlier
    counted or not (the right rule: 2^-10, tiles, not counted)."""
    flushes = 448.0 / outlier < smallest  # 1.0 divided by the outlier's scale, A / 448
    if not flushes:
        return 0
    shared = 128 if scaling == "tile" and tiles else OUTLIER_SHAPE[0] * OUTLIER_SHAPE[1]
    return shared if outlier_counts else shared - 1


def check_flushed_values(fn) -> CheckResult:
    """Check ``fn() -> {(scaling, outlier): count}`` against the library's quantizer on
    exercise 8.4's tensor, for every scaling and outlier; a wrong count is shown as given."""
    check = Checking("Exercise 8.4: flushed_values", FLUSH_MISTAKES)
    opened = check.prediction(fn)
    if opened is None:
        return check.verdict()
    got, _ = opened
    variants = {"count": dict(outlier_counts=True), "tiles": dict(tiles=False),
                "normal": dict(smallest=2.0 ** -6), "none": dict(smallest=0.0)}
    for scaling in SCALINGS:
        for outlier in OUTLIERS:
            check.count(f"{scaling}, outlier {outlier:g}", got.get((scaling, outlier)),
                        flushed_ordinary_values(outlier, scaling), "not what the quantizer did",
                        lambda n: {m for m, rule in variants.items()
                                   if _flush_variant(outlier, scaling, **rule) == n})
    return check.verdict()


__all__ += ["check_flushed_values", "flushed_ordinary_values", "outlier_tensor", "OUTLIERS",
            "SCALINGS"]
