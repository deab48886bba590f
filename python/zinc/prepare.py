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
          separated) or lines (one document per non-empty line).
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
               without special tokens; no EOS appended. Mask 1 on the tokens
               of each assistant turn: for assistant message i, the characters
               between render(messages[:i], add_generation_prompt=True) and
               render(messages[:i+1]), i.e. the content plus whatever the
               template writes after it before the next message (the
               end-of-turn token, and e.g. ChatML's newline). A token that
               overlaps such a span is a label (transformers' rule for
               assistant_masks). The rest (system, user, tool turns, the
               assistant header) is 0. A template whose renderings of the
               prefixes are not prefixes of the whole conversation cannot be
               split this way: such a record is bad.
EOS is the tokenizer config's eos_token (--eos overrides it).

Lengths: --seq-len N is the training sequence length; a record of more than
N+1 tokens is a bad record unless --truncate (cut to its first N+1 tokens)
or, for text and jsonl, --chunk (cut into documents of N+1 tokens).
A record left with no label (mask all 0) is bad as well.

Output (read by zinc's `tokens` data source):
  PREFIX.bin   llm.c's token file: 256 little-endian int32 header (magic,
               version, token count; 20240520/1 = uint16 tokens, 20240801/7 =
               uint32 tokens, uint16 when the vocabulary with added tokens is
               <= 65536), then the tokens, little-endian. Header slots 3..10
               (0 in llm.c's files) record the set: [3] 0x434E495A (the bytes
               "ZINC" in file order), [4] 1 (this record's version), [5] the
               zlib CRC-32 of PREFIX.mask (its uint32 bit pattern), [6] and [7]
               the low and high 32 bits of its size in bytes, [8], [9] and [10]
               the same of PREFIX.docs; the other slots are 0.
  PREFIX.mask  one uint8 per token: 1 = a training label, 0 = not.
  PREFIX.docs  little-endian uint64 token index at which each document starts
               (first 0, strictly increasing). Documents are packed back to
               back, unpadded.
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
'*', a loop, a macro, a filter's width: compile_chat_template) or renders
for more than MAX_RENDER_SECONDS. --max-bad N stops at the (N+1)th. Exit
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
"""
from __future__ import annotations

import argparse
import array
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import stat
import struct
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, BinaryIO, Callable, Iterator, Optional

try:  # a fast path for JSONL parsing; the standard library's json decides whatever orjson refuses
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is optional
    _fast_loads = None

MANIFEST_FORMAT = "zinc.prepare/1"
HEADER_INTS = 256
SET_MARKER = 0x434E495A  # header[3]: the bytes "ZINC" in file order; header[4..10] then record the set
SET_VERSION = 1  # header[4]: the version of that record
OUTPUT_EXTENSIONS = ("bin", "mask", "docs", "json")
# The data's commit point is the .bin (its header vouches for the .mask and .docs); the manifest, whose old
# version is removed before the first rename, comes after it: a manifest present always describes the .bin.
RENAME_ORDER = ("mask", "docs", "bin", "json")
MAX_RENDER_CHARS = 1 << 24  # a chat template's rendering of a record, and any string or list it builds, at most
MAX_RENDER_SECONDS = 10.0  # a record's renderings at most (enforced on the main thread, by SIGALRM)
TOKEN_FORMATS = {"uint16": (20240520, 1, "H"), "uint32": (20240801, 7, "I")}  # magic, version, array typecode
JSON_EXTENSIONS = (".jsonl", ".json", ".ndjson")
MAX_LISTED_BAD = 10
BATCH_CHARS = 1 << 20  # records are tokenized in batches of about this many characters
BATCH_BAD = 1024  # ... or of this many bad records (reported, and --max-bad checked, a batch at a time)
PIPELINE = True  # encode on a worker thread, overlapped with parsing and writing (False: one thread, in turn)

ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                 "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_PROMPT_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n"
                       "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")

# The named special tokens transformers passes to a chat template (PreTrainedTokenizerBase.special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class PrepareError(Exception):
    """A failure of the whole run: printed as one line, exit status 1."""


class BadRecord(Exception):
    """One record that cannot be used: counted, skipped, reported with its place."""


# ---------------------------------------------------------------------------------------------------------------
# Files read: regular files only (a FIFO would block, /dev/zero never ends, a folder holds no records)


def _not_regular(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return "is " + next((name for test, name in kinds if test(mode)), "something") + ", not a regular file"


def check_regular(path: str, hint: str = "") -> os.stat_result:
    """The stat (symlinks followed) of a file to read; a PrepareError naming it when it is missing or not a
    regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PrepareError(f"{path}: no such file{hint}")
    except OSError as e:
        raise PrepareError(f"{path}: {e.strerror}{hint}")
    if not stat.S_ISREG(st.st_mode):
        raise PrepareError(f"{path}: {_not_regular(st.st_mode)}{hint}")
    return st


def open_regular(path: str, hint: str = "") -> BinaryIO:
    """Opens a file to read (binary), refusing anything but a regular file without blocking: by stat before
    the open, then by fstat of what was opened, with O_NONBLOCK (a FIFO put there in between does not block
    the open)."""
    check_regular(path, hint)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise PrepareError(f"{path}: {e.strerror}{hint}")
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PrepareError(f"{path}: {_not_regular(mode)}{hint}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer and its chat template


def _token_text(value: Any) -> Optional[str]:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _check_built(value: Any, what: str) -> Any:
    """value, unless it is a string, list, tuple or dict longer than MAX_RENDER_CHARS (a BadRecord)."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDER_CHARS:
        unit = "characters" if isinstance(value, str) else "items"
        raise BadRecord(f"the chat template builds {what} of {len(value):,} {unit}, more than {MAX_RENDER_CHARS:,}")
    return value


def _check_argument(value: Any) -> None:
    """An argument of a call or filter: an integer above MAX_RENDER_CHARS (a width, a count) is a BadRecord,
    as is a string or list longer than that."""
    if isinstance(value, int) and abs(value) > MAX_RENDER_CHARS:
        raise BadRecord(f"the chat template passes {value:,} to a function or filter, more than {MAX_RENDER_CHARS:,}")
    _check_built(value, "an argument")


def _check_format(fmt: Any) -> None:
    """A format string ('%' or str.format) with a number above MAX_RENDER_CHARS (a width or precision) is a
    BadRecord, checked before it runs: '%1000000000s' would allocate a gigabyte."""
    if not isinstance(fmt, str):
        return
    digits = len(str(MAX_RENDER_CHARS))
    for n in re.findall(r"\d{%d,}" % digits, fmt):
        if len(n) > digits or int(n) > MAX_RENDER_CHARS:
            raise BadRecord(f"the chat template formats with a width or precision above {MAX_RENDER_CHARS:,}")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Before a '*', '**' or '%' runs: what it would build is not above MAX_RENDER_CHARS."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_CHARS:
                unit = "characters" if isinstance(seq, str) else "items"
                raise BadRecord(f"the chat template repeats a {type(seq).__name__} of {len(seq):,} {unit} {n:,} "
                                f"times ('*'): {len(seq) * n:,}, more than {MAX_RENDER_CHARS:,}")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and \
                (abs(left).bit_length() - 1) * right > 8 * MAX_RENDER_CHARS:
            raise BadRecord(f"the chat template raises {left:,} to the power {right:,} ('**'), an integer of more "
                            f"than {8 * MAX_RENDER_CHARS:,} bits")
    elif operator == "%":
        _check_format(left)
        for a in right if isinstance(right, tuple) else (right,):
            _check_argument(a)


class _RenderDeadline:
    """A record's renderings end with a BadRecord after MAX_RENDER_SECONDS (a template looping without end):
    SIGALRM, whose handler runs on the main thread between two bytecodes, so only there, and only when no
    other ITIMER_REAL timer is running (elsewhere: no bound on time, only on size). One C call (a huge sort,
    say) is not interrupted."""

    def __init__(self) -> None:
        self.active = False
        self.previous: Any = None
        self.enabled = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
                        and signal.getitimer(signal.ITIMER_REAL)[0] == 0)

    def _expired(self, signum: int, frame: Any) -> None:
        if self.active:
            self.active = False
            raise BadRecord(f"the chat template ran past {MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)")

    def __enter__(self) -> "_RenderDeadline":
        if self.enabled:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            self.active = True
            signal.setitimer(signal.ITIMER_REAL, MAX_RENDER_SECONDS)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.active = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous)


def compile_chat_template(source: str) -> Any:
    """The template compiled in the jinja2 environment transformers' apply_chat_template uses
    (transformers/utils/chat_template_utils.py, _compile_jinja_template): a sandbox with trim_blocks and
    lstrip_blocks, loop controls, tojson without HTML escaping, raise_exception, strftime_now, and the
    {% generation %} tag (rendered as its body: the assistant spans are found from prefixes instead).

    Bounded, where transformers' is not: no string, list or dict above MAX_RENDER_CHARS may be built by '*'
    or '**' (checked before they run), '+' or '%', a call (a macro, a method, a global: its arguments and
    result), a filter (the same) or a namespace attribute; a BadRecord says which. With jinja2's own bound on
    range() (MAX_RANGE) and ChatRenderer's on the rendering's length and time, `{{ content * 100000000 }}`
    or a string doubled in a loop is a bad record in microseconds, not minutes and gigabytes."""
    import functools

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _check_built(super().call_binop(context, operator, left, right), f"a {operator!r} result")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            for a in (*args, *kwargs.values()):
                _check_argument(a)
            return _check_built(super().call(__context, __obj, *args, **kwargs), "a call's result")

        def wrap_str_format(self, value: Any) -> Optional[Callable[..., str]]:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            _check_format(value.__self__)
            return lambda *args, **kwargs: _check_built(wrapped(*args, **kwargs), "a str.format result")

    def bounded_filter(name: str, f: Callable) -> Callable:
        @functools.wraps(f)  # keeps jinja2's pass_context / pass_eval_context marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            for a in (*args, *kwargs.values()):
                if name == "format":
                    _check_format(a)
                _check_argument(a)
            return _check_built(f(*args, **kwargs), f"the result of the filter {name!r}")
        return bounded

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        # As transformers: dict(...) and dict.fromkeys(...) without the type itself.
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # As transformers: no underscore-prefixed attributes on a namespace.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, _check_built(value, f"a namespace attribute {name!r}"))

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters.update({name: bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


@dataclasses.dataclass
class TokenizerInfo:
    tokenizer: Any  # tokenizers.Tokenizer
    path: str  # tokenizer.json
    sha256: str  # of tokenizer.json
    vocab_size: int  # with added tokens
    special_tokens: dict  # name -> text, the chat template's variables
    eos_id: Optional[int]
    chat_template: Optional[str]

    @property
    def token_dtype(self) -> str:
        return "uint16" if self.vocab_size <= 65536 else "uint32"


TOKENIZER_HINT = " (--tokenizer takes a model folder or a tokenizer.json)"


def tokenizer_files(path: str, chat_template_path: Optional[str] = None) -> list[tuple[str, str]]:
    """(what, path) of every file load_tokenizer reads: the tokenizer.json, then the tokenizer_config.json
    and chat template (--chat-template, else the folder's chat_template.jinja) where they exist. A PrepareError
    when the tokenizer.json or the --chat-template is missing, or any of them is no regular file."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    tok_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    check_regular(tok_file, TOKENIZER_HINT)
    files = [("tokenizer", tok_file)]
    config = os.path.join(folder, "tokenizer_config.json")
    template = chat_template_path or os.path.join(folder, "chat_template.jinja")
    for what, p in (("tokenizer config", config), ("chat template", template)):
        if os.path.exists(p) or (what == "chat template" and chat_template_path):
            check_regular(p)
            files.append((what, p))
    return files


def _read_text(path: str) -> str:
    with open_regular(path) as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: invalid UTF-8 at byte {e.start}: {e.reason}")


def load_tokenizer(path: str, eos: Optional[str] = None, chat_template_path: Optional[str] = None) -> TokenizerInfo:
    """A model folder (tokenizer.json, tokenizer_config.json, optionally chat_template.jinja) or a tokenizer.json
    (its folder's tokenizer_config.json is read when present). chat_template.jinja wins over the config's
    chat_template, as in transformers; a list of named templates uses "default". Only regular files are read
    (tokenizer_files)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError("the Hugging Face tokenizers package is missing: python3 -m pip install tokenizers")
    files = dict((what, p) for what, p in tokenizer_files(path, chat_template_path))
    tok_file = files["tokenizer"]
    with open_regular(tok_file, TOKENIZER_HINT) as f:
        raw = f.read()
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:
        raise PrepareError(f"{tok_file}: not a tokenizers file: {e}")
    config: Any = {}
    if "tokenizer config" in files:
        config_file = files["tokenizer config"]
        try:
            config = json.loads(_read_text(config_file))
        except ValueError as e:
            raise PrepareError(f"{config_file}: {e}")
        except RecursionError:
            raise PrepareError(f"{config_file}: invalid JSON: nested too deeply")
        if not isinstance(config, dict):
            raise PrepareError(f"{config_file}: a JSON {type(config).__name__}, not an object")
    special = {name: t for name in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(name))) is not None}
    if eos is not None:
        special["eos_token"] = eos
    eos_id = None
    if "eos_token" in special:
        try:
            eos_id = tokenizer.token_to_id(special["eos_token"])
        except UnicodeError:  # a lone surrogate
            raise PrepareError(f"the eos token {special['eos_token']!r} is not valid Unicode text")
        if eos_id is None:
            raise PrepareError(f"the eos token {special['eos_token']!r} is not in {tok_file}'s vocabulary")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if "chat template" in files:
        template = _read_text(files["chat template"])
    return TokenizerInfo(tokenizer, os.path.abspath(tok_file), hashlib.sha256(raw).hexdigest(),
                         tokenizer.get_vocab_size(with_added_tokens=True), special, eos_id,
                         template if isinstance(template, str) else None)


class ChatRenderer:
    """Renders a conversation and finds the character spans of its assistant turns."""

    def __init__(self, info: TokenizerInfo):
        if info.chat_template is None:
            raise PrepareError("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); "
                               "pass --chat-template FILE")
        try:
            self.template = compile_chat_template(info.chat_template)
        except Exception as e:
            raise PrepareError(f"the chat template does not compile: {e}")
        self.variables = dict(info.special_tokens)

    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        """The rendering (as jinja2's render() joins it), stopped with a BadRecord as soon as it passes
        MAX_RENDER_CHARS."""
        parts, length = [], 0
        for part in self.template.generate(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **self.variables):
            length += len(part)
            if length > MAX_RENDER_CHARS:
                raise BadRecord(f"the chat template's rendering passes {MAX_RENDER_CHARS:,} characters")
            parts.append(part)
        return "".join(parts)

    def render_with_spans(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and its assistant spans; a BadRecord past MAX_RENDER_SECONDS (on the main thread)."""
        with _RenderDeadline():
            return self._render_with_spans(messages)

    def _render_with_spans(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = full if i == len(messages) - 1 else self.render(messages[:i + 1])
            if not (full.startswith(through) and through.startswith(before)):
                raise BadRecord(f"the template's rendering of messages[:{i}] is not a prefix of the conversation's, "
                                f"so assistant turn {i} cannot be located")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return full, spans


def normalize_messages(messages: Any) -> list:
    """Checks a chat record's messages and applies transformers' normalisation: keys whose value is None are
    dropped, and a message's reasoning is copied under each name templates read it by."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' is not a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRecord(f"messages[{i}] is not an object with a string 'role'")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no assistant message")
    return out


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


class Encoder:
    """Turns a record (parsed JSON or text) into an Item, and batches of Items into (ids, mask) pairs."""

    def __init__(self, info: TokenizerInfo, fmt: str, use_chat_template: bool):
        self.info, self.fmt = info, fmt
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
        try:
            text, spans = self.chat.render_with_spans(messages)
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


# ---------------------------------------------------------------------------------------------------------------
# Output: temporaries in the destination folder, renamed at the end, the .bin last


def fault_point(phase: str) -> None:
    """Test hook (tests/tools/crash_prepare.py), as the engine's ZINC_CHECKPOINT_FAULT: ZINC_PREPARE_FAULT=PHASE
    kills this process with SIGKILL, as kill -9 would, at PHASE: "writing" (the first batch is in the
    temporaries), "before_rename" (the four temporaries complete and fsynced, none renamed), "after_mask",
    "after_docs", "after_bin" (that file renamed into place, those after it in RENAME_ORDER not yet; the old
    manifest already removed), "after_manifest" (all four renamed, the folder not yet fsynced). Nothing when
    unset or another phase."""
    if os.environ.get("ZINC_PREPARE_FAULT") == phase:
        os.kill(os.getpid(), signal.SIGKILL)


RENAME_FAULTS = {"mask": "after_mask", "docs": "after_docs", "json": "after_manifest", "bin": "after_bin"}


def check_out_prefix(out: str) -> str:
    """The absolute --out prefix; a PrepareError when it names no file (empty, a folder's path, . or ..)."""
    if os.path.basename(out) in ("", ".", ".."):
        raise PrepareError(f"--out {out!r} is not a file prefix: give one such as data/sft (the outputs are "
                           "PREFIX.bin, PREFIX.mask, PREFIX.docs and PREFIX.json)")
    prefix = os.path.abspath(out)
    folder = os.path.dirname(prefix)
    if not os.path.isdir(folder):
        raise PrepareError(f"{folder}: no such folder (the --out prefix's folder must exist)")
    return prefix


def output_paths(prefix: str) -> dict:
    """Every path a run on the prefix writes: the four outputs, their temporaries (.BASENAME.EXT.tmp-PID) and
    the lock file (.BASENAME.lock), all in the prefix's folder."""
    folder, base = os.path.split(prefix)
    paths = {ext: f"{prefix}.{ext}" for ext in OUTPUT_EXTENSIONS}
    paths.update({f"{ext}.tmp": os.path.join(folder, f".{base}.{ext}.tmp-{os.getpid()}") for ext in OUTPUT_EXTENSIONS})
    paths["lock"] = os.path.join(folder, f".{base}.lock")
    return paths


def _identity(path: str) -> Optional[tuple[int, int]]:
    """(device, inode) of the file a path resolves to (symlinks followed), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_apart(prefix: str, reads: list[tuple[str, str]]) -> None:
    """Refuses, before anything is written, an output that is a file the run reads: (what, path) of each
    input, the tokenizer's files. Files are compared by device and inode of the resolved path, never by name:
    a symlink, a hard link or another spelling of the path is the same file. An output that is a folder is
    refused too (it could not be replaced)."""
    read_ids = {}
    for what, path in reads:
        if (i := _identity(path)) is not None:
            read_ids.setdefault(i, (what, path))
    for key, path in output_paths(prefix).items():
        if key in OUTPUT_EXTENSIONS and os.path.isdir(path):
            raise PrepareError(f"{path}: is a folder, where --out writes a file; choose another --out")
        if (i := _identity(path)) in read_ids:
            what, source = read_ids[i]
            raise PrepareError(f"--out would overwrite the {what} {source}: {path} is that file; choose another --out")


def _alive(pid: int) -> bool:
    """Whether a process of that id runs (one of another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


class PrefixLock:
    """The run's exclusive hold on an output prefix: flock on FOLDER/.BASENAME.lock (created, holding the pid;
    removed at the end), non-blocking: a second run on the same --out at once is refused naming the pid that
    holds it. Once held, the temporaries runs on the prefix left when killed (.BASENAME.EXT.tmp-PID of a PID
    that is no live process) are removed."""

    def __init__(self, prefix: str, reads: list[tuple[str, str]]):
        self.prefix = prefix
        self.path = output_paths(prefix)["lock"]
        self.fd: Optional[int] = None
        self._acquire()
        try:
            self.removed = remove_dead_temporaries(prefix, {_identity(p) for _, p in reads})
        except BaseException:
            self.release()
            raise

    def _acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                raise PrepareError(f"{self.path}: another zinc.prepare (pid {holder or 'unknown'}) is writing "
                                   f"{self.prefix}.{{bin,mask,docs,json}}; wait for it to end or choose another --out")
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                    raise
                print(f"zinc.prepare: warning: {self.path}: cannot lock ({e.strerror}): a second run on this --out "
                      "at once would not be refused", file=sys.stderr)
                return
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == _identity(self.path):
                break
            os.close(fd)  # the run that held it removed the file in between: lock the one now there
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Removes the lock file, while still holding it, then lets it go."""
        if self.fd is None:
            return
        st = os.fstat(self.fd)
        if (st.st_dev, st.st_ino) == _identity(self.path):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None


def remove_dead_temporaries(prefix: str, keep: set) -> list[str]:
    """Removes the temporaries of the prefix (.BASENAME.EXT.tmp-PID in its folder) whose PID is no live process:
    what a run killed before its renames left. Those of a live process are left, and so is a file the run reads
    (by its identity in keep). Returns the paths removed."""
    folder, base = os.path.split(prefix)
    pattern = re.compile(r"\.%s\.(?:%s)\.tmp-(\d+)" % (re.escape(base), "|".join(OUTPUT_EXTENSIONS)))
    removed = []
    for name in sorted(os.listdir(folder)):
        m = pattern.fullmatch(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) or _identity(path) in keep:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _create(path: str) -> BinaryIO:
    """A new file at path, opened to write: whatever was there (a temporary of an earlier process that had this
    pid) is removed first, so that nothing is written through a symlink."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), "wb")


class Outputs:
    """PREFIX.{bin,mask,docs} written under temporary names (.BASENAME.EXT.tmp-PID, in the prefix's folder), with
    the CRC-32 and size of the mask and documents counted on the way; commit() writes the .bin's header and the
    manifest, fsyncs the four and renames them into place, the .bin last; discard() removes whatever is left.
    The caller holds the prefix's PrefixLock."""

    def __init__(self, prefix: str, token_dtype: str):
        self.prefix = os.path.abspath(prefix)
        paths = output_paths(self.prefix)
        self.final = {ext: paths[ext] for ext in OUTPUT_EXTENSIONS}
        self.temp = {ext: paths[f"{ext}.tmp"] for ext in OUTPUT_EXTENSIONS}
        self.magic, self.version, self.typecode = TOKEN_FORMATS[token_dtype]
        self.files: dict = {}
        self.tokens = 0
        self.documents = 0
        self.masked = 0
        self.crc = {"tokens": 0, "mask": 0, "documents": 0}  # zlib.crc32 of the .bin after its header, .mask, .docs
        self.bytes = {"tokens": 0, "mask": 0, "documents": 0}
        try:
            for ext in ("bin", "mask", "docs"):
                self.files[ext] = _create(self.temp[ext])
        except BaseException:
            self.discard()
            raise
        self.files["bin"].write(bytes(4 * HEADER_INTS))  # the header is written at commit, with the count

    def add(self, docs: list[tuple[list, Optional[bytearray]]]) -> None:
        """Appends documents: (token ids, mask or None for all 1), one write per file."""
        tokens, starts, mask = array.array(self.typecode), array.array("Q"), bytearray()
        for ids, m in docs:
            starts.append(self.tokens + len(tokens))
            tokens.extend(ids)
            mask += b"\x01" * len(ids) if m is None else m
        for key, ext, data in (("tokens", "bin", _little_endian(tokens).tobytes()), ("mask", "mask", mask),
                               ("documents", "docs", _little_endian(starts).tobytes())):
            self.files[ext].write(data)
            self.crc[key] = zlib.crc32(data, self.crc[key])
            self.bytes[key] += len(data)
        self.tokens += len(tokens)
        self.documents += len(starts)
        self.masked += len(mask) - mask.count(1)
        fault_point("writing")

    def header(self) -> bytes:
        """The .bin's 256 little-endian int32s: llm.c's magic, version and token count, then the set record
        zinc-train checks the .mask and .docs beside it against: [3] SET_MARKER, [4] SET_VERSION, [5] the
        .mask's CRC-32 (its uint32 bit pattern), [6] and [7] the low and high 32 bits of its size in bytes,
        [8], [9] and [10] the same of the .docs; the rest 0."""
        if self.tokens > 0x7FFFFFFF:
            raise PrepareError(f"{self.tokens:,} tokens: more than llm.c's header counts (2**31 - 1); split the "
                               "data set into several --out")
        ints = [self.magic, self.version, self.tokens, SET_MARKER, SET_VERSION]
        for key in ("mask", "documents"):
            ints += [self.crc[key], self.bytes[key] & 0xFFFFFFFF, self.bytes[key] >> 32]
        return struct.pack(f"<{HEADER_INTS}I", *ints, *[0] * (HEADER_INTS - len(ints)))

    def commit(self, manifest: dict) -> None:
        """Writes the header and the manifest, fsyncs the four temporaries, removes the old manifest and renames
        them in RENAME_ORDER: the .mask, the .docs, the .bin, the data's commit point (its header vouches for
        the .mask and .docs by CRC-32 and size, so a set a kill left mixed is refused by zinc-train, not trained
        on), and the manifest last (one present always describes the .bin beside it). The folder is fsynced
        before the .bin's rename and after it."""
        self.files["bin"].seek(0)
        self.files["bin"].write(self.header())
        with _create(self.temp["json"]) as f:
            f.write(json.dumps(manifest, indent=2).encode("utf-8") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        fault_point("before_rename")
        folder = os.path.dirname(self.prefix)
        try:  # a manifest present always describes the .bin beside it: the old one goes before any rename
            os.unlink(self.final["json"])
        except FileNotFoundError:
            pass
        for ext in RENAME_ORDER:
            if ext == "bin":
                _fsync_path(folder)
            os.replace(self.temp[ext], self.final[ext])
            fault_point(RENAME_FAULTS[ext])
        _fsync_path(folder)

    def discard(self) -> None:
        for f in self.files.values():
            f.close()
        for path in self.temp.values():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _little_endian(a: array.array) -> array.array:
    if sys.byteorder != "little":
        a.byteswap()
    return a


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
    if args.seq_len < 1:
        raise PrepareError("--seq-len must be at least 1")
    reads = [("input", p) for p in inputs] + tokenizer_files(args.tokenizer, args.chat_template)
    check_apart(prefix, reads)
    lock = PrefixLock(prefix, reads)
    try:
        return _prepare(args, prefix, inputs)
    finally:
        lock.release()


def _prepare(args: argparse.Namespace, prefix: str, inputs: list[str]) -> dict:
    """run()'s work, under the prefix's lock."""
    fmt = args.format
    if fmt is None:
        fmt, why = infer_format(inputs[0])
        print(f"zinc.prepare: format {fmt} (inferred: {why}; --format sets it)", file=sys.stderr)
    if args.chunk and fmt not in ("text", "jsonl"):
        raise PrepareError("--chunk is for text and jsonl (it would cut a prompt from its response)")
    if args.use_chat_template and fmt != "alpaca":
        raise PrepareError("--use-chat-template is for --format alpaca (chat always uses the template)")
    info = load_tokenizer(args.tokenizer, args.eos, args.chat_template)
    encoder = Encoder(info, fmt, args.use_chat_template)
    limit = args.seq_len + 1
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
                    bads.append((it.source, it.line,
                                 f"{len(ids)} tokens, more than --seq-len + 1 = {limit} (--truncate cuts it)"))
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
        out.add(docs)
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
        progress.update(records, out.tokens, final=True)
        if bad_total > MAX_LISTED_BAD:
            print(f"zinc.prepare: ... {bad_total - MAX_LISTED_BAD} more bad records not listed", file=sys.stderr)
        if out.documents == 0:
            raise PrepareError(f"nothing usable: {bad_total} bad records and no good one in {len(sources)} file(s)")
        base = os.path.basename(out.prefix)
        manifest = {
            "format": MANIFEST_FORMAT,
            "tokenizer": info.path,
            "tokenizer_sha256": info.sha256,
            "vocab_size": info.vocab_size,
            "token_dtype": info.token_dtype,
            "tokens": out.tokens,
            "documents": out.documents,
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
          f"{out.documents:,} documents, {manifest['masked_share']:.1%} masked, {bad_total} bad records",
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
                   help="default: inferred from the first file (extension, then the first record's keys)")
    p.add_argument("--split", choices=("file", "paragraphs", "lines"), default="file",
                   help="text: one document per file (default), per blank-line-separated paragraph, or per line")
    p.add_argument("--truncate", action="store_true", help="cut a record longer than N+1 tokens to N+1")
    p.add_argument("--chunk", action="store_true",
                   help="text, jsonl: cut a record longer than N+1 tokens into documents of N+1 tokens")
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
