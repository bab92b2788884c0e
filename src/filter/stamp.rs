//! Engine-aligned identity: stamping each image part with vLLM's per-item `uuid`.
//!
//! vLLM uses a content part's `uuid` verbatim as the item's multimodal identifier when the
//! request sets no per-request processor kwargs (`vllm/entrypoints/chat_utils.py`, the
//! `*_uuid` arguments of `MultiModalItemTracker.add`/`add_*` collected per part, and
//! `vllm/multimodal/processing` where a given uuid replaces the computed mm hash; vLLM PRs
//! #23394 and #23449). That identifier is what the engine's block extra keys and KV events
//! carry. So the filter writes the router's content id (32 hex chars of the xxh3-128 of the
//! image bytes) as the uuid of every image part that has none: the engine's cache and its
//! events then name images the way the router does, and the sidecar maps an event's
//! identifier to the router's image key without a tokenizer.
//!
//! Only images the router identified by their bytes are stamped: inline images, and URL images
//! the filter fetched (`fetch` on), whose content id is that of the bytes the engine fetches
//! too. A URL the filter did not fetch keeps the engine's own identity (of the bytes too). A client's own `uuid` is
//! left as it is, as vLLM would use it. A content id is the same for everyone sending the same
//! bytes, so where tenants must not share an image's cache they set `cache_salt`, which vLLM
//! and the router both put in the first block's key.
//!
//! The rewrite: Envoy lets a filter replace a prefix of the buffered body (`set_buffer` with
//! start 0 replaces the first `size` bytes), not insert in the middle. The filter therefore
//! reads the body up to the last insertion point, inserts `"uuid":"<id>",` right after each
//! image part's `{`, and replaces that prefix; the rest of the body, usually the largest image
//! data, stays where it is in Envoy. The request's `content-length`, when it has one, grows by
//! the bytes inserted.

use crate::analysis::Analysis;

/// One insertion: `text` goes at body offset `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insertion {
    pub at: usize,
    pub text: String,
}

/// The uuid insertions for `analysis`'s image parts that need one, in body order.
pub fn uuid_insertions(analysis: &Analysis) -> Vec<Insertion> {
    let mut out: Vec<Insertion> = analysis
        .media
        .iter()
        .zip(&analysis.sites)
        .filter(|(m, site)| m.id.is_content() && !site.has_uuid)
        .map(|(m, site)| Insertion {
            at: site.offset,
            text: format!("\"uuid\":\"{}\",", m.id.id),
        })
        .collect();
    out.sort_by_key(|i| i.at);
    out
}

/// Where the prefix to rewrite ends: the last insertion point (None: nothing to insert).
pub fn prefix_len(insertions: &[Insertion]) -> Option<usize> {
    insertions.last().map(|i| i.at)
}

/// `prefix` (the body's first [`prefix_len`] bytes) with the insertions made. None when an
/// insertion point is past the prefix.
pub fn rewrite_prefix(prefix: &[u8], insertions: &[Insertion]) -> Option<Vec<u8>> {
    let added: usize = insertions.iter().map(|i| i.text.len()).sum();
    let mut out = Vec::with_capacity(prefix.len() + added);
    let mut from = 0;
    for i in insertions {
        out.extend_from_slice(prefix.get(from..i.at)?);
        out.extend_from_slice(i.text.as_bytes());
        from = i.at;
    }
    out.extend_from_slice(prefix.get(from..)?);
    Some(out)
}

/// Bytes the insertions add.
pub fn added_bytes(insertions: &[Insertion]) -> usize {
    insertions.iter().map(|i| i.text.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::analyze;
    use crate::config::RouterConfig;
    use test_images::{data_url, png};

    fn body(images: &[(&[u8], Option<&str>)]) -> Vec<u8> {
        let parts: Vec<String> = images
            .iter()
            .map(|(bytes, uuid)| {
                let uuid = uuid.map_or(String::new(), |u| format!(r#","uuid":"{u}""#));
                format!(
                    r#"{{ "type":"image_url","image_url":{{"url":"{}"}}{uuid}}}"#,
                    data_url("image/png", bytes)
                )
            })
            .collect();
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{},{{"type":"text","text":"x"}}]}}]}}"#,
            parts.join(",")
        )
        .into_bytes()
    }

    #[test]
    fn stamped_bodies_stay_valid_keep_their_keys_and_carry_the_content_ids() {
        let (a, b, c) = (png(40, 30), png(50, 20), png(20, 20));
        let original = body(&[(&a, None), (&b, Some("client-id")), (&c, None)]);
        let config = RouterConfig::default();
        let before = analyze(&original, &config).expect("analyses");
        let ins = uuid_insertions(&before);
        assert_eq!(ins.len(), 2, "the client's uuid is kept");
        let cut = prefix_len(&ins).expect("a prefix");
        let mut stamped = rewrite_prefix(&original[..cut], &ins).expect("rewrites");
        stamped.extend_from_slice(&original[cut..]);
        assert_eq!(stamped.len(), original.len() + added_bytes(&ins));
        let v: serde_json::Value = serde_json::from_slice(&stamped).expect("still JSON");
        let parts = &v["messages"][0]["content"];
        assert_eq!(parts[0]["uuid"], before.media[0].id.id.as_str());
        assert_eq!(parts[1]["uuid"], "client-id");
        assert_eq!(parts[2]["uuid"], before.media[2].id.id.as_str());
        let after = analyze(&stamped, &config).expect("analyses");
        assert_eq!(
            after.layout.keys, before.layout.keys,
            "same blocks for the router"
        );
        assert_eq!(uuid_insertions(&after), vec![], "nothing left to stamp");
    }

    #[test]
    fn url_images_are_not_stamped() {
        let original = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]}"#;
        let a = analyze(original, &RouterConfig::default()).expect("analyses");
        assert!(uuid_insertions(&a).is_empty());
        assert_eq!(
            rewrite_prefix(
                b"ab",
                &[Insertion {
                    at: 5,
                    text: "x".into()
                }]
            ),
            None
        );
    }
}
