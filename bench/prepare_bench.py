"""zinc.prepare's throughput against the tokenizers package's own batch encode.

    PYTHONPATH=build/python python3 bench/prepare_bench.py [--mb 4] [--rounds 3] [--input FILE ...]

Input: the help files of Debian's vim-runtime (/usr/share/vim/vim90/doc/*.txt,
plain English text; `apt-get install vim-runtime`), or --input files, cut into
blank-line-separated paragraphs, the first --mb MB of them. From them, in a
temporary folder: a byte-level BPE (vocabulary 8192, trained here on the same
text, Llama-style: BOS by the post-processor, an EOS token), text.jsonl (one
paragraph per record) and alpaca.jsonl (instruction: a paragraph, output: the
next one).

Per form, alternating rounds, both in this process:
  bound     Tokenizer.encode_batch on the strings the preparer tokenizes (the
            documents; for alpaca the rendered prompts and the outputs),
            already in memory;
  prepare   zinc.prepare.main on the JSONL file: reading, JSON parsing,
            encoding, masks, writing and fsyncing the four files.
Both rates count the bound's tokens (the preparer adds one EOS per record),
so the ratio is the ratio of the times. Medians and bests (the least
disturbed round on a shared host) over the rounds are printed, with
encode_batch_fast's rate (no offsets) for reference, and the median of the
rounds' own ratios (each round's bound and prepare run back to back, so a
slow spell of a shared host tends to slow both).
"""
import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from zinc import prepare

DEFAULT_INPUT = "/usr/share/vim/vim90/doc/*.txt"


def paragraphs(paths, limit_bytes):
    out, size = [], 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for p in f.read().split("\n\n"):
                p = p.strip("\n")
                if p.strip():
                    out.append(p)
                    size += len(p.encode())
                    if size >= limit_bytes:
                        return out, size
    return out, size


def make_tokenizer(folder, texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", nargs="+", help=f"text files (default: {DEFAULT_INPUT})")
    ap.add_argument("--mb", type=float, default=4.0, help="megabytes of text to use")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    paths = args.input or sorted(glob.glob(DEFAULT_INPUT))
    if not paths:
        sys.exit(f"prepare_bench: no {DEFAULT_INPUT}: apt-get install vim-runtime, or pass --input FILE ...")
    texts, size = paragraphs(paths, int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as tmp:
        tok = make_tokenizer(tmp, texts)
        alpaca = [{"instruction": a, "input": "", "output": b} for a, b in zip(texts[::2], texts[1::2])]
        forms = {
            "jsonl-text": ([{"text": t} for t in texts], [(texts, True)]),
            "alpaca": (alpaca, [([prepare.ALPACA_PROMPT.format(instruction=r["instruction"]) for r in alpaca], True),
                                ([r["output"] for r in alpaca], False)]),
        }
        print(f"input: {len(paths)} files from {os.path.dirname(paths[0])}, {len(texts):,} paragraphs, "
              f"{size / 1e6:.1f} MB; BPE vocabulary {tok.get_vocab_size()}; "
              f"{os.cpu_count()} CPUs, tokenizers' threads: all")
        for name, (records, batches) in forms.items():
            data = os.path.join(tmp, f"{name}.jsonl")
            with open(data, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            tokens = sum(len(e.ids) for strings, special in batches
                         for e in tok.encode_batch_fast(strings, add_special_tokens=special))
            bound, fast, prep = [], [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for strings, special in batches:
                    tok.encode_batch(strings, add_special_tokens=special)
                bound.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for strings, special in batches:
                    tok.encode_batch_fast(strings, add_special_tokens=special)
                fast.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                rc = prepare.main([data, "--tokenizer", tmp, "--seq-len", "1000000", "--out",
                                   os.path.join(tmp, "out")])
                prep.append(time.perf_counter() - t0)
                assert rc == 0
            for label, pick in (("median", statistics.median), ("best", min)):
                b, f_, p = (pick(x) for x in (bound, fast, prep))
                print(f"{name} ({label} of {args.rounds}): {len(records):,} records, {tokens:,} tokens; "
                      f"encode_batch {tokens / b:,.0f} tokens/s, encode_batch_fast {tokens / f_:,.0f} tokens/s, "
                      f"zinc.prepare {tokens / p:,.0f} tokens/s; ratio prepare / encode_batch = {b / p:.2f}")
            paired = statistics.median(b / p for b, p in zip(bound, prep))
            print(f"{name}: median of the {args.rounds} rounds' ratios prepare / encode_batch = {paired:.2f}")


if __name__ == "__main__":
    main()
