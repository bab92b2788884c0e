//! An allocation cap on the Rust heap: the global allocator of every fuzz target (and of the
//! regression test that replays them) counts the bytes live, and while a [`Cap`] is set, an
//! allocation that would take the live bytes more than the cap above where they were when it
//! was set aborts the process with a message. libFuzzer reports the abort as a crash and keeps
//! the input, so an input that makes a decoder allocate far more than it should is a finding
//! even when the allocation would succeed.
//!
//! This complements libFuzzer's own `-malloc_limit_mb` (one allocation over the limit, seen
//! only through a sanitizer's malloc hooks) and `-rss_limit_mb` (the whole process, checked
//! once a second): the cap here bounds the peak of everything one input holds at once, with
//! or without a sanitizer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The counting allocator.
pub struct Counting;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static BASE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grow(by: usize) {
    let live = LIVE.fetch_add(by, Relaxed).saturating_add(by);
    PEAK.fetch_max(live, Relaxed);
    let limit = LIMIT.load(Relaxed);
    if live > limit {
        over(by, live);
    }
}

#[cold]
fn over(by: usize, live: usize) -> ! {
    // No allocation here: stderr is unbuffered and format_args writes in place.
    let base = BASE.load(Relaxed);
    let cap = LIMIT.load(Relaxed).saturating_sub(base);
    let _ = writeln!(
        std::io::stderr(),
        "alloc_cap: an allocation of {by} bytes takes the heap to {} bytes above the start of \
         this input, over the cap of {cap} bytes",
        live.saturating_sub(base)
    );
    std::process::abort();
}

// SAFETY: every method forwards to `System` with the same arguments; the counters only
// observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: as the caller's contract for `alloc`.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grow(layout.size());
        // SAFETY: as the caller's contract for `alloc_zeroed`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as the caller's contract for `dealloc`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old {
            grow(new_size - old);
        }
        // SAFETY: as the caller's contract for `realloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        match (p.is_null(), new_size > old) {
            (true, true) => {
                LIVE.fetch_sub(new_size - old, Relaxed);
            }
            (false, false) => {
                LIVE.fetch_sub(old - new_size, Relaxed);
            }
            _ => {}
        }
        p
    }
}

/// A cap in force until dropped: at most `bytes` more than were live when it was set.
pub struct Cap(());

impl Cap {
    pub fn set(bytes: usize) -> Cap {
        let base = LIVE.load(Relaxed);
        BASE.store(base, Relaxed);
        PEAK.store(base, Relaxed);
        LIMIT.store(base.saturating_add(bytes), Relaxed);
        Cap(())
    }

    /// The most bytes live at once since the cap was set, above where they started.
    pub fn peak(&self) -> usize {
        PEAK.load(Relaxed).saturating_sub(BASE.load(Relaxed))
    }
}

impl Drop for Cap {
    fn drop(&mut self) {
        LIMIT.store(usize::MAX, Relaxed);
    }
}
