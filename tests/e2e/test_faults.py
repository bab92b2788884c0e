"""Faults under a steady request stream (issue 14, item 5): a worker crashed and restarted on
the same port, a worker's /metrics hanging, the sidecar killed and restarted, Envoy hot
restarted. Each case asserts that no request failed that a healthy worker could have served
(requests in flight on a crashed worker included: Envoy retries a reset to the next-best
worker), and measures how long routing takes to be back to normal; the numbers are printed
(and appended to $CARGO_TARGET_DIR/faults/results.jsonl) and collected in docs/FAULTS.md, with
only generous functional bounds asserted. Loopback only; each case takes 6-20 s.

The mock workers run at --time-scale 1 here (a request takes ~0.1 s: encoder, prefill, 8
decoded tokens), so a crash catches requests in flight.
"""
import json
import os
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from conftest import chat, png
from faults import BLOCK, Stream, first, hot_restart, kill_worker, proxied, restart_worker
from precise import PreciseStack
from stack import TARGET, Stack

# Requests take real (emulated) time, so a crash catches some in flight.
WORKER_ARGS = ("--time-scale", "1")
IMAGES = 8
MODES = ["approximate", "precise"]


@pytest.fixture(scope="module")
def bodies():
    """Chat requests with one 448x448 PNG each (17 KV blocks), all different: the first IMAGES
    are the stream's, the next IMAGES are new content a test may add later."""
    return [json.dumps(chat(png(448, 448, seed=100 + i))).encode() for i in range(2 * IMAGES)]


class Pool:
    """The bodies a Stream picks from: the first IMAGES, and after widen() one more new body
    every `every` seconds up to 2 * IMAGES. New content arrives over several seconds, not in
    one burst: in a burst it could all be placed before routing has seen a restarted worker
    healthy again (a poll every 250 ms; slower on a loaded 2-core CI machine), and then cache
    affinity rightly keeps every request on the survivors."""

    def __init__(self, every=0.5):
        self.every = every
        self.widened = None

    def widen(self):
        self.widened = time.monotonic()

    def __call__(self, rng, _):
        n = IMAGES
        if self.widened is not None:
            n += min(IMAGES, 1 + int((time.monotonic() - self.widened) / self.every))
        return rng.randrange(n)


@pytest.fixture
def report(capsys, request):
    """Prints one case's numbers past pytest's capture and appends them to results.jsonl."""
    def emit(**numbers):
        numbers = {"case": request.node.name, **numbers}
        out = TARGET / "faults"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), **numbers}) + "\n")
        with capsys.disabled():
            print("\nfaults: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))
    return emit


def make_stack(mode, cls_wrap=None, **kw):
    cls = Stack if mode == "approximate" else PreciseStack
    if cls_wrap:
        cls = cls_wrap(cls)
    return cls(workers=3, worker_args=WORKER_ARGS, **kw)


def busiest(answers):
    """The worker that served the most requests (it holds cached images and has requests in
    flight)."""
    return Counter(a.worker for a in answers if a.ok).most_common(1)[0][0]


def hit_rate(answers):
    """The share of answers the engine served with cached tokens."""
    return round(sum(a.cached > 0 for a in answers) / max(1, len(answers)), 3)


def secs(x):
    return None if x is None else round(x, 3)


def assert_none_failed(stream):
    failed = stream.failed()
    assert not failed, (f"{len(failed)} of {len(stream.answers)} requests failed while healthy "
                        f"workers were up: " + "; ".join(
                            f"{a.error} at +{a.start - stream.t0:.2f}s" for a in failed[:5]))


def metrics_status(stack, name):
    """The HTTP status of worker `name`'s /metrics asked directly, or why there was none."""
    address = (dict(stack.workers)[name] if hasattr(stack, "worker_procs")
               else stack.workers[name][0])
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as r:
            return r.status
    except Exception as e:  # noqa: BLE001 (a diagnostic: any failure is the answer)
        return repr(e)


def health_lines(stack, name):
    """The filter's log lines on worker `name`'s health (it logs each change)."""
    log = stack.envoy_log.read_text() if stack.envoy_log.exists() else ""
    return [line[-160:] for line in log.splitlines()
            if f"worker {name} is" in line][-6:]


def old_cache_predictions(answers, victim, since):
    """Requests routed to `victim` after `since` with a predicted cache hit on a body that the
    victim had not been sent since then: a prediction that can only come from the cache of its
    previous incarnation."""
    sent = set()
    stale = []
    for a in sorted(answers, key=lambda a: a.start):
        if a.start < since or a.routed != victim:
            continue
        if a.body not in sent and a.matched > 0:
            stale.append(a)
        sent.add(a.body)
    return stale


@pytest.mark.parametrize("mode", MODES)
def test_a_crashed_worker_loses_no_request_and_comes_back_on_its_port_with_an_empty_cache(
        mode, bodies, report):
    stack = make_stack(mode)
    pool = Pool()
    try:
        with Stream(stack.url, bodies, clients=3, pick=pool) as stream:
            time.sleep(1.5)
            victim = busiest(stream.answers)
            killing = time.monotonic()
            kill_worker(stack, victim)
            crashed = time.monotonic()
            # Down for 2 s: past the filter's 3 failed polls (approximate) and the sidecar's 2
            # failed scrapes (precise), so routing has marked it unhealthy.
            time.sleep(2.0)
            restart_worker(stack, victim, WORKER_ARGS)
            up = time.monotonic()
            # New images from now on too: every body of the first pool is cached on the
            # survivors, so cache affinity alone would keep the empty worker idle.
            pool.widen()
            try:
                takes_traffic = stream.wait_for(
                    first(lambda a: a.worker == victim), up, 15, f"{victim} serving again")
            except AssertionError as e:
                since = stream.since(up)
                raise AssertionError(
                    f"{e}: of {len(since)} answers since, {victim} was chosen by the filter for "
                    f"{sum(a.routed == victim for a in since)} (served elsewhere: Envoy's outlier "
                    f"detection still ejecting it?); modes {Counter(a.mode for a in since)}; "
                    f"bodies since {sorted(Counter(a.body for a in since).items())}; "
                    f"{victim}'s /metrics now: {metrics_status(stack, victim)}; the filter's "
                    f"health lines on it: {health_lines(stack, victim)}"
                ) from None
            hits_again = stream.wait_for(
                first(lambda a: a.worker == victim and a.routed == victim
                      and a.matched > 0 and a.cached > 0),
                up, 15, f"{victim} serving predicted cache hits again")
            time.sleep(0.5)
        answers = stream.answers
        down = [a for a in answers if crashed <= a.start < up]
        stale = old_cache_predictions(answers, victim, up)
        in_flight = [a for a in answers if a.start < killing < a.end and a.routed == victim]
        report(requests=len(answers), failed=len(stream.failed()),
               retried=sum(1 for a in answers if a.routed and a.routed != a.worker),
               in_flight_at_crash=len(in_flight),
               routed_to_dead=sum(1 for a in down if a.routed == victim),
               old_cache_predictions=len(stale),
               takes_traffic_s=secs(takes_traffic), predicted_hits_again_s=secs(hits_again))
        assert_none_failed(stream)
        assert not stale, (
            f"{victim} restarted with an empty cache, yet routing predicted hits on it for bodies "
            f"it had not been sent since: " + "; ".join(
                f"body {a.body} {a.matched}/{a.total} blocks predicted, {a.cached} tokens cached, "
                f"+{a.start - up:.2f}s" for a in stale))
        # Routing stopped choosing the dead worker once it was found unhealthy.
        assert not [a for a in down if a.routed == victim and a.start > crashed + 1.8]
        # Recovery: the restarted worker is chosen again and its new cache attracts repeats.
        assert takes_traffic < 10 and hits_again < 12
    finally:
        stack.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_hanging_metrics_endpoint_loses_no_request_the_worker_is_skipped_until_it_answers(
        mode, bodies, report):
    # The filter's docs (envoy/README.md) and the sidecar's (docs/SIDECAR.md): a worker whose
    # /metrics times out repeatedly is unhealthy and routing skips it until a poll succeeds.
    stack = make_stack(mode, cls_wrap=proxied)
    try:
        with Stream(stack.url, bodies[:IMAGES], clients=3) as stream:
            time.sleep(1.5)
            victim = busiest(stream.answers)
            proxy = stack.proxies[victim]
            proxy.hang.set()
            hung = time.monotonic()
            time.sleep(3.5)
            proxy.hang.clear()
            back = time.monotonic()
            serving_again = stream.wait_for(
                first(lambda a: a.worker == victim and a.routed == victim), back, 15,
                f"{victim} taking traffic after its /metrics answers again")
            time.sleep(0.5)
        answers = stream.answers
        during = [a for a in answers if hung <= a.start < back]
        to_victim = [a.start - hung for a in during if a.routed == victim]
        skipped_after = max(to_victim, default=0.0)
        served_by_victim = sum(1 for a in during if a.worker == victim)
        report(requests=len(answers), failed=len(stream.failed()), held_metrics=proxy.held,
               served_by_victim_while_hanging=served_by_victim,
               skipped_after_s=secs(skipped_after), serving_again_s=secs(serving_again))
        assert_none_failed(stream)
        assert proxy.held > 0, "no /metrics request reached the hanging endpoint"
        # Unhealthy after a few timed-out polls: approximate 3 x (500 ms period, 400 ms timeout),
        # precise 2 x (100 ms period, 500 ms timeout) plus a feed poll.
        assert skipped_after < 3.0, f"{victim} still chosen {skipped_after:.2f} s into the hang"
    finally:
        stack.close()


def test_killing_the_sidecar_loses_no_request_routing_goes_approximate_then_precise_again(
        bodies, report):
    stack = make_stack("precise")
    try:
        with Stream(stack.url, bodies[:IMAGES], clients=3) as stream:
            time.sleep(1.5)
            stack.kill_sidecar()
            killed = time.monotonic()
            approximate = stream.wait_for(first(lambda a: a.mode == "approximate"), killed, 5,
                                          "approximate mode after the sidecar died")
            time.sleep(2.0)
            stack.start_sidecar()
            restarted = time.monotonic()
            precise = stream.wait_for(first(lambda a: a.mode == "precise"), restarted, 10,
                                      "precise mode after the sidecar came back")
            time.sleep(1.5)
        answers = stream.answers
        # A VM reads the mode from the shared table on its own schedule: allow 0.5 s after
        # the first approximate answer for every VM to have seen it.
        outage = [a for a in answers if killed + approximate + 0.5 <= a.start < restarted]
        after = [a for a in answers if a.start >= restarted + precise + 0.5]
        report(requests=len(answers), failed=len(stream.failed()),
               approximate_after_s=secs(approximate), precise_again_s=secs(precise),
               hit_rate_during_outage=hit_rate(outage), hit_rate_after=hit_rate(after),
               precise_during_outage=sum(a.mode == "precise" for a in outage),
               approximate_after=sum(a.mode == "approximate" for a in after))
        assert_none_failed(stream)
        assert outage and after, "no requests in a window"
        # Seen under a busy CPU: one answer in ~60 said precise 0.5 s into the outage (a
        # transient; see docs/FAULTS.md). The bulk must be approximate, and precise after.
        outage_modes = [a.mode for a in sorted(outage, key=lambda a: a.end)]
        after_modes = [a.mode for a in sorted(after, key=lambda a: a.end)]
        assert outage_modes.count("approximate") >= 0.8 * len(outage_modes), outage_modes
        assert after_modes.count("precise") >= 0.8 * len(after_modes), after_modes
        # Without the feed the router still routes on what it decided: the images stay hits.
        assert hit_rate(outage) > 0.8
    finally:
        stack.close()


@pytest.mark.parametrize("mode", MODES)
def test_envoy_hot_restart_answers_every_request_and_routing_state_is_rebuilt(
        mode, bodies, report):
    stack = make_stack(mode)
    try:
        base_id = int(stack.base_id_path.read_text().strip())
        old = stack.procs[-1]
        with Stream(stack.url, bodies[:IMAGES], clients=3) as stream:
            time.sleep(1.5)
            restarted = time.monotonic()
            new = hot_restart(stack, stack.envoy_config, base_id,
                              stack.envoy_log.with_name("envoy-epoch1.log"),
                              parent_shutdown_s=3, drain_s=2)
            old.wait(timeout=20)
            parent_gone = time.monotonic() - restarted
            # Then at least 12 more answers (at most 10 s): the tail the checks below read.
            stream.wait_for(lambda got: got[11] if len(got) >= 12 else None,
                            restarted + parent_gone, 10, "answers after the parent's exit")
        assert new.poll() is None, "the new Envoy exited"
        answers = stream.answers
        after = sorted((a for a in answers if a.start >= restarted), key=lambda a: a.start)
        # The new Envoy's filter starts with empty shared data (proxy-wasm shared data belongs
        # to the process): the first request of each prefix is routed without a prediction,
        # and its decision rebuilds the state.
        seen_before = {a.body for a in answers if a.start < restarted}
        forgotten = [a for a in after if a.body in seen_before and a.matched == 0]
        rebuilt = max((a.end - restarted for a in forgotten), default=0.0)
        tail = [a for a in after if a.start >= restarted + rebuilt]
        report(requests=len(answers), failed=len(stream.failed()),
               parent_exited_s=secs(parent_gone), unpredicted_after_restart=len(forgotten),
               hit_rate_after_restart=round(sum(a.cached > 0 for a in after) / len(after), 3),
               rebuilt_s=secs(rebuilt))
        assert_none_failed(stream)
        hits = sum(a.cached > 0 for a in after) / len(after)
        assert hits > 0.5, f"only {hits:.0%} cache hits after the hot restart"
        # Each already-seen body is routed once without a prediction (the first decision of
        # the new Envoy rebuilds its state; precise mode gets the rest from the sidecar's
        # feed). Generous bounds: at most twice per body, within 5 s of the parent's exit,
        # and predicted hits after.
        assert len(forgotten) <= 2 * len(seen_before), \
            f"{len(forgotten)} answers of {len(seen_before)} seen bodies without a prediction"
        assert rebuilt <= parent_gone + 5, \
            f"routing predicted nothing for {rebuilt:.1f} s, parent gone at {parent_gone:.1f} s"
        assert len(tail) >= 3 and all(a.matched > 0 and a.cached > 0 for a in tail), \
            "cache-affine routing not back after the hot restart"
        assert tail[-1].mode == mode
    finally:
        stack.close()
