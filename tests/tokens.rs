//! Image token counts: every entry of tests/fixtures/tokens.json (computed by transformers'
//! own image processors, see scripts/make-token-fixture.py) must match exactly; plus specs,
//! overrides, model-name rules and error cases.

use mmrouter::tokens::{
    BUILTIN_RULES, ImageTokens, Profile, ProfileConfig, ProfileParams, ProfileRule, TokenError,
    glob_match,
};
use proptest::prelude::*;

const FIXTURE: &str = include_str!("fixtures/tokens.json");

fn tokens(spec: &str, w: u32, h: u32) -> Result<u32, TokenError> {
    Profile::parse(spec)
        .unwrap()
        .image_tokens(w, h)
        .map(|t| t.tokens)
}

fn is_bad_spec(r: Result<Profile, TokenError>, needle: &str) -> bool {
    matches!(&r, Err(TokenError::BadSpec(m)) if m.contains(needle))
}

#[test]
fn every_fixture_entry_matches_transformers_exactly() {
    let doc: serde_json::Value = serde_json::from_str(FIXTURE).unwrap();
    let columns: Vec<String> = doc["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    for want in [
        "qwen2.5-vl",
        "qwen3-vl",
        "gemma4:70",
        "gemma4:140",
        "gemma4:280",
        "gemma4:560",
        "gemma4:1120",
        "internvl",
    ] {
        assert!(columns.iter().any(|c| c == want), "fixture lacks {want}");
    }
    // The aliases must count like the family the fixture computed.
    let mut profiles: Vec<(usize, Profile)> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| (i, Profile::parse(c).unwrap()))
        .collect();
    let col = |name: &str| columns.iter().position(|c| c == name).unwrap();
    profiles.push((col("qwen2.5-vl"), Profile::parse("qwen2-vl").unwrap()));
    profiles.push((col("qwen3-vl"), Profile::parse("qwen3.5").unwrap()));
    profiles.push((col("gemma4:280"), Profile::parse("gemma4").unwrap()));

    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 1000, "only {} fixture sizes", cases.len());
    let mut checked = 0usize;
    let mut mismatches = Vec::new();
    for case in cases {
        let w = u32::try_from(case[0].as_u64().unwrap()).unwrap();
        let h = u32::try_from(case[1].as_u64().unwrap()).unwrap();
        let row = case[2].as_array().unwrap();
        assert_eq!(row.len(), columns.len());
        for (i, profile) in &profiles {
            let want = row[*i].as_u64();
            let got = profile.image_tokens(w, h);
            let ok = match (&got, want) {
                (Ok(t), Some(n)) => u64::from(t.tokens) == n,
                (Err(TokenError::BadSize(_)), None) => true,
                _ => false,
            };
            if !ok {
                mismatches.push(format!(
                    "{}: {w}x{h}: transformers {}, mmrouter {:?}",
                    profile.spec,
                    want.map_or("error".to_string(), |n| n.to_string()),
                    got.map(|t| t.tokens)
                ));
            }
            checked += 1;
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {checked} counts differ from transformers; first ones:\n{}",
        mismatches.len(),
        mismatches
            .iter()
            .take(25)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn fixture_covers_ties_tiny_thin_huge_and_errors() {
    let doc: serde_json::Value = serde_json::from_str(FIXTURE).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    let sizes: Vec<(u64, u64)> = cases
        .iter()
        .map(|c| (c[0].as_u64().unwrap(), c[1].as_u64().unwrap()))
        .collect();
    // A round-half-even tie for factor 28 (h / 28 = k + 0.5) with k even and odd.
    assert!(
        sizes
            .iter()
            .any(|&(w, _)| w % 28 == 14 && (w / 28) % 2 == 0)
    );
    assert!(
        sizes
            .iter()
            .any(|&(w, _)| w % 28 == 14 && (w / 28) % 2 == 1)
    );
    assert!(sizes.contains(&(1, 1)) && sizes.contains(&(1, 5000)) && sizes.contains(&(3000, 14)));
    assert!(sizes.iter().any(|&(w, h)| w >= 8000 && h >= 6000));
    assert!(sizes.iter().any(|&(w, h)| w * h > 1 << 53));
    // Some entries are processor errors (aspect ratio over 200).
    assert!(
        cases
            .iter()
            .any(|c| c[2].as_array().unwrap().iter().any(|v| v.is_null()))
    );
}

#[test]
fn qwen_known_counts_and_round_half_even() {
    assert_eq!(tokens("qwen2.5-vl", 1920, 1080), Ok(69 * 39));
    assert_eq!(tokens("qwen3-vl", 1920, 1080), Ok(2040));
    // 14 px: 14/28 = 0.5 rounds to 0 (even), so the image is below min_pixels and is enlarged
    // to 56x56 = 2x2 tokens; 42/28 = 1.5 rounds to 2.
    assert_eq!(tokens("qwen2.5-vl", 14, 14), Ok(4));
    assert_eq!(tokens("qwen2.5-vl", 84, 42), Ok(3 * 2));
    // 70/28 = 2.5 rounds to 2 (even), 98/28 = 3.5 rounds to 4 (even).
    assert_eq!(tokens("qwen2.5-vl", 70, 98), Ok(2 * 4));
}

#[test]
fn qwen_refuses_aspect_ratio_over_200_and_zero_sizes() {
    // 200x1 is accepted (ratio exactly 200): below min_pixels, enlarged to 812x28.
    assert_eq!(tokens("qwen2.5-vl", 200, 1), Ok(29));
    assert!(matches!(
        tokens("qwen2.5-vl", 201, 1),
        Err(TokenError::BadSize(m)) if m.contains("aspect ratio")
    ));
    assert!(matches!(
        tokens("qwen3-vl", 1, 4001 * 20),
        Err(TokenError::BadSize(_))
    ));
    for spec in [
        "qwen2.5-vl",
        "qwen3-vl",
        "gemma3",
        "gemma4",
        "llava",
        "internvl",
        "fixed:10",
        "factor:1024",
    ] {
        for (w, h) in [(0, 0), (0, 10), (10, 0)] {
            assert!(
                matches!(tokens(spec, w, h), Err(TokenError::BadSize(_))),
                "{spec} {w}x{h}"
            );
        }
    }
    // Gemma 4 and InternVL have no aspect limit in transformers.
    assert_eq!(tokens("gemma4", 1, 5000), Ok(280));
    assert!(tokens("internvl", 1, 5000).is_ok());
}

#[test]
fn gemma_llava_internvl_fixed_and_factor_counts() {
    assert_eq!(tokens("gemma3", 4000, 3000), Ok(256));
    assert_eq!(tokens("llava", 10, 10), Ok(576));
    assert_eq!(tokens("gemma4:560", 1920, 1080), Ok(527));
    assert_eq!(tokens("internvl", 1920, 1080), Ok(9 * 256));
    assert_eq!(tokens("internvl:6", 1920, 1080), Ok(3 * 256));
    assert_eq!(tokens("internvl", 448, 448), Ok(256));
    assert_eq!(tokens("fixed:576", 1, 1), Ok(576));
    // llm-d: floor(W*H/F), at least 1.
    assert_eq!(tokens("factor:1024", 640, 360), Ok(225));
    assert_eq!(tokens("factor:1024", 641, 360), Ok(225));
    assert_eq!(tokens("factor:1024", 10, 10), Ok(1));
}

#[test]
fn markers_per_profile() {
    let m = |spec: &str| Profile::parse(spec).unwrap().markers();
    assert_eq!(m("qwen2.5-vl"), 2);
    assert_eq!(m("qwen3.5"), 2);
    assert_eq!(m("gemma3"), 4);
    assert_eq!(m("gemma4"), 2);
    assert_eq!(m("internvl"), 2);
    assert_eq!(m("llava"), 0);
    assert_eq!(m("fixed:5"), 0);
    assert_eq!(m("factor:9"), 0);
    assert_eq!(m("fixed:5:markers=2"), 2);
    assert_eq!(
        Profile::parse("qwen2.5-vl").unwrap().image_tokens(56, 56),
        Ok(ImageTokens {
            tokens: 4,
            markers: 2
        })
    );
}

#[test]
fn specs_parse_case_insensitively_into_canonical_round_tripping_strings() {
    let cases = [
        ("qwen2.5-vl", "qwen2.5-vl"),
        (" Qwen2.5-VL ", "qwen2.5-vl"),
        ("qwen2-vl", "qwen2-vl"),
        ("QWEN3-VL", "qwen3-vl"),
        ("qwen3.5", "qwen3.5"),
        ("gemma4", "gemma4"),
        ("gemma4:280", "gemma4"),
        ("gemma4:560", "gemma4:560"),
        ("gemma4:budget=1120", "gemma4:1120"),
        ("internvl", "internvl"),
        ("internvl:max_tiles=6", "internvl:6"),
        ("fixed:576", "fixed:576"),
        ("fixed:tokens=7", "fixed:7"),
        ("factor:1024", "factor:1024"),
        (
            "qwen2.5-vl:max_pixels=1003520",
            "qwen2.5-vl:max_pixels=1003520",
        ),
        (
            "qwen2.5-vl:max_pixels=1003520,min_pixels=3136",
            "qwen2.5-vl:max_pixels=1003520",
        ),
        (
            "qwen2.5-vl:max_pixels=1003520:min_pixels=200704",
            "qwen2.5-vl:min_pixels=200704,max_pixels=1003520",
        ),
        ("gemma4:560:markers=0", "gemma4:560:markers=0"),
        (
            "gemma4:patch_size=14,merge_size=4",
            "gemma4:patch_size=14,merge_size=4",
        ),
    ];
    for (spec, canonical) in cases {
        let p = Profile::parse(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert_eq!(p.spec, canonical, "{spec}");
        assert_eq!(p.to_string(), canonical);
        assert_eq!(
            Profile::parse(canonical).unwrap(),
            p,
            "{canonical} round trip"
        );
    }
}

#[test]
fn overrides_change_the_count_like_the_processor_config_would() {
    // transformers with max_pixels=1003520 (the class default) on 1920x1080: 1222 tokens.
    assert_eq!(
        tokens("qwen2.5-vl:max_pixels=1003520", 1920, 1080),
        Ok(1222)
    );
    assert_eq!(tokens("qwen2.5-vl:min_pixels=200704", 100, 50), Ok(276));
    assert_eq!(
        tokens("gemma4:patch_size=14,merge_size=4", 1920, 1080),
        Ok(264)
    );
    let params = ProfileParams {
        max_pixels: Some(1003520),
        ..ProfileParams::default()
    };
    let p = Profile::with_params("qwen2.5-vl", &params).unwrap();
    assert_eq!(p.spec, "qwen2.5-vl:max_pixels=1003520");
    assert_eq!(p.image_tokens(1920, 1080).map(|t| t.tokens), Ok(1222));
    // Params win over the spec.
    let params = ProfileParams {
        budget: Some(70),
        ..ProfileParams::default()
    };
    assert_eq!(
        Profile::with_params("gemma4:560", &params).unwrap().spec,
        "gemma4:70"
    );
}

#[test]
fn bad_specs_and_overrides_are_refused_with_the_problem_named() {
    assert!(is_bad_spec(Profile::parse("qwen9-vl"), "unknown profile"));
    assert!(is_bad_spec(Profile::parse(""), "unknown profile"));
    assert!(is_bad_spec(Profile::parse("gemma4:100"), "budget"));
    assert!(is_bad_spec(
        Profile::parse("gemma4:560:280"),
        "one bare value"
    ));
    assert!(is_bad_spec(Profile::parse("fixed"), "needs a count"));
    assert!(is_bad_spec(Profile::parse("fixed:abc"), "integer"));
    assert!(is_bad_spec(Profile::parse("fixed:-3"), "integer"));
    assert!(is_bad_spec(Profile::parse("factor"), "divisor"));
    assert!(is_bad_spec(Profile::parse("factor:0"), "at least 1"));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:600"),
        "no bare value"
    ));
    assert!(is_bad_spec(Profile::parse("qwen2.5-vl:"), "empty item"));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:max_pixel=5"),
        "unknown parameter `max_pixel`"
    ));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:patch_size=0"),
        "patch_size"
    ));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:merge_size=0"),
        "merge_size"
    ));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:min_pixels=100,max_pixels=99"),
        "greater than `max_pixels`"
    ));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:max_pixels=0"),
        "max_pixels"
    ));
    assert!(is_bad_spec(
        Profile::parse("qwen2.5-vl:budget=280"),
        "does not apply"
    ));
    assert!(is_bad_spec(
        Profile::parse("llava:max_tiles=3"),
        "does not apply"
    ));
    assert!(is_bad_spec(Profile::parse("internvl:0"), "max_tiles"));
    assert!(is_bad_spec(Profile::parse("internvl:1000"), "max_tiles"));
    assert!(is_bad_spec(Profile::parse("fixed:5:markers=65"), "markers"));
    // Parameter objects are checked the same way.
    let zero_patch = ProfileParams {
        patch_size: Some(0),
        ..ProfileParams::default()
    };
    assert!(is_bad_spec(
        Profile::with_params("qwen3-vl", &zero_patch),
        "patch_size"
    ));
    let e: Result<ProfileParams, _> = serde_json::from_str(r#"{"patch":14}"#);
    assert!(e.unwrap_err().to_string().contains("unknown field `patch`"));
}

#[test]
fn globs_are_case_insensitive_with_star_and_question_mark() {
    assert!(glob_match(
        "*QWEN2.5*vl*",
        "Qwen/Qwen2.5-VL-72B-Instruct-AWQ"
    ));
    assert!(glob_match("llava-?.?-*", "llava-1.5-7b-hf"));
    assert!(!glob_match("llava-?.?-*", "llava-v1.6-mistral"));
    assert!(glob_match("exact", "EXACT"));
    assert!(!glob_match("exact", "exact2"));
    assert!(glob_match("**a**", "a"));
    assert!(!glob_match("", "a"));
}

#[test]
fn builtin_rules_pick_the_family_from_common_model_names() {
    let config = ProfileConfig::default();
    let name = |model: &str| config.resolve(model).unwrap().spec;
    assert_eq!(name("Qwen/Qwen2-VL-7B-Instruct"), "qwen2-vl");
    assert_eq!(name("Qwen/Qwen2.5-VL-7B-Instruct"), "qwen2.5-vl");
    assert_eq!(name("Qwen/Qwen3-VL-30B-A3B-Instruct"), "qwen3-vl");
    assert_eq!(name("Qwen/Qwen3.5-27B"), "qwen3.5");
    assert_eq!(name("google/gemma-3-27b-it"), "gemma3");
    assert_eq!(name("google/gemma-4-31B-it"), "gemma4");
    assert_eq!(name("llava-hf/llava-1.5-7b-hf"), "llava");
    assert_eq!(name("OpenGVLab/InternVL3-8B"), "internvl");
    // Nothing matches: the default.
    assert_eq!(name("meta-llama/Llama-3.1-8B"), "qwen2.5-vl");
    for (pattern, spec) in BUILTIN_RULES {
        assert!(Profile::parse(spec).is_ok(), "{pattern} -> {spec}");
    }
}

#[test]
fn configured_rules_come_first_then_builtins_then_the_default() {
    let config: ProfileConfig = serde_json::from_str(
        r#"{
            "rules": [
                {"pattern": "*qwen2.5*small*", "profile": "qwen2.5-vl",
                 "params": {"max_pixels": 1003520}},
                {"pattern": "*qwen2.5*", "profile": "gemma4:560"},
                {"pattern": "*QWEN*", "profile": "fixed:1"}
            ],
            "default": "llava",
            "default_params": {"markers": 2}
        }"#,
    )
    .unwrap();
    assert!(config.validate().is_ok());
    let spec = |model: &str| config.resolve(model).unwrap().spec;
    assert_eq!(
        spec("Qwen2.5-VL-small"),
        "qwen2.5-vl:max_pixels=1003520",
        "first match wins"
    );
    assert_eq!(spec("qwen2.5-vl-7b"), "gemma4:560");
    assert_eq!(
        spec("qwen3-vl"),
        "fixed:1",
        "configured rules beat built-ins"
    );
    assert_eq!(spec("gemma-3-4b"), "gemma3", "built-ins before the default");
    assert_eq!(spec("mistral"), "llava:markers=2");

    let mut no_builtins = config.clone();
    no_builtins.builtin_rules = false;
    assert_eq!(
        no_builtins.resolve("gemma-3-4b").unwrap().spec,
        "llava:markers=2"
    );
}

#[test]
fn validate_names_the_bad_rule_or_default() {
    let mut config = ProfileConfig {
        rules: vec![
            ProfileRule {
                pattern: "*a*".into(),
                profile: "llava".into(),
                params: None,
            },
            ProfileRule {
                pattern: "*b*".into(),
                profile: "qwen2.5-vl".into(),
                params: Some(ProfileParams {
                    min_pixels: Some(10),
                    max_pixels: Some(5),
                    ..ProfileParams::default()
                }),
            },
        ],
        ..ProfileConfig::default()
    };
    let e = config.validate().unwrap_err().to_string();
    assert!(
        e.contains("rule 1") && e.contains("*b*") && e.contains("min_pixels"),
        "{e}"
    );
    config.rules.truncate(1);
    assert!(config.validate().is_ok());
    config.default = "gemma4:99".into();
    let e = config.validate().unwrap_err().to_string();
    assert!(e.contains("default") && e.contains("budget"), "{e}");
    config.default = "llava".into();
    config.rules[0].pattern.clear();
    assert!(
        config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("empty pattern")
    );
}

#[test]
fn router_config_accepts_profile_rules_with_params() {
    let config = mmrouter::config::RouterConfig::from_json(
        br#"{"profiles": {"rules": [{"pattern": "*", "profile": "qwen2.5-vl",
             "params": {"max_pixels": 1003520}}]}}"#,
    )
    .unwrap();
    assert_eq!(
        config.profiles.resolve("anything").unwrap().spec,
        "qwen2.5-vl:max_pixels=1003520"
    );
    let bad = mmrouter::config::RouterConfig::from_json(
        br#"{"profiles": {"rules": [{"pattern": "*", "profile": "gemma4:3"}]}}"#,
    );
    assert_eq!(bad.unwrap_err().field, "profiles");
}

const ALL_SPECS: [&str; 12] = [
    "qwen2.5-vl",
    "qwen3-vl",
    "gemma3",
    "gemma4:70",
    "gemma4:1120",
    "llava",
    "internvl",
    "internvl:256",
    "fixed:576",
    "factor:1",
    "qwen2.5-vl:min_pixels=12845056",
    "gemma4:patch_size=1,merge_size=1",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn no_size_up_to_100000_panics(w in 0u32..=100_000, h in 0u32..=100_000) {
        for spec in ALL_SPECS {
            let p = Profile::parse(spec).unwrap();
            if let Ok(t) = p.image_tokens(w, h) {
                prop_assert!(w > 0 && h > 0);
                prop_assert!(t.tokens > 0 || spec.starts_with("fixed"));
            }
        }
    }

    #[test]
    fn no_u32_size_panics(w in any::<u32>(), h in any::<u32>()) {
        for spec in ALL_SPECS {
            let _ = Profile::parse(spec).unwrap().image_tokens(w, h);
        }
    }

    #[test]
    fn qwen_counts_stay_within_the_pixel_bounds(w in 1u32..=20_000, h in 1u32..=20_000) {
        if let Ok(t) = Profile::parse("qwen2.5-vl").unwrap().image_tokens(w, h) {
            let px = u64::from(t.tokens) * 28 * 28;
            prop_assert!(px <= 12_845_056, "{}x{}: {} tokens", w, h, t.tokens);
            prop_assert!(px >= 3136);
        }
    }
}
