"""The ``bf16`` reference: no quantization. It is transformers' own grouped-mm experts forward, so a run
with ``--kernel bf16`` computes exactly what the model computes without evalgate.

One guard: outside expert parallelism, transformers' grouped_mm path leaves the rows of empty slots
(index E, or -1) uninitialised and sums them into the output (NaN in practice). Empty slots are turned
into weight-0 slots of expert 0 first, which adds exact zeros: the same as skipping them.

In a model with canonical numerics (``evalgate.model_adapters.canonical.invariant``) the same function is computed
with canonical matmuls, SiLU and slot sums (``canonical_bf16_experts``), so that it is reproducible too."""

import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from . import canonical, names
from .recipe import Unquantized
from .registry import Kernel, register_kernel


def bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    if getattr(self, "_evalgate_canonical", False):
        return canonical_bf16_experts(self, hidden_states, top_k_index, top_k_weights)
    empty = (top_k_index < 0) | (top_k_index >= self.num_experts)
    if bool(empty.any()):
        top_k_index = top_k_index.masked_fill(empty, 0)
        top_k_weights = top_k_weights.masked_fill(empty, 0)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _expert_operand(module, name: str):
    """All experts' [E, out, in] weights on their fixed-point grid, as [E, in, out] right operands."""
    weight = getattr(module, name)
    return canonical.cached_operand(module, f"experts:{name}", weight,
                                    lambda w: canonical.fixed_operand(w.transpose(-2, -1), "columns"))


def _per_expert(a: torch.Tensor, expert: torch.Tensor, num_experts: int, operand, dtype) -> torch.Tensor:
    """Rows a [S, K] times their own expert's weights: rows padded into [E, max_rows, K], one canonical
    batched matmul (a row's result depends on that row only)."""
    counts = torch.bincount(expert, minlength=num_experts)
    order = torch.argsort(expert, stable=True)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(len(order), device=a.device) - start[expert[order]]
    block = a.new_zeros(num_experts, int(counts.max()), a.shape[-1])
    block[expert[order], pos] = a[order]
    out = canonical.fixed_matmul(block, operand, dtype)[expert[order], pos]
    back = torch.empty_like(out)
    back[order] = out
    return back


def canonical_bf16_experts(self, hidden_states, top_k_index, top_k_weights):
    """``grouped_mm_experts_forward`` + ``DeepseekV4Experts._apply_gate`` with canonical numerics: BF16
    projections (fixed_matmul), SiLU correctly rounded, the slot sum in slot order in FP32."""
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < self.num_experts)
    rows = valid.nonzero().flatten()
    out = torch.zeros(t * k, hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
    if len(rows):
        expert = flat[rows].long()
        x = hidden_states[rows // k]
        gate_up = _per_expert(x, expert, self.num_experts, _expert_operand(self, "gate_up_proj"), hidden_states.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        limit = getattr(self, "limit", None)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        h = canonical.silu(gate).to(gate.dtype) * up
        o = _per_expert(h, expert, self.num_experts, _expert_operand(self, "down_proj"), hidden_states.dtype)
        out[rows] = (o * top_k_weights.reshape(-1)[rows, None]).float()
    return canonical.ordered_sum(out.view(t, k, -1), 1).to(hidden_states.dtype)


BF16 = register_kernel(
    Kernel(
        name=names.BF16,
        version="transformers-grouped_mm",
        description="BF16 weights and activations, no quantization (the reference)",
        experts_forward=bf16_experts_forward,
        declared=Unquantized(),
    )
)
