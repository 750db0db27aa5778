//! A lean HTTP/1.1 client for load: one keep-alive connection per worker, requests sent
//! one after another on it, written and read straight on the socket (no pool, no
//! redirects, no TLS, no task per connection). The load generator shares the machine with
//! the server it measures, so every microsecond it spends is taken from the server: with
//! hyper's client connection (a second task per connection, a header map per request) it
//! topped out near half of what wrk reaches against the same nginx.

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::http::Method;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad response: {0}")]
    BadResponse(String),
    #[error("the server closed the connection")]
    Closed,
}

pub struct Connection {
    stream: TcpStream,
    host: String,
    /// The request being written, reused across requests.
    out: Vec<u8>,
    /// What has been read and not yet consumed.
    buf: Vec<u8>,
    /// The server said `Connection: close`: the next request needs a new connection.
    closing: bool,
}

/// The answer to a purchase, as far as the bench cares.
#[derive(Debug, Default, Deserialize)]
pub struct Answer<'a> {
    #[serde(default, borrow)]
    pub code: &'a str,
    #[serde(default, borrow)]
    pub order_id: Option<&'a str>,
}

/// Largest response head accepted; the server's are a few hundred bytes.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 32;

impl Connection {
    pub async fn open(addr: SocketAddr) -> Result<Connection, ClientError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(ClientError::Connect)?;
        let _ = stream.set_nodelay(true);
        Ok(Connection {
            stream,
            host: addr.to_string(),
            out: Vec::with_capacity(512),
            buf: Vec::with_capacity(4096),
            closing: false,
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
        let (status, range) = self.exchange(&method, path, bearer, &body).await?;
        let answer = Bytes::copy_from_slice(&self.buf[range.clone()]);
        self.buf.drain(..range.end);
        Ok((status, answer))
    }

    /// Writes the request and reads its response; the body is `self.buf[range]`, and the
    /// caller drains `..range.end` once done with it.
    async fn exchange(
        &mut self,
        method: &Method,
        path: &str,
        bearer: Option<&str>,
        body: &[u8],
    ) -> Result<(u16, std::ops::Range<usize>), ClientError> {
        if self.closing {
            return Err(ClientError::Closed);
        }
        self.write_request(method, path, bearer, body);
        self.stream.write_all(&self.out).await?;
        let (status, head_len, length) = loop {
            if let Some(head) = self.parse_head()? {
                break head;
            }
            self.fill().await?;
        };
        let length = match length {
            BodyLength::Exact(n) => n,
            BodyLength::UntilClose => {
                while self.fill().await.is_ok() {}
                self.closing = true;
                self.buf.len() - head_len
            }
        };
        while self.buf.len() < head_len + length {
            self.fill().await?;
        }
        self.buf.drain(..head_len);
        Ok((status, 0..length))
    }

    fn write_request(&mut self, method: &Method, path: &str, bearer: Option<&str>, body: &[u8]) {
        use std::io::Write;
        let out = &mut self.out;
        out.clear();
        // Writing into a Vec cannot fail.
        let _ = write!(out, "{method} {path} HTTP/1.1\r\nHost: {}\r\n", self.host);
        if let Some(token) = bearer {
            let _ = write!(out, "Authorization: Bearer {token}\r\n");
        }
        if !body.is_empty() {
            out.extend_from_slice(b"Content-Type: application/json\r\n");
        }
        let _ = write!(out, "Content-Length: {}\r\n\r\n", body.len());
        out.extend_from_slice(body);
    }

    /// Reads more of the response; end of stream is an error.
    async fn fill(&mut self) -> Result<(), ClientError> {
        // Into the spare capacity: no zeroing of a fresh buffer per read.
        self.buf.reserve(8192);
        let n = self.stream.read_buf(&mut self.buf).await?;
        if n == 0 {
            self.closing = true;
            return Err(ClientError::Closed);
        }
        Ok(())
    }

    /// (status, head length, body length) once the whole head has arrived.
    fn parse_head(&mut self) -> Result<Option<(u16, usize, BodyLength)>, ClientError> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        let head_len = match response.parse(&self.buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if self.buf.len() < MAX_HEAD => return Ok(None),
            Ok(httparse::Status::Partial) => {
                return Err(ClientError::BadResponse("response head too large".into()))
            }
            Err(e) => return Err(ClientError::BadResponse(e.to_string())),
        };
        let status = response.code.unwrap_or(0);
        let mut length = BodyLength::UntilClose;
        for h in response.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                let n = std::str::from_utf8(h.value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| ClientError::BadResponse("bad Content-Length".into()))?;
                length = BodyLength::Exact(n);
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                return Err(ClientError::BadResponse(
                    "chunked responses are not supported by the bench client".into(),
                ));
            } else if h.name.eq_ignore_ascii_case("connection")
                && h.value.eq_ignore_ascii_case(b"close")
            {
                self.closing = true;
            }
        }
        if status == 204 || status == 304 || (100..200).contains(&status) {
            length = BodyLength::Exact(0);
        }
        Ok(Some((status, head_len, length)))
    }

    /// One purchase; with `anti_bot`, first a purchase token, as a browser client would;
    /// with a waiting room's `pass`, that in the body.
    /// A refused token request is the answer (its status and code). `seen` gets the status
    /// and the answer, borrowed from the connection's buffer.
    pub async fn purchase<R>(
        &mut self,
        sale: &str,
        bearer: &str,
        anti_bot: bool,
        pass: Option<&str>,
        seen: impl FnOnce(u16, Answer<'_>) -> R,
    ) -> Result<R, ClientError> {
        let mut fields = serde_json::Map::new();
        if let Some(pass) = pass {
            fields.insert("pass".into(), pass.into());
        }
        if anti_bot {
            let path = format!("/api/sales/{sale}/token");
            let (status, answer) = self
                .send(Method::GET, &path, Some(bearer), Bytes::new())
                .await?;
            match serde_json::from_slice::<PurchaseToken>(&answer) {
                Ok(t) if status == 200 => {
                    fields.insert("token".into(), t.token.into());
                }
                _ => {
                    let answer = serde_json::from_slice(&answer).unwrap_or_default();
                    return Ok(seen(status, answer));
                }
            }
        }
        let body = if fields.is_empty() {
            Vec::new()
        } else {
            serde_json::Value::Object(fields).to_string().into_bytes()
        };
        let path = format!("/api/sales/{sale}/purchase");
        let (status, range) = self
            .exchange(&Method::POST, &path, Some(bearer), &body)
            .await?;
        let answer = serde_json::from_slice(&self.buf[range.clone()]).unwrap_or_default();
        let result = seen(status, answer);
        self.buf.drain(..range.end);
        Ok(result)
    }
}

enum BodyLength {
    Exact(usize),
    UntilClose,
}

#[derive(Deserialize)]
struct PurchaseToken {
    token: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A server that reads one request head per entry of `answers` and writes that entry's
    /// pieces with pauses between them, then closes.
    async fn canned(answers: Vec<Vec<&'static [u8]>>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut seen = Vec::new();
            for pieces in answers {
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut b = [0u8; 1024];
                    let n = s.read(&mut b).await.unwrap();
                    seen.extend_from_slice(&b[..n]);
                }
                let end = seen.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                seen.drain(..end);
                for p in pieces {
                    s.write_all(p).await.unwrap();
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_response_split_anywhere_is_read_whole_and_the_next_starts_clean() {
        let addr = canned(vec![
            vec![
                b"HTTP/1.1 409 Conflict\r\nContent-Le",
                b"ngth: 19\r\n\r\n{\"code\":\"sold",
                b"_out\"}",
            ],
            vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"],
        ])
        .await;
        let mut c = Connection::open(addr).await.unwrap();
        let seen = c
            .purchase("1", "t", false, None, |status, a| {
                (status, a.code.to_string())
            })
            .await
            .unwrap();
        assert_eq!(seen, (409, "sold_out".to_string()));
        let (status, body) = c.send(Method::GET, "/", None, Bytes::new()).await.unwrap();
        assert_eq!((status, &body[..]), (200, &b"ok"[..]));
    }

    #[tokio::test]
    async fn a_body_without_length_runs_to_the_close_and_ends_the_connection() {
        let addr = canned(vec![vec![
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ",
            b"world",
        ]])
        .await;
        let mut c = Connection::open(addr).await.unwrap();
        let (status, body) = c.send(Method::GET, "/", None, Bytes::new()).await.unwrap();
        assert_eq!((status, &body[..]), (200, &b"hello world"[..]));
        assert!(matches!(
            c.send(Method::GET, "/", None, Bytes::new()).await,
            Err(ClientError::Closed)
        ));
    }

    #[tokio::test]
    async fn a_connection_closed_mid_body_is_an_error() {
        let addr = canned(vec![vec![
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        ]])
        .await;
        let mut c = Connection::open(addr).await.unwrap();
        assert!(c.send(Method::GET, "/", None, Bytes::new()).await.is_err());
    }
}
