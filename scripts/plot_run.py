"""Draws a run's loss curves (train and held-out) into a PNG.

    python3 scripts/plot_run.py RUN --out loss.png [--title TEXT]

RUN is what a zinc-train (or zinc.train) run's monitors wrote:
  - a tensorboard event file (events.out.tfevents.*), or the folder holding
    a run's (tensorboard.output_path/job_name; every file in it, as
    TensorBoard reads a run): read with the tensorboard package's own
    EventAccumulator;
  - a csv_monitor folder (csv_monitor.output_path/job_name), whose
    Train_Samples_train_loss.csv and Eval_Samples_eval_loss.csv it reads.
The x axis is the samples trained, as both monitors write it (DeepSpeed's
convention). Needs matplotlib (scripts/setup.sh installs it), and
tensorboard for event files.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys

TRAIN, EVAL = "Train/Samples/train_loss", "Eval/Samples/eval_loss"


def _from_events(path: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(path, size_guidance={ea.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in (TRAIN, EVAL) if t in tags}


def _csv_runs(path: str) -> tuple[list[list[tuple[int, float]]], int]:
    """The runs of one csv_monitor file, each the rows under a header row ("step,NAME": a fresh run in the
    folder starts under its own; a resumed one continues the run before it), and the count of lines that are
    no row (one a kill cut short)."""
    runs: list[list[tuple[int, float]]] = [[]]
    torn = 0
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "step":
                runs.append([])
                continue
            try:
                if len(r) != 2:
                    raise ValueError
                runs[-1].append((int(r[0]), float(r[1])))
            except ValueError:
                torn += 1
    if not runs[0]:
        runs.pop(0)
    return runs, torn


def _from_csv(folder: str) -> dict[str, list[tuple[int, float]]]:
    """The last run's curves: the train file's last run, and the held-out file's when it holds as many runs
    (a run without evaluations wrote no header there, so its runs would not line up)."""
    out = {}
    counts = {}
    for tag in (TRAIN, EVAL):
        path = os.path.join(folder, tag.replace("/", "_") + ".csv")
        if not os.path.isfile(path):
            continue
        runs, torn = _csv_runs(path)
        if torn:
            print(f"plot_run: {path}: skipped {torn} line(s) that are no row (cut short by a kill)", file=sys.stderr)
        counts[tag] = len(runs)
        if runs:
            out[tag] = runs[-1]
    n = counts.get(TRAIN, 0)
    if n > 1:
        print(f"plot_run: {folder} holds {n} runs (a fresh run in a csv_monitor folder starts under a header row "
              "of its own); drawing the last (set csv_monitor.job_name per run to keep runs apart)", file=sys.stderr)
    if EVAL in out and counts.get(EVAL) != n:
        print(f"plot_run: {folder}: its held-out file holds {counts.get(EVAL)} runs and its train file {n}: which "
              "is the last run's is unknown, so no held-out curve is drawn", file=sys.stderr)
        del out[EVAL]
    return out


def read_curves(run: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(samples, loss), ...]} of the run's train and held-out loss."""
    if os.path.isdir(run):
        events = sorted(glob.glob(os.path.join(run, "events.out.tfevents.*")))
        if events:
            # The whole folder, as TensorBoard reads a run: a resumed run's
            # file continues the earlier ones (its SessionLog START drops
            # what a crashed run wrote past its checkpoint).
            curves = _from_events(run)
        else:
            curves = _from_csv(run)
    elif os.path.basename(run).startswith("events.out.tfevents."):
        curves = _from_events(run)
    else:
        raise SystemExit(f"plot_run: {run} is neither an event file nor a folder of one or of csv_monitor files")
    if TRAIN not in curves or not curves[TRAIN]:
        # The monitor's output_path, not its job_name folder: name the runs inside.
        inner = sorted(d for d in (glob.glob(os.path.join(run, "*", "events.out.tfevents.*")) +
                                   glob.glob(os.path.join(run, "*", "Train_Samples_train_loss.csv"))))
        if os.path.isdir(run) and inner:
            folders = sorted({os.path.dirname(p) for p in inner})
            raise SystemExit(f"plot_run: {run} holds no {TRAIN} scalars itself; its run folder(s): "
                             + ", ".join(folders[:5]) + (" ..." if len(folders) > 5 else "")
                             + " (the monitor's output_path/job_name): give one")
        raise SystemExit(f"plot_run: {run} holds no {TRAIN} scalars (was a monitor enabled, and did a step finish?)")
    return curves


def plot(curves: dict, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x, y = zip(*curves[TRAIN])
    ax.plot(x, y, lw=1, label="train loss (each step's global batch)")
    if curves.get(EVAL):
        ex, ey = zip(*curves[EVAL])
        ax.plot(ex, ey, "o-", lw=1.5, ms=4, label="held-out loss")
    ax.set_xlabel("samples trained")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    # Written whole beside its place and renamed: a kill leaves the old PNG or the new one.
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="an event file, or a tensorboard or csv_monitor folder")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default=None, help="default: the run's path")
    a = ap.parse_args(argv)
    # The PNG never replaces what it is drawn from (compared as files, not as spellings of a path).
    inputs = [a.run] if not os.path.isdir(a.run) else [os.path.join(a.run, f) for f in os.listdir(a.run)]
    for f in inputs:
        if os.path.exists(a.out) and os.path.exists(f) and os.path.samefile(a.out, f):
            raise SystemExit(f"plot_run: --out {a.out} is {f}, which it reads; choose another file")
    if os.path.isdir(a.out):
        raise SystemExit(f"plot_run: --out {a.out} is a folder; name the PNG to write")
    curves = read_curves(a.run)
    plot(curves, a.out, a.title or a.run)
    n_eval = len(curves.get(EVAL, []))
    print(f"plot_run: {a.out}: {len(curves[TRAIN])} train points, {n_eval} held-out points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
