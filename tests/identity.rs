//! Identity and block-key invariants, through whole requests: what a user sends decides which
//! requests share cache, and nothing else does.

use base64::Engine as _;
use mmrouter::analysis::analyze;
use mmrouter::config::RouterConfig;
use mmrouter::identity::IdSource;
use std::path::Path;

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/images")
            .join(name),
    )
    .expect("fixture")
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A user turn with `images` (as full URLs) followed by `text`.
fn body(images: &[String], text: &str) -> Vec<u8> {
    let mut parts: Vec<String> = images
        .iter()
        .map(|u| format!(r#"{{"type":"image_url","image_url":{{"url":"{u}"}}}}"#))
        .collect();
    parts.push(format!(r#"{{"type":"text","text":"{text}"}}"#));
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":[{}]}}]}}"#,
        parts.join(",")
    )
    .into_bytes()
}

fn data(mime: &str, bytes: &[u8]) -> String {
    format!("data:{mime};base64,{}", b64(bytes))
}

fn ids(body: &[u8]) -> Vec<String> {
    analyze(body, &RouterConfig::default())
        .expect("analyses")
        .media
        .into_iter()
        .map(|m| m.id.id)
        .collect()
}

fn keys(body: &[u8]) -> Vec<u64> {
    analyze(body, &RouterConfig::default())
        .expect("analyses")
        .layout
        .keys
}

#[test]
fn the_mime_label_does_not_change_the_identity() {
    let png = fixture("png_rgb8_37x23.png");
    let a = ids(&body(&[data("image/png", &png)], "x"));
    let b = ids(&body(&[data("image/jpeg", &png)], "x"));
    let c = ids(&body(&[data("application/octet-stream", &png)], "x"));
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_eq!(a[0].len(), 32);
}

#[test]
fn line_wrapping_of_the_base64_does_not_change_the_identity() {
    let jpg = fixture("jpeg_progressive_61x35.jpg");
    let flat = b64(&jpg);
    // MIME-style 76-column wrapping with CRLF, as mail clients and some SDKs produce.
    let wrapped: String = flat
        .as_bytes()
        .chunks(76)
        .map(|c| std::str::from_utf8(c).expect("ascii"))
        .collect::<Vec<_>>()
        .join("\\r\\n");
    let a = ids(&body(&[format!("data:image/jpeg;base64,{flat}")], "x"));
    let b = ids(&body(&[format!("data:image/jpeg;base64,{wrapped}")], "x"));
    assert_eq!(a, b);
}

#[test]
fn different_bytes_give_different_identities_and_keys() {
    let mut png = fixture("png_rgb8_37x23.png");
    let a = body(&[data("image/png", &png)], "x");
    let last = png.len() - 1;
    png[last] ^= 1;
    let b = body(&[data("image/png", &png)], "x");
    assert_ne!(ids(&a), ids(&b));
    assert_ne!(keys(&a)[0], keys(&b)[0]);
}

#[test]
fn a_client_uuid_is_the_identity_and_url_ids_are_marked() {
    let png = fixture("png_rgb8_37x23.png");
    let with_uuid = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{}"}},"uuid":"sku-42"}},{{"type":"image_url","image_url":"HTTPS://Example.com:443/cat.png#frag"}}]}}]}}"#,
        data("image/png", &png)
    );
    let a = analyze(with_uuid.as_bytes(), &RouterConfig::default()).expect("analyses");
    assert_eq!(a.media[0].id.id, "sku-42");
    assert_eq!(a.media[0].id.source, IdSource::Uuid);
    assert_eq!(
        a.media[0].width,
        Some(37),
        "the size still comes from the bytes"
    );
    assert_eq!(a.media[1].id.source, IdSource::Url);
    let plain = body(&["https://example.com/cat.png".to_string()], "x");
    assert_eq!(ids(&plain)[0], a.media[1].id.id, "normalised URL");
}

#[test]
fn requests_sharing_a_text_and_image_prefix_share_exactly_its_blocks() {
    let png = fixture("png_rgb8_37x23.png");
    let jpg = fixture("jpeg_progressive_61x35.jpg");
    let (p, j) = (data("image/png", &png), data("image/jpeg", &jpg));
    let question = "Describe both pictures: the objects, the colours, the light, the framing, \
        and anything written in them, in as much detail as you can manage.";
    let short = keys(&body(&[p.clone(), j.clone()], question));
    let long = keys(&body(
        &[p.clone(), j.clone()],
        &format!(
            "{question} Then compare their shapes and composition, say which one was taken first and why, and list every difference you can find between them."
        ),
    ));
    assert!(short.len() >= 4, "{} blocks", short.len());
    // Same images, the text extended: every full block before the text's end is shared,
    // then the chains part.
    let shared = short.iter().zip(&long).take_while(|(a, b)| a == b).count();
    assert!(shared >= short.len() - 2, "{shared} of {}", short.len());
    assert!(long.len() > short.len());
    // Swapping the two images changes the keys from the first block on (it holds image 0).
    let swapped = keys(&body(&[j, p], question));
    assert_ne!(swapped[0], short[0]);
    assert!(
        swapped.iter().zip(&short).all(|(a, b)| a != b),
        "chained: nothing after differs"
    );
}

#[test]
fn blocks_carry_their_images_with_offsets_like_vllm_extra_keys() {
    let png = fixture("png_wide_1000x7.png");
    let a = analyze(
        &body(&[data("image/png", &png)], "x"),
        &RouterConfig::default(),
    )
    .expect("analyses");
    let tokens = a.media[0].tokens.tokens as i64;
    let overlaps: Vec<_> = a.layout.media.iter().filter(|m| m.media == 0).collect();
    assert!(overlaps.len() >= 2);
    let first = overlaps[0].offset;
    assert!(
        (0..16).contains(&first),
        "placeholder starts inside block 0"
    );
    for (i, o) in overlaps.iter().enumerate() {
        assert_eq!(
            o.offset,
            first - 16 * i as i64,
            "offset relative to each block's start"
        );
    }
    // Every block the placeholders touch carries the image, and no other block does.
    let last_block = (first + tokens - 1) / 16;
    assert_eq!(overlaps.len() as i64, last_block + 1);
}

/// The body of `body` with a `cache_salt` and/or a `uuid` on its image part.
fn tenant_body(image: &[u8], salt: Option<&str>, uuid: Option<&str>) -> Vec<u8> {
    let uuid = uuid.map_or(String::new(), |u| format!(r#","uuid":"{u}""#));
    let salt = salt.map_or(String::new(), |s| format!(r#","cache_salt":"{s}""#));
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct"{salt},"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{}"}}{uuid}}},{{"type":"text","text":"same question"}}]}}]}}"#,
        data("image/png", image)
    )
    .into_bytes()
}

#[test]
fn a_client_uuid_changes_only_its_own_requests_keys_and_salts_separate_tenants() {
    let img = fixture("png_rgb8_37x23.png");
    let plain = keys(&tenant_body(&img, None, None));
    // A client naming the image with its own uuid gets keys of its own...
    let named = keys(&tenant_body(&img, None, Some("client-chosen-id")));
    assert_ne!(named, plain);
    // ... and sending it does not change anyone else's: the analysis is a pure function of
    // the request, nothing is remembered between requests.
    assert_eq!(keys(&tenant_body(&img, None, None)), plain);
    // A uuid that equals another image's content id names that id, as vLLM would: the engine
    // shares that item's cache between the two requests; cache_salt is what separates tenants.
    let content_id = ids(&tenant_body(&img, None, None))[0].clone();
    let spoof = keys(&tenant_body(
        &fixture("png_gray16_41x19.png"),
        None,
        Some(&content_id),
    ));
    let a = keys(&tenant_body(&img, Some("tenant-a"), None));
    let b = keys(&tenant_body(&img, Some("tenant-b"), None));
    let b_spoof = keys(&tenant_body(
        &fixture("png_gray16_41x19.png"),
        Some("tenant-b"),
        Some(&content_id),
    ));
    assert!(
        a.iter().all(|k| !b.contains(k)),
        "different salts share no block"
    );
    assert!(
        a.iter().all(|k| !b_spoof.contains(k)),
        "a uuid cannot reach another tenant's blocks"
    );
    assert_eq!(spoof.len(), plain.len());
}
