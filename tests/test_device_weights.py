"""benchmarks/device_weights.py: a file split here, carried in parts over several calls, joined and checked there.

A small random file stands in for the 253 MB GGUF; each refusal (a missing part, a part or a
whole whose sha256 is not the manifest's, parts of two splits) is one line naming what to send.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import device_weights as dw

SIZE = 1_000_003  # not a multiple of the part size: the last part is short
PART_MIB = 0.25


@pytest.fixture
def source(tmp_path) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
    return str(path)


def split(source: str, output) -> dw.Manifest:
    assert dw.main(["split", "--source", source, "--output", str(output), "--part-mib", str(PART_MIB)]) == 0
    return dw.read_manifest(os.path.join(output, dw.MANIFEST))


def carried(parts_dir, names: list[str], call) -> str:
    """The folder one call carries: the manifest and the named parts."""
    call.mkdir()
    for name in [dw.MANIFEST, *names]:
        shutil.copy(os.path.join(parts_dir, name), call / name)
    return str(call)


def test_split_writes_parts_of_at_most_the_size_and_a_manifest_of_their_sha256(source, tmp_path) -> None:
    manifest = split(source, tmp_path / "parts")
    data = open(source, "rb").read()
    assert [p.bytes for p in manifest.parts] == [262144, 262144, 262144, 213571]
    assert manifest.file == "model.gguf" and manifest.bytes == SIZE and manifest.sha256 == hashlib.sha256(data).hexdigest()
    assert manifest.source == {"path": source}
    offset = 0
    for part in manifest.parts:
        chunk = open(tmp_path / "parts" / part.name, "rb").read()
        assert part.name.startswith("model.gguf.part") and hashlib.sha256(chunk).hexdigest() == part.sha256
        assert chunk == data[offset:offset + part.bytes]
        offset += part.bytes
    # Split again, smaller: no part of the first split is left beside the new ones.
    assert dw.main(["split", "--source", source, "--output", str(tmp_path / "parts"), "--part-mib", "0.5"]) == 0
    assert sorted(os.listdir(tmp_path / "parts")) == [dw.MANIFEST, "model.gguf.part00", "model.gguf.part01"]


def test_parts_carried_over_calls_join_into_the_file_and_a_right_one_is_reused(source, tmp_path, capsys) -> None:
    manifest = split(source, tmp_path / "parts")
    names = [p.name for p in manifest.parts]
    into = str(tmp_path / "tmp-weights")
    capsys.readouterr()
    assert dw.main(["collect", carried(tmp_path / "parts", names[:1], tmp_path / "call1"), "--into", into]) == 0
    assert capsys.readouterr().out.strip() == f"1 of 4 parts of model.gguf in {into}, each checked; missing {', '.join(names[1:])}"
    assert dw.main(["collect", carried(tmp_path / "parts", names[1:3], tmp_path / "call2"), "--into", into]) == 0
    capsys.readouterr()
    # The last part comes with the call that joins.
    assert dw.main(["join", carried(tmp_path / "parts", names[3:], tmp_path / "call3"), "--into", into]) == 0
    joined = capsys.readouterr().out.strip()
    assert joined == os.path.join(into, "model.gguf") and open(joined, "rb").read() == open(source, "rb").read()
    for name in names:  # a later call joins nothing: the file is checked and reused
        os.remove(os.path.join(into, name))
    assert dw.join([], into) == joined


def test_a_missing_part_is_one_line_naming_it(source, tmp_path) -> None:
    manifest = split(source, tmp_path / "parts")
    names = [p.name for p in manifest.parts]
    call = carried(tmp_path / "parts", [names[0], names[2], names[3]], tmp_path / "call")
    done = subprocess.run([sys.executable, "-m", "benchmarks.device_weights", "join", call, "--into", str(tmp_path / "into")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"device_weights join: part {names[1]} is missing from {tmp_path / 'into'}, {call} "
                                  f"(1 of 4 parts missing: {names[1]}): carry it")


def test_a_part_whose_sha256_differs_is_refused_before_it_is_copied(source, tmp_path) -> None:
    manifest = split(source, tmp_path / "parts")
    call = carried(tmp_path / "parts", [manifest.parts[1].name], tmp_path / "call")
    damaged = os.path.join(call, manifest.parts[1].name)
    data = bytearray(open(damaged, "rb").read())
    data[1000] ^= 1
    open(damaged, "wb").write(bytes(data))
    with pytest.raises(dw.WeightsError, match=rf"^{damaged}: sha256 \w+… is not the manifest's \w+… for "
                                               rf"{manifest.parts[1].name}: send that part again$"):
        dw.collect([call], str(tmp_path / "into"))
    assert not os.path.exists(tmp_path / "into" / manifest.parts[1].name)
    open(damaged, "wb").write(bytes(data[:-5]))  # cut short: the size says so first
    with pytest.raises(dw.WeightsError, match=rf"^{damaged}: 262,139 bytes, the manifest's {manifest.parts[1].name} has 262,144"):
        dw.collect([call], str(tmp_path / "into"))


def test_a_part_damaged_in_place_or_a_wrong_whole_stops_the_join(source, tmp_path) -> None:
    manifest = split(source, tmp_path / "parts")
    into = tmp_path / "into"
    dw.collect([str(tmp_path / "parts")], str(into))
    last = into / manifest.parts[-1].name
    good = last.read_bytes()
    last.write_bytes(b"\0" + good[1:])
    with pytest.raises(dw.WeightsError, match=rf"^{last}: sha256 .* for {manifest.parts[-1].name}: send that part again$"):
        dw.join([], str(into))
    last.write_bytes(good)
    for folder in (tmp_path / "parts", into):  # every copy of the manifest promises another whole file
        data = json.loads((folder / dw.MANIFEST).read_text())
        data["sha256"] = "0" * 64
        (folder / dw.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(dw.WeightsError, match=r"the joined parts' sha256 \w+… is not the manifest's 000000000000…: split the file again"):
        dw.join([], str(into))
    assert sorted(os.listdir(into)) == sorted([dw.MANIFEST, *(p.name for p in manifest.parts)])  # no half-made file left


def test_parts_of_two_splits_are_not_mixed(source, tmp_path) -> None:
    split(source, tmp_path / "parts")
    dw.collect([str(tmp_path / "parts")], str(tmp_path / "into"))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another file")
    split(str(other), tmp_path / "parts2")
    with pytest.raises(dw.WeightsError, match=r"is another split than .*: remove \S+into and send the parts of one split"):
        dw.collect([str(tmp_path / "parts2")], str(tmp_path / "into"))
