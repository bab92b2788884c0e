//! The proxy-wasm ABI 0.2.1 host functions (module `env`), with Envoy's semantics.

use super::host_fn;
use super::memory::{give, read, read_str, ret, write_u32, write_u64};
use crate::abi::{
    BufferType, HeaderMap, LogLevel, MapType, MetricKind, Status, StreamType, deserialize_pairs,
    split_property_path,
};
use crate::exchange::LocalResponse;
use crate::host::{lock, next_http_token};
use crate::http_call::HttpCall;
use crate::log::LogSource;
use crate::shared::QueueTarget;
use crate::vm::VmState;
use std::time::Duration;
use wasmtime::Linker;

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

/// Defines every `env` function this host implements.
pub(super) fn define(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    const ENV: &str = "env";

    // ---- logging ----
    host_fn!(l, ENV, "proxy_log", |c, level: i32, p: i32, n: i32| {
        ret((|| {
            let level = LogLevel::from_u32(level as u32).ok_or(Status::BadArgument)?;
            let msg = read(&mut c, p, n)?;
            let msg = String::from_utf8_lossy(&msg).into_owned();
            c.data_mut().log(level, msg, LogSource::ProxyLog);
            Ok(Status::Ok)
        })())
    },)?;
    host_fn!(l, ENV, "proxy_get_log_level", |c, rp: i32| {
        ret((|| {
            let level = c.data().config.log_level as u32;
            write_u32(&mut c, rp, level)?;
            Ok(Status::Ok)
        })())
    })?;

    // ---- clock, timers ----
    host_fn!(
        l,
        ENV,
        "proxy_get_current_time_nanoseconds",
        |c, rp: i32| {
            ret((|| {
                let ns = lock(&c.data().host.state).wall_clock_nanos();
                write_u64(&mut c, rp, ns)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    host_fn!(
        l,
        ENV,
        "proxy_set_tick_period_milliseconds",
        |c, period: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_buffer_bytes",
        |c, bt: i32, start: i32, max: i32, rp: i32, rs: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_buffer_status",
        |c, bt: i32, rs: i32, rf: i32| {
            ret((|| {
                let bt = BufferType::from_i32(bt).ok_or(Status::BadArgument)?;
                let len = buffer_mut(c.data_mut(), bt).ok_or(Status::NotFound)?.len();
                write_u32(&mut c, rs, len as u32)?;
                write_u32(&mut c, rf, 0)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    host_fn!(
        l,
        ENV,
        "proxy_set_buffer_bytes",
        |c, bt: i32, start: i32, size: i32, p: i32, n: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_header_map_pairs",
        |c, mt: i32, rp: i32, rs: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_header_map_size",
        |c, mt: i32, rs: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_set_header_map_pairs",
        |c, mt: i32, p: i32, n: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_header_map_value",
        |c, mt: i32, kp: i32, kn: i32, rp: i32, rs: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_replace_header_map_value",
        |c, mt: i32, kp: i32, kn: i32, vp: i32, vn: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_add_header_map_value",
        |c, mt: i32, kp: i32, kn: i32, vp: i32, vn: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_remove_header_map_value",
        |c, mt: i32, kp: i32, kn: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_property",
        |c, pp: i32, pn: i32, rp: i32, rs: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_set_property",
        |c, pp: i32, pn: i32, vp: i32, vn: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_get_shared_data",
        |c, kp: i32, kn: i32, rp: i32, rs: i32, rc: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_set_shared_data",
        |c, kp: i32, kn: i32, vp: i32, vn: i32, cas: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_register_shared_queue",
        |c, np: i32, nn: i32, rp: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_resolve_shared_queue",
        |c, vp: i32, vn: i32, np: i32, nn: i32, rp: i32| {
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
    host_fn!(
        l,
        ENV,
        "proxy_enqueue_shared_queue",
        |c, token: i32, vp: i32, vn: i32| {
            ret((|| {
                let value = read(&mut c, vp, vn)?;
                let mut shared = lock(&c.data().host.state);
                let target = shared.queues.enqueue(token as u32, &value)?;
                shared.queue_ready.push_back((target, token as u32));
                Ok(Status::Ok)
            })())
        },
    )?;
    host_fn!(
        l,
        ENV,
        "proxy_dequeue_shared_queue",
        |c, token: i32, rp: i32, rs: i32| {
            ret((|| {
                let value = lock(&c.data().host.state).queues.dequeue(token as u32)?;
                give(&mut c, &value, rp, rs)?;
                Ok(Status::Ok)
            })())
        },
    )?;

    // ---- streams ----
    host_fn!(l, ENV, "proxy_continue_stream", |c, t: i32| {
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
    host_fn!(l, ENV, "proxy_close_stream", |c, t: i32| {
        ret((|| {
            let t = StreamType::from_i32(t).ok_or(Status::BadArgument)?;
            let s = c.data_mut().stream_mut().ok_or(Status::NotFound)?;
            s.closed = Some(t);
            Ok(Status::Ok)
        })())
    })?;
    host_fn!(
        l,
        ENV,
        "proxy_send_local_response",
        |c, status: i32, dp: i32, dn: i32, bp: i32, bn: i32, hp: i32, hn: i32, grpc: i32| {
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
    host_fn!(l, ENV, "proxy_set_effective_context", |c, id: i32| {
        let id = id as u32;
        let st = c.data_mut();
        if id == st.root_context || st.streams.contains_key(&id) {
            st.effective = id;
            Ok(Status::Ok.code())
        } else {
            Ok(Status::BadArgument.code())
        }
    },)?;
    host_fn!(l, ENV, "proxy_done", |c| {
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
    host_fn!(
        l,
        ENV,
        "proxy_http_call",
        |c,
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
    host_fn!(
        l,
        ENV,
        "proxy_define_metric",
        |c, kind: i32, np: i32, nn: i32, rp: i32| {
            ret((|| {
                let kind = MetricKind::from_i32(kind).ok_or(Status::BadArgument)?;
                let name = read_str(&mut c, np, nn)?;
                let id = lock(&c.data().host.state).metrics.define(kind, &name)?;
                write_u32(&mut c, rp, id)?;
                Ok(Status::Ok)
            })())
        },
    )?;
    host_fn!(
        l,
        ENV,
        "proxy_increment_metric",
        |c, id: i32, delta: i64| {
            Ok(lock(&c.data().host.state)
                .metrics
                .increment(id as u32, delta)
                .code())
        },
    )?;
    host_fn!(l, ENV, "proxy_record_metric", |c, id: i32, value: i64| {
        Ok(lock(&c.data().host.state)
            .metrics
            .record(id as u32, value as u64)
            .code())
    },)?;
    host_fn!(l, ENV, "proxy_get_metric", |c, id: i32, rp: i32| {
        ret((|| {
            let v = lock(&c.data().host.state).metrics.get(id as u32)?;
            write_u64(&mut c, rp, v)?;
            Ok(Status::Ok)
        })())
    })?;
    Ok(())
}
