"""zinc-train's tensorboard monitor, read back by the real `tensorboard` package.

A run with "tensorboard": {"enabled": true} writes one event file; the
tensorboard package's own EventAccumulator (the reader behind TensorBoard's
scalar dashboard) must find in it every scalar the run's --json step and eval
events carry, under DeepSpeed's tag names (and zinc's own), at x = samples
trained, with the event's value as a float32. A file cut mid-record, a damaged
record, or a run that dies mid-way, still reads up to its last whole record.

Run by CTest (monitor_tensorboard) with ZINC_TRAIN and ZINC_ROOT set; by
hand: python3 -m pytest tests/tools/test_tensorboard.py from the repo root
after a build. Skipped when tensorboard is not importable (scripts/setup.sh
installs it).
"""
import glob
import json
import os
import re
import shutil
import socket
import struct
import subprocess

import pytest

try:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
except ImportError as e:  # pragma: no cover - depends on the machine
    pytestmark = pytest.mark.skip(reason="the tensorboard package is not importable (%s); scripts/setup.sh installs it" % e)

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
ZINC_TRAIN = os.environ.get("ZINC_TRAIN", os.path.join(ROOT, "build", "tools", "zinc-train"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
CFG = os.path.join(ROOT, "configs", "default.json")
# A small, quick model; held-out loss every 3 steps.
SMALL = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "run.eval_interval=3",
         "--set", "run.eval_batches=2"]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def run(tmp, steps, *extra, check=True, env=ENV):
    tb = tmp / "tb"
    cmd = [ZINC_TRAIN, CFG, "--steps", str(steps), "--json", *SMALL,
           "--set", "tensorboard.enabled=true", "--set", "tensorboard.output_path=%s" % tb,
           "--set", "tensorboard.job_name=job", *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if check:
        assert p.returncode == 0, p.stderr
    events = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    files = glob.glob(str(tb / "job" / "events.out.tfevents.*"))
    assert len(files) == 1, files
    return events, files[0], p


def records(path):
    """The file's TFRecords as (offset, data), checking both masked CRCs of each."""
    out, blob, at = [], open(path, "rb").read(), 0
    while at < len(blob):
        (n,) = struct.unpack_from("<Q", blob, at)
        (len_crc,) = struct.unpack_from("<I", blob, at + 8)
        assert len_crc == masked_crc32c(blob[at:at + 8]), "length CRC of the record at %d" % at
        data = blob[at + 12:at + 12 + n]
        (data_crc,) = struct.unpack_from("<I", blob, at + 12 + n)
        assert data_crc == masked_crc32c(data), "data CRC of the record at %d" % at
        out.append((at, data))
        at += 12 + n + 4
    assert at == len(blob)
    return out


def scalars(folder):
    acc = ea.EventAccumulator(folder, size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {t: [(s.step, s.value) for s in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def expected(events):
    """What the monitor must hold, from the --json events (steps_per_print 1)."""
    batch = next(e for e in events if e["event"] == "config")["config"]["train_batch_size"]
    want = {}
    for e in events:
        x = e.get("step", 0) * batch
        if e["event"] == "step":
            for key, tag in (("loss", "train_loss"), ("lr", "lr"), ("grad_norm", "grad_norm"),
                             ("tokens_per_s", "tokens_per_s"), ("loss_scale", "loss_scale"),
                             ("comm_wait_share", "comm_wait_share")):
                if key in e:
                    want.setdefault("Train/Samples/" + tag, []).append((x, f32(e[key])))
        elif e["event"] == "eval":
            want.setdefault("Eval/Samples/eval_loss", []).append((x, f32(e["loss"])))
    return want


def test_every_scalar_equals_the_json_events(tmp_path):
    events, path, _ = run(tmp_path, 6, "--set", "steps_per_print=1")
    # Named as TensorBoard's writers name it: events.out.tfevents.<unix seconds>.<host>
    assert re.fullmatch(r"events\.out\.tfevents\.\d{10}\." + re.escape(socket.gethostname()),
                        os.path.basename(path)), path
    recs = records(path)
    first = list(event_file_loader.EventFileLoader(path).Load())
    assert first[0].file_version == "brain.Event:2", first[0]
    assert len(first) == len(recs)
    got = scalars(os.path.dirname(path))
    want = expected(events)
    assert set(want) == {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm",
                         "Train/Samples/tokens_per_s", "Eval/Samples/eval_loss"}, sorted(want)
    assert len(want["Train/Samples/train_loss"]) == 6 and len(want["Eval/Samples/eval_loss"]) == 2
    assert got == want
    # One scalar per record after the file_version, as PyTorch's SummaryWriter writes them.
    assert len(recs) == 1 + sum(len(v) for v in want.values())


def test_fp16_loss_scale(tmp_path):
    events, path, _ = run(tmp_path, 4, "--set", "steps_per_print=1", "--set", "bf16.enabled=false",
                          "--set", 'fp16={"enabled":true,"initial_scale_power":8}')
    got = scalars(os.path.dirname(path))
    want = expected(events)
    assert "Train/Samples/loss_scale" in want
    assert got == want


def test_deepspeed_tags_every_step_zincs_at_the_step_events(tmp_path):
    events, path, _ = run(tmp_path, 4, "--set", "steps_per_print=2")
    got = scalars(os.path.dirname(path))
    batch = next(e for e in events if e["event"] == "config")["config"]["train_batch_size"]
    every = [s * batch for s in (1, 2, 3, 4)]
    for tag in ("Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm"):
        assert [x for x, _ in got[tag]] == every, tag
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert sorted(steps) == [2, 4]
    assert got["Train/Samples/tokens_per_s"] == [(s * batch, f32(steps[s]["tokens_per_s"])) for s in (2, 4)]
    assert [v for x, v in got["Train/Samples/train_loss"] if x in (2 * batch, 4 * batch)] == \
        [f32(steps[s]["loss"]) for s in (2, 4)]


def test_truncated_or_damaged_file_reads_to_its_last_whole_record(tmp_path):
    _, path, _ = run(tmp_path, 4, "--set", "steps_per_print=1")
    full = scalars(os.path.dirname(path))
    recs = records(path)
    blob = open(path, "rb").read()
    last_at, last = recs[-1]
    # The last record holds the last scalar of its tag.
    tag_of_last = event_pb2.Event.FromString(last).summary.value[0].tag
    without_last = {t: (v[:-1] if t == tag_of_last else v) for t, v in full.items()}
    without_last = {t: v for t, v in without_last.items() if v}
    cut_dir = tmp_path / "cut"
    # Cut inside the length, its CRC, the data, and the data's CRC of the last record.
    for cut in (last_at + 3, last_at + 10, last_at + 12 + len(last) // 2, len(blob) - 2):
        shutil.rmtree(cut_dir, ignore_errors=True)
        cut_dir.mkdir()
        with open(cut_dir / os.path.basename(path), "wb") as f:
            f.write(blob[:cut])
        assert scalars(str(cut_dir)) == without_last, cut
    # A damaged byte in the last record's data: its CRC no longer matches; the rest reads.
    shutil.rmtree(cut_dir)
    cut_dir.mkdir()
    bad = bytearray(blob)
    bad[last_at + 12 + len(last) // 2] ^= 0x55
    with open(cut_dir / os.path.basename(path), "wb") as f:
        f.write(bytes(bad))
    assert scalars(str(cut_dir)) == without_last


def test_a_run_that_dies_leaves_its_steps_readable(tmp_path):
    # ZINC_INJECT_ERROR=0:4: rank 0 throws at step 4, before training it.
    env = dict(ENV, ZINC_INJECT_ERROR="0:4")
    events, path, p = run(tmp_path, 8, "--set", "steps_per_print=1", check=False, env=env)
    assert p.returncode == 1 and "injected failure at step 4" in p.stderr, p.stderr
    got = scalars(os.path.dirname(path))
    want = expected(events)
    assert [x for x, _ in want["Train/Samples/train_loss"]] == [64, 128, 192]
    assert got == want


def test_unwritable_output_path_is_refused_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "x")
    for extra in (["--check"], ["--steps", "1"]):
        p = subprocess.run([ZINC_TRAIN, CFG, *extra, "--set", "tensorboard.enabled=true",
                            "--set", "tensorboard.output_path=" + bad], env=ENV, capture_output=True, text=True)
        assert p.returncode == 1, (extra, p.stdout, p.stderr)
        assert bad in p.stdout + p.stderr, (extra, p.stdout, p.stderr)
