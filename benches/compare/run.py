#!/usr/bin/env python3
"""Routing-quality harness: trace families replayed side by side through several routers.

    .venv/bin/python benches/compare/run.py [--families all] [--workers 2,4,8] [--seeds 1,2,3]
        [--systems mmrouter,sglang,envoy-rr,bound] [--quick] [--out DIR] ...

(scripts/bench-compare builds and installs what this needs, then runs it.)

For every family x worker count x seed it replays one seeded trace (trace.py) through each
system (replay.py), each on its own fresh mock workers, and computes the offline `sim`
reference for that cache size and worker count (sim.py). Requests are built ahead of the replay
with the mock's own rules (blocks.py, the trace-blocks tool), so every system is sent the same
bytes in the same arrival pattern. Results accumulate in DIR/results.json (one entry per run,
written as it goes; --resume skips runs already there), per-request records in DIR/records/,
the traces in DIR/traces/; at the end report.py writes DIR/report.md, DIR/report.json and the
PNG plots. Needs aiohttp, Pillow, sglang-router and matplotlib
(benches/compare/requirements.txt), Envoy (MMROUTER_ENVOY), the filter (MMROUTER_WASM), the
mock worker (MOCK_WORKER_BIN) and trace-blocks (TRACE_BLOCKS_BIN).
"""
import argparse
import asyncio
import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import blocks  # noqa: E402
import replay  # noqa: E402
import report  # noqa: E402
import sim  # noqa: E402
import trace as tracegen  # noqa: E402

DEFAULT_SYSTEMS = ("mmrouter", "mmrouter-approx", "sglang", "envoy-rr", "bound")

MOCK_FLAGS = {"prefill_tps": "prefill-tokens-per-sec", "encoder_ms": "encoder-ms-per-image",
              "decode_tps": "decode-tokens-per-sec", "max_num_seqs": "max-num-seqs",
              "mm_cache_items": "mm-cache-items"}

# The mock's timing model (docs/MOCK_WORKER.md); every one is a flag. The cache size is the
# family's (trace.FAMILIES[...]["gpu_blocks"]) unless --gpu-blocks says otherwise.
WORKER_DEFAULTS = {
    "prefill_tps": 8000.0,  # uncached prompt tokens per second, one prefill at a time
    "encoder_ms": 40.0,  # per image that needs the encoder
    "decode_tps": 100.0,  # output tokens per second per sequence
    "max_num_seqs": 32,
    "mm_cache_items": 8,  # vLLM's encoder cache holds a few images, not hundreds
}
BLOCK_SIZE = 16
QUICK_SHARE = 0.3  # --quick: this share of each family's sessions, one seed
# --warmup replays another trace of the same family first: this far from the measured seed, so
# its sessions and images are its own; it keeps the measured trace's system prompts (a fleet
# that has served other users of the same applications).
WARMUP_SEED_OFFSET = 1_000_000


def tools_from_env():
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return {
        "wasm": Path(os.environ.get("MMROUTER_WASM", target / "wasm32-wasip1/wasm/mmrouter.wasm")),
        "mock": Path(os.environ.get("MOCK_WORKER_BIN", target / "release/mock-worker")),
        "envoy": Path(os.environ.get("MMROUTER_ENVOY", ROOT / ".venv/bin/envoy")),
        "sidecar": Path(os.environ.get("MMROUTER_SIDECAR_BIN", target / "release/mmrouter-sidecar")),
        "trace_blocks": Path(os.environ.get("TRACE_BLOCKS_BIN", target / "release/examples/trace-blocks")),
        "python": Path(os.environ.get("BENCH_PYTHON", sys.executable)),
    }


def build_id(tools):
    """What was measured: the filter's sha256 and the checkout's commit."""
    out = {}
    w = tools["wasm"]
    if w.exists():
        out["wasm_sha256"] = hashlib.sha256(w.read_bytes()).hexdigest()[:12]
        out["wasm"] = str(w)
    try:
        out["commit"] = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                       capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    for name in ("envoy", "mock"):
        out[name] = str(tools[name])
    return out


def parse_list(s, cast=str):
    return [cast(x.strip()) for x in str(s).split(",") if x.strip()]


def fmt_dur(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Plan:
    """The traces, request sets and runs of one invocation."""

    def __init__(self, a, tools):
        self.a = a
        self.families = (list(tracegen.FAMILIES) if a.families == "all"
                         else list(tracegen.HELD_OUT) if a.families == "held-out"
                         else parse_list(a.families))
        for f in self.families:
            if f not in tracegen.NAMED and f != "legacy":
                sys.exit(f"unknown family {f} (known: {', '.join(tracegen.NAMED)}, legacy)")
        self.pool_dir = a.images_dir
        self.tools = tools
        self.cells = {}  # (family, seed) -> dict(header, requests, gpu_blocks, dropped, ...)
        self._expanded = {}
        self.image_server = None  # replay.ImageServer, started by the first URL-image family

    def warmup_cell(self, family, seed):
        """The `--warmup` trace of a cell: seed + WARMUP_SEED_OFFSET, with the cell's system
        prompts."""
        return self.cell(family, seed + WARMUP_SEED_OFFSET, prompts_of=seed)

    def cell(self, family, seed, trace_file=None, prompts_of=None):
        key = (family, seed)
        if key in self.cells:
            return self.cells[key]
        a = self.a
        speeds = None
        if trace_file:
            header, turns = tracegen.load(trace_file)
            gpu = a.gpu_blocks or 4096
        else:
            p = (tracegen.family_params(family) if family != "legacy"
                 else tracegen.SESSIONS)
            sessions = a.sessions
            if a.quick and not sessions and family != "legacy":
                sessions = max(8, round(p["sessions"] * QUICK_SHARE))
            over = {"users": a.users} if a.users else {}
            header, turns = tracegen.family_trace(family, seed, sessions=sessions, **over)
            if prompts_of is not None:
                # The warm-up's users are other users of the same applications: the measured
                # trace's system prompts (turns pick them by index), their own sessions and images.
                header["system_prompts"] = self.cell(family, prompts_of)["header"]["system_prompts"]
            gpu = p["gpu_blocks"]
            if a.gpu_blocks and not family.startswith("tight-"):
                gpu = a.gpu_blocks
            speeds = p.get("worker_speeds")
        pool = tracegen.ImagePool(header, self.pool_dir)
        pool.warm()
        # tight-* replay the sessions trace: expand each distinct trace once.
        tkey = hashlib.sha256(json.dumps([header["system_prompts"], header["images"], turns],
                                         sort_keys=True).encode()).hexdigest()
        if tkey not in self._expanded:
            tool = blocks.TraceBlocks(self.tools["trace_blocks"], BLOCK_SIZE)
            try:
                self._expanded[tkey] = blocks.expand(header, turns, pool, tool)
            finally:
                tool.close()
        reqs, dropped = blocks.fit_to_cache(self._expanded[tkey], gpu, BLOCK_SIZE)
        fetch_allow = None
        if header.get("params", {}).get("image_source") == "url":
            if self.image_server is None:
                self.image_server = replay.ImageServer(self.pool_dir)
            reqs = blocks.by_url(reqs, pool, self.image_server.url)
            fetch_allow = self.image_server.address
        tdir = Path(a.out) / "traces"
        tdir.mkdir(parents=True, exist_ok=True)
        tracegen.save(tdir / f"{family}-seed{seed}.jsonl", header, turns)
        order = sim.nominal_order(reqs, header["arrival"], a.prefill_tps, a.decode_tps, a.encoder_ms)
        c = {"header": header, "requests": reqs, "gpu_blocks": gpu, "dropped": dropped,
             "worker_speeds": speeds, "fetch_allow": fetch_allow,
             "order": order, "summary": tracegen.summary(header, turns, pool),
             "set_key": (tkey, gpu if dropped else None)}
        c["summary"].update(requests_replayed=len(reqs), requests_dropped_too_long=dropped,
                            prompt_tokens_mean=round(sum(r.prompt_tokens for r in reqs) / max(1, len(reqs))),
                            prompt_tokens_max=max((r.prompt_tokens for r in reqs), default=0),
                            body_kb_mean=round(sum(len(r.body) for r in reqs) / max(1, len(reqs)) / 1024))
        self.cells[key] = c
        return c


def worker_args(a, gpu_blocks, time_scale, speed=1.0):
    """The mock's flags; `speed` scales its prefill, encoder and decode speeds (a family's
    `worker_speeds`)."""
    return ["--time-scale", str(time_scale), "--prefill-tokens-per-sec", str(a.prefill_tps * speed),
            "--encoder-ms-per-image", str(a.encoder_ms / speed),
            "--decode-tokens-per-sec", str(a.decode_tps * speed),
            "--num-gpu-blocks", str(gpu_blocks), "--max-num-seqs", str(a.max_num_seqs),
            "--mm-cache-items", str(a.mm_cache_items), "--model", tracegen.MODEL]


def warmup_requests(warm, sleep_factor, seconds):
    """The warm-up's requests: an open-arrival trace's sessions that start within `seconds`
    (the replay's deadline stops a closed loop's users)."""
    if warm["header"]["arrival"].get("mode") == "closed":
        return warm["requests"]
    first = {}
    for r in warm["requests"]:
        first.setdefault(r.session, r.at)
    return [r for r in warm["requests"] if first[r.session] * sleep_factor < seconds]


def counters_since(after, before):
    """Each worker's counters (`*_total`) less what they were `before`; gauges as read."""
    return {w: {k: v - before.get(w, {}).get(k, 0.0) if k.endswith("_total") else v
                for k, v in m.items()} for w, m in after.items()}


def run_system(a, tools, system, n_workers, cell, variants, warm=None):
    """One replay of a cell's requests through `system`, after `warm`'s for `a.warmup`
    seconds where given; returns (summary, records)."""
    header = cell["header"]
    if system == "bound":
        # One worker, a cache that never evicts, no emulated time, waits x0.02: the most any
        # router can get from the caches on this trace (order aside).
        args = worker_args(a, 1_000_000, 0) + ["--mm-cache-items", "0"]
        fleet, factor, scale = replay.Fleet(system, [args], tools), 0.02, 0.0
    else:
        args = [worker_args(a, cell["gpu_blocks"], a.time_scale,
                            tracegen.worker_speed(cell["worker_speeds"], i))
                for i in range(n_workers)]
        fleet = replay.Fleet(system, args, tools, variants.get(system), cell["fetch_allow"])
        factor = scale = a.time_scale
    try:
        before, warm_s = {}, None
        if warm is not None and system != "bound":
            # The same warm-up for every system: the fleet (and the router) have run a while
            # when the measured replay starts; only the measured requests are counted.
            t_warm = time.time()
            reqs = warmup_requests(warm, factor, a.warmup)
            asyncio.run(replay.replay(fleet.url, reqs, warm["header"]["arrival"], factor,
                                      a.warmup))
            time.sleep(0.3)
            before, warm_s = fleet.metrics(), round(time.time() - t_warm, 1)
        records, wall = asyncio.run(replay.replay(fleet.url, cell["requests"], header["arrival"],
                                                  factor, a.deadline))
        time.sleep(0.3)  # let the last finished lines reach the worker logs
        metrics = counters_since(fleet.metrics(), before)
        fetches = (fleet.image_fetches() if cell["fetch_allow"] and system.startswith("mmrouter")
                   else None)
    finally:
        fleet.close()
    s = report.summarize(records, metrics, wall, len(cell["requests"]), scale, BLOCK_SIZE)
    if warm_s is not None:
        s["warmup_wall_s"] = warm_s
    if fetches is not None:
        s["filter_image_fetches"] = fetches
    if system == "bound":
        # The simulator against the mock: the same requests in the order they were sent.
        by_key = {(r.session, r.turn): r for r in cell["requests"]}
        ok = sorted((r for r in records if not r.get("error")), key=lambda r: r["sent"])
        order = [by_key[(r["session"], r["turn"])] for r in ok]
        simulated = sim.unbounded_single(order, BLOCK_SIZE)
        mism = sum(1 for r, c in zip(ok, simulated) if r["cached_tokens"] != c)
        s["sim_check"] = {"requests": len(ok), "mismatched": mism,
                          "simulated_hit_rate": round(sum(simulated) / max(1, sum(q.prompt_tokens for q in order)), 4)}
    return s, records


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--families", default="all",
                    help=f"comma-separated, or all: {', '.join(tracegen.FAMILIES)}; or held-out: "
                         f"{', '.join(tracegen.HELD_OUT)} (legacy: the earlier single trace)")
    ap.add_argument("--workers", default="2,4,8", help="comma-separated worker counts")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated trace seeds")
    ap.add_argument("--seed", type=int, help="one seed (same as --seeds N)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help="comma-separated: mmrouter, sglang, sglang-bal, envoy-rr, bound")
    ap.add_argument("--router-config", action="append", default=[], metavar="LABEL=FILE",
                    help="also run mmrouter-LABEL with FILE (JSON) merged into the filter "
                         "configuration; repeatable")
    ap.add_argument("--no-sim", action="store_true", help="skip the offline sim reference")
    ap.add_argument("--trace", help="replay this JSONL trace instead of the families (family "
                    "name: the file's stem)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: first seed only, {QUICK_SHARE * 100:.0f}%% of each family's sessions")
    ap.add_argument("--sessions", type=int, help="sessions per trace (default: the family's)")
    ap.add_argument("--users", type=int, help="concurrent users of closed-loop families (default 8)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every system per cell")
    ap.add_argument("--time-scale", type=float, default=0.5,
                    help="mock --time-scale, and the factor on think times and arrivals; "
                         "latencies are reported divided by it (emulated seconds)")
    ap.add_argument("--gpu-blocks", type=int,
                    help="KV blocks per worker for every family but tight-* (default: 4096)")
    for k, v in WORKER_DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v,
                        help="mock-worker --" + MOCK_FLAGS[k])
    ap.add_argument("--warmup", type=float, default=0.0,
                    help="wall seconds of another trace of the same family (seed + "
                         f"{WARMUP_SEED_OFFSET}, with the measured trace's system prompts) "
                         "replayed through each fleet before the measured one and not counted "
                         "(0: the fleet starts cold)")
    ap.add_argument("--deadline", type=float, default=900.0,
                    help="wall seconds after which a run sends nothing more")
    ap.add_argument("--images-dir", default=str(Path(tempfile.gettempdir()) / "mmrouter-cmp-images"))
    ap.add_argument("--out", default=str(ROOT / "target/bench-compare"))
    ap.add_argument("--resume", action="store_true",
                    help="keep DIR/results.json and skip the runs it already has")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)

    out = Path(a.out)
    (out / "records").mkdir(parents=True, exist_ok=True)
    seeds = [a.seed] if a.seed is not None else parse_list(a.seeds, int)
    if a.quick:
        seeds = seeds[:1]
    workers = parse_list(a.workers, int)
    systems = parse_list(a.systems)
    variants = {}
    for spec in a.router_config:
        label, _, path = spec.partition("=")
        variants[f"mmrouter-{label}"] = json.loads(Path(path).read_text())
    # A variant also named in --systems runs once.
    systems += [v for v in variants if v not in systems]
    for s in systems:
        if s not in replay.ROUTERS and s != "bound" and s not in variants:
            sys.exit(f"unknown system {s}")

    tools = tools_from_env()
    for k in ("mock", "envoy", "trace_blocks"):
        if not tools[k].exists():
            sys.exit(f"missing {k}: {tools[k]}")
    if any(s.startswith("mmrouter") for s in systems) and not tools["wasm"].exists():
        sys.exit(f"missing the filter: {tools['wasm']}")
    if any(s.startswith("mmrouter") and s != "mmrouter-approx" for s in systems) \
            and not tools["sidecar"].exists():
        sys.exit(f"missing mmrouter-sidecar: {tools['sidecar']}")

    plan = Plan(a, tools)
    families = [Path(a.trace).stem] if a.trace else plan.families
    if a.warmup and a.trace:
        sys.exit("--warmup replays another trace of a family: not with --trace")
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if a.resume and results_path.exists() else []
    done = {(r["family"], r["workers"], r["seed"], r["system"], r.get("repeat", 0)) for r in results}

    print(f"bench-compare: preparing traces ({len(families)} families x {len(seeds)} seeds)", flush=True)
    t_prep = time.time()
    for f in families:
        for seed in seeds:
            c = plan.cell(f, seed, a.trace)
            print(f"  {f} seed {seed}: {json.dumps(c['summary'])}", flush=True)
            if a.warmup:
                plan.warmup_cell(f, seed)
    print(f"  ({time.time() - t_prep:.0f} s)", flush=True)

    meta = {
        "command": os.environ.get("BENCH_COMMAND") or "benches/compare/run.py " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "build": build_id(tools), "time_scale": a.time_scale, "warmup_s": a.warmup,
        "workers_flags": {k: getattr(a, k) for k in WORKER_DEFAULTS},
        "families": {f: (tracegen.describe_family(f, plan.cells[(f, seeds[0])]["header"]["params"])
                         if f in tracegen.NAMED else f) for f in families},
        "traces": {f"{f}-seed{s}": plan.cells[(f, s)]["summary"] for f in families for s in seeds},
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))

    # The runs, in order; the bound runs once per distinct request set (it has one worker).
    runs = []
    bound_seen = {}
    for f in families:
        for w in workers:
            for seed in seeds:
                for rep in range(a.repeat):
                    for s in systems:
                        runs.append((f, w, seed, s, rep))
    weight = lambda r: len(plan.cells[(r[0], r[2])]["requests"]) * (0.15 if r[3] == "bound" else 1.0)  # noqa: E731
    todo = [r for r in runs if r not in done]
    total_units = sum(weight(r) for r in todo) or 1.0
    done_units, t0 = 0.0, time.time()
    print(f"bench-compare: {len(todo)} runs ({len(runs) - len(todo)} already in {results_path}); "
          f"time scale {a.time_scale}; load {os.getloadavg()[0]:.1f}", flush=True)

    def save():
        results_path.write_text(json.dumps(results, indent=1))

    # The sim reference, per cell (cheap; no processes).
    if not a.no_sim:
        for f in families:
            for w in workers:
                for seed in seeds:
                    if (f, w, seed, "sim", 0) in done and (f, w, seed, "sim-online", 0) in done:
                        continue
                    c = plan.cell(f, seed, a.trace)
                    b = sim.bound_sim(c["order"], w, c["gpu_blocks"], BLOCK_SIZE)
                    results.append({"family": f, "workers": w, "seed": seed, "system": "sim",
                                    "repeat": 0, "gpu_blocks": c["gpu_blocks"],
                                    "hit_rate": b["hit_rate"], "policy": b["policy"],
                                    "policies": b["policies"],
                                    "per_worker": {f"w{i}": n for i, n in enumerate(b["per_worker"])},
                                    "requests": len(c["requests"]), "errors": 0})
                    # The same pools and order with the policy that knows only the past.
                    results.append({"family": f, "workers": w, "seed": seed,
                                    "system": "sim-online", "repeat": 0,
                                    "gpu_blocks": c["gpu_blocks"],
                                    "hit_rate": b["policies"][sim.ONLINE_POLICY],
                                    "policy": sim.ONLINE_POLICY, "requests": len(c["requests"]),
                                    "errors": 0})
        save()

    for i, (f, w, seed, s, rep) in enumerate(todo):
        c = plan.cell(f, seed, a.trace)
        bkey = (c["set_key"], seed, rep)
        load_before = os.getloadavg()[0]
        if s == "bound" and bkey in bound_seen:
            summ = dict(bound_seen[bkey])
            wall = 0.0
        else:
            t_run = time.time()
            try:
                warm = plan.warmup_cell(f, seed) if a.warmup else None
                summ, records = run_system(a, tools, s, w, c, variants, warm)
            except Exception as e:  # noqa: BLE001  (one broken run must not lose the others)
                print(f"[{i + 1}/{len(todo)}] {f} w={w} seed={seed} {s}: FAILED {e}", flush=True)
                done_units += weight((f, w, seed, s, rep))
                continue
            wall = time.time() - t_run
            summ["load_before"] = round(load_before, 2)
            summ["load_after"] = round(os.getloadavg()[0], 2)
            report.records_path(out, f, w, seed, s, rep).write_text(json.dumps(
                {"summary": summ, "records": records}, indent=0))
            if s == "bound":
                bound_seen[bkey] = summ
        summ.update(family=f, workers=w, seed=seed, system=s, repeat=rep,
                    gpu_blocks=c["gpu_blocks"] if s != "bound" else None)
        results = [r for r in results if (r["family"], r["workers"], r["seed"], r["system"],
                                          r.get("repeat", 0)) != (f, w, seed, s, rep)]
        results.append(summ)
        save()
        done_units += weight((f, w, seed, s, rep))
        elapsed = time.time() - t0
        eta = elapsed / done_units * (total_units - done_units) if done_units else 0
        extra = ""
        if summ.get("prediction"):
            extra = f", pred MAE {summ['prediction']['mae_tokens']:.0f} tok"
        if summ.get("sim_check"):
            extra = f", sim check {summ['sim_check']['mismatched']}/{summ['sim_check']['requests']} off"
        ttft = summ.get("ttft_p99")
        print(f"[{i + 1}/{len(todo)}] {f} w={w} seed={seed} {s}: hit {summ.get('hit_rate')}, "
              f"TTFT p99 {'-' if ttft is None or s == 'bound' else f'{ttft:.2f} s'}, "
              f"errors {summ.get('errors')}{extra} ({wall:.0f} s wall, load {load_before:.1f}); "
              f"elapsed {fmt_dur(elapsed)}, ETA {fmt_dur(eta)}", flush=True)

    md = report.write_report(out, meta, make_plots=not a.no_plots)
    print(md)
    print(f"bench-compare: {out / 'report.md'}, {out / 'report.json'}; total {fmt_dur(time.time() - t0)}")


if __name__ == "__main__":
    main(sys.argv[1:])
