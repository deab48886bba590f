"""Shared by test_prepare.py and test_prepare_safety.py: the fixtures, running
zinc.prepare in this process, and reading its outputs back with their layout
checked."""
import array
import json
import os
import struct
import zlib

from tokenizers import Tokenizer

from conftest import REPO
from zinc import prepare

FIX = REPO / "tests" / "fixtures" / "prepare"
LLAMA3, CHATML = FIX / "llama3", FIX / "chatml"
EXPECTED = json.loads((FIX / "expected_chat.json").read_text(encoding="utf-8"))


def tok(folder):
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def run_prepare(tmp_path, capsys, *args, tokenizer=LLAMA3, seq_len=256, name="out"):
    """Runs main() in this process; returns (exit status, stderr, prefix)."""
    prefix = tmp_path / name
    rc = prepare.main([*map(str, args), "--tokenizer", str(tokenizer), "--seq-len", str(seq_len),
                       "--out", str(prefix)])
    return rc, capsys.readouterr().err, prefix


def read_outputs(prefix):
    """(tokens, mask, docs, manifest, header) of PREFIX.*, checking the layout: llm.c's header, then the set
    record (the bytes "ZINC", version 1, the CRC-32 and size of the .mask and of the .docs, the rows' seq_len
    of --pack rows or 0, the bytes "TCRC" and the CRC-32 of the tokens), the rest 0."""
    raw = open(f"{prefix}.bin", "rb").read()
    header = array.array("i", raw[:1024])
    typecode = {(20240520, 1): "H", (20240801, 7): "I"}[(header[0], header[1])]
    tokens = array.array(typecode, raw[1024:])
    mask_raw, docs_raw = open(f"{prefix}.mask", "rb").read(), open(f"{prefix}.docs", "rb").read()
    u = struct.unpack("<256I", raw[:1024])
    assert len(tokens) == header[2] and raw[12:16] == b"ZINC" and u[4] == 1 and list(u[14:]) == [0] * 242
    assert raw[48:52] == b"TCRC" and u[13] == zlib.crc32(raw[1024:])
    assert (u[5], u[6] + (u[7] << 32)) == (zlib.crc32(mask_raw), len(mask_raw))
    assert (u[8], u[9] + (u[10] << 32)) == (zlib.crc32(docs_raw), len(docs_raw))
    mask = list(mask_raw)
    docs = list(array.array("Q", docs_raw))
    manifest = json.loads(open(f"{prefix}.json").read())
    assert u[11] == (manifest["seq_len"] if manifest["pack"] == "rows" else 0)
    assert manifest["crc32"] == {"tokens": zlib.crc32(raw[1024:]), "mask": u[5], "documents": u[8]}
    assert len(mask) == len(tokens) and set(mask) <= {0, 1}
    assert docs[0] == 0 and all(a < b for a, b in zip(docs, docs[1:])) and docs[-1] < len(tokens)
    return list(tokens), mask, docs, manifest, header


def bad_lines(err):
    return [int(line.split(":")[2]) for line in err.splitlines() if ": bad record " in line]


def snapshot(folder):
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))}
