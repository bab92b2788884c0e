//! Building a crate's proxy-wasm `.wasm` from a test, so that the test command itself builds
//! what it tests (no manual step).

use crate::error::HostError;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What to build: `cargo build --lib --target <target> --profile <profile> --features
/// <features> --manifest-path <manifest_dir>/Cargo.toml --target-dir <target_dir>`.
#[derive(Debug, Clone)]
pub struct WasmBuild {
    /// The crate's directory (holding Cargo.toml).
    pub manifest_dir: PathBuf,
    /// Cargo features to enable. Default: none.
    pub features: Vec<String>,
    /// Cargo profile. Default: "release".
    pub profile: String,
    /// Target triple. Default: "wasm32-wasip1".
    pub target: String,
    /// The library's file stem (`<lib name>.wasm`, dashes as underscores).
    pub lib_name: String,
    /// Cargo target dir of this build. Default: `<CARGO_TARGET_DIR or manifest_dir/target>/
    /// filter-wasm` — a directory of its own, so that this build never waits for the lock of
    /// the cargo that is running the tests.
    pub target_dir: Option<PathBuf>,
}

impl WasmBuild {
    /// Builds the library `lib_name` of the crate in `manifest_dir` (release, wasm32-wasip1,
    /// no features until [`WasmBuild::feature`] adds some).
    pub fn new(manifest_dir: impl Into<PathBuf>, lib_name: &str) -> WasmBuild {
        WasmBuild {
            manifest_dir: manifest_dir.into(),
            features: Vec::new(),
            profile: "release".to_string(),
            target: "wasm32-wasip1".to_string(),
            lib_name: lib_name.replace('-', "_"),
            target_dir: None,
        }
    }
    /// Enables a cargo feature.
    pub fn feature(mut self, f: &str) -> Self {
        self.features.push(f.to_string());
        self
    }
    /// Sets the cargo profile (`dev` lands in `debug/`).
    pub fn profile(mut self, p: &str) -> Self {
        self.profile = p.to_string();
        self
    }
    /// Sets the target triple.
    pub fn target(mut self, t: &str) -> Self {
        self.target = t.to_string();
        self
    }
    /// Sets the cargo target dir of this build.
    pub fn target_dir(mut self, d: impl Into<PathBuf>) -> Self {
        self.target_dir = Some(d.into());
        self
    }

    /// The target dir used (see [`WasmBuild::target_dir`]).
    pub fn resolved_target_dir(&self) -> PathBuf {
        if let Some(d) = &self.target_dir {
            return d.clone();
        }
        let base = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| self.manifest_dir.join("target"));
        base.join("filter-wasm")
    }

    /// Where the `.wasm` lands. Cargo puts the `dev` profile in `debug/`.
    pub fn output(&self) -> PathBuf {
        let dir = if self.profile == "dev" {
            "debug"
        } else {
            &self.profile
        };
        self.resolved_target_dir()
            .join(&self.target)
            .join(dir)
            .join(format!("{}.wasm", self.lib_name))
    }

    /// Runs cargo (the `CARGO` environment variable, else `cargo` on PATH) and returns the
    /// path of the `.wasm`. Cargo's own freshness check makes repeated calls cheap.
    pub fn run(&self) -> Result<PathBuf, HostError> {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.arg("build")
            .arg("--lib")
            .arg("--target")
            .arg(&self.target)
            .arg("--profile")
            .arg(&self.profile)
            .arg("--manifest-path")
            .arg(self.manifest_dir.join("Cargo.toml"))
            .arg("--target-dir")
            .arg(self.resolved_target_dir());
        if !self.features.is_empty() {
            cmd.arg("--features").arg(self.features.join(","));
        }
        // Flags meant for the native test build must not leak into the wasm build.
        for var in ["RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_BUILD_TARGET"] {
            cmd.env_remove(var);
        }
        let out = cmd
            .output()
            .map_err(|e| HostError::Build(format!("cannot run cargo: {e}")))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(HostError::Build(format!(
                "cargo build exited with {}:\n{}",
                out.status,
                tail.join("\n")
            )));
        }
        let path = self.output();
        if !Path::new(&path).exists() {
            return Err(HostError::Build(format!(
                "cargo succeeded but {} does not exist",
                path.display()
            )));
        }
        Ok(path)
    }
}
