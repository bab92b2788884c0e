import base64
import struct
import zlib

import pytest

from stack import Stack


def png(width, height, seed=0):
    """A real PNG (gradient plus a seed-dependent pattern): distinct seeds give distinct bytes."""
    rows = []
    for y in range(height):
        row = bytearray(b"\x00")
        for x in range(width):
            row += bytes(((x * 7 + seed * 31) & 255, (y * 5 + seed * 17) & 255, (x ^ y ^ seed) & 255))
        rows.append(bytes(row))

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))


def data_url(image, mime="image/png"):
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


def chat(*images, text="What is in this image?", model="Qwen/Qwen2.5-VL-7B-Instruct", **extra):
    content = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    content.append({"type": "text", "text": text})
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


@pytest.fixture(scope="module")
def stack():
    s = Stack(workers=4)
    yield s
    s.close()
