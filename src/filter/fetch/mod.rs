//! Fetching http(s) images in the filter, so that an image given by URL is identified by its
//! bytes (the same content id as inline) and sized from its header.
//!
//! - [`guard`]: which URLs may be fetched at all (the SSRF guard, on by default).
//! - [`FetchConfig`]: the `fetch` object of the filter configuration.
//! - [`Plan`]: one request's images by URL, from the shared URL cache
//!   ([`crate::state::urls`]) to a fetch (through `dispatch_http_call`), a wait for another
//!   request's fetch of the same URL, or a fall-back to the URL identity. Host-independent:
//!   the proxy shell sends the GETs the plan asks for and hands back what came.
//!
//! Data flow of one request (`fetch.enabled`):
//! 1. The body is scanned to its end; its images by URL are listed in request order.
//! 2. Each URL goes through the guard (refused: fall back, counted by reason), then the cache:
//!    a fetched entry gives the identity and size at once; a failure cached in the last
//!    `failure_ttl_ms` falls back at once; a URL another request is fetching is waited for;
//!    a miss is claimed (one CAS on its bucket: exactly one request per process wins) and
//!    fetched. The request's fetches run in parallel.
//! 3. A response is read up to `max_bytes` (the whole file when under the cap): xxh3-128 of
//!    all its bytes and the header's size. Larger files, failures, non-200 answers and
//!    timeouts fall back to the URL identity and estimated size; the result is cached.
//! 4. When every image is settled, or at the request's deadline (`deadline_ms` after the
//!    body ended, whichever comes first), the request is routed with what is known.

pub mod guard;

use crate::analysis::FetchedImage;
use crate::config::ConfigError;
use crate::state::urls::{self, Claim, Lookup, UrlCacheConfig, UrlState};
use crate::state::{Keys, SharedStore};
use guard::{Guard, Refusal, Target};

/// The `fetch` object of the filter configuration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FetchConfig {
    /// Fetch http(s) images (default false in the filter; `./scripts/run` turns it on).
    pub enabled: bool,
    /// Envoy cluster the GETs go through (default `mmrouter_fetch`). `envoy/render.py`
    /// renders it as an ORIGINAL_DST cluster reading `address_header`, for targets written as
    /// IP addresses; `<cluster>_dns` as a dynamic forward proxy for names allowed by an exact
    /// entry; `<cluster>_guard` as the guard listener (resolves, refuses special-use addresses,
    /// then the dynamic forward proxy) for names allowed only by a wildcard.
    pub cluster: String,
    /// Header carrying `ip:port` to the ORIGINAL_DST cluster (default
    /// `x-mmrouter-fetch-address`).
    pub address_header: String,
    /// Schemes fetched (default `http`, `https`; nothing else is possible).
    pub schemes: Vec<String>,
    /// Host patterns allowed ([`guard::HostPattern`]; default `*`: every public host on its
    /// scheme's default port).
    pub allow: Vec<String>,
    /// Bytes read of one image at most (default 20 MiB). A larger image is not identified by
    /// its bytes: it falls back to its URL identity (reason `too_large`).
    pub max_bytes: u32,
    /// Images fetched (GETs) per request at most (default 8); the others fall back. Images
    /// the shared cache already holds do not count.
    pub max_images: usize,
    /// Timeout of one GET, ms (default 2000).
    pub timeout_ms: u64,
    /// The longest a request waits for its images, ms after its body ended (default 3000).
    pub deadline_ms: u64,
    /// Redirects followed per image (default 0: a 3xx is a failure). Every hop goes through
    /// the guard again.
    pub max_redirects: u8,
    pub cache: UrlCacheConfig,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            enabled: false,
            cluster: "mmrouter_fetch".into(),
            address_header: "x-mmrouter-fetch-address".into(),
            schemes: vec!["http".into(), "https".into()],
            allow: vec!["*".into()],
            max_bytes: 20 << 20,
            max_images: 8,
            timeout_ms: 2000,
            deadline_ms: 3000,
            max_redirects: 0,
            cache: UrlCacheConfig::default(),
        }
    }
}

impl FetchConfig {
    /// Checks the configuration and builds its guard.
    pub fn guard(&self) -> Result<Guard, ConfigError> {
        if self.cluster.is_empty() || self.address_header.is_empty() {
            return Err(ConfigError::new(
                "fetch.cluster",
                "cluster and address_header must not be empty",
            ));
        }
        if self.timeout_ms == 0 || self.deadline_ms == 0 || self.max_bytes == 0 {
            return Err(ConfigError::new(
                "fetch.timeout_ms",
                "timeout_ms, deadline_ms and max_bytes must be > 0",
            ));
        }
        self.cache.validate()?;
        Guard::new(&self.schemes, &self.allow)
    }

    /// The cluster a target goes through: `<cluster>` (ORIGINAL_DST, to the address in
    /// `address_header`) for a target written as an IP address (the guard has checked it);
    /// for a name, `<cluster>_dns` (Envoy's dynamic forward proxy) when an exact entry allowed
    /// it ([`Target::trusted`]), else `<cluster>_guard` (the guard listener, which refuses a
    /// name that resolves to a special-use address); `_tls` appended for https.
    pub fn cluster_for(&self, target: &Target) -> String {
        let mut name = self.cluster.clone();
        if target.host.parse::<std::net::IpAddr>().is_err() {
            name.push_str(if target.trusted { "_dns" } else { "_guard" });
        }
        if target.scheme == guard::Scheme::Https {
            name.push_str("_tls");
        }
        name
    }

    /// Whether a target goes to the ORIGINAL_DST cluster (and carries `address_header`).
    pub fn by_address(target: &Target) -> bool {
        target.host.parse::<std::net::IpAddr>().is_ok()
    }
}

/// Why an image was not identified by its bytes (the `<reason>` of
/// `mmrouter.fetch_failed.<reason>`; guard refusals are `mmrouter.fetch_refused.<reason>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    Refused(Refusal),
    /// No answer: connection failure, reset, or the per-fetch timeout (Envoy reports each
    /// as a response without headers).
    NoResponse,
    /// An answer other than 200 (a 3xx when redirects are off or exhausted).
    Status,
    /// Larger than `max_bytes`.
    TooLarge,
    /// Not an image whose header the router reads.
    NotImage,
    /// The request's deadline came first.
    Deadline,
}

impl Failure {
    pub fn reason(self) -> &'static str {
        match self {
            Failure::Refused(r) => r.reason(),
            Failure::NoResponse => "no_response",
            Failure::Status => "status",
            Failure::TooLarge => "too_large",
            Failure::NotImage => "not_image",
            Failure::Deadline => "deadline",
        }
    }

    /// Code kept in the shared cache for a failed URL.
    fn code(self) -> u8 {
        match self {
            Failure::NoResponse => 1,
            Failure::Status => 2,
            Failure::TooLarge => 3,
            Failure::NotImage => 4,
            Failure::Refused(Refusal::ResolvedSpecialAddress) => 5,
            _ => 0,
        }
    }

    fn of_code(code: u8) -> Failure {
        match code {
            1 => Failure::NoResponse,
            2 => Failure::Status,
            3 => Failure::TooLarge,
            4 => Failure::NotImage,
            5 => Failure::Refused(Refusal::ResolvedSpecialAddress),
            _ => Failure::NoResponse,
        }
    }
}

/// Where one image of the request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Identified by its bytes; `from_cache` when no fetch of this request was needed.
    Done {
        image: FetchedImage,
        from_cache: bool,
    },
    /// Falls back to the URL identity; `cached` when the failure came from the cache.
    Failed { failure: Failure, cached: bool },
    /// To be sent: the shell dispatches it and calls [`Plan::sent`]. `hops`: redirects
    /// followed so far.
    Send {
        target: Target,
        claimed: bool,
        hops: u8,
    },
    /// Sent as call `token`.
    InFlight {
        token: u32,
        target: Target,
        claimed: bool,
        hops: u8,
    },
    /// Another request is fetching the URL; polled on the shell's tick.
    Waiting,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// Media index in the request.
    pub index: usize,
    /// The URL's cache key.
    pub url: u128,
    pub step: Step,
}

/// The answer to one GET, as the shell read it.
#[derive(Debug)]
pub enum Reply {
    /// No headers: reset, connect failure, timeout.
    None,
    /// A redirect with its `Location`.
    Redirect(String),
    /// Another status than 200.
    Status,
    /// 200 with a body larger than the cap.
    TooLarge,
    /// 200: the body read whole.
    Image(Result<FetchedImage, crate::image_header::HeaderError>),
    /// Envoy's guard listener refused the target (see [`Reply::refusal`]).
    Refused(Refusal),
}

impl Reply {
    /// The refusal an answer carries: a 403 with [`guard::REFUSED_HEADER`] set to
    /// `resolved_special_address` is the guard listener's own (its RBAC filter refused the
    /// address the name resolved to); any other answer, an image server's 403 included, is
    /// not a refusal.
    pub fn refusal(status: Option<u16>, refused_header: Option<&str>) -> Option<Refusal> {
        match (status, refused_header.map(str::trim)) {
            (Some(403), Some(v)) if v == Refusal::ResolvedSpecialAddress.reason() => {
                Some(Refusal::ResolvedSpecialAddress)
            }
            _ => None,
        }
    }
}

/// One request's images by URL (see the module docs).
#[derive(Debug, Clone)]
pub struct Plan {
    pub items: Vec<Item>,
    /// This request's claim id in the shared cache.
    claim: u64,
    /// ms since the epoch after which nothing is waited for.
    pub deadline_ms: u64,
    /// The URLs this request has claimed to GET: at most `fetch.max_images`.
    gets: usize,
}

/// The step a cache lookup settles: the image, its failure, or waiting for the request
/// that is fetching it; None on a miss.
fn of_lookup(l: Lookup) -> Option<Step> {
    match l {
        Lookup::Fetched(image) => Some(Step::Done {
            image,
            from_cache: true,
        }),
        Lookup::Failed(code) => Some(Step::Failed {
            failure: Failure::of_code(code),
            cached: true,
        }),
        Lookup::InFlight { .. } => Some(Step::Waiting),
        Lookup::Miss => None,
    }
}

impl Plan {
    /// Plans the images `urls` (media index, URL, in request order) at `now_ms`: guard, cache,
    /// claims. Items that need a GET are [`Step::Send`].
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        urls: &[(usize, &str)],
        config: &FetchConfig,
        guard: &Guard,
        store: &dyn SharedStore,
        keys: &Keys,
        claim: u64,
        now_ms: u64,
    ) -> Plan {
        let mut plan = Plan {
            items: Vec::with_capacity(urls.len()),
            claim,
            deadline_ms: now_ms.saturating_add(config.deadline_ms),
            gets: 0,
        };
        for &(index, url) in urls {
            let key = urls::url_key(url);
            // The same URL twice in one request: one plan entry serves both.
            if let Some(twin) = plan.items.iter().find(|i| i.url == key) {
                let step = match &twin.step {
                    s @ (Step::Done { .. } | Step::Failed { .. }) => s.clone(),
                    _ => Step::Waiting,
                };
                plan.items.push(Item {
                    index,
                    url: key,
                    step,
                });
                continue;
            }
            let step = match guard.check(url) {
                Err(r) => Step::Failed {
                    failure: Failure::Refused(r),
                    cached: false,
                },
                Ok(target) => plan.resolve(target, key, config, store, keys, now_ms),
            };
            plan.items.push(Item {
                index,
                url: key,
                step,
            });
        }
        plan
    }

    /// A plan with no images (nothing to fetch: settled).
    pub fn empty() -> Plan {
        Plan {
            items: Vec::new(),
            claim: 0,
            deadline_ms: 0,
            gets: 0,
        }
    }

    /// The step for URL key `url`: from the shared cache (its image, its failure, or waiting
    /// for the request that is fetching it), else a GET this request claims. `max_images`
    /// bounds the GETs, not the URLs: an image the cache already knows does not count, so a
    /// conversation that re-sends its earlier images by URL still identifies its newest.
    fn resolve(
        &mut self,
        target: Target,
        url: u128,
        config: &FetchConfig,
        store: &dyn SharedStore,
        keys: &Keys,
        now_ms: u64,
    ) -> Step {
        if let Some(step) = of_lookup(urls::lookup(store, keys, &config.cache, url, now_ms)) {
            return step;
        }
        if self.gets >= config.max_images {
            return Step::Failed {
                failure: Failure::Refused(Refusal::TooMany),
                cached: false,
            };
        }
        let hold = config.timeout_ms.saturating_add(500);
        let step = match urls::claim(store, keys, &config.cache, url, self.claim, now_ms, hold) {
            Claim::Claimed => Step::Send {
                target,
                claimed: true,
                hops: 0,
            },
            Claim::Taken(l) => of_lookup(l).unwrap_or(Step::Waiting),
            Claim::Failed => Step::Send {
                target,
                claimed: false,
                hops: 0,
            },
        };
        if matches!(step, Step::Send { .. }) {
            self.gets += 1;
        }
        step
    }

    /// The GETs to send now: (item position, target).
    pub fn to_send(&self) -> Vec<(usize, Target)> {
        self.items
            .iter()
            .enumerate()
            .filter_map(|(i, it)| match &it.step {
                Step::Send { target, .. } => Some((i, target.clone())),
                _ => None,
            })
            .collect()
    }

    /// Item `pos` was dispatched as call `token` (None: the dispatch failed).
    pub fn sent(
        &mut self,
        pos: usize,
        token: Option<u32>,
        config: &FetchConfig,
        store: &dyn SharedStore,
        keys: &Keys,
        now_ms: u64,
    ) {
        let Some(item) = self.items.get_mut(pos) else {
            return;
        };
        let Step::Send {
            target,
            claimed,
            hops,
        } = &item.step
        else {
            return;
        };
        item.step = match token {
            Some(token) => Step::InFlight {
                token,
                target: target.clone(),
                claimed: *claimed,
                hops: *hops,
            },
            None => Step::Failed {
                failure: Failure::NoResponse,
                cached: false,
            },
        };
        if token.is_none() {
            let url = item.url;
            self.finish_url(url, Err(Failure::NoResponse), config, store, keys, now_ms);
        }
    }

    /// Whether call `token` is one of this plan's.
    pub fn has_token(&self, token: u32) -> bool {
        self.items
            .iter()
            .any(|i| matches!(i.step, Step::InFlight { token: t, .. } if t == token))
    }

    /// The answer to call `token`. A followed redirect turns its item back into
    /// [`Step::Send`] (send it with [`Plan::to_send`]).
    #[allow(clippy::too_many_arguments)]
    pub fn on_reply(
        &mut self,
        token: u32,
        reply: Reply,
        config: &FetchConfig,
        guard: &Guard,
        store: &dyn SharedStore,
        keys: &Keys,
        now_ms: u64,
    ) {
        let Some(item) = self
            .items
            .iter_mut()
            .find(|i| matches!(i.step, Step::InFlight { token: t, .. } if t == token))
        else {
            return;
        };
        let Step::InFlight {
            target,
            claimed,
            hops,
            ..
        } = item.step.clone()
        else {
            return;
        };
        let url = item.url;
        let result = match reply {
            Reply::None => Err(Failure::NoResponse),
            Reply::Status => Err(Failure::Status),
            Reply::TooLarge => Err(Failure::TooLarge),
            Reply::Image(Ok(image)) => Ok(image),
            Reply::Image(Err(_)) => Err(Failure::NotImage),
            Reply::Refused(r) => Err(Failure::Refused(r)),
            Reply::Redirect(location) => {
                if hops >= config.max_redirects {
                    Err(Failure::Status)
                } else {
                    match Guard::resolve_location(&target, &location)
                        .ok_or(Refusal::BadUrl)
                        .and_then(|next| guard.check(&next))
                    {
                        Ok(next) => {
                            if claimed {
                                let hold = config.timeout_ms.saturating_add(500);
                                urls::extend(
                                    store,
                                    keys,
                                    &config.cache,
                                    url,
                                    self.claim,
                                    now_ms,
                                    hold,
                                );
                            }
                            item.step = Step::Send {
                                target: next,
                                claimed,
                                hops: hops.saturating_add(1),
                            };
                            return;
                        }
                        Err(r) => Err(Failure::Refused(r)),
                    }
                }
            }
        };
        self.finish_url(url, result, config, store, keys, now_ms);
    }

    /// Settles every item of `url` (and records the result in the cache).
    fn finish_url(
        &mut self,
        url: u128,
        result: Result<FetchedImage, Failure>,
        config: &FetchConfig,
        store: &dyn SharedStore,
        keys: &Keys,
        now_ms: u64,
    ) {
        let state = match result {
            Ok(image) => UrlState::Fetched(image),
            Err(f) => UrlState::Failed(f.code()),
        };
        urls::record(store, keys, &config.cache, url, state, now_ms);
        for item in self.items.iter_mut().filter(|i| i.url == url) {
            item.step = match result {
                Ok(image) => Step::Done {
                    image,
                    from_cache: false,
                },
                Err(failure) => Step::Failed {
                    failure,
                    cached: false,
                },
            };
        }
    }

    /// On the shell's tick: re-reads the URLs waited for; a claim that expired or was released
    /// is taken over (its item becomes [`Step::Send`]); past the deadline everything still
    /// open fails with [`Failure::Deadline`] and this request's claims are released.
    pub fn poll(
        &mut self,
        config: &FetchConfig,
        guard: &Guard,
        store: &dyn SharedStore,
        keys: &Keys,
        now_ms: u64,
        urls_of: &dyn Fn(usize) -> Option<String>,
    ) {
        if now_ms >= self.deadline_ms {
            self.expire(config, store, keys);
            return;
        }
        for pos in 0..self.items.len() {
            let Some(item) = self.items.get(pos) else {
                continue;
            };
            if item.step != Step::Waiting {
                continue;
            }
            let (url, index) = (item.url, item.index);
            // A twin of an item of this request still in flight waits for it, not the cache.
            if self.items.iter().any(|i| {
                i.url == url && matches!(i.step, Step::InFlight { .. } | Step::Send { .. })
            }) {
                continue;
            }
            let Some(target) = urls_of(index).and_then(|u| guard.check(&u).ok()) else {
                continue;
            };
            let step = self.resolve(target, url, config, store, keys, now_ms);
            if let Some(item) = self.items.get_mut(pos) {
                item.step = step.clone();
            }
            // Twins follow a settled result.
            if matches!(step, Step::Done { .. } | Step::Failed { .. }) {
                for twin in self
                    .items
                    .iter_mut()
                    .filter(|i| i.url == url && i.step == Step::Waiting)
                {
                    twin.step = step.clone();
                }
            }
        }
    }

    /// The deadline: everything open fails, this request's claims are released (so that the
    /// next request for those URLs fetches at once instead of waiting for the claim's expiry;
    /// the GETs still in flight are left to Envoy's timeout and their answers ignored).
    pub fn expire(&mut self, config: &FetchConfig, store: &dyn SharedStore, keys: &Keys) {
        for item in &mut self.items {
            if let Step::InFlight { claimed: true, .. } | Step::Send { claimed: true, .. } =
                item.step
            {
                urls::release(store, keys, &config.cache, item.url, self.claim);
            }
            if !matches!(item.step, Step::Done { .. } | Step::Failed { .. }) {
                item.step = Step::Failed {
                    failure: Failure::Deadline,
                    cached: false,
                };
            }
        }
    }

    /// Every image settled: the request can be routed.
    pub fn settled(&self) -> bool {
        self.items
            .iter()
            .all(|i| matches!(i.step, Step::Done { .. } | Step::Failed { .. }))
    }

    /// The images identified by their bytes, for [`crate::analysis::Scanned::finish`].
    pub fn fetched(&self) -> Vec<(usize, FetchedImage)> {
        self.items
            .iter()
            .filter_map(|i| match i.step {
                Step::Done { image, .. } => Some((i.index, image)),
                _ => None,
            })
            .collect()
    }

    /// Counts for the log line and metrics: (fetched now, from cache, failed).
    pub fn counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for i in &self.items {
            match i.step {
                Step::Done {
                    from_cache: false, ..
                } => c.0 += 1,
                Step::Done {
                    from_cache: true, ..
                } => c.1 += 1,
                Step::Failed { .. } => c.2 += 1,
                _ => {}
            }
        }
        c
    }

    /// The failures, in request order.
    pub fn failures(&self) -> Vec<Failure> {
        self.items
            .iter()
            .filter_map(|i| match i.step {
                Step::Failed { failure, .. } => Some(failure),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image_header::{ImageFormat, ImageInfo};
    use crate::state::MemoryStore;

    fn image(d: u128) -> FetchedImage {
        FetchedImage {
            digest: d,
            info: ImageInfo {
                format: ImageFormat::Png,
                width: 64,
                height: 32,
            },
            bytes: 100,
        }
    }

    fn setup(allow: &[&str]) -> (FetchConfig, Guard, MemoryStore, Keys) {
        let config = FetchConfig {
            enabled: true,
            allow: allow.iter().map(|s| s.to_string()).collect(),
            max_images: 3,
            ..FetchConfig::default()
        };
        let guard = config.guard().expect("guard");
        let store = MemoryStore::default();
        let keys = Keys::new(1);
        assert!(urls::prepare(&store, &keys, &config.cache));
        (config, guard, store, keys)
    }

    #[test]
    fn a_url_is_fetched_once_and_then_served_from_the_cache() {
        let (c, g, s, k) = setup(&["127.0.0.1:8765"]);
        let url = "http://127.0.0.1:8765/a.png";
        let mut p = Plan::new(&[(0, url)], &c, &g, &s, &k, 1, 1000);
        let send = p.to_send();
        assert_eq!(send.len(), 1);
        assert_eq!(send[0].1.authority, "127.0.0.1:8765");
        assert_eq!(c.cluster_for(&send[0].1), "mmrouter_fetch");
        p.sent(0, Some(5), &c, &s, &k, 1000);
        assert!(!p.settled());
        // A second request meanwhile waits for the first.
        let mut q = Plan::new(&[(0, url)], &c, &g, &s, &k, 2, 1001);
        assert_eq!(q.items[0].step, Step::Waiting);
        assert!(q.to_send().is_empty());
        p.on_reply(5, Reply::Image(Ok(image(42))), &c, &g, &s, &k, 1010);
        assert!(p.settled());
        assert_eq!(p.fetched(), vec![(0, image(42))]);
        assert_eq!(p.counts(), (1, 0, 0));
        q.poll(&c, &g, &s, &k, 1020, &|_| Some(url.to_string()));
        assert_eq!(q.fetched(), vec![(0, image(42))]);
        assert_eq!(
            q.counts(),
            (0, 1, 0),
            "served from the cache, no second fetch"
        );
        // Within the TTL a third request needs no fetch at all.
        let r = Plan::new(&[(0, url)], &c, &g, &s, &k, 3, 2000);
        assert!(r.settled() && r.to_send().is_empty());
    }

    #[test]
    fn refusals_and_the_image_cap_fall_back_without_a_fetch() {
        let (c, g, s, k) = setup(&["*"]);
        let urls = [
            (0, "http://127.0.0.1/a.png"),
            (1, "ftp://example.com/a.png"),
            (2, "http://a.example.com/1.png"),
            (3, "http://a.example.com/2.png"),
            (4, "http://a.example.com/3.png"),
            (5, "http://a.example.com/4.png"),
        ];
        let p = Plan::new(&urls, &c, &g, &s, &k, 1, 0);
        let reasons: Vec<&str> = p.failures().iter().map(|f| f.reason()).collect();
        assert_eq!(reasons, vec!["private_address", "scheme", "too_many"]);
        assert_eq!(p.to_send().len(), 3);
        assert_eq!(c.cluster_for(&p.to_send()[0].1), "mmrouter_fetch_guard");
        let https = g.check("https://a.example.com/x.png").expect("allowed");
        assert_eq!(c.cluster_for(&https), "mmrouter_fetch_guard_tls");
        let https_ip = g.check("https://93.184.216.34/x.png").expect("allowed");
        assert_eq!(c.cluster_for(&https_ip), "mmrouter_fetch_tls");
    }

    #[test]
    fn the_image_cap_counts_fetches_so_a_conversation_keeps_its_newest_images() {
        let (c, g, s, k) = setup(&["127.0.0.1:8765"]);
        let urls: Vec<String> = (0..8)
            .map(|i| format!("http://127.0.0.1:8765/{i}.png"))
            .collect();
        let turn = |n: usize| -> Vec<(usize, &str)> {
            urls.iter()
                .take(n)
                .map(|u| u.as_str())
                .enumerate()
                .collect()
        };
        // Turn 1: three images, the cap (3); all fetched.
        let mut p = Plan::new(&turn(3), &c, &g, &s, &k, 1, 1000);
        let sends = p.to_send();
        assert_eq!(sends.len(), 3);
        for (token, (pos, _)) in (1u32..).zip(sends) {
            p.sent(pos, Some(token), &c, &s, &k, 1000);
            let reply = Reply::Image(Ok(image(u128::from(token))));
            p.on_reply(token, reply, &c, &g, &s, &k, 1010);
        }
        assert_eq!(p.counts(), (3, 0, 0));
        // Turn 2 re-sends them and adds three: the three known ones come from the cache and
        // the new ones are fetched, none refused as too many.
        let q = Plan::new(&turn(6), &c, &g, &s, &k, 2, 1100);
        assert_eq!(q.counts(), (0, 3, 0));
        let sent: Vec<usize> = q.to_send().iter().map(|(pos, _)| *pos).collect();
        assert_eq!(sent, vec![3, 4, 5]);
        assert!(q.failures().is_empty());
        // Four new images in one request: the fourth GET is past the cap.
        let (c, g, s, k) = setup(&["127.0.0.1:8765"]);
        let r = Plan::new(&turn(4), &c, &g, &s, &k, 3, 1200);
        assert_eq!(r.to_send().len(), 3);
        let reasons: Vec<&str> = r.failures().iter().map(|f| f.reason()).collect();
        assert_eq!(reasons, vec!["too_many"]);
    }

    #[test]
    fn names_allowed_by_a_wildcard_go_through_the_guard_listener_and_exact_names_do_not() {
        let (c, g, _, _) = setup(&["*", "*.cdn.example.com", "images.example.com"]);
        let cluster = |url: &str| c.cluster_for(&g.check(url).expect(url));
        assert_eq!(
            cluster("http://a.example.org/x.png"),
            "mmrouter_fetch_guard"
        );
        assert_eq!(
            cluster("https://a.cdn.example.com/x.png"),
            "mmrouter_fetch_guard_tls"
        );
        assert_eq!(
            cluster("http://images.example.com/x.png"),
            "mmrouter_fetch_dns"
        );
        assert_eq!(
            cluster("https://images.example.com/x.png"),
            "mmrouter_fetch_dns_tls"
        );
        assert_eq!(cluster("http://93.184.216.34/x.png"), "mmrouter_fetch");
    }

    #[test]
    fn only_the_guard_listeners_marked_403_is_a_refusal() {
        let marked = Some("resolved_special_address");
        assert_eq!(
            Reply::refusal(Some(403), marked),
            Some(Refusal::ResolvedSpecialAddress)
        );
        assert_eq!(
            Reply::refusal(Some(403), None),
            None,
            "the server's own 403"
        );
        assert_eq!(Reply::refusal(Some(200), marked), None);
        assert_eq!(Reply::refusal(Some(403), Some("other")), None);
        assert_eq!(Reply::refusal(None, marked), None);
    }

    #[test]
    fn a_resolved_address_refusal_is_cached_as_that_refusal() {
        let (c, g, s, k) = setup(&["*"]);
        let url = "http://images.example.test/a.png";
        let mut p = Plan::new(&[(0, url)], &c, &g, &s, &k, 1, 0);
        p.sent(0, Some(1), &c, &s, &k, 0);
        p.on_reply(
            1,
            Reply::Refused(Refusal::ResolvedSpecialAddress),
            &c,
            &g,
            &s,
            &k,
            1,
        );
        let refused = Failure::Refused(Refusal::ResolvedSpecialAddress);
        assert_eq!(p.failures(), vec![refused]);
        assert_eq!(refused.reason(), "resolved_special_address");
        let q = Plan::new(&[(0, url)], &c, &g, &s, &k, 2, 5);
        assert_eq!(
            q.items[0].step,
            Step::Failed {
                failure: refused,
                cached: true
            },
            "the next request falls back at once, with the same reason"
        );
    }

    #[test]
    fn failures_are_cached_negatively_and_expire() {
        let (c, g, s, k) = setup(&["127.0.0.1:*"]);
        let url = "http://127.0.0.1:9/a.png";
        let mut p = Plan::new(&[(0, url)], &c, &g, &s, &k, 1, 0);
        p.sent(0, Some(1), &c, &s, &k, 0);
        p.on_reply(1, Reply::None, &c, &g, &s, &k, 10);
        assert_eq!(p.failures(), vec![Failure::NoResponse]);
        let q = Plan::new(&[(0, url)], &c, &g, &s, &k, 2, 20);
        assert_eq!(
            q.items[0].step,
            Step::Failed {
                failure: Failure::NoResponse,
                cached: true
            }
        );
        let r = Plan::new(&[(0, url)], &c, &g, &s, &k, 3, 10 + c.cache.failure_ttl_ms);
        assert_eq!(r.to_send().len(), 1, "the failure expired: fetched again");
    }

    #[test]
    fn the_deadline_fails_what_is_open_and_releases_the_claims() {
        let (c, g, s, k) = setup(&["127.0.0.1:*"]);
        let url = "http://127.0.0.1:9/slow.png";
        let mut p = Plan::new(&[(0, url), (1, url)], &c, &g, &s, &k, 1, 0);
        assert_eq!(p.to_send().len(), 1, "one GET for a URL given twice");
        p.sent(0, Some(1), &c, &s, &k, 0);
        p.poll(&c, &g, &s, &k, 100, &|_| Some(url.to_string()));
        assert!(!p.settled());
        p.poll(&c, &g, &s, &k, c.deadline_ms, &|_| Some(url.to_string()));
        assert!(p.settled());
        assert_eq!(p.failures(), vec![Failure::Deadline, Failure::Deadline]);
        // The claim is gone: the next request fetches at once.
        let q = Plan::new(&[(0, url)], &c, &g, &s, &k, 2, c.deadline_ms + 1);
        assert_eq!(q.to_send().len(), 1);
        // A late answer to the expired plan changes nothing.
        p.on_reply(
            1,
            Reply::Image(Ok(image(1))),
            &c,
            &g,
            &s,
            &k,
            c.deadline_ms + 2,
        );
        assert_eq!(p.fetched(), vec![]);
    }

    #[test]
    fn redirects_are_failures_unless_configured_and_each_hop_is_guarded() {
        let (mut c, g, s, k) = setup(&["127.0.0.1:8765"]);
        let url = "http://127.0.0.1:8765/a.png";
        let mut p = Plan::new(&[(0, url)], &c, &g, &s, &k, 1, 0);
        p.sent(0, Some(1), &c, &s, &k, 0);
        p.on_reply(1, Reply::Redirect("/b.png".into()), &c, &g, &s, &k, 1);
        assert_eq!(p.failures(), vec![Failure::Status]);
        c.max_redirects = 2;
        let url2 = "http://127.0.0.1:8765/c.png";
        let mut p = Plan::new(&[(0, url2)], &c, &g, &s, &k, 2, 0);
        p.sent(0, Some(2), &c, &s, &k, 0);
        p.on_reply(2, Reply::Redirect("/d.png".into()), &c, &g, &s, &k, 1);
        assert_eq!(p.to_send()[0].1.path, "/d.png");
        p.sent(0, Some(3), &c, &s, &k, 1);
        p.on_reply(
            3,
            Reply::Redirect("http://169.254.169.254/".into()),
            &c,
            &g,
            &s,
            &k,
            2,
        );
        assert_eq!(p.failures()[0].reason(), "not_allowed");
        // Past max_redirects hops a redirect is a failure.
        let url3 = "http://127.0.0.1:8765/e.png";
        let mut p = Plan::new(&[(0, url3)], &c, &g, &s, &k, 3, 0);
        for token in 10..12 {
            p.sent(0, Some(token), &c, &s, &k, 0);
            p.on_reply(token, Reply::Redirect("/e.png".into()), &c, &g, &s, &k, 1);
        }
        p.sent(0, Some(12), &c, &s, &k, 0);
        p.on_reply(12, Reply::Redirect("/e.png".into()), &c, &g, &s, &k, 1);
        assert_eq!(p.failures(), vec![Failure::Status]);
    }
}
