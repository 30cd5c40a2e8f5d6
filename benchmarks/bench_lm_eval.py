"""evalgate's in-process GSM8K run against lm-evaluation-harness's HF backend: the same canary model (loaded
the same way), the same items and prompts, the same batch size and token limit, timed side by side in one
run; prints the seconds and the ratio (goal: evalgate at least 2x faster).

    python benchmarks/bench_lm_eval.py [--items 40] [--batch-size 16] [--kernel w4a4_packed] [--venv DIR]

lm-eval runs in its own virtual environment, made by this script (``python -m venv``; lm-eval==0.4.13, torch's
CPU build of this environment's version, and evalgate built from this checkout), kept in --venv for the next
run. Where it cannot be made (no venv module, no package index), the script says so in one line and stops
(exit 0: skipped, not failed).

The canary is a DeepSeek-V4 with FP4 experts served by an evalgate kernel: ``--model hf pretrained=PATH``
would load it without the kernel, the FP4 codes or evalgate's canonical numerics. So lm-eval's side is a
small wrapper (this file, run with the venv's python and ``--lm-eval-side``) that loads the model with
evalgate's own loader (``model_adapters.hf.adapter.load_model``: registers the kernel, re-attaches the FP4 codes) and
hands the instance to lm-eval's ``HFLM``, then calls ``lm_eval.simple_evaluate``. lm-eval reads the exact
prompts evalgate sends (a one-task YAML over a JSONL of them, generate_until with the profile's stops and
token limit). Each side times a whole run (reading the items, generating, scoring) after the model is loaded,
the fastest of --repeat; the script prints how many prompts and outputs agree (they must: same model, same
numerics, greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LM_EVAL = "lm-eval==0.4.13"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TASK = "evalgate_canary_gsm8k"
SOURCES = ("pyproject.toml", "README.md", "evalgate", "kernels", "model_adapters")


# ---- the items, as evalgate asks them ---------------------------------------------------------------------

def canary_requests(n_items: int):
    from evalgate.canary import PROFILES
    from evalgate.tasks import get_task, resolve_profile
    from evalgate.tasks.data import resolve_data_dir

    task = get_task("gsm8k")
    items, resolved = task.load(resolve_profile(task, PROFILES["gsm8k"]), resolve_data_dir(None), n_items)
    return task.requests(items, resolved)


def task_yaml(items_file: Path, stops: list[str], max_new_tokens: int) -> str:
    """An lm-eval task whose documents are evalgate's prompts, generated as the canary profile generates."""
    return json.dumps({  # YAML is a superset of JSON
        "task": TASK, "dataset_path": "json", "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(items_file)}}, "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "doc_id", "target_delimiter": "",
        "generation_kwargs": {"until": stops, "do_sample": False, "max_gen_toks": max_new_tokens},
        "metric_list": [{"metric": "exact_match"}],
    }, indent=1)


# ---- lm-eval's side: runs inside the venv ----------------------------------------------------------------

def lm_eval_side(args) -> None:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from evalgate.canary import canary_path
    from evalgate.model_adapters.hf.adapter import load_model

    model, tokenizer = load_model(canary_path(), args.kernel)  # the kernel, the FP4 codes, canonical numerics
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, device="cpu")
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=TaskManager(include_path=args.tasks_dir),
                                          log_samples=True, bootstrap_iters=0)
        times.append(time.perf_counter() - t0)
    seconds = min(times)
    texts = {str(s["doc"]["doc_id"]): s["resps"][0][0] for s in results["samples"][TASK]}
    prompts = {str(s["doc"]["doc_id"]): s["arguments"][0][0] for s in results["samples"][TASK]}  # (context, kwargs)
    Path(args.result).write_text(json.dumps({"seconds": seconds, "texts": texts, "prompts": prompts,
                                             "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else ""}))


# ---- its environment ---------------------------------------------------------------------------------------

class Skip(Exception):
    """lm-eval's environment cannot be made here."""


def _pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise Skip(f"pip install {' '.join(a for a in args if not a.startswith('-'))[:120]} failed: {last}")


def evalgate_wheel(tmp: Path) -> Path:
    """evalgate as it is in this checkout, built from a copy (the checkout gets no build/ folder)."""
    src = tmp / "src"
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp / "wheel"), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Skip(f"cannot build evalgate's wheel: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    (wheel,) = (tmp / "wheel").glob("evalgate-*.whl")
    return wheel


def lm_eval_python(venv: Path, tmp: Path) -> Path:
    """The venv's python with lm-eval, torch (CPU) and this checkout's evalgate; made on first use."""
    import torch

    python = venv / "bin" / "python"
    ready = venv / "evalgate-bench-ready"
    torch_version = torch.__version__.split("+")[0]
    wanted = f"{LM_EVAL} torch=={torch_version}"
    wheel = evalgate_wheel(tmp)
    if not (ready.is_file() and ready.read_text() == wanted and python.exists()):
        shutil.rmtree(venv, ignore_errors=True)
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if made.returncode != 0:
            raise Skip(f"python -m venv failed: {(made.stderr.strip().splitlines() or ['?'])[-1]}")
        print(f"making lm-eval's environment in {venv} (once)", file=sys.stderr, flush=True)
        # torch first, alone, from PyTorch's CPU index too (PyPI's Linux torch is the CUDA build)
        _pip(python, "--retries", "1", "--extra-index-url", TORCH_INDEX, f"torch=={torch_version}")
        _pip(python, LM_EVAL, str(wheel))
        ready.write_text(wanted)
    _pip(python, "--no-deps", "--force-reinstall", str(wheel))  # this checkout's evalgate, every run
    return python


# ---- both sides -------------------------------------------------------------------------------------------

def evalgate_side(kernel: str, batch_size: int, n_items: int, out: Path, repeat: int) -> tuple[float, dict]:
    """A whole in-process run (data, generation, scoring, records written), the model loaded beforehand as
    lm-eval's is: the best of ``repeat`` runs, and the texts."""
    from evalgate.canary import PROFILES, canary_path
    from evalgate.model_adapters.hf.adapter import HFAdapter
    from evalgate.run.progress import Progress
    from evalgate.run.runner import execute
    from evalgate.run.spec import RunSpec
    from evalgate.run.store import load_run

    adapter = HFAdapter(canary_path(), kernel, batch_size=batch_size)
    spec = RunSpec(model=str(canary_path()), kernel=kernel, tasks=["gsm8k"], profiles={"gsm8k": PROFILES["gsm8k"]},
                   limit=n_items, batch_size=batch_size)
    times = []
    with open(os.devnull, "w") as quiet:
        for i in range(repeat):
            t0 = time.perf_counter()
            run = execute(spec, out / f"evalgate-{i}", adapter=adapter, progress=Progress(enabled=False, stream=quiet))
            times.append(time.perf_counter() - t0)
    return min(times), {r["doc_id"]: r["resps"] for r in load_run(run).records["gsm8k"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16, help="both sides (lm-eval decodes static batches)")
    parser.add_argument("--kernel", default="w4a4_packed")
    parser.add_argument("--repeat", type=int, default=1, help="runs per side, the fastest counts (a shared machine)")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "evalgate" / "bench-lm-eval-venv")
    parser.add_argument("--lm-eval-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tasks-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lm_eval_side:
        return lm_eval_side(args)

    with tempfile.TemporaryDirectory(prefix="bench-lm-eval-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            python = lm_eval_python(args.venv, tmp)
        except Skip as exc:
            print(f"bench_lm_eval: skipped: lm-eval's own environment cannot be made here ({exc})")
            return
        requests = canary_requests(args.items)
        stops, max_new = list(requests[0].stop), requests[0].max_new_tokens
        items_file = tmp / "items.jsonl"
        items_file.write_text("".join(json.dumps({"doc_id": r.doc_id, "prompt": r.prompt}) + "\n" for r in requests))
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / f"{TASK}.yaml").write_text(task_yaml(items_file, stops, max_new))

        print(f"{len(requests)} canary GSM8K items, batch {args.batch_size}, up to {max_new} new tokens, "
              f"kernel {args.kernel}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        ours_s, ours = evalgate_side(args.kernel, args.batch_size, args.items, tmp, args.repeat)
        print(f"evalgate in-process: {ours_s:7.2f} s", flush=True)

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "HF_DATASETS_CACHE": str(tmp / "datasets"), "PYTHONPATH": ""}
        result = tmp / "lm_eval.json"
        proc = subprocess.run([str(python), __file__, "--lm-eval-side", "--kernel", args.kernel, "--batch-size",
                               str(args.batch_size), "--repeat", str(args.repeat), "--tasks-dir", str(tmp / "tasks"), "--result", str(result)],
                              env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench_lm_eval: lm-eval's run failed:\n{proc.stderr[-3000:]}")
        theirs = json.loads(result.read_text())
    print(f"lm-eval HF backend:  {theirs['seconds']:7.2f} s  (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})",
          flush=True)
    same_prompts = sum(theirs["prompts"].get(str(r.doc_id)) == r.prompt for r in requests)
    same_texts = sum(theirs["texts"].get(str(r.doc_id)) == ours[r.doc_id] for r in requests)
    print(f"ratio lm-eval / evalgate: {theirs['seconds'] / ours_s:.2f}x (goal >= 2x); same prompts {same_prompts}/"
          f"{len(requests)}, same outputs {same_texts}/{len(requests)}")


if __name__ == "__main__":
    main()
