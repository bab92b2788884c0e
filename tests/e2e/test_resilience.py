"""Upstream resilience in the rendered Envoy configuration (envoy/render.py, override_host)."""
import re

from conftest import chat, png
from stack import Stack


def stat(text, name, cluster):
    m = re.search(rf'^{name}{{envoy_cluster_name="{cluster}"}} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


def test_a_dead_worker_loses_no_request_retries_go_to_the_next_best_and_it_is_ejected():
    # Polls off: the filter keeps choosing the dead worker for its cached image; Envoy must
    # absorb that with retries to the next addresses the filter listed.
    stack = Stack(workers=3, plugin_config={"metrics": {"poll_ms": 0}})
    try:
        body = chat(png(320, 240, seed=7))
        status, h, _ = stack.post(body)
        assert status == 200
        dead = h["x-mock-worker"]
        stack.kill_worker(dead)
        served = []
        for _ in range(12):
            status, h, _ = stack.post(body)
            assert status == 200, "a request a healthy worker could serve failed"
            served.append(h["x-mock-worker"])
        assert dead not in served
        stats = stack.stats()
        assert stat(stats, "envoy_cluster_upstream_rq_retry", "mmrouter_workers") >= 1
        # Connection failures are local-origin errors: two in a row eject the worker.
        assert stat(stats, "envoy_cluster_outlier_detection_ejections_enforced_total",
                    "mmrouter_workers") >= 1
    finally:
        stack.close()
