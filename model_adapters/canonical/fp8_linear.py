"""Dense linears kept in FP8 on a GPU: E4M3 codes and UE8M0 128 x 128 block scales as the checkpoint stores
them (``kernels/fp8_blocks.py``), half the bytes of BF16 weights.

``keep_fp8(module, codes, scale)`` turns a loaded ``nn.Linear`` (or transformers' grouped linear) into one
that holds ``weight_fp8`` and ``weight_scale_inv`` instead of ``weight``; its ``weight`` becomes the exact BF16
dequantization, computed when read. Every forward that reads ``module.weight`` (transformers' own, CUDA-graphed
or not) therefore computes what it computes on the CPU, where the weights are dequantized once at load: the
same weights, bit for bit. The canonical forward (``invariant.py``) builds its fixed-point grid from the
codes once (``weight_sources`` keys its cache), so it gives the CPU's bits too.
"""

from __future__ import annotations

import torch

from evalgate.kernels.fp8_blocks import BLOCK, scale_values


class _Fp8Weight:
    """Mixed in before the module's own class: ``weight`` is the exact dequantization of the stored codes."""

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_fast(self.weight_fp8, self._evalgate_scale_f32, self._evalgate_dtype)


_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Fp8{cls.__name__}", (_Fp8Weight, cls), {"__module__": __name__})
    return _CLASSES[cls]


def keep_fp8(module: torch.nn.Module, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Hold ``codes`` (E4M3 [N, K]) and ``scale`` (UE8M0 [ceil(N/128), ceil(K/128)]) in ``module`` in place of
    its ``weight``, which then reads as their exact dequantization in ``dtype``."""
    module._parameters.pop("weight", None)
    module.__class__ = _fp8_class(type(module))
    module.weight_fp8 = torch.nn.Parameter(codes, requires_grad=False)
    module.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
    # the scales as FP32 powers of two (2^-127 .. 2^127 are all FP32 values): read by every dequantization
    module._evalgate_scale_f32 = scale_values(scale, torch.float32)
    module._evalgate_dtype = dtype


def is_fp8(module) -> bool:
    return isinstance(module, _Fp8Weight)


def weight_sources(module) -> tuple[torch.Tensor, ...]:
    """The tensors a module's weight is made of (its cache key in the canonical forward): the codes and
    scales of an FP8 one, else the weight itself."""
    return (module.weight_fp8, module.weight_scale_inv) if is_fp8(module) else (module.weight,)


def _triton_dequantize():
    """The one-pass GPU kernel (``kernels/triton/fp8_dequant.py``), or None where Triton is not installed."""
    try:
        from evalgate.kernels.triton.fp8_dequant import dequantize_bf16
    except ImportError:
        return None
    return dequantize_bf16


def dequantize_fast(codes: torch.Tensor, scale_f32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_blocks.dequantize`` from FP32 block scales, broadcast over each block without expanding them
    (exact: a code has 4 significant bits, a scale is a power of two, so every path gives the same bits)."""
    if codes.is_cuda and dtype == torch.bfloat16 and codes.is_contiguous() and scale_f32.is_contiguous():
        kernel = _triton_dequantize()
        if kernel is not None:
            return kernel(codes, scale_f32)
    n, k = codes.shape
    gn, gk = scale_f32.shape
    if n == gn * BLOCK and k == gk * BLOCK:
        blocks = codes.view(gn, BLOCK, gk, BLOCK).to(torch.float32) * scale_f32[:, None, :, None]
        return blocks.view(n, k).to(dtype)
    s = scale_f32.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (codes.to(torch.float32) * s).to(dtype)
