//! The bench report: a table for people, JSON for machines.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Checks {
    pub orders: i64,
    pub expected_orders: i64,
    pub max_units_per_buyer: i64,
    pub per_user_limit: i64,
    pub ok_answers: usize,
    pub ok_orders_in_sql: usize,
    pub oversold: i64,
    pub drain_seconds: f64,
    pub passed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub gate: String,
    pub model: String,
    pub connections: usize,
    pub buyers: usize,
    pub requests: usize,
    pub stock: i64,
    pub seconds: f64,
    pub throughput: f64,
    pub latency: Latency,
    pub answers: std::collections::BTreeMap<String, u64>,
    pub errors: u64,
    pub checks: Checks,
    /// With `--waiting-room`: joining, admission and the wait between.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub room: Option<super::room::RoomFigures>,
}

fn thousands(n: f64) -> String {
    let s = format!("{:.0}", n);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn mark(ok: bool) -> &'static str {
    if ok {
        "ok"
    } else {
        "FAILED"
    }
}

impl Report {
    pub fn table(&self) -> String {
        let l = &self.latency;
        let c = &self.checks;
        let answers: Vec<String> = self
            .answers
            .iter()
            .map(|(k, v)| format!("{k} {}", thousands(*v as f64)))
            .collect();
        let room = match &self.room {
            None => String::new(),
            Some(r) => format!(
                "room         {rate}/s: {joined} joined, {admitted} let through in {secs:.1} s, {closed} closed | \
                 joining to admission p50 {p50:.2} s | p99 {p99:.2} s | max {max:.2} s\n",
                rate = thousands(r.admit_per_sec as f64),
                joined = thousands(r.joined as f64),
                admitted = thousands(r.admitted as f64),
                secs = r.seconds,
                closed = r.closed,
                p50 = r.wait_p50_ms / 1000.0,
                p99 = r.wait_p99_ms / 1000.0,
                max = r.wait_max_ms / 1000.0,
            ),
        };
        let table = format!(
            "seckill bench: {gate} gate, {model} model, {conns} connections\n\
             storm        {req} requests from {buyers} buyers on a stock of {stock}\n\
             throughput   {tp} req/s over {secs:.2} s\n\
             latency      mean {mean:.2} ms | p50 {p50:.2} | p90 {p90:.2} | p99 {p99:.2} | p99.9 {p999:.2} | max {max:.2} ms\n\
             answers      {answers}\n\
             errors       {errors}\n\
             checks       orders {orders} == min(stock, buyers) {expected}: {o1} | most per buyer {mpb} <= limit {limit}: {o2} | \
             ok answers in SQL {found}/{oks}: {o3} | oversold {over}: {o4}\n\
             drained      in {drain:.2} s\n\
             verdict      {verdict}\n",
            gate = self.gate,
            model = self.model,
            conns = self.connections,
            req = thousands(self.requests as f64),
            buyers = thousands(self.buyers as f64),
            stock = thousands(self.stock as f64),
            tp = thousands(self.throughput),
            secs = self.seconds,
            mean = l.mean_ms,
            p50 = l.p50_ms,
            p90 = l.p90_ms,
            p99 = l.p99_ms,
            p999 = l.p999_ms,
            max = l.max_ms,
            answers = answers.join(" | "),
            errors = self.errors,
            orders = c.orders,
            expected = c.expected_orders,
            o1 = mark(c.orders == c.expected_orders),
            mpb = c.max_units_per_buyer,
            limit = c.per_user_limit,
            o2 = mark(c.max_units_per_buyer <= c.per_user_limit),
            found = c.ok_orders_in_sql,
            oks = c.ok_answers,
            o3 = mark(c.ok_orders_in_sql == c.ok_answers),
            over = c.oversold,
            o4 = mark(c.oversold == 0),
            drain = c.drain_seconds,
            verdict = if c.passed { "all checks passed" } else { "CHECKS FAILED" },
        );
        // The room's line goes before the storm's verdict.
        match table.rfind("verdict") {
            Some(at) => format!("{}{room}{}", &table[..at], &table[at..]),
            None => table + &room,
        }
    }
}

/// One row per gate, in the form of the seeds' comparison.
pub fn comparison(reports: &[Report]) -> String {
    let mut out = String::from(
        "gate              throughput (req/s)   mean (ms)   p99 (ms)   oversold   orders/stock   checks\n",
    );
    for r in reports {
        out.push_str(&format!(
            "{:<17} {:>18}   {:>9.2}   {:>8.2}   {:>8}   {:>12}   {}\n",
            r.gate,
            thousands(r.throughput),
            r.latency.mean_ms,
            r.latency.p99_ms,
            r.checks.oversold,
            format!("{}/{}", r.checks.orders, r.stock),
            mark(r.checks.passed)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1000.0), "1,000");
    }
}
