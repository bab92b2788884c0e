//! The table of docs/ROUTING.md, "Scoring options at a glance", against `ScoringConfig`
//! (src/scoring.rs): one row per field, in the struct's order, each at its default.
//!
//! The struct's order is the order of the keys of `serde_json::to_value(default)`: serde
//! serializes fields in declaration order, and the crate enables serde_json's
//! `preserve_order` (Cargo.toml), so the map keeps that order instead of sorting the keys.

use mmrouter::scoring::ScoringConfig;
use serde_json::Value;
use std::path::Path;

const SECTION: &str = "## Scoring options at a glance";

/// The serialized default's fields, in struct order.
fn defaults() -> Vec<(String, Value)> {
    match serde_json::to_value(ScoringConfig::default()).expect("ScoringConfig serializes") {
        Value::Object(map) => map.into_iter().collect(),
        other => panic!("ScoringConfig serialized to {other}, not an object"),
    }
}

/// The section's table rows whose first cell is `` `name` ``: (name, default cell without
/// its backticks), in the document's order.
fn table_rows() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ROUTING.md");
    let text = std::fs::read_to_string(&path).expect("docs/ROUTING.md is readable");
    let start = text
        .lines()
        .position(|line| line.trim_end() == SECTION)
        .unwrap_or_else(|| panic!("docs/ROUTING.md has no section `{SECTION}`"));
    let rows: Vec<(String, String)> = text
        .lines()
        .skip(start + 1)
        .take_while(|line| !line.starts_with("## "))
        .filter_map(|line| {
            let cells: Vec<&str> = line.trim().strip_prefix('|')?.split('|').collect();
            let name = cells.first()?.trim();
            let name = name.strip_prefix('`')?.strip_suffix('`')?;
            if name.is_empty() || name.contains('`') {
                return None;
            }
            let default = cells
                .get(1)
                .unwrap_or_else(|| panic!("the row of `{name}` has no default cell"))
                .trim()
                .trim_matches('`')
                .to_string();
            Some((name.to_string(), default))
        })
        .collect();
    assert!(
        !rows.is_empty(),
        "the section `{SECTION}` has no option rows"
    );
    rows
}

#[test]
fn every_scoring_option_is_in_the_table_once() {
    let rows = table_rows();
    let fields = defaults();
    for (field, _) in &fields {
        let times = rows.iter().filter(|(name, _)| name == field).count();
        assert_eq!(
            times, 1,
            "`{field}` is a ScoringConfig field and appears {times} times in the table of \
             docs/ROUTING.md, `{SECTION}` (expected once)"
        );
    }
    for (name, _) in &rows {
        assert!(
            fields.iter().any(|(field, _)| field == name),
            "the table of docs/ROUTING.md, `{SECTION}`, has a row for `{name}`, which is no \
             ScoringConfig field"
        );
    }
}

#[test]
fn the_table_lists_the_options_in_the_structs_order() {
    let rows = table_rows();
    let fields = defaults();
    for (i, ((name, _), (field, _))) in rows.iter().zip(&fields).enumerate() {
        assert_eq!(
            name,
            field,
            "row {} of the table of docs/ROUTING.md names `{name}` where ScoringConfig's \
             field {} is `{field}`",
            i + 1,
            i + 1
        );
    }
    assert_eq!(
        rows.len(),
        fields.len(),
        "the table has {} rows and ScoringConfig {} fields",
        rows.len(),
        fields.len()
    );
}

#[test]
fn the_table_shows_each_option_at_its_default() {
    let rows = table_rows();
    for (field, default) in defaults() {
        let Some((_, cell)) = rows.iter().find(|(name, _)| *name == field) else {
            panic!("`{field}` has no row in the table of docs/ROUTING.md, `{SECTION}`");
        };
        let shown: Value = serde_json::from_str(cell).unwrap_or_else(|e| {
            panic!("the default of `{field}` in the table, `{cell}`, is not JSON: {e}")
        });
        let same = match (&shown, &default) {
            (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
            (a, b) => a == b,
        };
        assert!(
            same,
            "the table shows `{field}` at `{cell}`, but its default is `{default}`"
        );
    }
}
