"""A worker that, when ``E2E_BAD_LR`` is set, prints a warning and then dies
of ``ValueError: bad lr`` with a plain traceback (no torch ``@record``, so no
error file); otherwise it sleeps until stopped."""

import os
import time
import warnings


def train(lr: float) -> None:
    if lr > 1:
        raise ValueError("bad lr")


if os.environ.get("E2E_BAD_LR"):
    warnings.warn("The value of the smallest subnormal for <class 'numpy.float64'> type is zero.")
    time.sleep(0.5)
    train(10.0)
time.sleep(600)
