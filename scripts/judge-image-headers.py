#!/usr/bin/env python3
"""Pillow's verdict on image files where mmrouter's header reader and a reference decoder
disagree (the fuzz targets header_png, header_jpeg, header_webp, header_gif; docs/FUZZING.md).

For each file: whether Pillow opens it and decodes its first frame, its format, its size, and
the size after ImageOps.exif_transpose (what vLLM's image processor sees: vLLM's
normalize_image in ImageMediaIO.load_bytes). The header reader is right when it reports that
last size for a file Pillow decodes; a file Pillow refuses may be refused or sized either way.

Usage: .venv/bin/python scripts/judge-image-headers.py FILE...   (one JSON object per line)
Needs Pillow (scripts/requirements-fuzz.txt) in the project venv.
"""

import json
import sys

from PIL import Image, ImageOps


def judge(path: str) -> dict:
    out = {"file": path}
    try:
        with Image.open(path) as img:
            out["format"] = img.format
            out["size"] = list(img.size)
            img.load()
            out["decodes"] = True
            out["transposed_size"] = list(ImageOps.exif_transpose(img).size)
    except Exception as e:  # Pillow raises many types for broken files; all are a refusal.
        out["decodes"] = False
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in sys.argv[1:]:
        print(json.dumps(judge(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
