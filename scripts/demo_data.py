"""The fine-tuning walk-through's raw data, from two Debian packages, offline.

    python3 scripts/demo_data.py OUT_DIR

writes
  OUT_DIR/fortunes.jsonl   one {"text"} per fortune cookie of Debian's
                           `fortunes` (/usr/share/games/fortunes): the
                           pretraining corpus;
  OUT_DIR/wordnet.jsonl    Alpaca records {"instruction", "input", "output"}
                           from the glosses of Debian's `wordnet-base`
                           (/usr/share/wordnet/data.*): "What does the noun
                           "lantern" mean?" -> the gloss's definition (20,000
                           of the 92,000 words, drawn with a fixed seed);
  OUT_DIR/tokenizer/       a byte-level BPE tokenizer trained with the
                           `tokenizers` package on the fortunes
                           (tokenizer.json), with a tokenizer_config.json
                           naming its end-of-text token and a chat template.

Deterministic: the same packages give the same files. Needs `tokenizers`.
"""
from __future__ import annotations

import json
import pathlib
import random
import sys

FORTUNES = pathlib.Path("/usr/share/games/fortunes")
WORDNET = pathlib.Path("/usr/share/wordnet")
EOT = "<|endoftext|>"
VOCAB = 2048
QUESTIONS = 20000
# A small ChatML-style template of our own (the walk-through's fine-tune uses
# the Alpaca prompt; the template lets zinc.prepare --format chat run too).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + EOT + "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def fortunes() -> list[str]:
    """Every cookie of every fortune file (the '%'-separated text files)."""
    if not FORTUNES.is_dir():
        sys.exit(f"demo_data: {FORTUNES} is missing: install Debian's fortunes package (scripts/setup.sh does)")
    out = []
    for f in sorted(FORTUNES.iterdir()):
        if f.suffix or not f.is_file():  # .dat indexes, .u8 links
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        for cookie in text.split("\n%\n"):
            cookie = cookie.strip("%\n ")
            if cookie:
                out.append(cookie)
    return out


def wordnet() -> list[dict]:
    """One question per (part of speech, word): its first sense's definition."""
    if not WORDNET.is_dir():
        sys.exit(f"demo_data: {WORDNET} is missing: install Debian's wordnet-base package (scripts/setup.sh does)")
    pos_names = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
    seen, out = set(), []
    for pos, name in pos_names.items():
        for line in (WORDNET / f"data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:  # the licence header
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            word = parts[4].replace("_", " ")
            if "(" in word:  # adjective markers such as "(a)"
                word = word[: word.index("(")]
            definition = gloss.split(";")[0].strip()
            if not definition or (pos, word) in seen:
                continue
            seen.add((pos, word))
            out.append({"instruction": f'What does the {name} "{word}" mean?', "input": "", "output": definition})
    random.Random(0).shuffle(out)
    return out[:QUESTIONS]


def train_tokenizer(texts: list[str], out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1) + "\n")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    texts = fortunes()
    with open(out / "fortunes.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    qa = wordnet()
    with open(out / "wordnet.jsonl", "w", encoding="utf-8") as f:
        for r in qa:
            f.write(json.dumps(r) + "\n")
    train_tokenizer(texts, out / "tokenizer")
    print(f"demo_data: {len(texts)} fortunes, {len(qa)} WordNet questions, a {VOCAB}-token BPE in {out}/tokenizer")


if __name__ == "__main__":
    main()
