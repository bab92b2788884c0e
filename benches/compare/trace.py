"""Multimodal chat traces for the routing-quality harness: seeded families, the image pool.

A trace is JSONL. The first line is a header:

    {"type": "header", "family": "sessions", "seed": 1, "params": {...},
     "arrival": {"mode": "closed", "users": 8},          # or {"mode": "open"}
     "system_prompts": ["You are ...", ...],
     "images": [{"id": "img0007", "w": 1024, "h": 768, "fmt": "webp", "seed": 123}, ...]}

then one line per request (a turn of a session), sessions in order:

    {"type": "turn", "session": 3, "turn": 0, "system": 2, "at": 1.734, "images": ["img0007"],
     "text": "...", "max_tokens": 64}
    {"type": "turn", "session": 3, "turn": 1, "system": 2, "think": 2.1, "images": [],
     "text": "...", "max_tokens": 32}

Every turn re-sends the whole conversation: the session's system prompt, every earlier user
message with its images (inline data URLs; http URLs on the replay's image server in families
with `image_source="url"`) and every earlier answer as the worker streamed it (the mock's answer
depends only on the prompt). Turn k > 0 is sent `think` seconds after turn
k-1's answer ended. Arrival modes:

- `closed`: `users` concurrent users; each takes the next session in trace order, sends its
  turns one after another, then takes the next session (`at` is ignored);
- `open`: session s starts `at` seconds after the replay starts, whatever the load.

Images are references; their bytes are regenerated from (seed, size, format) by `ImagePool`,
so a trace file stays small and replays bit-identically. Families (`FAMILIES`, and the
held-out ones in `HELD_OUT`) are generated from a seed by `family_trace(name, seed)`; the legacy
single trace of earlier versions is `generate(seed)` (family `legacy`). Only the Python standard
library and Pillow are used.
"""
import base64
import io
import json
import math
import random
from pathlib import Path

WORDS = (
    "image photo picture scene object person car street building tree sky water table chair "
    "document invoice receipt chart graph table figure label text sign logo color shape "
    "left right top bottom center background foreground small large red blue green yellow "
    "describe explain count identify compare list summarize read extract locate estimate "
    "what where which how many why is are does the a an of in on with and or to from this "
    "that these those there here first second third last number total price date name "
    "between behind above below near far inside outside detail details visible shown"
).split()

# ----------------------------------------------------------------------------- families

# The reporter's trace of issue 9: 80 sessions of 1-4 turns (~200 requests), 40 images
# (JPEG/PNG/WebP, 200-1280 px, Zipf-popular, 0-2 per turn), 6 shared system prompts of
# 150-400 words, closed loop with 8 users.
SESSIONS = {
    "sessions": 80,
    "turns_weights": [0.25, 0.25, 0.25, 0.25],  # P(session has 1..4 turns)
    "system_prompts": 6,
    "system_words": [150, 400],
    "hot_system_share": None,  # share of sessions on system prompt 0 (None: uniform)
    "image_pool": 40,  # distinct images
    "image_zipf": 1.0,  # popularity: P(image of rank r) ~ 1 / r^zipf
    "new_image_share": None,  # hot images: None; else P(a slot takes a never-used image)
    "images_weights": [0.35, 0.45, 0.20],  # P(turn has 0..2 images)
    "first_text": None,  # fixed text of every first turn (None: random words)
    "min_px": 200,
    "max_px": 1280,
    "formats": {"jpeg": 0.5, "png": 0.25, "webp": 0.25},
    "user_words": [5, 40],
    "max_tokens": [8, 48],
    "think_s": [0.5, 2.5],
    "arrival": "closed",
    "users": 8,
    # open arrivals only:
    "rate": 4.0,  # mean requests per second (Poisson session starts at rate / mean turns)
    "burst_gap_s": 8.0,  # bursty: mean gap between burst starts (exponential)
    "burst_sessions": [8, 16],  # bursty: sessions that start in one burst
    "burst_spread_s": 1.0,  # bursty: a burst's sessions start within this many seconds
    "gpu_blocks": 4096,  # KV blocks per worker (the mock's default, as the reporter's run)
}

FAMILIES = {
    # What the reporter ran; caches hold the working set (4096 blocks per worker).
    "sessions": dict(SESSIONS),
    # The same traffic, caches that do not hold it: routing decides what survives eviction.
    "tight-1024": dict(SESSIONS, gpu_blocks=1024),
    # 256 blocks = 4096 tokens: sessions are cut before the first turn whose prompt plus
    # max_tokens cannot fit (run.py does it; the count is reported).
    "tight-256": dict(SESSIONS, gpu_blocks=256),
    # Open loop, arrivals in bursts: 8-16 sessions start within 1 s, bursts ~8 s apart.
    "bursty": dict(SESSIONS, sessions=96, arrival="bursty"),
    # Open loop Poisson at 4 requests/s; 90% of sessions share one 400-word system prompt:
    # herding pressure on whichever worker holds it.
    "hot-system": dict(SESSIONS, arrival="poisson", hot_system_share=0.9,
                       system_words=[400, 400]),
    # Mostly new images (90% of slots take an image never seen), each first turn is one image
    # and "Describe this image." behind a one-line system prompt: new content to spread.
    "many-images": dict(SESSIONS, sessions=160, turns_weights=[0.75, 0.25], system_prompts=1,
                        system_words=[6, 6], new_image_share=0.9, image_pool=None,
                        images_weights=[0.0, 1.0, 0.0], later_images_weights=[1.0],
                        first_text="Describe this image.", user_words=[4, 12]),
}

# Held out: shapes that no default was tuned on, first run in the eighty-sixth run
# (docs/BENCHMARKS.md), for checking a change on traffic it was not made for. Not in `all`:
# `--families held-out` runs them.
HELD_OUT = {
    # Closed loop, 12 users; longer conversations (1-6 turns), more images per turn (0-3), 10
    # system prompts of 50-300 words, 60 images less skewed; a cache about the working set.
    "long-sessions": dict(SESSIONS, sessions=60, users=12, turns_weights=[1, 1, 1, 1, 1, 1],
                          system_prompts=10, system_words=[50, 300], image_pool=60,
                          image_zipf=0.8, images_weights=[0.3, 0.4, 0.2, 0.1], gpu_blocks=2048),
    # Open loop, Poisson at 6 requests/s; half of the sessions on one of 4 system prompts;
    # 1-3 turns; a tight cache.
    "half-hot": dict(FAMILIES["hot-system"], sessions=120, rate=6.0, hot_system_share=0.5,
                     system_prompts=4, system_words=[100, 400], turns_weights=[1, 1, 1],
                     gpu_blocks=1024),
    # Open loop, bursts of 12-24 sessions ~10 s apart, 1-5 turns; a tight cache.
    "big-bursts": dict(FAMILIES["bursty"], burst_sessions=[12, 24], burst_gap_s=10.0,
                       turns_weights=[1, 1, 1, 1, 1], gpu_blocks=1024),
    # Open loop, Poisson at 5 requests/s, on a fleet of two speeds: worker i runs at
    # `worker_speeds[i % 2]` times the prefill, encoder and decode speed (a newer and an older
    # GPU). 8 system prompts of 80-350 words, 1-4 turns, 0-2 images; 2048 blocks per worker.
    "mixed-fleet": dict(SESSIONS, sessions=100, arrival="poisson", rate=5.0, system_prompts=8,
                        system_words=[80, 350], turns_weights=[1, 1, 1, 1],
                        images_weights=[0.3, 0.5, 0.2], gpu_blocks=2048,
                        worker_speeds=[1.0, 0.4]),
    # Written in the 197th run: closed loop, 8 users; 24 system prompts of 60-300 words (many
    # more groups than workers), 100 sessions of 1-4 turns; a tight cache.
    "many-prompts": dict(SESSIONS, sessions=100, system_prompts=24, system_words=[60, 300],
                         gpu_blocks=1024),
    # Written in the 197th run: no images at all (SGLang's own ground: its match on the text
    # is exact there), longer user turns; closed loop, 8 users; 128 blocks per worker (2,048
    # tokens): text alone fits 1024 blocks, where every router reached the bound.
    "text-only": dict(SESSIONS, image_pool=None, images_weights=[1.0], user_words=[20, 120],
                      gpu_blocks=128),
    # Written in the 208th run: images by http URL, not inline (`image_source`: the replay
    # serves the pool over loopback HTTP; mmrouter fetches each once through Envoy, SGLang
    # matches the URL text, the workers fetch as vLLM does). Closed loop, 8 users; 90 sessions
    # of 1-4 turns, 0-3 images a turn from 50 more skewed ones; 2048 blocks.
    "url-images": dict(SESSIONS, image_source="url", sessions=90, image_pool=50, image_zipf=1.2,
                       images_weights=[0.2, 0.5, 0.2, 0.1], gpu_blocks=2048),
}


# Parameters of the workers a family runs on, not of its traffic: `gpu_blocks` (KV blocks per
# worker) and `worker_speeds` (optional; worker i runs at `worker_speeds[i % len]` times the
# mock's speeds).
FLEET = ("gpu_blocks", "worker_speeds")


def worker_speed(speeds, i):
    """The speed factor of worker `i` under a family's `worker_speeds` (None: 1.0)."""
    speeds = speeds or [1.0]
    return speeds[i % len(speeds)]


# Every family a name selects (`legacy` aside): the tuned ones and the held-out ones.
NAMED = {**FAMILIES, **HELD_OUT}


def family_params(name):
    """The parameters of family `name`: one of `FAMILIES` or `HELD_OUT`."""
    return NAMED[name]


ARRIVAL_DOC = {
    "closed": "closed loop, {users} users",
    "poisson": "open loop, Poisson at {rate} req/s",
    "bursty": "open loop, bursts of {burst_sessions[0]}-{burst_sessions[1]} sessions within "
              "{burst_spread_s} s every ~{burst_gap_s} s",
}


def describe_family(name, p=None):
    """One line: the family's arrival mode and shape, for tables and docs."""
    p = p or family_params(name)
    arrival = ARRIVAL_DOC[p["arrival"]].format(**p)
    speeds = p.get("worker_speeds")
    fleet = f"; workers at {' / '.join(f'{x:g}' for x in speeds)}× speed" if speeds else ""
    return (f"{arrival}; {p['sessions']} sessions of 1-{len(p['turns_weights'])} turns; "
            f"{p['gpu_blocks']} blocks/worker{fleet}")


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _image_spec(rng, idx, p):
    # Width and height each uniform in [min_px, max_px].
    w, h = rng.randint(p["min_px"], p["max_px"]), rng.randint(p["min_px"], p["max_px"])
    fmts = p.get("formats") or {"jpeg": 0.75, "png": 0.25}
    fmt = rng.choices(list(fmts), list(fmts.values()))[0]
    return {"id": f"img{idx:04d}", "w": w, "h": h, "fmt": fmt, "seed": rng.randrange(1 << 30)}


def family_trace(name, seed, sessions=None, **overrides):
    """Returns (header, turns) for family `name` from `seed`; `sessions` scales it down (quick
    runs) and `overrides` replace parameters."""
    if name == "legacy":
        return generate(seed, **overrides)
    p = dict(family_params(name))
    p.update({k: v for k, v in overrides.items() if v is not None})
    if sessions:
        p["sessions"] = sessions
    # The traffic of a family is its own: the seed stream also depends on the family's shape,
    # not on the fleet it runs on (tight-* replay exactly the sessions trace of the same seed).
    shape = {k: v for k, v in p.items() if k not in FLEET}
    rng = random.Random(f"{seed}/{json.dumps(shape, sort_keys=True)}")
    n_sys = p["system_prompts"]
    systems = []
    for k in range(n_sys):
        lo, hi = p["system_words"]
        systems.append(f"You are assistant {k}. " + _words(rng, rng.randint(lo, hi)))

    images = []
    pool_n = p["image_pool"]
    if pool_n:
        images = [_image_spec(rng, i, p) for i in range(pool_n)]
    zipf = lambda n: [1.0 / (r + 1) ** p["image_zipf"] for r in range(n)]  # noqa: E731

    def pick_image(exclude):
        new_share = p["new_image_share"]
        if new_share is not None and (not images or rng.random() < new_share):
            spec = _image_spec(rng, len(images), p)
            images.append(spec)
            return spec["id"]
        weights = zipf(len(images))
        for _ in range(16):
            cand = rng.choices(images, weights)[0]["id"]
            if cand not in exclude:
                return cand
        return cand

    def pick_system():
        share = p["hot_system_share"]
        if share is not None:
            return 0 if rng.random() < share or n_sys == 1 else rng.randrange(1, n_sys)
        return rng.randrange(n_sys)

    tw = p["turns_weights"]
    mean_turns = sum((i + 1) * w for i, w in enumerate(tw)) / sum(tw)
    turns = []
    t = 0.0
    burst_left = 0
    for s in range(p["sessions"]):
        # Arrival time of the session's first turn (open loop only).
        if p["arrival"] == "poisson":
            t += rng.expovariate(p["rate"] / mean_turns)
            at = t
        elif p["arrival"] == "bursty":
            if burst_left == 0:
                t += rng.expovariate(1.0 / p["burst_gap_s"]) if s else 0.0
                burst_left = rng.randint(*p["burst_sessions"])
            burst_left -= 1
            at = t + rng.uniform(0, p["burst_spread_s"])
        else:
            at = 0.0
        n_turns = rng.choices(range(1, len(tw) + 1), tw)[0]
        system = pick_system()
        used = set()
        for k in range(n_turns):
            iw = p["images_weights"] if k == 0 else p.get("later_images_weights", p["images_weights"])
            n_img = rng.choices(range(len(iw)), iw)[0]
            imgs = []
            for _ in range(n_img):
                i = pick_image(used)
                used.add(i)
                imgs.append(i)
            if k == 0 and p["first_text"]:
                text = p["first_text"]
            else:
                text = _words(rng, rng.randint(*p["user_words"])) + "?"
            turn = {"type": "turn", "session": s, "turn": k, "system": system, "images": imgs,
                    "text": text, "max_tokens": rng.randint(*p["max_tokens"])}
            if k == 0:
                turn["at"] = round(at, 4)
            else:
                turn["think"] = round(rng.uniform(*p["think_s"]), 3)
            turns.append(turn)
    arrival = ({"mode": "closed", "users": p["users"]} if p["arrival"] == "closed"
               else {"mode": "open"})
    used_ids = {i for tr in turns for i in tr["images"]}
    header = {"type": "header", "family": name, "seed": seed, "params": p, "arrival": arrival,
              "system_prompts": systems, "images": [x for x in images if x["id"] in used_ids]}
    return header, turns


# ----------------------------------------------------------------------------- legacy trace

DEFAULTS = {
    "requests": 300,  # total requests (turns) in the trace
    "rate": 5.0,  # mean requests per second; session starts are Poisson at rate / mean turns
    "image_reuse": 0.5,  # probability that a new image slot re-uses an image already seen
    "reuse_zipf": 1.1,  # popularity skew among already-seen images (Zipf exponent over rank)
    "min_px": 256,
    "max_px": 1536,
    "system_words": 220,  # shared system prompt length (pseudo-tokens ~ words)
    "turns_weights": [0.4, 0.25, 0.15, 0.12, 0.08],  # P(session has 1..5 turns)
    "first_images_weights": [0.6, 0.3, 0.1],  # P(turn 0 has 1..3 images)
    "later_image_prob": 0.3,  # P(a follow-up turn adds one image)
    "user_words": [8, 60],
    "max_tokens": [24, 128],
    "think_s": [0.5, 3.0],
    "jpeg_share": 0.75,  # the rest are PNG
}


def _legacy_image_spec(rng, idx, p):
    # Sizes skew small (phone screenshots, thumbnails) with a tail of large photos.
    long_side = int(p["min_px"] + (p["max_px"] - p["min_px"]) * rng.random() ** 1.6)
    aspect = rng.choice([1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 9 / 16])
    if aspect >= 1:
        w, h = long_side, max(p["min_px"] // 2, int(long_side / aspect))
    else:
        w, h = max(p["min_px"] // 2, int(long_side * aspect)), long_side
    fmt = "jpeg" if rng.random() < p["jpeg_share"] else "png"
    return {"id": f"img{idx:04d}", "w": w, "h": h, "fmt": fmt, "seed": rng.randrange(1 << 30)}


def generate(seed=1, **overrides):
    """The earlier harness's single trace (family `legacy`): open loop, Poisson session starts
    at `rate`, one shared system prompt, sessions of 1-5 turns, 1-3 images on a first turn."""
    p = dict(DEFAULTS)
    p.update({k: v for k, v in overrides.items() if v is not None})
    rng = random.Random(seed)
    system_prompt = "You are a careful visual assistant. " + _words(rng, p["system_words"])
    images = []
    seen = []  # ids in first-use order (rank = popularity order for the Zipf pick)

    def pick_image(exclude):
        if seen and rng.random() < p["image_reuse"]:
            weights = [1.0 / (r + 1) ** p["reuse_zipf"] for r in range(len(seen))]
            for _ in range(8):
                cand = rng.choices(seen, weights)[0]
                if cand not in exclude:
                    return cand
        spec = _legacy_image_spec(rng, len(images), p)
        images.append(spec)
        seen.append(spec["id"])
        return spec["id"]

    tw = p["turns_weights"]
    mean_turns = sum((i + 1) * w for i, w in enumerate(tw)) / sum(tw)
    session_rate = p["rate"] / mean_turns
    turns = []
    t = 0.0
    session = 0
    while len(turns) < p["requests"]:
        t += rng.expovariate(session_rate)
        n_turns = rng.choices(range(1, len(tw) + 1), tw)[0]
        n_turns = min(n_turns, p["requests"] - len(turns))
        used = set()
        for k in range(n_turns):
            if k == 0:
                n_img = rng.choices(range(1, len(p["first_images_weights"]) + 1),
                                    p["first_images_weights"])[0]
            else:
                n_img = 1 if rng.random() < p["later_image_prob"] else 0
            imgs = []
            for _ in range(n_img):
                i = pick_image(used)
                used.add(i)
                imgs.append(i)
            turn = {"type": "turn", "session": session, "turn": k, "system": 0, "images": imgs,
                    "text": _words(rng, rng.randint(*p["user_words"])) + "?",
                    "max_tokens": rng.randint(*p["max_tokens"])}
            if k == 0:
                turn["at"] = round(t, 4)
            else:
                turn["think"] = round(rng.uniform(*p["think_s"]), 3)
            turns.append(turn)
        session += 1
    header = {"type": "header", "family": "legacy", "seed": seed, "params": p,
              "arrival": {"mode": "open"}, "system_prompts": [system_prompt], "images": images}
    return header, turns


# ----------------------------------------------------------------------------- files

def save(path, header, turns):
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for t in turns:
            f.write(json.dumps(t) + "\n")


def load(path):
    """Reads a trace; traces of the earlier format (one `system_prompt`, open loop) load as
    such."""
    header, turns = None, []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            if obj.get("type") == "header":
                header = obj
            else:
                turns.append(obj)
    if header is None:
        raise ValueError(f"{path}: no header line")
    if "system_prompts" not in header:
        header["system_prompts"] = [header.pop("system_prompt")]
    header.setdefault("arrival", {"mode": "open"})
    header.setdefault("family", Path(path).stem)
    for t in turns:
        t.setdefault("system", 0)
    return header, turns


def sessions_of(turns):
    """{session: [turns in order]} in first-appearance order."""
    out = {}
    for t in turns:
        out.setdefault(t["session"], []).append(t)
    for ts in out.values():
        ts.sort(key=lambda t: t["turn"])
    return out


# ----------------------------------------------------------------------------- images

def render_image(spec):
    """Deterministic image bytes for a spec: a smooth random field with shapes and grain, so
    that JPEG/PNG/WebP sizes look like photos/screenshots (KB to ~1 MB)."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(spec["seed"])
    w, h = spec["w"], spec["h"]
    small = Image.frombytes("RGB", (max(2, w // 32), max(2, h // 32)),
                            rng.randbytes(max(2, w // 32) * max(2, h // 32) * 3))
    img = small.resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(4, 20)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = x0 + rng.randrange(8, max(9, w // 3)), y0 + rng.randrange(8, max(9, h // 3))
        color = tuple(rng.randrange(256) for _ in range(3))
        if rng.random() < 0.5:
            draw.rectangle([x0, y0, x1, y1], fill=color)
        else:
            draw.ellipse([x0, y0, x1, y1], fill=color)
    out = io.BytesIO()
    if spec["fmt"] == "png":
        # Screenshot-like: flat colours, no grain (PNG of a noisy photo would be several MB).
        img.quantize(colors=48).convert("RGB").save(out, "PNG", compress_level=6)
        return out.getvalue()
    # Grain: a low-amplitude noise layer blended in (photos are not smooth).
    noise = Image.frombytes("L", (w, h), rng.randbytes(w * h)).filter(ImageFilter.BoxBlur(1))
    img = Image.blend(img, Image.merge("RGB", (noise, noise, noise)), 0.2)
    if spec["fmt"] == "webp":
        img.save(out, "WEBP", quality=80, method=2)
    else:
        img.save(out, "JPEG", quality=92)
    return out.getvalue()


MIME = {"jpeg": "image/jpeg", "png": "image/png", "webp": "image/webp"}
EXT = {"jpeg": "jpg", "png": "png", "webp": "webp"}


class ImagePool:
    """Image bytes and data URLs by id, generated once and cached on disk under `cache_dir`."""

    def __init__(self, header, cache_dir):
        self.specs = {s["id"]: s for s in header["images"]}
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._urls = {}

    def path(self, spec):
        return self.dir / f"{spec['seed']}-{spec['w']}x{spec['h']}.{EXT[spec['fmt']]}"

    def bytes(self, image_id):
        spec = self.specs[image_id]
        p = self.path(spec)
        if not p.exists():
            tmp = p.with_suffix(".tmp")
            tmp.write_bytes(render_image(spec))
            tmp.replace(p)
        return p.read_bytes()

    def data_url(self, image_id):
        url = self._urls.get(image_id)
        if url is None:
            spec = self.specs[image_id]
            url = f"data:{MIME[spec['fmt']]};base64," + base64.b64encode(self.bytes(image_id)).decode()
            self._urls[image_id] = url
        return url

    def http_url(self, image_id, base):
        """The image's URL on the replay's image server at `base` (it serves `self.dir`)."""
        return f"{base}/{self.path(self.specs[image_id]).name}"

    def warm(self):
        for i in self.specs:
            self.data_url(i)


# ----------------------------------------------------------------------------- bodies

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def user_message(text, image_ids, pool):
    content = [{"type": "image_url", "image_url": {"url": pool.data_url(i)}} for i in image_ids]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def body(messages, max_tokens):
    """The request body sent for a turn (streaming, usage in the last chunk)."""
    return json.dumps({
        "model": MODEL, "messages": messages, "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
    }).encode()


def summary(header, turns, pool=None):
    """A few numbers describing a trace (and its images, when a pool is given)."""
    uses = [i for t in turns for i in t["images"]]
    first_turns = [t for t in turns if t["turn"] == 0]
    s = {
        "family": header.get("family"),
        "requests": len(turns),
        "sessions": len(first_turns),
        "distinct_images": len({*uses}),
        "image_slots": len(uses),
        "image_slot_reuse": round(1 - len({*uses}) / max(1, len(uses)), 3),
        "multi_turn_requests": sum(1 for t in turns if t["turn"] > 0),
        "system_prompts": len({t["system"] for t in turns}),
    }
    if header["arrival"]["mode"] == "open":
        s["arrival_span_s"] = round(max(t["at"] for t in first_turns), 1)
    if pool is not None and pool.specs:
        sizes = sorted(len(pool.bytes(i)) for i in pool.specs)
        s["image_kb_min_median_max"] = [round(sizes[0] / 1024), round(sizes[len(sizes) // 2] / 1024),
                                        round(sizes[-1] / 1024)]
    px = sorted(x["w"] * x["h"] for x in header["images"])
    if px:
        s["image_px_median"] = int(math.sqrt(px[len(px) // 2]))
    return s


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write a seeded multimodal trace (JSONL)")
    ap.add_argument("--family", default="sessions", choices=[*NAMED, "legacy"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sessions", type=int)
    ap.add_argument("--out", required=True)
    ap.add_argument("--images-dir", help="also render the images here and print their sizes")
    a = ap.parse_args()
    h, ts = family_trace(a.family, a.seed, sessions=a.sessions)
    save(a.out, h, ts)
    pool = ImagePool(h, a.images_dir) if a.images_dir else None
    print(json.dumps(summary(h, ts, pool)))
