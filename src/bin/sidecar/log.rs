//! One-line logs on stderr: `[sidecar +SECONDS] message`, seconds since the start.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();

/// Fixes the clock of the log lines (the first log line does it otherwise).
pub fn start() {
    START.get_or_init(Instant::now);
}

/// Seconds since [`start`].
pub fn elapsed() -> f64 {
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// `log!("joined {name}")` writes `[sidecar +1.234s] joined NAME` on stderr.
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {
        eprintln!("[sidecar +{:.3}s] {}", $crate::log::elapsed(), format_args!($($arg)*))
    };
}
