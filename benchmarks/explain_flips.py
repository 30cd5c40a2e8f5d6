"""Explain every flip of a candidate run against the canary's W4A8 baseline: time per flip, near-ties and
divergences, and how far the candidate kernel moves the baseline's top-2 margin on ordinary tokens (what the
near-tie threshold of docs/explain.md is judged against).

    evalgate run --kernel w4a4_packed --tasks gsm8k,humaneval --out runs/w4a4_packed
    python benchmarks/explain_flips.py runs/w4a4_packed [--noise-items 15] [--device cuda]

``--device``: where both kernels' models are loaded and the flips replayed (default cpu). The time per flip
is wall time after loading, with every result read back to the host (each explanation's numbers are Python
floats), so a GPU's queue is drained before the clock stops.

The margin shift of a token: |(lp_base(a) - lp_base(b)) - (lp_cand(a) - lp_cand(b))|, a and b the
baseline kernel's top-2 tokens, teacher-forced along the baseline's own responses to the first
``--noise-items`` items of each task.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    import evalgate
    import evalgate.canary
    from evalgate.explain import summary_line
    from evalgate.model_adapters.hf.replay import teacher_forced

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a candidate run folder of the canary")
    ap.add_argument("--noise-items", type=int, default=15, help="items per task for the margin shifts (0: none)")
    ap.add_argument("--device", default="cpu", help="where to replay: cpu (default), cuda, cuda:1...")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")

    cmp = evalgate.compare(evalgate.canary.BASELINES, args.run, items="candidate")
    explainer = cmp.explainer(device=args.device)
    load_s = explainer.load(cmp.tasks)
    t0 = time.perf_counter()
    found = cmp.explain_flips(device=args.device)
    spent = time.perf_counter() - t0
    for x in found:
        print(x.line())
    print(summary_line(found))
    kinds = [x.kind for x in found]
    print(f"near-ties {kinds.count('near-tie')}, divergences {kinds.count('divergence')}, flips {len(found)}")
    if found:
        print(f"{spent / len(found):.2f} s per flip on {args.device} ({len(found)} flips, {spent:.1f} s; models "
              f"and prompts loaded in {load_s:.1f} s)")
    if args.noise_items <= 0:
        return
    models = explainer._loaded(explainer.checkpoint())
    tokenizer = models["tokenizer"]
    shifts = []
    for task, p in cmp.pairs.items():
        for doc_id, record in list(zip(p.doc_ids, p.base))[:args.noise_items]:
            request = explainer._request(task, doc_id)
            prompt = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            fed = tokenizer(record["resps"], add_special_tokens=False)["input_ids"]
            fb = teacher_forced(models["base"][0], models["base"][1], prompt, fed)
            fc = teacher_forced(models["cand"][0], models["cand"][1], prompt, fed)
            values, ids = fb.logprobs.topk(2)
            moved = fc.logprobs.gather(1, ids[:, :1])[:, 0] - fc.logprobs.gather(1, ids[:, 1:])[:, 0]
            shifts.append(((values[:, 0] - values[:, 1]) - moved).abs())
    s = torch.cat(shifts).double()
    q = {f"p{int(k * 1000) / 10:g}": round(float(s.quantile(k)), 3) for k in (0.5, 0.9, 0.99, 0.999)}
    print(f"margin shift over {len(s)} tokens (nats): {q}, max {float(s.max()):.3f}")


if __name__ == "__main__":
    main()
