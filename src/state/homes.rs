//! Homes (`<ns>.homes`): the worker each group of requests is kept on when `scoring.home_hold`
//! is on. A group is the requests that share a preamble (the leading system messages: one
//! application's system prompt), named by the key of the preamble's last block.
//!
//! Under cache pressure a worker holds only what the last few requests sent to it left, so a
//! request finds its system prompt cached only if the requests before it on that worker were
//! of its group. Choosing per request, by cost, spreads every group over every worker; a home
//! per group keeps each group's requests together. A group gets its home at first sight: the
//! eligible worker with the least homed request rate (the groups already homed there, each
//! weighted by its recent requests), so homes are balanced by traffic; with
//! [`Placement::fewest_groups`] (the filter's default), among the workers whose homed rate is
//! within its noise of the least, the one with the fewest groups, since a group's first
//! requests count who started with its prompt, not how popular it is. A home
//! whose worker left, became ineligible or was replaced (another incarnation of its slot) is
//! chosen again the same way. Each group's decayed rate also gives its share of the traffic
//! ([`Homes::rates`], [`share_of`]): the filter does not hold a group with more than about one
//! worker's share to one home.
//!
//! Value layout, little-endian; at most `capacity` entries, the least recently seen go first:
//!
//! ```text
//! u8 version (1) | u16 entries | entries × ( u64 group | u16 slot | u8 incarnation | f32 rate | u64 seen_ms )
//! ```
//!
//! Written by every VM with CAS (one update per request that has a preamble); a lost update
//! only loses one request's count.

use super::wire::Reader;

const VERSION: u8 = 1;
const ENTRY: usize = 8 + 2 + 1 + 4 + 8;

/// One group's home.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Home {
    pub group: u64,
    pub slot: u16,
    pub incarnation: u8,
    /// Requests of the group, decayed with the half-life to `seen_ms`.
    pub rate: f32,
    pub seen_ms: u64,
}

impl Home {
    fn rate_at(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        if half_life_ms == 0 {
            return f64::from(self.rate);
        }
        let elapsed = now_ms.saturating_sub(self.seen_ms) as f64;
        f64::from(self.rate) * (-elapsed / half_life_ms as f64 * std::f64::consts::LN_2).exp()
    }
}

/// The decoded table.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Homes {
    pub entries: Vec<Home>,
}

/// A worker a group may be homed on: its slot, the slot's incarnation and its prefill speed
/// relative to the fastest eligible worker's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Eligible {
    pub slot: usize,
    pub incarnation: u8,
    /// In (0, 1]: 1 for the fastest worker and for workers of unknown speed. A new group's
    /// home is placed by each worker's homed rate and groups per unit of speed, so a worker at
    /// half the speed of the others is the least homed with half their traffic
    /// ([`Eligible::relative_speeds`]).
    pub speed: f64,
}

impl Eligible {
    /// Slowest relative speed counted: a worker reported at a hundredth of the fastest one's
    /// speed still counts as one hundredth.
    const MIN_SPEED: f64 = 0.01;

    /// The relative speed that homed traffic is counted per: `speed` within
    /// [`Self::MIN_SPEED`, 1], and 1 where it is not a number.
    fn counted_speed(&self) -> f64 {
        if self.speed.is_finite() {
            self.speed.clamp(Self::MIN_SPEED, 1.0)
        } else {
            1.0
        }
    }

    /// Each worker's speed relative to the fastest one: `speeds[i] / max`, 1 for a speed
    /// that is unknown (not positive and finite), and 1 for all when no speed is known.
    /// Speeds within `band` of the fastest count as the fastest (measured speeds move with
    /// contention; 0 = none).
    pub fn relative_speeds(speeds: &[f64], band: f64) -> Vec<f64> {
        let known = |v: f64| v.is_finite() && v > 0.0;
        let fastest = speeds
            .iter()
            .copied()
            .filter(|&v| known(v))
            .fold(0.0, f64::max);
        speeds
            .iter()
            .map(|&v| {
                if !known(v) || fastest <= 0.0 {
                    return 1.0;
                }
                let r = v / fastest;
                if r >= 1.0 - band.clamp(0.0, 1.0) {
                    1.0
                } else {
                    r.max(Self::MIN_SPEED)
                }
            })
            .collect()
    }
}

impl Homes {
    /// Decodes the table; a malformed value decodes as empty.
    pub fn decode(bytes: &[u8]) -> Homes {
        let mut r = Reader::new(bytes);
        let mut entries = Vec::new();
        let ok = (|| {
            if r.u8()? != VERSION {
                return None;
            }
            let n = r.u16()?;
            for _ in 0..n {
                entries.push(Home {
                    group: r.u64()?,
                    slot: r.u16()?,
                    incarnation: r.u8()?,
                    rate: r.f32()?,
                    seen_ms: r.u64()?,
                });
            }
            Some(())
        })();
        match ok {
            Some(()) => Homes { entries },
            None => Homes::default(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let n = self.entries.len().min(usize::from(u16::MAX));
        let mut out = Vec::with_capacity(3 + n * ENTRY);
        out.push(VERSION);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        for h in self.entries.iter().take(n) {
            out.extend_from_slice(&h.group.to_le_bytes());
            out.extend_from_slice(&h.slot.to_le_bytes());
            out.push(h.incarnation);
            out.extend_from_slice(&h.rate.to_le_bytes());
            out.extend_from_slice(&h.seen_ms.to_le_bytes());
        }
        out
    }

    /// `group`'s decayed request rate now and every group's (one pass over the table), for
    /// callers that need its share counted two ways.
    pub fn rates(&self, group: u64, now_ms: u64, half_life_ms: u64) -> (f64, f64) {
        let (mut own, mut total) = (0.0, 0.0);
        for h in &self.entries {
            let rate = h.rate_at(now_ms, half_life_ms);
            total += rate;
            if h.group == group {
                own += rate;
            }
        }
        (own, total)
    }

    /// The effective number of groups now: `(Σ rate)² / Σ rate²` over the decayed rates (6
    /// groups of equal traffic count 6; one with 90% of it and five others about 1.2); 0 for
    /// an empty table.
    pub fn effective_groups(&self, now_ms: u64, half_life_ms: u64) -> f64 {
        let (sum, squares) = self
            .entries
            .iter()
            .map(|h| h.rate_at(now_ms, half_life_ms))
            .fold((0.0, 0.0), |(sum, squares), r| (sum + r, squares + r * r));
        if squares > 0.0 && squares.is_finite() {
            sum * sum / squares
        } else {
            0.0
        }
    }

    /// The request rate of the groups homed on `worker` now and how many they are (each
    /// counted up to 1 by its rate, so a group not seen for a few half-lives no longer
    /// counts), both per unit of the worker's relative speed, without `own` (a group whose
    /// home is being chosen again).
    fn homed_here(
        &self,
        worker: &Eligible,
        own: Option<Home>,
        now_ms: u64,
        half_life_ms: u64,
    ) -> (f64, f64) {
        let (rate, groups) = self
            .entries
            .iter()
            .filter(|h| {
                usize::from(h.slot) == worker.slot && own.is_none_or(|o| o.group != h.group)
            })
            .map(|h| h.rate_at(now_ms, half_life_ms))
            .fold((0.0, 0.0), |(rate, groups), r| {
                (rate + r, groups + r.min(1.0))
            });
        let speed = worker.counted_speed();
        (rate / speed, groups / speed)
    }

    /// Counts one request of `group` at `now_ms` and returns its home: the recorded one while
    /// that worker is eligible in the same incarnation, else a new one, the eligible worker
    /// with the least homed rate (`preferred` among equals, then the first; with
    /// `placement.fewest_groups`, see [`Placement`]). None when nothing is eligible. Keeps at
    /// most `placement.capacity` groups, forgetting the least recently seen.
    pub fn visit(
        &mut self,
        group: u64,
        eligible: &[Eligible],
        preferred: usize,
        now_ms: u64,
        half_life_ms: u64,
        placement: Placement,
    ) -> Option<usize> {
        let at = self.entries.iter().position(|h| h.group == group);
        let valid = at
            .and_then(|i| self.entries.get(i))
            .and_then(|h| {
                eligible
                    .iter()
                    .find(|e| e.slot == usize::from(h.slot) && e.incarnation == h.incarnation)
            })
            .copied();
        let home = match valid {
            Some(e) => e,
            None => {
                // Not counting this group's own old home, if any.
                let own = at.and_then(|i| self.entries.get(i)).copied();
                let homed: Vec<(f64, f64)> = eligible
                    .iter()
                    .map(|e| self.homed_here(e, own, now_ms, half_life_ms))
                    .collect();
                let least = homed.iter().map(|h| h.0).fold(f64::INFINITY, f64::min);
                // Equal within a tenth of a request or, with `fewest_groups`, within the noise
                // of the difference of two counts of requests (the square root of their sum).
                let near = |h: &(f64, f64)| {
                    let noise = if placement.fewest_groups {
                        (h.0 + least).max(0.0).sqrt()
                    } else {
                        0.0
                    };
                    h.0 - least <= noise.max(0.1)
                };
                let fewest = homed
                    .iter()
                    .filter(|h| near(h))
                    .map(|h| h.1)
                    .fold(f64::INFINITY, f64::min);
                // Among those, with `fewest_groups`, the fewest groups (within half of one);
                // then the scoring's choice decides.
                let equal =
                    |h: &(f64, f64)| near(h) && (!placement.fewest_groups || h.1 <= fewest + 0.5);
                let among = || {
                    eligible
                        .iter()
                        .zip(&homed)
                        .filter(|(_, h)| equal(h))
                        .map(|(e, _)| e)
                };
                *among()
                    .find(|e| e.slot == preferred)
                    .or_else(|| among().next())?
            }
        };
        let slot = u16::try_from(home.slot).ok()?;
        match at.and_then(|i| self.entries.get_mut(i)) {
            Some(h) => {
                h.rate = (h.rate_at(now_ms, half_life_ms) + 1.0) as f32;
                h.seen_ms = h.seen_ms.max(now_ms);
                h.slot = slot;
                h.incarnation = home.incarnation;
            }
            None => {
                if self.entries.len() >= placement.capacity.max(1)
                    && let Some(oldest) = self
                        .entries
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, h)| h.seen_ms)
                        .map(|(i, _)| i)
                {
                    self.entries.swap_remove(oldest);
                }
                self.entries.push(Home {
                    group,
                    slot,
                    incarnation: home.incarnation,
                    rate: 1.0,
                    seen_ms: now_ms,
                });
            }
        }
        Some(home.slot)
    }

    /// Moves `group`'s home to the worker with the least homed rate per unit of speed when its
    /// home carries more than `rule.above` times its fair part (the eligible workers' homed
    /// rate shared in proportion to their speeds; with equal speeds, the mean), and the move
    /// leaves that worker no busier per unit of speed than the home it left (with equal
    /// speeds: the group's rate is at most half the difference) or, with unequal speeds, not
    /// above that bound, so the group does not move back at its next request. Nothing moves before the table has seen `rule.min_total`
    /// requests (decayed). Returns the group's home afterwards (None for a group the table
    /// does not hold).
    ///
    /// A group gets its home at first sight, before its popularity is known: at start-up all
    /// groups arrive within a second, and 4 of 6 groups could share one of 2 workers and
    /// bring it 4 in 5 requests. With 2 workers the in-flight bound of `goes_home` never binds
    /// (twice the mean is every request in flight), so nothing else corrects that split. The
    /// same start-up places homes before any worker's speed is known.
    pub fn rebalance(
        &mut self,
        group: u64,
        eligible: &[Eligible],
        now_ms: u64,
        half_life_ms: u64,
        rule: Rebalance,
    ) -> Option<usize> {
        let at = self.entries.iter().position(|h| h.group == group)?;
        let own = *self.entries.get(at)?;
        let home = usize::from(own.slot);
        if rule.above <= 0.0 || eligible.len() < 2 {
            return Some(home);
        }
        // One pass: each group's decayed rate once, into the total and its worker's sum
        // (this runs at every request with a preamble, over up to 256 groups).
        let mut rates: Vec<(Eligible, f64)> = eligible.iter().map(|e| (*e, 0.0)).collect();
        let mut total = 0.0;
        for h in &self.entries {
            let r = h.rate_at(now_ms, half_life_ms);
            total += r;
            if let Some(w) = rates
                .iter_mut()
                .find(|(e, _)| e.slot == usize::from(h.slot))
            {
                w.1 += r;
            }
        }
        if total < rule.min_total {
            return Some(home);
        }
        let speed = Eligible::counted_speed;
        let homed: f64 = rates.iter().map(|(_, r)| r).sum();
        let speeds: f64 = rates.iter().map(|(e, _)| speed(e)).sum();
        let (Some(&(at_home_worker, at_home)), Some(&(least, at_least))) = (
            rates.iter().find(|(e, _)| e.slot == home),
            rates
                .iter()
                .min_by(|a, b| (a.1 / speed(&a.0)).total_cmp(&(b.1 / speed(&b.0)))),
        ) else {
            return Some(home);
        };
        let (home_speed, least_speed) = (speed(&at_home_worker), speed(&least));
        let fair = homed / speeds;
        let rate = own.rate_at(now_ms, half_life_ms);
        // After the move, per unit of speed: the worker it goes to, and the most it may carry.
        // With unequal speeds a group's rate is a coarse step (4 groups on a fast and a slow
        // worker: 2 and 2, or 3 and 1), so the worker it goes to may end up busier than the
        // home it left, within the bound that would move a group off it.
        let there = (at_least + rate) / least_speed;
        let left = (at_home - rate) / home_speed;
        let unequal = rates.iter().any(|(e, _)| speed(e) < 1.0);
        let limit = if unequal {
            left.max(rule.above * fair)
        } else {
            left
        };
        if least.slot == home || at_home / home_speed <= rule.above * fair || there > limit {
            return Some(home);
        }
        let slot = u16::try_from(least.slot).ok()?;
        if let Some(h) = self.entries.get_mut(at) {
            h.slot = slot;
            h.incarnation = least.incarnation;
        }
        Some(least.slot)
    }
}

/// `own` over `total`, 0 when there is no traffic. A group's share of the traffic is its rate
/// over every group's ([`Homes::rates`]), counted over at least some minimum total where the
/// first groups seen must not look like all of the traffic: `share_of(own, total.max(min))`.
pub fn share_of(own: f64, total: f64) -> f64 {
    if total > 0.0 { own / total } else { 0.0 }
}

/// How [`Homes::visit`] chooses a home for a group it has none for, and how many groups the
/// table keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Groups kept, the least recently seen forgotten first.
    pub capacity: usize,
    /// Among the workers whose homed rate is within its noise of the least (a difference of
    /// two counts of requests within the square root of their sum, or a tenth of a request),
    /// the one with the fewest groups homed, each counted up to 1 by its rate
    /// (`scoring.home_fewest_groups`). Otherwise the least homed rate within a tenth of a
    /// request. At start-up every user's first request arrives at once, and the groups' first
    /// requests count who happened to start with which prompt: by them alone, 4 of 6 groups
    /// went to one of 2 workers.
    pub fewest_groups: bool,
}

/// When [`Homes::rebalance`] moves a group's home.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rebalance {
    /// The home's homed rate over the eligible workers' mean above which a group may move
    /// (0 = never).
    pub above: f64,
    /// Requests (decayed) the table must have seen first.
    pub min_total: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Homes {
        /// `group`'s share over at least `min_total` requests, as the router counts it.
        fn share(&self, group: u64, now_ms: u64, half_life_ms: u64, min_total: f64) -> f64 {
            let (own, total) = self.rates(group, now_ms, half_life_ms);
            share_of(own, total.max(min_total))
        }
    }

    /// The least homed rate decides; 64 groups kept.
    const BY_RATE: Placement = Placement {
        capacity: 64,
        fewest_groups: false,
    };

    fn workers(n: usize) -> Vec<Eligible> {
        (0..n)
            .map(|slot| Eligible {
                slot,
                incarnation: 0,
                speed: 1.0,
            })
            .collect()
    }

    #[test]
    fn a_group_keeps_its_home_and_new_groups_go_where_the_least_traffic_is_homed() {
        let mut homes = Homes::default();
        let w = workers(2);
        // The first group: nothing is homed anywhere, the scoring's choice (1) decides.
        assert_eq!(homes.visit(7, &w, 1, 0, 60_000, BY_RATE), Some(1));
        for t in 1..10 {
            assert_eq!(homes.visit(7, &w, 0, t, 60_000, BY_RATE), Some(1), "stays");
        }
        // A second group goes to the worker without traffic, whatever the scoring prefers.
        assert_eq!(homes.visit(8, &w, 1, 20, 60_000, BY_RATE), Some(0));
        // A third: worker 0 has 1 request homed, worker 1 has 10.
        assert_eq!(homes.visit(9, &w, 1, 30, 60_000, BY_RATE), Some(0));
        let back = Homes::decode(&homes.encode());
        assert_eq!(back, homes);
        assert!((back.homed_here(&w[1], None, 30, 60_000).0 - 10.0).abs() < 0.01);
    }

    /// The start-up burst of tight-256, 2 workers, seed 138 (docs/BENCHMARKS.md, fifty-first
    /// run): 8 users' first requests at once, three of them with group 3's prompt.
    fn start_up_burst(placement: Placement) -> Homes {
        let mut homes = Homes::default();
        let w = workers(2);
        for (t, (group, preferred)) in [
            (3, 0),
            (1, 1),
            (4, 1),
            (5, 0),
            (5, 0),
            (4, 1),
            (3, 0),
            (3, 0),
        ]
        .into_iter()
        .enumerate()
        {
            homes.visit(group, &w, preferred, t as u64, 60_000, placement);
        }
        homes
    }

    #[test]
    fn with_fewest_groups_a_start_up_burst_does_not_decide_the_split() {
        let groups_on =
            |homes: &Homes, slot: u16| homes.entries.iter().filter(|h| h.slot == slot).count();
        // By rate: worker 0 has 5 requests homed (groups 3 and 5), worker 1 has 3 (1 and 4),
        // so the next two groups go to worker 1, whatever the scoring prefers: 2 groups
        // against 4.
        let mut by_rate = start_up_burst(BY_RATE);
        let w = workers(2);
        assert_eq!(by_rate.visit(2, &w, 0, 230, 60_000, BY_RATE), Some(1));
        assert_eq!(by_rate.visit(0, &w, 0, 270, 60_000, BY_RATE), Some(1));
        assert_eq!((groups_on(&by_rate, 0), groups_on(&by_rate, 1)), (2, 4));
        // With fewest groups: 5 against 3 requests is within the noise (√8), so the groups
        // decide, and when they are equal the scoring's choice: 3 groups each.
        let fewest = Placement {
            capacity: 64,
            fewest_groups: true,
        };
        let mut by_groups = start_up_burst(fewest);
        assert_eq!(
            by_groups.visit(2, &w, 0, 230, 60_000, fewest),
            Some(0),
            "scoring's choice"
        );
        assert_eq!(
            by_groups.visit(0, &w, 0, 270, 60_000, fewest),
            Some(1),
            "fewer groups"
        );
        assert_eq!((groups_on(&by_groups, 0), groups_on(&by_groups, 1)), (3, 3));
        // A difference beyond the noise still decides: with 30 more requests of group 3 on
        // worker 0 (35 against 3), a new group goes to worker 1, which has more groups.
        for t in 0..30 {
            by_groups.visit(3, &w, 0, 300 + t, 60_000, fewest);
        }
        assert_eq!(by_groups.visit(9, &w, 0, 400, 60_000, fewest), Some(1));
        // A group not seen for many half-lives no longer counts as one.
        let mut old = Homes::default();
        old.visit(1, &w, 0, 0, 1_000, fewest);
        old.visit(2, &w, 0, 0, 1_000, fewest);
        old.visit(3, &w, 1, 20_000, 1_000, fewest);
        assert_eq!(old.visit(4, &w, 1, 20_000, 1_000, fewest), Some(0));
    }

    #[test]
    fn a_groups_share_is_its_recent_requests_over_every_groups() {
        let mut homes = Homes::default();
        let w = workers(2);
        assert_eq!(
            homes.share(7, 0, 60_000, 0.0),
            0.0,
            "unknown group, empty table"
        );
        homes.visit(7, &w, 0, 0, 60_000, BY_RATE);
        assert_eq!(homes.share(7, 0, 60_000, 0.0), 1.0, "the only group");
        for t in 0..3 {
            homes.visit(8, &w, 0, t, 60_000, BY_RATE);
        }
        assert!((homes.share(7, 3, 60_000, 0.0) - 0.25).abs() < 0.001);
        assert!((homes.share(8, 3, 60_000, 0.0) - 0.75).abs() < 0.001);
        // A minute later, 7's one request counts half as much; so do 8's three.
        homes.visit(7, &w, 0, 60_003, 60_000, BY_RATE);
        let share = homes.share(7, 60_003, 60_000, 0.0);
        assert!((share - 1.5 / 3.0).abs() < 0.01, "{share}");
        // Over at least 8 requests: the table has seen 3 (decayed), so 7's 1.5 count as 1.5/8.
        let share = homes.share(7, 60_003, 60_000, 8.0);
        assert!((share - 1.5 / 8.0).abs() < 0.01, "{share}");
        assert!((homes.share(7, 60_003, 60_000, 2.0) - 0.5).abs() < 0.01);
    }

    #[test]
    fn a_home_that_left_or_was_replaced_is_chosen_again() {
        let mut homes = Homes::default();
        let w = workers(3);
        assert_eq!(homes.visit(7, &w, 2, 0, 60_000, BY_RATE), Some(2));
        // Worker 2 is no longer eligible: worker 0 or 1, the scoring's choice among equals.
        assert_eq!(homes.visit(7, &w[..2], 1, 1, 60_000, BY_RATE), Some(1));
        // Slot 1 now holds another worker (a new incarnation): chosen again.
        let replaced = [
            w[0],
            Eligible {
                slot: 1,
                incarnation: 1,
                speed: 1.0,
            },
        ];
        assert_eq!(homes.visit(7, &replaced, 0, 2, 60_000, BY_RATE), Some(0));
        assert_eq!(homes.entries.len(), 1);
        assert_eq!(homes.visit(7, &[], 0, 3, 60_000, BY_RATE), None);
    }

    /// The ninety-first run (docs/BENCHMARKS.md): 2 workers, one at 0.4 times the other's
    /// speed; placed by groups alone, the slow one got as many groups as the fast one and a
    /// queue that grew for the whole run.
    #[test]
    fn a_slower_worker_is_the_least_homed_with_less_traffic() {
        let fewest = Placement {
            capacity: 64,
            fewest_groups: true,
        };
        let speeds = Eligible::relative_speeds(&[20_000.0, 8_000.0], 0.0);
        assert_eq!(speeds, vec![1.0, 0.4]);
        let w: Vec<Eligible> = workers(2)
            .into_iter()
            .zip(&speeds)
            .map(|(e, &speed)| Eligible { speed, ..e })
            .collect();
        // Ten groups, one request each, the scoring preferring the slow worker every time.
        let mut homes = Homes::default();
        let on: Vec<usize> = (0..10u64)
            .filter_map(|g| homes.visit(g, &w, 1, g, 60_000, fewest))
            .collect();
        let slow = on.iter().filter(|&&s| s == 1).count();
        // 1 group on the slow worker weighs 2.5: it gets the 2nd, the 5th and the 10th
        // group or so, not every other one.
        assert!((2..=4).contains(&slow), "{on:?}");
        // The same workers at equal speed split the groups evenly.
        let mut even = Homes::default();
        let on: Vec<usize> = (0..10u64)
            .filter_map(|g| even.visit(g, &workers(2), 1, g, 60_000, fewest))
            .collect();
        assert_eq!(on.iter().filter(|&&s| s == 1).count(), 5, "{on:?}");
        // By rate alone: 5 requests homed on the slow worker count as 12.5 on the fast one.
        let mut by_rate = Homes::default();
        for t in 0..5 {
            assert_eq!(by_rate.visit(1, &w, 1, t, 60_000, BY_RATE), Some(1));
        }
        // A second group goes to the fast worker and brings it 12 requests: still the less
        // homed, so a third group goes there too.
        for t in 5..17 {
            assert_eq!(by_rate.visit(2, &w, 1, t, 60_000, BY_RATE), Some(0));
        }
        assert_eq!(by_rate.visit(3, &w, 1, 17, 60_000, BY_RATE), Some(0));
        // 13 against 12.5: the next group goes to the slow worker, whatever the scoring
        // prefers.
        assert_eq!(by_rate.visit(4, &w, 0, 18, 60_000, BY_RATE), Some(1));
    }

    #[test]
    fn relative_speeds_count_unknown_as_the_fastest_and_a_band_as_equal() {
        assert_eq!(
            Eligible::relative_speeds(&[0.0, f64::NAN, -1.0], 0.0),
            vec![1.0, 1.0, 1.0]
        );
        assert_eq!(
            Eligible::relative_speeds(&[10.0, 0.0, 5.0, 0.01], 0.0),
            vec![1.0, 1.0, 0.5, 0.01]
        );
        // Within 25% of the fastest counts as equal; below it, the ratio.
        assert_eq!(
            Eligible::relative_speeds(&[10.0, 8.0, 7.0], 0.25),
            vec![1.0, 1.0, 0.7]
        );
        assert_eq!(Eligible::relative_speeds(&[], 0.25), Vec::<f64>::new());
    }

    #[test]
    fn the_table_keeps_the_most_recently_seen_groups_and_bad_bytes_decode_empty() {
        let mut homes = Homes::default();
        let w = workers(2);
        for g in 0..10u64 {
            homes.visit(
                g,
                &w,
                0,
                g * 10,
                60_000,
                Placement {
                    capacity: 4,
                    ..BY_RATE
                },
            );
        }
        let mut groups: Vec<u64> = homes.entries.iter().map(|h| h.group).collect();
        groups.sort();
        assert_eq!(groups, vec![6, 7, 8, 9]);
        let bytes = homes.encode();
        for cut in 0..bytes.len() {
            assert_eq!(
                Homes::decode(&bytes[..cut]),
                Homes::default(),
                "cut at {cut}"
            );
        }
        assert_eq!(Homes::decode(&[2, 0, 0]), Homes::default());
    }

    /// Groups with these rates (decayed to `seen_ms` 0) homed on these slots.
    fn table(groups: &[(u64, u16, f32)]) -> Homes {
        Homes {
            entries: groups
                .iter()
                .map(|&(group, slot, rate)| Home {
                    group,
                    slot,
                    incarnation: 0,
                    rate,
                    seen_ms: 0,
                })
                .collect(),
        }
    }

    const MOVE: Rebalance = Rebalance {
        above: 1.25,
        min_total: 8.0,
    };

    #[test]
    fn a_group_moves_off_a_home_with_far_more_than_the_mean_to_the_least_homed_worker() {
        // Worker 0 carries 21 of 25 recent requests (mean 12.5; 1.25 × 12.5 = 15.6).
        let mut homes = table(&[(1, 0, 10.0), (2, 0, 6.0), (3, 0, 5.0), (4, 1, 4.0)]);
        let w = workers(2);
        // Group 2 (6) is at most half the difference (8.5): it moves, 15 against 10 after.
        assert_eq!(homes.rebalance(2, &w, 0, 60_000, MOVE), Some(1));
        assert_eq!(homes.entries[1].slot, 1);
        // Now worker 0 has 15, within 1.25 × the mean: group 3 stays.
        assert_eq!(homes.rebalance(3, &w, 0, 60_000, MOVE), Some(0));
        // And group 2 does not move back: worker 1 is below the mean.
        assert_eq!(homes.rebalance(2, &w, 0, 60_000, MOVE), Some(1));
        // Over three workers the least homed one takes it.
        let mut homes = table(&[(1, 0, 10.0), (2, 0, 6.0), (4, 1, 4.0), (5, 2, 1.0)]);
        assert_eq!(homes.rebalance(2, &workers(3), 0, 60_000, MOVE), Some(2));
    }

    #[test]
    fn a_group_does_not_move_where_it_would_overshoot_or_before_the_table_has_seen_enough() {
        let w = workers(2);
        // Group 1 (10) is more than half the difference (21 − 4 = 17): moving it would
        // leave worker 1 the busier (14 against 11), and it would move back.
        let mut homes = table(&[(1, 0, 10.0), (2, 0, 6.0), (3, 0, 5.0), (4, 1, 4.0)]);
        assert_eq!(homes.rebalance(1, &w, 0, 60_000, MOVE), Some(0));
        // A group alone on its home never moves.
        let mut homes = table(&[(1, 0, 20.0), (4, 1, 1.0)]);
        assert_eq!(homes.rebalance(1, &w, 0, 60_000, MOVE), Some(0));
        // Too little traffic seen (25 < 30), or the rule off: nothing moves.
        let mut homes = table(&[(1, 0, 10.0), (2, 0, 6.0), (3, 0, 5.0), (4, 1, 4.0)]);
        let early = Rebalance {
            min_total: 30.0,
            ..MOVE
        };
        assert_eq!(homes.rebalance(2, &w, 0, 60_000, early), Some(0));
        let off = Rebalance { above: 0.0, ..MOVE };
        assert_eq!(homes.rebalance(2, &w, 0, 60_000, off), Some(0));
        // One eligible worker, or a group the table does not hold.
        assert_eq!(homes.rebalance(2, &w[..1], 0, 60_000, MOVE), Some(0));
        assert_eq!(homes.rebalance(99, &w, 0, 60_000, MOVE), None);
        assert_eq!(homes.entries[1].slot, 0);
    }

    #[test]
    fn with_unequal_speeds_a_group_moves_off_a_slow_home_with_more_than_its_share() {
        // 4 groups of equal rate placed 2 and 2 before the speeds were known; worker 1 runs at
        // 0.4 times worker 0's speed. Its fair part is 0.4 / 1.4 of the 16 requests (4.6);
        // it carries 8.
        let w = [
            Eligible {
                slot: 0,
                incarnation: 0,
                speed: 1.0,
            },
            Eligible {
                slot: 1,
                incarnation: 0,
                speed: 0.4,
            },
        ];
        let mut homes = table(&[(1, 0, 4.0), (2, 0, 4.0), (3, 1, 4.0), (4, 1, 4.0)]);
        // A group on the fast worker stays.
        assert_eq!(homes.rebalance(1, &w, 0, 60_000, MOVE), Some(0));
        // One on the slow worker moves: the fast one carries 12 after it, more than the slow
        // one's 10 per unit of speed, within 1.25 × 11.4.
        assert_eq!(homes.rebalance(3, &w, 0, 60_000, MOVE), Some(0));
        // The last one stays: the slow worker carries 10 per unit of speed, under the bound,
        // and nothing moves back.
        assert_eq!(homes.rebalance(4, &w, 0, 60_000, MOVE), Some(1));
        assert_eq!(homes.rebalance(3, &w, 0, 60_000, MOVE), Some(0));
        // At equal speeds the same table is balanced.
        let mut even = table(&[(1, 0, 4.0), (2, 0, 4.0), (3, 1, 4.0), (4, 1, 4.0)]);
        assert_eq!(even.rebalance(3, &workers(2), 0, 60_000, MOVE), Some(1));
    }

    #[test]
    fn effective_groups_count_groups_by_their_traffic() {
        assert_eq!(Homes::default().effective_groups(0, 1000), 0.0);
        let equal = table(&[(1, 0, 2.0), (2, 1, 2.0), (3, 0, 2.0)]);
        assert!((equal.effective_groups(0, 0) - 3.0).abs() < 1e-9);
        // One group with 90% of the traffic and five with 2% each: about 1.2.
        let hot = table(&[
            (1, 0, 90.0),
            (2, 1, 2.0),
            (3, 1, 2.0),
            (4, 1, 2.0),
            (5, 1, 2.0),
            (6, 1, 2.0),
        ]);
        let n = hot.effective_groups(0, 0);
        assert!((1.2..1.25).contains(&n), "{n}");
    }

    #[test]
    fn old_traffic_counts_less() {
        let mut homes = Homes::default();
        let w = workers(2);
        for t in 0..8 {
            homes.visit(1, &w, 0, t, 1_000, BY_RATE);
        }
        // Four half-lives later group 1's 8 requests weigh 0.5: a group seen twice since
        // on worker 1 outweighs it.
        homes.visit(2, &w, 1, 4_000, 1_000, BY_RATE);
        homes.visit(2, &w, 1, 4_000, 1_000, BY_RATE);
        assert_eq!(homes.visit(3, &w, 1, 4_000, 1_000, BY_RATE), Some(0));
    }
}
