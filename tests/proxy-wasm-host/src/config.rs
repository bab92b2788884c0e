//! [`VmConfig`]: how a VM is configured (Envoy's `vm_config` and `plugin_config`).

use crate::abi::LogLevel;

/// How a VM is configured; everything but the plugin configuration has a default.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Bytes returned for `PLUGIN_CONFIGURATION` (Envoy: `plugin_config.configuration`).
    /// Default: empty.
    pub plugin_config: Vec<u8>,
    /// Bytes returned for `VM_CONFIGURATION` (Envoy: `vm_config.configuration`). Default: empty.
    pub vm_config: Vec<u8>,
    /// Namespace of shared data and queues (Envoy: `vm_config.vm_id`). Default: "" (Envoy's).
    pub vm_id: String,
    /// `plugin_name` property. Default: "proxy-wasm-host".
    pub plugin_name: String,
    /// `plugin_root_id` property. Default: "".
    pub root_id: String,
    /// Lowest level recorded and returned by `proxy_get_log_level`. Default: Trace (record
    /// everything; Envoy's default is Info).
    pub log_level: LogLevel,
    /// Envoy's `allow_on_headers_stop_iteration` (Envoy >= 1.35). Default: false, as in Envoy:
    /// then a Pause from `proxy_on_request_headers` withholds the body callbacks until the
    /// filter calls `proxy_continue_stream`.
    pub allow_on_headers_stop_iteration: bool,
    /// WASI environment (Envoy: `vm_config.environment_variables`). Default: none.
    pub env: Vec<(String, String)>,
    /// Extra properties (path parts → value) for `proxy_get_property`. Default: none.
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
    /// Seed of the deterministic `random_get`. Default: 0 = derived from the VM's number.
    pub random_seed: u64,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            plugin_config: Vec::new(),
            vm_config: Vec::new(),
            vm_id: String::new(),
            plugin_name: "proxy-wasm-host".to_string(),
            root_id: String::new(),
            log_level: LogLevel::Trace,
            allow_on_headers_stop_iteration: false,
            env: Vec::new(),
            properties: Vec::new(),
            random_seed: 0,
        }
    }
}

impl VmConfig {
    /// A configuration with this plugin configuration and defaults for the rest.
    pub fn new(plugin_config: impl Into<Vec<u8>>) -> VmConfig {
        VmConfig {
            plugin_config: plugin_config.into(),
            ..VmConfig::default()
        }
    }
    /// Sets [`VmConfig::vm_config`].
    pub fn vm_config(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.vm_config = bytes.into();
        self
    }
    /// Sets [`VmConfig::vm_id`].
    pub fn vm_id(mut self, id: &str) -> Self {
        self.vm_id = id.to_string();
        self
    }
    /// Sets [`VmConfig::log_level`].
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }
    /// Sets [`VmConfig::allow_on_headers_stop_iteration`].
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> Self {
        self.allow_on_headers_stop_iteration = allow;
        self
    }
    /// Adds a WASI environment variable ([`VmConfig::env`]).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }
    /// Adds a property ([`VmConfig::properties`]): `path` parts, as the SDK's
    /// `get_property(vec![...])` names them.
    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties
            .push((path.iter().map(|s| s.to_string()).collect(), value.into()));
        self
    }
}

impl From<&str> for VmConfig {
    fn from(s: &str) -> Self {
        VmConfig::new(s)
    }
}
impl From<String> for VmConfig {
    fn from(s: String) -> Self {
        VmConfig::new(s)
    }
}
impl From<Vec<u8>> for VmConfig {
    fn from(s: Vec<u8>) -> Self {
        VmConfig::new(s)
    }
}
impl From<&[u8]> for VmConfig {
    fn from(s: &[u8]) -> Self {
        VmConfig::new(s)
    }
}
