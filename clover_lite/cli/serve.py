"""`clover serve`: the model behind an OpenAI-compatible HTTP API on this machine."""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys

import click

from clover_lite.cli.common import fail, load_options, load_with_progress, model_argument
from clover_lite.errors import CloverError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made here so --port 0 can pick a free port and say which."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CloverError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or stop what uses "
                          "it") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@click.command()
@click.argument("model", required=False)
@click.option("--model", "-m", "model_path", type=click.Path(), default=None,
              help="Model directory (or give it as MODEL; default: the bundled model).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port (0: any free one, printed at start).")
@click.option("--api-key", default=None, envvar="CLOVER_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 requests [env: CLOVER_API_KEY].")
@click.option("--model-name", default=None, help="The model id clients see (default: the directory's name).")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests that may wait while one runs; beyond it a request gets 503 with Retry-After.")
@click.option("--max-body-mb", type=click.FloatRange(min=0.001), default=4.0, show_default=True,
              help="Largest request body accepted (413 beyond it).")
@click.option("--drain", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On Ctrl-C / SIGTERM: seconds the running generation may finish in before it is cancelled "
                   "(waiting requests get 503 at once).")
@click.option("--log-prompts", is_flag=True, help="Log every prompt and reply (off: only sizes and timings).")
@load_options
def serve(model, model_path, host, port, api_key, model_name, max_queue, max_body_mb, drain, log_prompts,
          device, dtype, context) -> None:
    """Serve a model over the OpenAI HTTP API: /v1/chat/completions, /v1/completions (streaming or not),
    /v1/models, /health, and joint decisions at /v1/clover/decide (block denoisers; DiffusionGemma serves
    text). One generation runs at a time; the others wait in a bounded queue. Needs the serve extra:
    pip install "clover-lite[serve]"."""
    try:
        import uvicorn

        from clover_lite.serve.app import ServeSettings, create_app
    except ImportError as e:
        fail(CloverError(f"clover serve needs the serve extra ({e.name} is missing): "
                         'pip install "clover-lite[serve]"'))
    if not is_loopback(host) and not api_key:
        raise click.UsageError(f"--host {host} listens beyond this machine: give an --api-key (or set "
                               "CLOVER_API_KEY) so strangers cannot use the model, or keep the default 127.0.0.1")
    path = model_argument(model, model_path)
    try:
        engine = load_with_progress(path, diffusion_gemma=True, device=device, dtype=dtype, context=context)
        sock = bind(host, port)
    except CloverError as e:
        fail(e)
    name = model_name or (engine.path.name if engine.path else "clover")
    settings = ServeSettings(model_id=name, api_key=api_key, max_body_bytes=int(max_body_mb * (1 << 20)),
                             max_queue=max_queue, log_prompts=log_prompts)
    app = create_app(engine, settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=drain,
                            lifespan="on")
    server = uvicorn.Server(config)
    scheduler = app.state.server.scheduler

    def handle_exit(sig, frame) -> None:
        # Waiting requests are refused now; the running one has --drain seconds (uvicorn then cancels it).
        # A second Ctrl-C stops at once. The signal is not re-raised afterwards: a drained stop exits 0.
        scheduler.begin_shutdown()
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    server.handle_exit = handle_exit
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"serving {name} on http://{shown}:{actual}/v1 (context {engine.context_limit}, queue {max_queue}"
               f"{', API key required' if api_key else ''}); Ctrl-C stops", err=True)
    sys.stderr.flush()
    server.run(sockets=[sock])
    click.echo("stopped", err=True)
