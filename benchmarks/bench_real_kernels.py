"""Real kernels against their emulated recipes on a GPU: the differences the conformance limits rest on, and speed.

    python benchmarks/bench_real_kernels.py --steps canary,dsv4,speed --tokens 16,512,4096 --json OUT.json

canary, dsv4: for each real kernel, the canary's own hidden states (its forward pass over the first GSM8K
prompts, as the gate captures them) and one synthetic DSV4-Flash layer (hidden 4096, intermediate 2048, 256
experts, top-6, `evalgate kernels check`'s layer) through the real kernel and its recipe: per layer the
worst expert's and the worst token's calc_diff, the largest difference relative to the row's largest
output, and the share of BF16 outputs that differ from the recipe's (the correctly rounded exact result).
speed: one DSV4-Flash layer, median ms per call of each real kernel, its emulated recipe and transformers'
BF16 grouped_mm in the same run, as ratios to BF16.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REAL = ("deepgemm/fp8_block128", "torch/fp8_rowwise")
DEVICE = "cuda"
OUT: dict = {}  # everything measured so far; written to --json after every row
JSON: Path | None = None


def record(key: str, row: dict) -> None:
    OUT.setdefault(key, []).append(row)
    print(json.dumps(row)[:800], flush=True)
    if JSON is not None:
        JSON.write_text(json.dumps(OUT, indent=1))


def layer_stats(experts, tokens) -> dict:
    worst_e = max(experts, key=lambda f: f.calc_diff, default=None)
    worst_t = max(tokens, key=lambda f: f.calc_diff, default=None)
    return {"expert_calc_diff": worst_e.calc_diff if worst_e else 0.0, "worst_expert": worst_e and worst_e.label(),
            "token_calc_diff": worst_t.calc_diff if worst_t else 0.0,
            "max_rel": max((f.max_rel for f in experts + tokens), default=0.0),
            "differing_share": sum(f.differing for f in tokens) / max(sum(f.elements for f in tokens), 1),
            "expert_differing_share": sum(f.differing for f in experts) / max(sum(f.elements for f in experts), 1)}


def measure_canary(names, prompts: int) -> None:
    from evalgate.canary import CANARY_DIR, PROFILES
    from evalgate.kernels.conformance import capture_routed_inputs, model_conformance
    from evalgate.model_adapters.hf.adapter import load_model
    from evalgate.tasks import get_task, resolve_profile
    from evalgate.tasks.data import resolve_data_dir

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, PROFILES["gsm8k"]), resolve_data_dir(None), prompts)
    texts = [r.prompt for r in task.requests(items, resolved)]
    for name in names:
        model, tok = load_model(CANARY_DIR, name, device=DEVICE)
        ids = [tok(t, return_tensors="pt").input_ids[0] for t in texts]
        captured = capture_routed_inputs(model, ids)
        t0 = time.perf_counter()
        c = model_conformance(model, name, captured=captured)
        record("canary", {"kernel": name, "ok": c.ok, "summary": c.summary(), "calc_diff": c.calc_diff,
                          "differing_share": c.differing / max(c.elements, 1), "max_rel": c.max_rel,
                          "worst_tokens": c.worst_tokens[:3], "per_layer": c.per_layer,
                          "implementation": c.implementation, "seconds": round(time.perf_counter() - t0, 2)})
        del model


def measure_dsv4(names, tokens: int) -> None:
    from evalgate.kernels import check, get_kernel
    from evalgate.kernels.conformance import _layer_findings
    from evalgate.kernels.fp8_moe import Fp8Recipe, convert_fp4_weights

    case = check.synthetic_layer("dsv4-flash", tokens)
    module = check.Fp4ExpertsModule(case.weights, case.limit, DEVICE)
    x, idx, w = case.x.to(DEVICE), case.top_k_index.to(DEVICE), case.top_k_weights.to(DEVICE)
    for name in names:
        kernel = get_kernel(name)
        t0 = time.perf_counter()
        e, t = _layer_findings(0, kernel, get_kernel(kernel.reference), module, x, idx, w, kernel.tolerance)
        conv = convert_fp4_weights(module, Fp8Recipe(kernel.recipe["layout"]), DEVICE)
        record("dsv4", {"tokens": tokens, "kernel": name, **layer_stats(e, t),
                        "failed": sum(not f.ok for f in e + t), "weights_inexact": conv.inexact,
                        "weights": conv.elements, "seconds": round(time.perf_counter() - t0, 2)})


def speed(names, token_counts, repeat: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_kernels import SHAPES, build_experts, route, time_kernel

    from evalgate.kernels import get_kernel

    shape = SHAPES["dsv4-flash"]
    module = build_experts(shape, "cuda", 0)
    kernels = ["bf16"] + [k for n in names for k in (n, get_kernel(n).reference)]
    for t in token_counts:
        g = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randn(t, shape["hidden"], generator=g, device="cuda").bfloat16()
        idx, w = route(x, shape["experts"], shape["top_k"], 0)
        base = None
        for name in kernels:
            reps = repeat if get_kernel(name).real or name == "bf16" else max(2, repeat // 5)
            first, per_call, extra, same = time_kernel(module, name, x, idx, w, reps, "cuda")
            base = per_call if name == "bf16" else base
            record("speed", {"tokens": t, "kernel": name, "first_s": round(first, 3), "ms": round(per_call * 1e3, 3),
                             "x_bf16": round(per_call / base, 3), "same_bits": same})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(REAL))
    p.add_argument("--steps", default="canary,dsv4,speed", help="canary: the canary's hidden states; dsv4: a "
                   "DSV4-Flash layer; speed: timings at --tokens")
    p.add_argument("--prompts", type=int, default=8, help="canary GSM8K prompts whose hidden states are captured")
    p.add_argument("--dsv4-tokens", type=int, default=512)
    p.add_argument("--tokens", default="16,512,4096")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_real_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import evalgate.kernels  # noqa: F401

    global JSON
    JSON = Path(args.json) if args.json else None
    names = [n for n in args.kernels.split(",") if n]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    OUT.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    known = {"canary": lambda: measure_canary(names, args.prompts),
             "dsv4": lambda: measure_dsv4(names, args.dsv4_tokens),
             "speed": lambda: speed(names, [int(t) for t in args.tokens.split(",")], args.repeat)}
    for step in [known[s] for s in args.steps.split(",") if s]:
        try:
            step()
        except Exception as exc:  # one failed step leaves the others' numbers
            import traceback

            traceback.print_exc()
            record("errors", {"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
