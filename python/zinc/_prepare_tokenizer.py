"""zinc.prepare's tokenizer: the files it reads (tokenizer.json, tokenizer_config.json, the chat template),
its special tokens, its eos token and its chat template's source. See prepare.py for the tool."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

from ._prepare_common import PrepareError, check_regular, open_regular

# The named special tokens transformers passes to a chat template (PreTrainedTokenizerBase.special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> Optional[str]:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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
    # A special token is text, an AddedToken {"content": text}, or null (none). Anything else is a damaged
    # file: read as "no such token", an eos_token of 128009 left every document without its EOS.
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if value is not None and _token_text(value) is None and not (name == "eos_token" and eos is not None):
            shown = json.dumps(value)
            raise PrepareError(f"{files['tokenizer config']}: {name} is {shown[:80]}{'...' if len(shown) > 80 else ''}"
                               ", not a token (a string, or an object with a \"content\" string, as transformers "
                               "writes it): the file is damaged; fix it, or pass --eos for the eos token")
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
