"""Multimodal chat workload: a seeded trace generator and the deterministic image pool.

A trace is JSONL. The first line is a header:

    {"type": "header", "seed": 1, "params": {...}, "system_prompt": "...",
     "images": [{"id": "img0007", "w": 1024, "h": 768, "fmt": "jpeg", "seed": 123}, ...]}

then one line per request (a turn of a session), ordered by session start:

    {"type": "turn", "session": 3, "turn": 0, "at": 1.734, "images": ["img0007"],
     "text": "...", "max_tokens": 96}
    {"type": "turn", "session": 3, "turn": 1, "think": 2.1, "images": [], "text": "...",
     "max_tokens": 64}

Turn 0 of a session is sent `at` seconds after the replay starts (Poisson arrivals). Turn k > 0
is sent `think` seconds after turn k-1 finished and re-sends the whole conversation: the shared
system prompt, every earlier user message with its images, and every earlier assistant answer
as the worker streamed it. Images are references; their bytes are regenerated from (seed, size,
format) by `ImagePool`, so a trace file stays small and replays bit-identically.

Only the Python standard library and Pillow are used.
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


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _image_spec(rng, idx, p):
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
    """Returns (header, turns) for a seeded workload; see the module doc for the shapes."""
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
        spec = _image_spec(rng, len(images), p)
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
            turn = {"type": "turn", "session": session, "turn": k, "images": imgs,
                    "text": _words(rng, rng.randint(*p["user_words"])) + "?",
                    "max_tokens": rng.randint(*p["max_tokens"])}
            if k == 0:
                turn["at"] = round(t, 4)
            else:
                turn["think"] = round(rng.uniform(*p["think_s"]), 3)
            turns.append(turn)
        session += 1
    header = {"type": "header", "seed": seed, "params": p, "system_prompt": system_prompt,
              "images": images}
    return header, turns


def save(path, header, turns):
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for t in turns:
            f.write(json.dumps(t) + "\n")


def load(path):
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
    return header, turns


def render_image(spec):
    """Deterministic image bytes for a spec: a smooth random field with shapes and grain, so
    that JPEG/PNG sizes look like photos/screenshots (tens of KB to ~1 MB)."""
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
    img.save(out, "JPEG", quality=92)
    return out.getvalue()


class ImagePool:
    """Image bytes and data URLs by id, generated once and cached on disk under `cache_dir`."""

    def __init__(self, header, cache_dir):
        self.specs = {s["id"]: s for s in header["images"]}
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._urls = {}

    def path(self, spec):
        ext = "jpg" if spec["fmt"] == "jpeg" else "png"
        return self.dir / f"{spec['seed']}-{spec['w']}x{spec['h']}.{ext}"

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
            mime = "image/jpeg" if spec["fmt"] == "jpeg" else "image/png"
            url = f"data:{mime};base64," + base64.b64encode(self.bytes(image_id)).decode()
            self._urls[image_id] = url
        return url

    def warm(self):
        for i in self.specs:
            self.data_url(i)


def summary(header, turns, pool=None):
    """A few numbers describing a trace (and its images, when a pool is given)."""
    uses = [i for t in turns for i in t["images"]]
    first_turns = [t for t in turns if t["turn"] == 0]
    s = {
        "requests": len(turns),
        "sessions": len(first_turns),
        "arrival_span_s": round(max(t["at"] for t in first_turns), 1),
        "distinct_images": len(header["images"]),
        "image_slots_new": len(uses),
        "image_slot_reuse": round(1 - len(header["images"]) / max(1, len(uses)), 3),
        "multi_turn_requests": sum(1 for t in turns if t["turn"] > 0),
    }
    if pool is not None:
        sizes = sorted(len(pool.bytes(i)) for i in pool.specs)
        s["image_kb_min_median_max"] = [round(sizes[0] / 1024), round(sizes[len(sizes) // 2] / 1024),
                                        round(sizes[-1] / 1024)]
    px = sorted(x["w"] * x["h"] for x in header["images"])
    s["image_px_median"] = int(math.sqrt(px[len(px) // 2]))
    return s


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write a seeded multimodal trace (JSONL)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--image-reuse", type=float)
    ap.add_argument("--out", required=True)
    ap.add_argument("--images-dir", help="also render the images here and print their sizes")
    a = ap.parse_args()
    h, ts = generate(a.seed, requests=a.requests, rate=a.rate, image_reuse=a.image_reuse)
    save(a.out, h, ts)
    pool = ImagePool(h, a.images_dir) if a.images_dir else None
    print(json.dumps(summary(h, ts, pool)))
