//! Precise mode: what of a worker's matched prefix its engine will still hold when it admits
//! the request: the blocks the prefill queued ahead of it will evict, and the images the
//! engine reported evicted.

use super::{Router, mean_known_speed};
use crate::analysis::Analysis;
use crate::identity::IdSource;
use crate::state::SharedStore;
use crate::state::images::resident_blocks;
use crate::state::load::Load;
use crate::state::lookup::{PrefixMatch, surviving_depth};
use crate::state::workers::LiveTable;
use std::collections::HashMap;

impl Router {
    /// Precise mode: a worker's match is what its engine will still hold when it admits the
    /// request, after allocating the blocks of the prefill queued before it (the router's
    /// queue clock, at the worker's speed). In approximate mode the router's own decisions
    /// moved the worker's allocation clock already.
    pub(super) fn cut_to_admission(
        &self,
        live: &LiveTable,
        loads: &[Load],
        eligible: &[usize],
        prefix: &mut PrefixMatch,
        now_us: u64,
    ) {
        let block = self.config.router.block_size.max(1) as f64;
        // A worker whose speed is not known yet drains its queue at the fleet's mean speed, as
        // in the cost (`route_analysis`); the configured default only when no speed is known.
        let unknown_tps = mean_known_speed(live, eligible)
            .unwrap_or(self.config.router.scoring.prefill_tokens_per_sec);
        for &s in eligible {
            let depth = prefix.depth(s);
            let (Some(l), Some(stamp)) =
                (live.get(s), prefix.deepest_stamps.get(s).copied().flatten())
            else {
                continue;
            };
            if depth == 0 {
                continue;
            }
            let speed = if l.prefill_tps > 0.0 {
                f64::from(l.prefill_tps)
            } else {
                unknown_tps
            };
            let load = loads.get(s).copied().unwrap_or_default();
            let queued_s = load.queued_us(now_us) as f64 / 1e6;
            let mut ahead_blocks = queued_s * speed / block;
            if self.config.router.scoring.admission_pending {
                // The requests admitted and still in prefill are on the queue clock but have
                // allocated their blocks already: what is left to allocate is at most what
                // the engine has not stored yet.
                ahead_blocks = ahead_blocks.min(f64::from(load.pending_blocks));
            }
            let ahead = ahead_blocks / f64::from(l.capacity.max(1));
            let first_age = prefix
                .first_stamps
                .get(s)
                .copied()
                .flatten()
                .map(|f| l.signed_age(f));
            let keep = surviving_depth(depth, first_age, l.signed_age(stamp), ahead);
            if let Some(d) = prefix.depths.get_mut(s) {
                *d = keep;
            }
        }
    }

    /// Precise mode: a worker's matched prefix stops at an image whose blocks its engine
    /// reported evicted. One image bucket read per image inside some worker's match.
    pub(super) fn cap_by_images(
        &self,
        analysis: &Analysis,
        live: &LiveTable,
        depths: &mut [usize],
        store: &dyn SharedStore,
    ) {
        let mut spans: HashMap<u32, (usize, usize)> = HashMap::new();
        for m in &analysis.layout.media {
            let e = spans
                .entry(m.media)
                .or_insert((m.block as usize, m.block as usize));
            e.0 = e.0.min(m.block as usize);
            e.1 = e.1.max(m.block as usize);
        }
        let deepest = depths.iter().copied().max().unwrap_or(0);
        for (media, (first, last)) in spans {
            if first >= deepest {
                continue;
            }
            let Some(report) = analysis.media.get(media as usize) else {
                continue;
            };
            if report.id.source == IdSource::Url {
                continue;
            }
            let image = report.id.key64();
            let bucket = self.config.state.images.bucket_of(image);
            let Ok(Some((bytes, _))) = store.get(&self.keys.image_bucket(bucket)) else {
                continue;
            };
            let span = last - first + 1;
            for (slot, depth) in depths.iter_mut().enumerate() {
                if *depth <= first {
                    continue;
                }
                let Some(l) = live.get(slot) else { continue };
                match resident_blocks(&bytes, image, slot as u16, l.incarnation) {
                    Some(0) => *depth = first,
                    // The engine evicts a sequence's tail first: the image's first blocks
                    // are the ones left (engine and router blocks are the same size, offset by
                    // at most one block).
                    Some(b) if (b as usize) + 1 < span => *depth = (*depth).min(first + b as usize),
                    _ => {}
                }
            }
        }
    }
}
