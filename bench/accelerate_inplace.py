"""Hugging Face accelerate in place (issue 20): node loss -> first accelerate step in world 2. Printed, never asserted.

    python -m bench.accelerate_inplace [--runs K] [--victim other|rank0]

3 rdzv-agents (2:3, ``--restart-mode in-place``) run
examples/train_accelerate_inplace.py (an ``InPlaceAccelerator`` per round);
SIGKILL a node -> seconds until both survivors printed their first step in
world 2 (after the new group, accelerate's state set up again, ``prepare``,
the broadcast of the most advanced rank's state), and whether they kept
their pids. The run itself is bench/lightning_inplace.py's, on this example.
"""

from __future__ import annotations

from . import _common as C
from .lightning_inplace import run_node_loss

EXAMPLE = C.ROOT / "examples" / "train_accelerate_inplace.py"


def main(argv: list[str] | None = None) -> None:
    run_node_loss(argv, EXAMPLE, "accelerate", __doc__)


if __name__ == "__main__":
    main()
