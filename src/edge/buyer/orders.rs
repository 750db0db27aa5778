//! The purchase endpoint (the hot path: token check, sale cache, one gate call; no SQL)
//! and the caller's own orders.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Bytes, HttpBody};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::{Deserialize, Serialize};

use super::super::auth::{caller_of, user_of, AuthUser, Caller};
use super::super::http::error::{ApiError, ErrorResponse, ReadErrors};
use super::super::http::input::{parse_id, parse_json, rfc3339, OrderId, PathId};
use super::super::{AppState, MAX_BODY_BYTES, REQUEST_TIMEOUT};
use crate::gate::{Purchase, Rejection, RetryKey, Verdict};
use crate::model::{Order, OrderStatus, Sale};

/// Clock skew allowed between this instance and the gate's clock before the edge answers
/// a window question on its own; closer to the edges, the gate decides.
const WINDOW_SLACK_MS: i64 = 1000;

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PurchaseBody {
    /// Units to buy (1 when left out); never more than the sale's per_user_limit (409
    /// otherwise).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(minimum = 1, maximum = 1000, nullable = false)]
    quantity: Option<i64>,
    /// The anti-bot purchase token, when the sale asks for one.
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    token: Option<String>,
    /// The waiting room's pass, when the sale has a room (`GET /api/sales/{id}/queue`
    /// gives it once the buyer is let through).
    #[serde(default, deserialize_with = "crate::edge::http::input::not_null")]
    #[schema(nullable = false)]
    pass: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct PurchaseOk {
    code: &'static str,
    order_id: String,
}

/// 202: the purchase was sent to the gate and its answer lost. `GET /api/orders/{id}`
/// tells, within seconds, whether it became an order.
#[derive(Serialize, utoipa::ToSchema)]
pub struct PendingView {
    code: &'static str,
    order_id: String,
    message: &'static str,
}

const PENDING_MESSAGE: &str = "the outcome is not known yet; GET /api/orders/{order_id} \
     shortly tells whether this became an order (do not buy again before)";

fn parse_body(body: &[u8]) -> Result<PurchaseBody, ApiError> {
    let body: PurchaseBody = if body.iter().all(crate::is_json_space) {
        PurchaseBody::default()
    } else {
        parse_json(body)?
    };
    match body.quantity {
        None | Some(1..) => Ok(body),
        Some(_) => Err(ApiError::invalid("quantity must be a positive integer")),
    }
}

#[cfg(test)]
fn quantity(body: &[u8]) -> Result<i64, ApiError> {
    parse_body(body).map(|b| b.quantity.unwrap_or(1))
}

/// The answer to a purchase: given at once, or still to come.
pub enum Answer {
    /// Decided without waiting for anything: a bad token or sale id, a sale not open, a
    /// sale this instance knows is sold out. Most of a storm; no future is allocated.
    Now(Response),
    /// Waits for the body, the sale (a cache miss asks SQL) or the gate.
    Later(BoxFuture<'static, Response>),
}

impl Answer {
    pub async fn wait(self) -> Response {
        match self {
            Answer::Now(response) => response,
            Answer::Later(response) => response.await,
        }
    }
}

/// `POST /api/sales/{id}/purchase`, called by the front door (and by the router for ids
/// it must decode first). Gives itself what the router's layers give other calls: the
/// body limit, the time limit, and `{code, message}` errors.
pub fn purchase<B>(st: &Arc<AppState>, sale: &str, headers: &HeaderMap, body: B) -> Answer
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let started = Instant::now();
    let now = st.now_ms();
    let caller =
        caller_of(st, headers, now).and_then(|caller| Ok((caller, parse_id(sale, "sale id")?)));
    let (user_id, sale_id) = match caller {
        Ok((Caller::User(user_id), sale_id)) => (user_id, sale_id),
        Ok((Caller::AfterKeyFetch(_), _)) => {
            // A shop key not seen yet: fetch the keys, then buy as if it had been known.
            let (st, sale, headers) = (st.clone(), sale.to_string(), headers.clone());
            return Answer::Later(Box::pin(async move {
                match user_of(&st, &headers, now).await {
                    Ok(_) => purchase(&st, &sale, &headers, body).wait().await,
                    Err(e) => answer(&st, started, Err(e)),
                }
            }));
        }
        Err(e) => return Answer::Now(answer(st, started, Err(e))),
    };
    let retry_key = match retry_key(headers) {
        Ok(key) => key,
        Err(e) => return Answer::Now(answer(st, started, Err(e))),
    };
    if body.size_hint().exact() != Some(0) {
        let st = st.clone();
        return Answer::Later(Box::pin(async move {
            let result = within_time_limit(async {
                let body = parse_body(&read_body(body).await?)?;
                let ask = Ask {
                    user_id,
                    quantity: body.quantity.unwrap_or(1),
                    token: body.token,
                    pass: body.pass,
                    retry_key,
                };
                decide(&st, sale_id, ask, now).await
            });
            answer(&st, started, result.await)
        }));
    }
    let ask = Ask {
        user_id,
        quantity: 1,
        token: None,
        pass: None,
        retry_key,
    };
    match st.sales.with(sale_id, |sale| admit(st, sale, &ask, now)) {
        Some(Err(e)) => Answer::Now(answer(st, started, Err(e))),
        Some(Ok(admitted)) => {
            let st = st.clone();
            Answer::Later(Box::pin(async move {
                let result = within_time_limit(ask_gate(&st, sale_id, &ask, admitted)).await;
                answer(&st, started, result)
            }))
        }
        None => {
            let st = st.clone();
            Answer::Later(Box::pin(async move {
                let result = within_time_limit(decide(&st, sale_id, ask, now)).await;
                answer(&st, started, result)
            }))
        }
    }
}

/// The buyer's `Idempotency-Key`, digested, when the purchase carries one.
fn retry_key(headers: &HeaderMap) -> Result<Option<RetryKey>, ApiError> {
    // A name made once: looking a header up by text parses the text on every purchase.
    const NAME: HeaderName = HeaderName::from_static(super::super::idempotency::HEADER);
    match headers.get(NAME) {
        None => Ok(None),
        Some(value) => Ok(Some(RetryKey::of(super::super::idempotency::key_text(
            value,
        )?))),
    }
}

/// Counts and times the answer, and renders it.
fn answer(st: &AppState, started: Instant, result: Result<PurchaseOk, ApiError>) -> Response {
    st.metrics
        .request_seconds
        .observe(started.elapsed().as_secs_f64());
    st.metrics.count_purchase(match &result {
        Ok(_) => "ok",
        Err(e) => e.code(),
    });
    match result {
        Ok(ok) if ok.code == "pending" => {
            let mut response = Json(PendingView {
                code: ok.code,
                order_id: ok.order_id,
                message: PENDING_MESSAGE,
            })
            .into_response();
            *response.status_mut() = axum::http::StatusCode::ACCEPTED;
            response
        }
        Ok(ok) => Json(ok).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Runs `answer` under `REQUEST_TIMEOUT`, arming the timer only if it is not answered on
/// its first poll (an embedded gate's answer is): a timer armed and cancelled per request
/// measured about 4% of the sold-out answer's CPU.
async fn within_time_limit<T>(
    answer: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let mut answer = std::pin::pin!(answer);
    if let Some(done) = answer.as_mut().now_or_never() {
        return done;
    }
    // Boxed: the timer would otherwise take room in every purchase's future.
    Box::pin(tokio::time::timeout(REQUEST_TIMEOUT, answer))
        .await
        .unwrap_or_else(|_| Err(ApiError::too_slow()))
}

/// The request body, at most `MAX_BODY_BYTES` (413 beyond).
async fn read_body<B>(body: B) -> Result<Bytes, ApiError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(ApiError::PayloadTooLarge),
        Err(e) => Err(ApiError::invalid(format!("could not read the body: {e}"))),
    }
}

/// Admits the purchase against the sale (read from SQL if this instance has not cached it
/// yet), then asks the gate.
async fn decide(st: &AppState, sale_id: i64, ask: Ask, now: i64) -> Result<PurchaseOk, ApiError> {
    let admitted = match st.sales.with(sale_id, |sale| admit(st, sale, &ask, now)) {
        Some(admitted) => admitted?,
        None => {
            // Boxed: inline, the SQL future made every purchase's future kilobytes larger.
            let sale = Box::pin(st.sales.get_or_refresh(sale_id, &st.store))
                .await?
                .ok_or_else(|| ApiError::NotFound(format!("sale {sale_id} does not exist")))?;
            admit(st, &sale, &ask, now)?
        }
    };
    ask_gate(st, sale_id, &ask, admitted).await
}

/// The one gate call of an admitted purchase.
async fn ask_gate(
    st: &AppState,
    sale_id: i64,
    ask: &Ask,
    admitted: Admitted,
) -> Result<PurchaseOk, ApiError> {
    let order_id = st.ids.next()?;
    let asked = Instant::now();
    let verdict = st
        .gate
        .purchase(Purchase {
            sale_id,
            user_id: ask.user_id,
            quantity: ask.quantity,
            order_id,
            token: admitted.token,
            segments: admitted.segments,
            after_move: false,
            retry_key: ask.retry_key,
        })
        .await;
    st.metrics
        .gate_seconds
        .observe(asked.elapsed().as_secs_f64());
    let limit = admitted.limit;
    let verdict = match verdict {
        Ok(verdict) => verdict,
        // Sent and unanswered: it may have bought. Never "no" for what may be an order.
        Err(e) if e.may_have_taken_effect() => {
            tracing::debug!(error = %e, order_id, "purchase outcome unknown; answered pending");
            return Ok(PurchaseOk {
                code: "pending",
                order_id: order_id.to_string(),
            });
        }
        Err(e) => return Err(e.into()),
    };
    match verdict {
        Verdict::Accepted { .. } => Ok(PurchaseOk {
            code: "ok",
            order_id: order_id.to_string(),
        }),
        // The first attempt with this Idempotency-Key bought it: the same answer again.
        Verdict::Again { order_id } => Ok(PurchaseOk {
            code: "ok",
            order_id: order_id.to_string(),
        }),
        Verdict::Rejected(Rejection::NotLoaded)
            if ask.retry_key.is_some()
                && st
                    .sales
                    .get(sale_id)
                    .is_some_and(|sale| st.now_ms() >= sale.ends_at) =>
        {
            // A retry of a sale gone from the gate, and no purchase recorded for its key.
            Err(ApiError::from_rejection(Rejection::Ended, limit))
        }
        Verdict::Rejected(Rejection::NotLoaded) => {
            // Approved but not preloaded yet (approved on another instance moments ago),
            // or lost by Redis. The load runs as a task of its own: a buyer who leaves, or
            // the request's time limit, must not cut a rebuild short and leave its locks
            // to lapse while every buyer hears `not_loaded`.
            if let Some(sale) = st.sales.get(sale_id) {
                let (store, gate, sales) = (st.store.clone(), st.gate.clone(), st.sales.clone());
                let load = tokio::spawn(async move {
                    crate::loader::load_sale_unless_loading(&store, gate.as_ref(), &sales, &sale)
                        .await
                });
                match load.await {
                    Ok(loaded) => {
                        loaded?;
                    }
                    Err(e) => tracing::error!(error = %e, sale = sale_id, "the sale's load failed"),
                }
            }
            Err(ApiError::from_rejection(Rejection::NotLoaded, limit))
        }
        Verdict::Rejected(r) => Err(ApiError::from_rejection(r, limit)),
    }
}

/// What the buyer asks for.
struct Ask {
    user_id: i64,
    quantity: i64,
    token: Option<String>,
    pass: Option<String>,
    retry_key: Option<RetryKey>,
}

/// A purchase that passed the checks made without the gate, and what the gate needs of them.
struct Admitted {
    limit: i64,
    segments: i64,
    token: Option<crate::gate::Spend>,
}

/// The checks that need nothing but the cached sale, cheapest first: the quantity against
/// the limit, the window, the anti-bot token, and this instance's sold-out flag (a storm's
/// commonest answer, given before an order id is taken or the gate is called).
fn admit(st: &AppState, sale: &Sale, ask: &Ask, now: i64) -> Result<Admitted, ApiError> {
    let limit = sale.per_user_limit;
    if ask.quantity > limit {
        return Err(ApiError::invalid(format!(
            "quantity exceeds the per-user limit of {limit}"
        )));
    }
    // A retry's first attempt may have bought before the sale ended or sold out: only
    // the gate, which keeps its record, can tell.
    let retry = ask.retry_key.is_some();
    if now < sale.begins_at - WINDOW_SLACK_MS {
        return Err(ApiError::from_rejection(Rejection::NotStarted, limit));
    }
    if now >= sale.ends_at + WINDOW_SLACK_MS && !retry {
        return Err(ApiError::from_rejection(Rejection::Ended, limit));
    }
    super::super::antibot::queue_pass(st, sale, ask.user_id, ask.pass.as_deref())?;
    let token = super::super::antibot::purchase_token(st, sale, ask.user_id, ask.token.as_deref())?;
    if let Some(Verdict::Rejected(sold_out)) = st.sold_out.answer(sale.id).filter(|_| !retry) {
        return Err(ApiError::from_rejection(sold_out, limit));
    }
    Ok(Admitted {
        limit,
        segments: sale.segments,
        token,
    })
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct OrderView {
    id: String,
    sale_id: String,
    quantity: i64,
    price_cents: i64,
    status: OrderStatus,
    accepted_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pay_deadline: Option<String>,
    /// Every step of the order with its time (single-order view only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    history: Vec<Step>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct Step {
    status: String,
    at: String,
}

impl From<&Order> for OrderView {
    fn from(o: &Order) -> Self {
        OrderView {
            id: o.id.to_string(),
            sale_id: o.sale_id.to_string(),
            quantity: o.quantity,
            price_cents: o.price_cents,
            status: o.status,
            accepted_at: rfc3339(o.accepted_at),
            pay_deadline: Some(rfc3339(o.pay_deadline)),
            history: Vec::new(),
        }
    }
}

#[utoipa::path(
    get,
    path = "/api/orders/{id}",
    tag = "buyer",
    summary = "One of the caller's orders (queued until written)",
    params(OrderId),
    responses((status = 200, description = "The order and its history", body = OrderView), (status = 202, description = "An id answered `pending` whose fate is not known yet: ask again in a second", body = ErrorResponse), ReadErrors),
    security(("user" = []))
)]
pub async fn get_order(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
    PathId(order_id, _): OrderId,
) -> Result<Json<OrderView>, ApiError> {
    let accepted_at = crate::ids::IdGenerator::time_of(order_id);
    let current: Vec<Arc<Sale>> = st
        .sales
        .all()
        .into_iter()
        .filter(|sale| {
            accepted_at >= sale.begins_at - WINDOW_SLACK_MS
                && accepted_at <= sale.ends_at + WINDOW_SLACK_MS
        })
        .collect();
    // Someone else's order is indistinguishable from no order at all.
    let not_found = || {
        if current.is_empty() {
            ApiError::NotFound(format!("order {order_id} does not exist"))
        } else if st.now_ms() <= crate::gate::attempt_deadline(order_id) + CLOCK_SLACK_MS {
            // An id answered `pending`, not settled until no gate can take it any more.
            ApiError::Pending
        } else {
            ApiError::NotPlaced
        }
    };
    if let Some(order) = st.store.order(order_id).await? {
        return if order.user_id == user_id {
            let mut view = OrderView::from(&order);
            view.history = vec![
                Step {
                    status: "queued".into(),
                    at: rfc3339(order.accepted_at),
                },
                Step {
                    status: "pending_payment".into(),
                    at: rfc3339(order.written_at),
                },
            ];
            for (status, at) in st.store.order_events(order_id).await? {
                view.history.push(Step {
                    status,
                    at: rfc3339(at),
                });
            }
            Ok(Json(view))
        } else {
            Err(not_found())
        };
    }
    // Accepted by the gate but not written yet: look in the gates of current sales.
    for sale in &current {
        let Some((owner, quantity)) = st.gate.queued_order(sale.id, order_id).await? else {
            continue;
        };
        if owner == user_id {
            let mut view = queued_view(order_id, sale, quantity);
            view.history = vec![Step {
                status: "queued".into(),
                at: rfc3339(accepted_at),
            }];
            return Ok(Json(view));
        }
    }
    Err(not_found())
}

/// Clock difference tolerated between this instance and the gate's Redis.
const CLOCK_SLACK_MS: i64 = 1000;

/// An order accepted and not yet in SQL.
fn queued_view(order_id: i64, sale: &Sale, quantity: i64) -> OrderView {
    OrderView {
        id: order_id.to_string(),
        sale_id: sale.id.to_string(),
        quantity,
        price_cents: sale.price_cents,
        status: OrderStatus::Queued,
        accepted_at: rfc3339(crate::ids::IdGenerator::time_of(order_id)),
        pay_deadline: None,
        history: Vec::new(),
    }
}

#[utoipa::path(
    get,
    path = "/api/orders",
    tag = "buyer",
    summary = "The caller's orders, newest first",
    responses((status = 200, description = "Queued ones (not in SQL yet) first", body = Vec<OrderView>), (status = 401, response = ErrorResponse), (status = 429, response = ErrorResponse), (status = 503, response = ErrorResponse)),
    security(("user" = []))
)]
pub async fn list_orders(
    AuthUser(user_id): AuthUser,
    State(st): State<Arc<AppState>>,
) -> Result<Json<Vec<OrderView>>, ApiError> {
    let orders = st.store.orders_of_user(user_id, 200).await?;
    let mut views: Vec<OrderView> = orders.iter().map(OrderView::from).collect();
    let written: std::collections::HashSet<i64> = orders.iter().map(|o| o.id).collect();
    // Orders answered `ok` and not yet in SQL, from the order log.
    let mut in_sql: std::collections::HashMap<i64, i64> = Default::default();
    for o in &orders {
        if matches!(o.status, OrderStatus::PendingPayment | OrderStatus::Paid) {
            *in_sql.entry(o.sale_id).or_default() += o.quantity;
        }
    }
    // Orders wait for writers for moments, not hours.
    let since = st.now_ms() - 3_600_000;
    let sales: Vec<(i64, i64, i64)> = st
        .sales
        .all()
        .iter()
        .filter(|s| s.ends_at > since)
        .map(|s| (s.id, in_sql.get(&s.id).copied().unwrap_or(0), s.segments))
        .collect();
    let queued_orders = st.backlog.queued_of_user(user_id, &sales).await?;
    // Newest first, as SQL's are.
    {
        let mut queued: Vec<_> = queued_orders
            .into_iter()
            .filter(|(id, _, _)| !written.contains(id))
            .filter_map(|(id, sale_id, quantity)| {
                st.sales
                    .get(sale_id)
                    .map(|sale| (id, queued_view(id, &sale, quantity)))
            })
            .collect();
        queued.sort_by_key(|(id, _)| std::cmp::Reverse(*id));
        views.splice(0..0, queued.into_iter().map(|(_, view)| view));
    }
    Ok(Json(views))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantity_defaults_to_one_and_rejects_nonsense() {
        assert_eq!(quantity(b"").unwrap(), 1);
        assert_eq!(quantity(b"  \n").unwrap(), 1);
        assert_eq!(quantity(b"{}").unwrap(), 1);
        assert_eq!(quantity(br#"{"quantity":3}"#).unwrap(), 3);
        for bad in [
            &br#"{"quantity":0}"#[..],
            br#"{"quantity":-1}"#,
            br#"{"quantity":1.5}"#,
            br#"{"quantity":"2"}"#,
            br#"{"quantity":99999999999999999999}"#,
            br#"{"qty":1}"#,
            b"{",
            b"[]",
            b"null",
            b"\x0c",
            b" \x0b ",
        ] {
            assert!(quantity(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
