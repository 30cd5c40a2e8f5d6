"""A gate that decides (issue 32, finding 4): every decision of one gate is a look at α·2^-(look+1), a rerun
with the same data is the same look and a rerun with new data the next, so rerunning until PASS cannot raise
the false-pass rate; undecided tasks get rounds of coupled samples per item, the baseline's in the same round."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from evalgate.errors import UserError
from evalgate.gate.policy import load_thresholds
from evalgate.gate.sequence import MAX_LOOKS
from evalgate.stats.exact_ni import critical_value
from evalgate.stats.paired import tango_z
from synthetic_runs import write_run
import cli_process

POLICY = """alpha: 0.05
tasks:
  gsm8k: {{profile: gsm8k-lmeval-v3, metric: "exact_match,strict-match", margin_pp: {margin}}}
  humaneval: {{profile: humaneval-completion-codex, metric: pass@1, margin_pp: {margin}}}
"""


def test_each_look_spends_half_of_what_is_left():
    policy = load_thresholds()
    looks = [policy.at_look(j) for j in range(MAX_LOOKS)]
    assert [p.alpha for p in looks[:3]] == pytest.approx([0.025, 0.0125, 0.00625])
    assert sum(p.alpha for p in looks) < policy.alpha
    assert sum(p.alpha_validity for p in looks) < policy.alpha_validity


def test_rerunning_until_pass_cannot_inflate_the_false_pass_rate():
    # a HumanEval kernel exactly M = 5 pp worse, greedy (ψ = 6%): rerun five times on fresh data (a stack that
    # is not bit-reproducible), stopping at the first PASS. At α each time the chance of a PASS adds up; at the
    # looks' α·2^-(j+1) it stays below α.
    rng = np.random.default_rng(3)
    n, margin, reps = 164, 0.05, 20_000
    passed_at_alpha = np.zeros(reps, bool)
    passed_at_looks = np.zeros(reps, bool)
    for look in range(5):
        moved = rng.multinomial(n, [0.03 + margin, 0.03, 1 - 0.06 - margin], size=reps)
        z = tango_z(-margin, moved[:, 0], moved[:, 1], n)
        passed_at_alpha |= z > critical_value(n, margin, 0.05)
        passed_at_looks |= z > critical_value(n, margin, load_thresholds().at_look(look).alpha)
    assert passed_at_alpha.mean() > 0.08  # what rerunning until PASS did
    assert passed_at_looks.mean() <= 0.05


def _pair(root: Path, lost: int, n: int = 40, name: str = "cand") -> tuple[Path, Path]:
    base = root / "base"
    if not base.exists():
        write_run(base, "w4a8", [True] * 200, [True] * n, ["failed:assertion"] * n, 0)
    cand = write_run(root / name, "w4a4_packed", [True] * 200, [i >= lost for i in range(n)],
                     ["failed:assertion"] * n, 1)
    return base, cand


def _plan(tmp_path: Path, candidate: Path, base: Path, margin: float = 20.0, **rest):
    from evalgate.plan import GateRequest, plan_gate
    from evalgate.run.store import load_run

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(margin=margin))
    return plan_gate(GateRequest(candidate=load_run(candidate), baselines=(base,), thresholds=load_thresholds(policy),
                                 allow_uncalibrated=True, baselines_root=tmp_path / "baselines", **rest))


def _looks(base: Path) -> dict:
    """identity -> task file -> the looks recorded with the baseline."""
    return {d.name: {f.name: [x["look"] for x in json.loads(f.read_text())["looks"]] for f in d.glob("*.json")}
            for d in (base / "looks").iterdir()}


def test_a_rerun_with_the_same_data_is_the_same_look_and_new_data_the_next(tmp_path, monkeypatch):
    from evalgate.pipeline import gate

    base, cand = _pair(tmp_path, lost=6)
    monkeypatch.chdir(tmp_path)
    first = gate(_plan(tmp_path, cand, base))
    assert first.sequence["looks"][0]["look"] == 0 and first.decision.tasks["humaneval"].rule.alpha == 0.025
    assert first.decision.tasks["humaneval"].outcome.look == 0
    again = gate(_plan(tmp_path, cand, base))  # the same stored candidate: the same data
    assert again.sequence["looks"][0] == {**first.sequence["looks"][0], "repeated": True}
    assert again.verdict == first.verdict and again.decision.tasks["humaneval"].rule.alpha == 0.025
    _, other = _pair(tmp_path, lost=2, name="cand-rerun")  # the same kernel again, other data
    later = gate(_plan(tmp_path, other, base))
    assert later.sequence["looks"][0]["look"] == 1 and later.decision.tasks["humaneval"].rule.alpha == 0.0125
    assert later.decision.tasks["humaneval"].outcome.look == 1
    # recorded with the baseline, not under the working directory
    assert not (tmp_path / "results").exists()
    # GSM8K's data repeat (every item right on both sides): only HumanEval's new data took look 1
    assert list(_looks(base).values()) == [{"gsm8k.json": [0], "humaneval.json": [0, 1]}]
    assert any(n.startswith("look 2 of this candidate") for n in later.notes)


def test_no_reset_of_ordinary_use_starts_the_sequence_again(tmp_path, monkeypatch):
    """Another working directory, a policy copy with a comment added, a task subset, a renamed run folder:
    new data of the same candidate always take the next look."""
    import shutil

    base, cand = _pair(tmp_path, lost=6)
    seen = []
    for attempt in range(4):
        _, other = _pair(tmp_path, lost=attempt + 1, name=f"attempt-{attempt}")
        where = tmp_path / f"cwd-{attempt}"
        where.mkdir()
        monkeypatch.chdir(where)
        policy = where / "thresholds.yaml"
        policy.write_text(f"# attempt {attempt}\n" + POLICY.format(margin=20.0))
        if attempt == 2:  # only one task: its own ledger still counts
            m = json.loads((other / "manifest.json").read_text())
            del m["tasks"]["gsm8k"]
            (other / "manifest.json").write_text(json.dumps(m))
            (other / "gsm8k.jsonl").unlink()
        if attempt == 3:
            other = Path(shutil.move(other, tmp_path / "renamed"))
        verdict = _decide(base, other, policy, allow_uncalibrated=True)
        seen.append((verdict.sequence["looks"][0]["look"], verdict.decision.tasks["humaneval"].rule.alpha))
    assert seen == [(0, 0.025), (1, 0.0125), (2, 0.00625), (3, 0.003125)]


def test_a_rebuilt_kernel_is_another_candidate_and_a_subset_check_its_own_sequence(tmp_path):
    from evalgate.gate.sequence import candidate_identity
    from evalgate.records import RunManifest

    base, cand = _pair(tmp_path, lost=6)
    assert _decide(base, cand, _policy(tmp_path), allow_uncalibrated=True).sequence["looks"][0]["look"] == 0
    _, fixed = _pair(tmp_path, lost=1, name="fixed")
    m = json.loads((fixed / "manifest.json").read_text())
    old = candidate_identity(RunManifest.model_validate(m))
    m["kernel"]["recipe"] = {"accumulate": "fp32"}  # the same name, another build
    (fixed / "manifest.json").write_text(json.dumps(m))
    assert candidate_identity(RunManifest.model_validate(m)) != old
    assert _decide(base, fixed, _policy(tmp_path), allow_uncalibrated=True).sequence["looks"][0]["look"] == 0
    # the first 100 GSM8K items only: a subset check, its own sequence; the full gate's next look is still 1
    _, part = _pair(tmp_path, lost=3, name="part")
    _lose_gsm8k_item(part, 0)
    (part / "humaneval.jsonl").unlink()
    path = part / "gsm8k.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text(encoding="utf-8").split("\n")[:100]),
                    encoding="utf-8")
    m = json.loads((part / "manifest.json").read_text())
    del m["tasks"]["humaneval"]
    m["tasks"]["gsm8k"]["n_items"] = 100
    (part / "manifest.json").write_text(json.dumps(m))
    sub = _decide(base, part, _policy(tmp_path), allow_uncalibrated=True, items="candidate")
    assert sub.sequence["looks"][0]["look"] == 0 and sub.decision.tasks["gsm8k"].statistics.counts.n == 100
    _, again = _pair(tmp_path, lost=6, name="again")
    _lose_gsm8k_item(again, 0)  # new GSM8K data for the full gate
    assert _decide(base, again, _policy(tmp_path), allow_uncalibrated=True).sequence["looks"][0]["look"] == 1


def _lose_gsm8k_item(run: Path, i: int) -> None:
    path = run / "gsm8k.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]
    rows[i]["exact_match,strict-match"] = 0.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _decide(base: Path, cand: Path, policy: Path, **kwargs):
    """The gate's door as its edges call it: the baseline and candidate loaded, the policy resolved for the run."""
    from evalgate.gate.door import decide_pair
    from evalgate.gate.policy import policy_for_run
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run

    stored = load_baseline([base])
    run = load_run(cand)
    return decide_pair(stored, run, policy_for_run(policy, run), **kwargs)


def _policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(margin=20.0))
    return path


def _decide_in_child(base, cand, policy, start, queue):
    start.wait()
    queue.put(_decide(base, cand, policy, allow_uncalibrated=True).sequence["looks"][0]["look"])


def test_two_gates_at_once_take_two_looks(tmp_path):
    import multiprocessing

    base, _ = _pair(tmp_path, lost=6)
    cands = [_pair(tmp_path, lost=j + 1, name=f"c{j}")[1] for j in range(2)]
    ctx = multiprocessing.get_context("fork")
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_decide_in_child, args=(base, c, _policy(tmp_path), start, queue)) for c in cands]
    for p in procs:
        p.start()
    start.set()
    looks = sorted(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert looks == [0, 1]
    assert sorted(json.loads((next((base / "looks").iterdir()) / "humaneval.json").read_text())["looks"],
                  key=lambda x: x["look"])[1]["look"] == 1


def test_a_gate_past_its_last_look_is_refused(tmp_path):
    from evalgate.gate.sequence import Ledger, Looks

    looks = Looks("id", {"humaneval": Ledger(None, [{"look": j, "digest": str(j)} for j in range(MAX_LOOKS)])})
    with pytest.raises(UserError, match="a further look is refused"):
        looks.look_for({"humaneval": "new data"})
    assert looks.look_for({"humaneval": "3"}) == (3, True)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        Ledger.read(tmp_path / "bad.json")


def test_next_samples_uses_the_measured_within_item_variance():
    from evalgate.pipeline import next_samples

    measured = SimpleNamespace(resolution=SimpleNamespace(samples_needed=6, samples_needed_is_bound=False))
    # greedy: a lower bound, not used
    bound = SimpleNamespace(resolution=SimpleNamespace(samples_needed=40, samples_needed_is_bound=True))
    assert next_samples(1, [bound], 8) == 4
    assert next_samples(4, [], 16) == 8 and next_samples(4, [measured], 16) == 8
    assert next_samples(2, [measured], 16) == 6
    assert next_samples(8, [], 8) is None and next_samples(4, [], 6) == 6


def _sampled(run: Path, dest: Path, k: int, kernel: str, tasks) -> Path:
    """``run`` with k samples per item, every sample the item's greedy outcome (the same keys on both sides)."""
    dest.mkdir(parents=True)
    m = json.loads((run / "manifest.json").read_text())
    m["kernel"].update(name=kernel, id=f"{kernel}@synthetic 1.0")
    m["tasks"] = {t: s for t, s in m["tasks"].items() if t in tasks}
    for task in m["tasks"].values():
        task["decoding"] = {"do_sample": True, "n": k, "temperature": 0.7, "seed": 0}
    (dest / "manifest.json").write_text(json.dumps(m))
    for task in m["tasks"]:
        metric = "pass@1" if task == "humaneval" else "exact_match,strict-match"
        rows = [json.loads(line) for line in (run / f"{task}.jsonl").read_text(encoding="utf-8").split("\n") if line]
        with open(dest / f"{task}.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                r = {**r, "n_samples": k, "samples": [{metric: r[metric], "finish_reason": "stop",
                                                       "failure_class": r.get("failure_class"), "seed": s}
                                                      for s in range(k)]}
                f.write(json.dumps(r) + "\n")
    from evalgate.run.store import load_run

    return load_run(dest)


@pytest.mark.parametrize("max_samples", [8, 1])
def test_an_undecided_task_gets_rounds_until_decided(tmp_path, monkeypatch, max_samples):
    """HumanEval loses 6 of 40 items greedily (INCONCLUSIVE at M = 20 pp); the round at k = 4 — where the
    kernel moves no sample — PASSes it. The baseline is sampled in the same round; GSM8K is not rerun."""
    import evalgate.pipeline as pipeline
    from evalgate.plan import GatePlan
    from evalgate.run.baselines import load_baseline
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    base, cand = _pair(tmp_path, lost=6)
    calls = []

    def fake_run(spec, out, adapter=None, observer=None, tasks=None, expected_tokens=None, options=None):
        calls.append((spec.kernel, spec.samples, tuple(spec.tasks)))
        if spec.samples == 1:
            return load_run(cand)
        source = base if spec.kernel == "w4a8" else base  # the round's candidate moves no sample
        return _sampled(source, Path(out), spec.samples, spec.kernel, spec.tasks)

    monkeypatch.setattr(pipeline, "run_or_resume", fake_run)
    monkeypatch.setattr(pipeline, "load_tasks", lambda spec: {t: SimpleNamespace(profile_id=f"{t}-k{spec.samples}")
                                                              for t in spec.tasks})
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(margin=20.0))
    plan = GatePlan(policy=load_thresholds(policy), baseline=load_baseline([base]), report_dir=tmp_path / "rep",
                    allow_uncalibrated=True, spec=RunSpec(model="m", kernel="w4a4_packed", tasks=["gsm8k", "humaneval"]),
                    out=tmp_path / "out", early_stop=False, max_samples=max_samples)
    verdict = pipeline.gate(plan)
    looks = verdict.sequence["looks"]
    assert looks[0]["k"] == 1 and looks[0]["tasks"] == {"gsm8k": "PASS", "humaneval": "INCONCLUSIVE"}
    if max_samples == 1:
        assert verdict.verdict == "INCONCLUSIVE" and len(looks) == 1 and len(calls) == 1
        return
    assert verdict.verdict == "PASS" and verdict.exit_code == 0
    assert looks[1]["k"] == 4 and looks[1]["look"] == 1 and looks[1]["tasks"] == {"humaneval": "PASS"}
    assert calls[1:] == [("w4a8", 4, ("humaneval",)), ("w4a4_packed", 4, ("humaneval",))]
    he = verdict.decision.tasks["humaneval"]
    assert he.statistics.n_samples == 4 and he.rule.alpha == 0.0125 and verdict.decision.tasks["gsm8k"].statistics.n_samples == 1
    assert any("humaneval PASS at look 2 (k = 4)" in n for n in verdict.notes)


def test_a_look_is_its_data_on_both_sides(tmp_path):
    """A repeated candidate decided against another (round) baseline is new data: the digest covers both
    sides, so the record never keeps an answer the data no longer give (issue 45, finding 4)."""
    from evalgate.gate.compare import compare
    from evalgate.gate.sequence import candidate_identity, task_digest
    from evalgate.run.store import load_run

    base, cand = _pair(tmp_path, lost=6)
    other_base = write_run(tmp_path / "base2", "w4a8", [True] * 200, [i != 39 for i in range(40)],
                           ["failed:assertion"] * 40, 0)
    one = compare(load_run(base), load_run(cand)).pairs["humaneval"]
    two = compare(load_run(other_base), load_run(cand)).pairs["humaneval"]
    assert task_digest(one) == task_digest(compare(load_run(base), load_run(cand)).pairs["humaneval"])
    assert task_digest(one) != task_digest(two)
    # the identity is the candidate's content: its folder and run id do not enter it
    m = load_run(cand).meta
    assert candidate_identity(m.updated(run_id="elsewhere")) == candidate_identity(m)
    other = m.model.model_copy(update={"fingerprint": "other weights"})
    assert candidate_identity(m.updated(model=other)) != candidate_identity(m)


def test_the_canarys_look_records_go_under_the_baselines_root_given(tmp_path):
    """The packaged canary baselines are read-only: their look records live under the user's baselines root,
    the one --baselines-root names (not ./results/baselines, nor $EVALGATE_BASELINES)."""
    import os

    from evalgate.canary import BASELINES
    from evalgate.gate.sequence import looks_home

    base = next(Path(BASELINES).glob("*/gsm8k-*/w4a8"))
    root, cwd, elsewhere = tmp_path / "root", tmp_path / "cwd", tmp_path / "env-root"
    cwd.mkdir()
    root.mkdir()
    inside = base.relative_to(BASELINES)
    assert looks_home(base, root) == root / "looks" / "canary" / inside
    assert looks_home(tmp_path / "mine", root) == tmp_path / "mine" / "looks"  # a user's baseline: its own folder
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EVALGATE_")},
           "EVALGATE_BASELINES": str(elsewhere)}
    other = next(Path(BASELINES).glob("*/humaneval-*/w4a8"))  # the A/A run holds both tasks
    proc = cli_process.run(["gate", "--candidate", str(base / "aa"), "--baseline",
                           str(base), "--baseline", str(other), "--baselines-root", str(root), "--report-dir",
                           str(tmp_path / "report")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1, 3), proc.stdout + proc.stderr
    ledgers = list((root / "looks" / "canary" / inside).glob("*/gsm8k.json"))
    assert len(ledgers) == 1 and json.loads(ledgers[0].read_text())["looks"][0]["look"] == 0
    assert not (cwd / "results").exists() and not elsewhere.exists()
    assert not (base / "looks").exists() and not (other / "looks").exists()  # the packaged folders: never written
