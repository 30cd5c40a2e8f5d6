"""Train the canary (seeded, reproducible; minutes on one H200).

    python -m evalgate.canary.train BUILD_DIR OUT_DIR [--steps N] [--device cuda]

BUILD_DIR comes from ``canary.data`` (examples + tokenizer). The routed experts are trained for FP4
(quantization-aware: the forward pass uses the FP4 grid values of the expert weights, RCEIL scales per 32,
ties to even — exactly what the shipped checkpoint stores — with a straight-through gradient); activations
stay BF16-free FP32 during training.

A canary that is too perfect is useless for a gate: once its top-two logit gaps are wide, no kernel's
noise flips an answer. So training saves snapshots along the way and measures each, teacher-forced on
every item with the emulated ``bf16``, ``w4a8`` and ``w4a4`` kernels: item accuracy, the share of items
whose argmax path differs between kernels, and the top-two gap distribution on answer tokens. ``report.json``
holds those numbers; the snapshot to ship is chosen from them (see ``MODEL_CARD.md``).
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


def register_qat() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(QAT_NAME, qat_experts_forward)


def encode(examples, tokenizer):
    """Token ids (prompt tokenized alone, as at inference) and a mask of target positions."""
    rows = []
    for e in examples:
        p = tokenizer(e["prompt"], add_special_tokens=False)["input_ids"]
        t = tokenizer(e["target"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
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


def train_step(model, ids, target, attn, label_smoothing: float, micro_batch: int, gap_cap: float | None = None) -> float:
    """One full-batch gradient, accumulated over micro-batches; the loss is a mean over target tokens.

    With ``gap_cap``, a target token whose logit already beats every other token's by ``gap_cap`` adds no
    loss: training stops widening margins there, so the canary keeps a real model's spread of near-ties
    instead of becoming too sure for any kernel's noise to matter."""
    total_tokens = int(target[:, 1:].sum())
    total = 0.0
    for s in range(0, ids.shape[0], micro_batch):
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


def choose_snapshots(entries: list[dict], keep: int) -> list[int]:
    """Steps worth shipping: accurate under bf16 (>= 90% of items on both tasks, teacher-forced), then
    the ones whose kernel disagreement is closest to a few percent (a real model's flip profile)."""
    def score(e):
        target = 0.04
        return abs(e["differ_bf16_w4a8"] - target) + abs(e["differ_w4a8_w4a4"] - target)

    measured = [e for e in entries if "acc_bf16" in e]
    good = [e for e in measured if min(e["acc_bf16"].values()) >= 0.9] or measured
    return sorted(e["step"] for e in sorted(good, key=score)[:keep])


@torch.no_grad()
def measure(eval_model, state, ids, target, attn, tasks, kernels=("bf16", "w4a8", "w4a4"), chunk=64) -> dict:
    """Teacher-forced: per kernel, argmax path and item accuracy; disagreement between kernels; gaps."""
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


def main(argv=None) -> None:
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    import evalgate.kernels  # noqa: F401  (registers the emulated kernels)
    from evalgate.canary.config import canary_config
    from evalgate.model_adapters.tiny import fill_hash_routes

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
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    build, out = Path(args.build_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(build / "tokenizer")
    examples = [json.loads(l) for l in (build / "examples.jsonl").read_text().splitlines()][:args.limit_examples]
    tasks = [e["task"] for e in examples]
    ids, target, attn = (t.to(args.device) for t in encode(examples, tokenizer))

    register_qat()
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
        loss = train_step(model, ids, target, attn, args.label_smoothing, args.micro_batch, args.gap_cap)
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
