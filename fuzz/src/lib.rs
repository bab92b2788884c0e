//! The property checks of mmrouter's fuzz targets, one module per target family.
//!
//! Each check takes the raw fuzz input and panics when a property fails; it returns false when
//! the input is not one the target is about (an image target given another format), which the
//! libFuzzer target turns into `Corpus::Reject`. The same checks replay the committed corpus
//! and every crash ever found (`fuzz/regressions/<target>/`) in the main test suite
//! (`tests/fuzz_regressions.rs` includes this file by path), so this crate uses only what
//! mmrouter's own tests have: mmrouter, its dependencies, and jpeg-decoder (a dev-dependency).
//!
//! Every check asserts more than "no panic": differential agreement (whole against pieces,
//! streaming against slice decoders, the hand-written readers against reference decoders),
//! round trips (encode after decode), and bounds on what a decoder may build from its input.
//! [`alloc_cap`] turns an allocation over the target's cap into an abort (a finding).
//!
//! See docs/FUZZING.md for the commands, the caps and the results.

pub mod alloc_cap;
pub mod analyze;
pub mod config;
pub mod feed;
pub mod image;
pub mod kv_events;
pub mod payload;
pub mod split;
pub mod state;

/// One fuzz target: its name (the `fuzz_targets/<name>.rs` binary and the
/// `fuzz/corpus/<name>`, `fuzz/regressions/<name>` directories) and its check.
pub struct Target {
    pub name: &'static str,
    /// Panics on a property violation; false when the input is not for this target.
    pub check: fn(&[u8]) -> bool,
    /// Most bytes of Rust heap live at once while one input runs (see [`alloc_cap`]).
    pub cap_bytes: usize,
}

const MIB: usize = 1 << 20;

/// Every target, in the order `scripts/fuzz` runs them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "analyze",
        check: analyze::check,
        // The `inspect` report (checked too) builds a serde_json value of ~1 KiB per block:
        // over 64 MiB for a layout at `max_media_tokens` (2^20 tokens, 65,536 blocks) from a
        // 687-byte body (fuzz/regressions/analyze/inspect-report-of-a-maximal-layout-over-64mib).
        cap_bytes: 256 * MIB,
    },
    Target {
        name: "base64",
        check: payload::check,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "header_png",
        check: image::check_png,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "header_jpeg",
        check: image::check_jpeg,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "header_webp",
        check: image::check_webp,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "header_gif",
        check: image::check_gif,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "config_router",
        check: config::check_router,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "config_filter",
        check: config::check_filter,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "kv_events",
        check: kv_events::check,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "feed",
        check: feed::check,
        cap_bytes: 64 * MIB,
    },
    Target {
        name: "state",
        check: state::check,
        cap_bytes: 64 * MIB,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// Runs one input through a target under its allocation cap: what a fuzz target's body does.
pub fn run(target: &Target, data: &[u8]) -> bool {
    let _cap = alloc_cap::Cap::set(target.cap_bytes);
    (target.check)(data)
}

/// [`run`] for the target called `name` (a fuzz target's whole body).
pub fn run_named(name: &str, data: &[u8]) -> bool {
    match target(name) {
        Some(t) => run(t, data),
        None => panic!("no fuzz target {name}"),
    }
}
