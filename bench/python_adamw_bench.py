#!/usr/bin/env python3
"""zinc.optim.AdamW called from Python, against the bound the machine sets.

One AdamW step (weight decay on, bias correction on) over 2^27 = 134M float32
parameters, measured in rounds; in every round, right before each case, the
Adam-pattern streaming probe (optim/adam_probe.h, the one zinc-bench adamw
runs; here through zinc._zinc._bench) runs on its own four arrays in this same
process. Bound = median probe GB/s / 28 bytes per parameter (read param, grad,
m, v; write param, m, v). Figures and bound are medians over the rounds.

Cases:
  zinc.optim.AdamW        the engine's kernels on NumPy arrays, in place
  zinc.torch.CPUAdamW     the same kernels as a torch.optim.Optimizer (torch only)
  numpy AdamW             PyTorch's AdamW formula as NumPy array operations,
                          in place with one scratch array (its best case)
  torch.optim.AdamW       foreach=True and fused=True (torch only)

    OMP_NUM_THREADS=2 PYTHONPATH=build/python python3 bench/python_adamw_bench.py [--json]

Memory: 4 arrays for the optimizers and 4 for the probe (4 GiB at 2^27), a
scratch array for NumPy, and torch's own m and v per torch optimizer.
"""
import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time

import numpy as np

import zinc
import zinc.optim
from zinc._zinc import _bench

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28.0  # fp32 grads: 16 read + 12 written


def cpu_model_and_flags():
    model, flags = "unknown CPU", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = [x for x in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                                         "avx512_bf16") if x in have]
                    break
    except OSError:
        pass
    return "%s (%d logical CPUs; %s)" % (model, os.cpu_count() or 0, " ".join(flags))


def numpy_adamw(t, w, g, m, v, tmp, lr=LR, betas=BETAS, eps=EPS, wd=WD):
    """PyTorch's AdamW (decoupled decay, bias correction), vectorised with NumPy, in place."""
    b1, b2 = betas
    w *= 1 - lr * wd
    np.multiply(g, 1 - b1, out=tmp)
    m *= b1
    m += tmp
    np.multiply(g, g, out=tmp)
    tmp *= 1 - b2
    v *= b2
    v += tmp
    step_size = lr / (1 - b1**t)
    np.sqrt(v, out=tmp)
    tmp /= np.sqrt(1 - b2**t)
    tmp += eps
    np.divide(m, tmp, out=tmp)
    tmp *= -step_size
    w += tmp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 27, help="parameters (default 2^27 = 134M)")
    ap.add_argument("--rounds", type=int, default=7, help="measurement rounds; medians are reported")
    ap.add_argument("--json", action="store_true", help="one JSON line per case")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch cases even where torch imports")
    a = ap.parse_args()
    n = a.numel
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()

    rng = np.random.default_rng(1)
    # Filled by NumPy (every page touched before timing). The values keep the
    # update finite over many steps: |w| ~ 1, |g| ~ 0.005.
    w = rng.random(n, dtype=np.float32) * 2 - 1
    g = (rng.random(n, dtype=np.float32) - 0.5) * 0.01
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    probe = [np.ones(n, np.float32) for _ in range(4)]
    tmp = np.zeros(n, np.float32)

    opt = zinc.optim.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    cases = []  # (name, function(step))
    cases.append(("zinc.optim.AdamW", lambda t: opt.step(t, w, g, m, v)))
    torch = None
    if not a.no_torch:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None:
        zinc_torch = importlib.import_module("zinc.torch")

        torch.set_num_threads(threads)
        # The parameter and gradient share memory with w and g: every case
        # streams the same arrays; each torch optimizer owns its own m and v.
        p = torch.nn.Parameter(torch.from_numpy(w))
        p.grad = torch.from_numpy(g)
        ours = zinc_torch.CPUAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        cases.append(("zinc.torch.CPUAdamW", lambda t: ours.step()))
    cases.append(("numpy AdamW", lambda t: numpy_adamw(t, w, g, m, v, tmp)))
    if torch is not None:
        for kind in ("foreach", "fused"):
            try:
                o = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **{kind: True})
                o.step()  # allocates its state; a failure here means this torch lacks the kind on CPU
            except (RuntimeError, TypeError) as e:
                print("torch.optim.AdamW(%s=True) skipped: %s" % (kind, e), file=sys.stderr)
                continue
            cases.append(("torch.optim.AdamW(%s=True)" % kind, lambda t, o=o: o.step()))

    def timed(fn, *args):
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0

    _bench.adam_probe(*probe)  # warm up
    for _, fn in cases:
        fn(1)
    probe_s, case_s = [], [[] for _ in cases]
    with torch.no_grad() if torch is not None else contextlib.nullcontext():
        for r in range(a.rounds):
            for i, (_, fn) in enumerate(cases):
                probe_s.append(timed(_bench.adam_probe, *probe))
                case_s[i].append(timed(fn, 2 + r))

    probe_gbs = _bench.ADAM_PROBE_BYTES * n / statistics.median(probe_s) / 1e9
    bound = probe_gbs / BYTES_PER_PARAM  # G updates/s
    cpu = cpu_model_and_flags()
    if not a.json:
        print("machine: %s\nzinc %s, optimizer path %s, %d threads, %d params, %d rounds%s" %
              (cpu, zinc.__version__, zinc.optim.isa(), threads, n, a.rounds,
               ", torch %s" % torch.__version__ if torch is not None else ", torch not importable"))
    for (name, _), s in zip(cases, case_s):
        figure = n / statistics.median(s) / 1e9
        line = {"bench": "python-adamw", "case": name, "figure": figure, "unit": "G updates/s", "bound": bound,
                "ratio": figure / bound, "bytes_per_param": BYTES_PER_PARAM, "probe_GBps": probe_gbs,
                "step_s": statistics.median(s), "isa": zinc.optim.isa(), "threads": threads, "numel": n,
                "rounds": a.rounds, "torch": torch.__version__ if torch is not None else None, "cpu": cpu}
        if a.json:
            print(json.dumps(line))
        else:
            print("%-30s %.3f G updates/s (%.1f GB/s, %.3f s/step) | bound %.3f G updates/s "
                  "(Adam-pattern probe %.1f GB/s) | ratio %.3f" %
                  (name, figure, figure * BYTES_PER_PARAM, statistics.median(s), bound, probe_gbs, figure / bound))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
