"""Where the gate finds a stored baseline: the user's root (--baselines-root, else $EVALGATE_BASELINES, else
./results/baselines of the current directory) first, then the canary's baselines shipped in the package,
from any directory and from a non-editable install; the packaged ones are never written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalgate.canary import BASELINES, PROFILES, canary_path
from evalgate.errors import UserError
from evalgate.run import baselines
from evalgate.run.spec import RunSpec

REPO = Path(__file__).resolve().parents[1]
TASKS = ["gsm8k", "humaneval"]


def canary_spec(data_dir) -> RunSpec:
    return RunSpec(model=str(canary_path()), kernel="w4a8", tasks=TASKS, profiles=dict(PROFILES), data_dir=str(data_dir))


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """An empty current directory, no $EVALGATE_BASELINES."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(baselines.ROOT_ENV, raising=False)
    return tmp_path


def test_user_root_is_the_flag_else_the_variable_else_results_baselines_here(elsewhere, monkeypatch):
    assert baselines.user_root() == Path("results/baselines")
    monkeypatch.setenv(baselines.ROOT_ENV, str(elsewhere / "mine"))
    assert baselines.user_root() == elsewhere / "mine"
    assert baselines.user_root(elsewhere / "flag") == elsewhere / "flag"
    assert baselines.lookup_roots() == [elsewhere / "mine", BASELINES]


def test_the_packaged_canary_baseline_is_found_from_any_directory(elsewhere, data_dir):
    from evalgate.plan import stored_baselines

    found = stored_baselines(canary_spec(data_dir), "w4a8")
    assert set(found) == set(TASKS)
    for task, path in found.items():
        assert path is not None and BASELINES in path.parents and (path / f"{task}.jsonl").is_file()
        assert (path / "aa.json").is_file()  # the A/A calibration ships too


def test_a_user_baseline_wins_over_the_packaged_one(elsewhere, data_dir):
    from evalgate.plan import stored_baselines

    packaged = stored_baselines(canary_spec(data_dir), "w4a8")["gsm8k"]
    mine = elsewhere / "results" / "baselines" / packaged.relative_to(BASELINES)
    shutil.copytree(packaged, mine)
    found = stored_baselines(canary_spec(data_dir), "w4a8")
    assert found["gsm8k"].resolve() == mine.resolve()
    assert BASELINES in found["humaneval"].parents  # the task the user has no baseline for still falls back


def test_calibrate_looks_in_the_user_root_only(elsewhere, data_dir):
    # calibrate writes its A/A next to the baseline it finds: it must never find the packaged one
    from evalgate.plan import stored_baselines

    assert stored_baselines(canary_spec(data_dir), "w4a8", packaged=False) == {t: None for t in TASKS}


def test_no_baseline_is_one_line_naming_the_flag_and_the_variable_exit_2(elsewhere, tiny_model, data_dir):
    from evalgate.cli.main import main

    result = CliRunner().invoke(main, ["gate", "--model", str(tiny_model), "--tasks", "gsm8k",
                                       "--data-dir", str(data_dir)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("evalgate: error: no stored w4a8 baseline"), result.output
    assert "--baselines-root" in lines[0] and "EVALGATE_BASELINES" in lines[0]
    assert "results/baselines" in lines[0]


def test_the_variable_points_the_cli_at_another_root(elsewhere, tiny_model, data_dir):
    from evalgate.cli.main import main

    env = {baselines.ROOT_ENV: str(elsewhere / "team-baselines")}
    result = CliRunner().invoke(main, ["gate", "--model", str(tiny_model), "--tasks", "gsm8k",
                                       "--data-dir", str(data_dir)], env=env)
    assert result.exit_code == 2 and str(elsewhere / "team-baselines") in result.output


def _a_complete_run(tmp_path: Path) -> Path:
    from synthetic_runs import write_pair

    base, _ = write_pair(tmp_path / "runs")
    return base


def test_an_installed_copy_refuses_to_write_its_packaged_baselines(tmp_path, monkeypatch):
    installed = tmp_path / "lib" / "site-packages" / "evalgate" / "canary" / "baselines"
    installed.mkdir(parents=True)
    monkeypatch.setattr(baselines, "packaged_root", lambda: installed)
    run = _a_complete_run(tmp_path)
    with pytest.raises(UserError, match="read-only") as exc:
        baselines.record(run, installed)
    assert "\n" not in str(exc.value) and not any(installed.iterdir())
    with pytest.raises(UserError, match="read-only"):
        baselines.write_aa(installed / "m" / "p" / "w4a8", {"tasks": {}}, run)
    # elsewhere, and in a source checkout's own package folder, recording works
    assert baselines.record(run, tmp_path / "mine")


@pytest.mark.slow
def test_a_non_editable_install_finds_its_baseline_from_an_empty_directory(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    site = tmp_path / "site-packages"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              *map(str, wheels.glob("*.whl"))], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    code = ("import evalgate\n"
            "from evalgate.plan import stored_baselines\n"
            "from evalgate.canary import PROFILES, canary_path\n"
            "from evalgate.run.spec import RunSpec\n"
            "spec = RunSpec(model=str(canary_path()), kernel='w4a8', tasks=['gsm8k', 'humaneval'], "
            "profiles=dict(PROFILES))\n"
            "print(evalgate.__file__)\n"
            "for task, path in stored_baselines(spec, 'w4a8').items(): print(task, path)\n")
    env = {k: v for k, v in os.environ.items() if k not in (baselines.ROOT_ENV, "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=empty, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(str(site))  # the installed copy, not the checkout
    for task in ("gsm8k", "humaneval"):
        (line,) = [x for x in lines if x.startswith(task + " ")]
        assert line.startswith(f"{task} {site / 'evalgate' / 'canary' / 'baselines'}"), proc.stdout


def _no_data_read(monkeypatch):
    from evalgate.tasks import source

    def read(*args, **kwargs):
        raise AssertionError("the task data were read before the missing baseline was told")

    monkeypatch.setattr(source, "_load_files", read)
    monkeypatch.setattr(source, "_load_local", read)


@pytest.mark.parametrize("flags", [["--limit", "20"], ["--samples", "4", "--temperature", "0.8"],
                                   ["--max-new-tokens", "64"]])
def test_a_gate_no_stored_baseline_can_match_is_refused_before_the_task_data_are_read(elsewhere, monkeypatch,
                                                                                     flags):
    from evalgate.cli.main import main

    _no_data_read(monkeypatch)
    own = [f for task, name in PROFILES.items() for f in ("--profile", f"{task}={name}")]  # stored: these
    result = CliRunner().invoke(main, ["gate", "--model", str(canary_path()), *own, "--out", str(elsewhere / "run"),
                                       *flags])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("evalgate: error: no stored w4a8 baseline"), result.output
    assert not (elsewhere / "run").exists()


def test_the_early_check_leaves_a_possible_match_to_the_profile_id():
    # only a certain miss is told early: the packaged canary baselines stay reachable (and --limit above
    # their item counts keeps them candidates), another kernel, limit or sampling does not
    from evalgate.plan import local_fingerprint
    from evalgate.run.spec import with_overrides
    from evalgate.run.samples import Sampling
    from evalgate.tasks import get_task, resolve_profile

    fingerprint, roots = local_fingerprint(str(canary_path())), [BASELINES]

    def could(task, kernel="w4a8", limit=None, sampling=None, max_new_tokens=None):
        sampling = Sampling(1, 0.0, 0) if sampling is None else sampling
        spec = RunSpec(model=str(canary_path()), kernel=kernel, tasks=[task], max_new_tokens=max_new_tokens)
        profile = with_overrides(resolve_profile(get_task(task), PROFILES[task]), spec)
        return baselines.could_be_stored(roots, fingerprint, kernel, task, profile, limit, sampling)

    assert could("gsm8k") and could("humaneval") and could("gsm8k", limit=1000)
    assert not could("gsm8k", kernel="w4a4")
    assert not could("gsm8k", limit=20)
    assert not could("humaneval", sampling=Sampling(4, 0.8, 0))
    assert not could("gsm8k", max_new_tokens=64)
    other = with_overrides(resolve_profile(get_task("gsm8k"), None), RunSpec(model="m", kernel="w4a8", tasks=["gsm8k"]))
    assert not baselines.could_be_stored(roots, fingerprint, "w4a8", "gsm8k", other, None, Sampling(1, 0.0, 0))
