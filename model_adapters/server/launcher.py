"""Start an SGLang or vLLM server with one kernel selected, and stop it again.

How a kernel is selected depends on the engine and kernel-library versions (``engines.TABLE``: SGLang's
mega-MoE path with ``DG_*`` variables before 0.5.19 and ``--enable-w4a4-mxfp4-megamoe`` from 0.5.19; vLLM's
``--moe-backend=deep_gemm_mega_moe --enable-expert-parallel``, in dev mode so that it reports it), so
``served_adapter`` first reads that stack in the server's Python (``engines.probe_stack``) and checks the
launch against it (``engines.preflight``). ``plan_launch`` builds the command line and environment as plain data
(testable without SGLang) and refuses recipes that would run other numerics than the kernel named:
the docs/kernels.md#the-packed-fp4-hazard hazard (``DG_MEGA_MOE_FP4`` without ``DG_USE_FP4_ACTS``), FP8 combine (docs/kernels.md#not-emulated), and inherited variables
that would silently select another kernel. By default the engine also runs in its deterministic
(batch-invariant) mode, so dynamic batching cannot flip answers between A/A runs: SGLang
``--enable-deterministic-inference``, vLLM ``VLLM_BATCH_INVARIANT=1`` (``DETERMINISTIC``; ``--no-deterministic``
opts out, recorded). ``ServerProcess`` runs the plan as a child process group, waits for health, logs to
``server.log`` and always stops the group again (error, Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from evalgate.errors import UserError
from evalgate.kernels.registry import Kernel
from evalgate.model_adapters.server.engines import Selection, Stack, preflight, probe_stack, server_python, version_tuple

ENGINES = ("sglang", "vllm")
# EVALGATE_SGLANG_COMMAND / EVALGATE_VLLM_COMMAND replace the program part (a wrapper, another python, a stand-in).
DEFAULT_PROGRAMS = {"sglang": [sys.executable, "-m", "sglang.launch_server"], "vllm": ["vllm", "serve"]}

# Variables that select the MoE kernel. The kernel's recipe owns them: an inherited value may not override it.
SELECTING_VARS = ("DG_USE_FP4_ACTS", "DG_MEGA_MOE_FP4", "DG_USE_MXF4_KIND",
                  "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS", "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_MXF4_KIND")
# Each engine's deterministic (batch-invariant) mode, as its documentation names it:
#   SGLang: docs/advanced_features/deterministic_inference.md, server argument `--enable-deterministic-inference`
#           (ServerArgs.enable_deterministic_inference; since 0.5.3; FlashInfer, FA3 or Triton attention)
#   vLLM:   docs/features/batch_invariance.md, environment variable `VLLM_BATCH_INVARIANT=1` (since 0.11.1;
#           compute capability >= 8.0 in v0.32 docs, >= 9.0 in "latest")
DETERMINISTIC = {
    "sglang": {"flag": "--enable-deterministic-inference", "env": None, "since": "0.5.3",
               "doc": "https://docs.sglang.io/advanced_features/deterministic_inference.html"},
    "vllm": {"flag": None, "env": ("VLLM_BATCH_INVARIANT", "1"), "since": "0.11.1",
             "doc": "https://docs.vllm.ai/en/stable/features/batch_invariance/"},
}
# Launch variables recorded beside the kernel's: the engines' own switches and what changes GPU numerics.
ENGINE_ENV_PREFIXES = ("DG_", "SGLANG_", "VLLM_", "NCCL_", "TORCH_", "CUBLAS", "CUDA_", "NVIDIA_", "FLASHINFER_")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
# The variant of W4A4-old that uses kind::mxf4 (docs/kernels.md#kernels-at-a-glance): allowed from the environment when FP4 activations are on.
OPTIONAL_WITH_FP4_ACTS = ("DG_USE_MXF4_KIND", "SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_MXF4_KIND")


def is_on(value: str | None) -> bool:
    """How DeepGEMM / SGLang read a flag: unset, empty, 0, false, no, off mean off."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def logged_env(env: dict[str, str]) -> dict[str, str]:
    """Every variable that can change kernel numerics, for the manifest (docs/kernels.md#the-packed-fp4-hazard: log every DG_* variable)."""
    return {k: v for k, v in sorted(env.items()) if k.startswith(("DG_", "SGLANG_OPT_DEEPGEMM", "VLLM_DEEPGEMM"))}


def engine_env(env: dict[str, str]) -> dict[str, str]:
    """The launch environment's engine switches and numerics-relevant variables for the manifest (never
    anything that looks like a credential)."""
    return {k: v for k, v in sorted(env.items())
            if k.startswith(ENGINE_ENV_PREFIXES) and not any(w in k.upper() for w in SECRET_WORDS)}


def deterministic_setup(engine: str, on: bool, extra_args, env: dict[str, str]) -> tuple[list[str], dict, dict]:
    """(arguments to add, variables to set, the manifest's record) for ``engine``'s deterministic mode.

    On: SGLang gets ``--enable-deterministic-inference`` (unless already among the server arguments), vLLM
    ``VLLM_BATCH_INVARIANT=1`` (over any inherited value). Off (``--no-deterministic``): nothing is added; the
    record says whether the mode is on anyway (the flag after ``--``, an inherited variable)."""
    spec = DETERMINISTIC[engine]
    args, variables = [], {}
    if spec["flag"]:
        present = spec["flag"] in extra_args
        if on and not present:
            args.append(spec["flag"])
        effective, how = on or present, spec["flag"]
    else:
        name, value = spec["env"]
        if on:
            variables[name] = value
        effective, how = (on or is_on(env.get(name))), f"{name}={value}"
    record = {"requested": on, "on": effective, "how": how, "engine_min_version": spec["since"], "doc": spec["doc"]}
    return args, variables, record


# sgl-deep-gemm >= 0.1.7 reads these with int() and raises on any value but 0 (deep_gemm/mega/__init__.py)
LEGACY_REFUSED = ("DG_USE_FP4_ACTS", "DG_USE_MXF4_KIND")


def check_environment(env: dict[str, str], engine: str) -> None:
    """Refuse launch environments whose numerics are not any kernel evalgate knows (spec docs/kernels.md#not-emulated, docs/kernels.md#the-packed-fp4-hazard)."""
    if is_on(env.get("DG_MEGA_MOE_FP4")) and not is_on(env.get("DG_USE_FP4_ACTS")):
        raise UserError("DG_MEGA_MOE_FP4=1 without DG_USE_FP4_ACTS=1 feeds FP8-sized activation slots to the packed "
                        "FP4 kernel (docs/kernels.md#the-packed-fp4-hazard); set both, or neither")
    if is_on(env.get("DG_USE_FP8_COMBINE")):
        raise UserError("DG_USE_FP8_COMBINE=1 sends the L2 output as FP8 (different numerics, docs/kernels.md#the-moe-forward); "
                        "unset it before gating")
    if is_on(env.get("DG_USE_MXF4_KIND")) and not is_on(env.get("DG_USE_FP4_ACTS")):
        raise UserError("DG_USE_MXF4_KIND=1 needs DG_USE_FP4_ACTS=1 (docs/kernels.md#environment-variables); unset it or pick a W4A4 kernel")
    if engine == "sglang" and is_on(env.get("DG_USE_FP4_ACTS")) \
            and not is_on(env.get("SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS")):
        raise UserError("DG_USE_FP4_ACTS=1 without SGLANG_OPT_DEEPGEMM_MEGA_MOE_USE_FP4_ACTS=1: SGLang's pre-dispatch "
                        "would still write FP8 activations (docs/kernels.md#the-packed-fp4-hazard); set both")


def child_environment(kernel: Kernel, selection: Selection, stack: Stack, base_env: dict[str, str]) -> dict[str, str]:
    """``base_env`` with the kernel's variables over it, refusing inherited ones that select another kernel or
    that the installed kernel library refuses."""
    wanted = dict(selection.env)
    fp4_acts = is_on(wanted.get("DG_USE_FP4_ACTS"))
    for var in SELECTING_VARS:
        inherited = base_env.get(var)
        if is_on(inherited) and not is_on(wanted.get(var)) and not (fp4_acts and var in OPTIONAL_WITH_FP4_ACTS):
            raise UserError(f"the environment sets {var}={inherited}, which selects another kernel than "
                            f"{kernel.name!r}; unset it (the kernel's recipe sets what it needs)")
    if (version_tuple(stack.library_version) or (0,)) >= (0, 1, 7):
        for var in LEGACY_REFUSED:
            if var in base_env and base_env[var].strip() != "0":
                raise UserError(f"the environment sets {var}={base_env[var]!r}, which sgl-deep-gemm "
                                f"{stack.library_version} refuses at start; unset it")
    env = {**base_env, **wanted}
    check_environment(env, stack.engine)
    return env


@dataclass
class LaunchPlan:
    engine: str
    argv: list[str]
    env: dict[str, str]  # the whole child environment
    host: str
    port: int
    kernel: str
    warnings: list[str] = field(default_factory=list)
    deterministic: dict = field(default_factory=dict)
    stack: Stack | None = None
    selection: Selection | None = None
    source: str | None = None  # the kernel table row's engine source files

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def record(self) -> dict:
        """What the manifest keeps: the command, the kernel-selecting variables, the installed DeepGEMM."""
        stack = self.stack or Stack(self.engine)
        selection = self.selection or Selection()
        return {"engine": self.engine, "engine_version": stack.engine_version or "not installed",
                "argv": self.argv, "url": self.url, "deterministic": self.deterministic,
                "kernel_env": logged_env(self.env), "engine_env": engine_env(self.env),
                "sgl_deep_gemm": stack.library_version or "not installed", "stack": stack.record(),
                "selection": {"env": dict(selection.env), "flags": list(selection.flags),
                              "server_info": dict(selection.server_info),
                              "served_numerics": selection.served_numerics, "source": self.source},
                "warnings": self.warnings}


def program_for(engine: str, base_env: dict[str, str]) -> list[str]:
    """The program part of the command: EVALGATE_<ENGINE>_COMMAND, or the engine's own launcher."""
    override = base_env.get(f"EVALGATE_{engine.upper()}_COMMAND")
    return shlex.split(override) if override else list(DEFAULT_PROGRAMS[engine])


def plan_launch(engine: str, model: str, kernel: Kernel, port: int, host: str = "127.0.0.1",
                extra_args: tuple[str, ...] | list[str] = (), base_env: dict[str, str] | None = None,
                deterministic: bool = True, stack: Stack | None = None) -> LaunchPlan:
    """The command line and environment that start ``engine`` serving ``model`` with ``kernel`` on ``stack``
    (the versions ``probe_stack`` read; pure), after the preflight, in the engine's deterministic mode unless
    ``deterministic`` is False."""
    if engine not in ENGINES:
        raise UserError(f"unknown --launch engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    base_env = dict(os.environ if base_env is None else base_env)
    stack = stack or Stack(engine)
    for arg in extra_args:
        if arg.split("=", 1)[0] in ("--port", "--host", "--model-path", "--model"):
            raise UserError(f"{arg.split('=', 1)[0]} after `--` is chosen by evalgate; drop it from the server arguments")
    selection, row, preflight_warnings = preflight(kernel.name, stack, list(extra_args), base_env)
    env = child_environment(kernel, selection, stack, base_env)
    det_args, det_env, det_record = deterministic_setup(engine, deterministic, extra_args, env)
    env.update(det_env)
    program = program_for(engine, base_env)
    kernel_flags = [f for f in selection.flags if f not in extra_args]
    if engine == "sglang":
        argv = [*program, "--model-path", model, "--host", host, "--port", str(port), *det_args, *kernel_flags,
                *extra_args]
    else:
        argv = [*program, model, "--host", host, "--port", str(port), *det_args, *kernel_flags, *extra_args]
    warnings = list(preflight_warnings)
    installed = stack.engine_version
    if det_record["on"] and installed and version_tuple(installed) < version_tuple(det_record["engine_min_version"]):
        warnings.append(f"{engine} {installed} predates its deterministic mode ({det_record['how']}, "
                        f"{engine} >= {det_record['engine_min_version']}); upgrade it or pass --no-deterministic")
    if not det_record["on"]:
        warnings.append(f"{engine} runs without its deterministic mode (--no-deterministic): dynamic batching "
                        "can make A/A runs disagree (psi0 > 0)")
    return LaunchPlan(engine=engine, argv=argv, env=env, host=host, port=port, kernel=kernel.name, warnings=warnings,
                      deterministic=det_record, stack=stack, selection=selection, source=row.source if row else None)


def health_status(url: str) -> str:
    """What ``/health`` answers now: ``"200"``, another status code, or why there was no answer."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except (OSError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"unreachable ({type(reason).__name__})"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A launched server as a context manager: started, healthy inside the ``with``, stopped on the way out."""

    def __init__(self, plan: LaunchPlan, log_path: str | Path, health_timeout_s: float = 1800.0,
                 grace_s: float = 30.0):
        self.plan = plan
        self.log_path = Path(log_path)
        self.health_timeout_s = health_timeout_s
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self._old_sigterm = None
        self.ready_s = 0.0

    PROGRESS_S = 30.0

    def __enter__(self) -> "ServerProcess":
        self._catch_sigterm()
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._restore_sigterm()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n=== evalgate: {shlex.join(self.plan.argv)}\n=== kernel {self.plan.kernel}, "
                  f"{' '.join(f'{k}={v}' for k, v in logged_env(self.plan.env).items()) or 'no DG_* variables'}\n"
                  .encode())
        log.flush()
        try:
            # its own session: Ctrl-C at the terminal reaches evalgate only, and the whole group can be stopped
            self.proc = subprocess.Popen(self.plan.argv, env=self.plan.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise UserError(f"cannot start the {self.plan.engine} server ({self.plan.argv[0]}: {exc.strerror}); "
                            f"is {self.plan.engine} installed?") from None
        finally:
            log.close()

    def wait_healthy(self) -> None:
        """Until ``/health`` answers 200 (SGLang answers 503 through its warm-up while ``/v1/models`` already
        answers), with a progress line every ``PROGRESS_S`` seconds: loading a 150 GB model takes many minutes."""
        t0 = last_said = time.monotonic()
        status = "no answer"
        while time.monotonic() - t0 < self.health_timeout_s:
            code = self.proc.poll()
            if code is not None:
                raise UserError(f"the {self.plan.engine} server exited with code {code} before it was healthy: "
                                f"{self._last_log_line()} (full log: {self.log_path})")
            status = health_status(self.plan.url)
            if status == "200":
                self.ready_s = time.monotonic() - t0
                return
            if time.monotonic() - last_said >= self.PROGRESS_S:
                last_said = time.monotonic()
                print(f"evalgate: waiting for the {self.plan.engine} server: /health {status} after "
                      f"{last_said - t0:.0f} s of {self.health_timeout_s:.0f} s (log: {self.log_path})",
                      file=sys.stderr, flush=True)
            time.sleep(0.25)
        raise UserError(f"the {self.plan.engine} server at {self.plan.url} was not healthy after "
                        f"{self.health_timeout_s:.0f} s (/health: {status}; raise --launch-timeout, or see "
                        f"{self.log_path})")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after the grace period."""
        if self.proc is None or self.proc.returncode is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait()
        _signal_group(pgid, signal.SIGKILL)  # workers the server left behind (TP/DP ranks) go too

    def _last_log_line(self) -> str:
        try:
            lines = [l for l in self.log_path.read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return "no log"
        return lines[-1].strip()[:300] if lines else "empty log"

    def _catch_sigterm(self) -> None:
        # a cancelled CI job sends SIGTERM: unwind like Ctrl-C so the server is stopped and the manifest written
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def served_adapter(kernel: str, out: Path, server: str | None = None, launch: str | None = None,
                   model: str | None = None, model_id: str | None = None, server_args: tuple[str, ...] = (),
                   launch_timeout: float = 1800.0, deterministic: bool = True, resume_hint: bool = True,
                   **client_options):
    """The adapter of a server run: the server at ``server``, or one launched here for the run's lifetime.

    Yields None when neither is asked for (the runner's in-process default). A server failure names the run
    folder to resume.
    """
    from evalgate.model_adapters.server.openai_client import OpenAIAdapter, ServerError

    if server and launch:
        raise UserError("--server and --launch exclude each other: use a running server, or let evalgate start one")
    if server_args and not launch:
        raise UserError("server arguments after `--` need --launch (evalgate passes them to the server it starts)")
    if not server and not launch:
        yield None
        return
    try:
        if server:
            adapter = OpenAIAdapter(server, kernel, model_id=model_id, deterministic=deterministic,
                                    health_timeout=launch_timeout, **client_options)
            with contextlib.closing(adapter):
                yield adapter
            return
        if not model:
            raise UserError(f"--launch {launch} needs --model: the checkpoint path the server loads")
        from evalgate.kernels import get_kernel

        if launch not in ENGINES:
            raise UserError(f"unknown --launch engine {launch!r}; choose one of: {', '.join(ENGINES)}")
        env = dict(os.environ)
        stack = probe_stack(launch, server_python(program_for(launch, env), env), env)
        plan = plan_launch(launch, model, get_kernel(kernel), free_port(), extra_args=tuple(server_args),
                           base_env=env, deterministic=deterministic, stack=stack)
        for warning in plan.warnings:
            print(f"evalgate: warning: {warning}", file=sys.stderr)
        with ServerProcess(plan, Path(out) / "server.log", health_timeout_s=launch_timeout) as proc:
            record = {**plan.record(), "log": str(Path(out) / "server.log"), "ready_s": round(proc.ready_s, 1)}
            adapter = OpenAIAdapter(plan.url, kernel, model_id=model_id, launch=record, deterministic=deterministic,
                                    **client_options)
            with contextlib.closing(adapter):
                yield adapter
    except ServerError as exc:
        if not resume_hint:
            raise
        raise ServerError(f"{exc} --out {out}", exc.finished) from None
