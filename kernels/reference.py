"""References the layer-level check measures kernels against, with the same run-in-expert-ranges
interface as `emulator.MoEEmulation` (`run_chunk(lo, hi, w1, w2)`, `finish()`).

- `Fp32Reference`: the routed experts in FP32 end to end on the same (FP4-exact) weights: no activation
  or intermediate quantization, no BF16 rounding anywhere, weight applied in FP32. Weight quantization is
  a property of the checkpoint, not of a kernel, so the reference holds it fixed.
- `Bf16GroupedMM`: what the `bf16` kernel (transformers' grouped_mm experts forward) computes, range by
  range, so it runs at shapes whose BF16 weights would not fit in memory at once.
"""

from __future__ import annotations

import torch

from .emulator import ExpertRows


class Fp32Reference(ExpertRows):
    recipe = None
    exact = False  # a reference, not a kernel: float64 products, rounded to FP32

    def __init__(self, x, top_k_index, top_k_weights, num_experts, limit):
        super().__init__(x, top_k_index, top_k_weights, num_experts)
        self.limit = limit
        self.x = x.to(torch.float32)
        self.slot_out = torch.zeros(self.shape[0] * self.shape[1], self.shape[2])

    def l1_input(self, begin, end):
        return self.x[self.token[begin:end]]

    def l2_input(self, begin, end, acc):
        i = acc.shape[-1] // 2
        g, u = acc[:, :i], acc[:, i:]
        if self.limit is not None:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return torch.nn.functional.silu(g) * u * self.w[begin:end, None]

    def store(self, begin, end, out):
        self.slot_out[self.rows[begin:end]] = out

    def finish(self):
        return self.slot_out.view(self.shape).sum(dim=1)


class Bf16GroupedMM(ExpertRows):
    """transformers `grouped_mm_experts_forward` + DeepseekV4Experts._apply_gate, in BF16.

    The GEMMs run in float64 on BF16-valued operands, rounded to FP32 and then BF16: what a BF16 GEMM with
    FP32 accumulation computes up to summation order, so this runner can share weights and a batched matmul
    with the others."""

    recipe = None
    exact = False

    def __init__(self, x, top_k_index, top_k_weights, num_experts, limit):
        super().__init__(x, top_k_index, top_k_weights, num_experts)
        self.limit = limit
        self.x = x.to(torch.bfloat16).to(torch.float32)
        self.w = top_k_weights.reshape(-1)[self.rows]  # in the router's dtype, as transformers uses them
        # transformers multiplies the BF16 expert output by the router weights in their own dtype
        self.out_dtype = torch.promote_types(torch.bfloat16, top_k_weights.dtype)
        self.slot_out = torch.zeros(self.shape[0] * self.shape[1], self.shape[2], dtype=self.out_dtype)

    def l1_input(self, begin, end):
        return self.x[self.token[begin:end]]

    def l2_input(self, begin, end, acc):
        gate, up = acc.to(torch.bfloat16).chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (torch.nn.functional.silu(gate) * up).to(torch.float32)

    def store(self, begin, end, out):
        self.slot_out[self.rows[begin:end]] = out.to(torch.bfloat16) * self.w[begin:end, None]

    def finish(self):
        return self.slot_out.view(self.shape).sum(dim=1).to(torch.bfloat16).to(torch.float32)
