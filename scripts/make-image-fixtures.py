#!/usr/bin/env python3
"""Writes the image fixtures of tests/image_header.rs and their expected sizes.

Creates (or reuses) the venv /work/main/.venv -- or $MMROUTER_VENV -- installs Pillow from PyPI
into it, re-executes itself there, and writes small real encodings into
tests/fixtures/images/ plus expected.json: for each file the format and the size that vLLM's
image processor sees, i.e. PIL's size after ImageOps.exif_transpose (vLLM's normalize_image,
applied in ImageMediaIO.load_bytes; see src/image_header.rs).

Odd sizes everywhere so that a width/height mix-up fails the tests. The fixtures are committed;
the Rust tests do not need Python.

Usage: python3 scripts/make-image-fixtures.py
"""

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("MMROUTER_VENV", ROOT / ".venv"))
OUT = ROOT / "tests" / "fixtures" / "images"


def ensure_venv() -> None:
    py = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if not py.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
    subprocess.check_call([str(py), "-m", "pip", "install", "-q", "Pillow>=11.1"])
    os.execv(str(py), [str(py), __file__, *sys.argv[1:]])


def pattern(mode: str, size: tuple[int, int]):
    """A deterministic picture with structure (so JPEG/WebP are not trivially tiny)."""
    from PIL import Image

    w, h = size
    img = Image.new("RGBA", size)
    px = img.load()
    for y in range(h):
        for x in range(w):
            px[x, y] = ((x * 7) % 256, (y * 11) % 256, ((x + y) * 5) % 256, (x * y) % 256)
    if mode == "RGBA":
        return img
    return img.convert("RGB").convert(mode) if mode != "RGB" else img.convert("RGB")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def interlaced_png(size: tuple[int, int]) -> bytes:
    """Pillow cannot write Adam7 PNGs, so build one: 8-bit RGB, filter 0 on every row."""
    w, h = size
    img = pattern("RGB", size)
    px = img.load()
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
    raw = bytearray()
    for x0, y0, dx, dy in passes:
        cols = range(x0, w, dx)
        if not cols:
            continue
        for y in range(y0, h, dy):
            raw.append(0)
            for x in cols:
                raw.extend(px[x, y])
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 1)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(bytes(raw), 9))
        + png_chunk(b"IEND", b"")
    )


def exif_with_orientation(o: int) -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = o
    exif[0x010F] = "mmrouter-fixture"  # Make, so IFD0 has more than one entry
    return exif.tobytes()


def jpeg_with_fill_bytes(data: bytes) -> bytes:
    """Insert 0xFF fill bytes before every marker segment up to SOS (legal per T.81 B.1.1.2)."""
    out = bytearray(data[:2])
    i = 2
    while i < len(data):
        assert data[i] == 0xFF
        marker = data[i + 1]
        out += b"\xff\xff\xff"  # padding, then the marker's own 0xFF below
        if marker == 0xDA:
            out += data[i:]
            break
        length = struct.unpack(">H", data[i + 2 : i + 4])[0]
        out += data[i : i + 2 + length]
        i += 2 + length
    return bytes(out)


def gif_frame_beyond_screen(data: bytes, screen: tuple[int, int]) -> bytes:
    """Shrink the logical screen so the first frame sticks out (Pillow grows the size)."""
    return data[:6] + struct.pack("<HH", *screen) + data[10:]


def main() -> None:
    ensure_venv()
    from io import BytesIO

    from PIL import Image, ImageCms, ImageOps

    OUT.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}

    def save(name: str, img, fmt: str, **kw) -> None:
        buf = BytesIO()
        img.save(buf, fmt, **kw)
        files[name] = buf.getvalue()

    # PNG
    save("png_rgb8_37x23.png", pattern("RGB", (37, 23)), "PNG")
    img16 = Image.new("I;16", (41, 19))
    img16.putdata([(i * 997) % 65536 for i in range(41 * 19)])
    save("png_gray16_41x19.png", img16, "PNG")
    rgb16 = pattern("RGB", (29, 13))
    # 16-bit RGB: Pillow reads but cannot write it; build from an 8-bit image's rows.
    rows = bytearray()
    rpx = rgb16.load()
    for y in range(13):
        rows.append(0)
        for x in range(29):
            for c in rpx[x, y]:
                rows += struct.pack(">H", c * 257)
    files["png_rgb16_29x13.png"] = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", struct.pack(">IIBBBBB", 29, 13, 16, 2, 0, 0, 0))
        + png_chunk(b"IDAT", zlib.compress(bytes(rows), 9))
        + png_chunk(b"IEND", b"")
    )
    save("png_palette_53x17.png", pattern("RGB", (53, 17)).quantize(16), "PNG")
    save("png_gray_alpha_31x45.png", pattern("RGBA", (31, 45)).convert("LA"), "PNG")
    files["png_interlaced_43x27.png"] = interlaced_png((43, 27))
    save("png_wide_1000x7.png", pattern("RGB", (1000, 7)), "PNG")
    save("png_exif_orient6_37x23.png", pattern("RGB", (37, 23)), "PNG", exif=exif_with_orientation(6))

    # JPEG
    save("jpeg_baseline_37x23.jpg", pattern("RGB", (37, 23)), "JPEG", quality=80)
    save("jpeg_progressive_61x35.jpg", pattern("RGB", (61, 35)), "JPEG", quality=80, progressive=True)
    save("jpeg_cmyk_33x21.jpg", pattern("RGB", (33, 21)).convert("CMYK"), "JPEG", quality=80)
    save("jpeg_gray_7x1000.jpg", pattern("L", (7, 1000)), "JPEG", quality=60)
    save(
        "jpeg_exif_orient6_37x23.jpg",
        pattern("RGB", (37, 23)),
        "JPEG",
        quality=80,
        exif=exif_with_orientation(6),
    )
    save(
        "jpeg_exif_orient8_51x29.jpg",
        pattern("RGB", (51, 29)),
        "JPEG",
        quality=80,
        exif=exif_with_orientation(8),
    )
    save(
        "jpeg_exif_orient3_45x19.jpg",
        pattern("RGB", (45, 19)),
        "JPEG",
        quality=80,
        exif=exif_with_orientation(3),
    )
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    save(
        "jpeg_icc_exif_restart_progressive_57x31.jpg",
        pattern("RGB", (57, 31)),
        "JPEG",
        quality=80,
        progressive=True,
        icc_profile=srgb,
        exif=exif_with_orientation(1),
        comment=b"APP/COM segments before SOF",
        restart_marker_blocks=1,
    )
    save("jpeg_restart_39x25.jpg", pattern("RGB", (39, 25)), "JPEG", quality=80, restart_marker_rows=1)
    files["jpeg_fill_bytes_37x23.jpg"] = jpeg_with_fill_bytes(files["jpeg_baseline_37x23.jpg"])
    # orientation only in XMP: Pillow's getexif() falls back to tiff:Orientation
    base = files["jpeg_baseline_37x23.jpg"]
    xmp = (
        b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF><rdf:Description '
        b'xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
    )
    payload = b"http://ns.adobe.com/xap/1.0/\x00" + xmp
    files["jpeg_xmp_orient6_37x23.jpg"] = base[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + base[2:]

    # WebP
    save("webp_lossy_37x23.webp", pattern("RGB", (37, 23)), "WEBP", quality=80)
    save("webp_lossless_45x27.webp", pattern("RGB", (45, 27)), "WEBP", lossless=True)
    save("webp_alpha_vp8x_39x21.webp", pattern("RGBA", (39, 21)), "WEBP", quality=80)
    frames = [pattern("RGB", (47, 25)).rotate(i * 90) for i in range(3)]
    save("webp_animated_47x25.webp", frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100, loop=0)
    save(
        "webp_exif_orient6_37x23.webp",
        pattern("RGB", (37, 23)),
        "WEBP",
        quality=80,
        exif=exif_with_orientation(6),
    )

    # GIF
    save("gif_still_37x23.gif", pattern("RGB", (37, 23)).quantize(32), "GIF")
    gframes = [pattern("RGB", (43, 21)).rotate(i * 180).quantize(16) for i in range(3)]
    save("gif_animated_43x21.gif", gframes[0], "GIF", save_all=True, append_images=gframes[1:], duration=80, loop=0)
    files["gif_frame_beyond_screen_37x23.gif"] = gif_frame_beyond_screen(files["gif_still_37x23.gif"], (30, 9))

    expected = {}
    for name, data in sorted(files.items()):
        (OUT / name).write_bytes(data)
        with Image.open(BytesIO(data)) as im:
            fmt = im.format
            transposed = ImageOps.exif_transpose(im)
            w, h = transposed.size
        expected[name] = {"format": {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt], "width": w, "height": h}
    (OUT / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    total = sum(len(d) for d in files.values())
    print(f"wrote {len(files)} fixtures, {total} bytes, with Pillow {Image.__version__}")


if __name__ == "__main__":
    main()
