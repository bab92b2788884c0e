#!/usr/bin/env python3
"""Builds tests/fixtures/kv_events/ from vLLM's OWN KV-event classes, and checks the mock
worker's events against them.

    .venv/bin/pip install -r scripts/requirements-kv-events.txt
    .venv/bin/python scripts/make-kv-event-fixtures.py            # (re)write the fixtures
    .venv/bin/python scripts/make-kv-event-fixtures.py --check target/debug/mock-worker

Not run by scripts/test (it downloads three vLLM wheels, ~300 MB each, once; only
`vllm/distributed/kv_events.py` is kept, in --cache). tests/kv_events.rs decodes what it wrote.

Where the classes come from (PyPI wheels, `pip download vllm==X --no-deps`):
  0.33.0  current form: events are msgspec structs with tag=True and no array_like, so maps
          tagged by "type"; EventBatch stays array_like ([ts, events, data_parallel_rank]).
  0.23.0  the last positional release: KVCacheEvent had array_like=True, so each event is
          [tag, field, ...] (0.24.0 dropped array_like).
  0.9.0   the oldest positional shape: BlockStored without medium/lora_name/extra_keys,
          BlockRemoved without medium, EventBatch without data_parallel_rank.

`kv_events.py` is imported standalone with only `msgspec` and `pyzmq` installed. Its vllm
imports are stubbed, none of them on the encoding path:
  vllm.config[.kv_events].KVEventsConfig  -> a plain class taking keyword arguments (the
                                             publisher's config record)
  vllm.logger.init_logger                 -> logging.getLogger
  vllm.utils.network_utils (0.33)          -> get_ip / get_tcp_uri / is_valid_ipv6_address /
                                             split_zmq_path (only used to bind tcp://*:0)
  vllm.v1.core.kv_cache_utils (>=0.1x)     -> ExternalBlockHash = bytes | int, its real value

Each fixture is a payload file NAME.msgpack (bytes exactly as vLLM's publisher encodes them:
msgspec.msgpack.Encoder().encode(batch)) and an entry in expected.json with what the decoder
must return, computed here from the Python objects: hashes folded to 64 bits (ints: low 64
bits two's complement; bytes: last 8 bytes big-endian, left-padded), extra keys classified
(str -> text, (str, int) -> mm, else other) and padded to one entry per block.

--check runs the mock worker with a KV-events config, subscribes with pyzmq (libzmq), decodes
every batch with vLLM 0.33's own msgspec types, and asks for a replay with a DEALER.
"""

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "kv_events"
VERSIONS = {"current": "0.33.0", "legacy": "0.23.0", "oldest": "0.9.0"}
MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------
# Loading vLLM's kv_events.py standalone


def kv_events_source(version, cache):
    """Path of vllm/distributed/kv_events.py from the vllm==version wheel (downloaded once)."""
    cache.mkdir(parents=True, exist_ok=True)
    kept = cache / f"kv_events-{version}.py"
    if kept.exists():
        return kept
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
             "--only-binary=:all:", "-q", "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            kept.write_bytes(z.read("vllm/distributed/kv_events.py"))
    return kept


class KVEventsConfig:
    """Stub of vllm.config.kv_events.KVEventsConfig: a record of keyword arguments."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def stub_vllm():
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    for name in ["vllm", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"]:
        module(name)
    module("vllm.config", KVEventsConfig=KVEventsConfig)
    module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    module("vllm.logger", init_logger=logging.getLogger)
    module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=lambda path: tuple(path.replace("//", "").rsplit(":", 2)),
    )
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)


def load(version, cache):
    stub_vllm()
    path = kv_events_source(version, cache)
    spec = importlib.util.spec_from_file_location(f"vllm_kv_events_{version.replace('.', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------
# What the decoder must return, from the Python objects


def fold(h):
    if isinstance(h, int):
        return h & MASK64
    return int.from_bytes(bytes(h)[-8:], "big")


def extra_key(k):
    if isinstance(k, str):
        return {"text": k}
    if isinstance(k, (tuple, list)) and len(k) == 2 and isinstance(k[0], str) \
            and isinstance(k[1], int) and not isinstance(k[1], bool):
        return {"mm": [k[0], k[1]]}
    return {"other": None}


def expected_event(e):
    kind = type(e).__name__
    get = lambda name, default=None: getattr(e, name, default)
    if kind == "BlockStored":
        hashes = [fold(h) for h in e.block_hashes]
        keys = [[] if entry is None else [extra_key(k) for k in entry]
                for entry in (get("extra_keys") or [])]
        keys = (keys + [[] for _ in hashes])[:len(hashes)]
        parent = e.parent_block_hash
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None if parent is None else fold(parent),
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_name": get("lora_name"),
            "medium": get("medium"),
            "extra_keys": keys,
            "group_idx": get("group_idx"),
            "kv_cache_spec_kind": get("kv_cache_spec_kind"),
        }
    if kind == "BlockRemoved":
        return {
            "type": "BlockRemoved",
            "block_hashes": [fold(h) for h in e.block_hashes],
            "medium": get("medium"),
            "group_idx": get("group_idx"),
        }
    if kind == "AllBlocksCleared":
        return {"type": "AllBlocksCleared", "medium": get("medium")}
    return {"type": "Unknown", "kind": kind}


def expected_batch(b):
    return {
        "ts": b.ts,
        "events": [expected_event(e) for e in b.events],
        "data_parallel_rank": getattr(b, "data_parallel_rank", None),
    }


# ---------------------------------------------------------------------------------------
# The fixtures

# Realistic values: 32-hex-char image identifiers (the router's content ids stamped as
# `uuid`), Qwen2.5-VL special tokens, sha256-sized bytes hashes.
IMG_A = "5d41402abc4b2a76b9719d911017c592"
IMG_B = "7d793037a0760186574b0282f2f435e7"
VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653
INT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, MASK64]
NEGATIVE = [-1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]
TS = 1763884800.25


def digest(i, n=32):
    return bytes((i * 37 + j * 11) & 255 for j in range(n))


def image_blocks():
    """Tokens of 3 blocks of 16: text, then IMG_A's pads over blocks 0..2, IMG_B in block 2."""
    tokens = [1, 2, 3, 4, VISION_START] + [IMAGE_PAD] * 27 + [VISION_END] + [5, 6] \
        + [VISION_START] + [IMAGE_PAD] * 10 + [VISION_END] + [7]
    assert len(tokens) == 48
    extra = [
        (("img-a", 5),),                          # IMG_A starts at token 5 of block 0
        (("img-a", -11),),                        # continues through block 1
        (("img-a", -27), ("img-b", 3)),           # ends in block 2, IMG_B starts there
    ]
    extra = [tuple((IMG_A if i == "img-a" else IMG_B, o) for i, o in keys) for keys in extra]
    return tokens, extra


def current_fixtures(kv):
    tokens, extra = image_blocks()
    big = [2**64 - 1, 2**63, 0x0123456789ABCDEF]
    out = []

    def add(name, batch, hashes, exact=None, note=""):
        out.append((name, batch, "tagged", hashes, exact, VERSIONS["current"], note))

    add("current-int-hashes", kv.KVEventBatch(ts=TS, data_parallel_rank=0, events=[
        kv.BlockStored(block_hashes=big, parent_block_hash=None, token_ids=tokens, block_size=16,
                       lora_id=None, medium=kv.MEDIUM_GPU, lora_name=None,
                       extra_keys=list(extra), group_idx=0),
        kv.BlockStored(block_hashes=[7], parent_block_hash=0x0123456789ABCDEF,
                       token_ids=list(range(100, 116)), block_size=16, lora_id=None,
                       medium=kv.MEDIUM_GPU, lora_name=None, extra_keys=[None], group_idx=0),
        kv.BlockRemoved(block_hashes=[2**63], medium=kv.MEDIUM_GPU, group_idx=0),
        kv.BlockRemoved(block_hashes=[2**64 - 1], medium=kv.MEDIUM_GPU, group_idx=0),
        kv.AllBlocksCleared(),
    ]), "int", note="what vLLM 0.33 sends by default: u64 hashes, mm keys over 3 blocks")

    add("current-bytes-hashes", kv.KVEventBatch(ts=TS, data_parallel_rank=2, events=[
        kv.BlockStored(block_hashes=[digest(1), digest(2), digest(3)], parent_block_hash=digest(0),
                       token_ids=tokens, block_size=16, lora_id=None, medium=kv.MEDIUM_GPU,
                       lora_name=None, extra_keys=list(extra), group_idx=0),
        kv.BlockRemoved(block_hashes=[digest(1), digest(9, 4), b""], medium=kv.MEDIUM_GPU),
    ]), "bytes", note="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: sha256 digests; a 4-byte and an empty one")

    add("current-int-edges", kv.KVEventBatch(ts=TS, data_parallel_rank=None, events=[
        kv.BlockRemoved(block_hashes=INT_EDGES + NEGATIVE, medium=None),
        kv.BlockStored(block_hashes=NEGATIVE[:2], parent_block_hash=-2**63, token_ids=[0, 2**32 - 1],
                       block_size=1, lora_id=None, medium=None, lora_name=None),
    ]), "int", note="every msgpack int width, signed and unsigned; data_parallel_rank unset (nil)")

    add("current-lora-salt-embeds", kv.KVEventBatch(ts=TS, data_parallel_rank=1, events=[
        kv.BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=tokens[:32],
                       block_size=16, lora_id=3, medium=kv.MEDIUM_CPU, lora_name="sql-adapter",
                       extra_keys=[
                           ("sql-adapter", (IMG_A, 5), "tenant-7-salt", digest(4)),
                           ("sql-adapter", (IMG_A, -11), digest(5)),
                       ],
                       group_idx=1, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=4096, locality="LOCAL", ownership="tier-2",
                       session_id="session-42", lookahead_token_ids=[[1, 2], [3, 4]]),
        kv.BlockRemoved(block_hashes=[11], medium=kv.MEDIUM_STORAGE, group_idx=1,
                        locality="REMOTE", ownership="tier-2"),
    ]), "int", note="LoRA name, cache salt and a prompt-embeds digest as untagged keys; every optional field set")

    add("current-empty", kv.KVEventBatch(ts=0.0, data_parallel_rank=0, events=[]),
        "int", note="a batch without events")

    add("current-empty-lists", kv.KVEventBatch(ts=TS, data_parallel_rank=0, events=[
        kv.BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=None, lora_name=None, extra_keys=[]),
        kv.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=None, lora_name=None, extra_keys=[None]),
        kv.BlockRemoved(block_hashes=[], medium=None),
    ]), "int", note="empty lists, extra_keys shorter than block_hashes (padded)")

    class BlockUpdated(kv.KVCacheEvent):
        """An event type from a future vLLM, built on vLLM's own tagged base class."""
        block_hashes: list[int]
        note: str | None = None

    add("current-unknown-type", kv.KVEventBatch(ts=TS, data_parallel_rank=0, events=[
        BlockUpdated(block_hashes=[1, 2, 3], note="future"),
        kv.AllBlocksCleared(),
    ]), "int", note="an event type the decoder does not know, then a known one")

    add("current-mock-shaped", kv.KVEventBatch(ts=TS, data_parallel_rank=0, events=[
        kv.BlockStored(block_hashes=[2**63 + 5, 6, 7], parent_block_hash=None, token_ids=tokens,
                       block_size=16, lora_id=None, medium=kv.MEDIUM_GPU, lora_name=None,
                       extra_keys=[extra[0] + ("salt",), extra[1], extra[2]], group_idx=0),
        kv.BlockRemoved(block_hashes=[6], medium=kv.MEDIUM_GPU, group_idx=0),
        kv.AllBlocksCleared(),
    ]), "int", exact="tagged-int",
        note="shaped like the mock's events: encode_batch must reproduce these bytes")
    return out


def legacy_fixtures(kv):
    tokens, extra = image_blocks()
    out = []

    def add(name, batch, hashes, exact=None, note=""):
        out.append((name, batch, "positional", hashes, exact, VERSIONS["legacy"], note))

    add("legacy-int-hashes", kv.KVEventBatch(ts=TS, data_parallel_rank=0, events=[
        kv.BlockStored(block_hashes=[2**64 - 1, 2**63, 5], parent_block_hash=None, token_ids=tokens,
                       block_size=16, lora_id=None, medium=kv.MEDIUM_GPU, lora_name=None,
                       extra_keys=list(extra), group_idx=0),
        kv.BlockRemoved(block_hashes=[5, -1], medium=kv.MEDIUM_GPU, group_idx=0),
        kv.AllBlocksCleared(),
    ]), "int", note="vLLM 0.23 positional arrays")

    add("legacy-bytes-hashes", kv.KVEventBatch(ts=TS, data_parallel_rank=None, events=[
        kv.BlockStored(block_hashes=[digest(1), digest(2), digest(3)], parent_block_hash=digest(0),
                       token_ids=tokens, block_size=16, lora_id=None, medium=kv.MEDIUM_GPU,
                       lora_name=None, extra_keys=None),
        kv.BlockRemoved(block_hashes=[digest(2)], medium=None),
    ]), "bytes", note="positional with sha256 digests, extra_keys None, data_parallel_rank unset")

    add("legacy-lora-salt", kv.KVEventBatch(ts=TS, data_parallel_rank=3, events=[
        kv.BlockStored(block_hashes=[11, 12], parent_block_hash=-10, token_ids=tokens[:32],
                       block_size=16, lora_id=3, medium=kv.MEDIUM_GPU, lora_name="sql-adapter",
                       extra_keys=[("sql-adapter", (IMG_A, 5), "salt"), None], group_idx=2,
                       kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None),
    ]), "int", note="0.23's untagged extra keys (LoRA name, (identifier, offset), salt) and a None entry")

    add("legacy-mock-shaped", kv.KVEventBatch(ts=TS, data_parallel_rank=0, events=[
        kv.BlockStored(block_hashes=[2**63 + 5, 6, 7], parent_block_hash=None, token_ids=tokens,
                       block_size=16, lora_id=None, medium=kv.MEDIUM_GPU, lora_name=None,
                       extra_keys=[extra[0] + ("salt",), extra[1], extra[2]], group_idx=0),
        kv.BlockRemoved(block_hashes=[6], medium=kv.MEDIUM_GPU, group_idx=0),
        kv.AllBlocksCleared(),
    ]), "int", exact="positional-int",
        note="positional twin of current-mock-shaped: encode_batch must reproduce these bytes")
    return out


def oldest_fixtures(kv):
    out = []
    out.append(("oldest-positional", kv.KVEventBatch(ts=TS, events=[
        kv.BlockStored(block_hashes=[-7, 2**63 - 1], parent_block_hash=None,
                       token_ids=list(range(32)), block_size=16, lora_id=None),
        kv.BlockRemoved(block_hashes=[-7]),
        kv.AllBlocksCleared(),
    ]), "positional", "int", None, VERSIONS["oldest"],
        "vLLM 0.9: [ts, events] without a rank; BlockStored of 5 fields, BlockRemoved of 1"))
    return out


def write_fixtures(cache, out_dir):
    mods = {k: load(v, cache) for k, v in VERSIONS.items()}
    fixtures = current_fixtures(mods["current"]) + legacy_fixtures(mods["legacy"]) \
        + oldest_fixtures(mods["oldest"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.msgpack"):
        old.unlink()
    encoder = msgspec.msgpack.Encoder()  # as ZmqEventPublisher._publisher_thread
    entries = []
    for name, batch, form, hashes, exact, version, note in fixtures:
        payload = encoder.encode(batch)
        (out_dir / f"{name}.msgpack").write_bytes(payload)
        entries.append({
            "name": name,
            "file": f"{name}.msgpack",
            "vllm": version,
            "form": form,
            "hashes": hashes,
            "encode_exact": exact,
            "note": note,
            "batch": expected_batch(batch),
        })
    doc = {
        "generated_by": "scripts/make-kv-event-fixtures.py",
        "vllm": VERSIONS,
        "msgspec": msgspec.__version__,
        "fixtures": entries,
    }
    (out_dir / "expected.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(entries)} fixtures to {out_dir.relative_to(ROOT)}")


# ---------------------------------------------------------------------------------------
# --check: the mock worker's events through libzmq and vLLM's own types


def check_mock(mock_bin, cache):
    import base64
    import http.client
    import struct
    import time
    import zlib

    import zmq

    kv = load(VERSIONS["current"], cache)
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)  # vLLM's own schema, strict
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0", "topic": "kv@mock@check", "buffer_steps": 100}
    proc = subprocess.Popen(
        [mock_bin, "--port", "0", "--time-scale", "0", "--num-gpu-blocks", "24",
         "--kv-events-config", json.dumps(config)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        pub = replay = port = None
        for line in proc.stderr:
            if " kv-events on " in line:
                words = line.split()
                pub = words[words.index("on") + 1]
                replay = words[words.index("replay") + 1]
            if " listening on " in line:
                port = int(line.split(" listening on ")[1].split()[0].rsplit(":", 1)[1])
                break
        assert pub and replay and port, "the mock did not print its kv-events and listening lines"
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@mock")
        sub.connect(pub.replace("0.0.0.0", "127.0.0.1"))
        time.sleep(0.3)  # the slow-joiner window of PUB/SUB

        def png(seed):
            raw = b"".join(b"\x00" + bytes((x * seed + y) & 255 for x in range(96)) for y in range(64))
            chunk = lambda k, d: struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d))
            return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 32, 64, 8, 2, 0, 0, 0))
                    + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))

        def post(path, body):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")

        uuid = "0123456789abcdef0123456789abcdef"
        url = "data:image/png;base64," + base64.b64encode(png(3)).decode()
        body = {"model": "Qwen/Qwen2.5-VL-7B-Instruct", "max_tokens": 4, "cache_salt": "s1",
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}, "uuid": uuid},
                    {"type": "text", "text": "what is this " * 10}]}]}
        status, _ = post("/v1/chat/completions", body)
        assert status == 200, status
        sub.RCVTIMEO = 5000
        seen = []
        while True:
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                break
            batch = decoder.decode(payload)
            seen.append((int.from_bytes(seq, "big"), batch))
            sub.RCVTIMEO = 500
        assert seen, "no KV events received"
        stored = [e for _, b in seen for e in b.events if isinstance(e, kv.BlockStored)]
        assert stored, "no BlockStored"
        first = stored[0]
        # Block 0 carries [uuid, placeholder start] (msgspec decodes the pair as a list), then
        # the cache salt: vLLM's order (mm keys, then the salt on the first block).
        start = first.token_ids.index(151655)  # Qwen2.5-VL <|image_pad|>
        assert list(first.extra_keys[0]) == [[uuid, start], "s1"], first.extra_keys
        assert first.parent_block_hash is None and first.group_idx == 0, first
        seqs = [s for s, _ in seen]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs

        status, answer = post("/reset_prefix_cache", {})
        assert status == 200 and answer == {"success": True}, (status, answer)
        topic, seq, payload = sub.recv_multipart()
        cleared = decoder.decode(payload)
        assert [type(e).__name__ for e in cleared.events] == ["AllBlocksCleared"], cleared

        dealer = ctx.socket(zmq.DEALER)
        dealer.RCVTIMEO = 5000
        dealer.connect(replay.replace("0.0.0.0", "127.0.0.1"))
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b"", frames
            rseq = int.from_bytes(frames[2], "big", signed=True)
            if rseq == -1:
                assert frames[1] == b"" and frames[3] == b"", frames
                break
            decoder.decode(frames[3])
            replayed.append(rseq)
        assert replayed == list(range(0, int.from_bytes(seq, "big") + 1)), replayed
        print(f"check: ok: {len(seen) + 1} live batches decoded by vLLM {VERSIONS['current']}'s "
              f"KVEventBatch over libzmq {zmq.zmq_version()}, replay of {len(replayed)} batches "
              f"then the -1 marker, AllBlocksCleared after /reset_prefix_cache")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mmrouter-vllm",
                    help="where vLLM's kv_events.py of each version is kept [~/.cache/mmrouter-vllm]")
    ap.add_argument("--out", type=Path, default=OUT, help="fixture directory [tests/fixtures/kv_events]")
    ap.add_argument("--check", metavar="MOCK_WORKER", help="check the mock worker's events instead")
    args = ap.parse_args()
    if args.check:
        check_mock(args.check, args.cache)
    else:
        write_fixtures(args.cache, args.out)


if __name__ == "__main__":
    main()
