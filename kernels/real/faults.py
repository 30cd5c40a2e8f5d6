"""Faults injected at a real kernel's boundary: the FP8 weights and scales handed to the library are wrong in
a way a real integration bug makes them wrong. Each is a function of the converted weights
(`fp8_moe.Fp8Weights`) that returns what the faulty integration would pass instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..fp8_moe import Fp8Operand, Fp8Weights

EXPERT = 1  # the expert a one-expert fault hits (its neighbour: EXPERT + 1)


def scale_layout(w: Fp8Weights) -> Fp8Weights:
    """Both scale tensors written expert-minor ([N/bn, K/bk, E] in memory) and read expert-major [E, N/bn,
    K/bk]: every scale lands on another expert's block."""
    def misread(op: Fp8Operand) -> Fp8Operand:
        return Fp8Operand(op.codes, op.scale.movedim(0, -1).contiguous().view(op.scale.shape))
    return replace(w, w1=misread(w.w1), w2=misread(w.w2))


def swap_expert(w: Fp8Weights) -> Fp8Weights:
    """Expert EXPERT's weights (codes and scales, both GEMMs) swapped with its neighbour's."""
    order = torch.arange(w.w1.codes.shape[0], device=w.w1.codes.device)
    order[EXPERT], order[EXPERT + 1] = EXPERT + 1, EXPERT
    return replace(w, w1=w.w1.take(order), w2=w.w2.take(order))


def stale_scale(w: Fp8Weights) -> Fp8Weights:
    """One block of expert EXPERT's W1 keeps the scale it had before its codes were re-encoded at half the
    scale: the block's values come out twice as large."""
    scale = w.w1.scale.clone()
    scale[EXPERT, 0, 0] *= 2
    return replace(w, w1=Fp8Operand(w.w1.codes, scale))


FAULTS = {"scale-layout": scale_layout, "swap-expert": swap_expert, "stale-scale": stale_scale}
DESCRIPTIONS = {
    "scale-layout": "both scale tensors read expert-major after being written expert-minor",
    "swap-expert": f"expert {EXPERT}'s weights and scales swapped with expert {EXPERT + 1}'s",
    "stale-scale": f"one W1 block of expert {EXPERT} with the scale from before its codes were re-encoded",
}
