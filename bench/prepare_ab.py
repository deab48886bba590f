"""A/B of zinc.prepare's variants on prepare_bench.py's jsonl-text input, in one process.

    PYTHONPATH=build/python python3 bench/prepare_ab.py [--rounds 20] [--mb 4] [--old OLD_PREPARE.py]

Each round runs, in an order shuffled per round: tokenizers' encode_batch on
the documents (the bound, as in prepare_bench.py), zinc.prepare with its
worker thread (PIPELINE = True, the default), zinc.prepare on one thread
(PIPELINE = False) and, with --old, another copy of prepare.py (for example
`git show 65085c2:python/zinc/prepare.py > /tmp/old_prepare.py`). Prints each
variant's median time, the ratio of the medians to the bound's and the
median of the rounds' own ratios.
"""
import argparse
import glob
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prepare_bench  # noqa: E402
from zinc import prepare  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--old", help="a previous prepare.py to time beside this one")
    args = ap.parse_args()
    paths = sorted(glob.glob(prepare_bench.DEFAULT_INPUT))
    if not paths:
        sys.exit(f"prepare_ab: no {prepare_bench.DEFAULT_INPUT}: apt-get install vim-runtime")
    texts, _ = prepare_bench.paragraphs(paths, int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as tmp:
        tok = prepare_bench.make_tokenizer(tmp, texts)
        data = os.path.join(tmp, "text.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        argv = [data, "--tokenizer", tmp, "--seq-len", "1000000", "--out", os.path.join(tmp, "out")]

        def variant(pipeline):
            def run():
                prepare.PIPELINE = pipeline
                assert prepare.main(argv) == 0
            return run
        fns = {"encode_batch (bound)": lambda: tok.encode_batch(texts),
               "prepare, worker thread": variant(True), "prepare, one thread": variant(False)}
        if args.old:
            spec = importlib.util.spec_from_file_location("old_prepare", args.old)
            old = importlib.util.module_from_spec(spec)
            sys.modules["old_prepare"] = old  # dataclasses look their module up
            spec.loader.exec_module(old)
            fns["prepare, --old"] = lambda: old.main(argv)
        times = {k: [] for k in fns}
        for r in range(args.rounds):
            order = list(fns.items())
            random.Random(r).shuffle(order)
            for k, fn in order:
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        prepare.PIPELINE = True
        bound = times["encode_batch (bound)"]
        print(f"{len(texts):,} records, {args.rounds} rounds, {os.cpu_count()} CPUs")
        for k, v in times.items():
            paired = statistics.median(b / t for b, t in zip(bound, v))
            print(f"{k:24s} median {statistics.median(v):.3f} s; ratio of medians "
                  f"{statistics.median(bound) / statistics.median(v):.2f}; median of paired ratios {paired:.2f}")


if __name__ == "__main__":
    main()
