// rdzv dashboard, the parts that explain (issue 25): a failed job's culprit and its last stderr
// lines, the nodes that left, a reason per job, and the hosts page. Loaded before app.js, whose
// helpers ($, el, api, fmtTime, fmtSecs, ready) these use when called. Everything that came from
// the network goes in with textContent, never as HTML.
"use strict";

// The culprit: the node and rank that failed first, its round and cause, its last stderr lines.
function renderCulprit(v) {
  const c = v.culprit;
  $("culprit").hidden = !c;
  if (!c) return;
  $("culprit-title").textContent = "node " + c.node_id + " (" + c.host + "), rank " + c.rank +
    " (local rank " + c.local_rank + "), round " + c.round;
  $("culprit-cause").textContent = c.cause;
  $("culprit-cause").hidden = c.cause === v.root_cause;  // said once: the root cause above is this failure
  $("culprit-stderr").textContent = (c.stderr || []).join("\n");
  $("culprit-stderr").hidden = !(c.stderr && c.stderr.length);
}

// Marks the culprit's row in the nodes table (while that node is still listed).
function markCulprit(v, row, n) {
  if (v.culprit && v.culprit.node_id === n.node_id) {
    row.classList.add("culprit");
    row.title = "last failure, round " + v.culprit.round + ": " + v.culprit.cause;
  }
}

// Nodes that left: when, in which round, why; newest first.
function renderDeparted(v) {
  const gone = v.departed || [];
  const frag = document.createDocumentFragment();
  for (const d of gone.slice().reverse()) {
    const li = el("li");
    li.dataset.node = d.node_id;
    if (v.culprit && v.culprit.node_id === d.node_id) li.classList.add("culprit");
    li.appendChild(el("b", null, d.node_id));
    li.appendChild(el("span", "muted", " " + d.host + " · left " + fmtTime(d.left_at) + " in round " + d.round));
    li.appendChild(el("span", "reason", d.reason));
    frag.appendChild(li);
  }
  $("departed").replaceChildren(frag);
  $("departed-box").hidden = gone.length === 0;
}

// The hosts page: every host record (failures, cool-downs, cordons), the first 1000.
async function renderHosts() {
  const list = await api("/v1/hosts?limit=1000");
  const frag = document.createDocumentFragment();
  for (const h of list.hosts) {
    const tr = el("tr");
    tr.dataset.host = h.host;
    tr.appendChild(el("td", null, h.host));
    const st = el("td");
    st.appendChild(el("span", "state host-" + h.state, h.state));
    tr.appendChild(st);
    tr.appendChild(el("td", "reason", h.reason || ""));
    tr.appendChild(el("td", "num", h.failures_total));
    tr.appendChild(el("td", "num", h.cooldowns));
    const last = h.failures.length ? h.failures[h.failures.length - 1] : null;
    tr.appendChild(el("td", "reason", last ? fmtTime(last.at) + " " + last.job_id + ": " + last.reason : ""));
    tr.appendChild(el("td", "num", fmtTime(h.updated_at)));
    frag.appendChild(tr);
  }
  $("hosts-body").replaceChildren(frag);
  $("hosts-count").textContent = list.hosts.length + " host(s)" + (list.next_cursor ? " (first 1000)" : "");
  $("hosts").hidden = false;
  ready();
}
