"""Inputs a user can type that once ended in exit 70 (a bug): each is one `evalgate: error:` line and exit 2,
and where the line suggests a command, that command, typed as suggested, works."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import cli_process



def _cli(args, env, cwd):
    return cli_process.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _one_line_exit_2(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("evalgate: error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["run", "--out", "{long}"], ["gate", "--out", "runs/{long}/r"],
                                  ["gate", "--report-dir", "{long}"], ["baseline", "record", "{cwd}", "--root", "{long}"]],
                         ids=["run-out", "gate-out", "report-dir", "baselines-root"])
def test_a_name_longer_than_the_file_system_allows_is_bad_input(args, cli_env, tmp_path):
    long = "x" * 300
    (tmp_path / "manifest.json").write_text("{}")  # `baseline record` reaches the root only past a run folder
    line = _one_line_exit_2(_cli([a.format(long=long, cwd=tmp_path) for a in args], cli_env, tmp_path))
    assert "has 300 characters" in line and "choose a shorter path" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # nothing made


def test_a_dataset_on_the_canary_names_a_profile_that_scores_it_and_that_profile_does(cli_env, data_dir, tmp_path):
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:30]
    (tmp_path / "mine.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    args = ["run", "--dataset", "gsm8k=mine.jsonl", "--limit", "1", "--max-new-tokens", "2"]
    line = _one_line_exit_2(_cli(args + ["--out", "first"], cli_env, tmp_path))
    assert not (tmp_path / "first").exists()
    suggested = shlex.split(re.search(r"with (--profile \S+)", line).group(1))
    proc = _cli(args + suggested + ["--out", "second"], cli_env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "second" / "gsm8k.jsonl").read_text().count("\n") == 1


def _spec(command, args: list[str]):
    """The RunSpec a gate or calibrate command line describes (parsed as the CLI parses it; nothing runs)."""
    from evalgate.cli.options import run_spec, sampling_settings

    ctx = command.make_context(command.name, list(args))
    with ctx:
        p = ctx.params
        return run_spec(p["model"], p["kernel"], p["tasks"], p["profiles"], p["limit"], p["batch_size"], p["device"],
                        p["dtype"], p["max_new_tokens"], p["data_dir"], None,
                        sampling_settings(p["samples"], p["temperature"], p["seed"]))


def test_the_calibrate_a_gate_suggests_records_the_baseline_of_that_gate(data_dir, tmp_path, monkeypatch):
    """A gate on your own dataset without a baseline names a calibrate command; as typed, it describes the
    same items and profiles (the same profile ids), so the baseline it records is the one that gate looks up."""
    from evalgate.cli.calibrate import calibrate
    from evalgate.cli.gate import gate
    from evalgate.plan import _missing_baseline, planned_profile_ids

    monkeypatch.chdir(tmp_path)
    rows = (data_dir / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:30]
    (tmp_path / "mine.jsonl").write_text("\n".join(r.replace('"question"', '"problem"') for r in rows) + "\n")
    spec = _spec(gate, ["--tasks", "gsm8k", "--profile", "gsm8k=gsm8k-cot-8shot", "--limit", "3",
                        "--dataset", "gsm8k=mine.jsonl", "--dataset", "gsm8k.question=problem"])
    message = str(_missing_baseline(spec, ["gsm8k"], "w4a8", tmp_path / "b", False))
    suggested = shlex.split(re.search(r"`evalgate calibrate ([^`]+)`", message).group(1))
    again = _spec(calibrate, suggested)
    assert again.datasets == spec.datasets and again.limit == 3
    assert planned_profile_ids(again) == planned_profile_ids(spec)


def test_a_damaged_baseline_names_how_to_record_it_again_and_that_works(cli_env, tmp_path):
    """Not "rerun into a new --out" (which makes a run, never a baseline): the command that records it again."""
    from synthetic_runs import write_pair

    write_pair(tmp_path / "runs", n_gsm8k=30, n_humaneval=10, lost_every=1000)
    assert _cli(["baseline", "record", "runs/base", "--baselines-root", "b"], cli_env, tmp_path).returncode == 0
    (stored,) = (p.parent for p in (tmp_path / "b").glob("*/gsm8k*/*/manifest.json"))
    with open(stored / "gsm8k.jsonl", "a") as f:
        f.write("{damaged\n")
    gate = ["gate", "--candidate", "runs/cand", "--baselines-root", "b", "--allow-uncalibrated", "--report-dir", "g"]
    line = _one_line_exit_2(_cli(gate, cli_env, tmp_path))
    assert "new --out" not in line and "not JSON" in line
    suggested = shlex.split(re.search(r"`evalgate (baseline record [^`]+)`", line).group(1))
    assert _cli(suggested, cli_env, tmp_path).returncode == 0
    assert _cli(gate, cli_env, tmp_path).returncode in (0, 1, 3)


# the CLI in a child process that says, after it exits, whether torch was ever imported (the model's load)
LOADS_TORCH = """
import sys
from evalgate.cli.main import main
try:
    main(sys.argv[1:])
finally:
    sys.stdout.write("torch imported: %s" % ("torch" in sys.modules))
"""


def test_a_resume_with_another_kernel_is_refused_before_the_model_loads(cli_env, tmp_path):
    import json

    made = _cli(["run", "--tasks", "gsm8k", "--limit", "1", "--max-new-tokens", "2", "--kernel", "bf16", "--out",
                 "r"], cli_env, tmp_path)
    assert made.returncode == 0, made.stderr
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    (tmp_path / "r" / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted"}))
    proc = subprocess.run([sys.executable, "-c", LOADS_TORCH, "run", "--out", "r", "--resume", "--kernel", "w4a8"],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "kernel (bf16 vs w4a8)" in _one_line_exit_2(proc)
    assert proc.stdout.endswith("torch imported: False")


def test_baseline_list_shows_the_packaged_baselines_the_gate_would_use_and_find_names_them(tmp_path, monkeypatch):
    """In a fresh directory the gate uses the canary's packaged baselines: `baseline list` shows them (marked),
    and `baseline find` (the gate's own lookup) names the same folders."""
    import json

    from click.testing import CliRunner

    from evalgate.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EVALGATE_BASELINES", raising=False)
    listed = CliRunner().invoke(main, ["baseline", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert rows and all(r["packaged"] for r in rows)
    found = CliRunner().invoke(main, ["baseline", "find", "--json"])
    assert found.exit_code == 0, found.output
    paths = {t["path"] for t in json.loads(found.output)["tasks"].values()}
    assert paths and paths <= {r["path"] for r in rows}
    assert "packaged with the canary" in CliRunner().invoke(main, ["baseline", "list"]).output


def test_device_map_auto_without_a_gpu_says_it_places_the_model_on_the_cpu(capsys):
    import torch

    from evalgate.model_adapters.loading.streamed import resolve_devices

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto places the model on it")
    assert resolve_devices("auto") == ["cpu"]
    assert "--device-map auto found no GPU; the model is placed on the CPU" in capsys.readouterr().err


def test_a_long_layer_check_says_how_far_it_is_on_stderr(monkeypatch):
    """`kernels check --shape dsv4-flash` takes minutes on a CPU, one kernel's preparation alone minutes: a
    line every few seconds (stderr, so --json stays parseable) whether or not the check moved since, naming
    the kernel being prepared, the kernels prepared and the experts done."""
    import json
    import time

    from click.testing import CliRunner

    from evalgate.cli import kernels as cli_kernels
    from evalgate.cli.main import main
    from evalgate.kernels import check as checks

    heartbeat = cli_kernels._Heartbeat
    monkeypatch.setattr(cli_kernels, "_Heartbeat", lambda t0: heartbeat(t0, every_s=0.05))
    runner = checks._runner

    def slow_runner(name, case):  # a preparation that reports nothing for a while, as a big one does
        time.sleep(0.5)
        return runner(name, case)

    monkeypatch.setattr(checks, "_runner", slow_runner)
    res = CliRunner().invoke(main, ["kernels", "check", "--shape", "tiny", "--tokens", "16", "--kernels",
                                    "bf16,w4a8", "--json"])
    assert res.exit_code == 0, res.output
    assert {r["kernel"] for r in json.loads(res.stdout)["rows"]} == {"bf16", "w4a8"}
    lines = res.stderr.splitlines()
    beats = [line for line in lines if line.startswith("layer check: preparing bf16, kernels prepared 0/2, ")]
    assert len(beats) >= 2, lines  # the same stretch told again: still working
    assert any(line.startswith("layer check: preparing w4a8, kernels prepared 1/2, ") for line in lines), lines
