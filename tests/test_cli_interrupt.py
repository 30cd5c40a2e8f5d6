"""A gate that cannot finish never reads as a verdict, and running the command its last line names resumes it:
Ctrl-C (SIGINT to the process group, as a terminal sends it) exits 130, SIGTERM 143, a disk that fills up
mid-run 4 — each with one `evalgate:` line — and the run folder is left resumable. The hint a stopped run
gets from `baseline record` (`evalgate run --resume --out X`) is run and completes the run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gate_helpers import policy
import cli_process

COMMON = ["--tasks", "gsm8k", "--limit", "8", "--max-new-tokens", "40", "--batch-size", "2"]


def _run(args, env, cwd, check=True):
    proc = cli_process.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"evalgate {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def gate_setup(tiny_model, tmp_path_factory):
    """A recorded w4a8 baseline of the tiny model and the gate command that compares bf16 with it."""
    from evalgate.tasks.data import DATA_DIR_ENV

    ws = tmp_path_factory.mktemp("interrupt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DG_")}
    env["HF_HUB_OFFLINE"] = "1"
    _run(["run", "--model", str(tiny_model), "--kernel", "w4a8", *COMMON, "--out", str(ws / "base")], env, ws)
    _run(["baseline", "record", str(ws / "base"), "--baselines-root", str(ws / "baselines")], env, ws)
    gate = ["gate", "--model", str(tiny_model), "--kernel", "bf16", *COMMON, "--baselines-root", str(ws / "baselines"),
            "--allow-uncalibrated", "--no-early-stop", "--thresholds", str(policy(ws))]
    assert DATA_DIR_ENV not in env or Path(env[DATA_DIR_ENV]).is_dir()
    return ws, env, gate


def _start(args, env, cwd) -> cli_process.Process:
    return cli_process.start(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for_records(proc: cli_process.Process, jsonl: Path, lines: int = 1) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if jsonl.exists() and jsonl.read_bytes().count(b"\n") >= lines:
            return
        if proc.poll() is not None:
            pytest.fail(f"the gate ended before it could be stopped: {proc.stderr.read()[-2000:]}")
        time.sleep(0.02)
    pytest.fail("no record written within 300 s")


def _last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


def _hinted_flags(line: str) -> list[str]:
    """The flags of "run the same command with --out X to resume"."""
    match = re.search(r"run the same command with (.+) to resume$", line)
    assert match, line
    return shlex.split(match.group(1))


def _records(jsonl: Path) -> list[int]:
    return [json.loads(line)["doc_id"] for line in jsonl.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("how, code, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_stopped_gate_exits_with_its_signal_code_and_the_hint_resumes_it(gate_setup, how, code, word):
    ws, env, gate = gate_setup
    out = ws / f"gate-{how}"
    proc = _start(gate + ["--out", str(out)], env, ws)
    _wait_for_records(proc, out / "gsm8k.jsonl")
    if how == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    else:
        os.kill(proc.pid, signal.SIGTERM)  # what a CI runner or `kill` does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    line = _last_line(stderr)
    assert line.startswith(f"evalgate: {word}; finished items in {str(out)!r} are kept"), line
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    kept = _records(out / "gsm8k.jsonl")
    assert 1 <= len(kept) < 8
    assert not (out / "gate").exists()  # no verdict was written

    if how == "SIGTERM":  # #45: `baseline record` of the stopped run names a command; it completes the run
        proc = _run(["baseline", "record", str(out), "--baselines-root", str(ws / "other")], env, ws, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        hinted = re.search(r"`evalgate (run [^`]+)`", proc.stderr).group(1)
        _run(shlex.split(hinted), env, ws)
        assert sorted(_records(out / "gsm8k.jsonl")) == list(range(8))
        assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    rerun = _run(gate[:1] + gate[1:] + _hinted_flags(line), env, ws, check=False)
    assert rerun.returncode in (0, 1, 3), rerun.stderr
    assert sorted(_records(out / "gsm8k.jsonl")) == list(range(8))  # nothing redone twice, nothing lost
    assert [d for d in _records(out / "gsm8k.jsonl") if d in kept] == sorted(kept)
    assert json.loads((out / "gate" / "gate.json").read_text())["exit_code"] == rerun.returncode


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_is_the_environment_code_and_a_rerun_resumes(gate_setup):
    ws, env, gate = gate_setup
    disk = ws / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(disk, "6m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out = disk / "run"
        proc = _start(gate + ["--out", str(out)], env, ws)
        _wait_for_records(proc, out / "gsm8k.jsonl")
        filler = disk / "filler"
        with open(filler, "wb") as f:  # another program fills the disk
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 4, stderr
        line = _last_line(stderr)
        assert line.startswith("evalgate: could not finish: no space left on device"), line
        assert f"finished items in {str(out)!r} are kept" in line
        filler.unlink()
        rerun = _run(gate + _hinted_flags(line), env, ws, check=False)
        assert rerun.returncode in (0, 1, 3), rerun.stderr
        assert sorted(_records(out / "gsm8k.jsonl")) == list(range(8))
        assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_ctrl_c_stops_evalgate_serve_with_130(tiny_model, cli_env, tmp_path):
    import socket
    import urllib.request

    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _start(["serve", "--model", str(tiny_model), "--port", str(port)], cli_env, tmp_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert _last_line(stderr) == "evalgate: interrupted"
