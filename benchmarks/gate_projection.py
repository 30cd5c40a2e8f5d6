"""What a whole gate costs on H200s, projected from one GPU's measured step and prefill times.

The gate priced is the default one (evalgate.pipeline.gate): the candidate's greedy pass over GSM8K and
HumanEval (early stop watching it), then rounds of coupled samples on the tasks left undecided, the baseline
kernel sampled alike in each round unless ``evalgate calibrate --samples k`` stored it beforehand. The
rounds' samples per item per side come from the gate's own decision path in simulation (``gate_rounds``:
benchmarks/simulate_gate.py's ``one_gate``, a healthy kernel at flip rate ψ); the prompts' and answers' token
counts from the real task data and prompt builders (``task_loads``). Arithmetic (``project``):

- decode: a pass of ``s`` sequences (items x samples per item) of ``t`` tokens each at batch ``B`` takes
  ``ceil(s / B) * t`` steps when every sequence runs to its profile's limit (worst case), and ``s * t / B``
  steps at the expected length (continuous batching refills a finished row's slot); each step of the whole
  model is the measured step x ``total_layers / layers`` (its layers run one device after another);
- prefill: each sequence's prompt from scratch, or with a prefix cache the task's shared few-shot prefix once
  a pass and each item's own tokens once for all its samples, at the measured rate for that case;
- copies: ``gpus // per_replica`` copies of the model take a share of the sequences each;
- early stop: its checks run on the scorer's thread beside decoding; the last one, after the last item, is
  on the wall once a greedy pass (a healthy kernel runs every item); the gate's decision at each look too;
- once a gate: load, the first prefill's compilation, graph capture, kernel conformance + execution witness
  (and the baseline kernel's load when its samples are not stored); once a baseline: ``calibrate``'s A/A
  (two greedy passes of the baseline kernel) and, for the rounds, two sampled passes at each round's k.

Tokens/s per GPU: the tokens the gate generates (both sides) over its minutes and its GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

PUBLISHED_PER_GPU = (4000, 4900)  # SGLang serving DeepSeek-V4-Flash, tokens/s per H200 at high concurrency (published)


@dataclass(frozen=True)
class TaskLoad:
    """One task's items as the gate runs them: prompt tokens (mean), the tokens every prompt starts with, the
    profile's token limit and the expected answer length (mean)."""

    name: str
    items: int
    prompt_tokens: float
    shared_prefix: int
    max_new_tokens: int
    expected_tokens: float


@dataclass(frozen=True)
class Rounds:
    """Samples per item each side generates beyond the greedy look, per task (the means of simulated gates),
    the looks after the greedy one, and each look's decision time on the CPU."""

    psi: float
    candidate: dict[str, float]
    baseline: dict[str, float]
    runs: dict[str, float] = field(default_factory=dict)  # round runs per task (each side), mean
    looks: float = 0.0
    decide_s: float = 0.0
    round_ks: tuple[int, ...] = ()
    source: str = "given"


GREEDY_ONLY = Rounds(psi=0.0, candidate={}, baseline={}, source="greedy pass only")


@dataclass(frozen=True)
class Measured:
    """One GPU's figures for ``layers`` of the model's layers: the decoding step at ``batch`` rows, prefill in
    prompt tokens computed per second (each prompt from scratch; ``cached_prefill_tokens_per_s``: the tokens a
    prefix cache leaves to compute, None where there is no prefix cache), and the one-time costs."""

    layers: int
    batch: int
    step_s: float
    prefill_tokens_per_s: float
    cached_prefill_tokens_per_s: float | None = None
    load_s: float = 0.0
    compile_s: float = 0.0  # Triton's kernel compilation: once a process, whatever the layers
    prefill_once_s: float = 0.0  # first prefills' extra beyond compiling (the allocator growing), these layers
    capture_s: float = 0.0  # CUDA graph capture beyond compiling, these layers
    conformance_s: float = 0.0  # kernel conformance + execution witness beyond compiling, these layers
    cached_prefill_once_s: float | None = None  # as prefill_once_s, the prefix cache's first pass (None: as that)
    check_s: float = 0.0  # one early-stop check (CPU)


@dataclass
class Pass:
    """One pass's cost on the whole model with its copies: seconds of decoding and of prefill, tokens."""

    decode_s: float = 0.0
    prefill_s: float = 0.0
    generated: float = 0.0
    prompt_tokens: float = 0.0

    def __iadd__(self, other: Pass) -> Pass:
        self.decode_s += other.decode_s
        self.prefill_s += other.prefill_s
        self.generated += other.generated
        self.prompt_tokens += other.prompt_tokens
        return self

    @property
    def seconds(self) -> float:
        return self.decode_s + self.prefill_s


@dataclass
class Projection:
    """A gate's seconds on ``gpus`` GPUs, split: the candidate's greedy pass, the rounds (candidate, baseline),
    the decisions and early stop's last check, the one-time costs; and what calibrating the baseline costs."""

    gpus: int
    lengths: str
    greedy: Pass
    rounds_candidate: Pass
    rounds_baseline: Pass
    decisions_s: float
    once_s: float
    calibration_s: float
    parts: dict = field(default_factory=dict)

    def seconds(self, baseline_stored: bool = True) -> float:
        rounds = self.rounds_candidate.seconds + (0.0 if baseline_stored else self.rounds_baseline.seconds)
        extra_load = 0.0 if baseline_stored or not self.rounds_baseline.generated else self.parts["load_s"]
        return self.greedy.seconds + rounds + self.decisions_s + self.once_s + extra_load

    def minutes(self, baseline_stored: bool = True) -> float:
        return self.seconds(baseline_stored) / 60

    def generated(self, baseline_stored: bool = True) -> float:
        return (self.greedy.generated + self.rounds_candidate.generated
                + (0.0 if baseline_stored else self.rounds_baseline.generated))

    def tokens_per_s_per_gpu(self, baseline_stored: bool = True) -> float:
        return self.generated(baseline_stored) / self.seconds(baseline_stored) / self.gpus


def run_pass(tasks: list[TaskLoad], samples: dict[str, float], m: Measured, scale: float, replicas: int,
             lengths: str, prefix_cache: bool, runs: dict[str, float] | None = None) -> Pass:
    """Seconds and tokens of ``samples[task]`` sequences per item of each task (0 or absent: the task is not
    run) on the whole model (``scale``: its layers over the measured ones) split over ``replicas`` copies.
    ``lengths``: "limit" (every sequence to its token limit, static batches) or "expected" (the expected
    answer length, continuous batching). ``runs[task]``: the runs its samples are spread over (default 1; with
    a prefix cache each run computes the shared prefix once and each item's own tokens once)."""
    if lengths not in ("limit", "expected"):
        raise ValueError(f"lengths: 'limit' or 'expected', got {lengths!r}")
    step = m.step_s * scale
    rate = m.cached_prefill_tokens_per_s if prefix_cache else m.prefill_tokens_per_s
    if prefix_cache and rate is None:
        raise ValueError("prefix_cache: no prefill rate measured with a prefix cache")
    out = Pass()
    for t in tasks:
        k = samples.get(t.name, 0.0)
        if k <= 0:
            continue
        seqs = t.items * k / replicas  # one copy's share
        if lengths == "limit":
            steps = math.ceil(seqs / m.batch) * t.max_new_tokens
            tokens = seqs * t.max_new_tokens
        else:
            steps = seqs * t.expected_tokens / m.batch
            tokens = seqs * t.expected_tokens
        if prefix_cache:  # the shared prefix once a run; an item's own tokens once a run for all its samples
            n = (runs or {}).get(t.name, 1.0)
            computed = n * t.shared_prefix + n * t.items / replicas * (t.prompt_tokens - t.shared_prefix)
        else:
            computed = seqs * t.prompt_tokens
        out += Pass(decode_s=steps * step, prefill_s=computed / rate * scale, generated=tokens * replicas,
                    prompt_tokens=seqs * t.prompt_tokens * replicas)
    return out


def first_prefills_s(m: Measured, prefix_cache: bool) -> float:
    """The first prefills' extra (these layers) on the path a gate with or without a prefix cache prefills by."""
    if prefix_cache and m.cached_prefill_once_s is not None:
        return m.cached_prefill_once_s
    return m.prefill_once_s


def project(tasks: list[TaskLoad], rounds: Rounds, m: Measured, total_layers: int, per_replica: int, gpus: int,
            lengths: str = "expected", prefix_cache: bool = False) -> Projection:
    """The whole gate on ``gpus`` GPUs, ``per_replica`` of them holding one copy of the model."""
    replicas = max(1, gpus // per_replica)
    scale = total_layers / m.layers
    every = {t.name: 1.0 for t in tasks}

    def at(samples, runs=None):
        return run_pass(tasks, samples, m, scale, replicas, lengths, prefix_cache, runs)

    greedy = at(every)
    cand = at(rounds.candidate, rounds.runs)
    base = at(rounds.baseline, rounds.runs)
    decisions = (1 + rounds.looks) * rounds.decide_s + m.check_s
    load = m.load_s * scale  # the copies load side by side
    once = load + m.compile_s + (first_prefills_s(m, prefix_cache) + m.capture_s + m.conformance_s) * scale
    # calibrate: the baseline's A/A (two greedy passes) and two sampled passes at each round's k, on every task
    calibration = load + m.compile_s + 2 * at(every).seconds + sum(
        2 * at({t.name: float(k) for t in tasks}).seconds for k in rounds.round_ks)
    return Projection(gpus, lengths, greedy, cand, base, decisions, once, calibration,
                      parts={"load_s": load, "scale": scale, "replicas": replicas})


# ---------------------------------------------------------------------------------------------------------
# Inputs from the gate's own code: the tasks' prompts and answers, the rounds' samples
# ---------------------------------------------------------------------------------------------------------


def _common_prefix(rows: list[list[int]]) -> int:
    first = rows[0]
    n = len(first)
    for r in rows[1:]:
        n = min(n, len(r))
        n = next((i for i in range(n) if r[i] != first[i]), n)
    return n


def task_loads(tokenize, limit: int | None = None, profiles: dict[str, str] | None = None) -> list[TaskLoad]:
    """GSM8K's and HumanEval's items as their profiles build the prompts (``profiles``: task -> profile name;
    default: the tasks' default profiles, the gate's), counted in ``tokenize``'s
    tokens (a callable: text -> token ids): mean prompt, the prefix every prompt shares, the profile's token
    limit, and the mean length of the reference answers (GSM8K's worked answers, HumanEval's canonical
    solutions) as the expected answer length. ``limit``: count the first so many items only (the item count
    stays the task's). The default GSM8K profile (lm-eval's gsm8k) samples its five shots per item, so its
    prompts share almost nothing; gsm8k-cot-8shot's eight fixed exemplars are a prefix every prompt shares."""
    from evalgate.tasks import get_task, resolve_profile

    out = []
    for name, answer in (("gsm8k", "answer"), ("humaneval", "canonical_solution")):
        task = get_task(name)
        items, resolved = task.load(resolve_profile(task, (profiles or {}).get(name)), None, None)
        n = len(items)
        reqs = task.requests(items[:limit] if limit else items, resolved)
        prompts = [tokenize(r.prompt) for r in reqs]
        answers = [len(tokenize(it[answer])) for it in items[:len(reqs)]]
        out.append(TaskLoad(name, n, sum(map(len, prompts)) / len(prompts), _common_prefix(prompts),
                            max(r.max_new_tokens for r in reqs), sum(answers) / len(answers)))
    return out


def _one_gate(job):
    """One simulated gate of a healthy kernel at ψ (simulate_gate's world, the real pipeline): per task the
    samples per item each side generated beyond the greedy look, the looks after the first, seconds."""
    import tempfile
    import time
    from pathlib import Path

    import simulate_gate as sim

    psi, moves, seed = job
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        world = sim.World(f"healthy, ψ {psi:g}, {moves} moves", psi=psi, moves=moves)
        verdict, _, _, looks = sim.one_gate(world, seed, 0, Path(tmp) / "baseline")
    cand = {t: 0.0 for t in sim.TASKS}
    base, runs = dict(cand), dict(cand)
    for kernel, k, tasks in sim.STATE["generated"]:
        if k == 1:
            continue  # the candidate's greedy pass
        for t in tasks:
            (base if kernel == "w4a8" else cand)[t] += k
            runs[t] += kernel != "w4a8"
    return verdict, cand, base, runs, looks, time.perf_counter() - t0


def gate_rounds(psi: float, reps: int, seed: int = 45, workers: int = 1, moves: str = "independent") -> Rounds:
    """The rounds a healthy kernel at flip rate ``psi`` needs under the default policy: ``reps`` gates through
    the real decision path (simulate_gate), averaged; ``reps`` 0: the greedy pass only. ``moves``: how its
    answers move (simulate_gate's World: "independent" per sample, or "persistent" on half the items)."""
    if reps <= 0:
        return replace(GREEDY_ONLY, psi=psi)
    import simulate_gate as sim
    from evalgate.pipeline import next_samples
    from evalgate.plan import DEFAULT_MAX_SAMPLES

    jobs = [(psi, moves, seed + r) for r in range(reps)]
    if workers > 1:
        from multiprocessing import get_context

        with get_context("fork").Pool(min(workers, reps), initializer=sim._patch_pipeline) as pool:
            results = pool.map(_one_gate, jobs)
    else:
        sim._patch_pipeline()
        results = [_one_gate(j) for j in jobs]
    ks, k = [], 1
    while (k := next_samples(k, [], DEFAULT_MAX_SAMPLES)) is not None:
        ks.append(k)
    mean = lambda side: {t: sum(r[side][t] for r in results) / reps for t in sim.TASKS}  # noqa: E731
    looks = sum(r[4] for r in results) / reps
    seconds = sum(r[5] for r in results) / reps
    verdicts = {v: sum(r[0] == v for r in results) for v in {r[0] for r in results}}
    return Rounds(psi, mean(1), mean(2), mean(3), max(0.0, looks - 1), seconds / max(looks, 1), tuple(ks),
                  f"simulate_gate.one_gate, {reps} healthy kernels at ψ {100 * psi:g}%, {moves} moves "
                  f"({', '.join(f'{n} {v}' for v, n in sorted(verdicts.items()))})")


def early_stop_check_s(reps: int = 2, seed: int = 45) -> float:
    """Seconds of one early-stop check on a whole greedy pass (``best_completion_verdict``: the gate's
    compare + decide on both tasks), on runs drawn from simulate_gate's healthy world: the fastest of ``reps``,
    as the last check of a pass is (the first computes the exact tests' critical values, beside decoding)."""
    import tempfile
    import time
    from pathlib import Path

    from types import SimpleNamespace

    import simulate_gate as sim
    from evalgate.gate.early_stop import best_completion_verdict
    from evalgate.gate.policy import load_thresholds

    world = sim.World("healthy")
    tasks = {t: sim.Task(t, world, seed) for t in sim.TASKS}
    spec = SimpleNamespace(tasks=list(sim.TASKS), samples=1, seed=0, temperature=0.0)  # a greedy run's
    policy = load_thresholds()
    with tempfile.TemporaryDirectory() as tmp:
        base = sim.make_run(tasks, "w4a8", spec, Path(tmp) / "b", 0)
        cand = sim.make_run(tasks, "cand", spec, Path(tmp) / "c", 0)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            best_completion_verdict(base, cand, policy, require_aa=False)
            times.append(time.perf_counter() - t0)
    return min(times)


# ---------------------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------------------


def describe_inputs(tasks: list[TaskLoad], rounds: Rounds) -> list[str]:
    lines = [f"{t.name}: {t.items} items, prompt {t.prompt_tokens:.0f} tokens (mean; {t.shared_prefix} shared by "
             f"every prompt), limit {t.max_new_tokens} new tokens, expected {t.expected_tokens:.0f} (reference "
             "answers, mean)" for t in tasks]
    if rounds.candidate:
        per = lambda side: ", ".join(f"{t} {v:.2f}" for t, v in side.items())  # noqa: E731
        lines.append(f"rounds at ψ = {100 * rounds.psi:g}% (k = {', '.join(map(str, rounds.round_ks))}; "
                     f"{rounds.source}): samples per item beyond the greedy look, candidate {per(rounds.candidate)}; "
                     f"baseline {per(rounds.baseline)}; {rounds.looks:.2f} looks after the first, "
                     f"{rounds.decide_s:.1f} s a look's decision")
    else:
        lines.append("rounds: none (the greedy pass only)")
    return lines


def describe_once(m: Measured, total_layers: int) -> str:
    """The one-time costs as measured (these layers) and as priced for the whole model."""
    scale = total_layers / m.layers
    parts = {"load": m.load_s * scale, "compilation": m.compile_s,
             "first prefills' extra": m.prefill_once_s * scale}
    if m.cached_prefill_once_s is not None:
        parts["(with the prefix cache)"] = m.cached_prefill_once_s * scale
    parts.update({"graph capture": m.capture_s * scale, "conformance + witness": m.conformance_s * scale})
    return (f"once a gate, for {total_layers} layers (measured on {m.layers} x {scale:.2f}; compilation as measured, "
            "once a process): " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items())
            + f"; early stop's last check {m.check_s:.1f} s")


def table(tasks: list[TaskLoad], rounds: Rounds, m: Measured, total_layers: int, per_replica: int,
          prefix_cache_options=(False,), gpus_options=(2, 4)) -> tuple[list[str], list[dict]]:
    """Rows of the projection: for each prefix-cache choice, token-length case and GPU count, the greedy
    pass alone, the gate with the baseline's samples stored, and with the baseline sampled in the gate."""
    lines = [f"{'prefix cache':>12s} {'lengths':>8s} {'GPUs':>4s} {'greedy min':>10s} {'gate min':>8s} "
             f"{'+base min':>9s} {'once min':>8s} {'prefill %':>9s} {'tok/s/GPU':>9s} {'calibrate min':>13s}"]
    rows = []
    for cached in prefix_cache_options:
        for lengths in ("expected", "limit"):
            for gpus in gpus_options:
                p = project(tasks, rounds, m, total_layers, per_replica, gpus, lengths, cached)
                greedy_min = (p.greedy.seconds + p.once_s + rounds.decide_s + m.check_s) / 60
                row = {"prefix_cache": cached, "lengths": lengths, "gpus": gpus, "greedy_min": round(greedy_min, 1),
                       "gate_min": round(p.minutes(True), 1), "gate_base_sampled_min": round(p.minutes(False), 1),
                       "once_min": round(p.once_s / 60, 1),
                       "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu(True)),
                       "calibrate_min": round(p.calibration_s / 60, 1),
                       "prefill_share": round((p.greedy.prefill_s + p.rounds_candidate.prefill_s) / p.seconds(True), 2)}
                rows.append(row)
                lines.append(f"{'yes' if cached else 'no':>12s} {lengths:>8s} {gpus:4d} {row['greedy_min']:10.1f} "
                             f"{row['gate_min']:8.1f} {row['gate_base_sampled_min']:9.1f} {row['once_min']:8.1f} "
                             f"{100 * row['prefill_share']:9.0f} {row['tokens_per_s_per_gpu']:9d} "
                             f"{row['calibrate_min']:13.1f}")
    lo, hi = PUBLISHED_PER_GPU
    lines.append(f"published: SGLang serves DeepSeek-V4-Flash at {lo:,}-{hi:,} tokens/s per H200 at high concurrency")
    return lines, rows


def main(argv: list[str] | None = None) -> dict:
    """The projection from figures given on the command line (a GPU run's, or a smoke test's on a CPU)."""
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(description="project the whole gate from measured step and prefill times")
    p.add_argument("--layers", type=int, required=True, help="the layers the figures were measured on")
    p.add_argument("--total-layers", type=int, default=43, help="the whole model's layers (DeepSeek-V4-Flash: 43)")
    p.add_argument("--per-replica", type=int, default=2, help="GPUs one copy of the whole model needs")
    p.add_argument("--batch", type=int, required=True, help="rows of the measured decoding step")
    p.add_argument("--step-ms", type=float, required=True, help="the decoding step at --batch, these layers")
    p.add_argument("--prefill-tokens-per-s", type=float, required=True, help="prompt tokens prefilled a second, "
                   "each prompt from scratch, these layers")
    p.add_argument("--prefix-cache-tokens-per-s", type=float, default=None, help="prompt tokens computed a second "
                   "with a prefix cache (the tokens it leaves), these layers")
    for name, what in (("load", "loading these layers"), ("compile", "Triton's compilation (once a process)"),
                       ("prefill-once", "the first prefills' extra beyond compiling (these layers)"),
                       ("capture", "CUDA graph capture beyond compiling, every bucket (these layers)"),
                       ("conformance", "kernel conformance + execution witness beyond compiling (these layers)")):
        p.add_argument(f"--{name}-s", type=float, default=0.0, help=f"seconds of {what}")
    p.add_argument("--cached-prefill-once-s", type=float, default=None, help="seconds of the prefix cache's first "
                   "pass beyond its second and compiling (these layers) [default: --prefill-once-s]")
    p.add_argument("--psi", type=float, default=0.06, help="a healthy kernel's flip rate, for the rounds")
    p.add_argument("--reps", type=int, default=16, help="simulated gates for the rounds (0: the greedy pass only)")
    p.add_argument("--moves", default="independent", choices=("independent", "persistent"))
    p.add_argument("--gsm8k-profile", default=None, help="GSM8K's profile [default: the gate's]")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (transformers) to count the prompts in "
                   "[default: the full-width benchmark's, trained on GSM8K's train split]")
    p.add_argument("--items", type=int, default=None, help="count the prompts of the first N items only (smoke)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from dsv4_flash_fullwidth import tokenizer_for

        tokenizer = tokenizer_for(None)
    tasks = task_loads(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], args.items,
                       {"gsm8k": args.gsm8k_profile} if args.gsm8k_profile else None)
    rounds = gate_rounds(args.psi, args.reps, workers=args.workers, moves=args.moves)
    m = Measured(args.layers, args.batch, args.step_ms / 1e3, args.prefill_tokens_per_s,
                 args.prefix_cache_tokens_per_s, args.load_s, args.compile_s, args.prefill_once_s, args.capture_s,
                 args.conformance_s, args.cached_prefill_once_s, early_stop_check_s())
    lines, rows = table(tasks, rounds, m, args.total_layers, args.per_replica,
                        (False, True) if args.prefix_cache_tokens_per_s else (False,))
    for line in [*describe_inputs(tasks, rounds), describe_once(m, args.total_layers), *lines]:
        print(line)
    figures = {"tasks": [t.__dict__ for t in tasks], "rounds": rounds.__dict__, "measured": m.__dict__, "table": rows}
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
