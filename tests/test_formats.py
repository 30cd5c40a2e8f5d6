"""Number formats, bit for bit: test vectors T1-T8 (docs/kernels.md#test-vectors) and the edges of docs/kernels.md#number-formats."""

import math

import pytest
import torch

from evalgate.kernels import formats
from evalgate.kernels.emulator import combine, gate_up_to_bf16, swiglu, weight_and_requantize
from evalgate.kernels.formats import EPILOGUE, PRE_DISPATCH, SGLANG_FP8
from evalgate.kernels.recipe import Recipe

# --- T1: E2M1 codes of scaled values ---------------------------------------------------------------

T1_Y = [0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.2, -0.75, -1.75, -3.5]
T1_CODES = {
    "zero": [0x0, 0x1, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0x0, 0x9, 0xB, 0xD],
    "even": [0x0, 0x1, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x7, 0x0, 0xA, 0xC, 0xE],
}


@pytest.mark.parametrize("ties", ["zero", "even"])
def test_t1_e2m1_codes(ties):
    codes = formats.e2m1_encode(torch.tensor(T1_Y), ties)
    assert codes.tolist() == T1_CODES[ties]


@pytest.mark.parametrize("ties", ["zero", "even"])
def test_e2m1_round_is_the_codes_grid_value_for_every_bf16_value_and_every_midpoint_neighbour(ties):
    """e2m1_round (FP32: read from the exponent field, in place) gives the value of e2m1_magnitude_index's
    code, bit for bit: every BF16 value, each midpoint and grid value with its FP32 neighbours, subnormals."""
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0])
    around = torch.cat([points, torch.nextafter(points, torch.zeros_like(points)),
                        torch.nextafter(points, torch.full_like(points, 9.0))])
    subnormal = torch.arange(1, 2**23, 4099, dtype=torch.int32).view(torch.float32)
    y = torch.cat([every_bf16, around, -around, subnormal, torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 4])
    y = y[~y.isnan()]
    grid = torch.tensor(formats.E2M1_MAGNITUDES)[formats.e2m1_magnitude_index(y, ties)].copysign(y)
    got = formats.e2m1_round(y, ties)
    assert torch.equal(got.view(torch.int32), grid.view(torch.int32))
    assert torch.equal(formats.e2m1_round(y.double(), ties), grid.double())  # the generic path agrees
    assert formats.e2m1_round(torch.tensor([float("nan")]), ties).isnan().all()


def test_e2m1_never_emits_negative_zero_code():
    codes = formats.e2m1_encode(torch.tensor([-0.0, -0.1, -0.25]), "even")
    assert codes.tolist() == [0, 0, 0]


def test_e2m1_decode_table():
    values = formats.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert values[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert values[9:] == [-0.5, -1, -1.5, -2, -3, -4, -6]


# --- T2: one 32-element group -----------------------------------------------------------------------

T2_X = [7, -1.5, 3.5, 0.5, 2.5, -5, 1, 0, 1.25, -0.75, 4, 6, -7, 0.625, 2, -3, 0.375, 1.5, -2.5, 5.5, 0.125,
        -0.25, 3, -6.5, 1.75, -1, 0.875, 2.25, -4.5, 0.0625, -0.5, 4.5]
T2_CODES = {
    "zero": "5 9 3 0 2 C 1 0 1 9 4 5 D 1 2 B 0 1 A 5 0 0 3 D 2 9 1 2 C 0 0 4",
    "even": "6 A 4 0 2 C 1 0 1 9 4 5 E 1 2 B 0 2 A 5 0 0 3 D 2 9 1 2 C 0 0 4",
}
T2_PACKED = {
    "zero": "95 03 C2 01 91 54 1D B2 10 5A 00 D3 92 21 0C 40",
    "even": "A6 04 C2 01 91 54 1E B2 20 5A 00 D3 92 21 0C 40",
}


def _hex(s):
    return [int(v, 16) for v in s.split()]


@pytest.mark.parametrize("ties", ["zero", "even"])
def test_t2_group_e2m1(ties):
    x = torch.tensor([T2_X], dtype=torch.bfloat16)
    codes, scale = formats.quantize(x, "e2m1", PRE_DISPATCH, ties=ties)
    assert scale.tolist() == [[0x80]]
    assert codes[0].tolist() == _hex(T2_CODES[ties])
    packed = formats.pack_e2m1(codes)
    assert packed[0].tolist() == _hex(T2_PACKED[ties])
    assert torch.equal(formats.unpack_e2m1(packed), codes)
    assert torch.equal(formats.unpack_e2m1(packed.view(torch.int8)), codes)


@pytest.mark.parametrize("ties", ["zero", "even"])
def test_t2_fake_quantize_matches_codes(ties):
    x = torch.tensor([T2_X])
    codes, scale = formats.quantize(x, "e2m1", PRE_DISPATCH, ties=ties)
    assert torch.equal(formats.fake_quantize(x, "e2m1", PRE_DISPATCH, ties), formats.dequantize(codes, scale, "e2m1"))


def test_t2_modes_differ_only_at_the_listed_ties():
    x = torch.tensor([T2_X])
    zero, _ = formats.quantize(x, "e2m1", PRE_DISPATCH, ties="zero")
    even, _ = formats.quantize(x, "e2m1", PRE_DISPATCH, ties="even")
    assert torch.nonzero(zero[0] != even[0]).flatten().tolist() == [0, 1, 2, 12, 17]


def test_t2_group_e4m3():
    x = torch.tensor([T2_X])
    codes, scale = formats.quantize(x, "e4m3", PRE_DISPATCH)
    assert scale.tolist() == [[121]]
    assert codes[0, 0].item() == 0x7E  # 7 * 64 = 448
    assert torch.equal(formats.dequantize(codes, scale, "e4m3"), x)  # every element x 64 is exact


# --- T3: the RCEIL scale rule -----------------------------------------------------------------------


@pytest.mark.parametrize("amax,byte", [(5.0, 127), (6.0, 127), (7.0, 128)])
def test_t3_rceil_e2m1(amax, byte):
    assert formats.ue8m0_bytes(torch.tensor([amax]), 6.0, PRE_DISPATCH).item() == byte


@pytest.mark.parametrize("amax,byte", [(7.0, 121), (7.03125, 122)])
def test_t3_rceil_e4m3(amax, byte):
    assert formats.ue8m0_bytes(torch.tensor([amax]), 448.0, PRE_DISPATCH).item() == byte


def test_rceil_matches_ceil_log2_on_random_amax():
    amax = torch.rand(10000) * torch.exp2(torch.randint(-20, 20, (10000,)).float())
    for fmax in (6.0, 448.0):
        got = formats.ue8m0_bytes(amax, fmax, EPILOGUE).tolist()
        q = (amax * torch.tensor(1.0 / fmax)).tolist()  # the epilogue's q, an FP32 value
        want = [math.ceil(math.log2(v)) + 127 for v in q]  # exact: log2 of a power of two is exact
        assert got == want


# --- amax on a power of two, all-zero groups, floors (T5) --------------------------------------------


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 20])
def test_amax_equal_to_format_max_times_power_of_two(k):
    x = torch.zeros(1, 32)
    x[0, 3] = 6.0 * 2.0**k
    codes, scale = formats.quantize(x, "e2m1", EPILOGUE)  # no floor: the pre-dispatch floor is T5's
    assert scale.item() == 127 + k and codes[0, 3].item() == 0x7
    x[0, 3] = 448.0 * 2.0**k
    codes, scale = formats.quantize(x, "e4m3", EPILOGUE)
    assert scale.item() == 127 + k and codes[0, 3].item() == 0x7E


@pytest.mark.parametrize("k", [-10, 0, 1, 10])
def test_amax_exactly_a_power_of_two(k):
    x = torch.zeros(1, 32)
    x[0, 0] = -(2.0**k)
    codes, scale = formats.quantize(x, "e2m1", EPILOGUE)
    assert scale.item() == 127 + k - 2  # 2^k / 6 -> ceil(k - 2.58) = k - 2
    assert codes[0, 0].item() == 0xE  # -4
    codes, scale = formats.quantize(x, "e4m3", EPILOGUE)
    assert scale.item() == 127 + k - 8  # 2^k / 448 -> ceil(k - 8.81) = k - 8
    assert formats.dequantize(codes, scale, "e4m3")[0, 0].item() == -(2.0**k)


@pytest.mark.parametrize(
    "rule,fmt,byte",
    [(PRE_DISPATCH, "e2m1", 112), (PRE_DISPATCH, "e4m3", 105), (SGLANG_FP8, "e4m3", 85), (EPILOGUE, "e2m1", 0),
     (EPILOGUE, "e4m3", 0)],
)
def test_t5_all_zero_group(rule, fmt, byte):
    codes, scale = formats.quantize(torch.zeros(2, 64), fmt, rule)
    assert scale.unique().tolist() == [byte]
    assert codes.unique().tolist() == [0]
    assert formats.fake_quantize(torch.zeros(2, 64), fmt, rule).abs().sum().item() == 0.0


def test_t5_floor_coarsens_tiny_groups():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 3 * 2.0**-16, 1.5 * 2.0**-17
    codes, scale = formats.quantize(x, "e2m1", PRE_DISPATCH, ties="even")
    assert scale.item() == 112 and codes[0, :2].tolist() == [0x3, 0x1]
    assert formats.dequantize(codes, scale, "e2m1")[0, 1].item() == 2.0**-16
    codes, scale = formats.quantize(x, "e2m1", EPILOGUE, ties="even")
    assert scale.item() == 110 and codes[0, :2].tolist() == [0x7, 0x3]
    assert torch.equal(formats.dequantize(codes, scale, "e2m1"), x)  # exact


# --- T4 and E4M3 saturation -------------------------------------------------------------------------


def test_t4_e4m3_ties_to_even():
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([7.0, 1.0625, 1.1875])  # amax 7 -> byte 121, x 64
    codes, scale = formats.quantize(x, "e4m3", PRE_DISPATCH)
    assert scale.item() == 121
    assert codes[0, 1:3].tolist() == [0x68, 0x6A]
    assert formats.dequantize(codes, scale, "e4m3")[0, 1:3].tolist() == [1.0, 1.25]


def test_e4m3_saturates():
    y = torch.tensor([448.0, 449.0, 464.0, 1e6, float("inf"), -500.0, -float("inf")])
    assert formats.e4m3_encode(y).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    assert formats.e4m3_round(y).tolist() == [448, 448, 448, 448, 448, -448, -448]


def test_e2m1_saturates():
    assert formats.e2m1_encode(torch.tensor([6.5, 100.0, -1e9]), "zero").tolist() == [0x7, 0x7, 0xF]


def test_byte_clamp_keeps_scales_finite():
    big = torch.full((1, 32), 3e38)
    _, scale = formats.quantize(big, "e2m1", PRE_DISPATCH)
    assert scale.item() <= 254


def test_scale_bytes_are_exact_powers_of_two():
    b = torch.arange(0, 255, dtype=torch.uint8)
    assert formats.scale_from_byte(b).tolist() == [math.ldexp(1.0, i - 127) for i in range(255)]
    assert formats.inverse_scale_from_byte(b).tolist() == [math.ldexp(1.0, 127 - i) for i in range(255)]


# --- T6: router weight before the intermediate quantization -----------------------------------------


def _h():
    h = torch.zeros(1, 32)
    h[0, 0], h[0, 1] = 6.0, 1.25
    return h


@pytest.mark.parametrize("fmt_recipe", [Recipe(activations="e2m1", intermediate="e2m1")])
def test_t6_weight_before_quantization(fmt_recipe):
    v = weight_and_requantize(_h(), torch.tensor([0.5625]), fmt_recipe)
    assert v[0, :2].tolist() == [3.0, 0.5]


def test_t6_wrong_order_is_the_fault():
    faulty = Recipe(activations="e2m1", intermediate="e2m1", fault="router_weight_after_requant")
    v = weight_and_requantize(_h(), torch.tensor([0.5625]), faulty)
    assert v[0, :2].tolist() == [3.375, 0.5625]


# --- T7: BF16 round and the one-sided gate clamp ----------------------------------------------------


def test_t7_bf16_round_and_clamp():
    acc = torch.tensor([[12.3, 10.02, -20.0, 1.0, 0.0, -10.04, 0.0, 0.0]])  # [gate x4; up x4]
    g, u = gate_up_to_bf16(acc, 10.0)
    assert g[0].tolist() == [10.0, 10.0, -20.0, 1.0]
    assert formats.bf16_round(torch.tensor([12.3, -10.04])).tolist() == [12.3125, -10.0625]
    assert u[0, 1].item() == -10.0


def test_t7_swiglu_fp32():
    v = weight_and_requantize(swiglu(torch.tensor([[1.0]]), torch.tensor([[2.0]])), torch.tensor([0.25]),
                              Recipe(activations="e4m3", intermediate="none"))
    assert v.item() == pytest.approx(0.3655293, abs=1e-7)
    assert v.dtype == torch.float32


# --- T8: FP32 combine in slot order -----------------------------------------------------------------


def test_t8_combine_fp32_then_bf16():
    o = torch.zeros(1, 3, 2)
    o[0, :, 0] = torch.tensor([1.0, 2.0**-8, 2.0**-8])
    assert combine(o)[0, 0].item() == 1.0078125
    running = torch.tensor(1.0, dtype=torch.bfloat16)
    for v in (2.0**-8, 2.0**-8):
        running = running + torch.tensor(v, dtype=torch.bfloat16)
    assert running.item() == 1.0  # what a BF16 running sum would give instead


# --- an independent scalar reference (pure Python floats and fractions) ------------------------------

from fractions import Fraction  # noqa: E402


def _scalar_quantize(group, fmax, ties, floor=0.0):
    """RCEIL + nearest-grid rounding, one Python number at a time, straight from docs/kernels.md#ue8m0-scales and docs/kernels.md#tie-modes."""
    amax = max(max(abs(v) for v in group), floor)
    q = Fraction(amax) / Fraction(fmax)
    e = -127 if q == 0 else math.ceil(math.log2(q))
    while Fraction(2) ** e < q:  # log2 of a float may round; fix up exactly
        e += 1
    while e > -127 and Fraction(2) ** (e - 1) >= q:
        e -= 1
    grid = [Fraction(m) for m in formats.E2M1_MAGNITUDES]
    out = []
    for v in group:
        y = min(abs(Fraction(v)) / Fraction(2) ** e, Fraction(6))
        best = min(range(8), key=lambda i: (abs(grid[i] - y), i if ties == "zero" else (i % 2, i)))
        out.append(best + (8 if v < 0 and best else 0))
    return out, e + 127


@pytest.mark.parametrize("ties", ["zero", "even"])
def test_matches_scalar_reference_on_random_groups(ties):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(40, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (40, 1), generator=g).float()))
    x = x.to(torch.bfloat16).float()
    x[0, 3] = x[0, :32].abs().max() * 0.75 / 6 * 6  # exact midpoints appear in BF16 data
    codes, scale = formats.quantize(x, "e2m1", formats.WEIGHTS, ties=ties)
    for r in range(x.shape[0]):
        for gi in range(2):
            group = x[r, 32 * gi : 32 * gi + 32].tolist()
            want_codes, want_byte = _scalar_quantize(group, 6.0, ties)
            assert scale[r, gi].item() == want_byte
            assert codes[r, 32 * gi : 32 * gi + 32].tolist() == want_codes
