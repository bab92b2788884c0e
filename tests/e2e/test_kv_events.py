"""The mock worker's KV events through libzmq (pyzmq), as a Python consumer of vLLM's events
would read them: the mock publishes with the pure-Rust `zeromq` crate, and this proves the
two ZMTP implementations interoperate (PUB -> SUB, ROUTER <-> DEALER and REQ).

Decoding is plain msgpack (msgspec), checked against the shapes of vLLM 0.33's
`vllm/distributed/kv_events.py`; scripts/make-kv-event-fixtures.py --check goes further and
decodes with vLLM's own classes (it needs the vLLM wheel).
"""
import base64
import json
import subprocess
import time
import urllib.request

import msgspec
import pytest
import zmq

from conftest import png
from stack import MOCK

UUID = "0123456789abcdef0123456789abcdef"
IMAGE_PAD = 151655


@pytest.fixture
def worker():
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0", "topic": "kv@w0@qwen", "buffer_steps": 50}
    proc = subprocess.Popen(
        [str(MOCK), "--port", "0", "--time-scale", "0", "--name", "w0",
         "--kv-events-config", json.dumps(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    endpoints = {}
    for line in proc.stderr:
        words = line.split()
        if "kv-events" in words:
            endpoints["pub"] = words[words.index("on") + 1]
            endpoints["replay"] = words[words.index("replay") + 1]
        if "listening" in words:
            endpoints["http"] = "http://" + words[words.index("on") + 1]
            break
    assert set(endpoints) == {"pub", "replay", "http"}, endpoints
    ctx = zmq.Context()
    yield endpoints, ctx
    ctx.destroy(linger=0)
    proc.terminate()
    proc.wait(timeout=10)


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def live_sub(ctx, endpoints):
    """A SUB whose subscription is live: reset the empty cache until AllBlocksCleared arrives."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@w0")
    sub.connect(endpoints["pub"])
    sub.RCVTIMEO = 300
    deadline = time.time() + 10
    while time.time() < deadline:
        assert post(endpoints["http"], "/reset_prefix_cache", {}) == {"success": True}
        try:
            return sub, [sub.recv_multipart()]
        except zmq.Again:
            continue
    raise AssertionError("no event reached the libzmq subscriber")


def image_chat(side=448):
    url = "data:image/png;base64," + base64.b64encode(png(side, side, seed=5)).decode()
    return {"model": "Qwen/Qwen2.5-VL-7B-Instruct", "max_tokens": 2, "cache_salt": "tenant-1",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "describe"},
                {"type": "image_url", "image_url": {"url": url}, "uuid": UUID}]}]}


def test_libzmq_sub_receives_vllm_shaped_batches_from_the_mock(worker):
    endpoints, ctx = worker
    sub, got = live_sub(ctx, endpoints)
    resp = post(endpoints["http"], "/v1/chat/completions", image_chat())
    blocks = resp["usage"]["prompt_tokens"] // 16
    sub.RCVTIMEO = 10_000
    stored = []
    while sum(len(e["block_hashes"]) for e in stored) < blocks:
        frames = sub.recv_multipart()
        got.append(frames)
        batch = msgspec.msgpack.decode(frames[2])
        stored += [e for e in batch[1] if e["type"] == "BlockStored"]
    for topic, seq, payload in got:
        assert topic == b"kv@w0@qwen" and len(seq) == 8
        ts, events, rank = msgspec.msgpack.decode(payload)  # EventBatch: [ts, events, rank]
        assert abs(ts - time.time()) < 60 and rank == 0
    seqs = [int.from_bytes(s, "big") for _, s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    tokens = [t for e in stored for t in e["token_ids"]]
    keys = [k for e in stored for k in e["extra_keys"]]
    start = tokens.index(IMAGE_PAD)
    for i, block_keys in enumerate(keys):
        lo = 16 * i
        want = [[UUID, start - lo]] if start < lo + 16 and start + 256 > lo else []
        if i == 0:
            want.append("tenant-1")
        assert (block_keys or []) == want, (i, block_keys)
    first = stored[0]
    # vLLM 0.33's map: the tag first, lora_id always written, defaults (None) omitted.
    assert list(first)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name"]
    assert first["lora_id"] is None and first["medium"] == "GPU" and first["group_idx"] == 0
    assert all(isinstance(h, int) and 0 <= h < 2**64 for e in stored for h in e["block_hashes"])


def test_libzmq_dealer_and_req_get_replays_then_the_end_marker(worker):
    endpoints, ctx = worker
    sub, got = live_sub(ctx, endpoints)
    post(endpoints["http"], "/v1/chat/completions", image_chat(224))
    assert post(endpoints["http"], "/reset_prefix_cache", {}) == {"success": True}
    sub.RCVTIMEO = 10_000
    while msgspec.msgpack.decode(got[-1][2])[1][-1]["type"] != "AllBlocksCleared" or len(got) < 3:
        got.append(sub.recv_multipart())
    live = {int.from_bytes(s, "big"): (t, p) for t, s, p in got}

    dealer = ctx.socket(zmq.DEALER)
    dealer.RCVTIMEO = 10_000
    dealer.connect(endpoints["replay"])
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while True:
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b""
        n = int.from_bytes(seq, "big", signed=True)
        if n == -1:
            assert (topic, payload) == (b"", b"")
            break
        replayed.append(n)
        if n in live:
            assert (topic, payload) == live[n], "a replayed batch is the live one, byte for byte"
    assert replayed == list(range(0, max(live) + 1))

    # A REQ socket (vLLM's docstring says REQ clients) receives only the first reply of a
    # replay: REQ takes one answer per request.
    req = ctx.socket(zmq.REQ)
    req.RCVTIMEO = 10_000
    req.connect(endpoints["replay"])
    last = max(live)
    req.send(last.to_bytes(8, "big"))
    assert req.recv_multipart() == [b"kv@w0@qwen", last.to_bytes(8, "big"), live[last][1]]
