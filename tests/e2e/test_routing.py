"""mmrouter in a real Envoy in front of mock vLLM workers: the behaviours users rely on."""
import concurrent.futures
import json
import re
import socket
import threading
import time

import pytest

from conftest import chat, data_url, png
from stack import Stack


def overlap(headers):
    m = re.fullmatch(r"(\d+)/(\d+)", headers.get("x-mmrouter-overlap", ""))
    assert m, f"no x-mmrouter-overlap header: {dict(headers)}"
    return int(m.group(1)), int(m.group(2))


def cached(body):
    details = json.loads(body)["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def test_same_image_twice_lands_on_the_same_worker_and_hits_its_cache(stack):
    body = chat(png(640, 480, seed=1))
    s1, h1, b1 = stack.post(body)
    s2, h2, b2 = stack.post(body)
    assert (s1, s2) == (200, 200)
    # The worker that answered is the one the router chose.
    assert h1["x-mock-worker"] == h1["x-mmrouter-worker"]
    assert h2["x-mock-worker"] == h1["x-mock-worker"]
    m1, total1 = overlap(h1)
    m2, total2 = overlap(h2)
    assert total1 == total2 and total1 > 10
    assert m1 <= total1 // 10, "first sight of the image: (almost) nothing cached"
    assert m2 >= total2 - 1, "second time: the whole prefix is on the chosen worker"
    usage = json.loads(b2)["usage"]
    assert cached(b2) >= 0.9 * usage["prompt_tokens"]
    assert cached(b1) < 0.1 * usage["prompt_tokens"]


def counter(stats, name):
    """The value of one Prometheus sample (`name` with its labels), 0 when absent."""
    m = re.search(rf"^{re.escape(name)} (\d+)$", stats, re.M)
    return int(m.group(1)) if m else 0


def routed(stats):
    return {w: int(v) for w, v in re.findall(r'^mmrouter_routed\{worker="(w\d)"\} (\d+)$', stats, re.M)}


def wait_until(what, cond, timeout=30):
    """Polls `cond` until it returns a true value (returned); fails after `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_different_images_in_flight_at_once_spread_across_workers():
    # The rule (src/scoring.rs): cost = uncached blocks + 4 x in-flight requests + their
    # blocks still to prefill. New images are uncached everywhere, so while the earlier ones
    # are in flight each next one goes to a worker with none: 4 in flight, 4 workers. Each
    # request is sent once the router has routed the previous one, and the workers decode
    # slowly (8 tokens at 4 tok/s, ~1.75 s), so all four are in flight together whatever the
    # random tie-breaks; the test checks that too.
    stack = Stack(workers=4, worker_args=("--time-scale", "1", "--decode-tokens-per-sec", "4"))
    try:
        bodies = [chat(png(320, 240, seed=100 + i)) for i in range(4)]
        pool = concurrent.futures.ThreadPoolExecutor(4)
        futures = []
        for i, body in enumerate(bodies):
            futures.append(pool.submit(lambda b: (stack.post(b), time.time()), body))
            wait_until(f"request {i} is routed", lambda: sum(routed(stack.stats()).values()) == i + 1)
        all_routed = time.time()
        results = [f.result() for f in futures]
        pool.shutdown()
        assert all(status == 200 for (status, _, _), _ in results)
        assert all(done > all_routed for _, done in results), \
            "precondition: every request was still in flight when the last one was routed"
        workers = [h["x-mock-worker"] for (_, h, _), _ in results]
        assert sorted(workers) == ["w0", "w1", "w2", "w3"], workers
        assert all(h["x-mmrouter-worker"] == h["x-mock-worker"] for (_, h, _), _ in results)
        # And each image then stays where it went: its cache outweighs any load (sent
        # together, each repeat's owner holds no other request).
        with concurrent.futures.ThreadPoolExecutor(4) as again_pool:
            again = list(again_pool.map(stack.post, bodies))
        assert [h["x-mock-worker"] for _, h, _ in again] == workers
    finally:
        stack.close()


def test_a_client_cannot_steer_the_request(stack):
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(0.5)
    hits = []

    def accept():
        try:
            conn, _ = trap.accept()
            hits.append(conn)
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    target = f"127.0.0.1:{trap.getsockname()[1]}"
    status, h, _ = stack.post(chat(png(64, 64, seed=7)), headers={
        "x-gateway-destination-endpoint": target,
        "x-envoy-original-dst-host": target,
    })
    t.join()
    trap.close()
    assert status == 200
    assert hits == [], "the client-chosen address received a connection"
    assert h["x-mock-worker"] in {n for n, _ in stack.workers}
    # Also on paths the filter does not route.
    status, h, _ = stack.post(b"{}", path="/v1/embeddings", headers={"x-gateway-destination-endpoint": target})
    assert h.get("x-mock-worker") in {n for n, _ in stack.workers}


@pytest.mark.parametrize("body,reason", [
    (b"{not json", "bad_json"),
    (json.dumps(chat(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR\x00")).encode(), "bad_image"),
])
def test_bodies_the_router_cannot_use_are_still_answered_and_counted(stack, body, reason):
    name = f'mmrouter_fallback{{reason="{reason}"}}'
    before = counter(stack.stats(), name)
    status, h, _ = stack.post(body)
    # Routed to a worker (which answers 400 for what vLLM would refuse), never a proxy 5xx.
    assert h.get("x-mock-worker") in {n for n, _ in stack.workers}, dict(h)
    assert status < 500
    assert counter(stack.stats(), name) == before + 1
    status, h, _ = stack.post(chat(png(96, 96, seed=8)))
    assert status == 200 and h["x-mmrouter-worker"] == h["x-mock-worker"]


def test_a_body_without_images_is_routed_by_its_text_prefix(stack):
    long_text = "You are a careful assistant. " * 40
    body = {"model": "Qwen/Qwen2.5-VL-7B-Instruct", "max_tokens": 4,
            "messages": [{"role": "system", "content": long_text}, {"role": "user", "content": "hi"}]}
    s1, h1, _ = stack.post(body)
    s2, h2, b2 = stack.post(body)
    assert (s1, s2) == (200, 200)
    assert h2["x-mock-worker"] == h1["x-mock-worker"]
    matched, total = overlap(h2)
    assert matched == total > 0


def test_an_oversize_body_gets_413_and_the_next_request_still_routes():
    stack = Stack(workers=2, buffer_limit=256 * 1024)
    try:
        big = chat(png(8, 8, seed=1), text="x" * (400 * 1024))
        status, _, _ = stack.post(big)
        assert status == 413
        status, h, _ = stack.post(chat(png(32, 32, seed=2)))
        assert status == 200 and h["x-mmrouter-worker"] == h["x-mock-worker"]
    finally:
        stack.close()


def test_a_body_over_the_filter_limit_falls_back_to_the_least_loaded_worker():
    stack = Stack(workers=2, plugin_config={"limits": {"max_body_bytes": 4096}})
    try:
        status, h, _ = stack.post(chat(png(64, 64, seed=3), text="y" * 8000))
        assert status == 200 and h["x-mock-worker"] in ("w0", "w1")
        assert counter(stack.stats(), 'mmrouter_fallback{reason="too_large"}') == 1
    finally:
        stack.close()


def test_a_body_over_both_limits_streams_to_a_worker_instead_of_413():
    # content-length announces more than limits.max_body_bytes: the filter decides at the
    # headers and never buffers, so Envoy's smaller buffer limit does not apply either.
    # (200 KiB of text is ~40k tokens: within the mock's default KV pool of 65,536 tokens.)
    stack = Stack(workers=2, buffer_limit=128 * 1024,
                  plugin_config={"limits": {"max_body_bytes": 64 * 1024}})
    try:
        status, h, _ = stack.post(chat(png(8, 8, seed=4), text="z" * (200 * 1024)))
        assert status == 200 and h["x-mock-worker"] in ("w0", "w1")
        assert counter(stack.stats(), 'mmrouter_fallback{reason="too_large"}') == 1
    finally:
        stack.close()


def test_streaming_passes_through_with_usage(stack):
    body = chat(png(200, 100, seed=9), stream=True, stream_options={"include_usage": True})
    status, h, raw = stack.post(body)
    assert status == 200
    assert h["content-type"].startswith("text/event-stream")
    assert h["x-mmrouter-worker"] == h["x-mock-worker"]
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["usage"]["prompt_tokens"] > 0


def test_the_official_openai_client_works_through_the_router(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    image = png(480, 360, seed=11)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image), "detail": "high"}},
        {"type": "text", "text": "Describe it."}]}]
    workers = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model="Qwen/Qwen2.5-VL-7B-Instruct", messages=messages, max_tokens=8)
        reply = raw.parse()
        assert reply.choices[0].message.content
        workers.append(raw.headers["x-mmrouter-worker"])
    assert workers[0] == workers[1]
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0.9 * reply.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="Qwen/Qwen2.5-VL-7B-Instruct", messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    models = client.models.list()
    assert [m.id for m in models.data] == ["Qwen/Qwen2.5-VL-7B-Instruct"]


def test_metrics_and_routing_log_are_visible(stack):
    # Only what this test's own request adds counts: the stack is shared with other tests.
    before = stack.stats()
    log_start = len(stack.log())
    _, h, _ = stack.post(chat(png(128, 128, seed=12)))
    worker = h["x-mmrouter-worker"]
    matched, total = overlap(h)
    stats = stack.stats()
    # A worker's counter exists from its first routed request on: one this shared stack has
    # not routed to yet has none before (or after) this request.
    names = {"w0", "w1", "w2", "w3"}
    assert set(routed(stats)) <= names and worker in routed(stats)
    assert {w: routed(stats).get(w, 0) - routed(before).get(w, 0) for w in names} == \
        {w: int(w == worker) for w in names}
    assert counter(stats, "mmrouter_images{}") == counter(before, "mmrouter_images{}") + 1
    # Envoy flushes its log every 50 ms: wait for this request's line.
    line = f"[ROUTING] Best: {worker} with {matched}/{total} blocks overlap"
    wait_until("the routing line is logged", lambda: line in stack.log()[log_start:], timeout=10)


def test_workers_are_polled_and_a_dead_worker_is_skipped():
    # A poll timeout far above a live mock's answer time (~1 ms), so that only the dead
    # worker's polls (refused at once) can fail.
    stack = Stack(workers=3, plugin_config={"metrics": {"poll_ms": 500, "timeout_ms": 450}})
    try:
        wait_until("the workers' /metrics are polled",
                   lambda: counter(stack.stats(), "mmrouter_polls_ok{}") >= 1, timeout=10)
        image = png(256, 256, seed=21)
        _, h, _ = stack.post(chat(image))
        owner = h["x-mmrouter-worker"]
        failed = counter(stack.stats(), "mmrouter_polls_failed{}")
        stack.kill_worker(owner)
        # Three failed polls (unhealthy_after) mark it unhealthy. The filter records a poll in
        # shared data before it counts it, so the counter moving means the router knows.
        wait_until("three polls of the dead worker failed",
                   lambda: counter(stack.stats(), "mmrouter_polls_failed{}") >= failed + 3, timeout=10)
        for i in range(6):
            status, h, _ = stack.post(chat(image if i == 0 else png(64, 64, seed=30 + i)))
            assert status == 200, f"request {i} got {status}"
            assert h["x-mock-worker"] != owner
    finally:
        stack.close()
