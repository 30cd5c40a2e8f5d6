"""Time two of a decoding step's small Triton kernels at decoding batches: the attention with its keys in one
program a row against split over several (flash-decoding), and the hyper-connection weights' tilings; and
two of a prefill's: a chunk's attention and the hyper-connection mixes.

    python benchmarks/bench_step_kernels.py --device cuda                        # H200, DeepSeek-V4-Flash shapes
    python benchmarks/bench_step_kernels.py --device cuda --splits 2,4,8,16 --reps 200
    python benchmarks/bench_step_kernels.py --device cpu --reps 2                # Triton's interpreter, tiny shapes

Prints numbers; not a test. (a) ``triton_attention.decode_attention`` at each of ``--batches`` with
``--shape`` (dsv4-flash: 64 heads of 512, one shared key-value head, a 128-key ring, 512 compressed entries of
which about half chosen, BF16; a sliding-window layer too, no entries) with SPLIT forced to 1 (the one
kernel), the automatic choice (``key_splits``) and each of ``--splits``: µs per call and the largest
difference from SPLIT 1's output. (b) ``triton_layers.hyper_weights`` (hc 4, 20 Sinkhorn steps) at 1 and
256 tokens for every ``HYPER`` warps x block: µs per call and whether its outputs have the default
setting's bits. On CUDA a call is timed by CUDA events over ``--reps`` replays of a CUDA graph of
``--graph-calls`` calls on the same inputs (after a warm-up that compiles), so the keys come from L2 as they
may not in a real step; on a CPU (Triton's interpreter) by the wall clock over ``--reps`` calls, which proves
the script runs and says nothing of speed. Off CUDA the automatic SPLIT counts ``--sms`` SMs (default an
H200's 132).

Measured on an H200 (2026-12-03, the first command above with --splits 2,4,8,16, one run): the CSA
layer's attention 44.0 -> 9.6 µs at batch 1 (auto SPLIT 16) and 44.7 -> 23.7 at batch 16 (4), the sliding
layer's 10.7 -> 7.2 at batch 1 (4) and 11.1 -> 11.4 at batch 16 (4: a wash); batch 64 and 256 keep SPLIT 1
(forced splits there cost 1.4 to 3x). hyper_weights 9.1 µs with 4 warps of 32 tokens, 3.4 to 3.5 with one
warp of 8 or 16 (the default: 8), with the same bits, at 1 and 256 tokens alike.

(c) and (d), a prefill chunk of ``--prefill-rows`` rows x ``--prefill-chunk`` tokens (dsv4-flash: a ring
of 128 keys, the chunk's own 256 causally, 512 entries about half open): ``chunk_attention`` for each
CHUNK tokens x warps against eager's masked form, and ``hyper_mixes`` for each MIXES setting against
transformers' norm and FP32 linear (µs a call, the largest difference). Measured on an H100 (2026-12-06,
``--device cuda --skip attention,hyper --reps 20``): the masked form 10.6 ms, the kernel 6.9 ms at 2 tokens x
4 warps (the default; 7.8 at 4 x 8, 9.9 at 1 x 4, 24.0 at 4 x 4); the mixes 1.70 ms eager, 0.30 ms at 32
rows x 64 inputs, 2 warps, TF32x3 (the default; FP32 multiply-adds 1.30 ms), within 2.2e-5 of eager.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SHAPES = {
    "dsv4-flash": dict(heads=64, head_dim=512, window=128, entries=512, hidden=4096),
    "tiny": dict(heads=32, head_dim=64, window=32, entries=64, hidden=64),
}


def time_call(fn, device: str, reps: int, graph_calls: int) -> float:
    """µs per call of ``fn`` (see the module's docstring)."""
    import torch

    fn()  # compiles
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # a warm-up off the default stream, as graph capture asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * graph_calls)


def attention_inputs(shape: dict, batch: int, with_entries: bool, device: str, seed: int = 0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    h, d, w, c = shape["heads"], shape["head_dim"], shape["window"], shape["entries"]
    ring = torch.randn(batch, w, d, generator=g).bfloat16().to(device)
    rows = torch.randperm(batch, generator=g).to(device)
    positions = torch.randint(w, 8192, (batch,), generator=g).to(device)  # past the first window: all W keys open
    q = (torch.randn(batch, h, 1, d, generator=g) * 0.5).bfloat16().to(device)
    sinks = torch.randn(h, generator=g).to(device)
    entries = chosen = None
    if with_entries:
        entries = torch.randn(batch, c, d, generator=g).bfloat16().to(device)
        chosen = (torch.rand(batch, c, generator=g) < 0.5).to(device)
    return q, ring, rows, positions, entries, chosen, sinks, d ** -0.5


def bench_attention(args, shape: dict) -> list[tuple]:
    import torch

    from evalgate.kernels.triton import availability
    from evalgate.model_adapters.fast import triton_attention as ta

    rows = []
    sms = availability.sm_count(args.device)
    forced = [int(s) for s in args.splits.split(",") if s]
    for layer, with_entries in (("csa", True), ("sliding", False)):
        for batch in (int(b) for b in args.batches.split(",")):
            inputs = attention_inputs(shape, batch, with_entries, args.device)
            c = shape["entries"] if with_entries else 0
            auto = ta.key_splits(batch, shape["heads"], shape["window"], c, sms)

            def run(split: int, inputs=inputs):
                saved = ta.SPLIT["force"]
                ta.SPLIT["force"] = split  # 0: the automatic choice
                try:
                    out = ta.decode_attention(*inputs)
                    us = time_call(lambda: ta.decode_attention(*inputs), args.device, args.reps, args.graph_calls)
                finally:
                    ta.SPLIT["force"] = saved
                return out, us

            one, us_one = run(1)
            rows.append((layer, batch, "1", us_one, 0.0))
            for label, split in [(f"auto={auto}", 0)] + [(str(s), s) for s in forced if s not in (1, auto)]:
                out, us = run(split)
                rows.append((layer, batch, label, us, (out.float() - one.float()).abs().max().item()))
            del inputs, one
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_hyper(args) -> list[tuple]:
    import torch

    from evalgate.model_adapters.fast import triton_layers as layers

    hc, iters, eps = 4, 20, 1e-6
    g = torch.Generator(device="cpu").manual_seed(0)
    base = torch.randn((2 + hc) * hc, generator=g).to(args.device)
    scale = torch.tensor([1.0, 0.5, 4.0]).to(args.device)
    default = dict(layers.HYPER)
    rows = []
    for tokens in (1, 256):
        mixes = (torch.randn(tokens, (2 + hc) * hc, generator=g) * 2).to(args.device)
        reference = layers.hyper_weights(mixes, base, scale, hc, iters, eps)
        for warps in (1, 2, 4):
            for block in (8, 16, 32):
                layers.HYPER.update(warps=warps, block=block)
                try:
                    out = layers.hyper_weights(mixes, base, scale, hc, iters, eps)
                    us = time_call(lambda: layers.hyper_weights(mixes, base, scale, hc, iters, eps), args.device,
                                   args.reps, args.graph_calls)
                finally:
                    layers.HYPER.update(default)
                same = all(torch.equal(a, b) for a, b in zip(out, reference))
                rows.append((tokens, warps, block, us, same))
    return rows


def bench_prefill(args, shape: dict) -> list[tuple]:
    """(c) A prefill chunk's attention (``chunk_attention``, each TOKENS x warps setting) against eager's masked
    form (``native_attend``), and (d) the hyper-connection mixes in one kernel (``hyper_mixes``) against
    transformers' norm and FP32 linear: rows (label, setting, µs per call, max |diff| from the reference)."""
    import types

    import torch

    from evalgate.model_adapters.fast import attention_slots
    from evalgate.model_adapters.fast import triton_attention as ta
    from evalgate.model_adapters.fast import triton_layers as layers

    g = torch.Generator(device="cpu").manual_seed(0)
    b, c = args.prefill_rows, args.prefill_chunk
    h, d, w, e = shape["heads"], shape["head_dim"], shape["window"], shape["entries"]
    t = w + c + e
    dev, dt = args.device, torch.bfloat16
    q = (torch.randn(b, c, h, d, generator=g) * 0.3).to(dev, dt).transpose(1, 2)
    keys = torch.randn(b, t, d, generator=g).to(dev, dt)
    j = torch.arange(c)
    opened = torch.zeros(b, c, t, dtype=torch.bool)
    opened[:, :, :w] = j.unsqueeze(1) < torch.arange(w).unsqueeze(0) + (w - 1)  # the ring's keys still in window
    opened[:, :, w:w + c] = (j.unsqueeze(0) <= j.unsqueeze(1)) & (j.unsqueeze(0) > j.unsqueeze(1) - w)
    opened[:, :, w + c:] = torch.rand(b, c, e, generator=g) < 0.5
    opened = opened.to(dev)
    sinks = torch.randn(h, generator=g).to(dev)
    scaling = d ** -0.5
    attn = types.SimpleNamespace(sinks=sinks, scaling=scaling)
    mask = attention_slots.additive_mask(opened, dt)

    def masked():
        return attention_slots.native_attend(attn, q, keys.unsqueeze(1), mask.unsqueeze(1))

    reference = masked()
    rows = [("attention", "eager, masked", time_call(masked, dev, args.reps, 1), 0.0)]
    default = dict(ta.CHUNK)
    for tokens in (1, 2, 4):
        for warps in (4, 8):
            ta.CHUNK.update(tokens=tokens, warps=warps)
            try:
                out = ta.chunk_attention(q, keys, opened, sinks, scaling)
                us = time_call(lambda: ta.chunk_attention(q, keys, opened, sinks, scaling), dev, args.reps, 1)
            except Exception as exc:  # noqa: BLE001  (a setting Triton cannot build: out of shared memory)
                rows.append(("attention", f"tokens {tokens}, {warps} warps", float("nan"), f"{type(exc).__name__}"))
                continue
            finally:
                ta.CHUNK.update(default)
            rows.append(("attention", f"tokens {tokens}, {warps} warps", us,
                         (out.float() - reference.float()).abs().max().item()))
    hc, hidden, n = 4, shape["hidden"], 24
    streams = torch.randn(b, c, hc, hidden, generator=g).to(dev, dt)
    fn = (torch.randn(n, hc * hidden, generator=g) * 0.02).to(dev)

    def eager():
        flat = streams.view(b, c, -1).float()
        normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
        return torch.nn.functional.linear(normed, fn)

    reference = eager()
    rows.append(("hyper mixes", "eager: norm, FP32 linear", time_call(eager, dev, args.reps, 1), 0.0))
    default = dict(layers.MIXES)
    for rows_, k, warps, precision in ((32, 128, 4, "ieee"), (32, 128, 4, "tf32x3"), (64, 64, 4, "tf32x3"),
                                       (64, 128, 4, "tf32x3"), (16, 128, 4, "tf32x3"), (32, 64, 2, "tf32x3")):
        layers.MIXES.update(rows=rows_, k=k, warps=warps, precision=precision)
        try:
            out = layers.hyper_mixes(streams, fn, 1e-6)
            us = time_call(lambda: layers.hyper_mixes(streams, fn, 1e-6), dev, args.reps, 1)
        finally:
            layers.MIXES.update(default)
        rows.append(("hyper mixes", f"rows {rows_}, k {k}, {warps} warps, {precision}", us,
                     (out - reference).abs().max().item()))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shape", default=None, choices=sorted(SHAPES), help="[default: dsv4-flash on cuda, tiny on cpu]")
    p.add_argument("--batches", default=None, help="attention batches [default: 1,16,64,256 on cuda, 1,4 on cpu]")
    p.add_argument("--splits", default="", help="SPLITs to force besides 1 and the automatic one, e.g. 2,4,8,16")
    p.add_argument("--reps", type=int, default=100, help="timed graph replays (CUDA) or calls (CPU)")
    p.add_argument("--graph-calls", type=int, default=10, help="calls captured in one CUDA graph")
    p.add_argument("--sms", type=int, default=132, help="SMs the automatic SPLIT counts off CUDA")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: attention, hyper, prefill")
    p.add_argument("--prefill-rows", type=int, default=None, help="prefill: rows of a chunk [default: 32 on cuda, 2 on cpu]")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill: tokens a row [default: 256 on cuda, 8 on cpu]")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is first imported: before any kernel module
    shape = SHAPES[args.shape or ("dsv4-flash" if args.device == "cuda" else "tiny")]
    args.batches = args.batches or ("1,16,64,256" if args.device == "cuda" else "1,4")
    args.prefill_rows = args.prefill_rows or (32 if args.device == "cuda" else 2)
    args.prefill_chunk = args.prefill_chunk or (256 if args.device == "cuda" else 8)

    import torch

    from evalgate.kernels.triton import availability
    from evalgate.model_adapters.fast import triton_attention as ta

    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: --device cpu runs under Triton's interpreter")
        where = f"{torch.cuda.get_device_name()}, {availability.sm_count('cuda')} SMs"
    else:
        availability.INTERPRETED_SMS = args.sms
        where = f"CPU under Triton's interpreter, counting {args.sms} SMs"
    print(f"{where}; SPLIT {ta.SPLIT}, HEADS {ta.HEADS}, KEYS {ta.KEYS}")
    skip = set(args.skip.split(","))
    if "attention" not in skip:
        print(f"\ndecode_attention, BF16: {shape['heads']} heads of {shape['head_dim']}, a {shape['window']}-key ring, "
              f"and {shape['entries']} entries about half chosen (csa) or none (sliding)")
        print(f"{'layer':8} {'batch':>5} {'split':>8} {'us/call':>9} {'max|diff| vs split 1':>21}")
        for layer, batch, split, us, diff in bench_attention(args, shape):
            print(f"{layer:8} {batch:5d} {split:>8} {us:9.2f} {diff:21.3g}")
    if "hyper" not in skip:
        from evalgate.model_adapters.fast.triton_layers import HYPER

        print(f"\nhyper_weights, hc 4, 20 Sinkhorn steps, FP32 (default HYPER: block {HYPER['block']}, "
              f"{HYPER['warps']} warps)")
        print(f"{'tokens':>6} {'warps':>5} {'block':>5} {'us/call':>9}  bits of the default")
        for tokens, warps, block, us, same in bench_hyper(args):
            print(f"{tokens:6d} {warps:5d} {block:5d} {us:9.2f}  {'same' if same else 'DIFFERENT'}")
    if "prefill" not in skip:
        print(f"\nprefill chunk: {args.prefill_rows} rows of {args.prefill_chunk} tokens, BF16 (entries "
              f"{shape['entries']}, about half open); hyper mixes of hc 4 x {shape['hidden']}")
        print(f"{'part':12} {'setting':36} {'us/call':>10} {'max|diff| vs first':>19}")
        for part, setting, us, diff in bench_prefill(args, shape):
            print(f"{part:12} {setting:36} {us:10.1f} {diff if isinstance(diff, str) else f'{diff:.3g}':>19}")


if __name__ == "__main__":
    main()
