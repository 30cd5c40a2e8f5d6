"""A scripted OpenAI-compatible stand-in server (stdlib only) for fault and launcher tests.

Answers are a deterministic function of the prompt, so two runs against it agree item by item. A fault
plan decides, per completion request number (0-based, counted across endpoints), whether to answer or to
fail: ``"500"``, ``"503"``, ``"400"``, ``"malformed"`` (200 with broken JSON), ``"drop"`` (close the
connection without an answer), ``"timeout"`` (answer only after ``slow_s``), ``"abort"`` (SGLang's
aborted finish reason). ``latency=(lo, hi)`` makes every completion take a stable time between ``lo`` and
``hi`` seconds, a function of the prompt (the dispatch benchmark's stand-in for a server with variable
latency); ``in_flight`` counts completions being answered and ``in_flight_log`` keeps that count at every
arrival; ``connections`` counts the TCP connections accepted (keep-alive: one per client slot).
``warmup_s`` makes ``/health`` answer 503 for that long while ``/v1/models`` already answers, as SGLang
does during its warm-up. In a thread: ``FakeServer(plan).start()``. As a process (the launcher's stand-in
for ``python -m sglang.launch_server`` or ``vllm serve``): ``python tests/fake_server.py --model-path M --host H --port P
[--delay S] [--pid-file F] [--env-file F] [--die-after N] [--exit-code C] [--ignore-sigterm] [--warmup-s S]
[--enable-deterministic-inference] [--moe-a2a-backend B] [--chunked-prefill-size N]
[--enable-w4a4-mxfp4-megamoe]`` (reported in ``/server_info`` as SGLang does)
(``--die-after N``: the process exits when completion request N arrives, with that request in flight).
As a process it behaves as the engine version installed beside it (``sglang``/``vllm`` and
``sgl-deep-gemm`` distributions on its path, as the tests' stand-in site folders provide): SGLang >= 0.5.19
reports ``enable_w4a4_mxfp4_megamoe`` and, without megamoe, the ``moe_runner_backend`` its DeepSeek-V4 override
resolves (``flashinfer_mxfp4``); it refuses mega-MoE without chunked prefill; older SGLang refuses that flag as
its parser does; sgl-deep-gemm >= 0.1.7 exits on a non-zero ``DG_USE_FP4_ACTS``; vLLM answers ``/version``, and
``/server_info`` only with ``VLLM_SERVER_DEV_MODE=1`` (text, or JSON with ``?config_format=json``: its
``kernel_config.moe_backend``, parallel config and ``VLLM_*`` variables), and ignores ``DG_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def latency_for(prompt: str, lo: float, hi: float) -> float:
    """A stable latency in [lo, hi] per prompt (sha256), so two runs of one benchmark see the same ones."""
    import hashlib

    u = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") / 2 ** 32
    return lo + (hi - lo) * u


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # socketserver's default listen backlog of 5 drops connections of a 64-wide pool
    daemon_threads = True


def reply_for(prompt: str) -> str:
    """A stable answer per prompt, with a GSM8K-style final line and text after a typical stop."""
    n = sum(prompt.encode()) % 97
    return f" Some steps.\nThe answer is {n}.\n\nQuestion: next"


class FakeServer:
    def __init__(self, plan=None, host: str = "127.0.0.1", port: int = 0, slow_s: float = 2.0, delay_s: float = 0.0,
                 strip_stop: bool = True, model: str = "fake-model", die_after: int | None = None,
                 server_info: dict | None = None, extra_models: tuple[str, ...] = (),
                 latency: tuple[float, float] | None = None, models_status: int = 200, warmup_s: float = 0.0):
        self.plan = plan or (lambda n, body: None)  # (request number, body) -> fault name or None
        self.slow_s, self.delay_s, self.strip_stop = slow_s, delay_s, strip_stop
        self.model, self.die_after, self.extra_models = model, die_after, tuple(extra_models)
        self.server_info = server_info if server_info is not None else {"model_path": f"/models/{model}", "tp_size": 1,
                                                                       "version": "fake 0.1"}
        self.latency, self.models_status = latency, models_status
        self.healthy_at = time.monotonic() + warmup_s
        self.connections = 0
        self.version: str | None = None  # vLLM's /version, when set
        self.requests: list[dict] = []  # bodies of completion requests, in arrival order
        self.in_flight = 0
        self.in_flight_log: list[int] = []  # completions being answered, at every arrival (itself included)
        self.latencies: list[float] = []  # the latency each completion was given (``latency``)
        self._lock = threading.Lock()
        self.httpd = _Server((host, port), self._handler())
        self.httpd.handle_error = lambda request, address: None  # injected drops make noise, not news
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FakeServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _count(self, body: dict) -> int:
        with self._lock:
            self.requests.append(body)
            self.in_flight += 1
            self.in_flight_log.append(self.in_flight)
            return len(self.requests) - 1

    def _finished(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def answer(self, path: str, body: dict):
        """(status, payload-or-bytes) for a completion request, after the fault plan."""
        n = self._count(body)
        try:
            return self._answer(n, path, body)
        finally:
            self._finished()

    def _answer(self, n: int, path: str, body: dict):
        prompt_text = body.get("prompt") if isinstance(body.get("prompt"), str) else json.dumps(body.get("messages"))
        if self.latency is not None:
            wait = latency_for(prompt_text or "", *self.latency)
            with self._lock:
                self.latencies.append(wait)
            time.sleep(wait)
        if self.die_after is not None and n >= self.die_after:
            os._exit(0)  # the server dies with this request in flight
        fault = self.plan(n, body)
        if self.delay_s:
            time.sleep(self.delay_s)
        if fault == "timeout":
            time.sleep(self.slow_s)
        elif fault in ("500", "503", "400"):
            return int(fault), {"error": {"message": f"injected {fault}", "type": "server_error"}}
        elif fault == "malformed":
            return 200, b'{"choices": [ {"text": "trunc'
        elif fault == "drop":
            return None, None
        chat = path.endswith("/chat/completions")
        prompt = "\n".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        text, reason, hit = reply_for(prompt), "length", None
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            i, hit = min(found)
            text, reason = (text[:i] if self.strip_stop else text), "stop"
        words = text.split()[: body.get("max_tokens", 16)]
        if reason == "length" and len(text.split()) > len(words):
            text = " " + " ".join(words)
        choice = {"index": 0, "finish_reason": "abort" if fault == "abort" else reason, "matched_stop": hit}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(words)}
        result = (200, {"id": f"cmpl-{n}", "object": "text_completion", "model": self.model, "choices": [choice],
                        "usage": usage})
        return result

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out in two writes: on a kept-alive connection Nagle would hold the body
            # until the client's delayed ACK (40 ms), as no real server does
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def setup(self):
                with server._lock:
                    server.connections += 1
                super().setup()

            def _send(self, status, payload):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    ready = time.monotonic() >= server.healthy_at
                    self._send(200 if ready else 503, {"status": "ok" if ready else "warming up"})
                elif self.path == "/v1/models" and server.models_status != 200:
                    self._send(server.models_status, {"error": {"message": "no model list here"}})
                elif self.path == "/v1/models":
                    ids = [server.model, *server.extra_models]
                    self._send(200, {"object": "list", "data": [{"id": i, "object": "model",
                                                                 "root": server.server_info.get("model_path")}
                                                                for i in ids]})
                elif self.path == "/stats":  # the stand-in's own counters (the dispatch benchmark reads them)
                    self._send(200, {"connections": server.connections, "completions": len(server.requests)})
                elif self.path == "/version" and server.version:
                    self._send(200, {"version": server.version})
                elif self.path.split("?")[0] in ("/get_server_info", "/server_info") and server.server_info:
                    info = server.server_info
                    if isinstance(info.get("vllm_config"), dict) and "config_format=json" not in self.path:
                        info = {**info, "vllm_config": f"VllmConfig({info['vllm_config']})"}  # vLLM's default: text
                    self._send(200, info)
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    self._send(404, {"error": {"message": "not found"}})
                    return
                status, payload = server.answer(self.path, body)
                if status is None:  # dropped: close without a status line
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self._send(status, payload)

        return Handler


def installed(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def at_least(version: str | None, floor: tuple) -> bool:
    import re

    return version is not None and tuple(int(p) for p in re.findall(r"\d+", version)[:3]) >= floor


def engine_behaviour(args) -> tuple[dict, str | None]:
    """(server info, vLLM version) of the engine version installed beside the stand-in; exits as that version
    would on settings it refuses."""
    dg = installed("sgl-deep-gemm")
    if args.model_path:  # SGLang
        version = installed("sglang") or "0.5.14"
        new = at_least(version, (0, 5, 19))
        if args.enable_w4a4_mxfp4_megamoe and not new:
            print("sglang serve: error: unrecognized arguments: --enable-w4a4-mxfp4-megamoe", flush=True)
            sys.exit(2)
        mega = args.moe_a2a_backend == "megamoe"
        if mega and new and (args.chunked_prefill_size or 0) <= 0:
            print("ValueError: DeepSeek-V4 with MegaMoE requires chunked prefill to be enabled.", flush=True)
            sys.exit(1)
        fp4_acts = os.environ.get("DG_USE_FP4_ACTS", "0")
        if mega and at_least(dg, (0, 1, 7)) and fp4_acts.strip() not in ("", "0"):
            print("RuntimeError: `DG_USE_FP4_ACTS` is no longer supported; it is replaced by the symmetric "
                  "buffer's `mma_type`.", flush=True)
            sys.exit(1)
        info = {"model_path": args.model_path, "tp_size": 1, "version": version,
                "moe_a2a_backend": args.moe_a2a_backend, "chunked_prefill_size": args.chunked_prefill_size,
                "enable_deterministic_inference": args.enable_deterministic_inference}
        if new:
            info["enable_w4a4_mxfp4_megamoe"] = args.enable_w4a4_mxfp4_megamoe
            info["moe_runner_backend"] = "auto" if mega else "flashinfer_mxfp4"  # the DeepSeek-V4 override
        return info, None
    version = installed("vllm") or "fake-vllm 0.1"  # vLLM: /version; /server_info only in dev mode
    dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    info = {"vllm_config": {"kernel_config": {"moe_backend": (args.moe_backend or "auto").replace("-", "_")},
                            "parallel_config": {"enable_expert_parallel": args.enable_expert_parallel,
                                                "tensor_parallel_size": args.tensor_parallel_size}},
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
            "system_env": {"os": "fake"}} if dev else {}
    return info, version


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?")  # vLLM style: `vllm serve MODEL`
    p.add_argument("--model-path")  # SGLang style
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.0, help="seconds per completion")
    p.add_argument("--latency", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="a stable latency per prompt between LO and HI seconds")
    p.add_argument("--pid-file")
    p.add_argument("--env-file", help="write the DG_*/SGLANG_* environment here")
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--exit-code", type=int, default=None, help="exit at once with this code (a failed start)")
    p.add_argument("--startup-s", type=float, default=0.0, help="seconds before listening (model loading)")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true", help="SGLang's flag, reported back")
    p.add_argument("--enable-w4a4-mxfp4-megamoe", action="store_true", help="SGLang >= 0.5.19's W4A4 switch")
    p.add_argument("--moe-a2a-backend", default="none")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--warmup-s", type=float, default=0.0, help="seconds /health answers 503 after listening")
    p.add_argument("--moe-backend", default=None, help="vLLM's MoE backend (auto)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="vLLM's expert parallelism")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    args, _unknown = p.parse_known_args(argv)  # engine flags like --tp 4 are accepted and ignored
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(str(os.getpid()))
    if args.env_file:
        with open(args.env_file, "w") as f:
            json.dump({k: v for k, v in os.environ.items() if k.startswith(("DG_", "SGLANG_", "VLLM_"))}, f)
    print(f"fake server: argv {sys.argv[1:]}", flush=True)
    if args.exit_code is not None:
        print("fake server: failing to start on purpose", flush=True)
        sys.exit(args.exit_code)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(args.startup_s)
    model = args.model_path or args.model or "fake"
    info, vllm_version = engine_behaviour(args)
    server = FakeServer(host=args.host, port=args.port, delay_s=args.delay, die_after=args.die_after,
                        model=os.path.basename(model.rstrip("/")) or "fake", server_info=info,
                        latency=tuple(args.latency) if args.latency else None, warmup_s=args.warmup_s)
    server.version = vllm_version
    print(f"fake server: listening on {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
