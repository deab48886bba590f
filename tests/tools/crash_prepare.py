#!/usr/bin/env python3
"""Crash-consistency test of python -m zinc.prepare's outputs (issue 49).

zinc.prepare writes a set of four files, PREFIX.bin, .mask, .docs and the
manifest .json, to temporaries, removes the old manifest, and renames them
into place one at a time: the .mask, the .docs, the .bin, and the manifest
last. The .bin's header records the CRC-32 and size of the .mask and .docs
(slots [3..10], see python/zinc/prepare.py), and zinc-train refuses a .mask
or .docs beside it that is not the one recorded; a manifest present always
describes the .bin beside it. So a run killed at any moment over an earlier
set leaves, of what zinc-train would train on:

  old complete set   the four files are the earlier run's (A);
  new complete set   the four files are the interrupted run's, as an
                     uninterrupted run makes them (B);
  refused            a mixed set (a new .mask or .docs beside the old
                     .bin): zinc-train exits 1 with exactly one line
                     "zinc-train: error: ..." naming the .mask or .docs;
  old data, no manifest / new data, no manifest
                     the .bin, .mask and .docs are all A's (or all B's)
                     and no manifest: killed between the old manifest's
                     removal and the new one's rename; zinc-train trains
                     on one whole set, and no manifest tells of another.

Anything else fails the trial: a file that is neither A's nor B's, a mixed
set zinc-train loads, a crash or a traceback. Each trial writes A at the
prefix, then runs zinc.prepare over it on another data set and stops it:
  fault  ZINC_PREPARE_FAULT=PHASE kills it (SIGKILL) at a phase of its
         commit: "writing", "before_rename", "after_mask", "after_docs",
         "after_bin", "after_manifest"; the files then present must be
         exactly those the rename order gives;
  kill9  kill -9 at a random moment: a time after the start, a time after
         the n-th line of its stderr, or microseconds after the k-th
         rename is seen (the moments the hook cannot vary);
  term   SIGTERM at such a moment: exit 143 with the old set (the run
         stops between batches, never inside its commit) and no temporary
         left, or 0 (the commit had begun), or -15 (before the handler is
         installed, or after it is removed).
The second data set is, at random, another data set (another token count),
the same documents' lengths with other tokens (the .mask and .docs
byte-identical), or the same token count and documents with other masks
(the dangerous case: an old .bin with a new .mask would train on targets
that are not its tokens'). After each trial zinc.prepare runs again,
uninterrupted: it must give B exactly and leave no temporary (those of the
killed run, a dead PID, are removed) and no lock file.

The refused class is checked by zinc-train when the binary has the check
(probed at the start on a mixed set: refused, or loaded); otherwise by the
rule alone, in Python (--require-reader makes that a failure). zinc.prepare
and zinc-train are copied into the work folder first, so that a rebuild or
an edit during the test does not mix two versions. zinc.prepare is
prepare.py and the private modules beside it (_prepare*.py) as found on
PYTHONPATH (zinc/prepare.py under an entry, e.g. build/python), else in this
source tree, else --prepare (the file or its folder); they are copied into
a package folder zinc/ of their own (its __init__.py empty: the tool needs
no extension module) and run as `python -m zinc.prepare` with this
interpreter (which needs `tokenizers`), that copy first on PYTHONPATH and
the work folder as the current one (so that no zinc/ there shadows it).

Usage:
  crash_prepare.py [ZINC_TRAIN] --trials N [--seed S] [--only I] [--keep]
      [--workdir DIR] [--report FILE.json] [--prepare PATH] [--require-reader]
A failure prints the trial's seed, kind, parameters, the commands and what
happened, and `--seed S --only I` reruns that one trial. Exit code 0 when
every trial holds, 1 otherwise, 2 for a wrong argument, 77 (skipped) when
the tokenizers package is missing. Python 3 standard library besides.
"""

import argparse
import datetime
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib

from crash_lib import (add_common_args, exit_code, Failure, outcome_counts, read_bytes, Result, rmtree,
                       run_in_workdir, run_trials, shquote, snapshot, write_bytes)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(os.path.dirname(HERE))
TOKENIZER = os.path.join(SOURCE, "tests", "fixtures", "prepare", "llama3")
EXTS = ("bin", "mask", "docs", "json")
RENAME_ORDER = ("mask", "docs", "bin", "json")
PHASES = ("writing", "before_rename", "after_mask", "after_docs", "after_bin", "after_manifest")
RENAMED = {"writing": (), "before_rename": (), "after_mask": ("mask",), "after_docs": ("mask", "docs"),
           "after_bin": ("mask", "docs", "bin"), "after_manifest": EXTS}
MANIFEST_REMOVED = ("after_mask", "after_docs", "after_bin")  # the old manifest goes before the first rename
KINDS = ("fault", "kill9", "term")
KIND_WEIGHTS = (0.45, 0.4, 0.15)
KIND_TITLES = {"fault": "kill in the commit (ZINC_PREPARE_FAULT)", "kill9": "kill -9 at a random moment",
               "term": "SIGTERM at a random moment"}
RELATIONS = ("other data", "same shape, other tokens", "same shape, other masks")
OLD, NEW, REFUSED, REFUSED_RULE, OLD_BARE, NEW_BARE, FAILED = (
    "old set", "new set", "refused by zinc-train", "refused by the rule", "old data, no manifest",
    "new data, no manifest", "failures")
OUTCOMES = (OLD, NEW, REFUSED, REFUSED_RULE, OLD_BARE, NEW_BARE, FAILED)
SET_MARKER = b"ZINC"  # header[3] in file order
SEQ_LEN = 256
# Words each one token (with the space before it) in the fixture tokenizer, so that a record's token count
# follows its word count; checked against the reference outputs (the relations) at the start.
WORDS = ("Contrib", "Derivative", "License", "Work", "Works", "You", "and", "any", "copy", "for", "such", "that",
         "the", "this", "with")
WARNING_RE = re.compile(r"^zinc\[\d+\] (warning|info|debug): ")


def rule_refuses(prefix):
    """The .mask and .docs (extensions) that zinc-train's rule refuses beside PREFIX.bin: those whose size or
    CRC-32 differ from what its header records, when header[3] is the marker."""
    head = read_bytes(prefix + ".bin")[:1024]
    if len(head) < 1024 or head[12:16] != SET_MARKER:
        return []
    u = struct.unpack("<256I", head)
    refused = []
    for ext, slot in (("mask", 5), ("docs", 8)):
        path = prefix + "." + ext
        data = read_bytes(path) if os.path.exists(path) else b""
        if (zlib.crc32(data), len(data)) != (u[slot], u[slot + 1] + (u[slot + 2] << 32)):
            refused.append(ext)
    return refused


def find_prepare(given):
    """prepare.py: --prepare (the file, or a folder holding it), else zinc/prepare.py under a PYTHONPATH entry,
    else this source tree's."""
    if given:
        given = os.path.abspath(given)
        return os.path.join(given, "prepare.py") if os.path.isdir(given) else given
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        candidate = os.path.join(entry, "zinc", "prepare.py")
        if entry and os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return os.path.join(SOURCE, "python", "zinc", "prepare.py")


def copy_prepare(prepare, dest):
    """Copies prepare.py (as zinc/prepare.py) and the private modules beside it (_prepare*.py) into DEST/zinc/, a
    package of its own with an empty __init__.py (zinc.prepare needs no extension module), so that
    `python -m zinc.prepare` with DEST first on PYTHONPATH runs this copy whatever is rebuilt or edited
    meanwhile. Returns DEST."""
    package = os.path.join(dest, "zinc")
    rmtree(package)
    os.makedirs(package)
    folder = os.path.dirname(prepare)
    shutil.copy2(prepare, os.path.join(package, "prepare.py"))
    for name in sorted(os.listdir(folder)):
        if name.startswith("_prepare") and name.endswith(".py"):
            shutil.copy2(os.path.join(folder, name), os.path.join(package, name))
    write_bytes(os.path.join(package, "__init__.py"), b"")
    return dest


# ---- data ------------------------------------------------------------------------------

def alpaca_line(rng, n_instruction, n_output):
    words = lambda n: " ".join(["You"] + [rng.choice(WORDS) for _ in range(n)])  # noqa: E731
    return json.dumps({"instruction": words(n_instruction), "output": words(n_output)})


def data_sets(rng, relation):
    """The lines of set 1 and set 2 (alpaca JSONL, a few bad records in each) for a relation."""
    n = rng.randint(1500, 2500)
    shape = [(rng.randint(1, 12), rng.randint(2, 12)) for _ in range(n)]
    if relation == "other data":
        shape2 = [(rng.randint(1, 12), rng.randint(2, 12)) for _ in range(n + rng.choice([-300, 300]))]
    elif relation == "same shape, other tokens":
        shape2 = shape
    else:  # the same lengths in all, the boundary between prompt and response moved by one
        shape2 = [(a + 1, b - 1) if rng.random() < 0.5 else (a - 1, b + 1) if a > 1 else (a + 1, b - 1)
                  for a, b in shape]
    sets = []
    for sh in (shape, shape2):
        lines = [alpaca_line(rng, a, b) for a, b in sh]
        for _ in range(3):
            lines.insert(rng.randrange(len(lines)), '{"instruction": "broken')
        sets.append("\n".join(lines) + "\n")
    return sets


# ---- the test --------------------------------------------------------------------------

class Test:
    def __init__(self, args):
        self.args = args
        self.seed = args.seed
        self.workdir = args.workdir
        self.trial_dir = os.path.join(self.workdir, "trial")
        self.prefix = os.path.join(self.trial_dir, "set")
        self.data_dir = os.path.join(self.workdir, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        # zinc.prepare's copy: `python -m zinc.prepare` finds it first on PYTHONPATH (run in the work folder)
        self.pythonpath = os.pathsep.join(
            [copy_prepare(args.prepare, os.path.join(self.workdir, "bin"))] +
            [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e])
        self.cfg = os.path.join(self.workdir, "train.json")
        with open(self.cfg, "w") as f:
            json.dump(self.train_config(), f, indent=1)
        self.refs = {}  # relation -> {"A": {ext: bytes}, "B": {ext: bytes}, "set1", "set2": paths}
        self.log = []
        self.starts = 0
        self.zinc_runs = 0
        self.reader = False
        self.wall = {}  # relation -> seconds of an uninterrupted run of set 2
        self.lines = {}  # relation -> newline-ended lines of its stderr

    def train_config(self):
        """One step of a tiny Llama on the prefix's set (a sample of 129 tokens always holds some response: a
        step whose every target is masked is an error)."""
        return {
            "train_batch_size": 2, "steps_per_print": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
            "model": {"type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "num_key_value_heads": 1},
            "data": {"type": "tokens", "path": self.prefix + ".bin", "mask_path": self.prefix + ".mask",
                     "documents_path": self.prefix + ".docs", "vocab_size": 400, "seq_len": 128},
            "run": {"steps": 1, "seed": 1, "eval_interval": 0, "checkpoint_interval": 0,
                    "output_dir": os.path.join(self.workdir, "train_out")},
        }

    # -- processes -------------------------------------------------------------------

    def command(self, data):
        return [sys.executable, "-m", "zinc.prepare", data, "--format", "alpaca", "--tokenizer", TOKENIZER,
                "--seq-len", str(SEQ_LEN), "--out", self.prefix, "--progress"]

    def spawn(self, data, env_extra=None):
        env_extra = dict(env_extra or {}, PYTHONPATH=self.pythonpath)
        env = dict(os.environ)
        env.pop("ZINC_PREPARE_FAULT", None)
        env.update(env_extra)
        cmd = self.command(data)
        err = open(os.path.join(self.workdir, "last.err"), "wb")
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                             cwd=self.workdir, start_new_session=True)
        err.close()
        self.starts += 1
        return {"p": p, "t0": t0, "cmd": cmd, "env": env_extra}

    def finish(self, h, timeout=120.0):
        p = h["p"]
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise Failure("zinc.prepare hung (killed after %.0f s): %s" % (timeout, " ".join(h["cmd"])))
        wall = time.monotonic() - h["t0"]
        err = read_bytes(os.path.join(self.workdir, "last.err")).decode("utf-8", "replace")
        r = Result(h["cmd"], h["env"], p.returncode, "", err, wall, pid=p.pid)
        self.log.append(r.shell() + "  -> rc %s" % r.rc)
        return r

    def prepare(self, data, env_extra=None):
        return self.finish(self.spawn(data, env_extra))

    def train(self):
        """zinc-train on the prefix, one step: (rc, error lines besides its warnings, stderr)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", ZINC_LOG_LEVEL="warn")
        cmd = [self.args.binary_copy, self.cfg, "--steps", "1"]
        try:
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120)
        except subprocess.TimeoutExpired:
            raise Failure("zinc-train hung (killed after 120 s): %s" % " ".join(cmd))
        self.zinc_runs += 1
        self.log.append(" ".join(shquote(a) for a in cmd) + "  -> rc %s" % r.returncode)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not WARNING_RE.match(ln)]
        return r.returncode, lines, r.stderr

    # -- files -----------------------------------------------------------------------

    def reset(self, files=None):
        rmtree(self.trial_dir)
        os.makedirs(self.trial_dir)
        for ext, data in (files or {}).items():
            write_bytes(self.prefix + "." + ext, data)

    def outputs(self):
        return {ext: read_bytes(self.prefix + "." + ext) for ext in EXTS if os.path.exists(self.prefix + "." + ext)}

    def others(self):
        """Entries of the trial folder besides the four outputs."""
        base = os.path.basename(self.prefix)
        return sorted(n for n in os.listdir(self.trial_dir) if n not in ["%s.%s" % (base, e) for e in EXTS])

    # -- references ------------------------------------------------------------------

    def references(self):
        """Per relation: the two data sets, set 1's complete outputs (A) and set 2's (B), made at the trial
        prefix (the manifest holds absolute paths), and the relation between them checked."""
        rng = random.Random("%d:data" % self.seed)
        for relation in RELATIONS:
            tag = relation.replace(",", "").replace(" ", "_")
            paths = []
            for k, text in enumerate(data_sets(rng, relation), 1):
                paths.append(os.path.join(self.data_dir, "%s_%d.jsonl" % (tag, k)))
                with open(paths[-1], "w") as f:
                    f.write(text)
            ref = {"set1": paths[0], "set2": paths[1]}
            walls = []
            for key, data in (("A", paths[0]), ("B", paths[1]), ("B", paths[1]), ("B", paths[1])):
                self.reset()
                r = self.prepare(data)
                if r.rc != 0 or "Traceback" in r.err:
                    raise Failure("the reference run %s failed: rc %s\n%s" % (r.shell(), r.rc, r.err[-2000:]))
                if self.others():
                    raise Failure("the reference run %s left %s" % (r.shell(), self.others()))
                out = self.outputs()
                if key in ref and out != ref[key]:
                    raise Failure("two uninterrupted runs of %s differ" % data)
                ref[key] = out
                if key == "B":
                    walls.append(r.wall)
                    self.lines[relation] = r.err.count("\n")
            self.wall[relation] = min(walls)
            a, b = ref["A"], ref["B"]
            same = {ext: a[ext] == b[ext] for ext in EXTS}
            want = {"other data": len(a["mask"]) != len(b["mask"]),
                    "same shape, other tokens": same["mask"] and same["docs"] and not same["bin"],
                    "same shape, other masks": (same["docs"] and not same["mask"] and not same["bin"]
                                                and len(a["mask"]) == len(b["mask"]))}[relation]
            if not want or same["json"]:
                raise Failure("the data sets for %r do not have that relation (same: %s)" % (relation, same))
            for key in ("A", "B"):
                self.reset(ref[key])
                if rule_refuses(self.prefix):
                    raise Failure("the complete set %s of %r breaks its own header's record" % (key, relation))
                rc, lines, err = self.train()
                if rc != 0:
                    raise Failure("zinc-train does not load the complete set %s of %r: rc %s: %s"
                                  % (key, relation, rc, err[-1500:]))
            self.refs[relation] = ref

    def probe_reader(self):
        """Whether zinc-train refuses a mixed set of one token count: set 1's .bin with set 2's .mask."""
        ref = self.refs["same shape, other masks"]
        self.reset(dict(ref["A"], mask=ref["B"]["mask"]))
        rc, lines, err = self.train()
        if rc == 0:
            return False
        if rc == 1 and len(lines) == 1 and lines[0].startswith("zinc-train: error: ") and \
                self.prefix + ".mask" in lines[0]:
            return True
        raise Failure("zinc-train on a mixed set neither loaded it nor refused it in one line naming %s.mask: "
                      "rc %s: %s" % (self.prefix, rc, err[-1500:]))

    # -- trials ----------------------------------------------------------------------

    def trial(self, i):
        rng = random.Random("%d:%d" % (self.seed, i))
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        relation = rng.choice(RELATIONS)
        self.log = []
        info = {"trial": i, "seed": self.seed, "kind": kind, "relation": relation, "params": {}, "problems": [],
                "outcome": None, "detail": None}
        try:
            self.kill_trial(rng, kind, relation, info)
        except Failure as e:
            info["problems"].append(str(e))
        if info["problems"]:
            info["outcome"] = FAILED
            info["commands"] = list(self.log)
        return info

    def kill_trial(self, rng, kind, relation, info):
        ref = self.refs[relation]
        p, problems = info["params"], info["problems"]
        self.reset(ref["A"])
        phase = None
        if kind == "fault":
            phase = rng.choice(PHASES)
            p["fault"] = phase
            r = self.prepare(ref["set2"], {"ZINC_PREPARE_FAULT": phase})
            if r.rc != -signal.SIGKILL:
                problems.append("the hook %s did not kill the run: rc %s: %s" % (phase, r.rc, r.err[-1500:]))
            info["detail"] = "killed at %s" % phase
        else:
            sig = signal.SIGKILL if kind == "kill9" else signal.SIGTERM
            at = self.moment(rng, relation)
            p["at"] = at
            h = self.spawn(ref["set2"])
            self.wait_for(h, at)
            try:
                h["p"].send_signal(sig)
            except ProcessLookupError:
                pass
            r = self.finish(h)
            ok = (0, -sig) if kind == "kill9" else (0, 128 + sig, -sig)
            if r.rc not in ok:
                problems.append("exit %s after %s (want one of %s): %s"
                                % (r.rc, signal.Signals(sig).name, ok, r.err[-1500:]))
            info["detail"] = ("finished before the signal" if r.rc == 0 else
                              "killed" if r.rc == -sig else "stopped by its handler")
            info["detail"] += " (%s)" % next(iter(at))
        if "Traceback" in r.err:
            problems.append("a traceback: %s" % r.err[-1500:])
        self.check_after_kill(rng, kind, relation, phase, r, info)
        if not problems:
            self.check_rerun(relation, info)

    def moment(self, rng, relation):
        """A random moment of a run: a time after its start, a time after the n-th line of its stderr, or a
        time after the k-th rename of an output is seen (a new inode under its name)."""
        u = rng.random()
        if u < 0.4:
            return {"ms_after_start": round(rng.uniform(0.0, 1.2 * self.wall[relation]) * 1000, 3)}
        if u < 0.6:
            return {"after_line": rng.randint(1, max(1, self.lines[relation])),
                    "us_later": round(rng.uniform(0.0, 3000.0), 1)}
        return {"after_rename": rng.randint(1, 3), "us_later": round(rng.choice([0.0, rng.uniform(0.0, 400.0)]), 1)}

    def wait_for(self, h, at):
        if "ms_after_start" in at:
            left = h["t0"] + at["ms_after_start"] / 1000 - time.monotonic()
            if left > 0:
                time.sleep(left)
            return
        if "after_line" in at:
            path = os.path.join(self.workdir, "last.err")
            while h["p"].poll() is None:
                if read_bytes(path).count(b"\n") >= at["after_line"]:
                    break
                time.sleep(0.0002)
        else:
            path = self.prefix + "." + RENAME_ORDER[at["after_rename"] - 1]
            before = os.stat(path).st_ino
            while h["p"].poll() is None:
                try:
                    if os.stat(path).st_ino != before:
                        break
                except FileNotFoundError:
                    pass
        deadline = time.monotonic() + at["us_later"] / 1e6
        while time.monotonic() < deadline:
            pass

    def check_after_kill(self, rng, kind, relation, phase, r, info):
        """Classifies what the stopped run left and checks it is allowed (see the module docstring)."""
        ref, problems = self.refs[relation], info["problems"]
        self.snapshot(info)
        out = self.outputs()
        state = {}  # per file: A (the old set's), B (the new one's), A=B (both are), missing or neither
        for ext in EXTS:
            data = out.get(ext)
            state[ext] = "missing" if data is None else "=".join(k for k in "AB" if data == ref[k][ext]) or "neither"
        info["state"] = "".join("%s:%s " % kv for kv in state.items()).strip()
        if phase is not None and r.rc == -signal.SIGKILL:
            want = {ext: ref["B" if ext in RENAMED[phase] else "A"][ext] for ext in EXTS}
            if phase in MANIFEST_REMOVED:
                del want["json"]
            if out != want:
                problems.append("killed at %s, the files are %s; the rename order gives %s"
                                % (phase, info["state"], ", ".join(e for e in EXTS if e in RENAMED[phase]) or
                                   "no new file"))
        base = os.path.basename(self.prefix)
        left = self.others()
        if r.rc == 0:
            allowed = re.compile("(?!)")  # nothing
        elif r.rc == 128 + signal.SIGTERM:  # the handler removed the temporaries; the lock file stays if the
            allowed = re.compile(r"\.%s\.lock" % re.escape(base))  # signal came while it was being taken
        else:  # killed: its temporaries and lock file, for the next run to remove
            allowed = re.compile(r"\.%s\.(?:(?:%s)\.tmp-%d|lock)" % (re.escape(base), "|".join(EXTS), r.pid))
        stray = [n for n in left if not allowed.fullmatch(n)]
        if stray:
            problems.append("left in the folder: %s (rc %s)" % (stray, r.rc))
        data = ("bin", "mask", "docs")
        bare = state["json"] == "missing"  # the old manifest removed, the new one not yet renamed in
        if any(state[e] in ("missing", "neither") for e in data) or state["json"] == "neither":
            problems.append("a file that is neither the old set's nor the new one's: %s" % info["state"])
            return
        if r.rc == 128 + signal.SIGTERM and (bare or not all("A" in s for s in state.values())):
            problems.append("stopped by SIGTERM (exit 143), yet not the old set: %s; a SIGTERM stops the run "
                            "before its commit or lets the commit end" % info["state"])
            return
        if not bare and not any(k in state["json"] and k in state["bin"] for k in "AB"):
            problems.append("the manifest does not describe the .bin beside it: %s" % info["state"])
            return
        if all("A" in state[e] for e in data):
            info["outcome"] = OLD_BARE if bare else OLD
            return
        if all("B" in state[e] for e in data):
            info["outcome"] = NEW_BARE if bare else NEW
            return
        refused = rule_refuses(self.prefix)
        if not refused:
            problems.append("a mixed set that the rule does not refuse: %s" % info["state"])
            return
        info["refused"] = refused
        if not self.reader:
            info["outcome"] = REFUSED_RULE
            return
        rc, lines, err = self.train()
        if rc != 1 or len(lines) != 1 or not lines[0].startswith("zinc-train: error: "):
            problems.append("zinc-train on the mixed set (%s): rc %s, want 1 and one line 'zinc-train: error: ...': "
                            "%s" % (info["state"], rc, err[-1500:]))
        elif not any(self.prefix + "." + ext in lines[0] for ext in refused):
            problems.append("zinc-train's error names none of %s: %s" % (refused, lines[0]))
        else:
            info["outcome"] = REFUSED
            info["error"] = lines[0]

    def check_rerun(self, relation, info):
        """An uninterrupted run after the kill: exit 0, exactly B, no temporary and no lock file left."""
        r = self.prepare(self.refs[relation]["set2"])
        problems = info["problems"]
        if r.rc != 0 or "Traceback" in r.err:
            problems.append("the run after the kill failed: rc %s: %s" % (r.rc, r.err[-1500:]))
            return
        if self.outputs() != self.refs[relation]["B"]:
            problems.append("the run after the kill did not give the reference outputs")
        if self.others():
            problems.append("left after the run that followed the kill: %s" % self.others())

    def snapshot(self, info):
        snapshot(self.workdir, self.trial_dir, info)

    # -- driver ----------------------------------------------------------------------

    def main(self):
        t0 = time.monotonic()
        a = self.args
        print("crash_prepare: %s, %s, %d trials, seed %d; work folder %s"
              % (a.prepare, a.binary, a.trials, a.seed, self.workdir), flush=True)
        try:
            self.references()
            self.reader = self.probe_reader()
        except Failure as e:
            print("FAIL (reference): %s" % e)
            for c in self.log:
                print("    " + c)
            return 1, None
        if not self.reader and a.require_reader:
            print("FAIL: zinc-train loads a mixed set (no check of the .mask and .docs against the .bin's header)")
            return 1, None
        ref_s = time.monotonic() - t0
        print("reference: %s; zinc-train %s" % (
            ", ".join("%s: %.0f ms, %d/%d tokens" % (rel, 1000 * self.wall[rel],
                                                    len(self.refs[rel]["A"]["mask"]), len(self.refs[rel]["B"]["mask"]))
                      for rel in RELATIONS),
            "refuses mixed sets (checked by it)" if self.reader else
            "has no set check: refused states are checked by the rule in Python only"), flush=True)
        indices = [a.only] if a.only is not None else list(range(a.trials))
        results, failed_dir = run_trials(self, indices, t0, 25, lambda rs: outcome_counts(rs, OUTCOMES), FAILED)
        report = self.summarize(results, time.monotonic() - t0, ref_s)
        return exit_code(report, results, failed_dir, FAILED), report

    def print_failure(self, info):
        print("FAIL trial %d (seed %d, kind %s, relation %r): %s"
              % (info["trial"], info["seed"], info["kind"], info["relation"], json.dumps(info["params"])))
        print("  files after the stop: %s" % info.get("state"))
        for pr in info["problems"]:
            print("  - " + pr)
        print("  commands of the trial:")
        for c in info.get("commands", []):
            print("    " + c)
        print("  rerun: python3 %s %s --seed %d --only %d --workdir DIR"
              % (sys.argv[0], self.args.binary, info["seed"], info["trial"]), flush=True)

    def summarize(self, results, wall, ref_s):
        kinds = {k: {"title": KIND_TITLES[k], "trials": 0, "outcomes": {o: 0 for o in OUTCOMES}, "details": {}}
                 for k in KINDS}
        relations = {rel: {o: 0 for o in OUTCOMES} for rel in RELATIONS}
        for r in results:
            e = kinds[r["kind"]]
            e["trials"] += 1
            e["outcomes"][r["outcome"]] += 1
            relations[r["relation"]][r["outcome"]] += 1
            d = "%s -> %s" % (r.get("detail") or "?", r["outcome"])
            e["details"][d] = e["details"].get(d, 0) + 1
        totals = {o: sum(kinds[k]["outcomes"][o] for k in KINDS) for o in OUTCOMES}
        print()
        widths = [max(len(o), 6) for o in OUTCOMES]
        print("%-44s %6s " % ("trial kind", "trials") + " ".join("%*s" % (w, o) for w, o in zip(widths, OUTCOMES)))
        for k in KINDS:
            e = kinds[k]
            print("%-44s %6d " % (e["title"], e["trials"]) +
                  " ".join("%*d" % (w, e["outcomes"][o]) for w, o in zip(widths, OUTCOMES)))
        print("%-44s %6d " % ("total", len(results)) +
              " ".join("%*d" % (w, totals[o]) for w, o in zip(widths, OUTCOMES)))
        for rel in RELATIONS:
            print("%-44s %6d " % ("  second data set: " + rel, sum(relations[rel].values())) +
                  " ".join("%*d" % (w, relations[rel][o]) for w, o in zip(widths, OUTCOMES)))
        for k in KINDS:
            if kinds[k]["details"]:
                print("  %s:" % k)
                for d, n in sorted(kinds[k]["details"].items(), key=lambda x: (-x[1], x[0])):
                    print("    %5d  %s" % (n, d))
        print("%d zinc.prepare runs, %d zinc-train runs; %.1f s (references %.1f s)"
              % (self.starts, self.zinc_runs, wall, ref_s))
        return {
            "command": [sys.executable] + sys.argv,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "prepare": self.args.prepare, "binary": os.path.abspath(self.args.binary),
            "reader_checked_by_zinc_train": self.reader,
            "seed": self.seed, "trials": len(results), "wall_s": round(wall, 2), "reference_s": round(ref_s, 2),
            "kinds": kinds, "relations": relations, "totals": totals,
            "failures": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results
                         if r["outcome"] == FAILED],
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", nargs="?", default=os.path.join(SOURCE, "build", "tools", "zinc-train"),
                    help="the zinc-train binary (default: build/tools/zinc-train of this tree)")
    add_common_args(ap)
    ap.add_argument("--prepare", metavar="PATH",
                    help="zinc.prepare's prepare.py, or the folder holding it and its _prepare*.py modules "
                         "(default: zinc/prepare.py found on PYTHONPATH, else this tree's)")
    ap.add_argument("--require-reader", action="store_true",
                    help="fail when zinc-train loads a mixed set (instead of checking the rule in Python)")
    args = ap.parse_args()
    if not os.access(args.binary, os.X_OK):
        print("crash_prepare: %s is not an executable" % args.binary)
        return 2
    args.prepare = find_prepare(args.prepare)
    if not os.path.isfile(args.prepare):
        print("crash_prepare: %s: no such file" % args.prepare)
        return 2
    if importlib.util.find_spec("tokenizers") is None:
        print("crash_prepare: skipped: zinc.prepare needs the tokenizers package (scripts/setup.sh installs it)")
        return 77
    # zinc-train is copied here, zinc.prepare's modules by Test (copy_prepare), into the work folder
    return run_in_workdir(args, "zinc-crash-prepare-", {"binary_copy": args.binary}, Test)


if __name__ == "__main__":
    sys.exit(main())
