"""One gate, its inputs read once: the policy parsed once, the task data loaded once, each baseline file read
once, and nothing the runner writes read back while the gate runs — counted on the canary in-process and on
a run through `evalgate serve`."""

from __future__ import annotations

import builtins
import io
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from serve_helpers import running_server

from evalgate.cli.main import main as evalgate_cli
from evalgate.tasks import get_task
import cli_process


class Reads:
    """Counts every file opened for reading in this process (the gate's threads included), by path."""

    def __init__(self, monkeypatch):
        self.paths: Counter = Counter()
        self.loads: Counter = Counter()
        real_open = io.open

        self.counting = True

        def counting_open(file, mode="r", *args, **kwargs):
            if self.counting and isinstance(file, (str, bytes, os.PathLike)) and not any(c in mode for c in "wax+"):
                self.paths[Path(os.fsdecode(file)).resolve()] += 1
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(io, "open", counting_open)
        monkeypatch.setattr(builtins, "open", counting_open)
        for name in ("gsm8k", "humaneval"):
            cls = type(get_task(name))
            monkeypatch.setattr(cls, "load", self._counted(name, cls.load))

    def _counted(self, name: str, real_load):
        def load(task, *args, **kwargs):
            self.loads[name] += 1
            return real_load(task, *args, **kwargs)

        return load

    def under(self, folder: Path) -> dict[Path, int]:
        folder = folder.resolve()
        return {p: n for p, n in self.paths.items() if p.is_relative_to(folder)}


def gate(args: list[str], cwd: Path):
    runner = CliRunner()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        return runner.invoke(evalgate_cli, ["gate", *args], catch_exceptions=False)
    finally:
        os.chdir(old)


def check_read_once(reads: Reads, policy: Path, baseline_dirs: list[Path], out: Path, tasks: list[str]) -> None:
    assert reads.paths[policy.resolve()] == 1, f"policy {policy} read {reads.paths[policy.resolve()]} times"
    assert dict(reads.loads) == {t: 1 for t in tasks}, f"task data loaded {dict(reads.loads)}"
    for folder in baseline_dirs:
        seen = reads.under(folder)
        assert seen and set(seen.values()) == {1}, f"baseline files read more than once: {seen}"
        assert {p.name for p in seen} >= {f"{t}.jsonl" for t in tasks}  # a manifest may be known from a lookup
    assert reads.under(out) == {}, f"the run's own files were read back: {reads.under(out)}"


@pytest.mark.slow  # the canary's 200 GSM8K items: ~15-25 s on 2 cores
def test_a_canary_gate_reads_each_input_once_and_nothing_it_wrote(tmp_path, monkeypatch):
    import json

    from evalgate.canary import THRESHOLDS

    reads = Reads(monkeypatch)
    out = tmp_path / "cand"
    result = gate(["--tasks", "gsm8k", "--out", str(out)], tmp_path)
    reads.counting = False
    assert result.exit_code == 0, result.output
    verdict = json.loads((out / "gate" / "gate.json").read_text())
    check_read_once(reads, Path(THRESHOLDS), [Path(d) for d in verdict["baseline_dirs"]], out, ["gsm8k"])


@pytest.mark.slow  # a served tiny model: start-up and two short runs, ~30 s on 2 cores
def test_a_gate_through_evalgate_serve_reads_each_input_once(tiny_model, data_dir, tmp_path, monkeypatch):
    from gate_helpers import policy

    from evalgate.model_adapters.server.launcher import free_port
    from evalgate.run.baselines import record

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "evalgate", "serve", "--model", str(tiny_model), "--kernel", "w4a8", "--port",
            str(port), "--batch-size", "4"]
    common = ["--tasks", "gsm8k", "--limit", "4", "--max-new-tokens", "24", "--data-dir", str(data_dir)]
    with running_server(argv, port, tmp_path / "serve.log", env, "evalgate serve") as url:
        proc = cli_process.run(["run", "--server", url, "--kernel", "w4a8", *common,
                               "--out", str(tmp_path / "base")], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        (stored,) = record(tmp_path / "base", tmp_path / "baselines")
        thresholds = policy(tmp_path)
        reads = Reads(monkeypatch)
        out = tmp_path / "cand"
        result = gate(["--server", url, "--kernel", "w4a8", *common, "--baselines-root", str(tmp_path / "baselines"),
                       "--thresholds", str(thresholds), "--allow-uncalibrated", "--out", str(out)], tmp_path)
        reads.counting = False
    assert result.exit_code in (0, 3), result.output
    check_read_once(reads, thresholds, [stored], out, ["gsm8k"])


def test_a_policy_for_other_profiles_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """Issue 45, finding 5: a policy without a section for a task, or written for another profile, was found
    only after the whole candidate had generated. The plan checks it once the task data are read: exit 2,
    nothing run, no model loaded."""
    import evalgate.run.runner as runner

    def no_run(*args, **kwargs):
        raise AssertionError("the candidate ran")

    monkeypatch.setattr(runner, "execute", no_run)
    policy = tmp_path / "policy.yaml"
    policy.write_text("alpha: 0.05\ntasks:\n"
                      "  gsm8k: {profile: gsm8k-lmeval-v3, metric: exact_match, margin_pp: 1.5}\n"
                      "  humaneval: {profile: humaneval-completion-codex, metric: pass@1, margin_pp: 5.0}\n")
    out = tmp_path / "cand"
    result = gate(["--tasks", "gsm8k", "--thresholds", str(policy), "--out", str(out)], tmp_path)
    assert result.exit_code == 2, result.output
    assert "tasks.gsm8k.profile is 'gsm8k-lmeval-v3' but the gsm8k runs use 'gsm8k-canary-v1'" in result.output
    assert not (out / "manifest.json").exists()
    policy.write_text("alpha: 0.05\ntasks:\n"
                      "  gsm8k: {profile: gsm8k-canary-v1, metric: exact_match, margin_pp: 1.5}\n"
                      "  humaneval: {profile: humaneval-completion-codex, metric: pass@1, margin_pp: 5.0}\n"
                      "  mbpp: {profile: mbpp-x, metric: pass@1, margin_pp: 5.0}\n")
    from evalgate.gate.policy import load_thresholds
    from evalgate.plan import checked_policy

    with pytest.raises(Exception, match="no section for task 'arc'"):
        checked_policy(load_thresholds(policy), {"gsm8k": "gsm8k-canary-v1", "arc": "arc-v1"})
