// `/simulated-pay/{intent}`: the simulated provider's pay page. The buyer pays, fails to,
// or pays after the deadline; the provider then calls seckill back, signed, and this page
// follows the payment until it is settled.
"use strict";

(() => {
  const { api, user, clock, $, say, money, duration } = seckill;
  const intentId = seckill.idFromPath();
  let intent = null;

  const WORDS = {
    created: "waiting for you",
    paid: "paid",
    failed: "failed",
    refund_due: "arrived too late: refund due",
  };

  function show() {
    $("intent").classList.remove("hidden");
    $("amount").textContent = money(intent.amount_cents);
    $("order-id").textContent = intent.order_id;
    $("intent-id").textContent = intent.intent_id;
    const status = $("pay-status");
    status.dataset.status = intent.status;
    status.textContent = WORDS[intent.status] || intent.status;
    const open = intent.status === "created" && intent.order_status === "pending_payment";
    $("actions").classList.toggle("hidden", !open);
    $("deadline-line").classList.toggle("hidden", !open);
    $("back").setAttribute("href", "/orders#order-" + intent.order_id);
  }

  async function load() {
    const r = await api("GET", "/api/simulated-pay/" + intentId, undefined, "user");
    if (!r.ok) {
      if (r.status === 401) return login();
      return say("message", r.data.message, "error");
    }
    intent = r.data;
    show();
    return intent;
  }

  // After the buyer's choice, the provider's callback settles the payment: follow it.
  async function follow() {
    for (let i = 0; i < 600; i++) {
      await new Promise((done) => setTimeout(done, 1000));
      const now = await load();
      if (now && now.status !== "created") {
        return say("message", now.status === "paid" ? "Paid. Thank you!" : WORDS[now.status] || now.status,
          now.status === "paid" ? "good" : "error");
      }
    }
  }

  async function choose(outcome, words) {
    const r = await api("POST", "/api/simulated-pay/" + intentId, { outcome }, "user");
    if (!r.ok) return say("message", r.data.message, "error");
    $("actions").classList.add("hidden");
    say("message", words);
    follow();
  }

  const login = () => seckill.askLogin(load);

  $("do-pay").addEventListener("click", () => choose("pay", "Paying…"));
  $("do-fail").addEventListener("click", () => choose("fail", "The provider is declining the payment…"));
  $("do-pay-late").addEventListener("click", () =>
    choose("pay_late", "The provider will pay one second after the deadline…"));
  setInterval(() => {
    if (intent) $("pay-countdown").textContent = duration(Date.parse(intent.pay_deadline) - clock.now());
  }, 250);

  clock.sync().then(() => (user() ? load() : login()));
})();
