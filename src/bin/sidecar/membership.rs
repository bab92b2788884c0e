//! Which workers exist: a static list, DNS names re-resolved on a timer, watched files. Each
//! source publishes its current list into a [`Sources`] slot; [`Sources::desired`] combines
//! them (first source wins a name or an address) and `main` reconciles the registry with it.

use crate::log;
use mmrouter::feed::valid_worker_name;
use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::sync::Notify;

/// One worker as a membership source describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// 1-64 chars of `[A-Za-z0-9_.-]`.
    pub name: String,
    /// The worker's HTTP server.
    pub addr: SocketAddr,
    /// Its KV-event PUB endpoint, when the source names one (`events=` in a file).
    pub events: Option<String>,
    /// Its replay ROUTER endpoint, when the source names one (`replay=` in a file).
    pub replay: Option<String>,
}

/// `tcp://ip:port` (`tcp://[ip]:port` for IPv6).
pub fn tcp_endpoint(ip: IpAddr, port: u16) -> String {
    format!("tcp://{}", SocketAddr::new(ip, port))
}

/// `name=ip:port,...` or `ip:port,...`; an unnamed entry at list position `i` is `w{first + i}`.
pub fn parse_static_list(list: &str, first: usize) -> Result<Vec<WorkerSpec>, String> {
    let mut out = Vec::new();
    for (i, item) in list.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            continue;
        }
        let (name, addr) = match item.split_once('=') {
            Some((n, a)) => (n.trim().to_string(), a.trim()),
            None => (format!("w{}", first + i), item),
        };
        if !valid_worker_name(&name) {
            return Err(format!(
                "`{name}` is not a worker name (1-64 chars of [A-Za-z0-9_.-])"
            ));
        }
        let addr = addr
            .parse()
            .map_err(|_| format!("`{addr}` is not ip:port"))?;
        out.push(WorkerSpec {
            name,
            addr,
            events: None,
            replay: None,
        });
    }
    Ok(out)
}

/// One line of a workers file: `name ip:port [events=tcp://...] [replay=tcp://...]`.
pub fn parse_file_line(line: &str) -> Result<Option<WorkerSpec>, String> {
    let line = line.split('#').next().unwrap_or("").trim();
    if line.is_empty() {
        return Ok(None);
    }
    let mut words = line.split_whitespace();
    let name = words.next().unwrap_or("").to_string();
    if !valid_worker_name(&name) {
        return Err(format!(
            "`{name}` is not a worker name (1-64 chars of [A-Za-z0-9_.-])"
        ));
    }
    let addr_text = words
        .next()
        .ok_or_else(|| format!("worker `{name}` has no ip:port"))?;
    let addr = addr_text
        .parse()
        .map_err(|_| format!("`{addr_text}` is not ip:port"))?;
    let mut spec = WorkerSpec {
        name,
        addr,
        events: None,
        replay: None,
    };
    for word in words {
        let (key, value) = word
            .split_once('=')
            .ok_or_else(|| format!("`{word}` is not events=... or replay=..."))?;
        let slot = match key {
            "events" => &mut spec.events,
            "replay" => &mut spec.replay,
            _ => return Err(format!("unknown key `{key}` (events= or replay=)")),
        };
        if !value.starts_with("tcp://") {
            return Err(format!("{key}: `{value}` is not a tcp:// endpoint"));
        }
        *slot = Some(value.to_string());
    }
    Ok(Some(spec))
}

/// Parses a whole workers file; bad lines are returned as `(line number, reason)`.
pub fn parse_file(text: &str) -> (Vec<WorkerSpec>, Vec<(usize, String)>) {
    let mut specs = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate() {
        match parse_file_line(line) {
            Ok(Some(s)) => specs.push(s),
            Ok(None) => {}
            Err(e) => errors.push((i + 1, e)),
        }
    }
    (specs, errors)
}

/// The name of a worker found through DNS: `IP_PORT`, an IPv6 address's colons written as
/// dashes (`10.1.2.3_8000`, `fd00--1_8000`).
pub fn dns_worker_name(addr: SocketAddr) -> String {
    format!(
        "{}_{}",
        addr.ip().to_string().replace(':', "-"),
        addr.port()
    )
}

/// The current list of every source.
pub struct Sources {
    slots: Mutex<Vec<Slot>>,
    changed: Notify,
}

struct Slot {
    label: String,
    specs: Vec<WorkerSpec>,
}

impl Sources {
    pub fn new() -> Arc<Sources> {
        Arc::new(Sources {
            slots: Mutex::new(Vec::new()),
            changed: Notify::new(),
        })
    }

    /// Adds a source; returns its slot.
    pub fn add(&self, label: String, specs: Vec<WorkerSpec>) -> usize {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.push(Slot { label, specs });
        self.changed.notify_one();
        slots.len() - 1
    }

    /// Replaces a source's list; wakes the reconciler when it differs.
    pub fn set(&self, slot: usize, specs: Vec<WorkerSpec>) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slots.get_mut(slot)
            && s.specs != specs
        {
            s.specs = specs;
            self.changed.notify_one();
        }
    }

    /// Waits until some source changed (at once if one changed since the last call).
    pub async fn wait_change(&self) {
        self.changed.notified().await;
    }

    /// The source labels, for `/v1/state`.
    pub fn labels(&self) -> Vec<String> {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.iter().map(|s| s.label.clone()).collect()
    }

    /// The union of all sources by name; on a clash of names or addresses the earlier source
    /// wins and the clash is returned as a message.
    pub fn desired(&self) -> (BTreeMap<String, WorkerSpec>, Vec<String>) {
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: BTreeMap<String, WorkerSpec> = BTreeMap::new();
        let mut addrs: HashSet<SocketAddr> = HashSet::new();
        let mut clashes = Vec::new();
        for slot in slots.iter() {
            for spec in &slot.specs {
                if let Some(prev) = out.get(&spec.name) {
                    if prev != spec {
                        clashes.push(format!(
                            "{}: worker {} at {} ignored: the name is already {} from an earlier source",
                            slot.label, spec.name, spec.addr, prev.addr
                        ));
                    }
                    continue;
                }
                if !addrs.insert(spec.addr) {
                    clashes.push(format!(
                        "{}: worker {} ignored: address {} already belongs to another worker",
                        slot.label, spec.name, spec.addr
                    ));
                    continue;
                }
                out.insert(spec.name.clone(), spec.clone());
            }
        }
        (out, clashes)
    }
}

/// A resolver of `host:port` to addresses (the system's in the program, a fake in tests).
pub trait Resolve: Send + Sync + 'static {
    fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>>;
}

/// getaddrinfo through tokio: every A and AAAA record.
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(
        &self,
        host: &str,
        port: u16,
    ) -> Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>> {
        let host = host.to_string();
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((host.as_str(), port)).await?;
            Ok(addrs.collect())
        })
    }
}

/// Re-resolves `host` every `interval` and publishes one worker per address. A failed
/// lookup keeps the last answer (a DNS blip must not drop every worker; a worker that is
/// really gone fails its scrapes and turns unhealthy).
pub async fn run_dns(
    host: String,
    port: u16,
    interval: Duration,
    resolver: Arc<dyn Resolve>,
    sources: Arc<Sources>,
    slot: usize,
) {
    let mut failing = false;
    loop {
        let lookup = tokio::time::timeout(
            interval.max(Duration::from_secs(2)),
            resolver.resolve(&host, port),
        )
        .await;
        match lookup {
            Ok(Ok(addrs)) => {
                if failing {
                    log!(
                        "dns {host}:{port}: resolves again ({} addresses)",
                        addrs.len()
                    );
                    failing = false;
                }
                let mut addrs: Vec<SocketAddr> = addrs
                    .into_iter()
                    .map(|a| SocketAddr::new(a.ip(), port))
                    .collect();
                addrs.sort();
                addrs.dedup();
                let specs = addrs
                    .into_iter()
                    .map(|addr| WorkerSpec {
                        name: dns_worker_name(addr),
                        addr,
                        events: None,
                        replay: None,
                    })
                    .collect();
                sources.set(slot, specs);
            }
            Ok(Err(e)) => {
                if !failing {
                    log!("dns {host}:{port}: lookup failed, keeping the last answer: {e}");
                    failing = true;
                }
            }
            Err(_) => {
                if !failing {
                    log!("dns {host}:{port}: lookup timed out, keeping the last answer");
                    failing = true;
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// How often a workers file's metadata is checked.
pub const FILE_POLL: Duration = Duration::from_millis(500);

/// Watches a workers file: re-reads it whenever its modification time or size changes. A
/// missing file is an empty list; bad lines are logged and skipped.
pub async fn run_file(path: PathBuf, poll: Duration, sources: Arc<Sources>, slot: usize) {
    let mut seen: Option<Option<(SystemTime, u64)>> = None;
    loop {
        let stamp = tokio::fs::metadata(&path)
            .await
            .ok()
            .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()));
        if seen != Some(stamp) {
            match tokio::fs::read_to_string(&path).await {
                Ok(text) => {
                    let (specs, errors) = parse_file(&text);
                    for (line, e) in errors {
                        log!("workers file {}:{line}: {e}; line skipped", path.display());
                    }
                    sources.set(slot, specs);
                }
                Err(e) => {
                    if stamp.is_some() || seen.is_none() {
                        log!(
                            "workers file {}: cannot read it ({e}); no workers from it",
                            path.display()
                        );
                    }
                    sources.set(slot, Vec::new());
                }
            }
            seen = Some(stamp);
        }
        tokio::time::sleep(poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn static_lists_name_unnamed_workers_by_position() {
        let w = parse_static_list("10.0.0.1:8000, b=10.0.0.2:8001,[::1]:9", 0).unwrap();
        let got: Vec<_> = w
            .iter()
            .map(|s| (s.name.as_str(), s.addr.to_string()))
            .collect();
        assert_eq!(
            got,
            [
                ("w0", "10.0.0.1:8000".to_string()),
                ("b", "10.0.0.2:8001".to_string()),
                ("w2", "[::1]:9".to_string())
            ]
        );
        assert!(
            parse_static_list("x=host:80", 0)
                .unwrap_err()
                .contains("ip:port")
        );
        assert!(
            parse_static_list("a b=1.2.3.4:5", 0)
                .unwrap_err()
                .contains("name")
        );
    }

    #[test]
    fn file_lines_with_endpoints_comments_and_errors() {
        let text = "# workers\n\
                    a 127.0.0.1:8000 events=tcp://127.0.0.1:5557 replay=tcp://127.0.0.1:5558\n\
                    \n\
                    b 127.0.0.1:8001   # no events endpoint: --events-port applies\n\
                    c localhost:8002\n\
                    d 127.0.0.1:8003 colour=blue\n";
        let (specs, errors) = parse_file(text);
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[0].events.as_deref(), Some("tcp://127.0.0.1:5557"));
        assert_eq!(specs[0].replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        assert_eq!(
            (specs[1].name.as_str(), specs[1].events.as_deref()),
            ("b", None)
        );
        assert_eq!(errors.len(), 2);
        assert_eq!(errors[0].0, 5);
        assert!(errors[1].1.contains("unknown key `colour`"), "{errors:?}");
    }

    #[test]
    fn dns_names_are_valid_worker_names() {
        for a in ["10.1.2.3:8000", "[fd00::1]:8000", "[::ffff:1.2.3.4]:1"] {
            let name = dns_worker_name(a.parse().unwrap());
            assert!(valid_worker_name(&name), "{name}");
        }
        assert_eq!(
            dns_worker_name("[fd00::1]:80".parse().unwrap()),
            "fd00--1_80"
        );
    }

    #[test]
    fn earlier_sources_win_names_and_addresses() {
        let s = Sources::new();
        let a = |n: &str, addr: &str| WorkerSpec {
            name: n.into(),
            addr: addr.parse().unwrap(),
            events: None,
            replay: None,
        };
        s.add(
            "static".into(),
            vec![a("x", "1.1.1.1:1"), a("y", "1.1.1.1:2")],
        );
        let slot = s.add("file".into(), vec![]);
        s.set(
            slot,
            vec![
                a("x", "2.2.2.2:1"),
                a("z", "1.1.1.1:2"),
                a("q", "3.3.3.3:3"),
            ],
        );
        let (d, clashes) = s.desired();
        assert_eq!(d.keys().cloned().collect::<Vec<_>>(), ["q", "x", "y"]);
        assert_eq!(d["x"].addr.to_string(), "1.1.1.1:1");
        assert_eq!(clashes.len(), 2, "{clashes:?}");
    }

    /// A resolver whose answer the test changes.
    struct Fake {
        answer: Mutex<io::Result<Vec<SocketAddr>>>,
        calls: AtomicUsize,
    }

    impl Resolve for Fake {
        fn resolve(
            &self,
            _host: &str,
            _port: u16,
        ) -> Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let a = match &*self.answer.lock().unwrap() {
                Ok(v) => Ok(v.clone()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            };
            Box::pin(async move { a })
        }
    }

    async fn names_within(s: &Sources, want: &[&str]) -> bool {
        for _ in 0..200 {
            let names: Vec<String> = s.desired().0.into_keys().collect();
            if names == want {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    }

    #[tokio::test]
    async fn dns_source_follows_the_answer_and_keeps_it_through_failures() {
        let fake = Arc::new(Fake {
            answer: Mutex::new(Ok(vec!["10.0.0.1:0".parse().unwrap()])),
            calls: AtomicUsize::new(0),
        });
        let s = Sources::new();
        let slot = s.add("dns".into(), vec![]);
        let task = tokio::spawn(run_dns(
            "svc".into(),
            8000,
            Duration::from_millis(10),
            fake.clone(),
            s.clone(),
            slot,
        ));
        assert!(names_within(&s, &["10.0.0.1_8000"]).await);
        *fake.answer.lock().unwrap() = Ok(vec![
            "10.0.0.2:0".parse().unwrap(),
            "[fd00::1]:0".parse().unwrap(),
            "10.0.0.2:0".parse().unwrap(),
        ]);
        assert!(names_within(&s, &["10.0.0.2_8000", "fd00--1_8000"]).await);
        *fake.answer.lock().unwrap() = Err(io::Error::other("SERVFAIL"));
        let calls = fake.calls.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(
            fake.calls.load(Ordering::SeqCst) > calls,
            "it keeps resolving"
        );
        assert!(names_within(&s, &["10.0.0.2_8000", "fd00--1_8000"]).await);
        *fake.answer.lock().unwrap() = Ok(vec![]);
        assert!(names_within(&s, &[]).await);
        task.abort();
    }

    #[tokio::test]
    async fn file_source_rereads_on_change_and_empties_when_removed() {
        let dir = std::env::temp_dir().join(format!(
            "mmrouter-sidecar-membership-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("workers");
        std::fs::write(&path, "a 127.0.0.1:1\n").unwrap();
        let s = Sources::new();
        let slot = s.add("file".into(), vec![]);
        let task = tokio::spawn(run_file(
            path.clone(),
            Duration::from_millis(5),
            s.clone(),
            slot,
        ));
        assert!(names_within(&s, &["a"]).await);
        std::fs::write(&path, "a 127.0.0.1:1\nb 127.0.0.1:2 # new\n").unwrap();
        assert!(names_within(&s, &["a", "b"]).await);
        std::fs::remove_file(&path).unwrap();
        assert!(names_within(&s, &[]).await);
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
