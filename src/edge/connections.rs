//! The cap on client connections served at once. Over the cap, the listener stops
//! accepting: new connections wait in the kernel's accept queue (long, see `cli`) instead
//! of each costing a task, buffers and a file descriptor. A slot is freed when its
//! connection closes, however it closes.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Connections {
    slots: Arc<Semaphore>,
    max: usize,
    /// Times the cap was reached and accepting paused.
    pub saturated: AtomicU64,
}

impl Connections {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Connections {
            slots: Arc::new(Semaphore::new(max.max(1))),
            max: max.max(1),
            saturated: AtomicU64::new(0),
        })
    }

    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Wraps a listener so that it holds at most `max` connections open.
    pub fn limit<L: Listener>(self: &Arc<Self>, inner: L) -> Limited<L> {
        Limited {
            inner,
            connections: self.clone(),
        }
    }
}

pub struct Limited<L> {
    inner: L,
    connections: Arc<Connections>,
}

impl<L: Listener> Listener for Limited<L> {
    type Io = Counted<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let slots = self.connections.slots.clone();
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                let times = self.connections.saturated.fetch_add(1, Ordering::Relaxed);
                // A flood would hit this once per connection: log the first of each thousand.
                if times.is_multiple_of(1000) {
                    tracing::warn!(
                        max = self.connections.max,
                        times = times + 1,
                        "connection cap reached; new connections wait in the accept queue"
                    );
                }
                // The semaphore is never closed, so this cannot fail; if it ever were,
                // serving without the cap beats refusing every connection.
                match slots.acquire_owned().await {
                    Ok(slot) => slot,
                    Err(_) => return self.unlimited().await,
                }
            }
        };
        let (io, addr) = self.inner.accept().await;
        (
            Counted {
                io,
                _slot: Some(slot),
            },
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

impl<L: Listener> Limited<L> {
    async fn unlimited(&mut self) -> (Counted<L::Io>, L::Addr) {
        let (io, addr) = self.inner.accept().await;
        (Counted { io, _slot: None }, addr)
    }
}

/// A connection holding its slot until dropped.
pub struct Counted<I> {
    io: I,
    _slot: Option<OwnedSemaphorePermit>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Counted<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Counted<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<I> Counted<I> {
    pub fn get_mut(&mut self) -> &mut I {
        &mut self.io
    }
}
