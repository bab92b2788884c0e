"""The upstream every benchmark cell uses: one nginx (Debian's, with its echo module) that reads
the whole request body, then answers a fixed chat.completion.

It listens on 0.0.0.0:PORT, so it answers every 127.x.y.z:PORT (all of 127/8 is loopback on
Linux): N synthetic workers are N loopback addresses of this one server. `/metrics` answers a
fixed vLLM Prometheus text, so the filter's polls of the workers parse as they would on vLLM.
"""
import json
import os
from pathlib import Path

import processes

ECHO_MODULE = "/usr/lib/nginx/modules/ngx_http_echo_module.so"

CHAT_COMPLETION = json.dumps({
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1767225600,
    "model": "Qwen/Qwen2.5-VL-7B-Instruct",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "A small benchmark answer."}}],
    "usage": {"prompt_tokens": 512, "completion_tokens": 6, "total_tokens": 518},
}, separators=(",", ":"))

VLLM_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 1.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{model_name="Qwen/Qwen2.5-VL-7B-Instruct"} 0.25\n'
)


def _quoted(text):
    """An nginx single-quoted string ($ would start a variable in echo: none in our texts)."""
    assert "$" not in text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def config(run_dir, port, workers):
    run_dir = Path(run_dir).resolve()
    return f"""# Written by benches/proxy/upstream.py
load_module {ECHO_MODULE};
daemon off;
master_process on;
worker_processes {workers};
pid {run_dir}/nginx.pid;
error_log {run_dir}/nginx-error.log warn;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  client_body_temp_path {run_dir}/nginx-body;
  proxy_temp_path {run_dir}/nginx-proxy;
  fastcgi_temp_path {run_dir}/nginx-fastcgi;
  uwsgi_temp_path {run_dir}/nginx-uwsgi;
  scgi_temp_path {run_dir}/nginx-scgi;
  # Bodies stay in memory (a buffer of the body's size), never in a temporary file.
  client_max_body_size 64m;
  client_body_buffer_size 64m;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  server {{
    listen 0.0.0.0:{port} backlog=4096;
    location = /metrics {{
      default_type text/plain;
      return 200 {_quoted(VLLM_METRICS)};
    }}
    location / {{
      default_type application/json;
      echo_read_request_body;
      echo -n {_quoted(CHAT_COMPLETION)};
    }}
  }}
}}
"""


def worker_addresses(n, port):
    """n distinct loopback addresses on port (127.0.1.1, 127.0.1.2, ..., 250 per /24): n
    synthetic workers, all answered by the one nginx listening on 0.0.0.0:port."""
    if n > 250 * 250:
        raise ValueError("at most 62,500 synthetic workers")
    return [f"127.0.{1 + i // 250}.{1 + i % 250}:{port}" for i in range(n)]


class Nginx:
    """One nginx master (and its worker processes) on 0.0.0.0:port."""

    def __init__(self, procs, run_dir, port, workers=1, binary="nginx"):
        if not os.path.exists(ECHO_MODULE):
            raise RuntimeError(f"{ECHO_MODULE} missing: apt-get install libnginx-mod-http-echo")
        self.port = port
        run_dir = Path(run_dir).resolve()
        for d in ("nginx-body", "nginx-proxy", "nginx-fastcgi", "nginx-uwsgi", "nginx-scgi"):
            (run_dir / d).mkdir(parents=True, exist_ok=True)
            os.chmod(run_dir / d, 0o777)  # nginx's workers drop root
        conf = run_dir / "nginx.conf"
        conf.write_text(config(run_dir, port, workers))
        self.proc = procs.start([binary, "-p", str(run_dir), "-c", str(conf),
                                 "-e", str(run_dir / "nginx-error.log")],
                                run_dir / "nginx.log")
        if not processes.wait_port("127.0.0.1", port, 10, self.proc):
            raise RuntimeError(f"nginx did not start on port {port}: see {run_dir}/nginx-error.log")

    def cpu_ticks(self):
        """CPU of the master and its workers, in clock ticks."""
        pids = [self.proc.pid] + processes.children(self.proc.pid)
        total = 0
        for pid in pids:
            try:
                total += processes.cpu_ticks(pid)
            except OSError:
                pass
        return total
