#!/usr/bin/env python3
"""The GEMM bound of issue 28: oneDNN (zinc's matmuls), Intel MKL and
PyTorch's GEMM at the fp32 (or, with --bf16, bf16) matmul shapes of one zinc
training step, in alternating rounds of one run.

zinc-bench gemm times oneDNN and MKL's cblas_sgemm (loaded with dlopen from
the peers venv's `mkl` package) shape by shape in one process; this script
times torch.matmul on the same shapes (`zinc-bench gemm --shapes`) in its own
process between those runs, and prints each library's GFLOP/s over one step's
matmuls and zinc's ratio to the best.

  bash bench/peers/setup.sh
  bench/peers/.venv/bin/python bench/peers/gemm_peer.py [--model gpt|llama] [--wide] [--threads 2] [--rounds 3] [--bf16]

--bf16: zinc and MKL multiply bf16 operands into fp32 C (zinc's bf16 step;
MKL's cblas_gemm_bf16bf16f32); PyTorch's CPU matmul has no bf16-to-fp32
form, so it writes bf16 C (what autocast runs), which moves slightly fewer
bytes.

Every library runs the same number of threads (OMP_NUM_THREADS and MKL on
GNU OpenMP for zinc-bench; torch.set_num_threads here).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def find_mkl():
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    hits = sorted(glob.glob(os.path.join(venv, "lib", "libmkl_rt.so*")))
    return hits[-1] if hits else ""


def torch_round(shapes, threads, reps, bf16=False):
    """One step's matmuls through torch, shape by shape: seconds per shape (median of reps)."""
    import torch
    torch.set_num_threads(threads)
    dt = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator().manual_seed(1)
    out = []
    for s in shapes:
        b, M, N, K = s["batch"], s["M"], s["N"], s["K"]
        a = (torch.rand((b, K, M) if s["trans_a"] else (b, M, K), generator=g) - 0.5) * 1e-3
        w = (torch.rand((b, N, K) if s["trans_b"] else (b, K, N), generator=g) - 0.5) * 1e-3
        a, w = a.to(dt), w.to(dt)
        c = torch.zeros(b, M, N, dtype=dt)
        A = a.transpose(1, 2) if s["trans_a"] else a
        B = w.transpose(1, 2) if s["trans_b"] else w
        if b == 1:
            A, B, c = A[0], B[0], c[0]

        def once():
            for _ in range(s["count"]):
                if s["accumulate"]:
                    c.addmm_(A, B) if b == 1 else c.baddbmm_(A, B)
                else:
                    torch.matmul(A, B, out=c)
        once()  # warm-up
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zinc-bench", default=os.path.join(ROOT, "build/bench/zinc-bench"))
    ap.add_argument("--model", default="gpt", choices=("gpt", "llama"))
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mkl", default=None, help="libmkl_rt for zinc-bench (default: this venv's)")
    ap.add_argument("--bf16", action="store_true", help="bf16 operands (fp32 sums) instead of fp32")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    mkl = a.mkl if a.mkl is not None else find_mkl()
    sel = ["--model", a.model] + (["--wide"] if a.wide else []) + (["--bf16"] if a.bf16 else [])
    shapes = json.loads(subprocess.check_output([a.zinc_bench, "gemm", "--shapes"] + sel))["shapes"]
    flops = sum(2.0 * s["batch"] * s["M"] * s["N"] * s["K"] * s["count"] for s in shapes)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    import torch
    rows = []
    for r in range(a.rounds):
        z = json.loads(subprocess.check_output(
            [a.zinc_bench, "gemm", "--json", "--rounds", "3", "--mkl", mkl] + sel, env=env).decode().splitlines()[-1])
        t = torch_round(shapes, a.threads, 3, a.bf16)
        torch_gfs = flops / sum(t) / 1e9
        row = {"round": r, "onednn_gflops": round(z["onednn_gflops"], 1),
               "mkl_gflops": round(z["mkl_gflops"], 1) if z["mkl_gflops"] else None,
               "torch_gflops": round(torch_gfs, 1),
               "torch_per_shape_gflops": [round(2.0 * s["batch"] * s["M"] * s["N"] * s["K"] * s["count"] / x / 1e9, 1)
                                          for s, x in zip(shapes, t)],
               "zinc_per_shape": [{k: v for k, v in s.items() if k in ("batch", "M", "N", "K", "trans_a", "trans_b",
                                                                        "accumulate", "count", "onednn_gflops",
                                                                        "mkl_gflops")} for s in z["shapes"]]}
        rows.append(row)
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print("round %d: oneDNN %.1f | MKL %s | PyTorch %s %.1f GFLOP/s" % (
                r, row["onednn_gflops"], row["mkl_gflops"], torch.__version__, torch_gfs), flush=True)
    med = {k: statistics.median(x[k] for x in rows if x[k]) for k in ("onednn_gflops", "mkl_gflops", "torch_gflops")
           if any(x[k] for x in rows)}
    best = max(med.values())
    summary = {"event": "summary", "model": a.model + ("-wide" if a.wide else ""),
               "dtype": "bf16" if a.bf16 else "fp32", "onednn_path": z.get("onednn_path"), "threads": a.threads,
               "step_gflop": round(flops / 1e9, 3), "median_gflops": {k: round(v, 1) for k, v in med.items()},
               "onednn_over_best": round(med["onednn_gflops"] / best, 3), "torch": torch.__version__,
               "mkl_version": z.get("mkl_version"), "cpu": z.get("cpu")}
    print(json.dumps(summary))
    # Per shape (the last round): where each library is faster.
    print("| shape (batch x M x N x K) | ops | count | oneDNN | MKL | PyTorch |")
    print("|---|---|---|---|---|---|")
    for s, tg in zip(z["shapes"], rows[-1]["torch_per_shape_gflops"]):
        op = ("A^T" if s["trans_a"] else "A") + " " + ("B^T" if s["trans_b"] else "B") + (" +=" if s["accumulate"] else "")
        print("| %d x %d x %d x %d | %s | %d | %.1f | %s | %.1f |" % (
            s["batch"], s["M"], s["N"], s["K"], op, s["count"], s["onednn_gflops"],
            "%.1f" % s["mkl_gflops"] if s["mkl_gflops"] else "-", tg))


if __name__ == "__main__":
    main()
