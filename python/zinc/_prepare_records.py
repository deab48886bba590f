"""zinc.prepare's records: reading them from the input files (text, jsonl, alpaca, chat), inferring the
format, and turning them into token ids and masks a batch at a time (Encoder). See prepare.py for the tool."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Iterator, Optional

from ._prepare_common import BadRecord, PrepareError, open_regular
from ._prepare_template import ChatRenderer, normalize_messages
from ._prepare_tokenizer import TokenizerInfo

try:  # a fast path for JSONL parsing; the standard library's json decides whatever orjson refuses
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is optional
    _fast_loads = None

JSON_EXTENSIONS = (".jsonl", ".json", ".ndjson")

ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                 "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_PROMPT_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n"
                       "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")


# ---------------------------------------------------------------------------------------------------------------
# Reading records


@dataclasses.dataclass
class Source:
    path: str
    sha256: str = ""
    records: int = 0
    bad_records: int = 0


READ_BLOCK = 8 << 20  # bytes per read: the file is hashed and split into lines a block at a time
# orjson (3.8) recurses without a limit and overflows the stack (SIGSEGV) on a line nested some 150,000 deep: a
# line with more opening brackets than this goes to the standard library, whose RecursionError is a bad record.
FAST_MAX_BRACKETS = 10000


def _read_lines(src: Source) -> Iterator[tuple[int, bytes]]:
    """(line number, the line without its b"\\n") for every line of the file; hashes the file on the way."""
    h = hashlib.sha256()
    number, rest = 0, b""
    with open_regular(src.path) as f:
        while True:
            block = f.read(READ_BLOCK)
            if not block:
                break
            h.update(block)
            lines = (rest + block).split(b"\n") if rest else block.split(b"\n")
            rest = lines.pop()  # the unfinished last line (b"" when the block ends with a newline)
            for raw in lines:
                number += 1
                yield number, raw
    if rest:
        yield number + 1, rest
    src.sha256 = h.hexdigest()


def _read_all(src: Source) -> bytes:
    with open_regular(src.path) as f:
        data = f.read()
    src.sha256 = hashlib.sha256(data).hexdigest()
    return data


def _json_slow(number: int, raw: bytes) -> Any:
    """The standard library's parse of one line: the object, or a BadRecord that says what is wrong."""
    try:
        return json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
    except UnicodeDecodeError as e:
        return BadRecord(f"invalid UTF-8: {e.reason} at byte {e.start}")
    except ValueError as e:
        return BadRecord(f"invalid JSON: {e}")
    except RecursionError:
        return BadRecord("invalid JSON: nested too deeply")


def read_json_records(src: Source) -> Iterator[tuple[int, Any]]:
    """(line, object or BadRecord) for every non-blank line.

    orjson, where it is installed, parses each line (3-4x the standard library's speed); a line it refuses goes
    to the standard library, so that what is accepted (NaN, big integers) and the error messages stay the
    standard library's. So does a line with more than FAST_MAX_BRACKETS brackets (orjson's stack)."""
    for number, raw in _read_lines(src):
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        if _fast_loads is not None and raw.count(b"[") + raw.count(b"{") <= FAST_MAX_BRACKETS:
            try:
                yield number, _fast_loads(raw)
                continue
            except ValueError:
                pass
        yield number, _json_slow(number, raw)


def read_text_records(src: Source, split: str) -> Iterator[tuple[int, Any]]:
    """(first line, text or BadRecord): the whole file, each paragraph or each non-empty line."""
    if split == "lines":
        for number, raw in _read_lines(src):
            if raw.strip():
                try:
                    yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r")
                except UnicodeDecodeError as e:
                    yield number, BadRecord(f"invalid UTF-8: {e.reason}")
        return
    data = _read_all(src)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        yield 1, BadRecord(f"invalid UTF-8 at byte {e.start}: {e.reason}")
        return
    # Universal newlines, as Python's text mode and the datasets library's text loader read a file: a CRLF
    # or a lone CR is a newline (its \r no token of the text).
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if split == "file":
        yield 1, text
        return
    # paragraphs: runs of non-blank lines; the text keeps its inner newlines, not the blank lines around it.
    for m in re.finditer(r"(?:[^\n]*\S[^\n]*(?:\n|$))+", text):
        yield text.count("\n", 0, m.start()) + 1, m.group().rstrip("\n")


def infer_format(path: str) -> tuple[str, str]:
    """(format, reason) from the extension and the keys of the first record."""
    if not path.lower().endswith(JSON_EXTENSIONS):
        return "text", f"{os.path.basename(path)} is not .jsonl/.json/.ndjson"
    with open_regular(path) as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                raise PrepareError(f"{path}:{number}: invalid JSON in the first record; pass --format")
            except RecursionError:
                raise PrepareError(f"{path}:{number}: invalid JSON in the first record (nested too deeply); "
                                   "pass --format")
            keys = obj.keys() if isinstance(obj, dict) else ()
            for fmt, key in (("chat", "messages"), ("alpaca", "instruction"), ("jsonl", "text")):
                if key in keys:
                    return fmt, f"{os.path.basename(path)} line {number} has the key {key!r}"
            raise PrepareError(f"{path}:{number}: no 'messages', 'instruction' or 'text' key; pass --format")
    raise PrepareError(f"{path}: no records")


def _string_field(obj: dict, key: str, required: bool = True) -> str:
    value = obj.get(key)
    if value is None and not required:
        return ""
    if value is None:
        raise BadRecord(f"missing field {key!r}")
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} is a {type(value).__name__}, not a string")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Records -> tokens and masks, a batch at a time (tokenizers' encode_batch runs on every core)


@dataclasses.dataclass
class Item:
    source: int  # index into the sources
    line: int
    text: str = ""  # text, jsonl: the document; alpaca: the prompt; chat: the rendering
    response: str = ""  # alpaca: the output
    spans: Optional[list] = None  # chat: assistant character spans


def _check_unicode(text: str) -> None:
    """A lone surrogate (half a UTF-16 pair: a JSON "\\ud800" escape without its other half) is no Unicode
    text; the tokenizer would refuse the whole batch with a TypeError."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord(f"a lone surrogate {text[e.start]!r} (half a UTF-16 pair, as a JSON \\u escape alone "
                            "writes it): not Unicode text")


def mask_from_spans(offsets: list, spans: list[tuple[int, int]]) -> bytearray:
    """1 for every token whose character range overlaps a span (spans and offsets are both in order)."""
    mask = bytearray(len(offsets))
    s = 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[t] = 1
    return mask


class Encoder:
    """Turns a record (parsed JSON or text) into an Item, and batches of Items into (ids, mask) pairs."""

    def __init__(self, info: TokenizerInfo, fmt: str, use_chat_template: bool, max_tokens: Optional[int] = None):
        self.info, self.fmt = info, fmt
        # A record longer than max_tokens is bad (when not cut): one whose text is longer than any max_tokens
        # tokens could cover is said so before it is tokenized, which takes ~170 bytes of memory per byte of
        # text (a 50 MB line took 8.5 GB, and under a memory limit the tokenizer's allocator aborted the
        # process). A token covers at most its piece's UTF-8 bytes of input (byte-level pieces map a byte to
        # a character of one or two bytes); a normalizer may shorten the text first (NFC, removed accents or
        # control characters), for which a margin of 4 is kept. len(text) <= its bytes: a cheap bound.
        self.max_chars = None
        if max_tokens is not None:
            vocab = info.tokenizer.get_vocab(with_added_tokens=True)
            piece = max((len(p.encode("utf-8", "surrogatepass")) for p in vocab), default=1)
            margin = 4 if info.tokenizer.normalizer is not None else 1
            self.max_chars = (max_tokens + 2) * piece * margin
        # Where only the ids are needed: encode_batch_fast (tokenizers >= 0.21) skips the offsets.
        self.encode_ids = getattr(info.tokenizer, "encode_batch_fast", info.tokenizer.encode_batch)
        self.chat = ChatRenderer(info) if fmt == "chat" or (fmt == "alpaca" and use_chat_template) else None
        if fmt == "alpaca" and self.chat is None and info.eos_id is None:
            raise PrepareError("the tokenizer config names no eos_token, which ends an alpaca response; pass --eos")

    def item(self, source: int, line: int, record: Any) -> Item:
        """The record's Item; a BadRecord saying what is wrong with it."""
        it = self._item(source, line, record)
        for text in (it.text, it.response):
            _check_unicode(text)
        chars = len(it.text) + len(it.response or "")
        if self.max_chars is not None and chars > self.max_chars:
            raise BadRecord(f"{chars} characters, more than the tokens a row holds could cover (--truncate cuts it)")
        return it

    def _item(self, source: int, line: int, record: Any) -> Item:
        if self.fmt == "text":
            if not record.strip():
                raise BadRecord("empty document")
            return Item(source, line, record)
        if not isinstance(record, dict):
            raise BadRecord(f"a JSON {type(record).__name__}, not an object")
        if self.fmt == "jsonl":
            text = _string_field(record, "text")
            if not text.strip():
                raise BadRecord("empty 'text'")
            return Item(source, line, text)
        if self.fmt == "alpaca":
            instruction, output = _string_field(record, "instruction"), _string_field(record, "output")
            extra = _string_field(record, "input", required=False)
            if not instruction.strip() or not output.strip():
                raise BadRecord("empty 'instruction' or 'output'")
            if self.chat is None:
                prompt = (ALPACA_PROMPT_INPUT if extra.strip() else ALPACA_PROMPT).format(instruction=instruction,
                                                                                           input=extra)
                return Item(source, line, prompt, output)
            user = instruction + ("\n\n" + extra if extra.strip() else "")
            record = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}
        if "messages" not in record:
            raise BadRecord("missing field 'messages'")
        messages = normalize_messages(record["messages"])
        # The tools a conversation may call (TRL's and the datasets' "tools" column): the template writes
        # their schemas, as apply_chat_template(messages, tools=...) does.
        tools = record.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise BadRecord("'tools' is not a list of objects (the tools' JSON schemas)")
        try:
            text, spans = self.chat.render_with_spans(messages, tools or None)
        except BadRecord:
            raise
        except Exception as e:  # a template's raise_exception, or any error inside the template
            raise BadRecord(f"the chat template failed: {type(e).__name__}: {e}")
        return Item(source, line, text, spans=spans)

    def encode(self, items: list[Item]) -> list[tuple[list, Optional[bytearray]]]:
        """(token ids, mask) per item; a mask of None means all 1."""
        tok, eos = self.info.tokenizer, self.info.eos_id
        texts = [it.text for it in items]
        if self.chat is not None:
            out = []
            for it, enc in zip(items, tok.encode_batch(texts, add_special_tokens=False)):
                out.append((enc.ids, mask_from_spans(enc.offsets, it.spans)))
            return out
        if self.fmt == "alpaca":
            prompts = self.encode_ids(texts, add_special_tokens=True)
            responses = self.encode_ids([it.response for it in items], add_special_tokens=False)
            out = []
            for p, r in zip(prompts, responses):
                p_ids, r_ids = p.ids, r.ids
                r_ids.append(eos)
                out.append((p_ids + r_ids, bytearray(len(p_ids)) + b"\x01" * len(r_ids)))
            return out
        out = []
        for enc in self.encode_ids(texts, add_special_tokens=True):
            ids = enc.ids
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            out.append((ids, None))  # None: every token a label
        return out
