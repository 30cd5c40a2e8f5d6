"""OpenAI-compatible server adapter (SGLang, vLLM, `evalgate serve`): same interface as ``HFAdapter``.

Greedy completions (chat completions for chat profiles), a bounded pool of concurrent requests, retries
with exponential backoff on what a restart or a retry can fix (connection errors, timeouts, 5xx, 429,
malformed JSON), then one clear error. Items that finished before a failure are handed back on the
exception (``exc.finished``) so the runner stores them; ``--resume`` redoes only the rest.

A server has no local checkpoint, so the model identity (``fingerprint``) is built from what the server
says about itself. The kernel of a remote server cannot be verified: the manifest records the kernel
claimed, the server's reported settings, and ``kernel_verified: false`` (``true`` only when the server is
``evalgate serve`` and reports that very kernel).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import platform
import queue
import threading
import time
from urllib.parse import urlsplit

from evalgate.version import __version__
from evalgate.errors import UserError
from evalgate.kernels import get_kernel
from evalgate.model_adapters.generation import cut_at_stop
from evalgate.types import Generation, Request

# Server settings that can change numerics; hashed into the fingerprint. Ports, seeds, paths of logs and
# memory-dependent sizes are left out so a restarted server keeps its identity.
IDENTITY_KEYS = ("model_path", "tokenizer_path", "revision", "dtype", "quantization", "kv_cache_dtype",
                 "load_format", "tp_size", "dp_size", "ep_size", "pp_size", "enable_dp_attention",
                 "moe_a2a_backend", "moe_runner_backend", "attention_backend", "speculative_algorithm", "version")
STOP_REASONS = {"stop": "stop", "eos": "stop", "content_filter": "stop", "tool_calls": "stop",
                "function_call": "stop", "length": "length"}
API_KEY_ENV = "EVALGATE_SERVER_API_KEY"  # sent as a bearer token when set; never recorded


class ServerError(UserError):
    """The server failed a request after every retry; ``finished`` holds what completed before."""

    def __init__(self, message: str, finished: dict | None = None):
        super().__init__(message)
        self.finished = finished or {}


class _Retryable(Exception):
    """A failure that another attempt may not repeat."""


class _Aborted(Exception):
    """Another request failed for good: stop this one."""


def normalize_url(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--server {url!r} is not an http(s) URL; pass e.g. http://gpu-node:30000")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


class OpenAIAdapter:
    """Generates for evalgate's requests through an OpenAI-compatible HTTP API."""

    kind = "openai"

    def __init__(self, url: str, kernel_name: str, model_id: str | None = None, concurrency: int = 8,
                 request_timeout: float = 600.0, retries: int = 3, backoff_s: float = 1.0, batch_size: int = 8,
                 seed: int = 0, launch: dict | None = None):
        t0 = time.perf_counter()
        self.url = normalize_url(url)
        self.kernel = get_kernel(kernel_name)
        self.model_id = model_id
        self.concurrency = concurrency
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size
        self.seed = seed
        self.launch = launch
        parts = urlsplit(self.url)
        self._conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._netloc, self._prefix = parts.netloc, parts.path
        self.described = self._describe_server()
        self.served_model = self._pick_served_model(self.described["models"])
        self.load_s = time.perf_counter() - t0

    # ---- what the server says about itself ----

    def _describe_server(self) -> dict:
        models = self._get_json("/v1/models", required=True)
        server_info = None
        for path in ("/server_info", "/get_server_info"):  # SGLang (newer, older); absent on vLLM
            server_info = self._get_json(path)
            if isinstance(server_info, dict):
                break
        return {"models": models, "server_info": server_info if isinstance(server_info, dict) else None,
                "model_info": self._get_json("/get_model_info"),  # SGLang
                "version": self._get_json("/version")}  # vLLM (SGLang has it too)

    def _pick_served_model(self, models) -> str:
        try:
            ids = [m["id"] for m in models["data"]]
        except (KeyError, TypeError):
            raise UserError(f"server {self.url}: /v1/models answered {str(models)[:200]!r}, not an OpenAI model list") from None
        if self.model_id in ids:
            return self.model_id
        if len(ids) == 1:
            return ids[0]
        raise UserError(f"server {self.url} serves {len(ids)} models ({', '.join(ids) or 'none'}); "
                        "pass --model-id one of them")

    def identity(self) -> dict:
        """What makes two server runs the same model: names, path, numerics-relevant settings, versions."""
        info = self.described["server_info"] or {}
        model_info = self.described["model_info"] if isinstance(self.described["model_info"], dict) else {}
        entry = next((m for m in self.described["models"]["data"] if m.get("id") == self.served_model), {})
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
            "kernel_verified": reported == self.kernel.name,
            "kernel_note": ("reported by evalgate serve" if reported else
                            "not verifiable: the server chose its kernel from its own launch environment; "
                            "see launch.kernel_env when evalgate launched it"),
            "launch": self.launch,
            "server_reported": self.described,
            "concurrency": self.concurrency,
            "request_timeout_s": self.request_timeout,
            "retries": self.retries,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "evalgate_client": __version__,
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
        }

    # ---- generation ----

    def generate(self, requests: list[Request]) -> list[Generation]:
        """One Generation per request, in order; on failure raises with the finished ones on ``exc.finished``."""
        jobs: queue.Queue = queue.Queue()
        for i, r in enumerate(requests):
            jobs.put((i, r))
        results: queue.Queue = queue.Queue()
        abort = threading.Event()

        def worker():
            while not abort.is_set():
                try:
                    i, r = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    results.put((i, self._complete(r, abort), None))
                except BaseException as exc:  # reported to the main thread, which raises it
                    if not isinstance(exc, _Aborted):
                        abort.set()  # start nothing new; requests in flight may still finish and are kept
                    results.put((i, None, exc))

        # daemon threads: Ctrl-C must not wait for requests in flight
        threads = [threading.Thread(target=worker, daemon=True, name=f"evalgate-request-{n}")
                   for n in range(min(self.concurrency, len(requests)))]
        for t in threads:
            t.start()
        finished: dict[int, Generation] = {}
        failure: tuple[Request, BaseException] | None = None
        try:
            while any(t.is_alive() for t in threads) or not results.empty():
                try:
                    i, gen, exc = results.get(timeout=0.05)
                except queue.Empty:
                    continue
                if gen is not None:
                    finished[i] = gen
                elif not isinstance(exc, _Aborted) and failure is None:
                    failure = (requests[i], exc)
        except BaseException as exc:  # Ctrl-C: hand back what finished
            abort.set()
            exc.finished = dict(finished)
            raise
        if failure is not None:
            request, exc = failure
            if isinstance(exc, UserError):
                raise ServerError(str(exc), finished) from None
            raise ServerError(f"server {self.url}: unexpected failure on item {request.doc_id!r}: "
                              f"{type(exc).__name__}: {exc}", finished) from exc
        return [finished[i] for i in range(len(requests))]

    def _complete(self, request: Request, abort: threading.Event) -> Generation:
        chat = bool(request.messages)
        payload = {"model": self.served_model, "max_tokens": request.max_new_tokens, "temperature": 0.0,
                   "top_p": 1.0, "n": 1, "seed": self.seed, "stream": False}
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
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, dropped mid-response
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise UserError(f"server {self.url} failed {what} on {path} after {self.retries + 1} attempts: {last}; "
                        "finished items are saved, restart the server and rerun with --resume")

    def _http(self, method: str, path: str, payload: dict | None) -> tuple[int, bytes]:
        conn = self._conn_class(self._netloc, timeout=self.request_timeout)
        headers = {"Accept": "application/json", "Connection": "close"}
        body = None
        if payload is not None:
            body = json.dumps(payload).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        try:
            conn.request(method, self._prefix + path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _get_json(self, path: str, required: bool = False):
        """GET ``path`` as JSON; None when the server has no such endpoint (only ``required`` ones retry)."""
        if required:
            return self._call(path, None, None, what="the model list", parse=lambda d: d)[0]
        try:
            status, body = self._http("GET", path, None)
            return json.loads(body) if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None


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
