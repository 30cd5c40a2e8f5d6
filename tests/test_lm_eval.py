"""lm-evaluation-harness as a peer: lm-eval's own ``local-completions`` model runs lm-eval's own ``gsm8k``
task (a local copy of its YAML, only the dataset location changed: the GSM8K jsonl packaged with evalgate)
against ``evalgate serve``; prompts (byte for byte), generations and both extractions (strict-match,
flexible-extract) equal ``evalgate run``'s on the same items. lm-eval's filters and exact_match also score
a set of crafted responses exactly as evalgate does.

Needs lm-eval (``pip install -e ".[test]"``, pinned there); skipped with the reason when it is missing.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import running_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e '.[test]' (lm-eval==0.4.13)")

from evalgate.model_adapters.server.launcher import free_port  # noqa: E402
from evalgate.types import sha256_text  # noqa: E402

KERNEL = "w4a8"
LIMIT, MAX_NEW = 4, 16
TASK = "gsm8k_evalgate"


def lm_eval_gsm8k_yaml(data_dir: Path) -> str:
    """lm-eval's installed gsm8k.yaml with only the dataset location (and, to keep it apart from the
    built-in task, the task name) changed."""
    source = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    text = source.read_text()
    assert "dataset_path: openai/gsm8k\ndataset_name: main\n" in text and "\ntask: gsm8k\n" in text
    gsm8k = data_dir / "gsm8k"
    local = (f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n"
             f"    train: {gsm8k / 'train.jsonl'}\n    test: {gsm8k / 'test.jsonl'}\n")
    return text.replace("dataset_path: openai/gsm8k\ndataset_name: main\n", local).replace(
        "\ntask: gsm8k\n", f"\ntask: {TASK}\n")


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    argv = [sys.executable, "-m", "evalgate", "serve", "--model", str(tiny_model), "--kernel", KERNEL, "--port",
            str(port), "--batch-size", "4"]
    with running_server(argv, port, log, {**os.environ, "HF_HUB_OFFLINE": "1"}, "evalgate serve") as url:
        yield url


@pytest.mark.slow
def test_lm_eval_against_evalgate_serve_equals_evalgate_run(served, tiny_model, data_dir, tmp_path):
    from evalgate.pipeline import in_process_adapter
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run
    from evalgate.tasks import get_task, resolve_profile

    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / f"{TASK}.yaml").write_text(lm_eval_gsm8k_yaml(data_dir))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds"),
           "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model=model,base_url={served}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tiny_model},tokenized_requests=False,max_gen_toks={MAX_NEW},num_concurrent=1")
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                           "--tasks", TASK, "--include_path", str(tasks_dir), "--limit", str(LIMIT), "--log_samples",
                           "--output_path", str(tmp_path / "lm_eval")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [samples_file] = glob.glob(str(tmp_path / "lm_eval" / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    samples = {s["doc_id"]: s for s in map(json.loads, Path(samples_file).read_text().splitlines())}
    assert sorted(samples) == list(range(LIMIT))

    spec = RunSpec(model=str(tiny_model), kernel=KERNEL, tasks=["gsm8k"], limit=LIMIT, batch_size=2,
                   data_dir=str(data_dir), max_new_tokens=MAX_NEW)
    ours = load_run(execute(spec, tmp_path / "evalgate", in_process_adapter(spec),
                            progress=Progress(enabled=False, stream=open(os.devnull, "w"))))
    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, None), data_dir, LIMIT)
    prompts = {r.doc_id: r.prompt for r in task.requests(items, resolved)}
    for record in ours.records["gsm8k"]:
        s = samples[record["doc_id"]]
        prompt = s["arguments"]["gen_args_0"]["arg_0"]
        assert prompt.encode() == prompts[record["doc_id"]].encode()  # byte-identical prompts
        assert sha256_text(prompt) == record["prompt_hash"]
        [[text]] = s["resps"]
        assert text == record["resps"]
        # lm-eval logs one sample per filter or both filters on one sample, by version: accept either
        filtered = s["filtered_resps"] if isinstance(s["filtered_resps"], dict) else None
        if filtered is None:
            per_filter = {x["filter"]: x for x in map(json.loads, Path(samples_file).read_text().splitlines())
                          if x["doc_id"] == record["doc_id"]}
            filtered = {f: x["filtered_resps"][0] for f, x in per_filter.items()}
            matches = {f: x["exact_match"] for f, x in per_filter.items()}
        else:
            matches = {f: s["exact_match"] for f in filtered}
        assert filtered == record["filtered_resps"]
        assert {f: float(v) for f, v in matches.items()} == record["exact_match"]


CRAFTED = [
    " She has 3 + 4 = 7 apples.\n#### 7", " #### 1,234.50", " The answer is $18.\n#### $18", " #### -5",
    " no number at all", " 12 then 13. So 14", " #### 3.\n#### 4", " 2,000 dollars; total $3,000.",
    " -0.5 and then 1e5", " #### 42\n\nQuestion: what", "", " 7.",
]


def test_lm_eval_filters_and_exact_match_agree_with_evalgate_on_crafted_texts(data_dir):
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters import build_filter_ensemble
    import yaml

    from evalgate.tasks.gsm8k import _regex_filter, gold_answer, normalize, PROFILES

    config = yaml.safe_load(lm_eval_gsm8k_yaml(data_dir))
    metric = config["metric_list"][0]
    settings = PROFILES["gsm8k-lmeval-v3"].settings
    golds = ["#### 7", "#### 1234.50", "#### 18", "#### -5", "#### 0", "#### 14", "#### 3", "#### 3000", "#### 5",
             "#### 42", "#### 1", "#### 7"]
    for entry, mode in zip(config["filter_list"], ("strict", "flexible")):
        ensemble = build_filter_ensemble(entry["name"], [[f["function"], {k: v for k, v in f.items() if k != "function"}]
                                                         for f in entry["filter"]])
        resps = [[t] for t in CRAFTED]
        for step in ensemble.filters:  # regex, then take_first: lm-eval's pipeline, step by step
            resps = step().apply(resps, [{}] * len(CRAFTED))
        theirs = [r[0] if isinstance(r, list) else r for r in resps]
        ours = [_regex_filter(t, settings[mode]["regex"], settings[mode]["group_select"]) for t in CRAFTED]
        assert ours == theirs, entry["name"]
        for pred, gold in zip(ours, golds):
            lm = exact_match_hf_evaluate([pred], [gold], regexes_to_ignore=metric["regexes_to_ignore"],
                                         ignore_case=metric["ignore_case"],
                                         ignore_punctuation=metric["ignore_punctuation"])["exact_match"]
            assert float(lm) == float(normalize(pred) == gold_answer(gold)), (pred, gold)
