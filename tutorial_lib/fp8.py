"""FP8 as DeepSeek-V3 uses it: 1x128 tiles, packed rows, and an all-to-all in any precision.

Read it top to bottom, like the chapter (sections 1 to 3, torch only and no processes, live in
:mod:`tutorial_lib.fp8_format`; every name of theirs is re-exported here):

1. **The format.**  E4M3 (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits, largest
   value 448, smallest normal 2**-6.  Rounding to nearest with 3 mantissa bits is off by at most
   1/17 of a normal value (the worst case is halfway between 1 and 1 + 1/8).
2. **Tiles and scales** (:func:`quantize_1x128`).  Each token's hidden vector is cut into tiles
   of 128 channels; each tile gets its own scale ``amax / 448`` (amax clamped to at least
   :data:`AMAX_FLOOR`, so an all-zero tile has a finite scale), optionally rounded *up* to a
   power of two.  Values are divided by the scale, clamped to +-448 explicitly (a cast to
   float8 saturates or gives NaN depending on the torch build and device; the clamp makes the
   library's answer independent of which) and cast.  :func:`dequantize_1x128` multiplies back,
   in float.  :func:`quantize_per_tensor` (one scale for everything) is here to compare with,
   and :func:`fake_quantize_blocks` does 128x128 blocks, as V3 quantizes weights.
3. **Rows on the wire** (:func:`pack_rows`).  gloo refuses float8 in all-to-all, and one
   collective per token batch is the point, so each token's FP8 bytes and its scales share one
   ``uint8`` row: ``H`` bytes + 4 per tile (fp32 scales, whether free or powers of two) or + 1
   per tile (a power-of-two scale as its biased exponent, the UE8M0 format).  Bit-exact both
   ways.
4. **The all-to-all** (:func:`all_to_all`).  An autograd function whose forward and backward
   each take their own precision (:data:`PRECISIONS`): MoE dispatch's backward is a combine of
   gradients and the combine's backward is a dispatch, and DeepSeek-V3 sends only two of the
   four in FP8 (:data:`DEEPSEEK_V3_DISPATCH`, :data:`DEEPSEEK_V3_COMBINE`).  Whatever the
   precision, it is one traced ``comm.all_to_all`` with the same splits, so the order and
   number of collectives never change; the event's tag ``precision`` says which.

Its time, BF16 against FP8 on 4 EP ranks (chapter 8's measurement), is a timing run:
:func:`tutorial_lib.timing.time_all_to_all`.

Hidden sizes that are not a multiple of 128 are refused by the quantizers unless
``pad=True``: the last tile is then shorter (its amax is taken over the channels that exist)
and no padding travels.  The all-to-all always pads this way, so the course's small models
(hidden 8, 64, ...) can run the FP8 path.
"""
from __future__ import annotations

import torch

from . import comm, fp8_format, parallel_state
from .fp8_format import (AMAX_FLOOR, DEEPSEEK_V3_COMBINE, DEEPSEEK_V3_DISPATCH, E4M3, E4M3_MAX,
                         E4M3_MIN_NORMAL, FP8_COMBINE, FP8_DISPATCH, PRECISIONS, TILE,
                         blockwise_fp8_linear, check_precision, check_precision_pair, decode,
                         dequantize_1x128, dequantize_per_tensor, encode, fake_quantize_1x128,
                         fake_quantize_blocks, has_pow2_scales, num_tiles, pack_rows,
                         quantize_1x128, quantize_blocks, quantize_per_tensor, round_to_bf16,
                         row_bytes, scale_from_amax, scaled_mm_available, tile_scales,
                         unpack_rows, wire_bytes_per_row)
from .fp8_format import _to_e4m3  # noqa: F401  (the cast chapter 8 shows clamping first)
from .trace import get_tracer

__all__ = [*fp8_format.__all__, "encoded_all_to_all", "PrecisionAllToAll", "all_to_all"]


# --- 4. the all-to-all ---------------------------------------------------------------------


def encoded_all_to_all(x, group, output_splits, input_splits, precision, op_name, phase):
    """One traced all-to-all of ``x`` encoded in ``precision`` (encoded and decoded locally when
    the group has one rank: the numbers do not depend on the EP size)."""
    wire = encode(x, precision)
    if parallel_state.group_size(group) > 1:
        out = wire.new_empty((sum(output_splits), *wire.shape[1:]))
        with get_tracer().tags(op_name=op_name, phase=phase, payload="tokens", precision=precision):
            wire = comm.all_to_all(out, wire.contiguous(), group, output_splits, input_splits)
    return decode(wire, precision, x.shape[-1], x.dtype)


class PrecisionAllToAll(torch.autograd.Function):
    """Forward: rows ``input_splits[j]`` to group rank j, in ``precisions[0]``.
    Backward: the reverse all-to-all of the gradient, in ``precisions[1]``."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, op_name, precisions):
        ctx.group, ctx.splits, ctx.op_name = group, (output_splits, input_splits), op_name
        ctx.backward_precision = precisions[1]
        return encoded_all_to_all(x, group, output_splits, input_splits, precisions[0], op_name, "forward")

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        dx = encoded_all_to_all(grad, ctx.group, input_splits, output_splits, ctx.backward_precision,
                       ctx.op_name, "backward")
        return dx, None, None, None, None, None


def all_to_all(x: torch.Tensor, group: str | None, output_splits: list[int],
               input_splits: list[int], op_name: str = "all_to_all",
               precision: tuple[str, str] | str = ("fp32", "fp32")) -> torch.Tensor:
    """Uneven all-to-all of ``[R, H]`` rows whose forward and backward each travel in their own
    precision, ``(forward, backward)``; the output has ``x``'s dtype.

    One ``comm.all_to_all`` per direction, tagged ``op_name``, ``phase``, ``payload="tokens"``
    and ``precision``; with a group of one rank the values are still encoded and decoded (the
    rounding FP8 would cause), but nothing is sent.
    """
    precision = check_precision_pair(precision)
    if x.dim() != 2:
        raise ValueError(f"fp8.all_to_all moves rows [R, H], got shape {tuple(x.shape)}")
    return PrecisionAllToAll.apply(x, group, list(output_splits), list(input_splits),
                                    op_name, precision)
