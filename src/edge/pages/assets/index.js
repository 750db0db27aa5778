// `/`: the sales that are upcoming or open, each linking to its page.
"use strict";

(async () => {
  const { api, clock, el, $, say, money, when, duration } = seckill;
  await clock.sync();
  const r = await api("GET", "/api/sales");
  if (!r.ok) return say("message", r.data.message, "error");
  const sales = r.data.sort((a, b) => Date.parse(a.begins_at) - Date.parse(b.begins_at));
  say("message", sales.length ? "" : "No sale is upcoming or open right now.");
  $("sales").replaceChildren(
    ...sales.map((s) => {
      const opens = Date.parse(s.begins_at);
      const line = el("p", { class: "muted" });
      const tick = () => {
        const left = opens - clock.now();
        line.textContent = left > 0 ? "Opens in " + duration(left) + " (" + when(s.begins_at) + ")"
          : "Open until " + when(s.ends_at);
      };
      tick();
      setInterval(tick, 1000);
      return el("article", { class: "card" },
        el("h2", {}, el("a", { href: "/sales/" + s.id, text: s.title })),
        el("p", {}, el("span", { class: "price", text: money(s.price_cents) }),
          " · " + s.stock + " in stock · at most " + s.per_user_limit + " per buyer"),
        line);
    })
  );
})();
