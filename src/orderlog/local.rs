//! The embedded order log: an in-process queue from the memory gate to the writer. Each
//! entry carries a one-shot channel back to the purchase request, which is answered `ok`
//! only once the writer's transaction holding the order has committed (group commit:
//! every order waiting at that moment shares one transaction and one fsync).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot, Mutex};

use super::{Batch, Delivery, LogError, OrderLog, Receipt};
use crate::model::NewOrder;

type Entry = (NewOrder, oneshot::Sender<Result<(), String>>);

/// The producer half, held by the memory gate.
#[derive(Clone)]
pub struct LocalLog {
    tx: mpsc::UnboundedSender<Entry>,
}

/// The consumer half, driven by the writer.
pub struct LocalLogReader {
    rx: Mutex<mpsc::UnboundedReceiver<Entry>>,
    done: Arc<AtomicBool>,
}

pub fn channel() -> (LocalLog, LocalLogReader) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        LocalLog { tx },
        LocalLogReader {
            rx: Mutex::new(rx),
            done: Arc::new(AtomicBool::new(false)),
        },
    )
}

impl LocalLog {
    /// Appends an order and waits until it is durable in SQL.
    pub async fn append(&self, order: NewOrder) -> Result<(), LogError> {
        let (done_tx, done_rx) = oneshot::channel();
        self.tx
            .send((order, done_tx))
            .map_err(|_| LogError::Closed)?;
        match done_rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(LogError::WriteFailed(reason)),
            Err(_) => Err(LogError::Closed),
        }
    }
}

fn answer(receipt: Receipt, result: Result<(), String>) {
    if let Receipt::Local(Some(tx)) = receipt {
        // The request may have gone away (client disconnected): the order stays written.
        let _ = tx.send(result);
    }
}

#[async_trait]
impl OrderLog for LocalLogReader {
    async fn next_batch(&self, max: usize) -> Result<Batch, LogError> {
        let mut rx = self.rx.lock().await;
        let mut batch = Batch::default();
        let first = tokio::time::timeout(std::time::Duration::from_millis(500), rx.recv()).await;
        let mut push = |(order, tx): Entry| {
            batch.deliveries.push(Delivery {
                order,
                receipt: Receipt::Local(Some(tx)),
            })
        };
        match first {
            Ok(Some(entry)) => push(entry),
            Ok(None) => {
                self.done.store(true, Ordering::Release);
                return Ok(batch);
            }
            Err(_) => return Ok(batch),
        }
        while batch_len(&batch) < max {
            match rx.try_recv() {
                Ok(entry) => batch.deliveries.push(Delivery {
                    order: entry.0,
                    receipt: Receipt::Local(Some(entry.1)),
                }),
                Err(_) => break,
            }
        }
        Ok(batch)
    }

    async fn reclaim(&self, _max: usize) -> Result<Batch, LogError> {
        // Nothing is ever left pending: an entry is answered in the same pass that read it.
        Ok(Batch::default())
    }

    async fn ack(&self, receipts: Vec<Receipt>) -> Result<(), LogError> {
        receipts.into_iter().for_each(|r| answer(r, Ok(())));
        Ok(())
    }

    async fn retry_later(&self, receipts: Vec<Receipt>, reason: &str) -> Result<(), LogError> {
        receipts
            .into_iter()
            .for_each(|r| answer(r, Err(reason.to_string())));
        Ok(())
    }

    async fn dead_letter(&self, receipt: Receipt, reason: &str) -> Result<(), LogError> {
        answer(receipt, Err(reason.to_string()));
        Ok(())
    }

    fn finished(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

fn batch_len(b: &Batch) -> usize {
    b.deliveries.len()
}
