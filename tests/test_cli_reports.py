"""A verdict whose reports cannot be written is printed, ends with the environment code (4) and one line, and
the command that line names writes the reports from the stored run; stored files get the usual modes."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from gate_helpers import policy
from synthetic_runs import write_pair
import cli_process

# the console script whose report writer meets a read-only file system, as after a remount mid-run
READ_ONLY_REPORTS = ("import errno, sys, evalgate.report.outputs as outputs\n"
                     "def refuse(verdict, out_dir, explained=None):\n"
                     "    raise OSError(errno.EROFS, 'Read-only file system', str(out_dir) + '/gate.json')\n"
                     "outputs.write_outputs = refuse\n"
                     "from evalgate.cli.main import entry\n"
                     "entry()\n")


@pytest.mark.slow
def test_unwritable_reports_keep_the_verdict_and_the_named_command_writes_them(tmp_path, cli_env):
    base, cand = write_pair(tmp_path / "runs", n_gsm8k=40, n_humaneval=10, lost_every=2)
    args = ["gate", "--candidate", str(cand), "--baseline", str(base), "--allow-uncalibrated", "--thresholds",
            str(policy(tmp_path, margin=5.0)), "--report-dir", str(tmp_path / "reports")]
    proc = subprocess.run([sys.executable, "-c", READ_ONLY_REPORTS, *args], env=cli_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("evalgate: could not finish: the verdict is FAIL (exit 1), but its reports could not be "
                           f"written to {str(tmp_path / 'reports')!r} (read-only file system")
    assert proc.stdout.splitlines()[1] == "evalgate verdict: FAIL"  # printed all the same: never lost

    command = shlex.split(line.split("write them elsewhere with: ", 1)[1])
    assert command[:2] == ["evalgate", "gate"] and command[-1] == "DIR"
    out = tmp_path / "elsewhere"
    rerun = cli_process.run([*command[1:-1], str(out)], env=cli_env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 1, rerun.stderr
    (tmp_path / "plain").write_text("")
    for name in ("gate.json", "report.md", "junit.xml", "report.html"):
        assert (out / name).stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777, name


def test_stored_runs_and_baselines_get_the_modes_open_gives(tmp_path):
    from evalgate.files import write_bytes_atomic

    write_bytes_atomic(tmp_path / "manifest.json", b"{}")
    (tmp_path / "plain.json").write_bytes(b"{}")
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == (tmp_path / "plain.json").stat().st_mode & 0o777
    assert (tmp_path / "manifest.json").stat().st_mode & 0o044  # readable by others under the usual umask 022
