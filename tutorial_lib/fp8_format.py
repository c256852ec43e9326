"""The FP8 format as DeepSeek-V3 uses it: E4M3 values, 1x128 tiles, packed rows (no processes).

Sections 1 to 3 of :mod:`tutorial_lib.fp8` (which re-exports every name here): the format,
tiles and scales, rows on the wire, and what one all-to-all leg encodes and decodes
(:func:`encode`, :func:`decode`).  Torch only: no process group, no collective, so a
drawing (:mod:`tutorial_lib.viz.fp8_tiles`) can quantize without loading the
communication layer.  The all-to-all that sends these rows is :func:`tutorial_lib.fp8.all_to_all`.
"""
from __future__ import annotations

import math

import torch

from .recipes import (DEEPSEEK_V3_COMBINE, DEEPSEEK_V3_DISPATCH, PRECISIONS, check_precision,
                      check_precision_pair)

__all__ = [
    "E4M3", "E4M3_MAX", "E4M3_MIN_NORMAL", "TILE", "AMAX_FLOOR", "PRECISIONS",
    "DEEPSEEK_V3_DISPATCH", "DEEPSEEK_V3_COMBINE", "FP8_DISPATCH", "FP8_COMBINE",
    "num_tiles", "tile_scales", "quantize_1x128", "dequantize_1x128", "fake_quantize_1x128",
    "quantize_per_tensor", "dequantize_per_tensor", "quantize_blocks", "fake_quantize_blocks",
    "round_to_bf16", "blockwise_fp8_linear", "scaled_mm_available",
    "pack_rows", "unpack_rows", "row_bytes", "wire_bytes_per_row",
    "check_precision", "check_precision_pair", "has_pow2_scales", "encode", "decode",
    "scale_from_amax",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite E4M3 value (1.75 * 2**8)."""
E4M3_MIN_NORMAL = 2.0 ** -6
"""The smallest normal E4M3 value; below it the relative spacing of values grows."""
TILE = 128
"""Channels per tile along the hidden dimension (DeepSeek-V3's 1x128 activation tiles)."""
AMAX_FLOOR = 1e-4
"""A tile's amax is clamped to at least this before the scale is taken (DeepSeek-V3's
inference kernels use the same floor), so an all-zero tile gets a finite, nonzero scale."""

# PRECISIONS, DEEPSEEK_V3_DISPATCH / _COMBINE, check_precision and check_precision_pair are
# defined, without torch, in tutorial_lib.recipes (a command line checks recipes before it
# loads torch); they are imported above and belong to this module's API as well.

FP8_DISPATCH = ("fp8", "fp8")
"""Every leg in FP8, the simplest reading of "the dispatch and combine may use FP8": both
directions of the dispatch in FP8 (DeepSeek-V3 keeps some legs in BF16:
:data:`DEEPSEEK_V3_DISPATCH`)."""
FP8_COMBINE = ("fp8", "fp8")
"""Likewise for the combine."""


# --- 1. checks that teach ------------------------------------------------------------------


def has_pow2_scales(precision: str) -> bool:
    """Whether ``precision`` rounds its scales up to powers of two (``fp8_pow2``, ``fp8_ue8m0``)."""
    return check_precision(precision) in ("fp8_pow2", "fp8_ue8m0")


def num_tiles(hidden: int, pad: bool = False, tile: int = TILE) -> int:
    """Tiles per row: ``hidden / tile``; with ``pad`` the last one may be shorter."""
    if hidden % tile and not pad:
        raise ValueError(f"hidden size {hidden} is not a multiple of the {tile}-wide tile "
                         f"({hidden} = {hidden // tile} x {tile} + {hidden % tile}); use pad=True "
                         f"(the last tile is then {hidden % tile} channels wide) or a multiple of "
                         f"{tile}, e.g. {math.ceil(hidden / tile) * tile}")
    return math.ceil(hidden / tile)


# --- 2. tiles and scales -------------------------------------------------------------------


def scale_from_amax(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """``amax / 448`` (amax at least AMAX_FLOOR); with ``pow2`` rounded up to a power of two,
    so no value can exceed 448 after the division.

    The rounding up works on the float's exponent, as DeepGEMM's UE8M0 scales do: with
    ``scale = m * 2**e`` and ``m`` in [0.5, 1), the smallest power of two at or above it is
    ``2**(e-1)`` when ``m == 0.5`` (the scale is one already) and ``2**e`` otherwise.
    (``exp2(ceil(log2(s)))`` is off by one for an ``s`` a few ulps above a power of two,
    whose float32 logarithm rounds to the whole number.)
    """
    scale = amax.float().clamp(min=AMAX_FLOOR) / E4M3_MAX
    if pow2:
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).int())
    return scale


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    # Explicit clamp: torch's cast saturates on this CPU build, gives NaN on other paths.
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _tiled(x: torch.Tensor, pad: bool, tile: int) -> torch.Tensor:
    """``[..., H]`` float32 -> ``[..., tiles, tile]``, zero-padded (zeros never raise an amax)."""
    hidden = x.shape[-1]
    tiles = num_tiles(hidden, pad, tile)
    x = x.float()
    if tiles * tile != hidden:
        x = torch.nn.functional.pad(x, (0, tiles * tile - hidden))
    return x.reshape(*x.shape[:-1], tiles, tile)


def tile_scales(x: torch.Tensor, pow2: bool = False, pad: bool = False,
                tile: int = TILE) -> torch.Tensor:
    """``[..., H]`` -> ``[..., H/128]`` fp32: each tile's ``max(amax, AMAX_FLOOR) / 448``."""
    return scale_from_amax(_tiled(x, pad, tile).abs().amax(dim=-1), pow2)


def quantize_1x128(x: torch.Tensor, pow2: bool = False, pad: bool = False,
                   tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> ``(q [..., H] float8_e4m3fn, scales [..., H/128] fp32)``.

    One scale per token per 128 channels: ``x ~= q * scale`` tile by tile.
    """
    hidden = x.shape[-1]
    tiles = _tiled(x, pad, tile)
    scales = scale_from_amax(tiles.abs().amax(dim=-1), pow2)
    q = _to_e4m3(tiles / scales.unsqueeze(-1))
    return q.reshape(*x.shape[:-1], tiles.shape[-2] * tile)[..., :hidden], scales


def dequantize_1x128(q: torch.Tensor, scales: torch.Tensor, tile: int = TILE,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_1x128`, computed in float32, returned as ``dtype``."""
    hidden = q.shape[-1]
    if scales.shape[-1] != math.ceil(hidden / tile):
        raise ValueError(f"{scales.shape[-1]} scales for a hidden size of {hidden}: expected "
                         f"ceil({hidden} / {tile}) = {math.ceil(hidden / tile)}")
    per_channel = scales.float().repeat_interleave(tile, dim=-1)[..., :hidden]
    return (q.float() * per_channel).to(dtype)


def fake_quantize_1x128(x: torch.Tensor, pow2: bool = False, pad: bool = True) -> torch.Tensor:
    """Quantize then dequantize (what FP8 does to the numbers), in ``x``'s dtype."""
    q, scales = quantize_1x128(x, pow2=pow2, pad=pad)
    return dequantize_1x128(q, scales, dtype=x.dtype)


def quantize_per_tensor(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (for comparison): ``(q, scale [])``."""
    scale = scale_from_amax(x.float().abs().amax(), pow2)
    return _to_e4m3(x.float() / scale), scale


def dequantize_per_tensor(q: torch.Tensor, scale: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def quantize_blocks(w: torch.Tensor, block: int = TILE,
                    pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight ``[..., out, in]`` in ``block x block`` blocks (V3's weights):
    ``(q [..., out, in] float8_e4m3fn, scales [..., ceil(out/block), ceil(in/block)] fp32)``.

    Edge blocks may be smaller; leading dimensions (stacked experts) are blocked separately.
    """
    *lead, rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.nn.functional.pad(w.float(), (0, bc * block - cols, 0, br * block - rows))
    blocks = padded.reshape(*lead, br, block, bc, block)
    scales = scale_from_amax(blocks.abs().amax(dim=(-3, -1), keepdim=True), pow2)
    q = _to_e4m3(blocks / scales).reshape(*lead, br * block, bc * block)[..., :rows, :cols]
    return q, scales.reshape(*lead, br, bc)


def fake_quantize_blocks(w: torch.Tensor, block: int = TILE, pow2: bool = False) -> torch.Tensor:
    """Quantize-dequantize a weight ``[..., out, in]`` in ``block x block`` blocks (V3's weights)."""
    q, scales = quantize_blocks(w, block, pow2)
    rows, cols = w.shape[-2:]
    per_element = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (q.float() * per_element[..., :rows, :cols]).to(w.dtype)


def scaled_mm_available(device) -> bool:
    """Whether ``torch._scaled_mm`` can run FP8 GEMMs on ``device``: a CUDA GPU of compute
    capability 8.9 or newer (Ada, Hopper and later) and a torch that has the function."""
    device = torch.device(device)
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x.view(torch.uint8), pad).view(x.dtype)


def _scaled_mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two float8 matrices on the tensor cores, fp32 out, unit scales
    (``torch._scaled_mm`` wants ``a`` row-major, ``b`` column-major, sizes multiples of 16)."""
    rows, cols = a.shape[0], b.shape[1]
    a = _pad_to(_pad_to(a, 0, 16), 1, 16).contiguous()
    b = _pad_to(_pad_to(b.t(), 0, 16), 1, 16).contiguous().t()
    one = torch.ones((), dtype=torch.float32, device=a.device)
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                            out_dtype=torch.float32)[:rows, :cols]


def blockwise_fp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         pow2: bool = False, matmul=None) -> torch.Tensor:
    """``x w^T (+ bias)`` with real FP8 GEMMs at DeepSeek-V3's granularity, in ``x``'s dtype.

    ``x [..., K]`` in 1x128 tiles, ``w [N, K]`` in 128x128 blocks (as the simulation quantizes
    them); for each 128-wide slice of ``K`` one FP8 GEMM (``matmul``, default
    ``torch._scaled_mm``, fp32 out) whose result is scaled by the slice's activation and
    weight scales in fp32 and added up: V3's fine-grained scaling, its scales applied
    outside the tensor cores after every 128 products.  Forward only (no autograd).
    ``matmul(a, b)``: any float8 ``[M, k] @ [k, N]`` to fp32, e.g. a CPU stand-in for tests.
    """
    matmul = matmul or _scaled_mm_fp32
    lead, k_total = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_1x128(x.reshape(-1, k_total), pow2=pow2, pad=True)  # [M, K], [M, K/128]
    wq, ws = quantize_blocks(w, TILE, pow2)                                 # [N, K], [N/128, K/128]
    out = torch.zeros(xq.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for kb in range(xs.shape[-1]):
        cols = slice(kb * TILE, min(k_total, (kb + 1) * TILE))
        part = matmul(xq[:, cols].contiguous(), wq[:, cols].contiguous().t())
        w_scale = ws[:, kb].repeat_interleave(TILE)[:w.shape[0]]
        out += part * xs[:, kb:kb + 1] * w_scale.unsqueeze(0)
    if bias is not None:
        out += bias.float()
    return out.reshape(*lead, w.shape[0]).to(x.dtype)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 and back to its own dtype (what a BF16 tensor can hold)."""
    return x.to(torch.bfloat16).to(x.dtype)


# --- 3. rows on the wire -------------------------------------------------------------------


def _scale_bytes(ue8m0: bool) -> int:
    return 1 if ue8m0 else 4


def pack_rows(q: torch.Tensor, scales: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """``q [T, H]`` float8 + ``scales [T, tiles]`` -> ``[T, H + 4 tiles]`` uint8 (``+ tiles``
    with ``ue8m0``: each power-of-two scale as its exponent + 127, one byte)."""
    if q.dtype != E4M3:
        raise TypeError(f"pack_rows takes float8_e4m3fn values, got {q.dtype}")
    if q.dim() != 2 or scales.dim() != 2 or q.shape[0] != scales.shape[0]:
        raise ValueError(f"pack_rows takes q [T, H] and scales [T, tiles], got "
                         f"{tuple(q.shape)} and {tuple(scales.shape)}")
    if ue8m0:
        exponent = torch.log2(scales.float())
        if not torch.equal(exponent, exponent.round()) or (exponent.numel() and exponent.abs().max() > 127):
            raise ValueError("ue8m0=True packs each scale as a one-byte exponent: every scale must "
                             "be a power of two between 2**-127 and 2**127 (quantize with "
                             "pow2=True)")
        scale_bytes = (exponent.round().to(torch.int32) + 127).to(torch.uint8)
    else:
        scale_bytes = scales.float().contiguous().view(torch.uint8)
    return torch.cat([q.contiguous().view(torch.uint8), scale_bytes], dim=1)


def unpack_rows(rows: torch.Tensor, hidden: int, ue8m0: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_rows`: ``[T, row_bytes]`` uint8 -> ``(q [T, H], scales [T, tiles])``."""
    tiles = num_tiles(hidden, pad=True)
    width = hidden + tiles * _scale_bytes(ue8m0)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != width:
        raise ValueError(f"unpack_rows expects [T, {width}] uint8 rows for hidden {hidden} "
                         f"({'ue8m0' if ue8m0 else 'fp32'} scales), got {tuple(rows.shape)} {rows.dtype}")
    q = rows[:, :hidden].contiguous().view(E4M3)
    tail = rows[:, hidden:].contiguous()
    if ue8m0:
        scales = torch.exp2(tail.to(torch.float32) - 127)
    else:
        scales = tail.view(torch.float32)
    return q, scales


def row_bytes(hidden: int, ue8m0: bool = False) -> int:
    """Bytes of one packed FP8 row: ``H + 4 * ceil(H/128)`` (``+ ceil(H/128)`` with ue8m0)."""
    return hidden + num_tiles(hidden, pad=True) * _scale_bytes(ue8m0)


def wire_bytes_per_row(hidden: int, precision: str) -> int:
    """Bytes one token copy of hidden size ``hidden`` occupies on the wire in ``precision``."""
    check_precision(precision)
    if precision == "fp32":
        return 4 * hidden
    if precision == "bf16":
        return 2 * hidden
    return row_bytes(hidden, ue8m0=precision == "fp8_ue8m0")


# --- 4. what travels ----------------------------------------------------------------------


def encode(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``[R, H]`` -> what travels: fp32, bf16, or packed uint8 FP8 rows."""
    if precision == "fp32":
        return x.float()
    if precision == "bf16":
        return x.bfloat16()
    q, scales = quantize_1x128(x, pow2=has_pow2_scales(precision), pad=True)
    return pack_rows(q, scales, ue8m0=precision == "fp8_ue8m0")


def decode(wire: torch.Tensor, precision: str, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """What arrived -> ``[R, H]`` of ``dtype`` (FP8 dequantized in float32 first)."""
    if precision in ("fp32", "bf16"):
        return wire.to(dtype)
    q, scales = unpack_rows(wire, hidden, ue8m0=precision == "fp8_ue8m0")
    return dequantize_1x128(q, scales, dtype=dtype)
