"""The in-process model with one kernel behind an OpenAI-compatible HTTP API (``evalgate serve``).

A Starlette app on uvicorn: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``
and ``/get_server_info`` (SGLang's name; it also says which evalgate kernel and model fingerprint serve).
Greedy at temperature 0; at temperature > 0 only with a per-request ``seed``, which keys evalgate's coupled
sampler (``sampling.py``): the seed evalgate's client sends is the stream seed of that (item, sample), so a
served run draws the samples an in-process run draws. Concurrent requests are collected for a few
milliseconds into one ``decode`` call (bounded by the batch size) on a single generation thread, so
concurrency helps and the model is never entered twice at once; decoding and the sampler are batch-invariant
(``tests/test_adapter.py``, ``tests/test_sampling.py``), so batching does not change any answer.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from evalgate.model_adapters.hf.sampling import MAX_SEED, SampleKey
from evalgate.version import __version__

MAX_BODY = 8 * 1024 * 1024


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class _Job:
    prompt: str
    stop: tuple[str, ...]
    max_tokens: int
    key: SampleKey | None  # None: greedy
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)


class BatchingGenerator:
    """One thread owns the model; jobs arriving within ``window_s`` of each other share a batch."""

    def __init__(self, model, tokenizer, device: str = "cpu", batch_size: int = 8, window_s: float = 0.005):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.batch_size, self.window_s = batch_size, window_s
        self.batches = 0  # how many decode calls ran (tests check that concurrency batches)
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="evalgate-generate")
        self._thread.start()

    async def submit(self, prompt: str, stop: tuple[str, ...], max_tokens: int, key: SampleKey | None = None):
        loop = asyncio.get_running_loop()
        job = _Job(prompt, stop, max_tokens, key, loop, loop.create_future())
        self._jobs.put(job)
        return await job.future

    def _loop(self) -> None:
        from evalgate.model_adapters.hf.generation import decode

        while True:
            batch = [self._jobs.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            try:
                outs = decode(self.model, self.tokenizer, [j.prompt for j in batch], [j.stop for j in batch],
                              [j.max_tokens for j in batch], device=self.device, keys=[j.key for j in batch])
                self.batches += 1
                for job, out in zip(batch, outs):
                    job.loop.call_soon_threadsafe(_settle, job.future, out, None)
            except Exception as exc:  # a bug or OOM: every request of the batch gets a 500
                for job in batch:
                    job.loop.call_soon_threadsafe(_settle, job.future, None, exc)


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.done():  # the client went away
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class OpenAIApp:
    """The OpenAI-compatible API as a Starlette application: each handler takes the request body and returns
    (status, payload); refusals are OpenAI-style error bodies."""

    def __init__(self, generator: BatchingGenerator, tokenizer, served_model: str, server_info: dict):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        self.generator = generator
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.server_info = server_info
        handlers = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.health,
            ("GET", "/get_server_info"): self.info,
            ("GET", "/server_info"): self.info,
        }
        routes = [Route(path, _endpoint(handler), methods=[method]) for (method, path), handler in handlers.items()]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    async def health(self, body):
        return 200, {"status": "ok"}

    async def models(self, body):
        return 200, {"object": "list", "data": [{"id": self.served_model, "object": "model", "created": 0,
                                                 "owned_by": "evalgate", "root": self.server_info["model_path"]}]}

    async def info(self, body):
        return 200, self.server_info

    async def completions(self, body):
        req = self._parse(body)
        prompts = req.get("prompt")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise BadRequest("prompt must be a string or a list of strings (token ids are not supported)")
        stop, max_tokens, key = _decoding(req)
        if key is not None and len(prompts) > 1:
            raise BadRequest("a sampled request takes one prompt: its seed keys one sample")
        outs = await asyncio.gather(*(self.generator.submit(p, stop, max_tokens, key) for p in prompts))
        choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason,
                    "matched_stop": o.stop_hit} for i, o in enumerate(outs)]
        return 200, self._envelope("text_completion", "cmpl", choices, outs)

    async def chat_completions(self, body):
        req = self._parse(body)
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} with string content")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model has no chat template; use /v1/completions with a completion profile")
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        stop, max_tokens, key = _decoding(req)
        out = await self.generator.submit(prompt, stop, max_tokens, key)
        choices = [{"index": 0, "message": {"role": "assistant", "content": out.text},
                    "finish_reason": out.finish_reason, "matched_stop": out.stop_hit}]
        return 200, self._envelope("chat.completion", "chatcmpl", choices, [out])

    def _parse(self, body: bytes) -> dict:
        try:
            req = json.loads(body)
        except ValueError as exc:
            raise BadRequest(f"body is not JSON ({exc})") from None
        if not isinstance(req, dict):
            raise BadRequest("body must be a JSON object")
        model = req.get("model")
        if model not in (None, self.served_model):
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.served_model!r}", 404)
        return req

    def _envelope(self, kind: str, prefix: str, choices: list, outs: list) -> dict:
        prompt_tokens = sum(o.n_prompt_tokens for o in outs)
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                "model": self.served_model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def _decoding(req: dict) -> tuple[tuple[str, ...], int, SampleKey | None]:
    """Stops, token limit and sampler key of a request: greedy at temperature 0, evalgate's keyed sampler at
    temperature > 0 with a seed. Anything else (no seed, top_p, n > 1, logprobs...) is refused."""
    temperature = req.get("temperature", 0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 100:
        raise BadRequest(f"temperature must be a number from 0 to 100, not {temperature!r}")
    key = None
    if temperature > 0:
        seed = req.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise BadRequest(f"temperature {temperature!r} needs a seed (an integer from 0 to 2^63 - 1), not "
                             f"{seed!r}: this server samples only with per-request seeds, so samples are reproducible")
        key = SampleKey(seed, float(temperature))
    if req.get("top_p", 1) != 1 or req.get("n", 1) != 1 or req.get("best_of", 1) != 1:
        raise BadRequest("top_p, n and best_of must be 1: this server draws one sample per request, from the full "
                         "distribution")
    if req.get("stream"):
        raise BadRequest("stream is not supported; send stream false")
    if req.get("logprobs") or req.get("echo"):
        raise BadRequest("logprobs and echo are not supported")
    stop = req.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a string or a list of non-empty strings")
    max_tokens = req.get("max_tokens", req.get("max_completion_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 32768:
        raise BadRequest(f"max_tokens must be an integer from 1 to 32768, not {max_tokens!r}")
    return tuple(stop), max_tokens, key


def _error(message: str, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def _endpoint(handler):
    """A Starlette endpoint around ``handler(body) -> (status, payload)``."""
    from starlette.responses import JSONResponse

    async def endpoint(request):
        try:
            if int(request.headers.get("content-length") or 0) > MAX_BODY:
                raise BadRequest("request body too large", 413)
            body = await request.body() if request.method == "POST" else b""
            if len(body) > MAX_BODY:
                raise BadRequest("request body too large", 413)
            status, payload = await handler(body)
        except BadRequest as exc:
            status, payload = exc.status, _error(str(exc), exc.status)
        except Exception as exc:  # a bug in generation: the client may retry, the server keeps running
            status, payload = 500, _error(f"{type(exc).__name__}: {exc}", 500)
        return JSONResponse(payload, status_code=status)

    return endpoint


async def _http_error(request, exc):
    """Unknown paths (404) and methods (405) answer in the OpenAI error shape too."""
    from starlette.responses import JSONResponse

    return JSONResponse(_error(f"{request.method} {request.url.path} is not served", exc.status_code),
                        status_code=exc.status_code)


def build_app(model_path: str, kernel_name: str, device: str = "cpu", dtype: str | None = None,
              batch_size: int = 8, served_model: str | None = None, window_s: float = 0.005) -> OpenAIApp:
    """Load the model with ``kernel_name`` and wrap it; the info endpoint names kernel and model fingerprint."""
    from evalgate.model_adapters.hf.adapter import HFAdapter
    from evalgate.kernels.environment import dg_environment

    adapter = HFAdapter(model_path, kernel_name, device=device, dtype=dtype, batch_size=batch_size)
    generator = BatchingGenerator(adapter.model, adapter.tokenizer, device, batch_size, window_s)
    served = served_model or adapter.path.name
    kernel = adapter.kernel
    info = {
        "model_path": str(adapter.path),
        "served_model_name": served,
        "dtype": str(adapter.model.dtype).replace("torch.", ""),
        "model_type": adapter.model.config.model_type,
        "version": f"evalgate {__version__}",
        "max_batch_size": batch_size,
        "evalgate": {"kernel": {"name": kernel.name, "id": kernel.id}, "model": adapter.info(),
                     "dg_env": dg_environment()},
    }
    return OpenAIApp(generator, adapter.tokenizer, served, info)


def serve(app: OpenAIApp, host: str, port: int) -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        from evalgate.errors import UserError

        raise UserError("evalgate serve needs uvicorn and starlette; pip install 'evalgate[serve]'") from None

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
