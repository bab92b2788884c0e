//! Command line: hand-rolled `--flag value` / `--flag=value` parsing.

use crate::membership::{WorkerSpec, parse_static_list};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Everything the sidecar can be told, with its default.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `--listen`, default 127.0.0.1:9902 (port 0 picks one, printed as `listening on`).
    pub listen: SocketAddr,
    /// `--workers name=ip:port,...` (repeatable; names default to w0, w1, ...).
    pub workers: Vec<WorkerSpec>,
    /// `--dns NAME:PORT` (repeatable): every A/AAAA record of NAME is a worker on PORT.
    pub dns: Vec<(String, u16)>,
    /// `--dns-interval-ms`, default 1000.
    pub dns_interval: Duration,
    /// `--workers-file PATH` (repeatable), watched.
    pub workers_files: Vec<PathBuf>,
    /// `--events-port`, default 5557: the KV-event PUB port on each worker's IP.
    pub events_port: u16,
    /// `--replay-port`, default none: the replay ROUTER port on each worker's IP.
    pub replay_port: Option<u16>,
    /// `--no-events`: metrics only.
    pub no_events: bool,
    /// `--topic`, default "" (all topics).
    pub topic: String,
    /// `--scrape-ms`, default 100.
    pub scrape_interval: Duration,
    /// `--scrape-timeout-ms`, default 500.
    pub scrape_timeout: Duration,
    /// `--unhealthy-after`, default 2 failed scrapes in a row.
    pub unhealthy_after: u32,
    /// `--max-blocks-per-worker`, default 262144.
    pub max_blocks_per_worker: usize,
    /// `--journal-entries`, default 65536.
    pub journal_entries: usize,
    /// `--eds-file PATH`: write the members as an Envoy EDS resource (see `eds`).
    pub eds_file: Option<PathBuf>,
    /// `--eds-cluster NAME`, default `mmrouter_workers`: the cluster the resource is for.
    pub eds_cluster: String,
    /// `--dns-guard ADDR`: serve the fetch DNS guard (see `dns_guard`) on this UDP address.
    pub dns_guard: Option<SocketAddr>,
    /// `--dns-guard-upstream ADDR`, default the first nameserver of /etc/resolv.conf.
    pub dns_guard_upstream: Option<SocketAddr>,
    /// `--dns-guard-allow LIST`: the filter's `fetch.allow`, comma-separated, as the guard
    /// applies it.
    pub dns_guard_policy: crate::dns_guard::Policy,
}

/// Default of `--max-blocks-per-worker`: 256 Ki blocks, about 21 MiB per worker at most
/// (docs/SIDECAR.md, "Memory").
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 18;
/// Default of `--journal-entries`: 64 Ki changes, 2 MiB.
pub const DEFAULT_JOURNAL_ENTRIES: usize = 1 << 16;

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 9902)),
            workers: Vec::new(),
            dns: Vec::new(),
            dns_interval: Duration::from_millis(1000),
            workers_files: Vec::new(),
            events_port: 5557,
            replay_port: None,
            no_events: false,
            topic: String::new(),
            scrape_interval: Duration::from_millis(100),
            scrape_timeout: Duration::from_millis(500),
            unhealthy_after: 2,
            max_blocks_per_worker: DEFAULT_MAX_BLOCKS,
            journal_entries: DEFAULT_JOURNAL_ENTRIES,
            eds_file: None,
            eds_cluster: "mmrouter_workers".into(),
            dns_guard: None,
            dns_guard_upstream: None,
            dns_guard_policy: crate::dns_guard::Policy::default(),
        }
    }
}

pub const USAGE: &str = "\
mmrouter-sidecar: watches the inference workers (membership, /metrics, vLLM KV events) and
serves their state to the mmrouter filter

USAGE: mmrouter-sidecar [OPTIONS]

MEMBERSHIP (sources combine; at least one is needed to see any worker):
  --workers LIST            static workers: name=ip:port,... or ip:port,... (names default
                            to w0, w1, ... by position); repeatable
  --dns NAME:PORT           every A/AAAA record of NAME is a worker on PORT (a Kubernetes
                            headless Service); repeatable; worker names are IP_PORT
  --dns-interval-ms N       re-resolve every N ms [1000]
  --workers-file PATH       one worker per line: `name ip:port [events=tcp://H:P]
                            [replay=tcp://H:P]`, # comments; re-read when it changes
                            (mtime polled every 500 ms); repeatable

KV EVENTS:
  --events-port P           the workers' KV-event PUB port, on each worker's IP [5557]
  --replay-port P           the workers' replay ROUTER port [none: no replay]
  --no-events               no subscriptions (metrics only)
  --topic T                 subscribe to topic prefix T [\"\" = all]
  --max-blocks-per-worker N resident blocks kept per worker, oldest dropped first; also
                            bounded by the worker's num_gpu_blocks [262144]
  --journal-entries N       image-residency changes kept for /v1/feed deltas [65536]

METRICS:
  --scrape-ms N             scrape each worker's /metrics every N ms [100]
  --scrape-timeout-ms N     a scrape that takes longer fails [500]
  --unhealthy-after N       failed scrapes in a row that make a worker unhealthy [2]

SERVER:
  --eds-file PATH           write the members as an Envoy EDS resource to PATH (atomically)
                            for a cluster with a filesystem path_config_source [none]
  --eds-cluster NAME        the cluster name in that resource [mmrouter_workers]
  --listen ADDR             HTTP address [127.0.0.1:9902]; port 0 = any free port

FETCH DNS GUARD (for envoy/render.py --fetch-dns-resolver ADDR):
  --dns-guard ADDR          forward DNS queries (UDP) received on ADDR; from an answer that
                            also holds fetchable addresses, drop the special-use ones
                            (loopback, private, link-local, ...) [off]
  --dns-guard-upstream ADDR the resolver asked [first nameserver of /etc/resolv.conf, port 53]
  --dns-guard-allow LIST    the filter's fetch.allow (comma-separated): its address and CIDR
                            entries keep their special-use addresses [none]
  -h, --help                this text

ENDPOINTS: GET /v1/state (JSON), GET /v1/feed?since=CURSOR (binary, see src/feed.rs),
GET /metrics (Prometheus), GET /health. See docs/SIDECAR.md.
";

/// What the command line asked for.
#[derive(Debug, PartialEq)]
pub enum Command {
    Run(Box<Config>),
    Help,
}

#[derive(Debug, PartialEq)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (see --help)", self.0)
    }
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, CliError> {
    v.parse()
        .map_err(|_| CliError(format!("{flag}: `{v}` is not a valid number")))
}

fn millis(flag: &str, v: &str) -> Result<Duration, CliError> {
    let n: u64 = num(flag, v)?;
    if n == 0 {
        return Err(CliError(format!("{flag}: must be at least 1")));
    }
    Ok(Duration::from_millis(n))
}

fn at_least_one(flag: &str, v: &str) -> Result<usize, CliError> {
    let n: usize = num(flag, v)?;
    if n == 0 {
        return Err(CliError(format!("{flag}: must be at least 1")));
    }
    Ok(n)
}

/// `NAME:PORT` (`[v6]:PORT` accepted too).
fn host_port(flag: &str, v: &str) -> Result<(String, u16), CliError> {
    let (host, port) = v
        .rsplit_once(':')
        .ok_or_else(|| CliError(format!("{flag}: `{v}` is not NAME:PORT")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(CliError(format!("{flag}: `{v}` has no name")));
    }
    Ok((host.to_string(), num(flag, port)?))
}

pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command, CliError> {
    let mut cfg = Config::default();
    let mut static_lists = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if flag == "--no-events" {
            if inline.is_some() {
                return Err(CliError("--no-events takes no value".into()));
            }
            cfg.no_events = true;
            continue;
        }
        if !flag.starts_with("--") {
            return Err(CliError(format!("unexpected argument `{arg}`")));
        }
        let value = match inline {
            Some(v) => v,
            None => args
                .next()
                .ok_or_else(|| CliError(format!("{flag} needs a value")))?,
        };
        let v = value.as_str();
        match flag.as_str() {
            "--listen" => {
                cfg.listen = v
                    .parse()
                    .map_err(|_| CliError(format!("--listen: `{v}` is not ip:port")))?
            }
            "--workers" => static_lists.push(value.clone()),
            "--dns" => cfg.dns.push(host_port("--dns", v)?),
            "--dns-interval-ms" => cfg.dns_interval = millis(&flag, v)?,
            "--workers-file" => cfg.workers_files.push(PathBuf::from(v)),
            "--events-port" => cfg.events_port = num(&flag, v)?,
            "--replay-port" => cfg.replay_port = Some(num(&flag, v)?),
            "--topic" => cfg.topic = value.clone(),
            "--scrape-ms" => cfg.scrape_interval = millis(&flag, v)?,
            "--scrape-timeout-ms" => cfg.scrape_timeout = millis(&flag, v)?,
            "--unhealthy-after" => {
                cfg.unhealthy_after = u32::try_from(at_least_one(&flag, v)?)
                    .map_err(|_| CliError(format!("{flag}: too large")))?
            }
            "--max-blocks-per-worker" => cfg.max_blocks_per_worker = at_least_one(&flag, v)?,
            "--journal-entries" => cfg.journal_entries = at_least_one(&flag, v)?,
            "--eds-file" => cfg.eds_file = Some(PathBuf::from(v)),
            "--eds-cluster" => cfg.eds_cluster = value.clone(),
            "--dns-guard" | "--dns-guard-upstream" => {
                let addr = v
                    .parse()
                    .map_err(|_| CliError(format!("{flag}: `{v}` is not ip:port")))?;
                if flag == "--dns-guard" {
                    cfg.dns_guard = Some(addr);
                } else {
                    cfg.dns_guard_upstream = Some(addr);
                }
            }
            "--dns-guard-allow" => {
                cfg.dns_guard_policy = crate::dns_guard::Policy::from_allow(v)
                    .map_err(|e| CliError(format!("--dns-guard-allow: {e}")))?;
            }
            _ => return Err(CliError(format!("unknown option `{flag}`"))),
        }
    }
    let mut next_index = 0;
    for list in &static_lists {
        let specs =
            parse_static_list(list, next_index).map_err(|e| CliError(format!("--workers: {e}")))?;
        next_index += specs.len();
        cfg.workers.extend(specs);
    }
    Ok(Command::Run(Box::new(cfg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Config, CliError> {
        match parse_args(args.iter().map(|s| s.to_string()))? {
            Command::Run(c) => Ok(*c),
            Command::Help => Err(CliError("help".into())),
        }
    }

    #[test]
    fn defaults_match_the_interface() {
        let c = run(&[]).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:9902");
        assert_eq!(c.events_port, 5557);
        assert_eq!(c.replay_port, None);
        assert_eq!(c.scrape_interval, Duration::from_millis(100));
        assert_eq!(c.dns_interval, Duration::from_millis(1000));
        assert_eq!(c.topic, "");
        assert!(!c.no_events);
    }

    #[test]
    fn every_flag_in_both_forms() {
        let c = run(&[
            "--listen=0.0.0.0:0",
            "--workers",
            "a=10.0.0.1:8000,10.0.0.2:8000",
            "--workers=10.0.0.3:8000",
            "--dns",
            "vllm.ns.svc:8000",
            "--dns",
            "[::1]:9",
            "--dns-interval-ms=250",
            "--workers-file",
            "/tmp/w",
            "--events-port=6000",
            "--replay-port",
            "6001",
            "--no-events",
            "--topic",
            "kv@",
            "--scrape-ms=50",
            "--scrape-timeout-ms=70",
            "--unhealthy-after=3",
            "--max-blocks-per-worker=10",
            "--journal-entries=20",
        ])
        .unwrap();
        let names: Vec<_> = c.workers.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["a", "w1", "w2"]);
        assert_eq!(
            c.dns,
            vec![("vllm.ns.svc".to_string(), 8000), ("::1".to_string(), 9)]
        );
        assert_eq!(c.dns_interval, Duration::from_millis(250));
        assert_eq!(c.workers_files, vec![PathBuf::from("/tmp/w")]);
        assert_eq!((c.events_port, c.replay_port), (6000, Some(6001)));
        assert!(c.no_events);
        assert_eq!(c.topic, "kv@");
        assert_eq!(c.scrape_timeout, Duration::from_millis(70));
        assert_eq!(
            (
                c.unhealthy_after,
                c.max_blocks_per_worker,
                c.journal_entries
            ),
            (3, 10, 20)
        );
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        for (args, needle) in [
            (&["--scrape-ms", "0"][..], "--scrape-ms: must be at least 1"),
            (&["--dns", "nohost"], "not NAME:PORT"),
            (&["--workers", "a=b=c"], "--workers"),
            (&["--workers", "bad name=1.2.3.4:5"], "--workers"),
            (&["--listen", "localhost"], "--listen"),
            (&["--frobnicate", "1"], "unknown option"),
            (&["--topic"], "needs a value"),
        ] {
            let e = run(args).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
        assert_eq!(parse_args(["--help".to_string()]).unwrap(), Command::Help);
    }
}
