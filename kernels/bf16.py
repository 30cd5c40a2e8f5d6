"""The ``bf16`` reference: no quantization. It is transformers' own grouped-mm experts forward, so a run
with ``--kernel bf16`` computes exactly what the model computes without evalgate."""

from transformers.integrations.moe import grouped_mm_experts_forward

from .registry import Kernel, register_kernel

BF16 = register_kernel(
    Kernel(
        name="bf16",
        version="transformers-grouped_mm",
        description="BF16 weights and activations, no quantization (the reference)",
        experts_forward=grouped_mm_experts_forward,
        env={},
        recipe={"weights": "bf16", "activations": "bf16", "intermediate": "bf16"},
    )
)
