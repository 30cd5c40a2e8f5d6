"""`evalgate serve`: the in-process model with a chosen kernel behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import click

from evalgate.cli.options import KERNEL, checked_device, resolve_model
from evalgate.errors import UserError


@click.command()
@click.option("--model", "--model-path", "model", default=None,
              help="Local transformers checkpoint folder (default: the built-in canary).")
@click.option("--kernel", type=KERNEL, default="bf16", show_default=True, help="Kernel name (see `evalgate kernels list`).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Most concurrent requests decoded in one batch.")
@click.option("--batch-window-ms", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="How long the first request of a batch waits for others.")
@click.option("--device", default="cpu", show_default=True, callback=checked_device, help="cpu, cuda, cuda:1...")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None, help="Override the checkpoint dtype.")
@click.option("--served-model-name", default=None, help="The model id clients send (default: the folder name).")
def serve(model, kernel, host, port, batch_size, batch_window_ms, device, dtype, served_model_name):
    """Serve /v1/completions, /v1/chat/completions, /v1/models and /health: greedy at temperature 0, evalgate's
    coupled sampler at temperature > 0 with a per-request seed. Needs the `serve` extra: pip install
    'evalgate[serve]'. Ctrl-C stops it (exit 130)."""
    import importlib.util

    if importlib.util.find_spec("uvicorn") is None:  # said before the model loads, not after
        raise UserError("evalgate serve needs uvicorn; pip install 'evalgate[serve]'")
    from evalgate.model_adapters.server.serve import build_app, serve as run_server

    app = build_app(resolve_model(model), kernel, device=device, dtype=dtype, batch_size=batch_size,
                    served_model=served_model_name, window_s=batch_window_ms / 1000)
    from evalgate import collector

    collector.resume()  # start-up is over: a server runs for hours
    click.echo(f"evalgate serve: {app.served_model} with kernel {kernel} on http://{host}:{port}", err=True)
    run_server(app, host, port)

