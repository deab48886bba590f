#!/usr/bin/env python3
"""Crash-consistency test of zinc-train's checkpoints (issue 27, "Acceptance").

In the spirit of leveldb's fault-injection tests: a tiny training job with a
checkpoint every step is killed at random points, inside every step of the
save protocol through the injection hook (ZINC_CHECKPOINT_FAULT=PHASE:N,
engine/checkpoint.h), by kill -9 at a random moment, or stopped by
SIGTERM/SIGINT; or a random file of a complete checkpoint is damaged (a bit
flipped, cut, deleted, bytes appended). After each trial:

  kill trials (fault, kill9, signal):
    - every tag folder left (global_step<k>) loads, with weights bit-identical
      to the uninterrupted reference run at step k;
    - `latest`, if present, names such a tag (never a missing or damaged one);
    - resuming from the folder (a fresh run if there is no `latest`) and
      training to the last step gives the reference's final weights;
    - a run stopped by a signal "after step k" left `latest` at global_step<k>.
  corruption trials:
    - the damaged tag either still loads bit-identical (a flipped bit in
      padding, a newline appended to metadata.json), or the load fails with
      exactly one line "zinc-train: error: ..." (exit 1, no crash) naming the
      damaged file; then the previous checkpoint still loads bit-identical
      (`latest` pointed at it by writing the file), and so do the others.

How weights are compared: `zinc-train CONFIG --resume DIR --steps 0 --json
--weights-digest` loads the tag DIR/latest names (at step k >= 1) and, as
--steps 0 asks, trains nothing: the summary line has
"steps": k, "final_loss": null and the weights_digest of the loaded fp32
master weights (FNV-1a over every block, padding included, so a digest is
compared only with one taken at the same world size: every load here runs
at one rank). A tag is loaded from a copy of its folder with `latest`
written to name it. The reference digest at step k is the load of the
reference run's tag k (one uninterrupted run of STEPS steps, a checkpoint
every step, keep_last 0), checked at 1 rank against a run of k steps
without checkpoints, at 2 ranks by loading the last tag at 2 ranks. Loads
are cached by the content (SHA-256) of the tag's files: a tag
byte-identical to one that loaded bit-identical is not loaded again
(--no-cache loads every one); `latest`, the damaged tag and the previous
checkpoint of a corruption trial are always loaded for real.

Kill trials start from an empty folder, a folder holding a complete earlier
run (its tags are saved again, or pruned), or a shorter run's folder that
the trial resumes; keep_last is 0, 1 or 2. With --np2-share F, that share of
the kill trials runs under `mpirun --oversubscribe -np 2` (every rank, or
one, killed; signals to mpirun or to every rank). Random moments are a time
after the start or a time after the n-th line of output (the machine may be
busy). The binary is copied into the work folder first, so that a rebuild
during the test does not mix two versions.

Usage:
  crash_consistency.py ZINC_TRAIN --trials N [--seed S] [--np2-share F]
      [--workdir DIR] [--report FILE.json] [--only I] [--no-cache] [--keep]
A failure prints the trial's seed, kind, parameters, the zinc-train command
lines and what happened, and `--seed S --only I` reruns that one trial. Exit
code 0 when every trial holds, 1 otherwise. Python 3 standard library only.
"""

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
import time

# The trial kinds and phases, the tiny config, the process helpers, the
# zinc-train runner and the file damage (tests/tools/crash_lib.py).
from crash_lib import *  # noqa: F401,F403


class Test:
    def __init__(self, args):
        self.args = args
        self.seed = args.seed
        self.workdir = args.workdir
        mpirun = []
        self.np2 = args.np2_share > 0
        if self.np2:
            exe = shutil.which("mpirun")
            if exe is None:
                print("note: mpirun not found, every trial runs at 1 rank")
                self.np2 = False
            else:
                mpirun = [exe, "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS", "-x", "ZINC_LOG_LEVEL"]
                if os.geteuid() == 0:
                    mpirun.append("--allow-run-as-root")
        self.z = Zinc(args.binary_copy, self.workdir, mpirun)
        self.trial_dir = os.path.join(self.workdir, "trial", "ck")
        self.verify_dir = os.path.join(self.workdir, "verify", "ck")
        self.lock_dir = os.path.join(self.workdir, "lock")
        self.templates = os.path.join(self.workdir, "templates")
        for d in (os.path.dirname(self.trial_dir), os.path.dirname(self.verify_dir), self.templates,
                  os.path.join(self.workdir, "out")):
            os.makedirs(d, exist_ok=True)
        self.cfg = os.path.join(self.workdir, "config.json")
        with open(self.cfg, "w") as f:
            json.dump(tiny_config(self.trial_dir, os.path.join(self.workdir, "out")), f, indent=1)
        self.cache = {}  # tree hash of a tag folder -> (world trained, step, digest)
        self.loads_real = 0
        self.loads_cached = 0
        self.ref = {}    # (world trained, k) -> digest of the tag loaded at 1 rank
        self.final = {}  # world -> digest of the uninterrupted run at STEPS, at that world size
        self.run_s = {}  # world -> wall time of one run of STEPS steps with checkpoints
        self.lines = {}  # world -> lines it prints (--json)
        self.step_s = {}  # world -> seconds per step with its checkpoint
        self.template_paths = {}

    # -- loading ---------------------------------------------------------------------

    def load(self, folder):
        """Loads FOLDER/latest at 1 rank without training: {ok, step, digest, ...}."""
        r = self.z.run(1, [self.cfg, "--json", "--weights-digest", "--resume", folder, "--steps", "0",
                           "--set", "run.checkpoint_interval=0", "--set", "run.checkpoint_dir=" + self.lock_dir])
        self.loads_real += 1
        res = {"rc": r.rc, "result": r, "ok": False, "step": None, "digest": None}
        resume, summary = r.event("resume"), r.event("summary")
        if r.rc == 0 and resume and summary and not r.crashed() and not r.hung:
            res.update(ok=True, step=resume.get("step"), digest=summary.get("weights_digest"))
            if summary.get("steps") != resume.get("step") or summary.get("final_loss") is not None:
                res["ok"] = False
                res["why"] = "the load trained (summary %s)" % json.dumps(summary)[:300]
        return res

    def describe_load(self, res):
        r = res["result"]
        lines = [l for l in r.err.splitlines() if l.strip()]
        if res.get("why"):
            return res["why"]
        if res["ok"]:
            return "loaded step %s, digest %s" % (res["step"], res["digest"])
        return "rc %s%s%s, stderr: %s" % (r.rc, " (hung)" if r.hung else "",
                                           " crash: %s" % r.crashed() if r.crashed() else "",
                                           " | ".join(lines[-6:])[:1500])

    def refused_naming(self, res, folder, rel):
        """True when a load failed with one error line naming FOLDER/REL (or at least its file name)."""
        r = res["result"]
        if res["ok"] or r.rc != 1 or r.hung or r.crashed():
            return False, "rc %s%s" % (r.rc, ", crash: %s" % r.crashed() if r.crashed() else "")
        lines = [l for l in r.err.splitlines() if l.strip() and not WARNING_RE.match(l)]
        if len(lines) != 1 or not lines[0].startswith("zinc-train: error: "):
            return False, "%d lines on stderr besides warnings (want one 'zinc-train: error: ...')" % len(lines)
        line = lines[0]
        full = os.path.join(folder, rel)
        base = os.path.basename(rel)
        if full in line or re.search(r"(^|[/\s'\"])" + re.escape(base) + r"($|[\s'\":,.)])", line):
            return True, line
        return False, "the error does not name %s: %s" % (full, line[:600])

    def expect_tag(self, folder, name, world, problems, real=False, what="tag"):
        """The tag FOLDER/NAME loads (from a copy with latest naming it) with the reference weights."""
        k = int(TAG_RE.match(name).group(1))
        want = self.ref.get((world, k))
        key = tree_hash(os.path.join(folder, name))
        if not real and not self.args.no_cache and key in self.cache:
            self.loads_cached += 1
            if self.cache[key] != (world, k, want):
                problems.append("%s %s: byte-identical to a tag that loaded as %s, expected %s"
                                % (what, name, self.cache[key], (world, k, want)))
            return True
        rmtree(os.path.dirname(self.verify_dir))
        os.makedirs(self.verify_dir)
        shutil.copytree(os.path.join(folder, name), os.path.join(self.verify_dir, name))
        write_text(os.path.join(self.verify_dir, "latest"), name + "\n")
        res = self.load(self.verify_dir)
        if not res["ok"]:
            problems.append("%s %s does not load: %s" % (what, name, self.describe_load(res)))
            return False
        if res["step"] != k or res["digest"] != want:
            problems.append("%s %s loads step %s digest %s; the reference at step %d is %s"
                            % (what, name, res["step"], res["digest"], k, want))
            return False
        self.cache[key] = (world, k, want)
        return True

    def expect_latest(self, folder, world, problems):
        """`latest` (if any) names a tag folder that loads, in place, with the reference weights."""
        path = os.path.join(folder, "latest")
        if not os.path.exists(path):
            return None
        text = read_bytes(path)
        m = re.match(rb"^global_step(\d+)\n$", text)
        if not m:
            problems.append("latest holds %r, not a tag" % text[:100])
            return None
        k = int(m.group(1))
        if not os.path.isdir(os.path.join(folder, "global_step%d" % k)):
            problems.append("latest names global_step%d, which is not in the folder" % k)
            return None
        res = self.load(folder)
        if not res["ok"]:
            problems.append("latest (global_step%d) does not load: %s" % (k, self.describe_load(res)))
            return None
        if res["step"] != k or res["digest"] != self.ref.get((world, k)):
            problems.append("latest (global_step%d) loads step %s digest %s; the reference is %s"
                            % (k, res["step"], res["digest"], self.ref.get((world, k))))
            return None
        return k

    # -- references ------------------------------------------------------------------

    def train_args(self, keep, steps=None, resume=False):
        a = [self.cfg, "--json", "--weights-digest", "--set", "run.keep_last=%d" % keep]
        if steps is not None:
            a += ["--steps", str(steps)]
        if resume:
            a.append("--resume")
        return a

    def reference(self, world):
        problems = []
        ref_dir = os.path.join(self.workdir, "ref%d" % world, "ck")
        rmtree(os.path.dirname(ref_dir))
        r = self.z.run(world, [self.cfg, "--json", "--weights-digest", "--set", "run.checkpoint_dir=" + ref_dir])
        s = r.event("summary")
        if r.rc != 0 or not s or s.get("steps") != STEPS:
            raise Failure("the reference run at %d rank(s) failed: %s\n%s" % (world, r.shell(), r.err[-2000:]))
        self.final[world] = s["weights_digest"]
        walls = [r.wall]
        for k in range(1, STEPS + 1):
            self.ref[(world, k)] = None
            rmtree(os.path.dirname(self.verify_dir))
            os.makedirs(self.verify_dir)
            name = "global_step%d" % k
            shutil.copytree(os.path.join(ref_dir, name), os.path.join(self.verify_dir, name))
            write_text(os.path.join(self.verify_dir, "latest"), name + "\n")
            res = self.load(self.verify_dir)
            if not res["ok"] or res["step"] != k:
                raise Failure("the reference tag %s (%d rank(s)) does not load: %s"
                              % (name, world, self.describe_load(res)))
            self.ref[(world, k)] = res["digest"]
        # The tags are the uninterrupted run: at 1 rank, a run of k steps
        # without checkpoints gives the digest of tag k; at 2 ranks, tag STEPS
        # loaded at 2 ranks gives the run's own final digest.
        if world == 1:
            for k in range(1, STEPS + 1):
                u = self.z.run(1, [self.cfg, "--json", "--weights-digest", "--steps", str(k), "--set",
                                   "run.checkpoint_interval=0", "--set", "run.checkpoint_dir=" + self.lock_dir])
                d = (u.event("summary") or {}).get("weights_digest")
                if d != self.ref[(1, k)]:
                    problems.append("a run of %d steps gives digest %s, its checkpoint loads as %s"
                                    % (k, d, self.ref[(1, k)]))
            if self.final[1] != self.ref[(1, STEPS)]:
                problems.append("the reference run's digest %s differs from its last tag's %s"
                                % (self.final[1], self.ref[(1, STEPS)]))
        else:
            name = "global_step%d" % STEPS
            u = self.z.run(2, [self.cfg, "--json", "--weights-digest", "--resume", ref_dir, "--steps", "0",
                               "--set", "run.checkpoint_interval=0", "--set", "run.checkpoint_dir=" + self.lock_dir])
            d = (u.event("summary") or {}).get("weights_digest")
            if d != self.final[2]:
                problems.append("%s loaded at 2 ranks gives digest %s, the run ended with %s"
                                % (name, d, self.final[2]))
        digests = [self.ref[(world, k)] for k in range(1, STEPS + 1)]
        if len(set(digests)) != STEPS:
            problems.append("the reference digests do not differ from step to step: %s" % digests)
        if problems:
            raise Failure("reference at %d rank(s): %s" % (world, "; ".join(problems)))
        # The time a run with checkpoints takes, for the moments of random
        # kills and signals: the fastest of a few (others may be building on
        # this machine; a slower trial run only moves the moments earlier).
        self.template(world, 0, STEPS)
        walls.append(self.last_template_wall)
        timing_dir = os.path.join(self.workdir, "timing")
        for _ in range(4 if world == 1 else 1):
            rmtree(timing_dir)
            r = self.z.run(world, [self.cfg, "--json", "--weights-digest", "--set", "run.checkpoint_dir=" + timing_dir])
            if r.rc == 0:
                walls.append(r.wall)
        self.run_s[world] = min(walls)
        self.lines[world] = len(r.out.splitlines())
        self.step_s[world] = r.event("summary")["elapsed_s"] / STEPS

    def template(self, world, keep, steps):
        """A checkpoint folder from a complete earlier run (built once, at the trial folder's path)."""
        key = (world, keep, steps)
        self.last_template_wall = None
        if key not in self.template_paths:
            path = os.path.join(self.templates, "w%d_k%d_s%d" % key)
            rmtree(self.trial_dir)
            r = self.z.run(world, self.train_args(keep, steps))
            s = r.event("summary")
            if r.rc != 0 or not s or s.get("weights_digest") is None:
                raise Failure("the template run %s failed: rc %s\n%s" % (r.shell(), r.rc, r.err[-2000:]))
            if steps == STEPS and s["weights_digest"] != self.final[world]:
                raise Failure("a second run of %d steps at %d rank(s) gives digest %s, the first %s"
                              % (STEPS, world, s["weights_digest"], self.final[world]))
            rmtree(path)
            shutil.move(self.trial_dir, path)
            self.template_paths[key] = path
            self.last_template_wall = r.wall
        return self.template_paths[key]

    # -- trials ----------------------------------------------------------------------

    def trial(self, i):
        rng = random.Random("%d:%d" % (self.seed, i))
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        u = rng.random()  # drawn always, so that a trial is the same whatever the share
        world = 2 if (kind in KILL_KINDS and self.np2 and u < self.args.np2_share) else 1
        self.z.log = []
        info = {"trial": i, "seed": self.seed, "kind": kind, "world": world, "params": {}, "problems": [],
                "outcome": None, "detail": None}
        try:
            if kind == "corrupt":
                self.corrupt_trial(rng, info)
            else:
                self.kill_trial(rng, kind, world, info)
        except Failure as e:
            info["problems"].append(str(e))
        if info["problems"]:
            info["outcome"] = FAILED
            info["commands"] = list(self.z.log)
        return info

    def prepare(self, rng, world, keep, info, phase=None):
        """The folder a kill trial starts from: empty, a complete earlier run's, or a shorter run's (resumed)."""
        start = rng.choices(["empty", "earlier run", "resume"], [0.5, 0.25, 0.25])[0]
        if phase == "old_aside" and rng.random() < 0.75:
            start = "earlier run"  # its tags are saved again: the old folder goes aside
        rmtree(self.trial_dir)
        first = 1
        if start == "earlier run":
            tk = rng.choice([0, 1, 2])
            if phase == "old_aside":
                tk = 0
            info["params"]["earlier_run"] = "%d steps, keep_last %d" % (STEPS, tk)
            shutil.copytree(self.template(world, tk, STEPS), self.trial_dir, symlinks=True)
        elif start == "resume":
            m = rng.randint(1, STEPS - 1)
            info["params"]["resume_from"] = "a run of %d steps, keep_last %d" % (m, keep)
            shutil.copytree(self.template(world, keep, m), self.trial_dir, symlinks=True)
            first = m + 1
        info["params"]["start"] = start
        return start, STEPS - first + 1  # saves this run makes

    def kill_trial(self, rng, kind, world, info):
        p = info["params"]
        phase = rng.choice(PHASES) if kind == "fault" else None
        keep = rng.choice([0, 1, 2])
        if phase == "prune" and rng.random() < 0.75:
            keep = rng.choice([1, 2])  # something to prune
        p["keep_last"] = keep
        start, saves = self.prepare(rng, world, keep, info, phase)
        args = self.train_args(keep, resume=(start == "resume"))
        problems = info["problems"]
        stop_step = None
        if kind == "fault":
            n = rng.randint(1, saves)
            p["fault"] = "%s:%d" % (phase, n)
            env = {"ZINC_CHECKPOINT_FAULT": p["fault"]}
            r = self.z.run(world, args, env)
            fired = (r.rc == -signal.SIGKILL) if world == 1 else (r.rc != 0)
            if r.crashed() or r.hung:
                problems.append("the run crashed or hung: %s" % r.err[-1500:])
            elif world == 1 and r.rc not in (0, -signal.SIGKILL):
                problems.append("the run exited %s (want killed by the hook, or 0): %s" % (r.rc, r.err[-1500:]))
            elif not fired and phase in ALWAYS_PHASES:
                problems.append("the hook %s never fired (rc %s)" % (p["fault"], r.rc))
            info["detail"] = "killed at %s" % phase if fired else "%s not reached, run completed" % phase
        elif kind == "kill9":
            at = self.moment(rng, world)
            victim = rng.choice(["every process", "one rank"]) if world == 2 else "zinc-train"
            p["at"] = at
            p["victim"] = victim
            h = self.z.spawn(world, args)
            self.wait_for(h, at)
            if victim == "one rank":
                ranks = rank_pids(h)
                if ranks:
                    pid = ranks[rng.randrange(len(ranks))]
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            else:
                kill_session(h["p"].pid, signal.SIGKILL)
            r = self.z.finish(h)
            if r.crashed() or r.hung:
                problems.append("the run crashed or hung: %s" % r.err[-1500:])
            elif world == 1 and r.rc not in (0, -signal.SIGKILL):
                problems.append("the run exited %s: %s" % (r.rc, r.err[-1500:]))
            info["detail"] = "finished before the kill" if r.rc == 0 else "killed"
        else:
            sig = rng.choice([signal.SIGTERM, signal.SIGINT])
            at = self.moment(rng, world)
            twice = rng.random() < 0.2
            gap = rng.uniform(0.0, 3 * self.step_s[world]) if twice else 0.0
            target = rng.choice(["mpirun", "every rank"]) if world == 2 else "zinc-train"
            p.update(signal=signal.Signals(sig).name, at=at, target=target)
            if twice:
                p["second_signal_after_ms"] = round(gap * 1000, 3)
            h = self.z.spawn(world, args)
            self.wait_for(h, at)
            self.send(h, target, sig)
            if twice:
                time.sleep(gap)
                self.send(h, target, sig)
            r = self.z.finish(h)
            m = re.search(r"stopped by signal (\d+) after step (\d+)", r.err)
            if m:
                stop_step = int(m.group(2))
            if r.crashed() or r.hung:
                problems.append("the run crashed or hung: %s" % r.err[-1500:])
            elif world == 1:
                trained = any(e.get("event") == "step" for e in r.events)
                if r.rc == 0:
                    s = r.event("summary")
                    if not s or s.get("steps") != STEPS:
                        problems.append("exit 0 without a complete run")
                    info["detail"] = "finished before the signal"
                elif r.rc == 128 + sig:
                    if m:
                        info["detail"] = "stopped after a step with a checkpoint"
                    elif "stopping now" in r.err:
                        info["detail"] = "stopped at once"
                    else:
                        problems.append("exit %d without a message saying how it stopped: %s" % (r.rc, r.err[-800:]))
                elif r.rc == -sig and not trained:
                    info["detail"] = "ended by the signal as the process started (before main)"
                else:
                    problems.append("exit %s after %s (want 0, %d, or %d before training): %s"
                                    % (r.rc, p["signal"], 128 + sig, -sig, r.err[-1500:]))
            else:
                info["detail"] = ("stopped after a step with a checkpoint" if m else
                                  "ended (rc %s)" % r.rc if r.rc != 0 else "finished before the signal")
        if world == 2 and r.leftovers:
            problems.append("processes still running 30 s after mpirun exited: %s" % r.leftovers)
        self.check_folder_after_kill(world, keep, stop_step, info)

    def moment(self, rng, world):
        """A random moment of a run: a time after its start, or a time after
        its n-th line of output (robust to a machine slowed by other work)."""
        if rng.random() < 0.5:
            return {"ms_after_start": round(rng.uniform(0.0, 1.15 * self.run_s[world]) * 1000, 3)}
        return {"after_line": rng.randint(1, self.lines[world]),
                "ms_later": round(rng.uniform(0.0, 1.5 * self.step_s[world]) * 1000, 3)}

    def wait_for(self, h, at):
        if "ms_after_start" in at:
            left = h["t0"] + at["ms_after_start"] / 1000 - time.monotonic()
            if left > 0:
                time.sleep(left)
            return
        while h["p"].poll() is None:
            with open(self.z.out_path, "rb") as f:
                if f.read().count(b"\n") >= at["after_line"]:
                    break
            time.sleep(0.0002)
        time.sleep(at["ms_later"] / 1000)

    def send(self, h, target, sig):
        if target in ("zinc-train", "mpirun"):
            try:
                h["p"].send_signal(sig)
            except ProcessLookupError:
                pass
            return
        for pid in rank_pids(h):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def snapshot(self, info):
        snapshot(self.workdir, self.trial_dir, info)

    def check_folder_after_kill(self, world, keep, stop_step, info):
        problems = info["problems"]
        self.snapshot(info)
        if not os.path.isdir(self.trial_dir):
            os.makedirs(self.trial_dir)
        bad = unexpected_entries(self.trial_dir)
        if bad:
            problems.append("unexpected entries in the checkpoint folder: %s" % bad)
        tags = tags_in(self.trial_dir)
        for k in sorted(tags):
            self.expect_tag(self.trial_dir, tags[k], world, problems)
        latest = self.expect_latest(self.trial_dir, world, problems)
        if stop_step is not None and latest != stop_step:
            problems.append("the run said it stopped after step %d with a checkpoint, latest is %s"
                            % (stop_step, latest))
        info["tags_left"] = len(tags)
        if problems:
            return
        # Resume (or start again, when there is no `latest`) and train to the end.
        resume = latest is not None
        r = self.z.run(world, self.train_args(keep, resume=resume))
        s = r.event("summary")
        ev = r.event("resume")
        if r.rc != 0 or not s:
            problems.append("%s to step %d failed: rc %s: %s" % ("resuming" if resume else "a fresh run", STEPS,
                                                                  r.rc, r.err[-1500:]))
        elif s.get("weights_digest") != self.final[world]:
            problems.append("%s to step %d gives digest %s, the reference %s"
                            % ("resuming from step %s" % latest if resume else "a fresh run", STEPS,
                               s.get("weights_digest"), self.final[world]))
        elif resume and (not ev or ev.get("step") != latest):
            problems.append("the resume started at %s, latest named step %s" % (ev and ev.get("step"), latest))
        else:
            text = read_bytes(os.path.join(self.trial_dir, "latest")) if os.path.exists(
                os.path.join(self.trial_dir, "latest")) else None
            if text != b"global_step%d\n" % STEPS:
                problems.append("after training to step %d latest holds %r" % (STEPS, text))
        info["outcome"] = OK_BITS

    def corrupt_trial(self, rng, info):
        p = info["params"]
        problems = info["problems"]
        keep = rng.choice([0, 2])  # so that there is a previous checkpoint
        p["keep_last"] = keep
        rmtree(self.trial_dir)
        shutil.copytree(self.template(1, keep, STEPS), self.trial_dir, symlinks=True)
        tags = tags_in(self.trial_dir)
        k = rng.choice(sorted(tags))
        tag = tags[k]
        fname = rng.choice(FILES)
        how = rng.choice(DAMAGES)
        rel = "latest" if fname == "latest" else os.path.join(tag, fname)
        p.update(tag=tag, file=rel, damage=how)
        latest_before = read_bytes(os.path.join(self.trial_dir, "latest")).decode().strip()
        p["damage_done"] = damage(os.path.join(self.trial_dir, rel), how, rng)
        self.snapshot(info)
        if fname != "latest":
            write_text(os.path.join(self.trial_dir, "latest"), tag + "\n")
        res = self.load(self.trial_dir)
        info["detail"] = "%s %s" % (fname, how)
        if res["ok"]:
            want = self.ref.get((1, res["step"]))
            if fname != "latest" and res["step"] != k:
                problems.append("the damaged %s loaded as step %s, not %d" % (tag, res["step"], k))
            elif res["digest"] != want:
                problems.append("the damaged checkpoint LOADED with digest %s; the reference at step %s is %s"
                                % (res["digest"], res["step"], want))
            info["outcome"] = OK_BITS
            if fname == "latest" and res["step"] != k:
                info["detail"] += " (latest named another complete tag)"
        else:
            ok, why = self.refused_naming(res, self.trial_dir, rel)
            if not ok:
                problems.append("the load of the damaged checkpoint neither succeeded bit-identical nor failed "
                                "with one line naming %s: %s; %s" % (rel, why, self.describe_load(res)))
            info["outcome"] = OK_REFUSED
            info["error"] = why
        # The previous checkpoint (for a damaged latest: the tag it named)
        # still loads, for real, through `latest` written to name it; the
        # other tags too (cached when byte-identical to a verified one).
        others = sorted(s for s in tags if s != k or fname == "latest")
        if fname == "latest":
            prev = int(latest_before[len("global_step"):])
        else:
            older = [s for s in others if s < k]
            prev = max(older) if older else (min(others) if others else None)
        if prev is not None:
            write_text(os.path.join(self.trial_dir, "latest"), "global_step%d\n" % prev)
            got = self.expect_latest(self.trial_dir, 1, problems)
            if got != prev and not problems:
                problems.append("the previous checkpoint global_step%d does not load" % prev)
        for s in others:
            if s != prev:
                self.expect_tag(self.trial_dir, tags[s], 1, problems, what="undamaged tag")

    # -- driver ----------------------------------------------------------------------

    def main(self):
        t0 = time.monotonic()
        a = self.args
        print("crash_consistency: %s, %d trials, seed %d, np2 share %s, %d steps; work folder %s"
              % (a.binary, a.trials, a.seed, a.np2_share if self.np2 else 0, STEPS, self.workdir))
        try:
            self.reference(1)
            if self.np2:
                self.reference(2)
        except Failure as e:
            print("FAIL (reference): %s" % e)
            return 1, None
        ref_s = time.monotonic() - t0
        print("reference: %d steps, a run with checkpoints takes %s; digests at 1 rank: %s"
              % (STEPS, ", ".join("%.0f ms at %d rank(s)" % (1000 * v, w) for w, v in sorted(self.run_s.items())),
                 " ".join(self.ref[(1, k)] for k in range(1, STEPS + 1))))
        indices = [a.only] if a.only is not None else list(range(a.trials))

        def progress(results):
            c = {}
            for r in results:
                c[r["outcome"]] = c.get(r["outcome"], 0) + 1
            return "%d %s, %d %s, %d failed; %d processes started, loads %d real / %d cached" % (
                c.get(OK_BITS, 0), OK_BITS, c.get(OK_REFUSED, 0), OK_REFUSED, c.get(FAILED, 0), self.z.starts,
                self.loads_real, self.loads_cached)
        results, failed_dir = run_trials(self, indices, t0, 10, progress, FAILED)
        report = self.summarize(results, time.monotonic() - t0, ref_s)
        return exit_code(report, results, failed_dir, FAILED), report

    def print_failure(self, info):
        print("FAIL trial %d (seed %d, kind %s, %d rank(s)): %s"
              % (info["trial"], info["seed"], info["kind"], info["world"], json.dumps(info["params"])))
        for pr in info["problems"]:
            print("  - " + pr)
        print("  zinc-train runs of the trial:")
        for c in info.get("commands", []):
            print("    " + c)
        print("  rerun: python3 %s %s --seed %d --np2-share %s --only %d --workdir DIR"
              % (sys.argv[0], self.args.binary, info["seed"], self.args.np2_share, info["trial"]), flush=True)

    def summarize(self, results, wall, ref_s):
        kinds = {}
        for k in KINDS:
            kinds[k] = {"title": KIND_TITLES[k], "trials": 0, "trials_2_ranks": 0,
                        "outcomes": {OK_BITS: 0, OK_REFUSED: 0, FAILED: 0}, "details": {}}
        for r in results:
            e = kinds[r["kind"]]
            e["trials"] += 1
            e["trials_2_ranks"] += r["world"] == 2
            e["outcomes"][r["outcome"]] += 1
            d = (r.get("detail") or "?") + (" -> " + r["outcome"] if r["kind"] == "corrupt" else "")
            if r["kind"] != "corrupt" and r["world"] == 2:
                d += " (2 ranks)"
            e["details"][d] = e["details"].get(d, 0) + 1
        totals = {o: sum(kinds[k]["outcomes"][o] for k in KINDS) for o in (OK_BITS, OK_REFUSED, FAILED)}
        print()
        print("%-52s %7s %22s %24s %9s" % ("trial kind", "trials", OK_BITS, OK_REFUSED, FAILED))
        for k in KINDS:
            e = kinds[k]
            name = e["title"] + (" [%d at 2 ranks]" % e["trials_2_ranks"] if e["trials_2_ranks"] else "")
            print("%-52s %7d %22d %24d %9d" % (name, e["trials"], e["outcomes"][OK_BITS],
                                               e["outcomes"][OK_REFUSED], e["outcomes"][FAILED]))
        print("%-52s %7d %22d %24d %9d" % ("total", len(results), totals[OK_BITS], totals[OK_REFUSED],
                                           totals[FAILED]))
        for k in KINDS:
            if kinds[k]["details"]:
                print("  %s:" % k)
                for d, n in sorted(kinds[k]["details"].items(), key=lambda x: (-x[1], x[0])):
                    print("    %5d  %s" % (n, d))
        tags_checked = sum(r.get("tags_left", 0) for r in results)
        print("%d tag folders left by kill trials checked; %d loads run, %d answered from the cache; "
              "%d zinc-train processes started; %.1f s (reference and templates %.1f s)"
              % (tags_checked, self.loads_real, self.loads_cached, self.z.starts, wall, ref_s))
        failures = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results if r["outcome"] == FAILED]
        return {
            "command": [sys.executable] + sys.argv,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "binary": os.path.abspath(self.args.binary),
            "seed": self.seed, "trials": len(results), "np2_share": self.args.np2_share if self.np2 else 0,
            "steps": STEPS, "wall_s": round(wall, 2), "reference_s": round(ref_s, 2),
            "kinds": kinds, "totals": totals,
            "tag_folders_checked_after_kills": tags_checked,
            "loads": {"run": self.loads_real, "cached": self.loads_cached},
            "processes_started": self.z.starts,
            "reference_digests_1_rank": {"%d:%d" % k: v for k, v in sorted(self.ref.items())},
            "failures": failures,
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="the zinc-train binary")
    add_common_args(ap)
    ap.add_argument("--np2-share", type=float, default=0.0,
                    help="share of the kill trials run under mpirun -np 2")
    ap.add_argument("--no-cache", action="store_true", help="load every tag, even byte-identical ones")
    args = ap.parse_args()
    if not os.access(args.binary, os.X_OK):
        print("crash_consistency: %s is not an executable" % args.binary)
        return 2
    if not 0 <= args.np2_share <= 1:
        print("crash_consistency: --np2-share must be in 0..1")
        return 2
    set_subreaper()
    return run_in_workdir(args, "zinc-crash-", {"binary_copy": args.binary}, Test)


if __name__ == "__main__":
    sys.exit(main())
