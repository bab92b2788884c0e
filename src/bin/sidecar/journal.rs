//! The bounded log of image-residency changes behind `/v1/feed` deltas.
//!
//! Entry `i` (from 1) has cursor `base + i`; the journal's cursor is the last entry's. A
//! poller at cursor `c` has seen every change up to `c` and needs `c + 1 ..= cursor`, which
//! the journal can give while `c + 1` is still held and `c` is not in the future. Cursors
//! start at a random base per sidecar start (between 2^32 and 2^62), so a cursor from another
//! run falls outside the window and gets a snapshot. When full, the oldest entry goes.
//! Memory: 32 bytes per entry (worker name pointer and length, image key, block count), so
//! the default 65,536 entries take 2 MiB.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// One change: `worker` now holds `blocks` blocks carrying `image`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub worker: Arc<str>,
    pub image: u64,
    pub blocks: u32,
}

pub struct Journal {
    /// The cursor before the first held entry.
    base: u64,
    entries: VecDeque<Change>,
    cap: usize,
}

impl Journal {
    pub fn new(base: u64, cap: usize) -> Journal {
        Journal {
            base,
            entries: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    /// The cursor of the last change (the base when none was written).
    pub fn cursor(&self) -> u64 {
        self.base + self.entries.len() as u64
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The oldest cursor a delta can start from.
    pub fn oldest(&self) -> u64 {
        self.base
    }

    pub fn push(&mut self, change: Change) {
        if self.entries.len() == self.cap {
            self.entries.pop_front();
            self.base += 1;
        }
        self.entries.push_back(change);
    }

    /// The changes after `since`, the last one per (worker, image), in cursor order of that
    /// last change; `None` when `since` is older than the journal or newer than its cursor.
    pub fn since(&self, since: u64) -> Option<Vec<&Change>> {
        if since < self.base || since > self.cursor() {
            return None;
        }
        let skip = usize::try_from(since - self.base).ok()?;
        let mut last: HashMap<(&str, u64), usize> = HashMap::new();
        let tail: Vec<&Change> = self.entries.iter().skip(skip).collect();
        for (i, c) in tail.iter().enumerate() {
            last.insert((&c.worker, c.image), i);
        }
        let mut keep: Vec<usize> = last.into_values().collect();
        keep.sort_unstable();
        Some(
            keep.into_iter()
                .filter_map(|i| tail.get(i).copied())
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(w: &str, image: u64, blocks: u32) -> Change {
        Change {
            worker: w.into(),
            image,
            blocks,
        }
    }

    #[test]
    fn deltas_keep_the_last_change_per_worker_and_image() {
        let mut j = Journal::new(1000, 10);
        assert_eq!(j.cursor(), 1000);
        assert_eq!(j.since(1000), Some(vec![]));
        j.push(ch("a", 1, 3));
        j.push(ch("b", 1, 1));
        j.push(ch("a", 1, 0));
        j.push(ch("a", 2, 5));
        assert_eq!(j.cursor(), 1004);
        let d = j.since(1000).unwrap();
        assert_eq!(d, vec![&ch("b", 1, 1), &ch("a", 1, 0), &ch("a", 2, 5)]);
        let d = j.since(1003).unwrap();
        assert_eq!(d, vec![&ch("a", 2, 5)]);
        assert_eq!(j.since(1004), Some(vec![]));
    }

    #[test]
    fn cursors_outside_the_window_get_none() {
        let mut j = Journal::new(1000, 3);
        for i in 0..5 {
            j.push(ch("a", i, 1));
        }
        // Entries 1003..=1005 are held (cursors 1003, 1004, 1005); the base moved to 1002.
        assert_eq!(j.oldest(), 1002);
        assert_eq!(j.len(), 3);
        assert_eq!(j.since(1001), None, "1002 was dropped");
        assert_eq!(j.since(1002).unwrap().len(), 3);
        assert_eq!(j.since(1006), None, "from the future: another run");
        assert_eq!(j.since(0), None);
    }
}
