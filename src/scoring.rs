//! Choosing a worker: the time a request would wait and prefill on each worker.
//!
//! ## The rule
//! Moving a request away from the worker that holds its prefix costs recomputing that prefix
//! elsewhere; keeping it there costs waiting behind that worker's queue. Both are times, so
//! every candidate worker `w` gets an estimated cost in seconds and the lowest wins:
//!
//! ```text
//! cost(w) = wait(w) + prefill(w) + recompute_weight × (1 + in_flight) × recompute(w)
//!           + footprint(w) + running(w)
//!
//! wait(w)      = prefill still queued ahead on w: the router's queue clock (see
//!                crate::state::load), or, when the engine reports a longer queue than the
//!                router knows of (other routers' traffic), waiting(w) × this request's
//!                full prefill time, whichever is larger
//! prefill(w)   = (prompt_tokens − matched_blocks(w) × block_size) / speed(w)
//! recompute(w) = (best_matched − matched_blocks(w)) × block_size / speed(w)
//! in_flight    = requests in flight per candidate, the mean over the candidates
//! footprint(w) = footprint_weight × max(0, share(w) − 1) × new_tokens(w) / speed(w)
//!                (0 where w holds the conversation the request continues)
//! running(w)   = running_ms × running(w) / 1000
//! ```
//!
//! - `speed(w)` is the worker's observed prefill speed (uncached prompt tokens per second,
//!   from its `vllm:request_prefill_time_seconds` and token counters), or
//!   `prefill_tokens_per_sec` until it has one; with `speed_capped_by_peak` (off by default),
//!   at most its peak measured speed (`Candidate::peak_prefill_tps`) where that is known.
//! - `matched_blocks(w)` is the prefix of the request's blocks that `w` holds; in precise
//!   mode, the part of it still cached when `w` admits the request, after the blocks of the
//!   prefill queued before it (`admission_match`, docs/ROUTING.md), at most the blocks routed
//!   there that its engine has not stored yet (`admission_pending`), where a prefix that a
//!   queued request shares counts as touched at that request's admission
//!   (`admission_stamps`).
//! - `share(w)` is `w`'s recent footprint (new blocks the router put there, decayed with
//!   `footprint_half_life_ms`) over the mean of the candidates. A worker that took more than
//!   its share of new content pays for this request's new tokens in proportion: new content
//!   spreads over the fleet's caches (as SGLang's router sends unmatched requests to its
//!   smallest tree) instead of piling onto the one worker that holds a short shared prefix,
//!   whose sessions would then all queue there. The term spreads new conversations, not the
//!   turns of one: it does not apply to a worker that holds the conversation a request
//!   continues (every block before its last `assistant` message). A follow-up turn that adds
//!   an image has many new tokens, and the term used to move it for the sake of balance,
//!   leaving its history behind (15 of 119 follow-ups in `bursty`, 4 workers, seed 3, each
//!   after about 200 history tokens were recomputed elsewhere).
//! - `recompute(w)` is the part of `prefill(w)` that another candidate would not have to do:
//!   the prefix the best-matched worker holds and `w` does not. `prefill(w)` already charges
//!   it to this request; `recompute_weight` (default 1) charges it again for everyone else,
//!   once plus once per request in flight per worker (`recompute_grows_with_load`). A
//!   recompute occupies `w`'s prefill for that long, so every request that queues behind it
//!   there waits that much longer, about as many as are in flight on a worker now; and it
//!   writes a second copy of the prefix into `w`'s cache, evicting other conversations'
//!   blocks there. On idle workers a request leaves the worker that holds its history only
//!   when the wait there costs more than twice the recompute; with 3 in flight per worker,
//!   five times. Measured on `scripts/bench-compare`: the router that weighed only the
//!   request's own time moved 12–55 of ~100–130 follow-up turns and lost hit rate to SGLang's
//!   router, which never moves them; with a fixed weight of 1, bursts at 2 workers moved 27
//!   of 166 follow-ups, each to the shorter queue, which then became the longer one (hit rate
//!   0.57-0.60 against SGLang's 0.62 on `bursty`, seed 5, TTFT p99 1.9-3.6 s against 1.3 s).
//! - `running(w)` (default 0) is for engines whose steps slow with batch size.
//!
//! Load counts once: the queue clock already holds the router's own requests, the engine's
//! `waiting` is used only where it says more, and in-flight counts only break ties and
//! weigh the recompute.
//!
//! ## Worked example
//! A follow-up turn of 150 blocks (2,400 tokens); workers prefill 8,000 tokens/s. Worker A
//! holds 141 of its blocks and has 800 uncached tokens queued (0.100 s); worker B is idle and
//! holds the 2 blocks of the shared system prompt; footprints are even.
//!
//! ```text
//! A: wait 0.100 + prefill (2400 − 141×16)/8000 = 0.018                          → 0.118 s
//! B: wait 0     + prefill (2400 −   2×16)/8000 = 0.296 + recompute 139×16/8000 = 0.278
//!                                                                          → 0.574 s
//! ```
//! A: stay with the KV (nothing else in flight: the recompute counts once more). Had A
//! 0.300 s queued, A would cost 0.318 s and B still 0.574 s: the request stays. At 0.600 s
//! queued (0.618 s), the wait costs more than twice the recompute, and the request moves to
//! B. With 3 requests in flight per worker the recompute counts 4 times: B costs 0.296 + 4 ×
//! 0.278 = 1.408 s, and the request moves only once A has more than 1.39 s queued.
//!
//! ## Homes
//! Under cache pressure (a worker's cache holds a few requests) a request finds its system
//! prompt cached only where the requests just before it were of its group. The cost above is
//! per request: once the queue ahead will evict a shared prompt anyway, nothing in it keeps a
//! group together, and every group spreads over every worker. With `home_hold`, each group of
//! requests that share a preamble (the leading system messages) has a home worker
//! ([`crate::state::homes`]: assigned at first sight, among the workers whose homed traffic
//! is within its noise of the least, to the one with the fewest groups), and a request goes
//! home instead of to its lowest-cost worker when
//! - that worker would recompute the preamble: where it holds the preamble (or more: a
//!   follow-up's history, a repeated image) the request finds its prefix there, so where
//!   caches hold the working set every worker soon holds every preamble and the cost
//!   balances as before; the hold acts only where the preamble is gone, under cache
//!   pressure; and
//! - the group has at most `home_max_shares` (1.5) workers' shares of the recent traffic
//!   (its decayed request rate over all groups', times the workers): one application's
//!   system prompt on every request is no group to keep on one worker whose cache turns
//!   over (the filter checks this, from the homes table, over at least
//!   `home_share_min_requests` per worker, so that the first groups seen at start-up do not
//!   look like all of the traffic). Past it, a group with at most `home_fit_max_traffic`
//!   (0.5) of the traffic the table has seen is still held while the home's cache holds its
//!   footprint (as below): there a copy of its preamble elsewhere buys nothing. With
//!   `home_fit_lifts_share_limit` (on by default) the limit does not apply while the
//!   home's cache holds its footprint and its extra wait costs less than the preamble's
//!   weighted recompute
//!   ([`home_wait_pays_for_preamble`]); and
//! - the home is not overloaded: its requests in flight, this one included, are at most
//!   `ceil((1 + home_load_slack) × mean)` over the candidates (the bound of consistent hashing
//!   with bounded loads; `home_load_slack` 1 by default, so with 2 workers a group is held at
//!   any load), or `home_load_floor` (default 2) where that is more: at low load the bound is
//!   1, and a group's second request would copy its preamble to an idle worker instead of
//!   joining the first. Where the fleet's mean requests in flight per candidate, this one
//!   included, is at least `load_bounds_lift_at` (default 2), this bound and the
//!   conversations' below do not bind (each is every request in flight): every worker is
//!   then busy on the mean, and a request sent off its home or its conversation's worker adds
//!   a prefill to the fleet's work and its group to another worker's cache. A group of more
//!   than `load_bounds_lift_max_shares` (default 1) workers' shares of the recent traffic
//!   keeps its home's bound there: one worker cannot carry it, and only the bound spreads it.
//!   With `load_bounds_lift_unless_copy_fits` (and `conversation_lift_unless_copy_fits` for
//!   a conversation's worker; both off by default), a bound also stands under the lift where
//!   the cost's choice has room in its cache for the copy ([`copy_fits`]): the lift pays
//!   where a copy evicts another group's blocks, not where it costs nothing recent.
//!   With `load_bounds_lift_min_speed` (off by default), a home or conversation's worker
//!   that prefills slower than that share of the cost's choice keeps its bound under the
//!   lift ([`slower_than_choice`]): the lift counts requests, and on a slower worker each
//!   one queued is a longer wait.
//!   With
//!   `home_load_by_groups`, where the homes table counts more groups
//!   (effectively, by their recent rates) than there are workers, the slack is multiplied by
//!   the groups per worker: every worker is then some group's home, and a request the bound
//!   sends away recomputes on another group's home (off by default: docs/ROUTING.md). With
//!   `home_spares_homes` (off by default), where the request would go to another group's
//!   home that still holds that group's preamble, it stays home past the bound, up to
//!   `home_fit_load_factor` times it, while the home's extra wait is at most
//!   `home_wait_allowance` times the preamble's weighted prefill ([`allowed_wait`]). A
//!   home whose cache still holds what it took recently (its footprint, at least the blocks
//!   of the prefill queued there, plus this request's new blocks within its capacity) may
//!   carry up to `home_fit_load_factor` (default 2) times that bound: there a short wait
//!   costs less than the copy of the preamble, and more of the group does not evict the
//!   home's other conversations. Past it, the request goes where the cost says; and
//! - the home's extra wait is not past `home_wait_allowance` (4) times the preamble's weighted
//!   prefill while the chosen worker's cache holds the copy, or the copy is at most
//!   `small_copy_share` (1/16) of that cache ([`wait_past_a_copy_that_fits`]). By default
//!   this applies only with 2 candidates, where the bound above never binds
//!   ([`ScoringConfig::home_wait_applies`]); on a fleet of two speeds it is what keeps a slow
//!   home's queue from growing for as long as its groups send.
//!
//! A group gets its home at first sight, before its popularity is known, so two popular groups
//! can share a worker, and with 2 workers the load bound above never binds. With
//! `home_rebalance_above` set (off by default), a group whose home carries more than that
//! many times the mean homed traffic moves to the least homed worker, if it is at most half
//! the difference ([`crate::state::homes::Homes::rebalance`]). With `home_fewest_groups` (on
//! by default) a new group's home is the worker with the fewest groups among those whose
//! homed traffic is within its noise of the least ([`crate::state::homes::Placement`]).
//! With `home_speed_weighted` (on by default) both count homed traffic per unit of each
//! worker's peak measured prefill speed (`Candidate::peak_prefill_tps`; not the reading the
//! cost weighs, which falls with the queue), and where speeds differ a home with more than 1.25 times
//! its part by speed gives up a group ([`crate::state::homes::Eligible`]).
//!
//! ## Conversations
//! With `conversation_hold` (2 by default; 0 is off), a follow-up turn (a request that
//! continues a conversation beyond its preamble) goes back to the worker that held its whole
//! conversation (every block before its last `assistant` message) before the admission cut,
//! instead of the cost's choice, while that worker carries, with this request, at most
//! `conversation_hold` times the load bound above ([`conversation_load`]). The cost weighs
//! the history that will still be cached at admission; under cache pressure that forecast
//! often says the queue ahead will evict the history, and the follow-up then leaves for an
//! idle worker, where it finds nothing. In `tight-256` with 4 workers the cost alone moved 7-9
//! follow-ups per run and lost to SGLang's router, which never moves one (docs/ROUTING.md,
//! "Conversations go back to their worker", has the measurements). With up to 4 workers a
//! worker carrying all of the fleet's requests stays within twice the bound; with 8, a
//! conversation's worker carries at most about half of them. The hold comes after the home's:
//! a follow-up's history outweighs its group's preamble. Where no worker holds the whole
//! conversation, the worker holding at least `conversation_hold_partial_share` (half) of it
//! past the preamble is held to the same way (`conversation_hold_partial`, on by default).
//!
//! ## Choice
//! With `temperature` 0 the lowest cost wins. Costs within 1 µs or 1e-9 (relative) of the
//! best are ties: the tied worker with the longest match wins (a second copy of a prefix for
//! nothing would only take cache space), then the one with the fewest in-flight requests, and
//! among those `random` picks one. With `temperature > 0`, costs are min-max normalised to 0..1 and a
//! worker is sampled with probability ∝ `exp(−normalised / temperature)`. `random` is mixed
//! (splitmix64) before use, so a plain counter works; the result is a pure function of the
//! arguments.
//!
//! ## Robustness
//! No candidates → `None`. Negative or non-finite metrics count as unknown; a speed that is
//! not a positive finite number falls back to the default. Matched counts above the request's
//! blocks are clamped.

use crate::config_error::ConfigError;

/// Scoring parameters. Every field is optional in the JSON configuration.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Prefill speed assumed for a worker until its metrics give one, in uncached prompt
    /// tokens per second (default 10000, a mid-size model on one modern GPU).
    pub prefill_tokens_per_sec: f64,
    /// How strongly new content is steered away from workers that took more than their
    /// share of it recently (default 0.5; 0 turns the footprint term off). Dimensionless:
    /// seconds of penalty per second of new prefill, per unit of excess share.
    pub footprint_weight: f64,
    /// Half-life of a worker's footprint, in ms (default 60000).
    pub footprint_half_life_ms: u64,
    /// Cost of each request running on a worker, in ms (default 0): set it for engines whose
    /// steps slow noticeably with batch size.
    pub running_ms: f64,
    /// Softmax temperature over min-max normalised costs (default 0 = always the lowest).
    pub temperature: f64,
    /// How many times more a recompute counts than its own prefill time (default 1): the
    /// delay it causes to the requests queued after it and the duplicate it writes into
    /// another cache; times 1 + the requests in flight per worker when
    /// `recompute_grows_with_load`. 0 weighs the request's own time only.
    pub recompute_weight: f64,
    /// Precise mode: count only the part of a worker's match that is still cached when the
    /// worker admits the request, after the blocks of the requests queued before it
    /// (default true). False counts what the worker holds now.
    pub admission_match: bool,
    /// Precise mode: a routed request's block keys are stamped with the clock its worker
    /// will have once it has stored the prefill queued ahead of it (in blocks, at the
    /// worker's speed) and the request's own new blocks, up to 16 capacities ahead
    /// ([`crate::state::workers::FUTURE_CAPACITIES`]) (default false: its own new blocks
    /// only). A prefix that a queued request shares (its group's preamble) is touched again
    /// at that request's admission, so the admission cut counts it that young for the
    /// requests queued behind it, instead of evicted by the queue ahead of both. Measured
    /// level with the default in hit rate (docs/ROUTING.md, "Capacity").
    pub admission_stamps: bool,
    /// Precise mode: the blocks the admission cut counts ahead of a request are at most the
    /// new blocks routed to the worker that its engine has not stored yet (default true): the
    /// requests admitted and still in prefill are on the queue clock, but vLLM allocated their
    /// blocks when it admitted them ([`crate::state::load`], "Blocks not yet stored").
    pub admission_pending: bool,
    /// The recompute's weight grows with the fleet's load: `recompute_weight × (1 + mean
    /// requests in flight per candidate)` (default true): about as many requests queue
    /// behind a recompute as are in flight on a worker. False keeps it at `recompute_weight`.
    pub recompute_grows_with_load: bool,
    /// Keep each group of requests that share a preamble (their leading system messages) on
    /// one home worker where the request would otherwise recompute its preamble, while that
    /// worker's load stays within `home_load_slack` of the mean (default true; see "Homes"
    /// above and [`crate::state::homes`]).
    pub home_hold: bool,
    /// How far above the fleet's mean in-flight count a home may go and still be held to:
    /// a request goes home while the home's in-flight count, this request included, is at
    /// most `ceil((1 + home_load_slack) × mean)` (default 1: a home may carry twice the
    /// mean; with 2 workers that never stops a hold).
    pub home_load_slack: f64,
    /// Where the fleet's mean requests in flight per candidate, this request included, is at
    /// least this, the homes' and the conversations' load bounds do not bind (each is every
    /// request in flight): every worker is then busy on the mean, the prefill a request saves
    /// is work taken off the fleet, and a group or conversation spread over more workers
    /// interleaves with more of them in each cache. Below it the bounds trade hit rate for a
    /// shorter queue, where a worker is idle. Default 2 (0: the bounds always apply; alone,
    /// 2 lost where a popular group is what the bounds spread, hence
    /// `load_bounds_lift_max_shares`: docs/ROUTING.md).
    pub load_bounds_lift_at: f64,
    /// Where `load_bounds_lift_at` lifts the bounds, a group with more than this many
    /// workers' shares of the recent traffic (counted as for `home_max_shares`) keeps its
    /// home's load bound: one worker cannot carry it without queueing past the mean, and only
    /// the bound spreads it (default 1; 0: every group's bound is lifted).
    pub load_bounds_lift_max_shares: f64,
    /// Where `load_bounds_lift_at` lifts the bounds, a group's home keeps its load bound
    /// where the chosen worker's cache holds a copy ([`copy_fits`]): the lift is for a fleet
    /// whose caches turn over, where a copy elsewhere evicts another group (default false).
    pub load_bounds_lift_unless_copy_fits: bool,
    /// The same for a conversation's worker (default false).
    pub conversation_lift_unless_copy_fits: bool,
    /// Where `load_bounds_lift_at` lifts the bounds, a home or a conversation's worker whose
    /// observed prefill speed is below this share of the cost's choice's keeps its load bound
    /// ([`slower_than_choice`]): the lift counts requests, and on a slower worker each one
    /// in the queue is a longer wait (default 0: off; on a fleet of equal workers it never
    /// acts).
    pub load_bounds_lift_min_speed: f64,
    /// Where there are more groups than workers, `home_load_slack` is multiplied by the
    /// groups per eligible worker (the effective number of groups in the homes table, by
    /// their recent rates, over the workers; only where that is above 1) (default false).
    /// There every worker is some group's home: a request the bound sends off its home
    /// recomputes its history on another group's home and evicts that group's blocks there.
    pub home_load_by_groups: bool,
    /// A group's request past its home's load bound is still held to its home, up to
    /// `home_fit_load_factor` times the bound and while the home's extra wait is at most
    /// `home_wait_allowance` times the preamble's weighted prefill ([`allowed_wait`]),
    /// where the cost's choice is another group's home whose cache still holds that group's
    /// preamble (default false). Sent there, the request would interleave two groups in one
    /// worker's cache, and under a tight cache each evicts the other's preamble and images;
    /// where the choice is no group's home (more workers than groups) or its group's
    /// preamble is gone, the bound applies as before. Without the limit in time, at low load
    /// (a bound of `home_load_floor`) the home queued 4 requests while the choice was idle,
    /// and the TTFT p99 doubled (docs/BENCHMARKS.md, 175th-195th runs).
    pub home_spares_homes: bool,
    /// Requests in flight a home may always carry, this one included, whatever the mean
    /// (default 2; 0 = no floor). At low load the bound above is 1, so a group's second
    /// request could not join the first on its home and copied the preamble elsewhere.
    pub home_load_floor: u32,
    /// How many times its load bound a home may carry while its cache still holds what it
    /// took recently (its footprint plus this request's new blocks within its capacity;
    /// default 2; 1 = never past the bound). Where the home's cache holds its recent
    /// conversations, a group's request that waits there briefly costs less than the copy of
    /// the preamble it would make elsewhere; past its capacity, more of the group there
    /// would evict the home's other conversations.
    pub home_fit_load_factor: f64,
    /// A group is held to its home while it has at most this many workers' shares of the
    /// recent traffic (default 1.5), or past it as `home_fit_max_traffic` allows: one
    /// application's system prompt on every request is no group to keep on one worker whose
    /// cache cannot hold it.
    pub home_max_shares: f64,
    /// The share limit does not apply while the home's cache holds what it took recently
    /// (its footprint, at least the prefill queued there, plus this request's new blocks
    /// within its capacity) and the wait there costs less than the preamble's weighted
    /// recompute (default true; false leaves the share limit and `home_fit_max_traffic`).
    /// There the group's requests find its preamble at home, and the load bound still spreads
    /// what the home cannot carry (docs/ROUTING.md, "Homes for groups").
    pub home_fit_lifts_share_limit: bool,
    /// While the home's cache holds what it took recently (its footprint, at least the
    /// prefill queued there, plus this request's new blocks within its capacity), a group
    /// past `home_max_shares` is still held while it has at most this fraction of the
    /// traffic the homes table has seen (default 0.5; 0 = the share limit alone). With 8
    /// workers, half the traffic is 4 shares; with 2, one. Below 1, one application's
    /// system prompt on every request (all of the traffic) still spreads.
    pub home_fit_max_traffic: f64,
    /// A new group's home is, among the workers whose homed traffic is within its noise of the
    /// least (two counts of requests within the square root of their sum), the one with the
    /// fewest groups homed (default true; false: the least homed traffic). At start-up and
    /// in a burst every user's first request arrives at once, and a group's first requests
    /// count who happened to start with its prompt, not how popular it is
    /// ([`crate::state::homes::Placement`]).
    pub home_fewest_groups: bool,
    /// Requests per worker (recent, decayed) a group's share of the traffic is counted over
    /// at least (default 4; 0 = over what the table has seen). Before the homes table has
    /// seen that many, the first groups would look like all of the traffic and not be held.
    pub home_share_min_requests: f64,
    /// A group's home moves to the worker with the least homed traffic when it carries more
    /// than this many times the mean homed traffic (and the group is at most half the
    /// difference; see [`crate::state::homes::Homes::rebalance`]). Default 0: homes never
    /// move (1.25 was measured: docs/ROUTING.md, "Homes for groups").
    pub home_rebalance_above: f64,
    /// A follow-up turn goes back to the worker that held its whole conversation before the
    /// admission cut while that worker carries at most this many times the home load bound
    /// (default 2; 0 = off: the cost alone decides; see "Conversations" above).
    pub conversation_hold: f64,
    /// The conversation hold also sends a follow-up back to the worker holding the longest
    /// part of its conversation past the preamble where no worker holds the whole of it (its
    /// last turn went elsewhere, or the engine evicted its tail), if that part is at least
    /// `conversation_hold_partial_share` of it. Default true (since the 131st run in
    /// docs/BENCHMARKS.md: +0.010 in tight-256 with 4 workers and +0.012 with 8 on unused
    /// seeds, level elsewhere; false: the whole conversation only).
    pub conversation_hold_partial: bool,
    /// With `conversation_hold_partial`, the share of the conversation past the preamble a
    /// worker must hold to be held to (default 0.5, SGLang's match threshold; 0: any of it,
    /// which lost on unused seeds; 1: the whole). A worker holding a few blocks of a long
    /// history saves little recompute, and holding the follow-up there can put it behind a
    /// burst's queue.
    pub conversation_hold_partial_share: f64,
    /// A group's request is not held to its home, within its load bound, when the home's
    /// extra wait is more than `home_wait_allowance` times the preamble's weighted prefill
    /// and the chosen worker's cache holds the copy, or the copy is small
    /// ([`wait_past_a_copy_that_fits`]).
    /// Unset (the default): on where the load bound cannot bind, with 2 candidates
    /// ([`ScoringConfig::home_wait_applies`]); `true`: always; `false`: never.
    pub home_wait_where_copy_fits: Option<bool>,
    /// How many times the preamble's weighted prefill the home's extra wait may be before
    /// `home_wait_where_copy_fits` lets the request go (default 4; at least 1).
    pub home_wait_allowance: f64,
    /// The holds' wait rules ([`wait_past_a_copy_that_fits`]) also count a copy as fitting
    /// where its new blocks are at most this share of the chosen worker's KV capacity,
    /// whatever that worker took recently (default 1/16; 0: only the footprint test). Under a
    /// load that turns a cache over in seconds the footprint never fits, and a slow home's
    /// queue held its groups for 1-1.6 s more than a copy of a few dozen blocks would cost
    /// (docs/BENCHMARKS.md, hundred-and-tenth run); 1/8 evicted what tight caches' next
    /// requests wanted.
    pub small_copy_share: f64,
    /// A follow-up is not held to its conversation's worker, within the hold's bound, when
    /// that worker's extra wait costs more than the weighted prefill of the conversation the
    /// chosen worker lacks and the chosen worker's cache holds the copy (default false;
    /// [`wait_past_a_copy_that_fits`]).
    pub conversation_wait_where_copy_fits: bool,
    /// A new group's home is placed by each worker's homed traffic and groups per unit of its
    /// peak measured prefill speed (`Live::prefill_tps_peak`, from the router's own requests
    /// on an empty queue) relative to the fastest eligible worker's (speeds at least half
    /// of it count as equal; unknown speeds as the fastest), so that a worker at 0.4 times the
    /// others' speed is given about 0.4 times their traffic
    /// ([`crate::state::homes::Eligible`]). Where the speeds differ, a home that carries more
    /// than 1.25 times its part of the homed traffic by speed gives up a group as
    /// `home_rebalance_above` would (the first homes are placed before any speed is known).
    /// Default true (since the 287th run, docs/ROUTING.md): on equal workers the peaks read
    /// at least 0.71 of each other, inside the band, so nothing changes there; on a warm
    /// fleet of two speeds it lowered the TTFT p99 by up to a third for at most 0.002 of
    /// hit rate.
    pub home_speed_weighted: bool,
    /// The cost weighs each worker at its reading (`speed(w)`) but at most its peak measured
    /// speed (`Candidate::peak_prefill_tps`, once known): the reading falls with the
    /// prefills in flight (a load signal the defaults rely on) but also overshoots, as the
    /// engine counts cache hits at scheduling and prompt tokens at the prefill's end, and by
    /// unequal amounts, so that a slow worker's reading said 0.47 of the fast ones' speed
    /// where it was 0.40 (docs/BENCHMARKS.md, 271st run). Default false.
    pub speed_capped_by_peak: bool,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            prefill_tokens_per_sec: 10_000.0,
            footprint_weight: 0.5,
            footprint_half_life_ms: 60_000,
            running_ms: 0.0,
            temperature: 0.0,
            recompute_weight: 1.0,
            admission_match: true,
            admission_stamps: false,
            admission_pending: true,
            recompute_grows_with_load: true,
            home_hold: true,
            home_load_slack: 1.0,
            load_bounds_lift_at: 2.0,
            load_bounds_lift_max_shares: 1.0,
            load_bounds_lift_unless_copy_fits: false,
            conversation_lift_unless_copy_fits: false,
            load_bounds_lift_min_speed: 0.0,
            home_load_by_groups: false,
            home_spares_homes: false,
            home_load_floor: 2,
            home_fit_load_factor: 2.0,
            home_max_shares: 1.5,
            home_fit_lifts_share_limit: true,
            home_fit_max_traffic: 0.5,
            home_fewest_groups: true,
            home_share_min_requests: 4.0,
            home_rebalance_above: 0.0,
            conversation_hold: 2.0,
            conversation_hold_partial: true,
            conversation_hold_partial_share: 0.5,
            home_wait_where_copy_fits: None,
            home_wait_allowance: 4.0,
            small_copy_share: 1.0 / 16.0,
            conversation_wait_where_copy_fits: false,
            home_speed_weighted: true,
            speed_capped_by_peak: false,
        }
    }
}

impl ScoringConfig {
    /// Whether the home's wait rule (`home_wait_where_copy_fits`) applies to a request with
    /// `candidates` workers to choose from: as set, or where unset with 2 (or fewer), where
    /// the home's load bound, `ceil(2 × mean)` requests in flight, is every request in flight
    /// and never binds, so that the wait is the only bound on a home.
    pub fn home_wait_applies(&self, candidates: usize) -> bool {
        self.home_wait_where_copy_fits.unwrap_or(candidates <= 2)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.prefill_tokens_per_sec.is_finite() && self.prefill_tokens_per_sec > 0.0) {
            return Err(ConfigError::new(
                "scoring.prefill_tokens_per_sec",
                "must be a finite number > 0",
            ));
        }
        for (name, value) in [
            ("footprint_weight", self.footprint_weight),
            ("running_ms", self.running_ms),
            ("temperature", self.temperature),
            ("recompute_weight", self.recompute_weight),
            ("home_load_slack", self.home_load_slack),
            ("load_bounds_lift_at", self.load_bounds_lift_at),
            (
                "load_bounds_lift_max_shares",
                self.load_bounds_lift_max_shares,
            ),
            (
                "load_bounds_lift_min_speed",
                self.load_bounds_lift_min_speed,
            ),
            ("home_max_shares", self.home_max_shares),
            ("home_share_min_requests", self.home_share_min_requests),
            ("home_rebalance_above", self.home_rebalance_above),
            ("conversation_hold", self.conversation_hold),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(ConfigError::new(
                    format!("scoring.{name}"),
                    "must be a finite number >= 0",
                ));
            }
        }
        if !(self.home_wait_allowance.is_finite() && self.home_wait_allowance >= 1.0) {
            return Err(ConfigError::new(
                "scoring.home_wait_allowance",
                "must be a finite number >= 1",
            ));
        }
        if !(self.home_fit_load_factor.is_finite() && self.home_fit_load_factor >= 1.0) {
            return Err(ConfigError::new(
                "scoring.home_fit_load_factor",
                "must be a finite number >= 1 (1 = off)",
            ));
        }
        if !(0.0..=1.0).contains(&self.home_fit_max_traffic) {
            return Err(ConfigError::new(
                "scoring.home_fit_max_traffic",
                "must be a fraction of the traffic, 0 to 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.conversation_hold_partial_share) {
            return Err(ConfigError::new(
                "scoring.conversation_hold_partial_share",
                "must be a share of the conversation, 0 to 1",
            ));
        }
        if !(0.0..=1.0).contains(&self.small_copy_share) {
            return Err(ConfigError::new(
                "scoring.small_copy_share",
                "must be a share of the capacity, 0 to 1",
            ));
        }
        if self.home_rebalance_above > 0.0 && self.home_rebalance_above < 1.0 {
            return Err(ConfigError::new(
                "scoring.home_rebalance_above",
                "must be 0 (off) or >= 1 (a multiple of the mean)",
            ));
        }
        Ok(())
    }
}

/// The request being routed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RequestSize {
    /// Keyed (full) blocks.
    pub total_blocks: usize,
    /// Prompt tokens (full blocks plus the partial tail).
    pub prompt_tokens: usize,
    pub block_size: usize,
}

/// What the router knows about one candidate worker.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Candidate {
    /// Leading blocks of the request the worker holds.
    pub matched_blocks: usize,
    /// Prefill queued ahead of the request (the router's queue clock), seconds.
    pub queued_s: f64,
    /// `vllm:num_requests_waiting`, when known.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`, when known.
    pub running: Option<f64>,
    /// Observed prefill speed, tokens per second, when known.
    pub prefill_tps: Option<f64>,
    /// The highest prefill speed the router measured lately on its own requests (tokens per
    /// second), when known: the reading above falls with the prefills in flight, this does
    /// not, so workers' speeds are compared by it ([`slower_than_choice`]).
    pub peak_prefill_tps: Option<f64>,
    /// Recent new blocks put on the worker (decayed).
    pub footprint: f64,
    /// KV capacity in blocks of the request's size, when known.
    pub capacity_blocks: Option<f64>,
    /// Requests in flight (tie-break).
    pub inflight: u32,
    /// The worker holds the conversation this request continues (the blocks before its last
    /// `assistant` message): the footprint term does not apply to it.
    pub holds_conversation: bool,
}

/// One candidate's estimated cost, in seconds, and its parts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Estimate {
    pub wait_s: f64,
    pub prefill_s: f64,
    /// Prefill of the blocks the best-matched candidate holds and this one does not: the
    /// recompute that choosing this worker costs.
    pub recompute_s: f64,
    pub footprint_s: f64,
    pub running_s: f64,
    pub cost_s: f64,
}

/// The outcome of [`choose`].
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Index of the chosen candidate.
    pub index: usize,
    /// Candidate indices from best to worst cost (the chosen one first): retries go down it.
    pub ranking: Vec<usize>,
    /// Every candidate's estimate, by candidate index.
    pub estimates: Vec<Estimate>,
    /// The longest match over all candidates.
    pub best_matched: usize,
    /// The request's keyed blocks.
    pub request_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl Choice {
    pub fn estimate(&self) -> Estimate {
        self.estimates.get(self.index).copied().unwrap_or_default()
    }

    /// Chooses candidate `index` instead (it goes first in the ranking).
    pub fn prefer(&mut self, index: usize) {
        if index >= self.estimates.len() {
            return;
        }
        self.index = index;
        self.ranking.retain(|&i| i != index);
        self.ranking.insert(0, index);
    }

    /// The best candidate holding the longest match, when it is not the chosen one (what the
    /// decision log shows as the alternative that was passed over).
    pub fn passed_over(&self, candidates: &[Candidate]) -> Option<usize> {
        if self.best_matched == 0 {
            return None;
        }
        self.ranking.iter().copied().find(|&i| {
            i != self.index
                && candidates
                    .get(i)
                    .is_some_and(|c| c.matched_blocks >= self.best_matched)
        })
    }
}

/// Whether a request of a group whose home is candidate `home` goes there instead of to the
/// chosen candidate (see "Homes" above): the chosen worker would recompute the group's
/// preamble (where it holds the preamble, or more, the request finds its prefix there, and a
/// conversation's history or an image stays where it is cached), and the home's load is within
/// the bound, or within `home_fit_load_factor` times it while the home's cache holds its
/// footprint and this request's new blocks.
pub fn goes_home(
    choice: &Choice,
    candidates: &[Candidate],
    home: usize,
    preamble_blocks: usize,
    config: &ScoringConfig,
) -> bool {
    let Some(h) = candidates.get(home) else {
        return false;
    };
    if !home_saves_preamble(choice, candidates, home, preamble_blocks) {
        return false;
    }
    let (carries, bound) = home_load(choice, candidates, h, config);
    carries <= bound
}

/// Whether the home (candidate `home`) would save the request recomputing its group's
/// preamble: the chosen worker is another one and holds less than the preamble.
pub fn home_saves_preamble(
    choice: &Choice,
    candidates: &[Candidate],
    home: usize,
    preamble_blocks: usize,
) -> bool {
    home != choice.index
        && candidates
            .get(choice.index)
            .is_some_and(|c| c.matched_blocks < preamble_blocks)
}

/// The requests a home would carry with this one, and the most it may carry: its load
/// bound, or `home_fit_load_factor` times it while its cache still holds what it took
/// recently, this request's new blocks included (see [`goes_home`]).
pub fn home_load(
    choice: &Choice,
    candidates: &[Candidate],
    home: &Candidate,
    config: &ScoringConfig,
) -> (f64, f64) {
    let (carries, bound) = load_bound(candidates, home, config);
    if carries <= bound || !home_holds_its_footprint(choice, home, config) {
        return (carries, bound);
    }
    (carries, fit_limit(bound, config))
}

/// `home_fit_load_factor` times a home's load bound: the most it may carry while its cache
/// holds its footprint, or (`home_spares_homes`) where the request would otherwise go to
/// another group's home.
fn fit_limit(bound: f64, config: &ScoringConfig) -> f64 {
    (bound * config.home_fit_load_factor.max(1.0)).floor()
}

/// The requests candidate `c` would carry with this one, and the load bound of consistent
/// hashing with bounded loads: `ceil((1 + home_load_slack) × mean)` requests in flight per
/// candidate, this one included, or `home_load_floor` where that is more; every request in
/// flight where the mean is at least `load_bounds_lift_at` (default 2; 0 never).
fn load_bound(candidates: &[Candidate], c: &Candidate, config: &ScoringConfig) -> (f64, f64) {
    let (total, mean) = inflight_with_request(candidates);
    let carries = f64::from(c.inflight) + 1.0;
    if lifted(mean, config) {
        return (carries, total);
    }
    let bound = ((1.0 + config.home_load_slack.max(0.0)) * mean)
        .ceil()
        .max(f64::from(config.home_load_floor));
    (carries, bound)
}

/// The requests in flight over the candidates with this one, and their mean per candidate.
fn inflight_with_request(candidates: &[Candidate]) -> (f64, f64) {
    let total: f64 = candidates
        .iter()
        .map(|c| f64::from(c.inflight))
        .sum::<f64>()
        + 1.0;
    (total, total / candidates.len().max(1) as f64)
}

/// Whether `load_bounds_lift_at` lifts the load bounds at this `mean` in flight per candidate.
fn lifted(mean: f64, config: &ScoringConfig) -> bool {
    config.load_bounds_lift_at > 0.0 && mean >= config.load_bounds_lift_at
}

/// Whether the load bounds are lifted for a request among `candidates`
/// (`load_bounds_lift_at`): the fleet's mean in flight per candidate, this request
/// included, is at least that.
pub fn bounds_lifted(candidates: &[Candidate], config: &ScoringConfig) -> bool {
    lifted(inflight_with_request(candidates).1, config)
}

/// With `scoring.home_spares_homes`: the requests a home would carry with this one, and
/// the most it may carry where the request would otherwise go to another group's home that
/// holds that group's preamble: `home_fit_load_factor` times its load bound.
pub fn home_spare_load(
    candidates: &[Candidate],
    home: &Candidate,
    config: &ScoringConfig,
) -> (f64, f64) {
    let (carries, bound) = load_bound(candidates, home, config);
    (carries, fit_limit(bound, config))
}

/// Candidate `at`'s extra wait over the chosen worker's, and the wait a hold allows there:
/// `allowance` times the weighted prefill of `blocks` ([`wait_against_recompute`]), seconds.
pub fn allowed_wait(
    choice: &Choice,
    candidates: &[Candidate],
    at: usize,
    blocks: usize,
    allowance: f64,
    config: &ScoringConfig,
) -> Option<(f64, f64)> {
    let (extra_s, pays_s) = wait_against_recompute(choice, candidates, at, blocks, config)?;
    Some((extra_s, pays_s * allowance))
}

/// What candidate `at`, the worker that held a follow-up's whole conversation before the
/// admission cut, would carry with the request, and the most it may carry for the request to
/// go back there (see "Conversations" above): `conversation_hold` times the load bound.
pub fn conversation_load(
    candidates: &[Candidate],
    at: usize,
    config: &ScoringConfig,
) -> (f64, f64) {
    let Some(c) = candidates.get(at) else {
        return (f64::INFINITY, 0.0);
    };
    let (carries, bound) = load_bound(candidates, c, config);
    (carries, (bound * config.conversation_hold.max(0.0)).floor())
}

/// Whether a home's cache still holds what it took recently: its footprint plus the
/// request's new blocks there within its KV capacity (unknown capacity: no). The footprint
/// counts at least the blocks of the prefill queued there (its queue clock at its speed):
/// the state writer adds a decision to the footprint a tick later, so in a burst (at
/// start-up, every footprint is 0) the recorded one lags what the worker is about to write.
pub fn home_holds_its_footprint(choice: &Choice, home: &Candidate, config: &ScoringConfig) -> bool {
    let new_blocks = choice.request_blocks.saturating_sub(home.matched_blocks) as f64;
    let footprint = home
        .footprint
        .max(queued_blocks(home, choice.block_size, config))
        .max(0.0);
    known(home.capacity_blocks).is_some_and(|capacity| footprint + new_blocks <= capacity)
}

/// Whether the chosen worker's cache holds what it took recently plus this request's new
/// blocks there ([`home_holds_its_footprint`] of the choice): a copy of the request's prefix
/// there evicts nothing recent.
pub fn copy_fits(choice: &Choice, candidates: &[Candidate], config: &ScoringConfig) -> bool {
    candidates
        .get(choice.index)
        .is_some_and(|c| home_holds_its_footprint(choice, c, config))
}

/// Whether candidate `at` (a home or a conversation's worker) prefills slower than
/// `load_bounds_lift_min_speed` times the cost's choice, by their peak measured speeds
/// (`peak_prefill_tps`; never where either is unknown, or with 0). Not by the readings the
/// cost weighs: those fall with the prefills in flight, so that a busy worker reads slower
/// than an idle one of the same speed.
/// Under the lift such a worker keeps its load bound: the lift counts requests in flight, and
/// each one queued on a slower worker is a longer wait.
pub fn slower_than_choice(
    choice: &Choice,
    candidates: &[Candidate],
    at: usize,
    config: &ScoringConfig,
) -> bool {
    let share = config.load_bounds_lift_min_speed;
    match (candidates.get(at), candidates.get(choice.index)) {
        (Some(held), Some(chosen)) if share > 0.0 => match (peak_speed(held), peak_speed(chosen)) {
            (Some(held), Some(chosen)) => held < share * chosen,
            _ => false,
        },
        _ => false,
    }
}

/// `config` with the load bounds binding at any load: what a hold weighs where
/// `load_bounds_lift_max_shares`, `load_bounds_lift_min_speed` or the
/// `*_lift_unless_copy_fits` options keep a bound.
pub fn unlifted(config: &ScoringConfig) -> ScoringConfig {
    ScoringConfig {
        load_bounds_lift_at: 0.0,
        ..config.clone()
    }
}

/// The blocks of the prefill queued on a worker: its queue clock at its speed.
pub fn queued_blocks(c: &Candidate, block_size: usize, config: &ScoringConfig) -> f64 {
    c.queued_s.max(0.0) * speed(c, config) / block_size.max(1) as f64
}

/// Whether a home's extra wait (over the chosen worker's) costs no more than the preamble's
/// prefill that going home saves, weighed as the cost weighs a recompute (once for the request,
/// `recompute_weight` per request in flight for those behind it). What a group past its share
/// limit is held for: a long preamble is worth a short wait, a preamble of two blocks in front
/// of a new image is not, and a hot group is not piled onto one worker's queue for it.
pub fn home_wait_pays_for_preamble(
    choice: &Choice,
    candidates: &[Candidate],
    home: usize,
    preamble_blocks: usize,
    config: &ScoringConfig,
) -> bool {
    wait_against_recompute(choice, candidates, home, preamble_blocks, config)
        .is_some_and(|(extra_s, pays_s)| extra_s <= pays_s)
}

/// Candidate `at`'s extra wait over the chosen worker's, and the weighted prefill of `blocks`
/// on the chosen worker that sending the request to `at` instead would save (once for the
/// request, `recompute_weight` per request in flight for those behind it, as the cost weighs
/// a recompute), in seconds: what a hold on a home ([`home_wait_pays_for_preamble`]) or on
/// a conversation's worker weighs.
pub fn wait_against_recompute(
    choice: &Choice,
    candidates: &[Candidate],
    at: usize,
    blocks: usize,
    config: &ScoringConfig,
) -> Option<(f64, f64)> {
    let held = choice.estimates.get(at)?;
    let chosen = choice.estimates.get(choice.index)?;
    let speed = candidates
        .get(choice.index)
        .map_or(config.prefill_tokens_per_sec, |c| speed(c, config));
    let recompute_s = blocks as f64 * choice.block_size as f64 / speed;
    Some((
        held.wait_s - chosen.wait_s,
        recompute_s * (1.0 + recompute_weight(candidates, config)),
    ))
}

/// A hold's wait past what it is allowed, where a copy on the chosen worker fits
/// ([`wait_past_a_copy_that_fits`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaitPast {
    /// The held worker's extra wait over the chosen worker's, seconds.
    pub extra_s: f64,
    /// The wait the hold allows, seconds.
    pub allowed_s: f64,
    /// The copy counts as fitting only for being small ([`copy_is_small`]).
    pub small: bool,
}

/// What the holds' wait rules (`home_wait_where_copy_fits`,
/// `conversation_wait_where_copy_fits`) let a request go for: candidate `at`'s extra wait and
/// the wait it is allowed ([`allowed_wait`]), where the wait is longer and the chosen
/// worker's cache holds a copy of the request's new blocks on top of what it took recently (as
/// [`home_holds_its_footprint`] asks of a home: the copy evicts nothing another request would
/// find), or the copy is small ([`copy_is_small`]: a cache that turns over anyway loses little
/// to it). None where the hold stands.
pub fn wait_past_a_copy_that_fits(
    choice: &Choice,
    candidates: &[Candidate],
    at: usize,
    blocks: usize,
    allowance: f64,
    config: &ScoringConfig,
) -> Option<WaitPast> {
    let chosen = candidates.get(choice.index)?;
    let fits = home_holds_its_footprint(choice, chosen, config);
    let small = !fits && copy_is_small(choice, chosen, config);
    if !fits && !small {
        return None;
    }
    let (extra_s, allowed_s) = allowed_wait(choice, candidates, at, blocks, allowance, config)?;
    (extra_s > allowed_s).then_some(WaitPast {
        extra_s,
        allowed_s,
        small,
    })
}

/// Whether the request's new blocks on `chosen` are at most `small_copy_share` of its KV
/// capacity (unknown capacity: no).
pub fn copy_is_small(choice: &Choice, chosen: &Candidate, config: &ScoringConfig) -> bool {
    let new_blocks = choice.request_blocks.saturating_sub(chosen.matched_blocks) as f64;
    known(chosen.capacity_blocks)
        .is_some_and(|capacity| new_blocks <= capacity * config.small_copy_share)
}

/// The weight of a recompute in the cost: `recompute_weight`, times one plus the requests in
/// flight per candidate with `recompute_grows_with_load`.
fn recompute_weight(candidates: &[Candidate], config: &ScoringConfig) -> f64 {
    if !config.recompute_grows_with_load || candidates.is_empty() {
        return config.recompute_weight;
    }
    let mean_inflight = candidates
        .iter()
        .map(|c| f64::from(c.inflight))
        .sum::<f64>()
        / candidates.len() as f64;
    config.recompute_weight * (1.0 + mean_inflight)
}

/// A candidate's prefill speed (tokens/s): observed, or `prefill_tokens_per_sec`; with
/// `speed_capped_by_peak`, at most its peak where that is known.
fn speed(c: &Candidate, config: &ScoringConfig) -> f64 {
    let reading = known(c.prefill_tps)
        .filter(|s| *s > 0.0)
        .unwrap_or(config.prefill_tokens_per_sec);
    match peak_speed(c) {
        Some(peak) if config.speed_capped_by_peak => reading.min(peak),
        _ => reading,
    }
}

/// What the worker can prefill at, when measured: its recent peak.
fn peak_speed(c: &Candidate) -> Option<f64> {
    known(c.peak_prefill_tps).filter(|s| *s > 0.0)
}

fn known(v: Option<f64>) -> Option<f64> {
    v.filter(|x| x.is_finite() && *x >= 0.0)
}

/// Estimates every candidate's cost for `request` and chooses one. See the module docs.
pub fn choose(
    request: RequestSize,
    candidates: &[Candidate],
    config: &ScoringConfig,
    random: u64,
) -> Option<Choice> {
    if candidates.is_empty() {
        return None;
    }
    let best_matched = candidates
        .iter()
        .map(|c| c.matched_blocks.min(request.total_blocks))
        .max()
        .unwrap_or(0);
    let mean_footprint =
        candidates.iter().map(|c| c.footprint.max(0.0)).sum::<f64>() / candidates.len() as f64;
    let recompute_weight = recompute_weight(candidates, config);
    let estimates: Vec<Estimate> = candidates
        .iter()
        .map(|c| {
            estimate(
                request,
                c,
                config,
                best_matched,
                mean_footprint,
                recompute_weight,
            )
        })
        .collect();
    let cost = |i: usize| estimates.get(i).map_or(f64::INFINITY, |e| e.cost_s);
    let mut ranking: Vec<usize> = (0..candidates.len()).collect();
    ranking.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)));
    let random = splitmix64(random);
    let index = if config.temperature > 0.0 {
        sample(&estimates, config.temperature, random)
            .unwrap_or_else(|| argmin(&estimates, candidates, random))
    } else {
        argmin(&estimates, candidates, random)
    };
    if let Some(pos) = ranking.iter().position(|&i| i == index) {
        ranking.remove(pos);
        ranking.insert(0, index);
    }
    Some(Choice {
        index,
        ranking,
        estimates,
        best_matched,
        request_blocks: request.total_blocks,
        block_size: request.block_size,
    })
}

fn estimate(
    request: RequestSize,
    c: &Candidate,
    config: &ScoringConfig,
    best_matched: usize,
    mean_footprint: f64,
    recompute_weight: f64,
) -> Estimate {
    let speed = speed(c, config);
    let block = request.block_size.max(1) as f64;
    let matched = c.matched_blocks.min(request.total_blocks);
    let prompt = request
        .prompt_tokens
        .max(request.total_blocks * request.block_size) as f64;
    let new_tokens = (prompt - matched as f64 * block).max(0.0);
    let prefill_s = new_tokens / speed;
    let full_s = prompt / speed;
    let queued = if c.queued_s.is_finite() {
        c.queued_s.max(0.0)
    } else {
        0.0
    };
    let engine_queue = known(c.waiting).map_or(0.0, |w| w * full_s);
    let wait_s = queued.max(engine_queue);
    let share = if mean_footprint > 0.0 {
        c.footprint.max(0.0) / mean_footprint
    } else {
        1.0
    };
    let footprint_s = if c.holds_conversation {
        0.0
    } else {
        config.footprint_weight * (share - 1.0).max(0.0) * prefill_s
    };
    let running_s = config.running_ms * known(c.running).unwrap_or(0.0) / 1000.0;
    let recompute_s = best_matched.saturating_sub(matched) as f64 * block / speed;
    let cost_s = wait_s + prefill_s + recompute_weight * recompute_s + footprint_s + running_s;
    Estimate {
        wait_s,
        prefill_s,
        recompute_s,
        footprint_s,
        running_s,
        cost_s: if cost_s.is_nan() {
            f64::INFINITY
        } else {
            cost_s
        },
    }
}

/// Lowest cost; ties by the longest match (no duplicate copy of a prefix for nothing), then
/// fewest in-flight, then `random`.
fn argmin(estimates: &[Estimate], candidates: &[Candidate], random: u64) -> usize {
    let best = estimates
        .iter()
        .map(|e| e.cost_s)
        .fold(f64::INFINITY, f64::min);
    let tol = (1e-9 * best.abs()).max(1e-6);
    let tied = |c: f64| c == best || (best.is_finite() && c - best <= tol);
    // Ordering key among ties: longer match first, then fewer in flight.
    let key = |i: usize| {
        candidates.get(i).map_or((0, u32::MAX), |c| {
            (usize::MAX - c.matched_blocks, c.inflight)
        })
    };
    let tied_ids = || {
        estimates
            .iter()
            .enumerate()
            .filter(move |(_, e)| tied(e.cost_s))
            .map(|(i, _)| i)
    };
    let best_key = tied_ids().map(key).min().unwrap_or((0, 0));
    let count = tied_ids().filter(|&i| key(i) == best_key).count();
    let pick = pick_below(random, count);
    tied_ids()
        .filter(|&i| key(i) == best_key)
        .nth(pick)
        .unwrap_or(0)
}

/// Softmax sample over normalised finite costs; None if no cost is finite.
fn sample(estimates: &[Estimate], temperature: f64, random: u64) -> Option<usize> {
    let finite = || estimates.iter().map(|e| e.cost_s).filter(|c| c.is_finite());
    let min = finite().fold(f64::INFINITY, f64::min);
    let max = finite().fold(f64::NEG_INFINITY, f64::max);
    if !min.is_finite() {
        return None;
    }
    let range = max - min;
    let weight = |c: f64| {
        if !c.is_finite() {
            0.0
        } else if range > 0.0 {
            (-((c - min) / range) / temperature).exp()
        } else {
            1.0
        }
    };
    let sum: f64 = estimates.iter().map(|e| weight(e.cost_s)).sum();
    let mut target = unit_f64(random) * sum;
    let mut last = None;
    for (i, e) in estimates.iter().enumerate() {
        let p = weight(e.cost_s);
        if p > 0.0 {
            last = Some(i);
            if target < p {
                return Some(i);
            }
            target -= p;
        }
    }
    last
}

/// splitmix64's finaliser: spreads a counter or a weak random over all 64 bits.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from the top 53 bits.
fn unit_f64(r: u64) -> f64 {
    (r >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Uniform in 0..n (0 when n is 0) by a multiply-high.
pub fn pick_below(r: u64, n: usize) -> usize {
    ((u128::from(r) * n as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_spreads_a_counter() {
        let picks: Vec<usize> = (0..1000).map(|i| pick_below(splitmix64(i), 4)).collect();
        for k in 0..4 {
            let c = picks.iter().filter(|&&p| p == k).count();
            assert!((200..300).contains(&c), "{k}: {c}");
        }
        assert!(unit_f64(u64::MAX) < 1.0);
    }
}
