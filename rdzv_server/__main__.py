"""rdzv-server: command line to settings to a running server."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import ssl
import sys
from pathlib import Path

from aiohttp import web

from . import __version__
from .app import Settings, create_app
from .store import DataDirError

log = logging.getLogger("rdzv_server")


def default_data_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "rdzv"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rdzv-server",
        description="Rendezvous server for elastic PyTorch training (see rdzv-agent).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"rdzv-server {__version__}")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=29400, help="port to listen on (0: any free port)")
    p.add_argument("--data-dir", default=None,
                   help=f"where job state is kept (SQLite); default {default_data_dir()} "
                        "($XDG_STATE_HOME/rdzv); 'none' keeps state in memory only")
    p.add_argument("--token", default=None,
                   help="bearer token required on every request but /healthz (default: $RDZV_TOKEN)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--disconnect-grace", type=float, default=0.5,
                   help="seconds a node whose connection dropped has to reconnect before it is lost")
    p.add_argument("--log-level", default=os.environ.get("RDZV_LOG_LEVEL", "INFO"),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.data_dir is None:
        data_dir: Path | None = default_data_dir()
    elif args.data_dir.lower() in ("none", ":memory:"):
        data_dir = None
    else:
        data_dir = Path(args.data_dir)
    token = args.token if args.token is not None else os.environ.get("RDZV_TOKEN") or None
    if not 0 < args.disconnect_grace <= 60:
        raise SystemExit("rdzv-server: --disconnect-grace must be in (0, 60] seconds")
    return Settings(data_dir=data_dir, token=token, disconnect_grace_s=args.disconnect_grace)


def ssl_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert and not key:
        return None
    if not (cert and key):
        raise SystemExit("rdzv-server: --tls-cert and --tls-key go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(f"rdzv-server: cannot load TLS certificate/key: {e}")
    return ctx


async def serve(settings: Settings, host: str, port: int, ssl_ctx=None, ready=None) -> None:
    """Run until SIGINT/SIGTERM. ``ready(port)`` is called once listening."""
    app = create_app(settings)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()  # opens the store: DataDirError stops us here
    # Thousands of held connections are ~100 tracked objects each; CPython's full
    # collections then stop the loop for a second or more and free nothing
    # (measured at 10,000 nodes). Freeze what startup made and collect the old
    # generations far less often; reference counting frees almost everything.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    site = web.TCPSite(runner, host, port, ssl_context=ssl_ctx, reuse_address=True, backlog=4096)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise SystemExit(f"rdzv-server: cannot listen on {host}:{port}: {e.strerror or e}")
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    scheme = "https" if ssl_ctx else "http"
    log.info("rdzv-server listening on %s://%s:%d (data: %s, auth: %s)", scheme, host, bound,
             settings.data_dir or "memory only", "token" if settings.token else "none")
    if ready:
        ready(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("rdzv-server stopping")
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    settings = settings_from_args(args)
    ctx = ssl_context(args.tls_cert, args.tls_key)
    if not 0 <= args.port <= 65535:
        raise SystemExit("rdzv-server: --port must be 0..65535")
    try:
        asyncio.run(serve(settings, args.host, args.port, ctx))
    except DataDirError as e:
        print(f"rdzv-server: refusing to start: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
