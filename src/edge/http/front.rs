//! The front door: accepts client connections, serves each with hyper, and routes each
//! request. It closes a connection at once when its address holds its share, and later
//! when it is idle too long or too slow sending a request's head (`connections`). It
//! applies the per-address rate limit (when configured) to every call, hands
//! purchases straight to `orders::purchase`, and everything else to the router.
//!
//! Purchases skip the router, and connections skip `axum::serve`, because a storm is
//! hundreds of thousands of purchases, most answered `sold_out` from a local flag: on the
//! 2-core box (docs/internals/benchmarking.md) the router with its boxed per-route services and layers,
//! and axum's per-request service clone and body boxing, cost more CPU per request than
//! hyper itself. The purchase handler gives itself what the layers gave it (the body
//! limit, the time limit, JSON errors). This door must never answer a call differently
//! from the router; anything it does not recognise goes to the router.

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;

use axum::body::Body;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::serve::Listener;
use axum::Router;
use futures_util::future::{BoxFuture, Either, Map};
use futures_util::FutureExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tower_service::Service;

use super::super::buyer::orders;
use super::super::AppState;
use super::connections::{Activity, Counted};
use super::cors::{self, Cors};

/// Serves `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish the request it is serving, and returns once all are closed.
pub async fn serve<L, I>(mut listener: L, state: Arc<AppState>, shutdown: impl Future<Output = ()>)
where
    L: Listener<Io = Counted<I>, Addr = SocketAddr>,
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let router = super::super::router(state.clone());
    let cors = Arc::new(super::cors::Cors::new(&state.config.cors_origins));
    // Connections hold a receiver of each: the first tells them to close, the second
    // tells this loop when the last of them has.
    let (stop_tx, stop_rx) = watch::channel(());
    let (closed_tx, closed_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            conn = listener.accept() => conn,
            () = &mut shutdown => break,
        };
        let Some(address_slot) = state.connections.admit(peer.ip()) else {
            drop(io);
            continue;
        };
        let activity = io.activity();
        let front = Front {
            state: state.clone(),
            router: router.clone(),
            peer,
            activity: activity.clone(),
            cors: cors.clone(),
        };
        let (mut stop, closed) = (stop_rx.clone(), closed_rx.clone());
        let connections = state.connections.clone();
        tokio::spawn(async move {
            // One write per answer: head and body copied into one buffer measured 1.5-3.5%
            // faster than a vectored write of the two on loopback.
            let conn = hyper::server::conn::http1::Builder::new()
                .writev(false)
                .serve_connection(TokioIo::new(io), front);
            let mut conn = pin!(conn);
            let watchdog = tokio::spawn(
                activity
                    .clone()
                    .watch(connections.header_read_timeout, connections.idle_timeout),
            );
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
                // Idle, or too slow with a request's head: no request is lost by closing.
                () = std::future::poll_fn(|cx| activity.poll_expired(cx)) => {
                    if !activity.was_shed() {
                        connections.timed_out.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
            watchdog.abort();
            drop(address_slot);
            drop(closed);
        });
    }
    drop(listener);
    let _ = stop_tx.send(());
    drop(closed_rx);
    closed_tx.closed().await;
}

/// Serves the requests of one connection.
struct Front {
    state: Arc<AppState>,
    router: Router,
    peer: SocketAddr,
    activity: Arc<Activity>,
    cors: Arc<Cors>,
}

/// An answer given at once (no allocation), or one to wait for.
type Answering = Either<
    Ready<Result<Response, Infallible>>,
    Map<BoxFuture<'static, Response>, fn(Response) -> Result<Response, Infallible>>,
>;

fn now(response: Response) -> Answering {
    Either::Left(ready(Ok(response)))
}

fn later(response: BoxFuture<'static, Response>) -> Answering {
    Either::Right(response.map(Ok))
}

impl hyper::service::Service<hyper::Request<Incoming>> for Front {
    type Response = Response;
    type Error = Infallible;
    type Future = Answering;

    fn call(&self, req: hyper::Request<Incoming>) -> Self::Future {
        self.activity.head_complete();
        if self.cors.enabled() {
            return self.call_cross_origin(req);
        }
        self.answer(req)
    }
}

impl Front {
    /// A request from a browser page, perhaps of another origin: preflights answered here,
    /// the rest served as usual and marked readable by an allowed origin.
    fn call_cross_origin(&self, req: hyper::Request<Incoming>) -> Answering {
        if let Some(preflight) = self.cors.preflight(req.method(), req.headers()) {
            return now(preflight);
        }
        let Some(origin) = self.cors.allowed(req.headers()) else {
            return self.answer(req);
        };
        match self.answer(req) {
            Either::Left(ready) => later(Box::pin(async move {
                let Ok(mut response) = ready.await;
                cors::allow(&mut response, origin);
                response
            })),
            Either::Right(pending) => later(Box::pin(async move {
                let Ok(mut response) = pending.await;
                cors::allow(&mut response, origin);
                response
            })),
        }
    }

    fn answer(&self, req: hyper::Request<Incoming>) -> Answering {
        let limiter = &self.state.address_limiter;
        if limiter.enabled() {
            if let Err(e) = limiter.admit(self.peer.ip(), req.headers()) {
                return now(e.into_response());
            }
        }
        if req.method() == Method::POST && purchase_sale_segment(req.uri().path()).is_some() {
            let (parts, body) = req.into_parts();
            let sale = purchase_sale_segment(parts.uri.path()).unwrap_or_default();
            return match orders::purchase(&self.state, sale, &parts.headers, body) {
                orders::Answer::Now(response) => now(response),
                orders::Answer::Later(response) => later(response),
            };
        }
        let mut req = req.map(Body::new);
        req.extensions_mut()
            .insert(super::super::auth::PeerAddr(self.peer.ip()));
        // The router is always ready: no poll_ready needed before call.
        let routed = self.router.clone().call(req);
        later(Box::pin(async move {
            match routed.await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        }))
    }
}

/// The `{id}` of `/api/sales/{id}/purchase`, as the router would match it. A segment with
/// percent-escapes is left to the router, which decodes it.
pub fn purchase_sale_segment(path: &str) -> Option<&str> {
    let id = path
        .strip_prefix("/api/sales/")?
        .strip_suffix("/purchase")?;
    (!id.is_empty() && !id.bytes().any(|b| b == b'/' || b == b'%')).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::purchase_sale_segment;

    #[test]
    fn only_the_purchase_route_is_taken() {
        assert_eq!(purchase_sale_segment("/api/sales/42/purchase"), Some("42"));
        assert_eq!(purchase_sale_segment("/api/sales/x/purchase"), Some("x"));
        for other in [
            "/api/sales/purchase",
            "/api/sales//purchase",
            "/api/sales/4/2/purchase",
            "/api/sales/%34%32/purchase",
            "/api/sales/42/purchase/",
            "/api/sales/42/purchases",
            "/api/sales/42",
            "/api/sales/42/stock",
            "//api/sales/42/purchase",
        ] {
            assert_eq!(purchase_sale_segment(other), None, "{other}");
        }
    }
}
