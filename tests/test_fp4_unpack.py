"""The load's FP4 unpacking (model_adapters/loading/fp4_unpack.py) gives transformers' own floats, bit for bit."""

import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from evalgate.model_adapters.loading.fp4_unpack import fast_fp4_unpack, pair_table, unpack_fp4


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # -0.0 and 0.0 differ here


def test_every_byte_unpacks_to_transformers_values():
    every = torch.arange(256, dtype=torch.uint8).view(torch.int8).reshape(2, 128)  # each byte once
    packed = torch.cat([every, every.flip(-1)], dim=0)[:, 3:]  # odd width, other order
    expected = Fp8Dequantize(None)._unpack_fp4(packed)
    got = unpack_fp4(packed, pair_table(Fp8Dequantize._FP4_E2M1_LUT))
    assert got.shape == expected.shape == (4, 250) and got.dtype == expected.dtype == torch.float32
    assert torch.equal(_bits(got), _bits(expected))


def test_a_stacked_experts_tensor_and_a_non_contiguous_one():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (3, 16, 64), dtype=torch.int8, generator=g)
    for x in (packed, packed.transpose(-2, -1)):
        expected = Fp8Dequantize(None)._unpack_fp4(x)
        assert torch.equal(_bits(unpack_fp4(x, pair_table(Fp8Dequantize._FP4_E2M1_LUT))), _bits(expected))


def test_swapped_in_only_while_loading():
    original = Fp8Dequantize._unpack_fp4
    packed = torch.arange(256, dtype=torch.uint8).view(torch.int8).reshape(4, 64)
    expected = original(Fp8Dequantize(None), packed)
    with fast_fp4_unpack():
        assert Fp8Dequantize._unpack_fp4 is not original
        assert torch.equal(_bits(Fp8Dequantize(None)._unpack_fp4(packed)), _bits(expected))
    assert Fp8Dequantize._unpack_fp4 is original
