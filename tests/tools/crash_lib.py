"""Shared pieces of tests/tools/crash_consistency.py: the trial kinds and
phases, the tiny config, the process-tree helpers (subreaper, sessions,
killing a run's ranks), the zinc-train runner and the file damage the
trials apply. See crash_consistency.py for what the test does."""
import argparse
import ctypes
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STEPS = 6  # the reference run's length; every trial trains (or resumes) to it
KINDS = ("fault", "kill9", "signal", "corrupt")
KIND_WEIGHTS = (0.35, 0.2, 0.15, 0.3)
KIND_TITLES = {
    "fault": "kill in the save protocol (ZINC_CHECKPOINT_FAULT)",
    "kill9": "kill -9 at a random moment",
    "signal": "SIGTERM / SIGINT at a random moment",
    "corrupt": "damaged file of a complete checkpoint",
}
KILL_KINDS = ("fault", "kill9", "signal")
PHASES = ("shards", "index", "metadata", "before_rename", "old_aside", "before_latest", "after_latest", "prune")
ALWAYS_PHASES = ("shards", "index", "metadata", "before_rename", "before_latest", "after_latest")  # every save
FILES = ("metadata.json", "rank00000.json", "rank00000.bin", "latest")
DAMAGES = ("flip", "truncate", "delete", "append")
CRASH_MARKERS = ("Segmentation", "terminate called", "Aborted", "core dumped", "Bus error", "stack smashing",
                 "AddressSanitizer", "double free", "free(): ", "malloc(): ")
OK_BITS = "loaded bit-identical"
OK_REFUSED = "refused naming the file"
FAILED = "failures"
TAG_RE = re.compile(r"^global_step(\d+)$")
WARNING_RE = re.compile(r"^zinc\[\d+\] (warning|info|debug): ")


def tiny_config(ckpt_dir, out_dir):
    """A model and data small enough that a run of STEPS steps takes tens of milliseconds."""
    return {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.01}},
        # warmup_min_ratio > 0: step 1 changes the weights (lr 0 would not).
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 100, "warmup_num_steps": 2, "warmup_type": "linear",
                                 "warmup_min_ratio": 0.1, "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 1},  # at 2 ranks each rank file holds a shard of Adam's states
        "model": {"type": "mlp", "context": 2, "n_embd": 16, "hidden": 64, "n_layer": 2},
        "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16, "determinism": 0.8, "seed": 1234},
        "run": {"steps": STEPS, "seed": 42, "eval_interval": 0, "checkpoint_interval": 1, "keep_last": 0,
                "checkpoint_dir": ckpt_dir, "output_dir": out_dir},
    }


# ---- processes -------------------------------------------------------------------------

def set_subreaper():
    """Ranks orphaned by a killed mpirun become our children, so we can wait for them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def proc_stat(pid):
    """(state, ppid, session, comm) of a process, or None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            s = f.read().decode("latin-1")
    except OSError:
        return None
    comm = s[s.index("(") + 1:s.rindex(")")]
    rest = s[s.rindex(")") + 2:].split()
    return rest[0], int(rest[1]), int(rest[3]), comm


def session_members(sid):
    """Live (not zombie) processes of a session we started (its leader, zinc-train or mpirun, has
    the session's id), reaping the orphaned ranks that became our zombies."""
    alive = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        st = proc_stat(pid)
        if st is None or st[2] != sid:
            continue
        if st[0] == "Z":
            if st[1] == os.getpid() and pid != sid:  # an orphan; the leader is Popen's to wait for
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            continue
        alive.append((pid, st[3]))
    return alive


class Failure(Exception):
    """A trial's setup (or the references) went wrong: the test cannot go on."""


class Result:
    """One process the crash tests ran: its command (and extra environment), exit status, output, wall
    time; whether it hung, what it left behind, its pid; the JSON events of its stdout."""

    def __init__(self, cmd, env_extra, rc, out, err, wall, hung=False, leftovers=(), pid=None):
        self.cmd, self.env_extra, self.rc, self.out, self.err = cmd, env_extra, rc, out, err
        self.wall, self.hung, self.leftovers, self.pid = wall, hung, leftovers, pid
        self.events = []
        for line in out.splitlines():
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass

    def event(self, name):
        found = [e for e in self.events if e.get("event") == name]
        return found[-1] if found else None

    def crashed(self):
        return [m for m in CRASH_MARKERS if m in self.err or m in self.out]

    def shell(self):
        env = " ".join("%s=%s" % kv for kv in sorted(self.env_extra.items()))
        return (env + " " if env else "") + " ".join(shquote(a) for a in self.cmd)


def shquote(s):
    return s if re.match(r"^[\w@%+=:,./-]+$", s) else "'" + s.replace("'", "'\\''") + "'"


class Zinc:
    """Starts zinc-train (at 1 rank, or 2 under mpirun), one process tree at a time."""

    def __init__(self, binary, workdir, mpirun):
        self.binary, self.workdir, self.mpirun = binary, workdir, mpirun
        self.starts = 0
        self.log = []  # the current trial's command lines
        self.out_path = os.path.join(workdir, "last.out")
        self.err_path = os.path.join(workdir, "last.err")

    def command(self, world, args, env_extra=()):
        if world == 1:
            return [self.binary] + list(args)
        forward = [x for name in sorted(env_extra) for x in ("-x", name)]  # to every rank
        return self.mpirun + forward + [self.binary] + list(args)

    def spawn(self, world, args, env_extra=None):
        env_extra = dict(env_extra or {})
        env = dict(os.environ, OMP_NUM_THREADS="1", ZINC_LOG_LEVEL="warn")
        env.pop("ZINC_CHECKPOINT_FAULT", None)
        env.pop("ZINC_INJECT_ERROR", None)
        env.update(env_extra)
        cmd = self.command(world, args, env_extra)
        self.starts += 1
        out = open(self.out_path, "wb")
        err = open(self.err_path, "wb")
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                             start_new_session=True)
        out.close()
        err.close()
        return {"p": p, "t0": t0, "cmd": cmd, "env": env_extra, "world": world}

    def finish(self, h, timeout=120.0):
        p = h["p"]
        hung = False
        try:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - h["t0"])))
        except subprocess.TimeoutExpired:
            hung = True
            kill_session(p.pid, signal.SIGKILL)
            p.wait()
        wall = time.monotonic() - h["t0"]
        # Ranks a killed mpirun left behind, or a rank that outlives the job:
        # wait for them (a dead rank must end the job), then kill what is left.
        leftovers = []
        deadline = time.monotonic() + 30.0
        while True:
            alive = session_members(p.pid)
            if not alive:
                break
            if time.monotonic() > deadline:
                leftovers = alive
                kill_session(p.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        with open(self.out_path, "rb") as f:
            out = f.read().decode("utf-8", "replace")
        with open(self.err_path, "rb") as f:
            err = f.read().decode("utf-8", "replace")
        r = Result(h["cmd"], h["env"], p.returncode, out, err, wall, hung, leftovers)
        self.log.append(r.shell() + "  -> rc %s" % r.rc)
        return r

    def run(self, world, args, env_extra=None, timeout=120.0):
        return self.finish(self.spawn(world, args, env_extra), timeout)


def kill_session(sid, sig, seconds=5.0):
    """Sends `sig` to every live process of session `sid` until none is left (for SIGKILL)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = session_members(sid)
        if not alive:
            return
        for pid, _ in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig != signal.SIGKILL or time.monotonic() > deadline:
            return
        time.sleep(0.002)


def rank_pids(h, want=2, seconds=20.0):
    """The zinc-train processes under an mpirun, once `want` of them run (or mpirun ended)."""
    deadline = time.monotonic() + seconds
    while True:
        ranks = sorted(pid for pid, comm in session_members(h["p"].pid)
                       if comm.startswith("zinc-train") and pid != h["p"].pid)
        if len(ranks) >= want or h["p"].poll() is not None or time.monotonic() > deadline:
            return ranks
        time.sleep(0.002)


# ---- files -----------------------------------------------------------------------------

def tree_hash(path):
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            with open(full, "rb") as f:
                data = f.read()
            h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


def rmtree(path):
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def snapshot(workdir, trial_dir, info):
    """Keeps the trial's folder as the trial left it (WORKDIR/snapshot): run_trials copies it under failed/ if
    the trial fails."""
    snap = os.path.join(workdir, "snapshot")
    rmtree(snap)
    if os.path.isdir(trial_dir):
        shutil.copytree(trial_dir, snap, symlinks=True)
    info["_snapshot"] = snap


def tags_in(folder):
    """{step: name} of the tag folders global_step<k> in a checkpoint folder."""
    tags = {}
    for name in os.listdir(folder):
        m = TAG_RE.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            tags[int(m.group(1))] = name
    return tags


def unexpected_entries(folder):
    """Entries of a checkpoint folder that are none of: tags, latest, latest.tmp, dot-files."""
    bad = []
    for name in os.listdir(folder):
        full = os.path.join(folder, name)
        if name.startswith("."):
            continue
        if TAG_RE.match(name) and os.path.isdir(full):
            continue
        if name in ("latest", "latest.tmp") and os.path.isfile(full):
            continue
        bad.append(name)
    return bad


def damage(path, how, rng):
    """Damages a file; returns a description."""
    data = read_bytes(path)
    if how == "flip" and data:
        at, bit = rng.randrange(len(data)), rng.randrange(8)
        b = bytearray(data)
        b[at] ^= 1 << bit
        with open(path, "wb") as f:
            f.write(b)
        return "bit %d of byte %d (of %d) flipped: 0x%02x -> 0x%02x" % (bit, at, len(data), data[at], b[at])
    if how == "truncate" and data:
        n = rng.randrange(len(data))
        with open(path, "r+b") as f:
            f.truncate(n)
        return "cut to %d of %d bytes" % (n, len(data))
    if how == "delete":
        os.remove(path)
        return "deleted (%d bytes)" % len(data)
    extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if rng.random() < 0.25:
        extra = rng.choice([b"\n", b" ", b"\0", b"x"])
    with open(path, "ab") as f:
        f.write(extra)
    return "%d bytes appended to %d: %r" % (len(extra), len(data), extra[:16])


# ---- the test --------------------------------------------------------------------------


# ---- the command line and work folder every crash test shares ---------------------------------------


def add_common_args(ap, trials=60):
    """--trials, --seed, --only, --workdir, --keep and --report, as every crash test takes them."""
    ap.add_argument("--trials", type=int, default=trials)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", type=int, help="run only this trial (by index) of the seed's sequence")
    ap.add_argument("--workdir", help="work folder (default: a temporary one, removed when every trial holds)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--report", help="write the counts as JSON to this file")


def run_in_workdir(args, prefix, copies, make_test):
    """Makes the work folder (args.workdir, else a temporary one named `prefix`...), copies each file of
    `copies` ({attribute: source path}) into it and sets args.<attribute> to the copy (a rebuild or an edit
    while the test runs would otherwise mix two versions in one test), runs make_test(args).main(), writes
    the report, and removes a temporary folder when every trial held. Returns the exit code."""
    temp = args.workdir is None
    if temp:
        args.workdir = tempfile.mkdtemp(prefix=prefix)
    else:
        args.workdir = os.path.abspath(args.workdir)
        os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(os.path.join(args.workdir, "bin"), exist_ok=True)
    for attr, source in copies.items():
        setattr(args, attr, os.path.join(args.workdir, "bin", os.path.basename(source)))
        shutil.copy2(source, getattr(args, attr))
    rc, report = make_test(args).main()
    if args.report and report is not None:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    if temp and rc == 0 and not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)
    elif temp:
        print("work folder kept: %s" % args.workdir)
    return rc


def run_trials(test, indices, t0, every, progress_line, failed_label="FAILED"):
    """Runs test.trial(i) for each index in order. A trial whose outcome is `failed_label` is printed
    (test.print_failure) and the snapshot it left (info["_snapshot"]) copied to WORKDIR/failed/trial<i>;
    every `every` trials and after the last, progress_line(results) (the counts) is printed after
    "[n/N] seconds:". Returns the results and the failed trials' folder."""
    results = []
    failed_dir = os.path.join(test.workdir, "failed")
    rmtree(failed_dir)
    for n, i in enumerate(indices):
        info = test.trial(i)
        results.append(info)
        if info["outcome"] == failed_label:
            test.print_failure(info)
            os.makedirs(failed_dir, exist_ok=True)
            dst = os.path.join(failed_dir, "trial%d" % i)
            rmtree(dst)
            if os.path.isdir(info.get("_snapshot", "")):
                shutil.copytree(info["_snapshot"], dst, symlinks=True)
        if (n + 1) % every == 0 or n + 1 == len(indices):
            print("[%d/%d] %.0f s: %s" % (n + 1, len(indices), time.monotonic() - t0, progress_line(results)),
                  flush=True)
    return results, failed_dir


def outcome_counts(results, outcomes):
    """ "n outcome, ..." of the results so far, in `outcomes` order."""
    c = {}
    for r in results:
        c[r["outcome"]] = c.get(r["outcome"], 0) + 1
    return ", ".join("%d %s" % (c.get(o, 0), o) for o in outcomes)


def exit_code(report, results, failed_dir, failed_label="FAILED"):
    """1 (and a line saying where the failed trials' folders are) when a trial failed, else 0."""
    nfail = report["totals"][failed_label]
    if nfail:
        print("%d of %d trials FAILED; the folders they left are under %s" % (nfail, len(results), failed_dir))
    return 1 if nfail else 0
