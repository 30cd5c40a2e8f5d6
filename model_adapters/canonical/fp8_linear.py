"""Dense linears kept in FP8 on a GPU: E4M3 codes and UE8M0 128 x 128 block scales as the checkpoint stores
them (``kernels/fp8_blocks.py``), half the bytes of BF16 weights.

``keep_fp8(module, codes, scale)`` turns a loaded ``nn.Linear`` (or transformers' grouped linear) into one
that holds ``weight_fp8`` and ``weight_scale_inv`` instead of ``weight``; its ``weight`` becomes the exact BF16
dequantization, computed when read. Every forward that reads ``module.weight`` (transformers' own, CUDA-graphed
or not) therefore computes what it computes on the CPU, where the weights are dequantized once at load: the
same weights, bit for bit. The canonical forward (``invariant.py``) builds its fixed-point grid from the
codes once (``weight_sources`` keys its cache), so it gives the CPU's bits too.

``hold_dequantized(model, keep_free, free_bytes)`` (PyTorch's numerics on a GPU) keeps each such weight's dequantization
beside its codes where the device has room for it, so a decoding step reads it instead of dequantizing every
linear again: the same bits (the dequantization is exact), one pass fewer per linear and step.
"""

from __future__ import annotations

from typing import Callable

import torch

from evalgate.kernels.fp8_blocks import BLOCK, scale_values


class _Fp8Weight:
    """Mixed in before the module's own class: ``weight`` is the exact dequantization of the stored codes."""

    @property
    def weight(self) -> torch.Tensor:
        held = self.__dict__.get("_evalgate_held")
        if held is not None:
            return held
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
    if codes.is_cuda:
        gpu_kernel(codes.device)  # its one check, before any forward (a CUDA graph capture among them)


def is_fp8(module) -> bool:
    return isinstance(module, _Fp8Weight)


def hold_dequantized(model: torch.nn.Module, keep_free: dict[str, int], free_bytes: Callable[[str], int]) -> int:
    """Hold the dequantized weight of each FP8 linear of ``model`` while its device keeps
    ``keep_free[device]`` bytes free (its planned reserve: KV cache and workspace come first; ``free_bytes(device)``
    says what it has, the loader's own measure); returns the
    bytes held. Not a parameter or buffer: never saved, and the weights a step must read stay the codes."""
    held = 0
    for module in model.modules():
        if not is_fp8(module) or "_evalgate_held" in module.__dict__:
            continue
        device = str(module.weight_fp8.device)
        need = module.weight_fp8.numel() * module._evalgate_dtype.itemsize
        if free_bytes(device) - need < keep_free.get(device, 0):
            continue
        module.__dict__["_evalgate_held"] = module.weight
        held += need
    return held


def weight_sources(module) -> tuple[torch.Tensor, ...]:
    """The tensors a module's weight is made of (its cache key in the canonical forward): the codes and
    scales of an FP8 one, else the weight itself."""
    return (module.weight_fp8, module.weight_scale_inv) if is_fp8(module) else (module.weight,)


def _probe(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-NaN E4M3 code under every UE8M0 scale byte, with a partial block: [512 + 40, 128 x 64 + 8]
    codes, FP32 scales."""
    from evalgate.kernels.fp8_blocks import scale_grid

    n, k = 4 * BLOCK + 40, 64 * BLOCK + 8
    raw = (torch.arange(n * k, dtype=torch.int64) % 256).to(torch.uint8).view(n, k)
    raw[(raw & 0x7F) == 0x7F] = 0
    gn, gk = scale_grid((n, k))
    scale = (torch.arange(gn * gk) % 255).to(torch.uint8).view(gn, gk).view(torch.float8_e8m0fnu)
    return raw.view(torch.float8_e4m3fn).to(device), scale_values(scale, torch.float32).to(device)


def checked(kernel, device) -> bool:
    """Whether ``kernel(codes, scale_f32)`` gives PyTorch's dequantization bit for bit on ``device`` over
    ``_probe``'s codes and scales (any error: no)."""
    codes, scale = _probe(device)
    try:
        got = kernel(codes, scale)
    except Exception:  # a Triton that cannot compile it here: the PyTorch path serves
        return False
    return torch.equal(got.view(torch.int16), _dequantize_torch(codes, scale, torch.bfloat16).view(torch.int16))


_KERNELS: dict[str, object] = {}  # device -> the Triton kernel once checked there, or None


def gpu_kernel(device):
    """The one-pass Triton dequantization (``kernels/triton/fp8_dequant.py``) for ``device`` if it gives the
    PyTorch path's bits there (checked once per device and process), else None."""
    key = str(device)
    if key not in _KERNELS:
        try:
            from evalgate.kernels.triton.fp8_dequant import dequantize_bf16
        except ImportError:
            dequantize_bf16 = None
        _KERNELS[key] = dequantize_bf16 if dequantize_bf16 is not None and checked(dequantize_bf16, device) else None
    return _KERNELS[key]


def dequantize_fast(codes: torch.Tensor, scale_f32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_blocks.dequantize`` from FP32 block scales (exact: a code has 4 significant bits, a scale is a
    power of two, so every path gives the same bits): on a GPU one Triton pass where it was checked."""
    if codes.is_cuda and dtype == torch.bfloat16 and codes.is_contiguous() and scale_f32.is_contiguous():
        # checked at load (keep_fp8); never first inside a CUDA graph's capture
        kernel = _KERNELS.get(str(codes.device)) if torch.cuda.is_current_stream_capturing() else gpu_kernel(codes.device)
        if kernel is not None:
            return kernel(codes, scale_f32)
    return _dequantize_torch(codes, scale_f32, dtype)


def _dequantize_torch(codes: torch.Tensor, scale_f32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight broadcast over each block without expanding the scales."""
    n, k = codes.shape
    gn, gk = scale_f32.shape
    if n == gn * BLOCK and k == gk * BLOCK:
        blocks = codes.view(gn, BLOCK, gk, BLOCK).to(torch.float32) * scale_f32[:, None, :, None]
        return blocks.view(n, k).to(dtype)
    s = scale_f32.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (codes.to(torch.float32) * s).to(dtype)
