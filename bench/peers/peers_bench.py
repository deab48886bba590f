#!/usr/bin/env python3
"""zinc side by side with DeepSpeed and PyTorch on the same GPT (issue 28).

For each case it runs zinc-train and the case's peers alternately, round by
round, in one run, and prints each figure and zinc's ratio to each peer in the
same round. The model is zinc's GPT at the reference size (6 x 384, 6 heads,
seq 256, micro-batch 8 per rank, vocabulary 256) or configs/default.json's
(2 x 128, 4 heads, seq 64, global batch 64, vocabulary 64); AdamW lr 3e-4,
weight decay 0.1, clipping 1.0, fp32 or bf16 (fp32 master weights).

Peers (bench/peers/setup.sh's venv; --venv):
  eager      bench/torch_gpt_peer.py: PyTorch eager, fused CPU AdamW, 1 rank
  ddp        bench/peers/ddp_gpt_peer.py: PyTorch DDP over gloo
  deepspeed  bench/peers/deepspeed_gpt_peer.py: DeepSpeed on CPU ranks over
             gloo (DS_ACCELERATOR=cpu), at the case's ZeRO stage and offload

  python3 bench/peers/peers_bench.py [--size reference|default] [--rounds 2]
      [--case NAME ...] [--venv DIR] [--json]

`--case list` names the cases. Threads: 2 at one rank, 1 per rank at two (the
2-core machine zinc is measured on); zinc's ranks run under mpirun, the
peers' under torchrun. zinc's tokens/s is its steady rate (the median step
time after 2 warm-up steps, from --json's step events); each peer reports the
median of its rounds after 2 warm-up steps. Peak RSS: zinc's largest rank,
the peers' rank 0.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# name: (ranks, dtype, zero stage, offload, peers)
CASES = {
    "1r-fp32": (1, "fp32", 0, "none", ["eager", "deepspeed"]),
    "1r-bf16": (1, "bf16", 0, "none", ["eager", "deepspeed"]),
    "2r-fp32-s0": (2, "fp32", 0, "none", ["ddp", "deepspeed"]),
    "2r-fp32-s1": (2, "fp32", 1, "none", ["deepspeed"]),
    "2r-fp32-s2": (2, "fp32", 2, "none", ["ddp", "deepspeed"]),
    "2r-fp32-s3": (2, "fp32", 3, "none", ["deepspeed"]),
    "2r-fp32-s2-cpu": (2, "fp32", 2, "cpu", ["deepspeed"]),
    "2r-fp32-s3-cpu": (2, "fp32", 3, "cpu", ["deepspeed"]),
    "2r-fp32-s3-nvme": (2, "fp32", 3, "nvme", ["deepspeed"]),
    "2r-bf16-s2": (2, "bf16", 2, "none", ["ddp", "deepspeed"]),
}


def zinc_config(size, ranks, dtype, stage, offload, steps, nvme_dir):
    if size == "reference":
        model = {"type": "gpt", "n_layer": 6, "n_head": 6, "n_embd": 384}
        data = {"type": "synthetic", "vocab_size": 256, "seq_len": 256}
        batch = {"train_micro_batch_size_per_gpu": 8}
    else:
        model = {"type": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 128}
        data = {"type": "synthetic", "vocab_size": 64, "seq_len": 64}
        batch = {"train_batch_size": 64}
    zero = {"stage": stage}
    if ranks > 1:
        zero["overlap_comm"] = True
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
        if stage == 3:
            zero["offload_param"] = {"device": offload}
        if offload == "nvme":
            for k in ("offload_optimizer", "offload_param"):
                if k in zero:
                    zero[k]["nvme_path"] = nvme_dir
    return dict(batch, gradient_clipping=1.0, steps_per_print=1, bf16={"enabled": dtype == "bf16"},
                optimizer={"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
                zero_optimization=zero, model=model, data=data,
                run={"steps": steps, "eval_interval": 0})


def run_zinc(a, ranks, dtype, stage, offload, tmp):
    cfg = os.path.join(tmp, "zinc.json")
    nvme = os.path.join(tmp, "zinc_nvme")
    os.makedirs(nvme, exist_ok=True)
    with open(cfg, "w") as f:
        json.dump(zinc_config(a.size, ranks, dtype, stage, offload, a.steps, nvme), f)
    train = os.path.join(ROOT, "build/tools/zinc-train")
    cmd = [train, cfg, "--json", "--set", "run.output_dir=" + os.path.join(tmp, "zinc_out")]
    env = dict(os.environ, OMP_NUM_THREADS=str(2 // ranks if ranks <= 2 else 1))
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "-np", str(ranks), "-x", "OMP_NUM_THREADS"] + (
            ["--allow-run-as-root"] if os.geteuid() == 0 else []) + cmd
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["rc %d" % out.returncode])[-1]}
    ev = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    steps = [e for e in ev if e.get("event") == "step"]
    summary = [e for e in ev if e.get("event") == "summary"][-1]
    el = [s["elapsed_s"] for s in steps]
    step_s = statistics.median(el[i] - el[i - 1] for i in range(3, len(el)))
    tokens = summary["tokens_per_s"] * summary["elapsed_s"] / len(el)
    return {"tokens_per_s": tokens / step_s, "step_s": step_s,
            "peak_rss_mib": max(summary["peak_rss_bytes_per_rank"]) / 2 ** 20}


def run_peer(a, peer, ranks, dtype, stage, offload, tmp):
    py = os.path.join(a.venv, "bin", "python")
    args = ["--json", "--size", a.size] + (["--fp32"] if dtype == "fp32" else [])
    if peer == "eager":
        script, args = os.path.join(ROOT, "bench/torch_gpt_peer.py"), args + ["--device", "cpu", "--gas", "1"]
    elif peer == "ddp":
        script = os.path.join(HERE, "ddp_gpt_peer.py")
    else:
        script = os.path.join(HERE, "deepspeed_gpt_peer.py")
        args += ["--stage", str(stage), "--offload", offload, "--nvme-path", os.path.join(tmp, "ds_nvme")]
    # Each peer times --peer-rounds rounds of --peer-steps steps after 2
    # warm-up steps (bf16 on a CPU without bf16 arithmetic runs PyTorch's
    # matmuls 10-30x slower than fp32: fewer steps keep such a case in minutes).
    args += ["--rounds", str(a.peer_rounds), "--steps", str(a.peer_steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(2 // ranks if ranks <= 2 else 1), DS_ACCELERATOR="cpu")
    if ranks > 1:
        cmd = [os.path.join(a.venv, "bin", "torchrun"), "--nproc_per_node", str(ranks), "--master_port", "29561",
               script] + args
    else:
        cmd = [py, script] + args
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        err = [l for l in out.stderr.strip().splitlines()
               if ("Error:" in l or "Exception:" in l) and "ChildFailedError" not in l]
        return {"error": (err or out.stderr.strip().splitlines() or ["rc %d" % out.returncode])[-1][:300]}
    r = json.loads(lines[-1])
    return {"tokens_per_s": r["tokens_per_s"], "step_s": r["step_s"], "peak_rss_mib": r.get("peak_rss_mib"),
            "version": r.get("deepspeed") or r.get("torch"), "optimizer": r.get("optimizer")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("reference", "default"), default="reference")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=11, help="zinc-train steps per run (2 warm-up steps left out)")
    ap.add_argument("--peer-rounds", type=int, default=3, help="rounds each peer times (their median is its figure)")
    ap.add_argument("--peer-steps", type=int, default=3, help="steps per peer round")
    ap.add_argument("--case", action="append", default=[])
    ap.add_argument("--venv", default=os.environ.get("ZINC_PEERS_VENV", os.path.join(HERE, ".venv")))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.case == ["list"]:
        for k, v in CASES.items():
            print(k, "ranks %d, %s, stage %d, offload %s, peers %s" % (v[0], v[1], v[2], v[3], ", ".join(v[4])))
        return
    names = a.case or list(CASES)
    for n in names:
        if n not in CASES:
            sys.exit("peers_bench: unknown case %r (--case list names them)" % n)
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo; grep -m1 flags /proc/cpuinfo"],
                         stdout=subprocess.PIPE, text=True).stdout
    flags = [f for f in cpu.split() if f.startswith(("avx", "fma", "amx"))]
    print(json.dumps({"event": "setup", "size": a.size, "cpu": cpu.splitlines()[0].split(":")[-1].strip(),
                      "flags": flags, "rounds": a.rounds}), flush=True)
    table = []
    with tempfile.TemporaryDirectory(prefix="zinc_peers_") as tmp:
        for name in names:
            ranks, dtype, stage, offload, peers = CASES[name]
            for rnd in range(a.rounds):
                z = run_zinc(a, ranks, dtype, stage, offload, tmp)
                row = {"event": "round", "case": name, "round": rnd, "zinc": z}
                for p in peers:
                    r = run_peer(a, p, ranks, dtype, stage, offload, tmp)
                    if "tokens_per_s" in r and "tokens_per_s" in z:
                        r["zinc_over_peer"] = round(z["tokens_per_s"] / r["tokens_per_s"], 3)
                    row[p] = r
                print(json.dumps(row), flush=True)
                table.append(row)
    print()
    print("| case | zinc tokens/s (peak RSS MiB) | peer | peer tokens/s (peak RSS MiB) | zinc / peer |")
    print("|---|---|---|---|---|")
    fmt = lambda r: ("%.0f (%.0f)" % (r["tokens_per_s"], r["peak_rss_mib"] or 0)) if "tokens_per_s" in r else \
        "error: " + r["error"]
    for name in names:
        rows = [r for r in table if r["case"] == name]
        for p in CASES[name][4]:
            print("| %s | %s | %s | %s | %s |" % (
                name, " / ".join(fmt(r["zinc"]) for r in rows), p, " / ".join(fmt(r[p]) for r in rows),
                " / ".join(str(r[p].get("zinc_over_peer", "-")) for r in rows)))


if __name__ == "__main__":
    main()
