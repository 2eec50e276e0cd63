"""An in-place worker whose round store port another process holds (issue 25):
in round 0, rank 0 binds MASTER_PORT itself before its group does (the race
seen once in 9 runs: a port the agent picked at join, taken meanwhile), so
rdzv_client.inplace.process_group raises StorePortTaken, uncaught; from the
next round on it forms its group and finishes."""

from __future__ import annotations

import socket

from rdzv_client import inplace, worker

for world in worker.rounds():
    if world.round == 0 and world.rank == 0:
        holder = socket.socket()
        # (SO_REUSEADDR: the agent holds the port it offered, rdzv_client.ports, and a plain
        # bind is refused; a process that binds it so and listens still takes it)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((world.master_addr, world.master_port))
        holder.listen()
    pg = inplace.process_group(world)  # round 0, rank 0: StorePortTaken (exit 76, its agent's word)
    print(f"formed round {world.round} rank {world.rank} world {world.world_size}", flush=True)
    break
inplace.exit(0)
