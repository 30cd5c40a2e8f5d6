"""Which implementation an emulated kernel runs: the PyTorch emulator or the Triton kernels.

`EVALGATE_KERNEL_BACKEND` = auto (default) | torch | triton. auto runs Triton for CUDA inputs when Triton
imports, and the emulator otherwise; triton runs Triton everywhere (on a CPU only under
``TRITON_INTERPRET=1``, Triton's interpreter) and fails loudly where it cannot. Both compute the same bits.
"""

from __future__ import annotations

import os

from evalgate.errors import UserError

from .availability import available, unavailable_reason

BACKEND_ENV = "EVALGATE_KERNEL_BACKEND"
BACKENDS = ("auto", "torch", "triton")


def backend() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise UserError(f"{BACKEND_ENV}={value!r}; expected one of {', '.join(BACKENDS)}")
    return value


def supports(recipe) -> bool:
    """Recipes the Triton path computes: quantized input and intermediate (every registered kernel)."""
    return recipe.activations in ("e2m1", "e4m3") and recipe.intermediate in ("e2m1", "e4m3")


def use_triton(hidden_states, recipe) -> bool:
    choice = backend()
    if choice == "torch":
        return False
    device = hidden_states.device.type
    if choice == "triton":
        reason = unavailable_reason(device) or (None if supports(recipe) else f"recipe {recipe} is not supported")
        if reason:
            raise UserError(f"{BACKEND_ENV}=triton: {reason}")
        return True
    return device == "cuda" and available("cuda") and supports(recipe)


def with_backend_choice(torch_forward):
    """Wrap an emulated kernel's transformers experts function so that it runs the Triton kernels where
    `use_triton` says so. Functions without a recipe (bf16) are returned unchanged."""
    recipe = getattr(torch_forward, "recipe", None)
    if recipe is None or getattr(torch_forward, "torch_forward", None) is not None:
        return torch_forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if use_triton(hidden_states, recipe):
            from .moe import triton_experts_forward

            return triton_experts_forward(self, hidden_states, top_k_index, top_k_weights, recipe)
        return torch_forward(self, hidden_states, top_k_index, top_k_weights)

    forward.__name__ = torch_forward.__name__
    forward.recipe = recipe
    forward.torch_forward = torch_forward
    return forward
