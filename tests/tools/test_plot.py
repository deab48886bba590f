"""scripts/plot_run.py draws a run's loss curves from what its monitors wrote.

A short zinc-train run with both the tensorboard and the csv_monitor monitors
on; the curves read from the event file (through tensorboard's
EventAccumulator) and from the CSV files hold the run's --json losses at x =
samples trained, and each draws a PNG (matplotlib) of the figure's size.
Skipped where matplotlib or tensorboard is missing (scripts/setup.sh
installs both). Run by CTest (plot_run) with ZINC_TRAIN and ZINC_ROOT set.
"""
import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/setup.sh installs it)")
pytest.importorskip("tensorboard", reason="tensorboard is not installed (scripts/setup.sh installs it)")

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
ZINC_TRAIN = os.environ.get("ZINC_TRAIN", os.path.join(ROOT, "build", "tools", "zinc-train"))
SCRIPT = os.path.join(ROOT, "scripts", "plot_run.py")


def load_plot_run():
    spec = importlib.util.spec_from_file_location("plot_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not os.path.exists(ZINC_TRAIN):
        pytest.skip("zinc-train is not built (set ZINC_TRAIN)")
    tmp = tmp_path_factory.mktemp("plot")
    cmd = [ZINC_TRAIN, os.path.join(ROOT, "configs", "default.json"), "--steps", "12", "--json",
           "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "run.eval_interval=4",
           "--set", "run.eval_batches=2", "--set", "steps_per_print=1",
           "--set", "tensorboard.enabled=true", "--set", f"tensorboard.output_path={tmp}/tb",
           "--set", "tensorboard.job_name=job",
           "--set", "csv_monitor.enabled=true", "--set", f"csv_monitor.output_path={tmp}/csv",
           "--set", "csv_monitor.job_name=job"]
    p = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return tmp, events


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("source", ["events", "csv"])
def test_curves_hold_the_runs_losses_and_draw(run, source):
    tmp, events = run
    pr = load_plot_run()
    where = (glob.glob(str(tmp / "tb" / "job" / "events.out.tfevents.*"))[0] if source == "events"
             else str(tmp / "csv" / "job"))
    curves = pr.read_curves(where)
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    batch = next(e for e in events if e["event"] == "config")["config"]["train_batch_size"]
    assert len(steps) == 12 and len(evals) == 3
    assert [x for x, _ in curves[pr.TRAIN]] == [e["step"] * batch for e in steps]
    assert [x for x, _ in curves[pr.EVAL]] == [e["step"] * batch for e in evals]
    assert [y for _, y in curves[pr.TRAIN]] == pytest.approx([e["loss"] for e in steps], rel=1e-6)
    assert [y for _, y in curves[pr.EVAL]] == pytest.approx([e["loss"] for e in evals], rel=1e-6)
    out = tmp / f"{source}.png"
    subprocess.run([sys.executable, SCRIPT, where, "--out", str(out)], check=True, capture_output=True)
    assert png_size(out) == (700, 400)


def test_a_folder_without_losses_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--out", str(tmp_path / "x.png")],
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "holds no Train/Samples/train_loss scalars" in p.stderr
    assert not (tmp_path / "x.png").exists()


def test_the_png_never_replaces_what_it_is_drawn_from(run):
    """Issue 49: --out naming the event file or a CSV file it reads (also through a symlink) is refused, and
    the file is left as it was; a PNG is replaced whole (no temporary left beside it)."""
    tmp, _ = run
    event = glob.glob(str(tmp / "tb" / "job" / "events.out.tfevents.*"))[0]
    csv = str(tmp / "csv" / "job" / "Train_Samples_train_loss.csv")
    os.symlink(csv, tmp / "link.csv")
    for source, out in ((event, event), (str(tmp / "csv" / "job"), csv), (str(tmp / "csv" / "job"), str(tmp / "link.csv"))):
        with open(out, "rb") as f:
            before = f.read()
        p = subprocess.run([sys.executable, SCRIPT, source, "--out", out], capture_output=True, text=True)
        assert p.returncode != 0 and "which it reads; choose another file" in p.stderr, p.stderr
        with open(out, "rb") as f:
            assert f.read() == before
    out = tmp / "twice.png"
    for _ in range(2):
        subprocess.run([sys.executable, SCRIPT, event, "--out", str(out)], check=True, capture_output=True)
    assert png_size(out) == (700, 400)
    assert not [f for f in os.listdir(tmp) if f.startswith(".twice.png")]


def test_a_csv_folder_of_several_runs_draws_the_last_and_skips_rows_cut_short(tmp_path):
    """A csv_monitor folder two fresh runs wrote was drawn as one curve (a line from the first run's end back to
    the second's start); a row a kill cut short raised IndexError; the monitor's output_path (the job folders'
    parent) was said to hold no losses."""
    job = tmp_path / "csv" / "job"
    job.mkdir(parents=True)
    (job / "Train_Samples_train_loss.csv").write_text(
        "step,train_loss\n8,5.0\n16,4.0\n24,3.0\nstep,train_loss\n8,5.5\n16,4.5\n3\n24,3.5\n32,3")
    (job / "Eval_Samples_eval_loss.csv").write_text("step,eval_loss\n24,3.1\nstep,eval_loss\n16,4.6\n")
    pr = load_plot_run()
    curves = pr.read_curves(str(job))
    assert curves[pr.TRAIN] == [(8, 5.5), (16, 4.5), (24, 3.5), (32, 3.0)]
    assert curves[pr.EVAL] == [(16, 4.6)]
    p = subprocess.run([sys.executable, SCRIPT, str(job), "--out", str(tmp_path / "a.png")], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert "holds 2 runs" in p.stderr and "drawing the last" in p.stderr and "skipped 1 line(s)" in p.stderr, p.stderr
    # The second run evaluated nothing: the held-out file's one run is the first's, not drawn.
    (job / "Eval_Samples_eval_loss.csv").write_text("step,eval_loss\n24,3.1\n")
    assert pr.EVAL not in pr.read_curves(str(job))
    p = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "csv"), "--out", str(tmp_path / "b.png")],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "its run folder(s): " + str(job) in p.stderr, p.stderr
