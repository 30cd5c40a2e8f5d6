"""Each way a command can end has its own exit code and one stderr line (a bug alone adds its traceback):
the environment (4), Ctrl-C (130), SIGTERM (143), click's own errors (2), a bug (70, never 1 = FAIL)."""

from __future__ import annotations

import errno
import sys

import click
import pytest

from evalgate.cli.main import _run_main, main
from evalgate.cli.options import note_resumable
from evalgate.errors import EnvironmentFailure, Interrupted
import cli_process

KEPT = "; finished items in 'runs/x' are kept: run the same command with --out runs/x to resume"
ENDINGS = [
    (OSError(errno.ENOSPC, "No space left on device"), 4, "evalgate: could not finish: no space left on device" + KEPT),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run/manifest.json"), 4,
     "evalgate: could not finish: read-only file system on '/ro/run/manifest.json'" + KEPT),
    (MemoryError(), 4,
     "evalgate: could not finish: out of memory (MemoryError); lower --batch-size or free memory" + KEPT),
    (EnvironmentFailure("server http://gpu:30000 went away"), 4,
     "evalgate: could not finish: server http://gpu:30000 went away" + KEPT),
    (KeyboardInterrupt(), 130, "evalgate: interrupted" + KEPT),
    (Interrupted(), 143, "evalgate: terminated" + KEPT),
    (click.FileError("x.json", "unreadable"), 2, "evalgate: error: Could not open file 'x.json': unreadable"),
    (RuntimeError("boom"), 70, "evalgate: internal error (a bug, exit 70): RuntimeError: boom"),
]


def _end_with(exc: BaseException, rerun: str, monkeypatch) -> int:
    """Run a command that notes runs/x as its run folder (resumed with ``rerun``), then raises ``exc``."""
    @click.command("ending")
    def ending():
        note_resumable("runs/x", rerun)
        raise exc

    main.add_command(ending)
    monkeypatch.setattr(sys, "argv", ["evalgate", "ending"])
    try:
        return _run_main()
    finally:
        main.commands.pop("ending")


@pytest.mark.parametrize("exc, code, line", ENDINGS, ids=[type(e).__name__ + str(c) for e, c, _ in ENDINGS])
def test_every_ending_has_its_code_and_one_line(exc, code, line, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "manifest.json").write_text("{}")  # the run stored something: it can resume

    got = _end_with(exc, "--out runs/x", monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert got == code
    assert err[-1] == line
    if code != 70:
        assert len(err) == 1
    else:
        assert err[0] == "Traceback (most recent call last):"


def test_a_failure_before_the_run_stored_anything_offers_no_resume(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)

    # runs/x chosen, never written: `--resume` would fail there
    got = _end_with(EnvironmentFailure("server http://gpu:30000 failed the model list"), "--out runs/x --resume",
                    monkeypatch)
    assert got == 4
    assert capsys.readouterr().err.strip() == "evalgate: could not finish: server http://gpu:30000 failed the model list"


@pytest.mark.parametrize("command", [["gate"], ["run", "--out", "{tmp}/run"], ["calibrate"]])
def test_a_server_failing_at_start_is_the_environment_and_names_no_resume(command, cli_env, tmp_path):

    from fake_server import FakeServer

    with FakeServer(models_status=500) as server:
        args = [a.format(tmp=tmp_path) for a in command]
        proc = cli_process.run([*args, "--server", server.url, "--retries", "1"],
                              env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    (line,) = proc.stderr.strip().splitlines()
    assert proc.returncode == 4, proc.stderr
    assert line.startswith("evalgate: could not finish: server ") and "failed the model list" in line
    assert "--resume" not in line and "are kept" not in line
