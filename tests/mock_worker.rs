//! End-to-end tests of the `mock-worker` binary: each test starts the real program on a free
//! port (`--port 0`, the bound address read from its stderr) and talks HTTP/1.1 to it over a
//! plain TCP socket.

use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use test_images::Png;

#[path = "support/process.rs"]
mod process;
use process::spawn_listening;

const MODEL: &str = "Qwen/Qwen2.5-VL-7B-Instruct";

struct Worker {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    /// Starts the worker with `--port 0 --time-scale 0` and `args` (later flags win).
    fn start(args: &[&str]) -> Worker {
        let mut all = vec!["--port", "0", "--time-scale", "0"];
        all.extend_from_slice(args);
        let (child, port, log) = spawn_listening(env!("CARGO_BIN_EXE_mock-worker"), &all);
        Worker { child, port, log }
    }

    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Resp {
        http(
            self.port,
            method,
            path,
            body.map(|b| b.to_string()).as_deref(),
        )
    }

    fn chat(&self, body: &Value) -> Value {
        let r = self.request("POST", "/v1/chat/completions", Some(body));
        assert_eq!(r.status, 200, "body: {}", r.body);
        serde_json::from_str(&r.body).unwrap()
    }

    fn metrics(&self) -> Metrics {
        let r = self.request("GET", "/metrics", None);
        assert_eq!(r.status, 200);
        parse_prometheus(&r.body)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A minimal HTTP/1.1 client: one request per connection, chunked bodies decoded.
fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> Resp {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(raw[..split].to_vec()).unwrap();
    let mut rest = raw[split + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    if headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
    {
        rest = dechunk(&rest);
    }
    Resp {
        status,
        headers,
        body: String::from_utf8(rest).unwrap(),
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").unwrap();
        let size_text = std::str::from_utf8(&b[..eol]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

// ---- images ---------------------------------------------------------------------------------

/// A PNG file whose header says `w`x`h`; `seed` varies the (undecoded) pixel data, so two
/// seeds give two different files of the same size.
fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    Png::new(w, h).idat(&[seed; 64]).bytes()
}

fn data_url(bytes: &[u8]) -> String {
    test_images::data_url("image/png", bytes)
}

fn image_part(url: &str, uuid: Option<&str>) -> Value {
    let mut p = json!({"type": "image_url", "image_url": {"url": url}});
    if let Some(u) = uuid {
        p["uuid"] = json!(u);
    }
    p
}

fn chat_body(text: &str, images: Vec<Value>, max_tokens: u32) -> Value {
    let mut content = vec![json!({"type": "text", "text": text})];
    content.extend(images);
    json!({
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    })
}

fn cached(resp: &Value) -> u64 {
    // vLLM leaves prompt_tokens_details null when nothing hit the cache.
    resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn prompt_tokens(resp: &Value) -> u64 {
    resp["usage"]["prompt_tokens"].as_u64().unwrap()
}

// ---- Prometheus text ------------------------------------------------------------------------

/// One sample: metric name, labels, value.
type Sample = (String, Vec<(String, String)>, f64);

struct Metrics {
    samples: Vec<Sample>,
}

impl Metrics {
    /// Sum over all series of `name`.
    fn get(&self, name: &str) -> f64 {
        self.samples
            .iter()
            .filter(|(n, _, _)| n == name)
            .map(|(_, _, v)| v)
            .sum()
    }
}

/// Parses the text format strictly enough to fail on malformed output: every line is a
/// `# HELP`/`# TYPE` comment or `name{k="v",...} value`, every sample's family was typed.
fn parse_prometheus(text: &str) -> Metrics {
    let mut typed = std::collections::HashSet::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut it = rest.splitn(3, ' ');
            let kw = it.next().unwrap();
            let name = it.next().expect("comment names a metric");
            assert!(kw == "HELP" || kw == "TYPE", "bad comment: {line}");
            if kw == "TYPE" {
                let kind = it.next().unwrap();
                assert!(
                    ["counter", "gauge", "histogram"].contains(&kind),
                    "bad type: {line}"
                );
                if kind == "histogram" {
                    for suffix in ["_bucket", "_count", "_sum"] {
                        typed.insert(format!("{name}{suffix}"));
                    }
                } else {
                    typed.insert(name.to_string());
                }
            }
            continue;
        }
        let brace = line
            .find('{')
            .unwrap_or_else(|| panic!("no labels: {line}"));
        let close = line.rfind('}').unwrap();
        let name = &line[..brace];
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        assert!(typed.contains(name), "sample without TYPE: {line}");
        let mut labels = Vec::new();
        let mut rest = &line[brace + 1..close];
        while !rest.is_empty() {
            let eq = rest.find("=\"").unwrap();
            let key = &rest[..eq];
            let after = &rest[eq + 2..];
            let mut end = 0;
            let bytes = after.as_bytes();
            while bytes[end] != b'"' {
                end += if bytes[end] == b'\\' { 2 } else { 1 };
            }
            labels.push((key.to_string(), after[..end].to_string()));
            rest = after[end + 1..].trim_start_matches(',');
        }
        let value: f64 = line[close + 1..].trim().parse().unwrap();
        samples.push((name.to_string(), labels, value));
    }
    Metrics { samples }
}

// ---- tests ----------------------------------------------------------------------------------

#[test]
fn same_image_twice_hits_the_prefix_cache_and_another_image_does_not() {
    let w = Worker::start(&["--name", "w-cache"]);
    let img_a = data_url(&png(448, 448, 1));
    let img_b = data_url(&png(448, 448, 2));
    let body_a = chat_body(
        "What is in this picture?",
        vec![image_part(&img_a, None)],
        4,
    );
    let first = w.chat(&body_a);
    let n = prompt_tokens(&first);
    assert!(
        n > 200,
        "a 448x448 image costs ~256 tokens under qwen2.5-vl: {n}"
    );
    assert_eq!(cached(&first), 0);
    assert!(first["usage"]["prompt_tokens_details"].is_null());

    let second = w.chat(&body_a);
    assert_eq!(prompt_tokens(&second), n);
    let c = cached(&second);
    assert!(c * 10 >= n * 9, "cached {c} of {n}");
    assert!(c < n, "the last token is never served from cache");
    assert_eq!(c % 16, 0, "whole blocks only");
    assert_eq!(
        second["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"],
        "deterministic output"
    );

    let other = w.chat(&chat_body(
        "What is in this picture?",
        vec![image_part(&img_b, None)],
        4,
    ));
    assert_eq!(prompt_tokens(&other), n, "same size, same token count");
    assert!(cached(&other) * 10 < n, "cached {} of {n}", cached(&other));
}

#[test]
fn uuid_overrides_content_identity() {
    let w = Worker::start(&[]);
    let img_a = data_url(&png(448, 448, 1));
    let img_b = data_url(&png(448, 448, 2));
    let text = "Describe it.";
    let a = w.chat(&chat_body(
        text,
        vec![image_part(&img_a, Some("item-1"))],
        2,
    ));
    let n = prompt_tokens(&a);
    // Different bytes, same uuid: the engine trusts the uuid, so the cache hits.
    let b = w.chat(&chat_body(
        text,
        vec![image_part(&img_b, Some("item-1"))],
        2,
    ));
    assert!(cached(&b) * 10 >= n * 9, "cached {} of {n}", cached(&b));
    // Same bytes, another uuid: a different item, a miss.
    let c = w.chat(&chat_body(
        text,
        vec![image_part(&img_a, Some("item-2"))],
        2,
    ));
    assert!(cached(&c) * 10 < n, "cached {} of {n}", cached(&c));
    // Same bytes without uuid: also a different identity (content hash) from "item-1".
    let d = w.chat(&chat_body(text, vec![image_part(&img_a, None)], 2));
    assert!(cached(&d) * 10 < n, "cached {} of {n}", cached(&d));
}

#[test]
fn streaming_sends_role_content_usage_and_done() {
    let w = Worker::start(&[]);
    let img = data_url(&png(224, 224, 3));
    let plain = chat_body("Say something.", vec![image_part(&img, None)], 5);
    let full = w.chat(&plain);
    let mut body = plain.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = w.request("POST", "/v1/chat/completions", Some(&body));
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events: Vec<&str> = r
        .body
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("SSE data line"))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // role chunk + 5 content chunks + usage chunk
    assert_eq!(chunks.len(), 7);
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], MODEL);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks[1..6]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        text,
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert!(chunks[1]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert!(
        chunks[1].get("usage").is_none(),
        "no usage on content chunks"
    );
    let usage = &chunks[6];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        full["usage"]["prompt_tokens"]
    );
    // The stream repeated the prompt: it hit the cache.
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // Without include_usage: no usage chunk.
    body["stream_options"] = json!({"include_usage": false});
    let r = w.request("POST", "/v1/chat/completions", Some(&body));
    assert!(!r.body.contains("\"usage\""));
    assert!(r.body.ends_with("data: [DONE]\n\n"));
}

#[test]
fn completions_models_health_and_worker_header() {
    let w = Worker::start(&["--name", "alpha"]);
    let r = w.request(
        "POST",
        "/v1/completions",
        Some(&json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-mock-worker"), Some("alpha"));
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap().split(' ').count(),
        3
    );

    let h = w.request("GET", "/health", None);
    assert_eq!((h.status, h.header("x-mock-worker")), (200, Some("alpha")));
    let m = w.request("GET", "/v1/models", None);
    let v: Value = serde_json::from_str(&m.body).unwrap();
    assert_eq!(v["data"][0]["id"], MODEL);
    let missing = w.request(
        "POST",
        "/v1/chat/completions",
        Some(&json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]})),
    );
    assert_eq!(missing.status, 404);
    assert_eq!(missing.header("x-mock-worker"), Some("alpha"));
    let v: Value = serde_json::from_str(&missing.body).unwrap();
    assert_eq!(v["error"]["type"], "NotFoundError");
}

#[test]
fn bad_requests_get_openai_errors_with_400() {
    let w = Worker::start(&[]);
    let cases = [
        ("{not json".to_string(), "JSON"),
        (
            chat_body(
                "x",
                vec![image_part("data:image/png;base64,aGVsbG8gd29ybGQ=", None)],
                2,
            )
            .to_string(),
            "invalid image",
        ),
        (
            chat_body("x", vec![image_part("data:image/png;base64,@@@", None)], 2).to_string(),
            "base64",
        ),
        (
            chat_body("x", vec![image_part("https://example.com/a.png", None)], 2).to_string(),
            "https",
        ),
        (chat_body("x", vec![], 0).to_string(), "max_tokens"),
    ];
    for (body, needle) in cases {
        let r = http(w.port, "POST", "/v1/chat/completions", Some(&body));
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.to_lowercase().contains(&needle.to_lowercase()),
            "`{msg}` lacks `{needle}`"
        );
    }
    // The worker is still fine afterwards.
    assert_eq!(w.request("GET", "/health", None).status, 200);
}

#[test]
fn metrics_parse_and_counters_move() {
    let w = Worker::start(&["--num-gpu-blocks", "500"]);
    let before = w.metrics();
    for (name, labels, _) in &before.samples {
        if name.starts_with("vllm:") && name != "vllm:cache_config_info" {
            assert!(
                labels.contains(&("model_name".into(), MODEL.into())),
                "{name}"
            );
            assert!(labels.contains(&("engine".into(), "0".into())), "{name}");
        }
    }
    let info = before
        .samples
        .iter()
        .find(|(n, _, _)| n == "vllm:cache_config_info")
        .unwrap();
    assert!(info.1.contains(&("block_size".into(), "16".into())));
    assert!(info.1.contains(&("num_gpu_blocks".into(), "500".into())));
    assert_eq!(info.2, 1.0);
    assert_eq!(before.get("vllm:prefix_cache_queries_total"), 0.0);
    assert_eq!(before.get("vllm:kv_cache_usage_perc"), 0.0);

    let img = data_url(&png(448, 448, 9));
    let body = chat_body("Count the objects.", vec![image_part(&img, None)], 3);
    let a = w.chat(&body);
    let b = w.chat(&body);
    let m = w.metrics();
    let n = prompt_tokens(&a) as f64;
    assert_eq!(m.get("vllm:prefix_cache_queries_total"), 2.0 * n);
    assert_eq!(m.get("vllm:prefix_cache_hits_total"), cached(&b) as f64);
    assert_eq!(m.get("vllm:mm_cache_queries_total"), 2.0);
    assert_eq!(m.get("vllm:mm_cache_hits_total"), 1.0);
    assert_eq!(m.get("vllm:prompt_tokens_total"), 2.0 * n);
    assert_eq!(m.get("vllm:generation_tokens_total"), 6.0);
    assert_eq!(m.get("vllm:request_success_total"), 2.0);
    assert_eq!(m.get("vllm:num_requests_running"), 0.0);
    assert_eq!(m.get("vllm:num_requests_waiting"), 0.0);
    assert_eq!(m.get("mock:encoder_runs_total"), 1.0);
    assert!(m.get("mock:kv_blocks_stored_total") >= (n / 16.0).floor());
    let usage = m.get("vllm:kv_cache_usage_perc");
    assert!((0.0..=1.0).contains(&usage));
}

#[test]
fn http_image_urls_are_fetched_and_counted() {
    let png_bytes = png(224, 224, 5);
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let hits = Arc::new(Mutex::new(0u32));
    let hits2 = hits.clone();
    std::thread::spawn(move || {
        for conn in server.incoming() {
            let Ok(mut s) = conn else { break };
            // Read the whole request head, however the client's writes were split.
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let req = String::from_utf8_lossy(&head).to_string();
            *hits2.lock().unwrap() += 1;
            if req.starts_with("GET /img.png ") {
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n",
                    png_bytes.len()
                );
                let _ = s.write_all(&png_bytes);
            } else {
                let _ = write!(s, "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n");
            }
        }
    });
    let w = Worker::start(&[]);
    let url = format!("http://127.0.0.1:{port}/img.png");
    let body = chat_body("What is this?", vec![image_part(&url, None)], 2);
    let a = w.chat(&body);
    let b = w.chat(&body);
    assert!(prompt_tokens(&a) > 64, "224x224 = 64 image tokens + text");
    assert!(cached(&b) * 10 >= prompt_tokens(&b) * 8);
    assert_eq!(
        *hits.lock().unwrap(),
        2,
        "fetched once per request, as vLLM does"
    );
    assert_eq!(w.metrics().get("mock:image_fetches_total"), 2.0);
    let missing = format!("http://127.0.0.1:{port}/nope.png");
    let r = w.request(
        "POST",
        "/v1/chat/completions",
        Some(&chat_body("x", vec![image_part(&missing, None)], 2)),
    );
    assert_eq!(r.status, 400);
    assert!(r.body.contains("404"), "{}", r.body);
}

#[test]
fn tiny_pool_evicts_least_recently_used_prefix() {
    // Measure one request's size on a roomy worker, then size the pool for exactly two.
    let probe = Worker::start(&[]);
    let imgs: Vec<String> = (10..13).map(|s| data_url(&png(448, 448, s))).collect();
    let body = |i: usize| chat_body("Look closely.", vec![image_part(&imgs[i], None)], 4);
    let n = prompt_tokens(&probe.chat(&body(0)));
    drop(probe);
    let need = (n + 4).div_ceil(16);
    let pool = (2 * need).to_string();
    let w = Worker::start(&["--num-gpu-blocks", &pool]);
    let (a, b, c) = (body(0), body(1), body(2));
    assert_eq!(cached(&w.chat(&a)), 0);
    assert_eq!(cached(&w.chat(&b)), 0);
    // Both fit: A is still cached, and using it again makes it the most recently used.
    assert!(cached(&w.chat(&a)) * 10 >= n * 9);
    // C needs a full sequence's worth of blocks: the least recently used prefix (B) goes.
    assert_eq!(cached(&w.chat(&c)), 0);
    assert!(
        cached(&w.chat(&a)) * 10 >= n * 9,
        "A was used last, it survives"
    );
    let m = w.metrics();
    assert!(m.get("mock:kv_blocks_removed_total") > 0.0);
    assert_eq!(cached(&w.chat(&b)), 0, "B was evicted");
    // A request that can never fit is refused.
    let huge = chat_body("x", vec![image_part(&imgs[0], None)], 64 * need as u32);
    let r = w.request("POST", "/v1/chat/completions", Some(&huge));
    assert_eq!(r.status, 400);
    assert!(r.body.contains("num-gpu-blocks"), "{}", r.body);
}

/// Polls `cond` every 10 ms until it holds; panics with `what` after 30 s. The deadline only
/// bounds a broken run: a passing run never depends on it.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The value of `key=<number>` in a log line.
fn log_field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
        .parse()
        .unwrap()
}

#[test]
fn waiting_queue_shows_in_metrics_and_latency() {
    // One seat. The first request holds it for 119 decode steps at 40 tok/s (~3 s); the two
    // others are sent only once it runs, so they queue behind it whatever the scheduling of
    // this test's threads, and each of them decodes 6 tokens (5 steps, 125 ms) after it.
    let w = Worker::start(&[
        "--max-num-seqs",
        "1",
        "--time-scale",
        "1",
        "--decode-tokens-per-sec",
        "40",
    ]);
    let port = w.port;
    let send = |i: usize, max_tokens: u32| {
        std::thread::spawn(move || {
            let body = json!({"model": MODEL, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": format!("request {i}")}]});
            http(
                port,
                "POST",
                "/v1/chat/completions",
                Some(&body.to_string()),
            )
            .status
        })
    };
    let start = Instant::now();
    let mut max_running = 0.0f64;
    let mut observe = || {
        let m = w.metrics();
        let (running, waiting) = (
            m.get("vllm:num_requests_running"),
            m.get("vllm:num_requests_waiting"),
        );
        max_running = max_running.max(running);
        (running, waiting)
    };
    let long = send(0, 120);
    wait_until("the first request runs", || observe().0 == 1.0);
    let short: Vec<_> = (1..3).map(|i| send(i, 6)).collect();
    // Both arrive while the seat is taken (the first request runs for seconds), so the gauge
    // shows them waiting until it ends.
    let mut max_waiting = 0.0f64;
    wait_until("a request waits", || {
        let (_, waiting) = observe();
        max_waiting = max_waiting.max(waiting);
        waiting >= 1.0
    });
    assert_eq!(long.join().unwrap(), 200);
    for h in short {
        assert_eq!(h.join().unwrap(), 200);
    }
    let elapsed = start.elapsed();
    assert!(max_waiting >= 1.0, "waiting never seen: {max_waiting}");
    assert_eq!(max_running, 1.0);
    // One seat: 119 + 5 + 5 decode steps of 25 ms one after the other.
    assert!(
        elapsed >= Duration::from_millis(129 * 25),
        "three serialised requests took only {elapsed:?}"
    );
    let m = w.metrics();
    assert_eq!(m.get("vllm:num_requests_waiting"), 0.0);
    assert_eq!(m.get("vllm:num_requests_running"), 0.0);
    assert_eq!(m.get("vllm:request_success_total"), 3.0);
    // The log line is written before the response; the reader thread may lag behind it.
    let lines = || -> Vec<String> {
        w.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("prompt_tokens="))
            .cloned()
            .collect()
    };
    wait_until("three request lines are logged", || lines().len() >= 3);
    let lines = lines();
    assert_eq!(lines.len(), 3, "{lines:?}");
    // The waiting shows in latency: the short requests queued, and the later of the two
    // queued at least through the other's 5 decode steps.
    let mut queued: Vec<f64> = lines
        .iter()
        .filter(|l| log_field(l, "output_tokens") == 6.0)
        .map(|l| log_field(l, "queued_ms"))
        .collect();
    queued.sort_by(f64::total_cmp);
    assert_eq!(queued.len(), 2, "{lines:?}");
    assert!(queued[0] > 0.0, "{lines:?}");
    assert!(queued[1] >= 125.0, "{lines:?}");
}

#[test]
fn sigterm_stops_the_worker_cleanly() {
    let mut w = Worker::start(&[]);
    assert_eq!(w.request("GET", "/health", None).status, 200);
    let pid = w.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = w.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "worker did not exit on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}
