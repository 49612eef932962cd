// The dashboard of phalanx server: three pages (jobs, a job, the fleet) drawn from /api/v1/dashboard/* and kept
// up to date by one WebSocket per page (/api/v1/dashboard/live), which sends the page's data again whenever it
// changes. The token stays in this tab (sessionStorage) and goes with every request.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
const main = $("#main");
const STATES = ["PENDING", "ADMITTED", "RUNNING", "PREEMPTED", "SUCCEEDED", "FAILED", "CANCELLED"];
const GOODPUT = {
  productive: "#2b8a3e", lost: "#c92a2a", checkpoint: "#4c6ef5", data: "#15aabf",
  detection: "#e67700", recovery: "#f08c00", idle: "#adb5bd",
};
let token = sessionStorage.getItem("phalanx-token");
let channel = null; // the live channel of the page shown
let follow = null; // the log poller of the job page

const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const pct = (v) => (v == null ? "" : `${(100 * v).toFixed(1)}%`);
const num = (v, digits = 0) => (v == null ? "" : Number(v).toLocaleString(undefined, { maximumFractionDigits: digits }));
const when = (ts) => new Date(ts * 1000).toLocaleString();
function duration(s) {
  if (s == null) return "";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(s % 60).padStart(2, "0")}s` : `${s}s`;
}

async function api(path, options = {}) {
  const response = await fetch("/api/v1" + path, {
    ...options,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
  });
  if (response.status === 401) {
    logout();
    throw new Error("logged out");
  }
  const body = await response.json();
  if (!response.ok) {
    const detail = body.detail;
    throw new Error(typeof detail === "string" ? detail : detail.map((d) => `${d.loc.join(".")}: ${d.msg}`).join("; "));
  }
  return body;
}

function live(view, id, render) {
  if (channel) channel.close();
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/api/v1/dashboard/live`);
  ws.onopen = () => ws.send(JSON.stringify({ token, view, id }));
  ws.onmessage = (message) => render(JSON.parse(message.data));
  ws.onclose = (event) => {
    if (channel !== ws) return; // replaced by another page's
    if (event.code === 4401) logout();
    else if (event.code === 4404) main.innerHTML = `<p class="error">${esc(event.reason)}</p>`;
    else setTimeout(() => channel === ws && live(view, id, render), 2000); // the server restarted: again
  };
  channel = ws;
}

function stopPage() {
  if (channel) channel.close();
  channel = null;
  if (follow) clearInterval(follow);
  follow = null;
}

// --- logging in
function loginPage() {
  stopPage();
  main.replaceChildren($("#login-page").content.cloneNode(true));
  const submit = async () => {
    token = $("#token").value.trim();
    try {
      await whoami();
      sessionStorage.setItem("phalanx-token", token);
      location.hash = "#/jobs";
      route();
    } catch (e) {
      $("#login-error").textContent = e.message;
    }
  };
  $("#login").onclick = submit;
  $("#token").onkeydown = (e) => e.key === "Enter" && submit();
}

async function whoami() {
  const response = await fetch("/api/v1/whoami", { headers: { Authorization: `Bearer ${token}` } });
  if (!response.ok) throw new Error("that token is not valid (missing, expired or revoked)");
  const who = await response.json();
  $("#who").textContent = `${who.user} (${who.role}${who.tenant ? `, ${who.tenant}` : ""})`;
  $("#logout").hidden = false;
  return who;
}

function logout() {
  sessionStorage.removeItem("phalanx-token");
  token = null;
  $("#who").textContent = "";
  $("#logout").hidden = true;
  loginPage();
}

// --- the jobs table
const COLUMNS = [
  ["id", "job"], ["tenant", "tenant"], ["state", "state"], ["gpus", "GPUs"], ["progress", "progress"],
  ["eta_s", "ETA"], ["tokens_per_s", "tokens/s"], ["mfu", "MFU"], ["goodput", "goodput"], ["restarts", "restarts"],
  ["submitted_at", "submitted"],
];
const table = { sort: "submitted_at", descending: true, filter: "", state: "" };

function jobsPage() {
  main.innerHTML = `
    <h1>Jobs</h1>
    <div class="toolbar">
      <input id="filter" placeholder="filter: id, name, tenant, owner" size="40" value="${esc(table.filter)}">
      <select id="state-filter"><option value="">any state</option>
        ${STATES.map((s) => `<option ${s === table.state ? "selected" : ""}>${s}</option>`).join("")}</select>
      <span id="count"></span>
    </div>
    <table id="jobs-table"><thead><tr>${COLUMNS.map(([k, label]) => `<th data-sort="${k}">${label}</th>`).join("")}</tr></thead>
      <tbody></tbody></table>
    <h2>Submit a job</h2>
    <textarea id="submit-spec" rows="8" placeholder="name: my-job&#10;resources: {procs_per_node: 2, device: cpu}&#10;train: {model: {preset: llama-tiny}, steps: 100}"></textarea>
    <div class="toolbar"><label>priority <input id="submit-priority" type="number" value="0" style="width:5em"></label>
      <button id="submit">Submit</button><span id="submit-result"></span></div>`;
  let rows = [];
  const draw = () => {
    const text = table.filter.toLowerCase();
    const shown = rows
      .filter((j) => (!table.state || j.state === table.state) &&
        (!text || [j.id, j.name, j.tenant, j.owner].some((v) => v.toLowerCase().includes(text))))
      .sort((a, b) => {
        const [x, y] = [a[table.sort], b[table.sort]];
        const order = x == null ? 1 : y == null ? -1 : x < y ? -1 : x > y ? 1 : 0;
        return table.descending ? -order : order;
      });
    $("#count").textContent = `${shown.length} of ${rows.length}`;
    $("#jobs-table tbody").innerHTML = shown.map((j) => `
      <tr data-job="${esc(j.id)}">
        <td><a href="#/jobs/${esc(j.id)}">${esc(j.id)}</a></td><td>${esc(j.tenant)}</td>
        <td class="state state-${esc(j.state)}" title="${esc(j.reason)}">${esc(j.state)}</td><td>${j.gpus}</td>
        <td class="progress"><div class="bar"><span style="width:${100 * (j.progress || 0)}%"></span></div>
          ${j.steps_done == null ? "" : `${j.steps_done}${j.total_steps ? ` / ${j.total_steps}` : ""}`}</td>
        <td>${duration(j.eta_s)}</td><td>${num(j.tokens_per_s)}</td><td>${pct(j.mfu)}</td><td>${pct(j.goodput)}</td>
        <td class="restarts">${j.restarts}</td><td>${when(j.submitted_at)}</td>
      </tr>`).join("");
  };
  $("#filter").oninput = (e) => { table.filter = e.target.value; draw(); };
  $("#state-filter").onchange = (e) => { table.state = e.target.value; draw(); };
  for (const th of main.querySelectorAll("th[data-sort]")) {
    th.onclick = () => {
      table.descending = table.sort === th.dataset.sort ? !table.descending : false;
      table.sort = th.dataset.sort;
      draw();
    };
  }
  $("#submit").onclick = async () => {
    try {
      const spec = $("#submit-spec").value;
      const made = await api("/jobs", { method: "POST", body: JSON.stringify({ spec, priority: Number($("#submit-priority").value) }) });
      $("#submit-result").innerHTML = `submitted <a href="#/jobs/${esc(made.id)}">${esc(made.id)}</a>`;
    } catch (e) {
      $("#submit-result").innerHTML = `<span class="error">${esc(e.message)}</span>`;
    }
  };
  live("jobs", null, (data) => { rows = data.jobs; draw(); });
}

// --- one job
function chart(element, title, label, format = (v) => v) {
  const marks = { attempts: [], bad: [] };
  const plot = new uPlot({
    title, width: Math.max(380, element.clientWidth), height: 220,
    scales: { x: { time: true } },
    series: [{}, { label, stroke: "#4c6ef5", width: 1.5, value: (u, v) => (v == null ? "" : format(v)) }],
    axes: [{}, { values: (u, ticks) => ticks.map(format), size: 80 }],
    hooks: { draw: [(u) => {
      const { ctx, bbox } = u;
      ctx.save();
      for (const [times, color, dash] of [[marks.attempts, "#e67700", []], [marks.bad, "#c92a2a", [4, 4]]]) {
        ctx.strokeStyle = color; ctx.setLineDash(dash); ctx.lineWidth = 1.5;
        for (const t of times) {
          const x = u.valToPos(t, "x", true);
          if (x < bbox.left || x > bbox.left + bbox.width) continue;
          ctx.beginPath(); ctx.moveTo(x, bbox.top); ctx.lineTo(x, bbox.top + bbox.height); ctx.stroke();
        }
      }
      ctx.restore();
    }] },
  }, [[], []], element);
  return { plot, marks };
}

function jobPage(id) {
  main.innerHTML = `
    <h1>Job <span id="job-id">${esc(id)}</span> <span id="job-state"></span></h1>
    <p id="job-reason" class="why"></p>
    <div class="toolbar"><div class="bar" style="width:20em"><span id="job-bar"></span></div><span id="job-progress"></span>
      <span id="job-speed"></span><button id="cancel">Cancel</button></div>
    <div class="charts"><div id="chart-loss"></div><div id="chart-tokens"></div><div id="chart-mfu"></div>
      <div id="chart-step"></div><div id="chart-memory"></div></div>
    <p class="legend"><span><i style="background:#e67700"></i>an attempt began (a restart)</span>
      <span><i style="background:#c92a2a"></i>a bad step (NaN, spike)</span></p>
    <h2>Goodput</h2><div id="goodput"></div>
    <h2>Restarts</h2><ol id="restarts"></ol>
    <h2>Timeline</h2><table id="timeline"><tbody></tbody></table>
    <h2>Logs</h2>
    <div class="toolbar"><label>rank <select id="rank"></select></label><label><input id="follow" type="checkbox" checked> follow</label></div>
    <pre id="log"></pre>
    <h2>Stack dumps</h2><div id="stacks"><p class="why">none: dumped when a rank is found hung</p></div>`;
  const gib = (v) => `${(v / 2 ** 30).toFixed(2)} GiB`;
  const charts = {
    loss: chart($("#chart-loss"), "loss", "loss", (v) => v.toFixed(3)),
    tokens_per_s: chart($("#chart-tokens"), "tokens/s", "tokens/s", (v) => num(v)),
    mfu: chart($("#chart-mfu"), "MFU", "MFU", (v) => pct(v)),
    step_time_s: chart($("#chart-step"), "step time", "s", (v) => `${v.toFixed(3)} s`),
    peak_memory_bytes: chart($("#chart-memory"), "peak memory", "memory", gib),
  };
  $("#cancel").onclick = () => api(`/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" }).catch((e) => alert(e.message));
  const log = { rank: null, offset: 0, execution: null };
  const readLog = async () => {
    if (log.rank == null || !$("#follow").checked) return;
    const chunk = await api(`/jobs/${encodeURIComponent(id)}/logs?rank=${log.rank}&offset=${log.offset}`);
    if (chunk.execution !== log.execution) { $("#log").textContent = ""; log.execution = chunk.execution; }
    if (chunk.text) {
      const pre = $("#log");
      pre.textContent += chunk.text;
      pre.scrollTop = pre.scrollHeight;
    }
    log.offset = chunk.next_offset;
  };
  $("#rank").onchange = (e) => { log.rank = Number(e.target.value); log.offset = 0; $("#log").textContent = ""; readLog(); };
  follow = setInterval(() => readLog().catch(() => {}), 1000);

  live("job", id, (d) => {
    const j = d.job;
    $("#job-state").textContent = j.state;
    $("#job-state").className = `state state-${j.state}`;
    $("#job-reason").textContent = j.reason;
    $("#job-bar").style.width = `${100 * (j.progress || 0)}%`;
    $("#job-progress").textContent = j.steps_done == null ? "no step yet" :
      `step ${j.steps_done}${j.total_steps ? ` of ${j.total_steps} (${pct(j.progress)})` : ""}${j.eta_s ? `, ETA ${duration(j.eta_s)}` : ""}`;
    $("#job-speed").textContent = [j.tokens_per_s && `${num(j.tokens_per_s)} tokens/s`, j.mfu && `MFU ${pct(j.mfu)}`,
      j.goodput != null && `goodput ${pct(j.goodput)}`].filter(Boolean).join(" · ");
    $("#cancel").hidden = d.final;
    // One line per attempt: a gap where an attempt ended and the next resumed (steps go back to a checkpoint).
    const points = [];
    d.steps.forEach((s, i) => {
      const before = d.steps[i - 1];
      if (before && (s.execution !== before.execution || s.step <= before.step)) points.push({ ts: (before.ts + s.ts) / 2 });
      points.push(s);
    });
    const attempts = d.marks.filter((m) => m.kind === "attempt" && (m.attempt > 0 || m.execution > 1)).map((m) => m.ts);
    const bad = d.marks.filter((m) => m.kind === "bad_step").map((m) => m.ts);
    for (const [key, c] of Object.entries(charts)) {
      c.marks.attempts = attempts; c.marks.bad = bad;
      c.plot.setData([points.map((p) => p.ts), points.map((p) => p[key] ?? null)]);
    }
    const g = d.goodput;
    $("#goodput").innerHTML = `<div class="goodput">${Object.entries(g.seconds).map(([k, s]) =>
      `<span data-category="${k}" style="width:${g.wall_s ? (100 * s) / g.wall_s : 0}%;background:${GOODPUT[k]}" title="${k} ${s.toFixed(1)} s"></span>`).join("")}</div>
      <p class="legend">${Object.entries(g.seconds).map(([k, s]) => `<span><i style="background:${GOODPUT[k]}"></i>${k} ${duration(s)}</span>`).join("")}
      of ${duration(g.wall_s)}: goodput ${pct(g.goodput)}</p>`;
    $("#restarts").innerHTML = d.restarts.length ? d.restarts.map((r) =>
      `<li data-cause="${esc(r.cause)}"><b>${esc(r.cause)}</b> (execution ${r.execution}, ${when(r.ts)}): ${esc(r.reason)}</li>`).join("")
      : "<li class=\"why\">none</li>";
    $("#timeline tbody").innerHTML = d.timeline.map((e) =>
      `<tr><td>${when(e.ts)}</td><td>${esc(e.kind)}</td><td class="why">${esc(e.text)}</td></tr>`).join("");
    const ranks = d.ranks.map(String);
    const shown = [...$("#rank").options].map((o) => o.value);
    if (ranks.join() !== shown.join()) {
      $("#rank").innerHTML = ranks.map((r) => `<option>${r}</option>`).join("");
      if (log.rank == null && ranks.length) { log.rank = Number(ranks[0]); readLog(); }
    }
    const stacks = Object.entries(d.stacks);
    if (stacks.length) $("#stacks").innerHTML = stacks.map(([r, text]) => `<h3>rank ${esc(r)}</h3><pre>${esc(text)}</pre>`).join("");
  });
}

// --- the fleet
function fleetPage() {
  main.innerHTML = `
    <h1>Fleet</h1><p id="capacity"></p>
    <h2>GPUs by tenant</h2>
    <table id="tenants"><thead><tr><th>tenant</th><th>in use / quota</th><th></th><th>borrowing limit</th><th>preemptions</th></tr></thead><tbody></tbody></table>
    <h2>Queue</h2>
    <table id="queue"><thead><tr><th>job</th><th>tenant</th><th>GPUs</th><th>priority</th><th>waiting</th><th>why</th></tr></thead><tbody></tbody></table>
    <h2>Utilisation, last 24 hours</h2><div id="chart-utilisation"></div>`;
  const used = chart($("#chart-utilisation"), "GPUs allocated", "GPUs", (v) => num(v, 1));
  live("fleet", null, (d) => {
    const inUse = d.tenants.reduce((sum, t) => sum + t.gpus_in_use, 0);
    $("#capacity").textContent = `${inUse} of ${d.capacity} GPUs in use; ${d.queue.length} job(s) waiting`;
    $("#tenants tbody").innerHTML = d.tenants.map((t) => {
      const scale = Math.max(t.nominal_gpus + (t.borrowing_limit || 0), t.gpus_in_use, 1);
      return `<tr data-tenant="${esc(t.name)}"><td>${esc(t.name)}</td><td>${t.gpus_in_use} / ${t.nominal_gpus}</td>
        <td><div class="bar" style="width:16em"><span style="width:${(100 * t.gpus_in_use) / scale}%"></span>
          <span class="quota" style="width:${(100 * t.nominal_gpus) / scale}%"></span>
          ${t.borrowing_limit != null ? `<span class="borrow" style="width:${(100 * (t.nominal_gpus + t.borrowing_limit)) / scale}%"></span>` : ""}</div></td>
        <td>${t.cohort == null ? "none (no cohort)" : t.borrowing_limit ?? `any idle in ${esc(t.cohort)}`}</td><td>${t.preemptions}</td></tr>`;
    }).join("");
    $("#queue tbody").innerHTML = d.queue.map((q) => `<tr data-job="${esc(q.id)}"><td><a href="#/jobs/${esc(q.id)}">${esc(q.id)}</a></td>
      <td>${esc(q.tenant)}</td><td>${q.gpus}</td><td>${q.priority}</td><td>${duration(q.waiting_s)}</td><td class="why">${esc(q.why)}</td></tr>`).join("")
      || "<tr><td colspan=\"6\" class=\"why\">nothing waits</td></tr>";
    used.plot.setData([d.utilisation.ts, d.utilisation.gpus]);
  });
}

// --- routing: #/jobs, #/jobs/ID, #/fleet
async function route() {
  stopPage();
  if (!token) return loginPage();
  try {
    await whoami();
  } catch {
    return logout();
  }
  const [, page, id] = location.hash.split("/");
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.id === `nav-${page}`);
  if (page === "fleet") fleetPage();
  else if (page === "jobs" && id) jobPage(decodeURIComponent(id));
  else jobsPage();
}

$("#logout").onclick = logout;
window.addEventListener("hashchange", route);
route();
