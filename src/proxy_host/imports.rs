//! The host functions: proxy-wasm ABI 0.2.1 (module `env`) and the WASI preview1 subset a
//! proxy-wasm module built for wasm32-wasip1 imports. Any other import the module declares is
//! linked to a function that traps with the import's name.

use super::abi::{
    BufferType, HeaderMap, LogLevel, MapType, MetricKind, Status, StreamType, deserialize_pairs,
    split_property_path,
};
use super::vm::{HttpCall, LocalResponse, LogSource, VmState, len_i32};
use super::{lock, next_http_token, shared::QueueTarget};
use std::time::Duration;
use wasmtime::{Caller, Engine, Extern, Linker, Module, format_err};

type C<'a> = Caller<'a, VmState>;

/// A host function's failure: a status for the guest, or a trap.
enum Fail {
    Status(Status),
    Trap(wasmtime::Error),
}

impl From<Status> for Fail {
    fn from(s: Status) -> Self {
        Fail::Status(s)
    }
}

impl From<wasmtime::Error> for Fail {
    fn from(e: wasmtime::Error) -> Self {
        Fail::Trap(e)
    }
}

type R = Result<Status, Fail>;

fn ret(r: R) -> wasmtime::Result<i32> {
    match r {
        Ok(s) | Err(Fail::Status(s)) => Ok(s.code()),
        Err(Fail::Trap(e)) => Err(e),
    }
}

/// WASI errno values used here.
const ERRNO_SUCCESS: i32 = 0;
const ERRNO_BADF: i32 = 8;
const ERRNO_FAULT: i32 = 21;
const ERRNO_INVAL: i32 = 28;

fn wasi_ret(r: Result<(), i32>) -> wasmtime::Result<i32> {
    Ok(match r {
        Ok(()) => ERRNO_SUCCESS,
        Err(e) => e,
    })
}

fn memory(c: &mut C<'_>) -> Result<wasmtime::Memory, Status> {
    c.get_export("memory")
        .and_then(Extern::into_memory)
        .ok_or(Status::InvalidMemoryAccess)
}

fn read(c: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
    let len = len as u32 as usize;
    if len == 0 {
        return Ok(Vec::new());
    }
    let mem = memory(c)?;
    let start = ptr as u32 as usize;
    let end = start.checked_add(len).ok_or(Status::InvalidMemoryAccess)?;
    mem.data(&*c)
        .get(start..end)
        .map(|s| s.to_vec())
        .ok_or(Status::InvalidMemoryAccess)
}

fn read_str(c: &mut C<'_>, ptr: i32, len: i32) -> Result<String, Status> {
    String::from_utf8(read(c, ptr, len)?).map_err(|_| Status::BadArgument)
}

fn write(c: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<(), Status> {
    let mem = memory(c)?;
    let start = ptr as u32 as usize;
    let end = start
        .checked_add(bytes.len())
        .ok_or(Status::InvalidMemoryAccess)?;
    mem.data_mut(&mut *c)
        .get_mut(start..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

fn write_u32(c: &mut C<'_>, ptr: i32, v: u32) -> Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

fn write_u64(c: &mut C<'_>, ptr: i32, v: u64) -> Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

/// Copies `data` into memory the guest allocates (`proxy_on_memory_allocate`, else `malloc`)
/// and writes its address and size to the two return pointers. Empty data is returned as a
/// null pointer and size 0 (the Rust SDK reads that as "no value").
fn give(c: &mut C<'_>, data: &[u8], ret_ptr: i32, ret_size: i32) -> Result<(), Fail> {
    if data.is_empty() {
        write_u32(c, ret_ptr, 0)?;
        write_u32(c, ret_size, 0)?;
        return Ok(());
    }
    let alloc = c
        .get_export("proxy_on_memory_allocate")
        .or_else(|| c.get_export("malloc"))
        .and_then(Extern::into_func)
        .ok_or_else(|| format_err!("module exports neither proxy_on_memory_allocate nor malloc"))?;
    let alloc = alloc.typed::<i32, i32>(&*c)?;
    let ptr = alloc.call(&mut *c, len_i32(data.len()))?;
    if ptr == 0 {
        return Err(Fail::Trap(format_err!(
            "the module's allocator returned 0 for {} bytes",
            data.len()
        )));
    }
    write(c, ptr, data)
        .map_err(|_| format_err!("the module's allocator returned an out-of-bounds pointer"))?;
    write_u32(c, ret_ptr, ptr as u32)?;
    write_u32(c, ret_size, data.len() as u32)?;
    Ok(())
}

/// The header map `map` of the effective context, if it has one now.
fn map_mut(st: &mut VmState, map: MapType) -> Option<&mut HeaderMap> {
    match map {
        MapType::HttpCallResponseHeaders => st.call_response.as_mut().map(|r| &mut r.headers),
        MapType::HttpCallResponseTrailers => st.call_response.as_mut().map(|r| &mut r.trailers),
        MapType::GrpcInitialMetadata | MapType::GrpcTrailingMetadata => None,
        MapType::RequestHeaders => st.stream_mut().map(|s| &mut s.request_headers),
        MapType::RequestTrailers => st.stream_mut().map(|s| &mut s.request_trailers),
        MapType::ResponseHeaders => st.stream_mut().map(|s| &mut s.response_headers),
        MapType::ResponseTrailers => st.stream_mut().map(|s| &mut s.response_trailers),
    }
}

fn map_type(v: i32) -> Result<MapType, Status> {
    MapType::from_i32(v).ok_or(Status::BadArgument)
}

/// The buffer `buf` of the effective context (None: not available now).
fn buffer_mut(st: &mut VmState, buf: BufferType) -> Option<&mut Vec<u8>> {
    match buf {
        BufferType::RequestBody => st.stream_mut().map(|s| &mut s.request_body),
        BufferType::ResponseBody => st.stream_mut().map(|s| &mut s.response_body),
        BufferType::HttpCallResponseBody => st.call_response.as_mut().map(|r| &mut r.body),
        BufferType::VmConfiguration => Some(&mut st.config.vm_config),
        BufferType::PluginConfiguration => Some(&mut st.config.plugin_config),
        BufferType::DownstreamData
        | BufferType::UpstreamData
        | BufferType::GrpcReceiveBuffer
        | BufferType::CallData => None,
    }
}

pub(crate) fn linker(engine: &Engine, module: &Module) -> wasmtime::Result<Linker<VmState>> {
    let mut l: Linker<VmState> = Linker::new(engine);
    define_env(&mut l)?;
    define_wasi(&mut l)?;
    // Every other import traps loudly, naming itself.
    for import in module.imports() {
        if let wasmtime::ExternType::Func(ty) = import.ty() {
            let m = import.module().to_string();
            let n = import.name().to_string();
            let what = format!("{m}::{n}");
            // Errors here only mean "already defined by us".
            let _ = l.func_new(&m, &n, ty.clone(), move |_, _, _| {
                Err(format_err!(
                    "proxy_host: unimplemented import `{what}` was called"
                ))
            });
        }
    }
    Ok(l)
}

fn define_env(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    const ENV: &str = "env";

    // ---- logging ----
    l.func_wrap(
        ENV,
        "proxy_log",
        |mut c: C<'_>, level: i32, p: i32, n: i32| {
            ret((|| {
                let level = LogLevel::from_u32(level as u32).ok_or(Status::BadArgument)?;
                let msg = read(&mut c, p, n)?;
                let msg = String::from_utf8_lossy(&msg).into_owned();
                c.data_mut().log(level, msg, LogSource::ProxyLog);
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(ENV, "proxy_get_log_level", |mut c: C<'_>, rp: i32| {
        ret((|| {
            let level = c.data().config.log_level as u32;
            write_u32(&mut c, rp, level)?;
            Ok(Status::Ok)
        })())
    })?;

    // ---- clock, timers ----
    l.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, rp: i32| {
            ret((|| {
                let ns = lock(&c.data().host.state).wall_clock_nanos();
                write_u64(&mut c, rp, ns)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, period: i32| {
            let now = c.data().now();
            let st = c.data_mut();
            if period == 0 {
                st.tick_period = None;
                st.next_tick = None;
            } else {
                let p = Duration::from_millis(u64::from(period as u32));
                st.tick_period = Some(p);
                st.next_tick = Some(now + p);
            }
            Ok(Status::Ok.code())
        },
    )?;

    // ---- buffers ----
    l.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: C<'_>, bt: i32, start: i32, max: i32, rp: i32, rs: i32| {
            ret((|| {
                let bt = BufferType::from_i32(bt).ok_or(Status::BadArgument)?;
                let data = {
                    let buf = buffer_mut(c.data_mut(), bt).ok_or(Status::NotFound)?;
                    let start = start as u32 as usize;
                    if start > buf.len() {
                        return Err(Status::BadArgument.into());
                    }
                    let end = start.saturating_add(max as u32 as usize).min(buf.len());
                    buf.get(start..end).unwrap_or_default().to_vec()
                };
                give(&mut c, &data, rp, rs)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_buffer_status",
        |mut c: C<'_>, bt: i32, rs: i32, rf: i32| {
            ret((|| {
                let bt = BufferType::from_i32(bt).ok_or(Status::BadArgument)?;
                let len = buffer_mut(c.data_mut(), bt).ok_or(Status::NotFound)?.len();
                write_u32(&mut c, rs, len as u32)?;
                write_u32(&mut c, rf, 0)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_buffer_bytes",
        |mut c: C<'_>, bt: i32, start: i32, size: i32, p: i32, n: i32| {
            ret((|| {
                let bt = BufferType::from_i32(bt).ok_or(Status::BadArgument)?;
                if matches!(
                    bt,
                    BufferType::VmConfiguration | BufferType::PluginConfiguration
                ) || bt == BufferType::HttpCallResponseBody
                {
                    return Err(Status::BadArgument.into());
                }
                let data = read(&mut c, p, n)?;
                let buf = buffer_mut(c.data_mut(), bt).ok_or(Status::NotFound)?;
                let start = (start as u32 as usize).min(buf.len());
                let end = start.saturating_add(size as u32 as usize).min(buf.len());
                buf.splice(start..end, data);
                Ok(Status::Ok)
            })())
        },
    )?;

    // ---- header maps ----
    l.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: C<'_>, mt: i32, rp: i32, rs: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let bytes = map_mut(c.data_mut(), mt)
                    .ok_or(Status::NotFound)?
                    .serialize();
                give(&mut c, &bytes, rp, rs)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_header_map_size",
        |mut c: C<'_>, mt: i32, rs: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let n = map_mut(c.data_mut(), mt)
                    .ok_or(Status::NotFound)?
                    .serialize()
                    .len();
                write_u32(&mut c, rs, n as u32)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_header_map_pairs",
        |mut c: C<'_>, mt: i32, p: i32, n: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let bytes = read(&mut c, p, n)?;
                let pairs = deserialize_pairs(&bytes).map_err(|_| Status::BadArgument)?;
                let mut new = HeaderMap::new();
                for (k, v) in pairs {
                    let k = String::from_utf8(k).map_err(|_| Status::BadArgument)?;
                    new.add(&k, &v);
                }
                let map = map_mut(c.data_mut(), mt).ok_or(Status::NotFound)?;
                *map = new;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: C<'_>, mt: i32, kp: i32, kn: i32, rp: i32, rs: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let key = read_str(&mut c, kp, kn)?;
                let value = map_mut(c.data_mut(), mt)
                    .ok_or(Status::NotFound)?
                    .get_bytes(&key)
                    .ok_or(Status::NotFound)?
                    .to_vec();
                give(&mut c, &value, rp, rs)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: C<'_>, mt: i32, kp: i32, kn: i32, vp: i32, vn: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let key = read_str(&mut c, kp, kn)?;
                let value = read(&mut c, vp, vn)?;
                map_mut(c.data_mut(), mt)
                    .ok_or(Status::NotFound)?
                    .replace(&key, &value);
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_add_header_map_value",
        |mut c: C<'_>, mt: i32, kp: i32, kn: i32, vp: i32, vn: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let key = read_str(&mut c, kp, kn)?;
                let value = read(&mut c, vp, vn)?;
                map_mut(c.data_mut(), mt)
                    .ok_or(Status::NotFound)?
                    .add(&key, &value);
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: C<'_>, mt: i32, kp: i32, kn: i32| {
            ret((|| {
                let mt = map_type(mt)?;
                let key = read_str(&mut c, kp, kn)?;
                map_mut(c.data_mut(), mt)
                    .ok_or(Status::NotFound)?
                    .remove(&key);
                Ok(Status::Ok)
            })())
        },
    )?;

    // ---- properties ----
    l.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: C<'_>, pp: i32, pn: i32, rp: i32, rs: i32| {
            ret((|| {
                let path = split_property_path(&read(&mut c, pp, pn)?);
                let value = {
                    let st = c.data_mut();
                    let from_stream = st
                        .stream_mut()
                        .and_then(|s| s.properties.get(&path).cloned());
                    from_stream
                        .or_else(|| st.properties.get(&path).cloned())
                        .ok_or(Status::NotFound)?
                };
                give(&mut c, &value, rp, rs)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_property",
        |mut c: C<'_>, pp: i32, pn: i32, vp: i32, vn: i32| {
            ret((|| {
                let path = split_property_path(&read(&mut c, pp, pn)?);
                let value = read(&mut c, vp, vn)?;
                let st = c.data_mut();
                match st.stream_mut() {
                    Some(s) => {
                        s.properties.insert(path, value);
                    }
                    None => {
                        st.properties.insert(path, value);
                    }
                }
                Ok(Status::Ok)
            })())
        },
    )?;

    // ---- shared data ----
    l.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: C<'_>, kp: i32, kn: i32, rp: i32, rs: i32, rc: i32| {
            ret((|| {
                let key = read_str(&mut c, kp, kn)?;
                let (value, cas) = {
                    let st = c.data();
                    let mut shared = lock(&st.host.state);
                    let (v, cas) = shared
                        .data
                        .get(&st.config.vm_id, &key)
                        .map(|(v, cas)| (v.to_vec(), cas))
                        .ok_or(Status::NotFound)?;
                    let race = match &mut shared.races {
                        Some((suffix, n)) if *n > 0 && key.ends_with(suffix.as_str()) => {
                            *n -= 1;
                            true
                        }
                        _ => false,
                    };
                    if race {
                        shared.data.set(&st.config.vm_id, &key, &v, 0);
                    }
                    (v, cas)
                };
                give(&mut c, &value, rp, rs)?;
                write_u32(&mut c, rc, cas)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: C<'_>, kp: i32, kn: i32, vp: i32, vn: i32, cas: i32| {
            ret((|| {
                let key = read_str(&mut c, kp, kn)?;
                let value = read(&mut c, vp, vn)?;
                let st = c.data();
                let status =
                    lock(&st.host.state)
                        .data
                        .set(&st.config.vm_id, &key, &value, cas as u32);
                Ok(status)
            })())
        },
    )?;

    // ---- shared queues ----
    l.func_wrap(
        ENV,
        "proxy_register_shared_queue",
        |mut c: C<'_>, np: i32, nn: i32, rp: i32| {
            ret((|| {
                let name = read_str(&mut c, np, nn)?;
                let token = {
                    let st = c.data();
                    let target = QueueTarget {
                        vm: st.index,
                        context_id: st.root_context,
                    };
                    lock(&st.host.state)
                        .queues
                        .register(&st.config.vm_id, &name, target)
                };
                write_u32(&mut c, rp, token)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_resolve_shared_queue",
        |mut c: C<'_>, vp: i32, vn: i32, np: i32, nn: i32, rp: i32| {
            ret((|| {
                let vm_id = read_str(&mut c, vp, vn)?;
                let name = read_str(&mut c, np, nn)?;
                let token = lock(&c.data().host.state)
                    .queues
                    .resolve(&vm_id, &name)
                    .ok_or(Status::NotFound)?;
                write_u32(&mut c, rp, token)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_enqueue_shared_queue",
        |mut c: C<'_>, token: i32, vp: i32, vn: i32| {
            ret((|| {
                let value = read(&mut c, vp, vn)?;
                let mut shared = lock(&c.data().host.state);
                let target = shared.queues.enqueue(token as u32, &value)?;
                shared.queue_ready.push_back((target, token as u32));
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_dequeue_shared_queue",
        |mut c: C<'_>, token: i32, rp: i32, rs: i32| {
            ret((|| {
                let value = lock(&c.data().host.state).queues.dequeue(token as u32)?;
                give(&mut c, &value, rp, rs)?;
                Ok(Status::Ok)
            })())
        },
    )?;

    // ---- streams ----
    l.func_wrap(ENV, "proxy_continue_stream", |mut c: C<'_>, t: i32| {
        ret((|| {
            let t = StreamType::from_i32(t).ok_or(Status::BadArgument)?;
            let s = c.data_mut().stream_mut().ok_or(Status::NotFound)?;
            match t {
                StreamType::HttpRequest => s.resume_request = true,
                StreamType::HttpResponse => s.resume_response = true,
                StreamType::Downstream | StreamType::Upstream => {
                    return Err(Status::Unimplemented.into());
                }
            }
            Ok(Status::Ok)
        })())
    })?;
    l.func_wrap(ENV, "proxy_close_stream", |mut c: C<'_>, t: i32| {
        ret((|| {
            let t = StreamType::from_i32(t).ok_or(Status::BadArgument)?;
            let s = c.data_mut().stream_mut().ok_or(Status::NotFound)?;
            s.closed = Some(t);
            Ok(Status::Ok)
        })())
    })?;
    l.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: C<'_>,
         status: i32,
         dp: i32,
         dn: i32,
         bp: i32,
         bn: i32,
         hp: i32,
         hn: i32,
         grpc: i32| {
            ret((|| {
                let details = String::from_utf8_lossy(&read(&mut c, dp, dn)?).into_owned();
                let body = read(&mut c, bp, bn)?;
                let hbytes = read(&mut c, hp, hn)?;
                let headers = HeaderMap::deserialize(&hbytes).map_err(|_| Status::BadArgument)?;
                let s = c.data_mut().stream_mut().ok_or(Status::BadArgument)?;
                s.local_response = Some(LocalResponse {
                    status: status as u32,
                    details,
                    body,
                    headers,
                    grpc_status: grpc,
                });
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: C<'_>, id: i32| {
            let id = id as u32;
            let st = c.data_mut();
            if id == st.root_context || st.streams.contains_key(&id) {
                st.effective = id;
                Ok(Status::Ok.code())
            } else {
                Ok(Status::BadArgument.code())
            }
        },
    )?;
    l.func_wrap(ENV, "proxy_done", |mut c: C<'_>| {
        let st = c.data_mut();
        let id = st.effective;
        if st.streams.get(&id).is_some_and(|s| s.done_pending) {
            st.done_requests.push(id);
            Ok(Status::Ok.code())
        } else {
            Ok(Status::NotFound.code())
        }
    })?;

    // ---- http calls ----
    l.func_wrap(
        ENV,
        "proxy_http_call",
        |mut c: C<'_>,
         up: i32,
         un: i32,
         hp: i32,
         hn: i32,
         bp: i32,
         bn: i32,
         tp: i32,
         tn: i32,
         timeout: i32,
         rt: i32| {
            ret((|| {
                let upstream = read_str(&mut c, up, un)?;
                let headers = HeaderMap::deserialize(&read(&mut c, hp, hn)?)
                    .map_err(|_| Status::BadArgument)?;
                let body = read(&mut c, bp, bn)?;
                let trailers = HeaderMap::deserialize(&read(&mut c, tp, tn)?)
                    .map_err(|_| Status::BadArgument)?;
                // Envoy refuses calls without these.
                for required in [":method", ":path", ":authority"] {
                    if !headers.contains(required) {
                        return Err(Status::BadArgument.into());
                    }
                }
                let token = next_http_token(&c.data().host);
                let now = c.data().now();
                let timeout = Duration::from_millis(u64::from(timeout as u32));
                let st = c.data_mut();
                let call = HttpCall {
                    token,
                    context_id: st.effective,
                    upstream,
                    headers,
                    body,
                    trailers,
                    timeout,
                    deadline: now + timeout,
                };
                st.http_calls.insert(token, call);
                st.unoffered_calls.push(token);
                write_u32(&mut c, rt, token)?;
                Ok(Status::Ok)
            })())
        },
    )?;

    // ---- metrics ----
    l.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: C<'_>, kind: i32, np: i32, nn: i32, rp: i32| {
            ret((|| {
                let kind = MetricKind::from_i32(kind).ok_or(Status::BadArgument)?;
                let name = read_str(&mut c, np, nn)?;
                let id = lock(&c.data().host.state).metrics.define(kind, &name)?;
                write_u32(&mut c, rp, id)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_increment_metric",
        |c: C<'_>, id: i32, delta: i64| {
            Ok(lock(&c.data().host.state)
                .metrics
                .increment(id as u32, delta)
                .code())
        },
    )?;
    l.func_wrap(
        ENV,
        "proxy_record_metric",
        |c: C<'_>, id: i32, value: i64| {
            Ok(lock(&c.data().host.state)
                .metrics
                .record(id as u32, value as u64)
                .code())
        },
    )?;
    l.func_wrap(ENV, "proxy_get_metric", |mut c: C<'_>, id: i32, rp: i32| {
        ret((|| {
            let v = lock(&c.data().host.state).metrics.get(id as u32)?;
            write_u64(&mut c, rp, v)?;
            Ok(Status::Ok)
        })())
    })?;
    Ok(())
}

fn define_wasi(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    const WASI: &str = "wasi_snapshot_preview1";

    l.func_wrap(
        WASI,
        "fd_write",
        |mut c: C<'_>, fd: i32, iovs: i32, n: i32, rn: i32| {
            wasi_ret((|| {
                if fd != 1 && fd != 2 {
                    return Err(ERRNO_BADF);
                }
                let table = read(&mut c, iovs, n.saturating_mul(8)).map_err(|_| ERRNO_FAULT)?;
                let mut bytes = Vec::new();
                for iov in table.chunks_exact(8) {
                    let mut p = [0u8; 4];
                    let mut q = [0u8; 4];
                    p.copy_from_slice(iov.get(0..4).unwrap_or(&[0; 4]));
                    q.copy_from_slice(iov.get(4..8).unwrap_or(&[0; 4]));
                    let part = read(
                        &mut c,
                        u32::from_le_bytes(p) as i32,
                        u32::from_le_bytes(q) as i32,
                    )
                    .map_err(|_| ERRNO_FAULT)?;
                    bytes.extend_from_slice(&part);
                }
                write_u32(&mut c, rn, bytes.len() as u32).map_err(|_| ERRNO_FAULT)?;
                let st = c.data_mut();
                let (partial, level, source) = if fd == 1 {
                    (&mut st.stdout_partial, LogLevel::Info, LogSource::Stdout)
                } else {
                    (&mut st.stderr_partial, LogLevel::Error, LogSource::Stderr)
                };
                partial.extend_from_slice(&bytes);
                let mut lines = Vec::new();
                while let Some(pos) = partial.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = partial.drain(..=pos).collect();
                    let text = String::from_utf8_lossy(line.strip_suffix(b"\n").unwrap_or(&line))
                        .into_owned();
                    lines.push(text);
                }
                for line in lines {
                    st.log(level, line, source);
                }
                Ok(())
            })())
        },
    )?;
    l.func_wrap(
        WASI,
        "clock_time_get",
        |mut c: C<'_>, id: i32, _precision: i64, rp: i32| {
            wasi_ret((|| {
                // realtime, monotonic, process and thread CPU time: all read the virtual clock
                if !(0..=3).contains(&id) {
                    return Err(ERRNO_INVAL);
                }
                let ns = lock(&c.data().host.state).wall_clock_nanos();
                write_u64(&mut c, rp, ns).map_err(|_| ERRNO_FAULT)
            })())
        },
    )?;
    l.func_wrap(WASI, "clock_res_get", |mut c: C<'_>, id: i32, rp: i32| {
        wasi_ret((|| {
            if !(0..=3).contains(&id) {
                return Err(ERRNO_INVAL);
            }
            write_u64(&mut c, rp, 1).map_err(|_| ERRNO_FAULT)
        })())
    })?;
    l.func_wrap(WASI, "random_get", |mut c: C<'_>, p: i32, n: i32| {
        let n = n as u32 as usize;
        let mut bytes = Vec::with_capacity(n + 8);
        while bytes.len() < n {
            let r = c.data_mut().next_random();
            bytes.extend_from_slice(&r.to_le_bytes());
        }
        bytes.truncate(n);
        wasi_ret(write(&mut c, p, &bytes).map_err(|_| ERRNO_FAULT))
    })?;
    l.func_wrap(
        WASI,
        "environ_sizes_get",
        |mut c: C<'_>, rcount: i32, rsize: i32| {
            wasi_ret((|| {
                let env = &c.data().config.env;
                let count = env.len();
                let size: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
                write_u32(&mut c, rcount, count as u32).map_err(|_| ERRNO_FAULT)?;
                write_u32(&mut c, rsize, size as u32).map_err(|_| ERRNO_FAULT)
            })())
        },
    )?;
    l.func_wrap(WASI, "environ_get", |mut c: C<'_>, ptrs: i32, buf: i32| {
        wasi_ret((|| {
            let env = c.data().config.env.clone();
            let mut at = buf as u32;
            for (i, (k, v)) in env.iter().enumerate() {
                let entry = format!("{k}={v}\0");
                write(&mut c, at as i32, entry.as_bytes()).map_err(|_| ERRNO_FAULT)?;
                write_u32(&mut c, ptrs.wrapping_add((i * 4) as i32), at)
                    .map_err(|_| ERRNO_FAULT)?;
                at = at.wrapping_add(entry.len() as u32);
            }
            Ok(())
        })())
    })?;
    l.func_wrap(
        WASI,
        "args_sizes_get",
        |mut c: C<'_>, rcount: i32, rsize: i32| {
            wasi_ret((|| {
                write_u32(&mut c, rcount, 0).map_err(|_| ERRNO_FAULT)?;
                write_u32(&mut c, rsize, 0).map_err(|_| ERRNO_FAULT)
            })())
        },
    )?;
    l.func_wrap(WASI, "args_get", |_c: C<'_>, _ptrs: i32, _buf: i32| {
        Ok(ERRNO_SUCCESS)
    })?;
    l.func_wrap(WASI, "sched_yield", |_c: C<'_>| Ok(ERRNO_SUCCESS))?;
    l.func_wrap(
        WASI,
        "proc_exit",
        |_c: C<'_>, code: i32| -> wasmtime::Result<()> {
            Err(format_err!("the module called proc_exit({code})"))
        },
    )?;
    Ok(())
}
