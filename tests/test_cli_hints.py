"""The command a missing-baseline error suggests is run as written, and after it the same gate decides."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from gate_helpers import policy


@pytest.mark.slow
def test_the_calibrate_command_a_limited_gate_suggests_makes_its_baseline(tiny_model, cli_env, tmp_path):
    gate = [sys.executable, "-m", "evalgate", "gate", "--model", str(tiny_model), "--kernel", "bf16", "--tasks",
            "gsm8k", "--limit", "3", "--max-new-tokens", "8", "--batch-size", "3", "--baselines-root",
            str(tmp_path / "baselines"), "--thresholds", str(policy(tmp_path))]
    (tmp_path / "baselines").mkdir()
    proc = subprocess.run(gate, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    hinted = shlex.split(re.search(r"create one with `evalgate (calibrate [^`]+)`", line).group(1))
    assert "--limit" in hinted and "--max-new-tokens" in hinted
    done = subprocess.run([sys.executable, "-m", "evalgate", *hinted],  # exactly as suggested
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 3), done.stderr
    again = subprocess.run(gate, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode in (0, 1, 3), again.stderr
