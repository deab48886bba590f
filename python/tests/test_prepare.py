"""python -m zinc.prepare against the fixtures of tests/fixtures/prepare (made by
make_fixtures.py there): token ids equal to the tokenizers package's own encode,
exact masks, document offsets, the manifest, bad records by line, truncation,
uint16 and uint32 files, and nothing half-written after a failed or interrupted
run (what a hostile user tries: test_prepare_safety.py). Chat renderings are checked against the committed
output of transformers' apply_chat_template (expected_chat.json), and against
transformers itself where it is installed. Needs tokenizers and jinja2; no
torch, no network."""
import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest


tokenizers = pytest.importorskip("tokenizers", reason="zinc.prepare needs the tokenizers package (setup.sh)")
pytest.importorskip("jinja2", reason="zinc.prepare renders chat templates with jinja2 (setup.sh)")

from zinc import prepare  # noqa: E402
# The tool's parts, whose globals a test patches where the code reads them (prepare's copies are not read).
from zinc import _prepare_records  # noqa: E402

from prepare_util import CHATML, EXPECTED, FIX, LLAMA3, bad_lines, read_outputs, run_prepare, snapshot, tok  # noqa: E402


def split_docs(tokens, mask, docs):
    """The documents' (tokens, mask), without --pack rows' padding (a document with no label; every
    record has one)."""
    bounds = docs + [len(tokens)]
    return [(tokens[a:b], mask[a:b]) for a, b in zip(bounds, bounds[1:]) if 1 in mask[a:b]]


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


@pytest.mark.parametrize("split", ["file", "paragraphs", "lines"])
def test_text_with_crlf_reads_as_with_lf(tmp_path, capsys, split):
    """Universal newlines, as Python's text mode and the datasets library's text loader: a CRLF file's
    documents are its LF copy's (a paragraph's last \\r once became a token before EOS)."""
    lf = (FIX / "docs" / "b.txt").read_bytes()
    assert b"\r" not in lf and b"\n\n" in lf
    (tmp_path / "crlf.txt").write_bytes(lf.replace(b"\n", b"\r\n"))
    (tmp_path / "lf.txt").write_bytes(lf)
    got = []
    for name in ("crlf", "lf"):
        rc, err, prefix = run_prepare(tmp_path, capsys, tmp_path / f"{name}.txt", "--format", "text", "--split",
                                      split, name=name)
        assert rc == 0, err
        got.append(read_outputs(prefix)[:3])
    assert got[0] == got[1]


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
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl", "--pack", "stream")  # in order
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
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "chat.jsonl", "--pack", "stream", tokenizer=folder)
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
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "chat.jsonl", "--pack", "stream", tokenizer=folder)
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


@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_turns_where_prefixes_are_not_prefixes_equal_the_tagged_templates_transformers_masks(tmp_path, capsys, name):
    """Note [assistant spans]: templates whose renderings of a conversation's prefixes are not its prefixes
    (Qwen3's dropped reasoning, Phi-3's end of text written once, an opening assistant turn before which
    the empty conversation fails) have their assistant turns found by markers. Their masks equal what
    transformers' return_assistant_tokens_mask gives for the same template with {% generation %} around
    those turns (expected_chat.json), and the tagged template itself gives them too, from its tags."""
    renderer = prepare.ChatRenderer(prepare.load_tokenizer(str(FIX / name)))
    records = [json.loads(x) for x in (FIX / "chat_turns.jsonl").read_text(encoding="utf-8").splitlines()]
    refused = 0
    for r in records:  # the prefix rule alone would have dropped most of them
        messages = prepare.normalize_messages(r["messages"])
        try:
            renderer._prefix_spans(messages, None, renderer.render(messages))
        except Exception:
            refused += 1
    assert refused >= 3
    want = EXPECTED[name + "_gen"]
    assert all(sum(r["assistant_masks"]) > 0 for r in want)
    for folder in (name, name + "_gen"):
        for pack in ("stream", "rows"):
            rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "chat_turns.jsonl", "--format", "chat", "--pack",
                                          pack, tokenizer=FIX / folder, name=folder + pack)
            assert rc == 0, err
            assert bad_lines(err) == []
            got = [(list(ids), list(m)) for ids, m in split_docs(*read_outputs(prefix)[:3])]
            expected = [(r["ids"], r["assistant_masks"]) for r in want]
            assert (got if pack == "stream" else sorted(got)) == (expected if pack == "stream" else sorted(expected))


def test_a_turn_that_cannot_be_located_is_a_bad_record_saying_why(tmp_path, capsys):
    """An empty assistant turn (a tool call's) in a template whose prefixes are not prefixes has no content
    to mark: a bad record, naming the way out (a template with {% generation %} blocks)."""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"}]}) + "\n" + "\n".join(
        json.dumps(r) for r in json.loads("[" + ",".join((FIX / "chat_turns.jsonl").read_text().splitlines()) + "]")) +
        "\n", encoding="utf-8")
    rc, err, _ = run_prepare(tmp_path, capsys, path, tokenizer=FIX / "qwen3")
    assert rc == 0, err
    assert bad_lines(err) == [1]
    assert "assistant turn 1's content is empty, so the turn cannot be located (a template with " \
           "{% generation %} blocks" in err


def test_a_records_tools_reach_the_template(tmp_path, capsys):
    """A record's "tools" (TRL's and the datasets' tool column) reach the template, as
    apply_chat_template(messages, tools=...) passes them; tools that are not a list of objects are a bad
    record."""
    template = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
                "{%- endif %}{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
                "{%- if m['role'] == 'assistant' %}{%- generation %}{{- m['content'] + '<|im_end|>\\n' }}"
                "{%- endgeneration %}{%- else %}{{- m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}")
    (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"messages": messages, "tools": [schema]},
                                                       {"messages": messages, "tools": "lookup"},
                                                       {"messages": messages}]) + "\n", encoding="utf-8")
    rc, err, prefix = run_prepare(tmp_path, capsys, path, "--chat-template", tmp_path / "t.jinja", tokenizer=CHATML)
    assert rc == 0, err
    assert bad_lines(err) == [2] and "'tools' is not a list of objects" in err
    t = tok(CHATML)
    (with_tools, _), (without, _) = split_docs(*read_outputs(prefix)[:3])
    assert t.decode(with_tools, skip_special_tokens=False).startswith(
        '<|im_start|>system\nTools: [{"type": "function", "function": {"name": "lookup"')
    assert t.decode(without, skip_special_tokens=False).startswith("<|im_start|>user\nhi")


@pytest.mark.parametrize("folder", [LLAMA3, CHATML], ids=["llama3", "chatml"])
def test_alpaca_with_chat_template(tmp_path, capsys, folder):
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl", "--use-chat-template", "--pack", "stream",
                                  tokenizer=folder)
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
    assert EXPECTED["transformers"] and set(EXPECTED) == {"transformers", "llama3", "chatml", "qwen3_gen", "phi3_gen"}


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


@pytest.mark.parametrize("seq_len", [40, 64, 100])
def test_pack_rows_keeps_every_record_within_one_training_row(tmp_path, capsys, seq_len):
    """--pack rows (chat's default): every record lies within one of zinc-train's rows (tokens kN..kN+N-1 of
    kN..kN+N), placed by best fit, each row filled up with padding (EOS, mask 0, a document of its own) and
    one padding token at the end; the records are those of --pack stream (in another order). --pack stream
    leaves some across rows."""
    data = tmp_path / "turns.jsonl"
    data.write_text((FIX / "chat_turns.jsonl").read_text(encoding="utf-8") * 5, encoding="utf-8")
    rc, err, prefix = run_prepare(tmp_path, capsys, data, tokenizer=FIX / "qwen3_gen", seq_len=seq_len, name="rows")
    assert rc == 0, err
    tokens, mask, docs, manifest, _ = read_outputs(prefix)
    assert manifest["pack"] == "rows"
    bounds = docs + [len(tokens)]
    eos = tok(FIX / "qwen3_gen").token_to_id("<|endoftext|>")
    assert len(tokens) % seq_len == 1  # whole rows, and the last one's last target
    for a, b in zip(bounds, bounds[1:]):
        if 1 not in mask[a:b]:  # padding: up to the next row's start (and the one token at the end)
            assert set(tokens[a:b]) == {eos} and (b % seq_len == 0 or b == a + 1 == len(tokens)), (a, b)
        else:
            assert (b - 1) // seq_len == a // seq_len, (a, b)
    assert manifest["padding_tokens"] == mask.count(0) - sum(m.count(0) for _, m in split_docs(tokens, mask, docs))
    rc, err, stream = run_prepare(tmp_path, capsys, data, "--pack", "stream",
                                  tokenizer=FIX / "qwen3_gen", seq_len=seq_len, name="stream")
    assert rc == 0, err
    s_tokens, s_mask, s_docs, s_manifest, _ = read_outputs(stream)
    assert sorted(split_docs(tokens, mask, docs)) == sorted(split_docs(s_tokens, s_mask, s_docs))
    assert s_manifest["padding_tokens"] == 0 and s_manifest["pack"] == "stream"
    s_bounds = s_docs + [len(s_tokens)]
    assert any(b - 1 > a // seq_len * seq_len + seq_len for a, b in zip(s_bounds, s_bounds[1:]))


def test_zinc_train_says_when_its_seq_len_is_not_the_rows_one(tmp_path, capsys):
    """The .bin records --pack rows' row length (header word 11); zinc-train at another data.seq_len says
    that the examples then cross rows (--check lists it among the warnings), and at the same one says
    nothing. A stream records 0."""
    from conftest import default_doc, zinc_train_path
    zt = zinc_train_path()
    if zt is None:
        pytest.skip("zinc-train is not built")
    data = tmp_path / "turns.jsonl"
    data.write_text((FIX / "chat_turns.jsonl").read_text(encoding="utf-8") * 5, encoding="utf-8")
    for pack in ("rows", "stream"):
        rc, err, prefix = run_prepare(tmp_path, capsys, data, "--pack", pack, tokenizer=FIX / "qwen3_gen",
                                      seq_len=64, name=pack)
        assert rc == 0, err
        header, manifest = read_outputs(prefix)[4], read_outputs(prefix)[3]
        assert header[11] == (64 if pack == "rows" else 0)
        doc = default_doc()
        doc["data"] = manifest["data"]
        doc["run"]["eval_interval"] = 0
        doc["model"].pop("vocab_size", None)
        for seq_len in (64, 48):
            doc["data"]["seq_len"] = seq_len
            (tmp_path / "c.json").write_text(json.dumps(doc))
            out = subprocess.run([zt, str(tmp_path / "c.json"), "--check"], capture_output=True, text=True)
            assert out.returncode == 0, out.stdout + out.stderr
            said = f"data.seq_len: {seq_len}, but {prefix}.bin was packed in rows of 64 tokens" in out.stdout
            assert said == (pack == "rows" and seq_len == 48), out.stdout


def test_zinc_train_refuses_a_bin_edited_after_zinc_prepare_wrote_it(tmp_path, capsys):
    """The .bin's header records its tokens' CRC-32 (words 12-13); a token changed afterwards, to another
    token of the vocabulary (nothing else would notice), is refused by zinc-train in one line naming the file,
    and the file is left as it was. Restored, the set trains again."""
    from conftest import default_doc, zinc_train_path
    zt = zinc_train_path()
    if zt is None:
        pytest.skip("zinc-train is not built")
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "text.jsonl", "--truncate", seq_len=16)
    assert rc == 0, err
    tokens, _, _, manifest, _ = read_outputs(prefix)
    doc = default_doc()
    doc["data"] = manifest["data"]
    doc["run"]["eval_interval"] = 0
    doc["model"].pop("vocab_size", None)
    (tmp_path / "c.json").write_text(json.dumps(doc))
    bin_path = f"{prefix}.bin"
    good = open(bin_path, "rb").read()
    edited = bytearray(good)
    at = 1024 + 2 * (len(tokens) // 2)  # a uint16 token in the middle
    edited[at:at + 2] = struct.pack("<H", tokens[0] if tokens[len(tokens) // 2] != tokens[0] else tokens[1])
    open(bin_path, "wb").write(bytes(edited))
    out = subprocess.run([zt, str(tmp_path / "c.json"), "--check"], capture_output=True, text=True)
    assert out.returncode != 0, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert f"data.path: {bin_path}: the CRC-32 of its {len(tokens)} tokens is" in said, said
    assert "changed or damaged after it was written; prepare the set again" in said, said
    assert open(bin_path, "rb").read() == bytes(edited)
    open(bin_path, "wb").write(good)
    out = subprocess.run([zt, str(tmp_path / "c.json"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


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
    assert manifest["pack"] == "rows" and manifest["padding_documents"] > 0
    records = len(docs) - manifest["padding_documents"]
    assert manifest["padding_tokens"] == mask.count(0) - sum(m.count(0) for _, m in split_docs(tokens, mask, docs))
    assert manifest["sources"] == [{"path": str(FIX / "chat.jsonl"), "sha256": sha(FIX / "chat.jsonl"),
                                    "records": records, "bad_records": 4}]
    assert manifest["files"] == {"tokens": "out.bin", "mask": "out.mask", "documents": "out.docs"}
    assert manifest["data"] == {"type": "tokens", "path": f"{prefix}.bin", "mask_path": f"{prefix}.mask",
                                "documents_path": f"{prefix}.docs", "vocab_size": manifest["vocab_size"],
                                "seq_len": 160}
    assert sorted(os.listdir(tmp_path)) == ["out.bin", "out.docs", "out.json", "out.mask"]


def test_uint32_tokens_for_a_large_vocabulary(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
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


def test_a_special_token_that_is_not_text_is_a_damaged_config(tmp_path, capsys):
    # An eos_token of 128009 (an id where transformers has text) was read as
    # "no eos token": every document was written without its EOS, rc 0.
    # null is transformers' "no such token"; --eos overrides the config's.
    import shutil
    folder = tmp_path / "tok"
    shutil.copytree(LLAMA3, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one document"}\n{"text": "another document"}\n')
    before = None
    for bad in (128009, {"content": 5}, [1], True):
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, eos_token=bad)))
        rc, err, prefix = run_prepare(tmp_path, capsys, data, tokenizer=folder)
        assert rc == 1 and "tokenizer_config.json: eos_token is %s, not a token" % json.dumps(bad) in err, (bad, err)
        assert before is None or open(f"{prefix}.bin", "rb").read() == before  # the last good set is kept
        rc, err, prefix = run_prepare(tmp_path, capsys, data, "--eos", "<|eot_id|>", tokenizer=folder)
        assert rc == 0, err
        before = open(f"{prefix}.bin", "rb").read()
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, bos_token=7)))
    rc, err, _ = run_prepare(tmp_path, capsys, data, tokenizer=folder)
    assert rc == 1 and "bos_token is 7, not a token" in err, err
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, eos_token=None)))
    rc, err, prefix = run_prepare(tmp_path, capsys, data, tokenizer=folder)
    assert rc == 0, err
    tokens, _, docs, _, _ = read_outputs(prefix)
    assert len(docs) == 2 and tok(LLAMA3).token_to_id("<|eot_id|>") not in tokens


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


def test_a_seq_len_training_cannot_take_is_refused_and_a_set_too_short_for_one_sample_is_said(tmp_path, capsys):
    # --seq-len 10^20 went into the manifest, which zinc-train then refused;
    # a set shorter than one sample was written without a word.
    rc, err, _ = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl", seq_len=10**20)
    assert rc == 1 and "--seq-len must be between 1 and 2147483647, got 100000000000000000000" in err, err
    assert snapshot(tmp_path) == {}
    rc, err, prefix = run_prepare(tmp_path, capsys, FIX / "alpaca.jsonl", "--truncate", "--pack", "stream",
                                  seq_len=1_000_000)  # --pack rows fills a row whatever the length
    tokens = read_outputs(prefix)[3]["tokens"]
    assert rc == 0 and tokens < 1_000_001, err
    assert f"warning: the set holds {tokens} tokens, fewer than one sample of --seq-len 1000000 needs (1000001)" in err


def test_inputs_of_different_formats_and_contradictory_options_are_refused(tmp_path, capsys):
    # The format came from the first input alone: a .jsonl after a .txt was
    # tokenized as text, its braces and keys with it, with exit 0.
    (tmp_path / "a.txt").write_text("plain words here\n")
    (tmp_path / "b.jsonl").write_text('{"text": "a json record"}\n')
    rc, err, _ = run_prepare(tmp_path, capsys, tmp_path / "a.txt", tmp_path / "b.jsonl")
    assert rc == 1 and "the inputs are of different formats" in err and "b.jsonl is jsonl" in err, err
    assert not (tmp_path / "out.bin").exists()
    rc, err, _ = run_prepare(tmp_path, capsys, tmp_path / "a.txt", "--chunk", "--truncate")
    assert rc == 1 and "--chunk and --truncate both" in err, err
    rc, err, _ = run_prepare(tmp_path, capsys, tmp_path / "a.txt", "--max-bad", "-1")
    assert rc == 1 and "--max-bad must be >= 0, got -1" in err, err
    # A prefix that is not UTF-8 cannot be named by the manifest's data
    # section (JSON): refused before anything is written.
    rc, err, _ = run_prepare(tmp_path, capsys, tmp_path / "a.txt", name=os.fsdecode(b"set\xff"))
    assert rc == 1 and "is not valid UTF-8" in err, err
    rc, err, _ = run_prepare(tmp_path, capsys, tmp_path / "a.txt", tmp_path / "a.txt", "--format", "text")
    assert rc == 0, err  # one format, given


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
    manifest = read_outputs(tmp_path / "cli")[3]
    assert manifest["documents"] - manifest["padding_documents"] == 3
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
