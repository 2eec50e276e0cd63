"""The test suite: a package, so that every folder imports the shared
harness as ``tests.helpers`` (the repository root is on ``pythonpath`` in
pyproject's pytest configuration)."""
