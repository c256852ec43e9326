"""Precision recipes: which module computes in fp32, bf16 or FP8, and how MoE tokens travel.

A :class:`PrecisionRecipe` is an ordered list of glob patterns over module names
(``model.named_modules()``), each with a precision; the first pattern that matches a name
decides, and ``default`` covers the rest.  :func:`apply_recipe` walks a model and

* gives every *linear-like* module (:data:`LINEAR_LIKE`: column/row-parallel linears, routed
  and shared experts, the router, ``torch.nn.Linear``) the matmul precision of its name.
  On CPU there are no FP8 matrix units, so the precision is **simulated**: every
  ``F.linear`` inside the module sees its input and weight quantized and dequantized at the
  real granularity (FP8: 1x128 tiles for the input, 128x128 blocks for the weight, as
  DeepSeek-V3; BF16: rounding to bfloat16), and the gradient of its output likewise in the
  backward pass (1x128 tiles).  Gradients pass the rounding straight through.  The numbers
  are FP8's; the speed is not.
* sets each :class:`~tutorial_lib.moe.MoELayer`'s dispatch and combine precisions from the
  precision of the name ``<layer>.dispatcher``: an FP8 precision gives the recipe's
  ``dispatch`` and ``combine`` pairs, ``bf16`` sends everything in BF16, ``fp32`` leaves the
  rows in their own dtype.

    model = ...                                   # any torch.nn.Module
    plan = apply_recipe(model, get_recipe("deepseek_v3"))
    plan = apply_recipe(model, resolve_recipe("my_recipe.toml"))   # a file (see recipe_from_file)

Applying a recipe again replaces the previous one; :func:`remove_recipe` undoes it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import fp8
from .moe import MoELayer, RoutedExperts, Router, SharedExperts
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["PrecisionRecipe", "LINEAR_LIKE", "RECIPES", "get_recipe", "resolve_recipe",
           "recipe_from_dict", "recipe_from_file", "apply_recipe", "remove_recipe", "PlanEntry"]

LINEAR_LIKE = (ColumnParallelLinear, RowParallelLinear, RoutedExperts, SharedExperts, Router,
               torch.nn.Linear)
"""Module types whose ``F.linear`` calls a recipe simulates."""


@dataclass
class PrecisionRecipe:
    """Which precision each module computes in, and how MoE token rows travel."""

    name: str = "custom"
    """What the recipe is called (``fp32``, ``bf16``, ``deepseek_v3``, or your own)."""
    rules: list[tuple[str, str]] = field(default_factory=list)
    """Ordered ``(glob pattern, precision)`` pairs over module names; the first match wins.
    ``*`` matches any characters, dots included: ``layers.0.*`` is all of layer 0 (not layer
    10), ``*.router`` every router.  Precisions: :data:`tutorial_lib.fp8.PRECISIONS`."""
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
                fp8.check_precision(rule[1])
            except ValueError as err:
                raise ValueError(f"recipe {self.name!r}, rule {i} ({rule[0]!r}): {err}") from None
        fp8.check_precision(self.default)
        self.dispatch = fp8.check_precision_pair(self.dispatch)
        self.combine = fp8.check_precision_pair(self.combine)

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
        dispatch=fp8.DEEPSEEK_V3_DISPATCH, combine=fp8.DEEPSEEK_V3_COMBINE),
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
    ``quantize_gradients``.  For example, DeepSeek-V3 with its first and last layers in BF16::

        base = "deepseek_v3"
        name = "v3_bf16_ends"
        rules = [["layers.0.*", "bf16"], ["layers.7.*", "bf16"]]
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


# --- simulating a matmul precision ---------------------------------------------------------


def _activation_rounding(precision: str):
    if precision == "bf16":
        return fp8.round_to_bf16
    return lambda x: fp8.fake_quantize_1x128(x, pow2=fp8.has_pow2_scales(precision), pad=True)


def _weight_rounding(precision: str):
    if precision == "bf16":
        return fp8.round_to_bf16
    return lambda w: fp8.fake_quantize_blocks(w, pow2=fp8.has_pow2_scales(precision))


class _StraightThrough(torch.autograd.Function):
    """Forward: ``rounding(x)``.  Backward: the gradient unchanged (straight through)."""

    @staticmethod
    def forward(ctx, x, rounding):
        return rounding(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _RoundGradient(torch.autograd.Function):
    """Forward: identity.  Backward: ``rounding(grad)``, what the backward matmuls consume."""

    @staticmethod
    def forward(ctx, y, rounding):
        ctx.rounding = rounding
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rounding(grad), None


class SimulatedMatmul(TorchFunctionMode):
    """While active, every ``F.linear`` runs on rounded inputs and weights (see module doc)."""

    def __init__(self, precision: str, quantize_gradients: bool = True):
        super().__init__()
        self.precision, self.quantize_gradients = precision, quantize_gradients
        self.activation, self.weight = _activation_rounding(precision), _weight_rounding(precision)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, w, *rest = args
        y = func(_StraightThrough.apply(x, self.activation),
                 _StraightThrough.apply(w, self.weight), *rest, **kwargs)
        if self.quantize_gradients and y.requires_grad:
            y = _RoundGradient.apply(y, self.activation)
        return y


def _enter(module, args):
    mode = SimulatedMatmul(module.matmul_precision, module.quantize_gradients)
    mode.__enter__()
    module._simulated_matmul_modes.append(mode)


def _exit(module, args, output):
    module._simulated_matmul_modes.pop().__exit__(None, None, None)


class PlanEntry(NamedTuple):
    """What :func:`apply_recipe` did to one module."""

    name: str
    """The module's name in ``model.named_modules()`` (``<layer>.dispatcher`` for MoE comm)."""
    kind: str
    """The module's class name, or ``dispatcher``."""
    precision: str
    """The matmul precision, or for a dispatcher ``dispatch fwd/bwd, combine fwd/bwd``."""
    rule: str
    """The pattern that decided, or ``default``."""


def remove_recipe(model: torch.nn.Module) -> None:
    """Undo :func:`apply_recipe`: plain matmuls, MoE rows in their own dtype."""
    for module in model.modules():
        for handle in getattr(module, "_precision_hooks", []):
            handle.remove()
        module._precision_hooks = []
        if hasattr(module, "matmul_precision"):
            del module.matmul_precision
        if isinstance(module, MoELayer):
            module.dispatcher.dispatch_precision = module.dispatcher.combine_precision = None


def apply_recipe(model: torch.nn.Module, recipe: PrecisionRecipe | str) -> list[PlanEntry]:
    """Apply ``recipe`` (or a recipe name / file) to every module of ``model``; returns the plan.

    Linear-like modules whose precision is not ``fp32`` get a forward pre-hook and a forward
    hook that simulate their precision; MoE layers get their dispatcher's precisions.
    """
    recipe = resolve_recipe(recipe)
    remove_recipe(model)
    plan = []

    def rule_name(name):
        i = recipe.matching_rule(name)
        return "default" if i is None else recipe.rules[i][0]

    for name, module in model.named_modules():
        if isinstance(module, LINEAR_LIKE):
            precision = recipe.precision_of(name)
            plan.append(PlanEntry(name, type(module).__name__, precision, rule_name(name)))
            if precision != "fp32":
                module.matmul_precision = precision
                module.quantize_gradients = recipe.quantize_gradients
                module._simulated_matmul_modes = []
                module._precision_hooks = [
                    module.register_forward_pre_hook(_enter),
                    module.register_forward_hook(_exit, always_call=True)]
        if isinstance(module, MoELayer):
            dispatch, combine = recipe.communication_of(name)
            module.dispatcher.dispatch_precision = dispatch
            module.dispatcher.combine_precision = combine
            comm_name = f"{name}.dispatcher" if name else "dispatcher"
            described = "native dtype" if dispatch is None and combine is None else (
                f"dispatch {'/'.join(dispatch or ('native',) * 2)}, "
                f"combine {'/'.join(combine or ('native',) * 2)}")
            plan.append(PlanEntry(comm_name, "dispatcher", described, rule_name(comm_name)))
    return plan
