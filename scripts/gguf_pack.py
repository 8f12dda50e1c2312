"""Carry a GGUF file to a machine without network in fewer parts: a lossless repacking, then N parts.

The embedded model's file (SmolLM2-135M-Instruct.Q4_1.gguf, 98.4 MB) xz-compresses to 90.4 MB: its
block-quantized tensors interleave 2-4 bytes of fp16 scales with 16-32 bytes of quantized values, and
a compressor sees them mixed. Here each block-quantized tensor (Q4_1: 20-byte blocks, Q8_0: 34-byte
blocks) is split into a stream of its scales and a stream of its values, every stream is compressed
alone (lzma), and the file comes out at 87.2 MB: two parts of 43.6 MB, each small enough to travel
with the ~21 MB working tree under a 64 MiB transfer limit (scripts/device_reproduce.sh). Unpacking
needs only numpy and the standard library (no gguf package), and checks the sha256 of the whole file.

    python scripts/gguf_pack.py pack FILE.gguf --parts 2 --out .dev2     # .dev2/m1/model.part1, .dev2/m2/...
    python scripts/gguf_pack.py pack FILE.gguf --max-part 45000000 --first-part 44000000 --out .dev2   # as many
                                                                         # parts as that needs, the first smaller
    python scripts/gguf_pack.py unpack DIR [DIR ...] --out FILE.gguf     # the parts found in DIRs (any order)

The packed blob: b"QGPK", an 8-byte little-endian header length, a JSON header (file name, size,
sha256, the block-quantized segments [offset, bytes, block size, scale bytes], each stream's raw and
packed size), then the streams; the parts are the blob cut into N pieces of nearly equal size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

MAGIC = b"QGPK"
# block layouts of the quantized GGML types packed as two streams: type name -> (block bytes, scale bytes)
LAYOUTS = {"Q4_1": (20, 4), "Q8_0": (34, 2), "Q4_0": (18, 2), "Q5_0": (22, 6), "Q5_1": (24, 8)}
PRESET = 9 | lzma.PRESET_EXTREME
PART = "model.part{}"


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def segments(path: Path) -> list[list[int]]:
    """[offset, bytes, block bytes, scale bytes] of every tensor of a LAYOUTS type in the GGUF file, in file order."""
    from gguf import GGUFReader  # only to pack (here); unpacking reads the blob's own index

    out = []
    for t in GGUFReader(str(path)).tensors:
        name = t.tensor_type.name
        if name in LAYOUTS and int(t.n_bytes) % LAYOUTS[name][0] == 0:
            out.append([int(t.data_offset), int(t.n_bytes), *LAYOUTS[name]])
    return sorted(out)


def split_streams(raw: np.ndarray, segs: list[list[int]]) -> dict[str, bytes]:
    """{stream name: bytes}: "rest" (every byte outside the segments, in order), then per block layout its
    scales and its values (the segments of that layout in file order)."""
    mask = np.ones(len(raw), dtype=bool)
    parts: dict[str, list[bytes]] = {}
    for off, n, bs, pre in segs:
        mask[off:off + n] = False
        blocks = raw[off:off + n].reshape(-1, bs)
        parts.setdefault(f"scales{bs}", []).append(blocks[:, :pre].tobytes())
        parts.setdefault(f"values{bs}", []).append(blocks[:, pre:].tobytes())
    return {"rest": raw[mask].tobytes(), **{k: b"".join(v) for k, v in parts.items()}}


def join_streams(size: int, segs: list[list[int]], streams: dict[str, bytes]) -> bytes:
    """The file's bytes back from split_streams' streams."""
    out = np.zeros(size, dtype=np.uint8)
    mask = np.ones(size, dtype=bool)
    pos: dict[str, int] = {}
    for off, n, bs, pre in segs:
        mask[off:off + n] = False
        k = n // bs
        blocks = out[off:off + n].reshape(k, bs)
        for name, width, lo in ((f"scales{bs}", pre, 0), (f"values{bs}", bs - pre, pre)):
            start = pos.get(name, 0)
            blocks[:, lo:lo + width] = np.frombuffer(streams[name], np.uint8, k * width, start).reshape(k, width)
            pos[name] = start + k * width
    out[mask] = np.frombuffer(streams["rest"], np.uint8)
    return out.tobytes()


def pack(path: Path, preset: int = PRESET) -> bytes:
    """The packed blob of a GGUF file."""
    data = Path(path).read_bytes()
    raw = np.frombuffer(data, np.uint8)
    segs = segments(path)
    streams = split_streams(raw, segs)
    packed = {k: lzma.compress(v, preset=preset) for k, v in streams.items()}
    header = {"name": Path(path).name, "size": len(data), "sha256": _sha256(data), "segments": segs,
              "streams": [[k, len(streams[k]), len(packed[k])] for k in streams]}
    h = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(h)) + h + b"".join(packed[k] for k in streams)


def unpack(blob: bytes) -> tuple[str, bytes]:
    """(file name, the file's bytes) of a packed blob; ValueError if it is cut short or its sha256 differs."""
    if blob[:4] != MAGIC:
        raise ValueError("not a packed GGUF (no QGPK header): is the first part missing?")
    (hlen,) = struct.unpack("<Q", blob[4:12])
    header = json.loads(blob[12:12 + hlen])
    pos, streams = 12 + hlen, {}
    want = pos + sum(p for _, _, p in header["streams"])
    if len(blob) != want:
        raise ValueError(f"the parts hold {len(blob)} bytes, the packed file has {want}: a part is missing or cut short")
    for name, raw_n, packed_n in header["streams"]:
        streams[name] = lzma.decompress(blob[pos:pos + packed_n])
        if len(streams[name]) != raw_n:
            raise ValueError(f"stream {name}: {len(streams[name])} bytes, expected {raw_n}")
        pos += packed_n
    data = join_streams(header["size"], header["segments"], streams)
    if _sha256(data) != header["sha256"]:
        raise ValueError(f"{header['name']}: sha256 {_sha256(data)} after unpacking, expected {header['sha256']}")
    return header["name"], data


def cuts(total: int, parts: int = 0, max_part: int = 0, first_part: int = 0) -> list[int]:
    """Part sizes: ``parts`` nearly equal ones, or as few as parts of at most ``max_part`` bytes need, the first of
    at most ``first_part`` (what travels beside it leaves it less room; 0: max_part)."""
    if not max_part:
        return [-(-total // parts)] * (parts - 1) + [total - -(-total // parts) * (parts - 1)]
    first = min(first_part or max_part, total)
    rest = total - first
    n = -(-rest // max_part) if rest else 0
    return [first] + ([-(-rest // n)] * (n - 1) + [rest - -(-rest // n) * (n - 1)] if n else [])


def write_parts(blob: bytes, sizes: int | list[int], out: Path) -> list[Path]:
    """The blob in parts (n nearly equal ones, or these sizes): <out>/m<i>/model.part<i>, i = 1..n (old m<i>
    folders replaced)."""
    sizes = cuts(len(blob), sizes) if isinstance(sizes, int) else sizes
    if sum(sizes) != len(blob) or min(sizes) <= 0:
        raise ValueError(f"part sizes {sizes} do not cut {len(blob)} bytes")
    paths, pos = [], 0
    for i, n in enumerate(sizes, 1):
        d = Path(out) / f"m{i}"
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("model.part*"):
            old.unlink()
        p = d / PART.format(i)
        p.write_bytes(blob[pos:pos + n])
        pos += n
        paths.append(p)
    for stale in sorted(Path(out).glob("m[0-9]*")):  # parts of an earlier, longer cut
        if stale.name[1:].isdigit() and int(stale.name[1:]) > len(sizes):
            shutil.rmtree(stale)
    return paths


def read_parts(dirs: list[Path]) -> bytes:
    """The blob from the model.part<i> files found in ``dirs`` (each part once, i = 1..N without a gap)."""
    found = {}
    for d in dirs:
        for p in Path(d).glob("model.part*"):
            found[int(p.name.rsplit("part", 1)[1])] = p
    if not found:
        raise ValueError(f"no model.part<i> files in {' '.join(map(str, dirs))}")
    missing = [i for i in range(1, max(found) + 1) if i not in found]
    if missing:
        raise ValueError(f"part(s) {' '.join(map(str, missing))} missing (found {' '.join(map(str, sorted(found)))})")
    return b"".join(found[i].read_bytes() for i in sorted(found))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", allow_abbrev=False, help="FILE.gguf -> <out>/m<i>/model.part<i>")
    p.add_argument("file")
    p.add_argument("--parts", type=int, default=2)
    p.add_argument("--max-part", type=int, default=0, metavar="BYTES", help="as many parts as parts of at most "
                   "BYTES need (instead of --parts)")
    p.add_argument("--first-part", type=int, default=0, metavar="BYTES", help="with --max-part: the first part at "
                   "most BYTES (what travels with it leaves it less room)")
    p.add_argument("--out", default=".dev2")
    u = sub.add_parser("unpack", allow_abbrev=False, help="the parts in DIRs -> the GGUF file (sha256 checked)")
    u.add_argument("dirs", nargs="+")
    u.add_argument("--out", required=True, help="the GGUF file to write")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            if args.parts < 1:
                raise ValueError(f"--parts must be >= 1, got {args.parts}")
            blob = pack(Path(args.file))
            sizes = cuts(len(blob), args.parts, max(args.max_part, 0), max(args.first_part, 0))
            for path in write_parts(blob, sizes, Path(args.out)):
                print(f"{path} {path.stat().st_size} bytes")
            print(f"packed {args.file} ({Path(args.file).stat().st_size} bytes) into {len(blob)} bytes, {len(sizes)} parts")
        else:
            name, data = unpack(read_parts([Path(d) for d in args.dirs]))
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(out)
            print(f"unpacked {name}: {out} ({len(data)} bytes, sha256 {_sha256(data)})")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
