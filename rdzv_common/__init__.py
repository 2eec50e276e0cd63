"""What rdzv's server (``rdzv_server``) and client (``rdzv_client``) share, so that neither imports the
other: the wire contract (protocol, wire, rest_models, spec_table), errors, log lines, stopping tasks,
durations. ``__version__`` is the one version of rdzv (pyproject reads it)."""

__version__ = "0.1.0"
