//! The real filter `.wasm` (feature `filter`, wasm32-wasip1, profile `wasm`) on the Wasmtime
//! proxy-wasm host (`proxy-wasm-host`, in `tests/proxy-wasm-host`). The test command builds the `.wasm` itself (see
//! `tests/support`), so these tests exercise exactly what Envoy would load.

mod support;

use mmrouter::feed::{self, Feed, FeedWorker};
use mmrouter::state::load::{Load, decode as decode_loads};
use mmrouter::state::workers::LiveTable;
use mmrouter::state::{Keys, StateConfig};
use proxy_wasm_host::{
    Action, Callback, Host, HostError, HttpResponse, LogLevel, Response, Vm, VmConfig,
};
use std::time::Duration;
use test_images::{Png, base64 as b64, noise};

const ADDRS: [&str; 3] = ["127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002"];
const DEST: &str = "x-gateway-destination-endpoint";

fn workers_json(n: usize) -> String {
    let ws: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"name":"w{i}","address":"{}"}}"#, ADDRS[i]))
        .collect();
    format!("[{}]", ws.join(","))
}

/// The plugin configuration with `n` workers and the response headers on, polling off
/// unless `extra` turns it on.
fn plugin_config(n: usize, extra: &str) -> String {
    let extra = if extra.is_empty() {
        r#""metrics":{"poll_ms":0}"#.to_string()
    } else {
        extra.to_string()
    };
    format!(
        r#"{{"workers":{},"response_headers":true,{extra}}}"#,
        workers_json(n)
    )
}

/// The writer's tick (state.tick_ms by default).
const TICK: Duration = Duration::from_millis(20);

fn vm_config(n: usize, extra: &str) -> VmConfig {
    VmConfig::new(plugin_config(n, extra)).allow_on_headers_stop_iteration(true)
}

fn host() -> Host {
    Host::new(&support::filter_module()).unwrap()
}

// ---- request bodies ----

/// A PNG of `w`×`h` whose IDAT holds `payload` bytes derived from `seed` (the header reader
/// follows chunk lengths, it never inflates).
fn png(w: u32, h: u32, payload: usize, seed: u64) -> Vec<u8> {
    Png::new(w, h).idat(&noise(payload, seed)).bytes()
}

fn image_body(image_b64: &str, text: &str) -> String {
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image_b64}"}}}},{{"type":"text","text":"{text}"}}]}}]}}"#
    )
}

fn text_body(text: &str) -> String {
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":"{text}"}}]}}"#
    )
}

fn chat<'a>(vm: &'a Vm, body: &str) -> proxy_wasm_host::RequestBuilder<'a> {
    vm.request()
        .header(":path", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(body.as_bytes())
        .chunk_size(16 * 1024)
}

// ---- shared state, read the way the filter lays it out ----

/// The bytes of a shared-data table, by its key (empty when absent).
fn table(host: &Host, key: impl Fn(&Keys) -> String) -> Vec<u8> {
    let keys = Keys::new(StateConfig::default().namespace(16));
    host.shared_data(&key(&keys))
        .map(|(v, _)| v)
        .unwrap_or_default()
}

fn loads(host: &Host, n: usize) -> Vec<Load> {
    decode_loads(&table(host, Keys::load), n)
}

/// In-flight requests per worker, from the shared load table.
fn inflight(host: &Host, n: usize) -> Vec<u32> {
    loads(host, n).iter().map(|l| l.inflight).collect()
}

/// Each worker's queue clock, µs after the host's current time (0 when drained).
fn queued_us(host: &Host, n: usize) -> Vec<u64> {
    let now = host_now_us(host);
    loads(host, n).iter().map(|l| l.queued_us(now)).collect()
}

/// Each worker's peak measured prefill speed (tokens/s, counted or not yet), from the shared
/// live table.
fn peak_speeds(host: &Host, n: usize) -> Vec<f64> {
    let live = LiveTable::decode(&table(host, Keys::live));
    (0..n)
        .map(|s| live.get(s).map_or(0.0, |l| f64::from(l.prefill_tps_peak)))
        .collect()
}

fn host_now_us(host: &Host) -> u64 {
    proxy_wasm_host::DEFAULT_EPOCH_SECS * 1_000_000 + host.now().as_micros() as u64
}

fn worker_of(addr: Option<&str>) -> usize {
    let addr = addr.expect("no destination header upstream");
    ADDRS
        .iter()
        .position(|a| *a == addr)
        .unwrap_or_else(|| panic!("destination {addr} is not a configured worker"))
}

// ---- the request path ----

#[test]
fn a_chat_request_is_routed_to_a_configured_worker_after_the_whole_body() {
    let host = host();
    let vm = host.vm(vm_config(2, "")).unwrap();
    let s = chat(&vm, &text_body("hello there")).send().unwrap();
    assert!(s.is_complete());
    // Headers are held until the body has been read, then everything goes upstream.
    assert_eq!(s.action(Callback::RequestHeaders), Some(Action::Pause));
    assert_eq!(s.action(Callback::RequestBody), Some(Action::Continue));
    let w = worker_of(s.request_header(DEST));
    assert_eq!(s.upstream_body(), text_body("hello there").as_bytes());
    assert_eq!(
        s.response_header("x-mmrouter-worker"),
        Some(format!("w{w}").as_str())
    );
    assert!(s.response_header("x-mmrouter-overlap").is_some());
    let decision = s
        .response_header("x-mmrouter-decision")
        .expect("decision header");
    assert!(
        decision.contains("wait_ms=") && decision.contains("recompute_ms="),
        "{decision}"
    );
    let lines = vm.logs_containing("[ROUTING] Best: ");
    assert_eq!(lines.len(), 1);
    assert_eq!(
        lines[0].level,
        LogLevel::Debug,
        "the decision line is at debug level by default"
    );
    assert_eq!(host.metric_value("mmrouter.requests"), Some(1));
    assert_eq!(host.metric_value(&format!("mmrouter.routed.w{w}")), Some(1));
}

#[test]
fn worker_naming_response_headers_are_off_by_default_and_the_log_line_has_a_switch() {
    let host = host();
    let quiet = host
        .vm(VmConfig::new(format!(
            r#"{{"workers":{},"metrics":{{"poll_ms":0}}}}"#,
            workers_json(2)
        ))
        .allow_on_headers_stop_iteration(true))
        .unwrap();
    let s = chat(&quiet, &text_body("hello")).send().unwrap();
    worker_of(s.request_header(DEST));
    for h in [
        "x-mmrouter-worker",
        "x-mmrouter-overlap",
        "x-mmrouter-decision",
    ] {
        assert_eq!(s.response_header(h), None, "{h}");
    }
    let loud = host
        .vm(vm_config(
            2,
            r#""metrics":{"poll_ms":0},"decision_log":"info""#,
        ))
        .unwrap();
    chat(&loud, &text_body("hello")).send().unwrap();
    let lines = loud.logs_containing("[ROUTING] Best: ");
    assert_eq!(lines.len(), 1);
    assert!(lines[0].message.contains("recompute"), "{:?}", lines[0]);
}

#[test]
fn with_retry_alternates_the_header_lists_the_next_best_workers_after_the_chosen_one() {
    let host = host();
    let vm = host
        .vm(vm_config(
            3,
            r#""metrics":{"poll_ms":0},"retry_alternates":2"#,
        ))
        .unwrap();
    let s = chat(&vm, &text_body("hello")).send().unwrap();
    let dest = s.request_header(DEST).expect("destination");
    let listed: Vec<&str> = dest.split(',').collect();
    assert_eq!(listed.len(), 3, "{dest}");
    let mut sorted = listed.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, ADDRS.to_vec(), "each worker once");
    assert_eq!(
        s.response_header("x-mmrouter-worker"),
        Some(format!("w{}", worker_of(Some(listed[0]))).as_str()),
        "the chosen worker first"
    );
}

#[test]
fn nothing_from_the_request_reaches_the_log() {
    let host = host();
    let vm = host
        .vm(vm_config(
            2,
            r#""metrics":{"poll_ms":0},"decision_log":"info""#,
        ))
        .unwrap();
    // JSON escapes: a newline, a NUL and a carriage return once decoded.
    let evil = r"x\n[ROUTING] Best: evil with 9/9 blocks overlap\u0000\r";
    let body = format!(
        r#"{{"model":"{evil}","cache_salt":"{evil}","messages":[{{"role":"{evil}","content":"{evil}"}}]}}"#
    );
    chat(&vm, &body).send().unwrap();
    chat(&vm, &format!("{{\"model\":\"{evil}")).send().unwrap(); // a bad body too
    let logs = vm.logs();
    assert!(
        logs.iter()
            .any(|l| l.message.starts_with("[ROUTING] Best: w"))
    );
    assert!(
        logs.iter()
            .any(|l| l.message.starts_with("[ROUTING] Fallback: w"))
    );
    for l in &logs {
        assert!(!l.message.contains("evil"), "{:?}", l.message);
        assert!(!l.message.contains('\n'), "{:?}", l.message);
    }
}

#[test]
fn client_sent_steering_headers_never_reach_upstream() {
    let host = host();
    let vm = host.vm(vm_config(2, "")).unwrap();
    // On a routed path the filter's own value replaces the client's.
    let s = chat(&vm, &text_body("x"))
        .header(DEST, "6.6.6.6:1")
        .header("x-envoy-original-dst-host", "6.6.6.6:1")
        .send()
        .unwrap();
    let dest = s.request_header(DEST);
    assert_ne!(dest, Some("6.6.6.6:1"));
    worker_of(dest);
    assert_eq!(s.request_header("x-envoy-original-dst-host"), None);
    assert_eq!(s.upstream_request_headers().unwrap().get_all(DEST).len(), 1);
    // On a path the filter does not route, both are removed and nothing is set.
    let s = vm
        .request()
        .header(":method", "GET")
        .header(":path", "/health")
        .header(DEST, "6.6.6.6:1")
        .header("x-envoy-original-dst-host", "6.6.6.6:1")
        .send()
        .unwrap();
    assert_eq!(s.action(Callback::RequestHeaders), Some(Action::Continue));
    assert_eq!(s.request_header(DEST), None);
    assert_eq!(s.request_header("x-envoy-original-dst-host"), None);
}

#[test]
fn bodies_the_filter_cannot_use_fail_open_to_a_worker_and_are_counted_by_reason() {
    let host = host();
    let extra = r#""metrics":{"poll_ms":0},"limits":{"max_body_bytes":4096},"decision_log":"info""#;
    let vm = host.vm(vm_config(2, extra)).unwrap();

    let not_json = chat(&vm, "this is not json").send().unwrap();
    worker_of(not_json.request_header(DEST));
    assert_eq!(host.metric_value("mmrouter.fallback.bad_json"), Some(1));

    let big = text_body(&"a".repeat(10_000));
    let oversize = chat(&vm, &big).send().unwrap();
    worker_of(oversize.request_header(DEST));
    assert_eq!(
        oversize.upstream_body().len(),
        big.len(),
        "body forwarded whole"
    );
    assert_eq!(host.metric_value("mmrouter.fallback.too_large"), Some(1));

    let mut corrupt = png(64, 64, 16, 1);
    corrupt[20] ^= 0xff; // inside IHDR: its CRC no longer matches
    let bad_image = chat(&vm, &image_body(&b64(&corrupt), "what"))
        .send()
        .unwrap();
    worker_of(bad_image.request_header(DEST));
    assert_eq!(host.metric_value("mmrouter.fallback.bad_image"), Some(1));

    let bad_b64 = chat(&vm, &image_body("!!!notbase64!!!", "what"))
        .send()
        .unwrap();
    worker_of(bad_b64.request_header(DEST));
    assert_eq!(host.metric_value("mmrouter.fallback.bad_base64"), Some(1));

    assert!(vm.logs_containing("[ROUTING] Fallback").len() >= 4);
    assert!(vm.failure().is_none());
}

#[test]
fn oversize_bodies_are_decided_early_and_never_buffered_whole() {
    let host = host();
    let extra = r#""metrics":{"poll_ms":0},"limits":{"max_body_bytes":4096}"#;
    let vm = host.vm(vm_config(2, extra)).unwrap();
    let big = text_body(&"b".repeat(20_000));

    // Announced by content-length: routed at the headers, no pause, no body callback pauses.
    let announced = chat(&vm, &big)
        .header("content-length", &big.len().to_string())
        .send()
        .unwrap();
    assert_eq!(
        announced.action(Callback::RequestHeaders),
        Some(Action::Continue)
    );
    assert!(
        !announced
            .actions()
            .iter()
            .any(|(c, a)| *c == Callback::RequestBody && *a == Action::Pause),
        "{:?}",
        announced.actions()
    );
    worker_of(announced.request_header(DEST));
    assert_eq!(
        announced.upstream_body().len(),
        big.len(),
        "body forwarded whole"
    );

    // Chunked, no content-length: decided at the first chunk that crosses the limit; later
    // chunks flow on.
    let chunked = chat(&vm, &big).chunk_size(1024).send().unwrap();
    let body_actions: Vec<Action> = chunked
        .actions()
        .iter()
        .filter(|(c, _)| *c == Callback::RequestBody)
        .map(|(_, a)| *a)
        .collect();
    let pauses = body_actions
        .iter()
        .take_while(|a| **a == Action::Pause)
        .count();
    assert_eq!(
        pauses, 4,
        "paused until 4 KiB was buffered: {body_actions:?}"
    );
    assert!(
        body_actions[pauses..]
            .iter()
            .all(|a| *a == Action::Continue)
    );
    worker_of(chunked.request_header(DEST));
    assert_eq!(chunked.upstream_body().len(), big.len());
    assert_eq!(host.metric_value("mmrouter.fallback.too_large"), Some(2));
}

#[test]
fn without_allow_on_headers_stop_iteration_envoy_never_delivers_the_body() {
    // Envoy's default: a Pause from on_request_headers stops ALL iteration. The filter needs
    // `allow_on_headers_stop_iteration: true`; without it the request hangs, as in Envoy.
    let host = host();
    let vm = host
        .vm(VmConfig::new(plugin_config(2, "")).allow_on_headers_stop_iteration(false))
        .unwrap();
    let s = chat(&vm, &text_body("hi")).send().unwrap();
    assert!(!s.is_complete());
    assert!(!s.forwarded_upstream());
    assert_eq!(s.action(Callback::RequestBody), None);
    assert_eq!(vm.open_streams(), vec![s.id()]);
    let s = vm.reset(s.id()).unwrap();
    assert!(s.is_complete());
}

#[test]
fn an_invalid_plugin_configuration_is_refused() {
    let host = host();
    for bad in [
        r#"{"workers":[{"name":"w0","address":"127.0.0.1:8000"}],"no_such_key":1}"#,
        r#"{"workers":[{"name":"w0","address":"not an address"}]}"#,
        r#"{"paths":["/v1/chat/completions"]}"#,
        r#"{"mode":"precise","workers":[{"name":"w0","address":"127.0.0.1:8000"}]}"#,
        r#"{"sidecar":{"poll_ms":100,"timeout_ms":150}}"#,
        "not json",
    ] {
        match host.vm(bad) {
            Err(HostError::ConfigureRejected { logs }) => {
                assert!(!logs.is_empty(), "{bad}: refused without a log line");
            }
            other => panic!("{bad}: expected ConfigureRejected, got {other:?}"),
        }
    }
}

// ---- several VMs (Envoy worker threads) sharing state ----

#[test]
fn an_image_routed_by_one_vm_lands_on_the_same_worker_through_another_vm() {
    let host = host();
    let vm1 = host.vm(vm_config(3, "")).unwrap();
    let vm2 = host.vm(vm_config(3, "")).unwrap();
    for seed in 0..6 {
        let img = b64(&png(448, 448, 2048, seed));
        let body = image_body(&img, "describe the picture");
        let first = chat(&vm1, &body).send().unwrap();
        // The state writer applies the decision on its tick.
        host.advance(TICK).unwrap();
        let second = chat(&vm2, &body).send().unwrap();
        let (w1, w2) = (
            worker_of(first.request_header(DEST)),
            worker_of(second.request_header(DEST)),
        );
        assert_eq!(w1, w2, "image {seed}: VM 2 did not see VM 1's decision");
        let overlap = second.response_header("x-mmrouter-overlap").unwrap();
        let (matched, total) = overlap.split_once('/').unwrap();
        let (matched, total): (usize, usize) = (matched.parse().unwrap(), total.parse().unwrap());
        assert!(matched > 0 && matched <= total, "overlap {overlap}");
    }
    assert_eq!(host.metric_value("mmrouter.images"), Some(12));
}

#[test]
fn inflight_is_counted_while_a_request_is_open_and_released_at_its_end_or_reset() {
    let host = host();
    let vm = host.vm(vm_config(2, "")).unwrap();
    let img = b64(&png(448, 448, 512, 7));
    let a = chat(&vm, &image_body(&img, "a")).send_request().unwrap();
    assert!(a.forwarded_upstream() && !a.is_complete());
    let wa = worker_of(a.request_header(DEST));
    let mut expect = vec![0, 0];
    expect[wa] += 1;
    assert_eq!(inflight(&host, 2), expect);
    assert!(
        queued_us(&host, 2)[wa] > 0,
        "its prefill is on the queue clock"
    );

    // Normal end: in-flight released at the end of the stream.
    let a = vm
        .respond(a.id(), Response::new(200).body(b"{}".to_vec()))
        .unwrap();
    assert!(a.is_complete());
    assert_eq!(inflight(&host, 2), vec![0, 0]);
    assert_eq!(queued_us(&host, 2), vec![0, 0]);

    // Reset before any response: released exactly once, its prefill taken off the queue.
    let b = chat(&vm, &image_body(&img, "b")).send_request().unwrap();
    assert_eq!(inflight(&host, 2).iter().sum::<u32>(), 1);
    let b = vm.reset(b.id()).unwrap();
    assert!(b.is_complete() && b.was_reset());
    assert_eq!(inflight(&host, 2), vec![0, 0]);
    assert_eq!(queued_us(&host, 2), vec![0, 0]);
}

fn stream_body(text: &str) -> String {
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","stream":true,"messages":[{{"role":"user","content":"{text}"}}]}}"#
    )
}

#[test]
fn a_streams_first_chunk_ends_its_prefill_and_moves_what_queued_behind_it() {
    // One worker, two unrelated requests: the second queues behind the first on the clock.
    let host = host();
    let vm = host.vm(vm_config(1, "")).unwrap();
    let a = chat(&vm, &stream_body(&"alpha ".repeat(2000)))
        .send_request()
        .unwrap();
    let da = queued_us(&host, 1)[0];
    let b = chat(&vm, &stream_body(&"bravo ".repeat(2000)))
        .send_request()
        .unwrap();
    let db = queued_us(&host, 1)[0] - da;
    assert!(
        da > 10_000 && db > 10_000,
        "two prefills queued: {da} + {db} µs"
    );
    // The first token of A comes late, at 1.5× its estimate: B's start moves with it.
    host.advance(Duration::from_micros(da * 3 / 2)).unwrap();
    vm.respond(a.id(), Response::new(200).body(b"data: {}\n\n".to_vec()))
        .unwrap();
    let left = queued_us(&host, 1)[0];
    assert!(
        left.abs_diff(db) < 1_000,
        "B's prefill ({db} µs) now starts at A's real first token: {left} µs left"
    );
    // A went to an empty queue, so its first token measured the worker's speed: its tokens
    // (estimated at the default 10,000 tokens/s) over 1.5 times the estimate. B, queued
    // behind A, measures nothing.
    let peak = peak_speeds(&host, 1)[0];
    assert!(
        (peak - 10_000.0 / 1.5).abs() < 100.0,
        "the peak speed measured from A: {peak} tokens/s"
    );
    vm.reset(b.id()).unwrap();
    assert_eq!(
        queued_us(&host, 1),
        vec![0],
        "a reset takes its share off the queue"
    );
    assert_eq!(inflight(&host, 1), vec![0]);
}

#[test]
fn interleaved_decisions_on_three_vms_leave_the_load_table_consistent() {
    let host = host();
    let vms: Vec<Vm> = (0..3).map(|_| host.vm(vm_config(3, "")).unwrap()).collect();
    let mut open = Vec::new();
    for i in 0..30 {
        let vm = &vms[i % 3];
        let img = b64(&png(224, 224, 256, (i % 5) as u64));
        let s = chat(vm, &image_body(&img, &format!("q{i}")))
            .send_request()
            .unwrap();
        worker_of(s.request_header(DEST));
        open.push((i % 3, s.id()));
        assert_eq!(inflight(&host, 3).iter().sum::<u32>(), (i + 1) as u32);
    }
    let routed: i64 = (0..3)
        .map(|w| {
            host.metric_value(&format!("mmrouter.routed.w{w}"))
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(routed, 30);
    assert_eq!(host.metric_value("mmrouter.requests"), Some(30));
    // End them in another interleaving: odd ones reset, even ones answered.
    open.reverse();
    for (k, (v, id)) in open.iter().enumerate() {
        if k % 2 == 0 {
            vms[*v].respond(*id, Response::new(200)).unwrap();
        } else {
            vms[*v].reset(*id).unwrap();
        }
    }
    assert_eq!(inflight(&host, 3), vec![0, 0, 0]);
    assert_eq!(queued_us(&host, 3), vec![0, 0, 0]);
    assert_eq!(
        host.metric_value("mmrouter.state_unrecorded").unwrap_or(0),
        0
    );
}

#[test]
fn lost_cas_races_are_retried_and_no_update_is_lost() {
    let host = host();
    let vm1 = host.vm(vm_config(2, "")).unwrap();
    let vm2 = host.vm(vm_config(2, "")).unwrap();
    // Another "thread" wins the next 5 races on the load table.
    host.race_shared_data(".load", 5);
    let a = chat(&vm1, &text_body("a")).send_request().unwrap();
    let b = chat(&vm2, &text_body("b")).send_request().unwrap();
    assert_eq!(inflight(&host, 2).iter().sum::<u32>(), 2);
    assert_eq!(
        host.races_left(),
        0,
        "the filter read the load table 5 times or more"
    );
    vm1.reset(a.id()).unwrap();
    vm2.respond(b.id(), Response::new(200)).unwrap();
    assert_eq!(inflight(&host, 2), vec![0, 0]);
    assert_eq!(
        host.metric_value("mmrouter.state_unrecorded").unwrap_or(0),
        0
    );
}

// ---- the state writer: lease, decisions, /metrics polls, the sidecar's feed ----

const POLL: &str = r#""metrics":{"poll_ms":500,"timeout_ms":400,"cluster":"mmrouter_endpoint","unhealthy_after":3}"#;

fn vllm_metrics(waiting: u32) -> String {
    format!(
        "# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\nvllm:num_requests_running{{model_name=\"m\"}} 1\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} 0.5\n"
    )
}

/// The VM holding the writer lease: the one with pending calls after a tick.
fn the_poller<'a>(a: &'a Vm, b: &'a Vm) -> &'a Vm {
    match (a.http_calls().is_empty(), b.http_calls().is_empty()) {
        (false, true) => a,
        (true, false) => b,
        other => panic!("exactly one VM holds the writer lease: {other:?}"),
    }
}

#[test]
fn one_vm_polls_every_worker_on_its_tick_and_engine_load_steers_routing() {
    let host = host();
    let vm1 = host.vm(vm_config(2, POLL)).unwrap();
    let vm2 = host.vm(vm_config(2, POLL)).unwrap();
    assert_eq!(vm1.tick_period(), Some(TICK));
    host.advance(TICK).unwrap();
    let poller = the_poller(&vm1, &vm2);
    let calls = poller.http_calls();
    assert_eq!(calls.len(), 2);
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(call.upstream, "mmrouter_endpoint");
        assert_eq!(call.headers.get(":method"), Some("GET"));
        assert_eq!(call.headers.get(":path"), Some("/metrics"));
        assert_eq!(call.headers.get(":authority"), Some(ADDRS[i]));
        assert_eq!(call.headers.get(DEST), Some(ADDRS[i]));
        assert_eq!(call.timeout, Duration::from_millis(400));
    }
    // w0 is drowning, w1 is idle.
    poller
        .answer_http_call(
            calls[0].token,
            HttpResponse::new(200).body(vllm_metrics(500)),
        )
        .unwrap();
    poller
        .answer_http_call(calls[1].token, HttpResponse::new(200).body(vllm_metrics(0)))
        .unwrap();
    assert_eq!(host.metric_value("mmrouter.polls_ok"), Some(2));
    for i in 0..6 {
        let vm = if i % 2 == 0 { &vm1 } else { &vm2 };
        let s = chat(vm, &text_body(&format!("t{i}"))).send().unwrap();
        assert_eq!(s.request_header(DEST), Some(ADDRS[1]), "request {i}");
    }
    // Only the lease holder polls, every poll_ms, never more.
    host.advance(Duration::from_millis(480)).unwrap();
    assert!(vm1.http_calls().is_empty() && vm2.http_calls().is_empty());
    host.advance(TICK).unwrap();
    assert_eq!(the_poller(&vm1, &vm2).http_calls().len(), 2);
}

#[test]
fn poll_timeouts_failures_and_garbage_count_as_failed_and_make_a_worker_unhealthy() {
    let host = host();
    let vm = host.vm(vm_config(2, POLL)).unwrap();
    for round in 0..3 {
        // to the next poll (every 500 ms from the first tick)
        while vm.http_calls().is_empty() {
            host.advance(TICK).unwrap();
        }
        let calls = vm.http_calls();
        assert_eq!(calls.len(), 2, "round {round}");
        // w1 answers well every time; w0 times out, fails, then answers garbage.
        vm.answer_http_call(calls[1].token, HttpResponse::new(200).body(vllm_metrics(0)))
            .unwrap();
        match round {
            0 => host.advance(Duration::from_millis(400)).unwrap(), // timeout
            1 => vm.fail_http_call(calls[0].token).unwrap(),
            _ => vm
                .answer_http_call(
                    calls[0].token,
                    HttpResponse::new(200).body("<html>not metrics</html>"),
                )
                .unwrap(),
        }
        assert!(
            vm.http_calls().is_empty(),
            "round {round}: a call is left pending"
        );
    }
    assert_eq!(host.metric_value("mmrouter.polls_failed"), Some(3));
    assert_eq!(host.metric_value("mmrouter.polls_ok"), Some(3));
    // One log line, when w0 turned unhealthy (with the last reason), not one per failure.
    let lines = vm.logs_containing("is unhealthy");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].message.contains("w0")
            && lines[0].message.contains("no vllm:num_requests_waiting"),
        "{:?}",
        lines[0].message
    );
    // w0 failed 3 polls in a row: unhealthy, so everything goes to w1, even with load on w1.
    let mut open = Vec::new();
    for i in 0..4 {
        let s = chat(&vm, &text_body(&format!("u{i}")))
            .send_request()
            .unwrap();
        assert_eq!(s.request_header(DEST), Some(ADDRS[1]), "request {i}");
        open.push(s.id());
    }
    for id in open {
        vm.reset(id).unwrap();
    }
    assert!(vm.failure().is_none());
}

#[test]
fn a_writer_that_stops_renewing_its_lease_is_replaced() {
    let host = host();
    let keys = Keys::new(StateConfig::default().namespace(16));
    // A writer on a VM that died: its lease runs until t + 1 s.
    let mut lease = 0xdead_u64.to_le_bytes().to_vec();
    lease.extend_from_slice(&(proxy_wasm_host::DEFAULT_EPOCH_SECS * 1000 + 1000).to_le_bytes());
    host.set_shared_data("", &keys.lease(), &lease, 0);
    let vm = host.vm(vm_config(2, POLL)).unwrap();
    host.advance(Duration::from_millis(980)).unwrap();
    assert!(
        vm.http_calls().is_empty(),
        "the lease is still held elsewhere"
    );
    // Decisions wait in the queue meanwhile: a follow-up does not see the first request's
    // blocks (only an exact repeat would, through the last key its VM recorded itself).
    let img = b64(&png(320, 320, 256, 3));
    let first = chat(&vm, &image_body(&img, "q")).send().unwrap();
    let longer = "q, and then a much longer follow-up question about the same picture";
    let follow = chat(&vm, &image_body(&img, longer)).send().unwrap();
    assert!(
        follow
            .response_header("x-mmrouter-overlap")
            .unwrap()
            .starts_with("0/")
    );
    host.advance(Duration::from_millis(40)).unwrap();
    assert_eq!(vm.http_calls().len(), 2, "taken over: it polls");
    assert_eq!(host.metric_value("mmrouter.decisions_applied"), Some(2));
    let again = chat(&vm, &image_body(&img, &format!("{longer}?")))
        .send()
        .unwrap();
    let overlap = again.response_header("x-mmrouter-overlap").unwrap();
    assert!(!overlap.starts_with("0/"), "{overlap}");
    assert!(
        again.request_header(DEST) == first.request_header(DEST)
            || again.request_header(DEST) == follow.request_header(DEST)
    );
}

fn feed_bytes(cursor: u64, workers: &[(&str, &str, u32)]) -> Vec<u8> {
    feed::encode(&Feed {
        snapshot: true,
        epoch: 7,
        cursor,
        now_ms: 0,
        workers: workers
            .iter()
            .map(|(name, address, waiting)| FeedWorker {
                name: (*name).into(),
                address: (*address).into(),
                healthy: true,
                metrics_valid: true,
                capacity: 4096,
                block_size: 16,
                waiting: *waiting as f32,
                prefill_tps: 10_000.0,
                ..FeedWorker::default()
            })
            .collect(),
        images: Vec::new(),
    })
}

#[test]
fn the_sidecar_feed_drives_membership_and_a_stale_feed_falls_back_to_approximate() {
    let host = host();
    let config = r#"{"sidecar":{"cluster":"mmrouter_sidecar","poll_ms":100,"timeout_ms":90,"stale_ms":300},
        "metrics":{"poll_ms":200,"timeout_ms":150},"response_headers":true}"#;
    let vm = host
        .vm(VmConfig::new(config).allow_on_headers_stop_iteration(true))
        .unwrap();
    // No worker known yet: the request takes Envoy's default route.
    let s = chat(&vm, &text_body("early")).send().unwrap();
    assert_eq!(s.request_header(DEST), None);
    assert_eq!(host.metric_value("mmrouter.no_worker"), Some(1));
    host.advance(TICK).unwrap();
    let calls = vm.http_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].upstream, "mmrouter_sidecar");
    assert_eq!(calls[0].headers.get(":path"), Some("/v1/feed?since=0"));
    vm.answer_http_call(
        calls[0].token,
        HttpResponse::new(200).body(feed_bytes(11, &[("a", ADDRS[0], 0), ("b", ADDRS[1], 900)])),
    )
    .unwrap();
    assert_eq!(host.metric_value("mmrouter.workers_joined"), Some(2));
    let s = chat(&vm, &text_body("now")).send().unwrap();
    assert_eq!(
        s.request_header(DEST),
        Some(ADDRS[0]),
        "b's engine queue is long"
    );
    assert!(
        s.response_header("x-mmrouter-decision")
            .unwrap()
            .contains("mode=precise")
    );
    // The next poll asks from the cursor; b leaves, c joins.
    host.advance(Duration::from_millis(100)).unwrap();
    let calls = vm.http_calls();
    assert_eq!(calls[0].headers.get(":path"), Some("/v1/feed?since=11"));
    vm.answer_http_call(
        calls[0].token,
        HttpResponse::new(200).body(feed_bytes(12, &[("a", ADDRS[0], 900), ("c", ADDRS[2], 0)])),
    )
    .unwrap();
    let s = chat(&vm, &text_body("later")).send().unwrap();
    assert_eq!(s.request_header(DEST), Some(ADDRS[2]));
    assert_eq!(host.metric_value("mmrouter.workers_left"), Some(1));
    // The sidecar goes away: its polls fail; after stale_ms the writer polls the workers
    // itself and requests still route (approximate).
    for _ in 0..8 {
        host.advance(Duration::from_millis(50)).unwrap();
        for c in vm.http_calls() {
            if c.upstream == "mmrouter_sidecar" {
                vm.fail_http_call(c.token).unwrap();
            }
        }
    }
    let worker_polls: Vec<_> = vm
        .http_calls()
        .into_iter()
        .filter(|c| c.upstream == "mmrouter_endpoint")
        .collect();
    assert_eq!(worker_polls.len(), 2, "polling a and c directly");
    let s = chat(&vm, &text_body("stale")).send().unwrap();
    worker_of(s.request_header(DEST));
    assert!(
        s.response_header("x-mmrouter-decision")
            .unwrap()
            .contains("mode=approximate")
    );
    assert!(
        host.metric_value("mmrouter.routed_approximate")
            .unwrap_or(0)
            >= 1
    );
    assert!(!vm.logs_containing("routing in approximate mode").is_empty());
    // It comes back.
    for c in vm.http_calls() {
        vm.fail_http_call(c.token).unwrap();
    }
    while !vm
        .http_calls()
        .iter()
        .any(|c| c.upstream == "mmrouter_sidecar")
    {
        host.advance(TICK).unwrap();
    }
    for c in vm.http_calls() {
        if c.upstream == "mmrouter_sidecar" {
            vm.answer_http_call(
                c.token,
                HttpResponse::new(200)
                    .body(feed_bytes(13, &[("a", ADDRS[0], 0), ("c", ADDRS[2], 0)])),
            )
            .unwrap();
        }
    }
    host.advance(TICK).unwrap();
    let s = chat(&vm, &text_body("back")).send().unwrap();
    assert!(
        s.response_header("x-mmrouter-decision")
            .unwrap()
            .contains("mode=precise")
    );
    assert!(vm.failure().is_none());
}

// ---- memory ----

#[test]
fn a_thousand_requests_with_1mib_inline_images_keep_linear_memory_bounded() {
    let host = host();
    let vm = host.vm(vm_config(2, "").log_level(LogLevel::Warn)).unwrap();
    let start = vm.memory_bytes();
    let img = b64(&png(1024, 1024, 1 << 20, 42));
    let base = image_body(&img, "what is in this picture?");
    let pos = base.find("base64,").unwrap() + 7 + 4096; // a spot inside the image data
    let mut after_100 = 0;
    let mut high = 0;
    let mut samples = Vec::new();
    for i in 0..1000u32 {
        // A different image each time: overwrite 8 base64 characters.
        let mut body = base.clone().into_bytes();
        let tag = format!("{:08X}", i.wrapping_mul(2_654_435_761));
        body[pos..pos + 8].copy_from_slice(tag.as_bytes());
        let s = vm
            .request()
            .header(":path", "/v1/chat/completions")
            .body(&body)
            .chunk_size(64 * 1024)
            .send()
            .unwrap();
        assert!(s.request_header(DEST).is_some(), "request {i}");
        if i % 10 == 9 {
            host.advance(TICK).unwrap();
        }
        high = high.max(vm.memory_bytes());
        if i == 99 {
            after_100 = vm.memory_bytes();
        }
        if (i + 1) % 100 == 0 {
            samples.push(vm.memory_bytes());
        }
    }
    assert_eq!(host.metric_value("mmrouter.images"), Some(1000));
    assert_eq!(
        host.metric_value("mmrouter.fallback.bad_image")
            .unwrap_or(0),
        0
    );
    assert_eq!(host.metric_value("mmrouter.decisions_applied"), Some(1000));
    // The VM reports its linear memory on its tick.
    let reported: Vec<i64> = host
        .metrics()
        .iter()
        .filter(|(name, _)| name.starts_with("mmrouter.vm_memory_bytes."))
        .filter_map(|(name, _)| host.metric_value(name))
        .collect();
    assert_eq!(reported, vec![vm.memory_bytes() as i64]);
    eprintln!(
        "linear memory: {start} B at start, {after_100} B after 100 requests, {high} B high-water after 1000 (body {} B); every 100: {samples:?}; shared data {} B",
        base.len(),
        host.shared_data_bytes()
    );
    // Bounded: a plateau is reached (nothing grows over the last 500 requests) and the
    // warm-up costs at most 2 MiB more than the first 100 requests did.
    assert_eq!(samples[4], samples[9], "memory still growing: {samples:?}");
    assert!(
        high <= after_100 + (2 << 20),
        "memory grew from {after_100} to {high} bytes"
    );
    assert!(high < 16 << 20, "high-water {high} bytes");
    assert!(vm.failure().is_none());
}

// ---- host calls per request (issue 12: O(1), counted) ----

fn print_calls(label: &str, s: &proxy_wasm_host::Exchange) {
    let calls = s.host_calls();
    eprintln!("{label}: {} host calls", calls.total());
    for (callback, import, n) in calls.iter() {
        eprintln!("  {callback:32} {import:40} {n}");
    }
}

#[test]
fn host_calls_per_request_are_few_and_do_not_grow_with_the_body() {
    let host = host();
    let vm = host.vm(vm_config(3, "")).unwrap();
    // Warm up: membership read, first decisions.
    chat(&vm, &text_body("warm up")).send().unwrap();
    let text = chat(&vm, &text_body(&"hello world ".repeat(150)))
        .chunk_size(1 << 20)
        .send()
        .unwrap();
    let small = b64(&png(64, 64, 256, 1));
    let image = chat(&vm, &image_body(&small, "what is it"))
        .chunk_size(1 << 20)
        .send()
        .unwrap();
    let big = b64(&png(1024, 1024, 1 << 20, 2));
    let large = chat(&vm, &image_body(&big, "what is it"))
        .chunk_size(64 * 1024)
        .send()
        .unwrap();
    // With a system prompt the request belongs to a group: its home is read and counted.
    let system = format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"hi"}}]}}"#,
        "You are a careful assistant. ".repeat(20)
    );
    let grouped = chat(&vm, &system).chunk_size(1 << 20).send().unwrap();
    print_calls("text", &text);
    print_calls("text with a system prompt", &grouped);
    print_calls("small image", &image);
    print_calls("1 MiB image in 64 KiB pieces", &large);
    let total = |s: &proxy_wasm_host::Exchange| s.host_calls().total();
    // Pinned: a request costs this many host calls at most (the routing decision reads the
    // live and load tables and a few buckets, updates the load table, records its last key,
    // enqueues the decision, sets the destination header, counts its metrics; at the end it
    // reads the answer's status and the live table to see whether its freed blocks need a
    // new stamp).
    assert!(total(&text) <= 28, "text: {}", total(&text));
    // The homes table (scoring.home_hold): one read and one CAS write more.
    assert!(
        total(&grouped) <= 30,
        "with a system prompt: {}",
        total(&grouped)
    );
    assert_eq!(
        grouped.host_calls().count("proxy_set_shared_data"),
        text.host_calls().count("proxy_set_shared_data") + 1,
        "one more shared-data write: the home's count"
    );
    assert!(total(&image) <= 28, "image: {}", total(&image));
    // The body pieces cost one read each; nothing else grows with the body.
    let pieces = large.host_calls().count("proxy_get_buffer_bytes");
    assert!(pieces >= 16, "{pieces}");
    assert!(
        total(&large) - pieces <= total(&image),
        "{} - {pieces} > {}",
        total(&large),
        total(&image)
    );
}

#[test]
fn a_body_envoy_buffered_whole_is_read_in_windows_not_copied_into_the_vm_at_once() {
    // A fast client: Envoy has the whole 1.4 MB body when the filter first sees it. The filter
    // copies it into the VM a window at a time, so the VM's memory does not grow by the body.
    let host = host();
    let vm = host.vm(vm_config(2, "").log_level(LogLevel::Warn)).unwrap();
    chat(&vm, &text_body("warm up")).send().unwrap();
    let start = vm.memory_bytes();
    let img = b64(&png(1024, 1024, 1 << 20, 7));
    let body = image_body(&img, "what is it");
    let s = chat(&vm, &body).chunk_size(body.len()).send().unwrap();
    assert!(s.request_header(DEST).is_some());
    assert_eq!(host.metric_value("mmrouter.images"), Some(1));
    let reads = s.host_calls().count("proxy_get_buffer_bytes") as usize;
    let windows = body.len().div_ceil(256 * 1024);
    assert_eq!(reads, windows, "{} bytes", body.len());
    let grown = vm.memory_bytes() - start;
    assert!(
        grown < body.len() / 2,
        "linear memory grew by {grown} bytes for a {} byte body",
        body.len()
    );
}

#[test]
fn with_stamp_uuid_image_parts_carry_the_content_id_and_content_length_follows() {
    let host = host();
    let vm = host
        .vm(vm_config(2, r#""metrics":{"poll_ms":0},"stamp_uuid":true"#))
        .unwrap();
    let img = b64(&png(200, 100, 4096, 9));
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"look"}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{img}"}}}},{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{img}"}},"uuid":"mine"}}]}}]}}"#
    );
    let s = chat(&vm, &body)
        .header("content-length", &body.len().to_string())
        .chunk_size(1024)
        .send()
        .unwrap();
    let sent = s.upstream_body();
    let v: serde_json::Value = serde_json::from_slice(sent).expect("the stamped body is JSON");
    let parts = &v["messages"][0]["content"];
    let id = parts[1]["uuid"].as_str().expect("stamped");
    assert_eq!(id.len(), 32);
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(parts[2]["uuid"], "mine", "a client's uuid is kept");
    assert_eq!(
        s.request_header("content-length"),
        Some(sent.len().to_string().as_str())
    );
    assert_eq!(sent.len(), body.len() + r#""uuid":"","#.len() + 32);
    assert_eq!(host.metric_value("mmrouter.uuids_stamped"), Some(1));
    // Off by default without a sidecar: the body goes upstream untouched.
    let plain = host.vm(vm_config(2, "")).unwrap();
    let s = chat(&plain, &body).send().unwrap();
    assert_eq!(s.upstream_body(), body.as_bytes());
}
