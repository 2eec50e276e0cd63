"""rdzv: ask a server what its jobs are doing, or close one.

    rdzv status              every job, one line each
    rdzv status JOB          the job, its nodes and its round history
    rdzv status JOB --watch  the same, redrawn in place on each of its events (waits for a job that does not exist yet)
    rdzv events [JOB]        print events as they happen (every job's, or one job's); --json: one object a line
    rdzv close JOB           stop a job: its agents stop their workers and exit
    rdzv delete JOB          forget a finished job (close it first if it still runs)
    rdzv hosts [HOST]        host records: failures, cool-downs, cordons
    rdzv cordon HOST --reason TEXT [--ttl 2h] [--drain]
                             no new admissions from HOST (--drain: replace its running nodes now)
    rdzv uncordon HOST       admit HOST again (lifts a cool-down too)

Endpoint and token come from --endpoint/--token (before or after the
subcommand) or RDZV_ENDPOINT/RDZV_TOKEN (RDZV_OPERATOR_TOKEN first when set:
a server with --operator-token needs it to close, delete or cordon). Errors
are one line on stderr and exit status 1 (2 for usage). Text from the server is printed through
``printable()``; ``--json`` is ASCII JSON (one compact document per line
with ``--watch``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Sequence

from pydantic import BaseModel, ValidationError

from rdzv_common import __version__
from rdzv_common.protocol import (
    HostList,
    HostView,
    JobList,
    JobNotFoundError,
    JobState,
    JobView,
    NodeView,
    RdzvError,
    is_valid_id,
    printable,
)

from . import explain
from .rest import RestClient


def _table(headers: list[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[printable(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


def restarts_text(restarts: int, max_restarts: int) -> str:
    """Restarts spent of the budget; the table's largest budget (the torchrun
    plugin's default: torchrun keeps its own) is no limit, said so."""
    from rdzv_common.spec_table import MAX_RESTARTS

    return f"{restarts}/" + ("unlimited" if max_restarts >= MAX_RESTARTS else str(max_restarts))


def render_jobs(jobs: JobList) -> str:
    if not jobs.jobs:
        return "no jobs"
    return _table(
        ["JOB", "STATE", "ROUND", "NODES", "MIN:MAX", "WORLD", "RESTARTS"],
        [
            [
                j.job_id,
                j.state.value,
                j.round,
                j.nodes,
                f"{j.min_nodes}:{j.max_nodes}",
                j.world_size,
                restarts_text(j.restarts, j.max_restarts),
            ]
            for j in jobs.jobs
        ],
    )


STATUS_NODES = 1000  # nodes `rdzv status JOB` lists (a big job's: the first, by rank; all are counted)


def render_job(job: JobView) -> str:
    spares = job.node_counts.get("spare", 0) if job.node_counts else len(job.spares)
    nodes = sum(job.node_counts.values()) - spares if job.node_counts else len(job.nodes)
    out = [
        f"job {printable(job.job_id)}: {job.state.value}, round {job.round}, world size {job.world_size}, "
        f"nodes {nodes} (min {job.min_nodes}, max {job.max_nodes}), spares {spares}, "
        f"restarts {restarts_text(job.restarts, job.max_restarts)}",
    ]
    if job.master_addr:
        out.append(f"master {printable(job.master_addr)}:{job.master_port}")
    if job.waiting_for:
        out.append(f"waiting for: {printable(job.waiting_for.text)}")
    if job.root_cause:
        out.append(f"root cause: {printable(job.root_cause)}")
    out += explain.culprit_lines(job)
    out.append("")
    rows = [
        [
            n.group_rank if n.group_rank is not None else "-",
            n.node_id,
            n.host,
            n.addr,
            n.state,
            n.local_world_size,
            f"{n.last_seen_s:.1f}s ago",
            _progress_cell(n),
        ]
        for n in job.nodes + job.spares
    ]
    out.append(
        _table(["RANK", "NODE", "HOST", "ADDR", "STATE", "NPROC", "LAST SEEN", "PROGRESS"], rows)
        if rows
        else "no nodes"
    )
    for n in job.spares:
        if n.host_blocked:
            out.append(f"spare {printable(n.node_id)} waits: {printable(n.host_blocked)}")
    if job.nodes_omitted:
        counts = ", ".join(f"{n} {state}" for state, n in sorted(job.node_counts.items()))
        out.append(f"(+{job.nodes_omitted} more nodes not listed; all of them: {counts or '-'})")
    out += explain.departed_lines(job)
    out.append("")
    hist = [
        [
            r.round,
            _when(r.started_at),
            "-" if r.completed_at is None else f"{(r.completed_at - r.started_at) * 1000:.0f} ms",
            r.world_size if r.world_size is not None else "-",
            r.reason,
        ]
        for r in job.history[-20:]
    ]
    out.append(_table(["ROUND", "OPENED", "FORMED IN", "WORLD", "WHY"], hist))
    if job.runs:  # the job id ran before (the same command again)
        runs = [[r.run, r.state, _when(r.ended_at), r.rounds, printable(r.reason, limit=300)] for r in job.runs]
        out += ["", f"this is run {job.run}; earlier runs:"]
        out.append(_table(["RUN", "STATE", "ENDED", "ROUNDS", "WHY"], runs))
    return "\n".join(out)


def _global_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """--endpoint and --token: on the main parser with their defaults, and on
    every subcommand without (so ``rdzv status --endpoint X`` works and a flag
    given before the subcommand is not reset by it)."""
    p.add_argument(
        "--endpoint",
        default=os.environ.get("RDZV_ENDPOINT", "127.0.0.1:29400") if defaults else argparse.SUPPRESS,
        help="server HOST:PORT, or a comma-separated list of HA replicas (default $RDZV_ENDPOINT or 127.0.0.1:29400)",
    )
    # the operator token (close, delete, cordon on a server with --operator-token) reads as well
    token = os.environ.get("RDZV_OPERATOR_TOKEN") or os.environ.get("RDZV_TOKEN")
    p.add_argument(
        "--token",
        default=token if defaults else argparse.SUPPRESS,
        help="bearer token (default $RDZV_OPERATOR_TOKEN if set, else $RDZV_TOKEN)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdzv", description="Query and control an rdzv server.")
    p.add_argument("--version", action="version", version=f"rdzv {__version__}")
    _global_flags(p, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _global_flags(common, defaults=False)
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="list jobs, or show one job", parents=[common])
    st.add_argument("job", nargs="?", help="job id")
    st.add_argument("--state", choices=[s.value for s in JobState], default=None, help="list only jobs in this state")
    st.add_argument("--json", action="store_true", help="print the raw JSON")
    st.add_argument(
        "--watch", action="store_true", help="redraw in place on every event (the event stream) until interrupted"
    )
    st.add_argument(
        "--interval", type=float, default=5.0, help="with --watch: redraw at least this often (seconds; ages move)"
    )
    ev = sub.add_parser("events", help="print events as they happen: every job's, or one job's", parents=[common])
    ev.add_argument("job", nargs="?", help="job id (it may not exist yet)")
    ev.add_argument("--json", action="store_true", help="one JSON object per line, as the server sent it")
    ev.add_argument(
        "--since", type=int, default=None, metavar="ID", help="first the held events after ID (0: all held)"
    )
    cl = sub.add_parser("close", help="close a job: its agents stop their workers and exit", parents=[common])
    cl.add_argument("job", help="job id")
    de = sub.add_parser(
        "delete", help="forget a finished job (its view, its saved state, its metrics)", parents=[common]
    )
    de.add_argument("job", help="job id")
    ho = sub.add_parser("hosts", help="host records: failures, cool-downs, cordons", parents=[common])
    ho.add_argument("host", nargs="?", help="one host, with its failures")
    ho.add_argument("--json", action="store_true", help="print the raw JSON")
    co = sub.add_parser(
        "cordon", help="no new admissions from a host (--drain: replace its running nodes now)", parents=[common]
    )
    co.add_argument("host")
    co.add_argument("--reason", required=True, help="why (shown to the host's agents and in rdzv status)")
    co.add_argument(
        "--ttl",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="lift the cordon after this long (e.g. 30m, 2h); default: until uncordoned",
    )
    co.add_argument("--drain", action="store_true", help="replace the host's running nodes at once")
    un = sub.add_parser("uncordon", help="admit a host again (lifts a cool-down too)", parents=[common])
    un.add_argument("host")
    return p


def _duration(text: str) -> float:
    from rdzv_common.durations import parse_duration

    return parse_duration(text)


def render_hosts(hosts: HostList) -> str:
    if not hosts.hosts:
        return "no host records (no host failed or was cordoned)"
    return _table(
        ["HOST", "STATE", "FAILURES", "COOL-DOWNS", "UNTIL", "WHY"],
        [
            [
                h.host,
                h.state + (" (drain)" if h.drain and h.cordoned else ""),
                h.failures_total,
                h.cooldowns,
                _when(h.cordon_until if h.cordoned else h.cooled_until if h.state == "cooled_down" else None),
                h.reason or (h.failures[-1].reason if h.failures else "-"),
            ]
            for h in hosts.hosts
        ],
    )


def render_host(h: HostView) -> str:
    out = [
        f"host {printable(h.host)}: {h.state}" + (f": {printable(h.reason)}" if h.reason else ""),
        f"failures {h.failures_total}, cool-downs {h.cooldowns}",
    ]
    if h.failures:
        out.append("")
        out.append(_table(["WHEN", "JOB", "FAILURE"], [[_when(f.at), f.job_id, f.reason] for f in h.failures]))
    return "\n".join(out)


async def _hosts_command(client: RestClient, args: argparse.Namespace) -> int:
    from rdzv_common.protocol import is_valid_host

    host = getattr(args, "host", None)
    if host is not None and not is_valid_host(host):
        print(f"rdzv: {host!r} is not a host name (letters, digits and ._:[]%-, at most 255)", file=sys.stderr)
        return 2
    if args.command == "cordon":
        view = await client.cordon(args.host, args.reason, args.ttl, args.drain)
        print(
            f"host {view.host}: cordoned"
            + (" and drained" if view.drain else "")
            + (f" until {_when(view.cordon_until)}" if view.cordon_until is not None else "")
        )
        return 0
    if args.command == "uncordon":
        view = await client.uncordon(args.host)
        print(f"host {view.host}: {view.state}")
        return 0
    if host is not None:
        one = await client.host(host)
        print(_json(one, False) if args.json else render_host(one))
        return 0
    hosts = await client.all_hosts()
    print(_json(hosts, False) if args.json else render_hosts(hosts))
    return 0


def _json(model: BaseModel, compact: bool) -> str:
    """ASCII JSON: no control or non-ASCII character reaches the terminal raw."""
    data = model.model_dump(mode="json")
    return json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=2)


def _progress_cell(n: NodeView) -> str:
    """step N, steps/s, seconds since the step advanced ("-" when its workers do not call progress()),
    and its straggler flag."""
    mark = " STRAGGLER" + (" (no spare to replace it)" if n.straggler_note else "") if n.straggler else ""
    if n.straggler and n.slow_rank is not None:  # flagged by a rank's compute, or NCCL RAS (lock-step)
        s = n.slow_rank
        rank = s.rank if s.rank is not None else "-"
        if s.rule == "nccl_lag":
            mark += f" rank {rank}: behind in NCCL RAS {s.lag_share or 0:.0%} of {s.readings} readings"
        else:
            mark += f" rank {rank}: compute score {s.ratio or 0:.2f} for {s.window_s:.0f}s"
    if n.step is None:  # (NCCL RAS flags ranks that call nothing)
        return mark.strip() or "-"
    rate = f" {n.steps_per_s:g}/s" if n.steps_per_s is not None else ""
    since = f" {n.since_progress_s:.0f}s ago" if n.since_progress_s is not None else ""
    return f"step {n.step}{rate}{since}{mark}"


async def _status_text(
    client: RestClient, job: str | None, as_json: bool, state: str | None = None, compact: bool = False
) -> str:
    if job:
        view = await client.job(job, None if as_json else STATUS_NODES)
        return _json(view, compact) if as_json else render_job(view)
    jobs = await client.all_jobs(state)
    return _json(jobs, compact) if as_json else render_jobs(jobs)


_EVENT_SKIP = frozenset({"id", "time", "type", "job", "round", "node", "failures"})


def render_event(ev: dict[str, object]) -> str:
    """One event, one line: time, job, round, type, node, then its fields (printable)."""
    t = ev.get("time")
    when = _when(float(t)) if isinstance(t, (int, float)) else "-"
    rnd = ev.get("round")
    fields = [  # a job id's run is named from run 2 on
        f"{k}={printable(v, 300)}"
        for k, v in ev.items()
        if k not in _EVENT_SKIP and v is not None and v != "" and not (k == "run" and v == 1)
    ]
    head = [
        when,
        printable(ev.get("job") or "-", 128),
        f"r{rnd}" if isinstance(rnd, int) else "-",
        printable(ev.get("type"), 40),
        printable(ev.get("node") or "-", 128),
    ]
    return "  ".join(head + fields)


_ENDED = ("succeeded", "failed", "closed")
MAX_HELD_PAGES = 100  # ?since answers a finished job's replay may take (each ~4 MiB at most)


async def _ended(client: RestClient, job: str) -> str | None:
    """'JOB has ended (STATE: reason)' when the job's current run is over, else None."""
    try:
        view = await client.job(job)
    except JobNotFoundError:
        return None
    if view.state.value not in _ENDED:
        return None
    why = f": {printable(view.root_cause, 300)}" if view.root_cause else ""
    return f"job {job} has ended ({view.state.value}{why})"


def _print_event(ev: dict[str, object], as_json: bool) -> None:
    line = json.dumps(ev, separators=(",", ":")) if as_json else render_event(ev)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _events_command(client: RestClient, args: argparse.Namespace) -> int:
    """A job's events as they happen; once its run has ended (at the start, or
    an end event arrives) say so and exit: nothing more will come until a
    fresh join starts its next run. ``--since``: the held events first."""
    if args.job is not None and (ended := await _ended(client, args.job)) is not None:
        since, pages = args.since, 0
        while since is not None and pages < MAX_HELD_PAGES:
            held = await client.held_events(args.job, since)
            for ev in held.get("events", []):
                _print_event(ev, args.json)
            since, pages = (held.get("last_id") if held.get("more") else None), pages + 1
        hint = "" if args.since is not None else "; --since 0 prints the events the server holds"
        print(f"rdzv: {ended}: no more events{hint}", file=sys.stderr, flush=True)
        return 0
    said = False

    def retry(why: str) -> None:
        nonlocal said
        if not said:
            print(f"rdzv: event stream interrupted ({why}); reconnecting", file=sys.stderr, flush=True)
            said = True

    async for ev in client.events(args.job, last_id=args.since, on_retry=retry):
        said = False
        _print_event(ev, args.json)
        # an end event; a replayed end of an earlier run is followed by its next run: ask what is true now
        ends = args.job is not None and ev.get("type") == "job_state" and ev.get("state") in _ENDED
        if ends and (ended := await _ended(client, args.job)) is not None:
            print(f"rdzv: {ended}: no more events", file=sys.stderr, flush=True)
            return 0
    return 0


async def _watch_events(client: RestClient, job: str | None, changed: asyncio.Event) -> None:
    """Set ``changed`` on each event of ``job`` (or of any job), and when the
    stream (re)opens (what happened before is in the next draw); the watch
    redraws then. A server without an event stream leaves --interval redraws."""
    try:
        async for _ in client.events(job, on_open=changed.set):
            changed.set()
    except RdzvError:
        return


async def _run(args: argparse.Namespace) -> int:
    try:
        client = RestClient(args.endpoint, args.token)
    except ValueError as e:
        print(f"rdzv: {e}", file=sys.stderr)
        return 2
    if args.command in ("hosts", "cordon", "uncordon"):
        return await _hosts_command(client, args)
    if args.job is not None and not is_valid_id(args.job):
        # the id goes into the URL path: "a?b" or "x/close" would name another resource
        print(f"rdzv: {args.job!r} is not a job id (letters, digits and ._:@+-, at most 128)", file=sys.stderr)
        return 2
    if args.command == "close":
        result = await client.close_job(args.job)
        print(f"job {result.job_id}: {result.state.value}")
        return 0
    if args.command == "delete":
        deleted = await client.delete_job(args.job)
        print(f"job {deleted.job_id}: deleted (it had {deleted.state.value})")
        return 0
    if args.command == "events":
        return await _events_command(client, args)
    if not args.watch:
        print(await _status_text(client, args.job, args.json, args.state))
        return 0
    changed = asyncio.Event()
    watcher = asyncio.create_task(_watch_events(client, args.job, changed))
    try:
        return await _watch(client, args, changed)
    finally:
        watcher.cancel()


async def _redraw_wait(changed: asyncio.Event, interval: float) -> None:
    """Until an event arrived (then a moment more, so a burst is one redraw) or ``interval`` passed."""
    try:
        await asyncio.wait_for(changed.wait(), max(0.1, interval))
        await asyncio.sleep(0.05)
    except asyncio.TimeoutError:
        pass
    changed.clear()


async def _watch(client: RestClient, args: argparse.Namespace, changed: asyncio.Event) -> int:
    tty = sys.stdout.isatty()
    missing_said = False
    while True:
        try:
            text = await _status_text(client, args.job, args.json, args.state, compact=True)
        except JobNotFoundError:
            # started before the job's first agent: wait for it
            if args.json:
                if not missing_said:
                    print(f"rdzv: job {args.job} does not exist yet; waiting for it", file=sys.stderr, flush=True)
                    missing_said = True
                await _redraw_wait(changed, args.interval)
                continue
            text = f"job {args.job} does not exist yet; waiting for it"
        if args.json:
            # one document per line: a stream that jq and head can read
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            await _redraw_wait(changed, args.interval)
            continue
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J")
        sys.stdout.write(f"{time.strftime('%H:%M:%S')}  rdzv status {args.job or ''}\n\n{text}\n")
        sys.stdout.flush()
        await _redraw_wait(changed, args.interval)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = asyncio.run(_run(args))
    except RdzvError as e:
        print(f"rdzv: {e.message}", file=sys.stderr)
        code = 1
    except ValidationError as e:  # something answered, but not an rdzv server of this version
        print(
            f"rdzv: unexpected answer from {args.endpoint} (is it an rdzv server?): {e.error_count()} invalid field(s)",
            file=sys.stderr,
        )
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # the reader went away (| head): nothing left to say, and nothing at exit either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 0
    raise SystemExit(code)


if __name__ == "__main__":
    main()
