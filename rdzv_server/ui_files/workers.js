// The job page's per-worker detail: under each running node's row, its workers
// (local rank -> global rank, the rank's step rate when its ranks time, the one
// that failed last or computes slowest), from the job view alone. The server
// does not know worker pids (an agent reports them only in a failure's exit
// records), so none are shown. Text only (textContent), as in app.js.
"use strict";

const MAX_WORKERS_SHOWN = 64;  // a node of more local ranks shows the first ones and "+N more"

function workersRow(v, n) {
  if (n.rank_offset === null || n.rank_offset === undefined) return null;  // not running: no ranks
  const box = document.createElement("div");
  box.className = "workers";
  box.dataset.node = n.node_id;
  const timed = new Map((n.timings || []).map((t) => [t.local_rank, t]));
  const shown = Math.min(n.local_world_size, MAX_WORKERS_SHOWN);
  for (let lr = 0; lr < shown; lr++) {
    const w = document.createElement("span");
    w.className = "worker";
    w.dataset.localRank = String(lr);
    w.dataset.rank = String(n.rank_offset + lr);
    const parts = ["local " + lr + " · rank " + (n.rank_offset + lr)];
    const t = timed.get(lr);
    if (t && t.window_s > 0) parts.push((t.steps / t.window_s).toFixed(2) + " step/s");
    if (n.slow_rank && n.slow_rank.local_rank === lr) { parts.push("slowest compute"); w.classList.add("slow"); }
    const c = v.culprit;
    if (c && c.node_id === n.node_id && c.local_rank === lr) {
      parts.push("failed in round " + c.round);
      w.classList.add("culprit");
      w.title = c.cause;
    }
    w.textContent = parts.join(" · ");
    box.appendChild(w);
  }
  if (n.local_world_size > shown) {
    const more = document.createElement("span");
    more.className = "muted";
    more.textContent = "+" + (n.local_world_size - shown) + " more";
    box.appendChild(more);
  }
  if (n.step !== null && n.step !== undefined) {
    const step = document.createElement("span");
    step.className = "muted";
    step.textContent = "lowest step " + n.step + (n.steps_per_s === null || n.steps_per_s === undefined ? "" : " at " + n.steps_per_s.toFixed(2) + " step/s");
    box.appendChild(step);
  }
  return box;
}
