"""OpenAI-compatible server adapter (SGLang, vLLM, `evalgate serve`): same interface as ``HFAdapter``.

Completions (chat completions for chat profiles), greedy or sampled, from a bounded pool of in-flight requests that
refills as each request finishes (``dispatch``: continuous, never batch-synchronous), retries with
exponential backoff on what a restart or a retry can fix (connection errors, timeouts, 5xx, 429, malformed
JSON), then one clear error. Every request carries its own seed, derived from the run seed, the item and
the sample index (``request_seed``); a sampled request also its temperature, and its seed is the stream seed
``evalgate serve`` keys its sampler with, so a served run draws the samples an in-process run draws
(vLLM and SGLang take the seed too; whether their samples stay coupled across kernels:
docs/serving.md#per-request-seeds). Items that finished before a failure are handed over as they finish
(``dispatch``) or on the exception (``generate``: ``exc.finished``), so the runner stores them and
``--resume`` redoes only the rest.

A server has no local checkpoint, so the model identity (``fingerprint``) is built from what the server
says about itself. Before the first request the client waits for ``/health`` (503 while an engine warms
up), then checks the kernel against what the server reports (``verification.check_kernel``): a server
that reports another kernel is refused; one that reports nothing that tells is recorded as
``kernel_verified: false`` (status ``unverified``) with the reason, and the verdict says so. What the server says about its deterministic mode (SGLang's
``enable_deterministic_inference``, or the launch plan when evalgate started it) goes into the manifest;
evalgate warns when it is off or unknown (docs/serving.md#deterministic-engines). Transport: ``http.client``
connections kept alive for the whole run, one per request in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import platform
import queue
import select
import ssl
import sys
import threading
import time
from collections import deque
from urllib.parse import urlsplit

from evalgate.version import __version__
from evalgate.errors import UserError
from evalgate.model_adapters.stops import cut_at_stop
from evalgate.model_adapters.sample_seeds import SEED_RULE, sample_seed
from evalgate.model_adapters.server.errors import RESUME_HINT, ServerError  # noqa: F401  (raised here)
from evalgate.model_adapters.server.verification import CONTRADICTED, UNVERIFIED, check_kernel
from evalgate.types import AdapterBase, Generation, Request

# Server settings that can change numerics; hashed into the fingerprint. Ports, seeds, paths of logs and
# memory-dependent sizes are left out so a restarted server keeps its identity.
IDENTITY_KEYS = ("model_path", "tokenizer_path", "revision", "dtype", "quantization", "kv_cache_dtype",
                 "load_format", "tp_size", "dp_size", "ep_size", "pp_size", "enable_dp_attention",
                 "moe_a2a_backend", "moe_runner_backend", "attention_backend", "speculative_algorithm", "version",
                 "enable_deterministic_inference")
STOP_REASONS = {"stop": "stop", "eos": "stop", "content_filter": "stop", "tool_calls": "stop",
                "function_call": "stop", "length": "length"}
API_KEY_ENV = "EVALGATE_SERVER_API_KEY"  # sent as a bearer token when set; never recorded


class _Retryable(Exception):
    """A failure that another attempt may not repeat."""


class _Aborted(Exception):
    """Another request failed for good: stop this one."""


def request_seed(run_seed: int, doc_id, sample: int = 0) -> int:
    """The seed sent with one (item, sample) request: ``sampling.sample_seed``, a stable 31-bit hash of the run
    seed, the item's doc id and the sample index, so a sample draws the same randomness whatever the batch,
    order or kernel (on engines that honour per-request seeds: docs/serving.md#per-request-seeds)."""
    return sample_seed(run_seed, doc_id, sample)


def normalize_url(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--server {url!r} is not an http(s) URL; pass e.g. http://gpu-node:30000")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def _warn(message: str) -> None:
    print(f"evalgate: warning: {message}", file=sys.stderr, flush=True)


class OpenAIAdapter(AdapterBase):
    """Generates for evalgate's requests through an OpenAI-compatible HTTP API (its kernel is out of reach:
    no conformance record)."""

    kind = "openai"
    serving = "dispatch"

    def __init__(self, url: str, kernel_name: str, model_id: str | None = None, concurrency: int = 64,
                 request_timeout: float = 600.0, retries: int = 3, backoff_s: float = 1.0, batch_size: int = 8,
                 seed: int = 0, launch: dict | None = None, deterministic: bool = True,
                 health_timeout: float = 1800.0):
        t0 = time.perf_counter()
        self.url = normalize_url(url)
        from evalgate.kernels.catalogs import get_kernel  # torch: only once a server is used

        self.kernel = get_kernel(kernel_name)
        self.model_id = model_id
        self.concurrency = concurrency
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self.seed = seed
        self.launch = launch
        self.deterministic_requested = deterministic
        self.warnings: list[str] = []
        self._connections = Connections(self.url, request_timeout)
        if launch is None:  # a launched server was waited for already
            self._wait_healthy(health_timeout)
        self.described = self._describe_server()
        self.served_model = self._pick_served_model(self.described["models"])
        self.determinism = self._determinism()
        self.kernel_check = check_kernel(self.kernel.name, self.described["server_info"], self.described["version"],
                                         launch)
        if self.kernel_check.status == CONTRADICTED and self.kernel_check.engine != "evalgate":
            raise UserError(f"server {self.url} contradicts --kernel {self.kernel.name}: {self.kernel_check.why}; "
                            "gate the kernel it runs, or restart it with the one to gate")
        if self.kernel_check.status == UNVERIFIED:
            self.warnings.append(f"server {self.url}: kernel {self.kernel.name} unverified: {self.kernel_check.why}")
        for warning in self.warnings:
            _warn(warning)
        self.load_s = time.perf_counter() - t0

    HEALTH_PROGRESS_S = 30.0

    def _wait_healthy(self, timeout_s: float) -> None:
        """Wait while ``/health`` answers 503 (an engine still loading or warming up), with a progress line;
        a server without ``/health`` (404) or one not answering at all goes on to the model list, which says so."""
        t0 = last_said = time.monotonic()
        while True:
            try:
                with self._connections.lend() as conn:
                    status = conn.request("GET", "/health")[0]
            except TRANSPORT_ERRORS:
                return
            if status != 503:
                return
            waited = time.monotonic() - t0
            if waited >= timeout_s:
                raise UserError(f"server {self.url}: /health still answers 503 after {timeout_s:.0f} s; wait for it "
                                "to finish loading, or raise --launch-timeout")
            if time.monotonic() - last_said >= self.HEALTH_PROGRESS_S:
                last_said = time.monotonic()
                print(f"evalgate: waiting for {self.url}: /health 503 after {waited:.0f} s of {timeout_s:.0f} s",
                      file=sys.stderr, flush=True)
            time.sleep(min(0.25, max(0.05, timeout_s - waited)))

    def close(self) -> None:
        self._connections.close()

    # ---- what the server says about itself ----

    def _describe_server(self) -> dict:
        models = self._model_list()
        server_info = None
        for path in ("/server_info", "/get_server_info"):  # SGLang (newer, older); vLLM only in dev mode
            server_info = self._get_json(path)
            if isinstance(server_info, dict):
                break
        if isinstance(server_info, dict) and isinstance(server_info.get("vllm_config"), str):
            # vLLM's dev-mode /server_info prints its configuration as text unless asked for JSON
            as_json = self._get_json("/server_info?config_format=json")
            server_info = as_json if isinstance(as_json, dict) else server_info
            server_info.pop("system_env", None)  # the host's whole software inventory: not the kernel's business
        return {"models": models, "server_info": server_info if isinstance(server_info, dict) else None,
                "model_info": self._get_json("/get_model_info"),  # SGLang
                "version": self._get_json("/version")}  # vLLM (SGLang has it too)

    def _model_list(self):
        """``/v1/models``. With ``--model-id`` a server whose list fails (``transformers serve`` answers 500
        without a hub cache) is still used: the id given is what requests name. Unreachable is an error."""
        if self.model_id is not None:
            try:
                status, body = self._http("GET", "/v1/models", None)
            except TRANSPORT_ERRORS:
                status, body = None, b""  # unreachable: the retrying call below says so clearly
            if status is not None:
                try:
                    models = json.loads(body) if status == 200 else None
                except ValueError:
                    models = None
                if models is None:
                    answer = " ".join(filter(None, (f"HTTP {status}", _error_text(body))))
                    self.warnings.append(f"server {self.url}: /v1/models answered {answer}; "
                                         f"using --model-id {self.model_id!r} as given")
                return models
        return self._call("/v1/models", None, None, what="the model list", parse=lambda d: d)[0]

    def _pick_served_model(self, models) -> str:
        if models is None and self.model_id is not None:
            return self.model_id
        try:
            ids = [m["id"] for m in models["data"]]
        except (KeyError, TypeError):
            if self.model_id is not None:
                self.warnings.append(f"server {self.url}: /v1/models answered {str(models)[:120]!r}, not an OpenAI "
                                     f"model list; using --model-id {self.model_id!r} as given")
                return self.model_id
            raise UserError(f"server {self.url}: /v1/models answered {str(models)[:200]!r}, not an OpenAI model list") from None
        if self.model_id is not None:  # the id given is what requests name, whatever the list says
            if self.model_id not in ids:
                self.warnings.append(f"server {self.url} lists {len(ids)} model(s) ({', '.join(ids) or 'none'}), not "
                                     f"--model-id {self.model_id!r}; sending {self.model_id!r} as given")
            return self.model_id
        if len(ids) == 1:
            return ids[0]
        raise UserError(f"server {self.url} serves {len(ids)} models ({', '.join(ids) or 'none'}); "
                        "pass --model-id one of them")

    def _models_data(self) -> list:
        models = self.described["models"]
        data = models.get("data") if isinstance(models, dict) else None
        return data if isinstance(data, list) else []

    def identity(self) -> dict:
        """What makes two server runs the same model: names, path, numerics-relevant settings, versions."""
        info = self.described["server_info"] or {}
        model_info = self.described["model_info"] if isinstance(self.described["model_info"], dict) else {}
        entry = next((m for m in self._models_data() if isinstance(m, dict) and m.get("id") == self.served_model), {})
        settings = {k: info[k] for k in IDENTITY_KEYS if k in info}
        version = self.described["version"]
        return {
            "model_id": self.model_id or self.served_model,
            "served_model": self.served_model,
            "model_path": info.get("model_path") or model_info.get("model_path") or entry.get("root"),
            "server_settings_sha256": _sha(settings) if settings else None,
            "server_version": version.get("version") if isinstance(version, dict) else None,
            "evalgate_model_fingerprint": ((info.get("evalgate") or {}).get("model") or {}).get("fingerprint"),
        }

    def _determinism(self) -> dict:
        """Is the server in its deterministic (batch-invariant) mode? From the launch plan when evalgate started
        it, else from what the server reports (SGLang's ``enable_deterministic_inference``); vLLM does not say."""
        info = self.described["server_info"] or {}
        reported = info.get("enable_deterministic_inference")
        reported = reported if isinstance(reported, bool) else None
        launched = (self.launch or {}).get("deterministic") if self.launch else None
        if launched is not None:
            state = "on" if launched.get("on") else "off"
            source = f"launch: {launched.get('how')}"
            if reported is not None and reported != launched.get("on"):
                self.warnings.append(f"server {self.url} reports enable_deterministic_inference={reported}, but "
                                     f"was launched with deterministic mode {state}")
                state = "on" if reported else "off"
        elif reported is not None:
            state, source = ("on" if reported else "off"), "server_info.enable_deterministic_inference"
        else:
            state, source = "unknown", "the server does not report a deterministic mode"
        out = {"state": state, "requested": self.deterministic_requested, "source": source}
        if self.deterministic_requested and state != "on":
            out["warning"] = (f"server {self.url}: deterministic mode is {state}; dynamic batching can make A/A "
                              "runs disagree (psi0 > 0). Start the server in its deterministic mode (SGLang "
                              "--enable-deterministic-inference, vLLM VLLM_BATCH_INVARIANT=1) or let evalgate start "
                              "it (--launch); --no-deterministic records the choice and silences this")
            self.warnings.append(out["warning"])
        return out

    def _reported_kernel(self) -> str | None:
        info = self.described["server_info"] or {}
        return ((info.get("evalgate") or {}).get("kernel") or {}).get("name")

    def info(self) -> dict:
        identity = self.identity()
        reported = self._reported_kernel()
        if reported is not None and reported != self.kernel.name:
            raise UserError(f"server {self.url} reports kernel {reported!r}, not --kernel {self.kernel.name!r}; "
                            "pass the kernel it runs, or restart it with the one to gate")
        info = self.described["server_info"] or {}
        return {
            "adapter": self.kind,
            "server": self.url,
            "model_id": identity["model_id"],
            "served_model": self.served_model,
            "fingerprint": _sha(identity)[:16],
            "identity": identity,
            "model_type": info.get("model_type") or "served",
            "dtype": info.get("dtype"),
            "kernel_claimed": self.kernel.name,
            "kernel_verified": self.kernel_check.verified,
            "kernel_note": self.kernel_check.why,
            "kernel_check": self.kernel_check.record(),
            "served_numerics": self.kernel_check.serving.get("served_numerics"),
            # compared between baseline and candidate (gate/compare.py): the kernel may differ, this may not
            "serving_identity": {k: v for k, v in self.kernel_check.serving.items() if k != "served_numerics"} or None,
            "launch": self.launch,
            "server_reported": self.described,
            "determinism": self.determinism,
            "warnings": list(self.warnings),
            "dispatch": "continuous",
            "concurrency": self.concurrency,
            "request_timeout_s": self.request_timeout,
            "retries": self.retries,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "seed_rule": SEED_RULE,
            "evalgate_client": __version__,
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
        }

    # ---- generation ----

    def dispatch(self, requests: list[Request]) -> "Dispatch":
        """Continuous dispatch: ``--concurrency`` requests in flight, refilled as each finishes; iterate the
        result for the (request, generation) pairs in the order they finish."""
        return Dispatch(self, requests)

    def generate(self, requests: list[Request]) -> list[Generation]:
        """One Generation per request, in order; on failure raises with the finished ones on ``exc.finished``."""
        index = {id(r): i for i, r in enumerate(requests)}
        finished: dict[int, Generation] = {}
        run = self.dispatch(requests)
        try:
            for chunk in run:
                for request, gen in chunk:
                    finished[index[id(request)]] = gen
        except BaseException as exc:
            for request, gen in run.close():
                finished[index[id(request)]] = gen
            if isinstance(exc, ServerError):
                raise ServerError(str(exc), finished) from exc.__cause__
            exc.finished = dict(finished)
            raise
        return [finished[i] for i in range(len(requests))]

    def _complete(self, request: Request, abort: threading.Event) -> Generation:
        chat = bool(request.messages)
        # a sampled request carries its stream seed (the runner derived it from the run seed); a greedy one
        # gets the adapter's, which the engine ignores at temperature 0
        seed = request.seed if request.seed is not None else request_seed(self.seed, request.doc_id, request.sample)
        payload = {"model": self.served_model, "max_tokens": request.max_new_tokens,
                   "temperature": float(request.temperature), "top_p": 1.0, "n": 1, "seed": seed, "stream": False}
        if chat:
            payload["messages"] = [dict(m) for m in request.messages]
        else:
            payload["prompt"] = request.prompt
        if request.stop:
            payload["stop"] = list(request.stop)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        data, attempts = self._call(path, payload, abort, what=f"item {request.doc_id!r}",
                                    parse=lambda d: _parse_choice(d, chat))
        text, reason, stop_hit, usage = data
        cut, hit = cut_at_stop(text, request.stop)  # servers strip the stop string already; be sure
        if hit is not None:
            text, reason, stop_hit = cut, "stop", hit
        return Generation(text=text, finish_reason=reason, stop_hit=stop_hit,
                          n_prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          n_tokens=int(usage.get("completion_tokens") or 0),
                          latency_s=time.perf_counter() - t0, extra={"attempts": attempts})

    def _call(self, path: str, payload: dict | None, abort: threading.Event | None, what: str, parse):
        """POST (or GET when ``payload`` is None) with retries; returns (parsed, attempts)."""
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), 60.0)
                if abort is not None and abort.wait(delay):
                    raise _Aborted()
                if abort is None:
                    time.sleep(delay)
            if abort is not None and abort.is_set():
                raise _Aborted()
            try:
                status, body = self._http("POST" if payload is not None else "GET", path, payload)
                if status >= 500 or status == 429:
                    raise _Retryable(f"HTTP {status} {_error_text(body)}")
                if status >= 400:  # our request is wrong: another attempt gets the same answer
                    raise UserError(f"server {self.url} refused {what} on {path}: HTTP {status} {_error_text(body)}")
                try:
                    return parse(json.loads(body)), attempt + 1
                except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                    raise _Retryable(f"malformed response ({type(exc).__name__}: {exc}): {body[:120]!r}") from None
            except _Retryable as exc:
                last = str(exc)
            except TimeoutError:
                last = f"no answer within --request-timeout {self.request_timeout:g} s"
            except TRANSPORT_ERRORS as exc:  # refused, reset, dropped mid-response
                last = _transport_error(exc)
        # the server, not the input: the command line ends with the environment code (4)
        hint = RESUME_HINT if what.startswith("item") else "check that the server is up and serving, then rerun"
        raise ServerError(f"server {self.url} failed {what} on {path} after {self.retries + 1} attempts: {last}; "
                          f"{hint}")

    def _http(self, method: str, path: str, payload: dict | None) -> tuple[int, bytes]:
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json"} if body is not None else None
        with self._connections.lend() as conn:
            return conn.request(method, path, body, headers)

    def _get_json(self, path: str, required: bool = False):
        """GET ``path`` as JSON; None when the server has no such endpoint (only ``required`` ones retry)."""
        if required:
            return self._call(path, None, None, what="the model list", parse=lambda d: d)[0]
        try:
            status, body = self._http("GET", path, None)
            return json.loads(body) if status == 200 else None
        except (*TRANSPORT_ERRORS, ValueError):
            return None



class Dispatch:
    """A bounded pool of in-flight requests that refills as each one finishes (continuous dispatch).

    ``concurrency`` worker threads each take the next request as soon as their previous one is answered, so
    the server always holds ``concurrency`` requests until the queue runs dry (the tail), and no request waits
    for a slower neighbour. Iterating yields lists of (request, generation) pairs as they finish (everything
    finished since the previous yield). A request that fails for good stops new ones from starting; the
    requests in flight may still finish and are yielded, then ``ServerError`` is raised. ``close()`` stops the
    pool and returns what finished but was not yet handed over (Ctrl-C). ``stats()`` tells how full the pool
    was: ``in_flight_at_refill`` holds, for every request started after the first ``concurrency``, how many
    were in flight once it had started (a finished request and its successor swap places under one lock).
    An empty list is yielded after ``TICK_S`` seconds without a result.
    """

    TICK_S = 0.25

    def __init__(self, adapter: OpenAIAdapter, requests: list[Request]):
        self.adapter = adapter
        self.requests = list(requests)
        self.concurrency = max(1, min(adapter.concurrency, len(self.requests) or 1))
        self._jobs = deque(self.requests)
        self._lock = threading.Lock()
        self._results: queue.Queue = queue.Queue()
        self._abort = threading.Event()
        self._in_flight = 0
        self._started = 0
        self._events: list[tuple[float, int]] = []  # (time, requests in flight) after every change
        self.in_flight_at_refill: list[int] = []
        self._t0 = time.perf_counter()
        self._tail_t: float | None = None
        self._failure: tuple[Request, BaseException] | None = None
        # the first ``concurrency`` requests enter the pool at once, each with its thread; daemon threads:
        # Ctrl-C must not wait for requests in flight
        first = [self._next(finished=False) for _ in range(self.concurrency if self.requests else 0)]
        self._threads = [threading.Thread(target=self._worker, args=(request,), daemon=True,
                                          name=f"evalgate-request-{n}") for n, request in enumerate(first)]
        for t in self._threads:
            t.start()

    def _next(self, finished: bool) -> Request | None:
        """Under one lock: the request that just finished leaves the pool and the next one enters it, so the
        pool stays full until the queue runs dry (the tail) whatever the threads' scheduling."""
        with self._lock:
            if finished:
                self._in_flight -= 1
            now = time.perf_counter()
            if self._abort.is_set() or not self._jobs:
                self._events.append((now, self._in_flight))
                return None
            request = self._jobs.popleft()
            self._in_flight += 1
            self._started += 1
            self._events.append((now, self._in_flight))
            if self._started > self.concurrency:
                self.in_flight_at_refill.append(self._in_flight)
            if not self._jobs:
                self._tail_t = now  # the last request has started: the tail begins
            return request

    def _worker(self, request: Request | None) -> None:
        while request is not None:
            try:
                gen = self.adapter._complete(request, self._abort)
                result = (request, gen, None)
            except BaseException as exc:  # reported to the consumer, which raises it
                if not isinstance(exc, _Aborted):
                    self._abort.set()  # start nothing new; requests in flight may still finish and are kept
                result = (request, None, exc)
            request = self._next(finished=True)
            self._results.put(result)

    def _drain(self, block: bool) -> list[tuple[Request, Generation]]:
        """Everything finished so far (when ``block``, waiting up to ``TICK_S`` for at least one result)."""
        chunk = []
        deadline = time.monotonic() + self.TICK_S
        while True:
            try:
                request, gen, exc = self._results.get(timeout=0.05) if block and not chunk else self._results.get_nowait()
            except queue.Empty:
                if block and not chunk and time.monotonic() < deadline and any(t.is_alive() for t in self._threads):
                    continue
                return chunk
            if gen is not None:
                chunk.append((request, gen))
            elif not isinstance(exc, _Aborted) and self._failure is None:
                self._failure = (request, exc)

    def __iter__(self):
        try:
            while True:
                chunk = self._drain(block=True)
                if not chunk and not any(t.is_alive() for t in self._threads) and self._results.empty():
                    break
                yield chunk  # empty after TICK_S without a result: the consumer may store what it holds
        finally:
            self._abort.set()
        if self._failure is not None:
            request, exc = self._failure
            if isinstance(exc, UserError):
                raise ServerError(str(exc)) from None
            raise ServerError(f"server {self.adapter.url}: unexpected failure on item {request.doc_id!r}: "
                              f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> list[tuple[Request, Generation]]:
        """Stop starting requests; what finished but was not handed over yet."""
        self._abort.set()
        return self._drain(block=False)

    def stats(self) -> dict:
        """How full the pool was: time-weighted mean in flight until the tail, and the minimum at a refill."""
        end = self._tail_t if self._tail_t is not None else time.perf_counter()
        area, start = 0.0, None
        for (t, level), (t_next, _) in zip(self._events, self._events[1:] + [(end, 0)]):
            if start is None:
                start = t
            if t >= end:
                break
            area += level * (min(t_next, end) - t)
        span = (end - start) if start is not None else 0.0
        return {"concurrency": self.concurrency, "requests": len(self.requests), "started": self._started,
                "mean_in_flight_until_tail": round(area / span, 2) if span > 0 else float(self.concurrency),
                "min_in_flight_at_refill": min(self.in_flight_at_refill, default=self.concurrency),
                "tail_s": round(time.perf_counter() - end, 3) if self._tail_t is not None else None}


def _parse_choice(data: dict, chat: bool) -> tuple[str, str, str | None, dict]:
    choice = data["choices"][0]
    text = (choice["message"].get("content") or "") if chat else choice["text"]
    if not isinstance(text, str):
        raise TypeError(f"response text is {type(text).__name__}")
    raw = choice.get("finish_reason")
    if raw == "abort":  # SGLang aborted the request (e.g. a scheduler restart): worth another attempt
        raise _Retryable("the server aborted the request")
    if raw not in STOP_REASONS:
        raise ValueError(f"finish_reason {raw!r}")
    # which stop string ended the text: SGLang says matched_stop, vLLM stop_reason (an int is an EOS token id)
    hit = choice.get("matched_stop", choice.get("stop_reason"))
    usage = data.get("usage") or {}
    return text, STOP_REASONS[raw], hit if isinstance(hit, str) else None, usage


class Connection:
    """One kept-alive HTTP/1.1 connection (``http.client``: about 0.6 ms less CPU per request than an httpx
    client, which counts on a two-core runner driving a server at concurrency 16). A connection the server
    closed while it sat idle (its socket reads as ready: end of stream) is opened again before the request is
    sent, as keep-alive clients do; a request is never sent twice here: failures are the caller's to retry."""

    def __init__(self, url: str, timeout: float, headers: dict, tls: ssl.SSLContext):
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout, self.headers, self.tls = timeout, headers, tls
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, bytes]:
        if self._conn is not None and self._conn.sock is not None and select.select([self._conn.sock], [], [], 0)[0]:
            self.close()  # idle and readable: the server closed it (or sent what no request asked for)
        if self._conn is None:
            self._conn = (http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.tls)
                          if self.https else http.client.HTTPConnection(self.host, self.port, timeout=self.timeout))
        try:
            self._conn.request(method, self.prefix + path, body=body, headers={**self.headers, **(headers or {})})
            resp = self._conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if resp.will_close:
            self.close()
        return resp.status, data

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class Connections:
    """The run's kept-alive connections, each lent to one request at a time and returned after it, so a
    connection is opened only when more requests are in flight than ever before (no request opens one after
    the first ``concurrency`` have), and never dropped for sitting idle: a run that pauses on a loaded machine,
    or to score, finds its connections where it left them."""

    def __init__(self, url: str, request_timeout: float):
        self.url, self.request_timeout = url, request_timeout
        self._free: list[Connection] = []
        self._all: list[Connection] = []
        self._lock = threading.Lock()
        self._tls = ssl.create_default_context()  # one for all: loading the CA bundle costs ~18 ms

    @contextlib.contextmanager
    def lend(self):
        with self._lock:
            conn = self._free.pop() if self._free else self._open()
        try:
            yield conn
        finally:
            with self._lock:
                self._free.append(conn)

    def _open(self) -> Connection:
        headers = {"Accept": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        conn = Connection(self.url, self.request_timeout, headers, self._tls)
        self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
            self._free.clear()


TRANSPORT_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, dropped mid-response, timed out


def _transport_error(exc: BaseException) -> str:
    """The innermost cause of a transport failure (e.g. ``ConnectionRefusedError``), named with its message."""
    inner = exc
    while (inner.__cause__ or inner.__context__) is not None:
        inner = inner.__cause__ or inner.__context__
    if not isinstance(inner, OSError):
        inner = exc
    return f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__


def _error_text(body: bytes) -> str:
    """The server's own message, short and on one line."""
    try:
        data = json.loads(body)
        message = data.get("error", {}).get("message") if isinstance(data.get("error"), dict) else data.get("error")
        message = message or data.get("message") or data.get("detail") or body.decode("utf-8", "replace")
    except (ValueError, AttributeError):
        message = body.decode("utf-8", "replace")
    message = " ".join(str(message).split())
    return f"({message[:200]})" if message else ""


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
