//! The SSRF guard: which image URLs the filter may fetch, and through which cluster.
//!
//! A URL is fetched only when all of these hold, else it is refused with a [`Refusal`]:
//!
//! - its scheme is one of `fetch.schemes` (default `http`, `https`);
//! - it parses: a host, an optional port (not 0), no user info (`user:pass@`), no control
//!   characters, spaces or backslashes; a host whose last label is numeric must be a dotted-quad
//!   IPv4 address (no `0x7f.1` or `2130706433`, which some resolvers read as addresses);
//! - its host and port match an entry of `fetch.allow` ([`HostPattern`]);
//! - a literal address in a special-use range ([`SPECIAL_RANGES`]: private, loopback,
//!   link-local, CGNAT, multicast, documentation, IPv4-mapped, ...) is refused unless an exact
//!   entry (that address, or a CIDR range holding it) allows it: `*` never does;
//! - a local name (`localhost`, `*.localhost`, `*.local`, `*.internal`, `*.home.arpa`, ...,
//!   and any single-label name, which a resolver completes with its search domains) is refused
//!   unless an exact entry names it.
//!
//! **Resolved addresses.** The filter cannot resolve names; Envoy does, and refuses what a
//! name resolves to. [`Target::trusted`] picks the path (see
//! [`super::FetchConfig::cluster_for`]): a name allowed by an exact entry goes straight to the
//! dynamic forward proxy cluster (`<fetch.cluster>_dns`); a name allowed only by `*` or
//! `*.suffix` goes to `<fetch.cluster>_guard`, an Envoy internal listener (rendered by
//! `envoy/render.py`) whose dynamic forward proxy filter resolves the name and saves the
//! address, whose RBAC filter refuses an address in [`SPECIAL_RANGES`] (read from this file by
//! `envoy/render.py`) unless an exact address or CIDR entry of `fetch.allow` holds it, and whose
//! router then connects through the same DNS cache. Its refusal is a 403 carrying
//! [`REFUSED_HEADER`]: `resolved_special_address` ([`Refusal::ResolvedSpecialAddress`]).
//! `docs/URL_IMAGES.md` has the data flow.

use crate::config::ConfigError;
use std::net::IpAddr;

/// URL schemes the filter can fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    fn parse(s: &str) -> Option<Scheme> {
        if s.eq_ignore_ascii_case("http") {
            Some(Scheme::Http)
        } else if s.eq_ignore_ascii_case("https") {
            Some(Scheme::Https)
        } else {
            None
        }
    }

    pub fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

/// Why a URL is not fetched (the `<reason>` of `mmrouter.fetch_refused.<reason>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A scheme not in `fetch.schemes`.
    Scheme,
    /// Not a URL the guard can read safely.
    BadUrl,
    /// User info in the URL (`user:pass@host`).
    Credentials,
    /// The host (and port) match no entry of `fetch.allow`.
    NotAllowed,
    /// A literal special-use address not allowed by an exact entry.
    PrivateAddress,
    /// A local or single-label name not allowed by an exact entry.
    LocalName,
    /// A name that Envoy's guard listener resolved to a special-use address not allowed by an
    /// exact entry (its 403 carries [`REFUSED_HEADER`]).
    ResolvedSpecialAddress,
    /// More images to fetch in the request than `fetch.max_images`.
    TooMany,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Scheme => "scheme",
            Refusal::BadUrl => "bad_url",
            Refusal::Credentials => "credentials",
            Refusal::NotAllowed => "not_allowed",
            Refusal::PrivateAddress => "private_address",
            Refusal::LocalName => "local_name",
            Refusal::ResolvedSpecialAddress => "resolved_special_address",
            Refusal::TooMany => "too_many",
        }
    }

    pub const ALL: [Refusal; 8] = [
        Refusal::Scheme,
        Refusal::BadUrl,
        Refusal::Credentials,
        Refusal::NotAllowed,
        Refusal::PrivateAddress,
        Refusal::LocalName,
        Refusal::ResolvedSpecialAddress,
        Refusal::TooMany,
    ];
}

/// The response header by which Envoy's guard listener marks its own refusal of a resolved
/// address (value: a [`Refusal::reason`], `resolved_special_address`), to tell it from an image
/// server's 403.
pub const REFUSED_HEADER: &str = "x-mmrouter-fetch-refused";

/// Special-use address ranges (IANA's IPv4 and IPv6 special-purpose registries, plus
/// multicast and reserved space): never fetched unless allowed by an exact entry. The single
/// source of the list: `envoy/render.py` reads it from this file (keep it one quoted range per
/// entry) to render the guard listener's RBAC filter for resolved addresses.
pub const SPECIAL_RANGES: [&str; 28] = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "::/128",
    "::1/128",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "2001::/23",
    "2001:db8::/32",
    "2002::/16",
    "3fff::/20",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
];

/// Names that resolve locally (RFC 6761/6762/8375 and common private suffixes): refused unless
/// an exact entry names them. A single-label name is refused too.
const LOCAL_SUFFIXES: [&str; 8] = [
    "localhost",
    "local",
    "internal",
    "home.arpa",
    "localdomain",
    "lan",
    "intranet",
    "corp",
];

/// An IP range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Cidr> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a.parse::<IpAddr>().ok()?, p.parse::<u8>().ok()?),
            None => {
                let a = s.parse::<IpAddr>().ok()?;
                (a, if a.is_ipv4() { 32 } else { 128 })
            }
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (prefix <= max).then_some(Cidr { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => prefix_eq(
                u128::from(u32::from(net)) << 96,
                u128::from(u32::from(ip)) << 96,
                self.prefix,
            ),
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                prefix_eq(u128::from(net), u128::from(ip), self.prefix)
            }
            _ => false,
        }
    }
}

fn prefix_eq(a: u128, b: u128, prefix: u8) -> bool {
    if prefix == 0 {
        return true;
    }
    let shift = 128u32.saturating_sub(u32::from(prefix));
    a.checked_shr(shift) == b.checked_shr(shift)
}

/// Whether `ip` is in a special-use range.
pub fn is_special(ip: IpAddr) -> bool {
    SPECIAL_RANGES
        .iter()
        .filter_map(|r| Cidr::parse(r))
        .any(|c| c.contains(ip))
}

/// The host part of an allow-list entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    /// `*`: any public name or public address.
    Any,
    /// `*.example.com`: any name under `example.com` (not `example.com` itself).
    Suffix(String),
    /// `images.example.com`: exactly that name (an explicit allowance).
    Name(String),
    /// `10.0.0.5`, `[fd00::1]`, `10.0.0.0/8`: those addresses (an explicit allowance).
    Addresses(Cidr),
}

/// One `fetch.allow` entry: `host`, `*.suffix`, `*`, an IP address or CIDR range, each with an
/// optional `:port` (`[v6]:port` for IPv6). Without a port it matches the scheme's default
/// port only (80, 443); `:*` matches any port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPattern {
    pub host: HostMatch,
    /// None: the default port of the URL's scheme. Some(None): any port.
    pub port: Option<Option<u16>>,
}

impl HostPattern {
    pub fn parse(entry: &str) -> Result<HostPattern, String> {
        let entry = entry.trim();
        let bad = |why: &str| Err(format!("`{entry}`: {why}"));
        if entry.is_empty() {
            return bad("empty entry");
        }
        let (host, port) =
            split_pattern_port(entry).ok_or_else(|| format!("`{entry}`: bad port"))?;
        if host.ends_with("*.") {
            return bad("not a host name after `*.`");
        }
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let host_match = if host == "*" {
            HostMatch::Any
        } else if let Some(suffix) = host.strip_prefix("*.") {
            if !valid_name(suffix) {
                return bad("not a host name after `*.`");
            }
            HostMatch::Suffix(suffix.to_string())
        } else if host.contains('*') {
            return bad("`*` only as `*` or a leading `*.`");
        } else if let Some(cidr) = Cidr::parse(host.trim_start_matches('[').trim_end_matches(']')) {
            HostMatch::Addresses(cidr)
        } else if valid_name(&host) && !numeric_tail(&host) {
            HostMatch::Name(host)
        } else {
            return bad("not a host name, an IP address or a CIDR range");
        };
        Ok(HostPattern {
            host: host_match,
            port,
        })
    }

    fn port_matches(&self, port: u16, scheme: Scheme) -> bool {
        match self.port {
            None => port == scheme.default_port(),
            Some(None) => true,
            Some(Some(p)) => p == port,
        }
    }

    /// Whether the entry names this exact host (an explicit allowance).
    fn is_exact(&self) -> bool {
        matches!(self.host, HostMatch::Name(_) | HostMatch::Addresses(_))
    }
}

/// `host[:port]` of an allow entry, IPv6 in brackets. Port: None (absent), Some(None) (`*`).
fn split_pattern_port(entry: &str) -> Option<(&str, Option<Option<u16>>)> {
    let parse_port = |p: &str| -> Option<Option<Option<u16>>> {
        if p == "*" {
            return Some(Some(None));
        }
        let n = p.parse::<u16>().ok().filter(|n| *n > 0)?;
        Some(Some(Some(n)))
    };
    if let Some(rest) = entry.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return match after.strip_prefix(':') {
            Some(p) => Some((host, parse_port(p)?)),
            None if after.is_empty() => Some((host, None)),
            None => None,
        };
    }
    // A bare IPv6 address or CIDR has several colons: no port.
    if entry.matches(':').count() > 1 {
        return Some((entry, None));
    }
    match entry.rsplit_once(':') {
        Some((host, p)) => Some((host, parse_port(p)?)),
        None => Some((entry, None)),
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// The last label is numeric (or hex): the name reads as an address to some resolvers.
fn numeric_tail(name: &str) -> bool {
    let last = name.rsplit('.').next().unwrap_or(name);
    last.bytes().all(|b| b.is_ascii_digit()) || last.starts_with("0x")
}

fn is_local_name(name: &str) -> bool {
    !name.contains('.')
        || LOCAL_SUFFIXES
            .iter()
            .any(|s| name == *s || name.strip_suffix(s).is_some_and(|p| p.ends_with('.')))
}

/// A URL the guard allowed: where to send the GET.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub scheme: Scheme,
    /// Lowercase name, or the address (IPv6 without brackets).
    pub host: String,
    pub port: u16,
    /// `:authority`: host, `[v6]`, with `:port` unless it is the scheme's default.
    pub authority: String,
    /// `:path`: path and query as written (`/` when empty), no fragment.
    pub path: String,
    /// Allowed by an exact entry: a name goes straight to the dynamic forward proxy cluster,
    /// without the guard listener's check of the address it resolves to.
    pub trusted: bool,
}

/// The parts of an absolute http(s) URL.
struct Parts<'a> {
    scheme: &'a str,
    host: String,
    ip: Option<IpAddr>,
    port: Option<u16>,
    path: String,
}

fn parse_url(url: &str) -> Result<Parts<'_>, Refusal> {
    let url = url.trim();
    if url
        .bytes()
        .any(|b| b.is_ascii_control() || b == b' ' || b == b'\\' || b >= 0x80)
    {
        return Err(Refusal::BadUrl);
    }
    let (scheme, rest) = url.split_once("://").ok_or(Refusal::BadUrl)?;
    let rest = rest.split('#').next().unwrap_or(rest);
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if authority.contains('@') {
        return Err(Refusal::Credentials);
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or(Refusal::BadUrl)?;
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(Refusal::BadUrl),
        };
        (h, port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        None | Some("") => None,
        Some(p) => Some(
            p.parse::<u16>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or(Refusal::BadUrl)?,
        ),
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if host.is_empty() {
        return Err(Refusal::BadUrl);
    }
    let ip = host.parse::<IpAddr>().ok();
    if ip.is_none() && (!valid_name(&host) || numeric_tail(&host)) {
        return Err(Refusal::BadUrl);
    }
    let path = if tail.is_empty() {
        "/".to_string()
    } else if tail.starts_with('?') {
        format!("/{tail}")
    } else {
        tail.to_string()
    };
    Ok(Parts {
        scheme,
        host,
        ip,
        port,
        path,
    })
}

/// The guard of one configuration: schemes and allow-list, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    schemes: Vec<Scheme>,
    allow: Vec<HostPattern>,
}

impl Guard {
    /// `schemes`: `http`/`https`; `allow`: [`HostPattern`] entries. An error names the entry.
    pub fn new(schemes: &[String], allow: &[String]) -> Result<Guard, ConfigError> {
        let schemes = schemes
            .iter()
            .map(|s| {
                Scheme::parse(s).ok_or_else(|| {
                    ConfigError::new(
                        "fetch.schemes",
                        format!("`{s}`: only http and https can be fetched"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if schemes.is_empty() {
            return Err(ConfigError::new("fetch.schemes", "needs http and/or https"));
        }
        let allow = allow
            .iter()
            .map(|e| HostPattern::parse(e).map_err(|m| ConfigError::new("fetch.allow", m)))
            .collect::<Result<Vec<_>, _>>()?;
        if allow.is_empty() {
            return Err(ConfigError::new(
                "fetch.allow",
                "needs at least one host pattern (`*` allows every public host)",
            ));
        }
        Ok(Guard { schemes, allow })
    }

    /// Whether `url` may be fetched, and where.
    pub fn check(&self, url: &str) -> Result<Target, Refusal> {
        let scheme_text = url.trim().split_once("://").map(|(s, _)| s);
        let Some(scheme) = scheme_text.and_then(Scheme::parse) else {
            return Err(if scheme_text.is_some() || !url.contains(':') {
                Refusal::Scheme
            } else {
                Refusal::BadUrl
            });
        };
        if !self.schemes.contains(&scheme) {
            return Err(Refusal::Scheme);
        }
        let parts = parse_url(url)?;
        debug_assert!(Scheme::parse(parts.scheme) == Some(scheme));
        let port = parts.port.unwrap_or(scheme.default_port());
        let matching = self
            .allow
            .iter()
            .filter(|p| p.port_matches(port, scheme))
            .filter(|p| match (&p.host, parts.ip) {
                (HostMatch::Any, _) => true,
                (HostMatch::Suffix(s), None) => parts
                    .host
                    .strip_suffix(s.as_str())
                    .is_some_and(|head| head.ends_with('.')),
                (HostMatch::Suffix(_), Some(_)) => false,
                (HostMatch::Name(n), None) => *n == parts.host,
                (HostMatch::Name(_), Some(_)) => false,
                (HostMatch::Addresses(c), Some(ip)) => c.contains(ip),
                (HostMatch::Addresses(_), None) => false,
            });
        let mut any = false;
        let mut exact = false;
        for p in matching {
            any = true;
            exact |= p.is_exact();
        }
        if !any {
            return Err(Refusal::NotAllowed);
        }
        if !exact {
            match parts.ip {
                Some(ip) if is_special(ip) => return Err(Refusal::PrivateAddress),
                None if is_local_name(&parts.host) => return Err(Refusal::LocalName),
                _ => {}
            }
        }
        let host_text = match parts.ip {
            Some(IpAddr::V6(_)) => format!("[{}]", parts.host),
            _ => parts.host.clone(),
        };
        let authority = if port == scheme.default_port() {
            host_text
        } else {
            format!("{host_text}:{port}")
        };
        Ok(Target {
            scheme,
            host: parts.host,
            port,
            authority,
            path: parts.path,
            trusted: exact,
        })
    }

    /// A redirect's `Location`, resolved against the URL it came from (absolute, scheme-relative
    /// `//host/path`, absolute path `/path`, or relative path), as an absolute URL for
    /// [`Guard::check`]. None when it cannot be resolved.
    pub fn resolve_location(base: &Target, location: &str) -> Option<String> {
        let location = location.trim();
        if location.is_empty() {
            return None;
        }
        if location.contains("://") {
            return Some(location.to_string());
        }
        let origin = format!("{}://{}", base.scheme.name(), base.authority);
        if let Some(rest) = location.strip_prefix("//") {
            return Some(format!("{}://{rest}", base.scheme.name()));
        }
        if location.starts_with('/') {
            return Some(format!("{origin}{location}"));
        }
        let base_path = base.path.split('?').next().unwrap_or("/");
        let dir = match base_path.rfind('/') {
            Some(i) => base_path.get(..=i).unwrap_or("/"),
            None => "/",
        };
        if location.starts_with('?') {
            return Some(format!("{origin}{base_path}{location}"));
        }
        Some(format!("{origin}{dir}{location}"))
    }
}

/// The special-use ranges as parsed values.
pub fn special_ranges() -> Vec<Cidr> {
    SPECIAL_RANGES
        .iter()
        .filter_map(|r| Cidr::parse(r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    fn v6(segments: [u16; 8]) -> IpAddr {
        let [a, b, c, d, e, f, g, h] = segments;
        IpAddr::V6(Ipv6Addr::new(a, b, c, d, e, f, g, h))
    }

    fn guard(allow: &[&str]) -> Guard {
        Guard::new(
            &["http".into(), "https".into()],
            &allow.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .expect("valid guard")
    }

    fn refusal(g: &Guard, url: &str) -> Option<&'static str> {
        g.check(url).err().map(Refusal::reason)
    }

    #[test]
    fn the_special_ranges_parse_and_cover_what_they_name() {
        assert_eq!(special_ranges().len(), SPECIAL_RANGES.len());
        for ip in [
            v4(127, 0, 0, 1),
            v4(10, 1, 2, 3),
            v4(172, 31, 255, 255),
            v4(192, 168, 1, 1),
            v4(169, 254, 169, 254),
            v4(100, 64, 0, 1),
            v4(0, 0, 0, 0),
            v4(255, 255, 255, 255),
            v4(224, 0, 0, 1),
            v6([0, 0, 0, 0, 0, 0, 0, 1]),
            v6([0, 0, 0, 0, 0, 0xffff, 0x7f00, 1]),
            v6([0xfd00, 0, 0, 0, 0, 0, 0, 1]),
            v6([0xfe80, 0, 0, 0, 0, 0, 0, 1]),
            v6([0x64, 0xff9b, 0, 0, 0, 0, 0x0a00, 1]),
        ] {
            assert!(is_special(ip), "{ip}");
        }
        for ip in [
            v4(8, 8, 8, 8),
            v4(172, 32, 0, 1),
            v4(100, 128, 0, 1),
            v4(93, 184, 216, 34),
            v6([0x2606, 0x4700, 0, 0, 0, 0, 0, 0x1111]),
        ] {
            assert!(!is_special(ip), "{ip}");
        }
    }

    #[test]
    fn public_hosts_are_allowed_by_star_on_default_ports() {
        let g = guard(&["*"]);
        let t = g
            .check("https://Images.Example.com/a/b.png?sig=1#frag")
            .expect("allowed");
        assert_eq!(t.scheme, Scheme::Https);
        assert_eq!(t.authority, "images.example.com");
        assert_eq!(t.path, "/a/b.png?sig=1");
        assert_eq!(t.port, 443);
        assert!(!t.trusted, "a wildcard is not an explicit allowance");
        let t = g.check("http://93.184.216.34").expect("public address");
        assert_eq!(t.path, "/");
        assert_eq!(
            refusal(&g, "http://example.com:8080/a.png"),
            Some("not_allowed")
        );
        assert_eq!(
            g.check("http://example.com?x=1").map(|t| t.path),
            Ok("/?x=1".to_string())
        );
    }

    #[test]
    fn every_refusal_reason_is_reachable() {
        let g =
            Guard::new(&["https".into()], &["*".into(), "*.example.com:*".into()]).expect("guard");
        assert_eq!(refusal(&g, "http://example.com/a.png"), Some("scheme"));
        assert_eq!(refusal(&g, "ftp://example.com/a.png"), Some("scheme"));
        assert_eq!(refusal(&g, "file:///etc/passwd"), Some("scheme"));
        assert_eq!(refusal(&g, "example.com/a.png"), Some("scheme"));
        assert_eq!(refusal(&g, "https://exa mple.com/"), Some("bad_url"));
        assert_eq!(refusal(&g, "https://example.com:0/"), Some("bad_url"));
        assert_eq!(refusal(&g, "https://example.com:99999/"), Some("bad_url"));
        assert_eq!(refusal(&g, "https:///a.png"), Some("bad_url"));
        assert_eq!(refusal(&g, "https://0x7f.1/"), Some("bad_url"));
        assert_eq!(refusal(&g, "https://2130706433/"), Some("bad_url"));
        assert_eq!(refusal(&g, "https://127.1/"), Some("bad_url"));
        assert_eq!(refusal(&g, "https://ex\\ample.com/"), Some("bad_url"));
        assert_eq!(
            refusal(&g, "https://user:pw@example.com/"),
            Some("credentials")
        );
        assert_eq!(refusal(&g, "https://other.org:8443/"), Some("not_allowed"));
        assert_eq!(refusal(&g, "https://127.0.0.1/"), Some("private_address"));
        assert_eq!(refusal(&g, "https://[::1]/"), Some("private_address"));
        assert_eq!(
            refusal(&g, "https://[::ffff:10.0.0.1]/"),
            Some("private_address")
        );
        assert_eq!(
            refusal(&g, "https://169.254.169.254/latest"),
            Some("private_address")
        );
        assert_eq!(refusal(&g, "https://localhost/"), Some("local_name"));
        assert_eq!(refusal(&g, "https://a.localhost/"), Some("local_name"));
        assert_eq!(
            refusal(&g, "https://metadata.google.internal/"),
            Some("local_name")
        );
        assert_eq!(refusal(&g, "https://redis/"), Some("local_name"));
        assert_eq!(refusal(&g, "https://printer.local./"), Some("local_name"));
        assert_eq!(Refusal::TooMany.reason(), "too_many");
        let mut reasons: Vec<&str> = Refusal::ALL.iter().map(|r| r.reason()).collect();
        reasons.sort_unstable();
        reasons.dedup();
        assert_eq!(reasons.len(), 8, "one distinct reason per refusal");
    }

    #[test]
    fn exact_entries_allow_special_addresses_and_names_and_mark_them_trusted() {
        let g = guard(&[
            "127.0.0.1:8765",
            "10.1.0.0/16:*",
            "[fd00::5]",
            "images.internal",
        ]);
        let t = g.check("http://127.0.0.1:8765/a.jpg").expect("explicit");
        assert!(t.trusted);
        assert_eq!(t.authority, "127.0.0.1:8765");
        assert_eq!(
            refusal(&g, "http://127.0.0.1:8766/a.jpg"),
            Some("not_allowed")
        );
        assert_eq!(
            refusal(&g, "http://127.0.0.2:8765/a.jpg"),
            Some("not_allowed")
        );
        assert!(g.check("http://10.1.200.3:9000/x").expect("cidr").trusted);
        assert_eq!(refusal(&g, "http://10.2.0.1/x"), Some("not_allowed"));
        let t = g.check("https://[FD00::5]/x").expect("v6");
        assert_eq!(t.authority, "[fd00::5]");
        assert!(
            g.check("https://images.internal/a.png")
                .expect("name")
                .trusted
        );
        assert_eq!(
            refusal(&g, "https://x.images.internal/a.png"),
            Some("not_allowed")
        );
    }

    #[test]
    fn suffix_entries_match_subdomains_only_and_never_addresses() {
        let g = guard(&["*.cdn.example.com", "*.example.org:8080"]);
        assert!(g.check("https://a.cdn.example.com/x").is_ok());
        assert!(g.check("https://a.b.cdn.example.com/x").is_ok());
        assert_eq!(
            refusal(&g, "https://cdn.example.com/x"),
            Some("not_allowed")
        );
        assert_eq!(
            refusal(&g, "https://evilcdn.example.com/x"),
            Some("not_allowed")
        );
        assert!(g.check("http://img.example.org:8080/x").is_ok());
        assert_eq!(refusal(&g, "http://img.example.org/x"), Some("not_allowed"));
        // A wildcard under a local suffix still refuses local names: only exact entries allow.
        let g = guard(&["*.internal"]);
        assert_eq!(refusal(&g, "https://a.internal/x"), Some("local_name"));
    }

    #[test]
    fn bad_allow_entries_are_refused_naming_the_entry() {
        for bad in [
            "",
            "*.",
            "a*.com",
            "host:0",
            "host:x",
            "[::1",
            "10.0.0.0/33",
            "exa mple",
        ] {
            let e = Guard::new(&["http".into()], &[bad.into()]).expect_err(bad);
            assert_eq!(e.field, "fetch.allow", "{bad}");
        }
        assert_eq!(
            Guard::new(&["ftp".into()], &["*".into()])
                .expect_err("ftp")
                .field,
            "fetch.schemes"
        );
        assert_eq!(
            Guard::new(&["http".into()], &[]).expect_err("empty").field,
            "fetch.allow"
        );
    }

    #[test]
    fn locations_resolve_against_the_url_they_came_from() {
        let g = guard(&["*:*"]);
        let base = g
            .check("https://a.example.com:8443/img/x.png?q=1")
            .expect("base");
        let r = |loc: &str| Guard::resolve_location(&base, loc);
        assert_eq!(
            r("https://b.example.com/y.png").as_deref(),
            Some("https://b.example.com/y.png")
        );
        assert_eq!(
            r("//c.example.com/z").as_deref(),
            Some("https://c.example.com/z")
        );
        assert_eq!(
            r("/abs.png").as_deref(),
            Some("https://a.example.com:8443/abs.png")
        );
        assert_eq!(
            r("rel.png").as_deref(),
            Some("https://a.example.com:8443/img/rel.png")
        );
        assert_eq!(
            r("?v=2").as_deref(),
            Some("https://a.example.com:8443/img/x.png?v=2")
        );
        assert_eq!(r(" "), None);
    }
}
