//! KV events over ZMQ, as vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`,
//! vLLM 0.33.0) publishes them, with the pure-Rust `zeromq` crate.
//!
//! - `--kv-events-config JSON` takes vLLM's `KVEventsConfig` fields
//!   (`vllm/config/kv_events.py`): `enable_kv_cache_events`, `publisher` (`"zmq"`, or
//!   `"null"`: off; default `"zmq"` when enabled), `endpoint` (default `tcp://*:5557`),
//!   `replay_endpoint`, `buffer_steps` (default 10000), `hwm`, `max_queue_size`, `topic`.
//!   Unknown fields are an error, as vLLM's config class rejects them.
//! - The PUB socket binds when the endpoint has `*` or `::` (vLLM's rule), else connects.
//!   `tcp://*:0` binds a free port on the worker's `--host` (vLLM binds the node's IP); `*`
//!   with a port binds every interface. The replay ROUTER socket always binds.
//! - Every message is `[topic, seq as 8 bytes big-endian, payload]`, seq from 0, payload
//!   `mmrouter::kv_events::encode_batch(.., Tagged, Int)`: what vLLM 0.33 writes by default.
//! - One batch per cache change (vLLM: one per engine step): the blocks a prefill or a finished
//!   request caches (one `BlockStored` per contiguous run), the cached blocks an admission
//!   evicts (one `BlockRemoved` per block, as vLLM), a prefix-cache reset (`AllBlocksCleared`).
//!   The batch carries `data_parallel_rank: 0`, as vLLM's publisher fills in.
//! - Replay: a ROUTER request `[identity, "", start_seq]` (from a REQ, or a DEALER that sends
//!   the empty delimiter) gets every buffered batch with `seq >= start_seq` as
//!   `[identity, "", topic, seq, payload]`, then `[identity, "", "", -1, ""]`; requests of
//!   another shape are ignored with a warning, as vLLM does. The last `buffer_steps` batches
//!   are kept.
//! - Not emulated: `hwm` and `max_queue_size` are accepted and ignored (the `zeromq` PUB socket
//!   keeps at most 100,000 messages per subscriber and drops beyond; the engine hands batches
//!   to the publisher task without blocking), `ipc://` and `inproc://` endpoints, and the
//!   port offset by data-parallel rank (the mock is rank 0).

use crate::prefix_cache::{BlockHash, ExtraKey as PoolKey, HashedBlock, KvEventSink};
use bytes::Bytes;
use mmrouter::kv_events::{
    BlockStored, EventBatch, ExtraKey, HashEncoding, KvEvent, WireForm, encode_batch,
};
use serde::Deserialize;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The medium of every block of the mock (vLLM's `MEDIUM_GPU`).
const MEDIUM: &str = "GPU";

/// vLLM's `KVEventsConfig`, parsed from `--kv-events-config`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    pub publisher: Option<String>,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub buffer_steps: usize,
    pub hwm: u64,
    pub max_queue_size: u64,
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Parses vLLM's JSON form; an unknown publisher is an error (as vLLM's factory says).
    pub fn parse(json: &str) -> Result<KvEventsConfig, String> {
        let c: KvEventsConfig =
            serde_json::from_str(json).map_err(|e| format!("--kv-events-config: {e}"))?;
        match c.publisher.as_deref() {
            None | Some("zmq" | "null") => {}
            Some(p) => return Err(format!("--kv-events-config: Unknown event publisher '{p}'")),
        }
        for e in std::iter::once(&c.endpoint).chain(c.replay_endpoint.as_ref()) {
            if !e.starts_with("tcp://") {
                return Err(format!(
                    "--kv-events-config: endpoint `{e}`: the mock supports tcp:// endpoints only"
                ));
            }
        }
        Ok(c)
    }

    /// Whether events are published (vLLM: the publisher defaults to "zmq" when enabled).
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref().unwrap_or("zmq") == "zmq"
    }
}

/// vLLM's `_is_bind_endpoint` for tcp: a wildcard host binds, anything else connects.
fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::")
}

/// The address to bind for `endpoint`: `tcp://*:0` on `host` (vLLM: the node's IP), `*`
/// otherwise on every interface.
fn bind_address(endpoint: &str, host: &str) -> String {
    if endpoint == "tcp://*:0" {
        if host.contains(':') {
            format!("tcp://[{host}]:0")
        } else {
            format!("tcp://{host}:0")
        }
    } else {
        endpoint.replace('*', "0.0.0.0")
    }
}

/// The running publisher's endpoints and the sink the block pool reports to.
pub struct Publisher {
    pub sink: ZmqSink,
    /// The PUB endpoint as bound (or connected to).
    pub endpoint: String,
    pub connects: bool,
    pub replay_endpoint: Option<String>,
}

/// Binds (or connects) the sockets and starts the publishing and replay tasks.
pub async fn start(cfg: &KvEventsConfig, host: &str, name: &str) -> Result<Publisher, String> {
    let mut pub_socket = zeromq::PubSocket::new();
    let connects = !is_bind_endpoint(&cfg.endpoint);
    let endpoint = if connects {
        cfg.endpoint.clone()
    } else {
        let addr = bind_address(&cfg.endpoint, host);
        pub_socket
            .bind(&addr)
            .await
            .map_err(|e| format!("kv events: cannot bind {addr}: {e}"))?
            .to_string()
    };
    let buffer = Arc::new(Mutex::new(VecDeque::new()));
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let replay_endpoint = match &cfg.replay_endpoint {
        Some(e) => {
            let addr = bind_address(e, host);
            let mut router = zeromq::RouterSocket::new();
            let bound = router
                .bind(&addr)
                .await
                .map_err(|e| format!("kv events: cannot bind the replay socket {addr}: {e}"))?;
            tokio::spawn(replay_loop(
                router,
                topic.clone(),
                buffer.clone(),
                name.to_string(),
            ));
            Some(bound.to_string())
        }
        None => None,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let target = connects.then(|| cfg.endpoint.clone());
    tokio::spawn(publish_loop(
        rx,
        pub_socket,
        target,
        topic,
        buffer,
        cfg.buffer_steps,
        name.to_string(),
    ));
    Ok(Publisher {
        sink: ZmqSink { tx },
        endpoint,
        connects,
        replay_endpoint,
    })
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

fn lock(buffer: &Buffer) -> std::sync::MutexGuard<'_, VecDeque<(u64, Bytes)>> {
    buffer.lock().unwrap_or_else(|e| e.into_inner())
}

/// Numbers, encodes and sends each batch in order, and keeps the last `steps` for replay.
async fn publish_loop(
    mut rx: mpsc::UnboundedReceiver<EventBatch>,
    mut socket: zeromq::PubSocket,
    connect_to: Option<String>,
    topic: Bytes,
    buffer: Buffer,
    steps: usize,
    name: String,
) {
    if let Some(target) = connect_to
        && let Err(e) = socket.connect(&target).await
    {
        eprintln!("[{name}] kv events: cannot connect to {target}: {e}; not publishing");
        return;
    }
    let mut seq: u64 = 0;
    while let Some(batch) = rx.recv().await {
        let payload = Bytes::from(encode_batch(&batch, WireForm::Tagged, HashEncoding::Int));
        let mut msg = ZmqMessage::from(topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload.clone());
        if let Err(e) = socket.send(msg).await {
            eprintln!("[{name}] kv events: publishing seq {seq} failed: {e}");
        }
        if steps > 0 {
            let mut b = lock(&buffer);
            if b.len() >= steps {
                b.pop_front();
            }
            b.push_back((seq, payload));
        }
        seq += 1;
    }
}

/// vLLM's `_service_replay`: `[identity, _, start_seq]` → the buffered batches from
/// `start_seq` on, then the end marker.
async fn replay_loop(mut router: zeromq::RouterSocket, topic: Bytes, buffer: Buffer, name: String) {
    const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();
    loop {
        let frames = match router.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                eprintln!("[{name}] kv events: replay socket closed: {e}");
                return;
            }
        };
        let [identity, _, start] = frames.as_slice() else {
            eprintln!(
                "[{name}] kv events: invalid replay request of {} frames (want [identity, \"\", start_seq])",
                frames.len()
            );
            continue;
        };
        // int.from_bytes(start, "big"): a number past u64 is past every seq.
        let start = start.iter().try_fold(0u64, |acc, &b| {
            acc.checked_mul(256).map(|v| v | u64::from(b))
        });
        let batches: Vec<(u64, Bytes)> = match start {
            Some(start) => lock(&buffer)
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        let reply = |frames: [Bytes; 3]| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(Bytes::new());
            for f in frames {
                m.push_back(f);
            }
            m
        };
        for (seq, payload) in batches {
            let m = reply([
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ]);
            if let Err(e) = router.send(m).await {
                eprintln!("[{name}] kv events: replay send failed: {e}");
                break;
            }
        }
        let end = reply([Bytes::new(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()]);
        if let Err(e) = router.send(end).await {
            eprintln!("[{name}] kv events: replay send failed: {e}");
        }
    }
}

/// The block pool's [`KvEventSink`]: turns cache changes into batches for the publisher task
/// (without blocking: the pool calls it under the engine lock).
pub struct ZmqSink {
    tx: mpsc::UnboundedSender<EventBatch>,
}

impl ZmqSink {
    fn send(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        // Fails only once the publisher task is gone (shutdown): nothing left to tell.
        let _ = self.tx.send(EventBatch {
            ts,
            events,
            data_parallel_rank: Some(0),
        });
    }
}

/// The `BlockStored` events for `blocks`: one per run of blocks that chain (each one's parent
/// is the previous one), so that a consumer can rebuild the chain from `parent_block_hash`.
pub fn stored_events(blocks: &[&HashedBlock], block_size: usize) -> Vec<KvEvent> {
    let mut runs: Vec<Vec<&HashedBlock>> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some(run) if run.last().map(|p| Some(p.hash)) == Some(b.parent) => run.push(b),
            _ => runs.push(vec![b]),
        }
    }
    runs.into_iter()
        .map(|run| {
            let parent = run.first().and_then(|b| b.parent);
            KvEvent::BlockStored(BlockStored {
                block_hashes: run.iter().map(|b| b.hash.event_id()).collect(),
                parent_block_hash: parent.map(BlockHash::event_id),
                token_ids: run.iter().flat_map(|b| b.tokens.iter().copied()).collect(),
                block_size: u32::try_from(block_size).unwrap_or(u32::MAX),
                lora_name: None,
                medium: Some(MEDIUM.into()),
                extra_keys: run
                    .iter()
                    .map(|b| {
                        b.extra_keys
                            .iter()
                            .map(|k| match k {
                                PoolKey::Mm { identifier, offset } => ExtraKey::Mm {
                                    identifier: identifier.clone(),
                                    offset: *offset,
                                },
                                PoolKey::CacheSalt(s) => ExtraKey::Text(s.clone()),
                            })
                            .collect()
                    })
                    .collect(),
                group_idx: Some(0),
                kv_cache_spec_kind: None,
            })
        })
        .collect()
}

impl KvEventSink for ZmqSink {
    fn blocks_stored(&mut self, blocks: &[&HashedBlock], block_size: usize) {
        self.send(stored_events(blocks, block_size));
    }

    fn blocks_removed(&mut self, hashes: &[BlockHash]) {
        self.send(
            hashes
                .iter()
                .map(|h| KvEvent::BlockRemoved {
                    block_hashes: vec![h.event_id()],
                    medium: Some(MEDIUM.into()),
                    group_idx: Some(0),
                })
                .collect(),
        );
    }

    fn all_blocks_cleared(&mut self) {
        self.send(vec![KvEvent::AllBlocksCleared { medium: None }]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix_cache::{MmRange, hash_request_blocks};

    #[test]
    fn config_takes_vllms_fields_and_defaults() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","topic":"kv"}"#,
        )
        .unwrap();
        assert!(c.publishes());
        assert_eq!(c.buffer_steps, 10_000);
        assert_eq!(c.replay_endpoint, None);
        assert!(!KvEventsConfig::parse("{}").unwrap().publishes());
        assert!(
            !KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"null"}"#)
                .unwrap()
                .publishes()
        );
        let e = KvEventsConfig::parse(r#"{"publisher":"kafka"}"#).unwrap_err();
        assert!(e.contains("Unknown event publisher 'kafka'"), "{e}");
        assert!(KvEventsConfig::parse(r#"{"endpoit":"x"}"#).is_err());
        assert!(KvEventsConfig::parse(r#"{"endpoint":"ipc:///tmp/x"}"#).is_err());
    }

    #[test]
    fn wildcard_endpoints_bind_and_port_zero_binds_the_worker_host() {
        assert!(is_bind_endpoint("tcp://*:5557"));
        assert!(is_bind_endpoint("tcp://[::]:5557"));
        assert!(!is_bind_endpoint("tcp://10.0.0.1:5557"));
        assert_eq!(bind_address("tcp://*:0", "127.0.0.1"), "tcp://127.0.0.1:0");
        assert_eq!(bind_address("tcp://*:0", "::1"), "tcp://[::1]:0");
        assert_eq!(
            bind_address("tcp://*:5557", "127.0.0.1"),
            "tcp://0.0.0.0:5557"
        );
    }

    #[test]
    fn stored_blocks_that_do_not_chain_become_separate_events() {
        let toks: Vec<u32> = (0..64).collect();
        let mm = [MmRange {
            identifier: "img".into(),
            offset: 4,
            length: 20,
        }];
        let blocks = hash_request_blocks(&toks, &mm, Some("salt"), 16);
        // Blocks 0, 1 and 3 (2 was cached elsewhere): two runs.
        let picked = [&blocks[0], &blocks[1], &blocks[3]];
        let events = stored_events(&picked, 16);
        assert_eq!(events.len(), 2);
        let KvEvent::BlockStored(first) = &events[0] else {
            panic!()
        };
        assert_eq!(
            first.block_hashes,
            vec![blocks[0].hash.event_id(), blocks[1].hash.event_id()]
        );
        assert_eq!(first.parent_block_hash, None);
        assert_eq!(first.token_ids, (0..32).collect::<Vec<u32>>());
        assert_eq!(
            first.extra_keys,
            vec![
                vec![
                    ExtraKey::Mm {
                        identifier: "img".into(),
                        offset: 4
                    },
                    ExtraKey::Text("salt".into())
                ],
                vec![ExtraKey::Mm {
                    identifier: "img".into(),
                    offset: -12
                }],
            ]
        );
        let KvEvent::BlockStored(second) = &events[1] else {
            panic!()
        };
        assert_eq!(second.parent_block_hash, Some(blocks[2].hash.event_id()));
        assert_eq!(second.extra_keys, vec![Vec::<ExtraKey>::new()]);
    }
}
