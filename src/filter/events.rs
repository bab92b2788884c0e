//! What the state writer's tick ([`super::poller`], [`super::feed_apply`]) reports for the
//! proxy-wasm shell to count and log: membership changes, polls, feed health, the lease.

/// Something the shell counts or logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// This VM took the writer lease.
    BecameWriter,
    Joined {
        name: String,
        address: String,
    },
    Left {
        name: String,
    },
    /// Decisions applied to the block buckets, and bucket writes.
    Drained {
        decisions: u64,
        buckets: u64,
    },
    /// A worker's `/metrics` poll: good or failed (with why); `transition` when it changed the
    /// worker's health (worth a log line; every poll is counted).
    Poll {
        name: String,
        ok: bool,
        why: Option<String>,
        transition: bool,
    },
    /// A feed poll: good, or failed with why.
    Feed {
        ok: bool,
        why: Option<String>,
    },
    /// Routing switched between precise (feed fresh) and approximate.
    Precise(bool),
}

/// Events for a membership change.
pub(super) fn membership_events(
    change: crate::state::writer::MembershipChange,
    desired: &[(String, String)],
) -> Vec<Event> {
    let mut events = Vec::new();
    for (_, name) in change.left {
        events.push(Event::Left { name });
    }
    for (_, name) in change.joined {
        let address = desired
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, a)| a.clone())
            .unwrap_or_default();
        events.push(Event::Joined { name, address });
    }
    events
}
