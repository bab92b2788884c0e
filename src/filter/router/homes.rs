//! `scoring.home_hold`: a request group (the requests that share a preamble, such as one
//! system prompt) is kept on its home worker where the request would otherwise recompute the
//! preamble (docs/ROUTING.md, "Homes for groups").

use super::Router;
use super::decision::{HomeHold, LetGo, PastBound};
use crate::scoring::{
    Candidate, Choice, ScoringConfig, allowed_wait, bounds_lifted, copy_fits, goes_home,
    home_holds_its_footprint, home_load, home_saves_preamble, home_spare_load,
    home_wait_pays_for_preamble, slower_than_choice, unlifted, wait_past_a_copy_that_fits,
};
use crate::state::blocks::holders_of;
use crate::state::homes::{Eligible, Homes, Placement, Rebalance, share_of};
use crate::state::workers::{Live, LiveTable};
use crate::state::{SharedStore, cas_update};

/// Groups the homes table keeps (`scoring.home_hold`): about 23 bytes each, so one read of
/// the table copies at most 6 KiB.
const HOME_GROUPS: usize = 256;

/// With `scoring.home_speed_weighted`, speeds within this fraction of the fastest worker's
/// count as equal: a prefill speed measured from the engine's counters moves with what the
/// worker happened to run. In the ninety-sixth run the slowest of equal workers read 0.72-0.99
/// times the fastest's speed with 2 workers, and 0.43-0.94 with 4 and 8 (image-heavy requests
/// read slower: the encoder's time is in the prefill time), which no band separates from a
/// slower GPU. Measured by the probes' peak (counted from the eighth probe), equal
/// workers after a warm-up still read 0.79 of each other (277th run, docs/BENCHMARKS.md), at
/// the edge of the 0.25 it was: half the fastest's speed and above counts as equal, so that
/// only a worker below half the fastest's speed (0.4 in the held-out `mixed-fleet`) is weighted.
const SPEED_BAND: f64 = 0.5;

/// With `scoring.home_speed_weighted` on a fleet of unequal speeds, a home moves when it carries
/// more than this many times its fair part of the homed traffic (its share of the fleet's
/// speed), where `scoring.home_rebalance_above` is off: the first groups' homes are placed
/// before any speed is known. The value measured for `home_rebalance_above`.
const SPEED_REBALANCE_ABOVE: f64 = 1.25;

/// What [`Router::hold_home`] did with a request of a group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum HomeOutcome {
    /// Sent to its home against the cost: within its load bound, or past it within the wait
    /// allowed (`scoring.home_spares_homes`).
    Held(HomeHold),
    /// Its lowest-cost worker would recompute the preamble and the home (this slot) was not
    /// held to, for this reason: what the decision log says.
    LetGo(usize, LetGo),
    /// No group, no home, or nothing to hold (the home is the choice, or the choice holds
    /// the preamble).
    Nothing,
}

impl Router {
    /// `scoring.home_hold`: counts the request in its group's home (the group is named by the
    /// key of the preamble's last block) and sends it there when [`goes_home`] says so.
    /// Says whether it changed the choice, and why not where the choice recomputes the
    /// preamble.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hold_home(
        &self,
        keys: &[u64],
        preamble_blocks: usize,
        live: &LiveTable,
        eligible: &[usize],
        candidates: &[Candidate],
        choice: &mut Choice,
        store: &dyn SharedStore,
        now_ms: u64,
    ) -> HomeOutcome {
        let preamble = preamble_blocks.min(keys.len());
        let Some(&group) = preamble.checked_sub(1).and_then(|i| keys.get(i)) else {
            return HomeOutcome::Nothing;
        };
        let scoring = &self.config.router.scoring;
        let mut workers: Vec<Eligible> = eligible
            .iter()
            .filter_map(|&slot| {
                live.get(slot).map(|l| Eligible {
                    slot,
                    incarnation: l.incarnation,
                    speed: 1.0,
                })
            })
            .collect();
        if scoring.home_speed_weighted {
            let measured: Vec<f64> = workers
                .iter()
                .map(|w| {
                    live.get(w.slot)
                        .and_then(Live::peak_prefill_tps)
                        .unwrap_or(0.0)
                })
                .collect();
            let relative = Eligible::relative_speeds(&measured, SPEED_BAND);
            for (w, speed) in workers.iter_mut().zip(relative) {
                w.speed = speed;
            }
        }
        let preferred = eligible.get(choice.index).copied().unwrap_or(usize::MAX);
        let half_life = scoring.footprint_half_life_ms;
        // Shares and moves count over at least `home_share_min_requests` per worker.
        let n = workers.len() as f64;
        let seen = scoring.home_share_min_requests * n;
        let unequal = workers.iter().any(|w| w.speed < 1.0);
        let above = if unequal && scoring.home_rebalance_above <= 0.0 {
            SPEED_REBALANCE_ABOVE
        } else {
            scoring.home_rebalance_above
        };
        let rule = Rebalance {
            above,
            min_total: seen,
        };
        let (mut home, mut table) = (None, Homes::default());
        cas_update(store, &self.keys.homes(), |bytes| {
            let mut homes = Homes::decode(bytes);
            let placement = Placement {
                capacity: HOME_GROUPS,
                fewest_groups: scoring.home_fewest_groups,
            };
            home = homes.visit(group, &workers, preferred, now_ms, half_life, placement);
            if home.is_some() {
                home = homes.rebalance(group, &workers, now_ms, half_life, rule);
            }
            let encoded = homes.encode();
            table = homes;
            Some(encoded)
        });
        let Some((slot, index, at_home)) = home.and_then(|h| {
            let index = eligible.iter().position(|&s| s == h)?;
            Some((h, index, candidates.get(index)?))
        }) else {
            return HomeOutcome::Nothing;
        };
        // The group's recent rate, every group's, and its shares of the traffic, counted over
        // at least `home_share_min_requests` per worker (at start-up the first group seen is
        // all of the traffic): one pass over the table.
        let rates = || {
            let (own, total) = table.rates(group, now_ms, half_life);
            (own, total, share_of(own, total.max(seen)) * n)
        };
        // `load_bounds_lift_max_shares`: a group of more shares keeps its home's load bound
        // where the lift would lift it: one worker cannot carry it without queueing past the
        // mean, and only the bound spreads it.
        // Counted only where the bounds are lifted now: it decays every group's rate.
        let early = (scoring.load_bounds_lift_max_shares > 0.0
            && bounds_lifted(candidates, scoring))
        .then(rates);
        let keeps_bound = match early {
            Some((_, _, shares)) => shares > scoring.load_bounds_lift_max_shares,
            None => false,
        } || (bounds_lifted(candidates, scoring)
            && ((scoring.load_bounds_lift_unless_copy_fits
                && copy_fits(choice, candidates, scoring))
                || slower_than_choice(choice, candidates, index, scoring)));
        let kept;
        let scoring = if keeps_bound {
            kept = unlifted(scoring);
            &kept
        } else {
            scoring
        };
        let mut past_bound = None;
        if !goes_home(choice, candidates, index, preamble, scoring) {
            if !home_saves_preamble(choice, candidates, index, preamble) {
                return HomeOutcome::Nothing;
            }
            let loosened = loosened_by_groups(scoring, &table, n, now_ms);
            let bounded = loosened.as_ref().unwrap_or(scoring);
            if !goes_home(choice, candidates, index, preamble, bounded) {
                let (carries, bound) = home_load(choice, candidates, at_home, bounded);
                // `home_spares_homes`: held past the bound where the choice is another
                // group's home, within `home_fit_load_factor` times the bound and the wait
                // allowed.
                let spared = scoring
                    .home_spares_homes
                    .then(|| {
                        let allowance = scoring.home_wait_allowance;
                        allowed_wait(choice, candidates, index, preamble, allowance, scoring)
                    })
                    .flatten()
                    .filter(|&(extra_s, allowed_s)| {
                        extra_s <= allowed_s
                            && carries <= home_spare_load(candidates, at_home, bounded).1
                            && self.choice_holds_another_home(
                                &table, group, eligible, live, choice, store,
                            )
                    });
                let Some(wait) = spared else {
                    return HomeOutcome::LetGo(slot, LetGo::LoadBound { carries, bound });
                };
                past_bound = Some(PastBound {
                    carries,
                    bound,
                    wait,
                });
            }
        }
        // Where the chosen worker's cache holds a copy of the preamble, the copy costs its
        // prefill once; a long queue at home costs the request its wait.
        if scoring.home_wait_applies(candidates.len())
            && let Some(past) = wait_past_a_copy_that_fits(
                choice,
                candidates,
                index,
                preamble,
                scoring.home_wait_allowance,
                scoring,
            )
        {
            return HomeOutcome::LetGo(slot, LetGo::Wait(past));
        }
        // A group with clearly more than one worker's share of the traffic (one application's
        // system prompt on every request, say) cannot keep to one worker whose cache turns
        // over: the cost spreads it. Up to `home_max_shares` (1.5) are held, so that groups of
        // about one share each (as many groups as workers) are not let go whenever their
        // recent rates wobble above it. A share counts over at least
        // `home_share_min_requests` per worker: at start-up the first group seen is all of
        // the traffic, and was let go at its second request. Past the limit, a group is
        // still held while its home's cache holds its footprint and it has at most
        // `home_fit_max_traffic` (0.5) of the traffic the table has seen (not counted over
        // that minimum, or every user's first request of one application would go to its
        // home at once): with 6 system prompts on 8 workers a popular one passes 1.5 shares,
        // and each first turn the cost sent to an idle worker copied its prompt there, for
        // nothing where caches hold the working set (with 2 or 3 workers half the traffic is
        // within 1.5 shares: no change). With `home_fit_lifts_share_limit` (on by default)
        // there is no share limit while the home's cache holds its footprint and its wait
        // costs less than the preamble's weighted recompute (docs/ROUTING.md). Checked last:
        // it decays every group's rate, and most requests stop at `goes_home`.
        let (own, total, shares) = early.unwrap_or_else(rates);
        if shares > scoring.home_max_shares {
            let fits = home_holds_its_footprint(choice, at_home, scoring);
            let within = fits && share_of(own, total) <= scoring.home_fit_max_traffic;
            let lifted = scoring.home_fit_lifts_share_limit
                && fits
                && home_wait_pays_for_preamble(choice, candidates, index, preamble, scoring);
            if !within && !lifted {
                return HomeOutcome::LetGo(slot, LetGo::ShareLimit { shares, fits });
            }
        }
        choice.prefer(index);
        match past_bound {
            Some(past) => HomeOutcome::Held(HomeHold::PastBound(past)),
            None => HomeOutcome::Held(HomeHold::Held),
        }
    }

    /// `scoring.home_spares_homes`: whether the cost's choice is the home of another group
    /// than `group` (in `table`) whose preamble its cache still holds, by the LRU model (the
    /// preamble's last block, the group's key, is the oldest of its blocks).
    fn choice_holds_another_home(
        &self,
        table: &Homes,
        group: u64,
        eligible: &[usize],
        live: &LiveTable,
        choice: &Choice,
        store: &dyn SharedStore,
    ) -> bool {
        let Some((slot, l)) = eligible
            .get(choice.index)
            .and_then(|&slot| Some((slot, live.get(slot)?)))
        else {
            return false;
        };
        let blocks = &self.config.state.blocks;
        let mut holders = Vec::new();
        table
            .entries
            .iter()
            .filter(|h| {
                h.group != group && usize::from(h.slot) == slot && h.incarnation == l.incarnation
            })
            .any(|h| {
                holders.clear();
                let bucket = self.keys.block_bucket(blocks.bucket_of(h.group));
                if let Ok(Some((bytes, _))) = store.get(&bucket) {
                    holders_of(&bytes, h.group, &mut holders);
                }
                holders
                    .iter()
                    .any(|x| usize::from(x.slot) == slot && l.holds(x.stamp))
            })
    }
}

/// `scoring.home_load_by_groups`: the scoring with `home_load_slack` times the groups per
/// eligible worker, where there are more groups than `workers`; None where the bound stays.
fn loosened_by_groups(
    scoring: &ScoringConfig,
    table: &Homes,
    workers: f64,
    now_ms: u64,
) -> Option<ScoringConfig> {
    if !scoring.home_load_by_groups || workers <= 0.0 {
        return None;
    }
    let per_worker = table.effective_groups(now_ms, scoring.footprint_half_life_ms) / workers;
    (per_worker > 1.0).then(|| ScoringConfig {
        home_load_slack: scoring.home_load_slack * per_worker,
        ..scoring.clone()
    })
}
