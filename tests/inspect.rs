//! `mmrouter inspect` as a user runs it: one JSON object out, or one line naming the problem.

use base64::Engine as _;
use std::io::{ErrorKind, Write};
use std::process::{Command, Output, Stdio};
use test_images::fixture;

/// Runs the CLI with `stdin` on its standard input. The input is written from a thread while
/// the output is collected, so a large input never dead-locks against a full stdout pipe, and a
/// CLI that exits before reading its input (a bad flag, a file argument) only closes the pipe:
/// that `BrokenPipe` is expected and ignored, since the exit status and output are what the
/// tests assert on.
fn run(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_mmrouter"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    let mut pipe = child.stdin.take().expect("stdin");
    let input = stdin.to_vec();
    let writer = std::thread::spawn(move || match pipe.write_all(&input) {
        Err(e) if e.kind() != ErrorKind::BrokenPipe => Err(e),
        _ => Ok(()),
    });
    let out = child.wait_with_output().expect("exits");
    writer.join().expect("writer thread").expect("writes stdin");
    out
}

fn image_body(images: &[Vec<u8>]) -> Vec<u8> {
    let parts: Vec<String> = images
        .iter()
        .map(|b| {
            format!(
                r#"{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{}"}}}}"#,
                base64::engine::general_purpose::STANDARD.encode(b)
            )
        })
        .collect();
    format!(
        r#"{{"model":"Qwen/Qwen2.5-VL-7B-Instruct","messages":[{{"role":"user","content":[{},{{"type":"text","text":"hi"}}]}}]}}"#,
        parts.join(",")
    )
    .into_bytes()
}

#[test]
fn inspect_prints_images_tokens_and_blocks() {
    let body = image_body(&[
        fixture("png_wide_1000x7.png"),
        fixture("jpeg_exif_orient6_37x23.jpg"),
    ]);
    let out = run(&["inspect"], &body);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["model"], "Qwen/Qwen2.5-VL-7B-Instruct");
    assert_eq!(v["profile"], "qwen2.5-vl");
    let images = v["images"].as_array().expect("images");
    assert_eq!(images.len(), 2);
    assert_eq!(
        (images[0]["index"].as_u64(), images[1]["index"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(
        (images[0]["width"].as_u64(), images[0]["height"].as_u64()),
        (Some(1000), Some(7))
    );
    // EXIF orientation 6: the processor sees it rotated.
    assert_eq!(
        (images[1]["width"].as_u64(), images[1]["height"].as_u64()),
        (Some(23), Some(37))
    );
    assert_eq!(images[0]["source"], "inline");
    // Qwen2.5-VL smart_resize: 1000x7 is under min_pixels (3136), so it is scaled by
    // sqrt(3136/7000) and rounded up to multiples of 28: 672x28, i.e. 24x1 merged patches.
    assert_eq!(images[0]["tokens"].as_u64(), Some(24));
    let blocks = v["blocks"].as_array().expect("blocks");
    assert_eq!(v["block_size"].as_u64(), Some(16));
    assert_eq!(
        blocks.len() as u64,
        v["prompt_tokens"].as_u64().expect("tokens") / 16
    );
    assert!(
        blocks
            .iter()
            .all(|b| b["key"].as_str().is_some_and(|k| k.len() == 16))
    );
    assert_eq!(blocks[0]["images"][0]["id"], images[0]["id"]);
}

#[test]
fn profile_and_block_size_options_change_the_answer() {
    let body = image_body(&[fixture("png_rgb8_37x23.png")]);
    let dir = std::env::temp_dir().join(format!("mmrouter-inspect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let config = dir.join("router.json");
    std::fs::write(&config, br#"{"block_size": 32}"#).expect("write");
    let file = dir.join("body.json");
    std::fs::write(&file, &body).expect("write");
    let out = run(
        &[
            "inspect",
            "--profile",
            "fixed:100",
            "--config",
            config.to_str().expect("utf8"),
            file.to_str().expect("utf8"),
        ],
        b"",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["images"][0]["tokens"].as_u64(), Some(100));
    assert_eq!(v["block_size"].as_u64(), Some(32));
    assert_eq!(v["profile"], "fixed:100");
    let out = run(&["inspect", "--model", "google/gemma-3-27b-it", "-"], &body);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["model"], "google/gemma-3-27b-it");
    assert_eq!(
        v["images"][0]["tokens"].as_u64(),
        Some(256),
        "gemma3 by the model-name rules"
    );
}

#[test]
fn bad_input_exits_non_zero_with_one_line_naming_the_problem() {
    let mut png = fixture("png_rgb8_37x23.png");
    png.truncate(20);
    let good = fixture("jpeg_baseline_37x23.jpg");
    let out = run(&["inspect"], &image_body(&[good, png]));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf8");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("image 1: truncated PNG header"), "{err}");
    assert!(out.stdout.is_empty());

    let out = run(&["inspect"], b"{\"model\": \"m\", \"messages\": [");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid JSON"));

    // A body larger than a pipe buffer: the CLI refuses the flag before reading it all.
    let padded = format!(r#"{{"model": "m", "pad": "{}"}}"#, "x".repeat(1 << 20));
    let out = run(&["inspect", "--profile", "qwen9"], padded.as_bytes());
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen9"));

    let out = run(&["frobnicate"], b"");
    assert_eq!(out.status.code(), Some(2), "usage errors are 2");
}

#[test]
fn defaults_prints_a_configuration_inspect_accepts() {
    let out = run(&["defaults"], b"");
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["block_size"].as_u64(), Some(16));
    assert!(v["scoring"]["prefill_tokens_per_sec"].is_number());
    assert!(v.get("index").is_none(), "the per-VM index is gone");
}

#[test]
fn check_config_runs_the_filters_own_parser() {
    let ok = run(
        &["check-config"],
        br#"{"workers":[{"name":"w0","address":"10.0.0.1:8000"}],"scoring":{"footprint_weight":1}}"#,
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&ok.stdout).trim(), "ok");
    let sidecar = run(&["check-config", "-"], br#"{"sidecar":{}}"#);
    assert!(sidecar.status.success());
    for (bad, field) in [
        (
            &br#"{"workers":[{"name":"w0","address":"vllm:8000"}]}"#[..],
            "workers[0].address",
        ),
        (
            br#"{"workers":[{"name":"w0","address":"10.0.0.1:8000"}],"scorin":{}}"#,
            "scorin",
        ),
        (
            br#"{"mode":"precise","workers":[{"name":"a","address":"1.2.3.4:5"}]}"#,
            "mode",
        ),
    ] {
        let out = run(&["check-config"], bad);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{field}: {err}");
    }
}
