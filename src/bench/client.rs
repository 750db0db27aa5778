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

    pub async fn purchase(
        &mut self,
        sale: &str,
        token: &str,
    ) -> Result<(u16, Answer), ClientError> {
        let path = format!("/api/sales/{sale}/purchase");
        let (status, body) = self
            .send(Method::POST, &path, Some(token), Bytes::new())
            .await?;
        Ok((status, serde_json::from_slice(&body).unwrap_or_default()))
    }
}
