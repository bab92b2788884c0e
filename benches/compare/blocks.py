"""Every request of a trace, built before the replay: body bytes, tokens, KV block ids, answer.

A turn re-sends the conversation with the answers the worker streamed. The mock's answer
depends only on the prompt, so the whole conversation can be built ahead of time with the
`trace-blocks` tool (benches/compare/trace_blocks.rs: the mock's template, tokenizer and block
hashing, run offline). That gives, per request, the exact bytes every system is sent, and the
prompt's block ids that the offline bounds (sim.py) need. The replay checks each streamed
answer against the precomputed one (`answer_mismatch` in the results).
"""
import json
import re
import subprocess
from dataclasses import dataclass, field, replace

import trace as tracegen

DATA_URL = re.compile(rb"data:image/[a-z]+;base64,[A-Za-z0-9+/=]+")


@dataclass
class Request:
    session: int
    turn: int
    body: bytes
    prompt_tokens: int
    max_tokens: int
    images: int  # images in this turn's message
    images_in_prompt: int  # images in the whole conversation
    blocks: list  # the prompt's full KV blocks (ids), in order
    finish_blocks: list  # further full blocks cached when the request finishes
    output: str  # the answer the mock streams
    think: float = 0.0
    at: float = 0.0
    extra: dict = field(default_factory=dict)


class TraceBlocks:
    """The trace-blocks tool as a line-by-line subprocess."""

    def __init__(self, binary, block_size=16, profile="qwen2.5-vl"):
        self.proc = subprocess.Popen(
            [str(binary), "--block-size", str(block_size), "--profile", profile],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def describe(self, body):
        self.proc.stdin.write(body + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("trace-blocks exited")
        out = json.loads(line)
        if "error" in out:
            raise ValueError(f"trace-blocks: {out['error']}")
        return out

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def expand(header, turns, pool, tool):
    """Requests of every turn, sessions in trace order, turns in order."""
    out = []
    for ts in tracegen.sessions_of(turns).values():
        messages = [{"role": "system", "content": header["system_prompts"][ts[0]["system"]]}]
        n_images = 0
        for t in ts:
            messages.append(tracegen.user_message(t["text"], t["images"], pool))
            n_images += len(t["images"])
            b = tracegen.body(messages, t["max_tokens"])
            d = tool.describe(b)
            out.append(Request(
                session=t["session"], turn=t["turn"], body=b, prompt_tokens=d["prompt_tokens"],
                max_tokens=d["max_tokens"], images=len(t["images"]), images_in_prompt=n_images,
                blocks=d["blocks"], finish_blocks=d["finish_blocks"], output=d["output"],
                think=t.get("think", 0.0), at=t.get("at", 0.0)))
            messages.append({"role": "assistant", "content": d["output"]})
    return out


def by_url(requests, pool, base):
    """Copies of `requests` whose images are http URLs on the image server at `base`, not
    inline data URLs. Block ids, tokens and answers stay: the mock keys an image by its bytes,
    however they arrived."""
    urls = {pool.data_url(i).encode(): pool.http_url(i, base).encode() for i in pool.specs}
    swap = lambda m: urls[m.group(0)]  # noqa: E731  (every data URL of a trace is the pool's)
    return [replace(r, body=DATA_URL.sub(swap, r.body)) for r in requests]


def fit_to_cache(requests, gpu_blocks, block_size=16):
    """Cuts every session before its first turn that can never fit in `gpu_blocks` blocks
    (the mock refuses prompt + max_tokens over the pool with a 400). Returns (kept, dropped
    count)."""
    cap = gpu_blocks * block_size
    kept, dropped, cut = [], 0, set()
    for r in requests:
        if r.session in cut or r.prompt_tokens + r.max_tokens > cap:
            cut.add(r.session)
            dropped += 1
            continue
        kept.append(r)
    return kept, dropped
