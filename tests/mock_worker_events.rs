//! The mock worker's KV events (`--kv-events-config`), received as a consumer would: a
//! `zeromq` SUB on the PUB endpoint and a DEALER on the replay endpoint, every message decoded
//! with `mmrouter::kv_events`. Each test starts the real binary on free ports (`--port 0`,
//! `tcp://*:0`) and reads the endpoints from its stderr.

use mmrouter::kv_events::{
    BlockStored, ExtraKey, KvEvent, KvEventLimits, KvMessage, decode_message, is_replay_end,
};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const MODEL: &str = "Qwen/Qwen2.5-VL-7B-Instruct";
const IMAGE_PAD: u32 = 151655;
const WAIT: Duration = Duration::from_secs(10);

struct Worker {
    child: Child,
    port: u16,
    events: String,
    replay: Option<String>,
}

impl Worker {
    /// Starts the worker with `--port 0 --time-scale 0`, KV events on `tcp://*:0` (replay
    /// too, keeping `buffer_steps` batches) and `args`.
    fn start(buffer_steps: usize, args: &[&str]) -> Worker {
        let config = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0",
            "buffer_steps": buffer_steps,
            "topic": "kv@mock",
        });
        let mut child = Command::new(env!("CARGO_BIN_EXE_mock-worker"))
            .args(["--port", "0", "--time-scale", "0"])
            .args(["--kv-events-config", &config.to_string()])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn mock-worker");
        let stderr = child.stderr.take().unwrap();
        // Owned by the Worker from here on, so that its Drop stops it on every path.
        let mut w = Worker {
            child,
            port: 0,
            events: String::new(),
            replay: None,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("the worker did not report its addresses");
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |w: &str| {
                words
                    .iter()
                    .position(|x| *x == w)
                    .and_then(|i| words.get(i + 1))
                    .map(|s| s.to_string())
            };
            if line.contains(" kv-events on ") {
                w.events = after("on").unwrap();
                w.replay = after("replay");
            }
            if let Some(rest) = line.split(" listening on ").nth(1) {
                let addr = rest.split_whitespace().next().unwrap();
                w.port = addr.rsplit(':').next().unwrap().parse().unwrap();
                assert!(
                    !w.events.is_empty(),
                    "no `kv-events on` line before `listening on`"
                );
                return w;
            }
        }
    }

    async fn request(&self, method: &str, path: &str, body: &Value) -> (u16, Value) {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .unwrap();
        let body = body.to_string();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.unwrap();
        let text = String::from_utf8(raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    async fn chat(&self, body: &Value) -> Value {
        let (status, v) = self.request("POST", "/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{v}");
        v
    }

    async fn reset(&self) -> bool {
        let (status, v) = self
            .request("POST", "/reset_prefix_cache", &json!({}))
            .await;
        assert_eq!(status, 200);
        v["success"].as_bool().unwrap()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn decode(m: ZmqMessage) -> KvMessage {
    let frames = m.into_vec();
    let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
    decode_message(&refs, &KvEventLimits::default()).expect("a decodable KV-event message")
}

/// A SUB on the worker's events whose subscription is live: it resets the (empty) prefix
/// cache until an `AllBlocksCleared` comes through, which covers PUB/SUB's slow joiner.
async fn subscribe(w: &Worker) -> (zeromq::SubSocket, Vec<KvMessage>) {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&w.events).await.unwrap();
    sub.subscribe("kv@").await.unwrap();
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < WAIT, "no event reached the subscriber");
        assert!(w.reset().await);
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
            let m = decode(m.unwrap());
            assert_eq!(m.topic, b"kv@mock");
            return (sub, vec![m]);
        }
    }
}

/// Receives until `done` holds for everything received so far (or fails after `WAIT`).
async fn until(
    sub: &mut zeromq::SubSocket,
    got: &mut Vec<KvMessage>,
    done: impl Fn(&[KvMessage]) -> bool,
) {
    let start = Instant::now();
    while !done(got) {
        let left = WAIT.saturating_sub(start.elapsed());
        let m = tokio::time::timeout(left, sub.recv())
            .await
            .expect("timed out waiting for KV events")
            .unwrap();
        got.push(decode(m));
    }
}

fn stored(got: &[KvMessage]) -> Vec<&BlockStored> {
    got.iter()
        .flat_map(|m| &m.batch.events)
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

fn removed(got: &[KvMessage]) -> Vec<u64> {
    got.iter()
        .flat_map(|m| &m.batch.events)
        .filter_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn cleared(got: &[KvMessage]) -> usize {
    got.iter()
        .flat_map(|m| &m.batch.events)
        .filter(|e| matches!(e, KvEvent::AllBlocksCleared { .. }))
        .count()
}

// ---- requests -------------------------------------------------------------------------------

/// A PNG data URL whose header says `side`x`side` (the mock reads only the header).
fn png_url(side: u32, seed: u8) -> String {
    let png = test_images::Png::new(side, side).idat(&[seed; 64]).bytes();
    test_images::data_url("image/png", &png)
}

fn chat(text: &str, images: &[(&str, Option<&str>)], max_tokens: u32) -> Value {
    let mut content = vec![json!({"type": "text", "text": text})];
    for (url, uuid) in images {
        let mut p = json!({"type": "image_url", "image_url": {"url": url}});
        if let Some(u) = uuid {
            p["uuid"] = json!(u);
        }
        content.push(p);
    }
    json!({"model": MODEL, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": content}]})
}

/// The blocks of `events` in order, checking that they chain: each event's parent is the
/// last block of the one before.
fn chained_blocks(events: &[&BlockStored]) -> (Vec<u64>, Vec<u32>, Vec<Vec<ExtraKey>>) {
    let (mut hashes, mut tokens, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    for e in events {
        assert_eq!(e.parent_block_hash, hashes.last().copied(), "{e:?}");
        assert_eq!(e.block_size, 16);
        assert_eq!(e.token_ids.len(), 16 * e.block_hashes.len());
        assert_eq!(e.extra_keys.len(), e.block_hashes.len());
        assert_eq!(e.medium.as_deref(), Some("GPU"));
        assert_eq!(e.group_idx, Some(0));
        hashes.extend(&e.block_hashes);
        tokens.extend(&e.token_ids);
        keys.extend(e.extra_keys.iter().cloned());
    }
    (hashes, tokens, keys)
}

/// Every run of image placeholders in `tokens`: (start, length).
fn placeholder_runs(tokens: &[u32]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] == IMAGE_PAD {
            let start = i;
            while i < tokens.len() && tokens[i] == IMAGE_PAD {
                i += 1;
            }
            runs.push((start, i - start));
        } else {
            i += 1;
        }
    }
    runs
}

/// Asks the replay socket for everything from `start` (as a DEALER: empty delimiter, then
/// the 8-byte big-endian start) and collects the answers up to the end marker.
async fn replay(dealer: &mut zeromq::DealerSocket, start: u64) -> Vec<KvMessage> {
    let mut req = ZmqMessage::from(Vec::<u8>::new());
    req.push_back(start.to_be_bytes().to_vec().into());
    dealer.send(req).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(WAIT, dealer.recv())
            .await
            .expect("replay timed out")
            .unwrap();
        let frames = m.into_vec();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        if is_replay_end(&refs) {
            assert_eq!(refs[0], b"", "a DEALER sees the empty delimiter first");
            return out;
        }
        out.push(decode_message(&refs, &KvEventLimits::default()).unwrap());
    }
}

// ---- tests ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_stored_carries_each_blocks_image_keys_at_vllms_offsets_and_the_salt_first() {
    let w = Worker::start(100, &[]);
    let (mut sub, mut got) = subscribe(&w).await;
    let before = got.len();
    let uuid = "client-chosen-image-id";
    let (a, b) = (png_url(448, 1), png_url(448, 2));
    let mut body = chat("compare these", &[(&a, Some(uuid)), (&b, None)], 1);
    body["cache_salt"] = json!("tenant-a");
    let resp = w.chat(&body).await;
    let prompt_tokens = resp["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    until(&mut sub, &mut got, |g| {
        stored(&g[before..])
            .iter()
            .map(|s| s.block_hashes.len())
            .sum::<usize>()
            >= prompt_tokens / 16
    })
    .await;
    let (hashes, tokens, keys) = chained_blocks(&stored(&got[before..]));
    assert_eq!(hashes.len(), prompt_tokens / 16);
    // Two images of 448x448 = 256 placeholders each, as Qwen2.5-VL.
    let runs = placeholder_runs(&tokens);
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!((runs[0].1, runs[1].1), (256, 256));
    // The second image had no uuid: its identifier is the content hash (32 hex chars).
    let ids: Vec<String> = keys
        .iter()
        .flatten()
        .filter_map(|k| match k {
            ExtraKey::Mm { identifier, .. } => Some(identifier.clone()),
            _ => None,
        })
        .collect();
    let other = ids
        .iter()
        .find(|i| *i != uuid)
        .expect("the second image's key");
    assert!(
        other.len() == 32 && other.bytes().all(|c| c.is_ascii_hexdigit()),
        "{other}"
    );
    // Block i carries (identifier, start - 16 i) for every image overlapping it, in prompt
    // order, and the cache salt on block 0 only, after the image keys.
    for (i, block_keys) in keys.iter().enumerate() {
        let (lo, hi) = (16 * i, 16 * i + 16);
        let mut want: Vec<ExtraKey> = runs
            .iter()
            .zip([uuid, other.as_str()])
            .filter(|((s, l), _)| *s < hi && s + l > lo)
            .map(|((s, _), id)| ExtraKey::Mm {
                identifier: id.to_string(),
                offset: *s as i64 - lo as i64,
            })
            .collect();
        if i == 0 {
            want.push(ExtraKey::Text("tenant-a".into()));
        }
        assert_eq!(block_keys, &want, "block {i}");
    }
    let offsets: Vec<i64> = keys
        .iter()
        .flatten()
        .filter_map(|k| match k {
            ExtraKey::Mm { identifier, offset } if identifier == uuid => Some(*offset),
            _ => None,
        })
        .collect();
    assert!(offsets.len() >= 16, "{offsets:?}");
    for pair in offsets.windows(2) {
        assert_eq!(pair[1], pair[0] - 16, "{offsets:?}");
    }

    // A follow-up turn shares the first prompt's prefix: it hits those blocks and stores
    // only its new ones, the first chained to a block of the shared prefix.
    let before = got.len();
    let mut body2 = chat("compare these", &[(&a, Some(uuid)), (&b, None)], 1);
    body2["cache_salt"] = json!("tenant-a");
    body2["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "and now a follow-up question with more words"}));
    let resp = w.chat(&body2).await;
    let hit = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(hit >= 16 * 16, "cached {hit}: the images' blocks at least");
    until(&mut sub, &mut got, |g| !stored(&g[before..]).is_empty()).await;
    let tail = stored(&got[before..]);
    let parent = tail[0]
        .parent_block_hash
        .expect("the tail chains to the prefix");
    assert!(
        hashes.contains(&parent),
        "parent {parent} is one of the first request's blocks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_in_a_small_pool_publishes_block_removed_for_stored_blocks() {
    // 8 blocks: each request below needs 5 (4 prompt blocks + decode), so the second evicts
    // the first one's cached blocks.
    let w = Worker::start(100, &["--num-gpu-blocks", "8"]);
    let (mut sub, mut got) = subscribe(&w).await;
    let text_a = "alpha ".repeat(40);
    let text_b = "bravo ".repeat(40);
    w.chat(&chat(&text_a, &[], 4)).await;
    until(&mut sub, &mut got, |g| !stored(g).is_empty()).await;
    let first: Vec<u64> = stored(&got)
        .iter()
        .flat_map(|s| s.block_hashes.clone())
        .collect();
    assert!(removed(&got).is_empty());
    w.chat(&chat(&text_b, &[], 4)).await;
    until(&mut sub, &mut got, |g| !removed(g).is_empty()).await;
    let gone = removed(&got);
    assert!(
        gone.iter().all(|h| first.contains(h)),
        "removed {gone:?} must have been stored {first:?}"
    );
    // One BlockRemoved per block, as vLLM emits them.
    for m in &got {
        for e in &m.batch.events {
            if let KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } = e
            {
                assert_eq!(block_hashes.len(), 1);
                assert_eq!((medium.as_deref(), *group_idx), (Some("GPU"), Some(0)));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_publishes_all_blocks_cleared_and_forgets_the_prefix() {
    let w = Worker::start(100, &[]);
    let (mut sub, mut got) = subscribe(&w).await;
    let body = chat(&"words ".repeat(60), &[], 2);
    w.chat(&body).await;
    let again = w.chat(&body).await;
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    let n = cleared(&got);
    assert!(w.reset().await);
    until(&mut sub, &mut got, |g| cleared(g) == n + 1).await;
    let after = w.chat(&body).await;
    assert!(
        after["usage"]["prompt_tokens_details"].is_null(),
        "nothing is cached after the reset: {after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_numbers_have_no_gaps_and_replay_returns_the_buffer_then_minus_one() {
    let w = Worker::start(5, &["--num-gpu-blocks", "12"]);
    let (mut sub, mut got) = subscribe(&w).await;
    for i in 0..4 {
        w.chat(&chat(&format!("request {i} ").repeat(30), &[], 3))
            .await;
    }
    assert!(w.reset().await);
    let n = cleared(&got);
    // The reset's event is the last one published: everything before it has arrived then.
    until(&mut sub, &mut got, |g| cleared(g) > n).await;
    let seqs: Vec<u64> = got.iter().map(|m| m.seq).collect();
    let first = seqs[0];
    assert_eq!(seqs, (first..first + seqs.len() as u64).collect::<Vec<_>>());
    let last = *seqs.last().unwrap();
    assert!(last >= 5, "{seqs:?}");

    // Replay from 0 with a 5-batch buffer: the last 5 batches, byte-identical to the live
    // ones, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(w.replay.as_deref().unwrap()).await.unwrap();
    let all = replay(&mut dealer, 0).await;
    let replayed: Vec<u64> = all.iter().map(|m| m.seq).collect();
    assert_eq!(replayed, (last - 4..=last).collect::<Vec<_>>());
    for m in &all {
        let live = got.iter().find(|g| g.seq == m.seq).unwrap();
        assert_eq!(m.batch, live.batch);
        assert_eq!(m.topic, b"kv@mock");
    }
    let tail = replay(&mut dealer, last - 1).await;
    assert_eq!(
        tail.iter().map(|m| m.seq).collect::<Vec<_>>(),
        vec![last - 1, last]
    );
    assert!(replay(&mut dealer, last + 1).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_vllms_prefill_time_histogram() {
    let w = Worker::start(10, &[]);
    for i in 0..3 {
        w.chat(&chat(&format!("question {i}"), &[], 2)).await;
    }
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", w.port))
        .await
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).await.unwrap();
    let p = "vllm:request_prefill_time_seconds";
    assert!(raw.contains(&format!("# TYPE {p} histogram\n")));
    let line = |name: &str| {
        raw.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {raw}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(line(&format!("{p}_count{{")), 3.0);
    assert_eq!(line(&format!("{p}_bucket{{engine=\"0\",le=\"+Inf\"")), 3.0);
    assert_eq!(line(&format!("{p}_bucket{{engine=\"0\",le=\"0.3\"")), 3.0);
    let sum = line(&format!("{p}_sum{{"));
    assert!((0.0..0.9).contains(&sum), "time-scale 0: {sum}");
}
