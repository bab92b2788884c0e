"""Offline cache simulation: the `sim` reference of the routing-quality harness.

`BlockPool` re-implements the mock worker's block pool (src/bin/mock_worker/prefix_cache.rs,
after vLLM's block_pool.py): a fixed number of blocks, a free queue in eviction order that
also holds cached blocks nobody references, taking a free block evicts its content, a
finished request frees its blocks tail first, a hit is the longest cached run of the prompt's
blocks capped at prompt_tokens - 1 tokens, the prompt's full blocks are cached at prefill and
the full blocks of prompt + output at the end.

`simulate(requests, workers, capacity, policy)` replays a trace's requests one at a time, in
a fixed nominal order, through `workers` such pools, each request sent to the worker the
policy picks. All but `greedy` know the whole trace (what is asked later, when sessions end):

- `greedy`: the worker with the longest hit; ties to the one with the fewest requests. It
  knows only the past, with exact state: the harness reports it alone as `sim-online`, the
  reference for what a router that does not see the future reaches on these pools;
- `sticky`: a session's turns stay on the worker of its first turn; a first turn goes to the
  longest hit, ties to the worker with the fewest sessions still running (clairvoyant);
- `lookahead`: the longest hit minus the blocks this request would evict from that worker
  that some later request will ask for (clairvoyant); ties as `sticky`;
- `sticky-lookahead`: follow-ups stay, first turns as `lookahead`.

`bound_sim` runs them all and keeps the best hit rate: a reference for what routing can reach
with these caches, not a proof. It can be beaten: the policies are heuristics (the best
assignment is a hard combinatorial problem), and it ignores nothing that would help a router
(no load limit). It can also be out of reach: requests run one at a time, so no cache space is
held by requests in flight and a prefix is always cached before the next request that wants
it, which a real, concurrent run cannot always have. See docs/BENCHMARKS.md.
"""
import bisect
import heapq
from collections import OrderedDict


class BlockPool:
    """The mock's block pool, one request at a time."""

    def __init__(self, num_blocks, block_size=16):
        self.bs = block_size
        self.n = num_blocks
        self.free = OrderedDict((i, None) for i in range(num_blocks))  # eviction order
        self.hash_of = [None] * num_blocks
        self.cached = {}  # block id (hex) -> physical block
        self.evicted = 0

    def hit_blocks(self, req):
        limit = (req.prompt_tokens - 1) // self.bs
        n = 0
        for h in req.blocks[:limit]:
            if h not in self.cached:
                break
            n += 1
        return n

    def new_needed(self, req, hits):
        total = -(-(req.prompt_tokens + req.max_tokens) // self.bs)
        return total - hits

    def would_evict(self, k):
        """Cached contents of the first `k` blocks of the free queue (what allocating k
        blocks would evict)."""
        out = []
        for i, b in enumerate(self.free):
            if i >= k:
                break
            h = self.hash_of[b]
            if h is not None and self.cached.get(h) == b:
                out.append(h)
        return out

    def run(self, req):
        """Admits, prefills and finishes `req`; returns its cached tokens."""
        hits = self.hit_blocks(req)
        hit_ids = [self.cached[h] for h in req.blocks[:hits]]
        for b in hit_ids:
            self.free.pop(b, None)
        need = self.new_needed(req, hits)
        if need > len(self.free):
            raise ValueError(f"request of {req.prompt_tokens}+{req.max_tokens} tokens cannot "
                             f"fit in {self.n} blocks")
        new = []
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                    self.evicted += 1
                self.hash_of[b] = None
            new.append(b)
        blocks = hit_ids + new
        self._cache(blocks, req.blocks)
        self._cache(blocks, req.blocks + req.finish_blocks)
        for b in reversed(blocks):
            self.free[b] = None
        return hits * self.bs

    def _cache(self, ids, hashes):
        for b, h in zip(ids, hashes):
            if h in self.cached or self.hash_of[b] is not None:
                continue
            self.hash_of[b] = h
            self.cached[h] = b


# ----------------------------------------------------------------------------- order

def nominal_order(requests, arrival, prefill_tps, decode_tps, encoder_ms):
    """The order a replay would send `requests` in if every request took its uncached,
    unqueued service time (prompt / prefill speed + encoder per new image + max_tokens /
    decode speed): one fixed order per trace, the same for every system and bound."""
    sessions = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    service = {id(r): r.prompt_tokens / prefill_tps + r.images * encoder_ms / 1000
               + r.max_tokens / decode_tps for r in requests}
    sent = []  # (time, seq, request)
    seq = 0

    def run_session(t, rs):
        nonlocal seq
        for k, r in enumerate(rs):
            if k:
                t += r.think
            sent.append((t, seq, r))
            seq += 1
            t += service[id(r)]
        return t

    order = list(sessions.values())
    if arrival.get("mode") == "closed":
        users = [(0.0, u) for u in range(arrival.get("users", 8))]
        heapq.heapify(users)
        for rs in order:
            t, u = heapq.heappop(users)
            heapq.heappush(users, (run_session(t, rs), u))
    else:
        for rs in order:
            run_session(rs[0].at, rs)
    sent.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in sent]


# ----------------------------------------------------------------------------- policies

POLICIES = ("greedy", "sticky", "lookahead", "sticky-lookahead")
ONLINE_POLICY = "greedy"  # the one that uses nothing from later in the trace


def simulate(order, workers, capacity, policy, block_size=16):
    """Replays `order` through `workers` pools of `capacity` blocks; returns a summary."""
    pools = [BlockPool(capacity, block_size) for _ in range(workers)]
    last_turn = {}
    for i, r in enumerate(order):
        last_turn[r.session] = i
    future = {}  # block id -> positions (in order) of the requests whose prompt has it
    if "lookahead" in policy:
        for i, r in enumerate(order):
            for h in r.blocks:
                future.setdefault(h, []).append(i)
    home = {}  # session -> worker
    n_req = [0] * workers
    running = [set() for _ in range(workers)]  # sessions with turns to come, per worker
    cached = prompt = 0
    per_request = []
    for i, r in enumerate(order):
        hits = [p.hit_blocks(r) for p in pools]
        if r.session in home and policy.startswith("sticky"):
            w = home[r.session]
        else:
            if "lookahead" in policy:
                def damage(wi):
                    p = pools[wi]
                    ev = p.would_evict(max(0, p.new_needed(r, hits[wi])))
                    return sum(1 for h in ev if _used_after(future.get(h), i))
                score = [hits[wi] - damage(wi) for wi in range(workers)]
            else:
                score = hits
            if policy == "greedy":
                w = max(range(workers), key=lambda wi: (score[wi], -n_req[wi], -wi))
            else:
                w = max(range(workers), key=lambda wi: (score[wi], -len(running[wi]),
                                                        -n_req[wi], -wi))
        home[r.session] = w
        c = pools[w].run(r)
        n_req[w] += 1
        running[w].add(r.session)
        if last_turn[r.session] == i:
            for s in running:
                s.discard(r.session)
        cached += c
        prompt += r.prompt_tokens
        per_request.append(c)
    return {"policy": policy, "hit_rate": round(cached / prompt, 4) if prompt else None,
            "cached_tokens": cached, "prompt_tokens": prompt, "per_worker": n_req,
            "evicted_blocks": sum(p.evicted for p in pools), "per_request": per_request}


def _used_after(positions, i):
    if not positions:
        return False
    return bisect.bisect_right(positions, i) < len(positions)


def bound_sim(order, workers, capacity, block_size=16):
    """Best of POLICIES (by hit rate); the others ride along under `policies`."""
    runs = [simulate(order, workers, capacity, p, block_size) for p in POLICIES]
    for r in runs:
        r.pop("per_request")
    best = max(runs, key=lambda r: (r["hit_rate"] or 0.0))
    return dict(best, policies={r["policy"]: r["hit_rate"] for r in runs})


def unbounded_single(order, block_size=16):
    """One pool that never evicts (the measured `bound` system, simulated): per-request cached
    tokens in `order`."""
    need = sum(-(-(r.prompt_tokens + r.max_tokens) // block_size) for r in order) + 1
    pool = BlockPool(need, block_size)
    return [pool.run(r) for r in order]
