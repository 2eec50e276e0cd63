// rdzv dashboard: plain JavaScript, no build step, nothing fetched from elsewhere.
// Everything that came from the network is put into the page with textContent, never as HTML.
"use strict";

const EVENT_TYPES = ["round_opened", "round_completed", "node_joined", "node_lost", "node_evicted",
  "node_succeeded", "node_failed", "restart_charged", "job_state", "host_cordoned", "host_uncordoned", "straggler_flagged", "gap"];
const MIN_REFRESH_MS = 200;   // at most this often a view is refetched on events
const POLL_MS = 5000;         // and this often anyway (last seen, ages)
const MAX_EVENTS_SHOWN = 100;
const UI_NODES = 500; // nodes a job page lists (a 16,384-node job: the first 500 by rank; node_counts counts all)

const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function fmtSecs(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

function fmtTime(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "";
}

class AuthNeeded extends Error {}

async function api(path, opts) {
  const r = await fetch(path, Object.assign({ credentials: "same-origin" }, opts || {}));
  if (r.status === 401) throw new AuthNeeded();
  const role = r.headers.get("X-Rdzv-Role");  // set on answers to a /ui session (a server with a token)
  if (role) { $("role").textContent = role; $("session").hidden = false; }
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new Error((body && body.message) || ("HTTP " + r.status));
  return body;
}

// ------------------------------------------------------------------ live updates

let source = null;
let refreshTimer = null;
let refreshing = false;
let dirty = false;
let lastRefresh = 0;
let render = async () => {};

function scheduleRefresh() {
  dirty = true;
  if (refreshing || refreshTimer) return;
  const wait = Math.max(0, lastRefresh + MIN_REFRESH_MS - Date.now());
  refreshTimer = setTimeout(runRefresh, wait);
}

async function runRefresh() {
  refreshTimer = null;
  if (refreshing) return;
  refreshing = true;
  dirty = false;
  lastRefresh = Date.now();
  try {
    await render();
  } catch (e) {
    if (e instanceof AuthNeeded) { showLogin(); return; }
    console.error(e);
  } finally {
    refreshing = false;
  }
  if (dirty) scheduleRefresh();
}

function listen(url, onEvent) {
  if (source) source.close();
  source = new EventSource(url);
  const live = $("live");
  source.onopen = () => { live.textContent = "live"; live.classList.remove("off"); scheduleRefresh(); };
  source.onerror = () => { live.textContent = "reconnecting"; live.classList.add("off"); };
  for (const t of EVENT_TYPES) {
    source.addEventListener(t, (msg) => {
      let ev = null;
      try { ev = JSON.parse(msg.data); } catch (e) { return; }
      if (onEvent) onEvent(ev);
      scheduleRefresh();
    });
  }
}

// ------------------------------------------------------------------ login

function showLogin() {
  if (source) { source.close(); source = null; }
  for (const id of ["jobs", "job", "hosts"]) $(id).hidden = true;
  $("login").hidden = false;
  $("token").focus();
}

async function login(ev) {
  ev.preventDefault();
  $("login-error").textContent = "";
  try {
    await api("/ui/login", {
      method: "POST", headers: { "Content-Type": "application/json", "X-Rdzv-UI": "1" },
      body: JSON.stringify({ token: $("token").value }),
    });
  } catch (e) {
    $("login-error").textContent = e instanceof AuthNeeded ? "wrong token" : e.message;
    return;
  }
  $("token").value = "";
  $("login").hidden = true;
  start();
}

async function logout() {
  await fetch("/ui/logout", { method: "POST", headers: { "X-Rdzv-UI": "1" }, credentials: "same-origin" });
  $("session").hidden = true;
  showLogin();
}

function ready() {
  document.body.dataset.ready = "1";
  if (window.rdzvReadyMs === undefined) window.rdzvReadyMs = performance.now();  // for bench/ui_events.py
}

// ------------------------------------------------------------------ job list

async function renderJobs() {
  const state = $("state-filter").value;
  const q = "/v1/jobs?order=newest&limit=1000" + (state ? "&state=" + encodeURIComponent(state) : "");
  const list = await api(q);
  const now = Date.now() / 1000;
  const frag = document.createDocumentFragment();
  for (const j of list.jobs) {
    const tr = el("tr");
    tr.dataset.job = j.job_id;
    const a = el("a", null, j.job_id);
    a.href = "/ui/jobs/" + encodeURIComponent(j.job_id);
    const td = el("td"); td.appendChild(a); tr.appendChild(td);
    const st = el("td"); st.appendChild(el("span", "state " + j.state, j.state)); tr.appendChild(st);
    tr.appendChild(el("td", "num", j.round));
    tr.appendChild(el("td", "num", j.nodes + (j.spares ? " +" + j.spares : "")));
    tr.appendChild(el("td", "num", j.min_nodes + ":" + j.max_nodes));
    tr.appendChild(el("td", "num", j.world_size));
    tr.appendChild(el("td", "num", j.restarts + "/" + j.max_restarts));
    tr.appendChild(el("td", "num", j.created_at ? fmtSecs(Math.max(0, now - j.created_at)) : ""));
    tr.appendChild(el("td", "reason", j.reason || "")).title = j.reason || "";
    frag.appendChild(tr);
  }
  $("jobs-body").replaceChildren(frag);
  $("jobs-count").textContent = list.jobs.length + " job(s)" + (list.next_cursor ? " (first 1000)" : "");
  $("jobs").hidden = false;
  ready();
}

// ------------------------------------------------------------------ one job

function nodeRow(n, v) {
  const row = el("div", "row");
  row.setAttribute("role", "row");
  row.dataset.node = n.node_id;
  const cell = (cls, text) => row.appendChild(el("span", cls, text));
  cell("num", n.group_rank === null ? "" : n.group_rank);
  cell(null, n.node_id).title = n.node_id;  // (a clipped cell shows all of it on hover)
  cell(null, n.host).title = n.host;
  cell(null, n.addr);
  const st = el("span");
  const slow = n.straggler && n.slow_rank ? n.slow_rank : null;  // flagged by a rank's compute (lock-step)
  st.appendChild(el("span", "state " + n.state, n.state + (n.straggler ? " (straggler)" : "")));
  if (n.host_blocked) st.title = n.host_blocked;
  else if (slow) st.title = "rank " + slow.rank + ": compute score " + slow.ratio.toFixed(2) + " for " + fmtSecs(slow.window_s);
  row.appendChild(st);
  cell("num", n.local_world_size);
  cell("num", (n.last_seen_s < 60 ? n.last_seen_s.toFixed(1) + " s" : fmtSecs(n.last_seen_s)) + " ago");
  cell("num", n.step === null || n.step === undefined ? "" : n.step);
  cell("num", n.steps_per_s === null || n.steps_per_s === undefined ? "" : n.steps_per_s.toFixed(2));
  markCulprit(v, row, n);
  return row;
}

function renderForming(v) {
  const w = v.waiting_for;
  $("forming").hidden = !w;
  if (!w) return;
  const max = Math.max(1, w.max_nodes);
  $("forming-title").textContent = "Round " + v.round + " forming: " + w.joined + " joined (min " + w.min_nodes + ", max " + w.max_nodes + ")";
  $("forming-text").textContent = w.text;
  const p = $("progress");
  p.setAttribute("aria-valuemin", "0");
  p.setAttribute("aria-valuemax", String(w.max_nodes));
  p.setAttribute("aria-valuenow", String(w.joined));
  p.dataset.joined = String(w.joined);
  p.dataset.min = String(w.min_nodes);
  p.dataset.max = String(w.max_nodes);
  $("progress-fill").style.width = Math.min(100, (100 * w.joined) / max) + "%";
  $("progress-min").style.left = Math.min(100, (100 * w.min_nodes) / max) + "%";
  $("progress-label").textContent = "min " + w.min_nodes;
  $("progress-max").textContent = "max " + w.max_nodes;
}

function renderHistory(v) {
  const frag = document.createDocumentFragment();
  const longest = Math.max(0.001, ...v.history.map((r) => (r.completed_at ? r.completed_at - r.started_at : 0)));
  for (const r of v.history.slice().reverse()) {
    const li = el("li");
    li.dataset.round = String(r.round);
    li.appendChild(el("b", null, "round " + r.round));
    li.appendChild(el("span", "muted", fmtTime(r.started_at)));
    if (r.completed_at) {
      const secs = r.completed_at - r.started_at;
      li.appendChild(el("span", null, " formed in " + fmtSecs(secs) + ", " + r.nodes + " node(s), world " + r.world_size));
      const bar = el("span", "dur");
      bar.style.width = Math.max(2, Math.round((80 * secs) / longest)) + "px";
      li.appendChild(bar);
    } else {
      li.appendChild(el("span", null, " forming"));
    }
    li.appendChild(el("span", "reason", r.reason));
    frag.appendChild(li);
  }
  if (v.history_omitted) frag.appendChild(el("li", "muted", v.history_omitted + " earlier round(s) not shown"));
  $("history").replaceChildren(frag);
}

function renderRuns(v) {
  // a job id's previous runs (the job id started again after it ended), newest first
  const runs = v.runs || [];
  const frag = document.createDocumentFragment();
  for (const r of runs.slice().reverse()) {
    const li = el("li");
    li.dataset.run = String(r.run);
    li.appendChild(el("b", null, "run " + r.run + " "));
    li.appendChild(el("span", "state " + r.state, r.state));
    li.appendChild(el("span", "muted", " " + fmtTime(r.started_at) + ", " + fmtSecs(Math.max(0, r.ended_at - r.started_at)) +
      ", " + r.rounds + " round(s), " + r.restarts + " restart(s)"));
    li.appendChild(el("span", "reason", r.root_cause || r.reason));
    frag.appendChild(li);
  }
  $("runs").replaceChildren(frag);
  $("runs-box").hidden = runs.length === 0;
}

function addEvent(ev) {
  const li = el("li");
  li.dataset.type = ev.type;
  li.appendChild(el("span", "type", ev.type));
  const run = ev.run !== null && ev.run !== undefined && ev.run > 1 ? " run " + ev.run : "";
  li.appendChild(el("span", "muted", " " + fmtTime(ev.time) + run + (ev.round !== null && ev.round !== undefined ? " round " + ev.round : "")));
  const parts = [];
  if (ev.node) parts.push("node " + ev.node);
  for (const k of ["state", "reason", "cause", "root_cause", "host", "world_size", "formation_s", "restarts", "message"]) {
    if (ev[k] !== undefined && ev[k] !== null) parts.push(k + ": " + (k === "formation_s" ? fmtSecs(ev[k]) : ev[k]));
  }
  li.appendChild(el("span", "detail", parts.join("; ")));
  const list = $("events");
  list.insertBefore(li, list.firstChild);
  while (list.childElementCount > MAX_EVENTS_SHOWN) list.removeChild(list.lastChild);
}

async function renderJob(jobId) {
  let v;
  try {
    v = await api("/v1/jobs/" + encodeURIComponent(jobId) + "?limit=" + UI_NODES);  // a big job: a page, all counted
  } catch (e) {
    if (e instanceof AuthNeeded) throw e;
    $("job-title").textContent = jobId;
    $("job-facts").textContent = e.message;
    $("job").hidden = false;
    return;
  }
  const finished = ["succeeded", "failed", "closed"].includes(v.state);
  $("job-title").textContent = v.job_id;
  const st = $("job-state");
  st.textContent = v.state;
  st.className = "state " + v.state;
  $("job-facts").textContent = (v.run > 1 ? "run " + v.run + " · " : "") + "round " + v.round + " · world " + v.world_size + " · nnodes " + v.min_nodes + ":" + v.max_nodes +
    " · restarts " + v.restarts + "/" + v.max_restarts + (v.master_addr ? " · master " + v.master_addr + ":" + v.master_port : "");
  $("close-btn").disabled = finished;
  if (finished) $("close-confirm").hidden = true;
  $("root-cause").hidden = !v.root_cause;
  $("root-cause-text").textContent = v.root_cause || "";
  renderForming(v);
  const frag = document.createDocumentFragment();
  for (const n of v.nodes) {
    frag.appendChild(nodeRow(n, v));
    const workers = workersRow(v, n);  // its workers' ranks (workers.js)
    if (workers) frag.appendChild(workers);
  }
  for (const n of v.spares) frag.appendChild(nodeRow(n, v));
  $("nodes-body").replaceChildren(frag);
  const counts = Object.entries(v.node_counts || {}).map(([k, n]) => n + " " + k).join(", ");
  $("nodes-count").textContent = (v.nodes.length + v.spares.length) + (v.nodes_omitted ? " (+" + v.nodes_omitted + " not shown; " + counts + ")" : "");
  renderCulprit(v);
  renderDeparted(v);
  renderHistory(v);
  renderRuns(v);
  $("job").hidden = false;
  ready();
}

async function closeJob(jobId) {
  $("close-error").textContent = "";
  $("close-yes").disabled = true;
  try {
    await api("/v1/jobs/" + encodeURIComponent(jobId) + "/close", { method: "POST", headers: { "X-Rdzv-UI": "1" } });
    $("close-confirm").hidden = true;
  } catch (e) {
    if (e instanceof AuthNeeded) { showLogin(); return; }
    $("close-error").textContent = "close failed: " + e.message;
  } finally {
    $("close-yes").disabled = false;
  }
  scheduleRefresh();
}

// ------------------------------------------------------------------ start

function route() {
  const m = location.pathname.match(/^\/ui\/jobs\/([^/]+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

async function start() {
  const jobId = route();
  try {
    if (location.pathname === "/ui/hosts") {
      $("crumb").textContent = "hosts";
      render = renderHosts;
      await renderHosts();
      listen("/v1/events", null);
    } else if (jobId === null) {
      $("crumb").textContent = "jobs";
      render = renderJobs;
      await renderJobs();
      listen("/v1/events", null);
    } else {
      $("crumb").textContent = "job " + jobId;
      document.title = "rdzv: " + jobId;
      render = () => renderJob(jobId);
      await renderJob(jobId);
      // the job's recent events for the list, then live ones from there (a replay would only redraw)
      const path = "/v1/jobs/" + encodeURIComponent(jobId) + "/events";
      // (an answer holds ~4 MiB at most: "more" says ask again from its last_id)
      let held = await api(path + "?since=0");
      let recent = held.events.slice(-MAX_EVENTS_SHOWN);
      while (held.more) {
        held = await api(path + "?since=" + held.last_id);
        recent = recent.concat(held.events).slice(-MAX_EVENTS_SHOWN);
      }
      for (const ev of recent) addEvent(ev);
      listen(path + "?last_event_id=" + held.last_id, addEvent);
    }
  } catch (e) {
    if (e instanceof AuthNeeded) { showLogin(); return; }
    throw e;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("state-filter").addEventListener("change", () => scheduleRefresh());
  $("close-btn").addEventListener("click", () => { $("close-confirm").hidden = false; });
  $("close-no").addEventListener("click", () => { $("close-confirm").hidden = true; });
  $("close-yes").addEventListener("click", () => { const j = route(); if (j !== null) closeJob(j); });
  setInterval(() => { if (!document.hidden && $("login").hidden) scheduleRefresh(); }, POLL_MS);
  start();
});
