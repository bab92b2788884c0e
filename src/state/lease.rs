//! The state writer's lease (`<ns>.lease`): one VM per process holds it, so one VM writes the
//! buckets and worker tables, polls the sidecar or the workers, and drains the decisions.
//!
//! Value: holder id (u64) and expiry (u64 ms since the epoch). A VM takes the lease when it is
//! free, expired, or already its own, with a CAS write, and renews it on its tick; a holder
//! that stops renewing (its VM trapped, was reloaded, or its thread is stuck) loses it to the
//! next VM whose tick comes after the expiry.

use super::SharedStore;
use super::wire::Reader;

/// Takes or renews the lease at `key` for `holder` until `now_ms + ttl_ms`. True when this
/// holder has it.
pub fn try_lease(
    store: &dyn SharedStore,
    key: &str,
    holder: u64,
    now_ms: u64,
    ttl_ms: u64,
) -> bool {
    let (current, cas) = match store.get(key) {
        Ok(Some((bytes, cas))) => (bytes, Some(cas)),
        Ok(None) => (Vec::new(), None),
        Err(_) => return false,
    };
    let mut r = Reader::new(&current);
    if let (Some(owner), Some(expiry)) = (r.u64(), r.u64())
        && owner != holder
        && expiry > now_ms
    {
        return false;
    }
    let mut value = holder.to_le_bytes().to_vec();
    value.extend_from_slice(&now_ms.saturating_add(ttl_ms).to_le_bytes());
    store.set(key, &value, cas).is_ok()
}

/// The current holder and expiry, if any.
pub fn holder(store: &dyn SharedStore, key: &str) -> Option<(u64, u64)> {
    let bytes = store.get(key).ok()??.0;
    let mut r = Reader::new(&bytes);
    Some((r.u64()?, r.u64()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::MemoryStore;

    #[test]
    fn one_holder_until_it_stops_renewing() {
        let s = MemoryStore::default();
        assert!(try_lease(&s, "l", 1, 1000, 300));
        assert!(!try_lease(&s, "l", 2, 1100, 300), "held by 1");
        assert!(try_lease(&s, "l", 1, 1200, 300), "renewed");
        assert!(!try_lease(&s, "l", 2, 1499, 300));
        assert!(try_lease(&s, "l", 2, 1501, 300), "expired: taken over");
        assert_eq!(holder(&s, "l"), Some((2, 1801)));
    }
}
