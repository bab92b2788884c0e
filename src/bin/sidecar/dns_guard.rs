//! `--dns-guard ADDR`: a DNS forwarder for the DNS cache of the filter's image fetches
//! (`envoy/render.py --fetch-dns-resolver ADDR`). It closes the gap of a name with several
//! addresses (docs/URL_IMAGES.md): Envoy's guard listener checks the first address of a name
//! with RBAC, but its dynamic forward proxy cluster tries the others when the first refuses
//! (happy eyeballs), so a name answering a public address and then 127.0.0.1 could be fetched
//! from 127.0.0.1.
//!
//! Every UDP query is forwarded to the upstream resolver as it is, and every answer is passed
//! back with one change: when it holds both addresses the filter may fetch from and
//! special-use addresses ([`is_special`], the ranges the filter and RBAC refuse) that no exact
//! address or CIDR entry of the allow-list holds, the special ones are dropped. The name then
//! resolves, in Envoy's cache, to its fetchable addresses only. An answer with only special
//! addresses passes unchanged: RBAC refuses the name with its own reason
//! (`resolved_special_address`). An answer this module cannot rewrite safely (a compressed
//! name pointing into a dropped record) becomes SERVFAIL: the fetch fails closed.

use mmrouter::filter::fetch::guard::{Cidr, HostMatch, HostPattern, is_special};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;
const HEADER: usize = 12;
/// An upstream that does not answer within this is a failed query (c-ares retries).
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest DNS message over UDP with EDNS0.
const MAX_MESSAGE: usize = 4096;

/// Counters for the sidecar's `/metrics`.
pub static QUERIES: AtomicU64 = AtomicU64::new(0);
pub static ANSWERS_FILTERED: AtomicU64 = AtomicU64::new(0);
pub static ADDRESSES_DROPPED: AtomicU64 = AtomicU64::new(0);
pub static FAILURES: AtomicU64 = AtomicU64::new(0);

/// Which addresses an answer may keep.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Policy {
    /// The exact address and CIDR entries of the allow-list (their ports are RBAC's to check).
    allowed: Vec<Cidr>,
}

impl Policy {
    /// From the filter's `fetch.allow` entries (comma-separated); names and wildcards are
    /// ignored here, only address entries allow a special-use address.
    pub fn from_allow(list: &str) -> Result<Policy, String> {
        let mut allowed = Vec::new();
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if let HostMatch::Addresses(c) = HostPattern::parse(entry)?.host {
                allowed.push(c);
            }
        }
        Ok(Policy { allowed })
    }

    fn fetchable(&self, ip: IpAddr) -> bool {
        !is_special(ip) || self.allowed.iter().any(|c| c.contains(ip))
    }
}

/// What [`filter_answer`] did with an answer.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// Passed as it came.
    Unchanged,
    /// Rewritten without `dropped` special-use addresses.
    Filtered { message: Vec<u8>, dropped: usize },
    /// Not a well-formed answer, or not safely rewritable: answer SERVFAIL.
    Refused(&'static str),
}

fn u16_at(m: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*m.get(at)?, *m.get(at + 1)?]))
}

/// Skips a (possibly compressed) name at `at`; returns the offset after it and the targets of
/// the compression pointers it holds.
fn skip_name(m: &[u8], mut at: usize, pointers: &mut Vec<usize>) -> Option<usize> {
    for _ in 0..128 {
        let len = *m.get(at)?;
        match len & 0xC0 {
            0x00 if len == 0 => return Some(at + 1),
            0x00 => at += 1 + usize::from(len),
            0xC0 => {
                pointers.push(usize::from(u16_at(m, at)? & 0x3FFF));
                return Some(at + 2);
            }
            _ => return None,
        }
    }
    None
}

struct Record {
    start: usize,
    end: usize,
    address: Option<IpAddr>,
    pointers: Vec<usize>,
}

/// Drops the special-use addresses of an answer that also holds fetchable ones (see the
/// module docs). Authority and additional records go with any rewrite: a resolver reads the
/// answer section only.
pub fn filter_answer(m: &[u8], policy: &Policy) -> Outcome {
    match try_filter(m, policy) {
        Some(o) => o,
        None => Outcome::Refused("malformed answer"),
    }
}

fn try_filter(m: &[u8], policy: &Policy) -> Option<Outcome> {
    let flags = u16_at(m, 2)?;
    if flags & 0x8000 == 0 {
        return Some(Outcome::Refused("not an answer"));
    }
    let questions = u16_at(m, 4)?;
    let answers = u16_at(m, 6)?;
    let mut at = HEADER;
    let mut ignored = Vec::new();
    for _ in 0..questions {
        at = skip_name(m, at, &mut ignored)? + 4;
    }
    let answers_start = at;
    let mut records = Vec::with_capacity(usize::from(answers));
    for _ in 0..answers {
        let start = at;
        let mut pointers = Vec::new();
        at = skip_name(m, at, &mut pointers)?;
        let kind = u16_at(m, at)?;
        let rdlen = usize::from(u16_at(m, at + 8)?);
        let rdata = at + 10;
        let end = rdata + rdlen;
        let bytes = m.get(rdata..end)?;
        let address = match kind {
            TYPE_A if bytes.len() == 4 => <[u8; 4]>::try_from(bytes).ok().map(IpAddr::from),
            TYPE_AAAA if bytes.len() == 16 => <[u8; 16]>::try_from(bytes).ok().map(IpAddr::from),
            _ => {
                // A name in the data (CNAME, ...) may be compressed too: scan it as one when
                // it parses as one; other data holds no pointer this module must keep valid.
                let mut inner = Vec::new();
                if skip_name(m, rdata, &mut inner) == Some(end) {
                    pointers.extend(inner);
                }
                None
            }
        };
        records.push(Record {
            start,
            end,
            address,
            pointers,
        });
        at = end;
    }
    // Each record's verdict once: an address the policy refuses is dropped.
    let drop: Vec<bool> = records
        .iter()
        .map(|r| r.address.is_some_and(|ip| !policy.fetchable(ip)))
        .collect();
    let dropped = drop.iter().filter(|&&d| d).count();
    let addresses = records.iter().filter(|r| r.address.is_some()).count();
    if dropped == 0 || dropped == addresses {
        return Some(Outcome::Unchanged);
    }
    let kept: Vec<&Record> = records
        .iter()
        .zip(&drop)
        .filter_map(|(r, &d)| (!d).then_some(r))
        .collect();
    // Offsets before the first dropped record do not move; a pointer past it would.
    let first_dropped = records
        .iter()
        .zip(&drop)
        .find_map(|(r, &d)| d.then_some(r.start))
        .unwrap_or(m.len());
    if kept
        .iter()
        .flat_map(|r| r.pointers.iter())
        .any(|&p| p >= first_dropped)
    {
        return Some(Outcome::Refused(
            "compressed name points into a dropped record",
        ));
    }
    let mut out = Vec::with_capacity(m.len());
    out.extend_from_slice(m.get(..answers_start)?);
    let count = u16::try_from(kept.len()).ok()?;
    out.get_mut(6..8)?.copy_from_slice(&count.to_be_bytes());
    out.get_mut(8..12)?.copy_from_slice(&[0, 0, 0, 0]);
    for r in kept {
        out.extend_from_slice(m.get(r.start..r.end)?);
    }
    Some(Outcome::Filtered {
        message: out,
        dropped,
    })
}

/// SERVFAIL for `query` (its id and question, no answer).
pub fn servfail(query: &[u8]) -> Vec<u8> {
    let mut ignored = Vec::new();
    let question_end = u16_at(query, 4)
        .filter(|&n| n == 1)
        .and_then(|_| skip_name(query, HEADER, &mut ignored))
        .map(|at| at + 4)
        .filter(|&end| end <= query.len());
    let (body, questions) = match question_end {
        Some(end) => (query.get(HEADER..end).unwrap_or(&[]), 1u8),
        None => (&[][..], 0u8),
    };
    let id = [*query.first().unwrap_or(&0), *query.get(1).unwrap_or(&0)];
    // QR, the query's RD bit, RA; RCODE 2 (server failure).
    let rd = query.get(2).map_or(0, |b| b & 0x01);
    let mut out = vec![
        id[0],
        id[1],
        0x80 | rd,
        0x82,
        0,
        questions,
        0,
        0,
        0,
        0,
        0,
        0,
    ];
    out.extend_from_slice(body);
    out
}

/// The first `nameserver` of /etc/resolv.conf, on port 53.
pub fn system_upstream() -> Option<SocketAddr> {
    let conf = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    conf.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .find_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
}

/// Serves the guard on `socket` until the task is aborted.
pub async fn serve(socket: tokio::net::UdpSocket, upstream: SocketAddr, policy: Policy) {
    let socket = Arc::new(socket);
    let policy = Arc::new(policy);
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let Ok((n, client)) = socket.recv_from(&mut buf).await else {
            continue;
        };
        QUERIES.fetch_add(1, Ordering::Relaxed);
        let query = buf.get(..n).unwrap_or(&[]).to_vec();
        let (socket, policy) = (socket.clone(), policy.clone());
        tokio::spawn(async move {
            let reply = answer(&query, upstream, &policy).await;
            let _ = socket.send_to(&reply, client).await;
        });
    }
}

async fn answer(query: &[u8], upstream: SocketAddr, policy: &Policy) -> Vec<u8> {
    let fail = |why: &str| {
        FAILURES.fetch_add(1, Ordering::Relaxed);
        crate::log!("dns guard: SERVFAIL ({why})");
        servfail(query)
    };
    let bind: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let Ok(socket) = tokio::net::UdpSocket::bind(bind).await else {
        return fail("no socket");
    };
    if socket.connect(upstream).await.is_err() || socket.send(query).await.is_err() {
        return fail("upstream unreachable");
    }
    let mut buf = vec![0u8; MAX_MESSAGE];
    let n = match tokio::time::timeout(UPSTREAM_TIMEOUT, socket.recv(&mut buf)).await {
        Ok(Ok(n)) => n,
        _ => return fail("upstream did not answer"),
    };
    let reply = buf.get(..n).unwrap_or(&[]);
    if reply.get(..2) != query.get(..2) {
        return fail("answer id differs");
    }
    match filter_answer(reply, policy) {
        Outcome::Unchanged => reply.to_vec(),
        Outcome::Filtered { message, dropped } => {
            ANSWERS_FILTERED.fetch_add(1, Ordering::Relaxed);
            ADDRESSES_DROPPED.fetch_add(dropped as u64, Ordering::Relaxed);
            crate::log!("dns guard: dropped {dropped} special-use address(es) from an answer");
            message
        }
        Outcome::Refused(why) => fail(why),
    }
}

/// The counters in Prometheus' text format.
pub fn prometheus() -> String {
    let mut out = String::new();
    for (name, help, v) in [
        (
            "mmrouter_sidecar_dns_guard_queries_total",
            "DNS queries the fetch DNS guard forwarded",
            &QUERIES,
        ),
        (
            "mmrouter_sidecar_dns_guard_answers_filtered_total",
            "answers from which special-use addresses were dropped",
            &ANSWERS_FILTERED,
        ),
        (
            "mmrouter_sidecar_dns_guard_addresses_dropped_total",
            "special-use addresses dropped from answers",
            &ADDRESSES_DROPPED,
        ),
        (
            "mmrouter_sidecar_dns_guard_failures_total",
            "queries answered SERVFAIL (upstream silent, or an answer not safely rewritable)",
            &FAILURES,
        ),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
            v.load(Ordering::Relaxed)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer to an A query for `name` with these addresses, every owner name a pointer to
    /// the question (as servers write them).
    fn answer_with(name: &str, addresses: &[IpAddr]) -> Vec<u8> {
        let mut m = vec![
            0x12,
            0x34,
            0x81,
            0x80,
            0,
            1,
            0,
            addresses.len() as u8,
            0,
            0,
            0,
            0,
        ];
        for label in name.split('.') {
            m.push(label.len() as u8);
            m.extend_from_slice(label.as_bytes());
        }
        m.extend_from_slice(&[0, 0, 1, 0, 1]);
        for a in addresses {
            let (kind, bytes) = match a {
                IpAddr::V4(v4) => (TYPE_A, v4.octets().to_vec()),
                IpAddr::V6(v6) => (TYPE_AAAA, v6.octets().to_vec()),
            };
            m.extend_from_slice(&[0xC0, 12]);
            m.extend_from_slice(&kind.to_be_bytes());
            m.extend_from_slice(&[0, 1, 0, 0, 0, 60]);
            m.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
            m.extend_from_slice(&bytes);
        }
        m
    }

    fn ips(s: &[&str]) -> Vec<IpAddr> {
        s.iter().map(|a| a.parse().unwrap()).collect()
    }

    /// The addresses of an answer, parsed back.
    fn addresses_of(m: &[u8]) -> Vec<IpAddr> {
        let mut ignored = Vec::new();
        let mut at = skip_name(m, HEADER, &mut ignored).unwrap() + 4;
        let mut out = Vec::new();
        for _ in 0..u16_at(m, 6).unwrap() {
            at = skip_name(m, at, &mut ignored).unwrap();
            let rdlen = usize::from(u16_at(m, at + 8).unwrap());
            let data = &m[at + 10..at + 10 + rdlen];
            out.push(match rdlen {
                4 => IpAddr::from(<[u8; 4]>::try_from(data).unwrap()),
                _ => IpAddr::from(<[u8; 16]>::try_from(data).unwrap()),
            });
            at += 10 + rdlen;
        }
        assert_eq!(at, m.len(), "nothing after the answers");
        out
    }

    /// The rewritten answer and how many addresses it dropped; fails when not rewritten.
    fn filtered(m: &[u8], policy: &Policy) -> (Vec<u8>, usize) {
        match filter_answer(m, policy) {
            Outcome::Filtered { message, dropped } => (message, dropped),
            other => panic!("not filtered: {other:?}"),
        }
    }

    #[test]
    fn a_name_with_a_public_and_a_special_address_keeps_only_the_public_one() {
        let m = answer_with(
            "images.example.test",
            &ips(&["1.1.1.1", "127.0.0.1", "::1"]),
        );
        let (message, dropped) = filtered(&m, &Policy::default());
        assert_eq!(dropped, 2);
        assert_eq!(addresses_of(&message), ips(&["1.1.1.1"]));
        assert_eq!(&message[..4], &m[..4], "same id and flags");
    }

    #[test]
    fn the_special_address_first_is_dropped_too() {
        let m = answer_with(
            "a.test",
            &ips(&["10.0.0.1", "93.184.216.34", "169.254.169.254"]),
        );
        let (message, dropped) = filtered(&m, &Policy::default());
        assert_eq!(dropped, 2);
        assert_eq!(addresses_of(&message), ips(&["93.184.216.34"]));
    }

    #[test]
    fn an_answer_of_only_special_or_only_public_addresses_passes_unchanged() {
        let special = answer_with("a.test", &ips(&["127.0.0.1", "10.1.2.3"]));
        assert_eq!(
            filter_answer(&special, &Policy::default()),
            Outcome::Unchanged
        );
        let public = answer_with("a.test", &ips(&["1.1.1.1", "8.8.8.8"]));
        assert_eq!(
            filter_answer(&public, &Policy::default()),
            Outcome::Unchanged
        );
    }

    #[test]
    fn an_address_entry_of_the_allow_list_keeps_its_special_address() {
        let policy = Policy::from_allow("*.example.test:*, 127.0.0.1:8765, 10.0.0.0/8").unwrap();
        let m = answer_with(
            "a.example.test",
            &ips(&["1.1.1.1", "127.0.0.1", "10.9.9.9", "192.168.1.1"]),
        );
        let (message, dropped) = filtered(&m, &policy);
        assert_eq!(dropped, 1);
        assert_eq!(
            addresses_of(&message),
            ips(&["1.1.1.1", "127.0.0.1", "10.9.9.9"])
        );
    }

    #[test]
    fn a_pointer_into_a_dropped_record_fails_closed() {
        let mut m = answer_with("a.test", &ips(&["127.0.0.1", "1.1.1.1"]));
        // The second record's owner name points at the first record, which is dropped.
        let (first, second) = (m.len() - 32, m.len() - 16);
        m[second + 1] = first as u8;
        assert!(matches!(
            filter_answer(&m, &Policy::default()),
            Outcome::Refused(_)
        ));
    }

    #[test]
    fn truncated_and_non_answers_are_refused() {
        let m = answer_with("a.test", &ips(&["127.0.0.1", "1.1.1.1"]));
        for cut in [3, 12, 20, m.len() - 1] {
            assert!(matches!(
                filter_answer(&m[..cut], &Policy::default()),
                Outcome::Refused(_)
            ));
        }
        let mut query = m.clone();
        query[2] &= 0x7F;
        assert_eq!(
            filter_answer(&query, &Policy::default()),
            Outcome::Refused("not an answer")
        );
    }

    #[test]
    fn servfail_keeps_the_id_and_the_question() {
        let m = answer_with("a.test", &[]);
        let mut query = m.clone();
        query[2] = 0x01;
        let s = servfail(&query);
        assert_eq!(&s[..2], &[0x12, 0x34]);
        assert_eq!(s[3] & 0x0F, 2, "RCODE server failure");
        assert_eq!(&s[12..], &m[12..], "the question");
        assert_eq!(servfail(&[1]).len(), HEADER);
    }
}
