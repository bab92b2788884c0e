//! The filter's plugin configuration: one JSON object.
//!
//! ```json
//! {
//!   "workers": [{"name": "w0", "address": "10.0.0.5:8000"}, ...],
//!   "sidecar": {"cluster": "mmrouter_sidecar", "poll_ms": 100, ...},
//!   "mode": "approximate",
//!   "paths": ["/v1/chat/completions", "/v1/completions"],
//!   "destination_header": "x-gateway-destination-endpoint",
//!   "retry_alternates": 0,
//!   "response_headers": false,
//!   "decision_log": "debug",
//!   "stamp_uuid": false,
//!   "state": {"capacity_blocks": 16384, "tick_ms": 20, "blocks": {...}, ...},
//!   "fetch": {"enabled": true, "allow": ["*", "127.0.0.1:8765"], "timeout_ms": 2000, ...},
//!   "metrics": {"poll_ms": 250, "path": "/metrics", "timeout_ms": 200,
//!               "cluster": "mmrouter_endpoint", "unhealthy_after": 3},
//!   "block_size": 16, "profiles": {...}, "scoring": {...},
//!   "limits": {...}, "media": {...}
//! }
//! ```
//! The filter's own keys are listed above; every other key is a [`RouterConfig`] field and is
//! validated as such. Unknown keys are refused, naming the key, so that a typo never routes
//! badly in silence.
//!
//! Where the workers come from: the `workers` list (static), or the sidecar's feed (`sidecar`
//! set; the list may then be empty or omitted, and is used only until the first feed).

use super::fetch::FetchConfig;
use crate::config::{ConfigError, RouterConfig, json_error};
use crate::state::StateConfig;
use serde::Deserialize;
use std::net::SocketAddr;

/// One inference worker behind the router.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Worker {
    /// Name in logs, metrics and the `x-mmrouter-worker` response header: 1-64 characters
    /// of `[A-Za-z0-9_.-]`.
    pub name: String,
    /// `ip:port` (`[v6]:port` for IPv6) the ORIGINAL_DST cluster connects to.
    pub address: String,
}

/// Where worker prefix state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// From the filter's own routing decisions and the workers' `/metrics`. The default
    /// without a sidecar.
    #[default]
    Approximate,
    /// The sidecar's feed (vLLM's KV events and `/metrics`) drives membership, allocation
    /// clocks and image residency; the filter's decisions still name the text blocks. Needs
    /// `sidecar`. When the feed goes stale the filter routes in approximate mode until it
    /// returns.
    Precise,
}

/// The per-request decision log line's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DecisionLog {
    /// Logged at debug (Envoy's default `wasm` level is info: not shown). The default.
    #[default]
    Debug,
    /// Logged at info.
    Info,
    /// Not logged.
    Off,
}

/// The sidecar the state writer polls for its feed (`GET <path>?since=<cursor>`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SidecarConfig {
    /// Envoy cluster of the sidecar (default `mmrouter_sidecar`).
    pub cluster: String,
    /// `:authority` of the poll (default `mmrouter-sidecar`).
    pub authority: String,
    /// Path of the feed (default `/v1/feed`).
    pub path: String,
    /// Poll period (default 100 ms).
    pub poll_ms: u64,
    /// Timeout of one poll (default 90 ms).
    pub timeout_ms: u64,
    /// The feed is stale after this long without a good poll (default 1000 ms): routing then
    /// goes on in approximate mode, polling the workers' `/metrics` itself, until it returns.
    pub stale_ms: u64,
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            cluster: "mmrouter_sidecar".into(),
            authority: "mmrouter-sidecar".into(),
            path: "/v1/feed".into(),
            poll_ms: 100,
            timeout_ms: 90,
            stale_ms: 1000,
        }
    }
}

/// Polling of each worker's `/metrics` (vLLM's Prometheus endpoint) for engine-side load and
/// health. One VM polls for the whole Envoy process (a shared lease).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Poll period (default 250 ms; 0 turns polling off and routing uses only the router's own
    /// counts and the configured defaults).
    pub poll_ms: u64,
    /// Path polled on every worker (default `/metrics`).
    pub path: String,
    /// Timeout of one poll (default 200 ms).
    pub timeout_ms: u64,
    /// Cluster the polls go through (default `mmrouter_endpoint`, the ORIGINAL_DST cluster; the
    /// worker's address travels in the destination header, as for requests).
    pub cluster: String,
    /// Consecutive failed polls after which a worker is skipped by routing until a poll
    /// succeeds again (default 3; 0 never skips). When every worker is failing, all are used.
    pub unhealthy_after: u32,
    /// Polls in flight at most (default 64): a large fleet's polls spread over the period.
    /// Past a few hundred workers, prefer the sidecar, which scrapes outside Envoy.
    pub max_inflight: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            poll_ms: 250,
            path: "/metrics".into(),
            timeout_ms: 200,
            cluster: "mmrouter_endpoint".into(),
            unhealthy_after: 3,
            max_inflight: 64,
        }
    }
}

/// The whole plugin configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterConfig {
    /// The static worker list (the initial one when a sidecar is configured).
    pub workers: Vec<Worker>,
    pub sidecar: Option<SidecarConfig>,
    pub mode: Mode,
    /// Request paths (query string ignored) whose POST bodies are routed (default
    /// `/v1/chat/completions` and `/v1/completions`). Other requests pass through untouched.
    pub paths: Vec<String>,
    /// Header the ORIGINAL_DST cluster reads (default `x-gateway-destination-endpoint`).
    pub destination_header: String,
    /// How many next-best workers follow the chosen one in the destination header, as
    /// `ip:port,ip:port,...` (default 0: one address, what an ORIGINAL_DST cluster reads).
    /// With Envoy's `override_host` load-balancing policy the extra addresses are where a
    /// retry goes (on connect failure or reset): the filter ranks them.
    pub retry_alternates: u8,
    /// Add `x-mmrouter-worker`, `x-mmrouter-overlap` and `x-mmrouter-decision` to responses
    /// (default false: they name workers, which clients need not know).
    pub response_headers: bool,
    /// Level of the per-request `[ROUTING]` line (default debug).
    pub decision_log: DecisionLog,
    /// Write the router's content id as vLLM's `uuid` into image parts that have none, so the
    /// engine's KV events name images as the router does (see `filter::stamp`). Default: on
    /// when a sidecar is configured (precise mode), off otherwise.
    pub stamp_uuid: bool,
    pub state: StateConfig,
    pub metrics: MetricsConfig,
    /// Fetching http(s) images (see `filter::fetch`; off unless `fetch.enabled`).
    pub fetch: FetchConfig,
    pub router: RouterConfig,
}

const FILTER_KEYS: [&str; 12] = [
    "fetch",
    "stamp_uuid",
    "retry_alternates",
    "metrics",
    "workers",
    "sidecar",
    "mode",
    "paths",
    "destination_header",
    "response_headers",
    "decision_log",
    "state",
];

impl FilterConfig {
    /// Parses and validates the plugin configuration.
    pub fn from_json(text: &[u8]) -> Result<FilterConfig, ConfigError> {
        let value: serde_json::Value = serde_json::from_slice(text).map_err(|e| json_error(&e))?;
        let serde_json::Value::Object(mut map) = value else {
            return Err(ConfigError::new("(document)", "must be a JSON object"));
        };
        let mut take = |key: &str| map.remove(key);
        let sidecar: Option<SidecarConfig> = match take("sidecar") {
            Some(serde_json::Value::Null) | None => None,
            Some(v) => Some(field("sidecar", v)?),
        };
        let workers: Vec<Worker> = match take("workers") {
            Some(v) => field("workers", v)?,
            None if sidecar.is_some() => Vec::new(),
            None => return Err(ConfigError::new("workers", "is required without a sidecar")),
        };
        let mode: Mode = match take("mode") {
            Some(v) => field("mode", v)?,
            None if sidecar.is_some() => Mode::Precise,
            None => Mode::default(),
        };
        let paths: Vec<String> = match take("paths") {
            Some(v) => field("paths", v)?,
            None => vec!["/v1/chat/completions".into(), "/v1/completions".into()],
        };
        let destination_header: String = match take("destination_header") {
            Some(v) => field("destination_header", v)?,
            None => "x-gateway-destination-endpoint".into(),
        };
        let retry_alternates: u8 = match take("retry_alternates") {
            Some(v) => field("retry_alternates", v)?,
            None => 0,
        };
        let response_headers: bool = match take("response_headers") {
            Some(v) => field("response_headers", v)?,
            None => false,
        };
        let stamp_uuid: bool = match take("stamp_uuid") {
            Some(v) => field("stamp_uuid", v)?,
            None => sidecar.is_some(),
        };
        let decision_log: DecisionLog = match take("decision_log") {
            Some(v) => field("decision_log", v)?,
            None => DecisionLog::default(),
        };
        let state: StateConfig = match take("state") {
            Some(v) => field("state", v)?,
            None => StateConfig::default(),
        };
        let metrics: MetricsConfig = match take("metrics") {
            Some(v) => field("metrics", v)?,
            None => MetricsConfig::default(),
        };
        let fetch: FetchConfig = match take("fetch") {
            Some(v) => field("fetch", v)?,
            None => FetchConfig::default(),
        };
        debug_assert!(FILTER_KEYS.iter().all(|k| !map.contains_key(*k)));
        let router: RouterConfig =
            serde_json::from_value(serde_json::Value::Object(map)).map_err(|e| json_error(&e))?;
        let config = FilterConfig {
            workers,
            sidecar,
            mode,
            paths,
            destination_header: destination_header.to_ascii_lowercase(),
            retry_alternates,
            response_headers,
            decision_log,
            stamp_uuid,
            state,
            metrics,
            fetch,
            router,
        };
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        // Checked even when off, so that turning it on never finds a bad entry late.
        self.fetch.guard()?;
        if self.workers.is_empty() && self.sidecar.is_none() {
            return Err(ConfigError::new(
                "workers",
                "needs at least one worker (or a sidecar that lists them)",
            ));
        }
        if self.workers.len() > self.state.max_workers {
            return Err(ConfigError::new(
                "workers",
                format!("at most state.max_workers ({})", self.state.max_workers),
            ));
        }
        for (i, w) in self.workers.iter().enumerate() {
            if !valid_worker_name(&w.name) {
                return Err(ConfigError::new(
                    format!("workers[{i}].name"),
                    format!("`{}` must be 1-64 characters of [A-Za-z0-9_.-]", w.name),
                ));
            }
            if w.address.parse::<SocketAddr>().is_err() {
                return Err(ConfigError::new(
                    format!("workers[{i}].address"),
                    format!(
                        "`{}` is not ip:port (ORIGINAL_DST needs an IP address, not a host name)",
                        w.address
                    ),
                ));
            }
            if self.workers.iter().take(i).any(|o| o.name == w.name) {
                return Err(ConfigError::new(
                    format!("workers[{i}].name"),
                    format!("`{}` is used twice", w.name),
                ));
            }
        }
        if self.mode == Mode::Precise && self.sidecar.is_none() {
            return Err(ConfigError::new(
                "mode",
                "`precise` needs `sidecar` (the KV-event sidecar's feed); use `approximate` without one",
            ));
        }
        if let Some(sc) = &self.sidecar {
            if sc.cluster.is_empty() || sc.authority.is_empty() || !sc.path.starts_with('/') {
                return Err(ConfigError::new(
                    "sidecar",
                    "needs a cluster, an authority and a path starting with `/`",
                ));
            }
            if sc.poll_ms == 0 || sc.timeout_ms == 0 || sc.timeout_ms >= sc.poll_ms {
                return Err(ConfigError::new(
                    "sidecar.timeout_ms",
                    "poll_ms and timeout_ms must be > 0 and timeout_ms shorter than poll_ms",
                ));
            }
            if sc.stale_ms <= sc.poll_ms {
                return Err(ConfigError::new(
                    "sidecar.stale_ms",
                    "must be longer than sidecar.poll_ms",
                ));
            }
        }
        if self.paths.is_empty() || self.paths.iter().any(|p| !p.starts_with('/')) {
            return Err(ConfigError::new(
                "paths",
                "needs one or more paths starting with `/`",
            ));
        }
        let header_ok = !self.destination_header.is_empty()
            && self
                .destination_header
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !header_ok {
            return Err(ConfigError::new(
                "destination_header",
                "must be a header name",
            ));
        }
        self.state.validate()?;
        if self.metrics.poll_ms > 0 {
            if !self.metrics.path.starts_with('/') {
                return Err(ConfigError::new("metrics.path", "must start with `/`"));
            }
            if self.metrics.timeout_ms == 0 || self.metrics.timeout_ms >= self.metrics.poll_ms {
                return Err(ConfigError::new(
                    "metrics.timeout_ms",
                    "must be > 0 and shorter than metrics.poll_ms, so that polls never overlap",
                ));
            }
            if self.metrics.cluster.is_empty() {
                return Err(ConfigError::new("metrics.cluster", "must name a cluster"));
            }
        }
        self.router.validate()
    }

    /// Whether a request path (possibly with a query string) is one the filter routes.
    pub fn routes_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.paths.iter().any(|p| p == path)
    }
}

/// Whether `name` can name a worker (in metrics, logs and the response header): 1-64
/// characters of `[A-Za-z0-9_.-]`.
pub fn valid_worker_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

fn field<T: serde::de::DeserializeOwned>(
    name: &str,
    value: serde_json::Value,
) -> Result<T, ConfigError> {
    serde_json::from_value(value).map_err(|e| {
        let inner = json_error(&e);
        let field = if inner.field == "(document)" {
            name.to_string()
        } else {
            format!("{name}.{}", inner.field)
        };
        ConfigError::new(field, inner.message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_field(json: &str) -> String {
        match FilterConfig::from_json(json.as_bytes()) {
            Ok(_) => "(accepted)".into(),
            Err(e) => e.field,
        }
    }

    #[test]
    fn the_fetch_object_is_parsed_and_its_guard_checked_naming_the_field() {
        let w = r#""workers":[{"name":"w0","address":"127.0.0.1:8001"}]"#;
        let c = FilterConfig::from_json(
            format!(r#"{{{w},"fetch":{{"enabled":true,"allow":["*","127.0.0.1:8765"],"deadline_ms":900}}}}"#)
                .as_bytes(),
        )
        .expect("valid");
        assert!(c.fetch.enabled);
        assert_eq!(c.fetch.deadline_ms, 900);
        assert_eq!(c.fetch.allow, vec!["*", "127.0.0.1:8765"]);
        let off = FilterConfig::from_json(format!("{{{w}}}").as_bytes()).expect("valid");
        assert!(!off.fetch.enabled, "off unless asked for");
        assert_eq!(
            err_field(&format!(r#"{{{w},"fetch":{{"allow":["a*b"]}}}}"#)),
            "fetch.allow"
        );
        assert_eq!(
            err_field(&format!(r#"{{{w},"fetch":{{"schemes":["ftp"]}}}}"#)),
            "fetch.schemes"
        );
        assert_eq!(
            err_field(&format!(r#"{{{w},"fetch":{{"timeout_ms":0}}}}"#)),
            "fetch.timeout_ms"
        );
        assert_eq!(
            err_field(&format!(r#"{{{w},"fetch":{{"cache":{{"buckets":0}}}}}}"#)),
            "fetch.cache.buckets"
        );
        assert_ne!(
            err_field(&format!(r#"{{{w},"fetch":{{"typo":1}}}}"#)),
            "(accepted)"
        );
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c =
            FilterConfig::from_json(br#"{"workers":[{"name":"w0","address":"127.0.0.1:8001"}]}"#)
                .expect("valid");
        assert_eq!(c.mode, Mode::Approximate);
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert!(c.routes_path("/v1/chat/completions?x=1"));
        assert!(!c.routes_path("/v1/models"));
        assert_eq!(c.router, RouterConfig::default());
    }

    #[test]
    fn invalid_configs_name_the_field() {
        assert_eq!(err_field(r#"{}"#), "workers");
        assert_eq!(err_field(r#"{"workers":[]}"#), "workers");
        assert_eq!(
            err_field(r#"{"workers":[{"name":"w0","address":"localhost:80"}]}"#),
            "workers[0].address"
        );
        assert_eq!(
            err_field(
                r#"{"workers":[{"name":"a","address":"1.2.3.4:1"},{"name":"a","address":"1.2.3.4:2"}]}"#
            ),
            "workers[1].name"
        );
        assert_eq!(
            err_field(r#"{"workers":[{"name":"a","address":"1.2.3.4:1"}],"mode":"precise"}"#),
            "mode"
        );
        assert_eq!(err_field(r#"{"sidecar":{}}"#), "(accepted)");
        assert_eq!(
            err_field(r#"{"sidecar":{"poll_ms":100,"timeout_ms":100}}"#),
            "sidecar.timeout_ms"
        );
        assert_eq!(err_field(r#"{"sidecar":{"clustr":"x"}}"#), "sidecar.clustr");
        assert_eq!(
            err_field(r#"{"workers":[{"name":"a","address":"1.2.3.4:1"}],"blok_size":16}"#),
            "blok_size"
        );
        assert_eq!(
            err_field(r#"{"workers":[{"name":"a","address":"1.2.3.4:1"}],"block_size":0}"#),
            "block_size"
        );
        assert_eq!(
            err_field(r#"{"workers":[{"name":"a","address":"1.2.3.4:1"}],"state":{"log_slot":3}}"#),
            "state.log_slot"
        );
        assert_eq!(
            err_field(
                r#"{"workers":[{"name":"a","address":"1.2.3.4:1"}],"state":{"blocks":{"buckets":0}}}"#
            ),
            "state.buckets"
        );
        assert_eq!(
            err_field(
                r#"{"workers":[{"name":"a","address":"1.2.3.4:1"}],"metrics":{"poll_ms":100,"timeout_ms":100}}"#
            ),
            "metrics.timeout_ms"
        );
        assert_eq!(err_field("[1]"), "(document)");
        assert_eq!(err_field("{"), "(document)");
    }
}
