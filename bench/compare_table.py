"""The markdown table and the lines under it for bench/compare.py's rows."""

from __future__ import annotations

import re

from . import _common as C
from .compare import LAUNCHERS, STEP_BOUND_S, STEP_KEYS, Outcome, Row


def _cell(outs: list[Outcome], unit: str, row: Row) -> tuple[str, float | None]:
    if not outs:
        return "-", None
    vals = [o.value for o in outs if o.value is not None]
    fails = [o.failure for o in outs if o.value is None]
    parts = []
    med = C.median(vals) if vals else None
    if vals:
        fmt = (lambda v: f"{v:.0f}") if unit == "MiB" else (lambda v: f"{v:.2f}")
        text = f"{fmt(med)} {unit}"
        if len(vals) > 1:
            text += f" ({fmt(min(vals))}-{fmt(max(vals))})"
        if row.key == "footprint":
            cpus = [o.info.get("cpu_pct", 0.0) for o in outs if o.value is not None]
            text += f" [{C.median(cpus):.2f}% CPU]"
        step_key = STEP_KEYS.get(row.key)
        if step_key:
            steps = [o.info.get(step_key) for o in outs if o.value is not None]
            got = [v for v in steps if v is not None]
            text += f" [1st all_reduce {C.median(got):.1f} s" if got else " [1st all_reduce: none"
            text += (
                f", none in {STEP_BOUND_S:g} s in {len(steps) - len(got)} run(s)]"
                if got and len(got) < len(steps)
                else (f" in {STEP_BOUND_S:g} s]" if not got else "]")
            )
        parts.append(text)
    if fails:
        counts: dict[str, list[int]] = {}
        for f in fails:
            m = re.search(r" (\d+) s in$", f)
            key = f[: m.start()] if m else f
            counts.setdefault(key, []).append(int(m.group(1)) if m else -1)
        texts = []
        for f, secs in counts.items():
            known = sorted(x for x in secs if x >= 0)
            when = ""
            if known:
                when = f" {known[0]} s in" if len(set(known)) == 1 else f" {known[0]}-{known[-1]} s in"
            texts.append(f + when + (f" ({len(secs)}/{len(outs)} runs)" if len(outs) > 1 else ""))
        parts.append("; ".join(texts))
    return "; ".join(parts), med if not fails else (med if vals else None)


def table(rows: list[Row], results: dict) -> str:
    body = []
    for row in rows:
        r = results[row.key]
        rc, rm = _cell(r.get("rdzv", []), row.unit, row)
        tc, tm = _cell(r.get("torchrun", []), row.unit, row)
        if "torchrun" not in row.launchers:
            tc = "n/a"
        ratio = (
            f"{rm / tm:.2f}"
            if rm is not None and tm and not any(o.value is None for o in r.get("torchrun", []) + r.get("rdzv", []))
            else "-"
        )
        if ratio == "-" and rm is not None and r.get("torchrun") and all(o.value is None for o in r["torchrun"]):
            bounds = [re.fullmatch(r"> (\d+(?:\.\d+)?) s", o.failure or "") for o in r["torchrun"]]
            ratio = (
                f"< {rm / min(float(m.group(1)) for m in bounds):.2f}" if all(bounds) else "torchrun did not recover"
            )
        body.append([row.title, rc, tc, ratio])
    return C.md_table(["row", "rdzv median (min-max)", "torchrun median (min-max)", "rdzv/torchrun"], body)


def info_lines(results: dict) -> list[str]:
    """Secondary numbers worth a line under the table."""
    out = []
    for key, by in results.items():
        for o in by.get("rdzv", []):
            if "server_first_join_to_complete" in o.info:
                out.append((key, o.info["server_first_join_to_complete"]))
    lines = []
    keys = sorted({k for k, _ in out}, key=lambda k: int(k.split("n")[-1]) if k.split("n")[-1].isdigit() else 0)
    for k in keys:
        vals = [v for kk, v in out if kk == k]
        lines.append(
            f"- rdzv server history, {k}: first join -> round complete (completed_at - started_at), "
            f"median {C.median(vals) * 1000:.0f} ms over {len(vals)} run(s); the rest of row 1 is agent "
            f"start-up (Python imports, connect) and worker spawn"
        )
    floors = [o.info for o in results.get("join_sent", {}).get("rdzv", []) if "aiohttp_import_s" in o.info]
    if floors:
        lines.append(
            f"- row 0, what a bare `python -c` costs here (best of {floors[0].get('floor_reps', 3)}, wall, "
            "per run's median): nothing "
            f"{C.median([f['python_floor_s'] for f in floors]) * 1000:.0f} ms, `import aiohttp` "
            f"{C.median([f['aiohttp_import_s'] for f in floors]) * 1000:.0f} ms, `import "
            f"rdzv_common.protocol` (pydantic and the wire models) "
            f"{C.median([f['protocol_import_s'] for f in floors]) * 1000:.0f} ms: the agent needs neither "
            "before its join frame (its WebSocket client is rdzv_client/wsclient.py; pydantic "
            "comes right after the join)"
        )
    for launcher in LAUNCHERS:
        cpu = [
            o.info["agent_cpu_s"]
            for o in results.get("join_sent", {}).get(launcher, [])
            if o.info.get("agent_cpu_s") is not None
        ]
        if cpu:
            lines.append(
                f"- row 0, {launcher}: the agent's own CPU time (user+sys) when its first word arrived, "
                f"median {C.median(cpu) * 1000:.0f} ms over {len(cpu)} run(s) (less load-dependent "
                "than the wall time)"
            )
    if any(k in results for k in STEP_KEYS):
        lines.append(
            "- rows 4-6, [1st all_reduce]: from the same start of the clock until every worker of the "
            "new world finished its first gloo all_reduce (import torch and init_process_group "
            f"included; waited for up to {STEP_BOUND_S:g} s after the workers started)"
        )
    return lines


def to_json(rows: list[Row], results: dict) -> dict:
    return {
        row.key: {
            "title": row.title,
            "unit": row.unit,
            **{
                name: [{"value": o.value, "failure": o.failure, "info": o.info} for o in outs]
                for name, outs in results[row.key].items()
            },
        }
        for row in rows
    }
