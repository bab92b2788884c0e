#!/usr/bin/env python3
"""Writes tests/fixtures/tokens.json: image token counts computed by transformers itself.

Usage: python3 scripts/make-token-fixture.py   (from anywhere; no arguments)

It creates (or reuses) the virtualenv /work/main/.venv -- or $TOKEN_FIXTURE_VENV -- installs
`transformers`, `pillow` and `numpy` there (NO torch: only the PIL image processors are used),
re-executes itself inside it and writes the fixture. tests/tokens.rs checks every entry against
`mmrouter::tokens`.

Where each count comes from (all transformers' own code, nothing re-implemented here):

* qwen2.5-vl / qwen3-vl: `Qwen2VLImageProcessorPil(...).get_number_of_image_patches(h, w)`
  (the helper vLLM calls too), divided by merge_size**2 exactly as
  `Qwen2VLProcessor/Qwen3VLProcessor._get_num_multimodal_tokens` does. Qwen3-VL and Qwen3.5 use
  the same image processor class (transformers' auto mapping), configured with the released
  checkpoints' preprocessor_config values. A ValueError (aspect ratio > 200, zero size) is stored
  as null.
* gemma4:B: `transformers.models.gemma4.processing_gemma4.get_aspect_ratio_preserving_size`, the
  function `Gemma4Processor._get_num_multimodal_tokens` calls (building a Gemma4Processor needs a
  tokenizer from the Hub), then `(th // patch) * (tw // patch) // pooling**2` as there.
* internvl: `GotOcr2ImageProcessorPil(crop_to_patches=True, size=448x448, max_patches=12)
  .get_number_of_image_patches(h, w)` (the InternVL checkpoints' processor) times
  `InternVLProcessor.image_seq_length` (256).

Cross-check: for every size whose longer side is at most CROSS_MAX px, the script also runs the
real image processors on a blank PIL image of that size (`Qwen2VLImageProcessorPil.__call__` ->
image_grid_thw, `Gemma4ImageProcessorPil.__call__` -> num_soft_tokens_per_image,
`GotOcr2ImageProcessorPil.__call__` -> num_patches) and fails if they disagree with the helpers.
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("TOKEN_FIXTURE_VENV", str(ROOT / ".venv")))
OUT = ROOT / "tests" / "fixtures" / "tokens.json"
PACKAGES = ["transformers", "pillow", "numpy"]
CROSS_MAX = 1600
CROSS_EVERY = 3  # run the real processors on every third eligible size (time)


def ensure_venv() -> None:
    """Re-executes this script inside the venv, creating it and installing packages if needed."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    probe = subprocess.run(
        [str(python), "-c", "import transformers, PIL, numpy"], capture_output=True
    )
    if probe.returncode != 0:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *PACKAGES], check=True
        )
    os.execv(str(python), [str(python), __file__, *sys.argv[1:]])


def sizes() -> list[tuple[int, int]]:
    """(width, height) pairs: tiny, thin, square, photos, huge, ties, limits, random."""
    out: list[tuple[int, int]] = []
    tiny = [1, 2, 3, 4, 5, 7, 8, 10, 13, 14, 15, 16, 17, 20, 23, 27, 28, 29, 30]
    out += [(w, h) for w in tiny for h in tiny]
    out += [(s, s) for s in range(1, 31)]
    thin = [
        (1, 5000), (5000, 1), (3000, 14), (14, 3000), (1, 200), (1, 201), (200, 1),
        (201, 1), (2, 400), (2, 401), (400, 2), (401, 2), (10, 2000), (10, 2001),
        (2000, 10), (2001, 10), (50, 10000), (50, 10001), (10000, 50), (10001, 50),
        (1, 100), (100, 1), (3, 900), (900, 3), (5, 999), (7, 1400), (1400, 7),
        (28, 5600), (5600, 28), (32, 6400), (6400, 32), (48, 9600), (9600, 48),
        (1, 30), (30, 1), (1, 2), (2, 1), (16, 3000), (3000, 16), (100, 19999),
    ]
    out += thin
    squares = [32, 48, 56, 64, 96, 100, 128, 224, 255, 256, 257, 336, 384, 448, 512, 640,
               672, 768, 896, 1000, 1024, 1280, 1344, 1536, 2048, 3072, 3584, 3585, 3598,
               4096, 4097, 4111, 5000, 6144, 8192, 9999, 10000]
    out += [(s, s) for s in squares]
    photos = [
        (640, 480), (480, 640), (640, 360), (360, 640), (800, 600), (1024, 768),
        (1280, 720), (720, 1280), (1280, 960), (1600, 1200), (1920, 1080), (1080, 1920),
        (2560, 1440), (3840, 2160), (2160, 3840), (4032, 3024), (3024, 4032), (4000, 3000),
        (6000, 4000), (4000, 6000), (7680, 4320), (8000, 6000), (9999, 7777), (10000, 7500),
        (1170, 2532), (1284, 2778), (750, 1334), (2480, 3508), (3508, 2480), (1200, 628),
        (1080, 1350), (1080, 1080), (500, 375), (333, 500), (612, 612), (299, 299),
        (4608, 3456), (5472, 3648), (6720, 4480), (8256, 5504), (9504, 6336), (4480, 6720),
        (1366, 768), (1440, 900), (1536, 864), (2880, 1800), (3000, 2000), (1000, 667),
    ]
    out += photos
    # Rounding ties for Python's round-half-even: side / factor = k + 0.5 exactly.
    for k in range(0, 60):
        out.append((28 * k + 14, 28 * ((k * 7) % 50) + 14))  # qwen2.5-vl factor 28
        out.append((32 * k + 16, 32 * ((k * 11) % 50) + 16))  # qwen3-vl factor 32
        out.append((28 * k + 14, 640))
        out.append((1024, 32 * k + 16))
    # Around Qwen's min/max pixel limits and Gemma 4's budgets.
    for s in (55, 56, 57, 83, 84, 85, 253, 254, 255, 256, 257, 258, 3583, 3584, 3586, 4095, 4096,
              4098, 4127, 4128):
        out += [(s, s), (s + 1, s), (s, s - 1)]
    for budget in (70, 140, 280, 560, 1120):
        side = int(math.isqrt(budget * 9 * 256))
        out += [(side - 1, side), (side, side), (side + 1, side + 1), (side * 2, side // 2)]
    # Aspect ratios right at 200.
    for h in (1, 2, 3, 7, 14, 16, 28, 50):
        out += [(200 * h, h), (200 * h + 1, h), (h, 200 * h), (h, 200 * h + 1), (200 * h - 1, h)]
    # Beyond 65535 px and up to u32::MAX: products above 2**53 exercise exact int division.
    out += [(65535, 65535), (65535, 1), (1, 65535), (65535, 328), (100000, 100000),
            (99999, 77777), (4294967295, 4294967295), (4000000000, 3999999999),
            (2147483655, 1073741827), (4294967295, 21474837), (4294967295, 21474836),
            (3000000019, 2999999993), (123456789, 987654321), (987654321, 123456789)]
    rng = random.Random(20240917)
    for _ in range(500):  # log-uniform sides from 1 to 10000
        w = int(round(math.exp(rng.uniform(0, math.log(10000)))))
        h = int(round(math.exp(rng.uniform(0, math.log(10000)))))
        out.append((max(1, w), max(1, h)))
    for _ in range(250):  # typical photo sizes
        out.append((rng.randint(200, 5000), rng.randint(200, 5000)))
    for _ in range(100):  # extreme aspect ratios near and past 200
        h = rng.randint(1, 60)
        out.append((h * rng.randint(100, 260) + rng.randint(0, h), h))
    seen = set()
    unique = []
    for s in out:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique


def main() -> None:
    ensure_venv()
    import numpy as np
    import transformers
    from PIL import Image
    from transformers.models.gemma4 import processing_gemma4
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # Blank 1- and 3-px wide images make transformers warn that the channel axis is ambiguous
    # inside the processors' internal steps; the counts are checked below, so keep it quiet.
    transformers.logging.set_verbosity_error()

    qwen = {
        # Released checkpoints' preprocessor_config.json values.
        "qwen2.5-vl": Qwen2VLImageProcessorPil(
            patch_size=14, merge_size=2, min_pixels=3136, max_pixels=12845056
        ),
        "qwen3-vl": Qwen2VLImageProcessorPil(
            patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216
        ),
    }
    budgets = (70, 140, 280, 560, 1120)
    gemma4 = {b: Gemma4ImageProcessorPil(max_soft_tokens=b) for b in budgets}
    internvl = GotOcr2ImageProcessorPil(
        crop_to_patches=True, size={"height": 448, "width": 448}, min_patches=1, max_patches=12
    )
    internvl_seq = 256  # InternVLProcessor image_seq_length default

    def count_qwen(name: str, w: int, h: int):
        p = qwen[name]
        try:
            return p.get_number_of_image_patches(h, w) // (p.merge_size**2)
        except (ValueError, ZeroDivisionError):
            return None

    def count_gemma4(budget: int, w: int, h: int):
        p = gemma4[budget]
        try:
            th, tw = processing_gemma4.get_aspect_ratio_preserving_size(
                height=h,
                width=w,
                patch_size=p.patch_size,
                max_patches=budget * p.pooling_kernel_size**2,
                pooling_kernel_size=p.pooling_kernel_size,
            )
        except (ValueError, ZeroDivisionError):
            return None
        return (th // p.patch_size) * (tw // p.patch_size) // p.pooling_kernel_size**2

    def count_internvl(w: int, h: int):
        try:
            return internvl.get_number_of_image_patches(h, w) * internvl_seq
        except (ValueError, ZeroDivisionError):
            return None

    columns = ["qwen2.5-vl", "qwen3-vl"] + [f"gemma4:{b}" for b in budgets] + ["internvl"]
    cases = []
    for w, h in sizes():
        row = [count_qwen("qwen2.5-vl", w, h), count_qwen("qwen3-vl", w, h)]
        row += [count_gemma4(b, w, h) for b in budgets]
        row.append(count_internvl(w, h))
        cases.append([w, h, row])

    # Cross-check the helpers against the processors run on real (blank) images.
    checked = 0
    eligible = [c for c in cases if max(c[0], c[1]) <= CROSS_MAX]
    for i, (w, h, row) in enumerate(eligible):
        if i % CROSS_EVERY and not (w <= 30 and h <= 30 and i % 7 == 0):
            continue
        image = Image.new("RGB", (w, h), (120, 60, 30))
        # The processors infer the channel axis from the array shape; give it explicitly, as a
        # 1x3 or 3x3 image would otherwise be ambiguous.
        arr = np.asarray(image)
        kw = {"input_data_format": "channels_last"}
        for j, name in enumerate(("qwen2.5-vl", "qwen3-vl")):
            want = row[j]
            if want is None:
                continue
            out = qwen[name](images=[arr], **kw)
            t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
            got = t * gh * gw // qwen[name].merge_size ** 2
            assert got == want, f"{name} {w}x{h}: processor {got} != helper {want}"
        for j, b in enumerate(budgets):
            want = row[2 + j]
            if want is None:
                continue
            out = gemma4[b](images=[arr], **kw)
            got = int(out["num_soft_tokens_per_image"][0])
            assert got == want, f"gemma4:{b} {w}x{h}: processor {got} != helper {want}"
        want = row[-1]
        if want is not None:
            out = internvl(images=[arr], **kw)
            got = int(out["num_patches"][0]) * internvl_seq
            assert got == want, f"internvl {w}x{h}: processor {got} != helper {want}"
        checked += 1

    doc = {
        "generator": "scripts/make-token-fixture.py",
        "transformers": transformers.__version__,
        "functions": {
            "qwen2.5-vl": "Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, min_pixels=3136, "
            "max_pixels=12845056).get_number_of_image_patches(h, w) // 4",
            "qwen3-vl": "Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=65536, "
            "max_pixels=16777216).get_number_of_image_patches(h, w) // 4",
            "gemma4:B": "processing_gemma4.get_aspect_ratio_preserving_size(h, w, 16, B*9, 3) "
            "-> (th//16)*(tw//16)//9",
            "internvl": "GotOcr2ImageProcessorPil(crop_to_patches=True, size=448x448, "
            "max_patches=12).get_number_of_image_patches(h, w) * 256",
        },
        "cross_checked_with_real_images": checked,
        "columns": columns,
        "null_means": "the processor raises (zero size, aspect ratio over 200, ...)",
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w") as f:
        f.write("{\n")
        items = [(k, v) for k, v in doc.items() if k != "cases"]
        for k, v in items:
            f.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
        f.write('  "cases": [\n')
        f.write(",\n".join("    " + json.dumps(c, separators=(",", ":")) for c in cases))
        f.write("\n  ]\n}\n")
    print(
        f"wrote {OUT} ({len(cases)} sizes, {OUT.stat().st_size} bytes, transformers "
        f"{transformers.__version__}, {checked} sizes cross-checked with real images)"
    )


if __name__ == "__main__":
    main()
