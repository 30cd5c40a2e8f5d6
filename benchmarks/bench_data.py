"""What loading the items through ``datasets`` costs the default gate, against reading the JSONL by hand.

    python benchmarks/bench_data.py [--repeats 5] [--gates 0]

The reference is the loader evalgate had before ``datasets`` (each published file sha256-checked, then
``json.loads`` per line), swapped in for ``TaskData``'s published-file reader in the same tree, so only the
loader differs. Every measurement runs in a fresh interpreter, reference and ``datasets`` alternating, so
background load hits both alike; ratios are medians of ``datasets`` over medians of the reference.

1. start-up: the interpreter, the canary gate's ``load_tasks`` (GSM8K's train split and HumanEval), then the
   imports the gate makes next anyway (torch, transformers), which share much of what ``datasets`` imports;
   printed with ``import datasets`` alone and the Arrow cache it builds (a temporary folder, removed at exit);
2. ``--gates N``: N pairs of whole ``evalgate gate`` runs (the default canary gate, in an empty folder; the
   HumanEval self-test's child interpreter gets the same loader as its parent).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Installed as sitecustomize.py in a folder put first on PYTHONPATH: every interpreter of a reference run,
# the self-test's child included, reads the published files as evalgate did before datasets.
REFERENCE = '''
import os
if os.environ.get("BENCH_DATA_REFERENCE") == "1":
    from evalgate.tasks import source
    from evalgate.tasks.data import parse_jsonl, read_verified

    def _published_split(self, name):
        file = self.files[name]
        rows = [{f: row[f] for f in self.fields} for row in parse_jsonl(read_verified(self.data_dir, file))]
        return source.Split(rows, {file.path: file.sha256}, {"source": "reference", "split": name, "rows": len(rows)})

    source.TaskData._published_split = _published_split
'''

STARTUP = r'''
import json, sys, time
started = float(sys.argv[1])
t0 = time.perf_counter()
from evalgate.run.spec import RunSpec, load_tasks
from evalgate.canary import PROFILES
spec = RunSpec(model="canary", kernel="w4a4_packed", tasks=["gsm8k", "humaneval"], profiles=dict(PROFILES))
loaded = load_tasks(spec)
t1 = time.perf_counter()
import torch, transformers  # what the gate imports next (the model's load)
t2 = time.perf_counter()
print(json.dumps({"ids": {t: l.profile_id for t, l in loaded.items()}, "load_tasks_s": t1 - t0,
                  "with_model_imports_s": t2 - t0, "sources": sorted({r["source"] for l in loaded.values()
                                                                        for r in l.resolved.data.values()})}))
'''

IMPORT_ONLY = r'''
import json, time
t0 = time.perf_counter()
import datasets
t1 = time.perf_counter()
from evalgate.tasks.source import TaskData
from evalgate.tasks.gsm8k import FIELDS, FILES
from evalgate.tasks.data import packaged_data_dir
TaskData("gsm8k", FIELDS, FILES, packaged_data_dir(), None, ["train"]).split("train")
t2 = time.perf_counter()
print(json.dumps({"import_datasets_s": t1 - t0, "train_split_s": t2 - t1}))
'''


def _env(reference: bool, site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["BENCH_DATA_REFERENCE"] = "1" if reference else "0"
    env.pop("EVALGATE_DATA_DIR", None)
    return env


def _python(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(time.perf_counter())], env=env, capture_output=True,
                         text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _timed_interpreter(code: str, env: dict) -> tuple[float, dict]:
    started = time.perf_counter()
    result = _python(code, env)
    return time.perf_counter() - started, result


def _gate(env: dict) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "evalgate", "gate"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"the default gate exited {proc.returncode}: {proc.stderr[-2000:]}")
        return time.perf_counter() - started, proc.returncode


def _ratio(name: str, ours: list[float], ref: list[float]) -> None:
    m, r = statistics.median(ours), statistics.median(ref)
    print(f"{name:<44} datasets {m:7.3f} s  reference {r:7.3f} s  ratio {m / r:5.3f}  "
          f"(ranges {min(ours):.3f}-{max(ours):.3f} / {min(ref):.3f}-{max(ref):.3f})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gates", type=int, default=0, help="pairs of whole default gates to time (each ~1 min)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as site_dir:
        site = Path(site_dir)
        (site / "sitecustomize.py").write_text(REFERENCE, encoding="utf-8")
        times: dict[str, list[float]] = {}
        ids = {}
        for _ in range(args.repeats):
            for reference in (False, True):
                label = "reference" if reference else "datasets"
                wall, result = _timed_interpreter(STARTUP, _env(reference, site))
                assert result["sources"] == (["reference"] if reference else ["packaged"]), result["sources"]
                ids.setdefault(label, result["ids"])
                assert result["ids"] == ids[label], "profile ids changed between repeats"
                times.setdefault(f"{label} interpreter + load_tasks wall", []).append(wall)
                times.setdefault(f"{label} load_tasks", []).append(result["load_tasks_s"])
                times.setdefault(f"{label} load_tasks + torch/transformers", []).append(result["with_model_imports_s"])
        only = [_python(IMPORT_ONLY, _env(False, site)) for _ in range(args.repeats)]
        print(f"profile ids equal: {ids['datasets'] == ids['reference']} {json.dumps(ids['datasets'])}")
        print(f"import datasets alone: median {statistics.median(o['import_datasets_s'] for o in only):.3f} s; "
              f"GSM8K train split (7473 rows, Arrow cache built in a temp folder): "
              f"median {statistics.median(o['train_split_s'] for o in only):.3f} s")
        for key in ("load_tasks", "load_tasks + torch/transformers", "interpreter + load_tasks wall"):
            _ratio(key, times[f"datasets {key}"], times[f"reference {key}"])
        if args.gates:
            gates: dict[str, list[float]] = {"datasets": [], "reference": []}
            for _ in range(args.gates):
                for reference in (False, True):
                    wall, code = _gate(_env(reference, site))
                    assert code == 0, f"the default gate exited {code}"
                    gates["reference" if reference else "datasets"].append(wall)
            _ratio(f"evalgate gate (default canary), {args.gates} pairs", gates["datasets"], gates["reference"])


if __name__ == "__main__":
    main()
