"""Options and argument parsing shared by the commands (``run``, ``gate``, ``calibrate``, ``serve``)."""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass
from pathlib import Path

import click

from evalgate.errors import UserError

DEFAULT_BASELINES = "results/baselines"  # relative to the current directory
# in-process rows per decoding process: larger batches pay a step's fixed part (~52 ms on the canary, 2-core
# EPYC) for more rows; 128 with the baseline's answer lengths ended the default gate's decoding ~10% sooner
# than 64 (README "Measured"); no output depends on it
BATCH_SIZE = 128


class KernelName(click.ParamType):
    """A kernel name of `evalgate kernels list` (``multiple``: comma-separated names, converted to a list). An
    unknown name is a usage error (exit 2) on one line listing the known kernels, checked against
    ``evalgate.kernels.names`` and the installed packages' entry points; a kernel another package offers is
    checked as declared (no torch import: it answers before anything heavy loads)."""

    name = "kernel"

    def __init__(self, multiple: bool = False):
        self.multiple = multiple
        if multiple:
            self.name = "kernels"

    def convert(self, value, param, ctx):
        from evalgate.kernels.names import ALL, listed_names

        if value is None or isinstance(value, list):
            return value
        names = [v.strip() for v in value.split(",") if v.strip()] if self.multiple else [value]
        if not names:
            self.fail("is empty; name at least one kernel, comma-separated", param, ctx)
        for name in names:
            if name not in ALL:
                self._check_plugin(name, listed_names(), param, ctx)
        return names if self.multiple else value

    def _check_plugin(self, name, builtin, param, ctx):
        """A kernel another package offers (``evalgate.kernels.plugins``): its declaration is imported and
        checked now, its library looked for, all before torch loads."""
        from evalgate.errors import UserError
        from evalgate.kernels import plugins

        if not plugins.is_plugin(name):
            known = sorted(set(builtin) | set(plugins.plugin_names()))
            self.fail(f"unknown kernel {name!r}; choose one of: {', '.join(known)} "
                      "(see `evalgate kernels list`, or name your own as package.module:NAME)", param, ctx)
        try:
            plugins.require(name)
        except UserError as exc:
            self.fail(str(exc), param, ctx)


KERNEL = KernelName()  # --kernel, --baseline-kernel
KERNELS = KernelName(multiple=True)  # --kernels a,b,c


def decision_options(f):
    """How a stored candidate is paired with its baseline, shared by ``gate`` and ``report``."""
    f = click.option("--across-serving", is_flag=True,
                     help="Compare although the two runs' servers differ in serving identity (shared-expert fusion, "
                          "routed-scaling placement); the verdict says so (docs/serving.md).")(f)
    return click.option("--items", type=click.Choice(["all", "candidate"]), default="all", show_default=True,
                        help="'candidate': decide a stored run on its own items (a --limit run against the full "
                             "baseline, checked item by item; the policy's margins, the smaller n).")(f)


def baselines_root_option(dest: str = "baselines_root"):
    """The user's baselines root, ``--baselines-root`` in every command (``--root`` is kept as another name
    for it); the gate then falls back to the canary's packaged baselines (evalgate.run.baselines.lookup_roots)."""
    return click.option("--baselines-root", "--root", dest, type=click.Path(), default=DEFAULT_BASELINES, show_default=True,
                        envvar="EVALGATE_BASELINES",
                        help="Your baselines: where calibrate and `baseline record` write, and where the gate looks "
                             "first, before the built-in canary's (shipped with evalgate) [env: EVALGATE_BASELINES].")


def checked_device(ctx, param, value):
    """--device: a device name, and a GPU only where the machine has one (``preflight.device``)."""
    from evalgate.cli.preflight import device

    device(value, "--" + param.name.replace("_", "-"))
    return value


# the flags of how a run is carried out, and the RunOptions field each one fills
OPTION_FLAGS = {"dataset": "datasets", "device_map": "device_map", "threads": "threads",
                "deterministic": "deterministic"}


def _option_value(name: str, value):
    """A flag's value as its RunOptions field holds it, checked (one line, exit 2, for a bad one)."""
    if name == "dataset":
        from evalgate.tasks import task_names
        from evalgate.tasks.source import parse_dataset_options

        return parse_dataset_options(value or (), task_names())
    if name == "device_map" and value is not None:
        from evalgate.model_adapters.loading.placement import parse_device_map

        parse_device_map(value)
    return value


def collects_options(command):
    """The command takes its --dataset, --device-map, --threads and --deterministic as one ``options``
    (``evalgate.run.options.RunOptions``), whichever of them it has; the plan holds it, the runner and the
    model's loader get it from there."""

    @functools.wraps(command)
    def with_options(*args, **kwargs):
        from dataclasses import replace

        from evalgate.run.options import RunOptions

        given = {name: kwargs.pop(name) for name in OPTION_FLAGS if name in kwargs}
        options = kwargs.pop("options", None) or RunOptions()
        options = replace(options, **{OPTION_FLAGS[name]: _option_value(name, value) for name, value in given.items()})
        return command(*args, options=options, **kwargs)

    return with_options


def parse_tasks(value: str | None, default: str = "gsm8k") -> list[str]:
    value = default if value is None else value
    tasks = [t.strip() for t in value.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; name at least one task, e.g. --tasks gsm8k")
    return tasks


def parse_profiles(values: tuple[str, ...], tasks: list[str]) -> dict[str, str]:
    """``--profile NAME`` (the task is looked up) or ``--profile task=NAME``."""
    from evalgate.tasks import get_task

    chosen: dict[str, str] = {}
    for value in values:
        if "=" in value:
            task, name = value.split("=", 1)
            chosen[task] = name
            continue
        owners = [t for t in tasks if value in get_task(t).profiles]
        if not owners:
            known = ", ".join(p for t in tasks for p in get_task(t).profiles)
            raise UserError(f"unknown profile {value!r} for tasks {', '.join(tasks)}; choose from: {known}")
        chosen[owners[0]] = value
    return chosen


def default_out(kernel: str) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("results/runs") / f"{stamp}-{kernel.replace('/', '_')}"


def grouped(name: str, build, flags: dict[str, str]):
    """The command takes the values of ``flags`` (click parameter -> field) as one ``name`` = ``build(**fields)``."""
    def decorate(command):
        @functools.wraps(command)
        def with_group(*args, **kwargs):
            kwargs[name] = build(**{field: kwargs.pop(flag) for flag, field in flags.items()})
            return command(*args, **kwargs)

        return with_group

    return decorate


@dataclass(frozen=True)
class RunChoice:
    """What a run is asked to run, as ``run``, ``gate`` and ``calibrate`` take it: the model, the tasks and
    their profiles, how many items, the batch, device and dtype, a token limit, the data folder."""

    model: str | None = None
    tasks: str | None = None
    profiles: tuple = ()
    limit: int | None = None
    batch_size: int = BATCH_SIZE
    device: str = "cpu"
    dtype: str | None = None
    max_new_tokens: int | None = None
    data_dir: str | None = None

    def spec(self, kernel: str, name: str | None = None, sampling: dict | None = None, datasets: dict | None = None):
        """The RunSpec (``run_spec``; ``name``: a served model's, ``sampling``: ``SamplingChoice.settings()``)."""
        return run_spec(self.model, kernel, self.tasks, self.profiles, self.limit, self.batch_size, self.device,
                        self.dtype, self.max_new_tokens, self.data_dir, name, sampling, datasets)


RUN_FLAGS = {f: f for f in RunChoice.__dataclass_fields__}


def run_options(f):
    """Options shared by ``run``, ``gate`` and ``calibrate``: the command takes them as ``run`` (``RunChoice``)
    and ``options`` (``RunOptions``: --dataset, --device-map, --threads)."""
    decorators = [
        click.option("--model", "model", default=None, help="Local transformers checkpoint folder (default: the built-in canary)."),
        click.option("--tasks", default=None, help="Comma-separated tasks [default: gsm8k for run; gsm8k,humaneval for gate and calibrate]."),
        click.option("--profile", "profiles", multiple=True, help="Scoring profile, e.g. gsm8k-cot-8shot (or task=NAME). Repeatable."),
        click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N items of each task."),
        click.option("--batch-size", type=click.IntRange(min=1), default=BATCH_SIZE, show_default=True,
                     help="In-process rows decoded together per process (finished rows are refilled); with canonical "
                          "numerics no output depends on it."),
        click.option("--device", default="cpu", show_default=True, callback=checked_device, help="cpu, cuda, cuda:1..."),
        click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None, help="Override the checkpoint dtype."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=None, help="Override every profile's token limit (changes the profile id; for smoke runs)."),
        click.option("--data-dir", type=click.Path(), default=None, envvar="EVALGATE_DATA_DIR", help="Offline data folder laid out as in docs/scoring.md#data-directory [env: EVALGATE_DATA_DIR]."),
        click.option("--dataset", multiple=True, metavar="TASK=SOURCE",
                     help="A task's items from your own dataset, read by `datasets`: a save_to_disk folder, Parquet/JSONL/CSV "
                          "file(s) or a hub id OWNER/NAME[:CONFIG][@REV]; TASK.FIELD=COLUMN maps a column. Repeatable "
                          "(docs/scoring.md#your-own-dataset)."),
        click.option("--device-map", default=None,
                     help="Stream an FP4 checkpoint onto devices, experts kept packed: auto (every visible GPU), cpu, "
                          "or cuda:0,cuda:1; refused before loading, with the bytes needed and available, when it does not fit."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads of the in-process model [default: OMP_NUM_THREADS, else the cores this process may use, as many as the model's size profits from]."),
    ]
    f = collects_options(grouped("run", RunChoice, RUN_FLAGS)(f))
    for d in reversed(decorators):
        f = d(f)
    return f


@dataclass(frozen=True)
class SamplingChoice:
    """--samples, --temperature and --seed as given; ``settings()`` checks them (one line, exit 2)."""

    samples: int = 1
    temperature: float = 0.0
    seed: int | None = None

    def settings(self) -> dict:
        return sampling_settings(self.samples, self.temperature, self.seed)


def sampling_options(f):
    """k samples per item at temperature T from run seed S (``run`` and ``gate``; docs/scoring.md#k-samples);
    the command takes them as ``sampling`` (``SamplingChoice``)."""
    decorators = [
        click.option("--samples", type=click.IntRange(min=1), default=1, show_default=True, help="Samples per item (k); an item scores the mean over its samples. More than 1 needs --temperature > 0."),
        click.option("--temperature", type=click.FloatRange(min=0.0, max=100.0), default=0.0, show_default=True, help="Sampling temperature; 0 is greedy decoding. Samples are coupled across kernels: each (item, sample, position) draws keyed randomness."),
        click.option("--seed", type=click.IntRange(min=0), default=None, help="Run seed of the sampler [default: 0 when --temperature > 0]. Runs with different --samples, --temperature or --seed are not comparable."),
    ]
    f = grouped("sampling", SamplingChoice, {"samples": "samples", "temperature": "temperature", "seed": "seed"})(f)
    for d in reversed(decorators):
        f = d(f)
    return f


def sampling_settings(samples: int, temperature: float, seed: int | None) -> dict:
    """RunSpec's sampling fields, checked (one line, exit 2, for settings that cannot be run)."""
    from evalgate.run.samples import Sampling

    if seed is not None and temperature == 0:
        raise UserError("--seed only applies to sampling; add --temperature > 0 or drop --seed")
    sampling = Sampling(samples, float(temperature), 0 if seed is None else seed).check()
    return {"samples": sampling.samples, "temperature": sampling.temperature, "seed": sampling.seed}


@dataclass(frozen=True)
class ServerChoice:
    """The server a run's requests go to instead of the in-process model: a running one (``url``) or one to
    launch (``launch``: sglang or vllm, with ``args``), and how requests are sent to it."""

    url: str | None = None
    model_id: str | None = None
    launch: str | None = None
    launch_timeout: float = 1800.0
    request_timeout: float = 600.0
    concurrency: int = 64
    retries: int = 3
    args: tuple = ()

    @property
    def served(self) -> bool:
        return bool(self.url or self.launch)

    def model_name(self, model: str | None) -> str:
        """What ``RunSpec.model`` holds (``served_model_name``)."""
        return served_model_name(model, self.url, self.launch, self.model_id)

    def adapter(self, model, kernel, out, batch_size, deterministic: bool = True, resume_hint=True):
        """Context manager yielding the server adapter, or None for the in-process model."""
        return server_adapter(self.url, self.launch, model, kernel, out, self.model_id, self.args,
                              self.launch_timeout, self.request_timeout, self.concurrency, self.retries, batch_size,
                              deterministic, resume_hint)


SERVER_FLAGS = {"server": "url", "model_id": "model_id", "launch": "launch", "launch_timeout": "launch_timeout",
                "request_timeout": "request_timeout", "concurrency": "concurrency", "retries": "retries",
                "server_args": "args"}


def server_options(f):
    """Options of ``run``, ``gate`` and ``calibrate`` that drive an OpenAI-compatible server instead of the
    in-process model: the command takes them as ``server`` (``ServerChoice``), --deterministic in its
    ``options``."""
    decorators = [
        click.option("--server", default=None, metavar="URL", help="A running OpenAI-compatible server (SGLang, vLLM, evalgate serve) started with --kernel selected."),
        click.option("--model-id", default=None, help="The model name every request sends, whatever /v1/models lists (a warning when it is not listed); part of a server run's model identity."),
        click.option("--launch", type=click.Choice(["sglang", "vllm"]), default=None, help="Start this server on --model with the kernel's environment, stop it after; its arguments follow `--` [command: env EVALGATE_SGLANG_COMMAND / EVALGATE_VLLM_COMMAND]."),
        click.option("--launch-timeout", type=click.FloatRange(min=1), default=1800.0, show_default=True, help="Seconds a launched server has to become healthy."),
        click.option("--request-timeout", type=click.FloatRange(min=0.1), default=600.0, show_default=True, help="Seconds one server request may take."),
        click.option("--concurrency", type=click.IntRange(min=1), default=64, show_default=True, help="Server requests kept in flight, refilled as each one finishes (independent of --batch-size, which is the in-process model's)."),
        click.option("--retries", type=click.IntRange(min=0), default=3, show_default=True, help="Retries per request on connection errors, timeouts, 5xx and malformed answers."),
        click.option("--deterministic/--no-deterministic", default=True, show_default=True, help="Launch SGLang/vLLM in their deterministic (batch-invariant) mode, and warn when a --server's mode is off or unknown; --no-deterministic opts out (recorded)."),
        click.argument("server_args", nargs=-1, type=click.UNPROCESSED),
    ]
    f = collects_options(grouped("server", ServerChoice, SERVER_FLAGS)(f))
    for d in reversed(decorators):
        f = d(f)
    return f


def server_adapter(server, launch, model, kernel, out, model_id, server_args, launch_timeout, request_timeout,
                   concurrency, retries, batch_size, deterministic: bool = True, resume_hint=True):
    """Context manager yielding the server adapter, or None for the in-process model. ``deterministic``: the
    run's options' (--deterministic/--no-deterministic)."""
    from evalgate.model_adapters.server.launcher import served_adapter

    return served_adapter(kernel, out, server=server, launch=launch, model=model, model_id=model_id,
                          server_args=server_args, launch_timeout=launch_timeout, request_timeout=request_timeout,
                          concurrency=concurrency, retries=retries, batch_size=batch_size,
                          deterministic=deterministic, resume_hint=resume_hint)


def with_canary_profiles(model: str | None, task_list: list[str], chosen: dict[str, str]) -> dict[str, str]:
    """With no --model the canary runs, scored with its own profiles unless --profile says otherwise."""
    if model:
        from evalgate.cli.notes import full_profiles_on_canary

        full_profiles_on_canary(model, chosen, task_list)
        return chosen
    from evalgate.canary import PROFILES

    return {**{t: PROFILES[t] for t in task_list if t in PROFILES}, **chosen}


def resolve_model(model: str | None) -> str:
    if model:
        return model
    try:
        from evalgate.canary import canary_path
    except ImportError:
        raise UserError("no --model given and this install has no built-in canary model; pass --model PATH") from None
    return str(canary_path())


def served_model_name(model, server, launch, model_id) -> str:
    """What ``RunSpec.model`` holds: the checkpoint, or for a server run its name (identity is the fingerprint)."""
    if launch:
        return model or ""
    if server:
        return model_id or server
    return resolve_model(model)


def run_spec(model, kernel, tasks, profiles, limit, batch_size, device, dtype, max_new_tokens, data_dir, name=None,
             sampling: dict | None = None, datasets: dict | None = None):
    """The RunSpec of ``gate`` and ``calibrate``; ``sampling`` is ``sampling_settings(...)`` (default greedy),
    ``datasets`` the run's options' (--dataset)."""
    from evalgate.run.spec import RunSpec

    task_list = parse_tasks(tasks, default="gsm8k,humaneval")
    chosen = parse_profiles(profiles, task_list)
    if name is None:
        chosen = with_canary_profiles(model, task_list, chosen)
    return RunSpec(model=name or resolve_model(model), kernel=kernel, tasks=task_list,
                   profiles=chosen, limit=limit, batch_size=batch_size,
                   device=device, dtype=dtype, data_dir=data_dir, datasets=dict(datasets or {}),
                   max_new_tokens=max_new_tokens, **(sampling or {}))


RESUME_KEY = "evalgate.resume"


def note_resumable(out: str | Path, rerun: str) -> None:
    """Remember the run folder a command writes and the flags that resume it, for the one line an
    interruption or an environment failure ends with (``resume_note``)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[RESUME_KEY] = (str(out), rerun)


def resume_note(ctx) -> str:
    """"; finished items in 'X' are kept: run the same command with --out X to resume", or "" before a run
    folder was chosen or before the run stored anything (nothing to resume: the same command starts again)."""
    noted = ctx.meta.get(RESUME_KEY)
    if not noted:
        return ""
    out, rerun = noted
    if not (Path(out) / "manifest.json").is_file():
        return ""
    return f"; finished items in {out!r} are kept: run the same command with {rerun} to resume"
