"""Time one MoE layer's routed experts for each kernel against transformers' grouped_mm BF16 experts.

    python benchmarks/bench_kernels.py                                   # CPU, small shape
    python benchmarks/bench_kernels.py --device cuda --shape dsv4-flash --tokens 16,512

Prints numbers; not a test. The first call of an emulated kernel on a module quantizes the BF16 weights
to FP4 and caches them (and their FP32 dequantization); it is reported apart ("first call") from the
steady-state time per call. Router: sqrt-softplus top-k, as DeepseekV4TopKRouter (spec docs/kernels.md#routing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {
    "small": dict(hidden=1024, intermediate=512, experts=32, top_k=6),
    "dsv4-flash": dict(hidden=4096, intermediate=2048, experts=256, top_k=6),
}


def build_experts(shape: dict, device: str, seed: int):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    config = DeepseekV4Config(hidden_size=shape["hidden"], moe_intermediate_size=shape["intermediate"],
                              n_routed_experts=shape["experts"], num_experts_per_tok=shape["top_k"])
    config._experts_implementation = "bf16"
    with torch.device("meta"):
        module = DeepseekV4Experts(config)
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    module.gate_up_proj = torch.nn.Parameter(
        (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).bfloat16(), requires_grad=False)
    module.down_proj = torch.nn.Parameter(
        (torch.randn(e, h, i, generator=g, device=device) / i**0.5).bfloat16(), requires_grad=False)
    return module.eval()


def route(x: torch.Tensor, experts: int, top_k: int, seed: int):
    g = torch.Generator(device=x.device).manual_seed(seed)
    gate = torch.randn(experts, x.shape[-1], generator=g, device=x.device) / x.shape[-1] ** 0.5
    scores = torch.sqrt(torch.nn.functional.softplus(x.float() @ gate.T))
    idx = torch.topk(scores, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    return idx, w / w.sum(-1, keepdim=True) * 1.5


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_kernel(module, name, x, idx, w, repeat, device):
    module.config._experts_implementation = name
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        module(x, idx, w)
    sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with torch.no_grad():
            module(x, idx, w)
        sync(device)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--tokens", default="16,128", help="comma-separated token counts")
    p.add_argument("--kernels", default="bf16,w4a8,w4a4,w4a4_packed,w4a4_te")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda, but torch sees no CUDA device; run on a GPU host", file=sys.stderr)
        return 2

    import evalgate.kernels  # noqa: F401  (registers the kernels)
    from evalgate.kernels import weights

    if args.device == "cuda":  # keep the FP32 dequantized experts resident (25.7 GB at dsv4-flash)
        weights.DEQUANT_CACHE_BYTES = 64 << 30

    shape = SHAPES[args.shape]
    module = build_experts(shape, args.device, args.seed)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    print(f"device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f" ({torch.get_num_threads()} threads)")
          + f", torch {torch.__version__}, shape {args.shape} {shape}")
    print(f"{'kernel':14s} {'tokens':>6s} {'first call s':>12s} {'ms/call':>10s} {'x bf16':>7s}")
    for t in [int(v) for v in args.tokens.split(",")]:
        g = torch.Generator(device=args.device).manual_seed(args.seed + t)
        x = torch.randn(t, shape["hidden"], generator=g, device=args.device).bfloat16()
        idx, w = route(x, shape["experts"], shape["top_k"], args.seed)
        base = None
        for name in kernels:
            first, per_call = time_kernel(module, name, x, idx, w, args.repeat, args.device)
            base = per_call if name == "bf16" else base
            ratio = f"{per_call / base:7.1f}" if base else "      -"
            print(f"{name:14s} {t:6d} {first:12.3f} {per_call * 1e3:10.2f} {ratio}")
    if args.device == "cuda":
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
