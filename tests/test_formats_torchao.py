"""Agreement with an independent implementation: torchao's MX quantization with the RCEIL scale mode.

Where the recipes coincide (RCEIL scale, division q = amax / F, ties to even for E2M1, RNE + saturation
for E4M3, groups of 32 along the last dim, amax well above every floor), scale bytes and element codes
must be identical bit for bit. torchao packs FP4 with the even element in the low nibble, as we do;
it may emit the code 0x8 (-0), which is compared by value."""

import pytest
import torch

from evalgate.kernels import formats

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
config = pytest.importorskip("torchao.prototype.mx_formats.config")

RCEIL = config.ScaleCalculationMode.RCEIL


def _random(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g).float())
    x[0, :32] = 0.7  # a constant group
    x[1, 5] = 6.0 * 4  # amax exactly F * 2^k
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1])
def test_e2m1_matches_torchao_rceil(seed, dtype):
    x = _random(seed, dtype)
    scale, packed = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, RCEIL)
    codes, byte = formats.quantize(x, "e2m1", formats.WEIGHTS, ties="even")
    assert torch.equal(scale.view(torch.uint8).reshape(byte.shape), byte)
    theirs = formats.unpack_e2m1(packed.view(torch.uint8).reshape(64, 128))
    # torchao emits -0 (0x8) for small negatives, as the hardware cvt may; DeepGEMM's helpers never do.
    # Zero codes are compared by value (spec docs/kernels.md#e2m1).
    theirs = torch.where(theirs == 0x8, torch.zeros_like(theirs), theirs)
    assert torch.equal(theirs, codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e4m3_matches_torchao_rceil(dtype):
    x = _random(2, dtype)
    scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, RCEIL)
    codes, byte = formats.quantize(x, "e4m3", formats.PRE_DISPATCH)
    assert torch.equal(scale.view(torch.uint8).reshape(byte.shape), byte)
    assert torch.equal(data.view(torch.uint8), codes)
