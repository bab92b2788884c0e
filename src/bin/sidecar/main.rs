//! mmrouter-sidecar: runs beside Envoy and watches the inference workers so the filter does
//! not have to: membership (static list, DNS, watched file), each worker's `/metrics`
//! (health, load, capacity, prefill speed) and its vLLM KV events over ZMQ (resident blocks
//! and the images they carry). The filter polls `GET /v1/feed`; people read `/v1/state`.
//! See docs/SIDECAR.md and `mmrouter-sidecar --help`.
//!
//! Modules: [`cli`] (arguments), [`dns_guard`] (the fetch DNS guard), [`membership`] (sources of workers), [`eds`] (the members
//! as an Envoy EDS file), [`scrape`]
//! (`/metrics`), [`events`] (ZMQ subscription, sequence, replay), [`residency`] (a worker's
//! resident blocks and images), [`journal`] (changes for feed deltas), [`registry`] (the
//! shared state and its views), [`http`] (endpoints), [`log`](mod@log) (stderr lines).

mod cli;
mod dns_guard;
mod eds;
mod events;
mod http;
mod journal;
mod log;
mod membership;
mod registry;
mod residency;
mod scrape;

use cli::{Command, Config, USAGE, parse_args};
use membership::{Resolve, Sources, SystemResolver, WorkerSpec, tcp_endpoint};
use registry::Registry;
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

fn main() -> ExitCode {
    log::start();
    let cfg = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(c)) => c,
        Err(e) => {
            eprintln!("mmrouter-sidecar: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mmrouter-sidecar: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(*cfg));
    // Worker tasks may be mid-connection; do not wait for them.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mmrouter-sidecar: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The KV-event endpoints of a worker: the source's, else the flags' on the worker's IP.
fn event_endpoints(spec: &WorkerSpec, cfg: &Config) -> (Option<String>, Option<String>) {
    if cfg.no_events {
        return (None, None);
    }
    let ip = spec.addr.ip();
    let events = spec
        .events
        .clone()
        .unwrap_or_else(|| tcp_endpoint(ip, cfg.events_port));
    let replay = spec
        .replay
        .clone()
        .or_else(|| cfg.replay_port.map(|p| tcp_endpoint(ip, p)));
    (Some(events), replay)
}

async fn run(cfg: Config) -> Result<(), String> {
    let cfg = Arc::new(cfg);
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let shutdown = shutdown_signal();
    let registry = Arc::new(Mutex::new(Registry::new(
        cfg.max_blocks_per_worker,
        cfg.journal_entries,
        cfg.unhealthy_after,
    )));
    let sources = Sources::new();
    if !cfg.workers.is_empty() {
        sources.add("static".into(), cfg.workers.clone());
    }
    let mut background: Vec<JoinHandle<()>> = Vec::new();
    let resolver: Arc<dyn Resolve> = Arc::new(SystemResolver);
    for (host, port) in &cfg.dns {
        let slot = sources.add(format!("dns {host}:{port}"), Vec::new());
        background.push(tokio::spawn(membership::run_dns(
            host.clone(),
            *port,
            cfg.dns_interval,
            resolver.clone(),
            sources.clone(),
            slot,
        )));
    }
    for path in &cfg.workers_files {
        let slot = sources.add(format!("file {}", path.display()), Vec::new());
        background.push(tokio::spawn(membership::run_file(
            path.clone(),
            membership::FILE_POLL,
            sources.clone(),
            slot,
        )));
    }
    let labels = sources.labels();
    let epoch = {
        let mut reg = registry.lock().unwrap_or_else(|e| e.into_inner());
        reg.sources = labels.clone();
        reg.epoch
    };
    log!(
        "listening on {addr} epoch={epoch} membership=[{}] events: {} scrape every {} ms",
        labels.join(", "),
        if cfg.no_events {
            "off;".to_string()
        } else {
            format!(
                "default port {}, replay {};",
                cfg.events_port,
                cfg.replay_port
                    .map_or("off".to_string(), |p| format!("port {p}"))
            )
        },
        cfg.scrape_interval.as_millis()
    );
    if labels.is_empty() {
        log!("no membership source (--workers, --dns, --workers-file): no workers to watch");
    }
    if let Some(guard) = cfg.dns_guard {
        let upstream = match cfg.dns_guard_upstream.or_else(dns_guard::system_upstream) {
            Some(u) => u,
            None => {
                // Nothing to ask: every query gets SERVFAIL, and fetches of names fail closed.
                log!("dns guard: no --dns-guard-upstream and no nameserver in /etc/resolv.conf");
                std::net::SocketAddr::from(([127, 0, 0, 1], 53))
            }
        };
        let socket = tokio::net::UdpSocket::bind(guard)
            .await
            .map_err(|e| format!("cannot listen on udp {guard}: {e}"))?;
        let bound = socket.local_addr().map_err(|e| e.to_string())?;
        log!("dns guard on udp {bound}, upstream {upstream}");
        background.push(tokio::spawn(dns_guard::serve(
            socket,
            upstream,
            cfg.dns_guard_policy.clone(),
        )));
    }
    background.push(tokio::spawn(reconcile(
        sources.clone(),
        registry.clone(),
        cfg.clone(),
    )));
    http::serve(listener, registry, shutdown).await;
    log!("shutting down");
    for task in background {
        task.abort();
    }
    Ok(())
}

/// Keeps the registry and the per-worker tasks equal to the combined membership.
async fn reconcile(sources: Arc<Sources>, registry: Arc<Mutex<Registry>>, cfg: Arc<Config>) {
    let mut running: HashMap<String, (WorkerSpec, Vec<JoinHandle<()>>)> = HashMap::new();
    let mut eds_version = 0u64;
    loop {
        sources.wait_change().await;
        let (desired, clashes) = sources.desired();
        // The first change can come before the sources have been read (no workers yet): a
        // restarted sidecar must not empty Envoy's cluster, which would fail every request
        // until the next write. An empty set is written only once a non-empty one was.
        let unread = eds_version == 0 && desired.is_empty();
        if let Some(path) = cfg.eds_file.as_ref().filter(|_| !unread) {
            eds_version += 1;
            let members: Vec<&WorkerSpec> = desired.values().collect();
            match eds::write(path, &cfg.eds_cluster, eds_version, &members) {
                Ok(()) => log!(
                    "eds: {} workers written to {} (version {eds_version})",
                    members.len(),
                    path.display()
                ),
                Err(e) => log!("{e}"),
            }
        }
        for c in clashes {
            log!("{c}");
        }
        let gone: Vec<String> = running
            .iter()
            .filter(|(name, (spec, _))| desired.get(*name) != Some(spec))
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            if let Some((spec, tasks)) = running.remove(&name) {
                for t in tasks {
                    t.abort();
                }
                registry
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .leave(&name);
                log!("leave {name} {}", spec.addr);
            }
        }
        for (name, spec) in desired {
            if running.contains_key(&name) {
                continue;
            }
            let (events, replay) = event_endpoints(&spec, &cfg);
            let shared = registry.lock().unwrap_or_else(|e| e.into_inner()).join(
                spec.clone(),
                events.clone(),
                replay.clone(),
            );
            log!(
                "join {name} {} events={} replay={}",
                spec.addr,
                events.as_deref().unwrap_or("off"),
                replay.as_deref().unwrap_or("off")
            );
            let mut tasks = vec![tokio::spawn(scrape::run(
                shared.clone(),
                spec.addr,
                cfg.scrape_interval,
                cfg.scrape_timeout,
                registry.clone(),
            ))];
            if let Some(endpoint) = events {
                tasks.push(tokio::spawn(events::run(
                    shared,
                    endpoint,
                    replay,
                    cfg.topic.clone(),
                    registry.clone(),
                )));
            }
            running.insert(name, (spec, tasks));
        }
    }
}

/// Registers SIGINT and SIGTERM handlers now and returns a future that completes on either.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let int = signal(SignalKind::interrupt());
    let term = signal(SignalKind::terminate());
    async move {
        let (Ok(mut int), Ok(mut term)) = (int, term) else {
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    }
}
