//! What the browser shell (`crate::web`, feature `web`) and the WIT component
//! (`crate::component`, feature `component`) both do on top of the core, so the two cannot
//! drift: analyse a body with caller options, list the profile specs, and choose a worker
//! from explicit per-worker block holdings.

use crate::analysis::{Analysis, Overrides, analyze_with};
use crate::config::RouterConfig;
use crate::scoring::{Candidate, Estimate, RequestSize, choose};
use crate::tokens::Profile;
use std::collections::HashSet;

/// Profile specs the demos offer. Each is checked with [`Profile::parse`] before it is listed
/// (see [`builtin_profiles`]), so a spec the core does not accept is never offered.
pub const KNOWN_PROFILES: &[&str] = &[
    "qwen2.5-vl",
    "qwen3-vl",
    "gemma3",
    "gemma4:280",
    "gemma4:560",
    "llava",
    "internvl",
    "fixed:576",
];

/// [`KNOWN_PROFILES`] that the core accepts, in that order.
pub fn builtin_profiles() -> Vec<String> {
    KNOWN_PROFILES
        .iter()
        .filter(|s| Profile::parse(s).is_ok())
        .map(|s| (*s).to_string())
        .collect()
}

/// How to analyse a body; `None` everywhere means the defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct InspectOptions<'a> {
    /// Profile spec instead of the model-name rules.
    pub profile: Option<&'a str>,
    /// Analyse as if the body named this model.
    pub model: Option<&'a str>,
    /// Router configuration JSON ([`RouterConfig::from_json`]); default [`RouterConfig::default`].
    pub config_json: Option<&'a str>,
    /// Tokens per KV block, overriding the configuration's (default: the configuration's, 16).
    pub block_size: Option<usize>,
}

/// The configuration named by `config_json`, or the default one.
pub fn config_from(config_json: Option<&str>) -> Result<RouterConfig, String> {
    match config_json {
        Some(text) => RouterConfig::from_json(text.as_bytes()).map_err(|e| e.to_string()),
        None => Ok(RouterConfig::default()),
    }
}

/// Analyses `body` as `mmrouter inspect` does, with `options`.
pub fn inspect(body: &[u8], options: InspectOptions<'_>) -> Result<Analysis, String> {
    let mut config = config_from(options.config_json)?;
    if let Some(block_size) = options.block_size {
        config.block_size = block_size;
        config.validate().map_err(|e| e.to_string())?;
    }
    let profile = match options.profile.map(str::trim) {
        None | Some("") => None,
        Some(spec) => Some(Profile::parse(spec).map_err(|e| e.to_string())?),
    };
    let overrides = Overrides {
        model: options.model,
        profile: profile.as_ref(),
    };
    analyze_with(body, &config, overrides).map_err(|e| e.to_string())
}

/// A worker for [`score`]: the block keys it holds and what the router knows of its load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerState {
    /// Block keys held (e.g. the keys of requests it served).
    pub held: Vec<u64>,
    /// Its load and metrics; `matched_blocks` is computed from `held`.
    pub load: Candidate,
}

/// The outcome of [`score`].
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Index into the workers given.
    pub worker: usize,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// Leading blocks of the request held by each worker, in the order given.
    pub matched: Vec<usize>,
    /// The chosen worker's estimate (wait, prefill, recompute, cost).
    pub estimate: Estimate,
}

/// Chooses a worker for a request whose block keys are `keys` (a prompt of `keys.len()` full
/// blocks of `config.block_size` tokens): each worker's matched prefix is the leading run of
/// `keys` it holds, and [`choose`] weighs it against the worker's load with `config.scoring`;
/// `seed` is the tie-break randomness.
pub fn score(
    keys: &[u64],
    workers: &[WorkerState],
    config: &RouterConfig,
    seed: u64,
) -> Result<Scored, String> {
    if workers.is_empty() {
        return Err("no workers to choose from".to_string());
    }
    let matched: Vec<usize> = workers
        .iter()
        .map(|w| {
            let held: HashSet<u64> = w.held.iter().copied().collect();
            keys.iter().take_while(|k| held.contains(k)).count()
        })
        .collect();
    let candidates: Vec<Candidate> = workers
        .iter()
        .zip(&matched)
        .map(|(w, &m)| Candidate {
            matched_blocks: m,
            ..w.load
        })
        .collect();
    let request = RequestSize {
        total_blocks: keys.len(),
        prompt_tokens: keys.len() * config.block_size,
        block_size: config.block_size,
    };
    let choice = choose(request, &candidates, &config.scoring, seed)
        .ok_or_else(|| "no worker could be chosen".to_string())?;
    Ok(Scored {
        worker: choice.index,
        matched_blocks: matched.get(choice.index).copied().unwrap_or(0),
        total_blocks: keys.len(),
        estimate: choice.estimate(),
        matched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_profile_parses() {
        let listed = builtin_profiles();
        assert!(listed.contains(&"qwen2.5-vl".to_string()));
        for spec in &listed {
            assert!(Profile::parse(spec).is_ok(), "{spec}");
        }
    }

    #[test]
    fn score_refuses_an_empty_worker_list() {
        let e = score(&[1, 2], &[], &RouterConfig::default(), 0).unwrap_err();
        assert!(e.contains("no workers"), "{e}");
    }

    #[test]
    fn score_reports_one_match_count_per_worker() {
        let workers = vec![
            WorkerState::default(),
            WorkerState {
                held: vec![1, 2, 3],
                load: Candidate::default(),
            },
        ];
        let s = score(&[1, 2, 3, 4], &workers, &RouterConfig::default(), 7).unwrap();
        assert_eq!(s.matched, vec![0, 3]);
        assert_eq!(s.total_blocks, 4);
        assert_eq!(s.worker, 1, "both idle: the one holding 3 of 4 blocks");
    }

    #[test]
    fn inspect_honours_block_size_and_refuses_bad_ones() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"enough words to fill a few blocks of eight pseudo tokens each, for sure"}]}"#;
        let a16 = inspect(body, InspectOptions::default()).unwrap();
        let a8 = inspect(
            body,
            InspectOptions {
                block_size: Some(8),
                ..InspectOptions::default()
            },
        )
        .unwrap();
        assert_eq!(a16.layout.block_size, 16);
        assert_eq!(a8.layout.block_size, 8);
        assert!(a8.layout.keys.len() > a16.layout.keys.len());
        let bad = InspectOptions {
            block_size: Some(0),
            ..InspectOptions::default()
        };
        assert!(inspect(body, bad).is_err());
        let bad = InspectOptions {
            config_json: Some(r#"{"block_sise":16}"#),
            ..InspectOptions::default()
        };
        assert!(inspect(body, bad).unwrap_err().contains("block_sise"));
    }
}
