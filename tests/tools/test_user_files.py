"""The files a user gives zinc and the files zinc writes for them (issue 49).

Every writer of a user's file follows one rule (docs/files.md): it never
writes over what the run reads (compared by device and inode, not by the
path's spelling), it replaces a set of files as one unit, and a reader can
tell a complete set from a partial one. Each test here is one hole a
hostile user found, and fails without its fix:

- an export into the folder the model was loaded from (also through a
  symlink or src/../src) is refused before training, and the model is left
  byte for byte; so is --save-weights onto one of its files;
- an export into a folder holding an earlier export of the other layout
  (one file against shards) leaves no stale weights a reader would prefer,
  and keeps the user's own files; a kill at any phase of the export leaves
  the old folder or the new one (tests/tools/crash_export.py tries hundreds);
- zinc-export's plain safetensors sets: the same, and never inside the
  checkpoint it reads;
- the monitors' job_name is one folder name, and no monitor folder lies in a
  checkpoint tag that a save would swap out;
- a run in which no step updated (every target masked) exits 1 and says so,
  never "final loss 0.0";
- a config that is /dev/zero or a FIFO is refused at once, not read without
  end; --save-pretrained "" is refused; a resume past run.steps is refused;
- a checkpoint shard with bytes appended is refused naming the file.

Run by CTest (user_files) with ZINC_TRAIN, ZINC_EXPORT and ZINC_ROOT set.
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import threading

import pytest

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
ZINC_TRAIN = os.environ.get("ZINC_TRAIN", os.path.join(ROOT, "build", "tools", "zinc-train"))
ZINC_EXPORT = os.environ.get("ZINC_EXPORT", os.path.join(ROOT, "build", "tools", "zinc-export"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")


def run(*args, env=None, timeout=240):
    return subprocess.run(list(args), env=env or ENV, capture_output=True, text=True, timeout=timeout)


def errors(r):
    """stderr without the log lines: what a user reads as the error."""
    return [l for l in r.stderr.splitlines() if l and not l.startswith("zinc[")]


def digest(folder):
    """Every file under `folder` (relative name -> sha256), dot files included."""
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(base, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def copy_fixture(tmp, name="llama_gqa"):
    src = tmp / name
    src.mkdir()
    for f in os.listdir(os.path.join(FIXTURES, name)):
        with open(os.path.join(FIXTURES, name, f), "rb") as a, open(src / f, "wb") as b:
            b.write(a.read())
    return src


def config(tmp, model_dir, **run):
    doc = {"train_batch_size": 2, "model": {"from_pretrained": str(model_dir)},
           "data": {"type": "synthetic", "vocab_size": 96, "seq_len": 12},
           "run": dict({"steps": 1, "output_dir": str(tmp / "run")}, **run)}
    path = tmp / "cfg.json"
    path.write_text(json.dumps(doc))
    return str(path)


def model_files(folder):
    return sorted(f for f in os.listdir(folder)
                  if f == "config.json" or f.endswith(".safetensors") or f.endswith(".index.json"))


# ---- exports never replace what the run reads ------------------------------------------------


def test_an_export_into_the_model_it_reads_is_refused_before_training(tmp_path):
    src = copy_fixture(tmp_path)
    before = digest(src)
    cfg = config(tmp_path, src)
    os.symlink(src, tmp_path / "link")
    for out in (str(src), str(src) + "/", str(tmp_path / "link"), str(src / ".." / src.name), str(tmp_path)):
        r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-pretrained", out, "--save-dtype", "bf16")
        assert r.returncode == 1, (out, r.stdout, r.stderr)
        assert "step 1" not in r.stdout, out  # refused before training
        (line,) = errors(r)
        assert "--save-pretrained" in line and ("which this run reads" in line or "holds the folder" in line), line
        assert digest(src) == before, out
    # zinc-export --format hf into the folder the checkpoint's model came from.
    ck = tmp_path / "ck"
    r = run(ZINC_TRAIN, cfg, "--steps", "2", "--set", "run.checkpoint_interval=2", "--set", "run.checkpoint_dir=%s" % ck)
    assert r.returncode == 0, r.stderr
    for out in (str(src), str(tmp_path / "link"), str(ck), str(ck / "global_step2")):
        r = run(ZINC_EXPORT, str(ck), "--format", "hf", "--out", out)
        assert r.returncode == 1 and "which this run reads" in r.stderr, (out, r.stderr)
    assert digest(src) == before
    # --save-weights onto the model's own weights file, or into its folder.
    for out in (src / "model.safetensors", src / "other.safetensors"):
        r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-weights", str(out))
        assert r.returncode == 1 and "--save-weights" in r.stderr and "which this run reads" in r.stderr, r.stderr
        assert "step 1" not in r.stdout
    assert digest(src) == before


def test_an_export_replaces_the_other_layout_and_keeps_the_users_files(tmp_path):
    src = copy_fixture(tmp_path)
    cfg = config(tmp_path, src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    os.symlink("README.md", out / "notes.md")

    def save(*extra):
        r = run(ZINC_TRAIN, cfg, "--steps", "0", "--save-pretrained", str(out), "--save-dtype", "fp32", *extra)
        assert r.returncode == 0, r.stderr

    save()
    assert model_files(out) == ["config.json", "model.safetensors"]
    save("--max-shard-size", "30KB")  # sharded over single: the single file would win
    files = model_files(out)
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    with open(out / "model.safetensors.index.json") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert files == sorted(["config.json", "model.safetensors.index.json"] + shards)
    save("--max-shard-size", "60KB")  # fewer shards: the extra old ones go
    with open(out / "model.safetensors.index.json") as f:
        fewer = sorted(set(json.load(f)["weight_map"].values()))
    assert len(fewer) < len(shards) and model_files(out) == sorted(["config.json", "model.safetensors.index.json"] + fewer)
    save()  # single over sharded: the index would win
    assert model_files(out) == ["config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "my notes" and os.readlink(out / "notes.md") == "README.md"
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(".out.")]
    assert leftovers == [], leftovers
    # A folder inside is refused (an export keeps files, not folders), before training.
    (out / "sub").mkdir()
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-pretrained", str(out))
    assert r.returncode == 1 and "holds the folder sub" in r.stderr and "step 1" not in r.stdout, r.stderr


@pytest.mark.parametrize("phase", ["shard", "staged", "linked", "swapped"])
def test_a_kill_during_an_export_leaves_the_old_folder_or_the_new_one(tmp_path, phase):
    src = copy_fixture(tmp_path)
    cfg = config(tmp_path, src)
    out = tmp_path / "out"
    r = run(ZINC_TRAIN, cfg, "--steps", "0", "--save-pretrained", str(out), "--save-dtype", "fp32")
    assert r.returncode == 0, r.stderr
    (out / "README.md").write_text("mine")
    old = digest(out)
    r = run(ZINC_TRAIN, cfg, "--steps", "2", "--save-pretrained", str(out), "--save-dtype", "fp32",
            "--max-shard-size", "30KB", env=dict(ENV, ZINC_EXPORT_FAULT=phase))
    assert r.returncode == -9, (r.returncode, r.stderr)
    now = digest(out)
    if phase == "swapped":  # the new folder is in place
        assert "model.safetensors.index.json" in now and "model.safetensors" not in now
        assert now["README.md"] == old["README.md"]
    else:
        assert now == old
    # The next export cleans up what the killed one left and completes.
    r = run(ZINC_TRAIN, cfg, "--steps", "2", "--save-pretrained", str(out), "--save-dtype", "fp32",
            "--max-shard-size", "30KB")
    assert r.returncode == 0, r.stderr
    assert [f for f in os.listdir(tmp_path) if f.startswith(".out.")] == []
    assert (out / "README.md").read_text() == "mine"


def test_zinc_export_safetensors_sets_replace_the_other_layout_and_stay_out_of_the_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    r = run(ZINC_TRAIN, os.path.join(ROOT, "configs", "default.json"), "--steps", "1", "--set", "run.eval_interval=0",
            "--set", "run.checkpoint_interval=1", "--set", "run.checkpoint_dir=%s" % ck)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "w.safetensors"
    names = lambda: sorted(f for f in os.listdir(tmp_path) if f.startswith("w"))
    assert run(ZINC_EXPORT, str(ck), "--out", str(out)).returncode == 0
    assert names() == ["w.safetensors"]
    assert run(ZINC_EXPORT, str(ck), "--out", str(out), "--max-shard-size", "1MB").returncode == 0
    sharded = names()
    assert "w.safetensors" not in sharded and "w.safetensors.index.json" in sharded and len(sharded) > 2, sharded
    assert run(ZINC_EXPORT, str(ck), "--out", str(out)).returncode == 0
    assert names() == ["w.safetensors"]
    assert [f for f in os.listdir(tmp_path) if f.startswith(".w")] == []
    r = run(ZINC_EXPORT, str(ck), "--out", str(ck / "global_step1" / "w.safetensors"))
    assert r.returncode == 1 and "inside the checkpoint" in r.stderr, r.stderr


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_zinc_export_stopped_by_a_signal_removes_what_it_wrote(tmp_path, fmt):
    """A SIGTERM in zinc-export (ZINC_EXPORT_FAULT=append:term: at the first write of weights) ended it at once,
    its temporaries left beside --out. It now stops at the next write, removes what it wrote, says so and exits
    143, and --out holds what it held before."""
    src = copy_fixture(tmp_path)
    ck = tmp_path / "ck"
    r = run(ZINC_TRAIN, config(tmp_path, src, checkpoint_dir=str(ck), checkpoint_interval=1))
    assert r.returncode == 0, r.stderr
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / ("w.safetensors" if fmt == "safetensors" else "model")
    args = [ZINC_EXPORT, str(ck), "--format", fmt, "--out", str(out), "--max-shard-size", "30KB"]
    assert run(*args).returncode == 0
    (tmp_path / "out" / "notes.txt").write_text("mine")
    old = digest(tmp_path / "out")
    r = run(*args, env=dict(ENV, ZINC_EXPORT_FAULT="append:term"))
    assert r.returncode == 143, (r.returncode, r.stderr)
    said = errors(r)
    assert len(said) == 2 and "SIGTERM: stopping at the next write" in said[0], said
    assert "stopped by SIGTERM while writing" in said[1] and "nothing was written to " + str(out) in said[1], said
    assert digest(tmp_path / "out") == old  # no temporary, staging folder or lock left; the old export whole
    assert run(*args).returncode == 0


def test_an_export_name_with_no_room_for_its_companions_is_refused_before_any_work(tmp_path):
    """A 232-byte --out fitted, but its shards' temporaries (.STEM-00001-of-00006.safetensors.zinc-tmp) did not:
    the export failed part-way (zinc-train's after training). The longest name beside it is checked first."""
    ck = tmp_path / "ck"
    r = run(ZINC_TRAIN, os.path.join(ROOT, "configs", "default.json"), "--steps", "1", "--set", "run.eval_interval=0",
            "--set", "run.checkpoint_interval=1", "--set", "run.checkpoint_dir=%s" % ck)
    assert r.returncode == 0, r.stderr
    fits, past = "w" * 215 + ".safetensors", "w" * 216 + ".safetensors"
    r = run(ZINC_EXPORT, str(ck), "--out", str(tmp_path / past), "--max-shard-size", "100KB")
    assert r.returncode == 1 and "its name is 228 bytes" in r.stderr and "choose a name of at most 227 bytes" in r.stderr, \
        r.stderr
    r = run(ZINC_TRAIN, os.path.join(ROOT, "configs", "default.json"), "--steps", "1", "--set", "run.eval_interval=0",
            "--save-weights", str(tmp_path / past))
    assert r.returncode == 1 and "choose a name of at most 227 bytes" in r.stderr and "step 1" not in r.stdout, r.stderr
    r = run(ZINC_EXPORT, str(ck), "--out", str(tmp_path / fits), "--max-shard-size", "100KB")
    assert r.returncode == 0, r.stderr
    assert len([f for f in os.listdir(tmp_path) if f.startswith("w")]) > 2
    # A model folder: its staging folder (.NAME.zinc-staging) is the longest, refused before training.
    src = copy_fixture(tmp_path)
    r = run(ZINC_TRAIN, config(tmp_path, src), "--save-pretrained", str(tmp_path / ("p" * 242)))
    assert r.returncode == 1 and "choose a name of at most 241 bytes" in r.stderr and "step 1" not in r.stdout, \
        r.stderr


# ---- monitors ---------------------------------------------------------------------------------


def test_a_monitor_job_name_is_one_folder_name_and_never_a_checkpoint_tag(tmp_path):
    cfg = os.path.join(ROOT, "configs", "default.json")
    for job in ("../../x", "/abs", "a/b", "..", ".", ""):
        r = run(ZINC_TRAIN, cfg, "--steps", "1", "--set", "tensorboard.enabled=true",
                "--set", "tensorboard.output_path=%s" % tmp_path, "--set", "tensorboard.job_name=%s" % json.dumps(job))
        assert r.returncode == 1 and "tensorboard.job_name: must be one folder name" in r.stderr, (job, r.stderr)
    ck = tmp_path / "ck"
    for section in ("tensorboard", "csv_monitor"):
        r = run(ZINC_TRAIN, cfg, "--steps", "2", "--set", "run.checkpoint_interval=1",
                "--set", "run.checkpoint_dir=%s" % ck, "--set", "%s.enabled=true" % section,
                "--set", "%s.output_path=%s" % (section, ck), "--set", "%s.job_name=global_step2" % section)
        assert r.returncode == 1 and "lies in the checkpoint tag global_step2" in r.stderr, r.stderr
        assert "step 1" not in r.stdout


def test_a_resumed_run_appends_its_csv_rows_without_a_second_header(tmp_path):
    # DeepSpeed's csv_monitor writes the header once per process, so a resumed
    # run put a second header row in the middle of the curve; and a row a kill
    # cut short merged with the next run's first.
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "steps_per_print": 1,
                               "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"},
                               "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
                               "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16},
                               "run": {"steps": 4, "checkpoint_interval": 2, "checkpoint_dir": str(tmp_path / "ck")}}))
    assert run(ZINC_TRAIN, str(cfg), "--steps", "2").returncode == 0
    loss = tmp_path / "csv" / "j" / "Train_Samples_train_loss.csv"
    with open(loss, "rb+") as f:  # a row cut short, as a kill leaves it
        f.seek(-2, os.SEEK_END)
        f.truncate()
    r = run(ZINC_TRAIN, str(cfg), "--resume")
    assert r.returncode == 0, r.stderr
    lines = loss.read_text().splitlines()
    assert lines[0] == "step,train_loss" and lines.count("step,train_loss") == 1, lines
    assert len(lines) == 5 and all(len(l.split(",")) == 2 for l in lines), lines


def test_check_refuses_the_folders_a_run_cannot_create(tmp_path):
    # --check tried access(), which says yes to root everywhere: /proc, /sys,
    # a 300-byte name and a path past PATH_MAX passed it, and the run then
    # stopped. It now makes (and removes) a folder where the run would.
    cfg = os.path.join(ROOT, "configs", "default.json")
    cases = [
        (("tensorboard.enabled=true", "tensorboard.output_path=/proc"), "tensorboard.output_path", "takes no new folder"),
        (("csv_monitor.enabled=true", "csv_monitor.output_path=/sys/kernel"), "csv_monitor.output_path",
         "takes no new folder"),
        (("tensorboard.enabled=true", "tensorboard.output_path=%s" % tmp_path,
          "tensorboard.job_name=%s" % json.dumps("j" * 300)), "tensorboard.job_name",  # the key at fault
         "is 300 bytes, past the file system's 255"),
        (("csv_monitor.enabled=true", "csv_monitor.output_path=%s" % (str(tmp_path) + "/d" * 2100)),
         "csv_monitor.output_path", "longer than the system's"),
        (("zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=\"nvme\"",
          "zero_optimization.offload_optimizer.nvme_path=\"/proc\""), "offload_optimizer.nvme_path", "takes no new folder"),
    ]
    for sets, key, words in cases:
        args = [a for s in sets for a in ("--set", s)]
        for extra in (("--check",), ("--steps", "1")):
            r = run(ZINC_TRAIN, cfg, *args, *extra)
            assert r.returncode == 1, (sets, extra, r.stdout, r.stderr)
            if extra == ("--check",):
                assert key in r.stdout + r.stderr and words in r.stdout + r.stderr, (sets, r.stdout, r.stderr)
    assert [f for f in os.listdir(tmp_path) if f.startswith(".zinc-check")] == []


def test_an_nvme_folder_is_neither_in_an_export_folder_nor_in_a_checkpoint_tag(tmp_path):
    # The run's scratch folder appeared in the --save-pretrained folder after
    # the start's checks: the run trained to the end and its export was then
    # refused. Inside a checkpoint tag, a save removed the scratch files
    # under the running engine. Both are refused at the start now.
    cfg = tmp_path / "c.json"
    out = tmp_path / "out"
    ck = tmp_path / "ck"
    (ck / "global_step5").mkdir(parents=True)
    out.mkdir()
    doc = {"train_batch_size": 4, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(out)}},
           "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
           "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16},
           "run": {"steps": 2, "checkpoint_dir": str(ck)}}
    cfg.write_text(json.dumps(doc))
    r = run(ZINC_TRAIN, str(cfg), "--save-pretrained", str(out))
    assert r.returncode == 1 and "which this run reads" in r.stderr and "step 1" not in r.stdout, (r.stdout, r.stderr)
    doc["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(ck / "global_step5")
    cfg.write_text(json.dumps(doc))
    for extra in ((), ("--check",)):
        r = run(ZINC_TRAIN, str(cfg), *extra)
        assert r.returncode == 1, (extra, r.stdout, r.stderr)
        assert "zero_optimization.offload_optimizer.nvme_path" in r.stdout + r.stderr
        assert "lies in the checkpoint tag global_step5" in r.stdout + r.stderr, (r.stdout, r.stderr)


def small_checkpoint(tmp, steps=4, interval=2):
    cfg = tmp / "gpt.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32},
                               "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16},
                               "run": {"steps": steps, "checkpoint_interval": interval, "checkpoint_dir": str(tmp / "ck")}}))
    r = run(ZINC_TRAIN, str(cfg))
    assert r.returncode == 0, r.stderr
    return str(cfg), tmp / "ck"


def test_a_save_never_replaces_a_tag_folder_zinc_did_not_write(tmp_path):
    # A DeepSpeed global_step2 (or a user's file of that name) in the
    # checkpoint folder was swapped out and deleted by the save of that tag.
    ck = tmp_path / "ck"
    (ck / "global_step2").mkdir(parents=True)
    (ck / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"deepspeed")
    (ck / "global_step4").write_bytes(b"a file of the user's")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
                               "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16},
                               "run": {"steps": 4, "checkpoint_interval": 2, "checkpoint_dir": str(ck)}}))
    r = run(ZINC_TRAIN, str(cfg))
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "is not a zinc checkpoint tag" in line and "global_step" in line, line
    assert (ck / "global_step2" / "mp_rank_00_model_states.pt").read_bytes() == b"deepspeed"
    assert (ck / "global_step4").read_bytes() == b"a file of the user's"


def test_exports_stay_out_of_checkpoint_tags_and_model_folders(tmp_path):
    # An export into a sibling tag of the checkpoint it read was accepted and
    # pruned (or swapped out) with the tag later; --save-pretrained into a
    # subfolder of the pretrained model replaced the files kept there.
    cfg, ck = small_checkpoint(tmp_path)
    (ck / ".global_step6.partial").mkdir()
    for out in (ck / "global_step2" / "final.safetensors", ck / ".global_step6.partial" / "w.safetensors"):
        r = run(ZINC_EXPORT, str(ck), "--out", str(out))
        assert r.returncode == 1 and "lies inside the checkpoint tag" in r.stderr, (out, r.stderr)
        assert not out.exists()
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-weights", str(ck / "global_step2" / "w.safetensors"))
    assert r.returncode == 1 and "lies inside" in r.stderr and "step 1" not in r.stdout, r.stderr
    assert run(ZINC_EXPORT, str(ck), "--out", str(ck / "beside.safetensors")).returncode == 0  # beside the tags: fine
    src = copy_fixture(tmp_path)
    (src / "original").mkdir()
    (src / "original" / "params.json").write_text("{}")
    before = digest(src)
    r = run(ZINC_TRAIN, config(tmp_path, src), "--steps", "1", "--save-pretrained", str(src / "original"))
    assert r.returncode == 1 and "lies inside the model folder" in r.stderr and "step 1" not in r.stdout, r.stderr
    assert digest(src) == before
    os.symlink(tmp_path / "nowhere" / "x", tmp_path / "dangling")  # a link to nothing: refused at the start
    r = run(ZINC_TRAIN, config(tmp_path, src), "--steps", "1", "--save-pretrained", str(tmp_path / "dangling"))
    assert r.returncode == 1 and "is a symbolic link to" in r.stderr and "step 1" not in r.stdout, r.stderr


def test_a_sharded_export_killed_before_its_index_leaves_the_old_set_whole(tmp_path):
    # The old index was removed first and the new shards renamed over the
    # old ones one by one: a kill there left shards of two exports and no
    # index (12 of 40 trials in the hostile sweep).
    cfg, ck = small_checkpoint(tmp_path)
    out = tmp_path / "x" / "m.safetensors"
    out.parent.mkdir()
    (out.parent / "README.md").write_text("mine")

    def load_set():
        index = json.loads((out.parent / "m.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        for f in files:
            assert (out.parent / f).is_file(), f
        return files

    assert run(ZINC_EXPORT, str(ck), "--out", str(out), "--max-shard-size", "20KB").returncode == 0
    first = load_set()
    assert len(first) > 1 and all("-b." not in f for f in first), first
    old = {f: (out.parent / f).read_bytes() for f in first}
    env = dict(ENV, ZINC_EXPORT_FAULT="set_committed")
    r = run(ZINC_EXPORT, str(ck), "--out", str(out), "--max-shard-size", "20KB", env=env)
    assert r.returncode != 0
    assert load_set() == first and all((out.parent / f).read_bytes() == old[f] for f in first)
    r = run(ZINC_EXPORT, str(ck), "--out", str(out), "--max-shard-size", "20KB")
    assert r.returncode == 0, r.stderr
    second = load_set()
    assert len(second) == len(first) and all(f.endswith("-b.safetensors") for f in second), second
    left = sorted(f for f in os.listdir(out.parent) if not f.startswith("."))
    assert left == sorted(second + ["README.md", "m.safetensors.index.json"]), left
    assert run(ZINC_EXPORT, str(ck), "--out", str(out), "--max-shard-size", "20KB").returncode == 0
    assert load_set() == first  # the plain names again


def test_an_edited_metadata_and_a_file_size_limit_get_one_line(tmp_path):
    cfg, ck = small_checkpoint(tmp_path)
    meta = ck / "global_step4" / "metadata.json"
    good = meta.read_bytes()
    meta.write_bytes(good + b"\x00garbage")  # JSON parsers stop at a NUL: this passed
    r = run(ZINC_EXPORT, str(ck), "--out", str(tmp_path / "a.safetensors"))
    assert r.returncode == 1 and "a NUL byte at offset" in r.stderr and "metadata.json" in r.stderr, r.stderr
    meta.write_bytes(good)
    # ulimit -f: a write fails with EFBIG, reported naming the file; SIGXFSZ
    # ended zinc-export without a word (exit 153).
    r = subprocess.run(["bash", "-c", 'ulimit -f 16; exec "$0" "$@"', ZINC_EXPORT, str(ck), "--out",
                        str(tmp_path / "big.safetensors")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "File too large" in r.stderr and "big.safetensors" in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "big.safetensors").exists()


# ---- runs that trained nothing ------------------------------------------------------------


def tokens_with_mask(tmp, mask_byte, docs=None):
    """A headerless uint16 token file, its mask (every byte mask_byte) and optionally a documents file."""
    n = 400
    (tmp / "t.bin").write_bytes(b"".join(((i * 7) % 50).to_bytes(2, "little") for i in range(n)))
    (tmp / "t.mask").write_bytes(bytes([mask_byte]) * n)
    data = {"type": "tokens", "path": str(tmp / "t.bin"), "mask_path": str(tmp / "t.mask"), "seq_len": 16,
            "vocab_size": 64}
    if docs is not None:
        (tmp / "t.docs").write_bytes(b"".join(d.to_bytes(8, "little") for d in docs))
        data["documents_path"] = str(tmp / "t.docs")
    return data


def test_a_mask_without_a_target_is_refused_before_training(tmp_path):
    # --check said ok (it reads the mask), and the run trained its steps on
    # nothing, then exited 1.
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
                               "data": tokens_with_mask(tmp_path, 0), "run": {"steps": 3}}))
    for extra in (("--check",), ()):
        r = run(ZINC_TRAIN, str(cfg), *extra)
        assert r.returncode == 1 and "step 1" not in r.stdout, (extra, r.stdout, r.stderr)
        assert "data.mask_path" in r.stdout + r.stderr and "masks every one of its 400 tokens" in r.stdout + r.stderr


def test_a_run_in_which_no_step_updated_exits_1(tmp_path):
    data = tokens_with_mask(tmp_path, 1, range(400))  # every token starts a document: no target seen
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
                               "data": data, "run": {"steps": 3, "output_dir": str(tmp_path / "run")}}))
    out = tmp_path / "exp"
    r = run(ZINC_TRAIN, str(cfg), "--save-pretrained", str(out))
    assert r.returncode == 1, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "none of the 3 steps of this run updated the weights" in line and "no export was written" in line, line
    assert "final loss 0.0" not in r.stdout
    assert not os.path.exists(out / "config.json")
    r = run(ZINC_TRAIN, str(cfg), "--json")
    steps = [e for e in (json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")) if e["event"] == "step"]
    assert steps and all(s["loss"] is None for s in steps), steps  # NaN: no loss, never 0


def test_a_static_loss_scale_that_overflows_every_step_exits_1_and_a_fraction_shows(tmp_path):
    # A static scale never comes down: the run said "normal in a run's first
    # steps" and exited 0, and a scale of 0.5 showed as "loss scale 0".
    cfg = tmp_path / "c.json"
    doc = {"train_batch_size": 4, "fp16": {"enabled": True, "loss_scale": 2.0 ** 64},
           "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
           "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16}, "run": {"steps": 3}}
    cfg.write_text(json.dumps(doc))
    r = run(ZINC_TRAIN, str(cfg))
    assert r.returncode == 1, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "at the static fp16.loss_scale 1.84467e+19, which never comes down" in line, line
    doc["fp16"]["loss_scale"] = 0.5
    cfg.write_text(json.dumps(doc))
    r = run(ZINC_TRAIN, str(cfg))
    assert r.returncode == 0 and "loss scale 0.5, 0 skipped" in r.stdout, (r.stdout, r.stderr)


# ---- input that is not what it claims ----------------------------------------------------------


def test_a_config_that_never_ends_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        for extra in ((), ("--check",)):
            r = run(ZINC_TRAIN, path, *extra, timeout=20)
            assert r.returncode == 1 and "not a regular file" in r.stdout + r.stderr, (path, extra, r.stdout, r.stderr)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate((256 << 20) + 1)
    r = run(ZINC_TRAIN, str(big), timeout=20)
    assert r.returncode == 1 and "over the limit of" in r.stderr, r.stderr
    # The model's config.json as a FIFO: no hang either.
    src = copy_fixture(tmp_path)
    os.remove(src / "config.json")
    os.mkfifo(src / "config.json")
    r = run(ZINC_TRAIN, config(tmp_path, src), "--steps", "1", timeout=20)
    assert r.returncode == 1 and "config.json is a FIFO, not a regular file" in r.stderr, r.stderr


def test_command_lines_that_would_do_nothing_or_the_wrong_thing_are_refused(tmp_path):
    src = copy_fixture(tmp_path)
    cfg = config(tmp_path, src)
    r = run(ZINC_TRAIN, cfg, "--save-pretrained", "")
    assert r.returncode == 2 and "--save-pretrained: an empty path names no folder" in r.stderr, r.stderr
    ck = tmp_path / "ck"
    sets = ("--set", "run.checkpoint_interval=1", "--set", "run.checkpoint_dir=%s" % ck)
    assert run(ZINC_TRAIN, cfg, "--steps", "3", *sets).returncode == 0
    r = run(ZINC_TRAIN, cfg, "--steps", "2", *sets, "--resume")
    assert r.returncode == 1 and "the checkpoint is at step 3, past it" in r.stderr, r.stderr
    r = run(ZINC_TRAIN, cfg, "--steps", "3", *sets, "--resume")  # a finished job restarted: nothing to do, said so
    assert r.returncode == 0 and "done: nothing left to train (the checkpoint is at step 3" in r.stdout, r.stdout
    # A shard with bytes appended is not the shard that was saved.
    with open(ck / "global_step3" / "rank00000.bin", "ab") as f:
        f.write(b"\0" * 4096)
    r = run(ZINC_TRAIN, cfg, "--steps", "4", *sets, "--resume")
    (line,) = errors(r)
    assert r.returncode == 1 and "rank00000.bin has" in line and "bytes appended" in line, line


def test_a_run_stopped_by_a_signal_exports_nothing(tmp_path):
    """An unfinished run's weights would replace a finished export: a stop signal saves a checkpoint (the
    progress is kept, --resume continues) and leaves the export folder as it was."""
    import signal
    import time
    src = copy_fixture(tmp_path)
    cfg = config(tmp_path, src, checkpoint_dir=str(tmp_path / "ck"))
    out = tmp_path / "out"
    assert run(ZINC_TRAIN, cfg, "--steps", "0", "--save-pretrained", str(out)).returncode == 0
    before = digest(out)
    p = subprocess.Popen([ZINC_TRAIN, cfg, "--steps", "100000", "--json", "--save-pretrained", str(out),
                          "--save-weights", str(tmp_path / "w.safetensors")],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if '"event":"step"' in line or '"step":2' in line:
            break
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert "are not written" in err and "--resume finishes the run" in err, err
    assert digest(out) == before and not os.path.exists(tmp_path / "w.safetensors")
    assert os.path.exists(tmp_path / "ck" / "latest")


# ---- found by a hostile user's sweep (2026-11-30) ----------------------------------------------


def lora_config(tmp, model_dir, lora, **run):
    """config() with model.lora (or model.lora null)."""
    path = config(tmp, model_dir, **run)
    doc = json.loads(open(path).read())
    doc["model"]["lora"] = lora
    open(path, "w").write(json.dumps(doc))
    return path


def test_zinc_export_never_writes_into_the_pretrained_model_the_checkpoint_came_from(tmp_path):
    """The safetensors export and the PEFT adapter folder once went into the base model's folder: the first
    replaced its weights, the second turned it into base plus adapter for transformers with PEFT."""
    src = copy_fixture(tmp_path)
    before = digest(src)
    ck = tmp_path / "ck"
    for lora in (None, {"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}):
        cfg = lora_config(tmp_path, src, lora) if lora else config(tmp_path, src)
        r = run(ZINC_TRAIN, cfg, "--steps", "1", "--set", "run.checkpoint_interval=1",
                "--set", "run.checkpoint_dir=%s" % ck)
        assert r.returncode == 0, r.stderr
        for out in (src / "model.safetensors", src / "other.safetensors"):
            r = run(ZINC_EXPORT, str(ck), "--out", str(out))
            assert r.returncode == 1 and "the pretrained model this checkpoint was trained from" in r.stderr, r.stderr
        if lora:
            r = run(ZINC_EXPORT, str(ck), "--format", "peft", "--out", str(src))
            assert r.returncode == 1 and "which this run reads" in r.stderr, r.stderr
        assert digest(src) == before
        assert run(ZINC_EXPORT, str(ck), "--out", str(tmp_path / "w.safetensors")).returncode == 0
        shutil.rmtree(ck)


def test_lora_null_is_no_lora_and_a_rank_past_the_limit_is_refused(tmp_path):
    src = copy_fixture(tmp_path)
    r = run(ZINC_TRAIN, lora_config(tmp_path, src, None), "--steps", "1")
    assert r.returncode == 0, r.stderr
    assert "LoRA" not in r.stdout, r.stdout
    for rank in (1 << 32, 1 << 21):  # 2^32 once ended the process with SIGFPE in the memory estimate
        for extra in ((), ("--check",), ("--estimate",)):
            r = run(ZINC_TRAIN, lora_config(tmp_path, src, {"r": rank}), *extra)
            assert r.returncode == 1, (rank, extra, r.returncode, r.stderr)
            assert "model.lora.r" in r.stdout + r.stderr, (rank, extra, r.stdout, r.stderr)


def test_a_resume_with_another_adapter_scale_is_refused_naming_both(tmp_path):
    """lora_alpha and use_rslora change the model without changing a block's size: a resume once went on with the
    new scale without a word."""
    src = copy_fixture(tmp_path)
    lora = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
    r = run(ZINC_TRAIN, lora_config(tmp_path, src, lora, steps=2, checkpoint_interval=1))
    assert r.returncode == 0, r.stderr
    for change in ({"lora_alpha": 8}, {"use_rslora": True}, {"r": 4}, {"target_modules": ["q_proj"]}):
        r = run(ZINC_TRAIN, lora_config(tmp_path, src, dict(lora, **change), steps=3, checkpoint_interval=1),
                "--resume")
        assert r.returncode == 1, (change, r.stdout, r.stderr)
        (line,) = errors(r)
        assert "trained LoRA adapters of r 2, lora_alpha 4 on q_proj, v_proj; this run's are" in line, (change, line)
        assert "step 3" not in r.stdout
    # Over other base weights of the same shapes (the checkpoint does not hold the base): refused; over the same
    # weights in another folder: resumed.
    from safetensors.numpy import load_file, save_file
    other = tmp_path / "other"
    shutil.copytree(src, other)
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v * 1.5 for k, v in weights.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    r = run(ZINC_TRAIN, lora_config(tmp_path, other, lora, steps=3, checkpoint_interval=1), "--resume")
    assert r.returncode == 1, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "over a frozen base whose weights differ from %s's" % other in line, line
    moved = tmp_path / "moved"
    shutil.copytree(src, moved)
    r = run(ZINC_TRAIN, lora_config(tmp_path, moved, dict(lora, lora_dropout=0.1), steps=3, checkpoint_interval=1),
            "--resume")
    assert r.returncode == 0, r.stderr  # the dropout changes training, not the model; the base's path may change


def test_a_merged_export_that_is_not_finite_is_refused_and_replaces_nothing(tmp_path):
    src = copy_fixture(tmp_path, "lora_llama")
    out = tmp_path / "merged"
    r = run(ZINC_TRAIN, config(tmp_path, os.path.join(FIXTURES, "llama_gqa")), "--steps", "0", "--save-pretrained",
            str(out))
    assert r.returncode == 0, r.stderr
    before = digest(out)
    adapter_config = json.loads((src / "adapter_config.json").read_text())
    weights = (src / "adapter_model.safetensors").read_bytes()

    def adapter_values(v):
        """adapter_model.safetensors with every LoRA A and B value set to v (a finite float32): lora_alpha past
        float's range is refused as the adapter is read, so the merge is made to overflow through the weights."""
        import array
        n = struct.unpack("<Q", weights[:8])[0]
        header = json.loads(weights[8:8 + n])
        out = bytearray(weights)
        for name, t in header.items():
            if name != "__metadata__" and t["dtype"] == "F32" and ("lora_A" in name or "lora_B" in name):
                a, b = t["data_offsets"]
                out[8 + n + a:8 + n + b] = array.array("f", [v] * ((b - a) // 4)).tobytes()
        return bytes(out)

    for alpha, values, dtype, what in ((8, 1e20, "fp32", "NaN or infinity"), (3e6, None, "fp16", "past what fp16 holds")):
        adapter_config["lora_alpha"] = alpha
        (src / "adapter_config.json").write_text(json.dumps(adapter_config))
        (src / "adapter_model.safetensors").write_bytes(adapter_values(values) if values else weights)
        cfg = config(tmp_path, os.path.join(FIXTURES, "llama_gqa"))
        doc = json.loads(open(cfg).read())
        doc["model"]["adapter"] = str(src)
        open(cfg, "w").write(json.dumps(doc))
        r = run(ZINC_TRAIN, cfg, "--steps", "0", "--save-pretrained", str(out), "--merge", "--save-dtype", dtype)
        assert r.returncode == 1, (alpha, r.stdout, r.stderr)
        assert "non-finite value" in r.stderr and what in r.stderr and "nothing was replaced" in r.stderr, r.stderr
        assert digest(out) == before


def test_a_config_json_naming_more_layers_than_its_weights_is_refused_at_once(tmp_path):
    src = copy_fixture(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    # 10 GB and half a minute, or no end, before; past any model's depth (4096 layers) refused by the bound,
    # within it by the weights.
    for layers, words in ((1000000, "num_hidden_layers: must be in [1, 4096], got 1000000"),
                          (1 << 31, "num_hidden_layers: must be in [1, 4096], got %d" % (1 << 31)),
                          (3000, "num_hidden_layers is 3000, but the weights")):
        cfg["num_hidden_layers"] = layers
        (src / "config.json").write_text(json.dumps(cfg))
        r = run(ZINC_TRAIN, config(tmp_path, src), "--check", timeout=30)
        assert r.returncode == 1, r.stderr
        assert words in r.stdout + r.stderr and "config.json" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_run_whose_every_step_overflowed_in_fp16_exits_1_and_exports_nothing(tmp_path):
    out = tmp_path / "exp"
    r = run(ZINC_TRAIN, os.path.join(ROOT, "configs", "default.json"), "--steps", "3", "--set", "run.eval_interval=0",
            "--set", "bf16.enabled=false", "--set", 'fp16={"enabled": true, "initial_scale_power": 40}', "--set", "run.output_dir=%s" % (tmp_path / "r"),
            "--save-pretrained", str(out))
    assert r.returncode == 1, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "each overflowed in fp16" in line and "no export was written" in line, line
    assert not out.exists()


def test_a_resume_with_nothing_left_to_train_still_prints_the_digest(tmp_path):
    base = [ZINC_TRAIN, os.path.join(ROOT, "configs", "default.json"), "--steps", "2", "--set", "run.eval_interval=0",
            "--set", "run.checkpoint_interval=2", "--set", "run.output_dir=%s" % tmp_path, "--weights-digest"]
    r = run(*base)
    assert r.returncode == 0, r.stderr
    (trained,) = [l for l in r.stdout.splitlines() if l.startswith("weights digest")]
    r = run(*base, "--resume")
    assert r.returncode == 0 and "nothing left to train" in r.stdout, r.stdout + r.stderr
    assert [l for l in r.stdout.splitlines() if l.startswith("weights digest")] == [trained]


def test_the_adapter_and_the_merged_model_never_share_a_folder(tmp_path):
    src = copy_fixture(tmp_path)
    cfg = lora_config(tmp_path, src, {"r": 2, "target_modules": ["q_proj"]})
    out = tmp_path / "both"
    for other in (str(out), str(out) + "/", str(tmp_path / "x" / ".." / "both")):
        r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-pretrained", str(out), "--merge", "--save-adapter", other)
        assert r.returncode == 1 and "is the folder --save-pretrained writes" in r.stderr, (other, r.stderr)
        assert "step 1" not in r.stdout and not out.exists()


# ---- found by a hostile user's sweep (2026-12-02) ----------------------------------------------


def gpt_config(tmp, **extra):
    """A one-layer GPT on synthetic data, with `extra` merged into its run section."""
    cfg = tmp / "gpt1.json"
    doc = {"train_batch_size": 4, "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
           "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 16},
           "run": dict({"steps": 2, "checkpoint_dir": str(tmp / "ck")}, **extra)}
    cfg.write_text(json.dumps(doc))
    return str(cfg)


def test_a_latest_that_is_not_a_checkpoint_pointer_is_refused_before_training(tmp_path):
    # Every save replaces `latest`: a regular file of that name was replaced
    # whatever it held, the run's own config included; a folder of that name
    # was checked only with checkpoint_interval, and a stop signal's save
    # then failed after training.
    ck = tmp_path / "ck"
    ck.mkdir()
    cfg = gpt_config(tmp_path, checkpoint_interval=1)
    shutil.copy(cfg, ck / "latest")
    before = (ck / "latest").read_bytes()
    r = run(ZINC_TRAIN, str(ck / "latest"), "--steps", "1")
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "ck/latest is not a checkpoint pointer" in line, line
    assert (ck / "latest").read_bytes() == before
    (ck / "latest").unlink()
    (ck / "latest").mkdir()
    r = run(ZINC_TRAIN, gpt_config(tmp_path), "--steps", "1")  # no checkpoint_interval
    assert r.returncode == 1 and "ck/latest is not a file (a folder)" in r.stderr, r.stderr
    (ck / "latest").rmdir()
    # A pointer whose tag was removed by hand is still zinc's: replaced.
    (ck / "latest").write_text("global_step9\n")
    r = run(ZINC_TRAIN, gpt_config(tmp_path, checkpoint_interval=1), "--steps", "1")
    assert r.returncode == 0, r.stderr
    assert (ck / "latest").read_text() == "global_step1\n"


def test_a_tag_holding_what_zinc_did_not_write_is_neither_replaced_nor_pruned(tmp_path):
    # A model folder moved into a tag (or another run's checkpoint folder
    # made there) was removed with the tag by the next save of it, or by
    # run.keep_last's pruning.
    cfg = gpt_config(tmp_path, checkpoint_interval=1)
    assert run(ZINC_TRAIN, cfg).returncode == 0
    ck = tmp_path / "ck"
    (ck / "global_step1" / "model").mkdir()
    (ck / "global_step1" / "model" / "config.json").write_text("{}")
    r = run(ZINC_TRAIN, cfg)  # afresh: its first save is global_step1
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "ck/global_step1 holds model, which a zinc save does not write" in line, line
    r = run(ZINC_TRAIN, cfg, "--steps", "4", "--resume", "--set", "run.keep_last=1")
    assert r.returncode == 0, r.stderr
    assert "run.keep_last: kept" in r.stderr and "global_step1: it holds model" in r.stderr, r.stderr
    assert (ck / "global_step1" / "model" / "config.json").read_text() == "{}"
    assert not (ck / "global_step2").exists() and (ck / "global_step4").exists()


def test_a_csv_monitor_file_that_is_not_the_monitors_is_refused_before_training(tmp_path):
    # The monitor appended its rows to whatever had a .csv name in its
    # folder: the run's own config there was left unreadable.
    folder = tmp_path / "csv" / "j"
    folder.mkdir(parents=True)
    cfg = folder / "Train_Samples_train_loss.csv"
    shutil.copy(gpt_config(tmp_path), cfg)
    before = cfg.read_bytes()
    r = run(ZINC_TRAIN, str(cfg), "--set", "steps_per_print=1",
            "--set", 'csv_monitor={"enabled": true, "output_path": "%s", "job_name": "j"}' % (tmp_path / "csv"))
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    (line,) = errors(r)
    assert "Train_Samples_train_loss.csv is not a csv_monitor file" in line, line
    assert cfg.read_bytes() == before


def test_a_checkpoint_folder_and_an_export_folder_are_never_one_folder_of_two_runs(tmp_path):
    # A run that checkpoints into the folder another run exports into at its
    # end (or the other way round) was not refused: the exporting run
    # trained to the end, then found the other's tags in its folder.
    holder = subprocess.Popen([ZINC_TRAIN, gpt_config(tmp_path), "--steps", "1000000", "--save-pretrained",
                               str(tmp_path / "out")], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        for line in holder.stdout:  # its locks are taken before its first step
            if line.startswith("step "):
                break
        other = tmp_path / "other"
        other.mkdir()
        r = run(ZINC_TRAIN, gpt_config(other, checkpoint_interval=1), "--set",
                "run.checkpoint_dir=%s" % json.dumps(str(tmp_path / "out")))
        assert r.returncode == 1 and "is in use by another run" in r.stderr, r.stderr
        assert not (tmp_path / "out" / "global_step1").exists()
        r = run(ZINC_TRAIN, gpt_config(other), "--save-pretrained", str(tmp_path / "ck"))
        assert r.returncode == 1 and "is in use by another run" in r.stderr and "step 1" not in r.stdout, r.stderr
    finally:
        holder.kill()
        holder.communicate(timeout=60)


def test_a_checkpoint_folder_with_no_room_below_it_for_a_save_is_refused_at_the_start(tmp_path):
    # A folder path that fit, with the files a save writes below it past
    # PATH_MAX: the first save failed after training, naming a filesystem
    # error. (4000 bytes: the folder itself is made; its tags would not fit.)
    deep = str(tmp_path)
    while len(deep) < 3900:
        deep += "/" + "d" * 200
    deep += "/" + "e" * (4000 - len(deep) - 1)
    cfg = gpt_config(tmp_path, checkpoint_interval=1)
    for extra in (("--check",), ()):
        r = run(ZINC_TRAIN, cfg, "--set", "run.checkpoint_dir=%s" % json.dumps(deep), *extra)
        assert r.returncode == 1 and "step 1" not in r.stdout, (extra, r.stdout, r.stderr)
        out = r.stdout + r.stderr
        assert "run.checkpoint_dir" in out and "past the system's limit of 4095 bytes for a path" in out, out


def test_a_full_model_and_an_adapter_are_never_exported_into_one_folder(tmp_path):
    # An export keeps the user's files: a merged model written into a folder
    # holding a PEFT adapter kept its adapter_config.json, and transformers
    # then loaded the folder as that adapter over its base model, ignoring
    # the weights just written. The same the other way round. Refused before
    # training.
    src = copy_fixture(tmp_path)
    cfg = lora_config(tmp_path, src, {"r": 2, "target_modules": ["q_proj"]})
    adapter, full = tmp_path / "adapter", tmp_path / "full"
    assert run(ZINC_TRAIN, cfg, "--steps", "1", "--save-adapter", str(adapter)).returncode == 0
    assert run(ZINC_TRAIN, cfg, "--steps", "1", "--save-pretrained", str(full), "--merge").returncode == 0
    before = (digest(adapter), digest(full))
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-pretrained", str(adapter), "--merge")
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    assert "holds adapter_config.json, a PEFT adapter's" in r.stderr, r.stderr
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-adapter", str(full))
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    assert "holds a full model (config.json and its weights)" in r.stderr, r.stderr
    assert (digest(adapter), digest(full)) == before
    # Each into its own kind of folder again: as before.
    assert run(ZINC_TRAIN, cfg, "--steps", "1", "--save-adapter", str(adapter)).returncode == 0


# ---- found by a hostile user's sweep of model folders (2026-12-02) -----------------------------


def test_a_model_folder_of_links_protects_the_files_they_lead_to(tmp_path):
    # A from_pretrained folder of symbolic links (a hub cache's snapshot, or
    # one made by hand): --save-weights onto a file it links to, or an export
    # into the folder holding those files, replaced the model the run read.
    base = copy_fixture(tmp_path)
    links = tmp_path / "m"
    links.mkdir()
    for f in os.listdir(base):
        os.symlink(base / f, links / f)
    cfg = config(tmp_path, links)
    before = digest(base)
    for args in (("--save-weights", str(base / "model.safetensors")), ("--save-pretrained", str(base))):
        r = run(ZINC_TRAIN, cfg, "--steps", "1", *args)
        assert r.returncode == 1 and "step 1" not in r.stdout, (args, r.stdout, r.stderr)
        assert "which this run reads" in r.stderr and "llama_gqa" in r.stderr, (args, r.stderr)
    assert digest(base) == before


def test_zinc_export_reads_the_source_model_the_run_named_from_any_folder(tmp_path):
    # The checkpoint kept model.from_pretrained as given ("m"); zinc-export,
    # run from another folder, resolved it there: it copied that folder's
    # tokenizer and let an export replace the real source.
    run1, elsewhere = tmp_path / "run1", tmp_path / "elsewhere"
    run1.mkdir()
    elsewhere.mkdir()
    src = copy_fixture(run1, "llama_gqa")
    (src / "tokenizer_config.json").write_text('{"marker": "REAL"}')
    other = copy_fixture(elsewhere, "llama_gqa")
    (other / "tokenizer_config.json").write_text('{"marker": "WRONG"}')
    doc = {"train_batch_size": 2, "model": {"from_pretrained": "llama_gqa"},
           "data": {"type": "synthetic", "vocab_size": 96, "seq_len": 12},
           "run": {"steps": 1, "checkpoint_interval": 1, "checkpoint_dir": "ck"}}
    (run1 / "cfg.json").write_text(json.dumps(doc))
    r = subprocess.run([ZINC_TRAIN, "cfg.json"], cwd=run1, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    before = digest(src)
    r = subprocess.run([ZINC_EXPORT, str(run1 / "ck"), "--format", "hf", "--out", str(run1 / "exp")], cwd=elsewhere,
                       env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert json.loads((run1 / "exp" / "tokenizer_config.json").read_text()) == {"marker": "REAL"}
    r = subprocess.run([ZINC_EXPORT, str(run1 / "ck"), "--format", "hf", "--out", str(src)], cwd=elsewhere,
                       env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and "which this run reads" in r.stderr, r.stderr
    assert digest(src) == before


def test_nested_exports_and_unreadable_tokenizer_files_are_refused_before_training(tmp_path):
    # --save-adapter o with --save-pretrained o/merged: the adapter's export
    # found the merged folder inside its own only after training. A
    # tokenizer.json that is a dangling link was dropped from the export
    # without a word; one past the size limit was refused after training.
    src = copy_fixture(tmp_path)
    cfg = lora_config(tmp_path, src, {"r": 2, "target_modules": ["q_proj"]})
    o = tmp_path / "o"
    for args in (("--save-pretrained", str(o / "merged"), "--merge", "--save-adapter", str(o)),
                 ("--save-pretrained", str(o), "--merge", "--save-adapter", str(o / "ad"))):
        r = run(ZINC_TRAIN, cfg, "--steps", "1", *args)
        assert r.returncode == 1 and "step 1" not in r.stdout, (args, r.stdout, r.stderr)
        assert "lies inside the folder --save-" in r.stderr, (args, r.stderr)
    assert not o.exists()
    if (src / "tokenizer.json").exists():
        (src / "tokenizer.json").unlink()
    os.symlink(tmp_path / "no-such-blob", src / "tokenizer.json")
    cfg = config(tmp_path, src)
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--save-pretrained", str(o))
    assert r.returncode == 1 and "step 1" not in r.stdout, (r.stdout, r.stderr)
    assert "tokenizer.json is a symbolic link to" in r.stderr and "which does not exist" in r.stderr, r.stderr


def test_an_adapter_whose_lora_alpha_scales_it_to_nothing_or_past_float_is_refused(tmp_path):
    # An adapter folder's lora_alpha 0 trained nothing (every gradient 0,
    # exit 0); 1e308 overflowed at the first step with an error blaming an
    # earlier update. model.lora refused both already.
    src = copy_fixture(tmp_path)
    adapter = copy_fixture(tmp_path, "lora_llama")
    cfg = config(tmp_path, src)
    doc = json.loads(open(cfg).read())
    doc["model"]["adapter"] = str(adapter)
    open(cfg, "w").write(json.dumps(doc))
    ac = json.loads((adapter / "adapter_config.json").read_text())
    for alpha in (0, -2, 1e308):
        (adapter / "adapter_config.json").write_text(json.dumps(dict(ac, lora_alpha=alpha)))
        r = run(ZINC_TRAIN, cfg, "--steps", "1")
        assert r.returncode == 1 and "step 1" not in r.stdout, (alpha, r.stdout, r.stderr)
        assert "lora_alpha" in r.stderr and "expected a number > 0 within float's range" in r.stderr, r.stderr


def test_a_tight_address_space_limit_is_refused_in_one_line_never_a_crash(tmp_path):
    # Under `ulimit -v` just above what the process needs to start, the room
    # check itself segfaulted: its estimate creates oneDNN primitives, and
    # oneDNN crashes where its allocations fail. Below 64 MiB of room no
    # estimate is made. The limits around the edge, whatever this machine's.
    import resource
    cfg = os.path.join(ROOT, "configs", "mlp.json")
    outcomes = set()
    for kib in range(60000, 200001, 10000):
        def limit(kib=kib):
            resource.setrlimit(resource.RLIMIT_AS, (kib << 10, kib << 10))
        r = subprocess.run([ZINC_TRAIN, cfg, "--steps", "1", "--set", "run.checkpoint_dir=%s" % json.dumps(
            str(tmp_path / "ck"))], env=ENV, capture_output=True, text=True, timeout=120, preexec_fn=limit)
        if r.returncode == 127 and "error while loading shared libraries" in r.stderr:
            continue  # too little for the dynamic loader: zinc never started
        assert r.returncode in (0, 1), (kib, r.returncode, r.stderr[-2000:])
        if r.returncode == 1:
            assert len(errors(r)) <= 2 and r.stderr.strip(), (kib, r.stderr[-2000:])  # said, not a crash
        outcomes.add(r.returncode)
    assert 1 in outcomes, outcomes  # the lowest limits are refused


# ---- found by a hostile user's sweep of resuming (2026-12-02) ----------------------------------


def test_eval_batches_past_the_held_out_set_read_it_once(tmp_path):
    # run.eval_batches was not capped at the held-out set: 100000 of them
    # over a tail of a few samples read those samples again and again (20 s
    # of the CPU at each evaluation). Now each evaluation reads the set once,
    # and the run says so; the loss is the one over the whole set.
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = tmp_path / "text.json"
    doc = {"train_batch_size": 4, "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
           "data": {"type": "text", "path": str(data), "seq_len": 16, "eval_fraction": 0.1},
           "run": {"steps": 1, "eval_interval": 1, "eval_batches": 100000}}
    cfg.write_text(json.dumps(doc))
    r = run(ZINC_TRAIN, str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    assert "run.eval_batches 100000 is more than the held-out set fills (" in r.stderr, r.stderr
    assert "each evaluation reads the set once" in r.stderr, r.stderr
    held = int(r.stderr.split("set fills (")[1].split()[0])
    doc["run"]["eval_batches"] = held
    cfg.write_text(json.dumps(doc))
    r2 = run(ZINC_TRAIN, str(cfg), "--json")
    assert r2.returncode == 0 and "eval_batches" not in r2.stderr, r2.stderr
    evals = [[e["loss"] for e in map(json.loads, out.stdout.splitlines()) if e.get("event") == "eval"]
             for out in (r, r2)]
    assert evals[0] and evals[0] == evals[1], evals
    # A micro-batch that does not divide the set: its last rows count no
    # sample twice (they wrapped to the set's start), so with the weights
    # held still (lr 1e-30) the loss is the one a dividing micro-batch gives.
    doc["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-30, "weight_decay": 0.0}}
    losses = {}
    for micro in (4, 5):
        doc["train_batch_size"] = micro
        cfg.write_text(json.dumps(doc))
        out = run(ZINC_TRAIN, str(cfg), "--json", "--set", "run.eval_batches=1000")
        assert out.returncode == 0, out.stderr
        losses[micro] = [e["loss"] for e in map(json.loads, out.stdout.splitlines()) if e.get("event") == "eval"][0]
    assert abs(losses[4] - losses[5]) < 1e-5 * losses[4], losses


def test_the_weights_digest_is_of_the_weights_alone(tmp_path):
    # --weights-digest hashed each block's flat vector, its alignment gaps
    # and the world size's padding with it: a digest of the layout too. It
    # is FNV-1a over the weights' fp32 bytes in order, which are what
    # --save-weights writes (a safetensors file: an 8-byte header length,
    # the header, then the tensors' bytes back to back in that order).
    cfg = gpt_config(tmp_path)
    out = tmp_path / "w.safetensors"
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--json", "--weights-digest", "--save-weights", str(out))
    assert r.returncode == 0, r.stderr
    digest = json.loads(r.stdout.splitlines()[-1])["weights_digest"]
    blob = out.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0
    h = 1469598103934665603
    for byte in blob[8 + n:8 + n + spans[-1][1]]:
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    assert digest == "%016x" % h, (digest, "%016x" % h)


def test_a_resume_whose_schedule_or_optimizer_changed_is_said(tmp_path):
    # total_num_steps "auto" follows run.steps: a resume with other --steps
    # went on along a schedule of another length (the lr jumps) without a
    # word. The checkpoint keeps the schedule's shape; a change is said.
    cfg = gpt_config(tmp_path, checkpoint_interval=2)
    doc = json.loads(open(cfg).read())
    doc["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    doc["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": "auto"}}
    open(cfg, "w").write(json.dumps(doc))
    assert run(ZINC_TRAIN, cfg, "--steps", "2").returncode == 0
    r = run(ZINC_TRAIN, cfg, "--steps", "2", "--resume", "--json")  # the same length: nothing to say
    assert r.returncode == 0 and "learning-rate schedule" not in r.stderr, r.stderr
    # A run of no steps: its shares of the time are shares (one was -0.42).
    summary = json.loads(r.stdout.splitlines()[-1])
    assert 0 <= summary["compute_off_cpu_share"] <= 1 and 0 <= summary["comm_wait_share"] <= 1, summary
    assert "optimizer or batch" not in r.stderr, r.stderr
    r = run(ZINC_TRAIN, cfg, "--steps", "4", "--resume")
    assert r.returncode == 0, r.stderr
    assert "whose learning-rate schedule differs from this run's (total_num_steps 2 -> 4" in r.stderr, r.stderr
    # The optimizer's settings and the batch a resume takes from its own
    # config: a change is said too.
    r = run(ZINC_TRAIN, cfg, "--steps", "5", "--resume", "--set", "optimizer.params.lr=0.002")
    assert r.returncode == 0, r.stderr
    assert "whose optimizer or batch differs from this run's (lr 0.001 -> 0.002)" in r.stderr, r.stderr
    # A resume that trains nothing (run.steps at or below the saved step)
    # has no schedule to differ.
    r = run(ZINC_TRAIN, cfg, "--steps", "1", "--resume")
    assert "learning-rate schedule" not in r.stderr and "optimizer or batch" not in r.stderr, r.stderr


def test_a_resume_with_another_data_order_or_other_synthetic_data_is_said(tmp_path):
    # run.seed orders the data: a resume with another one went on from the
    # saved position in another shuffle (some samples twice, some never),
    # and a synthetic source with another seed or length is other data
    # whose 2^40-sample epoch never showed it by its count. Both said now.
    cfg = gpt_config(tmp_path, checkpoint_interval=2)
    assert run(ZINC_TRAIN, cfg, "--steps", "2").returncode == 0
    r = run(ZINC_TRAIN, cfg, "--steps", "3", "--resume", "--set", "run.seed=7")
    assert r.returncode == 0, r.stderr
    assert "was saved by a run whose run.seed (the data order's) was 42; this run's is 7" in r.stderr, r.stderr
    r = run(ZINC_TRAIN, cfg, "--steps", "4", "--resume", "--set", "run.seed=7", "--set", "data.seed=99")
    assert r.returncode == 0, r.stderr
    assert "was saved over other synthetic data" in r.stderr and "seed=99" in r.stderr, r.stderr
    r = run(ZINC_TRAIN, cfg, "--steps", "5", "--resume", "--set", "run.seed=7", "--set", "data.seed=99")
    assert r.returncode == 0 and "other synthetic data" not in r.stderr and "run.seed" not in r.stderr, r.stderr


def test_a_file_of_another_set_is_never_written_over(tmp_path):
    # Found by a sweep of two writers on one folder (2026-12-03): a single
    # file whose name is another set's shard (zinc-export --out
    # a-00001-of-00003.safetensors beside the set a, --save-weights into a
    # sharded model folder) replaced that shard, and an export's index
    # replaced a zinc.prepare manifest of the same name. Each is refused
    # before anything is written, naming the other set's file.
    cfg = gpt_config(tmp_path, checkpoint_interval=2)
    assert run(ZINC_TRAIN, cfg).returncode == 0
    ck = str(tmp_path / "ck")
    out = tmp_path / "out"
    out.mkdir()
    r = run(ZINC_EXPORT, ck, "--out", str(out / "a.safetensors"), "--max-shard-size", "8KB")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "a.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    before = digest(out)
    r = run(ZINC_EXPORT, ck, "--out", str(out / shard))
    assert r.returncode == 1 and f"{shard} is a file of the set {out / 'a.safetensors.index.json'} names" in r.stderr, \
        r.stderr
    r = run(ZINC_TRAIN, cfg, "--save-weights", str(out / shard))
    assert r.returncode == 1 and f"--save-weights {out / shard}: {shard} is a file of the set" in r.stderr, r.stderr
    assert "step " not in r.stdout  # refused before training
    assert digest(out) == before
    # A zinc.prepare manifest named as an export's index (its --out was b.safetensors.index).
    manifest = {"format": "zinc.prepare/1", "files": {"tokens": "b.safetensors.index.bin"}}
    (out / "b.safetensors.index.json").write_text(json.dumps(manifest))
    before = digest(out)
    r = run(ZINC_EXPORT, ck, "--out", str(out / "b.safetensors"), "--max-shard-size", "8KB")
    assert r.returncode == 1 and "b.safetensors.index.json is not a safetensors index" in r.stderr, r.stderr
    assert digest(out) == before


def test_no_export_goes_into_another_checkpoints_tag(tmp_path):
    # An export into a tag of a checkpoint folder it does not read (another
    # run's, found by a sweep of two writers, 2026-12-03) was accepted: that
    # run's next save of the tag swaps it out, and its pruning removes it.
    cfg = gpt_config(tmp_path, checkpoint_interval=2)
    assert run(ZINC_TRAIN, cfg).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    cfg2 = gpt_config(other, checkpoint_interval=2)
    assert run(ZINC_TRAIN, cfg2).returncode == 0
    tag = other / "ck" / "global_step2"
    before = digest(other)
    r = run(ZINC_EXPORT, str(tmp_path / "ck"), "--out", str(tag / "w.safetensors"))
    assert r.returncode == 1 and f"lies inside the checkpoint tag {tag}" in r.stderr, r.stderr
    r = run(ZINC_TRAIN, cfg, "--save-weights", str(tag / "w.safetensors"))
    assert r.returncode == 1 and f"lies inside the checkpoint tag {tag}" in r.stderr, r.stderr
    r = run(ZINC_EXPORT, str(tmp_path / "ck"), "--format", "hf", "--out", str(tag / "hf"))
    assert r.returncode == 1 and f"lies inside the checkpoint tag {tag}" in r.stderr, r.stderr
    assert digest(other) == before
