//! Images by URL fetched by the real filter `.wasm` on the Wasmtime proxy-wasm host: scripted
//! answers to its `dispatch_http_call`s, timeouts on the virtual clock, failures, several VMs
//! asking for one URL at once, and the SSRF guard.

mod support;

use proxy_wasm_host::{Host, HttpCallOutcome, HttpResponse, LogLevel, Vm, VmConfig};
use std::time::Duration;
use test_images::{Png, base64 as b64, noise};

const ADDRS: [&str; 3] = ["127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002"];
const DEST: &str = "x-gateway-destination-endpoint";
const TICK: Duration = Duration::from_millis(20);

fn config(fetch: &str) -> VmConfig {
    let workers: Vec<String> = ADDRS
        .iter()
        .enumerate()
        .map(|(i, a)| format!(r#"{{"name":"w{i}","address":"{a}"}}"#))
        .collect();
    VmConfig::new(format!(
        r#"{{"workers":[{}],"response_headers":true,"metrics":{{"poll_ms":0}},"stamp_uuid":true,"decision_log":"info","fetch":{fetch}}}"#,
        workers.join(",")
    ))
    .allow_on_headers_stop_iteration(true)
    .log_level(LogLevel::Info)
}

const FETCH: &str =
    r#"{"enabled":true,"allow":["*","127.0.0.1:8765"],"timeout_ms":500,"deadline_ms":800}"#;

fn host() -> Host {
    Host::new(&support::filter_module()).unwrap()
}

fn png(w: u32, h: u32, seed: u64) -> Vec<u8> {
    Png::new(w, h).idat(&noise(4096, seed)).bytes()
}

fn body(image_url: &str) -> String {
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{image_url}"}}}},{{"type":"text","text":"what is in this picture?"}}]}}]}}"#
    )
}

fn inline(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", b64(bytes))
}

fn send(vm: &Vm, body: &str) -> proxy_wasm_host::Exchange {
    vm.request()
        .header(":path", "/v1/chat/completions")
        .header("content-type", "application/json")
        .header("content-length", &body.len().to_string())
        .body(body.as_bytes())
        .chunk_size(4096)
        .send()
        .unwrap()
}

/// The `uuid` the filter stamped into the first image part of what went upstream.
fn stamped_uuid(s: &proxy_wasm_host::Exchange) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(s.upstream_body()).ok()?;
    v["messages"][0]["content"][0]["uuid"]
        .as_str()
        .map(str::to_string)
}

fn image_reply(bytes: &[u8]) -> HttpResponse {
    HttpResponse::new(200)
        .header("content-type", "image/png")
        .body(bytes.to_vec())
}

#[test]
fn a_url_image_is_fetched_while_the_request_waits_and_matches_the_same_bytes_inline() {
    let host = host();
    let vm = host.vm(config(FETCH)).unwrap();
    let picture = png(640, 480, 1);
    let s = send(&vm, &body("http://127.0.0.1:8765/a.png?sig=1"));
    assert!(!s.forwarded_upstream(), "held until its image is fetched");
    let calls = vm.http_calls();
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(call.upstream, "mmrouter_fetch");
    assert_eq!(call.headers.get(":path"), Some("/a.png?sig=1"));
    assert_eq!(call.headers.get(":authority"), Some("127.0.0.1:8765"));
    assert_eq!(
        call.headers.get("x-mmrouter-fetch-address"),
        Some("127.0.0.1:8765")
    );
    assert_eq!(call.timeout, Duration::from_millis(500));
    vm.answer_http_call(call.token, image_reply(&picture))
        .unwrap();
    let s = vm.stream(s.id()).unwrap();
    assert!(s.forwarded_upstream(), "resumed once the image came");
    let by_url = stamped_uuid(&s).expect("the fetched image's content id is stamped");
    let worker = s.request_header(DEST).map(str::to_string);
    assert!(worker.is_some());
    assert_eq!(host.metric_value("mmrouter.fetched"), Some(1));
    assert_eq!(vm.logs_containing("1 fetched, 0 cached, 0 failed").len(), 1);

    // The same bytes inline: the same content id, the same worker, its blocks matched.
    host.advance(TICK).unwrap();
    let s2 = send(&vm, &body(&inline(&picture)));
    assert_eq!(stamped_uuid(&s2).as_deref(), Some(by_url.as_str()));
    assert_eq!(s2.request_header(DEST), worker.as_deref());
    let overlap = s2.response_header("x-mmrouter-overlap").unwrap();
    let (m, t) = overlap.split_once('/').unwrap();
    assert_eq!(
        m, t,
        "every block of the first request is matched: {overlap}"
    );

    // The same bytes at another URL: fetched (a new URL), the same identity.
    let s3 = send(&vm, &body("http://127.0.0.1:8765/b.png?sig=2"));
    let call = vm.http_calls().pop().expect("a new URL is fetched");
    vm.answer_http_call(call.token, image_reply(&picture))
        .unwrap();
    let s3 = vm.stream(s3.id()).unwrap();
    assert_eq!(stamped_uuid(&s3).as_deref(), Some(by_url.as_str()));
    assert_eq!(s3.request_header(DEST), worker.as_deref());

    // A re-encoded picture (other bytes) has another identity.
    let s4 = send(&vm, &body("http://127.0.0.1:8765/c.png"));
    let call = vm.http_calls().pop().expect("fetched");
    vm.answer_http_call(call.token, image_reply(&png(640, 480, 2)))
        .unwrap();
    let s4 = vm.stream(s4.id()).unwrap();
    assert_ne!(stamped_uuid(&s4).as_deref(), Some(by_url.as_str()));
}

#[test]
fn a_url_is_fetched_once_per_ttl_for_every_vm_and_later_requests_wait_for_the_first() {
    let host = host();
    let a = host.vm(config(FETCH)).unwrap();
    let b = host.vm(config(FETCH)).unwrap();
    let picture = png(320, 200, 3);
    let url = "http://127.0.0.1:8765/shared.png";
    let first = send(&a, &body(url));
    let second = send(&b, &body(url));
    assert_eq!(a.http_calls().len(), 1);
    assert!(b.http_calls().is_empty(), "VM b waits for VM a's fetch");
    assert!(!second.forwarded_upstream());
    let token = a.http_calls()[0].token;
    a.answer_http_call(token, image_reply(&picture)).unwrap();
    let first = a.stream(first.id()).unwrap();
    // VM b sees the result on its next tick.
    host.advance(TICK).unwrap();
    let second = b.stream(second.id()).unwrap();
    assert!(second.forwarded_upstream());
    assert_eq!(stamped_uuid(&first), stamped_uuid(&second));
    assert!(stamped_uuid(&first).is_some());
    // Later requests: from the cache, no fetch.
    let third = send(&b, &body(url));
    assert!(third.forwarded_upstream() && b.http_calls().is_empty());
    assert_eq!(stamped_uuid(&third), stamped_uuid(&first));
    assert_eq!(host.metric_value("mmrouter.fetched"), Some(1));
    assert_eq!(host.metric_value("mmrouter.fetch_cached"), Some(2));
    assert_eq!(host.metric_value("mmrouter.fetch_waited"), Some(1));
}

#[test]
fn a_hanging_image_server_costs_at_most_the_deadline_and_fails_no_request() {
    let host = host();
    let a = host.vm(config(FETCH)).unwrap();
    let b = host.vm(config(FETCH)).unwrap();
    a.set_http_responder(|_| HttpCallOutcome::Pending).unwrap();
    let url = "http://127.0.0.1:8765/hang.png";
    let first = send(&a, &body(url));
    // The second request waits on the first's claim from another VM.
    host.advance(Duration::from_millis(100)).unwrap();
    let second = send(&b, &body(url));
    assert!(!first.forwarded_upstream() && !second.forwarded_upstream());
    // The fetch times out at 500 ms: the first request goes on without the bytes.
    host.advance(Duration::from_millis(420)).unwrap();
    let first = a.stream(first.id()).unwrap();
    assert!(first.forwarded_upstream());
    assert!(first.request_header(DEST).is_some(), "routed, not failed");
    assert_eq!(stamped_uuid(&first), None, "a URL identity is not stamped");
    assert_eq!(a.logs_containing("1 failed (no_response)").len(), 1);
    // The second saw the cached failure on its tick, without a fetch of its own.
    let second = b.stream(second.id()).unwrap();
    assert!(second.forwarded_upstream());
    assert!(b.http_calls().is_empty());
    assert_eq!(
        host.metric_value("mmrouter.fetch_failed.no_response"),
        Some(2),
        "both requests fell back"
    );
    // Within failure_ttl_ms the URL is not fetched again.
    let third = send(&b, &body(url));
    assert!(third.forwarded_upstream() && b.http_calls().is_empty());
}

#[test]
fn the_request_deadline_bounds_the_wait_even_when_the_fetch_timeout_is_longer() {
    let host = host();
    let vm = host
        .vm(config(
            r#"{"enabled":true,"allow":["127.0.0.1:8765"],"timeout_ms":5000,"deadline_ms":300}"#,
        ))
        .unwrap();
    vm.set_http_responder(|_| HttpCallOutcome::Pending).unwrap();
    let s = send(&vm, &body("http://127.0.0.1:8765/slow.png"));
    let call = vm.http_calls().pop().unwrap();
    assert_eq!(
        call.timeout,
        Duration::from_millis(300),
        "capped by the deadline"
    );
    host.advance(Duration::from_millis(320)).unwrap();
    let s = vm.stream(s.id()).unwrap();
    assert!(s.forwarded_upstream());
    assert!(s.request_header(DEST).is_some());
}

#[test]
fn failed_fetches_and_bad_answers_fall_back_and_are_counted() {
    let host = host();
    let vm = host.vm(config(FETCH)).unwrap();
    let cases: [(&str, Option<HttpResponse>, &str); 4] = [
        ("http://127.0.0.1:8765/reset.png", None, "no_response"),
        (
            "http://127.0.0.1:8765/404.png",
            Some(HttpResponse::new(404)),
            "status",
        ),
        (
            "http://127.0.0.1:8765/moved.png",
            Some(HttpResponse::new(302).header("location", "http://169.254.169.254/")),
            "status",
        ),
        (
            "http://127.0.0.1:8765/text.png",
            Some(HttpResponse::new(200).body(b"not an image".to_vec())),
            "not_image",
        ),
    ];
    for (url, reply, reason) in cases {
        let s = send(&vm, &body(url));
        let call = vm.http_calls().pop().expect("fetched");
        match reply {
            Some(r) => vm.answer_http_call(call.token, r).unwrap(),
            None => vm.fail_http_call(call.token).unwrap(),
        }
        let s = vm.stream(s.id()).unwrap();
        assert!(s.forwarded_upstream(), "{url}");
        assert!(s.request_header(DEST).is_some(), "{url}");
        assert!(
            !vm.logs_containing(&format!("1 failed ({reason})"))
                .is_empty(),
            "{url}"
        );
    }
    assert_eq!(
        host.metric_value("mmrouter.fetch_failed.no_response"),
        Some(1)
    );
    assert_eq!(host.metric_value("mmrouter.fetch_failed.status"), Some(2));
    assert_eq!(
        host.metric_value("mmrouter.fetch_failed.not_image"),
        Some(1)
    );
    assert!(
        vm.http_calls().is_empty(),
        "a redirect is not followed by default"
    );
}

#[test]
fn refused_targets_are_never_fetched_and_are_counted_by_reason() {
    let host = host();
    let vm = host.vm(config(FETCH)).unwrap();
    for (url, reason) in [
        ("http://10.0.0.1/a.png", "private_address"),
        ("http://169.254.169.254/latest/meta-data", "private_address"),
        ("http://localhost/a.png", "local_name"),
        ("http://127.0.0.1:8766/a.png", "not_allowed"),
        ("http://user:pw@example.com/a.png", "credentials"),
        ("ftp://example.com/a.png", "scheme"),
    ] {
        let s = send(&vm, &body(url));
        assert!(s.forwarded_upstream(), "{url}");
        assert!(vm.http_calls().is_empty(), "{url} was fetched");
        let metric = format!("mmrouter.fetch_refused.{reason}");
        assert!(host.metric_value(&metric).unwrap_or(0) >= 1, "{metric}");
    }
}

#[test]
fn fetching_is_off_by_default_and_urls_keep_their_url_identity() {
    let host = host();
    let vm = host
        .vm(VmConfig::new(format!(
            r#"{{"workers":[{{"name":"w0","address":"{}"}}],"metrics":{{"poll_ms":0}}}}"#,
            ADDRS[0]
        ))
        .allow_on_headers_stop_iteration(true))
        .unwrap();
    let s = send(&vm, &body("http://127.0.0.1:8765/a.png"));
    assert!(s.forwarded_upstream());
    assert!(vm.http_calls().is_empty());
}

#[test]
fn a_name_the_guard_listener_resolved_to_a_special_address_is_a_refusal_not_a_failure() {
    let host = host();
    let vm = host
        .vm(config(
            r#"{"enabled":true,"allow":["*","images.example.com"],"timeout_ms":500,"deadline_ms":800}"#,
        ))
        .unwrap();
    // A name allowed by `*` only goes through the guard listener, which answers with its
    // marked 403 when the name resolved to a special-use address.
    let s = send(&vm, &body("http://internal.example.test/a.png"));
    let call = vm.http_calls().pop().expect("sent to the guard listener");
    assert_eq!(call.upstream, "mmrouter_fetch_guard");
    assert_eq!(
        call.headers.get(":authority"),
        Some("internal.example.test")
    );
    assert_eq!(call.headers.get("x-mmrouter-fetch-address"), None);
    vm.answer_http_call(
        call.token,
        HttpResponse::new(403).header("x-mmrouter-fetch-refused", "resolved_special_address"),
    )
    .unwrap();
    let s = vm.stream(s.id()).unwrap();
    assert!(s.forwarded_upstream(), "the request goes on");
    assert!(s.request_header(DEST).is_some());
    assert_eq!(stamped_uuid(&s), None, "URL identity: nothing stamped");
    assert_eq!(
        host.metric_value("mmrouter.fetch_refused.resolved_special_address"),
        Some(1)
    );
    assert_eq!(
        vm.logs_containing("1 failed (resolved_special_address)")
            .len(),
        1
    );
    // Within the failure TTL the next request falls back at once, with the same reason.
    let s = send(&vm, &body("http://internal.example.test/a.png"));
    assert!(s.forwarded_upstream());
    assert!(vm.http_calls().is_empty(), "the refusal is cached");
    assert_eq!(
        host.metric_value("mmrouter.fetch_refused.resolved_special_address"),
        Some(2)
    );

    // An image server's own 403 is a failure (`status`), not a refusal.
    let s = send(&vm, &body("https://other.example.test/a.png"));
    let call = vm.http_calls().pop().expect("fetched");
    assert_eq!(call.upstream, "mmrouter_fetch_guard_tls");
    vm.answer_http_call(call.token, HttpResponse::new(403))
        .unwrap();
    assert!(vm.stream(s.id()).unwrap().forwarded_upstream());
    assert_eq!(host.metric_value("mmrouter.fetch_failed.status"), Some(1));
    assert_eq!(
        host.metric_value("mmrouter.fetch_refused.resolved_special_address"),
        Some(2)
    );

    // A name allowed by an exact entry goes straight to the dynamic forward proxy cluster.
    let s = send(&vm, &body("http://images.example.com/a.png"));
    let call = vm.http_calls().pop().expect("fetched");
    assert_eq!(call.upstream, "mmrouter_fetch_dns");
    vm.answer_http_call(call.token, image_reply(&png(64, 64, 3)))
        .unwrap();
    let s = vm.stream(s.id()).unwrap();
    assert!(stamped_uuid(&s).is_some(), "identified by its bytes");
}
