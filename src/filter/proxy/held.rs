//! Requests held for their images by URL (`fetch.enabled`): the GETs sent through the proxy,
//! their answers read in pieces, the held request settled and resumed, or given up at its
//! deadline on a tick.

use super::host::now_us;
use super::{FilterStream, Shared, apply, stamp_uuids};
use crate::analysis::{Analysis, AnalyzeError, ImageDigest, Overrides, Scanned};
use crate::filter::fetch::guard::{REFUSED_HEADER, Target};
use crate::filter::fetch::{FetchConfig, Plan, Reply, Step};
use crate::filter::router::Decision;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};
use std::time::Duration;
use xxhash_rust::xxh3::xxh3_64;

/// A request held until its images by URL are fetched (or its deadline).
pub(super) struct Waiting {
    pub(super) scanned: Scanned,
    pub(super) plan: Plan,
    /// Media index → URL, for a URL waited for that must be claimed again.
    pub(super) urls: Vec<(usize, String)>,
    pub(super) body_size: usize,
    pub(super) content_length: Option<usize>,
    pub(super) random: u64,
    /// Some image waited for another request's fetch.
    pub(super) waited: bool,
}

/// Bytes of a fetched image copied into the VM at a time.
const FETCH_PIECE: usize = 64 << 10;

/// Sends the GETs `plan` asks for, from the current context.
pub(super) fn dispatch_fetches(plan: &mut Plan, s: &Shared, now_ms: u64) {
    let config = &s.router.config.fetch;
    for (pos, target) in plan.to_send() {
        let left = plan.deadline_ms.saturating_sub(now_ms).max(1);
        let timeout = config.timeout_ms.min(left);
        let token = fetch_get(config, &target, timeout);
        plan.sent(pos, token, config, &s.store, s.router.keys(), now_ms);
    }
}

fn fetch_get(config: &FetchConfig, target: &Target, timeout_ms: u64) -> Option<u32> {
    let cluster = config.cluster_for(target);
    let address = match target.host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(_)) => format!("[{}]:{}", target.host, target.port),
        _ => format!("{}:{}", target.host, target.port),
    };
    let mut headers = vec![
        (":method", "GET"),
        (":path", target.path.as_str()),
        (":authority", target.authority.as_str()),
        (":scheme", target.scheme.name()),
        ("accept", "image/*"),
        // Names the fetcher to image servers (and lets tests tell it from the workers' GETs).
        ("user-agent", "mmrouter-fetch"),
    ];
    if FetchConfig::by_address(target) {
        headers.push((config.address_header.as_str(), address.as_str()));
    }
    hostcalls::dispatch_http_call(
        &cluster,
        headers,
        None,
        vec![],
        Duration::from_millis(timeout_ms),
    )
    .ok()
}

/// Reads the answer to a fetch now being delivered: status, and the image read in pieces
/// (hashed and its header read as they come, nothing kept).
fn read_fetch_reply(num_headers: usize, body_size: usize, max_bytes: u32) -> Reply {
    if num_headers == 0 {
        return Reply::None;
    }
    let header = |name: &str| {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, name)
            .ok()
            .flatten()
    };
    let status = header(":status").and_then(|v| v.parse::<u16>().ok());
    if let Some(refusal) = Reply::refusal(status, header(REFUSED_HEADER).as_deref()) {
        return Reply::Refused(refusal);
    }
    match status {
        Some(200) => {}
        Some(301 | 302 | 303 | 307 | 308) => {
            return match header("location") {
                Some(l) => Reply::Redirect(l),
                None => Reply::Status,
            };
        }
        _ => return Reply::Status,
    }
    if body_size > max_bytes as usize {
        return Reply::TooLarge;
    }
    let mut digest = ImageDigest::new();
    let mut at = 0;
    while at < body_size {
        let n = FETCH_PIECE.min(body_size - at);
        match hostcalls::get_buffer(BufferType::HttpCallResponseBody, at, n) {
            Ok(Some(piece)) if !piece.is_empty() => {
                at += piece.len();
                digest.feed(&piece);
            }
            _ => return Reply::None,
        }
    }
    Reply::Image(digest.finish())
}

impl FilterStream {
    /// The request's images by URL (fetching on): fetched in parallel, or found in the shared
    /// cache. None when the request waits (held in `s.waiting` until settled or its deadline),
    /// else the settled request to route now.
    pub(super) fn plan_fetches(
        &mut self,
        s: &mut Shared,
        scanned: Scanned,
        now_us: u64,
        random: u64,
    ) -> Option<Waiting> {
        let urls: Vec<(usize, String)> = match &s.guard {
            Some(_) => scanned
                .url_images()
                .into_iter()
                .map(|(i, u)| (i, u.to_string()))
                .collect(),
            None => Vec::new(),
        };
        let now_ms = now_us / 1000;
        let mut plan = match &s.guard {
            Some(guard) if !urls.is_empty() => {
                let refs: Vec<(usize, &str)> = urls.iter().map(|(i, u)| (*i, u.as_str())).collect();
                let claim = xxh3_64(
                    &[
                        s.holder.to_le_bytes(),
                        u64::from(self.context_id).to_le_bytes(),
                        now_us.to_le_bytes(),
                    ]
                    .concat(),
                );
                Plan::new(
                    &refs,
                    &s.router.config.fetch,
                    guard,
                    &s.store,
                    s.router.keys(),
                    claim,
                    now_ms,
                )
            }
            _ => Plan::empty(),
        };
        dispatch_fetches(&mut plan, s, now_ms);
        let waited = plan.items.iter().any(|i| i.step == Step::Waiting);
        let w = Waiting {
            scanned,
            plan,
            urls,
            body_size: self.body_size,
            content_length: self.content_length,
            random,
            waited,
        };
        if w.plan.settled() {
            return Some(w);
        }
        s.waiting.insert(self.context_id, w);
        None
    }
}

/// Routes a request whose images by URL are settled: analysis with the fetched identities,
/// decision, stamping, destination header. `ctx`: the held stream's id when this runs outside
/// its own callbacks (the decision is then kept in `s.decided` and the request resumed).
/// Returns the decision when `ctx` is None.
pub(super) fn complete(s: &mut Shared, w: Waiting, ctx: Option<u32>) -> Option<Decision> {
    if let Some(ctx) = ctx {
        let _ = hostcalls::set_effective_context(ctx);
    }
    let Waiting {
        scanned,
        plan,
        body_size,
        content_length,
        random,
        waited,
        ..
    } = w;
    let result: Result<Analysis, AnalyzeError> = scanned.finish(
        &s.router.config.router,
        Overrides::default(),
        &plan.fetched(),
    );
    let (decision, analysis) = s.router.route_analyzed(result, &s.store, now_us(), random);
    if let Some(a) = &analysis {
        s.metrics.skipped(a.skipped_count);
        if s.router.config.stamp_uuid && decision.is_some() {
            stamp_uuids(a, body_size, content_length, s);
        }
    }
    if !plan.items.is_empty() {
        s.metrics.fetch(&plan, waited);
    }
    let decision = apply(s, decision, Some(&plan));
    match ctx {
        None => decision,
        Some(ctx) => {
            if let Some(d) = decision {
                s.decided.insert(ctx, d);
            }
            let _ = hostcalls::resume_http_request();
            None
        }
    }
}

/// The answer to a fetch of held stream `ctx`.
pub(super) fn on_fetch_reply(
    s: &mut Shared,
    ctx: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    from_root: bool,
) {
    let Some(mut w) = s.waiting.remove(&ctx) else {
        return;
    };
    let reply = read_fetch_reply(num_headers, body_size, s.router.config.fetch.max_bytes);
    let now_ms = now_us() / 1000;
    if let Some(guard) = &s.guard {
        w.plan.on_reply(
            token,
            reply,
            &s.router.config.fetch,
            guard,
            &s.store,
            s.router.keys(),
            now_ms,
        );
    }
    if from_root {
        // Sent from the root context, their answers come back to it.
        dispatch_fetches(&mut w.plan, s, now_ms);
    } else {
        let _ = hostcalls::set_effective_context(ctx);
        dispatch_fetches(&mut w.plan, s, now_ms);
    }
    settle_or_hold(s, ctx, w);
}

fn settle_or_hold(s: &mut Shared, ctx: u32, w: Waiting) {
    if w.plan.settled() {
        complete(s, w, Some(ctx));
    } else {
        s.waiting.insert(ctx, w);
    }
}

/// On the root's tick: the held requests look again at the URLs they wait for (another
/// request's fetch), take over claims that expired, and give up at their deadline.
pub(super) fn poll_waiting(s: &mut Shared) {
    if s.waiting.is_empty() {
        return;
    }
    let Some(guard) = s.guard.clone() else {
        return;
    };
    let now_ms = now_us() / 1000;
    let ids: Vec<u32> = s.waiting.keys().copied().collect();
    for ctx in ids {
        let Some(mut w) = s.waiting.remove(&ctx) else {
            continue;
        };
        let urls = w.urls.clone();
        let url_of = move |i: usize| urls.iter().find(|(j, _)| *j == i).map(|(_, u)| u.clone());
        w.plan.poll(
            &s.router.config.fetch,
            &guard,
            &s.store,
            s.router.keys(),
            now_ms,
            &url_of,
        );
        // Sent from the root context: their answers come to the root, which hands them on.
        dispatch_fetches(&mut w.plan, s, now_ms);
        settle_or_hold(s, ctx, w);
    }
}
