// What every page shares: calls to the API, the buyer's and the admin's sessions, the
// server's clock, formatting, the login form and the page header. No library: the pages
// are small and must run from this binary alone.
"use strict";

const seckill = (() => {
  const USER_KEY = "seckill.user";
  const ADMIN_KEY = "seckill.admin";

  // The buyer's session survives closing the tab (like a shop's login); the admin's does not.
  function user() {
    try {
      const u = JSON.parse(localStorage.getItem(USER_KEY) || "null");
      return u && u.token ? u : null;
    } catch (_) {
      return null;
    }
  }
  function setUser(u) {
    if (u) localStorage.setItem(USER_KEY, JSON.stringify(u));
    else localStorage.removeItem(USER_KEY);
  }
  function adminToken() {
    return sessionStorage.getItem(ADMIN_KEY);
  }
  function setAdminToken(t) {
    if (t) sessionStorage.setItem(ADMIN_KEY, t);
    else sessionStorage.removeItem(ADMIN_KEY);
  }

  // One call to the API: {status, ok, data}; data is the JSON answer ({code, message} on
  // errors). A network failure is answered like the server's own `unavailable`.
  async function api(method, path, body, as) {
    const headers = { Accept: "application/json" };
    const token = as === "admin" ? adminToken() : as === "user" ? (user() || {}).token : null;
    if (token) headers.Authorization = "Bearer " + token;
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (e) {
      return { status: 0, ok: false, data: { code: "unavailable", message: "the server cannot be reached" } };
    }
    let data = null;
    try {
      data = await response.json();
    } catch (_) {
      data = { code: "unavailable", message: "the server answered " + response.status };
    }
    if (as === "user" && response.status === 401) setUser(null);
    return { status: response.status, ok: response.ok, data };
  }

  // The server's clock: windows open by it, so countdowns count by it. Offset measured
  // from the middle of a round trip, the shortest of a few.
  const clock = {
    offset: 0,
    synced: false,
    async sync() {
      let best = null;
      for (let i = 0; i < 3; i++) {
        const t0 = Date.now();
        const r = await api("GET", "/api/time");
        const t1 = Date.now();
        if (!r.ok) continue;
        const rtt = t1 - t0;
        if (!best || rtt < best.rtt) best = { rtt, offset: r.data.now_ms - (t0 + t1) / 2 };
      }
      if (best) {
        this.offset = best.offset;
        this.synced = true;
      }
      return this.synced;
    },
    now() {
      return Date.now() + this.offset;
    },
  };

  function money(cents) {
    return (cents / 100).toFixed(2);
  }

  // "2 d 03:04:05", "03:04:05", "04:05".
  function duration(ms) {
    let s = Math.max(0, Math.ceil(ms / 1000));
    const d = Math.floor(s / 86400);
    s -= d * 86400;
    const h = Math.floor(s / 3600);
    s -= h * 3600;
    const m = Math.floor(s / 60);
    s -= m * 60;
    const two = (n) => String(n).padStart(2, "0");
    const hms = (h || d ? two(h) + ":" : "") + two(m) + ":" + two(s);
    return d ? d + " d " + hms : hms;
  }

  function when(iso) {
    const t = new Date(iso);
    return isNaN(t) ? iso : t.toLocaleString();
  }

  const STATUS_WORDS = {
    queued: "accepted, being recorded",
    pending_payment: "waiting for payment",
    paid: "paid",
    cancelled: "cancelled",
    expired: "expired (not paid in time)",
  };
  const STATE_WORDS = {
    upcoming: "opens soon",
    active: "on sale",
    sold_out: "sold out",
    ended: "ended",
    paused: "paused",
  };

  // Builds an element: el("p", {class: "x", text: "hi"}, child, ...).
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "text") node.textContent = v;
      else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  function $(id) {
    return document.getElementById(id);
  }

  function say(target, text, kind) {
    const node = typeof target === "string" ? $(target) : target;
    node.textContent = text || "";
    node.classList.toggle("error", kind === "error");
    node.classList.toggle("good", kind === "good");
  }

  // The header every buyer page shows: where to go, who is logged in, log out.
  function header() {
    const who = $("who");
    if (!who) return;
    const u = user();
    who.replaceChildren();
    if (u) {
      who.append(
        "Logged in as " + u.phone + " ",
        el("button", {
          type: "button",
          id: "logout",
          on: {
            click: () => {
              setUser(null);
              location.reload();
            },
          },
          text: "Log out",
        })
      );
    }
  }

  // The phone-and-code login form, into `box`; `done()` once logged in.
  function loginForm(box, done) {
    const phone = el("input", { id: "phone", type: "tel", autocomplete: "tel", inputmode: "tel",
      placeholder: "+8613800000000", required: true });
    const code = el("input", { id: "code", inputmode: "numeric", autocomplete: "one-time-code",
      maxlength: "16", required: true });
    const msg = el("p", { class: "message", id: "login-message", role: "status", "aria-live": "polite" });
    const codeStep = el("div", { class: "hidden", id: "code-step" },
      el("label", { for: "code", text: "Code received by SMS" }), code,
      el("div", { class: "row" }, el("button", { type: "submit", id: "login", class: "primary", text: "Log in" })));
    const form = el("form", { id: "login-form", "aria-label": "Log in" },
      el("h2", { text: "Log in to buy" }),
      el("label", { for: "phone", text: "Phone number" }), phone,
      el("div", { class: "row" }, el("button", { type: "button", id: "send-code", text: "Send me a code" })),
      codeStep, msg);
    form.querySelector("#send-code").addEventListener("click", async () => {
      const r = await api("POST", "/api/auth/code", { phone: phone.value.trim() });
      if (!r.ok) return say(msg, r.data.message, "error");
      codeStep.classList.remove("hidden");
      if (r.data.dev_code) {
        code.value = r.data.dev_code;
        say(msg, "Development mode: the code is filled in for you (" + r.data.dev_code + ").", "good");
      } else {
        say(msg, "A code was sent to " + phone.value.trim() + ".", "good");
      }
      code.focus();
    });
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      const r = await api("POST", "/api/auth/login", { phone: phone.value.trim(), code: code.value.trim() });
      if (!r.ok) return say(msg, r.data.message, "error");
      setUser({ token: r.data.token, user_id: r.data.user_id, phone: phone.value.trim() });
      header();
      box.replaceChildren();
      done();
    });
    box.replaceChildren(form);
  }

  // Shows the login form in the page's #login-box; `then()` once logged in.
  function askLogin(then) {
    const box = $("login-box");
    box.classList.remove("hidden");
    loginForm(box, () => {
      box.classList.add("hidden");
      then();
    });
  }

  // A sale id or an order id from the page's path: /sales/123 -> "123".
  function idFromPath() {
    return location.pathname.split("/").filter(Boolean).pop();
  }

  document.addEventListener("DOMContentLoaded", header);

  return { api, user, setUser, adminToken, setAdminToken, clock, money, duration, when, el, $,
    say, header, loginForm, askLogin, idFromPath, STATUS_WORDS, STATE_WORDS };
})();
