#!/usr/bin/env python3
"""Crash-consistency test of zinc's Hugging Face exports (issue 49).

`zinc-train CONFIG --save-pretrained DIR` and `zinc-export CHECKPOINT_DIR
--format hf --out DIR` (and Engine.save_pretrained) go through export_hf,
which writes the whole folder into PARENT/.NAME.zinc-staging, hard-links
the user's other files of the old folder into it, swaps it in with
renameat2(RENAME_EXCHANGE) (a plain rename when DIR did not exist) and then
removes the old folder, under the lock PARENT/.NAME.zinc.lock (Note [export
folders] in tools/output_folder.cpp). So an export stopped at any moment
over an earlier export A leaves DIR as:

  old      the files of A, each byte-identical, and no other model file
           (config.json, model*.safetensors, the index, the tokenizer and
           generation files);
  new      byte-identical to an uninterrupted export B made by the same
           command into a fresh folder, config.json included;
  absent   no DIR, only where DIR did not exist before the trial;
  stopped early
           (zinc-train only) SIGTERM during training stops the run after
           step k < the run's steps, with a checkpoint, and an unfinished
           run exports nothing (its weights would replace the folder's
           with fewer steps' worth): DIR must then be old (absent when
           there was none) and zinc-train must say so. A folder holding an
           export of step k's weights (zinc-export of the reference run's
           checkpoint k) is recognised as this class and fails the trial;
           only when zinc-train says "stopped by signal 15 after step k"
           and exits 143.
Anything else fails the trial (a mix: new shards beside an old index, an
old model.safetensors beside a new index, ...). In every class but absent
the user's own files (README.md, LICENSE, ... with random content) are
there unchanged. Two readers must then load the folder and get A's tensors
for old, B's for new: the real `safetensors` package (safetensors.numpy,
through model.safetensors when present, else through the index, as
transformers looks), and zinc itself (`zinc-train` with
model.from_pretrained=DIR --steps 0 --json --weights-digest, compared with
the digest of a load of A's or B's reference). A loader that loads a mixed
folder without an error is counted as a silent load (and fails the trial
like the mix does). Beside DIR only the staging folder, .NAME.zinc-old and
the lock file may remain after a kill (nothing after an exit 0). Then the
same export runs again, uninterrupted: it must exit 0, DIR must be new,
with the user's files, and nothing may remain beside it (the leftovers of
the killed export are removed by it; the lock file by its release).

A trial picks a writer (alternating: --save-pretrained, then zinc-export
--format hf), a fixture (tests/fixtures/hf llama_gqa or gpt2, exported in
fp32), the start (an earlier export A of the untrained weights, with one or
two user files; an empty folder; no folder), A's layout and the new
export's layout independently (one model.safetensors, or shards of at most
8 KB or 30 KB: about 13 or 5 files and an index), and a way to stop it:
  fault  ZINC_EXPORT_FAULT=PHASE (SIGKILL) at "shard" (the first weights
         file written into the staging folder), "staged" (every new file
         written), "linked" (the user's files linked), "swapped" (the new
         folder in place, the old one not yet removed); the class must be
         old (absent for no folder) before the swap and new after it;
  kill9  kill -9 at a random moment: a time after the start, a time after
         the n-th line of its stdout (line-buffered with stdbuf; for
         zinc-train also its line of step k, to land in training), a time
         after the k-th file appears in the staging folder, or a time
         after DIR is swapped (its inode changes);
  term   SIGTERM at such a moment (zinc-train: 143, immediately outside
         training; zinc-export: 143 with DIR as it was, having stopped at
         its next write, or 0 after its last one).
B is 3 steps of training for --save-pretrained and the checkpoint of step
2 of such a run for zinc-export (both from the same fixture and config);
the references, made once per work folder, are each made twice and must be
byte-identical, and every reference folder must load in zinc with the
digest of its weights.

Usage:
  crash_export.py ZINC_TRAIN ZINC_EXPORT [--trials N] [--seed S] [--only I]
      [--writer both|save-pretrained|zinc-export] [--workdir DIR] [--keep]
      [--report FILE.json]
A failure prints the trial's seed, writer, kind, parameters, the command
lines and what was found, copies the trial folder to WORKDIR/failed/, and
`--seed S --only I` reruns that one trial. Exit code 0 when every trial
holds, 1 otherwise, 2 for a wrong argument, 77 (skipped) when numpy or the
safetensors package is missing. The binaries are copied into the work
folder first (a rebuild during the test would otherwise mix two versions).
Python 3 standard library besides numpy and safetensors.
"""

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import string
import subprocess
import sys
import threading
import time

from crash_lib import (add_common_args, exit_code, Failure, outcome_counts, read_bytes, Result, rmtree,
                       run_in_workdir, run_trials, snapshot, write_bytes)
from hf_folder import folder_files, load_weights, same_tensors

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(SOURCE, "tests", "fixtures", "hf")
FIXTURE_NAMES = ("llama_gqa", "gpt2")
WRITERS = ("save-pretrained", "zinc-export")
TRAIN_STEPS = 3  # B of --save-pretrained: the weights after 3 steps
EXPORT_STEP = 2  # B of zinc-export: the checkpoint of step 2 of that run
LAYOUTS = {"single": None, "shards-8KB": "8KB", "shards-30KB": "30KB"}  # --max-shard-size
STARTS = ("export", "empty", "fresh")  # DIR holds an earlier export A (and user files), is empty, does not exist
START_WEIGHTS = (0.8, 0.07, 0.13)
KINDS = ("fault", "kill9", "term")
KIND_WEIGHTS = (0.35, 0.45, 0.2)
KIND_TITLES = {"fault": "kill in the export (ZINC_EXPORT_FAULT)", "kill9": "kill -9 at a random moment",
               "term": "SIGTERM at a random moment"}
PHASES = ("shard", "staged", "linked", "swapped")
USER_FILES = ("README.md", "LICENSE", ".gitattributes", "notes.txt")
OLD, NEW, ABSENT, EARLY, FAILED = "old", "new", "absent", "stopped early", "failures"
OUTCOMES = (OLD, NEW, ABSENT, EARLY, FAILED)
STOPPED_RE = re.compile(r"stopped by signal 15 after step (\d+)")
ERROR_RE = re.compile(r"^(zinc-train|zinc-export): error: .*$", re.M)


def reason(problem):
    """A problem's first line without its paths, sizes and output: for counting failures by kind."""
    m = ERROR_RE.search(problem)
    line = problem.splitlines()[0] if problem else ""
    if m and m.group(0) not in line:
        line = line.split(":")[0] + ": " + m.group(0)
    line = re.sub(r"(?:/[^\s:]+|trial/out)", "PATH", line)
    line = re.sub(r"\(\d+ bytes, was \d+\)", "", line)
    return line[:200]


class Ref:
    """The weights at one step of one fixture: their tensors, zinc's digest of a load of them, and their
    export folder per layout ({name: bytes}), made when first needed."""

    def __init__(self, fixture, step):
        self.fixture, self.step = fixture, step
        self.tensors = None
        self.digest = None
        self.files = {}  # layout -> {name: bytes}


class Test:
    def __init__(self, args):
        self.args = args
        self.seed = args.seed
        self.workdir = args.workdir
        self.trial_dir = os.path.join(self.workdir, "trial")
        self.out_abs = os.path.join(self.trial_dir, "out")
        self.out_rel = os.path.join("trial", "out")  # from the work folder, every process's cwd
        self.staging = os.path.join(self.trial_dir, ".out.zinc-staging")
        self.allowed_after_kill = {".out.zinc-staging", ".out.zinc-old", ".out.zinc.lock"}
        self.stdbuf = shutil.which("stdbuf")
        self.log = []
        self.starts = 0
        self.loads = 0
        self.refs = {}  # (fixture, step) -> Ref
        self.timing = {}  # (writer, fixture, layout) -> {"wall": s, "lines": n, "files": n}
        self.cfg = {}
        self.load_cfg = os.path.join(self.workdir, "load.json")
        with open(self.load_cfg, "w") as f:
            json.dump(self.config(os.path.join(FIXTURES, FIXTURE_NAMES[0]), 0, "load"), f, indent=1)
        for fx in FIXTURE_NAMES:
            self.cfg[fx] = os.path.join(self.workdir, "train_%s.json" % fx)
            with open(self.cfg[fx], "w") as f:
                json.dump(self.config(os.path.join(FIXTURES, fx), TRAIN_STEPS, "train"), f, indent=1)

    def config(self, model, steps, name):
        return {"train_batch_size": 2, "steps_per_print": 1, "zero_optimization": {"stage": 0},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                "model": {"from_pretrained": model},
                "data": {"type": "synthetic", "vocab_size": 96, "seq_len": 12, "seed": 1234},
                "run": {"steps": steps, "seed": 1, "eval_interval": 0, "checkpoint_interval": 0,
                        "output_dir": os.path.join(self.workdir, name + "_run"),
                        "checkpoint_dir": os.path.join(self.workdir, name + "_ck")}}

    # -- processes -------------------------------------------------------------------

    def spawn(self, cmd, env_extra=None, line_buffered=False):
        env_extra = dict(env_extra or {})
        env = dict(os.environ, OMP_NUM_THREADS="1", ZINC_LOG_LEVEL="warn")
        env.pop("ZINC_EXPORT_FAULT", None)
        env.pop("ZINC_CHECKPOINT_FAULT", None)
        env.update(env_extra)
        if line_buffered and self.stdbuf:
            cmd = [self.stdbuf, "-oL"] + cmd
        out = open(os.path.join(self.workdir, "last.out"), "wb")
        err = open(os.path.join(self.workdir, "last.err"), "wb")
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                             start_new_session=True)
        out.close()
        err.close()
        self.starts += 1
        return {"p": p, "t0": t0, "cmd": cmd, "env": env_extra}

    def finish(self, h, timeout=120.0):
        p = h["p"]
        # A blocking wait (Popen.wait with a timeout polls, in steps of up to 50 ms: the wall times would be
        # as coarse), with a timer that kills a hung process.
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            p.wait()
        finally:
            timer.cancel()
        wall = time.monotonic() - h["t0"]
        if wall >= timeout:
            raise Failure("hung (killed after %.0f s): %s" % (timeout, " ".join(h["cmd"])))
        out = read_bytes(os.path.join(self.workdir, "last.out")).decode("utf-8", "replace")
        err = read_bytes(os.path.join(self.workdir, "last.err")).decode("utf-8", "replace")
        r = Result(h["cmd"], h["env"], p.returncode, out, err, wall)
        self.log.append(r.shell() + "  -> rc %s" % r.rc)
        return r

    def run(self, cmd, env_extra=None, line_buffered=False):
        return self.finish(self.spawn(cmd, env_extra, line_buffered))

    def writer_cmd(self, writer, fixture, layout, out):
        size = LAYOUTS[layout]
        shard = ["--max-shard-size", size] if size else []
        if writer == "save-pretrained":
            return [self.args.train_copy, self.cfg[fixture], "--steps", str(TRAIN_STEPS), "--save-dtype", "fp32"] + \
                shard + ["--save-pretrained", out]
        return [self.args.export_copy, self.ck(fixture), "--tag", "global_step%d" % EXPORT_STEP, "--format", "hf",
                "--dtype", "fp32"] + shard + ["--out", out]

    def clear_run_dirs(self):
        """The training run's output and checkpoint folders (a SIGTERM during training saves a checkpoint)."""
        for name in ("train_run", "train_ck", "load_run", "load_ck"):
            rmtree(os.path.join(self.workdir, name))

    def ck(self, fixture):
        return os.path.join(self.workdir, "refs", "ck_" + fixture)

    def zinc_load(self, folder):
        """zinc-train loading `folder` (--steps 0): (digest, None) or (None, what went wrong)."""
        self.loads += 1
        r = self.run([self.args.train_copy, self.load_cfg, "--steps", "0", "--json", "--weights-digest",
                      "--set", "model.from_pretrained=" + os.path.abspath(folder)])
        rmtree(os.path.join(self.workdir, "load_run"))
        if r.crashed():
            return None, "crashed (%s): %s" % (", ".join(r.crashed()), r.err[-1500:].strip())
        if r.rc != 0:
            m = ERROR_RE.search(r.err)
            return None, "refused: rc %s: %s" % (r.rc, m.group(0) if m else r.err[-800:].strip())
        for line in reversed(r.out.splitlines()):
            if line.startswith("{"):
                ev = json.loads(line)
                if ev.get("event") == "summary" and "weights_digest" in ev:
                    return ev["weights_digest"], None
        return None, "exit 0 without a summary holding weights_digest: %s" % r.out[-800:]

    # -- references ------------------------------------------------------------------

    def ref(self, fixture, step):
        key = (fixture, step)
        if key not in self.refs:
            self.refs[key] = Ref(fixture, step)
        return self.refs[key]

    def ref_files(self, fixture, step, layout, writer=None):
        """The export of step `step`'s weights in `layout` ({name: bytes}), made (twice, compared) when first
        asked for: step 0 by zinc-train --steps 0, step TRAIN_STEPS by zinc-train (--save-pretrained), the
        others by zinc-export from the reference checkpoint. Checks its tensors and its load in zinc."""
        ref = self.ref(fixture, step)
        if layout in ref.files:
            return ref.files[layout]
        if writer is None:
            writer = "zinc-export" if 0 < step < TRAIN_STEPS else "save-pretrained"
        got = None
        for attempt in (1, 2):
            folder = os.path.join(self.workdir, "refs", "%s_step%d_%s_%d" % (fixture, step, layout, attempt))
            rmtree(folder)
            self.clear_run_dirs()
            if writer == "save-pretrained":
                cmd = self.writer_cmd(writer, fixture, layout, folder)
                cmd[cmd.index("--steps") + 1] = str(step)
            else:
                cmd = self.writer_cmd(writer, fixture, layout, folder)
                cmd[cmd.index("--tag") + 1] = "global_step%d" % step
            r = self.run(cmd, line_buffered=True)
            if r.rc != 0 or r.crashed():
                raise Failure("the reference export %s failed: rc %s\n%s" % (r.shell(), r.rc, r.err[-2000:]))
            files, others = folder_files(folder)
            beside = [n for n in os.listdir(os.path.dirname(folder)) if n.startswith("." + os.path.basename(folder))]
            if others or beside:
                raise Failure("the reference export %s left %s" % (r.shell(), others + beside))
            if got is not None and files != got:
                raise Failure("two uninterrupted exports %s differ in %s" % (
                    r.shell(), sorted(n for n in set(files) | set(got) if files.get(n) != got.get(n))))
            got = files
            if (writer, step) in (("save-pretrained", TRAIN_STEPS), ("zinc-export", EXPORT_STEP)):
                t = self.timing.setdefault((writer, fixture, layout), {"wall": r.wall, "lines": 0, "files": 0})
                t["wall"] = min(t["wall"], r.wall)
                t["lines"] = r.out.count("\n")
                t["files"] = len(files)
        names = sorted(got)
        sharded = [n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)]
        if LAYOUTS[layout] is None and ("model.safetensors" not in got or sharded):
            raise Failure("the single-file reference %s holds %s" % (folder, names))
        if LAYOUTS[layout] is not None and (len(sharded) < 2 or "model.safetensors.index.json" not in got):
            raise Failure("the sharded reference %s holds %s" % (folder, names))
        tensors, error = load_weights(folder)
        if error:
            raise Failure("safetensors does not load the reference %s: %s" % (folder, error))
        if ref.tensors is None:
            ref.tensors = tensors
        elif not same_tensors(ref.tensors, tensors):
            raise Failure("the reference %s holds other tensors than the same weights in another layout" % folder)
        digest, error = self.zinc_load(folder)
        if error:
            raise Failure("zinc-train does not load the reference %s: %s" % (folder, error))
        if ref.digest is None:
            ref.digest = digest
        elif digest != ref.digest:
            raise Failure("zinc-train loads the reference %s with digest %s, the same weights in another layout "
                          "with %s" % (folder, digest, ref.digest))
        ref.files[layout] = got
        return got

    def references(self):
        """Per fixture: the reference run's checkpoints, the exports of A (step 0), of B for each writer (step
        3 by --save-pretrained, step 2 by zinc-export) in every layout, and the checks between them."""
        os.makedirs(os.path.join(self.workdir, "refs"), exist_ok=True)
        for fx in FIXTURE_NAMES:
            ck = self.ck(fx)
            rmtree(ck)
            self.clear_run_dirs()
            r = self.run([self.args.train_copy, self.cfg[fx], "--set", "run.checkpoint_interval=1",
                          "--set", "run.checkpoint_dir=" + ck])
            if r.rc != 0 or not all(os.path.isdir(os.path.join(ck, "global_step%d" % k))
                                    for k in range(1, TRAIN_STEPS + 1)):
                raise Failure("the reference run %s failed: rc %s\n%s" % (r.shell(), r.rc, r.err[-2000:]))
            for layout in LAYOUTS:
                self.ref_files(fx, 0, layout)
                for writer, step in (("save-pretrained", TRAIN_STEPS), ("zinc-export", EXPORT_STEP)):
                    self.ref_files(fx, step, layout, writer)
            # zinc-export of the last checkpoint is what --save-pretrained wrote at the end of the run (the
            # early stops are checked against zinc-export's exports of the other steps).
            folder = os.path.join(self.workdir, "refs", "%s_last_by_zinc_export" % fx)
            rmtree(folder)
            r = self.run([self.args.export_copy, ck, "--tag", "global_step%d" % TRAIN_STEPS, "--format", "hf",
                          "--dtype", "fp32", "--max-shard-size", LAYOUTS["shards-30KB"], "--out", folder])
            if r.rc != 0 or folder_files(folder)[0] != self.ref(fx, TRAIN_STEPS).files["shards-30KB"]:
                raise Failure("zinc-export of the reference run's last checkpoint (%s) is not what its "
                              "--save-pretrained wrote: rc %s %s" % (r.shell(), r.rc, r.err[-1500:].strip()))
            a, b3, b2 = self.ref(fx, 0), self.ref(fx, TRAIN_STEPS), self.ref(fx, EXPORT_STEP)
            if len({a.digest, b3.digest, b2.digest}) != 3 or same_tensors(a.tensors, b3.tensors) or \
                    same_tensors(a.tensors, b2.tensors) or same_tensors(b2.tensors, b3.tensors):
                raise Failure("%s: the weights of steps 0, %d and %d are not all different (digests %s, %s, %s)"
                              % (fx, EXPORT_STEP, TRAIN_STEPS, a.digest, b2.digest, b3.digest))
            # The untrained export is the fixture's own tensors (fp32 in, fp32 out).
            fixture_tensors, error = load_weights(os.path.join(FIXTURES, fx))
            if error or not same_tensors(fixture_tensors, a.tensors):
                raise Failure("%s: the export of 0 steps is not the fixture's tensors (%s)" % (fx, error))

    def probe_classifier(self):
        """The check of a trial finds a mix: A's model.safetensors beside B's shards and index, and half of B's
        shards under A's index of the same count, each with a user file, must be classed as neither old nor new,
        and every loader that loads one must be reported as a silent load."""
        fx = FIXTURE_NAMES[0]
        a1, a8 = self.ref_files(fx, 0, "single"), self.ref_files(fx, 0, "shards-8KB")
        b8 = self.ref_files(fx, TRAIN_STEPS, "shards-8KB", "save-pretrained")
        shards = sorted(n for n in b8 if n.startswith("model-"))
        mixes = {"A's model.safetensors beside B's shards":
                 (a1, dict(b8, **{"model.safetensors": a1["model.safetensors"]})),
                 "B's first shards under A's index": (a8, dict(a8, **{n: b8[n] for n in shards[:len(shards) // 2]}))}
        for what, (old, mix) in mixes.items():
            rmtree(self.trial_dir)
            os.makedirs(self.out_abs)
            user = {"README.md": b"user's"}
            for name, data in list(mix.items()) + list(user.items()):
                write_bytes(os.path.join(self.out_abs, name), data)
            info = {"fixture": fx, "writer": "save-pretrained", "new_layout": "shards-8KB", "silent": []}
            problems = []
            got = self.classify(info, dict(old), b8, user, None, problems)
            if got is not None or not info.get("mixed") or not info["silent"]:
                raise Failure("the check of a trial does not find the mix %s: class %s, silent loads %s, problems %s"
                              % (what, got, info["silent"], problems))
        rmtree(self.trial_dir)

    # -- trials ----------------------------------------------------------------------

    def trial(self, i):
        rng = random.Random("%d:%d" % (self.seed, i))
        writer = self.args.writer if self.args.writer != "both" else WRITERS[i % 2]
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        fixture = rng.choice(FIXTURE_NAMES)
        start = rng.choices(STARTS, START_WEIGHTS)[0]
        old_layout = rng.choice(list(LAYOUTS)) if start == "export" else None
        new_layout = rng.choice(list(LAYOUTS))
        relative = rng.random() < 0.3
        self.log = []
        info = {"trial": i, "seed": self.seed, "writer": writer, "kind": kind, "fixture": fixture, "start": start,
                "old_layout": old_layout, "new_layout": new_layout, "params": {"relative_path": relative},
                "problems": [], "outcome": None, "detail": None, "silent": []}
        try:
            self.run_trial(rng, info)
        except Failure as e:
            info["problems"].append(str(e))
        if info["problems"]:
            info["outcome"] = FAILED
        info["commands"] = list(self.log)
        return info

    def prepare_start(self, rng, info):
        """The trial folder with DIR as the start says; returns the files DIR holds ({name: bytes}, A's and the
        user's) and the user's."""
        rmtree(self.trial_dir)
        os.makedirs(self.trial_dir)
        self.clear_run_dirs()
        if info["start"] == "fresh":
            return None, {}
        os.makedirs(self.out_abs)
        if info["start"] == "empty":
            return {}, {}
        files = dict(self.ref_files(info["fixture"], 0, info["old_layout"]))
        user = {}
        for name in rng.sample(USER_FILES, rng.randint(1, 2)):
            n = rng.randint(0, 3000)
            user[name] = "".join(rng.choice(string.printable) for _ in range(n)).encode()
        info["params"]["user_files"] = {k: len(v) for k, v in user.items()}
        for name, data in list(files.items()) + list(user.items()):
            write_bytes(os.path.join(self.out_abs, name), data)
        return files, user

    def run_trial(self, rng, info):
        writer, kind, fixture = info["writer"], info["kind"], info["fixture"]
        new_step = TRAIN_STEPS if writer == "save-pretrained" else EXPORT_STEP
        want_new = self.ref_files(fixture, new_step, info["new_layout"], writer)
        old_files, user = self.prepare_start(rng, info)
        out = self.out_rel if info["params"]["relative_path"] else self.out_abs
        cmd = self.writer_cmd(writer, fixture, info["new_layout"], out)
        env = {}
        if kind == "fault":
            phase = rng.choice(PHASES)
            info["params"]["phase"] = phase
            env["ZINC_EXPORT_FAULT"] = phase
            info["detail"] = phase
            r = self.run(cmd, env, line_buffered=True)
        else:
            at = self.moment(rng, self.timing[(writer, fixture, info["new_layout"])], writer)
            info["params"]["moment"] = at
            sig = signal.SIGKILL if kind == "kill9" else signal.SIGTERM
            h = self.spawn(cmd, env, line_buffered=True)
            self.wait_for(h, at)
            sent = h["p"].poll() is None
            if sent:
                h["p"].send_signal(sig)
            r = self.finish(h)
            info["detail"] = next(iter(at)).replace("_", " ") + ("" if sent else " (finished first)")
        info["rc"] = r.rc
        problems = info["problems"]
        if r.crashed():
            problems.append("crashed (%s): %s" % (", ".join(r.crashed()), r.err[-1500:].strip()))
        early = None
        allowed_rc = {0}
        if kind == "fault":
            allowed_rc = {-signal.SIGKILL}
        elif kind == "kill9":
            allowed_rc = {0, -signal.SIGKILL}
        elif writer == "save-pretrained":
            allowed_rc = {0, 128 + signal.SIGTERM, -signal.SIGTERM}  # -15: before its signal thread runs
            m = STOPPED_RE.search(r.err)
            if m and r.rc == 128 + signal.SIGTERM:
                early = int(m.group(1))
                info["params"]["stopped_after_step"] = early
        else:
            # zinc-export stops at its next write, removing what it wrote (143), or is killed before its signal
            # thread runs (-15); 0 where the signal came after its last write.
            allowed_rc = {0, 128 + signal.SIGTERM, -signal.SIGTERM}
        if r.rc not in allowed_rc:
            problems.append("exit status %s, want one of %s: %s" % (r.rc, sorted(allowed_rc), r.err[-1500:].strip()))
        self.snapshot(info)

        # What is left: DIR's class, the user's files, and nothing beside it but the killed export's leftovers.
        allowed = {OLD, NEW} if info["start"] != "fresh" else {ABSENT, NEW}
        if early is not None and early != TRAIN_STEPS:
            # The run stopped after step `early`, unfinished: it exports nothing (its checkpoint keeps the
            # weights) and says so.
            allowed = {OLD} if info["start"] != "fresh" else {ABSENT}
            if "are not written" not in r.err:
                problems.append("a run stopped after step %d did not say that it wrote no export" % early)
        if kind == "fault":
            allowed = {NEW} if info["params"]["phase"] == "swapped" else allowed - {NEW}
        if r.rc == 0:
            allowed = {NEW}
        if writer != "save-pretrained" and r.rc == 128 + signal.SIGTERM:
            allowed = allowed - {NEW}  # it stopped before its commit: DIR as it was
        outcome = self.classify(info, old_files, want_new, user, early, problems)
        beside = sorted(set(os.listdir(self.trial_dir)) - {"out"})
        info["left"] = beside
        stray = [n for n in beside if r.rc == 0 or n not in self.allowed_after_kill]
        if stray:
            problems.append("beside DIR after the %s: %s" % ("exit 0" if r.rc == 0 else "stop", stray))
        if outcome is not None and outcome not in allowed:
            problems.append("DIR is %s; after this stop (%s, rc %s) it must be %s" % (
                outcome, info["detail"], r.rc, " or ".join(sorted(allowed))))
        if outcome is not None:
            info["outcome"] = info["class"] = outcome
        if problems:
            return

        # The export again, uninterrupted: B exactly, the user's files, nothing beside.
        self.clear_run_dirs()
        r2 = self.run(cmd, line_buffered=True)
        if r2.rc != 0 or r2.crashed():
            problems.append("the export after the stop failed: rc %s: %s" % (r2.rc, r2.err[-1500:].strip()))
            return
        after = self.classify(info, old_files, want_new, user, None, problems, again=True)
        if after != NEW:
            problems.append("after the uninterrupted export DIR is %s, not new" % after)
        beside = sorted(set(os.listdir(self.trial_dir)) - {"out"})
        if beside:
            problems.append("left beside DIR after the uninterrupted export: %s" % beside)
        if "left " in r2.err and "in place" in r2.err:
            problems.append("the uninterrupted export warned: %s" % r2.err[-800:])

    def classify(self, info, old_files, want_new, user, early, problems, again=False):
        """DIR's class (None when it is none: a problem is then added), with its loads checked."""
        fixture = info["fixture"]
        when = "after the uninterrupted export" if again else "after the stop"
        if not os.path.lexists(self.out_abs):
            if old_files is None:
                return ABSENT
            problems.append("DIR is gone %s (it held %s)" % (when, sorted(old_files) or "nothing"))
            return None
        files, others = folder_files(self.out_abs)
        if others:
            problems.append("DIR holds entries that are not files %s: %s" % (when, others))
        for name, data in user.items():
            got = files.pop(name, None)
            if got is None:
                problems.append("the user's %s is gone %s" % (name, when))
            elif got != data:
                problems.append("the user's %s changed %s (%d bytes, was %d)" % (name, when, len(got), len(data)))
        new_step = TRAIN_STEPS if info["writer"] == "save-pretrained" else EXPORT_STEP
        candidates = []  # (class, files, Ref); an early stop's export first (it may be A's or B's files too)
        if early is not None and early != TRAIN_STEPS:
            candidates.append((EARLY, self.ref_files(fixture, early, info["new_layout"]), self.ref(fixture, early)))
        if old_files is not None:
            candidates.append((OLD, old_files, self.ref(fixture, 0)))
        candidates.append((NEW, want_new, self.ref(fixture, new_step)))
        outcome = ref = None
        for cls, want, r in candidates:
            if files == want:
                outcome, ref = cls, r
                break
        if outcome is None:
            states = []
            for name in sorted(set(files) | set(old_files or {}) | set(want_new)):
                have = files.get(name)
                tag = "".join(k for k, src in (("A", old_files or {}), ("B", want_new)) if have is not None and
                              src.get(name) == have)
                states.append("%s:%s" % (name, "missing" if have is None else "=".join(tag) or "neither"))
            info["state"] = " ".join(states)
            problems.append("a mix %s: neither A's files nor B's (%s)" % (when, info["state"]))
            info["mixed"] = True
        if again and outcome == NEW:
            return outcome
        # The readers: safetensors and zinc must load the class's weights, and must not load a mix silently.
        tensors, error = load_weights(self.out_abs)
        digest, zerror = self.zinc_load(self.out_abs)
        info["loads"] = {"safetensors": error or "loaded", "zinc": zerror or digest}
        if outcome is None:
            if tensors is not None:
                which = [k for k, r in (("A", self.ref(fixture, 0)), ("B", self.ref(fixture, new_step)))
                         if same_tensors(tensors, r.tensors)]
                info["silent"].append("safetensors loads the mix (%s)" % (which[0] + "'s tensors" if which else
                                                                           "tensors of neither"))
            if digest is not None:
                which = [k for k, r in (("A", self.ref(fixture, 0)), ("B", self.ref(fixture, new_step)))
                         if digest == r.digest]
                info["silent"].append("zinc-train loads the mix (%s)" % (which[0] + "'s weights" if which else
                                                                          "digest " + digest))
            for s in info["silent"]:
                problems.append("silent load: " + s)
            return None
        if outcome == OLD and not old_files:
            # The empty folder a trial started from: nothing to load, and neither reader may load anything.
            if error is None:
                problems.append("safetensors loads tensors from DIR, an empty folder %s" % when)
            if zerror is None:
                problems.append("zinc-train loads DIR, an empty folder %s (digest %s)" % (when, digest))
            return outcome
        if error:
            problems.append("safetensors does not load DIR (%s) %s: %s" % (outcome, when, error))
        elif not same_tensors(tensors, ref.tensors):
            problems.append("safetensors loads other tensors than those of %s from DIR (%s)" % (outcome, when))
        if zerror:
            problems.append("zinc-train does not load DIR (%s) %s: %s" % (outcome, when, zerror))
        elif digest != ref.digest:
            problems.append("zinc-train loads DIR (%s) %s with digest %s, want %s" % (outcome, when, digest,
                                                                                    ref.digest))
        return outcome

    def moment(self, rng, t, writer):
        """A random moment of an export run: a time after its start, a time after the n-th line of its stdout
        (zinc-train: or after its line of step k, in training), a time after the k-th file appears in its
        staging folder, or a time after DIR is swapped."""
        u = rng.random()
        if writer == "save-pretrained" and self.stdbuf and rng.random() < 0.2:  # a step takes well under 1 ms
            return {"after_step": rng.randint(1, TRAIN_STEPS - 1), "us_later": round(rng.uniform(0.0, 400.0), 1)}
        if u < 0.2:
            return {"ms_after_start": round(rng.uniform(0.0, 1.2 * t["wall"]) * 1000, 3)}
        if u < 0.4 and self.stdbuf:
            return {"after_line": rng.randint(1, max(1, t["lines"])),
                    "us_later": round(rng.choice([0.0, rng.uniform(0.0, 2000.0)]), 1)}
        if u < 0.75:
            return {"after_staged_file": rng.randint(1, max(1, t["files"])),
                    "us_later": round(rng.choice([0.0, rng.uniform(0.0, 1500.0)]), 1)}
        return {"after_swap": True, "us_later": round(rng.choice([0.0, rng.uniform(0.0, 400.0)]), 1)}

    def wait_for(self, h, at):
        p = h["p"]
        if "ms_after_start" in at:
            left = h["t0"] + at["ms_after_start"] / 1000 - time.monotonic()
            if left > 0:
                time.sleep(left)
            return
        if "after_line" in at:
            path = os.path.join(self.workdir, "last.out")
            while p.poll() is None:
                if read_bytes(path).count(b"\n") >= at["after_line"]:
                    break
        elif "after_step" in at:
            path = os.path.join(self.workdir, "last.out")
            line = re.compile(rb"^step %d/" % at["after_step"], re.M)
            while p.poll() is None:
                if line.search(read_bytes(path)):
                    break
        elif "after_staged_file" in at:
            while p.poll() is None:
                try:
                    if len(os.listdir(self.staging)) >= at["after_staged_file"]:
                        break
                except FileNotFoundError:
                    pass
        else:
            try:
                before = os.stat(self.out_abs).st_ino
            except FileNotFoundError:
                before = None
            while p.poll() is None:
                try:
                    if os.stat(self.out_abs).st_ino != before:
                        break
                except FileNotFoundError:
                    pass
        deadline = time.monotonic() + at["us_later"] / 1e6
        while time.monotonic() < deadline:
            pass

    def snapshot(self, info):
        snapshot(self.workdir, self.trial_dir, info)

    # -- driver ----------------------------------------------------------------------

    def main(self):
        t0 = time.monotonic()
        a = self.args
        print("crash_export: %s, %s, %d trials, writer %s, seed %d; work folder %s"
              % (a.train, a.export, a.trials if a.only is None else 1, a.writer, a.seed, self.workdir), flush=True)
        try:
            self.references()
            self.probe_classifier()
        except Failure as e:
            print("FAIL (reference): %s" % e)
            for c in self.log:
                print("    " + c)
            return 1, None
        ref_s = time.monotonic() - t0
        print("references: %.1f s; %s" % (ref_s, ", ".join(
            "%s %s %s: %.0f ms, %d files" % (w, fx, lay, 1000 * t["wall"], t["files"])
            for (w, fx, lay), t in sorted(self.timing.items()) if lay != "shards-30KB")), flush=True)
        indices = [a.only] if a.only is not None else list(range(a.trials))
        results, failed_dir = run_trials(self, indices, t0, 50, lambda rs: outcome_counts(rs, OUTCOMES), FAILED)
        report = self.summarize(results, time.monotonic() - t0, ref_s)
        return exit_code(report, results, failed_dir, FAILED), report

    def print_failure(self, info):
        print("FAIL trial %d (seed %d, writer %s, kind %s, fixture %s, start %s, A %s, B %s): %s"
              % (info["trial"], info["seed"], info["writer"], info["kind"], info["fixture"], info["start"],
                 info["old_layout"], info["new_layout"], json.dumps(info["params"])))
        print("  rc %s; left beside DIR: %s; loads: %s" % (info.get("rc"), info.get("left"), info.get("loads")))
        for pr in info["problems"]:
            print("  - " + pr)
        print("  commands of the trial (cwd %s):" % self.workdir)
        for c in info.get("commands", []):
            print("    " + c)
        print("  rerun: python3 %s %s %s --seed %d --only %d%s --workdir DIR"
              % (sys.argv[0], self.args.train, self.args.export, info["seed"], info["trial"],
                 "" if self.args.writer == "both" else " --writer " + self.args.writer), flush=True)

    def summarize(self, results, wall, ref_s):
        table = {}  # (writer, kind) -> {outcome: n}
        details = {}  # (writer, kind) -> {detail -> outcome: n}
        starts = {}  # "A layout over B layout" -> {outcome: n}
        mixed = silent = 0
        for r in results:
            key = (r["writer"], r["kind"])
            table.setdefault(key, {o: 0 for o in OUTCOMES})[r["outcome"]] += 1
            d = "%s -> %s" % (r.get("detail") or "?", r["outcome"])
            details.setdefault(key, {})
            details[key][d] = details[key].get(d, 0) + 1
            s = "%s over %s" % (r["new_layout"], r["old_layout"] if r["start"] == "export" else
                                ("an empty folder" if r["start"] == "empty" else "no folder"))
            starts.setdefault(s, {o: 0 for o in OUTCOMES})[r["outcome"]] += 1
            mixed += bool(r.get("mixed"))
            silent += bool(r["silent"])
        totals = {o: sum(v[o] for v in table.values()) for o in OUTCOMES}
        reasons = {}  # a failure's problems, paths and sizes left out -> trials
        for r in results:
            for pr in set(reason(pr) for pr in r["problems"]):
                reasons[pr] = reasons.get(pr, 0) + 1
        print()
        widths = [max(len(o), 6) for o in OUTCOMES]
        head = lambda title: "%-58s %6s " % (title, "trials") + " ".join(  # noqa: E731
            "%*s" % (w, o) for w, o in zip(widths, OUTCOMES))
        row = lambda title, c: "%-58s %6d " % (title, sum(c.values())) + " ".join(  # noqa: E731
            "%*d" % (w, c[o]) for w, o in zip(widths, OUTCOMES))
        print(head("writer: trial kind"))
        for w in WRITERS:
            per = {o: 0 for o in OUTCOMES}
            for k in KINDS:
                if (w, k) in table:
                    print(row("%s: %s" % (w, KIND_TITLES[k]), table[(w, k)]))
                    for o in OUTCOMES:
                        per[o] += table[(w, k)][o]
            if sum(per.values()):
                print(row("%s: all" % w, per))
        print(row("total", totals))
        print(head("new layout over the start"))
        for s in sorted(starts):
            print(row("  " + s, starts[s]))
        for key in sorted(details):
            print("  %s, %s:" % key)
            for d, n in sorted(details[key].items(), key=lambda x: (-x[1], x[0])):
                print("    %5d  %s" % (n, d))
        if reasons:
            print("  failures, by problem:")
            for pr, n in sorted(reasons.items(), key=lambda x: (-x[1], x[0])):
                print("    %5d  %s" % (n, pr))
            classes = {}
            for r in results:
                if r["outcome"] == FAILED:
                    c = r.get("class") or ("a mix" if r.get("mixed") else "not classified")
                    classes[c] = classes.get(c, 0) + 1
            print("  the folder after the stop, in the failed trials: %s"
                  % ", ".join("%s %d" % kv for kv in sorted(classes.items())))
        print("%d mixed outputs, %d silent loads; %d export runs, %d zinc-train loads; %.1f s (references %.1f s)"
              % (mixed, silent, self.starts - self.loads, self.loads, wall, ref_s))
        return {
            "command": [sys.executable] + sys.argv,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "train": os.path.abspath(self.args.train), "export": os.path.abspath(self.args.export),
            "seed": self.seed, "trials": len(results), "wall_s": round(wall, 2), "reference_s": round(ref_s, 2),
            "table": {"%s: %s" % k: v for k, v in table.items()},
            "details": {"%s: %s" % k: v for k, v in details.items()},
            "starts": starts, "totals": totals, "mixed_outputs": mixed, "silent_loads": silent,
            "failure_reasons": reasons,
            "trial_list": [{k: r.get(k) for k in ("trial", "writer", "kind", "fixture", "start", "old_layout",
                                                  "new_layout", "params", "rc", "detail", "class", "outcome",
                                                  "left")}
                           for r in results],
            "failures": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results
                         if r["outcome"] == FAILED],
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("train", nargs="?", default=os.path.join(SOURCE, "build", "tools", "zinc-train"),
                    help="the zinc-train binary (default: build/tools/zinc-train of this tree)")
    ap.add_argument("export", nargs="?", default=os.path.join(SOURCE, "build", "tools", "zinc-export"),
                    help="the zinc-export binary (default: build/tools/zinc-export of this tree)")
    add_common_args(ap, trials=40)
    ap.add_argument("--writer", choices=("both",) + WRITERS, default="both",
                    help="the export under test (both: alternating, --save-pretrained for even trials)")
    args = ap.parse_args()
    for b in (args.train, args.export):
        if not os.access(b, os.X_OK):
            print("crash_export: %s is not an executable" % b)
            return 2
    if args.trials < 0 or (args.only is not None and args.only < 0):
        print("crash_export: --trials and --only take a count >= 0")
        return 2
    try:
        import numpy  # noqa: F401
        import safetensors.numpy  # noqa: F401
    except ImportError as e:
        print("crash_export: skipped: %s (scripts/setup.sh installs numpy and safetensors)" % e)
        return 77
    return run_in_workdir(args, "zinc-crash-export-", {"train_copy": args.train, "export_copy": args.export}, Test)


if __name__ == "__main__":
    sys.exit(main())
