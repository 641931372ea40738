// fleetgate dashboard: refreshes the server-rendered page from the admin API.
// No framework and no CDN; the page works offline. Text goes in with textContent only.
"use strict";
(() => {
  const POLL_MS = 1500;
  const $ = (sel) => document.querySelector(sel);
  const CONFIRM = {
    drain: (id) => `Drain worker ${id}? It takes no new requests, on every gateway; requests in flight finish.`,
    undrain: (id) => `Undrain worker ${id}? It goes back into routing.`,
    remove: (id) => `Remove worker ${id}? It is deregistered; its agent, if still running, stops its engine and exits.`,
  };
  let previous = null; // the last /admin/stats, for request rates
  let rates = null; // requests/s per worker, once two polls are in
  let lastOk = 0;
  let pending = null; // {action, id} while the confirmation dialog is open

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else node[k] = v;
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }

  async function getJSON(path) {
    const r = await fetch(path, {credentials: "same-origin", headers: {accept: "application/json"}});
    if (r.status === 401) {
      location.assign("/admin/ui"); // the session expired: back to the sign-in form
      throw new Error("signed out");
    }
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  }

  const pct = (x) => `${Math.round((x || 0) * 100)}%`;
  const gpuText = (g) => (g ? (g.memory_mib ? `${g.name} (${Math.floor(g.memory_mib / 1024)} GiB)` : g.name) : "");
  const circuitOf = (w) => {
    const c = w.circuit ?? w.circuit_state ?? w.breaker;
    if (c === undefined || c === null) return null;
    return typeof c === "object" ? String(c.state ?? JSON.stringify(c)) : String(c);
  };

  const speedText = (speed, source) => (speed == null ? "-" : `x${Number(speed).toFixed(2)} ${source || ""}`.trim());
  function speedCell(w) {
    // What routing weighs the worker by now; the start-up figure that seeded it on hover.
    const start = w.start_speed || {};
    return el("td", {class: "num", title: `at start: ${speedText(start.value, start.source)}`},
      speedText(w.speed, w.speed_source));
  }

  function workerRow(w) {
    const load = w.load || {};
    const toggle = w.admin_drain ? "undrain" : "drain";
    const rate = rates && (rates[w.id] || 0);
    const kv = el("td", {class: "num"}, el("span", {class: "bar"}, el("span", {})), pct(load.kv_cache_usage));
    kv.querySelector(".bar > span").style.width = pct(Math.min(1, load.kv_cache_usage || 0));
    const circuit = circuitOf(w);
    return el("tr", {"data-worker": w.id},
      el("td", {}, el("span", {class: "wid"}, w.id), el("span", {class: "url"}, w.url)),
      el("td", {}, w.host || ""),
      el("td", {}, gpuText(w.gpu)),
      el("td", {}, w.engine),
      el("td", {}, w.model),
      el("td", {}, (w.adapters || []).join(", ") || "-"),
      el("td", {}, el("span", {class: `state state-${w.state}`}, w.state)),
      el("td", {class: `col-circuit${circuit ? ` circuit-${circuit}` : ""}`}, circuit || "-"),
      el("td", {class: "num"}, `${load.running ?? 0} / ${load.waiting ?? 0}`),
      kv,
      speedCell(w),
      el("td", {class: "num"}, load.inflight ?? 0),
      el("td", {class: "num"}, rates ? rate.toFixed(1) : "-"),
      el("td", {class: "num"}, w.heartbeat_age_s == null ? "-" : `${w.heartbeat_age_s.toFixed(1)} s`),
      el("td", {class: "actions"},
        el("button", {type: "button", "data-action": toggle, "data-worker": w.id},
          toggle[0].toUpperCase() + toggle.slice(1)),
        el("button", {type: "button", class: "danger", "data-action": "remove", "data-worker": w.id}, "Remove")),
    );
  }

  function renderWorkers(workers) {
    const table = $("#workers");
    const rows = workers.map(workerRow);
    if (!rows.length) rows.push(el("tr", {class: "empty"}, el("td", {colSpan: 15}, "No workers registered.")));
    table.tBodies[0].replaceChildren(...rows);
    table.classList.toggle("no-circuit", !workers.some((w) => circuitOf(w) !== null));
    const by = {};
    for (const w of workers) by[w.state] = (by[w.state] || 0) + 1;
    $("#summary").textContent = `${workers.length} workers` +
      (workers.length ? ` (${Object.entries(by).map(([s, n]) => `${n} ${s}`).join(", ")})` : "");
  }

  function renderStats(stats) {
    if (previous && stats.now > previous.now) {
      const dt = stats.now - previous.now;
      rates = {};
      for (const [id, n] of Object.entries(stats.requests_by_worker)) {
        rates[id] = Math.max(0, n - (previous.requests_by_worker[id] || 0)) / dt;
      }
    }
    previous = stats;
    const reg = $("#registry");
    reg.textContent = `registry ${stats.registry}`;
    reg.className = `pill pill-${stats.registry}`;
    const t = stats.totals;
    const box = (label, value) => el("div", {class: "total"}, el("b", {}, value), el("span", {}, label));
    $("#totals").replaceChildren(
      box("requests", t.requests), box("retries", t.retries), box("failovers", t.failovers),
      box("resumed streams", t.resumed_streams), box("shed", t.shed),
      box("policy", stats.policy),
      box("snapshot age", stats.snapshot_age_s == null ? "-" : `${stats.snapshot_age_s.toFixed(1)} s`),
    );
  }

  function renderDecisions(d) {
    const rows = d.data.map((x) => el("tr", {},
      el("td", {}, new Date(x.ts * 1000).toLocaleTimeString()),
      el("td", {class: "mono"}, x.request_id),
      el("td", {}, x.model),
      el("td", {}, x.worker || "-"),
      el("td", {}, x.reason),
      el("td", {class: "num"}, x.attempts),
      el("td", {class: "num"}, x.status ?? "-"),
    ));
    if (!rows.length) rows.push(el("tr", {class: "empty"}, el("td", {colSpan: 7}, "No requests yet.")));
    $("#decisions").tBodies[0].replaceChildren(...rows);
  }

  function renderUsage(u) {
    const rows = u.data.map((x) => el("tr", {},
      el("td", {class: "mono"}, x.key),
      el("td", {}, x.model),
      el("td", {class: "num"}, x.requests),
      el("td", {class: "num"}, x.input_tokens),
      el("td", {class: "num"}, x.output_tokens),
      el("td", {class: "num"}, x.errors),
      el("td", {class: "num"}, x.rate_limited),
    ));
    if (!rows.length) rows.push(el("tr", {class: "empty"}, el("td", {colSpan: 7}, "No usage yet.")));
    $("#usage").tBodies[0].replaceChildren(...rows);
  }

  async function tick() {
    try {
      const [workers, stats, decisions, usage] = await Promise.all(
        ["/admin/workers", "/admin/stats", "/admin/decisions", "/admin/usage"].map(getJSON));
      renderStats(stats);
      if (!pending) renderWorkers(workers.data); // keep the rows still while a dialog is open
      renderDecisions(decisions);
      renderUsage(usage);
      lastOk = Date.now();
    } catch (err) {
      $("#live").title = String(err);
    }
    const stale = Date.now() - lastOk > 3 * POLL_MS;
    $("#live").textContent = stale ? "gateway unreachable" : "live";
    $("#live").classList.toggle("stale", stale);
  }

  function toast(text, bad) {
    const t = $("#toast");
    t.textContent = text;
    t.className = bad ? "show bad" : "show";
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => { t.className = ""; }, 4000);
  }

  async function act(action, id) {
    const path = `/admin/workers/${encodeURIComponent(id)}` + (action === "remove" ? "" : `/${action}`);
    try {
      const r = await fetch(path, {
        method: action === "remove" ? "DELETE" : "POST",
        credentials: "same-origin",
        headers: {"x-fleetgate-csrf": "1", accept: "application/json"},
      });
      const body = await r.json().catch(() => ({}));
      if (r.ok) toast(`${action}: ${id} done`);
      else toast(`${action} ${id} failed: ${body.error?.message || `HTTP ${r.status}`}`, true);
    } catch (err) {
      toast(`${action} ${id} failed: ${err}`, true);
    }
    tick();
  }

  document.addEventListener("click", (ev) => {
    const button = ev.target.closest("button[data-action]");
    if (!button) return;
    pending = {action: button.dataset.action, id: button.dataset.worker};
    const dialog = $("#confirm");
    $("#confirm-text").textContent = CONFIRM[pending.action](pending.id);
    $("#confirm-ok").textContent = pending.action[0].toUpperCase() + pending.action.slice(1);
    dialog.returnValue = "";
    dialog.showModal();
  });

  $("#confirm").addEventListener("close", () => {
    const chosen = pending;
    pending = null;
    if (chosen && $("#confirm").returnValue === "ok") act(chosen.action, chosen.id);
  });

  tick();
  setInterval(() => { if (!document.hidden) tick(); }, POLL_MS);
})();
