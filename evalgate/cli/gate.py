"""`evalgate gate`: run the candidate kernel (or take a stored run), compare with the baseline, decide."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click
from click.core import ParameterSource

from evalgate.cli import preflight
from evalgate.cli.baseline_paths import resolve_baselines
from evalgate.cli.notes import skipped_local_policy
from evalgate.cli.options import (KERNEL, SamplingChoice, baselines_root_option, decision_options, grouped,
                                  note_resumable, run_options, sampling_options, server_options)
from evalgate.errors import EnvironmentFailure, UserError, describe_os_error


def _finish(verdict, report_dir: Path, stored_run: Path, rerun_flags: list[str], explain: bool = False) -> None:
    """Write the verdict's reports, then print it. Reports that cannot be written end the command with the
    environment code (4) after the verdict is printed (never lost) and the command that writes them from the
    stored run; a closed stdout (``| head``) loses only the printout. ``explain``: replay the flips first
    (docs/explain.md#from-the-gate)."""
    from evalgate.pipeline import gate_explanations
    from evalgate.report.explained import verdict_line
    from evalgate.report.outputs import write_outputs

    from evalgate.gate.stopped import verdict_text

    explained = gate_explanations(verdict, report_dir, explain)
    rerun_flags = [*rerun_flags, "--explain"] if explain else rerun_flags
    try:
        paths = write_outputs(verdict, report_dir, explained)
    except OSError as exc:
        what = describe_os_error(exc)
        if what is None:
            raise
        _print(verdict)
        click.get_current_context().meta.pop("evalgate.resume", None)  # the run is complete: nothing to resume
        command = shlex.join(["evalgate", "gate", "--candidate", str(stored_run), *rerun_flags,
                              "--report-dir", "DIR"])
        raise EnvironmentFailure(f"the verdict is {verdict_text(verdict)} (exit {verdict.exit_code}), but its "
                                 f"reports could not be written to {str(report_dir)!r} ({what}); write them "
                                 f"elsewhere with: {command}") from None
    try:
        _print(verdict)
        observed = " of the items run" if verdict.early_stop else ""
        from evalgate.report.rows import first_look_suffix

        for task, rows in (verdict.to_dict().get("flips") or {}).items():
            lost = sum(r["direction"] == "lost" for r in rows)
            click.echo(f"{task}: {lost} lost, {len(rows) - lost} gained{observed}{first_look_suffix(verdict, task)} "
                       f"(see {paths['markdown']})")
        why = verdict_line(verdict, explained, report_dir)
        if why:
            click.echo(why)
        click.echo(f"verdict: {verdict_text(verdict)}  (reports in {report_dir})")
    except BrokenPipeError:  # the reader went away (`| head`): the reports are written, the exit code stands
        pass
    sys.exit(verdict.exit_code)


def _print(verdict) -> None:
    from evalgate.report.text import print_verdict

    print_verdict(verdict)  # the reason first, then a table that fits a terminal, or a CI log without wrapped cells
    policy = verdict.thresholds
    click.echo(f"policy: {policy.path} ({policy.source}, sha256 {policy.sha256[:12]})")


# options that only shape a run the gate makes: given with --candidate they would be ignored
RUN_ONLY = ("model", "kernel", "tasks", "profiles", "limit", "batch_size", "device", "dtype", "max_new_tokens",
            "data_dir", "out", "no_early_stop", "model_id", "launch_timeout", "request_timeout", "concurrency",
            "retries")


def _explicit(name: str) -> bool:
    return click.get_current_context().get_parameter_source(name) not in (ParameterSource.DEFAULT, None)


@dataclass(frozen=True)
class DecisionChoice:
    """How the gate decides, as its flags give it: the baseline (folders, or its kernel under a baselines
    root), the policy file, whether an uncalibrated baseline is accepted, the items and serving pairing."""

    baselines: tuple = ()
    baseline_kernel: str = "w4a8"
    baselines_root: str | None = None
    thresholds: str | None = None
    allow_uncalibrated: bool = False
    items: str = "all"
    across_serving: bool = False

    def request(self, policy, **more):
        """The plan's request (``evalgate.plan.GateRequest``) with ``policy`` parsed and ``more`` of the run."""
        from evalgate.plan import GateRequest

        return GateRequest(baselines=self.baselines, baseline_kernel=self.baseline_kernel,
                           baselines_root=self.baselines_root, thresholds=policy,
                           allow_uncalibrated=self.allow_uncalibrated, items=self.items,
                           across_serving=self.across_serving, **more)

    def flags(self, root_given: bool) -> list[str]:
        """The flags that decide a stored run as this command decides it (for the hint that rewrites reports)."""
        flags = [f for b in self.baselines for f in ("--baseline", str(b))]
        if _explicit("baseline_kernel"):
            flags += ["--baseline-kernel", self.baseline_kernel]
        if root_given:
            flags += ["--baselines-root", str(self.baselines_root)]
        if self.thresholds:
            flags += ["--thresholds", str(self.thresholds)]
        flags += ["--allow-uncalibrated"] if self.allow_uncalibrated else []
        flags += ["--items", "candidate"] if _explicit("items") and self.items != "all" else []
        return flags + (["--across-serving"] if self.across_serving else [])


DECISION_FLAGS = {"baselines": "baselines", "baseline_kernel": "baseline_kernel", "baselines_root": "baselines_root",
                  "thresholds_path": "thresholds", "allow_uncalibrated": "allow_uncalibrated", "items": "items",
                  "across_serving": "across_serving"}


@click.command()
@run_options
@click.option("--kernel", type=KERNEL, default="w4a4_packed", show_default=True, help="Candidate kernel (see `evalgate kernels list`).")
@click.option("--candidate", type=click.Path(), default=None, help="Decide from this stored run (no model needed).")
@click.option("--baseline", "baselines", type=click.Path(), multiple=True, help="Baseline folder(s); default: the stored baseline for the model and the tasks' profiles.")
@click.option("--baseline-kernel", type=KERNEL, default="w4a8", show_default=True, help="The kernel the stored baseline was run with.")
@baselines_root_option()
@click.option("--thresholds", "thresholds_path", type=click.Path(), default=None, help="Policy file (default: $EVALGATE_THRESHOLDS, else the canary's own for canary runs, else ./thresholds.yaml, else the packaged one).")
@click.option("--out", type=click.Path(), default=None, help="Candidate run folder (default: results/runs/gate-<time>-<kernel>); a gate into the folder of an unfinished one resumes it.")
@click.option("--report-dir", type=click.Path(), default=None, help="Where gate.json, report.md, junit.xml go (default: <run>/gate).")
@click.option("--allow-uncalibrated", is_flag=True, help="Decide even if the baseline has no A/A calibration (recorded).")
@click.option("--no-early-stop", "no_early_stop", is_flag=True,
              help="Run every item, even once the FAIL is certain (default: stop generating then; docs/gate.md#stopping-early).")
@click.option("--max-samples", type=click.IntRange(min=1), default=None, help="While a task is undecided, add coupled samples per item in rounds up to this many (default 8; 1: no rounds; docs/gate.md#sequential-rounds).")
@decision_options
@click.option("--explain", is_flag=True, help="Replay every flip through both kernels and say why it flipped (near-tie or divergence, where), in the verdict and every report (docs/explain.md).")
@sampling_options
@server_options
@grouped("decision", DecisionChoice, DECISION_FLAGS)
def gate(run, kernel, candidate, decision, out, report_dir, no_early_stop, sampling, server, options,
         max_samples=None, explain=False):
    """Compare a candidate kernel with the stored W4A8 baseline and decide: PASS (exit 0), FAIL (1: the
    kernel is worse, or does not compute what it declares), INCONCLUSIVE (3: the data show neither; the
    verdict says how many samples would).

    With --server or --launch, the candidate runs on an OpenAI-compatible server; server arguments follow `--`.
    With --candidate, the gate decides from a stored run (no model needed). Rerunning an interrupted gate with
    the same --out resumes it."""
    settings = sampling.settings()
    # what can be checked before the heavy start (torch, the model, a server), within a second or two
    # parsed once, handed to the plan
    policy = preflight.thresholds_file(decision.thresholds)
    preflight.baselines_root(decision.baselines_root, _explicit("baselines_root"))
    baselines, named_root = resolve_baselines(decision.baselines, decision.baseline_kernel)
    decision = replace(decision, baselines=baselines)
    if named_root is not None:  # --baseline named a baselines root (or a model folder in one)
        if _explicit("baselines_root"):
            raise UserError("--baseline names a baselines root and so does --baselines-root; give one")
        decision = replace(decision, baselines_root=named_root)
    decision_flags = decision.flags(named_root is not None or _explicit("baselines_root"))
    if candidate:
        if server.served:
            raise UserError("--candidate decides from a stored run; drop --server/--launch")
        if settings != SamplingChoice().settings():
            raise UserError("--candidate decides from a stored run, made with its own sampling settings; drop "
                            "--samples/--temperature/--seed")
        ignored = [name for name in RUN_ONLY  # on the command line (an environment variable serves every command)
                   if click.get_current_context().get_parameter_source(name) is ParameterSource.COMMANDLINE]
        if ignored:  # settings given and ignored are an error
            flags = "/".join("--" + name.replace("_", "-") for name in ignored)
            raise UserError(f"--candidate decides from a stored run, made with its own settings; drop {flags}")
        preflight.stored_run(candidate)
        preflight.writable_folder(report_dir or Path(candidate) / "gate", "--report-dir")
        from evalgate.pipeline import gate as run_gate
        from evalgate.plan import plan_gate
        from evalgate.run.store import load_run

        plan = plan_gate(decision.request(policy, candidate=load_run(candidate), report_dir=report_dir,
                                          options=options))
        skipped_local_policy(plan.policy.source)
        _finish(run_gate(plan), plan.report_dir, Path(candidate), decision_flags, explain)
    if decision.items != "all":
        raise UserError("--items candidate decides a stored run on its own items: make it with `evalgate run "
                        "--limit N --out RUN`, then `evalgate gate --candidate RUN --items candidate`")
    if not server.served:
        preflight.model_folder(run.model)
    preflight.server(server.url)
    if out:  # before the plan's imports (pydantic, the policy: a second or two)
        preflight.writable_folder(out, "--out")
    if report_dir:
        preflight.writable_folder(report_dir, "--report-dir")
    from evalgate.plan import gate_out

    run_out = Path(out) if out else gate_out(kernel)
    preflight.writable_folder(run_out, "--out")

    from evalgate.run.runner import prepare_ahead
    from evalgate.run.spec import load_tasks

    served = server.served
    spec = run.spec(kernel, server.model_name(run.model) if served else None, settings, options.datasets)
    from evalgate.plan import checked_policy, planned_profiles

    # the policy covers these tasks and profiles: refused before the data are read, a server starts or the model loads
    policy = checked_policy(policy, planned_profiles(spec))
    skipped_local_policy(policy.source)
    if not (served or decision.baselines or spec.datasets):  # no stored baseline can match: told before the data are read
        from evalgate.plan import no_baseline_possible

        no_baseline_possible(spec, decision.baseline_kernel, decision.baselines_root)
    loaded = load_tasks(spec)  # the task data, read once
    preflight.free_space(run_out, preflight.run_bytes(sum(len(t.items) for t in loaded.values()), spec.samples),
                         "--out")
    if not (served or decision.baselines):  # a missing baseline is told before torch and the statistics load
        from evalgate.plan import missing_stored_baselines

        missing_stored_baselines(spec, loaded, decision.baseline_kernel, decision.baselines_root)
    with preflight.run_lock(run_out):
        prepare_ahead(loaded)  # the executor self-test runs beside the imports and the model's load

        from evalgate.model_adapters.server.errors import RESUME_HINT, ServerError
        from evalgate.pipeline import gate as run_gate  # imports torch: only when a model runs
        from evalgate.plan import plan_gate

        note_resumable(run_out, f"--out {shlex.quote(str(run_out))}")
        try:
            with server.adapter(run.model, kernel, run_out, run.batch_size, options.deterministic,
                                resume_hint=False) as adapter:
                plan = plan_gate(decision.request(
                    policy, spec=spec, tasks=loaded, out=run_out, report_dir=report_dir,
                    early_stop=not no_early_stop, served=served, max_samples=max_samples, options=options,
                    fingerprint=adapter.info()["fingerprint"] if adapter is not None else None))
                verdict = run_gate(plan, adapter)
        except ServerError as exc:  # the server went away mid-run: the environment, not the input
            raise EnvironmentFailure(str(exc).replace(f"; {RESUME_HINT}", "").replace(RESUME_HINT, "")) from None
    _finish(verdict, plan.report_dir, run_out, decision_flags, explain)
