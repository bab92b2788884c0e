//! End-to-end tests of the `mmrouter-sidecar` binary. Each test starts the real sidecar on a
//! free port (`--listen 127.0.0.1:0`, the bound address read from its stderr), real
//! `mock-worker`s (`--port 0 --time-scale 0`) or tiny servers of its own, and reads
//! `/v1/state` and `/v1/feed` over plain HTTP/1.1.
//!
//! KV events come from an in-test publisher built on the same ZMQ crate and the core's
//! `kv_events::encode_batch` (vLLM's wire format): a PUB socket sending
//! `[topic, seq, payload]` and a replay ROUTER answering as vLLM 0.33's `ZmqEventPublisher`.

use bytes::Bytes;
use mmrouter::feed::{self, Feed};
use mmrouter::kv_events::{
    BlockStored, EventBatch, ExtraKey, HashEncoding, KvEvent, WireForm, encode_batch,
};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
#[path = "support/process.rs"]
mod process;
use process::spawn_listening;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

struct Worker {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    fn start(args: &[&str]) -> Worker {
        let mut all = vec!["--port", "0", "--time-scale", "0"];
        all.extend_from_slice(args);
        let (child, port, log) = spawn_listening(env!("CARGO_BIN_EXE_mock-worker"), &all);
        Worker { child, port, log }
    }

    /// A mock publishing KV events on free ports, with a replay endpoint.
    fn start_publishing(args: &[&str]) -> Worker {
        let mut all = vec![
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}"#,
        ];
        all.extend_from_slice(args);
        Worker::start(&all)
    }

    /// `(events, replay)` endpoints from the `kv-events on E replay R` line.
    fn event_endpoints(&self) -> (String, String) {
        let log = self.log.lock().unwrap();
        let line = log
            .iter()
            .find_map(|l| l.split("kv-events on ").nth(1))
            .expect("the worker printed its kv-events endpoints");
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words.get(1), Some(&"replay"), "{line}");
        (words[0].to_string(), words[2].to_string())
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Vec<u8>) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let body = body.to_string();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, raw[split + 4..].to_vec())
    }

    /// One chat request with text and images `(data URL, uuid)`; asserts a 200.
    fn chat(&self, text: &str, images: &[(&str, &str)]) {
        let mut content = vec![serde_json::json!({"type": "text", "text": text})];
        for (url, uuid) in images {
            content.push(serde_json::json!({
                "type": "image_url", "image_url": {"url": url}, "uuid": uuid
            }));
        }
        let body = serde_json::json!({
            "model": "Qwen/Qwen2.5-VL-7B-Instruct", "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]
        });
        let (status, body) = self.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Sidecar {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Sidecar {
    /// Starts the sidecar with `--listen 127.0.0.1:0 --scrape-ms 50` and `args`.
    fn start(args: &[&str]) -> Sidecar {
        let mut all = vec!["--listen", "127.0.0.1:0", "--scrape-ms", "50"];
        all.extend_from_slice(args);
        let (child, port, log) = spawn_listening(env!("CARGO_BIN_EXE_mmrouter-sidecar"), &all);
        Sidecar { child, port, log }
    }

    fn state(&self) -> Value {
        let (status, _, body) = get(self.port, "/v1/state");
        assert_eq!(status, 200);
        serde_json::from_slice(&body).unwrap()
    }

    fn worker(&self, name: &str) -> Option<Value> {
        self.state()["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["name"] == name)
            .cloned()
    }

    fn feed(&self, query: &str) -> Feed {
        let (status, headers, body) = get(self.port, &format!("/v1/feed?{query}"));
        assert_eq!(status, 200);
        assert!(
            headers
                .iter()
                .any(|(k, v)| k == "content-type" && v == feed::CONTENT_TYPE),
            "{headers:?}"
        );
        feed::decode(&body).expect("the feed decodes")
    }

    fn logs(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal HTTP/1.1 GET: one request per connection; bodies come with content-length.
fn get(port: u16, path: &str) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, raw[split + 4..].to_vec())
}

/// Polls `f` every 20 ms until it returns Some, or panics after `secs` with `what`.
fn wait_for<T>(secs: f64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn temp_path(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mmrouter-sidecar-test-{}-{tag}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("workers")
}

// ---------------------------------------------------------------------------------------
// Membership and scrapes

#[test]
fn static_worker_is_healthy_with_its_metrics_capacity_and_block_size() {
    let w = Worker::start(&["--num-gpu-blocks", "1234", "--block-size", "32"]);
    let list = format!("a={}", w.addr());
    let s = Sidecar::start(&["--workers", &list, "--no-events"]);
    let state = wait_for(10.0, "worker a healthy", || {
        s.worker("a").filter(|w| w["healthy"] == true)
    });
    assert_eq!(state["address"], w.addr());
    assert_eq!(state["capacity"], 1234);
    assert_eq!(state["block_size"], 32);
    assert_eq!(state["metrics"]["waiting"], 0.0);
    assert!(state["metrics_age_ms"].as_u64().unwrap() < 2000);
    assert_eq!(state["events"]["endpoint"], Value::Null, "--no-events");
    let f = s.feed("since=0");
    assert!(f.snapshot);
    assert_eq!(f.workers.len(), 1);
    let fw = &f.workers[0];
    assert_eq!(
        (fw.name.as_str(), fw.address.as_str()),
        ("a", w.addr().as_str())
    );
    assert!(fw.healthy && fw.metrics_valid && !fw.events_connected);
    assert_eq!((fw.capacity, fw.block_size), (1234, 32));
    assert!(fw.metrics_age_ms < 2000);
    let top = s.state();
    assert_eq!(top["membership"][0], "static");
    assert!(top["epoch"].as_u64().unwrap() == f.epoch);
    assert!(s.logs().contains("join a 127.0.0.1:"), "{}", s.logs());
}

#[test]
fn a_killed_worker_turns_unhealthy() {
    let mut w = Worker::start(&[]);
    let list = w.addr();
    let s = Sidecar::start(&["--workers", &list, "--no-events"]);
    wait_for(10.0, "w0 healthy", || {
        s.worker("w0").filter(|w| w["healthy"] == true)
    });
    w.kill();
    let killed = Instant::now();
    let state = wait_for(5.0, "w0 unhealthy", || {
        s.worker("w0").filter(|w| w["healthy"] == false)
    });
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "{:?}",
        killed.elapsed()
    );
    assert!(
        state["scrape"]["last_error"]
            .as_str()
            .unwrap()
            .contains("connect"),
        "{state}"
    );
    assert!(!s.feed("since=0").workers[0].healthy);
    assert!(s.logs().contains("w0 127.0.0.1:"), "{}", s.logs());
    assert!(
        s.logs().contains("unhealthy after 2 failed scrapes"),
        "{}",
        s.logs()
    );
}

#[test]
fn a_metrics_endpoint_that_hangs_is_timed_out() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = Arc::new(Mutex::new(Vec::new()));
    let held2 = held.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            held2.lock().unwrap().push(stream); // accept, never answer
        }
    });
    let list = format!("stuck=127.0.0.1:{port}");
    let s = Sidecar::start(&[
        "--workers",
        &list,
        "--no-events",
        "--scrape-timeout-ms",
        "150",
    ]);
    let state = wait_for(5.0, "a timed-out scrape", || {
        s.worker("stuck")
            .filter(|w| w["scrape"]["failures"].as_u64().unwrap_or(0) >= 2)
    });
    assert_eq!(state["healthy"], false);
    assert!(
        state["scrape"]["last_error"]
            .as_str()
            .unwrap()
            .contains("no answer within 150 ms"),
        "{state}"
    );
    assert!(!held.lock().unwrap().is_empty(), "the sidecar did connect");
    let fw = &s.feed("since=0").workers[0];
    assert!(!fw.healthy && !fw.metrics_valid);
    assert_eq!(fw.metrics_age_ms, feed::AGE_NEVER);
}

#[test]
fn a_watched_file_adds_and_removes_workers_within_two_seconds() {
    let a = Worker::start(&[]);
    let b = Worker::start(&[]);
    let path = temp_path("file");
    std::fs::write(&path, format!("# two workers soon\na {}\n", a.addr())).unwrap();
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap(), "--no-events"]);
    wait_for(10.0, "a healthy", || {
        s.worker("a").filter(|w| w["healthy"] == true)
    });
    let cursor = s.feed("since=0").cursor;

    std::fs::write(&path, format!("a {}\nb {}\n", a.addr(), b.addr())).unwrap();
    let added = Instant::now();
    wait_for(2.0, "b in /v1/state", || s.worker("b"));
    wait_for(2.0, "b in the feed", || {
        let f = s.feed(&format!("since={cursor}"));
        f.workers.iter().any(|w| w.name == "b").then_some(())
    });
    wait_for(3.0, "b healthy", || {
        s.worker("b").filter(|w| w["healthy"] == true)
    });
    assert!(added.elapsed() < Duration::from_secs(3));

    std::fs::write(&path, format!("b {}\n", b.addr())).unwrap();
    wait_for(2.0, "a gone from /v1/state and the feed", || {
        let f = s.feed(&format!("since={cursor}"));
        let names: Vec<&str> = f.workers.iter().map(|w| w.name.as_str()).collect();
        (s.worker("a").is_none() && names == ["b"]).then_some(())
    });
    let logs = s.logs();
    assert!(logs.contains("join b 127.0.0.1:"), "{logs}");
    assert!(logs.contains("leave a 127.0.0.1:"), "{logs}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_dns_name_resolves_to_workers() {
    let w = Worker::start(&[]);
    let dns = format!("localhost:{}", w.port);
    let s = Sidecar::start(&["--dns", &dns, "--dns-interval-ms", "100", "--no-events"]);
    let name = format!("127.0.0.1_{}", w.port);
    let state = wait_for(10.0, "the resolved worker healthy", || {
        s.worker(&name).filter(|w| w["healthy"] == true)
    });
    assert_eq!(state["address"], w.addr());
    assert_eq!(s.state()["membership"][0], dns_label(&dns));
}

fn dns_label(dns: &str) -> String {
    format!("dns {dns}")
}

// ---------------------------------------------------------------------------------------
// KV events from an in-test publisher

/// The batches a publisher still holds for replay: (seq, payload).
type ReplayBuffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A vLLM-like KV-event publisher: PUB `[topic, seq, payload]`, and a replay ROUTER that
/// answers `[start]` with `["", topic, seq, payload]...` then `["", "", -1, ""]`.
struct Publisher {
    rt: tokio::runtime::Runtime,
    socket: Arc<tokio::sync::Mutex<PubSocket>>,
    buffer: ReplayBuffer,
    next_seq: u64,
    endpoint: String,
    replay_endpoint: String,
}

impl Publisher {
    fn start() -> Publisher {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let buffer: ReplayBuffer = Arc::default();
        let (socket, endpoint, replay_endpoint) = rt.block_on(async {
            let mut p = PubSocket::new();
            let ep = p.bind("tcp://127.0.0.1:0").await.unwrap();
            let mut router = RouterSocket::new();
            let rep = router.bind("tcp://127.0.0.1:0").await.unwrap();
            let buffer = buffer.clone();
            tokio::spawn(async move {
                while let Ok(req) = router.recv().await {
                    let frames = req.into_vec();
                    let (Some(id), Some(start)) = (frames.first(), frames.last()) else {
                        continue;
                    };
                    let start = u64::from_be_bytes(start.as_ref().try_into().unwrap_or([0; 8]));
                    let held: Vec<(u64, Vec<u8>)> = buffer.lock().unwrap().clone();
                    for (seq, payload) in held.into_iter().filter(|(s, _)| *s >= start) {
                        let mut m = ZmqMessage::from(id.clone());
                        for f in [
                            Bytes::new(),
                            Bytes::new(),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            Bytes::from(payload),
                        ] {
                            m.push_back(f);
                        }
                        let _ = router.send(m).await;
                    }
                    let mut end = ZmqMessage::from(id.clone());
                    for f in [
                        Bytes::new(),
                        Bytes::new(),
                        Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                        Bytes::new(),
                    ] {
                        end.push_back(f);
                    }
                    let _ = router.send(end).await;
                }
            });
            (
                Arc::new(tokio::sync::Mutex::new(p)),
                ep.to_string(),
                rep.to_string(),
            )
        });
        Publisher {
            rt,
            socket,
            buffer,
            next_seq: 0,
            endpoint,
            replay_endpoint,
        }
    }

    /// Publishes a batch (or, with `send = false`, only buffers it for replay: a batch the
    /// subscriber missed).
    fn publish(&mut self, events: Vec<KvEvent>, send: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = encode_batch(
            &EventBatch {
                ts: 1.0,
                events,
                data_parallel_rank: Some(0),
            },
            WireForm::Tagged,
            HashEncoding::Int,
        );
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if send {
            let socket = self.socket.clone();
            self.rt.block_on(async move {
                let mut m = ZmqMessage::from(Bytes::new());
                m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                m.push_back(Bytes::from(payload));
                socket.lock().await.send(m).await.unwrap();
            });
        }
        seq
    }
}

/// A BlockStored of `hashes`, every block overlapping the image `uuid`.
fn stored(hashes: &[u64], uuid: &str) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: None,
        token_ids: vec![7; 16 * hashes.len()],
        block_size: 16,
        lora_name: None,
        medium: Some("GPU".into()),
        extra_keys: (0..hashes.len())
            .map(|i| {
                vec![ExtraKey::Mm {
                    identifier: uuid.to_string(),
                    offset: -16 * i as i64,
                }]
            })
            .collect(),
        group_idx: None,
        kv_cache_spec_kind: None,
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
        group_idx: None,
    }
}

const UUID: &str = "00112233445566778899aabbccddeeff";

fn image_key(uuid: &str) -> u64 {
    mmrouter::identity::MediaId::of_uuid(uuid).key64()
}

/// A worker file line for a mock worker with the publisher's endpoints.
fn events_file(tag: &str, w: &Worker, p: &Publisher, replay: bool) -> PathBuf {
    let path = temp_path(tag);
    let replay = if replay {
        format!(" replay={}", p.replay_endpoint)
    } else {
        String::new()
    };
    std::fs::write(
        &path,
        format!("w {} events={}{replay}\n", w.addr(), p.endpoint),
    )
    .unwrap();
    path
}

/// Waits until the subscription is live and has had time to reach the publisher.
fn wait_subscribed(s: &Sidecar) {
    wait_for(10.0, "events connected", || {
        s.worker("w").filter(|w| w["events"]["connected"] == true)
    });
    std::thread::sleep(Duration::from_millis(300));
}

#[test]
fn events_put_an_image_in_residency_and_removal_and_clear_take_it_out() {
    let w = Worker::start(&[]);
    let mut p = Publisher::start();
    let path = events_file("events", &w, &p, false);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    wait_subscribed(&s);
    let c0 = s.feed("since=0").cursor;

    p.publish(
        vec![stored(&[11, 12, 13], UUID), stored(&[14], "other")],
        true,
    );
    let state = wait_for(5.0, "4 resident blocks", || {
        s.worker("w").filter(|w| w["blocks"] == 4)
    });
    assert_eq!(state["images"], 2);
    assert_eq!(state["events"]["seq"], 0);
    assert_eq!(state["events"]["gaps"], 0);
    let f = s.feed(&format!("since={c0}"));
    assert!(!f.snapshot);
    let mut images: Vec<(u64, u32)> = f.images.iter().map(|e| (e.image, e.blocks)).collect();
    images.sort();
    let mut want = vec![(image_key(UUID), 3), (image_key("other"), 1)];
    want.sort();
    assert_eq!(images, want);
    let fw = &f.workers[0];
    assert!(fw.events_connected);
    assert_eq!((fw.resident, fw.stored_total, fw.removed_total), (4, 4, 0));

    // Eviction of two of the image's blocks, then of the last one.
    let c1 = f.cursor;
    p.publish(vec![removed(&[11, 12])], true);
    wait_for(5.0, "2 resident blocks", || {
        s.worker("w").filter(|w| w["blocks"] == 2)
    });
    let f = s.feed(&format!("since={c1}"));
    assert_eq!(f.images.len(), 1);
    assert_eq!(
        (f.images[0].image, f.images[0].blocks),
        (image_key(UUID), 1)
    );
    let c2 = f.cursor;
    p.publish(vec![removed(&[13])], true);
    wait_for(5.0, "1 resident block", || {
        s.worker("w").filter(|w| w["blocks"] == 1)
    });
    let f = s.feed(&format!("since={c2}"));
    assert_eq!(f.images.len(), 1);
    assert_eq!(
        (f.images[0].image, f.images[0].blocks),
        (image_key(UUID), 0)
    );

    // AllBlocksCleared (vLLM's /reset_prefix_cache) empties the rest.
    let c3 = f.cursor;
    p.publish(vec![KvEvent::AllBlocksCleared { medium: None }], true);
    let state = wait_for(5.0, "no resident block", || {
        s.worker("w").filter(|w| w["blocks"] == 0)
    });
    assert_eq!(state["images"], 0);
    assert_eq!(state["events"]["cleared_total"], 1);
    let f = s.feed(&format!("since={c3}"));
    assert_eq!(f.images.len(), 1);
    assert_eq!(
        (f.images[0].image, f.images[0].blocks),
        (image_key("other"), 0)
    );
    assert!(s.feed("since=0").images.is_empty(), "the snapshot is empty");
    assert_eq!(f.workers[0].cleared_total, 1);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_gap_without_replay_is_counted_and_later_batches_still_apply() {
    let w = Worker::start(&[]);
    let mut p = Publisher::start();
    let path = events_file("gap", &w, &p, false);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    wait_subscribed(&s);
    p.publish(vec![stored(&[1], UUID)], true);
    wait_for(5.0, "seq 0", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 0)
    });
    p.publish(vec![stored(&[2], UUID)], false); // lost
    p.publish(vec![stored(&[3], UUID)], true);
    let state = wait_for(5.0, "seq 2", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 2)
    });
    assert_eq!(state["events"]["gaps"], 1);
    assert_eq!(state["events"]["lost"], 1);
    assert_eq!(state["events"]["replayed"], 0);
    assert_eq!(state["blocks"], 2);
    assert_eq!(s.feed("since=0").workers[0].event_gaps, 1);
    assert!(
        s.logs()
            .contains("gap of 1 batches (1..2): no replay endpoint"),
        "{}",
        s.logs()
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_gap_is_replayed_from_the_replay_endpoint() {
    let w = Worker::start(&[]);
    let mut p = Publisher::start();
    let path = events_file("replay", &w, &p, true);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    wait_subscribed(&s);
    p.publish(vec![stored(&[1], UUID)], true);
    wait_for(5.0, "seq 0", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 0)
    });
    p.publish(vec![stored(&[2], UUID)], false);
    p.publish(vec![stored(&[3], UUID)], false);
    p.publish(vec![stored(&[4], UUID)], true);
    let state = wait_for(5.0, "seq 3", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 3)
    });
    assert_eq!(state["events"]["gaps"], 1);
    assert_eq!(state["events"]["replayed"], 2);
    assert_eq!(state["events"]["lost"], 0);
    assert_eq!(state["blocks"], 4, "the replayed blocks are resident too");
    let f = s.feed("since=0");
    assert_eq!(f.images.len(), 1);
    assert_eq!(
        (f.images[0].image, f.images[0].blocks),
        (image_key(UUID), 4)
    );
    assert!(s.logs().contains("2 replayed, 0 lost"), "{}", s.logs());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_sidecar_started_after_the_worker_catches_up_through_replay() {
    let w = Worker::start(&[]);
    let mut p = Publisher::start();
    // Published before any subscriber: only the replay buffer has them.
    p.publish(vec![stored(&[1, 2], UUID)], true);
    p.publish(vec![stored(&[3], "b")], true);
    p.publish(vec![removed(&[3])], true);
    let path = events_file("late", &w, &p, true);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    let state = wait_for(10.0, "caught up to seq 2", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 2)
    });
    assert_eq!(state["blocks"], 2);
    assert_eq!(state["images"], 1);
    assert_eq!(state["events"]["replayed"], 3);
    assert!(
        s.logs()
            .contains("caught up 3 batches from 0 through replay"),
        "{}",
        s.logs()
    );
    // Live batches follow on.
    wait_subscribed(&s);
    p.publish(vec![removed(&[1, 2])], true);
    wait_for(5.0, "seq 3", || {
        s.worker("w")
            .filter(|w| w["events"]["seq"] == 3 && w["blocks"] == 0)
    });
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_dropped_subscription_reconnects_and_catches_up() {
    let w = Worker::start(&[]);
    let mut p = Publisher::start();
    let path = events_file("drop", &w, &p, true);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    wait_subscribed(&s);
    p.publish(vec![stored(&[1], UUID)], true);
    wait_for(5.0, "seq 0", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 0)
    });
    // The publisher's socket goes away (its connections close) and comes back on the same
    // endpoint, as when vLLM's publisher thread restarts its socket.
    let endpoint = p.endpoint.clone();
    let socket = p.socket.clone();
    p.rt.block_on(async move {
        let mut guard = socket.lock().await;
        let old = std::mem::replace(&mut *guard, PubSocket::new());
        drop(old);
        // Rebind the same endpoint after the old socket let it go.
        let mut tries = 0;
        while guard.bind(&endpoint).await.is_err() {
            tries += 1;
            assert!(tries < 100, "cannot rebind {endpoint}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    wait_for(10.0, "a reconnection", || {
        s.worker("w").filter(|w| {
            w["events"]["reconnects"].as_u64().unwrap_or(0) >= 1 && w["events"]["connected"] == true
        })
    });
    // Missed while disconnected: only in the replay buffer.
    p.publish(vec![stored(&[2], UUID)], false);
    wait_subscribed(&s);
    p.publish(vec![stored(&[3], UUID)], true);
    let state = wait_for(5.0, "seq 2", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 2)
    });
    assert_eq!(state["blocks"], 3);
    assert!(state["events"]["replayed"].as_u64().unwrap() >= 1);
    assert!(s.logs().contains("events reconnected to"), "{}", s.logs());
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

// ---------------------------------------------------------------------------------------
// KV events from the real mock worker

/// A PNG data URL whose header says `side`x`side` (the mock reads only the header).
fn png_url(side: u32, seed: u8) -> String {
    let png = test_images::Png::new(side, side).idat(&[seed; 64]).bytes();
    test_images::data_url("image/png", &png)
}

/// A workers file naming the mock `w` with its own event endpoints.
fn mock_file(tag: &str, w: &Worker) -> PathBuf {
    let (events, replay) = w.event_endpoints();
    let path = temp_path(tag);
    std::fs::write(
        &path,
        format!("w {} events={events} replay={replay}\n", w.addr()),
    )
    .unwrap();
    path
}

/// The resident blocks the snapshot feed gives for `image` on worker 0 (0 when absent).
fn image_blocks(s: &Sidecar, image: u64) -> u32 {
    s.feed("since=0")
        .images
        .iter()
        .find(|e| e.worker == 0 && e.image == image)
        .map_or(0, |e| e.blocks)
}

#[test]
fn mock_worker_image_is_resident_until_evicted() {
    // 12 blocks of 16 tokens: the image request caches ~6 of them, and the text requests
    // after it need the whole pool, so they evict every block of the image.
    let w = Worker::start_publishing(&["--num-gpu-blocks", "12"]);
    let path = mock_file("mock-evict", &w);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    wait_for(10.0, "events connected and capacity scraped", || {
        s.worker("w")
            .filter(|w| w["events"]["connected"] == true && w["capacity"] == 12)
    });
    std::thread::sleep(Duration::from_millis(300));
    let uuid = "0123456789abcdef0123456789abcdef";
    let key = image_key(uuid);
    let c0 = s.feed("since=0").cursor;
    w.chat("what is in this picture?", &[(&png_url(112, 1), uuid)]);
    let blocks = wait_for(5.0, "the image resident", || {
        Some(image_blocks(&s, key)).filter(|b| *b > 0)
    });
    let delta = s.feed(&format!("since={c0}"));
    assert!(
        delta
            .images
            .iter()
            .any(|e| e.image == key && e.blocks == blocks),
        "the delta carries the image: {:?}",
        delta.images
    );
    let state = s.worker("w").unwrap();
    assert!(state["blocks"].as_u64().unwrap() >= u64::from(blocks));
    assert_eq!(state["events"]["gaps"], 0, "{state}");
    assert_eq!(state["capacity"], 12);

    let c1 = delta.cursor;
    for (i, word) in ["alpha ", "bravo ", "charlie "].iter().enumerate() {
        w.chat(&format!("{i} {}", word.repeat(60)), &[]);
    }
    wait_for(5.0, "the image evicted", || {
        (image_blocks(&s, key) == 0).then_some(())
    });
    let delta = s.feed(&format!("since={c1}"));
    assert!(
        delta.images.iter().any(|e| e.image == key && e.blocks == 0),
        "the delta says the image is gone: {:?}",
        delta.images
    );
    let fw = &delta.workers[0];
    assert!(
        fw.removed_total > 0 && fw.stored_total > fw.removed_total,
        "{fw:?}"
    );
    assert!(fw.resident <= 12, "bounded by the pool: {fw:?}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn mock_worker_reset_prefix_cache_clears_residency() {
    let w = Worker::start_publishing(&[]);
    let path = mock_file("mock-reset", &w);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    wait_for(10.0, "events connected", || {
        s.worker("w").filter(|w| w["events"]["connected"] == true)
    });
    std::thread::sleep(Duration::from_millis(300));
    let uuid = "ffeeddccbbaa99887766554433221100";
    w.chat("describe", &[(&png_url(112, 2), uuid)]);
    wait_for(5.0, "the image resident", || {
        Some(image_blocks(&s, image_key(uuid))).filter(|b| *b > 0)
    });
    let (status, _) = w.post("/reset_prefix_cache", &Value::Null);
    assert_eq!(status, 200);
    let state = wait_for(5.0, "residency cleared", || {
        s.worker("w").filter(|w| w["events"]["cleared_total"] == 1)
    });
    assert_eq!(state["blocks"], 0);
    assert_eq!(state["images"], 0);
    assert_eq!(image_blocks(&s, image_key(uuid)), 0);
    assert_eq!(s.feed("since=0").workers[0].cleared_total, 1);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn a_sidecar_started_after_a_mock_worker_catches_up_through_its_replay() {
    let w = Worker::start_publishing(&[]);
    let uuid = "00000000000000000000000000000abc";
    w.chat("before the sidecar", &[(&png_url(112, 3), uuid)]);
    let path = mock_file("mock-late", &w);
    let s = Sidecar::start(&["--workers-file", path.to_str().unwrap()]);
    let state = wait_for(10.0, "caught up", || {
        s.worker("w")
            .filter(|w| w["events"]["replayed"].as_u64().unwrap_or(0) > 0)
    });
    assert!(state["images"].as_u64().unwrap() >= 1, "{state}");
    assert!(image_blocks(&s, image_key(uuid)) > 0);
    assert_eq!(state["events"]["lost"], 0, "{state}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

// ---------------------------------------------------------------------------------------
// The feed

#[test]
fn feed_snapshot_delta_other_epoch_and_expired_cursor() {
    let w = Worker::start(&[]);
    let mut p = Publisher::start();
    let path = events_file("feed", &w, &p, false);
    let s = Sidecar::start(&[
        "--workers-file",
        path.to_str().unwrap(),
        "--journal-entries",
        "4",
    ]);
    wait_subscribed(&s);
    p.publish(vec![stored(&[1], "x")], true);
    wait_for(5.0, "seq 0", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 0)
    });

    let snap = s.feed("since=0");
    assert!(snap.snapshot);
    assert_eq!(snap.images.len(), 1);
    let (epoch, c0) = (snap.epoch, snap.cursor);
    assert!(c0 >= 1 << 32, "cursors start at a random base");

    let same = s.feed(&format!("since={c0}&epoch={epoch}"));
    assert!(!same.snapshot);
    assert!(same.images.is_empty(), "nothing changed");
    assert_eq!(same.cursor, c0);
    assert_eq!(same.workers.len(), 1, "membership is always complete");

    p.publish(vec![stored(&[2], "y")], true);
    wait_for(5.0, "seq 1", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 1)
    });
    let delta = s.feed(&format!("since={c0}"));
    assert!(!delta.snapshot);
    assert_eq!(delta.images.len(), 1);
    assert_eq!(delta.images[0].image, image_key("y"));
    assert_eq!(delta.cursor, c0 + 1);
    assert_eq!(delta.epoch, epoch);

    assert!(
        s.feed(&format!("since={c0}&epoch={}", epoch ^ 1)).snapshot,
        "another epoch"
    );
    assert!(
        s.feed(&format!("since={}", c0 + 1000)).snapshot,
        "a cursor from another run"
    );

    // Five more changes push c0 out of the 4-entry journal.
    for i in 0..5 {
        p.publish(vec![stored(&[10 + i], &format!("z{i}"))], true);
    }
    wait_for(5.0, "seq 6", || {
        s.worker("w").filter(|w| w["events"]["seq"] == 6)
    });
    let old = s.feed(&format!("since={c0}"));
    assert!(old.snapshot, "too old a cursor");
    assert_eq!(old.images.len(), 7);
    assert!(
        s.logs().contains("feed: snapshot for since="),
        "{}",
        s.logs()
    );
    let (status, _, _) = get(s.port, "/v1/feed?since=abc");
    assert_eq!(status, 400);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn health_and_prometheus_endpoints() {
    let w = Worker::start(&[]);
    let list = format!("a={}", w.addr());
    let s = Sidecar::start(&["--workers", &list, "--no-events"]);
    wait_for(10.0, "a healthy", || {
        s.worker("a").filter(|w| w["healthy"] == true)
    });
    let (status, _, body) = get(s.port, "/health");
    assert_eq!((status, body.as_slice()), (200, &b"ok\n"[..]));
    let (status, _, body) = get(s.port, "/metrics");
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert!(text.contains("mmrouter_sidecar_workers 1\n"), "{text}");
    assert!(
        text.contains("mmrouter_sidecar_worker_healthy{worker=\"a\"} 1\n"),
        "{text}"
    );
    assert_eq!(get(s.port, "/nope").0, 404);
}

#[test]
fn sigterm_exits_zero() {
    let mut s = Sidecar::start(&[]);
    let status = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(code) = s.child.try_wait().unwrap() {
            assert_eq!(code.code(), Some(0));
            break;
        }
        assert!(Instant::now() < deadline, "still running");
        std::thread::sleep(Duration::from_millis(20));
    }
}
