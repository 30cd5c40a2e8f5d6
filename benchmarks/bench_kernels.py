"""Time one MoE layer's routed experts for each kernel against transformers' grouped_mm BF16 experts.

    python benchmarks/bench_kernels.py                                   # CPU, small shape
    python benchmarks/bench_kernels.py --device cuda --shape dsv4-flash --tokens 16,512
    python benchmarks/bench_kernels.py --device cuda --shape dsv4-flash --tokens 16,512,4096 --backend triton
    python benchmarks/bench_kernels.py --device cuda --identity --shape dsv4-flash --tokens 64
    python benchmarks/bench_kernels.py --device cuda --shape dsv4-flash --tokens 1,16,256 --kernels w4a4_packed \
        --backend triton --sweep --sweep-keys split_k                   # split K at decoding sizes

Prints numbers; not a test. --backend picks the emulated kernels' implementation (EVALGATE_KERNEL_BACKEND:
auto = Triton on CUDA). On CUDA each row also gives the peak memory the call allocates beyond what was
resident before it, next to the experts' packed FP4 bytes. --identity checks the Triton kernels against
the emulator (on the same device) bit for bit on `check.synthetic_layer`, instead of timing; --sweep times
the Triton fast-path tilings of `fast.FAST`. The first call of an emulated kernel on a module quantizes the
BF16 weights to FP4 and caches them (and their FP32 dequantization); it is reported apart ("first call") from the
steady-state time per call. Router: sqrt-softplus top-k, as DeepseekV4TopKRouter (spec docs/kernels.md#routing).
"""

from __future__ import annotations

import argparse
import os
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
    """(first call s, median s per call, peak bytes a steady-state call allocates beyond what was resident
    before it, whether every later call's output had the first call's bits). The first call (weights
    quantized and cached, kernels compiled) is timed apart, and the peak is measured over the calls after
    it; on CUDA the later calls replay a CUDA graph, the first runs eagerly."""
    module.config._experts_implementation = name
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        reference = module(x, idx, w)
    sync(device)
    first = time.perf_counter() - t0
    identical = True
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = module(x, idx, w)
        sync(device)
        times.append(time.perf_counter() - t0)
        identical &= torch.equal(out.view(torch.int16), reference.view(torch.int16))  # bits, not values
        del out  # (not held while the next call allocates: the peak stays the call's own)
    extra = torch.cuda.max_memory_allocated() - resident if device == "cuda" else 0
    return first, statistics.median(times), extra, identical


def breakdown(module, x, idx, w) -> None:
    """GPU time per operation of one call (torch.profiler), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        module(x, idx, w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def cpu_profile(module, x, idx, w, device) -> None:
    """Host time of 10 calls by function (cProfile), the largest own time first."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    with torch.no_grad():
        prof.enable()
        for _ in range(10):
            module(x, idx, w)
        sync(device)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


TILINGS = [{"bk": 128, "warps": 4, "stages": 3}, {"bk": 128, "warps": 4, "stages": 2}, {"bk": 128, "warps": 4, "stages": 4},
           {"bk": 64, "warps": 4, "stages": 4}, {"bk": 128, "warps": 8, "stages": 3}, {"bk": 256, "warps": 8, "stages": 3},
           {"bk": 128, "bk2": 256, "warps": 4, "stages": 3}, {"bm_max": 64, "bk": 128, "warps": 4, "stages": 3},
           {"bn": 64, "bn2": 64}, {"bn": 64, "bn2": 64, "stages": 4}, {"bn": 64, "bn2": 32, "stages": 4},
           {"bn": 256, "bn2": 128}, {"bn": 256, "bn2": 256, "warps": 8}, {"bn": 64, "bn2": 64, "bk": 256, "stages": 2},
           # split K (programs per SM; 0: never): decoding's small grids (--tokens 1,16,256)
           {"split_k": 0}, {"split_k": 2}, {"split_k": 4}, {"split_k": 8}, {"split_k": 16}, {"split_k": 32},
           {"split_k": 8, "bn": 64, "bn2": 64}, {"split_k": 16, "bk": 64, "stages": 4},
           # more bytes in flight for decoding's few rows a tile (--tokens 256)
           {"stages": 5}, {"bn2": 256}, {"bn2": 256, "bk2": 256, "stages": 2}, {"warps": 2, "stages": 4},
           {"bk": 256, "stages": 3}, {"bk": 256, "bk2": 256, "stages": 4},
           # a register cap: more programs an SM, at the cost of the spills gemm_sass.py counts
           {"maxnreg": 80}, {"maxnreg": 96}, {"maxnreg": 104}, {"maxnreg": 112}]


def sweep(module, name, x, idx, w, repeat, base, keys=()) -> None:
    """ms per call of `name` under each tiling of the Triton fast path (fast.FAST; bm 0 = by rows/expert), and
    whether every call gave the bits of the settings in force (same bits); keys: only the tilings that set
    one of these FAST keys."""
    from evalgate.kernels.triton import fast

    keep = dict(fast.FAST)
    module.config._experts_implementation = name
    with torch.no_grad():
        reference = module(x, idx, w).view(torch.int16)
    for tiling in TILINGS:
        if keys and not set(keys) & set(tiling):
            continue
        fast.FAST.update(keep)
        fast.FAST.update(tiling)
        try:
            _, per_call, _, same = time_kernel(module, name, x, idx, w, repeat, "cuda")
            with torch.no_grad():
                same &= torch.equal(module(x, idx, w).view(torch.int16), reference)
            ratio = f"  x bf16 {per_call / base:5.2f}" if base else ""  # (no bf16 row without --kernels bf16,...)
            print(f"  tiling {tiling}: {per_call * 1e3:8.2f} ms{ratio}  same bits {same}", flush=True)
        except Exception as exc:  # noqa: BLE001  (a tiling this Triton cannot compile)
            print(f"  tiling {tiling}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    fast.FAST.clear()
    fast.FAST.update(keep)


def triton_stats() -> dict:
    """Rows through the Triton GEMMs so far, and those the per-block path took (slow_rows; half of
    rows are L1's)."""
    try:
        from evalgate.kernels.triton import moe
    except Exception:  # noqa: BLE001  (no Triton)
        return {}
    return dict(moe.STATS)


def packed_bytes(module) -> int:
    """Bytes of the experts' FP4 codes and scale bytes (what the Triton kernels keep resident)."""
    from evalgate.kernels.weights import fp4_weights

    fp4 = fp4_weights(module)
    return sum(t.numel() * t.element_size() for t in (fp4.w1, fp4.w1_scale, fp4.w2, fp4.w2_scale))


def identity(args) -> int:
    """The Triton kernels vs the emulator, both on --device, on check.synthetic_layer (FP4 weights)."""
    from evalgate.kernels import check

    check_shape = {"small": "small", "dsv4-flash": "dsv4-flash"}[args.shape]
    kernels = [k for k in args.kernels.split(",") if k.strip() and k != "bf16"] if args.kernels_given else None
    ok = True
    for t in [int(v) for v in args.tokens.split(",")]:
        t0 = time.perf_counter()
        case = check.synthetic_layer(check_shape, t, args.seed)
        print(f"synthetic layer {check_shape}, {t} tokens: built in {time.perf_counter() - t0:.1f} s", flush=True)
        rows = check.triton_layer_check(check_shape, t, args.seed, kernels, case=case, device=args.device,
                                        reference_device=args.device)
        print(f"{'kernel':42s} {'tokens':>6s} {'identical':>9s} {'differ':>7s} {'host rows':>9s} "
              f"{'triton s':>8s}")
        for r in rows:
            ok &= r["identical"]
            print(f"{r['kernel']:42s} {r['tokens']:6d} {r['identical']!s:>9s} {r['differing']:7d} "
                  f"{r['host_rows']:9d} {r['triton_seconds']:8.3f}")
        print(f"emulator (all kernels, {args.device}): {rows[0]['emulator_seconds_all']:.1f} s", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--tokens", default="16,128", help="comma-separated token counts")
    p.add_argument("--kernels", default=None, help="default: bf16,w4a8,w4a4,w4a4_packed,w4a4_te (--identity: all)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="implementation of the emulated kernels (EVALGATE_KERNEL_BACKEND)")
    p.add_argument("--identity", action="store_true", help="check bit-identity of Triton vs the emulator instead")
    p.add_argument("--breakdown", action="store_true", help="CUDA: also print where each emulated kernel's time goes")
    p.add_argument("--cpu-profile", action="store_true", help="also print where the host (Python) time of 10 calls goes")
    p.add_argument("--sweep", action="store_true", help="CUDA, Triton: time each emulated kernel under several GEMM tilings")
    p.add_argument("--fast", default="", help="Triton fast-path settings, KEY=VALUE,... (fast.FAST: bm, bn, bk, "
                   "warps, stages, half2, split_k)")
    p.add_argument("--sweep-tokens", default="", help="--sweep only at these token counts (default: all)")
    p.add_argument("--sweep-keys", default="", help="--sweep only the tilings that set one of these FAST keys, "
                   "KEY,... (e.g. split_k)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: --device cuda, but torch sees no CUDA device; run on a GPU host", file=sys.stderr)
        return 2
    args.kernels_given = args.kernels is not None
    args.kernels = args.kernels or "bf16,w4a8,w4a4,w4a4_packed,w4a4_te"
    os.environ["EVALGATE_KERNEL_BACKEND"] = args.backend
    if args.fast:
        from evalgate.kernels.triton import fast

        for item in args.fast.split(","):
            key, value = item.split("=")
            fast.FAST[key.strip()] = int(value)
        print(f"fast path settings: {fast.FAST}")
    if args.identity:
        return identity(args)

    import evalgate.kernels.catalogs  # noqa: F401  (registers the kernels)
    from evalgate.kernels import weights

    if args.device == "cuda" and args.backend == "torch":  # keep the emulator's FP32 experts resident (25.7 GB)
        weights.DEQUANT_CACHE_BYTES = 64 << 30

    shape = SHAPES[args.shape]
    module = build_experts(shape, args.device, args.seed)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    print(f"device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else f" ({torch.get_num_threads()} threads)")
          + f", torch {torch.__version__}, shape {args.shape} {shape}, backend {args.backend}")
    if any(k != "bf16" for k in kernels):
        print(f"experts packed FP4 (codes + scale bytes): {packed_bytes(module) / 2**30:.3f} GiB")
    packed = packed_bytes(module) if any(k != "bf16" for k in kernels) else 0
    print(f"{'kernel':14s} {'tokens':>6s} {'first call s':>12s} {'ms/call':>10s} {'x bf16':>7s} {'peak extra GiB':>14s}"
          f" {'mem ratio':>9s} {'slow rows':>9s} {'same bits':>9s}")
    for t in [int(v) for v in args.tokens.split(",")]:
        g = torch.Generator(device=args.device).manual_seed(args.seed + t)
        x = torch.randn(t, shape["hidden"], generator=g, device=args.device).bfloat16()
        idx, w = route(x, shape["experts"], shape["top_k"], args.seed)
        base = None
        for name in kernels:
            before = dict(triton_stats())
            first, per_call, extra, same = time_kernel(module, name, x, idx, w, args.repeat, args.device)
            after = triton_stats()
            base = per_call if name == "bf16" else base
            ratio = f"{per_call / base:7.2f}" if base else "      -"
            # (packed experts + the call's peak extra) / (packed experts + input and output activations)
            act = 2 * x.numel() * x.element_size()
            mem = f"{(packed + extra) / (packed + act):9.3f}" if name != "bf16" and packed else "        -"
            rows = after.get("rows", 0) - before.get("rows", 0)
            slow = f"{(after['slow_rows'] - before['slow_rows']) / rows:9.3f}" if rows else "        -"
            # same bits: every timed call (a CUDA graph's replay, on the fused path) gave the first call's output
            print(f"{name:14s} {t:6d} {first:12.3f} {per_call * 1e3:10.2f} {ratio} {extra / 2**30:14.3f} {mem} {slow}"
                  f" {same!s:>9s}", flush=True)
            if args.breakdown and args.device == "cuda" and name != "bf16":
                breakdown(module, x, idx, w)
            if args.cpu_profile and name != "bf16":
                cpu_profile(module, x, idx, w, args.device)
            sweep_here = not args.sweep_tokens or str(t) in args.sweep_tokens.split(",")
            if args.sweep and sweep_here and args.device == "cuda" and name != "bf16":
                sweep(module, name, x, idx, w, args.repeat, base,
                      [k.strip() for k in args.sweep_keys.split(",") if k.strip()])
    if args.device == "cuda":
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
