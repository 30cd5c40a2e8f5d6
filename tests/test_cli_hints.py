"""The command a missing-baseline error suggests is run as written, and after it the same gate decides."""

from __future__ import annotations

import re
import shlex

import pytest

from gate_helpers import policy
import cli_process


@pytest.mark.slow
def test_the_calibrate_command_a_limited_gate_suggests_makes_its_baseline(tiny_model, cli_env, tmp_path):
    gate = ["gate", "--model", str(tiny_model), "--kernel", "bf16", "--tasks",
            "gsm8k", "--limit", "3", "--max-new-tokens", "8", "--batch-size", "3", "--baselines-root",
            str(tmp_path / "baselines"), "--thresholds", str(policy(tmp_path))]
    (tmp_path / "baselines").mkdir()
    proc = cli_process.run(gate, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    hinted = shlex.split(re.search(r"create one with `evalgate (calibrate [^`]+)`", line).group(1))
    assert "--limit" in hinted and "--max-new-tokens" in hinted
    done = cli_process.run([*hinted],  # exactly as suggested
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 3), done.stderr
    again = cli_process.run(gate, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode in (0, 1, 3), again.stderr


def test_a_limited_stored_run_is_told_to_add_items_candidate_and_then_decided(cli_env, tmp_path):
    import json

    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path / "runs", n_gsm8k=200, n_humaneval=0)
    root = tmp_path / "baselines"
    cli_process.run(["baseline", "record", str(base), "--baselines-root", str(root)],
                   env=cli_env, check=True, capture_output=True)
    limited = tmp_path / "runs" / "limited"  # what `evalgate run --limit 60` stores: 60 items, its own profile id
    limited.mkdir()
    manifest = json.loads((cand / "manifest.json").read_text())
    manifest["tasks"]["gsm8k"].update(n_items=60, profile_id="9" * 64)
    (limited / "manifest.json").write_text(json.dumps(manifest))
    lines = (cand / "gsm8k.jsonl").read_text(encoding="utf-8").split("\n")[:60]  # records hold U+2028
    (limited / "gsm8k.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    gate = ["gate", "--candidate", str(limited), "--baselines-root", str(root),
            "--allow-uncalibrated", "--thresholds", str(policy(tmp_path))]
    proc = cli_process.run(gate, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    added = shlex.split(re.search(r"add `([^`]+)` to this command", line).group(1))
    done = cli_process.run([*gate, *added], env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1, 3), done.stderr
    verdict = json.loads((limited / "gate" / "gate.json").read_text())
    assert verdict["decision"]["tasks"]["gsm8k"]["statistics"]["counts"]["n"] == 60  # the smaller n decides
    assert any("60 of the baseline's 200 items" in n for n in verdict["notes"])
    recorded = next(root.rglob("manifest.json")).parent
    report = cli_process.run(["report", "--baseline", str(recorded), "--candidate",
                             str(limited), "--items", "candidate", "--allow-uncalibrated", "--thresholds",
                             str(tmp_path / "thresholds.yaml"), "--html", str(tmp_path / "r.html")],
                            env=cli_env, capture_output=True, text=True, timeout=300)
    assert report.returncode == done.returncode, report.stderr
    assert "60 of the baseline&#39;s 200 items" in (tmp_path / "r.html").read_text() or \
        "60 of the baseline's 200 items" in (tmp_path / "r.html").read_text()
