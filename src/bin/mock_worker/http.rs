//! The HTTP face: vLLM's OpenAI-compatible routes on a hyper 1 server.
//!
//! Response shapes follow `vllm/entrypoints/openai` (chat.completion, chat.completion.chunk,
//! text_completion): streamed chunks are written like `model_dump_json(exclude_unset=True)`
//! (a first chunk with `delta.role`, then content deltas, `finish_reason` on the last one),
//! the optional usage chunk has `choices: []`, then `data: [DONE]`. `usage` carries
//! `prompt_tokens_details.cached_tokens` as vLLM does with `--enable-prompt-tokens-details`:
//! only when some tokens hit the cache (otherwise `null` in a full response and absent in the
//! streamed usage chunk). Errors are `{"error":{"message","type","param","code"}}`.

use crate::engine::{Engine, EngineError, Ticket};
use crate::media::{MediaError, load_images};
use crate::metrics;
use crate::prompt::{output_token, render};
use crate::request::parse;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use mmrouter::request::{ApiKind, Limits, RequestError};
use mmrouter::tokens::Profile;
use serde::Deserialize;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Largest request body read, in bytes.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Everything a handler needs.
pub struct App {
    pub engine: Arc<Engine>,
    pub model: String,
    pub name: String,
    pub profile: Profile,
    pub default_max_tokens: u32,
    pub started: u64,
    pub next_id: AtomicU64,
}

/// A full body or a stream of SSE frames.
pub enum MockBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            MockBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            MockBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, MockBody::Full(None))
    }

    /// Exact for a full body, so that hyper sends `content-length` instead of chunks.
    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            MockBody::Full(b) => {
                hyper::body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            MockBody::Stream(_) => hyper::body::SizeHint::default(),
        }
    }
}

/// An OpenAI-style error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn into_response(self) -> Response<MockBody> {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLargeError",
            s if s.is_server_error() => "InternalServerError",
            _ => "BadRequestError",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": null,
            "code": self.status.as_u16(),
        }});
        json_response(self.status, &body)
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::TooLarge { .. } => ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: e.to_string(),
            },
            e => ApiError::bad_request(e.to_string()),
        }
    }
}

impl From<MediaError> for ApiError {
    fn from(e: MediaError) -> Self {
        ApiError::bad_request(e.to_string())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        ApiError::bad_request(e.to_string())
    }
}

fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<MockBody> {
    let mut r = Response::new(MockBody::Full(Some(body.into())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<MockBody> {
    full(status, "application/json", v.to_string())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Serves connections from `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<App>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                eprintln!("[{}] accept failed: {e}", app.name);
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let app = app.clone();
                async move { Ok::<_, Infallible>(handle(app, req).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Every response carries `x-mock-worker`.
async fn handle(app: Arc<App>, req: Request<Incoming>) -> Response<MockBody> {
    let mut resp = route(&app, req)
        .await
        .unwrap_or_else(ApiError::into_response);
    if let Ok(v) = HeaderValue::from_str(&app.name) {
        resp.headers_mut().insert("x-mock-worker", v);
    }
    resp
}

async fn route(app: &Arc<App>, req: Request<Incoming>) -> Result<Response<MockBody>, ApiError> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::GET, "/health") => Ok(full(StatusCode::OK, "application/json", "")),
        (Method::GET, "/v1/models") => Ok(models(app)),
        (Method::GET, "/metrics") => {
            let text = metrics::render(&app.model, app.engine.config(), &app.engine.snapshot());
            Ok(full(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                text,
            ))
        }
        (Method::POST, "/v1/chat/completions") => {
            let body = read_body(req).await?;
            generate(app, body, ApiKind::Chat).await
        }
        (Method::POST, "/v1/completions") => {
            let body = read_body(req).await?;
            generate(app, body, ApiKind::Completion).await
        }
        // vLLM serves it with VLLM_SERVER_DEV_MODE=1 (`vllm/entrypoints/serve/dev/cache`);
        // the query options (reset_running_requests, reset_external) are not emulated.
        (Method::POST, "/reset_prefix_cache") => {
            let success = app.engine.reset_prefix_cache();
            eprintln!("[{}] /reset_prefix_cache success={success}", app.name);
            Ok(json_response(
                StatusCode::OK,
                &json!({ "success": success }),
            ))
        }
        (
            _,
            "/health"
            | "/v1/models"
            | "/metrics"
            | "/v1/chat/completions"
            | "/v1/completions"
            | "/reset_prefix_cache",
        ) => Ok(json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"detail": "Method Not Allowed"}),
        )),
        _ => Ok(json_response(
            StatusCode::NOT_FOUND,
            &json!({"detail": "Not Found"}),
        )),
    }
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("cannot read the request body: {e}"),
        }),
    }
}

fn models(app: &App) -> Response<MockBody> {
    let cfg = app.engine.config();
    let body = json!({
        "object": "list",
        "data": [{
            "id": app.model,
            "object": "model",
            "created": app.started,
            "owned_by": "vllm",
            "root": app.model,
            "parent": null,
            "max_model_len": cfg.num_gpu_blocks as usize * cfg.block_size,
            "permission": [{
                "id": format!("modelperm-{}", app.name),
                "object": "model_permission",
                "created": app.started,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        }],
    });
    json_response(StatusCode::OK, &body)
}

/// The sampling options the mock honours (everything else is ignored).
#[derive(Deserialize, Default)]
#[serde(default)]
struct Options {
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// What one finished generation reports.
struct Done {
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
}

fn usage(d: &Done, streamed: bool) -> Value {
    let mut u = json!({
        "prompt_tokens": d.prompt_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "completion_tokens": d.completion_tokens,
        "prompt_tokens_details": null,
    });
    if d.cached_tokens > 0 {
        u["prompt_tokens_details"] = json!({"cached_tokens": d.cached_tokens});
    } else if streamed && let Some(o) = u.as_object_mut() {
        o.remove("prompt_tokens_details");
    }
    u
}

async fn generate(
    app: &Arc<App>,
    body: Bytes,
    api: ApiKind,
) -> Result<Response<MockBody>, ApiError> {
    let req = parse(&body, &Limits::default())?;
    if req.api != api {
        return Err(ApiError::bad_request(match api {
            ApiKind::Chat => "`messages` is required for /v1/chat/completions",
            ApiKind::Completion => "`prompt` is required for /v1/completions",
        }));
    }
    let opts: Options = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))?;
    if req.model != app.model {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{}` does not exist.", req.model),
        });
    }
    let requested = match api {
        ApiKind::Chat => opts.max_completion_tokens.or(opts.max_tokens),
        ApiKind::Completion => opts.max_tokens,
    };
    let max_tokens = match requested {
        None => app.default_max_tokens as usize,
        Some(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "max_tokens must be at least 1, got {n}."
            )));
        }
    };
    let images = load_images(&req, &app.model, &app.profile, &app.engine.image_fetches).await?;
    let rendered = render(&req, &images);
    if rendered.tokens.is_empty() {
        return Err(ApiError::bad_request("The decoder prompt cannot be empty"));
    }
    let n_images = images.len();
    let salt = req.cache_salt.as_ref().map(|s| s.to_string());
    let stream = req.stream;
    let include_usage = opts
        .stream_options
        .as_ref()
        .and_then(|s| s.include_usage)
        .unwrap_or(false);
    let prepared = app
        .engine
        .prepare(rendered.tokens, rendered.mm, salt, max_tokens)?;
    let seq = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id_hash = xxhash_rust::xxh3::xxh3_128(
        format!("{}/{}/{}/{seq}", app.name, app.started, now_secs()).as_bytes(),
    );
    let id = match api {
        ApiKind::Chat => format!("chatcmpl-{id_hash:032x}"),
        ApiKind::Completion => format!("cmpl-{id_hash:032x}"),
    };
    let meta = Meta {
        id,
        created: now_secs(),
        api,
        n_images,
        start: Instant::now(),
    };
    if stream {
        let (tx, rx) = mpsc::channel::<Bytes>(32);
        let app = app.clone();
        tokio::spawn(async move {
            // A client that leaves while queued gives its place up.
            let ticket = tokio::select! {
                t = app.engine.submit(prepared) => t,
                _ = tx.closed() => return,
            };
            run_stream(&app, ticket, &meta, include_usage, tx).await;
        });
        let mut r = Response::new(MockBody::Stream(rx));
        r.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        return Ok(r);
    }
    let mut ticket = app.engine.submit(prepared).await;
    ticket.prefill().await;
    let ttft = meta.start.elapsed();
    let seed = ticket.output_seed();
    let mut text = String::new();
    let mut ids = Vec::with_capacity(ticket.max_tokens());
    for i in 0..ticket.max_tokens() {
        if i > 0 {
            ticket.decode_step().await;
        }
        let (t, tok) = output_token(seed, i);
        text.push_str(&t);
        ids.push(tok);
    }
    let done = finish(app, ticket, &ids, &meta, ttft);
    let u = usage(&done, false);
    let body = match api {
        ApiKind::Chat => json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": app.model,
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": null,
                    "annotations": null,
                    "audio": null,
                    "function_call": null,
                    "tool_calls": [],
                    "reasoning_content": null,
                },
                "logprobs": null,
                "finish_reason": "length",
                "stop_reason": null,
            }],
            "service_tier": null,
            "system_fingerprint": null,
            "usage": u,
            "prompt_logprobs": null,
            "kv_transfer_params": null,
        }),
        ApiKind::Completion => json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": app.model,
            "choices": [{
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": "length",
                "stop_reason": null,
                "prompt_logprobs": null,
            }],
            "service_tier": null,
            "system_fingerprint": null,
            "usage": u,
            "kv_transfer_params": null,
        }),
    };
    Ok(json_response(StatusCode::OK, &body))
}

struct Meta {
    id: String,
    created: u64,
    api: ApiKind,
    n_images: usize,
    start: Instant,
}

/// Finishes the ticket and logs the request line.
fn finish(app: &App, ticket: Ticket, ids: &[u32], meta: &Meta, ttft: std::time::Duration) -> Done {
    let done = Done {
        prompt_tokens: ticket.prompt_tokens(),
        cached_tokens: ticket.cached_tokens,
        completion_tokens: ids.len(),
    };
    let queued = ticket.queued;
    let encoder = ticket.encoder_images;
    ticket.finish(ids);
    eprintln!(
        "[{}] {} prompt_tokens={} cached_tokens={} images={} encoder_runs={} output_tokens={} \
         queued_ms={:.1} ttft_ms={:.1} total_ms={:.1}",
        app.name,
        match meta.api {
            ApiKind::Chat => "/v1/chat/completions",
            ApiKind::Completion => "/v1/completions",
        },
        done.prompt_tokens,
        done.cached_tokens,
        meta.n_images,
        encoder,
        done.completion_tokens,
        queued.as_secs_f64() * 1e3,
        ttft.as_secs_f64() * 1e3,
        meta.start.elapsed().as_secs_f64() * 1e3,
    );
    done
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn chunk(app: &App, meta: &Meta, choices: Value) -> Value {
    let object = match meta.api {
        ApiKind::Chat => "chat.completion.chunk",
        ApiKind::Completion => "text_completion",
    };
    json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": app.model,
        "choices": choices,
    })
}

/// Streams one generation; returns early (dropping the ticket: an abort) if the client left.
async fn run_stream(
    app: &App,
    mut ticket: Ticket,
    meta: &Meta,
    include_usage: bool,
    tx: mpsc::Sender<Bytes>,
) {
    ticket.prefill().await;
    let ttft = meta.start.elapsed();
    if meta.api == ApiKind::Chat {
        let first = chunk(
            app,
            meta,
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null}]),
        );
        if tx.send(sse(&first)).await.is_err() {
            return;
        }
    }
    let seed = ticket.output_seed();
    let m = ticket.max_tokens();
    let mut ids = Vec::with_capacity(m);
    for i in 0..m {
        if i > 0 {
            ticket.decode_step().await;
        }
        let (text, tok) = output_token(seed, i);
        ids.push(tok);
        let last = i + 1 == m;
        let choice = match (meta.api, last) {
            (ApiKind::Chat, false) => json!({"index": 0, "delta": {"content": text},
                "logprobs": null, "finish_reason": null}),
            (ApiKind::Chat, true) => json!({"index": 0, "delta": {"content": text},
                "logprobs": null, "finish_reason": "length", "stop_reason": null}),
            (ApiKind::Completion, false) => json!({"index": 0, "text": text,
                "logprobs": null, "finish_reason": null, "stop_reason": null}),
            (ApiKind::Completion, true) => json!({"index": 0, "text": text,
                "logprobs": null, "finish_reason": "length", "stop_reason": null}),
        };
        if tx
            .send(sse(&chunk(app, meta, json!([choice]))))
            .await
            .is_err()
        {
            return;
        }
    }
    let done = finish(app, ticket, &ids, meta, ttft);
    if include_usage {
        let mut c = chunk(app, meta, json!([]));
        c["usage"] = usage(&done, true);
        let _ = tx.send(sse(&c)).await;
    }
    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
}
