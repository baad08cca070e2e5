// The dashboard's one JS module: live job progress over a WebSocket (reconnect with backoff, catch up
// from the JSON state view), uPlot charts, XHR dataset upload with a progress bar, history charts.
// Pages are server-rendered; this only updates what is already on them.

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

// ---------------------------------------------------------------- formatting
export function fmtDuration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "—";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  const pad = (n) => String(n).padStart(2, "0");
  return h ? `${h}:${pad(m)}:${pad(sec)}` : `${pad(m)}:${pad(sec)}`;
}
function fmtNum(v, digits = 2) {
  if (v === null || v === undefined || v === "") return "—";
  return Number(v).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}
const FORMAT = {
  samples_per_s: (v) => fmtNum(v, 2),
  avg_samples_per_s: (v) => fmtNum(v, 2),
  output_tokens_per_s: (v) => fmtNum(v, 0),
  eta_s: fmtDuration,
  elapsed_s: fmtDuration,
  errors: (v) => {
    const parts = Object.entries(v || {}).filter(([, n]) => n).map(([k, n]) => `${k}: ${n}`);
    return parts.length ? parts.join(", ") : "none";
  },
};

// ---------------------------------------------------------------- live socket
// Connects, forwards messages to onMessage, and after every (re)connect calls onOpen(reconnected) so
// the page can fetch the current state: nothing shown is lost while the socket was down.
export class LiveSocket {
  constructor(path, { onMessage, onOpen, onStatus }) {
    this.path = path;
    this.onMessage = onMessage;
    this.onOpen = onOpen || (() => {});
    this.onStatus = onStatus || (() => {});
    this.attempt = 0;
    this.opened = 0;
    this.closedByUs = false;
    this.connect();
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && (!this.ws || this.ws.readyState > 1)) this.connectNow();
    });
  }
  url() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    return `${proto}//${location.host}${this.path}`;
  }
  connect() {
    this.onStatus(this.opened ? "reconnecting…" : "connecting…", "");
    let ws;
    try { ws = new WebSocket(this.url()); } catch (e) { this.scheduleReconnect(); return; }
    this.ws = ws;
    ws.onopen = () => {
      const reconnected = this.opened > 0;
      this.opened += 1;
      this.attempt = 0;
      this.onStatus("live", "live");
      this.onOpen(reconnected);
      clearInterval(this.pinger);
      this.pinger = setInterval(() => { if (ws.readyState === 1) ws.send('{"type":"ping"}'); }, 25000);
    };
    ws.onmessage = (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if (msg.type === "pong") return;
      this.onMessage(msg);
    };
    ws.onclose = () => {
      clearInterval(this.pinger);
      if (this.closedByUs) return;
      this.onStatus("disconnected — reconnecting", "down");
      this.scheduleReconnect();
    };
    ws.onerror = () => { /* onclose follows */ };
  }
  scheduleReconnect() {
    // Exponential backoff with jitter: 0.5 s, 1 s, 2 s ... capped at 15 s.
    const base = Math.min(15000, 500 * 2 ** this.attempt);
    const delay = base / 2 + Math.random() * base / 2;
    this.attempt += 1;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.connect(), delay);
  }
  connectNow() { clearTimeout(this.timer); this.attempt = 0; this.connect(); }
  close() { this.closedByUs = true; clearTimeout(this.timer); if (this.ws) this.ws.close(); }
}

function setStatus(text, cls) {
  const el = $("#live-status");
  if (!el) return;
  el.textContent = text;
  el.className = "live-status " + (cls || "");
}

async function fetchJSON(url) {
  const r = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

// ---------------------------------------------------------------- progress fields
// Fills [data-field] elements under root from a job.progress payload.
export function applyProgress(root, snap) {
  const total = snap.total || 0;
  const frac = total ? Math.min(1, (snap.done || 0) / total) : 0;
  const pct = (100 * frac).toFixed(1) + "%";
  for (const el of $$("[data-field]", root)) {
    const f = el.dataset.field;
    if (f === "bar") {
      el.style.width = pct;
      el.className = "bar state-" + snap.state;
    } else if (f === "percent") {
      el.textContent = pct;
    } else if (f === "state") {
      el.textContent = snap.state;
      el.className = "badge state-" + snap.state;
    } else if (f === "stalled") {
      el.hidden = !snap.stalled;
    } else if (f === "tqdm") {
      // ng_collect_rollouts' progress line, e.g. "45%|████▌     | 450/1000 [02:15<02:45, 3.33it/s]"
      const blocks = Math.round(frac * 10);
      el.textContent = `${Math.floor(100 * frac)}%|${"█".repeat(blocks)}${" ".repeat(10 - blocks)}| ` +
        `${snap.done}/${total} [${fmtDuration(snap.elapsed_s)}<${fmtDuration(snap.eta_s)}, ${fmtNum(snap.samples_per_s)}it/s]`;
    } else if (f in snap) {
      const fmt = FORMAT[f];
      el.textContent = fmt ? fmt(snap[f]) : String(snap[f]);
    }
  }
}

// ---------------------------------------------------------------- charts (uPlot)
const PALETTE = ["#2f6fdf", "#d64545", "#d99a18", "#1f9d55", "#8e44ad", "#16a3b8", "#7f8c8d", "#e67e22"];
const MAX_POINTS = 1800;

function chartWidth(el) { return Math.max(300, Math.floor(el.getBoundingClientRect().width || 480)); }

function makeChart(el, title, seriesDefs, data) {
  if (typeof uPlot === "undefined") {
    el.innerHTML = `<div class="title-fallback">${title}: chart library not loaded (run scripts/frontend.sh)</div>`;
    return null;
  }
  el.innerHTML = "";
  const opts = {
    title,
    width: chartWidth(el),
    height: 190,
    scales: { x: { time: true } },
    legend: { live: false },
    series: [{}, ...seriesDefs.map((s, i) => ({
      label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 1.5, points: { show: false },
      ...(s.fill ? { fill: s.fill } : {}),
    }))],
    axes: [{ space: 80 }, { size: 55 }],
  };
  return new uPlot(opts, data, el);
}

class JobCharts {
  constructor(series) {
    this.els = {
      samples: $("#chart-samples"), tokens: $("#chart-tokens"), inflight: $("#chart-inflight"), errors: $("#chart-errors"),
    };
    this.points = $("#chart-points");
    this.load(series);
    window.addEventListener("resize", () => this.resize());
  }
  load(series) {
    this.t = series.t.slice();
    this.sps = series.samples_per_s.slice();
    this.tps = series.output_tokens_per_s.slice();
    this.inflight = series.in_flight.slice();
    this.errClasses = series.error_classes.slice();
    this.err = {};
    for (const c of this.errClasses) this.err[c] = series.errors[c].slice();
    this.build();
  }
  build() {
    if (!this.els.samples) return;
    this.charts = {
      samples: makeChart(this.els.samples, "samples/s", [{ label: "samples/s", fill: "rgba(47,111,223,.08)" }], [this.t, this.sps]),
      tokens: makeChart(this.els.tokens, "output tokens/s", [{ label: "tokens/s", color: "#1f9d55" }], [this.t, this.tps]),
      inflight: makeChart(this.els.inflight, "in flight", [{ label: "in flight", color: "#8e44ad" }], [this.t, this.inflight]),
      errors: this.buildErrors(),
    };
    this.updateCount();
  }
  buildErrors() {
    const classes = this.errClasses.length ? this.errClasses : ["errors"];
    const cols = classes.map((c) => this.err[c] || this.t.map(() => 0));
    return makeChart(this.els.errors, "errors by class (per interval)",
      classes.map((c, i) => ({ label: c, color: PALETTE[(i + 1) % PALETTE.length] })), [this.t, ...cols]);
  }
  // A point from a live message; a job that stops running (paused, cancelled, failed, done) adds a gap (null
  // values): the lines break there instead of ramping across the pause.
  push(snap) {
    if (typeof snap.t !== "number") return;
    const t = snap.t;
    if (this.t.length && t <= this.t[this.t.length - 1]) return; // keep x sorted
    const gap = snap.state !== "running";
    if (gap && (!this.sps.length || this.sps[this.sps.length - 1] === null)) return; // one gap is enough
    this.t.push(t);
    this.sps.push(gap ? null : (snap.samples_per_s || 0));
    this.tps.push(gap ? null : (snap.output_tokens_per_s || 0));
    this.inflight.push(gap ? null : (snap.in_flight || 0));
    const errs = gap ? {} : (snap.errors || {});
    let newClass = false;
    for (const c of Object.keys(errs)) {
      if (!this.errClasses.includes(c)) {
        this.errClasses.push(c);
        this.err[c] = this.t.slice(0, -1).map(() => 0);
        newClass = true;
      }
    }
    for (const c of this.errClasses) this.err[c].push(gap ? null : (errs[c] || 0));
    if (this.t.length > MAX_POINTS) {
      const drop = this.t.length - MAX_POINTS;
      for (const arr of [this.t, this.sps, this.tps, this.inflight, ...Object.values(this.err)]) arr.splice(0, drop);
    }
    if (!this.charts) return;
    this.charts.samples?.setData([this.t, this.sps]);
    this.charts.tokens?.setData([this.t, this.tps]);
    this.charts.inflight?.setData([this.t, this.inflight]);
    if (newClass) {
      this.charts.errors?.destroy();
      this.charts.errors = this.buildErrors();
    } else {
      this.charts.errors?.setData([this.t, ...(this.errClasses.length ? this.errClasses.map((c) => this.err[c]) : [this.t.map(() => 0)])]);
    }
    this.updateCount();
  }
  updateCount() { if (this.points) this.points.textContent = String(this.t.length); }
  resize() {
    for (const [k, ch] of Object.entries(this.charts || {})) {
      if (ch) ch.setSize({ width: chartWidth(this.els[k]), height: 190 });
    }
  }
}

// ---------------------------------------------------------------- job page
function updateActions(snap) {
  for (const form of $$("#job-actions form[data-states]")) {
    const ok = form.dataset.states.split(" ").includes(snap.state);
    const needsFailed = form.hasAttribute("data-needs-failed");
    form.hidden = !(ok && (!needsFailed || (snap.failed || 0) > 0));
  }
}

const PANEL_REFRESH_MS = 15000;

// Re-render the server-side panels (metrics, timing, errors, parameters, and any registered later)
// from a fresh copy of the page, without touching the live ones.
async function refreshPanels() {
  const r = await fetch(location.pathname, { credentials: "same-origin" });
  if (!r.ok) return;
  const doc = new DOMParser().parseFromString(await r.text(), "text/html");
  for (const el of $$(".panel[data-refresh]")) {
    const fresh = doc.querySelector(`.panel[data-panel="${el.dataset.panel}"]`);
    if (fresh && fresh.innerHTML !== el.innerHTML) el.innerHTML = fresh.innerHTML;
  }
}

function initJobPage() {
  const init = JSON.parse($("#job-init").textContent);
  let snapshot = JSON.parse($("#job-snapshot").textContent);
  const series = JSON.parse($("#job-series").textContent);
  const root = $("#job-root");
  let charts = null;
  const startCharts = () => { charts = new JobCharts(series); window.dashboardCharts = charts; };
  if (typeof uPlot === "undefined") window.addEventListener("load", startCharts); else startCharts();
  let lastT = snapshot.t || 0;
  // Fields only the database knows (elapsed, average rate): kept from the last state fetch; elapsed
  // then ticks on the client while the job runs.
  // Elapsed is running time (pauses excluded), carried by every message; between messages it ticks on the
  // client while the job runs.
  let startedAt = null;
  const takeElapsed = (st) => {
    startedAt = st.elapsed_s != null && st.state === "running" ? (st.t || Date.now() / 1000) - st.elapsed_s : null;
  };
  takeElapsed(snapshot);

  const catchUp = async (withSeries) => {
    const st = await fetchJSON(init.state_url + (withSeries ? "?series=1" : ""));
    if (withSeries && st.series && charts) charts.load(st.series);
    apply(st.snapshot, { chart: false, answer: true });
  };

  const apply = (snap, { chart = true, answer = false } = {}) => {
    if (snap.job_id !== undefined && String(snap.job_id) !== String(root.dataset.job)) return;
    if (answer && typeof snap.t === "number" && snap.t < lastT && snap.state === snapshot.state) {
      // an answer built before what is shown (overtaken by a live message): showing it would take the figures
      // back in time; keep only what the database alone knows (elapsed, average rate). A state it tells differs
      // is applied (its own catch-up follows), as live messages always are (another host's clock may run ahead).
      if ("elapsed_s" in snap) {
        takeElapsed(snap);
        snapshot = { ...snapshot, elapsed_s: snap.elapsed_s, avg_samples_per_s: snap.avg_samples_per_s };
      }
      return;
    }
    const stateChanged = snap.state !== snapshot.state;
    const merged = { ...snap };
    if (!("elapsed_s" in merged)) { merged.elapsed_s = snapshot.elapsed_s; merged.avg_samples_per_s = snapshot.avg_samples_per_s; }
    takeElapsed(merged);
    applyProgress(document, merged);
    updateActions(merged);
    const reason = $("#job-error");
    if (reason && "error_message" in merged) { reason.textContent = merged.error_message || ""; reason.hidden = !merged.error_message; }
    if (chart && charts && typeof snap.t === "number" && snap.t > lastT) charts.push(snap);
    if (typeof snap.t === "number") lastT = Math.max(lastT, snap.t);
    snapshot = merged;
    window.dashboardLast = merged;
    document.dispatchEvent(new CustomEvent("dashboard:progress-applied", { detail: merged }));
    if (stateChanged) {
      // started, paused, finished ...: fetch what only the database knows, and the panels
      catchUp(false).catch((e) => console.warn(e));
      refreshPanels().catch((e) => console.warn(e));
    }
  };
  apply(snapshot, { chart: false });
  setInterval(() => { // elapsed ticks between messages while the job runs
    if (startedAt === null || snapshot.state !== "running") return;
    const el = $('[data-field="elapsed_s"]');
    if (el) el.textContent = fmtDuration(Date.now() / 1000 - startedAt);
  }, 1000);

  const TERMINAL = ["completed", "cancelled", "failed"];
  // the badge says "live" only while there is something live to show
  const jobStatus = (text, cls) => (cls === "live" && TERMINAL.includes(snapshot.state)
    ? setStatus(`${snapshot.state}: nothing live`, "") : setStatus(text, cls));
  document.addEventListener("dashboard:progress-applied", (ev) => {
    if (TERMINAL.includes(ev.detail.state)) setStatus(`${ev.detail.state}: nothing live`, "");
    else if (window.dashboardSocket?.ws?.readyState === 1) setStatus("live", "live");
  });
  window.dashboardSocket = new LiveSocket(init.ws_path, {
    onMessage: (msg) => { if (msg.type === "job.progress") apply(msg); },
    onStatus: jobStatus,
    onOpen: (reconnected) => {
      // Catch up: whatever happened while the socket was down (or before it opened) is in the DB.
      catchUp(reconnected).catch((e) => console.warn("catch-up failed", e));
    },
  });
  setInterval(() => {
    if (["running", "queued"].includes(snapshot.state) && !document.hidden) refreshPanels().catch(() => {});
  }, PANEL_REFRESH_MS);
}

// ---------------------------------------------------------------- overview
function initOverview() {
  const activeIds = JSON.parse($("#overview-init").textContent).map(String);
  const rows = () => new Map($$("tr[data-job]").map((tr) => [tr.dataset.job, tr]));
  const apply = (snap) => {
    const tr = rows().get(String(snap.job_id));
    if (tr) applyProgress(tr, snap);
  };
  const refresh = async () => {
    try {
      const st = await fetchJSON("/overview.json");
      st.jobs.forEach(apply);
      const now = st.active_ids.map(String);
      const changed = now.length !== activeIds.length || now.some((id) => !activeIds.includes(id));
      if (changed) location.reload(); // a job started or ended: the server renders the new lists
    } catch (e) { console.warn(e); }
  };
  new LiveSocket("/ws/overview/", {
    onMessage: (msg) => { if (msg.type === "job.progress") apply(msg); },
    onStatus: setStatus,
    onOpen: () => refresh(),
  });
  setInterval(refresh, 10000);
}

// ---------------------------------------------------------------- endpoint page: live replica table
// The server renders the table (the page's own template) and sends it at connect, after every run's tick
// and when asked: a replica's window expiring sends no tick, so the page asks every REPLICAS_REFRESH_MS.
const REPLICAS_REFRESH_MS = 10000;

function initEndpointPage() {
  const init = $("#endpoint-init");
  const box = $("#replica-load-live");
  if (!init || !box) return;
  const socket = new LiveSocket(JSON.parse(init.textContent).ws_path, {
    onMessage: (msg) => {
      if (msg.type !== "endpoint.replicas") return;
      box.innerHTML = msg.html;
      window.dashboardReplicas = msg.load;
      document.dispatchEvent(new CustomEvent("dashboard:replicas-applied", { detail: msg.load }));
    },
    onStatus: setStatus,
  });
  window.dashboardSocket = socket;
  setInterval(() => {
    if (!document.hidden && socket.ws && socket.ws.readyState === 1) socket.ws.send('{"type":"refresh"}');
  }, REPLICAS_REFRESH_MS);
}

// ---------------------------------------------------------------- datasets: XHR upload
function escapeHTML(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function renderReport(box, payload) {
  const rep = payload.report || {};
  const lines = (rep.bad_lines || []).map((b) => `<tr><td>${b.line}</td><td>${escapeHTML(b.reason)}</td></tr>`).join("");
  box.innerHTML = `<div class="report"><p class="error">${escapeHTML(payload.message || "rejected")}</p>
    <p>${rep.good_rows || 0} good row(s), ${rep.bad_line_count || 0} bad line(s)${rep.blank_lines ? `, ${rep.blank_lines} blank line(s) skipped` : ""}.</p>
    ${lines ? `<table class="bad-lines"><thead><tr><th>line</th><th>reason</th></tr></thead><tbody>${lines}</tbody></table>` : ""}
    ${rep.truncated ? '<p class="muted">… and more (the list is capped).</p>' : ""}
    ${payload.dataset_url ? `<p><a href="${payload.dataset_url}">stored report</a></p>` : ""}</div>`;
  box.hidden = false;
}

function initUpload() {
  const form = $("#upload-form");
  if (!form) return;
  const bar = $("#upload-progress"), status = $("#upload-status"), report = $("#upload-report");
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("X-Requested-With", "XMLHttpRequest");
    xhr.setRequestHeader("Accept", "application/json");
    bar.hidden = false;
    report.hidden = true;
    const setPct = (p, label) => {
      $(".bar", bar).style.width = p + "%";
      $(".pct", bar).textContent = label || `${p.toFixed(0)}%`;
    };
    setPct(0);
    xhr.upload.onprogress = (e) => {
      if (e.lengthComputable) setPct(100 * e.loaded / e.total);
      status.textContent = `uploading… ${(e.loaded / 1048576).toFixed(1)} MiB`;
    };
    xhr.upload.onload = () => { setPct(100, "validating…"); status.textContent = "validating and storing rows…"; };
    xhr.onload = () => {
      let payload = {};
      try { payload = JSON.parse(xhr.responseText); } catch (e) { payload = { ok: false, message: `HTTP ${xhr.status}` }; }
      if (xhr.status === 200 && payload.ok) {
        setPct(100, "done");
        status.textContent = `stored ${payload.row_count} rows`;
        location.href = payload.url;
      } else {
        setPct(100, "rejected");
        status.textContent = "";
        renderReport(report, payload.report ? payload : { message: payload.message || `HTTP ${xhr.status}`, report: {} });
      }
    };
    xhr.onerror = () => { status.textContent = "upload failed (network)"; };
    xhr.send(new FormData(form));
  });
}

// ---------------------------------------------------------------- history
function initHistory() {
  const data = JSON.parse($("#history-data").textContent);
  const draw = () => {
    makeChart($("#history-throughput"), "samples/s", [{ label: "samples/s" }], [data.t, data.samples_per_s]);
    makeChart($("#history-reward"), "mean reward", [{ label: "mean reward", color: "#1f9d55" }], [data.t, data.mean_reward]);
  };
  if (typeof uPlot === "undefined") window.addEventListener("load", draw); else draw();
}

// ---------------------------------------------------------------- confirmations
// A form with data-confirm asks first (Cancel): a stray click does not stop a job.
document.addEventListener("submit", (ev) => {
  const msg = ev.target?.dataset?.confirm;
  if (msg && !window.confirm(msg)) ev.preventDefault();
}, true);

// ---------------------------------------------------------------- boot
const PAGES = { job: initJobPage, overview: initOverview, endpoint: initEndpointPage, datasets: initUpload, history: initHistory };
const page = document.body.dataset.page;
if (PAGES[page]) PAGES[page]();
