//! What the router decided for one request: the worker, the estimate it weighed, what the
//! request holds on the worker until it ends, or why it was routed without its cache affinity.

use crate::scoring::Estimate;

/// Why a request was routed without its cache affinity (to the least-loaded worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The body could not be analysed: [`crate::analysis::AnalyzeError::reason`]
    /// (`bad_json`, `bad_image`, ...).
    Analyze(&'static str),
    /// The body was larger than `limits.max_body_bytes`.
    TooLarge,
    /// A routed path with no body.
    NoBody,
    /// A compressed body (`content-encoding` other than identity): not read.
    Encoded,
}

impl Fallback {
    pub fn reason(&self) -> &'static str {
        match self {
            Fallback::Analyze(r) => r,
            Fallback::TooLarge => "too_large",
            Fallback::NoBody => "no_body",
            Fallback::Encoded => "encoded_body",
        }
    }
}

/// The worker a decision names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub slot: usize,
    pub name: String,
    pub address: String,
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub target: Target,
    /// The next-best workers' addresses, best first (for retries), without the target.
    pub alternates: Vec<String>,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// The chosen worker's estimate: wait, prefill, recompute, cost.
    pub estimate: Estimate,
    /// The best-matched worker when another was chosen: its name, matched blocks and estimate
    /// (what the decision weighed against).
    pub passed_over: Option<(String, usize, Estimate)>,
    /// The request's estimated prefill window on the worker's queue clock, µs since the epoch
    /// (None when the load update was lost).
    pub prefill_window: Option<(u64, u64)>,
    /// The client asked for a stream (prefill then ends at the first response chunk).
    pub stream: bool,
    /// Media items in the request.
    pub media: usize,
    /// Block buckets read.
    pub probes: usize,
    /// The decision used the engine's KV events (the sidecar's feed was fresh).
    pub precise: bool,
    pub fallback: Option<Fallback>,
    /// The request went to its group's home instead of its lowest-cost worker
    /// (`scoring.home_hold`).
    pub home: bool,
    /// False when the load update or the decision record was lost (counted, not fatal).
    pub recorded: bool,
    /// What the engine frees when the request ends, for [`super::Router::released`] (None for a
    /// fallback).
    pub held: Option<Held>,
}

/// The blocks a routed request holds on its worker until it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The request's block keys (as recorded).
    pub keys: Vec<u64>,
    /// The worker's allocation clock and incarnation when the request was routed.
    pub clock: u64,
    pub incarnation: u8,
    /// Blocks the request itself allocates (they move the clock in approximate mode).
    pub new_blocks: u32,
}

impl Decision {
    /// The destination header's value: the chosen worker, then up to `alternates` next-best
    /// ones for retries (`ip:port,ip:port`).
    pub fn destination(&self, alternates: usize) -> String {
        let mut out = self.target.address.clone();
        for a in self.alternates.iter().take(alternates) {
            out.push(',');
            out.push_str(a);
        }
        out
    }
}
