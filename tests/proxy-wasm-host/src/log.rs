//! The module's log lines: `proxy_log` and WASI stdout/stderr.

use crate::abi::LogLevel;

/// Where a log line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogSource {
    /// `proxy_log`.
    ProxyLog,
    /// WASI `fd_write` to stdout (level Info), one entry per line.
    Stdout,
    /// WASI `fd_write` to stderr (level Error), one entry per line.
    Stderr,
}

/// One log line of the module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Its level (stdout lines are Info, stderr lines Error).
    pub level: LogLevel,
    /// The text (without the newline for stdout/stderr lines).
    pub message: String,
    /// The effective context when it was logged.
    pub context_id: u32,
    /// Where it came from.
    pub source: LogSource,
}
