"""rdzv's rendezvous server. What it shares with the client (the wire contract, errors, log lines,
the version) lives in :mod:`rdzv_common`."""
