// `/admin`: sign in with the admin token; create, approve, pause, resume, end and delete
// sales; per sale a live view refreshed every second (gate and SQL stock, accepted and
// written per second, order log backlog, answers by code, p99 latency, a chart) and the
// SQL audit.
"use strict";

(() => {
  const { api, adminToken, setAdminToken, el, $, say, when } = seckill;
  const HISTORY = 60;
  let watched = null; // sale id
  let previous = null; // last reading: { at, stats, live }
  let series = []; // [{ accepted, written }]
  let timer = null;
  let reconciled = null; // the last reconciliation of the watched sale
  let rounds = 0;

  async function signIn(token) {
    setAdminToken(token);
    const r = await api("GET", "/api/admin/sales", undefined, "admin");
    if (!r.ok) {
      setAdminToken(null);
      return say("message", r.data.message, "error");
    }
    say("message", "");
    $("signin").classList.add("hidden");
    $("signout").classList.remove("hidden");
    $("dashboard").classList.remove("hidden");
    showSales(r.data);
    loadKeys();
    rooms();
    setInterval(rooms, 2000);
    setInterval(loadKeys, 10000);
  }

  async function loadSales() {
    const r = await api("GET", "/api/admin/sales", undefined, "admin");
    if (r.ok) showSales(r.data);
    else say("message", r.data.message, "error");
  }

  function showSales(sales) {
    const now = Date.now();
    $("sales").tBodies[0].replaceChildren(
      ...sales.map((s) => {
        const ended = Date.parse(s.ends_at) <= now;
        const status = s.status === "draft" ? "draft" : ended ? "ended" : s.paused ? "paused" : "approved";
        const act = (label, path, method) =>
          el("button", { type: "button", "data-action": label.toLowerCase(), text: label,
            on: { click: () => action(s.id, label, path, method) } });
        const actions = el("td", { class: "row" });
        if (s.status === "draft") {
          actions.append(act("Approve", "/approve"), act("Delete", "", "DELETE"));
        } else if (!ended) {
          actions.append(s.paused ? act("Resume", "/resume") : act("Pause", "/pause"), act("End", "/end"));
        }
        if (s.status !== "draft") {
          actions.append(el("button", { type: "button", "data-action": "watch", class: "primary", text: "Watch",
            on: { click: () => watch(s) } }));
        }
        return el("tr", { id: "sale-" + s.id, "data-status": status },
          el("td", { text: s.id }),
          el("td", {}, s.status === "draft" ? s.title : el("a", { href: "/sales/" + s.id, text: s.title })),
          el("td", { class: "status", text: status }),
          el("td", { text: when(s.begins_at) + " → " + when(s.ends_at) }),
          el("td", { text: s.sql_stock + " / " + s.stock }),
          actions);
      })
    );
  }

  async function action(id, label, path, method) {
    if ((label === "End" || label === "Delete") &&
        !confirm(label + " sale " + id + "? This cannot be undone.")) return;
    const r = await api(method || "POST", "/api/admin/sales/" + id + path, undefined, "admin");
    say("message", r.ok ? label + ": sale " + id + " done." : r.data.message, r.ok ? "good" : "error");
    loadSales();
  }

  function watch(sale) {
    watched = sale.id;
    previous = null;
    series = [];
    $("live").classList.remove("hidden");
    $("live-title").textContent = sale.title + " (" + sale.id + ")";
    $("audit").tBodies[0].replaceChildren();
    clearInterval(timer);
    refresh();
    timer = setInterval(refresh, 1000);
    reconciled = null;
    rounds = 0;
    $("live").scrollIntoView({ behavior: "smooth" });
  }

  // The p99 of the requests between two cumulative readings, as the bucket bound it falls in.
  function p99(before, after) {
    const total = after.latency_count - (before ? before.latency_count : 0);
    if (total <= 0) return "—";
    const target = total * 0.99;
    for (let i = 0; i < after.latency_buckets.length; i++) {
      const [bound, n] = after.latency_buckets[i];
      const seen = n - (before ? before.latency_buckets[i][1] : 0);
      if (seen >= target) return bound < 0.001 ? "≤ " + bound * 1e6 + " µs" : "≤ " + bound * 1e3 + " ms";
    }
    const last = after.latency_buckets[after.latency_buckets.length - 1][0];
    return "> " + last + " s";
  }

  function tile(id, name, value, small) {
    return el("div", { class: small ? "stat small" : "stat" }, el("div", { class: "value", id, text: String(value) }),
      el("div", { class: "name", text: name }));
  }

  async function refresh() {
    const id = watched;
    const [stats, live] = await Promise.all([
      api("GET", "/api/admin/sales/" + id + "/stats", undefined, "admin"),
      api("GET", "/api/admin/live", undefined, "admin"),
    ]);
    if (id !== watched) return;
    if (!stats.ok || !live.ok) return say("message", (stats.ok ? live : stats).data.message, "error");
    // The gate against SQL every few seconds: it reads every buyer, not a counter.
    if (rounds++ % 5 === 0) {
      const r = await api("GET", "/api/admin/sales/" + id + "/reconcile", undefined, "admin");
      if (id !== watched) return;
      reconciled = r.ok ? r.data : null;
    }
    const s = stats.data;
    const at = live.data.now_ms;
    let acceptedRate = 0;
    let writtenRate = 0;
    if (previous) {
      const secs = Math.max(0.001, (at - previous.at) / 1000);
      acceptedRate = Math.max(0, ((s.gate_accepted ?? 0) - (previous.stats.gate_accepted ?? 0)) / secs);
      writtenRate = Math.max(0, (s.orders_written - previous.stats.orders_written) / secs);
    }
    series.push({ accepted: acceptedRate, written: writtenRate });
    if (series.length > HISTORY) series.shift();
    const dash = (v) => (v === null || v === undefined ? "—" : v);
    const byStatus = Object.entries(s.orders_by_status || {}).map(([k, v]) => k.replace("_", " ") + ": " + v).join(", ") || "none";
    $("live-stats").replaceChildren(
      tile("gate-stock", "stock in the gate", dash(s.gate_stock)),
      tile("sql-stock", "stock in SQL", s.sql_stock),
      tile("accepted-total", "accepted by the gate", dash(s.gate_accepted)),
      tile("accepted-rate", "accepted / s", acceptedRate.toFixed(0)),
      tile("written-total", "orders written to SQL", s.orders_written),
      tile("written-rate", "written / s", writtenRate.toFixed(0)),
      tile("backlog", "order log backlog", dash(s.log_backlog)),
      tile("p99", "p99 purchase latency, last second", p99(previous && previous.live, live.data)),
      tile("buyers", "buyers in the gate", dash(s.gate_buyers)),
      tile("by-status", "orders in SQL by status", byStatus, true),
      tile("reconciled", "gate against SQL + in flight", drift(reconciled), true)
    );
    const before = previous ? previous.live.purchases : {};
    $("answers").tBodies[0].replaceChildren(
      ...Object.entries(live.data.purchases)
        .filter(([, n]) => n > 0)
        .map(([code, n]) => el("tr", { "data-code": code }, el("td", { text: code }),
          el("td", { text: String(n - (before[code] || 0)) }), el("td", { text: String(n) })))
    );
    chart();
    previous = { at, stats: s, live: live.data };
  }

  function drift(r) {
    if (!r) return "—";
    if (!r.gate_loaded) return "not in the gate";
    if (r.exact) return "exact";
    const parts = [];
    if (r.stock_drift) parts.push("stock " + (r.stock_drift > 0 ? "+" : "") + r.stock_drift);
    if (r.buyers_missing) parts.push(r.buyers_missing + " buyers missing");
    if (r.buyers_unknown) parts.push(r.buyers_unknown + " buyers unknown");
    if (r.journal_drift) parts.push("journal " + r.journal_drift);
    return (r.drift_confirmed_since ? "DRIFT since " + when(r.drift_confirmed_since) : "differs") + ": " + parts.join(", ");
  }

  async function repair() {
    if (!confirm("Rebuild the gate of sale " + watched + " from SQL and the order log?")) return;
    const r = await api("POST", "/api/admin/sales/" + watched + "/reconcile",
      { reason: "repair asked from the dashboard" }, "admin");
    say("message", r.ok ? "Repaired: the gate now " + drift({ ...r.data.after, exact: isExact(r.data.after) }) : r.data.message,
      r.ok ? "good" : "error");
    rounds = 0;
  }

  function isExact(a) {
    return !a.stock_drift && !a.buyers_missing && !a.buyers_unknown && !a.journal_drift;
  }

  function chart() {
    const svg = $("chart");
    const ns = "http://www.w3.org/2000/svg";
    const top = Math.max(1, ...series.map((p) => Math.max(p.accepted, p.written)));
    const line = (key, color) => {
      // The newest second on the right edge.
      const shift = HISTORY - series.length;
      const points = series
        .map((p, i) => ((i + shift) * 600) / (HISTORY - 1) + "," + (155 - (p[key] / top) * 145).toFixed(1))
        .join(" ");
      const node = document.createElementNS(ns, "polyline");
      node.setAttribute("points", points);
      node.setAttribute("fill", "none");
      node.setAttribute("stroke", color);
      node.setAttribute("stroke-width", "2");
      return node;
    };
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", "4");
    label.setAttribute("y", "14");
    label.setAttribute("font-size", "12");
    label.textContent = "max " + top.toFixed(0) + " /s";
    svg.replaceChildren(label, line("written", "#0969da"), line("accepted", "#c4281c"));
  }

  async function audit() {
    const r = await api("GET", "/api/admin/sales/" + watched + "/audit", undefined, "admin");
    if (!r.ok) return say("message", r.data.message, "error");
    $("audit").tBodies[0].replaceChildren(
      ...Object.entries(r.data).map(([k, v]) =>
        el("tr", { "data-field": k }, el("th", { scope: "row", text: k.replaceAll("_", " ") }),
          el("td", { text: v === null ? "—" : String(v) })))
    );
  }

  // The waiting rooms taking buyers now, every two seconds.
  async function rooms() {
    const r = await api("GET", "/api/admin/rooms", undefined, "admin");
    if (!r.ok) return;
    $("rooms-card").classList.toggle("hidden", r.data.length === 0);
    $("rooms").tBodies[0].replaceChildren(
      ...r.data.map((room) => el("tr", { id: "room-" + room.sale_id },
        el("td", { text: room.title || room.sale_id }),
        el("td", { class: "tickets", text: room.tickets }),
        el("td", { class: "waiting", text: room.waiting }),
        el("td", { text: room.admitted }),
        el("td", { text: room.admitted_per_sec + " (" + room.admit_per_sec + ")" }),
        el("td", { text: room.oldest_wait_secs.toFixed(1) + " s" }),
        el("td", { text: room.closed || "" })))
    );
  }

  const SCOPES = ["sales:read", "sales:write", "orders:read", "payments", "operations", "metrics", "keys"];

  // A key's secret is shown once, in the answer that made or rotated it.
  function showSecret(r, what) {
    if (!r.ok) return say("key-secret", r.data.message, "error");
    say("key-secret", what + " " + r.data.name + ": " + r.data.secret + " (shown once: copy it now)", "good");
    loadKeys();
  }

  async function loadKeys() {
    const r = await api("GET", "/api/admin/keys", undefined, "admin");
    // A key without the `keys` scope sees no panel.
    $("keys-card").classList.toggle("hidden", !r.ok);
    if (!r.ok) return;
    $("keys").tBodies[0].replaceChildren(
      ...r.data.map((k) => {
        const actions = el("td", { class: "row" });
        if (!k.revoked_at) {
          actions.append(
            el("button", { type: "button", "data-action": "rotate", text: "Rotate",
              on: { click: async () => showSecret(await api("POST", "/api/admin/keys/" + k.id + "/rotate", undefined, "admin"), "New secret of") } }),
            el("button", { type: "button", "data-action": "revoke", text: "Revoke",
              on: { click: async () => {
                const d = await api("DELETE", "/api/admin/keys/" + k.id, undefined, "admin");
                say("key-secret", d.ok ? "Key " + k.name + " revoked." : d.data.message, d.ok ? "good" : "error");
                loadKeys();
              } } }));
        }
        return el("tr", { id: "key-" + k.id, "data-state": k.revoked_at ? "revoked" : "live" },
          el("td", { text: k.id }), el("td", { text: k.name }), el("td", { text: k.scopes.join(" ") }),
          el("td", { text: k.last_used_at ? when(k.last_used_at) : "never" }),
          el("td", { text: k.revoked_at ? "revoked " + when(k.revoked_at) : "live" }), actions);
      }),
    );
  }

  async function createKey(e) {
    e.preventDefault();
    const scopes = SCOPES.filter((s) => $("scope-" + s).checked);
    const r = await api("POST", "/api/admin/keys", { name: $("key-name").value, scopes }, "admin");
    showSecret(r, "Key");
  }

  $("key-scopes").append(...SCOPES.map((s) => el("label", { class: "check" },
    el("input", { type: "checkbox", id: "scope-" + s, value: s }), " " + s)));
  $("key-create").addEventListener("submit", createKey);

  async function create(e) {
    e.preventDefault();
    const begins = new Date($("new-begins").value);
    if (isNaN(begins)) return say("message", "Give the opening time.", "error");
    const ends = new Date(begins.getTime() + Number($("new-minutes").value) * 60000);
    const segments = $("new-segments").value.trim();
    const body = {
      title: $("new-title").value,
      price_cents: Math.round(Number($("new-price").value) * 100),
      stock: Number($("new-stock").value),
      per_user_limit: Number($("new-limit").value),
      begins_at: begins.toISOString(),
      ends_at: ends.toISOString(),
      payment_window_secs: Number($("new-window").value),
      anti_bot: $("new-antibot").value,
      segments: segments === "auto" ? "auto" : Number(segments || "1"),
    };
    const room = $("new-room").value.trim();
    if (room) body.waiting_room = { admit_per_sec: Number(room) };
    const r = await api("POST", "/api/admin/sales", body, "admin");
    say("message", r.ok ? "Sale " + r.data.id + " created as a draft: approve it to publish it." : r.data.message,
      r.ok ? "good" : "error");
    if (r.ok) loadSales();
  }

  // The opening field starts a few minutes ahead, in local time.
  const start = new Date(Date.now() + 5 * 60000);
  start.setSeconds(0, 0);
  $("new-begins").value = new Date(start.getTime() - start.getTimezoneOffset() * 60000).toISOString().slice(0, 19);

  $("signin").addEventListener("submit", (e) => {
    e.preventDefault();
    signIn($("admin-token").value);
  });
  $("signout").addEventListener("click", () => {
    setAdminToken(null);
    location.reload();
  });
  $("create").addEventListener("submit", create);
  $("audit-run").addEventListener("click", audit);
  $("repair-run").addEventListener("click", repair);
  if (adminToken()) signIn(adminToken());
})();
