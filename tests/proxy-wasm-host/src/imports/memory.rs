//! The guest side of a host call: reading and writing the module's linear memory, handing it
//! memory it allocates, and turning a host function's outcome into the status it returns.

use crate::abi::Status;
use crate::vm::{VmState, len_i32};
use wasmtime::{Caller, Extern, format_err};

/// The caller every host function gets: the VM's store data is [`VmState`].
pub(crate) type C<'a> = Caller<'a, VmState>;

/// A host function's failure: a status for the guest, or a trap.
pub(crate) enum Fail {
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

pub(crate) type R = Result<Status, Fail>;

pub(crate) fn ret(r: R) -> wasmtime::Result<i32> {
    match r {
        Ok(s) | Err(Fail::Status(s)) => Ok(s.code()),
        Err(Fail::Trap(e)) => Err(e),
    }
}

fn memory(c: &mut C<'_>) -> Result<wasmtime::Memory, Status> {
    c.get_export("memory")
        .and_then(Extern::into_memory)
        .ok_or(Status::InvalidMemoryAccess)
}

pub(crate) fn read(c: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
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

pub(crate) fn read_str(c: &mut C<'_>, ptr: i32, len: i32) -> Result<String, Status> {
    String::from_utf8(read(c, ptr, len)?).map_err(|_| Status::BadArgument)
}

pub(crate) fn write(c: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<(), Status> {
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

pub(crate) fn write_u32(c: &mut C<'_>, ptr: i32, v: u32) -> Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

pub(crate) fn write_u64(c: &mut C<'_>, ptr: i32, v: u64) -> Result<(), Status> {
    write(c, ptr, &v.to_le_bytes())
}

/// Copies `data` into memory the guest allocates (`proxy_on_memory_allocate`, else `malloc`)
/// and writes its address and size to the two return pointers. Empty data is returned as a
/// null pointer and size 0 (the Rust SDK reads that as "no value").
pub(crate) fn give(c: &mut C<'_>, data: &[u8], ret_ptr: i32, ret_size: i32) -> Result<(), Fail> {
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
