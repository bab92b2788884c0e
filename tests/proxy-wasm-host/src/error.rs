//! [`HostError`]: everything that can go wrong hosting a module.

use std::fmt;

/// Everything that can go wrong hosting a module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostError {
    /// The `.wasm` could not be read or compiled.
    Load {
        /// The file (or the name given to [`WasmModule::from_bytes`](crate::WasmModule::from_bytes)).
        path: String,
        /// Why.
        message: String,
    },
    /// Linking or instantiation failed (e.g. an import with an unexpected signature).
    Instantiate(String),
    /// The module does not export `proxy_abi_version_0_2_1` (or `_0_2_0`).
    UnsupportedAbi,
    /// A callback trapped (a Rust panic in the SDK, an unimplemented import, `proc_exit`...).
    /// `logs` are the module's last error/critical log lines (the panic message, usually).
    Trap {
        /// The export that was running (`proxy_on_request_body`, ...).
        callback: String,
        /// The context it was called for.
        context_id: u32,
        /// Wasmtime's trap message with its backtrace.
        message: String,
        /// The module's last error and critical log lines.
        logs: Vec<String>,
    },
    /// `proxy_on_vm_start` returned false.
    VmStartRejected {
        /// The module's last error and critical log lines.
        logs: Vec<String>,
    },
    /// `proxy_on_configure` returned false (Envoy refuses the plugin configuration).
    ConfigureRejected {
        /// The module's last error and critical log lines (why it refused, usually).
        logs: Vec<String>,
    },
    /// The VM trapped earlier; Envoy would have failed it too.
    VmFailed(String),
    /// A callback returned a value outside the ABI (e.g. an action other than 0/1).
    Abi(String),
    /// No open or completed stream with this context id.
    UnknownStream(u32),
    /// No pending HTTP call with this token.
    UnknownHttpCall(u32),
    /// Pending events kept producing events (queue ping-pong, a responder that never ends).
    Runaway(String),
    /// Building a `.wasm` with cargo failed.
    Build(String),
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Load { path, message } => write!(f, "cannot load {path}: {message}"),
            HostError::Instantiate(m) => write!(f, "cannot instantiate the module: {m}"),
            HostError::UnsupportedAbi => write!(
                f,
                "the module exports neither proxy_abi_version_0_2_1 nor proxy_abi_version_0_2_0"
            ),
            HostError::Trap {
                callback,
                context_id,
                message,
                logs,
            } => {
                write!(f, "{callback}(context {context_id}) trapped: {message}")?;
                if !logs.is_empty() {
                    write!(f, "; module logs: {}", logs.join(" | "))?;
                }
                Ok(())
            }
            HostError::VmStartRejected { logs } => {
                write!(
                    f,
                    "proxy_on_vm_start returned false; logs: {}",
                    logs.join(" | ")
                )
            }
            HostError::ConfigureRejected { logs } => write!(
                f,
                "proxy_on_configure returned false (configuration refused); logs: {}",
                logs.join(" | ")
            ),
            HostError::VmFailed(m) => write!(f, "the VM failed earlier: {m}"),
            HostError::Abi(m) => write!(f, "ABI violation: {m}"),
            HostError::UnknownStream(id) => write!(f, "no stream with context id {id}"),
            HostError::UnknownHttpCall(t) => write!(f, "no pending HTTP call with token {t}"),
            HostError::Runaway(m) => write!(f, "pending events do not settle: {m}"),
            HostError::Build(m) => write!(f, "building the .wasm failed: {m}"),
        }
    }
}

impl std::error::Error for HostError {}
