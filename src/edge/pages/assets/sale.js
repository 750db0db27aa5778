// `/sales/{id}`: the sale page. Shows the live state (polling the stock endpoint each
// second), counts down to the opening by the server's clock, enables "buy" when the
// window opens, walks the buyer through login and the anti-bot steps, then follows the
// order from `queued` to `pending_payment` and on to payment.
"use strict";

(async () => {
  const { api, user, clock, el, $, say, money, duration, when, STATE_WORDS, STATUS_WORDS } = seckill;
  const saleId = seckill.idFromPath();
  const orderKey = "seckill.order." + saleId;
  let sale = null;
  let live = { state: "upcoming", remaining: null };
  let busy = false;
  let order = null; // { id, status, pay_deadline }
  let ticket = null; // the waiting room's answer, when the sale has a room

  const saleAnswer = await api("GET", "/api/sales/" + encodeURIComponent(saleId));
  if (!saleAnswer.ok) {
    $("title").textContent = "No such sale";
    return say("message", saleAnswer.data.message, "error");
  }
  sale = saleAnswer.data;
  const opens = Date.parse(sale.begins_at);
  const closes = Date.parse(sale.ends_at);
  document.title = sale.title + " · seckill";
  $("title").textContent = sale.title;
  $("price").textContent = money(sale.price_cents);
  $("limit").textContent = "· at most " + sale.per_user_limit + " per buyer";
  $("opens-at").textContent = "(" + when(sale.begins_at) + ")";
  $("closes-at").textContent = when(sale.ends_at);
  await clock.sync();

  // The state by the server's clock, between two polls: the window opens and closes on
  // time even if the last poll is a second old.
  function state() {
    const now = clock.now();
    if (now >= closes) return "ended";
    if (live.state === "upcoming" && now >= opens) return "active";
    if (live.state === "active" && now < opens) return "upcoming";
    return live.state;
  }

  function render() {
    const s = state();
    const now = clock.now();
    const badge = $("state");
    if (badge.dataset.state !== s) {
      badge.dataset.state = s;
      badge.className = "state " + s;
      badge.textContent = STATE_WORDS[s] || s;
    }
    $("remaining").textContent = live.remaining === null ? "" : live.remaining + " left";
    $("countdown-line").classList.toggle("hidden", s !== "upcoming");
    $("closes-line").classList.toggle("hidden", s !== "active");
    if (s === "upcoming") $("countdown").textContent = duration(opens - now);
    const buy = $("buy");
    const owned = order && order.status !== "cancelled" && order.status !== "expired";
    const waiting = sale.waiting_room && !owned && !(ticket && ticket.pass);
    $("room").classList.toggle("hidden", !sale.waiting_room || owned || !!(ticket && ticket.pass));
    buy.classList.toggle("hidden", !!waiting);
    buy.disabled = !(s === "active" && user() && !busy && !owned && !waiting);
    buy.textContent = s === "sold_out" ? "Sold out" : s === "ended" ? "Sale ended"
      : s === "paused" ? "Paused" : owned ? "Bought" : "Buy now";
    if (order && order.pay_deadline && order.status === "pending_payment") {
      $("pay-countdown").textContent = duration(Date.parse(order.pay_deadline) - now);
    }
  }

  // The waiting room: join, then follow the ticket until it is let through or closed.
  const ROOM_REASONS = {
    sold_out: "Sold out: the line is closed.",
    ended: "The sale has ended.",
    paused: "The sale is paused; the line moves again when it resumes.",
    pass_expired: "Your turn came and went: the pass expired unused.",
  };
  function showTicket() {
    if (!ticket) return;
    const placed = ticket.state === "waiting" && ticket.position !== null;
    $("room-place").classList.toggle("hidden", !placed);
    $("join").classList.add("hidden");
    if (placed) {
      $("room-position").textContent = ticket.position;
      $("room-ahead").textContent = ticket.ahead;
      $("room-eta").textContent = duration(ticket.eta_secs * 1000);
    }
    if (ticket.state === "waiting") {
      say("room-status", ticket.position === null
        ? "You are in the line. Places are drawn at the opening, by lottery among everyone who joined before it."
        : "You are in the line; this page moves on by itself when it is your turn.");
    } else if (ticket.state === "admitted") {
      say("message", "It is your turn: buy before " + when(ticket.pass_expires_at) + ".", "good");
    } else {
      say("room-status", ROOM_REASONS[ticket.reason] || ticket.reason, "error");
    }
    render();
  }
  async function readTicket(method) {
    if (!sale.waiting_room || !user()) return;
    const r = await api(method, "/api/sales/" + saleId + "/queue", undefined, "user");
    if (r.ok) {
      ticket = r.data;
      showTicket();
    } else if (method === "POST") {
      say("room-status", r.data.message, "error");
    }
  }
  async function followTicket() {
    for (;;) {
      await new Promise((done) => setTimeout(done, 2000));
      if (!ticket || ticket.state === "admitted") continue;
      await readTicket("GET");
    }
  }

  async function poll() {
    const r = await api("GET", "/api/sales/" + saleId + "/stock");
    if (r.ok) live = r.data;
    render();
  }

  function showLogin() {
    if (user()) return $("login-box").classList.add("hidden");
    seckill.askLogin(render);
  }

  // The anti-bot steps before a purchase: a token, after a solved captcha when asked.
  async function purchaseToken() {
    if (sale.anti_bot === "off") return { ok: true, token: undefined };
    let path = "/api/sales/" + saleId + "/token";
    if (sale.anti_bot === "captcha") {
      const id = $("captcha-image").dataset.captchaId;
      const answer = $("captcha-answer").value.trim();
      if (!id || !answer) {
        await newCaptcha();
        return { ok: false, message: "Type the digits in the picture, then press buy again." };
      }
      path += "?captcha_id=" + encodeURIComponent(id) + "&answer=" + encodeURIComponent(answer);
    }
    const r = await api("GET", path, undefined, "user");
    if (!r.ok) {
      if (sale.anti_bot === "captcha") await newCaptcha();
      return { ok: false, message: r.data.message };
    }
    return { ok: true, token: r.data.token };
  }

  async function newCaptcha() {
    const r = await api("GET", "/api/sales/" + saleId + "/captcha", undefined, "user");
    $("captcha").classList.remove("hidden");
    $("captcha-answer").value = "";
    if (!r.ok) return say("message", r.data.message, "error");
    $("captcha-image").src = r.data.image;
    $("captcha-image").dataset.captchaId = r.data.captcha_id;
  }

  const ANSWERS = {
    sold_out: "Sold out: every unit has found a buyer.",
    already_purchased: "You already bought your share of this sale.",
    not_started: "The sale has not opened yet.",
    ended: "The sale has ended.",
    paused: "The sale is paused; try again in a moment.",
    rate_limited: "Too many tries; wait a moment.",
    unavailable: "The shop is busy; try again in a moment.",
    not_loaded: "The sale is being prepared; try again in a moment.",
  };

  async function buy() {
    busy = true;
    render();
    say("message", "Buying…");
    try {
      const t = await purchaseToken();
      if (!t.ok) return say("message", t.message, "error");
      const pass = ticket && ticket.pass ? ticket.pass : undefined;
      const r = await api("POST", "/api/sales/" + saleId + "/purchase", { quantity: 1, token: t.token, pass }, "user");
      if (r.data && r.data.order_id && (r.data.code === "ok" || r.data.code === "pending")) {
        say("message", r.data.code === "ok" ? "You got one! Your order is being recorded." :
          "Your purchase is being decided…", "good");
        order = { id: r.data.order_id, status: "queued" };
        localStorage.setItem(orderKey, order.id);
        $("captcha").classList.add("hidden");
        followOrder();
        return;
      }
      if (r.status === 401) showLogin();
      say("message", ANSWERS[r.data.code] || r.data.message, "error");
      if (r.data.code === "sold_out") live.state = "sold_out";
      if (r.data.code === "queue_pass_required") await readTicket("GET");
    } finally {
      busy = false;
      render();
    }
  }

  // Follows the order until it needs nothing more from this page.
  let following = false;
  async function followOrder() {
    if (following) return;
    following = true;
    $("order").classList.remove("hidden");
    $("order-id").textContent = order.id;
    for (;;) {
      const r = await api("GET", "/api/orders/" + order.id, undefined, "user");
      if (r.ok) {
        order = r.data;
      } else if (r.data.code === "order_queued") {
        order.status = "queued";
      } else if (r.status === 404 || r.status === 401) {
        localStorage.removeItem(orderKey);
        $("order").classList.add("hidden");
        order = null;
        break;
      }
      showOrder();
      if (order.status !== "queued" && order.status !== "pending_payment") break;
      await new Promise((done) => setTimeout(done, 1000));
    }
    following = false;
    render();
  }

  function showOrder() {
    const pending = order.status === "pending_payment";
    const badge = $("order-status");
    badge.dataset.status = order.status;
    badge.textContent = STATUS_WORDS[order.status] || order.status;
    $("deadline-line").classList.toggle("hidden", !pending);
    $("pay").classList.toggle("hidden", !pending);
    $("cancel").classList.toggle("hidden", !pending);
    if (order.status !== "queued") say("message", "");
    render();
  }

  $("pay").addEventListener("click", async () => {
    const r = await api("POST", "/api/orders/" + order.id + "/pay", undefined, "user");
    if (!r.ok) return say("order-message", r.data.message, "error");
    location.assign(r.data.pay_url);
  });
  $("cancel").addEventListener("click", async () => {
    const r = await api("POST", "/api/orders/" + order.id + "/cancel", undefined, "user");
    if (!r.ok) return say("order-message", r.data.message, "error");
    say("order-message", "Cancelled; the unit went back on sale.", "good");
    order.status = "cancelled";
    showOrder();
  });
  $("buy").addEventListener("click", buy);
  $("join").addEventListener("click", () => (user() ? readTicket("POST") : showLogin()));
  $("captcha-new").addEventListener("click", newCaptcha);

  showLogin();
  const known = localStorage.getItem(orderKey);
  if (known && user()) {
    order = { id: known, status: "queued" };
    followOrder();
  }
  await poll();
  if (sale.waiting_room) {
    await readTicket("GET");
    followTicket();
  }
  setInterval(poll, 1000);
  setInterval(render, 250);
  // Clocks drift; resynchronise now and then.
  setInterval(() => clock.sync(), 60000);
})();
