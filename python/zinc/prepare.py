"""zinc.prepare: a data set -> zinc token files, with the model's own tokenizer.

    python -m zinc.prepare --tokenizer MODEL_DIR --seq-len 1024 --out data/sft train.jsonl [more.jsonl ...]

writes data/sft.bin, data/sft.mask, data/sft.docs and data/sft.json (the
manifest, whose "data" object is a ready-to-paste zinc config `data` section).
Needs the Hugging Face `tokenizers` package, and `jinja2` for chat templates
(neither torch nor transformers). Run it where `import zinc` works (an
installed wheel, or PYTHONPATH=build/python in a build tree).

Input (--format, inferred from the first file when not given, and said):
  text    plain text files (any extension but .jsonl/.json/.ndjson). --split
          file (default: one document per file), paragraphs (blank-line
          separated) or lines (one document per non-empty line). Read with
          universal newlines (CRLF and CR are newlines), as Python's text mode
          and the datasets library's text loader read them.
  jsonl   one JSON object per line with a string "text".
  alpaca  one JSON object per line: "instruction", optional "input", "output".
          Prompt (see ALPACA_PROMPT / ALPACA_PROMPT_INPUT, Stanford Alpaca's
          format) or, with --use-chat-template, the chat template applied to
          [user: instruction + "\\n\\n" + input, assistant: output].
  chat    one JSON object per line with "messages": [{"role", "content"}, ...],
          rendered with the model's chat template as transformers'
          apply_chat_template renders it (same jinja2 environment, the
          special tokens as variables, tokenized without adding special tokens).
Blank lines in JSONL files are skipped.

Tokens and BOS/EOS, per format (what transformers does for the same input):
  text, jsonl  encode(text) with the tokenizer's special tokens (a Llama-style
               post-processor adds BOS), then EOS appended unless the
               encoding already ends with it. Every token is a label (mask 1).
  alpaca       encode(prompt) with special tokens (BOS), mask 0; then
               encode(output) without special tokens + EOS, mask 1. The two
               parts are tokenized separately (as LLaMA-Factory does), so the
               boundary is exact.
  chat         the rendering (the template writes BOS itself) tokenized once
               without special tokens; no EOS appended. A record's "tools"
               (a list of JSON schemas) reach the template as
               apply_chat_template(messages, tools=...) passes them. Mask 1 on
               the tokens of each assistant turn (Note [assistant spans] in
               _prepare_template.py):
               - a template with {% generation %} blocks: their characters,
                 as transformers' return_assistant_tokens_mask takes them;
               - otherwise, for assistant message i, the characters between
                 render(messages[:i], add_generation_prompt=True) and
                 render(messages[:i+1]), i.e. the content plus whatever the
                 template writes after it before the next message (the
                 end-of-turn token, and e.g. ChatML's newline);
               - where those renderings are not prefixes of the whole
                 conversation (Qwen3's templates drop earlier turns'
                 reasoning, Phi-3's write the end of text once, at the end;
                 some fail on the empty conversation before an opening
                 assistant turn), each turn is found in the whole rendering
                 by markers around its content: from the end of the
                 assistant header the generation prompt writes to the end
                 of what the template writes after the content, as far as
                 the conversation repeats it. A turn with empty content (a
                 tool call's) cannot be marked: that record is bad, and a
                 template with {% generation %} blocks is the way out.
               A token that overlaps such a span is a label (transformers'
               rule for assistant_masks). The rest (system, user, tool turns,
               the assistant header) is 0.
EOS is the tokenizer config's eos_token (--eos overrides it).

Lengths and packing: --seq-len N is the training sequence length. zinc-train
reads a set in rows of N+1 tokens at a stride of N (row k is tokens kN to
kN+N: N inputs, N targets; the last token of a row is the first input of the
next). --pack says how the records lie in that stream:
  rows    (default for alpaca and chat) every record lies within one row, so
          a response is never trained without its prompt in view: records
          are placed into rows of N tokens by best fit over a window of 64
          open rows (RowPacker), each row filled up with padding (the EOS
          token, mask 0, a document of its own, so no record attends to it);
          a row's last target, the next row's first token, is a document
          start and not trained. A record may be N tokens long, and the
          records come out in the rows' order, not the input's (zinc-train
          shuffles rows). Train at the same seq_len, or the rows no longer
          line up.
  stream  (default for text and jsonl) the records back to back, unpadded, as
          transformers' run_clm groups texts: a record may span two rows (its
          second part then trains without the first in view), and may be N+1
          tokens long.
A longer record is a bad record unless --truncate (cut to its first N, or
N+1, tokens) or, for text and jsonl, --chunk (cut into documents of that
length). A record left with no label (mask all 0) is bad as well.

Output (read by zinc's `tokens` data source):
  PREFIX.bin   llm.c's token file: 256 little-endian int32 header (magic,
               version, token count; 20240520/1 = uint16 tokens, 20240801/7 =
               uint32 tokens, uint16 when the vocabulary with added tokens is
               <= 65536), then the tokens, little-endian. Header slots 3..13
               (0 in llm.c's files) record the set: [3] 0x434E495A (the bytes
               "ZINC" in file order), [4] 1 (this record's version), [5] the
               zlib CRC-32 of PREFIX.mask (its uint32 bit pattern), [6] and [7]
               the low and high 32 bits of its size in bytes, [8], [9] and [10]
               the same of PREFIX.docs, [11] the seq_len of --pack rows (0 for
               a stream: zinc-train warns when its data.seq_len differs), [12]
               0x43524354 (the bytes "TCRC") and [13] the zlib CRC-32 of the
               tokens after the header (zinc-train refuses a .bin whose tokens
               no longer match it); the other slots are 0.
  PREFIX.mask  one uint8 per token: 1 = a training label, 0 = not.
  PREFIX.docs  little-endian uint64 token index at which each document starts
               (first 0, strictly increasing): the records, and with --pack
               rows each row's padding, a document each.
  PREFIX.json  the manifest: tokenizer, checksums (the inputs' sha256; "crc32"
               of the tokens after the .bin's header, of the .mask and of the
               .docs), counts, masked share, and "data", whose paths are
               absolute (paste it anywhere); "files" holds the basenames,
               relative to the manifest's folder.
--out must be a file prefix (not "", a folder, . or ..), and none of the four
may be a file the run reads (an input, tokenizer.json, tokenizer_config.json,
the chat template), under any name: compared by device and inode, this is
refused before anything is written.

A set is replaced as a whole or refused by zinc-train, whatever the moment a
run is killed: each file is written to a temporary (.BASENAME.EXT.tmp-PID) in
the destination folder, the four are fsynced, the old manifest is removed,
then they are renamed into place one at a time: the .mask, the .docs, the
.bin, and the manifest last, the folder fsynced before the .bin's rename and
after. The .bin is the data's commit point: it vouches for the .mask and
.docs by their CRC-32 and size, and zinc-train refuses (naming the file) a
.mask or .docs beside it that is not the one its header records, so that a
kill between two renames leaves the old set, the new one, or a set
zinc-train refuses, never an old .bin training on a new mask; and a manifest
present always describes the .bin beside it (a kill between the .bin and the
manifest leaves the new data without one: rerun to get it). On
an error or Ctrl-C the temporaries are removed and existing files of the same
prefix are left as they were; so on a SIGTERM, which stops the run between
two batches (exit 143), or, once the renames have begun, lets them end. The
temporaries a killed run left (of a PID no process has) are removed by the
next run on the prefix. A run holds an exclusive lock on the prefix (flock on
.BASENAME.lock in its folder, removed at the end): a second run on the same
--out at once is refused, naming the pid that holds it. The test hook
ZINC_PREPARE_FAULT=PHASE kills the run at a phase of this (fault_point;
tests/tools/crash_prepare.py).

Bad records (invalid JSON or UTF-8, a lone surrogate, missing or wrongly
typed fields, a template that raises, too long, empty) are skipped, counted
per source and reported on stderr with file and line (the first 10). So is a
record whose chat template builds more than MAX_RENDER_CHARS characters (by
'*', a loop, a macro, a filter's width, str.replace or join: checked before
they run; compile_chat_template), more than MAX_RENDER_BUILT in all in one
rendering, or renders for more than MAX_RENDER_SECONDS. --max-bad N stops at the (N+1)th. Exit
status 1 with one line when nothing usable remains, on any other error, and
130 on Ctrl-C. Inputs and the tokenizer's files must be regular files: a
FIFO, a device or a folder is refused, saying which, without blocking on it.
A progress line goes to stderr when it is a terminal, or with --progress.

Speed: a worker thread runs tokenizers' batch encode (which releases the GIL
and uses every core) on one batch of records while this thread parses the
next batch and writes out the previous one; JSON lines are parsed by orjson
where it is installed, and by the standard library whenever orjson refuses a
line, so that what is accepted and the error messages are the standard
library's.

Code: this module holds the run (run(), main(), the command line); the rest
is in private modules of the package, and prepare re-exports their public
names (prepare.Outputs, prepare.load_tokenizer, ...):
  _prepare_common     PrepareError, BadRecord; files read are regular files
  _prepare_tokenizer  the tokenizer's files, load_tokenizer, TokenizerInfo
  _prepare_template   the chat template: compile_chat_template (the bounded
                      jinja2 sandbox), ChatRenderer (the render deadline and
                      the assistant spans), MAX_RENDER_CHARS/_SECONDS
  _prepare_records    reading records (text, jsonl, alpaca, chat), Encoder
  _prepare_outputs    Outputs (temporaries, the .bin's set record, the commit
                      order), PrefixLock, dead runs' temporaries, fault_point,
                      check_apart (no output is a file the run reads)
A constant is read where it is defined: lower MAX_RENDER_CHARS in
_prepare_template, not here (prepare's copy is not read).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ._prepare_common import BadRecord, PrepareError, check_regular, open_regular
from ._prepare_outputs import (HEADER_INTS, OUTPUT_EXTENSIONS, RENAME_FAULTS, RENAME_ORDER, SET_MARKER, SET_VERSION,
                               TOKEN_FORMATS, Outputs, PrefixLock, check_apart, check_out_prefix, fault_point,
                               output_paths, remove_dead_temporaries)
from ._prepare_records import (ALPACA_PROMPT, ALPACA_PROMPT_INPUT, FAST_MAX_BRACKETS, JSON_EXTENSIONS, READ_BLOCK,
                               Encoder, Item, Source, infer_format, mask_from_spans, read_json_records,
                               read_text_records)
from ._prepare_template import (MAX_RENDER_CHARS, MAX_RENDER_SECONDS, REASONING_FIELDS, ChatRenderer,
                                compile_chat_template, normalize_messages)
from ._prepare_tokenizer import SPECIAL_TOKEN_NAMES, TOKENIZER_HINT, TokenizerInfo, load_tokenizer, tokenizer_files

# This module's names and those of its parts: prepare.NAME reaches each, as when the tool was one module.
__all__ = [
    "MANIFEST_FORMAT", "MAX_LISTED_BAD", "BATCH_CHARS", "BATCH_BAD", "PIPELINE", "check_stop", "Progress", "run",
    "parse_args", "main",
    "PrepareError", "BadRecord", "check_regular", "open_regular",
    "SPECIAL_TOKEN_NAMES", "TOKENIZER_HINT", "TokenizerInfo", "tokenizer_files", "load_tokenizer",
    "MAX_RENDER_CHARS", "MAX_RENDER_SECONDS", "REASONING_FIELDS", "compile_chat_template", "ChatRenderer",
    "normalize_messages",
    "JSON_EXTENSIONS", "ALPACA_PROMPT", "ALPACA_PROMPT_INPUT", "READ_BLOCK", "FAST_MAX_BRACKETS", "Source",
    "read_json_records", "read_text_records", "infer_format", "Item", "mask_from_spans", "Encoder",
    "HEADER_INTS", "SET_MARKER", "SET_VERSION", "OUTPUT_EXTENSIONS", "RENAME_ORDER", "TOKEN_FORMATS", "RENAME_FAULTS",
    "fault_point", "check_out_prefix", "output_paths", "check_apart", "PrefixLock", "remove_dead_temporaries",
    "Outputs",
]

MANIFEST_FORMAT = "zinc.prepare/1"
MAX_LISTED_BAD = 10
BATCH_CHARS = 1 << 20  # records are tokenized in batches of about this many characters
BATCH_BAD = 1024  # ... or of this many bad records (reported, and --max-bad checked, a batch at a time)
PIPELINE = True  # encode on a worker thread, overlapped with parsing and writing (False: one thread, in turn)


# ---------------------------------------------------------------------------------------------------------------
# The run


_STOP_SIGNAL: list = []  # a SIGTERM received (main's handler): the run stops at its next check_stop()


def _on_sigterm(signum: int, frame: Any) -> None:
    # Only noted here: an exception raised by a signal handler can land in a __del__ or a weakref callback, where
    # Python prints it as a traceback and drops it; check_stop() raises it where it cannot.
    _STOP_SIGNAL.append(signum)


def check_stop() -> None:
    """Ends the run as sys.exit(128 + SIGTERM) when a SIGTERM came, so that the temporaries are removed on the
    way out. Called between batches and before the commit, never during it: a SIGTERM then lets it end."""
    if _STOP_SIGNAL:
        sys.exit(128 + _STOP_SIGNAL[0])


class Progress:
    """One line on stderr, rewritten at most 4 times a second."""

    def __init__(self, enabled: bool):
        self.enabled, self.start, self.last = enabled, time.monotonic(), 0.0

    def update(self, records: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.25):
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        sys.stderr.write(f"\rzinc.prepare: {records:,} records, {tokens:,} tokens, {rate:,.0f} tokens/s")
        sys.stderr.write("\n" if final else "")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> dict:
    """Prepares the data set; returns the manifest. Raises PrepareError for a failed run, before anything is
    written when an argument or a file is wrong (an input that is no regular file, an output that is a file the
    run reads) or another run holds the --out prefix."""
    prefix = check_out_prefix(args.out)
    inputs = [os.path.abspath(p) for p in args.inputs]
    for p in inputs:
        check_regular(p)
    # Positions are int32 in training (and a sample of seq_len + 1 tokens
    # must fit the data): zinc-train refuses past 2^31 - 1.
    if not 1 <= args.seq_len <= 2**31 - 1:
        raise PrepareError(f"--seq-len must be between 1 and {2**31 - 1}, got {args.seq_len}")
    if args.chunk and args.truncate:
        raise PrepareError("--chunk and --truncate both say what to do with a long record: give one")
    if args.max_bad is not None and args.max_bad < 0:
        raise PrepareError(f"--max-bad must be >= 0, got {args.max_bad}")
    reads = [("input", p) for p in inputs] + tokenizer_files(args.tokenizer, args.chat_template)
    check_apart(prefix, reads)
    lock = PrefixLock(prefix, reads)
    try:
        return _prepare(args, prefix, inputs)
    finally:
        lock.release()


class RowPacker:
    """--pack rows: documents (token ids, mask) into rows of n tokens, none across two, each row filled up
    with padding (a document of pad_id tokens, mask 0, so that no record attends to it). Best fit over a
    window of OPEN_ROWS rows: a document goes to the open row it fills most, or opens one; past OPEN_ROWS the
    fullest row is written out. Rows come out in that order, not the records' (zinc-train shuffles rows)."""

    OPEN_ROWS = 64

    def __init__(self, n: int, pad_id: int):
        self.n, self.pad_id = n, pad_id
        self.rows: list[tuple[int, list]] = []  # (tokens in it, its documents)
        self.padding = 0

    def add(self, docs: list) -> list:
        """The rows closed by these documents, flattened: what to write now."""
        out: list = []
        for doc in docs:
            size = len(doc[0])
            best = -1
            for i, (used, _) in enumerate(self.rows):
                if used + size <= self.n and (best < 0 or used > self.rows[best][0]):
                    best = i
            if best < 0:
                self.rows.append((0, []))
                best = len(self.rows) - 1
            used, row = self.rows[best]
            row.append(doc)
            self.rows[best] = (used + size, row)
            if used + size == self.n:
                out += self._close(best)
            elif len(self.rows) > self.OPEN_ROWS:
                out += self._close(max(range(len(self.rows)), key=lambda i: self.rows[i][0]))
        return out

    def close(self) -> list:
        """Every open row, padded (the last too: a set is whole rows), and one more padding token: the last
        row's last target, without which zinc-train would not read that row."""
        out: list = []
        while self.rows:
            out += self._close(0)
        if out:
            out.append(([self.pad_id], bytearray(1)))
            self.padding += 1
        return out

    def _close(self, i: int) -> list:
        used, row = self.rows.pop(i)
        fill = self.n - used
        if fill:
            row.append(([self.pad_id] * fill, bytearray(fill)))
            self.padding += fill
        return row


def _prepare(args: argparse.Namespace, prefix: str, inputs: list[str]) -> dict:
    """run()'s work, under the prefix's lock."""
    fmt = args.format
    if fmt is None:
        # Every input's, not the first's alone: a .jsonl after a .txt was
        # tokenized as text, its braces and keys with it.
        inferred = [(path, *infer_format(path)) for path in inputs]
        fmt, why = inferred[0][1], inferred[0][2]
        for path, other, other_why in inferred[1:]:
            if other != fmt:
                raise PrepareError(f"the inputs are of different formats: {inputs[0]} is {fmt} ({why}), {path} is "
                                   f"{other} ({other_why}); prepare one format at a time, or pass --format")
        print(f"zinc.prepare: format {fmt} (inferred: {why}; --format sets it)", file=sys.stderr)
    if args.chunk and fmt not in ("text", "jsonl"):
        raise PrepareError("--chunk is for text and jsonl (it would cut a prompt from its response)")
    if args.use_chat_template and fmt != "alpaca":
        raise PrepareError("--use-chat-template is for --format alpaca (chat always uses the template)")
    info = load_tokenizer(args.tokenizer, args.eos, args.chat_template)
    pack = args.pack or ("rows" if fmt in ("alpaca", "chat") else "stream")
    limit = args.seq_len if pack == "rows" else args.seq_len + 1  # the longest record that fits
    encoder = Encoder(info, fmt, args.use_chat_template, None if args.truncate or args.chunk else limit)
    packer = RowPacker(args.seq_len, info.eos_id if info.eos_id is not None else 0) if pack == "rows" else None
    sources = [Source(p) for p in inputs]
    bad_total = 0
    progress = Progress(args.progress or sys.stderr.isatty())
    records = 0

    def bad(src: Source, line: int, why: str) -> None:
        nonlocal bad_total
        src.bad_records += 1
        bad_total += 1
        if bad_total <= MAX_LISTED_BAD:
            print(f"zinc.prepare: bad record {os.path.relpath(src.path)}:{line}: {why}", file=sys.stderr)
        if args.max_bad is not None and bad_total > args.max_bad:
            raise PrepareError(f"more than --max-bad {args.max_bad} bad records (the last: "
                               f"{os.path.relpath(src.path)}:{line}: {why})")

    def finish(batch: list[Item], skipped: list, encoded: list) -> None:
        """Writes a batch's documents; reports its bad records, those found while parsing (skipped) and those
        found here, in line order."""
        nonlocal records
        docs, bads = [], list(skipped)
        for it, (ids, mask) in zip(batch, encoded):
            src = sources[it.source]
            if len(ids) > limit:
                if not (args.truncate or args.chunk):
                    what = f"--seq-len {limit} (--pack rows)" if pack == "rows" else f"--seq-len + 1 = {limit}"
                    bads.append((it.source, it.line, f"{len(ids)} tokens, more than {what} (--truncate cuts it)"))
                    continue
                if args.chunk:  # text and jsonl only: mask None
                    docs += [(ids[i:i + limit], None) for i in range(0, len(ids), limit)]
                    src.records += 1
                    continue
                ids, mask = ids[:limit], None if mask is None else mask[:limit]
            if not ids or (mask is not None and 1 not in mask):
                bads.append((it.source, it.line, "no training label left (nothing to learn)" if ids else "no tokens"))
                continue
            docs.append((ids, mask))
            src.records += 1
        for source, line, why in sorted(bads):
            bad(sources[source], line, why)
        out.add(packer.add(docs) if packer else docs)
        records += len(batch) + len(skipped)
        progress.update(records, out.tokens)

    # Two batches in flight: a worker thread encodes one (tokenizers releases the GIL and runs on every core)
    # while this thread parses the records of the next and writes out the one before. Output and reports are
    # those of the one-thread order (PIPELINE = False).
    pool = ThreadPoolExecutor(1) if PIPELINE else None
    pending: Optional[tuple] = None

    def flush(batch: list[Item], skipped: list) -> None:
        nonlocal pending
        check_stop()
        if pool is None:
            finish(batch, skipped, encoder.encode(batch))
            return
        started = (batch, skipped, pool.submit(encoder.encode, batch))
        if pending is not None:
            finish(pending[0], pending[1], pending[2].result())
        pending = started

    out = Outputs(prefix, info.token_dtype)
    out.row_tokens = args.seq_len if pack == "rows" else 0
    try:
        for index, src in enumerate(sources):
            reader = read_text_records(src, args.split) if fmt == "text" else read_json_records(src)
            batch: list[Item] = []
            skipped: list[tuple[int, int, str]] = []  # (source, line, why) of the batch's bad records
            chars = 0
            for line, record in reader:
                try:
                    if isinstance(record, BadRecord):
                        raise record
                    it = encoder.item(index, line, record)
                except BadRecord as e:
                    skipped.append((index, line, str(e)))
                    if len(skipped) < BATCH_BAD:
                        continue
                else:
                    batch.append(it)
                    chars += len(it.text) + len(it.response)
                if chars >= BATCH_CHARS or len(skipped) >= BATCH_BAD:
                    flush(batch, skipped)
                    batch, skipped, chars = [], [], 0
            if batch or skipped:
                flush(batch, skipped)
        if pending is not None:
            finish(pending[0], pending[1], pending[2].result())
            pending = None
        if packer:
            out.add(packer.close())
        progress.update(records, out.tokens, final=True)
        if bad_total > MAX_LISTED_BAD:
            print(f"zinc.prepare: ... {bad_total - MAX_LISTED_BAD} more bad records not listed", file=sys.stderr)
        if out.documents == 0:
            raise PrepareError(f"nothing usable: {bad_total} bad records and no good one in {len(sources)} file(s)")
        if out.tokens < args.seq_len + 1:  # zinc-train refuses such a set: say so now (a test set may be meant for more)
            print(f"zinc.prepare: warning: the set holds {out.tokens} tokens, fewer than one sample of --seq-len "
                  f"{args.seq_len} needs ({args.seq_len + 1}): zinc-train refuses it at that seq_len", file=sys.stderr)
        base = os.path.basename(out.prefix)
        manifest = {
            "format": MANIFEST_FORMAT,
            "tokenizer": info.path,
            "tokenizer_sha256": info.sha256,
            "vocab_size": info.vocab_size,
            "token_dtype": info.token_dtype,
            "tokens": out.tokens,
            "documents": out.documents,
            "pack": pack,
            "padding_documents": out.padding_documents,
            "padding_tokens": packer.padding if packer else 0,
            "masked_share": out.masked / out.tokens,
            "sources": [dataclasses.asdict(s) for s in sources],
            "bad_records": bad_total,
            "format_used": fmt,
            "seq_len": args.seq_len,
            "truncate": bool(args.truncate),
            "chunk": bool(args.chunk),
            "files": {"tokens": base + ".bin", "mask": base + ".mask", "documents": base + ".docs"},
            "crc32": dict(out.crc),
            "data": {"type": "tokens", "path": out.final["bin"], "mask_path": out.final["mask"],
                     "documents_path": out.final["docs"], "vocab_size": info.vocab_size, "seq_len": args.seq_len},
        }
        check_stop()  # the last moment a SIGTERM stops the run: once begun, the commit ends
        out.commit(manifest)
    except BaseException:
        out.discard()
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    print(f"zinc.prepare: wrote {out.prefix}.{{bin,mask,docs,json}}: {out.tokens:,} {info.token_dtype} tokens, "
          f"{out.documents - out.padding_documents:,} documents, {manifest['masked_share']:.1%} masked, {bad_total} bad records"
          + (f", {packer.padding:,} tokens of padding (--pack rows, {packer.padding / out.tokens:.1%})"
             if packer else ""),
          file=sys.stderr)
    return manifest


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zinc.prepare",
                                description="Tokenize a data set with a model's tokenizer into zinc token, mask "
                                            "and document files (see the module docstring for the rules).")
    p.add_argument("inputs", nargs="+", metavar="FILE", help="input files, all of one format")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="a model folder (tokenizer.json, tokenizer_config.json) or a tokenizer.json")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin, .mask, .docs and .json")
    p.add_argument("--seq-len", type=int, required=True, metavar="N", help="the training sequence length")
    p.add_argument("--format", choices=("text", "jsonl", "alpaca", "chat"),
                   help="default: inferred from each file (extension, then the first record's keys), which must agree")
    p.add_argument("--split", choices=("file", "paragraphs", "lines"), default="file",
                   help="text: one document per file (default), per blank-line-separated paragraph, or per line")
    p.add_argument("--pack", choices=("rows", "stream"),
                   help="rows: each record within one training row, padded before where needed (default for "
                        "alpaca and chat); stream: back to back, a record may span two rows (default for text "
                        "and jsonl)")
    p.add_argument("--truncate", action="store_true",
                   help="cut a record longer than a row holds (N tokens with --pack rows, else N+1) to that")
    p.add_argument("--chunk", action="store_true",
                   help="text, jsonl: cut a record longer than a row holds into documents of that length")
    p.add_argument("--use-chat-template", action="store_true",
                   help="alpaca: render instruction and output with the chat template")
    p.add_argument("--chat-template", metavar="FILE", help="a jinja file to use instead of the model's template")
    p.add_argument("--eos", metavar="TOKEN", help="the end-of-sequence token (default: the config's eos_token)")
    p.add_argument("--max-bad", type=int, metavar="N", help="fail when more than N records are bad (default: "
                   "no limit; a run with no good record always fails)")
    p.add_argument("--progress", action="store_true", help="a progress line on stderr even when it is no terminal")
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    # A SIGTERM stops the run at its next check_stop() and unwinds like an error, so that the temporaries are
    # removed; the caller's handler is back after.
    _STOP_SIGNAL.clear()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run(args)
    except PrepareError as e:
        print(f"zinc.prepare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nzinc.prepare: interrupted; nothing written", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"zinc.prepare: error: {e}", file=sys.stderr)
        return 1
    except MemoryError:
        # A record is read whole: a multi-GB input without line breaks (a binary file, a sparse one) does not fit.
        print("zinc.prepare: error: out of memory reading the input (a record is read whole: is a file without "
              f"line breaks among {', '.join(args.inputs)}?); nothing written", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return 0


if __name__ == "__main__":
    try:
        status = main()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the work is done: a Ctrl-C now ends the process plainly
    except KeyboardInterrupt:
        status = 130
    sys.exit(status)
