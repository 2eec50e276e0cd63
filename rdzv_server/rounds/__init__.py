"""The round state machine of a job: pure, no I/O, no clock.

``from rdzv_server import rounds; rounds.join(job, msg, now)``: every name a
caller needs is here. Inside:

* :mod:`.model`: node states (:class:`NodeState`) and the table of allowed
  transitions (:data:`TRANSITIONS`, applied only by :func:`move`), the
  ``Node``/``Job`` data and the ``Effects`` a step returns;
* :mod:`.machine`: the steps (reports, disconnects, time), and :mod:`.joins`:
  a join and its named cases (reconnect, resume, new node, rejoin);
* :mod:`.events`: the typed events a step returns (``Effects.events``), made in one place;
* :mod:`.progress`: heartbeats with progress, and the straggler flag;
* :mod:`.gates`: host blocks (cordon, cool-down, drain) applied to a job's nodes;
* :mod:`.views`: what REST and a forming round's status show (read-only);
* :mod:`.records`: jobs to JSON-able records for the store, and back.
"""

from .events import job_created
from .forming import assign_ranks
from .gates import hosts_changed
from .joins import check_owner, join, starts_run
from .machine import (
    MAX_HISTORY,
    MAX_RUNS,
    STATUS_PUSH_INTERVAL_S,
    close,
    disconnect,
    fail,
    give_up,
    grace,
    leave,
    new_job,
    new_run,
    next_due,
    restored,
    succeed,
    tick,
)
from .model import (
    REJOINING,
    RUNNING,
    SPARE,
    SUCCEEDED,
    TRANSITIONS,
    WAITING,
    Effects,
    Event,
    HostGate,
    IllegalTransitionError,
    Job,
    Node,
    NodeState,
    RoundRecord,
    RunRecord,
    blocked,
    count,
    job_secret_hash,
    move,
    natural_key,
    node_secret_hash,
)
from .progress import heartbeat
from .reclaim import held, reclaim
from .records import from_record, to_record
from .views import MAX_VIEW_HISTORY, MAX_VIEW_NODES, progress_age, summary, view, waiting_info

__all__ = [
    "MAX_HISTORY",
    "MAX_RUNS",
    "MAX_VIEW_HISTORY",
    "MAX_VIEW_NODES",
    "REJOINING",
    "RUNNING",
    "SPARE",
    "STATUS_PUSH_INTERVAL_S",
    "SUCCEEDED",
    "TRANSITIONS",
    "WAITING",
    "Effects",
    "Event",
    "HostGate",
    "IllegalTransitionError",
    "Job",
    "Node",
    "NodeState",
    "RoundRecord",
    "RunRecord",
    "assign_ranks",
    "blocked",
    "close",
    "count",
    "disconnect",
    "fail",
    "from_record",
    "give_up",
    "grace",
    "heartbeat",
    "held",
    "hosts_changed",
    "job_secret_hash",
    "job_created",
    "join",
    "leave",
    "move",
    "natural_key",
    "new_job",
    "new_run",
    "next_due",
    "node_secret_hash",
    "reclaim",
    "restored",
    "starts_run",
    "check_owner",
    "succeed",
    "progress_age",
    "summary",
    "tick",
    "to_record",
    "view",
    "waiting_info",
]
