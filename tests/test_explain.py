"""Explaining a flip (evalgate/explain.py, model_adapters/hf/replay.py): the first divergent token, both kernels'
top-2 margins there, the KL along the shared prefix, the MoE layer and expert, near-tie or divergence.

The replay is checked against an independent computation: each kernel's greedy tokens from the decoding
loop itself, and the margins from a fresh forward pass over the shared prefix alone. On the canary, a
fault-injected kernel's flips are divergences and the healthy packed W4A4 kernel's near-ties."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from evalgate.run.progress import Progress
import cli_process

KERNELS = ("w4a8", "w4a4_packed")


def _run(model, kernel: str, out, tasks=("gsm8k",), limit: int = 6, max_new_tokens: int | None = 12):
    from evalgate.pipeline import in_process_adapter
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec

    spec = RunSpec(model=str(model), kernel=kernel, tasks=list(tasks), limit=limit, batch_size=8,
                   max_new_tokens=max_new_tokens)
    return execute(spec, out, in_process_adapter(spec), progress=Progress(enabled=False, stream=io.StringIO()))


@pytest.fixture(scope="module")
def tiny_runs(tiny_model, tmp_path_factory) -> dict:
    """Two runs of the tiny random model, W4A8 and packed W4A4, on 6 GSM8K items of 12 tokens: their folders,
    read (never written) by the fixtures below."""
    root = tmp_path_factory.mktemp("explain")
    return {k: _run(tiny_model, k, root / k.replace("/", "-")) for k in KERNELS}


@pytest.fixture(scope="module")
def tiny_pair(tiny_runs):
    import evalgate

    return evalgate.compare(*(tiny_runs[k] for k in KERNELS))


def _greedy_tokens(model, tokenizer, request) -> list[int]:
    from evalgate.model_adapters.hf.generation import decode

    return decode(model, tokenizer, [request.prompt], [request.stop], [request.max_new_tokens])[0].token_ids


@torch.inference_mode()
def _last_logprobs(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), logits_to_keep=1)
    return torch.log_softmax(out.logits[0, -1].float(), -1)


@pytest.mark.slow
def test_the_first_divergence_and_its_margins_are_what_decoding_and_a_fresh_forward_give(tiny_model, tiny_pair):
    from evalgate.kernels.checkpoint import experts_modules
    from evalgate.model_adapters.hf.adapter import load_model

    cmp = tiny_pair
    p = cmp.pairs["gsm8k"]
    models = {k: load_model(tiny_model, k) for k in KERNELS}
    tokenizer = models["w4a8"][1]
    explainer = cmp.explainer()
    explained = 0
    for doc_id, b, c in zip(p.doc_ids, p.base, p.cand):
        x = cmp.explain("gsm8k", doc_id)
        if b["resps"] == c["resps"]:
            assert x.kind == "same tokens"
            continue
        request = explainer._request("gsm8k", doc_id)
        tokens = {k: _greedy_tokens(models[k][0], tokenizer, request) for k in KERNELS}
        d = next(i for i, (u, v) in enumerate(zip(*tokens.values())) if u != v)
        assert x.position == d
        assert x.reproduced is True
        prompt = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
        for kernel, choice in ((KERNELS[0], x.base), (KERNELS[1], x.cand)):
            lp = _last_logprobs(models[kernel][0], prompt + tokens[kernel][:d]).tolist()
            ids = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:2]  # ties: the lowest id first, as greedy
            assert choice.kernel == kernel
            assert [t.token for t in choice.top] == ids
            assert choice.top[0].token == tokens[kernel][d]  # each kernel's top-1 is what its run generated
            assert [t.logprob for t in choice.top] == [lp[t] for t in ids]  # bit for bit
            assert choice.margin == lp[ids[0]] - lp[ids[1]]
        assert x.kind == ("near-tie" if max(x.base.margin, x.cand.margin) < x.threshold else "divergence")
        assert x.kl_mean is not None and 0.0 <= x.kl_mean <= x.kl_max
        # one row per MoE layer; the expert named is one the baseline's router selected there
        assert [layer.layer for layer in x.layers] == sorted(experts_modules(models["w4a8"][0]))
        assert (x.layer, x.expert) in {(layer.layer, layer.expert) for layer in x.layers}
        assert all(layer.local_rel_diff > 0 for layer in x.layers)  # the two kernels differ on the same input
        explained += 1
    assert explained, "the two kernels generated the same text for every item: nothing was explained"


@pytest.mark.slow
def test_an_explanation_is_the_same_bit_for_bit_on_a_fresh_replay(tiny_pair):
    import evalgate

    cmp = tiny_pair
    again = evalgate.compare(cmp.baseline, cmp.candidate)
    for doc_id in cmp.pairs["gsm8k"].doc_ids:
        assert again.explain("gsm8k", doc_id).to_dict() == cmp.explain("gsm8k", doc_id).to_dict()


@pytest.mark.slow
def test_flips_explain_column_and_a_server_run_says_what_it_cannot(tiny_pair):
    import dataclasses

    from evalgate.explain import NOT_REPLAYED, Explainer, summary_line
    from evalgate.records import ModelInfo

    cmp = tiny_pair
    df = cmp.flips("gsm8k", explain=True)
    assert {"explanation", "margin", "divergence_at", "layer", "expert"} <= set(df.columns)
    # a candidate served through a server, with no checkpoint given: the texts only, and why
    from evalgate.run.store import Run

    served = Run(cmp.candidate.path, cmp.candidate.meta.updated(model=ModelInfo(adapter="openai", fingerprint="x")),
                 cmp.candidate.records)
    pairing = dataclasses.replace(cmp, candidate=served, _explainer=None)
    p = cmp.pairs["gsm8k"]
    differing = [d for d, b, c in zip(p.doc_ids, p.base, p.cand) if b["resps"] != c["resps"]]
    assert differing
    x = Explainer(pairing).explain("gsm8k", differing[0])
    assert x.kind == NOT_REPLAYED and "log-probabilities" in x.cannot and x.base_token is not None
    assert summary_line([x]) == ("0 of 1 flips are near-ties: margin < 0.5 nats at the first divergent token "
                                 f"(1 not replayed: {x.cannot})")
    assert x.cannot.startswith("no in-process model")


def test_the_summary_line_counts_near_ties():
    from evalgate.explain import DIVERGENCE, NEAR_TIE, Explanation, summary_line

    xs = [Explanation("gsm8k", i, "lost", kind, "w4a8", "w4a4") for i, kind in
          enumerate([NEAR_TIE] * 11 + [DIVERGENCE] * 2)]
    assert summary_line(xs) == "11 of 13 flips are near-ties: margin < 0.5 nats at the first divergent token"


# --- the canary: a faulty kernel's flips are divergences, a healthy kernel's near-ties ---------------------


@pytest.fixture(scope="module")
def canary_runs(tmp_path_factory):
    """HumanEval on the canary: the healthy packed W4A4 kernel on 40 items, the drop-slot fault on 12."""
    from evalgate.canary import canary_path

    root = tmp_path_factory.mktemp("canary-explain")
    profiles = {"humaneval": "humaneval-canary-v1"}
    out = {}
    for kernel, limit in (("w4a4_packed", 40), ("faulty/w4a4_packed-drop-slot", 12)):
        from evalgate.pipeline import in_process_adapter
        from evalgate.run.runner import execute
        from evalgate.run.spec import RunSpec

        spec = RunSpec(model=str(canary_path()), kernel=kernel, tasks=["humaneval"], profiles=profiles, limit=limit,
                       batch_size=16)
        out[kernel] = execute(spec, root / kernel.replace("/", "-"), in_process_adapter(spec),
                              progress=Progress(enabled=False, stream=io.StringIO()))
    return out


@pytest.mark.slow
def test_a_faulty_kernels_flips_are_divergences_a_healthy_kernels_near_ties(canary_runs, capsys):
    import evalgate
    import evalgate.canary

    counts = {}
    for kernel, path in canary_runs.items():
        cmp = evalgate.compare(evalgate.canary.BASELINES, path, items="candidate")
        found = cmp.explain_flips("humaneval")
        assert found, f"{kernel} flipped nothing on these items"
        kinds = [x.kind for x in found]
        counts[kernel] = (kinds.count("near-tie"), kinds.count("divergence"), len(kinds))
        for x in found:
            assert x.reproduced is True and x.position is not None and x.layer is not None
            if kernel == "faulty/w4a4_packed-drop-slot":  # its combine skips the last slot: that expert is named
                assert all(layer.expert == layer.selected[-1] for layer in x.layers), x.layers
    ties, divergences, n = counts["faulty/w4a4_packed-drop-slot"]
    assert divergences == n, counts
    ties, divergences, n = counts["w4a4_packed"]
    assert ties > n / 2, counts
    with capsys.disabled():
        print(f"\nnear-ties / divergences / flips: {counts}")


@pytest.mark.slow
def test_the_explain_command_on_a_run_folder(canary_runs, tmp_path, cli_env):
    path = canary_runs["faulty/w4a4_packed-drop-slot"]
    out = tmp_path / "x.json"
    done = cli_process.run(["explain", str(path), "--json", str(out)],
                          capture_output=True, text=True, env=cli_env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "0 of " in done.stdout and "flips are near-ties" in done.stdout
    written = json.loads(out.read_text())
    assert written and all(x["kind"] == "divergence" for x in written)
    one = cli_process.run(["explain", str(path), written[0]["doc_id"]],
                         capture_output=True, text=True, env=cli_env, timeout=600)
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith(f"humaneval {written[0]['doc_id']} (lost): divergence at token ")
    assert "local_rel_diff" in one.stdout and "logprob" in one.stdout  # the per-layer and top-2 tables
    bad = cli_process.run(["explain", str(path), "HumanEval/999"],
                         capture_output=True, text=True, env=cli_env, timeout=600)
    assert bad.returncode == 2 and bad.stderr.startswith("evalgate: error:") and "Traceback" not in bad.stderr


def test_the_report_tags_each_explained_flip_and_shows_the_summary_line(tmp_path):
    """report.html with explanations (what `evalgate explain --report` writes): the tagged flips carry their
    kind, with the explanation's line as the tag's title, and the summary line heads the flips."""
    import re

    from evalgate.explain import DIVERGENCE, NEAR_TIE, Explanation, summary_line
    from evalgate.gate.decide import gate_runs
    from evalgate.run.baselines import load_baseline
    from evalgate.run.store import load_run
    from evalgate.gate.policy import load_thresholds
    from evalgate.report.html import report_html
    from gate_helpers import policy
    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path, 40, 10, lost_every=3, gained_every=4)
    verdict = gate_runs(load_baseline(base), load_run(cand), load_thresholds(policy(tmp_path, margin=5.0)), allow_uncalibrated=True)
    flips = verdict.comparison.flips("gsm8k")
    picked = list(flips["doc_id"][:2])
    found = [Explanation("gsm8k", d, "lost", kind, "w4a8", "w4a4_packed", position=3)
             for d, kind in zip(picked, (NEAR_TIE, DIVERGENCE))]
    tags = {(x.task, str(x.doc_id)): {"kind": x.kind, "line": x.line()} for x in found}
    page = report_html(verdict, tags, summary_line(found))
    assert "1 of 2 flips is a near-tie: margin &lt; 0.5 nats" in page
    tagged = re.findall(r'<span class="explained" title="([^"]*)">([^<]*)</span>', page)
    assert [kind for _, kind in tagged] == [NEAR_TIE, DIVERGENCE]
    assert all(f"gsm8k {d}" in title for (title, _), d in zip(tagged, picked))
    assert 'class="explained"' not in report_html(verdict)  # untagged without explanations


# --- the gate's own outputs: `evalgate gate --explain` ------------------------------------------------------


@pytest.fixture(scope="module")
def gate_pair(tiny_runs, tmp_path_factory):
    """Stored runs of the tiny model (W4A8 and packed W4A4, 6 GSM8K items of 12 tokens) rescored so that every
    item whose two texts differ is lost: flips the gate decides on, whose generations really part (the
    replay explains the texts; the scores only make them flips)."""
    from gate_helpers import derive_run, policy

    root = tmp_path_factory.mktemp("gate-explain")
    from evalgate.run.store import load_run

    runs = {k: load_run(tiny_runs[k]) for k in KERNELS}
    texts = {k: {r["doc_id"]: r["resps"] for r in runs[k].records["gsm8k"]} for k in KERNELS}
    differ = [texts["w4a8"][d] != texts["w4a4_packed"][d] for d in sorted(texts["w4a8"])]
    assert any(differ), "the two kernels generated the same text for every item: nothing to explain"
    base = derive_run(runs["w4a8"].path, root / "base", differ)
    cand = derive_run(runs["w4a4_packed"].path, root / "cand", [False] * len(differ))
    return base, cand, policy(root), sum(differ)


def _gate(pair, report_dir, *flags):
    from click.testing import CliRunner

    from evalgate.cli.main import main

    base, cand, thresholds, _ = pair
    result = CliRunner().invoke(main, ["gate", "--candidate", str(cand), "--baseline", str(base), "--thresholds",
                                       str(thresholds), "--allow-uncalibrated", "--report-dir", str(report_dir),
                                       *flags])
    assert result.exit_code in (0, 1, 3), result.output
    return result.output, json.loads((report_dir / "gate.json").read_text())


@pytest.fixture(scope="module")
def explained_gate(gate_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("explained") / "gate"
    stdout, record = _gate(gate_pair, out, "--explain")
    return out, stdout, record


@pytest.mark.slow
def test_the_gate_with_explain_says_why_in_every_output(gate_pair, explained_gate):
    import html
    import re

    out, stdout, record = explained_gate
    stored = record["explanations"]
    flips = [(t, str(f["doc_id"])) for t, rows in record["flips"].items() for f in rows]
    assert len(flips) == gate_pair[3]
    # gate.json: one explanation per flip, in the flips' order, each replayed to its first divergent token
    assert [(x["task"], str(x["doc_id"])) for x in stored["items"]] == flips
    for x in stored["items"]:
        assert x["kind"] in ("near-tie", "divergence") and x["reproduced"] is True
        assert x["position"] is not None and x["layer"] is not None and x["expert"] is not None
        assert x["margin"] == max(x["base"]["margin"], x["cand"]["margin"])
    ties = sum(x["kind"] == "near-tie" for x in stored["items"])
    summary = stored["summary"]
    assert re.fullmatch(rf"{ties} of {len(flips)} flips (is a near-tie|are near-ties): margin < 0\.5 nats at the "
                        r"first divergent token", summary), summary
    # the printed verdict: the summary line, with the replay's time
    assert re.search(rf"^why they flipped: {re.escape(summary)} — {len(flips)} flip\(s\) replayed in ", stdout,
                     re.MULTILINE), stdout
    # report.md: the line, and each flip's kind, token and margin in its row
    md = (out / "report.md").read_text()
    assert f"- why they flipped: {summary}\n" in md
    for x in stored["items"]:
        assert re.search(rf"^\| {re.escape(str(x['doc_id']))} \| lost \|.* \| {x['kind']} at token {x['position']}, "
                         rf"margin {x['margin']:.3f} nats, layer {x['layer']} expert {x['expert']} \|$", md,
                         re.MULTILINE), md
    # report.html: every flip tagged with its kind, its margin sortable, the sorting controls and script there
    page = (out / "report.html").read_text()
    assert f"why they flipped: {html.escape(summary)}" in page
    rows = re.findall(r'<details class="flip" [^>]*data-id="([^"]*)"[^>]*data-kind="([^"]*)" data-margin="([^"]*)"',
                      page)
    assert sorted(rows) == sorted((str(x["doc_id"]), x["kind"], repr(x["margin"])) for x in stored["items"])
    assert len(re.findall(r'<span class="explained" title="[^"]+">(near-tie|divergence)</span>', page)) == len(flips)
    for key in ("task", "kind", "margin"):
        assert f'<button type="button" class="sort" data-sort="{key}">' in page
    assert "function sortBy(key)" in page


@pytest.mark.slow
def test_the_gates_explanations_are_the_same_bit_for_bit_and_reread_without_a_replay(gate_pair, explained_gate,
                                                                                    tmp_path, monkeypatch):
    from evalgate.explain import Explainer

    out, _, record = explained_gate
    _, again = _gate(gate_pair, tmp_path / "again", "--explain")  # a second replay, from scratch
    assert json.dumps(again["explanations"]) == json.dumps(record["explanations"])

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed without --explain")

    monkeypatch.setattr(Explainer, "explain", no_replay)
    monkeypatch.setattr(Explainer, "load", no_replay)
    # without --explain nothing is replayed: a fresh report folder gets the line saying how to explain them
    stdout, plain = _gate(gate_pair, tmp_path / "plain")
    assert "explanations" not in plain
    n = len(record["explanations"]["items"])
    assert f"why they flipped: `evalgate explain {tmp_path / 'plain'}` replays the {n} flip(s)" in stdout
    assert 'class="explained"' not in (tmp_path / "plain" / "report.html").read_text()
    assert "why they flipped" not in (tmp_path / "plain" / "report.md").read_text()
    # the reports rewritten where the explained gate.json is: its explanations shown again, not replayed
    stdout, rewritten = _gate(gate_pair, out)
    assert rewritten["explanations"] == record["explanations"]
    assert f"why they flipped: {record['explanations']['summary']}\n" in stdout
    assert 'class="explained"' in (out / "report.html").read_text()
    # `evalgate report` on the pair tags the flips the candidate's own gate folder explained, without a replay
    import shutil

    from click.testing import CliRunner

    from evalgate.cli.main import main

    base, cand, thresholds, _ = gate_pair
    (cand / "gate").mkdir()
    try:
        shutil.copy(out / "gate.json", cand / "gate" / "gate.json")
        result = CliRunner().invoke(main, ["report", "--baseline", str(base), "--candidate", str(cand), "--thresholds",
                                           str(thresholds), "--allow-uncalibrated", "--html", str(tmp_path / "r.html")])
        assert result.exit_code in (0, 1, 3), result.output
        page = (tmp_path / "r.html").read_text()
        assert len(re.findall(r'<span class="explained"', page)) == n
    finally:
        shutil.rmtree(cand / "gate")


@pytest.mark.slow
def test_a_gate_on_a_server_run_says_in_the_summary_line_what_it_cannot_explain(gate_pair, tmp_path):
    import shutil

    base, cand, thresholds, n = gate_pair
    served = {}
    for side, path in (("base", base), ("cand", cand)):  # both through a server: comparable, no checkpoint
        served[side] = tmp_path / side
        shutil.copytree(path, served[side])
        manifest = json.loads((served[side] / "manifest.json").read_text())
        manifest["model"] = {**manifest["model"], "adapter": "openai"}
        (served[side] / "manifest.json").write_text(json.dumps(manifest))
    stdout, record = _gate((served["base"], served["cand"], thresholds, n), tmp_path / "gate", "--explain")
    stored = record["explanations"]
    assert [x["kind"] for x in stored["items"]] == ["not replayed"] * n
    assert stored["summary"].startswith(f"0 of {n} flips are near-ties: margin < 0.5 nats at the first divergent "
                                        f"token ({n} not replayed: no in-process model: the run went through a server")
    assert f"why they flipped: {stored['summary']}\n" in stdout
