//! A minimal HTTP/1.1 client for load: one keep-alive connection per worker, requests sent
//! one after another on it (hyper's client connection, no pool, no redirects, no TLS).

use std::net::SocketAddr;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{header, Method, Request};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("http: {0}")]
    Http(#[from] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
}

pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    host: String,
}

/// The answer to a purchase, as far as the bench cares.
#[derive(Debug, Default, Deserialize)]
pub struct Answer {
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub order_id: Option<String>,
}

impl Connection {
    pub async fn open(addr: SocketAddr) -> Result<Connection, ClientError> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(ClientError::Connect)?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Connection {
            sender,
            host: addr.to_string(),
        })
    }

    /// Sends one request and reads the whole answer: (status, body).
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        bearer: Option<&str>,
        body: Bytes,
    ) -> Result<(u16, Bytes), ClientError> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, &self.host);
        if let Some(token) = bearer {
            req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if !body.is_empty() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let req = req.body(Full::new(body))?;
        self.sender.ready().await?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// One purchase; with `anti_bot`, first a purchase token, as a browser client would.
    /// A refused token request is the answer (its status and code).
    pub async fn purchase(
        &mut self,
        sale: &str,
        bearer: &str,
        anti_bot: bool,
    ) -> Result<(u16, Answer), ClientError> {
        let mut body = Bytes::new();
        if anti_bot {
            let path = format!("/api/sales/{sale}/token");
            let (status, answer) = self
                .send(Method::GET, &path, Some(bearer), Bytes::new())
                .await?;
            match serde_json::from_slice::<PurchaseToken>(&answer) {
                Ok(t) if status == 200 => {
                    body = Bytes::from(serde_json::json!({ "token": t.token }).to_string());
                }
                _ => return Ok((status, serde_json::from_slice(&answer).unwrap_or_default())),
            }
        }
        let path = format!("/api/sales/{sale}/purchase");
        let (status, body) = self.send(Method::POST, &path, Some(bearer), body).await?;
        Ok((status, serde_json::from_slice(&body).unwrap_or_default()))
    }
}

#[derive(Deserialize)]
struct PurchaseToken {
    token: String,
}
