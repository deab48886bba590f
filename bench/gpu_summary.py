"""The GPU bundle's results against issue 53's aims, as one table.

Reads what gpu-bundle/run.sh wrote into RESULTS_DIR (gpu-train-step.jsonl,
torch-peer.jsonl, deepspeed-peer.jsonl) and prints, for the 355M GPT
("large") and the ~1B Llama ("llama-1.1b"):

  - zinc with the states on the GPU against PyTorch's fused AdamW, and
    against cuBLAS's bound at the model's shapes;
  - ZeRO-Offload (stage 2) against PyTorch's CPU-AdamW loop, and its step
    against zinc's own resident step;
  - stage 3 with the parameters in page-locked RAM against stage 2, with
    the prefetched share and the step's floor from the uploads alone;
  - DeepSpeed's ZeRO-Offload where its peer ran;
  - the variants run.sh times (half the states on the GPU, the update in
    place, more CPU threads, the bias in a separate pass).

A plain case is the first line of its kind that no ZINC_* switch changed;
a line that is not JSON, or lacks a field, is skipped with a note. What
was not measured says so. Exit status 0 whatever the figures.

    python3 bench/gpu_summary.py RESULTS_DIR
"""
import json
import os
import sys

AIMS = {
    "resident_vs_torch": 1.0,    # >= PyTorch eager (SDPA, fused AdamW)
    "resident_vs_bound": 0.5,    # >= half of cuBLAS's rate at the model's shapes
    "offload_vs_torch": 1.5,     # >= 1.5x PyTorch's CPU-AdamW loop
    "offload_step_vs_resident": 1.25,  # offload step <= 1.25x the resident step
    "stage3_vs_offload": 0.7,    # stage 3 rate >= 0.7 of stage-2 offload's
}


def read_lines(path, notes):
    """The JSON objects of a .jsonl file, in order; other lines are noted."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, 1):
            text = text.strip()
            if not text.startswith("{"):
                continue  # a header or progress line that tee kept
            try:
                obj = json.loads(text)
            except ValueError:
                notes.append("%s:%d: not JSON, skipped" % (os.path.basename(path), n))
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def num(v):
    """v as a float, or None where it is none (a field of the wrong type)."""
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def first(lines, **want):
    for line in lines:
        if all(line.get(k) == v for k, v in want.items()):
            return line
    return None


def zinc_case(lines, case, states, stage, ratio=1.0, plain=True):
    for line in lines:
        if line.get("bench") != "gpu-train-step" or line.get("case") != case:
            continue
        if line.get("optimizer_states") != states or line.get("zero_stage") != stage:
            continue
        r = num(line.get("offload_ratio", 1.0))
        if states == "cpu" and (r is None or abs(r - ratio) > 1e-9):
            continue
        if plain and (line.get("env") or line.get("lora")):
            continue
        return line
    return None


def verdict(value, aim, at_most=False):
    if value is None:
        return "not measured"
    ok = value <= aim if at_most else value >= aim
    return "met" if ok else "not met"


def fmt(v, spec="%.2f"):
    return "-" if v is None else spec % v


def ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def summarise(results_dir):
    notes = []
    zinc = read_lines(os.path.join(results_dir, "gpu-train-step.jsonl"), notes)
    torch = read_lines(os.path.join(results_dir, "torch-peer.jsonl"), notes)
    ds = read_lines(os.path.join(results_dir, "deepspeed-peer.jsonl"), notes)
    rows = []

    def tps(line):
        if line is None:
            return None
        v = num(line.get("tokens_per_s"))
        if v is None:
            notes.append("a %s line without tokens_per_s, skipped" % line.get("bench", "?"))
        return v

    for case, name in (("large", "355M GPT"), ("llama-1.1b", "~1B Llama")):
        res = zinc_case(zinc, case, "gpu", 2)
        off = zinc_case(zinc, case, "cpu", 2)
        s3 = zinc_case(zinc, case, "cpu", 3)
        t_res = first(torch, bench="torch-gpt-peer", case=case, offload=False)
        t_off = first(torch, bench="torch-gpt-peer", case=case, offload=True)
        d_off = first(ds, bench="deepspeed-gpu-peer", case=case, stage=2, offload="cpu")
        d_s3 = first(ds, bench="deepspeed-gpu-peer", case=case, stage=3, offload="cpu")
        r = ratio(tps(res), tps(t_res))
        rows.append((name, "states on the GPU / PyTorch (SDPA, fused AdamW)", fmt(r), ">= %.2f" % AIMS["resident_vs_torch"],
                     verdict(r, AIMS["resident_vs_torch"])))
        b = num(res.get("ratio")) if res else None
        rows.append((name, "states on the GPU / cuBLAS bound", fmt(b), ">= %.2f" % AIMS["resident_vs_bound"],
                     verdict(b, AIMS["resident_vs_bound"])))
        r = ratio(tps(off), tps(t_off))
        rows.append((name, "ZeRO-Offload / PyTorch's CPU-AdamW loop", fmt(r), ">= %.2f" % AIMS["offload_vs_torch"],
                     verdict(r, AIMS["offload_vs_torch"])))
        r = ratio(tps(res), tps(off))  # the offload step over the resident step
        rows.append((name, "ZeRO-Offload step / resident step", fmt(r), "<= %.2f" % AIMS["offload_step_vs_resident"],
                     verdict(r, AIMS["offload_step_vs_resident"], at_most=True)))
        half = zinc_case(zinc, case, "cpu", 2, ratio=0.5)
        r = ratio(tps(res), tps(half))
        rows.append((name, "  offload ratio 0.5: step / resident step", fmt(r),
                     "<= %.2f" % AIMS["offload_step_vs_resident"], verdict(r, AIMS["offload_step_vs_resident"], at_most=True)))
        r = ratio(tps(s3), tps(off))
        extra = ""
        if s3 is not None:
            pre, floor, step = (num(s3.get(k)) for k in ("prefetched_share", "upload_floor_s", "step_s"))
            extra = " (%s prefetched%s)" % (fmt(pre * 100 if pre is not None else None, "%.0f%%"),
                                           ", uploads alone %s of the step" % fmt(floor / step if floor and step else None)
                                           if floor is not None else "")
        rows.append((name, "stage 3 / stage-2 offload" + extra, fmt(r), ">= %.2f" % AIMS["stage3_vs_offload"],
                     verdict(r, AIMS["stage3_vs_offload"])))
        for label, line, peer in (("ZeRO-Offload / DeepSpeed's (stage 2, CPU Adam)", off, d_off),
                                  ("stage 3 / DeepSpeed's stage 3 (CPU Adam)", s3, d_s3)):
            r = ratio(tps(line), tps(peer))
            rows.append((name, label, fmt(r), "-", "not measured" if r is None else "measured"))
        # The variants: each against its plain case.
        for line in zinc:
            if line.get("bench") != "gpu-train-step" or line.get("case") != case or not line.get("env"):
                continue
            if not isinstance(line["env"], dict):
                notes.append("a gpu-train-step line whose env is not an object, skipped")
                continue
            states = line.get("optimizer_states")
            base = res if states == "gpu" else off
            what = ", ".join("%s=%s" % kv for kv in sorted(line["env"].items()))
            rows.append((name, "  %s (%s) / plain" % ("resident" if states == "gpu" else "offload", what),
                         fmt(ratio(tps(line), tps(base))), "-", "measured"))
        for line in zinc:  # --lora: the LoRA step against the full step of the same rounds
            lora = line.get("lora") if line.get("bench") == "gpu-train-step" and line.get("case") == case else None
            if lora is None:
                continue
            if not isinstance(lora, dict):
                notes.append("a gpu-train-step line whose lora is not an object, skipped")
                continue
            rows.append((name, "  LoRA step / full step (%s, same rounds)" %
                         ("resident" if line.get("optimizer_states") == "gpu" else "offload"),
                         fmt(num(lora.get("vs_full_step"))), "-", "measured"))
        for line in zinc:
            if (line.get("bench") == "gpu-train-step" and line.get("case") == case and not line.get("env") and off
                    and line is not off and line.get("optimizer_states") == "cpu" and line.get("zero_stage") == 2
                    and line.get("offload_ratio") == off.get("offload_ratio")
                    and line.get("omp_threads") != off.get("omp_threads")):
                rows.append((name, "  offload, %s CPU threads / %s" % (line.get("omp_threads"), off.get("omp_threads")),
                             fmt(ratio(tps(line), tps(off))), "-", "measured"))
    return rows, notes


def main(argv):
    if len(argv) != 2:
        print("usage: gpu_summary.py RESULTS_DIR", file=sys.stderr)
        return 2
    if not os.path.isdir(argv[1]):
        print("gpu_summary.py: %s is not a folder" % argv[1], file=sys.stderr)
        return 2
    rows, notes = summarise(argv[1])
    print("| model | figure | value | aim | |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| %s |" % " | ".join(row))
    for n in notes:
        print("note: " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
