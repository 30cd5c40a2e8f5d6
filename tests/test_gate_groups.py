"""`evalgate gate` takes its flags in groups (the run, the decision, sampling, the server, the run's options),
and the plan one request: every flag is still there, each reaches its group's field."""

from __future__ import annotations

import inspect

from click.testing import CliRunner

# every flag `evalgate gate` has taken (its --help), before and after the grouping
GATE_FLAGS = {
    "--across-serving", "--allow-uncalibrated", "--baseline", "--baseline-kernel", "--baselines-root", "--batch-size",
    "--candidate", "--concurrency", "--data-dir", "--dataset", "--deterministic", "--device", "--device-map",
    "--dtype", "--explain", "--items", "--kernel", "--launch", "--launch-timeout", "--limit", "--max-new-tokens",
    "--max-samples", "--model", "--model-id", "--no-early-stop", "--out", "--profile", "--report-dir",
    "--request-timeout", "--retries", "--root", "--samples", "--seed", "--server", "--tasks", "--temperature",
    "--threads", "--thresholds", "--no-deterministic"}


def _command_function(command):
    f = command.callback
    while hasattr(f, "__wrapped__"):
        f = f.__wrapped__
    return f


def test_the_gate_takes_its_flags_in_groups_and_the_plan_one_request():
    from evalgate.cli.gate import gate
    from evalgate.plan import GateRequest, plan_gate

    flags = {o for p in gate.params for o in [*p.opts, *p.secondary_opts]}
    assert flags >= GATE_FLAGS
    params = list(inspect.signature(_command_function(gate)).parameters)
    assert {"run", "decision", "sampling", "server", "options"} <= set(params) and len(params) <= 12
    assert list(inspect.signature(plan_gate).parameters) == ["request"]
    assert {"options", "thresholds", "baselines", "spec", "candidate"} <= set(GateRequest.__dataclass_fields__)


def test_each_flag_reaches_its_group(tmp_path, monkeypatch):
    # the plan a stored-candidate gate makes, stopped there: what each group handed it
    from evalgate.cli.main import main
    from evalgate.errors import UserError

    from synthetic_runs import write_pair

    base, cand = write_pair(tmp_path, n_gsm8k=20, n_humaneval=8)
    policy = tmp_path / "policy.yaml"
    policy.write_text("alpha: 0.05\ntasks:\n  gsm8k: {profile: gsm8k-lmeval-v3, metric: \"exact_match,strict-match\", "
                      "margin_pp: 20}\n  humaneval: {profile: humaneval-completion-codex, metric: pass@1, "
                      "margin_pp: 20}\n")
    seen = []

    def plan_gate(request):
        seen.append(request)
        raise UserError("stopped at the plan")

    monkeypatch.setattr("evalgate.plan.plan_gate", plan_gate)
    result = CliRunner().invoke(main, [
        "gate", "--candidate", str(cand), "--baseline", str(base), "--thresholds", str(policy),
        "--allow-uncalibrated", "--across-serving", "--baseline-kernel", "w4a8", "--report-dir", str(tmp_path / "r"),
        "--threads", "2", "--device-map", "cpu", "--no-deterministic"])
    assert result.exit_code == 2 and "stopped at the plan" in result.output, result.output
    (request,) = seen
    assert request.baselines == (str(base),) and request.thresholds is not None and request.allow_uncalibrated
    assert request.across_serving and request.items == "all" and request.candidate.path == cand
    assert str(request.report_dir) == str(tmp_path / "r")
    assert (request.options.threads, request.options.device_map, request.options.deterministic) == (2, "cpu", False)
