//! The workers: membership (`<ns>.members`) and each worker slot's live state (`<ns>.live`).
//!
//! A worker occupies a *slot*, an index that block holders refer to (u16). Slots are assigned
//! by the state writer as workers join (from the plugin configuration or the sidecar's feed)
//! and freed when they leave; a freed slot is reused by the next worker to join, after its
//! allocation clock is moved past its capacity so that nothing the previous occupant held
//! stays valid.
//!
//! Membership changes rarely, so VMs cache it and re-read it only when `members_version` in
//! the live table moves. The live table is read on every request: it is small (one fixed-size
//! entry per slot) and carries everything scoring needs besides the load table.

use super::wire::{Reader, put_short_str};
use crate::worker_metrics::WorkerMetrics;

/// Most worker slots (holders store slots as u16; configurations allow up to this).
pub const MAX_SLOTS: usize = 4096;

/// One member (an occupied or freed slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    /// `ip:port` the ORIGINAL_DST cluster connects to.
    pub address: String,
    /// False for a freed slot (its worker left).
    pub active: bool,
}

/// The membership table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Members {
    pub version: u64,
    pub slots: Vec<Member>,
}

impl Members {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(10 + self.slots.len() * 40);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.slots.len().min(MAX_SLOTS) as u16).to_le_bytes());
        for m in self.slots.iter().take(MAX_SLOTS) {
            out.push(u8::from(m.active));
            put_short_str(&mut out, &m.name);
            put_short_str(&mut out, &m.address);
        }
        out
    }

    /// Decodes a table; a malformed value decodes as the empty table.
    pub fn decode(bytes: &[u8]) -> Members {
        Self::try_decode(bytes).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<Members> {
        let mut r = Reader::new(bytes);
        let version = r.u64()?;
        let n = usize::from(r.u16()?);
        let mut slots = Vec::with_capacity(n.min(r.remaining() / 3));
        for _ in 0..n {
            let active = r.u8()? != 0;
            let name = r.short_str()?.to_string();
            let address = r.short_str()?.to_string();
            slots.push(Member {
                name,
                address,
                active,
            });
        }
        Some(Members { version, slots })
    }

    /// The slot of the active member called `name`.
    pub fn slot_of(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|m| m.active && m.name == name)
    }

    pub fn active(&self) -> impl Iterator<Item = (usize, &Member)> {
        self.slots.iter().enumerate().filter(|(_, m)| m.active)
    }
}

/// Bits of [`Live::flags`].
pub mod flag {
    /// The slot holds a worker.
    pub const ACTIVE: u8 = 1;
    /// Routing may use the worker (its last polls succeeded, or it has not been polled yet).
    pub const HEALTHY: u8 = 2;
    /// `waiting`/`running`/`kv_usage` come from a poll (else unknown).
    pub const METRICS: u8 = 4;
    /// The engine's KV events drive this worker's clock and image residency (precise mode).
    pub const EVENTS: u8 = 8;
}

/// How far ahead of a worker's clock a stamp may be and still count, in capacities: a
/// request stamped for its admission behind a queue (`scoring.admission_stamps`) is as far
/// ahead as the prefill queued before it, and a queue longer than this many caches is one
/// whose blocks will be gone anyway.
pub const FUTURE_CAPACITIES: u32 = 16;

/// One slot's live state.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Live {
    /// Allocation clock: blocks (of the router's block size) the worker allocated so far.
    pub clock: u64,
    /// KV capacity in router blocks (never 0 once the writer filled it in).
    pub capacity: u32,
    pub flags: u8,
    /// Consecutive failed polls.
    pub failures: u8,
    /// Consecutive polls in which the router's in-flight count was above what the engine
    /// reported running and waiting (see [`super::load`] reconciliation).
    pub over_count: u8,
    /// Moves each time the slot gets a new worker: image residency entries of an earlier
    /// occupant carry another incarnation and are ignored.
    pub incarnation: u8,
    /// `vllm:num_requests_waiting`, `..._running`, `vllm:kv_cache_usage_perc` (when METRICS).
    pub waiting: f32,
    pub running: f32,
    pub kv_usage: f32,
    /// Observed prefill speed, uncached prompt tokens per second (0 = unknown).
    pub prefill_tps: f32,
    /// The highest prefill speed the router measured on its own requests, decayed by
    /// [`PEAK_DECAY`] at each probe ([`Live::observe_probe`]): a streamed request routed to an
    /// empty queue measures its uncached tokens over the time to its first chunk. Each such
    /// sample is at most the speed (the time counts the network, the encoder and other
    /// requests' decode steps), and does not fall with the queue as `prefill_tps` does (a
    /// request's prefill time counts its wait behind other prefills, and vLLM's counters
    /// count cache hits before prompt tokens); workers' speeds are compared by it
    /// ([`Live::peak_prefill_tps`]), not by the reading.
    pub prefill_tps_peak: f32,
    /// Probes taken (saturating): the peak counts from [`MIN_PROBES`] on.
    pub prefill_probes: u8,
    /// When the metrics were taken (ms since the epoch; 0 = never).
    pub metrics_ms: u64,
    /// New blocks the worker took recently, decayed with the configured half-life at
    /// `footprint_ms`: how much new content the router has been putting there.
    pub footprint: f32,
    pub footprint_ms: u64,
    /// Last scraped totals of uncached prompt tokens and prefill seconds (to derive
    /// `prefill_tps` from the next scrape; negative = none yet).
    pub tokens_total: f64,
    pub prefill_seconds_total: f64,
}

const LIVE_ENTRY: usize = 8 + 4 + 4 + 4 * 4 + 8 + 4 + 8 + 8 + 8 + 4 + 1;

/// What [`Live::prefill_tps_peak`] keeps of itself at each probe: a peak falls by half over
/// about 34 probes that stay below it (a worker that got slower for good), and never with
/// time alone (a worker too busy to be probed keeps its peak, so equal workers' peaks do not
/// drift apart under load).
pub const PEAK_DECAY: f64 = 0.98;

/// Probes a worker's peak needs before it counts: the first probes of a worker (image-heavy
/// requests, whose encoder time counts) read as low as half its speed.
pub const MIN_PROBES: u8 = 8;
const LIVE_HEADER: usize = 8 + 8 + 4 + 8;

impl Live {
    pub fn active(&self) -> bool {
        self.flags & flag::ACTIVE != 0
    }

    pub fn healthy(&self) -> bool {
        self.flags & flag::HEALTHY != 0
    }

    pub fn has_metrics(&self) -> bool {
        self.flags & flag::METRICS != 0
    }

    /// Whether a holder stamped `stamp` is still in the worker's cache by the LRU model. A
    /// stamp ahead of the clock (a decision recorded before the state writer moved the clock
    /// for it, or stamped for its admission behind a queue) holds too, up to
    /// [`FUTURE_CAPACITIES`] capacities ahead.
    pub fn holds(&self, stamp: u32) -> bool {
        let capacity = self.capacity.max(1);
        let age = (self.clock as u32).wrapping_sub(stamp);
        self.active()
            && (age < capacity || age > u32::MAX - capacity.saturating_mul(FUTURE_CAPACITIES))
    }

    /// The stamp of a block touched now.
    pub fn stamp(&self) -> u32 {
        self.clock as u32
    }

    /// How old a stamp is, as a fraction of the capacity (0 = just touched, >= 1 = evicted).
    pub fn age(&self, stamp: u32) -> f64 {
        self.signed_age(stamp).max(0.0)
    }

    /// How old a stamp is, as a fraction of the capacity, negative for a stamp ahead of the
    /// clock: the blocks of a request whose engine has not stored them yet (precise mode).
    pub fn signed_age(&self, stamp: u32) -> f64 {
        let age = (self.clock as u32).wrapping_sub(stamp) as i32;
        f64::from(age) / f64::from(self.capacity.max(1))
    }

    /// The footprint decayed to `now_ms`.
    pub fn footprint_at(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        decay(
            f64::from(self.footprint),
            now_ms.saturating_sub(self.footprint_ms),
            half_life_ms,
        )
    }

    /// Adds `blocks` new blocks to the footprint at `now_ms`.
    pub fn add_footprint(&mut self, blocks: f64, now_ms: u64, half_life_ms: u64) {
        let now_ms = now_ms.max(self.footprint_ms);
        self.footprint = (self.footprint_at(now_ms, half_life_ms) + blocks) as f32;
        self.footprint_ms = now_ms;
    }

    /// The worker's cache was emptied (its engine restarted, or the event stream cleared it):
    /// every block it held ages past its capacity, and the new content the router put there
    /// before no longer counts against it, so new content flows to it again.
    pub fn forget_cache(&mut self, now_ms: u64) {
        self.clock = self.clock.wrapping_add(u64::from(self.capacity) + 1);
        self.footprint = 0.0;
        self.footprint_ms = self.footprint_ms.max(now_ms);
    }

    /// A probe measured `tps` (tokens per second): the peak decays by [`PEAK_DECAY`] and
    /// becomes `tps` where that is higher. False (nothing counted) unless `tps` is positive
    /// and finite.
    pub fn observe_probe(&mut self, tps: f64) -> bool {
        if !(tps.is_finite() && tps > 0.0) {
            return false;
        }
        let decayed = f64::from(self.prefill_tps_peak) * PEAK_DECAY;
        self.prefill_tps_peak = decayed.max(tps) as f32;
        self.prefill_probes = self.prefill_probes.saturating_add(1);
        true
    }

    /// The peak prefill speed, once [`MIN_PROBES`] probes measured it (None before).
    pub fn peak_prefill_tps(&self) -> Option<f64> {
        (self.prefill_probes >= MIN_PROBES && self.prefill_tps_peak > 0.0)
            .then_some(f64::from(self.prefill_tps_peak))
    }

    /// The engine's metrics as [`WorkerMetrics`], when the slot has fresh ones.
    pub fn metrics(&self) -> Option<WorkerMetrics> {
        self.has_metrics().then(|| WorkerMetrics {
            waiting: f64::from(self.waiting),
            running: f64::from(self.running),
            kv_usage: f64::from(self.kv_usage),
        })
    }
}

fn decay(value: f64, elapsed_ms: u64, half_life_ms: u64) -> f64 {
    if half_life_ms == 0 {
        return value;
    }
    value * (-(elapsed_ms as f64) / half_life_ms as f64 * std::f64::consts::LN_2).exp()
}

/// The live table: a header and one [`Live`] per slot.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LiveTable {
    /// Moves on every write.
    pub version: u64,
    /// The membership table's version this was written with.
    pub members_version: u64,
    /// The sidecar's feed is fresh: routing is in precise mode.
    pub precise: bool,
    /// When the writer last wrote the table (ms since the epoch).
    pub written_ms: u64,
    pub slots: Vec<Live>,
}

impl LiveTable {
    pub fn encode(&self) -> Vec<u8> {
        let n = self.slots.len().min(MAX_SLOTS);
        let mut out = Vec::with_capacity(LIVE_HEADER + n * LIVE_ENTRY);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.members_version.to_le_bytes());
        out.extend_from_slice(&u32::from(self.precise).to_le_bytes());
        out.extend_from_slice(&self.written_ms.to_le_bytes());
        for l in self.slots.iter().take(n) {
            out.extend_from_slice(&l.clock.to_le_bytes());
            out.extend_from_slice(&l.capacity.to_le_bytes());
            out.extend_from_slice(&[l.flags, l.failures, l.over_count, l.incarnation]);
            for v in [l.waiting, l.running, l.kv_usage, l.prefill_tps] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&l.metrics_ms.to_le_bytes());
            out.extend_from_slice(&l.footprint.to_le_bytes());
            out.extend_from_slice(&l.footprint_ms.to_le_bytes());
            out.extend_from_slice(&l.tokens_total.to_le_bytes());
            out.extend_from_slice(&l.prefill_seconds_total.to_le_bytes());
            out.extend_from_slice(&l.prefill_tps_peak.to_le_bytes());
            out.push(l.prefill_probes);
        }
        out
    }

    /// Decodes a table; a malformed value decodes as the empty table.
    pub fn decode(bytes: &[u8]) -> LiveTable {
        Self::try_decode(bytes).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Option<LiveTable> {
        let mut r = Reader::new(bytes);
        let version = r.u64()?;
        let members_version = r.u64()?;
        let precise = r.u32()? & 1 != 0;
        let written_ms = r.u64()?;
        if !r.remaining().is_multiple_of(LIVE_ENTRY) {
            return None;
        }
        let n = (r.remaining() / LIVE_ENTRY).min(MAX_SLOTS);
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            let clock = r.u64()?;
            let capacity = r.u32()?;
            let flags = r.u8()?;
            let failures = r.u8()?;
            let over_count = r.u8()?;
            let incarnation = r.u8()?;
            let waiting = r.f32()?;
            let running = r.f32()?;
            let kv_usage = r.f32()?;
            let prefill_tps = r.f32()?;
            let metrics_ms = r.u64()?;
            let footprint = r.f32()?;
            let footprint_ms = r.u64()?;
            let tokens_total = f64::from_bits(r.u64()?);
            let prefill_seconds_total = f64::from_bits(r.u64()?);
            let prefill_tps_peak = r.f32()?;
            let prefill_probes = r.u8()?;
            slots.push(Live {
                clock,
                capacity,
                flags,
                failures,
                over_count,
                incarnation,
                waiting,
                running,
                kv_usage,
                prefill_tps,
                metrics_ms,
                footprint,
                footprint_ms,
                tokens_total,
                prefill_seconds_total,
                prefill_tps_peak,
                prefill_probes,
            });
        }
        Some(LiveTable {
            version,
            members_version,
            precise,
            written_ms,
            slots,
        })
    }

    pub fn get(&self, slot: usize) -> Option<&Live> {
        self.slots.get(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_and_garbage_is_empty() {
        let members = Members {
            version: 7,
            slots: vec![
                Member {
                    name: "w0".into(),
                    address: "10.0.0.1:8000".into(),
                    active: true,
                },
                Member {
                    name: "gone".into(),
                    address: "10.0.0.2:8000".into(),
                    active: false,
                },
            ],
        };
        assert_eq!(Members::decode(&members.encode()), members);
        assert_eq!(members.slot_of("w0"), Some(0));
        assert_eq!(members.slot_of("gone"), None);
        let live = LiveTable {
            version: 3,
            members_version: 7,
            precise: true,
            written_ms: 99,
            slots: vec![
                Live {
                    clock: 1 << 40,
                    capacity: 4096,
                    flags: flag::ACTIVE | flag::HEALTHY,
                    waiting: 2.0,
                    prefill_tps: 8000.0,
                    prefill_tps_peak: 9000.0,
                    prefill_probes: 3,
                    tokens_total: 1.5,
                    prefill_seconds_total: -1.0,
                    ..Live::default()
                };
                2
            ],
        };
        assert_eq!(LiveTable::decode(&live.encode()), live);
        for bytes in [&b""[..], b"\x01\x02", &live.encode()[..40]] {
            assert_eq!(LiveTable::decode(bytes), LiveTable::default());
            assert_eq!(Members::decode(bytes), Members::default());
        }
    }

    #[test]
    fn the_peak_speed_counts_after_enough_probes_and_decays_per_probe() {
        let mut w = Live::default();
        assert_eq!(w.peak_prefill_tps(), None);
        // The first probe is image-heavy and reads low; the next ones find the speed.
        assert!(w.observe_probe(5_000.0));
        assert!(w.observe_probe(10_000.0));
        for _ in 2..MIN_PROBES - 1 {
            assert!(w.observe_probe(6_000.0));
        }
        assert_eq!(w.peak_prefill_tps(), None, "one probe short");
        assert!(w.observe_probe(6_000.0));
        let peak = w.peak_prefill_tps().expect("enough probes");
        let want = 10_000.0 * PEAK_DECAY.powi(i32::from(MIN_PROBES) - 2);
        assert!((peak - want).abs() < 1.0, "{peak} {want}");
        // A worker that got slower for good: the peak follows its probes down.
        for _ in 0..300 {
            w.observe_probe(4_000.0);
        }
        assert!((w.peak_prefill_tps().unwrap_or(0.0) - 4_000.0).abs() < 1.0);
        // Nonsense samples count nothing.
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(!w.observe_probe(bad));
        }
        assert!((w.peak_prefill_tps().unwrap_or(0.0) - 4_000.0).abs() < 1.0);
        assert_eq!(w.prefill_probes, u8::MAX, "saturates");
    }

    #[test]
    fn a_stamp_is_held_until_capacity_newer_blocks_were_allocated() {
        let mut w = Live {
            clock: 100,
            capacity: 10,
            flags: flag::ACTIVE,
            ..Live::default()
        };
        let stamp = w.stamp();
        assert!(w.holds(stamp));
        w.clock += 9;
        assert!(w.holds(stamp), "9 newer blocks: still cached");
        w.clock += 1;
        assert!(!w.holds(stamp), "10 newer blocks: evicted");
        w.flags = 0;
        assert!(!w.holds(w.stamp()), "an inactive slot holds nothing");
        // Wrap-around of the 32-bit stamps.
        let mut w = Live {
            clock: u64::from(u32::MAX) - 2,
            capacity: 10,
            flags: flag::ACTIVE,
            ..Live::default()
        };
        let stamp = w.stamp();
        w.clock += 5;
        assert!(w.holds(stamp));
        // Ahead of the clock (stamped for an admission behind a queue): held up to
        // FUTURE_CAPACITIES capacities ahead, across the wrap too.
        let ahead = |blocks: u32| w.holds(w.stamp().wrapping_add(blocks));
        assert!(ahead(1) && ahead(10 * FUTURE_CAPACITIES));
        assert!(!ahead(10 * FUTURE_CAPACITIES + 1), "further ahead: garbage");
    }

    #[test]
    fn footprint_halves_every_half_life() {
        let mut w = Live::default();
        w.add_footprint(100.0, 1000, 10_000);
        assert!((w.footprint_at(11_000, 10_000) - 50.0).abs() < 1e-3);
        w.add_footprint(50.0, 11_000, 10_000);
        assert!((w.footprint_at(11_000, 10_000) - 100.0).abs() < 1e-3);
    }
}
