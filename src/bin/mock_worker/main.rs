//! mock-worker: a mock vLLM OpenAI server, so the router stack runs and is tested without a
//! GPU. It renders prompts, emulates vLLM's prefix cache and scheduler, and sleeps as a GPU
//! would, so a routing decision shows in `cached_tokens`, in `/metrics` and in latency.
//! See docs/MOCK_WORKER.md and `mock-worker --help`.
//!
//! Modules: [`cli`] (arguments), [`http`] (routes and response shapes), [`request`] (the
//! request parser, strict like vLLM), [`media`] and [`fetch`] (images), [`prompt`] (chat
//! template and tokens), [`prefix_cache`] (block hashes and the block pool), [`engine`]
//! (queue, admission, timing), [`histogram`] (its timing histograms), [`metrics`] (`/metrics`),
//! [`kv_publisher`] (KV events over ZMQ).

mod cli;
mod engine;
mod fetch;
mod histogram;
mod http;
mod kv_publisher;
mod media;
mod metrics;
mod prefix_cache;
mod prompt;
mod request;

use cli::{Command, Config, USAGE, parse_args};
use engine::{Engine, EngineConfig};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

fn main() -> ExitCode {
    let cfg = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(c)) => c,
        Err(e) => {
            eprintln!("mock-worker: {e}");
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
            eprintln!("mock-worker: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mock-worker: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cfg: Config) -> Result<(), String> {
    let profile = mmrouter::tokens::Profile::parse(&cfg.profile)
        .map_err(|e| format!("--profile {}: {e}", cfg.profile))?;
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| format!("cannot listen on {}:{}: {e}", cfg.host, cfg.port))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let name = cfg
        .name
        .clone()
        .unwrap_or_else(|| format!("mock-{}", addr.port()));
    let shutdown = shutdown_signal();
    let mut events: Box<dyn prefix_cache::KvEventSink> = Box::new(prefix_cache::NoEvents);
    if let Some(kv) = cfg.kv_events.as_ref().filter(|kv| kv.publishes()) {
        let p = kv_publisher::start(kv, &cfg.host, &name).await?;
        // Before `listening on`: whoever waits for that line can read this one already.
        eprintln!(
            "[{name}] kv-events on {}{}{}",
            p.endpoint,
            if p.connects { " (connect)" } else { "" },
            p.replay_endpoint
                .as_ref()
                .map(|r| format!(" replay {r}"))
                .unwrap_or_default(),
        );
        events = Box::new(p.sink);
    }
    let engine = Engine::with_events(
        EngineConfig {
            block_size: cfg.block_size,
            num_gpu_blocks: cfg.num_gpu_blocks,
            max_num_seqs: cfg.max_num_seqs,
            prefill_tokens_per_sec: cfg.prefill_tokens_per_sec,
            decode_tokens_per_sec: cfg.decode_tokens_per_sec,
            encoder_ms_per_image: cfg.encoder_ms_per_image,
            time_scale: cfg.time_scale,
            mm_cache_items: cfg.mm_cache_items,
        },
        events,
    );
    let app = Arc::new(http::App {
        engine: engine.clone(),
        model: cfg.model.clone(),
        name: name.clone(),
        profile,
        default_max_tokens: cfg.default_max_tokens,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        next_id: AtomicU64::new(0),
    });
    eprintln!(
        "[{name}] listening on {addr} model={} profile={} block_size={} num_gpu_blocks={} \
         max_num_seqs={} time_scale={}",
        cfg.model,
        cfg.profile,
        cfg.block_size,
        cfg.num_gpu_blocks,
        cfg.max_num_seqs,
        cfg.time_scale
    );
    http::serve(listener, app, shutdown).await;
    // Stop accepting, then give in-flight requests up to 5 s to finish.
    eprintln!("[{name}] shutting down");
    for _ in 0..100 {
        let s = engine.snapshot();
        if s.running == 0 && s.waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Registers SIGINT and SIGTERM handlers now (so a signal sent as soon as the worker says it
/// listens is not missed) and returns a future that completes on either.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let int = signal(SignalKind::interrupt());
    let term = signal(SignalKind::terminate());
    async move {
        let (Ok(mut int), Ok(mut term)) = (int, term) else {
            // No signal handling available: fall back to ctrl-c only.
            let _ = tokio::signal::ctrl_c().await;
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    }
}
