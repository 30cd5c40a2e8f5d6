"""How far a correct kernel that accumulates in another order or precision lands from the canonical emulation:
the ``calc_diff`` tolerance in docs/kernels.md#checking-a-real-kernel.

    python benchmarks/accumulation_tolerance.py [--shape tiny|mid] [--tokens 256] [--seeds 3]

One synthetic MoE layer (``evalgate.kernels.check``), each healthy kernel's recipe run with the canonical
accumulation (exact sums rounded once to FP32) and with hardware-like ones:

- ``fp32 per block``: the exact sum of each 32-element block added to an FP32 accumulator in ascending K
  (what a block-scaled MMA into an FP32 accumulator does if its internal sums are exact);
- ``25-bit blocks``: the same with each block sum truncated to 25 significant bits first (the accumulator
  width reported for B200 ``kind::f8f6f4``, DeepGEMM issue #176);
- ``fp32 BLAS``: an FP32 matrix product in BLAS order (evalgate's emulation before canonical-v1).

Printed: calc_diff against the canonical output (max over seeds) and the share of BF16-identical outputs, and
for scale each fault-injected twin's calc_diff against its healthy kernel.
"""

from __future__ import annotations

import argparse

import torch

from evalgate.kernels import check, get_kernel
from evalgate.kernels.canonical import exponent, pow2
from evalgate.kernels.emulator import MoEEmulation
from evalgate.kernels.exact import GemmWeights, _fp32_grouped

SHAPES = {"tiny": check.SHAPES["tiny"],
          "mid": dict(hidden=1024, intermediate=512, experts=32, top_k=6, routed_scaling=1.5, swiglu_limit=10.0)}


def _truncate(t: torch.Tensor, bits: int) -> torch.Tensor:
    q = pow2(exponent(t).to(torch.int64) - bits)
    return torch.trunc(t / q) * q


def blockwise(bits: int | None):
    def gemm(a, w, group):
        out = torch.empty(a.shape[0], w.shape[1], dtype=torch.float32)
        for g in group.unique().tolist():
            rows = (group == g).nonzero().flatten()
            ab = a[rows].double().view(len(rows), -1, 32)
            wb = w[g].double().view(w.shape[1], -1, 32)
            blocks = torch.einsum("rbk,nbk->rnb", ab, wb)  # exact block sums
            acc = torch.zeros(len(rows), w.shape[1], dtype=torch.float32)
            for b in range(blocks.shape[-1]):
                term = blocks[..., b] if bits is None else _truncate(blocks[..., b], bits)
                acc = (acc.double() + term).float()
            out[rows] = acc
        return out
    return gemm


def fp32_blas(a, w, group):
    return _fp32_grouped(a, GemmWeights.of(w), group)


class Variant(MoEEmulation):
    gemm = None

    def run_chunk(self, lo, hi, w1, w2):
        begin, end = self.span(lo, hi)
        if end == begin:
            return
        group = self.expert[begin:end] - lo
        acc = self.gemm(self.l1_input(begin, end), w1, group)
        self.store(begin, end, self.gemm(self.l2_input(begin, end, acc), w2, group))


def run(case, recipe, gemm=None):
    cls = MoEEmulation
    if gemm is not None:
        cls = type("V", (Variant,), {"gemm": staticmethod(gemm)})
    em = cls(case.x, case.top_k_index, case.top_k_weights, recipe, case.weights.num_experts, case.limit,
             case.routed_scaling)
    w1, w2 = case.weights.dequantize()
    em.run_chunk(0, case.weights.num_experts, w1, w2)
    return em.finish()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    check.SHAPES.setdefault("mid", SHAPES["mid"])
    variants = {"fp32 per block": blockwise(None), "25-bit blocks": blockwise(25), "fp32 BLAS": fp32_blas}
    worst: dict = {}
    for seed in range(args.seeds):
        case = check.synthetic_layer(args.shape, args.tokens, seed=seed)
        for name in ("w4a8", "w4a4_packed", "w4a4_te"):
            recipe = get_kernel(name).experts_forward.recipe
            ref = run(case, recipe)
            for vname, gemm in variants.items():
                out = run(case, recipe, gemm)
                cd = check.calc_diff(out, ref)
                same = float((out == ref).float().mean())
                w = worst.setdefault((name, vname), [0.0, 1.0])
                w[0], w[1] = max(w[0], cd), min(w[1], same)
            for faulty in ("faulty/w4a4_packed-weight-after-requant", "faulty/w4a4_packed-scale-exp"):
                if name == "w4a4_packed":
                    cd = check.calc_diff(run(case, get_kernel(faulty).experts_forward.recipe), ref)
                    w = worst.setdefault((faulty, "vs its healthy twin"), [1.0, 1.0])
                    w[0] = min(w[0], cd)  # the least a fault shows
    print(f"shape {args.shape}, {args.tokens} tokens, {args.seeds} seeds")
    print(f"{'kernel':<42} {'accumulation':<20} {'calc_diff vs canonical':>24} {'BF16-identical':>15}")
    for (name, vname), (cd, same) in worst.items():
        print(f"{name:<42} {vname:<20} {cd:>24.2e} {same if 'twin' not in vname else float('nan'):>15.4f}")


if __name__ == "__main__":
    main()
