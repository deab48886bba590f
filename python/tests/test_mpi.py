"""Two ranks from Python under mpirun: the same losses as zinc-train under mpirun."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

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


@pytest.mark.skipif(not MPIEXEC, reason="no mpirun on PATH (set MPIEXEC)")
def test_ranks_with_different_configs_are_refused(tmp_path):
    """Issue 27: ranks given different configs trained diverging shards.
    zinc.initialize checks a digest of the config and model on every rank and
    raises ConfigError (a ValueError) naming the first differing key."""
    doc = default_doc(steps=2)
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    script = tmp_path / "differ.py"
    script.write_text(textwrap.dedent("""
        import json, os, pathlib, sys
        import zinc
        doc = json.loads(pathlib.Path(sys.argv[1]).read_text())
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        if rank == 1:
            doc["optimizer"]["params"]["lr"] = 0.3
        try:
            zinc.initialize(doc)
            msg = "initialized"
        except ValueError as e:
            msg = "%s: %s" % (type(e).__name__, e)
        pathlib.Path(sys.argv[2], "rank%d.txt" % rank).write_text(msg)
    """))
    r = subprocess.run([*launcher(2), sys.executable, str(script), str(tmp_path / "cfg.json"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for k in range(2):
        msg = (tmp_path / ("rank%d.txt" % k)).read_text()
        assert msg.startswith("ConfigError: optimizer.params.lr: the ranks were given different configs: "
                              "rank 1 has 0.3, rank 0 has 0.003"), msg
