"""Train the canary (seeded, reproducible; minutes on one H200).

    python scripts/canary/train.py BUILD_DIR OUT_DIR [--steps N] [--device cuda]

BUILD_DIR comes from ``data.py`` beside this script (examples + tokenizer). The routed experts are trained for FP4
(quantization-aware: the forward pass uses the FP4 grid values of the expert weights, RCEIL scales per 32,
ties to even — exactly what the shipped checkpoint stores — with a straight-through gradient); activations
stay BF16-free FP32 during training.

A canary that is too perfect is useless for a gate: once its top-two logit gaps are wide, no kernel's
noise flips an answer. So training saves snapshots along the way and measures each, teacher-forced on
every item with the emulated ``bf16``, ``w4a8`` and ``w4a4`` kernels: item accuracy, the share of items
whose argmax path differs between kernels, and the top-two gap distribution on answer tokens. ``report.json``
holds those numbers; the snapshot to ship is chosen from them (see ``MODEL_CARD.md``).

``--recipes`` trains the experts under the healthy kernels' own numerics, mixed: each micro-batch runs the
experts with one recipe's activation and intermediate quantization (fake-quantized, straight-through), so
the margin cap holds under every healthy kernel, not only under BF16. Fault-injected kernels are never
trained on: what they break, they break. Contested items (``alt_target`` from ``data.py``) are trained on
both their right and their wrong answer, which leaves them at a near-tie that kernels resolve either way.
``measure`` reports, teacher-forced, each kernel's items lost (b) and gained (c) against W4A8 and the verdict
the canary's policy would give from those counts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

QAT_NAME = "canary_qat_fp4"


def fp4_grid(w: torch.Tensor) -> torch.Tensor:
    """Expert weights as the checkpoint will hold them: E2M1 codes x UE8M0 scales per 32 along K."""
    from evalgate.kernels import formats

    return formats.fake_quantize(w, "e2m1", formats.WEIGHTS, ties="even").to(w.dtype)


def qat_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped-mm experts on FP4-grid weights, gradients passed straight through."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    gate_up = self.gate_up_proj + (fp4_grid(self.gate_up_proj.detach()) - self.gate_up_proj).detach()
    down = self.down_proj + (fp4_grid(self.down_proj.detach()) - self.down_proj).detach()
    proxy = types.SimpleNamespace(**{k: getattr(self, k) for k in (
        "num_experts", "has_gate", "has_bias", "is_transposed", "has_post_expert_norm")})
    proxy.gate_up_proj, proxy.down_proj, proxy._is_expert_parallel = gate_up, down, False
    proxy._apply_gate = self._apply_gate
    return grouped_mm_experts_forward(proxy, hidden_states, top_k_index, top_k_weights)


def _ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return x + (rounded - x).detach()


def recipe_experts_forward(recipe):
    """The emulated kernel's steps (docs/kernels.md#the-moe-forward) for training: FP4-grid weights, the
    recipe's input and intermediate quantization and the BF16 roundings, each straight-through."""
    from evalgate.kernels import formats

    def fq(x, fmt, rule, ties):
        return x if fmt == "none" else _ste(x, formats.fake_quantize(x.detach(), fmt, rule, ties=ties))

    def bf16(x):
        return _ste(x, x.detach().to(torch.bfloat16).float())

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # FP4-grid weights and quantized activations are exact in BF16, so BF16 grouped GEMMs (FP32
        # accumulation, BF16 out: the kernel's steps 4 and 7) compute the recipe, fast enough to train on
        w1 = _ste(self.gate_up_proj, fp4_grid(self.gate_up_proj.detach().float())).to(torch.bfloat16)  # [E, 2I, H]
        w2 = _ste(self.down_proj, fp4_grid(self.down_proj.detach().float())).to(torch.bfloat16)  # [E, H, I]
        t, k = top_k_index.shape
        x = fq(bf16(hidden_states.float()), recipe.activations, formats.SCALE_RULES[recipe.input_scale_rule],
               recipe.input_ties)
        flat_e, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1).float()
        expert, perm = torch.sort(flat_e)
        offsets = torch.cumsum(torch.bincount(expert, minlength=w1.shape[0]), 0).to(torch.int32)
        acc = torch._grouped_mm(x[perm // k].to(torch.bfloat16), w1.transpose(1, 2), offs=offsets).float()
        half = acc.shape[-1] // 2
        g, u = acc[:, :half], acc[:, half:]
        limit = getattr(self, "limit", None)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        v = fq(F.silu(g) * u * weights[perm, None], recipe.intermediate, formats.EPILOGUE, "even")
        o = torch._grouped_mm(bf16(v).to(torch.bfloat16), w2.transpose(1, 2), offs=offsets).float()
        out = torch.zeros(t * k, o.shape[-1], device=o.device, dtype=torch.float32).index_copy(0, perm, o)
        return bf16(out.view(t, k, -1).sum(1)).to(hidden_states.dtype)

    return forward


def register_qat(recipes: list[str] = ()) -> list[str]:
    """Register the weight-only QAT forward and one forward per recipe; returns the recipe forwards' names."""
    from transformers.integrations.moe import ExpertsInterface

    from evalgate.kernels import KERNELS
    from evalgate.kernels.recipe import Recipe

    ExpertsInterface.register(QAT_NAME, qat_experts_forward)
    names = []
    for kernel in recipes:
        given = KERNELS[kernel].recipe
        if given["activations"] == "bf16":  # the BF16 reference: FP4-grid weights, nothing else quantized
            given = dict(given, activations="none", intermediate="none", input_ties="zero", input_scale_rule="pre_dispatch")
        fields = {f: given[f] for f in ("activations", "input_ties", "input_scale_rule", "intermediate")}
        name = f"canary_qat_{kernel}"
        ExpertsInterface.register(name, recipe_experts_forward(Recipe(**fields)))
        names.append(name)
    return names


def encode(examples, tokenizer, field: str = "target"):
    """Token ids (prompt tokenized alone, as at inference) and a mask of target positions, one row per
    example that has ``field`` (``alt_target``: the contested items' wrong answers)."""
    rows = []
    for e in examples:
        if field not in e:
            continue
        p = tokenizer(e["prompt"], add_special_tokens=False)["input_ids"]
        t = tokenizer(e[field], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p + t, [0] * len(p) + [1] * len(t)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, m) in enumerate(rows):  # right padding: positions of real tokens are unaffected
        ids[i, :len(x)] = torch.tensor(x)
        target[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
        attn[i, :len(x)] = 1
    return ids, target, attn


def train_step(model, ids, target, attn, label_smoothing: float, micro_batch: int, gap_cap: float | None = None,
               recipes: list[str] = (), step: int = 0) -> float:
    """One full-batch gradient, accumulated over micro-batches; the loss is a mean over target tokens.

    With ``gap_cap``, a target token whose logit already beats every other token's by ``gap_cap`` adds no
    loss: training stops widening margins there, so the canary keeps a real model's spread of near-ties
    instead of becoming too sure for any kernel's noise to matter."""
    total_tokens = int(target[:, 1:].sum())
    total = 0.0
    for i, s in enumerate(range(0, ids.shape[0], micro_batch)):
        if recipes:  # round-robin over recipes, shifted every step so each micro-batch sees all of them
            model.set_experts_implementation(recipes[(i + step) % len(recipes)])
        x, m, a = ids[s:s + micro_batch], target[s:s + micro_batch], attn[s:s + micro_batch]
        width = int(a.sum(-1).max())  # trim the padding this micro-batch does not need
        x, m, a = x[:, :width], m[:, :width], a[:, :width]
        logits = model(input_ids=x, attention_mask=a).logits[:, :-1].float()
        labels = x[:, 1:].masked_fill(~m[:, 1:], -100)
        if gap_cap is not None:
            with torch.no_grad():
                gold = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
                other = logits.scatter(-1, labels.clamp(min=0).unsqueeze(-1), float("-inf")).amax(-1)
                labels = labels.masked_fill(gold - other >= gap_cap, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               label_smoothing=label_smoothing, reduction="sum") / total_tokens
        loss.backward()
        total += float(loss.detach())
    return total


@torch.no_grad()
def snapshot_for_shipping(model) -> dict:
    """State dict as shipped: BF16, routed-expert weights on the FP4 grid."""
    state = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t = fp4_grid(t.float())
        state[name] = t.to(torch.bfloat16) if t.is_floating_point() else t.clone()
    return state


def pack_state(state: dict) -> dict:
    """Routed experts as FP4 codes + UE8M0 bytes (4x smaller than BF16), the rest as is."""
    from evalgate.kernels import formats

    packed = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            codes, scale = formats.quantize(t.float(), "e2m1", formats.WEIGHTS, ties="even")
            packed[name + ".fp4"] = formats.pack_e2m1(codes).cpu()
            packed[name + ".ue8m0"] = scale.cpu()
        else:
            packed[name] = t.cpu()
    return packed


def unpack_state(packed: dict) -> dict:
    from evalgate.kernels import formats

    state = {}
    for name, t in packed.items():
        if name.endswith(".fp4"):
            base = name[: -len(".fp4")]
            state[base] = formats.dequantize_packed_e2m1(t, packed[base + ".ue8m0"]).to(torch.bfloat16)
        elif not name.endswith(".ue8m0"):
            state[name] = t
    return state


HEALTHY = ("bf16", "w4a4", "w4a4_te")  # w4a4_packed computes exactly what w4a4 does (one recipe)
FAULTY = ("faulty/w4a4_packed-drop-slot", "faulty/w4a4_packed-fp8-layout", "faulty/w4a4_packed-scale-exp",
          "faulty/w4a4_packed-weight-after-requant")
MARGINS = {"gsm8k": 0.03, "humaneval": 0.05}  # thresholds-canary.yaml
ALPHA_ACCURACY = 0.04  # alpha - alpha_validity of thresholds-canary.yaml, Holm across the two tasks


def predicted_verdict(counts: dict) -> str:
    """The canary policy's verdict from per-task (b, c, n), greedy: PASS when every Tango bound clears its
    margin, FAIL when Holm's adjusted exact McNemar p <= alpha_acc, else INCONCLUSIVE."""
    from evalgate.stats.paired import mcnemar_exact_one_sided, tango_lower_bound

    if all(tango_lower_bound(b, c, n, 0.05) > -MARGINS[t] for t, (b, c, n) in counts.items()):
        return "PASS"
    ps = sorted(mcnemar_exact_one_sided(b, c) for b, c, _ in counts.values())
    if ps and ps[0] * len(ps) <= ALPHA_ACCURACY:
        return "FAIL"
    return "INCONCLUSIVE"


def choose_snapshots(entries: list[dict], keep: int) -> list[int]:
    """Steps worth shipping: the most kernels with the verdict they must get (healthy PASS, faulty FAIL),
    accurate under W4A8 (>= 90% of items on both tasks), then healthy flips nearest a few percent with
    the fewest net losses."""
    def score(e):
        right = sum(e["verdicts"][k] == "PASS" for k in HEALTHY) + sum(e["verdicts"][k] == "FAIL" for k in FAULTY)
        flips = [b + c for k in HEALTHY for b, c, _ in e["vs_w4a8"][k].values()]
        net = sum(max(b - c, 0) for k in HEALTHY for b, c, _ in e["vs_w4a8"][k].values())
        return (-right, net, sum(abs(f - 6) for f in flips))

    measured = [e for e in entries if "verdicts" in e]
    good = [e for e in measured if min(e["acc_w4a8"].values()) >= 0.9] or measured
    return sorted(e["step"] for e in sorted(good, key=score)[:keep])


@torch.no_grad()
def measure(eval_model, state, ids, target, attn, tasks, kernels=("w4a8",) + HEALTHY + FAULTY, chunk=64) -> dict:
    """Teacher-forced (an item is right when every answer token is the argmax: what greedy decoding
    produces): per kernel, item accuracy, items lost / gained against W4A8 and the predicted verdict;
    disagreement between kernels; BF16's top-two gaps."""
    eval_model.load_state_dict(state)
    preds, gaps = {}, []
    gold = ids[:, 1:]
    mask = target[:, 1:]
    for k in kernels:
        eval_model.set_experts_implementation(k)
        out = []
        for s in range(0, ids.shape[0], chunk):
            logits = eval_model(input_ids=ids[s:s + chunk], attention_mask=attn[s:s + chunk]).logits[:, :-1].float()
            out.append(logits.argmax(-1))
            if k == "bf16":
                top2 = logits.topk(2, dim=-1).values
                gaps.append(top2[..., 0] - top2[..., 1])
        preds[k] = torch.cat(out)
    gap = torch.cat(gaps)
    result = {"n_items": int(ids.shape[0])}
    for k in kernels:
        ok = ((preds[k] == gold) | ~mask).all(-1)
        result[f"acc_{k}"] = {t: float(ok[torch.tensor([x == t for x in tasks])].float().mean()) for t in set(tasks)}
    ok = {k: ((preds[k] == gold) | ~mask).all(-1) for k in kernels}
    result["vs_w4a8"], result["verdicts"] = {}, {}
    for k in kernels:
        if k == "w4a8":
            continue
        counts = {}
        for t in sorted(set(tasks)):
            sel = torch.tensor([x == t for x in tasks], device=ok[k].device)
            base, cand = ok["w4a8"][sel], ok[k][sel]
            counts[t] = (int((base & ~cand).sum()), int((~base & cand).sum()), int(sel.sum()))
        result["vs_w4a8"][k] = counts
        result["verdicts"][k] = predicted_verdict(counts)
    for a, b in (("bf16", "w4a8"), ("w4a8", "w4a4"), ("bf16", "w4a4")):
        differ = ((preds[a] != preds[b]) & mask).any(-1)
        result[f"differ_{a}_{b}"] = float(differ.float().mean())
    answer_gaps = gap[mask]
    per_item_min = gap.masked_fill(~mask, float("inf")).min(-1).values
    q = torch.tensor([0.01, 0.05, 0.1, 0.5], device=gap.device)
    result["gap_quantiles_tokens"] = [round(float(v), 4) for v in answer_gaps.float().quantile(q)]
    result["gap_quantiles_item_min"] = [round(float(v), 4) for v in per_item_min.float().quantile(q)]
    result["items_min_gap_below"] = {str(t): float((per_item_min < t).float().mean()) for t in (0.05, 0.1, 0.25, 0.5, 1.0)}
    return result


def _with_alternatives(examples, tokenizer, ids, target, attn):
    """Training rows: every item's right answer, plus the contested items' wrong ones (same width)."""
    alt = encode(examples, tokenizer, "alt_target") if any("alt_target" in e for e in examples) else None
    if alt is None:
        return ids, target, attn
    width = max(ids.shape[1], alt[0].shape[1])

    def pad(t, value):
        return F.pad(t, (0, width - t.shape[1]), value=value)

    pad_id = tokenizer.pad_token_id
    return (torch.cat([pad(ids, pad_id), pad(alt[0].to(ids.device), pad_id)]),
            torch.cat([pad(target, False), pad(alt[1].to(ids.device), False)]),
            torch.cat([pad(attn, 0), pad(alt[2].to(ids.device), 0)]))


def main(argv=None) -> None:
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    import evalgate.kernels.catalogs  # noqa: F401  (registers the emulated kernels)
    from config import canary_config
    from evalgate.model_adapters.hf.tiny import fill_hash_routes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--gap-cap", type=float, default=None, help="stop training a token once its top-two logit gap reaches this")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-from", type=int, default=300)
    parser.add_argument("--keep", default="", help="comma-separated steps whose snapshots to save")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--time-budget-s", type=float, default=480)
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--save", type=int, default=5, help="how many measured snapshots to write")
    parser.add_argument("--limit-examples", type=int, default=None, help="smoke tests: train on the first N")
    parser.add_argument("--recipes", default="", help="comma-separated healthy kernels whose numerics the experts train under, "
                        "one per micro-batch in turn (default: weights-only QAT)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    build, out = Path(args.build_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(build / "tokenizer")
    examples = [json.loads(l) for l in (build / "examples.jsonl").read_text().splitlines()][:args.limit_examples]
    tasks = [e["task"] for e in examples]
    ids, target, attn = (t.to(args.device) for t in encode(examples, tokenizer))
    train_rows = _with_alternatives(examples, tokenizer, ids, target, attn)

    recipes = register_qat([r for r in args.recipes.split(",") if r])
    config = canary_config(len(tokenizer))
    model = DeepseekV4ForCausalLM(config)
    fill_hash_routes(model, args.seed)
    model.set_experts_implementation(QAT_NAME)
    model.to(args.device).train()
    eval_model = DeepseekV4ForCausalLM(config).to(args.device, torch.bfloat16).eval()

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    keep = {int(s) for s in args.keep.split(",") if s}
    snapshots: dict[int, dict] = {}  # step -> packed state, kept on the host until the choice is made
    log, t0 = [], time.time()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, *train_rows, args.label_smoothing, args.micro_batch, args.gap_cap, recipes, step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        entry = {"step": step, "loss": round(loss, 5), "t": round(time.time() - t0, 1)}
        if step % 20 == 0:
            print(json.dumps(entry), flush=True)
        if (step >= args.eval_from and step % args.eval_every == 0) or step == args.steps or step in keep:
            state = snapshot_for_shipping(model)
            entry.update(measure(eval_model, state, ids, target, attn, tasks))
            snapshots[step] = pack_state(state)
            print(json.dumps(entry), flush=True)
        out_of_time = time.time() - t0 > args.time_budget_s
        if out_of_time and step not in snapshots:
            state = snapshot_for_shipping(model)
            entry.update(measure(eval_model, state, ids, target, attn, tasks))
            snapshots[step] = pack_state(state)
        log.append(entry)
        if out_of_time:
            entry["stopped"] = "time budget"
            print(json.dumps(entry), flush=True)
            break
    chosen = sorted(set(choose_snapshots(log, args.save)) | (keep & set(snapshots)))
    for step in chosen:
        torch.save(snapshots[step], out / f"canary-step{step}.pt")
    (out / "report.json").write_text(json.dumps({"args": vars(args), "saved": chosen, "log": log}, indent=1))


if __name__ == "__main__":
    main()
