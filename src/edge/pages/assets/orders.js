// `/orders`: the buyer's orders, newest first, each with its history on demand and the
// payment actions while it waits for payment.
"use strict";

(() => {
  const { api, user, el, $, say, money, when, STATUS_WORDS } = seckill;

  async function load() {
    const r = await api("GET", "/api/orders", undefined, "user");
    if (!r.ok) {
      if (r.status === 401) return login();
      return say("message", r.data.message, "error");
    }
    const orders = r.data.sort((a, b) => (BigInt(b.id) > BigInt(a.id) ? 1 : -1));
    say("message", orders.length ? "" : "You have no orders yet.");
    $("orders").classList.toggle("hidden", !orders.length);
    $("orders").tBodies[0].replaceChildren(...orders.map(row));
  }

  function row(o) {
    const actions = el("td", {});
    const history = el("ol", { class: "history hidden", "aria-label": "History of order " + o.id });
    const show = el("button", { type: "button", text: "History", "aria-expanded": "false" });
    show.addEventListener("click", async () => {
      const open = show.getAttribute("aria-expanded") === "true";
      show.setAttribute("aria-expanded", String(!open));
      history.classList.toggle("hidden", open);
      if (open) return;
      const r = await api("GET", "/api/orders/" + o.id, undefined, "user");
      if (!r.ok) return history.replaceChildren(el("li", { text: r.data.message }));
      history.replaceChildren(
        ...(r.data.history || []).map((s) => el("li", { text: (STATUS_WORDS[s.status] || s.status) + " · " + when(s.at) }))
      );
    });
    actions.append(show);
    if (o.status === "pending_payment") {
      actions.append(" ",
        el("button", { type: "button", class: "primary", text: "Pay", on: { click: () => pay(o.id) } }), " ",
        el("button", { type: "button", text: "Cancel", on: { click: () => cancel(o.id) } }));
    }
    return el("tr", { id: "order-" + o.id, "data-status": o.status },
      el("td", {}, o.id, history),
      el("td", {}, el("a", { href: "/sales/" + o.sale_id, text: o.sale_id })),
      el("td", { text: o.quantity + " × " + money(o.price_cents) }),
      el("td", { class: "status", text: STATUS_WORDS[o.status] || o.status }),
      el("td", { text: when(o.accepted_at) }),
      actions);
  }

  async function pay(id) {
    const r = await api("POST", "/api/orders/" + id + "/pay", undefined, "user");
    if (!r.ok) return say("message", r.data.message, "error");
    location.assign(r.data.pay_url);
  }

  async function cancel(id) {
    const r = await api("POST", "/api/orders/" + id + "/cancel", undefined, "user");
    say("message", r.ok ? "Order " + id + " cancelled." : r.data.message, r.ok ? "good" : "error");
    load();
  }

  const login = () => seckill.askLogin(load);

  if (user()) load();
  else login();
})();
