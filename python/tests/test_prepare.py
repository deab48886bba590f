"""python -m zinc.prepare against the fixtures of tests/fixtures/prepare (made by
make_fixtures.py there): token ids equal to the tokenizers package's own encode,
exact masks, document offsets, the manifest, bad records by line, truncation,
uint16 and uint32 files, and nothing half-written after a failed or interrupted
run. Issue 49: outputs that are files the run reads are refused, a run killed
at each phase of its commit leaves the old set, the new one or one the .bin's
set record refuses, bounded chat templates, and one-line errors for what is no
regular file or no prefix. Chat renderings are checked against the committed
output of transformers' apply_chat_template (expected_chat.json), and against
transformers itself where it is installed. Needs tokenizers and jinja2; no
torch, no network."""
import array
import fcntl
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import zlib

import pytest

from conftest import REPO

tokenizers = pytest.importorskip("tokenizers", reason="zinc.prepare needs the tokenizers package (setup.sh)")
pytest.importorskip("jinja2", reason="zinc.prepare renders chat templates with jinja2 (setup.sh)")
from tokenizers import Tokenizer  # noqa: E402

from zinc import prepare  # noqa: E402
# The tool's parts, whose globals a test patches where the code reads them (prepare's copies are not read).
from zinc import _prepare_outputs, _prepare_records, _prepare_template  # noqa: E402

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
    record (the bytes "ZINC", version 1, the CRC-32 and size of the .mask and of the .docs), the rest 0."""
    raw = open(f"{prefix}.bin", "rb").read()
    header = array.array("i", raw[:1024])
    typecode = {(20240520, 1): "H", (20240801, 7): "I"}[(header[0], header[1])]
    tokens = array.array(typecode, raw[1024:])
    mask_raw, docs_raw = open(f"{prefix}.mask", "rb").read(), open(f"{prefix}.docs", "rb").read()
    u = struct.unpack("<256I", raw[:1024])
    assert len(tokens) == header[2] and raw[12:16] == b"ZINC" and u[4] == 1 and list(u[11:]) == [0] * 245
    assert (u[5], u[6] + (u[7] << 32)) == (zlib.crc32(mask_raw), len(mask_raw))
    assert (u[8], u[9] + (u[10] << 32)) == (zlib.crc32(docs_raw), len(docs_raw))
    mask = list(mask_raw)
    docs = list(array.array("Q", docs_raw))
    manifest = json.loads(open(f"{prefix}.json").read())
    assert manifest["crc32"] == {"tokens": zlib.crc32(raw[1024:]), "mask": u[5], "documents": u[8]}
    assert len(mask) == len(tokens) and set(mask) <= {0, 1}
    assert docs[0] == 0 and all(a < b for a, b in zip(docs, docs[1:])) and docs[-1] < len(tokens)
    return list(tokens), mask, docs, manifest, header


def split_docs(tokens, mask, docs):
    bounds = docs + [len(tokens)]
    return [(tokens[a:b], mask[a:b]) for a, b in zip(bounds, bounds[1:])]


def bad_lines(err):
    return [int(line.split(":")[2]) for line in err.splitlines() if ": bad record " in line]


def reports(err):
    """The bad-record lines and the count of those not listed."""
    return [line for line in err.splitlines() if ": bad record " in line or "not listed" in line]


def test_text_files_one_document_per_file(tmp_path, capsys):
    t = tok(LLAMA3)
    eos = t.token_to_id("<|eot_id|>")
    files = [FIX / "docs" / "a.txt", FIX / "docs" / "b.txt"]
    rc, err, prefix = run_prepare(tmp_path, capsys, *files)
    assert rc == 0, err
    assert "format text (inferred" in err
    tokens, mask, docs, manifest, header = read_outputs(prefix)
    expected = [t.encode(f.read_text(encoding="utf-8")).ids + [eos] for f in files]
    assert expected[0][0] == t.token_to_id("<|begin_of_text|>")  # the post-processor's BOS
    assert [d for d, _ in split_docs(tokens, mask, docs)] == expected
    assert docs == [0, len(expected[0])]
    assert mask == [1] * len(tokens) and manifest["masked_share"] == 0.0
    assert (header[0], header[1]) == (20240520, 1) and os.path.getsize(f"{prefix}.bin") == 1024 + 2 * len(tokens)


@pytest.mark.parametrize("split,texts", [
    ("paragraphs", ["The quick brown fox jumps over the lazy dog.\nIt was a bright cold day in April.",
                    "First paragraph of the second file:\nit has two lines.",
                    "Second paragraph, naïve café, 日本語.", "Third paragraph."]),
    ("lines", ["The quick brown fox jumps over the lazy dog.", "It was a bright cold day in April.",
               "First paragraph of the second file:", "it has two lines.", "Second paragraph, naïve café, 日本語.",
               "Third paragraph."]),
])
def test_text_split(tmp_path, capsys, split, texts):
    t = tok(LLAMA3)
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "docs" / "a.txt", FIX / "docs" / "b.txt",
                                  "--format", "text", "--split", split)
    assert rc == 0, err
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    eos = t.token_to_id("<|eot_id|>")
    assert [d for d, _ in split_docs(tokens, mask, docs)] == [t.encode(x).ids + [eos] for x in texts]
    assert [s["records"] for s in manifest["sources"]] == ([1, 3] if split == "paragraphs" else [2, 4])


def test_jsonl_text_and_bad_records(tmp_path, capsys):
    t = tok(CHATML)  # no BOS, eos <|im_end|> (a serialized AddedToken in tokenizer_config.json)
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl", tokenizer=CHATML)
    assert rc == 0, err
    assert "format jsonl (inferred" in err
    assert bad_lines(err) == [3, 5, 6, 7, 8]
    assert "text.jsonl:3: invalid JSON" in err and "text.jsonl:5: missing field 'text'" in err
    assert "text.jsonl:6: field 'text' is a int, not a string" in err and "text.jsonl:7: empty" in err
    assert "text.jsonl:8: a JSON list, not an object" in err
    lines = (FIX / "text.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(lines[i])["text"] for i in (0, 1, 8)]
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    eos = t.token_to_id("<|im_end|>")
    expected = [t.encode(x).ids + [eos] for x in texts]
    assert [d for d, _ in split_docs(tokens, mask, docs)] == expected
    assert docs == [0, len(expected[0]), len(expected[0]) + len(expected[1])]
    assert manifest["sources"][0]["records"] == 3 and manifest["sources"][0]["bad_records"] == 5
    assert manifest["bad_records"] == 5 and manifest["format_used"] == "jsonl"


def alpaca_records():
    return [json.loads(x) for x in (FIX / "alpaca.jsonl").read_text(encoding="utf-8").splitlines()]


def test_alpaca_masks_exactly_the_prompt(tmp_path, capsys):
    t = tok(LLAMA3)
    eos = t.token_to_id("<|eot_id|>")
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl")
    assert rc == 0, err
    assert "format alpaca (inferred" in err
    assert bad_lines(err) == [5, 6, 7]
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    got = split_docs(tokens, mask, docs)
    assert len(got) == 4
    for r, (ids, m) in zip(alpaca_records(), got):
        form = prepare.ALPACA_PROMPT_INPUT if r.get("input") else prepare.ALPACA_PROMPT
        prompt = t.encode(form.format(instruction=r["instruction"], input=r.get("input"))).ids
        response = t.encode(r["output"], add_special_tokens=False).ids + [eos]
        assert prompt[0] == t.token_to_id("<|begin_of_text|>")
        assert ids == prompt + response
        assert m == [0] * len(prompt) + [1] * len(response)
        assert t.decode([i for i, k in zip(ids, m) if k], skip_special_tokens=False) == r["output"] + "<|eot_id|>"
    assert manifest["masked_share"] == pytest.approx(mask.count(0) / len(mask))


def expected_rows(folder, source):
    return [r for r in EXPECTED[folder] if r["source"] == source]


@pytest.mark.parametrize("folder", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_chat_equals_transformers_committed(tmp_path, capsys, folder):
    """Tokens and mask of every chat record equal transformers' apply_chat_template(tokenize=True,
    return_assistant_tokens_mask=True) as committed; the records transformers refuses are bad records."""
    t = tok(folder)
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "chat.jsonl", tokenizer=folder)
    assert rc == 0, err
    assert "format chat (inferred" in err
    rows = expected_rows(folder.name, "chat")
    good = [r for r in rows if "error" in r or sum(r["assistant_masks"]) > 0]
    refused = [r["line"] for r in rows if "error" in r]
    no_assistant = [r["line"] for r in rows if "error" not in r and sum(r["assistant_masks"]) == 0]
    assert bad_lines(err) == sorted(refused + no_assistant + [5, 7])
    for line in refused:
        assert f"chat.jsonl:{line}: the chat template failed" in err
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    got = split_docs(tokens, mask, docs)
    want = [r for r in good if "error" not in r]
    assert len(got) == len(want) == manifest["documents"]
    renderer = prepare.ChatRenderer(prepare.load_tokenizer(str(folder)))
    records = [json.loads(x) for x in (FIX / "chat.jsonl").read_text(encoding="utf-8").splitlines()]
    for r, (ids, m) in zip(want, got):
        text, _ = renderer.render_with_spans(prepare.normalize_messages(records[r["line"] - 1]["messages"]))
        assert text == r["text"]
        assert ids == r["ids"] == t.encode(text, add_special_tokens=False).ids
        assert m == r["assistant_masks"]


@pytest.mark.parametrize("folder,labels", [
    (LLAMA3, ["Yes, naïve café 日本語.<|eot_id|>", "You are welcome.<|eot_id|>"]),
    (CHATML, ["  Yes, naïve café 日本語.  <|im_end|>\n", "You are welcome.<|im_end|>\n"]),
], ids=["llama3", "chatml"])
def test_chat_mask_covers_the_assistant_turns(tmp_path, capsys, folder, labels):
    """What a label is, spelled out: each assistant turn's content and what the template writes after it
    (end-of-turn, ChatML's newline); never the system, user or assistant header tokens."""
    t = tok(folder)
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "chat.jsonl", tokenizer=folder)
    assert rc == 0, err
    ids, m = split_docs(*read_outputs(prefix)[:3])[1]  # record 2: system, user, assistant, user, assistant
    runs, current = [], []
    for i, k in zip(ids, m):
        if k:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    assert [t.decode(r, skip_special_tokens=False) for r in runs] == labels


@pytest.mark.parametrize("folder", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_alpaca_with_chat_template(tmp_path, capsys, folder):
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl", "--use-chat-template", tokenizer=folder)
    assert rc == 0, err
    got = split_docs(*read_outputs(prefix)[:3])
    want = expected_rows(folder.name, "alpaca")
    assert [ids for ids, _ in got] == [r["ids"] for r in want]
    assert [m for _, m in got] == [r["assistant_masks"] for r in want]


@pytest.mark.parametrize("folder", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_chat_rendering_equals_live_transformers(folder):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed; "
                                       "expected_chat.json (made with it) is checked instead")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    renderer = prepare.ChatRenderer(prepare.load_tokenizer(str(folder)))
    for line in (FIX / "chat.jsonl").read_text(encoding="utf-8").splitlines():
        messages = json.loads(line).get("messages")
        if not isinstance(messages, list):
            continue
        try:
            want = hf.apply_chat_template(messages, tokenize=False)
        except Exception:
            with pytest.raises(Exception):
                renderer.render(prepare.normalize_messages(messages))
            continue
        assert renderer.render([{k: v for k, v in m.items() if v is not None} for m in messages]) == want
        for gen in (False, True):
            assert renderer.render(messages[:1], add_generation_prompt=gen) == \
                hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=gen)


def test_committed_expectations_were_made_by_transformers():
    assert EXPECTED["transformers"] and set(EXPECTED) == {"transformers", "llama3", "chatml"}


def test_truncation_off_and_on(tmp_path, capsys):
    t = tok(LLAMA3)
    eos = t.token_to_id("<|eot_id|>")
    seq_len = 12
    lines = (FIX / "text.jsonl").read_text(encoding="utf-8").splitlines()
    full = [t.encode(json.loads(lines[i])["text"]).ids + [eos] for i in (0, 1, 8)]
    assert all(len(f) > seq_len + 1 for f in full)
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl", seq_len=seq_len, name="off")
    assert rc == 1 and "more than --seq-len + 1 = 13" in err and "error: nothing usable" in err
    assert not list(tmp_path.iterdir())
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl", "--truncate", seq_len=seq_len, name="on")
    assert rc == 0, err
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    assert [d for d, _ in split_docs(tokens, mask, docs)] == [f[:seq_len + 1] for f in full]
    assert manifest["truncate"] is True and manifest["seq_len"] == seq_len
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl", "--chunk", seq_len=seq_len, name="chunk")
    assert rc == 0, err
    tokens, mask, docs, _, _ = read_outputs(prefix)
    chunks = [f[i:i + seq_len + 1] for f in full for i in range(0, len(f), seq_len + 1)]
    assert [d for d, _ in split_docs(tokens, mask, docs)] == chunks


def test_alpaca_truncated_to_no_label_is_bad(tmp_path, capsys):
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl", "--truncate", seq_len=8)
    assert rc == 1 and "no training label left" in err


def test_manifest(tmp_path, capsys):
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "chat.jsonl", tokenizer=CHATML, seq_len=160)
    assert rc == 0, err
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()  # noqa: E731
    assert manifest["format"] == "zinc.prepare/1" and manifest["format_used"] == "chat"
    assert manifest["tokenizer"] == str(CHATML / "tokenizer.json")
    assert manifest["tokenizer_sha256"] == sha(CHATML / "tokenizer.json")
    assert manifest["vocab_size"] == tok(CHATML).get_vocab_size(with_added_tokens=True)
    assert manifest["token_dtype"] == "uint16"
    assert (manifest["tokens"], manifest["documents"]) == (len(tokens), len(docs))
    assert manifest["masked_share"] == pytest.approx(mask.count(0) / len(mask)) and 0 < manifest["masked_share"] < 1
    assert manifest["sources"] == [{"path": str(FIX / "chat.jsonl"), "sha256": sha(FIX / "chat.jsonl"),
                                    "records": len(docs), "bad_records": 4}]
    assert manifest["files"] == {"tokens": "out.bin", "mask": "out.mask", "documents": "out.docs"}
    assert manifest["data"] == {"type": "tokens", "path": f"{prefix}.bin", "mask_path": f"{prefix}.mask",
                                "documents_path": f"{prefix}.docs", "vocab_size": manifest["vocab_size"],
                                "seq_len": 160}
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.docs", "out.json", "out.mask"]


def test_uint32_tokens_for_a_large_vocabulary(tmp_path, capsys):
    from tokenizers import models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["<eos>"] = 70000
    big = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "big"
    folder.mkdir()
    big.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    data = tmp_path / "big.jsonl"
    data.write_text('{"text": "w69999 w3 w65536 w65535"}\n{"text": "w1"}\n')
    rc, err, prefix = run_prepare(tmp_path, capsys, data, tokenizer=folder)
    assert rc == 0, err
    tokens, mask, docs, manifest, header = read_outputs(prefix)
    assert (header[0], header[1], header[2]) == (20240801, 7, 7)
    assert tokens == [69999, 3, 65536, 65535, 70000, 1, 70000] and docs == [0, 5]
    assert manifest["token_dtype"] == "uint32" and manifest["vocab_size"] == 70001
    assert os.path.getsize(f"{prefix}.bin") == 1024 + 4 * 7


def snapshot(folder):
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder))}


def test_failed_run_keeps_earlier_outputs(tmp_path, capsys):
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl")
    assert rc == 0, err
    before = snapshot(tmp_path)
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl", "--max-bad", "0")
    assert rc == 1 and err.strip().splitlines()[-1].startswith("zinc.prepare: error: more than --max-bad 0")
    assert snapshot(tmp_path) == before  # the old outputs, and no temporaries
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "chat.jsonl", "--format", "alpaca")
    assert rc == 1 and "error: nothing usable" in err
    assert snapshot(tmp_path) == before


def test_interrupted_run_leaves_nothing(tmp_path, capsys, monkeypatch):
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl")
    before = snapshot(tmp_path)
    written = []

    def interrupted(self, docs):  # Ctrl-C once documents are in the temporaries
        original(self, docs)
        written.append(self.files["bin"].tell())
        raise KeyboardInterrupt
    original = prepare.Outputs.add
    monkeypatch.setattr(prepare.Outputs, "add", interrupted)
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert rc == 130 and "interrupted" in err and written and written[0] > 1024
    assert snapshot(tmp_path) == before


def test_bad_records_listed_then_counted(tmp_path, capsys):
    data = tmp_path / "many.jsonl"
    data.write_text("".join("{broken\n" if i % 2 else '{"text": "ok"}\n' for i in range(30)))
    rc, err, prefix = run_prepare(tmp_path, capsys, data)
    assert rc == 0, err
    assert bad_lines(err) == list(range(2, 21, 2)) and "5 more bad records not listed" in err
    assert read_outputs(prefix)[3]["sources"][0]["bad_records"] == 15


def test_progress_line(tmp_path, capsys):
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl", "--progress")
    assert rc == 0 and "tokens/s" in err


def test_command_line(tmp_path):
    """python -m zinc.prepare in a fresh interpreter (the environment the other tests get: PYTHONPATH)."""
    help_out = subprocess.run([sys.executable, "-m", "zinc.prepare", "--help"], capture_output=True, text=True)
    assert help_out.returncode == 0 and "--tokenizer" in help_out.stdout
    run = subprocess.run([sys.executable, "-m", "zinc.prepare", "--tokenizer", str(LLAMA3 / "tokenizer.json"),
                          "--seq-len", "128", "--out", str(tmp_path / "cli"), str(FIX / "chat.jsonl")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert read_outputs(tmp_path / "cli")[3]["documents"] == 3
    fail = subprocess.run([sys.executable, "-m", "zinc.prepare", "--tokenizer", str(LLAMA3), "--seq-len", "128",
                           "--out", str(tmp_path / "none"), str(tmp_path / "missing.jsonl")],
                          capture_output=True, text=True)
    assert fail.returncode == 1 and fail.stderr.count("\n") == 1 and "missing.jsonl: no such file" in fail.stderr


def test_pipelined_batches_equal_one_thread(tmp_path, capsys, monkeypatch):
    """Many small batches on the worker thread give the same files and the same reports, in line order, as one
    thread; with lines that orjson refuses and the standard library takes (NaN), a BOM, CRLF endings, a record
    too long (found after encoding), a bad record of each kind and no newline at the end."""
    lines = ['\ufeff{"text": "first, after a byte order mark"}']
    for i in range(60):
        kind = i % 6
        if kind == 0:
            lines.append('{"text": "long ' + "word " * 300 + '"}')  # more than --seq-len + 1 tokens
        elif kind == 1:
            lines.append("{broken")
        elif kind == 2:
            lines.append('{"text": "a NaN beside it", "score": NaN}\r')
        elif kind == 3:
            lines.append('{"title": "no text"}')
        else:
            lines.append(json.dumps({"text": f"record {i}: " + "abc " * (i % 7)}))
    data = tmp_path / "mixed.jsonl"
    data.write_bytes("\n".join(lines).encode())  # no newline after the last line
    monkeypatch.setattr(prepare, "BATCH_CHARS", 64)  # a few records per batch
    outputs = {}
    for pipeline in (False, True):
        monkeypatch.setattr(prepare, "PIPELINE", pipeline)
        rc, err, prefix = run_prepare(tmp_path, capsys, data, "--max-bad", "100", name=f"p{pipeline}")
        assert rc == 0, err
        tokens, mask, docs, manifest, _ = read_outputs(prefix)
        outputs[pipeline] = (tokens, mask, docs, bad_lines(err), reports(err))
        assert manifest["bad_records"] == 30 and manifest["sources"][0]["records"] == 31
    assert outputs[False] == outputs[True]
    assert outputs[True][3] == sorted(outputs[True][3])[:10] and outputs[True][3][:3] == [2, 3, 5]
    t = tok(LLAMA3)
    first = t.encode("first, after a byte order mark").ids
    assert outputs[True][0][:len(first)] == first  # the BOM is no token
    nan_doc = t.encode("a NaN beside it").ids
    assert outputs[True][0][len(first) + 1:len(first) + 1 + len(nan_doc)] == nan_doc


def test_orjson_and_the_standard_library_agree(tmp_path, capsys, monkeypatch):
    """The same files and reports with orjson's fast path and without it."""
    pytest.importorskip("orjson")
    results = []
    for fast in (_prepare_records._fast_loads, None):
        monkeypatch.setattr(_prepare_records, "_fast_loads", fast)
        rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl", tokenizer=CHATML, name=f"o{fast is None}")
        assert rc == 0, err
        results.append((read_outputs(prefix)[:3], reports(err)))
    assert results[0] == results[1]


def test_a_line_nested_too_deeply_is_a_bad_record(tmp_path, capsys):
    """A hostile line (100,000 nested lists) is one bad record, not a crash of the run (RecursionError)."""
    data = tmp_path / "deep.jsonl"
    data.write_text('{"text": "fine"}\n' + "[" * 100000 + "]" * 100000 + '\n{"text": "also fine"}\n')
    rc, err, prefix = run_prepare(tmp_path, capsys, data, "--format", "jsonl")
    assert rc == 0, err
    assert bad_lines(err) == [2]  # invalid JSON or "a JSON list", as the json module gets through it
    assert read_outputs(prefix)[3]["documents"] == 2


# ---- issue 49: outputs that are inputs, a kill mid-commit, hostile templates, files that are no files -----------

FAULT_PHASES = ("writing", "before_rename", "after_mask", "after_docs", "after_bin", "after_manifest")
# The files a run killed at each phase has already renamed into place (.mask, .docs, .bin, the manifest last;
# the old manifest is removed before the first rename).
RENAMED = {"writing": (), "before_rename": (), "after_mask": ("mask",), "after_docs": ("mask", "docs"),
           "after_bin": ("mask", "docs", "bin"), "after_manifest": ("mask", "docs", "bin", "json")}
MANIFEST_REMOVED = ("after_mask", "after_docs", "after_bin")  # no manifest there: the old one went first


def tree(folder):
    """{relative path: bytes, or "-> target" for a symlink} of everything under folder."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, folder)
            if os.path.islink(full):
                out[rel] = "-> " + os.readlink(full)
            elif os.path.isfile(full):
                out[rel] = open(full, "rb").read()
            else:
                out[rel] = "folder" if os.path.isdir(full) else "other"
    return out


def error_lines(err):
    return [line for line in err.splitlines() if line.strip()]


def cli(*args, timeout=60, code=None, env=None):
    """python -m zinc.prepare ARGS in a fresh interpreter, so that a hang, a crash or a kill is this test's
    failure, not the suite's; code: Python run before main() (e.g. a lowered bound). Returns (rc, stderr)."""
    head = ["-m", "zinc.prepare"] if code is None else \
        ["-c", f"import sys\nfrom zinc import prepare\n{code}\nsys.exit(prepare.main(sys.argv[1:]))"]
    r = subprocess.run([sys.executable, *head, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    return r.returncode, r.stderr


def copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("case", ["input .bin", "input .json", "tokenizer.json", "tokenizer_config.json",
                                  "chat template", "symlink", "hard link"])
def test_out_never_overwrites_what_the_run_reads(tmp_path, capsys, case):
    """An output (PREFIX.bin, .mask, .docs, .json) that is a file the run reads (an input, the tokenizer.json,
    tokenizer_config.json, the chat template), under its own name or another (a symlink, a hard link): refused
    before anything is written, exit 1, one line naming both paths."""
    model = copy_model(LLAMA3, tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_bytes((FIX / "text.jsonl").read_bytes())
    args, out, read, written = [data], tmp_path / "out", data, None
    if case in ("input .bin", "input .json"):
        read = tmp_path / ("in.bin" if case == "input .bin" else "g.json")
        read.write_bytes(data.read_bytes())
        args, out = [read, "--format", "jsonl"], read.with_suffix("")
    elif case in ("tokenizer.json", "tokenizer_config.json"):
        read = model / case
        out = read.with_suffix("")
    elif case == "chat template":
        read = tmp_path / "t.json"
        read.write_bytes((CHATML / "chat_template.jinja").read_bytes())
        args, out = [FIX / "chat.jsonl", "--chat-template", read], tmp_path / "t"
    elif case == "symlink":
        written = tmp_path / "out.mask"
        written.symlink_to(data)
    else:
        written = tmp_path / "out.docs"
        os.link(data, written)
    before = tree(tmp_path)
    rc = prepare.main([*map(str, args), "--tokenizer", str(model), "--seq-len", "64", "--out", str(out)])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith("zinc.prepare: error: --out would overwrite the ")
    assert str(read) in lines[0] and str(written or read) in lines[0]
    assert tree(tmp_path) == before


def set_rule(prefix):
    """What zinc-train's reader refuses in a set (the .mask or .docs whose size or CRC-32 differ from what the
    .bin beside it records), as the format states it: the names of the files it would refuse."""
    raw = open(f"{prefix}.bin", "rb").read(1024)
    u = struct.unpack("<256I", raw)
    if raw[12:16] != b"ZINC":
        return []
    refused = []
    for ext, slot in (("mask", 5), ("docs", 8)):
        data = open(f"{prefix}.{ext}", "rb").read()
        if (zlib.crc32(data), len(data)) != (u[slot], u[slot + 1] + (u[slot + 2] << 32)):
            refused.append(ext)
    return refused


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_a_kill_at_any_phase_leaves_one_set_or_a_refused_one(tmp_path, capsys, phase):
    """A run killed (SIGKILL, ZINC_PREPARE_FAULT) at each phase of its commit over an earlier set: the files it
    renamed are the .mask, then the .docs, then the .bin, and the manifest last (the old one removed before
    the first rename), so that the .bin present always vouches for the .mask and .docs beside it (a mixed set
    is refused) and a manifest present always describes the .bin; its temporaries are removed by the next run,
    which leaves the new set and nothing else."""
    prefix = tmp_path / "set"
    outputs = [f"{prefix}.{ext}" for ext in ("bin", "mask", "docs", "json")]
    new_args = [FIX / "text.jsonl", "--tokenizer", LLAMA3, "--seq-len", 256, "--out", prefix]
    assert prepare.main(list(map(str, new_args))) == 0
    new = {p: open(p, "rb").read() for p in outputs}
    assert prepare.main([str(FIX / "alpaca.jsonl"), "--tokenizer", str(LLAMA3), "--seq-len", "256",
                         "--out", str(prefix)]) == 0
    old = {p: open(p, "rb").read() for p in outputs}
    capsys.readouterr()
    assert all(old[p] != new[p] for p in outputs)
    rc, err = cli(*new_args, env={"ZINC_PREPARE_FAULT": phase})
    assert rc == -9, err  # killed by the hook
    state = {p: open(p, "rb").read() if os.path.exists(p) else None for p in outputs}
    renamed = [ext for ext in ("bin", "mask", "docs", "json") if state[f"{prefix}.{ext}"] == new[f"{prefix}.{ext}"]]
    assert sorted(renamed) == sorted(RENAMED[phase])
    assert all(state[f"{prefix}.{ext}"] == old[f"{prefix}.{ext}"] for ext in ("bin", "mask", "docs")
               if ext not in renamed)
    assert state[f"{prefix}.json"] == (None if phase in MANIFEST_REMOVED else
                                       new[f"{prefix}.json"] if "json" in renamed else old[f"{prefix}.json"])
    assert set_rule(prefix) == [ext for ext in ("mask", "docs") if ext in renamed and "bin" not in renamed]
    left = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert len(left) == (3 if phase == "writing" else 4 - len(renamed))
    assert prepare.main(list(map(str, new_args))) == 0
    assert {p: open(p, "rb").read() for p in outputs} == new
    assert sorted(os.listdir(tmp_path)) == ["set.bin", "set.docs", "set.json", "set.mask"]


def test_sigterm_stops_between_batches_never_inside_the_commit(tmp_path, capsys, monkeypatch):
    """A SIGTERM while records are read stops the run (SystemExit 143: the exit status) with the earlier set as
    it was and no temporary; one during the renames lets them end, so the new set is whole."""
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl")
    assert rc == 0, err
    before = snapshot(tmp_path)
    original = prepare.Outputs.add

    def add_then_term(self, docs):
        original(self, docs)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(prepare.Outputs, "add", add_then_term)
    monkeypatch.setattr(prepare, "BATCH_CHARS", 64)
    with pytest.raises(SystemExit) as stopped:
        run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert stopped.value.code == 143 and snapshot(tmp_path) == before
    monkeypatch.setattr(prepare.Outputs, "add", original)
    fired = []

    def term_after_mask(phase):
        if phase == "after_mask":
            fired.append(phase)
            os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(_prepare_outputs, "fault_point", term_after_mask)
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert rc == 0, err
    assert fired == ["after_mask"]  # the SIGTERM came during the renames
    assert read_outputs(prefix)[3]["sources"][0]["path"] == str(FIX / "text.jsonl")  # the whole new set
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.docs", "out.json", "out.mask"]


def test_temporaries_of_dead_runs_are_removed_those_of_live_ones_kept(tmp_path, capsys):
    """The temporaries a killed run left (.out.EXT.tmp-PID, PID no live process) go at the next run on the
    prefix; those of a live process stay, and so do other prefixes' and other names."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        names = {f".out.bin.tmp-{dead.pid}": False, f".out.json.tmp-{dead.pid}": False,
                 f".out.mask.tmp-{live.pid}": True, f".other.bin.tmp-{dead.pid}": True,
                 f".out.bin.tmp-{dead.pid}.keep": True}
        for n in names:
            (tmp_path / n).write_bytes(b"partial")
        rc, err, _ = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
        assert rc == 0, err
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == \
            sorted(n for n, kept in names.items() if kept)
    finally:
        live.kill()
        live.wait()


def test_a_second_run_on_the_same_out_is_refused(tmp_path, capsys):
    """Two runs on one --out at once: the second is refused with one line naming the first's pid (the lock
    file's holder), and writes nothing; the lock file goes with the run that held it."""
    lock = open(tmp_path / ".out.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write("4242\n")
    lock.flush()
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert "another zinc.prepare (pid 4242)" in lines[0] and str(tmp_path / ".out.lock") in lines[0]
    assert os.listdir(tmp_path) == [".out.lock"]
    lock.close()
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl")
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.docs", "out.json", "out.mask"]


BOOM_RECORDS = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}],
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "boom"}],
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]]


def boom_files(tmp_path, expression):
    """A chat file whose line 2 holds the assistant content "boom", and a template that renders each message's
    content through `expression` (of c, the content) for that content, as itself otherwise."""
    data = tmp_path / "boom.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in BOOM_RECORDS))
    template = tmp_path / "boom.jinja"
    template.write_text("{% for m in messages %}{% set c = m['content'] %}<{{ m['role'] }}>"
                        "{% if c == 'boom' %}" + expression + "{% else %}{{ c }}{% endif %}</s>{% endfor %}")
    return data, template


def test_a_template_repeating_a_string_without_bound_is_a_bad_record(tmp_path):
    """`{{ content * 100000000 }}` (issue 49: past 40 s and gigabytes): the record is bad, reported by file and
    line, in well under a second; the others are prepared."""
    data, template = boom_files(tmp_path, "{{ c * 100000000 }}")
    rc, err = cli(data, "--tokenizer", LLAMA3, "--chat-template", template, "--seq-len", 64,
                  "--out", tmp_path / "out", timeout=30)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "boom.jsonl:2: the chat template repeats a str of 4 characters" in err
    assert read_outputs(tmp_path / "out")[3]["documents"] == 2


def test_a_template_running_without_end_is_a_bad_record(tmp_path):
    """A template looping 10^10 times without output stops at MAX_RENDER_SECONDS (here 0.5 s): a bad record."""
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ c }}"
    data, template = boom_files(tmp_path, loop)
    lowered = "from zinc import _prepare_template\n_prepare_template.MAX_RENDER_SECONDS = 0.5"  # where it is read
    rc, err = cli(data, "--tokenizer", LLAMA3, "--chat-template", template, "--seq-len", 64,
                  "--out", tmp_path / "out", code=lowered, timeout=30)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "boom.jsonl:2: the chat template ran past 0.5 s" in err


@pytest.mark.parametrize("expression,why", [
    ("{% set ns = namespace(s=c) %}{% for i in range(12) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "builds a namespace attribute 's' of 1,024 characters"),
    ("{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}{{ f(c, 12) }}",
     "builds an argument of 1,024 characters"),
    ("{% for i in range(400) %}{{ c }}{% endfor %}", "rendering passes 1,000 characters"),
    ("{{ '%5000s' % c }}", "formats with a width or precision above 1,000"),
    ("{{ '{:>5000}'.format(c) }}", "formats with a width or precision above 1,000"),
    ("{{ '%-5000s'|format(c) }}", "formats with a width or precision above 1,000"),
    ("{{ '%s%s' % (c * 200, c * 200) }}", "builds a '%' result of 1,600 characters"),
    ("{{ c|center(5000) }}", "passes 5,000 to a function or filter"),
    ("{{ c.ljust(5000) }}", "passes 5,000 to a function or filter"),
    ("{{ ([c] * 5000)|join }}", "repeats a list of 1 items 5,000 times"),
    ("{{ 7 ** 9000 % 10 }}", "raises 7 to the power 9,000"),
    ("{{ (c ~ c ~ c ~ c) + (c ~ c ~ c ~ c) }}" * 40, "rendering passes 1,000 characters"),
])
def test_what_a_template_builds_is_bounded(tmp_path, capsys, monkeypatch, expression, why):
    """Each way a template can build a huge string or number (doubling in a namespace or through a macro's
    argument, output in a loop, '%' and filter widths, list repetition, '**'), against MAX_RENDER_CHARS
    lowered to 1,000: the record is bad, saying what, and the run goes on."""
    monkeypatch.setattr(_prepare_template, "MAX_RENDER_CHARS", 1000)
    data, template = boom_files(tmp_path, expression)
    rc, err, prefix = run_prepare(tmp_path, capsys, data, "--chat-template", template, seq_len=64)
    assert rc == 0, err
    assert bad_lines(err) == [2] and why in err
    assert read_outputs(prefix)[3]["documents"] == 2


@pytest.mark.parametrize("fmt", ["jsonl", "alpaca", "chat"])
def test_a_lone_surrogate_is_a_bad_record(tmp_path, capsys, fmt):
    """A JSON "\\ud800" escape alone (no Unicode text): a bad record naming file and line, not a TypeError from
    the tokenizer for its whole batch; a file of nothing else fails with exit 1, without a traceback."""
    def record(text):
        if fmt == "jsonl":
            return {"text": text}
        if fmt == "alpaca":
            return {"instruction": "Say it.", "output": text}
        return {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": text}]}
    lines = [json.dumps(record(t)) for t in ("fine", "a \ud800 b", "also fine")]
    assert "\\ud800" in lines[1]
    data = tmp_path / "s.jsonl"
    data.write_text("\n".join(lines) + "\n")
    rc, err, prefix = run_prepare(tmp_path, capsys, data, tokenizer=CHATML if fmt == "chat" else LLAMA3)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "s.jsonl:2: a lone surrogate '\\ud800'" in err
    assert read_outputs(prefix)[3]["documents"] == 2
    data.write_text(lines[1] + "\n")
    rc, err, _ = run_prepare(tmp_path, capsys, data, tokenizer=CHATML if fmt == "chat" else LLAMA3, name="only")
    assert rc == 1 and "Traceback" not in err and "s.jsonl:1: a lone surrogate" in err
    assert error_lines(err)[-1].startswith("zinc.prepare: error: nothing usable")


def test_a_first_record_nested_too_deeply(tmp_path, capsys):
    """200,000 nested lists in the first record: with the format to infer, one line saying so (exit 1), not a
    RecursionError; with --format, a bad record, in a fresh interpreter (orjson overflowed its stack there:
    SIGSEGV)."""
    data = tmp_path / "deep.jsonl"
    data.write_text("[" * 200000 + "]" * 200000 + '\n{"text": "fine"}\n')
    rc, err, _ = run_prepare(tmp_path, capsys, data)
    lines = error_lines(err)
    assert rc == 1 and lines == [f"zinc.prepare: error: {data}:1: invalid JSON in the first record (nested too "
                                 "deeply); pass --format"]
    rc, err = cli(data, "--format", "jsonl", "--tokenizer", LLAMA3, "--seq-len", 64, "--out", tmp_path / "out")
    assert rc == 0, err
    assert bad_lines(err) == [1] and "deep.jsonl:1: invalid JSON: nested too deeply" in err


ODD_FILES = {"fifo": "is a FIFO, not a regular file", "/dev/zero": "is a character device, not a regular file",
             "folder": "is a folder, not a file"}


@pytest.mark.parametrize("where,kind", [
    (where, kind) for where in ("input", "--tokenizer", "tokenizer.json", "tokenizer_config.json", "--chat-template")
    for kind in ODD_FILES if (where, kind) != ("--tokenizer", "folder")])  # that one is a model folder
def test_a_file_that_is_no_regular_file(tmp_path, where, kind):
    """A FIFO, /dev/zero or a folder where a file is read (an input, the tokenizer, its config, the chat
    template): one line naming it and saying what it is, exit 1, at once (never blocking on the FIFO, never
    reading /dev/zero to its end), nothing written."""
    says = ODD_FILES[kind]
    model = copy_model(LLAMA3, tmp_path / "tok")
    odd = {"input": tmp_path / "odd.jsonl", "--tokenizer": tmp_path / "odd", "tokenizer.json": model / "tokenizer.json",
           "tokenizer_config.json": model / "tokenizer_config.json", "--chat-template": tmp_path / "odd.jinja"}[where]
    if odd.exists():
        odd.unlink()
    if kind == "fifo":
        os.mkfifo(odd)
    elif kind == "folder":
        odd.mkdir()
    else:
        odd.symlink_to("/dev/zero")
    args = [odd if where == "input" else FIX / "chat.jsonl", "--tokenizer", odd if where == "--tokenizer" else model,
            "--seq-len", 64, "--out", tmp_path / "out"]
    if where == "--chat-template":
        args += ["--chat-template", odd]
    before = tree(tmp_path)
    rc, err = cli(*args, timeout=30)
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"zinc.prepare: error: {odd}: {says}")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("out", ["", "sub/", ".", "..", "sub/.."])
def test_out_must_name_a_file_prefix(tmp_path, capsys, monkeypatch, out):
    """--out "" (the outputs were ../NAME.bin beside the working folder), a folder or . or ..: one line, exit 1,
    nothing written anywhere."""
    work = tmp_path / "a" / "b"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work)
    before = tree(tmp_path)
    rc = prepare.main([str(FIX / "text.jsonl"), "--tokenizer", str(LLAMA3), "--seq-len", "64", "--out", out])
    lines = error_lines(capsys.readouterr().err)
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith(f"zinc.prepare: error: --out {out!r} is not a file prefix")
    assert tree(tmp_path) == before
