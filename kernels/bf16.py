"""The ``bf16`` reference: no quantization. It is transformers' own grouped-mm experts forward, so a run
with ``--kernel bf16`` computes exactly what the model computes without evalgate.

One guard: outside expert parallelism, transformers' grouped_mm path leaves the rows of empty slots
(index E, or -1) uninitialised and sums them into the output (NaN in practice). Empty slots are turned
into weight-0 slots of expert 0 first, which adds exact zeros: the same as skipping them."""

from transformers.integrations.moe import grouped_mm_experts_forward

from .registry import Kernel, register_kernel


def bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    empty = (top_k_index < 0) | (top_k_index >= self.num_experts)
    if bool(empty.any()):
        top_k_index = top_k_index.masked_fill(empty, 0)
        top_k_weights = top_k_weights.masked_fill(empty, 0)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


BF16 = register_kernel(
    Kernel(
        name="bf16",
        version="transformers-grouped_mm",
        description="BF16 weights and activations, no quantization (the reference)",
        experts_forward=bf16_experts_forward,
        env={},
        recipe={"weights": "bf16", "activations": "bf16", "intermediate": "bf16"},
    )
)
