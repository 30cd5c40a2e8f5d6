"""Threads from the cores this process may actually use: affinity, a cgroup v1/v2 CPU quota, an explicit
request or OMP_NUM_THREADS first, and the model's size as a cap; the sandbox's pool sized the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalgate import cores as threads


@pytest.fixture(autouse=True)
def no_request(monkeypatch):
    monkeypatch.delenv(threads.ENV_THREADS, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_our_own_group_and_its_parents(tmp_path):
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc-cgroup"
    _write(proc, "0::/jobs/me\n")
    _write(root / "jobs" / "me" / "cpu.max", "max 100000\n")
    _write(root / "jobs" / "cpu.max", "150000 100000\n")  # a parent's quota limits us too
    assert threads.cgroup_cpu_limit(root, proc) == 1.5
    _write(root / "jobs" / "me" / "cpu.max", "50000 100000\n")
    assert threads.cgroup_cpu_limit(root, proc) == 0.5


def test_cgroup_v2_inside_a_container_reads_the_mount_root(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/\n")
    _write(root / "cpu.max", "200000 100000\n")
    assert threads.cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_cfs_quota_and_no_quota(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "300000\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_cpu_limit(root, proc) == 3.0
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")  # unlimited
    assert threads.cgroup_cpu_limit(root, proc) is None
    assert threads.cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "missing") is None


def test_available_cores_is_affinity_lowered_to_the_quota(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cores", lambda: 8)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    assert threads.available_cores() == 8
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 2.5)
    assert threads.available_cores() == 2
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 0.3)
    assert threads.available_cores() == 1


def test_affinity_is_what_taskset_allows():
    if not hasattr(os, "sched_getaffinity") or not Path("/usr/bin/taskset").exists():
        pytest.skip("no sched_getaffinity / taskset here")
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c",
                           "from evalgate.cores import affinity_cores; print(affinity_cores())"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"


def test_order_request_then_env_then_omp_then_cores_capped_by_the_model(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 16)
    assert threads.intra_op_threads(7168) == (7, "hidden size 7168 (of 16 available cores)")
    assert threads.intra_op_threads(256)[0] == 1  # the canary: a second thread only adds barriers
    assert threads.intra_op_threads(None) == (16, "available cores")
    assert threads.intra_op_threads(65536) == (16, "available cores")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.intra_op_threads(256) == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv(threads.ENV_THREADS, "5")
    assert threads.intra_op_threads(256) == (5, threads.ENV_THREADS)
    assert threads.intra_op_threads(256, requested=2) == (2, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    monkeypatch.delenv(threads.ENV_THREADS)
    assert threads.intra_op_threads(None) == (16, "available cores")  # an unusable value is ignored


def test_configure_torch_sets_the_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert threads.configure_torch(4096, requested=1)["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_sandbox_pool_is_sized_from_the_available_cores(monkeypatch):
    from evalgate.tasks.humaneval import sandbox

    monkeypatch.setattr(threads, "available_cores", lambda: 3)
    assert sandbox.default_workers() == 3


def test_the_run_options_reach_the_loader_and_nothing_stays_in_the_process(tmp_path, monkeypatch):
    # --threads and --device-map travel in the run's options (the plan holds them for the gate), never as
    # process-wide state: the loader gets what this command asked, the next command its own
    from click.testing import CliRunner

    from evalgate.canary import BASELINES
    from evalgate.cli.main import main
    from evalgate.errors import UserError

    asked = []

    def loader(*args, **kwargs):  # the in-process model's adapter, stopped before anything loads
        asked.append({k: kwargs.get(k) for k in ("threads", "device_map")})
        raise UserError("stopped at the loader")

    monkeypatch.setattr("evalgate.model_adapters.hf.adapter.HFAdapter", loader)
    run = ["run", "--tasks", "gsm8k", "--limit", "1"]
    result = CliRunner().invoke(main, [*run, "--threads", "3", "--device-map", "cpu", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "stopped at the loader" in result.output, result.output
    assert asked == [{"threads": 3, "device_map": "cpu"}]
    result = CliRunner().invoke(main, [*run, "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and asked[-1] == {"threads": None, "device_map": None}
    assert threads.intra_op_threads(256)[1] != "--threads"
    # the gate: through its plan, down to the candidate's run
    baseline = next(BASELINES.glob("*/gsm8k-*/w4a8"))
    result = CliRunner().invoke(main, ["gate", "--tasks", "gsm8k", "--threads", "2", "--device-map", "cpu",
                                       "--baseline", str(baseline), "--out", str(tmp_path / "g")])
    assert result.exit_code == 2 and "stopped at the loader" in result.output, result.output
    assert asked[-1] == {"threads": 2, "device_map": "cpu"}
    for bad, flag in ((["--threads", "0"], "--threads"), (["--device-map", "gpu7"], "--device-map")):
        result = CliRunner().invoke(main, [*run, *bad, "--out", str(tmp_path / "c")])
        assert result.exit_code == 2 and flag in result.output, result.output
    assert len(asked) == 3  # refused before any model loads


def test_no_process_wide_choice_is_left():
    from evalgate.model_adapters.loading import placement

    assert not hasattr(threads, "request_threads") and not hasattr(placement, "request_device_map")
