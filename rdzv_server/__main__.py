"""rdzv-server: command line to settings to a running server (the flags: :mod:`rdzv_server.flags`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TextIO, cast

from aiohttp import web

from rdzv_common import logs

from . import early, upgrade
from .app import Settings, create_app
from .auth import is_loopback
from .conns import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    AcceptErrors,
    connection_limit,
    raise_fd_limit,
)
from .database import DataDirError, free_bytes
from .flags import UsageError, bind_host, build_parser, ha_settings, loop_factory, settings_from_args
from .gc_policy import tune_gc
from .keys import STORE
from .listener import Listener

log = logging.getLogger("rdzv_server")


def auth_note(host: str, token: str | None, operator: str | None = None) -> str:
    if token:
        return "auth: token and operator token" if operator else "auth: token"
    if is_loopback(host):
        return "auth: none, loopback only; set --token to listen on other addresses"
    return "auth: NONE on a non-loopback address (--insecure): anyone who can reach this port controls every job"


def ssl_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert and not key:
        return None
    if not (cert and key):
        raise SystemExit("rdzv-server: --tls-cert and --tls-key go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(f"rdzv-server: cannot load TLS certificate/key: {e}") from None
    return ctx


async def serve(
    settings: Settings,
    host: str,
    port: int,
    ssl_ctx: ssl.SSLContext | None = None,
    ready: Callable[[int], object] | None = None,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    per_address: int | None = None,
    fd_note: str | None = None,
) -> None:
    """Run until SIGINT/SIGTERM. ``ready(port)`` is called once listening."""
    asyncio.get_running_loop().set_exception_handler(AcceptErrors())
    app = create_app(settings)
    upgrades = upgrade.Upgrader(app)  # (before the runner freezes the app: it ends its connections on shutdown)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()  # opens the store: DataDirError stops us here
    if fd_note:
        log.info("%s", fd_note)
    tune_gc()
    app[STORE].gc_hold.on = True  # this process is the server's: hold young collections in round changes
    site = Listener(
        runner,
        host,
        port,
        ssl_context=ssl_ctx,
        max_connections=max_connections,
        header_timeout_s=header_timeout_s,
        per_address=per_address,
        refuse=early.Refuser(app) if settings.ha is not None else None,  # an HA replica's: it may not serve
        take=upgrades,
    )
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise SystemExit(f"rdzv-server: cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = site.sockets[0].getsockname()[1] if site.sockets else port
    scheme = "https" if ssl_ctx else "http"
    log.info(
        "rdzv-server listening on %s://%s:%d (data: %s, %s)",
        scheme,
        host,
        bound,
        settings.data_dir
        or (
            f"etcd {','.join(settings.ha.endpoints)} prefix {settings.ha.prefix}, HA replica "
            f"{settings.ha.advertise_url}"
            if settings.ha
            else "memory only"
        ),
        auth_note(host, settings.token, settings.operator_token),
    )
    free = free_bytes(settings.data_dir) if settings.data_dir is not None else None
    if free is not None and free < settings.min_free_disk:
        log.warning(
            "only %d bytes free on %s (--min-free-disk %d): new jobs are refused until there is space",
            free,
            settings.data_dir,
            settings.min_free_disk,
        )
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
        replica = app[STORE].replica
        if replica is not None:
            # Hand over while still listening: closing the listener first would make the
            # followers take this live replica for dead (its port refuses) and revoke its
            # lease while it still serves; and its agents would wait the shutdown timeout.
            await replica.stop()
        await runner.cleanup()


def run(main: Coroutine[Any, Any, None], factory: Callable[[], asyncio.AbstractEventLoop] | None) -> None:
    """``asyncio.run(main)`` on a loop from ``factory`` (None: asyncio's own)."""
    if factory is None:
        asyncio.run(main)
    elif sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main)
    else:  # pragma: no cover: Python 3.10 has no Runner
        loop = factory()
        try:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(main)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    stderr = sys.stderr
    if args.log_format == "json":  # what is printed, not logged (refusals to start), is json too
        sys.stderr = cast(TextIO, logs.JsonStream(stderr, level=logging.ERROR))
    logs.setup(args.log_format, args.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s", stream=stderr)
    try:
        settings = settings_from_args(args)
        host = bind_host(getattr(args, "host", None), settings.token, args.insecure)
        settings.listen_host = host
    except UsageError as e:
        print(f"rdzv-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    ctx = ssl_context(args.tls_cert, args.tls_key)
    if not 0 <= args.port <= 65535:
        raise SystemExit("rdzv-server: --port must be 0..65535")
    try:
        settings.ha = ha_settings(args, host, args.port, ctx is not None)
    except UsageError as e:
        print(f"rdzv-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not 0 < args.header_timeout <= 3600:
        raise SystemExit("rdzv-server: --header-timeout must be in (0, 3600] seconds")
    if args.max_connections < 1:
        raise SystemExit("rdzv-server: --max-connections must be at least 1")
    if args.max_connections_per_address < 0:
        raise SystemExit("rdzv-server: --max-connections-per-address must be 0 (no limit) or more")
    before, fds = raise_fd_limit()
    max_conns = connection_limit(args.max_connections, fds)
    fd_note = (
        f"file descriptors: limit {fds}"
        + (f" (raised from {before})" if fds != before else "")
        + f"; at most {max_conns} connections"
        + (f" (--max-connections {args.max_connections} lowered to fit)" if max_conns < args.max_connections else "")
    )
    try:
        factory = loop_factory(args.event_loop)
    except UsageError as e:
        print(f"rdzv-server: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    fd_note += f"; event loop: {'uvloop' if factory is not None else 'asyncio'}"
    try:
        run(
            serve(
                settings,
                host,
                args.port,
                ctx,
                header_timeout_s=args.header_timeout,
                max_connections=max_conns,
                per_address=args.max_connections_per_address,
                fd_note=fd_note,
            ),
            factory,
        )
    except DataDirError as e:
        print(f"rdzv-server: refusing to start: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
