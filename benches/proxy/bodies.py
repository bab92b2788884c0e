"""The request bodies of the benchmarks, made deterministically (same bytes for the same Pillow).

- `text_chat`: a ~2 KiB multi-turn text chat.
- `image_chat`: one user turn with one inline JPEG (data URL), the whole body ~1.53 MiB.
- `memory_traffic`: the bench-memory request sequence over a fixed pool of images and system
  prompts, some repeated.
"""
import base64
import io
import json
import random

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"

WORDS = ("the model routes each request to the worker that already holds its prefix cache so "
         "prefill is skipped for blocks it has seen before while images are hashed once and "
         "their identity names the blocks that follow them in the prompt of every turn").split()


def sentence_text(rng, n_bytes):
    out = []
    size = 0
    while size < n_bytes:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 18))).capitalize() + ". "
        out.append(s)
        size += len(s)
    return "".join(out)[:n_bytes].rstrip()


def _dump(body):
    return json.dumps(body, separators=(",", ":")).encode()


def text_chat(target_bytes=2048, seed=7):
    """A multi-turn text chat whose JSON is target_bytes long (within a few bytes)."""
    def build(pad):
        parts = [("system", 700), ("user", 400), ("assistant", 300), ("user", pad)]
        return {"model": MODEL, "max_tokens": 64, "messages": [
            {"role": role, "content": sentence_text(random.Random(seed * 10 + k), n)}
            for k, (role, n) in enumerate(parts)]}
    fixed = len(_dump(build(0)))
    return _dump(build(max(0, target_bytes - fixed)))


def jpeg(width, height, seed, quality):
    """A photo-like JPEG: smooth gradients under seeded noise (so it does not compress away)."""
    from PIL import Image

    rng = random.Random(seed)
    noise = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    r = Image.linear_gradient("L").resize((width, height))
    g = Image.radial_gradient("L").resize((width, height))
    b = r.rotate(90).resize((width, height))
    base = Image.merge("RGB", (r, g, b))
    img = Image.blend(base, noise, 0.3)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality, optimize=False, progressive=False)
    return buf.getvalue()


def jpeg_near(width, height, seed, target_bytes):
    """The JPEG of that size and seed whose quality gets its length closest to target_bytes."""
    lo, hi = 5, 98
    best = None
    while lo <= hi:
        q = (lo + hi) // 2
        data = jpeg(width, height, seed, q)
        if best is None or abs(len(data) - target_bytes) < abs(len(best) - target_bytes):
            best = data
        if len(data) < target_bytes:
            lo = q + 1
        else:
            hi = q - 1
    return best


def image_message(data, text, mime="image/jpeg"):
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text},
    ]}


def image_chat(target_bytes=int(1.53 * (1 << 20)), width=1600, height=1200, seed=11):
    """One user turn with one inline JPEG; the body is about target_bytes long."""
    overhead = len(_dump({"model": MODEL, "max_tokens": 64, "messages": [
        image_message(b"", "Describe this picture in one sentence.")]}))
    jpeg_bytes = (target_bytes - overhead) * 3 // 4
    data = jpeg_near(width, height, seed, jpeg_bytes)
    return _dump({"model": MODEL, "max_tokens": 64, "messages": [
        image_message(data, "Describe this picture in one sentence.")]})


# bench-memory's pool: (width, height) of each distinct image, from a thumbnail to a photo.
POOL_SIZES = [(320, 240), (480, 360), (640, 480), (800, 600), (1024, 768), (1280, 960),
              (400, 400), (720, 540), (960, 720), (1600, 1200), (560, 420), (1120, 840)]


def memory_traffic(requests, seed=5, with_images=True):
    """The same request sequence for every bench-memory configuration: list of bodies (bytes).

    Each request is a system prompt (one of 4), one image from the pool (Zipf-like choice, so
    popular images repeat) and a question of its own. The pool's JPEGs are drawn once. Without
    images, the same sequence with the image parts left out (what the state costs without
    the VMs' body buffers)."""
    rng = random.Random(seed)
    images = [jpeg(w, h, 100 + i, 80) if with_images else b"" for i, (w, h) in enumerate(POOL_SIZES)]
    systems = [sentence_text(random.Random(200 + i), 600) for i in range(4)]
    weights = [1.0 / (i + 1) for i in range(len(images))]
    bodies = []
    for n in range(requests):
        i = rng.choices(range(len(images)), weights)[0]
        question = f"Request {n}: " + sentence_text(random.Random(1000 + n), 120)
        user = image_message(images[i], question) if with_images else {"role": "user", "content": question}
        bodies.append(_dump({"model": MODEL, "max_tokens": 32, "messages": [
            {"role": "system", "content": systems[rng.randrange(len(systems))]}, user]}))
    return bodies
