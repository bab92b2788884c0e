//! One worker's vLLM KV-event stream: a ZMQ SUB to its publisher, sequence tracking, replay
//! of gaps from its replay ROUTER, and the events applied to its residency.
//!
//! Sequence numbers (8 bytes big-endian, from 0 per publisher start) are checked on every
//! message. Relative to the last applied number `last` (none yet: the stream's start, 0):
//! - `last + 1`: applied.
//! - above it: a gap (counted). With a replay endpoint, the missing numbers are asked for
//!   and applied in order; what the publisher no longer holds is counted as lost.
//! - at or below it: a duplicate of a batch just replayed (skipped), or else the publisher
//!   restarted (its counter went back): the residency is cleared and the batch applied.
//!
//! On every (re)connection with a replay endpoint the sidecar asks for everything after
//! `last` at once, so a sidecar started after its worker, or one whose subscription dropped,
//! catches up without waiting for the next live batch.
//!
//! A SUB socket does not learn that a silent peer vanished (no ZMTP heartbeats here): a
//! worker whose host disappears without closing the connection stays "connected" until the
//! OS gives up on the TCP connection; its scrapes fail meanwhile and it turns unhealthy.

use crate::log;
use crate::registry::{Registry, WorkerState};
use crate::residency::{Changes, ImageChanges};
use bytes::Bytes;
use mmrouter::kv_events::{
    EventBatch, ExtraKey, KvEvent, KvEventLimits, KvMessage, decode_message, is_replay_end,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Time allowed to connect a socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Reconnection backoff: doubles from the first to the last after each failed attempt.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A replay that sends nothing for this long is abandoned.
const REPLAY_IDLE: Duration = Duration::from_secs(2);
/// How often the socket monitor is checked for a disconnection.
const MONITOR_POLL: Duration = Duration::from_millis(100);

/// The router's key of a multimodal identifier (spec A: `MediaId::of_uuid(s).key64()`).
pub fn image_key(identifier: &str) -> u64 {
    xxh3_64(identifier.as_bytes())
}

/// The image keys of each block of a `BlockStored`.
fn block_images(extra_keys: &[Vec<ExtraKey>]) -> Vec<Vec<u64>> {
    extra_keys
        .iter()
        .map(|keys| {
            keys.iter()
                .filter_map(|k| match k {
                    ExtraKey::Mm { identifier, .. } => Some(image_key(identifier)),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// Applies one batch to a worker; returns the image changes.
pub fn apply_batch(w: &mut WorkerState, batch: &EventBatch) -> ImageChanges {
    let mut changes = Changes::default();
    for event in &batch.events {
        match event {
            KvEvent::BlockStored(s) => {
                w.events.stored_total += s.block_hashes.len() as u64;
                w.residency
                    .store(&s.block_hashes, &block_images(&s.extra_keys), &mut changes);
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                w.events.removed_total += block_hashes.len() as u64;
                w.residency.remove(block_hashes, &mut changes);
            }
            KvEvent::AllBlocksCleared { .. } => {
                w.events.cleared_total = w.events.cleared_total.saturating_add(1);
                w.events.cleared_since_scrape = true;
                w.residency.clear(&mut changes);
            }
            KvEvent::Unknown { .. } => w.events.unknown_events += 1,
        }
    }
    w.events.batches += 1;
    w.events.last_event = Some(Instant::now());
    changes.finish(&w.residency)
}

/// What to do with a live message, given the last applied sequence number and the lowest
/// number a replay on this connection asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seq {
    Next,
    /// Numbers `from..seq` are missing.
    Gap {
        from: u64,
    },
    /// Already applied through a replay.
    Duplicate,
    /// The publisher's counter went back: it restarted.
    Restart,
}

pub fn classify(last: Option<u64>, replay_floor: Option<u64>, seq: u64) -> Seq {
    let expected = last.map_or(0, |l| l.saturating_add(1));
    if seq == expected {
        Seq::Next
    } else if seq > expected {
        Seq::Gap { from: expected }
    } else if replay_floor.is_some_and(|f| seq >= f) {
        Seq::Duplicate
    } else {
        Seq::Restart
    }
}

struct Stream {
    name: Arc<str>,
    registry: Arc<Mutex<Registry>>,
    replay: Option<String>,
    limits: KvEventLimits,
    /// The lowest number a replay on this connection asked for.
    replay_floor: Option<u64>,
}

impl Stream {
    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn last_seq(&self) -> Option<u64> {
        self.lock().get(&self.name).and_then(|w| w.events.seq)
    }

    /// Applies a message and records its sequence number.
    fn apply(&self, m: &KvMessage) {
        self.lock().update(&self.name, |w| {
            w.events.seq = Some(m.seq);
            ((), apply_batch(w, &m.batch))
        });
    }

    fn decode(&mut self, frames: &[Bytes]) -> Option<KvMessage> {
        let refs: Vec<&[u8]> = frames.iter().map(|b| b.as_ref()).collect();
        match decode_message(&refs, &self.limits) {
            Ok(m) => Some(m),
            Err(e) => {
                let n = self
                    .lock()
                    .update(&self.name, |w| {
                        w.events.decode_errors += 1;
                        (w.events.decode_errors, Vec::new())
                    })
                    .unwrap_or(0);
                // The first ten, then one in a thousand.
                if n <= 10 || n.is_multiple_of(1000) {
                    log!("worker {}: events: message {n} not decoded: {e}", self.name);
                }
                None
            }
        }
    }

    /// A live message.
    async fn on_message(&mut self, frames: Vec<Bytes>) {
        let Some(m) = self.decode(&frames) else {
            return;
        };
        let last = self.last_seq();
        match classify(last, self.replay_floor, m.seq) {
            Seq::Next => self.apply(&m),
            Seq::Duplicate => {}
            Seq::Restart => {
                log!(
                    "worker {}: events: sequence went back from {} to {}: the publisher \
                     restarted; residency cleared",
                    self.name,
                    last.unwrap_or(0),
                    m.seq
                );
                self.lock().update(&self.name, |w| {
                    w.events.publisher_restarts += 1;
                    // The filter learns of a clear through cleared_total: its allocation clock
                    // for the worker jumps, so its own decision records go stale too.
                    w.events.cleared_total = w.events.cleared_total.saturating_add(1);
                    w.events.cleared_since_scrape = true;
                    w.events.seq = None;
                    let mut c = Changes::default();
                    w.residency.clear(&mut c);
                    ((), c.finish(&w.residency))
                });
                self.replay_floor = None;
                if m.seq == 0 {
                    self.apply(&m);
                } else {
                    self.gap(0, m).await;
                }
            }
            Seq::Gap { from } => self.gap(from, m).await,
        }
    }

    /// Numbers `from..m.seq` are missing: count, replay what can be, apply `m`.
    async fn gap(&mut self, from: u64, m: KvMessage) {
        let missing = m.seq - from;
        self.lock().update(&self.name, |w| {
            w.events.gaps = w.events.gaps.saturating_add(1);
            ((), Vec::new())
        });
        let recovered = if self.replay.is_some() {
            self.replay_from(from, Some(m.seq)).await
        } else {
            0
        };
        let lost = missing.saturating_sub(recovered);
        self.lock().update(&self.name, |w| {
            w.events.lost += lost;
            ((), Vec::new())
        });
        log!(
            "worker {}: events: gap of {missing} batches ({from}..{}): {}",
            self.name,
            m.seq,
            match &self.replay {
                Some(_) => format!("{recovered} replayed, {lost} lost"),
                None => "no replay endpoint, lost".to_string(),
            }
        );
        // A replay may have reached past `m` (it ran while `m` waited).
        if self.last_seq().is_none_or(|l| l < m.seq) {
            self.apply(&m);
        }
    }

    /// Asks the replay endpoint for every batch from `from` (below `until` when given) and
    /// applies those that follow the last applied one. Returns how many were applied.
    async fn replay_from(&mut self, from: u64, until: Option<u64>) -> u64 {
        let Some(endpoint) = self.replay.clone() else {
            return 0;
        };
        self.replay_floor = Some(self.replay_floor.map_or(from, |f| f.min(from)));
        let mut dealer = DealerSocket::new();
        match tokio::time::timeout(CONNECT_TIMEOUT, dealer.connect(&endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                log!(
                    "worker {}: replay: cannot connect to {endpoint}: {e}",
                    self.name
                );
                return 0;
            }
            Err(_) => {
                log!(
                    "worker {}: replay: connecting to {endpoint} timed out",
                    self.name
                );
                return 0;
            }
        }
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        if let Err(e) = dealer.send(request).await {
            log!("worker {}: replay: request failed: {e}", self.name);
            return 0;
        }
        let mut applied = 0u64;
        loop {
            let msg = match tokio::time::timeout(REPLAY_IDLE, dealer.recv()).await {
                Ok(Ok(msg)) => msg,
                Ok(Err(e)) => {
                    log!("worker {}: replay: receive failed: {e}", self.name);
                    break;
                }
                Err(_) => {
                    log!(
                        "worker {}: replay: no answer for {} s, abandoned",
                        self.name,
                        REPLAY_IDLE.as_secs()
                    );
                    break;
                }
            };
            let frames = msg.into_vec();
            let refs: Vec<&[u8]> = frames.iter().map(|b| b.as_ref()).collect();
            if is_replay_end(&refs) {
                break;
            }
            let Some(m) = self.decode(&frames) else {
                continue;
            };
            if until.is_some_and(|u| m.seq >= u) {
                continue;
            }
            let expected = self.last_seq().map_or(0, |l| l.saturating_add(1));
            if m.seq < expected {
                continue;
            }
            if m.seq > expected {
                // The publisher's buffer no longer holds `expected..m.seq`.
                let lost = m.seq - expected;
                self.lock().update(&self.name, |w| {
                    w.events.lost += lost;
                    ((), Vec::new())
                });
            }
            self.apply(&m);
            applied += 1;
        }
        if applied > 0 {
            self.lock().update(&self.name, |w| {
                w.events.replayed += applied;
                ((), Vec::new())
            });
        }
        applied
    }
}

/// Subscribes to a worker's events until the task is aborted (the worker left).
pub async fn run(
    name: Arc<str>,
    endpoint: String,
    replay: Option<String>,
    topic: String,
    registry: Arc<Mutex<Registry>>,
) {
    let mut stream = Stream {
        name: name.clone(),
        registry,
        replay,
        limits: KvEventLimits::default(),
        replay_floor: None,
    };
    let mut backoff = BACKOFF_MIN;
    let mut connections = 0u64;
    let mut failing = false;
    loop {
        let mut sub = SubSocket::new();
        let mut monitor = sub.monitor();
        let connect = async {
            sub.connect(&endpoint).await?;
            sub.subscribe(&topic).await
        };
        let result = tokio::time::timeout(CONNECT_TIMEOUT, connect).await;
        let error = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("timed out".to_string()),
        };
        if let Some(e) = error {
            if !failing {
                log!(
                    "worker {name}: events: cannot connect to {endpoint}: {e}; retrying (backoff up to {} s)",
                    BACKOFF_MAX.as_secs()
                );
                failing = true;
            }
            drop(sub);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            continue;
        }
        failing = false;
        backoff = BACKOFF_MIN;
        connections += 1;
        stream.replay_floor = None;
        stream.lock().update(&name, |w| {
            w.events.connected = true;
            if connections > 1 {
                w.events.reconnects += 1;
            }
            ((), Vec::new())
        });
        log!(
            "worker {name}: events {} {endpoint}",
            if connections > 1 {
                "reconnected to"
            } else {
                "connected to"
            }
        );
        if stream.replay.is_some() {
            let from = stream.last_seq().map_or(0, |l| l.saturating_add(1));
            let n = stream.replay_from(from, None).await;
            if n > 0 {
                log!("worker {name}: events: caught up {n} batches from {from} through replay");
            }
        }
        let mut poll = tokio::time::interval(MONITOR_POLL);
        let reason = loop {
            tokio::select! {
                msg = sub.recv() => match msg {
                    Ok(msg) => stream.on_message(msg.into_vec()).await,
                    Err(e) => break format!("receive failed: {e}"),
                },
                _ = poll.tick() => {
                    let mut gone = false;
                    while let Ok(ev) = monitor.try_recv() {
                        if matches!(ev, SocketEvent::Disconnected(_)) {
                            gone = true;
                        }
                    }
                    if gone {
                        break "the publisher closed the connection".to_string();
                    }
                }
            }
        };
        stream.lock().update(&name, |w| {
            w.events.connected = false;
            ((), Vec::new())
        });
        log!("worker {name}: events disconnected from {endpoint} ({reason}); reconnecting");
        drop(sub);
        tokio::time::sleep(backoff).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_classify() {
        assert_eq!(classify(None, None, 0), Seq::Next);
        assert_eq!(classify(None, None, 5), Seq::Gap { from: 0 });
        assert_eq!(classify(Some(4), None, 5), Seq::Next);
        assert_eq!(classify(Some(4), None, 9), Seq::Gap { from: 5 });
        assert_eq!(classify(Some(9), Some(5), 7), Seq::Duplicate);
        assert_eq!(classify(Some(9), Some(5), 9), Seq::Duplicate);
        assert_eq!(classify(Some(9), Some(5), 2), Seq::Restart);
        assert_eq!(classify(Some(9), None, 0), Seq::Restart);
    }

    #[test]
    fn image_keys_are_the_routers_media_keys() {
        let uuid = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            image_key(uuid),
            mmrouter::identity::MediaId::of_uuid(uuid).key64()
        );
    }
}
