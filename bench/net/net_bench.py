#!/usr/bin/env python3
"""bench/net/net_bench.py: zinc-train's step time over a throttled network
on one machine (issue 34, part). Python 3 stdlib only.

Every case runs `zinc-train CONFIG --json --steps N [EXTRA...]` either
 - compute-only: one rank pinned to core 0 (mpirun binds each rank to a
   core too), no MPI launcher, no network, or
 - through bench/net/throttled_net.sh at --ranks R and --rate RATE (each rank
   in its own network namespace, Open MPI over TCP on the veths, comm backend
   "mpi"), once with --steps N and once with --steps 0 so that the bytes the
   start-up costs (modex, the initial weight broadcast) drop out of the bytes
   per step.

Per case it prints one JSON line and, at the end, a Markdown table:
the steady step time (the median of the step-to-step differences of rank 0's
elapsed_s, the first WARMUP steps left out), tokens/s over the same steps,
comm_wait_share from the summary, the veth bytes each rank sent per step
against the all-reduce volume 2 (p-1)/p x 4 B x elements, and the CPU time
that processes other than this run used during it (/proc/stat busy minus this
run's own children's rusage), because the machine is not guaranteed quiet.

  sudo python3 bench/net/net_bench.py --config bench/net/gpt_net.json \\
      --case compute --case 2:0:1gbit --case 2:0:none --case 2:2:1gbit ...
      [--steps 10] [--repeat 2] [--threads 1] [-- EXTRA zinc-train args]

With `-- --set wall_clock_breakdown=true` each case also gives the medians of
rank 0's forward, backward and optimizer-step seconds per step.

A case is `compute`, `computeN` (N compute-only runs at once, N = 2..9:
one per core up to the core count, unpinned beyond it; the bound for N
ranks that share this machine) or RANKS:STAGE:RATE; the stage goes in with
--set zero_optimization.stage=STAGE (any other config works the same:
OneBitAdam later is just another --config or --set).
"""
import argparse
import json
import os
import re
import shlex
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NET = os.path.join(HERE, "throttled_net.sh")


def cpu_busy_s():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + v[4]
    return (sum(v[:8]) - idle) / hz


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd, env):
    b0, c0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    own = children_cpu_s() - c0
    busy = cpu_busy_s() - b0
    return p.returncode, p.stdout, wall, max(0.0, busy - own)


def wait_quiet(limit_s, idle_cores=0.15, need=3):
    """Wait until the host's busy CPU stays under idle_cores for `need`
    consecutive seconds (other people build on this machine); give up after
    limit_s. Returns the seconds waited."""
    t0, ok = time.perf_counter(), 0
    while time.perf_counter() - t0 < limit_s and ok < need:
        b = cpu_busy_s(); time.sleep(1.0)
        ok = ok + 1 if cpu_busy_s() - b < idle_cores else 0
    return time.perf_counter() - t0


def parse(out):
    steps, summary, net = [], None, {}
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if j.get("event") == "step":
                steps.append(j)
            elif j.get("event") == "summary":
                summary = j
        m = re.match(r"throttled_net: (?:rank|node) (\d+) veth tx_bytes (\d+) rx_bytes (\d+)", line)
        if m:
            net[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return steps, summary, net


def elements(config, extra):
    out = subprocess.run([os.path.join(ROOT, "build/tools/zinc-train"), config, "--estimate"] + extra,
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    m = re.search(r"gradients \(\w+, full\)\s+[\d.]+ \w+\s+(\d+) B x ([\d.]+)M elements", out)
    if not m:
        return None, None
    return float(m.group(2)) * 1e6, int(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(HERE, "gpt_net.json"))
    ap.add_argument("--case", action="append", default=[])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all cases (alternating)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--per-node", type=int, default=1,
                    help="ranks per network namespace (a node: shared memory inside, the capped link between)")
    ap.add_argument("--mca", action="append", default=[], metavar="NAME=VALUE",
                    help="an Open MPI MCA parameter for mpirun (repeatable)")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="rerun a case (up to --tries) when other processes used more than this many cores on average during it")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--quiet-wait", type=float, default=300, help="seconds to wait for a quiet host before each try")
    ap.add_argument("--no-bytes", action="store_true", help="skip the --steps 0 runs")
    ap.add_argument("extra", nargs="*", help="after --: extra zinc-train arguments")
    a = ap.parse_args()
    cases = a.case or ["compute", "2:0:1gbit", "2:0:none", "2:2:1gbit", "2:2:none"]
    train = os.path.join(ROOT, "build/tools/zinc-train")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    n_el, gbytes = elements(a.config, a.extra)
    print(json.dumps({"event": "setup", "config": a.config, "extra": a.extra, "elements": n_el,
                      "grad_bytes_per_element": gbytes, "steps": a.steps, "threads": a.threads, "mca": a.mca,
                      "loadavg": open("/proc/loadavg").read().split()[:3]}), flush=True)
    base_bytes = {}
    rows = []
    for rnd in range(a.repeat):
        for case in cases:
            zargs = [a.config, "--json"] + a.extra
            if case == "compute":
                # Pinned to one core, as mpirun binds each rank to one.
                ranks, stage, rate = 1, None, "-"
                cmd = ["taskset", "-c", "0", train] + zargs + ["--steps", str(a.steps)]
                net_cmd = None
            elif re.fullmatch(r"compute[2-9]", case):
                # N compute-only runs at once, nothing exchanged: what N ranks
                # sharing this machine's cores and memory can do at best (the
                # first run is the one timed). Up to one per core each run is
                # pinned to its own core, as mpirun binds ranks; beyond that
                # none is pinned, as mpirun --oversubscribe binds none.
                n = int(case[len("compute"):])
                ranks, stage, rate = 1, None, "-"
                one = " ".join(shlex.quote(x) for x in [train] + zargs + ["--steps", str(a.steps)])
                ncpu = os.cpu_count() or 1
                pin = (lambda i: "taskset -c %d " % i) if n <= ncpu else (lambda i: "")
                others = "".join("%s%s --set run.output_dir=%s >/dev/null 2>&1 & " % (
                    pin(i), one, shlex.quote("/tmp/zinc-net-compute%d-%d-%d" % (n, os.getpid(), i)))
                    for i in range(1, n))
                cmd = ["bash", "-c", "%s%s%s; wait" % (others, pin(0), one)]
                net_cmd = None
            else:
                r, stage, rate = case.split(":")
                ranks = int(r)
                zargs += ["--set", "zero_optimization.stage=%s" % stage]
                net_cmd = [NET, "--ranks", str(ranks), "--per-node", str(a.per_node), "--rate", rate,
                           "--env", "OMP_NUM_THREADS=%d" % a.threads]
                for kv in a.mca:
                    k, v = kv.split("=", 1)
                    net_cmd += ["--mpirun-arg", "--mca", "--mpirun-arg", k, "--mpirun-arg", v]
                net_cmd += ["--", train] + zargs
                cmd = net_cmd + ["--steps", str(a.steps)]
            for attempt in range(a.tries):
                waited = wait_quiet(a.quiet_wait)
                load = open("/proc/loadavg").read().split()[0]
                rc, out, wall, foreign = run(cmd, env)
                if foreign / wall <= a.max_foreign or rc != 0:
                    break
                print(json.dumps({"event": "noisy", "case": case, "foreign_cpu_s": round(foreign, 2),
                                  "wall_s": round(wall, 2), "attempt": attempt}), flush=True)
            steps, summary, net = parse(out)
            if rc != 0 or summary is None:
                sys.stdout.write(out[-4000:])
                print(json.dumps({"event": "failed", "case": case, "rc": rc}), flush=True)
                continue
            el = [s["elapsed_s"] for s in steps]
            diffs = [el[i] - el[i - 1] for i in range(max(1, a.warmup), len(el))]
            step_s = statistics.median(diffs)
            tokens = summary["tokens_per_s"] * summary["elapsed_s"] / max(1, len(el))  # tokens per step
            row = {"event": "case", "round": rnd, "case": case, "ranks": ranks, "stage": stage, "rate": rate,
                   "step_s_median": round(step_s, 4), "step_s_min": round(min(diffs), 4),
                   "step_s_max": round(max(diffs), 4),
                   "tokens_per_s_steady": round(tokens / step_s, 1),
                   "tokens_per_s_summary": round(summary["tokens_per_s"], 1),
                   "comm_wait_share": summary.get("comm_wait_share"),
                   "wall_s": round(wall, 2), "foreign_cpu_s": round(foreign, 2), "loadavg_before": load,
                   "quiet_wait_s": round(waited, 1), "attempts": attempt + 1}
            # With --set wall_clock_breakdown=true the step events carry rank 0's
            # cumulative forward / backward / optimizer-step seconds: their
            # per-step medians split the step into compute and the update.
            for key in ("forward_s", "backward_s", "optimizer_step_s"):
                if steps and key in steps[0]:
                    v = [s[key] for s in steps]
                    row[key + "_median"] = round(statistics.median(
                        v[i] - v[i - 1] for i in range(max(1, a.warmup), len(v))), 4)
            if net_cmd is not None:
                if not a.no_bytes and (ranks, stage, rate) not in base_bytes:
                    rc0, out0, _, _ = run(net_cmd + ["--steps", "0"], env)
                    base_bytes[(ranks, stage, rate)] = parse(out0)[2] if rc0 == 0 else None
                base = base_bytes.get((ranks, stage, rate))
                tx = [net[r][0] for r in sorted(net)]
                row["tx_bytes_per_rank"] = tx
                if base:
                    per = [(net[r][0] - base[r][0]) / a.steps for r in sorted(net)]
                    row["tx_bytes_per_step_per_rank"] = [int(x) for x in per]
                    row["startup_tx_bytes_per_rank"] = [base[r][0] for r in sorted(base)]
                if n_el:
                    theo = 2 * (ranks - 1) / ranks * gbytes * n_el
                    row["allreduce_bytes_per_rank_theory"] = int(theo)
                    if base:
                        row["wire_over_theory"] = round(statistics.mean(per) / theo, 4)
            rows.append(row)
            print(json.dumps(row), flush=True)

    # Markdown summary: medians over rounds
    print()
    print("| case | ranks | stage | rate | step s (median, min-max over rounds) | tokens/s | comm_wait_share | tx B/step/rank | all-reduce theory | wire/theory | foreign CPU s / wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        rs = [r for r in rows if r["case"] == case]
        if not rs:
            continue
        med = statistics.median(r["step_s_median"] for r in rs)
        lo = min(r["step_s_median"] for r in rs)
        hi = max(r["step_s_median"] for r in rs)
        tok = statistics.median(r["tokens_per_s_steady"] for r in rs)
        cw = statistics.median((r["comm_wait_share"] or 0) for r in rs)
        per = rs[0].get("tx_bytes_per_step_per_rank")
        per_s = "%.1f MB" % (statistics.mean(per) / 1e6) if per else "-"
        theo = rs[0].get("allreduce_bytes_per_rank_theory")
        theo_s = "%.1f MB" % (theo / 1e6) if theo else "-"
        wot = rs[0].get("wire_over_theory", "-")
        fc = " / ".join("%.1f/%.0f" % (r["foreign_cpu_s"], r["wall_s"]) for r in rs)
        print("| %s | %d | %s | %s | %.3f (%.3f-%.3f) | %.0f | %.2f | %s | %s | %s | %s |" % (
            case, rs[0]["ranks"], rs[0]["stage"] if rs[0]["stage"] is not None else "-", rs[0]["rate"],
            med, lo, hi, tok, cw, per_s, theo_s, wot, fc))


if __name__ == "__main__":
    main()
