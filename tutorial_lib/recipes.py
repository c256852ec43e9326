"""Precision recipes as data: what a tensor can be computed or sent in, and which module uses what.

This module holds no torch: the names of the precisions (:data:`PRECISIONS`) and their
checks, :class:`PrecisionRecipe`, the named recipes (:data:`RECIPES`), recipe files
(:func:`recipe_from_file`), and DeepSeek-V3's whole FP8 recipe as a card
(:data:`DEEPSEEK_V3_FP8_CARD`: each choice, where the V3 report makes it, and what this
library does about it).  So a command line can read and check a recipe before it
loads torch (``examples/train_4d.py``), and one definition serves everyone:
:mod:`tutorial_lib.precision` (which applies a recipe to a model) and
:mod:`tutorial_lib.fp8` (which moves tensors in these precisions) re-export these names.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from dataclasses import dataclass, field

__all__ = ["PRECISIONS", "DEEPSEEK_V3_DISPATCH", "DEEPSEEK_V3_COMBINE", "check_precision",
           "check_precision_pair", "PrecisionRecipe", "RECIPES", "get_recipe", "recipe_from_dict",
           "recipe_from_file", "resolve_recipe", "CardEntry", "DEEPSEEK_V3_FP8_CARD",
           "recipe_card_rows"]

PRECISIONS = ("fp32", "bf16", "fp8", "fp8_pow2", "fp8_ue8m0")
"""What a tensor can travel as: ``fp32`` (4 bytes per value), ``bf16`` (2), and FP8 (1 byte per
value) with one scale per 128 values in three flavours: ``fp8``, any fp32 scale (4 bytes);
``fp8_pow2``, a power-of-two scale still sent as fp32 (4 bytes; DeepEP's ``round_scale``);
``fp8_ue8m0``, a power-of-two scale sent as its one-byte exponent (1 byte; DeepEP's
``use_ue8m0``)."""

DEEPSEEK_V3_DISPATCH = ("fp8_pow2", "bf16")
"""(forward, backward) of the dispatch in DeepSeek-V3: tokens go out in FP8 with power-of-two
scales (the up-projection consumes FP8 anyway, and V3's report makes these scales integral
powers of two); the gradients coming back, a combine, stay BF16."""
DEEPSEEK_V3_COMBINE = ("bf16", "fp8_pow2")
"""(forward, backward) of the combine in DeepSeek-V3: expert outputs come back in BF16; the
gradients going out to the experts, a dispatch, travel in FP8 with power-of-two scales, the
same treatment as the dispatched activations (the down-projection's dgrad consumes FP8)."""


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a ``ValueError`` listing them."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return precision


def check_precision_pair(pair) -> tuple[str, str] | None:
    """A ``(forward, backward)`` pair of precisions (a single name means both), or ``None``."""
    if pair is None:
        return None
    if isinstance(pair, str):
        pair = (pair, pair)
    pair = tuple(pair)
    if len(pair) != 2:
        raise ValueError(f"a communication precision is a (forward, backward) pair such as "
                         f"('fp8', 'bf16'), got {pair!r}")
    return check_precision(pair[0]), check_precision(pair[1])


# --- the recipe --------------------------------------------------------------------------------


@dataclass
class PrecisionRecipe:
    """Which precision each module computes in, and how MoE token rows travel."""

    name: str = "custom"
    """What the recipe is called (``fp32``, ``bf16``, ``deepseek_v3``, or your own)."""
    rules: list[tuple[str, str]] = field(default_factory=list)
    """Ordered ``(glob pattern, precision)`` pairs over module names; the first match wins.
    ``*`` matches any characters, dots included: ``layers.0.*`` is all of layer 0 (not layer
    10), ``*.router`` every router.  Precisions: :data:`PRECISIONS`."""
    default: str = "fp32"
    """The precision of a name no rule matches."""
    dispatch: tuple[str, str] | None = None
    """(forward, backward) precision of the MoE dispatch rows where the dispatcher's name
    resolves to an FP8 precision; ``None``: rows travel in their own dtype."""
    combine: tuple[str, str] | None = None
    """Likewise for the combine."""
    quantize_gradients: bool = True
    """Also round the gradient of each simulated module's output (the input of its backward
    matmuls) to the module's precision."""

    def __post_init__(self):
        self.rules = [tuple(rule) for rule in self.rules]
        for i, rule in enumerate(self.rules):
            if len(rule) != 2 or not isinstance(rule[0], str):
                raise ValueError(f"recipe {self.name!r}, rule {i}: a rule is a (glob pattern, "
                                 f"precision) pair such as ('layers.0.*', 'bf16'), got {rule!r}")
            try:
                check_precision(rule[1])
            except ValueError as err:
                raise ValueError(f"recipe {self.name!r}, rule {i} ({rule[0]!r}): {err}") from None
        check_precision(self.default)
        self.dispatch = check_precision_pair(self.dispatch)
        self.combine = check_precision_pair(self.combine)
        if not isinstance(self.quantize_gradients, bool):
            raise ValueError(f"recipe {self.name!r}: quantize_gradients must be true or false, "
                             f"got {self.quantize_gradients!r}")

    def matching_rule(self, module_name: str) -> int | None:
        """The index of the first rule whose pattern matches ``module_name`` (``None``: default)."""
        for i, (pattern, _) in enumerate(self.rules):
            if fnmatch.fnmatchcase(module_name, pattern):
                return i
        return None

    def precision_of(self, module_name: str) -> str:
        """The precision of the module called ``module_name``: first matching rule, else default."""
        i = self.matching_rule(module_name)
        return self.default if i is None else self.rules[i][1]

    def communication_of(self, moe_layer_name: str):
        """``(dispatch, combine)`` pairs for the MoE layer called ``moe_layer_name``."""
        precision = self.precision_of(f"{moe_layer_name}.dispatcher" if moe_layer_name
                                      else "dispatcher")
        if precision == "fp32":
            return None, None
        if precision == "bf16":
            return ("bf16", "bf16"), ("bf16", "bf16")

        def fp8_flavour(pair):  # a pow2 / ue8m0 dispatcher gives its flavour to every FP8 leg
            if pair is None or precision == "fp8":
                return pair
            return tuple(precision if p.startswith("fp8") else p for p in pair)
        return fp8_flavour(self.dispatch), fp8_flavour(self.combine)

    def to_dict(self) -> dict:
        return {"name": self.name, "rules": [list(r) for r in self.rules], "default": self.default,
                "dispatch": list(self.dispatch) if self.dispatch else None,
                "combine": list(self.combine) if self.combine else None,
                "quantize_gradients": self.quantize_gradients}


# --- the named recipes ---------------------------------------------------------------------

RECIPES: dict[str, PrecisionRecipe] = {
    "fp32": PrecisionRecipe("fp32", rules=[], default="fp32"),
    "bf16": PrecisionRecipe(
        "bf16", rules=[("*.router", "fp32")],  # routing decisions stay fp32 (chapter 4)
        default="bf16", dispatch=("bf16", "bf16"), combine=("bf16", "bf16")),
    "deepseek_v3": PrecisionRecipe(
        "deepseek_v3",
        rules=[
            ("embedding*", "bf16"),         # the embedding module
            ("output_layer", "bf16"),       # the output head
            ("*.router", "fp32"),           # MoE gating: routing decisions
            ("*layernorm", "fp32"),         # normalization operators
            ("*.core_attention*", "bf16"),  # the attention operator (softmax(QK^T)V)
        ],
        default="fp8",                      # every other linear: qkv, proj, fc1/fc2, experts
        dispatch=DEEPSEEK_V3_DISPATCH, combine=DEEPSEEK_V3_COMBINE),
}
"""``fp32``: nothing changes.  ``bf16``: every matmul in BF16 but the router, tokens travel
in BF16.  ``deepseek_v3``: DeepSeek-V3's mixed precision: FP8 for the linears and experts,
BF16/FP32 for embedding, output head, router, norms and attention core; dispatch FP8 forward,
combine FP8 backward, both with power-of-two scales sent as fp32 (``fp8_pow2``)."""


def get_recipe(name: str) -> PrecisionRecipe:
    """A copy of the named recipe (edit it freely)."""
    if name not in RECIPES:
        raise ValueError(f"unknown precision recipe {name!r}: choose one of {', '.join(RECIPES)} "
                         f"or give a .json / .toml file (see precision.recipe_from_file)")
    return dataclasses.replace(RECIPES[name], rules=list(RECIPES[name].rules))


_FILE_KEYS = {"name", "base", "rules", "default", "dispatch", "combine", "quantize_gradients"}


def recipe_from_dict(spec: dict, source: str = "recipe") -> PrecisionRecipe:
    """A recipe from a plain dict (the content of a recipe file; see :func:`recipe_from_file`)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{source}: a recipe is a table of keys ({', '.join(sorted(_FILE_KEYS))}), "
                         f"got a {type(spec).__name__}")
    unknown = set(spec) - _FILE_KEYS
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {sorted(unknown)}; a recipe file may set "
                         f"{sorted(_FILE_KEYS)}")
    recipe = get_recipe(spec["base"]) if "base" in spec else PrecisionRecipe()
    rules = [tuple(r) for r in spec.get("rules", [])]
    changes = {"name": spec.get("name", source), "rules": rules + list(recipe.rules)}
    for key in ("default", "quantize_gradients"):
        if key in spec:
            changes[key] = spec[key]
    for key in ("dispatch", "combine"):
        if key in spec:
            value = spec[key]
            changes[key] = None if value in (None, "none") else value
    return dataclasses.replace(recipe, **changes)


def recipe_from_file(path: str) -> PrecisionRecipe:
    """Read a recipe from a ``.json`` or ``.toml`` file.

    Keys (all optional): ``base`` (a named recipe to start from), ``name``, ``rules`` (a
    list of ``[pattern, precision]`` pairs, put *before* the base's rules, so they win),
    ``default``, ``dispatch`` and ``combine`` (``[forward, backward]``, or ``"none"``),
    ``quantize_gradients``.  For example, DeepSeek-V3 with the routed experts of its first
    and last layers in BF16::

        base = "deepseek_v3"
        name = "v3_bf16_end_experts"
        rules = [["layers.0.mlp.experts", "bf16"], ["layers.7.mlp.experts", "bf16"]]

    Since the file's rules come first, a broad one such as ``["layers.0.*", "bf16"]`` would
    also catch the router and the layernorms of layer 0, which ``deepseek_v3`` keeps in
    fp32: name the modules you mean.
    """
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    elif path.endswith(".toml"):
        import tomllib
        with open(path, "rb") as f:
            spec = tomllib.load(f)
    else:
        raise ValueError(f"{path}: a recipe file must end in .json or .toml")
    return recipe_from_dict(spec, source=os.path.basename(path))


def resolve_recipe(name_or_path: str | PrecisionRecipe) -> PrecisionRecipe:
    """A recipe from a name (``fp32``, ``bf16``, ``deepseek_v3``), a file path, or a recipe."""
    if isinstance(name_or_path, PrecisionRecipe):
        return name_or_path
    if name_or_path in RECIPES:
        return get_recipe(name_or_path)
    if os.path.exists(name_or_path):
        return recipe_from_file(name_or_path)
    raise ValueError(f"precision recipe {name_or_path!r} is neither a named recipe "
                     f"({', '.join(RECIPES)}) nor an existing .json / .toml file")


# --- DeepSeek-V3's FP8 recipe, as a card -----------------------------------------------------


@dataclass(frozen=True)
class CardEntry:
    """One choice of DeepSeek-V3's FP8 training, where its report makes it, and what the
    library does about it."""

    key: str
    """A short name the tests check the entry by."""
    topic: str
    deepseek_v3: str
    """What V3 does."""
    section: str
    """The section of the DeepSeek-V3 Technical Report (arXiv:2412.19437v2) that says so."""
    here: str
    """What this library does: the same (simulated on CPU), or how it differs."""
    simulated: bool
    """Whether the library reproduces the choice (``False``: it only describes it)."""


DEEPSEEK_V3_FP8_CARD: tuple[CardEntry, ...] = (
    CardEntry(
        "gemms", "FP8 matmuls",
        "every matmul of the linear layers in FP8: forward, input gradient and weight "
        "gradient; outputs in BF16 or FP32",
        "3.3.1",
        "simulated: the inputs, weights and output gradients of every linear-like module "
        "are quantized and dequantized, the product is fp32", True),
    CardEntry(
        "format", "number format",
        "E4M3 on every tensor, gradients included (no E5M2 for the backward pass)",
        "3.3.2, mantissa over exponents",
        "E4M3 (torch.float8_e4m3fn) for inputs, weights and output gradients "
        "(quantize_gradients=True)", True),
    CardEntry(
        "online_scaling", "scales",
        "online: each tile's or block's amax is taken when it is quantized, no amax "
        "history (no delayed scaling)",
        "3.3.2, online quantization",
        "the same: each call takes each tile's amax (at least 1e-4) / 448", True),
    CardEntry(
        "activation_tiles", "activation tiles",
        "one scale per 1x128 tile: one token, 128 channels",
        "3.3.2, fine-grained quantization",
        "fp8.quantize_1x128 (TILE = 128): matmul inputs, output gradients and the FP8 "
        "token rows", True),
    CardEntry(
        "wgrad_tiles", "weight-gradient tiles",
        "for the weight gradient the cached activations are re-tiled 128x1 (128 tokens of "
        "one channel); power-of-two scales where a re-tiling must add no rounding (the "
        "attention output projection's input, the dispatched tokens)",
        "3.3.3, low-precision activation; 3.5.2",
        "not simulated: the weight gradient reuses the forward's 1x128-rounded input; the "
        "chapter's re-tiling cell measures what 128x1 would round", False),
    CardEntry(
        "activation_cache", "cached activations",
        "activations kept for the backward pass are cached in FP8, except the input of the "
        "linear layer after the attention operator: the attention backward reads it too, so "
        "it is cached in a custom E5M6 format, with power-of-two scales",
        "3.3.3, low-precision activation",
        "not simulated: autograd keeps each simulated linear's input as the forward's E4M3 "
        "1x128 rounding, held in fp32; the library has no E5M6 format", False),
    CardEntry(
        "weight_blocks", "weight blocks",
        "one scale per 128x128 block (128 input x 128 output channels)",
        "3.3.2, fine-grained quantization",
        "fp8.fake_quantize_blocks (block = 128), each expert's weight on its own", True),
    CardEntry(
        "accumulation", "accumulation",
        "Tensor Cores keep about 14 bits of the running sum; every 128 elements of the "
        "inner dimension (4 WGMMAs) the partial sums are promoted to FP32 on CUDA cores",
        "3.3.2, increasing accumulation precision",
        "not simulated: the CPU product accumulates in fp32 from the first element, "
        "what the promotion approximates", False),
    CardEntry(
        "kept_precision", "kept out of FP8",
        "embedding, output head, MoE gating, normalizations and the attention operator "
        "stay in BF16 or FP32",
        "3.3.1",
        "the deepseek_v3 recipe's rules: embedding, head and core attention bf16, router "
        "and layernorms fp32", True),
    CardEntry(
        "communication", "MoE all-to-alls",
        "dispatch and the combine's backward in FP8 with power-of-two scales; the combine "
        "and the dispatch's backward in BF16",
        "3.3.3, low-precision communication",
        "DEEPSEEK_V3_DISPATCH = (fp8_pow2, bf16), DEEPSEEK_V3_COMBINE = (bf16, fp8_pow2); "
        "the scales travel as fp32", True),
    CardEntry(
        "optimizer_moments", "optimizer state",
        "AdamW's first and second moments in BF16",
        "3.3.3, low-precision optimizer states",
        "not modelled: train_4d uses torch.optim.Adam, whose moments are fp32", False),
    CardEntry(
        "master_weights", "master weights",
        "master weights, and the gradients accumulated over micro-batches, in FP32",
        "3.3.1; 3.3.3",
        "the same: parameters and their .grad are fp32; the rounding passes gradients "
        "straight through to them", True),
)
"""DeepSeek-V3's FP8 recipe, one :class:`CardEntry` per choice (section 3.3 of the report);
``tests/unit/test_precision.py`` checks every entry's ``here`` against the library."""


def recipe_card_rows() -> list[list[str]]:
    """:data:`DEEPSEEK_V3_FP8_CARD` as table rows: topic, V3, report section, this library."""
    return [[e.topic, e.deepseek_v3, e.section, e.here] for e in DEEPSEEK_V3_FP8_CARD]
