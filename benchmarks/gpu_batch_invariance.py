"""The GPU A/A rate of in-process generation: the built-in canary decodes the same GSM8K items at batch 1 and
at batch 32 on the GPU, and this counts the items whose generated token sequences differ.

    python benchmarks/gpu_batch_invariance.py                                  # cuda, w4a4_packed, both numerics
    python benchmarks/gpu_batch_invariance.py --limit 64 --numerics canonical --kernel w4a8
    python -m evalgate.model_adapters.hf.tiny /tmp/csa --compressed
    python benchmarks/gpu_batch_invariance.py --model /tmp/csa --numerics native   # compressed attention

Prints numbers; not a test. For each numerics (``canonical``: evalgate's canonical forward pass, what the
gate runs; ``native``: PyTorch's own, cuBLAS and attention kernels choosing algorithms by shape) it loads
the canary onto the device with the kernel (emulated experts: the Triton path on CUDA), decodes the first
``--limit`` items of the canary GSM8K profile greedily, once with ``batch_size`` 1 (every item alone) and
once with ``--batch`` (32: continuous batching as the gate does it; the batch-1 side can run in
``--procs`` processes at once, each decoding its share one item at a time; ``--alone-device cpu``: on the
CPU), and prints how many items' token ids differ, where the first difference is, and the time each side
took (``--alone``: only these numerics run the batch-1 side; the others are timed at ``--batch``, what the
invariant path costs against). ``--model`` takes another local checkpoint in place of the canary (e.g. a
tiny one with compressed attention, which decodes from per-row slots in either numerics:
``generation._decode_slots``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def requests(limit: int | None):
    from evalgate.canary import GSM8K_PROFILE
    from evalgate.tasks import gsm8k
    from evalgate.tasks.data import resolve_data_dir

    items, resolved = gsm8k.TASK.load(gsm8k.TASK.profiles[GSM8K_PROFILE], resolve_data_dir(None), limit)
    return gsm8k.TASK.requests(items, resolved)


def decode_all(model, tokenizer, reqs, device: str, batch: int):
    from evalgate.model_adapters.hf.generation import decode_stream

    out = [None] * len(reqs)
    t0 = time.perf_counter()
    for finished in decode_stream(model, tokenizer, [r.prompt for r in reqs], [r.stop for r in reqs],
                                  [r.max_new_tokens for r in reqs], device=device, keys=None, batch_size=batch):
        for i, g in finished:
            out[i] = g
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _alone(args_tuple):
    """Worker: decode items `share` (indices) of the first `limit` requests at batch 1: one slot, so each item
    decodes alone (no neighbour), one after the other, and the step's graph is captured once."""
    numerics, kernel, device, limit, share, model = args_tuple
    import torch

    from evalgate.model_adapters.hf.adapter import HFAdapter

    torch.set_num_threads(1)
    adapter = HFAdapter(model, kernel, device=device, numerics=numerics)
    reqs = requests(limit)
    gens, _ = decode_all(adapter.model, adapter.tokenizer, [reqs[i] for i in share], adapter.device, 1)
    return {i: (g.token_ids, g.text) for i, g in zip(share, gens)}


class _Gen:
    def __init__(self, token_ids, text):
        self.token_ids, self.text = token_ids, text


def measure(numerics: str, args) -> dict:
    import torch

    from evalgate.model_adapters.hf.adapter import HFAdapter
    from evalgate.model_adapters.canonical.invariant import numerics as numerics_of

    adapter = HFAdapter(args.model, args.kernel, device=args.device, numerics=numerics)
    got = numerics_of(adapter.model)
    reqs = requests(args.limit)
    many, secs_many = decode_all(adapter.model, adapter.tokenizer, reqs, adapter.device, args.batch)
    print(f"  {numerics:9s} batch {args.batch:3d}: {len(reqs)} items in {secs_many:7.1f} s", flush=True)
    if numerics not in args.alone:  # its batch's time only: what canonical numerics cost against it
        del adapter
        return {"numerics": numerics, "numerics_got": got, "items": len(reqs), "differ": None, "texts_differ": None,
                "rate": None, "first_diff_positions": [], "batch1_s": None, f"batch{args.batch}_s": secs_many}
    t0 = time.perf_counter()
    if args.procs > 1:  # batch 1 in several processes: an item alone gives the same tokens in any process
        import multiprocessing as mp

        shares = [list(range(len(reqs)))[j::args.procs] for j in range(args.procs)]
        with mp.get_context("spawn").Pool(args.procs) as pool:
            jobs = [(numerics, args.kernel, args.alone_device, args.limit, sh, args.model) for sh in shares]
            parts = pool.map(_alone, jobs)
        one = [None] * len(reqs)
        for part in parts:
            for i, (ids, text) in part.items():
                one[i] = _Gen(ids, text)
    elif args.alone_device == args.device:
        one, _ = decode_all(adapter.model, adapter.tokenizer, reqs, adapter.device, 1)
    else:
        part = _alone((numerics, args.kernel, args.alone_device, args.limit, list(range(len(reqs))), args.model))
        one = [_Gen(*part[i]) for i in range(len(reqs))]
    secs_one = time.perf_counter() - t0
    print(f"  {numerics:9s} batch   1: {len(reqs)} items in {secs_one:7.1f} s ({args.procs} processes, "
          f"{args.alone_device})", flush=True)
    differ = [i for i in range(len(reqs)) if list(one[i].token_ids) != list(many[i].token_ids)]
    texts = sum(one[i].text != many[i].text for i in range(len(reqs)))
    tokens = sum(len(g.token_ids) for g in one)
    positions = [first_difference(list(one[i].token_ids), list(many[i].token_ids)) for i in differ]
    del adapter
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    r = {"numerics": numerics, "numerics_got": got, "items": len(reqs), "differ": len(differ),
         "texts_differ": texts, "rate": len(differ) / max(len(reqs), 1), "tokens_batch1": tokens,
         "first_diff_positions": positions[:20], "differing_items": [reqs[i].doc_id for i in differ][:20],
         "batch1_s": secs_one, f"batch{args.batch}_s": secs_many}
    print(f"  {numerics:9s} -> {r['differ']} of {r['items']} items differ (A/A rate {r['rate']:.3f}), "
          f"texts {texts}, first differing positions {positions[:20]}", flush=True)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None, help="a local checkpoint [default: the built-in canary]")
    p.add_argument("--kernel", default="w4a4_packed")
    p.add_argument("--numerics", default="canonical,native", help="comma-separated: canonical, native")
    p.add_argument("--limit", type=int, default=None, help="first N canary GSM8K items (default: all 200)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--procs", type=int, default=1, help="decode the batch-1 side in this many processes")
    p.add_argument("--alone-device", default=None, help="where the batch-1 side runs [default: --device]; with "
                   "canonical numerics (the same bits on a CPU and a GPU) `cpu` holds the GPU's batch against the "
                   "CPU's batch 1: batch and device at once")
    p.add_argument("--alone", default=None, help="the numerics whose batch-1 side runs (comma-separated) "
                   "[default: all of --numerics]; the others time their --batch side only")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    args.alone = {n.strip() for n in (args.alone or args.numerics).split(",") if n.strip()}
    args.alone_device = args.alone_device or args.device
    import torch

    if args.model is None:
        from evalgate.canary import canary_path

        args.model = str(canary_path())

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_batch_invariance: torch sees no CUDA device; run on a GPU host", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{args.model}: canary GSM8K profile, kernel {args.kernel}, {name}, torch {torch.__version__}, "
          f"batch 1 ({args.alone_device}) vs {args.batch} ({args.device})", flush=True)
    results = [measure(n.strip(), args) for n in args.numerics.split(",") if n.strip()]
    print(f"{'numerics':10s} {'(got)':14s} {'items':>5s} {'differ':>6s} {'A/A rate':>8s} {'texts':>5s} "
          f"{'b1 s':>7s} {'b' + str(args.batch) + ' s':>7s}  first differing positions")
    for r in results:
        if r["differ"] is None:
            print(f"{r['numerics']:10s} {r['numerics_got']:14s} {r['items']:5d} {'-':>6s} {'-':>8s} {'-':>5s} "
                  f"{'-':>7s} {r[f'batch{args.batch}_s']:7.1f}  (batch {args.batch} only)")
            continue
        print(f"{r['numerics']:10s} {r['numerics_got']:14s} {r['items']:5d} {r['differ']:6d} {r['rate']:8.3f} "
              f"{r['texts_differ']:5d} {r['batch1_s']:7.1f} {r[f'batch{args.batch}_s']:7.1f}  "
              f"{r['first_diff_positions']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
