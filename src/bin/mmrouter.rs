//! `mmrouter`: the router's core on the command line.
//!
//! ```text
//! mmrouter inspect [--model NAME] [--profile SPEC] [--config FILE] [FILE|-]
//! mmrouter defaults
//! mmrouter check-config [FILE|-]
//! ```
//! reads one chat-completions (or completions) body and prints one JSON object: the images
//! with their identity, size and tokens, and the prompt's KV blocks (see `mmrouter::report`).
//! On bad input it exits with status 1 and prints one line naming the problem.
//! `defaults` prints the router configuration with every field at its default: the complete,
//! current reference of the knobs (the filter's plugin configuration takes the same fields).
//! `check-config` validates a whole plugin configuration (workers, sidecar, state, and the
//! router fields) with the filter's own parser, exactly as `on_configure` does: it prints `ok`
//! and exits 0, or prints the refused field and exits 1.

use mmrouter::analysis::{Overrides, analyze_with};
use mmrouter::config::RouterConfig;
use mmrouter::filter::config::FilterConfig;
use mmrouter::report::inspect_json;
use mmrouter::tokens::Profile;
use std::io::Read;
use std::process::ExitCode;

const USAGE: &str =
    "usage: mmrouter inspect [--model NAME] [--profile SPEC] [--config FILE] [FILE|-]

  Reads one OpenAI chat-completions or completions body (from FILE, or stdin when FILE is
  absent or -) and prints what the router sees: each image's identity, size and tokens, the
  prompt's token count and its KV block keys.

  --model NAME     analyse as if the body named this model
  --profile SPEC   token profile instead of the model-name rules (qwen2.5-vl, qwen3-vl,
                   gemma3, gemma4[:BUDGET], llava, internvl, fixed:N, factor:F)
  --config FILE    router configuration JSON (block_size, profiles, limits, ...)

  `mmrouter defaults` prints that configuration with every field at its default.
  `mmrouter check-config [FILE|-]` validates a filter plugin configuration (the JSON given to
  Envoy or an Istio WasmPlugin's pluginConfig) with the filter's own parser.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(out) => {
            use std::io::Write;
            // A reader that went away (`| head`) ends the output quietly, as other CLIs do.
            match writeln!(std::io::stdout().lock(), "{out}") {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    eprintln!("mmrouter: writing the output: {e}");
                    ExitCode::FAILURE
                }
                _ => ExitCode::SUCCESS,
            }
        }
        Err(Failure::Usage(msg)) => {
            if !msg.is_empty() {
                eprintln!("mmrouter: {msg}");
            }
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Input(msg)) => {
            eprintln!("mmrouter: {msg}");
            ExitCode::from(1)
        }
    }
}

enum Failure {
    Usage(String),
    Input(String),
}

fn run(args: &[String]) -> Result<String, Failure> {
    let mut it = args.iter();
    match it.next().map(String::as_str) {
        Some("inspect") => {}
        Some("defaults") => {
            return serde_json::to_string_pretty(&RouterConfig::default())
                .map_err(|e| Failure::Input(e.to_string()));
        }
        Some("check-config") => {
            let text = read_input(it.next().map(String::as_str))?;
            return FilterConfig::from_json(&text)
                .map(|_| "ok".to_string())
                .map_err(|e| Failure::Input(e.to_string()));
        }
        Some("-h" | "--help" | "help") | None => return Err(Failure::Usage(String::new())),
        Some(other) => return Err(Failure::Usage(format!("unknown command `{other}`"))),
    }
    let (mut model, mut profile, mut config_path, mut input) = (None, None, None, None);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| Failure::Usage(format!("{name} needs a value")))
        };
        match arg.as_str() {
            "--model" => model = Some(value("--model")?),
            "--profile" => profile = Some(value("--profile")?),
            "--config" => config_path = Some(value("--config")?),
            "-h" | "--help" => return Err(Failure::Usage(String::new())),
            flag if flag.starts_with("--") => {
                return Err(Failure::Usage(format!("unknown option `{flag}`")));
            }
            path => {
                if input.replace(path.to_string()).is_some() {
                    return Err(Failure::Usage("more than one input file".into()));
                }
            }
        }
    }
    let config = match &config_path {
        Some(path) => {
            let text = std::fs::read(path).map_err(|e| Failure::Input(format!("{path}: {e}")))?;
            RouterConfig::from_json(&text).map_err(|e| Failure::Input(format!("{path}: {e}")))?
        }
        None => RouterConfig::default(),
    };
    let profile = match &profile {
        Some(spec) => Some(Profile::parse(spec).map_err(|e| Failure::Input(e.to_string()))?),
        None => None,
    };
    let body = read_input(input.as_deref())?;
    let overrides = Overrides {
        model: model.as_deref(),
        profile: profile.as_ref(),
    };
    let analysis =
        analyze_with(&body, &config, overrides).map_err(|e| Failure::Input(e.to_string()))?;
    serde_json::to_string_pretty(&inspect_json(&analysis))
        .map_err(|e| Failure::Input(e.to_string()))
}

/// A file's bytes, or stdin's when `path` is None or `-`.
fn read_input(path: Option<&str>) -> Result<Vec<u8>, Failure> {
    match path {
        None | Some("-") => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .map_err(|e| Failure::Input(format!("stdin: {e}")))?;
            Ok(buf)
        }
        Some(path) => std::fs::read(path).map_err(|e| Failure::Input(format!("{path}: {e}"))),
    }
}
