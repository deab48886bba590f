"""Two ranks from Python under mpirun: the same losses as zinc-train under mpirun."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import default_doc, run_zinc_train

MPIEXEC = os.environ.get("MPIEXEC") or shutil.which("mpirun")


def launcher(np_):
    flags = ["--oversubscribe"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    env_flags = []
    for k in ("PYTHONPATH", "OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA"):
        if k in os.environ:
            env_flags += ["-x", k]
    return [MPIEXEC, *flags, *env_flags, "-np", str(np_)]


@pytest.mark.skipif(not MPIEXEC, reason="no mpirun on PATH (set MPIEXEC)")
def test_two_ranks_reproduce_zinc_train_bit_for_bit(tmp_path):
    doc = default_doc(steps=8)
    doc["run"]["eval_interval"] = 0
    want = run_zinc_train(doc, tmp_path, launcher=launcher(2))
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    script = tmp_path / "loop.py"
    # Each rank writes its own file: two ranks' lines on mpirun's merged
    # stdout can arrive joined on one line.
    script.write_text(textwrap.dedent("""
        import json, pathlib, sys
        import zinc
        with zinc.initialize(sys.argv[1]) as engine:
            assert engine.world_size == 2, engine.world_size
            losses = [engine.train_batch() for _ in range(8)]
            rows = {"rank": engine.rank, "loss": losses, "lr": engine.learning_rate, "grad_norm": engine.grad_norm}
        pathlib.Path(sys.argv[2], "rank%d.json" % rows["rank"]).write_text(json.dumps(rows))
    """))
    r = subprocess.run([*launcher(2), sys.executable, str(script), str(tmp_path / "cfg.json"), str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads((tmp_path / ("rank%d.json" % k)).read_text()) for k in range(2)]
    assert sorted(row["rank"] for row in rows) == [0, 1]
    steps = [e for e in want if e["event"] == "step"]
    for row in rows:  # every rank sees the mean over all ranks
        assert row["loss"] == [e["loss"] for e in steps]
        assert (row["lr"], row["grad_norm"]) == (steps[-1]["lr"], steps[-1]["grad_norm"])


def _run_ranks(tmp_path, body, np_=2, timeout=300, extra=()):
    """Runs `body` (a script with sys.argv[1] the folder) on np_ ranks; returns
    the CompletedProcess and each rank's rank<k>.txt."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(body))
    r = subprocess.run([*launcher(np_), *extra, sys.executable, str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=timeout)
    return r, [(tmp_path / ("rank%d.txt" % k)).read_text() if (tmp_path / ("rank%d.txt" % k)).exists() else None
               for k in range(np_)]


@pytest.mark.skipif(not MPIEXEC, reason="no mpirun on PATH (set MPIEXEC)")
def test_ranks_with_different_configs_are_refused(tmp_path):
    """Issue 27: ranks given different configs trained diverging shards.
    zinc.initialize checks a digest of the config and model on every rank and
    raises ConfigError (a ValueError) naming the first differing key."""
    doc = default_doc(steps=2)
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    r, msgs = _run_ranks(tmp_path, """
        import json, os, pathlib, sys
        import zinc
        out = pathlib.Path(sys.argv[1])
        doc = json.loads((out / "cfg.json").read_text())
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        if rank == 1:
            doc["optimizer"]["params"]["lr"] = 0.3
        try:
            zinc.initialize(doc)
            msg = "initialized"
        except ValueError as e:
            msg = "%s: %s" % (type(e).__name__, e)
        (out / ("rank%d.txt" % rank)).write_text(msg)
    """)
    assert r.returncode == 0, r.stderr
    for msg in msgs:
        assert msg.startswith("ConfigError: optimizer.params.lr: the ranks were given different configs: "
                              "rank 1 has 0.3, rank 0 has 0.003"), msg


@pytest.mark.skipif(not MPIEXEC, reason="no mpirun on PATH (set MPIEXEC)")
def test_a_rank_that_ends_after_its_own_error_ends_the_others_wait(tmp_path):
    """A script that catches an error on rank 1 and ends while rank 0 is in
    train_batch(): before, rank 0 waited in an f64 reduction over MPI and
    rank 1 in its communicator's closing barrier, both without a limit. Now
    rank 0's wait ends at once, naming rank 1, far inside the 600 s timeout,
    and both processes end."""
    doc = default_doc(steps=4)
    doc["zero_optimization"] = {"stage": 2}
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    r, msgs = _run_ranks(tmp_path, """
        import json, os, pathlib, sys, time
        import zinc
        out = pathlib.Path(sys.argv[1])
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        engine = zinc.initialize(str(out / "cfg.json"))
        t0 = time.monotonic()
        try:
            if rank == 1:
                raise ValueError("a bad batch on rank 1 alone")
            for _ in range(4):
                engine.train_batch()
            msg = "trained"
        except Exception as e:
            msg = "%s: %s" % (type(e).__name__, e)
        (out / ("rank%d.txt" % rank)).write_text("%.1f %s" % (time.monotonic() - t0, msg))
        engine.close()
    """, timeout=240)
    assert r.returncode == 0, r.stderr
    took, _, msg0 = msgs[0].partition(" ")
    assert "has closed its communicator" in msg0 and "(rank 1)" in msg0, msg0
    assert float(took) < 60, msgs[0]
    assert msgs[1].split(" ", 1)[1] == "ValueError: a bad batch on rank 1 alone", msgs[1]


@pytest.mark.skipif(not MPIEXEC, reason="no mpirun on PATH (set MPIEXEC)")
def test_ranks_that_load_different_checkpoints_are_refused(tmp_path):
    """Ranks that open two checkpoints (a relative folder from two working
    directories, `latest` moved between their reads) went on from two
    states without a word; now every rank raises naming both tags, and
    nothing is loaded."""
    doc = default_doc(steps=4)
    doc["zero_optimization"] = {"stage": 1}
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    r, msgs = _run_ranks(tmp_path, """
        import os, pathlib, sys
        import zinc
        out = pathlib.Path(sys.argv[1])
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        with zinc.initialize(str(out / "cfg.json")) as engine:
            engine.train_batch()
            engine.save_checkpoint(str(out / "ck"), "a")
            engine.train_batch()
            engine.save_checkpoint(str(out / "ck"), "b")
            try:
                engine.load_checkpoint(str(out / "ck"), "a" if rank == 0 else "b")
                msg = "loaded"
            except OSError as e:
                msg = "%s: %s" % (type(e).__name__, e)
            steps = engine.global_steps
        (out / ("rank%d.txt" % rank)).write_text("%d %s" % (steps, msg))
    """)
    assert r.returncode == 0, r.stderr
    for m in msgs:
        assert "the ranks opened different checkpoints: rank 1 opened \"b\", rank 0 \"a\"" in m, m
        assert m.startswith("2 "), m  # nothing loaded: still at step 2


@pytest.mark.skipif(not MPIEXEC, reason="no mpirun on PATH (set MPIEXEC)")
@pytest.mark.parametrize("backend", ["mpi", "hierarchical"])
def test_a_rank_waiting_in_mpi_for_a_peer_that_never_comes_ends_the_job(tmp_path, monkeypatch, backend):
    """Note [MPI collectives: the time limit]: over the mpi backend, or
    between the machines of the hierarchical one (each rank a machine of its
    own here), a rank whose peer stopped calling the engine (here it sleeps)
    waited in an MPI collective without a limit. Now the job ends once
    comm.timeout_seconds have passed, with one line naming the waiting rank
    and the call."""
    doc = default_doc(steps=4)
    doc["comm"] = {"backend": backend, "timeout_seconds": 3}
    if backend == "hierarchical":
        monkeypatch.setenv("ZINC_COMM_FAKE_NODE_SIZE", "1")
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    t0 = time.monotonic()
    r, msgs = _run_ranks(tmp_path, """
        import os, pathlib, sys, time
        import zinc
        out = pathlib.Path(sys.argv[1])
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        engine = zinc.initialize(str(out / "cfg.json"))
        (out / ("rank%d.txt" % rank)).write_text("started")
        if rank == 1:
            time.sleep(300)
        else:
            for _ in range(4):
                engine.train_batch()
        (out / ("rank%d.txt" % rank)).write_text("ended")
    """, timeout=280, extra=("-x", "ZINC_COMM_FAKE_NODE_SIZE") if backend == "hierarchical" else ())
    took = time.monotonic() - t0
    assert r.returncode != 0, (r.stdout, r.stderr)
    assert msgs == ["started", "started"], msgs  # neither rank went on
    assert "zinc: rank 0: MPI_" in r.stderr and "for the other ranks, past comm.timeout_seconds (3 s" in r.stderr, \
        r.stderr
    assert took < 120, took  # the sleeping rank would have held the job for 300 s
