//! What the router decided for one request: the worker, the estimate it weighed, what the
//! request holds on the worker until it ends, or why it was routed without its cache affinity.

use crate::scoring::{Estimate, WaitPast};

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

/// A request held to its group's home past the home's load bound
/// (`scoring.home_spares_homes`): what the decision log says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PastBound {
    /// Requests in flight at the home with this one.
    pub carries: f64,
    /// The home's load bound.
    pub bound: f64,
    /// The home's extra wait over the cost's choice and the most it may be, seconds
    /// (`scoring.home_wait_allowance` times the preamble's weighted prefill).
    pub wait: (f64, f64),
}

/// How a request was sent to its group's home against the cost (`scoring.home_hold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HomeHold {
    /// Within the home's load bound (or `home_fit_load_factor` times it).
    Held,
    /// Past the home's load bound, because the cost's choice is another group's home that
    /// holds that group's preamble (`scoring.home_spares_homes`).
    PastBound(PastBound),
}

/// Why a request of a group did not go to its home, where its lowest-cost worker would
/// recompute the group's preamble (`scoring.home_hold`, docs/ROUTING.md "Homes for groups").
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LetGo {
    /// The home would carry `carries` requests in flight, this one included, past the most
    /// it may (`bound`: its load bound, or the fit factor times it).
    LoadBound { carries: f64, bound: f64 },
    /// The group has `shares` workers' shares of the recent traffic, past
    /// `home_max_shares`, and neither rule past the limit held it; `fits`: whether the
    /// home's cache holds its footprint and this request (both rules need it).
    ShareLimit { shares: f64, fits: bool },
    /// The home's extra wait is longer than the wait the preamble allows
    /// (`home_wait_allowance` times its weighted prefill), and the chosen worker's cache holds
    /// the copy or the copy is small (`WaitPast::small`; `scoring.home_wait_where_copy_fits`).
    Wait(WaitPast),
}

impl LetGo {
    fn describe(&self) -> String {
        match self {
            LetGo::LoadBound { carries, bound } => {
                format!("{carries:.0} in flight there past its bound of {bound:.0}")
            }
            LetGo::Wait(past) => format!(
                "its wait there is {:.1} ms longer, past the {:.1} ms its preamble allows, and {}",
                past.extra_s * 1e3,
                past.allowed_s * 1e3,
                copy_here(past.small)
            ),
            LetGo::ShareLimit { shares, fits } => format!(
                "its group has {shares:.1} workers' shares of the traffic{}",
                if *fits {
                    ""
                } else {
                    " and the home's cache does not hold its footprint"
                }
            ),
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

/// See [`Decision::speed_probe`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedProbe {
    pub routed_us: u64,
    pub tokens: u32,
    pub incarnation: u8,
}

/// The fewest uncached prompt tokens a request needs to measure its worker's prefill speed:
/// below, the time to its first chunk is mostly the proxy's and the network's.
pub const SPEED_PROBE_MIN_TOKENS: u32 = 512;

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
    /// The cost's own choice when a hold (`scoring.home_hold`, `scoring.conversation_hold`)
    /// sent the request elsewhere: its name, matched blocks and estimate (what the hold
    /// overruled).
    pub overruled: Option<(String, usize, Estimate)>,
    /// In precise mode, the worker that holds the longest prefix of the request now, when
    /// the prefill queued ahead of the request there will evict part of it before the engine
    /// admits it: its name, the blocks it holds now and the blocks left at admission (what
    /// the decision counted). It says why a request left a worker that holds its history.
    pub cut_at_admission: Option<(String, usize, usize)>,
    /// The request's estimated prefill window on the worker's queue clock, µs since the epoch
    /// (None when the load update was lost).
    pub prefill_window: Option<(u64, u64)>,
    /// The client asked for a stream (prefill then ends at the first response chunk).
    pub stream: bool,
    /// A streamed request routed to an empty prefill queue, with at least
    /// [`SPEED_PROBE_MIN_TOKENS`] uncached: when it was routed (µs since the epoch), its
    /// uncached prompt tokens and the slot's incarnation. Its first chunk measures the
    /// worker's prefill speed (`Router::measure_speed`).
    pub speed_probe: Option<SpeedProbe>,
    /// Media items in the request.
    pub media: usize,
    /// Block buckets read.
    pub probes: usize,
    /// The decision used the engine's KV events (the sidecar's feed was fresh).
    pub precise: bool,
    pub fallback: Option<Fallback>,
    /// The request went to its group's home instead of its lowest-cost worker, and how
    /// (`scoring.home_hold`).
    pub home: Option<HomeHold>,
    /// The group's home when the request was not held to it (its name and why): the
    /// preamble was recomputed on the chosen worker.
    pub home_let_go: Option<(String, LetGo)>,
    /// A follow-up whose whole conversation (or at least `conversation_hold_partial_share` of
    /// it) a worker other than the cost's choice held before the admission cut: sent back
    /// there, or not and why (`scoring.conversation_hold`).
    pub conversation: Option<Conversation>,
    /// False when the load update or the decision record was lost (counted, not fatal).
    pub recorded: bool,
    /// What the engine frees when the request ends, for [`super::Router::released`] (None for a
    /// fallback).
    pub held: Option<Held>,
}

/// What `scoring.conversation_hold` did with a follow-up whose conversation another worker
/// than the cost's choice held.
#[derive(Debug, Clone, PartialEq)]
pub enum Conversation {
    /// Sent back to this worker against the cost.
    Held(String),
    /// Not sent back to this worker: it carries `carries` requests in flight with this one,
    /// past the hold's `limit`.
    LetGo {
        name: String,
        carries: f64,
        limit: f64,
    },
    /// Not sent back to this worker: its wait is longer than the chosen worker's by more
    /// than the conversation's weighted prefill there, and the copy fits there or is small
    /// (`WaitPast::small`; `scoring.conversation_wait_where_copy_fits`).
    LetGoWait { name: String, past: WaitPast },
}

/// How the decision log says a copy fits on the chosen worker: its cache holds it on top of
/// what the worker took recently, or it is small (`scoring.small_copy_share`).
fn copy_here(small: bool) -> &'static str {
    if small {
        "the copy is a small share of the cache here"
    } else {
        "the copy fits here"
    }
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

    /// The `x-mmrouter-decision` response header: the chosen worker's estimated wait,
    /// prefill and recompute, and the state mode.
    pub fn header_value(&self) -> String {
        let e = self.estimate;
        format!(
            "wait_ms={:.1}; prefill_ms={:.1}; recompute_ms={:.1}; mode={}",
            e.wait_s * 1e3,
            e.prefill_s * 1e3,
            e.recompute_s * 1e3,
            self.mode()
        )
    }

    fn mode(&self) -> &'static str {
        if self.precise {
            "precise"
        } else {
            "approximate"
        }
    }

    /// The `[ROUTING]` log line: what was chosen and what it was weighed against. Only numbers,
    /// validated worker names and fixed words: nothing from the request reaches the log.
    pub fn log_line(&self) -> String {
        match self.fallback {
            Some(why) => format!(
                "[ROUTING] Fallback: {} (least loaded), reason {}",
                self.target.name,
                why.reason()
            ),
            None => {
                let e = self.estimate;
                let mut line = format!(
                    "[ROUTING] Best: {} with {}/{} blocks overlap; wait {:.1} ms, prefill {:.1} ms, recompute {:.1} ms ({})",
                    self.target.name,
                    self.matched_blocks,
                    self.total_blocks,
                    e.wait_s * 1e3,
                    e.prefill_s * 1e3,
                    e.recompute_s * 1e3,
                    self.mode(),
                );
                if self.home.is_some() {
                    line.push_str("; its group's home");
                }
                if let Some(HomeHold::PastBound(past)) = &self.home {
                    line.push_str(&format!(
                        ", {:.0} in flight there past its bound of {:.0}",
                        past.carries, past.bound
                    ));
                    let (extra_s, allowed_s) = past.wait;
                    line.push_str(&format!(
                        " and {:.1} ms more wait within {:.1} ms: the cost's choice is another group's home and holds its preamble",
                        extra_s * 1e3,
                        allowed_s * 1e3
                    ));
                }
                if let Some((name, why)) = &self.home_let_go {
                    line.push_str(&format!(
                        "; not its group's home {name}: {}",
                        why.describe()
                    ));
                }
                match &self.conversation {
                    Some(Conversation::Held(_)) => line.push_str("; back to its conversation"),
                    Some(Conversation::LetGo {
                        name,
                        carries,
                        limit,
                    }) => line.push_str(&format!(
                        "; not back to its conversation on {name}: {carries} in flight there past {limit}"
                    )),
                    Some(Conversation::LetGoWait { name, past }) => line.push_str(&format!(
                        "; not back to its conversation on {name}: its wait there is {:.1} ms longer, past the conversation's {:.1} ms, and {}",
                        past.extra_s * 1e3,
                        past.allowed_s * 1e3,
                        copy_here(past.small)
                    )),
                    None => {}
                }
                if let Some((name, matched, alt)) = &self.overruled {
                    line.push_str(&format!(
                        "; over the cost's choice {name} with {matched}/{} blocks: wait {:.1} ms, cost {:.1} ms < {:.1} ms",
                        self.total_blocks,
                        alt.wait_s * 1e3,
                        alt.cost_s * 1e3,
                        e.cost_s * 1e3,
                    ));
                }
                if let Some((name, matched, alt)) = self
                    .passed_over
                    .as_ref()
                    .filter(|p| self.overruled.as_ref().is_none_or(|o| o.0 != p.0))
                {
                    line.push_str(&format!(
                        "; passed over {name} with {matched}/{} blocks: wait {:.1} ms, cost {:.1} ms > {:.1} ms",
                        self.total_blocks,
                        alt.wait_s * 1e3,
                        alt.cost_s * 1e3,
                        e.cost_s * 1e3,
                    ));
                }
                if let Some((name, held, kept)) = &self.cut_at_admission {
                    line.push_str(&format!(
                        "; {name} holds {held}/{} blocks now, {kept} at admission",
                        self.total_blocks
                    ));
                }
                line
            }
        }
    }
}
