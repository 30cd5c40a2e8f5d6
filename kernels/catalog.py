"""The emulated kernels evalgate knows, registered on import from their declarations in names.py
(docs/kernels.md#kernels-at-a-glance and #selecting-a-real-kernel for names, versions, env).

Healthy kernels: `w4a8`, `w4a8_sglang`, `w4a4`, `w4a4_packed`, `w4a4_te`. Fault-injected kernels carry
the `faulty/` prefix and `faulty=True`; each names its healthy `twin`. None of them is ever a default.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import names
from .names import W4A4, W4A4_TE, W4A8, W4A8_SGLANG  # noqa: F401  (the recipes, importable from here)
from .checkpoint import prepare_fp4_model
from .emulator import experts_forward
from .fp8_moe import Fp8Recipe, recipe_forward
from .recipe import Recipe
from .registry import Kernel, get_kernel, register_kernel


def _emulated(name, version, description, recipe: Recipe, api=None, faulty=False, twin=None) -> Kernel:
    return register_kernel(
        Kernel(
            name=name,
            version=version,
            description=description,
            experts_forward=experts_forward(recipe),
            declared=recipe,
            faulty=faulty,
            twin=twin,
            api=dict(api or {}),
            prepare_model=prepare_fp4_model,
        )
    )


for _k in names.EMULATED_KERNELS:
    _emulated(_k.name, _k.version, _k.description, _k.recipe, api=dict(_k.api))


def _faulty(suffix: str, fault: str, description: str) -> Kernel:
    return _emulated(
        f"faulty/{names.PACKED}-{suffix}", "fault-injected (evalgate test double)",
        description, replace(W4A4, fault=fault), faulty=True, twin=names.PACKED,
    )


for _suffix, (_fault, _description) in names.PACKED_FAULTS.items():
    if _fault != "one_expert_router_weight":  # a fault of the router weights, not of the recipe: below
        _faulty(_suffix, _fault, _description)


# --- a fault confined to one expert (kernels/conformance.py holds every expert to its limit) ----------------

ONE_EXPERT = 1
ONE_EXPERT_FACTOR = 1 + 1 / 512


def _one_expert_fault(healthy):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        w = top_k_weights.to(torch.float32)  # the kernel computes in FP32 (a BF16 weight would round the factor away)
        return healthy(self, hidden_states, top_k_index, torch.where(top_k_index == ONE_EXPERT, w * ONE_EXPERT_FACTOR, w))

    forward.__name__ = "evalgate_one_expert_fault_forward"
    return forward


register_kernel(Kernel(
    name=f"faulty/{names.PACKED}-one-expert", version="fault-injected (evalgate test double)",
    description=f"w4a4_packed with expert {ONE_EXPERT}'s router weight x (1 + 1/512) (one expert of all)",
    experts_forward=_one_expert_fault(get_kernel(names.PACKED).experts_forward),
    declared=replace(W4A4, fault=names.PACKED_FAULTS["one-expert"][0]),
    faulty=True, twin=names.PACKED, prepare_model=prepare_fp4_model,
))


# --- FP8 grouped-GEMM recipes: the exact definitions of the SM90 real kernels (kernels/real/) ---------------

def _fp8_recipe(name: str, layout: str, real: str, description: str) -> Kernel:
    recipe = Fp8Recipe(layout)
    return register_kernel(Kernel(
        name=name, version=f"evalgate recipe: the exact definition of {real} (kernels/fp8_moe.py)",
        description=description, experts_forward=recipe_forward(recipe), declared=recipe,
        prepare_model=prepare_fp4_model,
    ))


for _name, (_layout, _real, _description) in names.FP8_RECIPES.items():
    _fp8_recipe(_name, _layout, _real, _description)
