// The job page's profiling panel: a live, sortable table of the job's profile (refreshed from the API
// every few seconds while the job runs), its red flags, and the on / off switch.
const REFRESH_MS = 3000;
const panel = document.getElementById("profiling-panel");
if (panel && !panel.dataset.wired) {
  panel.dataset.wired = "1";
  const api = panel.dataset.api;
  let sortKey = "ttot", sortDesc = true, last = null;
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  const csrf = () => (panel.querySelector("input[name=csrfmiddlewaretoken]") || {}).value || "";
  const fmt = (v, d) => (v == null ? "—" : Number(v).toFixed(d));

  function render(p) {
    last = p;
    const st = panel.querySelector("#profiling-status");
    let s = p.active ? `Profiling on (${p.active.scope}, ${p.active.clock} clock${p.active.until ? ", until " + p.active.until : ""}).`
                     : p.session ? `Last profile: session ${p.session.id}.` : "Not profiled yet.";
    if (p.snapshots) {
      s += ` ${p.snapshots} snapshots from ${p.workers.length} worker(s); ${p.verifications} verifications, ${p.profiled} profiled`;
      if (p.overhead_pct != null) s += `; measured overhead ≈ ${p.overhead_pct.toFixed(2)} % of throughput`;
      s += ".";
    }
    st.textContent = s;
    const few = panel.querySelector("#profiling-few-samples");
    few.hidden = !p.few_samples;
    few.querySelector(".n").textContent = p.profiled;
    panel.querySelector("#profiling-flags").innerHTML = p.red_flags.map((f) =>
      `<li data-kind="${esc(f.kind)}"><strong>${esc(f.kind)}</strong> ${esc(f.label)}: ${esc(f.figure)} — <span class="muted">${esc(f.advice)}</span></li>`).join("");
    const rows = [...p.rows].sort((a, b) => {
      const x = a[sortKey], y = b[sortKey];
      const c = typeof x === "string" ? x.localeCompare(y) : x - y;
      return sortDesc ? -c : c;
    }).slice(0, 60);
    panel.querySelector("#profiling-table tbody").innerHTML = rows.map((r) =>
      `<tr><td title="${esc(r.module)}:${r.line}">${esc(r.name)} <span class="muted">${esc(r.module)}:${r.line}</span></td>` +
      `<td>${r.ncall}</td><td>${fmt(r.tsub, 4)}</td><td>${fmt(r.ttot, 4)}</td><td>${fmt(r.tavg, 6)}</td><td>${fmt(r.share, 3)}</td></tr>`).join("");
  }

  // The flame graph (d3-flame-graph from npm, copied to static/vendor by scripts/frontend.sh), redrawn when a
  // new snapshot arrives. Its UMD build bundles d3-selection without exposing d3: the chart is handed a
  // one-element selection with the three methods it calls (each, datum, selectAll().remove()).
  let flame = null, flameKey = null;
  function selection(el, data) {
    const s = {
      _d: data,
      each(fn) { fn.call(el, s._d); return s; },
      datum(v) { if (!arguments.length) return s._d; s._d = typeof v === "function" ? v.call(el, s._d) : v; return s; },
      selectAll(q) { return { remove() { el.querySelectorAll(q).forEach((n) => n.remove()); } }; },
    };
    return s;
  }
  async function renderFlame(p) {
    const el = panel.querySelector("#profiling-flame");
    const key = `${p.session && p.session.id}:${p.snapshots}`;
    if (!el || !p.snapshots || key === flameKey || typeof window.flamegraph !== "function") return;
    flameKey = key;
    const r = await fetch(api + "export/?type=tree", { credentials: "same-origin" });
    if (!r.ok) return;
    const tree = await r.json();
    if (!flame) {
      flame = window.flamegraph().width(Math.max(300, el.clientWidth || 800)).cellHeight(16).minFrameSize(2)
        .label((d) => `${d.data.name}: ${(d.data.value / 1e6).toFixed(3)} s`);
      flame(selection(el, tree));
    } else {
      flame.update(tree);
    }
  }

  async function refresh() {
    if (document.hidden) return;
    try {
      const r = await fetch(api, { headers: { Accept: "application/json" }, credentials: "same-origin" });
      if (r.ok) {
        const p = await r.json();
        render(p);
        renderFlame(p).catch((e) => console.warn(e));
      }
    } catch (e) { console.warn(e); }
  }

  async function send(method, body) {
    const r = await fetch(api, { method, credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf(), Accept: "application/json" },
      body: body ? JSON.stringify(body) : undefined });
    if (!r.ok) panel.querySelector("#profiling-status").textContent = `Failed: ${(await r.text()).slice(0, 200)}`;
    await refresh();
  }

  // Enter in the seconds field must not submit the form (no inline handler: the CSP forbids them).
  panel.querySelector("#profiling-controls").addEventListener("submit", (e) => e.preventDefault());
  panel.querySelector("#profile-start").addEventListener("click", () => {
    const f = panel.querySelector("#profiling-controls");
    send("POST", { seconds: Number(f.seconds.value), scope: f.scope.value, clock: f.clock.value });
  });
  panel.querySelector("#profile-stop").addEventListener("click", () => send("DELETE"));
  for (const th of panel.querySelectorAll("#profiling-table th[data-key]")) {
    th.style.cursor = "pointer";
    th.addEventListener("click", () => {
      const k = th.dataset.key;
      sortDesc = sortKey === k ? !sortDesc : k !== "name";
      sortKey = k;
      if (last) render(last); else refresh();
    });
  }
  refresh();
  setInterval(refresh, REFRESH_MS);
}
