//! Command line: hand-rolled `--flag value` / `--flag=value` parsing.

use crate::kv_publisher::KvEventsConfig;
use std::fmt;

/// Everything the worker can be told, with its default.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `--host`, default `127.0.0.1`.
    pub host: String,
    /// `--port`, default 8000; 0 picks a free port (printed on stderr as `listening on ...`).
    pub port: u16,
    /// `--name`, default `mock-<port>` (the bound port): the `x-mock-worker` header value.
    pub name: Option<String>,
    /// `--model`, default `Qwen/Qwen2.5-VL-7B-Instruct`: the one served model name.
    pub model: String,
    /// `--profile`, default `qwen2.5-vl`: the image token profile (`mmrouter::tokens`).
    pub profile: String,
    /// `--block-size`, default 16 tokens per KV block.
    pub block_size: usize,
    /// `--num-gpu-blocks`, default 4096 KV blocks in the pool.
    pub num_gpu_blocks: u32,
    /// `--max-num-seqs`, default 256 concurrently running sequences.
    pub max_num_seqs: usize,
    /// `--prefill-tokens-per-sec`, default 20000 uncached prompt tokens per second (shared by
    /// all requests: prefills run one at a time).
    pub prefill_tokens_per_sec: f64,
    /// `--decode-tokens-per-sec`, default 100 output tokens per second per sequence.
    pub decode_tokens_per_sec: f64,
    /// `--encoder-ms-per-image`, default 30 ms per image not in the mm cache.
    pub encoder_ms_per_image: f64,
    /// `--time-scale`, default 1.0: multiplies every emulated duration; 0 = no sleeping.
    pub time_scale: f64,
    /// `--mm-cache-items`, default 1024 images remembered by the mm cache (LRU).
    pub mm_cache_items: usize,
    /// `--default-max-tokens`, default 16 output tokens when the request sets none.
    pub default_max_tokens: u32,
    /// `--kv-events-config JSON`, vLLM's flag: publish KV events over ZMQ. Default: none.
    pub kv_events: Option<Box<KvEventsConfig>>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host: "127.0.0.1".into(),
            port: 8000,
            name: None,
            model: "Qwen/Qwen2.5-VL-7B-Instruct".into(),
            profile: "qwen2.5-vl".into(),
            block_size: 16,
            num_gpu_blocks: 4096,
            max_num_seqs: 256,
            prefill_tokens_per_sec: 20_000.0,
            decode_tokens_per_sec: 100.0,
            encoder_ms_per_image: 30.0,
            time_scale: 1.0,
            mm_cache_items: 1024,
            default_max_tokens: 16,
            kv_events: None,
        }
    }
}

pub const USAGE: &str = "\
mock-worker: a mock vLLM OpenAI server with prefix-cache and timing emulation (no GPU)

USAGE: mock-worker [OPTIONS]

OPTIONS (defaults in brackets):
  --host HOST                    listen address [127.0.0.1]
  --port P                       listen port; 0 = any free port [8000]
  --name NAME                    value of the x-mock-worker response header [mock-<port>]
  --model MODEL                  served model name [Qwen/Qwen2.5-VL-7B-Instruct]
  --profile SPEC                 image token profile, e.g. qwen2.5-vl, fixed:576 [qwen2.5-vl]
  --block-size N                 tokens per KV block [16]
  --num-gpu-blocks N             KV blocks in the pool [4096]
  --max-num-seqs N               sequences running at once; others wait (FIFO) [256]
  --prefill-tokens-per-sec X     prefill speed for uncached tokens, shared [20000]
  --decode-tokens-per-sec X      decode speed per sequence [100]
  --encoder-ms-per-image X       encoder time per image not in the mm cache [30]
  --mm-cache-items N             images remembered by the mm cache [1024]
  --default-max-tokens N         output tokens when the request sets no max_tokens [16]
  --time-scale X                 multiplies every emulated duration; 0 = never sleep [1]
  --kv-events-config JSON        publish KV events over ZMQ as vLLM does, e.g.
                                 '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",
                                 \"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}'
                                 (tcp://*:0 = a free port on --host) [off]
  -h, --help                     this text

ENDPOINTS: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, POST /reset_prefix_cache. Image URLs: data:...;base64 and http:// (fetched, 5 s timeout); https:// is
refused (the mock has no TLS). See docs/MOCK_WORKER.md.
";

/// What the command line asked for.
#[derive(Debug, PartialEq)]
pub enum Command {
    Run(Config),
    Help,
}

#[derive(Debug, PartialEq)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (see --help)", self.0)
    }
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, CliError> {
    v.parse()
        .map_err(|_| CliError(format!("{flag}: `{v}` is not a valid number")))
}

fn positive(flag: &str, v: &str) -> Result<f64, CliError> {
    let x: f64 = num(flag, v)?;
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(CliError(format!("{flag}: must be a positive number")))
    }
}

fn non_negative(flag: &str, v: &str) -> Result<f64, CliError> {
    let x: f64 = num(flag, v)?;
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(CliError(format!("{flag}: must be zero or more")))
    }
}

fn at_least_one<T: std::str::FromStr + PartialOrd + From<u8>>(
    flag: &str,
    v: &str,
) -> Result<T, CliError> {
    let x: T = num(flag, v)?;
    if x >= T::from(1u8) {
        Ok(x)
    } else {
        Err(CliError(format!("{flag}: must be at least 1")))
    }
}

/// Every flag that takes a value.
const FLAGS: &[&str] = &[
    "--host",
    "--port",
    "--name",
    "--model",
    "--profile",
    "--block-size",
    "--num-gpu-blocks",
    "--max-num-seqs",
    "--prefill-tokens-per-sec",
    "--decode-tokens-per-sec",
    "--encoder-ms-per-image",
    "--time-scale",
    "--mm-cache-items",
    "--default-max-tokens",
    "--kv-events-config",
];

/// Parses the arguments after the program name.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Command, CliError> {
    let mut c = Config::default();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if !flag.starts_with("--") {
            return Err(CliError(format!("unexpected argument `{arg}`")));
        }
        if !FLAGS.contains(&flag.as_str()) {
            return Err(CliError(format!("unknown option `{flag}`")));
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .ok_or_else(|| CliError(format!("{flag} needs a value")))?,
        };
        let v = value.as_str();
        match flag.as_str() {
            "--host" => c.host = value.clone(),
            "--port" => c.port = num(&flag, v)?,
            "--name" => c.name = Some(value.clone()),
            "--model" => c.model = value.clone(),
            "--profile" => c.profile = value.clone(),
            "--block-size" => c.block_size = at_least_one(&flag, v)?,
            "--num-gpu-blocks" => c.num_gpu_blocks = at_least_one(&flag, v)?,
            "--max-num-seqs" => c.max_num_seqs = at_least_one(&flag, v)?,
            "--prefill-tokens-per-sec" => c.prefill_tokens_per_sec = positive(&flag, v)?,
            "--decode-tokens-per-sec" => c.decode_tokens_per_sec = positive(&flag, v)?,
            "--encoder-ms-per-image" => c.encoder_ms_per_image = non_negative(&flag, v)?,
            "--time-scale" => c.time_scale = non_negative(&flag, v)?,
            "--mm-cache-items" => c.mm_cache_items = num(&flag, v)?,
            "--default-max-tokens" => c.default_max_tokens = at_least_one(&flag, v)?,
            "--kv-events-config" => {
                c.kv_events = Some(Box::new(KvEventsConfig::parse(v).map_err(CliError)?))
            }
            _ => return Err(CliError(format!("unknown option `{flag}`"))),
        }
    }
    Ok(Command::Run(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flags_with_space_or_equals_and_defaults() {
        let Ok(Command::Run(c)) =
            parse_args(args("--port 0 --name=w1 --num-gpu-blocks 8 --time-scale=0"))
        else {
            panic!("parse failed")
        };
        assert_eq!(c.port, 0);
        assert_eq!(c.name.as_deref(), Some("w1"));
        assert_eq!(c.num_gpu_blocks, 8);
        assert_eq!(c.time_scale, 0.0);
        assert_eq!(c.block_size, 16);
        assert_eq!(parse_args(args("--help")), Ok(Command::Help));
        let Ok(Command::Run(c)) = parse_args(vec![
            "--kv-events-config".to_string(),
            r#"{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:0"}"#.to_string(),
        ]) else {
            panic!("parse failed")
        };
        let kv = c.kv_events.unwrap();
        assert!(kv.publishes());
        assert_eq!(kv.endpoint, "tcp://*:5557");
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://*:0"));
        assert!(parse_args(args("--kv-events-config {")).is_err());
    }

    #[test]
    fn bad_values_are_errors() {
        assert!(parse_args(args("--port x")).is_err());
        assert!(parse_args(args("--block-size 0")).is_err());
        assert!(parse_args(args("--decode-tokens-per-sec 0")).is_err());
        assert!(parse_args(args("--time-scale -1")).is_err());
        assert_eq!(
            parse_args(args("--bogus")),
            Err(CliError("unknown option `--bogus`".into()))
        );
        assert!(parse_args(args("--port")).is_err());
        assert!(parse_args(args("stray")).is_err());
    }
}
