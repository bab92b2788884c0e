//! The WASI preview1 functions a proxy-wasm module built for wasm32-wasip1 imports: output
//! to the logs, the virtual clock, deterministic randomness, the configured environment.

use super::host_fn;
use super::memory::{read, write, write_u32, write_u64};
use crate::abi::LogLevel;
use crate::host::lock;
use crate::log::LogSource;
use crate::vm::VmState;
use wasmtime::{Linker, format_err};

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

/// Defines every `wasi_snapshot_preview1` function this host implements.
pub(super) fn define(l: &mut Linker<VmState>) -> wasmtime::Result<()> {
    const WASI: &str = "wasi_snapshot_preview1";

    host_fn!(
        l,
        WASI,
        "fd_write",
        |c, fd: i32, iovs: i32, n: i32, rn: i32| {
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
    host_fn!(
        l,
        WASI,
        "clock_time_get",
        |c, id: i32, _precision: i64, rp: i32| {
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
    host_fn!(l, WASI, "clock_res_get", |c, id: i32, rp: i32| {
        wasi_ret((|| {
            if !(0..=3).contains(&id) {
                return Err(ERRNO_INVAL);
            }
            write_u64(&mut c, rp, 1).map_err(|_| ERRNO_FAULT)
        })())
    })?;
    host_fn!(l, WASI, "random_get", |c, p: i32, n: i32| {
        let n = n as u32 as usize;
        let mut bytes = Vec::with_capacity(n + 8);
        while bytes.len() < n {
            let r = c.data_mut().next_random();
            bytes.extend_from_slice(&r.to_le_bytes());
        }
        bytes.truncate(n);
        wasi_ret(write(&mut c, p, &bytes).map_err(|_| ERRNO_FAULT))
    })?;
    host_fn!(
        l,
        WASI,
        "environ_sizes_get",
        |c, rcount: i32, rsize: i32| {
            wasi_ret((|| {
                let env = &c.data().config.env;
                let count = env.len();
                let size: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
                write_u32(&mut c, rcount, count as u32).map_err(|_| ERRNO_FAULT)?;
                write_u32(&mut c, rsize, size as u32).map_err(|_| ERRNO_FAULT)
            })())
        },
    )?;
    host_fn!(l, WASI, "environ_get", |c, ptrs: i32, buf: i32| {
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
    host_fn!(l, WASI, "args_sizes_get", |c, rcount: i32, rsize: i32| {
        wasi_ret((|| {
            write_u32(&mut c, rcount, 0).map_err(|_| ERRNO_FAULT)?;
            write_u32(&mut c, rsize, 0).map_err(|_| ERRNO_FAULT)
        })())
    },)?;
    host_fn!(l, WASI, "args_get", |c, _ptrs: i32, _buf: i32| {
        Ok(ERRNO_SUCCESS)
    })?;
    host_fn!(l, WASI, "sched_yield", |c| { Ok(ERRNO_SUCCESS) })?;
    host_fn!(l, WASI, "proc_exit", |c,
                                    code: i32|
     -> wasmtime::Result<()> {
        Err(format_err!("the module called proc_exit({code})"))
    },)?;
    Ok(())
}
