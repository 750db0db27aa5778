//! The one client of the HTTP API the tests use: a method per operation (paths as in
//! `src/edge/mod.rs`'s router and `/openapi.json`), each answering a [`Reply`]. Tests that
//! send what no client would (malformed bodies, odd headers, raw sockets) build their
//! request with [`Api::request`] or keep it raw where the malformation is the point.

use std::fmt;
use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::{Method, RequestBuilder};
use serde_json::{json, Value};

/// What the server answered: its status, headers and body.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    /// The body as sent.
    pub text: String,
    /// The body read as JSON (`Null` when it is not JSON).
    pub body: Value,
    is_json: bool,
}

impl Reply {
    /// Reads a whole answer (a body that cannot be read is empty).
    pub async fn read(r: reqwest::Response) -> Reply {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap_or_default();
        let parsed = serde_json::from_str(&text);
        Reply {
            status,
            headers,
            is_json: parsed.is_ok(),
            body: parsed.unwrap_or(Value::Null),
            text,
        }
    }

    /// Whether the body is JSON.
    pub fn is_json(&self) -> bool {
        self.is_json
    }

    /// The body, which must be JSON.
    pub fn json(self) -> Value {
        assert!(self.is_json, "not JSON: {self}");
        self.body
    }

    /// The body, which must be JSON, of an answer that must have this status.
    pub fn expect(self, status: u16) -> Value {
        assert_eq!(self.status, status, "{self}");
        self.json()
    }

    /// The error code (`{code, message}`), or the purchase's answer; "" when there is none.
    pub fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or_default()
    }

    /// (status, code): what most assertions compare.
    pub fn status_code(&self) -> (u16, String) {
        (self.status, self.code().to_string())
    }

    /// The order id of a purchase's `ok` (or `pending`), if any.
    pub fn order_id(&self) -> Option<String> {
        self.body["order_id"].as_str().map(str::to_string)
    }

    /// A header's value, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

impl std::ops::Index<&str> for Reply {
    type Output = Value;

    fn index(&self, key: &str) -> &Value {
        &self.body[key]
    }
}

impl std::ops::Index<usize> for Reply {
    type Output = Value;

    fn index(&self, i: usize) -> &Value {
        &self.body[i]
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status, self.text)
    }
}

/// A client of one server: its base URL, the admin token when the server has one.
#[derive(Clone)]
pub struct Api {
    client: reqwest::Client,
    pub base: String,
    admin: Option<String>,
}

impl Api {
    /// A client of the server at `base` (storm settings: many connections, 30 s timeout).
    pub fn new(base: &str) -> Api {
        Api::with_client(super::client(), base)
    }

    /// A client of the server at `base` through this HTTP client.
    pub fn with_client(client: reqwest::Client, base: &str) -> Api {
        Api {
            client,
            base: base.trim_end_matches('/').to_string(),
            admin: None,
        }
    }

    /// The same, calling admin operations with this token.
    pub fn admin(mut self, token: &str) -> Api {
        self.admin = Some(token.to_string());
        self
    }

    /// The same client and admin token, for another instance of the deployment.
    pub fn at(&self, base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            ..self.clone()
        }
    }

    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn admin_token(&self) -> &str {
        self.admin
            .as_deref()
            .expect("an admin operation needs the admin token (Server::api)")
    }

    // ---- requests of any shape ------------------------------------------------------------

    /// A request to `path`, for what the typed calls do not send (headers, raw bodies).
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, self.url(path))
    }

    /// Sends a request and reads its answer; panics if none came.
    pub async fn send(request: RequestBuilder) -> Reply {
        Reply::read(request.send().await.unwrap()).await
    }

    /// Sends a request; an error if no answer came (the server was killed, say).
    pub async fn try_send(request: RequestBuilder) -> Result<Reply, reqwest::Error> {
        Ok(Reply::read(request.send().await?).await)
    }

    fn build(
        &self,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Option<&Value>,
    ) -> RequestBuilder {
        let mut r = self.request(method, path);
        if let Some(b) = bearer {
            r = r.bearer_auth(b);
        }
        if let Some(body) = body {
            r = r.json(body);
        }
        r
    }

    /// `method path` with this bearer token and JSON body, if any.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Option<&Value>,
    ) -> Reply {
        Api::send(self.build(method, path, bearer, body)).await
    }

    pub async fn get(&self, path: &str, bearer: Option<&str>) -> Reply {
        self.call(Method::GET, path, bearer, None).await
    }

    pub async fn post(&self, path: &str, bearer: Option<&str>, body: Option<&Value>) -> Reply {
        self.call(Method::POST, path, bearer, body).await
    }

    /// `method path` with the admin token.
    pub async fn admin_call(&self, method: Method, path: &str, body: Option<&Value>) -> Reply {
        self.call(method, path, Some(self.admin_token()), body)
            .await
    }

    // ---- logging in -----------------------------------------------------------------------

    /// `POST /api/auth/code`: a login code sent to this phone (`dev_code` in dev mode).
    pub async fn request_code(&self, phone: &str) -> Reply {
        self.post("/api/auth/code", None, Some(&json!({ "phone": phone })))
            .await
    }

    /// `POST /api/auth/login`: a token for this phone and code.
    pub async fn login(&self, phone: &str, code: &str) -> Reply {
        self.post(
            "/api/auth/login",
            None,
            Some(&json!({ "phone": phone, "code": code })),
        )
        .await
    }

    /// Code then login, in dev mode: the buyer's bearer token.
    pub async fn log_in(&self, phone: &str) -> String {
        let sent = self.request_code(phone).await;
        let code = sent["dev_code"]
            .as_str()
            .unwrap_or_else(|| panic!("no dev_code in {sent}"))
            .to_string();
        let r = self.login(phone, &code).await.json();
        r["token"].as_str().unwrap().to_string()
    }

    /// Logs `n` distinct users in (code, then login); returns their tokens.
    pub async fn login_users(&self, n: usize) -> Vec<String> {
        assert!(n <= 100_000, "phone numbers for at most 100,000 users");
        let prefix = super::common_phone_block();
        let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
        let mut tasks = Vec::new();
        for i in 0..n {
            let (api, sem) = (self.clone(), sem.clone());
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire().await.unwrap();
                api.log_in(&super::test_phone(prefix + i as u64)).await
            }));
        }
        let mut tokens = Vec::with_capacity(n);
        for t in tasks {
            tokens.push(t.await.unwrap());
        }
        tokens
    }

    // ---- the catalogue --------------------------------------------------------------------

    /// `GET /api/sales`: the sales upcoming or open.
    pub async fn sales(&self) -> Reply {
        self.get("/api/sales", None).await
    }

    /// `GET /api/sales/{id}`.
    pub async fn sale(&self, sale: impl fmt::Display) -> Reply {
        self.get(&format!("/api/sales/{sale}"), None).await
    }

    /// `GET /api/sales/{id}/stock`: `{state, remaining}`.
    pub async fn stock(&self, sale: impl fmt::Display) -> Reply {
        self.get(&format!("/api/sales/{sale}/stock"), None).await
    }

    /// `GET /api/sales/{id}/stock`'s `remaining` (-1 when there is none).
    pub async fn remaining(&self, sale: impl fmt::Display) -> i64 {
        self.stock(sale).await.json()["remaining"]
            .as_i64()
            .unwrap_or(-1)
    }

    // ---- a buyer --------------------------------------------------------------------------

    fn purchase(
        &self,
        token: &str,
        sale: impl fmt::Display,
        body: Option<&Value>,
    ) -> RequestBuilder {
        self.build(
            Method::POST,
            &format!("/api/sales/{sale}/purchase"),
            Some(token),
            body,
        )
    }

    /// `POST /api/sales/{id}/purchase` as this buyer, with no body.
    pub async fn buy(&self, token: &str, sale: impl fmt::Display) -> Reply {
        Api::send(self.purchase(token, sale, None)).await
    }

    /// The same, with this body (`{"token": ...}`, `{"quantity": ...}`).
    pub async fn buy_with(&self, token: &str, sale: impl fmt::Display, body: &Value) -> Reply {
        Api::send(self.purchase(token, sale, Some(body))).await
    }

    /// A purchase that may get no answer (the server or its Redis dying under it).
    pub async fn try_buy(
        &self,
        token: &str,
        sale: impl fmt::Display,
    ) -> Result<Reply, reqwest::Error> {
        Api::try_send(self.purchase(token, sale, None)).await
    }

    /// `GET /api/sales/{id}/token`: a single-use purchase token.
    pub async fn purchase_token(&self, token: &str, sale: impl fmt::Display) -> Reply {
        self.get(&format!("/api/sales/{sale}/token"), Some(token))
            .await
    }

    /// The same, answering a captcha.
    pub async fn purchase_token_for(
        &self,
        token: &str,
        sale: impl fmt::Display,
        captcha_id: &str,
        answer: &str,
    ) -> Reply {
        let path = format!("/api/sales/{sale}/token?captcha_id={captcha_id}&answer={answer}");
        self.get(&path, Some(token)).await
    }

    /// `GET /api/sales/{id}/captcha`.
    pub async fn captcha(&self, token: &str, sale: impl fmt::Display) -> Reply {
        self.get(&format!("/api/sales/{sale}/captcha"), Some(token))
            .await
    }

    /// `GET /api/orders`: the buyer's orders.
    pub async fn orders(&self, token: &str) -> Reply {
        self.get("/api/orders", Some(token)).await
    }

    /// `GET /api/orders/{id}`.
    pub async fn order(&self, token: &str, order: impl fmt::Display) -> Reply {
        self.get(&format!("/api/orders/{order}"), Some(token)).await
    }

    /// `POST /api/orders/{id}/pay`: the payment intent.
    pub async fn pay(&self, token: &str, order: impl fmt::Display) -> Reply {
        self.post(&format!("/api/orders/{order}/pay"), Some(token), None)
            .await
    }

    /// The same, with this body.
    pub async fn pay_with(&self, token: &str, order: impl fmt::Display, body: &Value) -> Reply {
        self.post(&format!("/api/orders/{order}/pay"), Some(token), Some(body))
            .await
    }

    /// `POST /api/orders/{id}/cancel`.
    pub async fn cancel(&self, token: &str, order: impl fmt::Display) -> Reply {
        self.post(&format!("/api/orders/{order}/cancel"), Some(token), None)
            .await
    }

    /// A cancel that may get no answer.
    pub async fn try_cancel(
        &self,
        token: &str,
        order: impl fmt::Display,
    ) -> Result<Reply, reqwest::Error> {
        let path = format!("/api/orders/{order}/cancel");
        Api::try_send(self.build(Method::POST, &path, Some(token), None)).await
    }

    /// Waits until the buyer's order is written (`pending_payment`).
    pub async fn written(&self, token: &str, order: impl fmt::Display) {
        let order = order.to_string();
        super::eventually(20, "the order is written", || async {
            self.order(token, &order).await["status"] == "pending_payment"
        })
        .await;
    }

    // ---- payments -------------------------------------------------------------------------

    /// `POST /api/payments/notify`: a provider's callback, with these headers if given.
    pub async fn notify(
        &self,
        timestamp: Option<i64>,
        signature: Option<&str>,
        body: &str,
    ) -> Reply {
        let mut r = self
            .request(Method::POST, "/api/payments/notify")
            .body(body.to_string());
        if let Some(ts) = timestamp {
            r = r.header(
                seckill::lifecycle::payment::TIMESTAMP_HEADER,
                ts.to_string(),
            );
        }
        if let Some(sig) = signature {
            r = r.header(seckill::lifecycle::payment::SIGNATURE_HEADER, sig);
        }
        Api::send(r).await
    }

    /// `POST /api/simulated-pay/{intent}`: the simulated pay page's button, as a buyer.
    pub async fn simulated_pay(&self, token: &str, intent: &str, outcome: &str) -> Reply {
        self.post(
            &format!("/api/simulated-pay/{intent}"),
            Some(token),
            Some(&json!({ "outcome": outcome })),
        )
        .await
    }

    /// `POST /api/admin/payments/{intent}/simulate`: the simulated provider calls back.
    pub async fn simulate(&self, intent: &str, outcome: &str) -> Reply {
        let path = format!("/api/admin/payments/{intent}/simulate");
        self.admin_call(Method::POST, &path, Some(&json!({ "outcome": outcome })))
            .await
    }

    // ---- the admin ------------------------------------------------------------------------

    /// `POST /api/admin/sales`: a draft.
    pub async fn create_sale(&self, fields: &Value) -> Reply {
        self.admin_call(Method::POST, "/api/admin/sales", Some(fields))
            .await
    }

    /// `GET /api/admin/sales`: every sale, drafts too.
    pub async fn admin_sales(&self) -> Reply {
        self.admin_call(Method::GET, "/api/admin/sales", None).await
    }

    /// The admin's view of one sale, from the list (None once deleted).
    pub async fn admin_sale(&self, sale: impl fmt::Display) -> Option<Value> {
        let id = sale.to_string();
        let all = self.admin_sales().await.json();
        all.as_array()?
            .iter()
            .find(|v| v["id"] == id.as_str())
            .cloned()
    }

    /// `PATCH /api/admin/sales/{id}`.
    pub async fn edit_sale(&self, sale: impl fmt::Display, fields: &Value) -> Reply {
        let path = format!("/api/admin/sales/{sale}");
        self.admin_call(Method::PATCH, &path, Some(fields)).await
    }

    /// `DELETE /api/admin/sales/{id}`.
    pub async fn delete_sale(&self, sale: impl fmt::Display) -> Reply {
        let path = format!("/api/admin/sales/{sale}");
        self.admin_call(Method::DELETE, &path, None).await
    }

    /// `POST /api/admin/sales/{id}/{action}`: approve, end, pause, resume.
    pub async fn sale_action(&self, sale: impl fmt::Display, action: &str) -> Reply {
        let path = format!("/api/admin/sales/{sale}/{action}");
        self.admin_call(Method::POST, &path, None).await
    }

    /// `POST /api/admin/sales/{id}/approve`.
    pub async fn approve(&self, sale: impl fmt::Display) -> Reply {
        self.sale_action(sale, "approve").await
    }

    /// `POST /api/admin/sales/{id}/end`.
    pub async fn end_sale(&self, sale: impl fmt::Display) -> Reply {
        self.sale_action(sale, "end").await
    }

    /// Makes a sale that is open now, with these fields besides, and approves it; its id.
    pub async fn open_sale_with(&self, stock: i64, limit: i64, extra: &Value) -> String {
        let now = time::OffsetDateTime::now_utc();
        let mut body = json!({
            "title": "e2e sale",
            "price_cents": 1999,
            "stock": stock,
            "per_user_limit": limit,
            "begins_at": super::rfc3339(now - time::Duration::seconds(5)),
            "ends_at": super::rfc3339(now + time::Duration::hours(1)),
        });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let created = self.create_sale(&body).await.expect(201);
        let id = created["id"].as_str().unwrap().to_string();
        self.approve(&id).await.expect(200);
        id
    }

    /// A sale open now; its id.
    pub async fn open_sale(&self, stock: i64, limit: i64) -> String {
        self.open_sale_with(stock, limit, &json!({})).await
    }

    /// `GET /api/admin/sales/{id}/{what}`: stats, audit, reconcile, order-ids, or the
    /// journal (`journal?limit=N`).
    pub async fn books(&self, sale: impl fmt::Display, what: &str) -> Reply {
        let path = format!("/api/admin/sales/{sale}/{what}");
        self.admin_call(Method::GET, &path, None).await
    }

    /// `GET /api/admin/sales/{id}/reconcile`: the gate against SQL and what is in flight.
    pub async fn reconciliation(&self, sale: impl fmt::Display) -> Value {
        self.books(sale, "reconcile").await.json()
    }

    /// `POST /api/admin/sales/{id}/reconcile`: the repair.
    pub async fn repair(&self, sale: impl fmt::Display) -> Reply {
        let path = format!("/api/admin/sales/{sale}/reconcile");
        self.admin_call(Method::POST, &path, None).await
    }

    /// `GET /api/admin/sales/{id}/journal?limit=10000`: the stock journal.
    pub async fn journal(&self, sale: impl fmt::Display) -> Value {
        self.books(sale, "journal?limit=10000").await.json()
    }

    /// Waits until the sale's gate matches SQL plus what is in flight with nothing in
    /// flight, and checks that its journal sums to its stock.
    pub async fn check_reconciled(&self, sale: impl fmt::Display) {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let r = self.reconciliation(&sale).await;
            let quiet = r["unwritten_orders"] == 0 && r["returns_owed_orders"] == 0;
            if r["exact"] == true && quiet && r["gate_loaded"] == true {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "sale {sale}: the gate never matched SQL: {r}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let j = self.books(&sale, "journal?limit=1").await.json();
        assert_eq!(
            j["sum"], j["stock"],
            "sale {sale}: journal sum != stock: {j}"
        );
    }

    /// `GET /api/admin/live`: this instance's answers and latency over the last second.
    pub async fn live(&self) -> Value {
        self.admin_call(Method::GET, "/api/admin/live", None)
            .await
            .json()
    }

    // ---- operations -----------------------------------------------------------------------

    /// `GET /readyz`.
    pub async fn readyz(&self) -> Reply {
        self.get("/readyz", None).await
    }

    /// `GET /metrics` with the admin token: Prometheus text.
    pub async fn metrics(&self) -> String {
        self.get("/metrics", Some(self.admin_token())).await.text
    }

    /// `GET /openapi.json`.
    pub async fn openapi(&self) -> Value {
        self.get("/openapi.json", None).await.json()
    }
}

/// Orders a journal's `written` rows account for: the writer puts one row per sale and
/// batch, its detail "N orders" ("1 order"), its delta minus their units.
pub fn written_orders(journal: &Value) -> usize {
    journal["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["cause"] == "written")
        .map(|r| {
            let detail = r["detail"].as_str().unwrap_or_default();
            let n = detail
                .strip_suffix(" orders")
                .or_else(|| detail.strip_suffix(" order"))
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("a written row's detail: {r}"));
            let delta = r["delta"].as_i64().unwrap();
            assert!(n > 0 && delta <= -(n as i64), "a written row: {r}");
            n
        })
        .sum()
}
