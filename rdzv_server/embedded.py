"""An rdzv server inside another process's event loop: ``rdzv-agent --standalone``.

    runner, port = await start_embedded()
    ...
    await runner.cleanup()

Memory only (no data directory), bound to 127.0.0.1 on a port the kernel picks
(``port=0``) or the one given. The port is read through aiohttp's public
``AppRunner.addresses``.
"""

from __future__ import annotations

from aiohttp import web

from .app import Settings, create_app


async def start_embedded(
    host: str = "127.0.0.1", port: int = 0, settings: Settings | None = None
) -> tuple[web.AppRunner, int]:
    """Start a server on ``host:port``; return its runner (``await runner.cleanup()``
    stops it) and the port it listens on."""
    runner = web.AppRunner(create_app(settings or Settings(data_dir=None, listen_host=host)), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(bound)
