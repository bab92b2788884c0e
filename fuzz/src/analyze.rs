//! Target `analyze`: the request scanner and parser, whole and in pieces.
//!
//! Input: [`crate::split`]'s control byte and piece sizes, then the request body. Flag bit 0
//! picks tight limits (small body, media, nesting and token caps, 4-token blocks), bit 1 the
//! profile without a size cap (`factor:1` for every model: the configuration of the VM crash
//! in issue 14). Properties:
//!
//! - `analyze(body)` equals the incremental [`Analyzer`] fed the body in the input's pieces
//!   (the same analysis, or the same error; a body over the size limit names the bytes seen
//!   when it crossed it, so only the limit is compared there);
//! - an analysis is consistent and bounded: one site per media item, in body order, each just
//!   after a `{`; at most `max_media_items` items and `max_media_tokens` media tokens; the
//!   prompt at most a few tokens per body byte plus the media tokens; one key per full block;
//!   block overlaps sorted and in range; skipped parts kept up to `MAX_SKIPPED_KEPT`;
//! - the `inspect` report has one entry per item and per block;
//! - stamping: inserting the router's content id as `uuid` into every image part without one
//!   (what the filter does in precise mode) gives a body that analyses to the same block keys,
//!   names the same items, and needs no more stamping.

use super::split::{pieces, split};
use mmrouter::analysis::{Analysis, AnalyzeError, Analyzer, analyze};
use mmrouter::config::RouterConfig;
use mmrouter::filter::stamp::{added_bytes, prefix_len, rewrite_prefix, uuid_insertions};
use mmrouter::identity::IdSource;
use mmrouter::request::RequestError;
use mmrouter::scan::MAX_SKIPPED_KEPT;
use std::sync::OnceLock;

const TIGHT: &str = r#"{"block_size": 4, "limits": {"max_body_bytes": 4096,
    "max_media_items": 2, "max_nesting": 6, "max_media_tokens": 4096}}"#;
const UNCAPPED: &str = r#"{"profiles": {"builtin_rules": false, "default": "factor:1"}}"#;
const TIGHT_UNCAPPED: &str = r#"{"block_size": 4, "limits": {"max_body_bytes": 4096,
    "max_media_items": 2, "max_nesting": 6, "max_media_tokens": 4096},
    "profiles": {"builtin_rules": false, "default": "factor:1"}}"#;

/// The configuration for flag bits 0-1.
pub fn config(flags: u8) -> &'static RouterConfig {
    static CONFIGS: OnceLock<[RouterConfig; 4]> = OnceLock::new();
    let all = CONFIGS.get_or_init(|| {
        [
            RouterConfig::default(),
            RouterConfig::from_json(TIGHT.as_bytes()).expect("tight config"),
            RouterConfig::from_json(UNCAPPED.as_bytes()).expect("uncapped config"),
            RouterConfig::from_json(TIGHT_UNCAPPED.as_bytes()).expect("tight uncapped config"),
        ]
    });
    &all[usize::from(flags & 3)]
}

pub fn check(data: &[u8]) -> bool {
    let input = split(data);
    let config = config(input.flags);
    let body = input.payload;
    let whole = analyze(body, config);
    let mut analyzer = Analyzer::new(config);
    let mut failed = None;
    for piece in pieces(body, input.sizes) {
        if let Err(e) = analyzer.feed(piece) {
            failed = Some(e);
            break;
        }
    }
    if failed.is_none() {
        assert_eq!(analyzer.bytes_seen(), body.len());
    }
    let pieced = match failed {
        Some(e) => Err(e),
        None => analyzer.finish(config),
    };
    assert_eq!(
        comparable(&whole),
        comparable(&pieced),
        "whole body and pieces disagree"
    );
    match &whole {
        Ok(analysis) => {
            consistent(analysis, body, config);
            stamped(analysis, body, config);
        }
        Err(e) => {
            assert!(!e.reason().is_empty());
            assert!(!e.to_string().is_empty());
        }
    }
    true
}

/// The result with the byte count of a size-limit error dropped (it is the bytes seen when
/// the limit was crossed, which depends on the pieces).
fn comparable(r: &Result<Analysis, AnalyzeError>) -> Result<&Analysis, AnalyzeError> {
    match r {
        Ok(a) => Ok(a),
        Err(AnalyzeError::Request(RequestError::TooLarge { limit, .. })) => {
            Err(AnalyzeError::Request(RequestError::TooLarge {
                bytes: 0,
                limit: *limit,
            }))
        }
        Err(e) => Err(e.clone()),
    }
}

fn consistent(a: &Analysis, body: &[u8], config: &RouterConfig) {
    let limits = &config.limits;
    assert_eq!(a.sites.len(), a.media.len());
    assert!(a.media.len() <= limits.max_media_items);
    let mut last_site = 0;
    for (i, (m, site)) in a.media.iter().zip(&a.sites).enumerate() {
        assert_eq!(m.index, i);
        assert!(site.offset > last_site, "sites out of body order");
        last_site = site.offset;
        assert_eq!(
            body.get(site.offset - 1),
            Some(&b'{'),
            "a site not after `{{`"
        );
        if m.format.is_some() {
            assert!(m.width.is_some_and(|w| w > 0) && m.height.is_some_and(|h| h > 0));
            assert!(m.bytes.is_some());
        }
        assert!(m.bytes.is_none_or(|b| b <= body.len()));
    }
    let media_tokens: u64 = a
        .media
        .iter()
        .map(|m| u64::from(m.tokens.tokens) + u64::from(m.tokens.markers))
        .sum();
    assert!(media_tokens <= limits.max_media_tokens);
    assert_eq!(a.skipped.len(), a.skipped_count.min(MAX_SKIPPED_KEPT));
    assert!(a.skipped_count <= body.len());
    let layout = &a.layout;
    assert_eq!(layout.block_size, config.block_size);
    assert!(
        layout.prompt_tokens as u64 <= 8 * body.len() as u64 + 16 + media_tokens,
        "{} tokens from a body of {} bytes and {} media tokens",
        layout.prompt_tokens,
        body.len(),
        media_tokens
    );
    assert_eq!(layout.keys.len(), layout.prompt_tokens / layout.block_size);
    assert!(
        layout
            .media
            .windows(2)
            .all(|w| (w[0].block, w[0].media) < (w[1].block, w[1].media))
    );
    for o in &layout.media {
        assert!((o.block as usize) < layout.keys.len());
        assert!((o.media as usize) < a.media.len());
        assert!(o.offset < layout.block_size as i64);
    }
    let report = mmrouter::report::inspect_json(a);
    assert_eq!(
        report["images"].as_array().map(Vec::len),
        Some(a.media.len())
    );
    assert_eq!(
        report["blocks"].as_array().map(Vec::len),
        Some(layout.keys.len())
    );
}

fn stamped(a: &Analysis, body: &[u8], config: &RouterConfig) {
    let insertions = uuid_insertions(a);
    let Some(cut) = prefix_len(&insertions) else {
        assert!(
            a.media
                .iter()
                .zip(&a.sites)
                .all(|(m, s)| m.id.source != IdSource::Inline || s.has_uuid)
        );
        return;
    };
    let mut stamped = rewrite_prefix(&body[..cut], &insertions).expect("insertions in the prefix");
    stamped.extend_from_slice(&body[cut..]);
    assert_eq!(stamped.len(), body.len() + added_bytes(&insertions));
    if stamped.len() > config.limits.max_body_bytes {
        return;
    }
    let after = match analyze(&stamped, config) {
        Ok(after) => after,
        Err(e) => panic!("the stamped body does not analyse: {e}"),
    };
    assert_eq!(
        after.layout.keys, a.layout.keys,
        "stamping moved the block keys"
    );
    assert_eq!(after.media.len(), a.media.len());
    for (before, now) in a.media.iter().zip(&after.media) {
        assert_eq!(before.id.id, now.id.id, "stamping renamed an item");
    }
    assert_eq!(uuid_insertions(&after), vec![], "stamped twice");
}
