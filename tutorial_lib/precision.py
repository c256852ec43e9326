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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import fp8
from .moe import MoELayer, RoutedExperts, Router, SharedExperts
from .recipes import (DEEPSEEK_V3_FP8_CARD, RECIPES, PrecisionRecipe, get_recipe,
                      recipe_card_rows, recipe_from_dict, recipe_from_file, resolve_recipe)
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["PrecisionRecipe", "LINEAR_LIKE", "RECIPES", "get_recipe", "resolve_recipe",
           "recipe_from_dict", "recipe_from_file", "apply_recipe", "remove_recipe", "PlanEntry",
           "DEEPSEEK_V3_FP8_CARD", "recipe_card_rows"]

LINEAR_LIKE = (ColumnParallelLinear, RowParallelLinear, RoutedExperts, SharedExperts, Router,
               torch.nn.Linear)
"""Module types whose ``F.linear`` calls a recipe simulates."""

# The recipe as data (PrecisionRecipe, RECIPES, recipe files, DeepSeek-V3's recipe card)
# lives without torch in tutorial_lib.recipes, imported above: a command line checks a
# recipe before loading torch.


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
