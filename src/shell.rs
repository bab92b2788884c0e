//! What the browser shell ([`crate::web`]) and the WIT component ([`crate::component`]) both
//! do on top of the core, so the two cannot drift: analyse a body with caller options, list
//! the profile specs, and choose a worker from explicit per-worker block holdings.

use crate::analysis::{Analysis, Overrides, analyze_with};
use crate::config::RouterConfig;
use crate::index::PrefixIndex;
use crate::scoring::{WorkerLoad, choose};
use crate::tokens::Profile;

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

/// A worker for [`score`]: the block keys it holds and its load.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerState {
    /// Block keys held, in prefix order (inserted into the index as one request's chain).
    pub held: Vec<u64>,
    pub load: WorkerLoad,
}

/// The outcome of [`score`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scored {
    /// Index into the workers given.
    pub worker: usize,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    /// Leading blocks of the request held by each worker, in the order given.
    pub matched: Vec<usize>,
}

/// Chooses a worker for a request whose block keys are `keys`: the workers' holdings go into a
/// fresh [`PrefixIndex`] (configured by `config.index`, all at time 0), the request's prefix
/// is matched against it and [`choose`] weighs the overlap against the loads with
/// `config.scoring`; `seed` is the tie-break randomness handed to [`choose`].
pub fn score(
    keys: &[u64],
    workers: &[WorkerState],
    config: &RouterConfig,
    seed: u64,
) -> Result<Scored, String> {
    if workers.is_empty() {
        return Err("no workers to choose from".to_string());
    }
    let mut index = PrefixIndex::new(config.index.clone(), workers.len());
    for (w, state) in workers.iter().enumerate() {
        index.insert(w, &state.held, 0);
    }
    let mut matched = Vec::with_capacity(workers.len());
    index.match_prefix(keys, 0, &mut matched);
    let loads: Vec<WorkerLoad> = workers.iter().map(|w| w.load).collect();
    let choice = choose(keys.len(), &matched, &loads, &config.scoring, seed)
        .ok_or_else(|| "no worker could be chosen".to_string())?;
    Ok(Scored {
        worker: choice.worker,
        matched_blocks: choice.matched_blocks,
        total_blocks: choice.total_blocks,
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
                load: WorkerLoad::default(),
            },
        ];
        let s = score(&[1, 2, 3, 4], &workers, &RouterConfig::default(), 7).unwrap();
        assert_eq!(s.matched.len(), 2);
        assert_eq!(s.total_blocks, 4);
        assert!(s.worker < 2);
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
