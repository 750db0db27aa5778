//! The door while the process starts: the listener is bound first, and until the database,
//! Redis and the first scheduler pass are ready, every call is answered here: `/healthz` 200
//! `starting` (the process is alive; `ok` once it serves), `/readyz` and everything else
//! 503 naming what the start waits for. An orchestrator sees a live process that is not ready yet, rather than no process
//! at all, and restarts nothing. Each answer closes its connection, so that a client's next
//! call reaches the real door once it opens. Never serves anything but these answers.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;

use axum::response::{IntoResponse, Response};
use hyper::header::{HeaderValue, CONNECTION};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::error::ApiError;

/// Answers every connection `listener` accepts while `starting` runs; returns its output.
/// The listener is the caller's again afterwards, for the real door.
pub async fn serve_while<T>(listener: &TcpListener, starting: impl Future<Output = T>) -> T {
    let mut starting = pin!(starting);
    loop {
        tokio::select! {
            done = &mut starting => return done,
            accepted = listener.accept() => {
                if let Ok((io, _)) = accepted {
                    tokio::spawn(answer_connection(io));
                }
            }
        }
    }
}

async fn answer_connection(io: tokio::net::TcpStream) {
    let service = hyper::service::service_fn(|request: hyper::Request<hyper::body::Incoming>| {
        let answer = answer(request.uri().path());
        async move { Ok::<_, Infallible>(answer) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .serve_connection(TokioIo::new(io), service)
        .await;
}

fn answer(path: &str) -> Response {
    let mut response = if path == "/healthz" {
        "starting".into_response()
    } else {
        let waiting = crate::health::waiting_for()
            .unwrap_or_else(|| "the first load of the sales".to_string());
        ApiError::Unavailable(format!("starting: waiting for {waiting}")).into_response()
    };
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}
