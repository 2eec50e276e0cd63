"""The torchrun plugin shares the agent's --server-timeout clock (the link's
ServiceClock): ``rdzv-conf server_timeout`` fires against a server that
evicts at each join or answers ``unavailable``, not only against one that is
down. A real handler against tests/helpers/broken_server.py."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from tests.helpers.broken_server import BrokenServer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["evict", "refuse:unavailable", "refuse:rate_limited", "silent", "close"])
def test_plugin_gives_up_on_a_server_that_does_not_serve(mode: str) -> None:
    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    server = BrokenServer(mode)
    try:
        params = RendezvousParameters(
            backend="rdzv",
            endpoint=f"127.0.0.1:{server.port}",
            run_id="plug",
            min_nodes=1,
            max_nodes=1,
            local_addr="127.0.0.1",
            server_timeout="2",
            join_timeout="40",  # the join timeout must not be what ends it
        )
        handler = RdzvRendezvousHandler(params)
        with pytest.raises(RendezvousConnectionError, match=r"gave up: rdzv server .* for 2s"):
            handler.next_rendezvous()
        # backoff: a few joins, not one per event-loop turn
        assert server.joins <= 10 and server.connections <= 10, (server.joins, server.connections)
        handler.shutdown()
    finally:
        server.close()
