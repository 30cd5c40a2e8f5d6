"""In-process generation speed on the canary, without the sandbox or the store: the gate's prompts (GSM8K and
HumanEval canary profiles), decoded by the adapter the gate uses, through the runner's own batching.

    python benchmarks/bench_generate.py --kernel w4a4_packed                      # all 364 items
    python benchmarks/bench_generate.py --kernel w4a8 --limit 40 --check          # texts vs the stored baseline
    python benchmarks/bench_generate.py --kernel w4a4_packed --save /tmp/new.json # texts, to diff two trees
    python benchmarks/bench_generate.py --kernel w4a4_packed --stream             # where the decoding time goes

``--stream`` decodes every task's prompts as one stream, as the gate does (``decode_stream`` with the gate's
workers and batch size, and the stored W4A8 canary baseline's answer lengths as the expected ones;
``--no-expected`` leaves them out), and prints what each decoding worker spent (``generation.DecodeStats``):
prefill calls, tokens and CPU seconds; decoding steps, rows per step, steps with fewer than 8 rows left, CPU
seconds.

``--check`` compares every generated text with the stored W4A8 canary baseline (kernel w4a8 only): the
canonical numerics make it bit-identical whatever the batch, order or thread count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="w4a4_packed")
    ap.add_argument("--tasks", default="gsm8k,humaneval")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the CLI's default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--check", action="store_true", help="compare texts with the stored w4a8 canary baseline")
    ap.add_argument("--save", default=None, help="write {task: {doc_id: text}} here")
    ap.add_argument("--profile", default=None, help="cProfile the generation, print the top 40 (tottime)")
    ap.add_argument("--stream", action="store_true", help="all tasks in one stream, as the gate; per-worker stats")
    ap.add_argument("--no-expected", action="store_true",
                    help="--stream without the baseline's answer lengths (the schedule of a run without a baseline)")
    args = ap.parse_args(argv)
    if args.stream and (args.check or args.save or args.profile):
        ap.error("--stream prints what each decoding worker spent; drop --check, --save and --profile")

    from evalgate.canary import BASELINES, PROFILES, canary_path
    from evalgate.cli.options import run_options  # noqa: F401  (the CLI's import cost, as the gate pays it)
    from evalgate.model_adapters.hf.adapter import HFAdapter
    from evalgate.run.spec import RunSpec, load_task

    try:
        from evalgate.run.runner import run_in_process
    except ImportError:  # an older tree: one static batch at a time
        from evalgate.run.runner import _run_in_batches as run_in_process
    from evalgate.tasks import get_task
    from evalgate.tasks.data import resolve_data_dir

    t_import = time.perf_counter() - T0
    tasks = args.tasks.split(",")
    batch_size = args.batch_size
    if batch_size is None:
        from evalgate.cli.options import BATCH_SIZE  # the CLI's default

        batch_size = BATCH_SIZE
    spec = RunSpec(model=str(canary_path()), kernel=args.kernel, tasks=tasks, profiles=dict(PROFILES),
                   limit=args.limit, batch_size=batch_size)
    data_dir = resolve_data_dir(None)
    t1 = time.perf_counter()
    adapter = HFAdapter(spec.model, spec.kernel, batch_size=batch_size, threads=args.threads)
    t_load = time.perf_counter() - t1
    import torch

    texts, report = {}, {"import_s": round(t_import, 2), "load_s": round(t_load, 2), "batch_size": batch_size,
                         "threads": torch.get_num_threads()}
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    by_task = {}
    for name in tasks:
        task = get_task(name)
        items, resolved = load_task(task, spec, data_dir)
        by_task[name] = list(task.requests(items, resolved))
    if args.stream:
        if not args.no_expected:
            by_task = _with_baseline_lengths(by_task)
        return _stream(adapter, [r for name in tasks for r in by_task[name]], batch_size, report)
    total_tokens = 0
    for name in tasks:
        requests = by_task[name]
        got = {}
        times = {"generate_s": 0.0}

        def keep(batch, gens):
            for r, g in zip(batch, gens):
                got[r.doc_id] = g

        if prof:
            prof.enable()
        run_in_process(adapter, requests, batch_size, keep, times)
        if prof:
            prof.disable()
        tokens = sum(g.n_tokens for g in got.values())
        total_tokens += tokens
        report[name] = {"items": len(got), "tokens": tokens, "generate_s": round(times["generate_s"], 2)}
        texts[name] = {str(k): g.text for k, g in got.items()}
    report["generate_s"] = round(sum(report[n]["generate_s"] for n in tasks), 2)
    report["tokens"] = total_tokens
    report["wall_s"] = round(time.perf_counter() - T0, 2)
    import resource

    ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    report["user_s"], report["sys_s"] = round(ru.ru_utime + rc.ru_utime, 2), round(ru.ru_stime + rc.ru_stime, 2)
    print(json.dumps(report))
    if prof:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
    if args.save:
        Path(args.save).write_text(json.dumps(texts, indent=0, sort_keys=True))
    if args.check:
        if args.kernel != "w4a8":
            print("--check compares with the w4a8 baseline: pass --kernel w4a8", file=sys.stderr)
            return 2
        bad = 0
        for name in tasks:
            (path,) = sorted(BASELINES.glob(f"*/{name}-*/w4a8/{name}.jsonl"))
            stored = {str(r["doc_id"]): r["resps"] for r in map(json.loads, path.read_text().splitlines())}
            for doc_id, text in texts[name].items():
                if stored[doc_id] != text:
                    bad += 1
                    print(f"DIFFERS {name} {doc_id}", file=sys.stderr)
        print(f"check: {sum(len(t) for t in texts.values())} texts, {bad} differ from the stored baseline")
        return 1 if bad else 0
    return 0


def _with_baseline_lengths(by_task: dict) -> dict:
    """Each task's requests with the stored W4A8 canary baseline's answer lengths, as the gate gives them."""
    from dataclasses import replace

    from evalgate.canary import BASELINES
    from evalgate.run.baselines import answer_lengths, load_baseline

    folders = [p.parent for name in by_task for p in BASELINES.glob(f"*/{name}-*/w4a8/{name}.jsonl")]
    lengths = answer_lengths(load_baseline(folders).run)
    return {name: [replace(r, expected_tokens=lengths[name].get(r.doc_id)) for r in requests]
            for name, requests in by_task.items()}


def _stream(adapter, requests, batch_size: int, report: dict) -> int:
    """Every task's requests as one ``decode_stream``, with the gate's workers: per-worker ``DecodeStats``."""
    from dataclasses import asdict

    from evalgate.cores import generation_workers
    from evalgate.model_adapters.hf.generation import decode_stream

    workers = generation_workers()[0]
    stats = []
    t0 = time.perf_counter()
    tokens = 0
    expected = [r.expected_tokens for r in requests]
    for finished in decode_stream(adapter.model, adapter.tokenizer, [r.prompt for r in requests],
                                  [r.stop for r in requests], [r.max_new_tokens for r in requests],
                                  batch_size=batch_size, workers=workers, stats=stats, expected_tokens=expected):
        tokens += sum(len(g.token_ids) for _, g in finished)
    report.update({"workers": workers, "expected_tokens": any(x is not None for x in expected),
                   "items": len(requests), "tokens": tokens,
                   "generate_s": round(time.perf_counter() - t0, 2),
                   "per_worker": [{k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(s).items()}
                                  for s in stats]})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
