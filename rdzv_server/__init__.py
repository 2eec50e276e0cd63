"""rdzv's rendezvous server; ``__version__`` is the one version of rdzv (pyproject reads it)."""

__version__ = "0.1.0"
