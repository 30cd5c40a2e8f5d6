"""The packed W4A4 recipe in plain PyTorch, written from the recipe (docs/kernels.md#the-moe-forward in
evalgate), not from evalgate's emulator: what a kernel engineer writes to check a port on a CPU.

transformers calls ``experts_forward(experts_module, hidden_states[T, H], top_k_index[T, K],
top_k_weights[T, K]) -> [T, H]`` for the routed experts of one MoE layer. The weights come as the
checkpoint stores them (``evalgate.kernels.weights.fp4_weights``: packed E2M1 codes, UE8M0 bytes per 32).
Every product of two FP4 values is exact in float64, and so is their sum at these sizes: a float64 GEMM
rounded once to FP32 is the recipe's exact accumulation.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e for integer e in [-1022, 1023], exactly, in float64 (from the bits: exp2 may round)."""
    return ((e.long() + 1023) << 52).view(torch.float64)


def dequantize(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [..., K/2] (low nibble first) and UE8M0 bytes [..., K/32] -> float64 [..., K]."""
    p = packed.view(torch.uint8).long()
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], -1)
    values = E2M1.double()[codes]
    scale = pow2(scale_bytes.view(torch.uint8).long() - 127).repeat_interleave(GROUP, dim=-1)
    return values * scale


def scale_bytes(amax: torch.Tensor, floor: float, multiply: bool, clamp) -> torch.Tensor:
    """UE8M0 byte of ceil(log2(amax / 6)) + 127 from the FP32 bits of amax / 6 (RCEIL)."""
    amax = amax.float().clamp(min=floor) if floor else amax.float()
    q = amax * torch.tensor(1 / 6, dtype=torch.float32) if multiply else amax / 6.0
    bits = q.view(torch.int32)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return byte.clamp(*clamp) if clamp else byte


def e2m1_round(y: torch.Tensor, ties: str) -> torch.Tensor:
    """Nearest E2M1 value (|y| clamped to 6): the grid is 0.5 apart below 2, 1 below 4, 2 up to 6."""
    a = y.abs().clamp(max=6.0)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    n = a / step
    n = torch.round(n) if ties == "even" else torch.ceil(n - 0.5)
    return (n * step).copysign(y)


def fake_quantize_e2m1(x: torch.Tensor, ties: str, floor: float, multiply: bool, clamp) -> torch.Tensor:
    """Per row, groups of 32: the FP32 values an E2M1 + UE8M0 tensor holds."""
    g = x.float().reshape(*x.shape[:-1], -1, GROUP)
    byte = scale_bytes(g.abs().amax(-1), floor, multiply, clamp).unsqueeze(-1)
    y = g * pow2(127 - byte).float()
    return (e2m1_round(y, ties) * pow2(byte - 127).float()).reshape(x.shape)


def _weights(module):
    from evalgate.kernels.weights import fp4_weights

    fp4 = fp4_weights(module)
    cache = module.__dict__.get("_example_cpu_weights")
    if cache is None or cache[0] is not fp4:
        cache = (fp4, dequantize(fp4.w1, fp4.w1_scale), dequantize(fp4.w2, fp4.w2_scale))
        module.__dict__["_example_cpu_weights"] = cache
    return cache[1], cache[2]


def _limit(module):
    limit = getattr(module, "limit", None)
    return getattr(module, "swiglu_limit", None) if limit is None else limit


def _forward(module, hidden_states, top_k_index, top_k_weights, input_ties: str):
    with torch.no_grad():
        w1, w2 = _weights(module)  # [E, 2I, H], [E, H, I] float64
        experts = w1.shape[0]
        t, k = top_k_index.shape
        x = hidden_states.to(torch.bfloat16).float()
        # the input: E2M1, pre-dispatch rule (amax floor 1e-4, q = amax / 6, byte in [1, 254])
        xq = fake_quantize_e2m1(x, input_ties, 1e-4, False, (1, 254)).double()
        slot_out = torch.zeros(t, k, x.shape[-1], dtype=torch.float32)
        limit = _limit(module)
        for e in top_k_index.unique().tolist():
            if not 0 <= e < experts:
                continue  # an empty slot (index E or -1) adds nothing
            token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            acc = (xq[token] @ w1[e].T).float()  # L1, rounded once to FP32
            inter = acc.shape[-1] // 2
            g = acc[:, :inter].bfloat16().float()
            u = acc[:, inter:].bfloat16().float()
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            h = (g / (1.0 + torch.exp(-g.double()).float())) * u  # exp correctly rounded to FP32
            h = h * top_k_weights[token, slot].float()[:, None]  # the router weight, before the re-quantization
            hq = fake_quantize_e2m1(h, "even", 0.0, True, None).double()  # epilogue rule, RNE
            slot_out[token, slot] = (hq @ w2[e].T).float().bfloat16().float()  # L2, then BF16
        y = slot_out[:, 0].clone()
        for s in range(1, k):  # the combine: FP32 in slot order
            y += slot_out[:, s]
        return y.to(hidden_states.dtype)


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    return _forward(module, hidden_states, top_k_index, top_k_weights, input_ties="zero")


def ties_even_forward(module, hidden_states, top_k_index, top_k_weights):
    """The fault of ``declarations.FAULTY_TIES``: the input rounded ties-to-even."""
    return _forward(module, hidden_states, top_k_index, top_k_weights, input_ties="even")
