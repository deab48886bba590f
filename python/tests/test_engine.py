"""zinc.Engine against zinc-train: same losses bit for bit; checkpoints."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import zinc
from conftest import REPO, default_doc, run_zinc_train


def test_version_is_the_projects():
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert zinc.__version__ == re.search(r"project\(zinc LANGUAGES CXX VERSION ([0-9.]+)\)", cmake).group(1)


def test_python_loop_reproduces_zinc_train_bit_for_bit(doc, tmp_path):
    events = run_zinc_train(doc, tmp_path)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 21))
    with zinc.initialize(doc) as engine:
        assert (engine.rank, engine.world_size) == (0, 1)
        for e in steps:
            loss = engine.train_batch()
            # Exact equality: the same float from the same computation.
            assert (loss, engine.learning_rate, engine.grad_norm) == (e["loss"], e["lr"], e["grad_norm"]), e["step"]
            assert engine.global_steps == e["step"]
        assert engine.last_loss == pytest.approx(steps[-1]["loss"], rel=1e-6)
        [ev] = [e for e in events if e["event"] == "eval"]
        assert engine.evaluate() == ev["loss"]


@pytest.mark.parametrize("stage, offload", [(2, "cpu"), (3, "cpu"), (1, "none")])
def test_device_cuda_reaches_the_gpu_path(doc, stage, offload):
    """"device": "cuda" from Python reaches the engine's GPU path. Without a
    GPU the config refuses it, naming "device" and why; on a GPU the run
    trains like the CPU path (bf16 here: every loss within 0.05 nats, the
    bound of tests/cuda/cuda_engine_test.cpp; the GPU sums in another
    order). The GPU path itself is checked by the C++ GPU tests, which kernel
    emulation (tests/cuda_emu) runs on machines without a GPU."""
    doc["run"]["steps"] = 4
    doc["gradient_clipping"] = 0.0  # GPU-resident states sum the norm in another order
    doc["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": offload}}
    if stage == 3:
        doc["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with zinc.initialize(doc) as cpu:
        want = [cpu.train_batch() for _ in range(4)]
    doc["device"] = "cuda"
    try:
        gpu = zinc.initialize(doc)
    except zinc.ConfigError as e:
        assert e.path == "device", str(e)
        assert "no GPU is visible" in str(e) or "built without CUDA" in str(e), str(e)
        return
    with gpu:
        got = [gpu.train_batch() for _ in range(4)]
    assert got == pytest.approx(want, abs=0.05)


def test_forward_backward_step_equals_train_batch(doc):
    doc["run"]["steps"] = 3
    with zinc.initialize(doc) as a, zinc.initialize(doc) as b:
        rng = np.random.default_rng(0)
        B, T = doc["train_batch_size"], doc["data"]["seq_len"]
        for _ in range(3):
            x = rng.integers(0, 64, size=(B, T), dtype=np.int32)
            y = rng.integers(0, 64, size=(B, T), dtype=np.int32)
            loss = a.forward((x, y))
            a.backward()
            a.step()
            assert b.train_batch([{"inputs": x, "targets": y}]) == loss
        assert a.global_steps == b.global_steps == 3
        assert a.evaluate((x, y)) == b.evaluate((x, y))


def test_train_yields_zinc_trains_events(doc, tmp_path):
    want = run_zinc_train(doc, tmp_path)
    got = list(zinc.train(doc))
    timing = {"elapsed_s", "tokens_per_s", "eta_s", "eval_s", "checkpoint_s"}
    strip = lambda e: {k: v for k, v in e.items() if k not in timing}
    assert [e["event"] for e in got] == [e["event"] for e in want]
    for g, w in zip(got[:-1], want[:-1]):
        assert strip(g) == strip(w)
    g, w = got[-1], want[-1]
    assert set(g) - set(w) == set()
    for k in ("steps", "final_loss", "world_size", "zero_stage", "skipped_steps", "loss_floor", "final_eval_loss"):
        assert g[k] == w[k], k


def test_train_with_callback_and_steps(doc):
    seen = []
    summary = zinc.train(doc, steps=2, on_step=seen.append)
    assert summary is seen[-1] and summary["event"] == "summary" and summary["steps"] == 2
    assert [e["step"] for e in seen if e["event"] == "step"] == [1, 2]
    assert seen[0]["event"] == "config" and seen[0]["config"]["run"]["steps"] == 2


def test_config_path_and_pathlike(tmp_path, doc):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    with zinc.initialize(p) as a, zinc.initialize(str(p)) as b:
        assert a.train_batch() == b.train_batch()
        assert a.config["run"]["steps"] == 20


def test_checkpoint_round_trip(doc, tmp_path):
    ck = str(tmp_path / "ck")
    with zinc.initialize(doc) as a:
        for _ in range(3):
            a.train_batch()
        a.save_checkpoint(ck, client_state={"note": "three"})
        a.save_checkpoint(ck, tag="named")
        after = [a.train_batch() for _ in range(2)]
    # .zinc.lock: the folder's lock file (a save holds it), no checkpoint
    assert sorted(os.listdir(ck)) == [".zinc.lock", "global_step3", "latest", "named"]
    with zinc.initialize(doc) as b:
        client = b.load_checkpoint(ck, tag="global_step3")
        assert client["note"] == "three" and client["step"] == 3
        assert b.global_steps == 3
        assert [b.train_batch() for _ in range(2)] == after
    with zinc.initialize(doc) as c:
        c.load_checkpoint(ck)  # latest: "named", also after step 3
        assert c.global_steps == 3 and c.train_batch() == after[0]


def test_a_client_state_key_that_zinc_keeps_is_never_replaced_without_a_word(doc, tmp_path):
    # zinc keeps its data position and step in client_state: a caller's
    # 'step' or 'samples' with another value was replaced silently.
    # DeepSpeed's {"step": engine's step} is the same value: kept.
    ck = str(tmp_path / "ck")
    with zinc.initialize(doc) as a:
        a.train_batch()
        for key, value in (("step", 1234), ("samples", 5), ("data_samples", "mine")):
            with pytest.raises(ValueError, match=r"client_state\['%s'\] is .*zinc's own key there" % key):
                a.save_checkpoint(ck, client_state={key: value, "epoch": 7})
        assert not os.path.exists(os.path.join(ck, "global_step1"))
        a.save_checkpoint(ck, client_state={"step": a.global_steps, "epoch": 7})
    with zinc.initialize(doc) as b:
        client = b.load_checkpoint(ck)
        assert client["epoch"] == 7 and client["step"] == 1


def test_a_load_that_cannot_resume_changes_nothing(doc, tmp_path):
    """load_checkpoint makes zinc-train --resume's checks before it reads
    anything: a data position this batch layout cannot continue from (it
    raised after the load had replaced the weights and the step), and LoRA
    adapters of another scale (which no block records: they loaded without
    a word, a silently different model)."""
    ck = str(tmp_path / "ck")
    doc["model"]["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]}
    with zinc.initialize(doc) as a:
        for _ in range(3):
            a.train_batch()
        a.save_checkpoint(ck)  # 3 x 64 samples
    other = json.loads(json.dumps(doc))
    other["train_batch_size"] = 40  # micro-batches of 40 do not divide 192
    with zinc.initialize(other) as b:
        with pytest.raises(zinc.Error, match=r"data position 192 .* not a multiple of .* = 40.*nothing was loaded"):
            b.load_checkpoint(ck)
        assert b.global_steps == 0 and b.learning_rate == 0.0
    other = json.loads(json.dumps(doc))
    other["model"]["lora"]["lora_alpha"] = 16
    with zinc.initialize(other) as c:
        with pytest.raises(zinc.Error, match=r"trained LoRA adapters of r 4, lora_alpha 8 .* this run's are r 4, "
                                             r"lora_alpha 16"):
            c.load_checkpoint(ck)
        assert c.global_steps == 0
    with zinc.initialize(doc) as d:
        assert d.load_checkpoint(ck)["step"] == 3 and d.global_steps == 3


def saved_over_text(doc, tmp_path, capfd):
    """(checkpoint folder, text file): doc set to train on the text, one step saved; stderr so far read."""
    ck = str(tmp_path / "ck")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    doc["data"] = {"type": "text", "path": str(text), "seq_len": 16}
    doc["train_batch_size"] = 8
    doc["run"]["eval_interval"] = 0
    with zinc.initialize(doc) as a:
        a.train_batch()
        a.save_checkpoint(ck)
    capfd.readouterr()
    return ck, text


def test_a_load_over_other_data_or_model_settings_is_said(doc, tmp_path, capfd):
    """What the weights' shapes do not show is said at the load: data of
    another length (the saved position then falls in another epoch and
    order) and model settings that change what the weights compute
    (n_head, with the same shapes)."""
    ck, text = saved_over_text(doc, tmp_path, capfd)
    with zinc.initialize(doc) as b:
        b.load_checkpoint(ck)
    assert "was saved" not in capfd.readouterr().err  # the same run: nothing to say
    text.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    other = json.loads(json.dumps(doc))
    other["model"]["n_head"] = 2
    with zinc.initialize(other) as c:
        c.load_checkpoint(ck)
    err = capfd.readouterr().err
    assert re.search(r"was saved over data of \d+ samples an epoch; this run's data has \d+", err), err
    assert "settings differ from this run's (n_head 4 -> 2)" in err, err
    assert "other data" not in err, err  # said once: the length says it


def test_a_load_over_data_replaced_at_the_same_length_is_said(doc, tmp_path, capfd):
    """Data replaced by other data of the same length keeps the sample
    count; the data's sampled digest, saved in the checkpoint, tells it."""
    ck, text = saved_over_text(doc, tmp_path, capfd)
    text.write_text("THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG. " * 200)
    with zinc.initialize(doc) as b:
        b.load_checkpoint(ck)
    err = capfd.readouterr().err
    assert f"was saved over other data than this run's {text} (as many samples an epoch" in err, err
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)  # the same bytes again
    with zinc.initialize(doc) as c:
        c.load_checkpoint(ck)
    assert "was saved" not in capfd.readouterr().err


def test_python_checkpoint_resumes_in_zinc_train(doc, tmp_path):
    ck = tmp_path / "ck"
    doc["run"]["checkpoint_dir"] = str(ck)
    doc["run"]["eval_interval"] = 0
    with zinc.initialize(doc) as a:
        for _ in range(3):
            a.train_batch()
        a.save_checkpoint(str(ck))
        after = [a.train_batch() for _ in range(2)]
    events = run_zinc_train(doc, tmp_path, "--steps", "5", "--resume")
    assert [e["loss"] for e in events if e["event"] == "step"] == after


def test_ctrl_c_stops_between_steps_and_engine_stays_usable(tmp_path):
    # In a child process: the test runner must not see the KeyboardInterrupt.
    script = textwrap.dedent(
        """
        import os, signal, sys, threading, time, json
        sys.path.insert(0, %r)
        import zinc
        from conftest import default_doc
        engine = zinc.initialize(default_doc())
        engine.train_batch()
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        done = 1
        try:
            while True:
                engine.train_batch()
                done += 1
        except KeyboardInterrupt:
            pass
        # The interrupt comes when a train_batch returns: that step is
        # complete (the loop may not have counted it yet) and no later one began.
        n = engine.global_steps
        assert n in (done, done + 1) and engine.micro_steps == n, (n, done, engine.micro_steps)
        engine.train_batch()
        assert engine.global_steps == n + 1
        print("stopped after", n, "steps")
        # zinc.train: the generator stops with KeyboardInterrupt between steps.
        seen = []
        run = zinc.train(default_doc(steps=100000))
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            for ev in run:
                seen.append(ev)
        except KeyboardInterrupt:
            pass
        steps = [e["step"] for e in seen if e["event"] == "step"]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 100000, steps[-3:]
        print("train stopped after", len(steps), "steps")
        """
        % str(pathlib.Path(__file__).parent)
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "stopped after" in r.stdout and "train stopped after" in r.stdout


@pytest.mark.parametrize("how", ["process", "thread", "handler_ignores"])
def test_ctrl_c_in_a_train_that_saves_saves_the_step_it_stops_at(tmp_path, how):
    """Note [zinc.train's stop]: zinc.train lost the steps since its last save on a Ctrl-C. A run that saves now
    saves the step it stopped at, yields that step's events (its checkpoint's too), then raises KeyboardInterrupt.
    "process": the SIGINT from another process, pending on the training thread (every thread blocks it);
    "thread": taken by a Python thread (Python's flag); "handler_ignores": a SIGINT handler that raises nothing
    lets the run go on to its end."""
    script = textwrap.dedent(
        """
        import os, signal, subprocess, sys, threading, time
        sys.path.insert(0, %r)
        import zinc
        from conftest import default_doc
        how = %r
        doc = default_doc(steps=6 if how == "handler_ignores" else 100000)
        doc["run"].update(output_dir=%r, checkpoint_interval=100000, eval_interval=0)
        if how == "handler_ignores":
            signal.signal(signal.SIGINT, lambda *a: print("handled"))
        def interrupt():
            if how == "thread":  # a Python thread (the timer's) takes it
                threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            else:
                subprocess.Popen(["sh", "-c", "sleep 0.05; kill -INT %%d" %% os.getpid()])
        seen = []
        try:
            for ev in zinc.train(doc):
                seen.append(ev)
                if ev["event"] == "step" and ev["step"] == 3:
                    interrupt()
        except KeyboardInterrupt:
            print("interrupted")
        time.sleep(0.3)  # the handler's line, when it comes after the last step
        steps = [e["step"] for e in seen if e["event"] == "step"]
        saved = [e for e in seen if e["event"] == "checkpoint"]
        print("last", steps[-1], "saved", [e["step"] for e in saved], "summary" if seen[-1]["event"] == "summary" else "")
        """
        % (str(pathlib.Path(__file__).parent), how, str(tmp_path / "run"))
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = int(r.stdout.split("last ")[1].split()[0])
    if how == "handler_ignores":
        assert "handled" in r.stdout and "interrupted" not in r.stdout and "summary" in r.stdout, r.stdout
        assert last == 6 and "saved [6]" in r.stdout, r.stdout
        return
    assert "interrupted" in r.stdout, r.stdout
    assert 3 <= last < 100000 and ("saved [%d]" % last) in r.stdout, r.stdout
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "global_step%d" % last
    # zinc-train resumes it at the next step.
    resumed = default_doc(steps=last + 1)
    resumed["run"].update(output_dir=str(tmp_path / "run"), eval_interval=0)
    events = run_zinc_train(resumed, tmp_path, "--resume")
    assert [e["step"] for e in events if e["event"] == "step"] == [last + 1]


def test_unsafe_tags_are_refused_and_nothing_is_removed(doc, tmp_path):
    """Issue 27: a NUL in a tag cut the partial folder's path to the checkpoint
    folder itself and the save removed every checkpoint in it; "latest"
    replaced the `latest` file by a folder. Both are refused, in Python as in
    C++, and the folder's checkpoints stay."""
    ck = str(tmp_path / "ck")
    with zinc.initialize(doc) as e:
        e.train_batch()
        e.save_checkpoint(ck)
        before = sorted(os.listdir(ck))
        for bad in ["a\0b", "\0", "latest", "step1 ", "../x", ".hidden"]:
            with pytest.raises(zinc.Error, match="checkpoint tag .*A-Z a-z 0-9"):
                e.save_checkpoint(ck, tag=bad)
            assert sorted(os.listdir(ck)) == before
        e.load_checkpoint(ck)


def test_a_refused_tag_leaves_no_folder_and_an_empty_tag_is_refused(doc, tmp_path):
    """A save with a refused tag into a new folder made the folder and left its lock file there; tag="" was
    read as no tag (the save named it global_step<N>, the load read `latest`)."""
    fresh, ck = tmp_path / "fresh", str(tmp_path / "ck")
    with zinc.initialize(doc) as e:
        e.train_batch()
        with pytest.raises(zinc.Error, match="checkpoint tag"):
            e.save_checkpoint(fresh, tag="..")
        assert not fresh.exists()
        with pytest.raises(ValueError, match="tag is empty; leave it None for global_step<N>"):
            e.save_checkpoint(ck, tag="")
        assert not os.path.exists(ck)
        e.save_checkpoint(ck, tag="mine")
        with pytest.raises(ValueError, match="tag is empty; leave it None for the tag `latest` names"):
            e.load_checkpoint(ck, tag="")
        # A save the engine refuses (mid-batch) into a new folder leaves no folder, and no lock on it.
        e.forward()
        with pytest.raises(zinc.Error, match="must come between global batches"):
            e.save_checkpoint(fresh)
        assert not fresh.exists()
        e.backward()
        e.step()
        (fresh / "keep").mkdir(parents=True)  # one that existed, refused: left as it was
        e.forward()
        with pytest.raises(zinc.Error, match="must come between global batches"):
            e.save_checkpoint(fresh)
        assert sorted(os.listdir(fresh)) == [".zinc.lock", "keep"]  # its lock file stays, let go
        e.backward()
        e.step()
        e.save_checkpoint(fresh)


def test_train_holds_its_checkpoint_folder(doc, tmp_path):
    """Issue 27: two runs on one checkpoint_dir both ended with every tag from
    the second. zinc.train holds the folder from its start, as zinc-train does;
    a second run is refused naming the holder's pid."""
    ck = tmp_path / "ck"
    doc["run"].update({"checkpoint_dir": str(ck), "checkpoint_interval": 1, "eval_interval": 0})
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import json, sys, zinc
            it = zinc.train(json.loads({json.dumps(json.dumps(doc))}), steps=1000)
            next(it)
            print("holding", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(OSError, match=rf"is in use by another run \(pid {holder.pid} on"):
            zinc.train(doc, steps=1, on_step=lambda event: None)
    finally:
        holder.kill()
        holder.wait()
    summary = zinc.train(doc, steps=1, on_step=lambda event: None)  # free again once the holder is gone
    assert summary["steps"] == 1 and os.path.isdir(ck / "global_step1")


def test_an_engine_holds_the_folder_it_saved_into_until_closed(doc, tmp_path):
    """Note [an engine holds the folders it saves into]: between two saves of an engine a zinc-train went on in
    the folder, and the engine's next save moved `latest` back over that run's (found by a sweep of two writers,
    2026-12-03). A run on it is refused naming this process until the engine is closed."""
    from conftest import zinc_train_path
    zt = zinc_train_path()
    if zt is None:
        pytest.skip("zinc-train is not built (set ZINC_TRAIN)")
    ck = tmp_path / "ck"
    cfg = tmp_path / "cfg.json"
    run = dict(doc, run=dict(doc["run"], checkpoint_dir=str(ck), checkpoint_interval=1, eval_interval=0))
    cfg.write_text(json.dumps(run))
    with zinc.initialize(doc) as e:
        e.train_batch()
        e.save_checkpoint(str(ck))
        r = subprocess.run([zt, str(cfg), "--steps", "2"], capture_output=True, text=True, timeout=240)
        assert r.returncode == 1 and f"is in use by another run (pid {os.getpid()} on" in r.stderr, r.stderr
        e.train_batch()
        e.save_checkpoint(str(ck))  # its own saves go on
        assert (ck / "latest").read_text().strip() == "global_step2"
    r = subprocess.run([zt, str(cfg), "--steps", "3", "--resume"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr  # free once the engine is closed


def test_a_second_train_run_of_this_process_on_its_folder_is_refused(doc, tmp_path):
    """Note [two writers in one process]: a second zinc.train of the same
    process on the folder a run holds was not refused (the lock is a
    process's), and its saves replaced the first run's tags."""
    ck = tmp_path / "ck"
    doc["run"].update({"checkpoint_dir": str(ck), "checkpoint_interval": 1, "eval_interval": 0})
    first = zinc.train(doc, steps=3)
    next(first)
    with pytest.raises(OSError, match=r"is in use by another run of this process \(pid %d holds" % os.getpid()):
        zinc.train(doc, steps=1, on_step=lambda event: None)
    for _ in first:
        pass
    summary = zinc.train(doc, steps=1, on_step=lambda event: None)  # free again once the first run ended
    assert summary["steps"] == 1


def test_train_refuses_a_run_that_cannot_fit(doc):
    """Issue 27: zinc.train checks the room for the run at its start, as
    zinc-train does: a model whose estimate is hundreds of GiB is refused at
    once naming the figures, not killed by the OOM killer."""
    doc["model"].update({"n_layer": 48, "n_embd": 8192, "n_head": 64})
    with pytest.raises(zinc.Error, match=r"no room for this run: RAM: this rank will need .* [GMK]iB more"):
        zinc.train(doc, steps=1, on_step=lambda event: None)
    # ignore_resources=True skips the check: a model with one 200 GB block
    # then fails at its first allocation (where the kernel refuses one far
    # past RAM; with overcommit 1 it would be granted and the OOM killer
    # would end the test instead).
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            return
    doc["model"].update({"n_layer": 1, "n_embd": 65536, "n_head": 64})
    with pytest.raises(zinc.Error, match="no room for this run"):
        zinc.train(doc, steps=1, on_step=lambda event: None)
    with pytest.raises(MemoryError):
        zinc.train(doc, steps=1, on_step=lambda event: None, ignore_resources=True)


def test_train_writes_the_tensorboard_monitor(doc, tmp_path):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    doc["run"]["steps"] = 3
    doc["run"]["eval_interval"] = 0
    doc["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "py"}
    events = list(zinc.train(doc))
    acc = ea.EventAccumulator(str(tmp_path / "tb" / "py"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = [(s.step, s.value) for s in acc.Scalars("Train/Samples/train_loss")]
    B = doc["train_batch_size"]
    f32 = lambda x: float(np.float32(x))
    assert got == [(e["step"] * B, f32(e["loss"])) for e in events if e["event"] == "step"]


def test_an_engine_driven_step_by_step_writes_the_monitors(doc, tmp_path):
    """Note [monitors of a driven engine]: zinc.initialize's engine wrote no tensorboard or csv_monitor file, without
    a word. Now train_batch, and forward/backward/step at each optimizer step (the loss: the forwards' mean), write
    DeepSpeed's curves at x = the samples trained; load_checkpoint drops those past the loaded step; a folder it
    cannot make is refused."""
    doc["gradient_accumulation_steps"] = 2
    doc["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "py"}
    folder = tmp_path / "csv" / "py"
    rows = lambda name: [tuple(map(float, l.split(","))) for l in
                         (folder / f"Train_Samples_{name}.csv").read_text().splitlines()[1:]]
    B = doc["train_batch_size"]
    with zinc.initialize(doc) as e:
        losses = [e.train_batch() for _ in range(2)]
        e.save_checkpoint(str(tmp_path / "ck"))
        e.train_batch()
    assert [r[0] for r in rows("train_loss")] == [B, 2 * B, 3 * B]
    assert [r[1] for r in rows("train_loss")][:2] == pytest.approx(losses, rel=1e-6)
    assert [r[0] for r in rows("lr")] == [r[0] for r in rows("grad_norm")] == [B, 2 * B, 3 * B]
    with zinc.initialize(doc) as e:
        e.load_checkpoint(str(tmp_path / "ck"))  # at step 2: the curves past it go
        assert [r[0] for r in rows("train_loss")] == [B, 2 * B]
        forwards = []
        for _ in range(2):  # forward and backward per micro-batch, then the step at the boundary
            forwards.append(e.forward())
            e.backward()
        e.step()
        assert e.global_steps == 3
    got = rows("train_loss")
    assert [r[0] for r in got] == [B, 2 * B, 3 * B] and got[2][1] == pytest.approx(sum(forwards) / 2, rel=1e-6), got
    doc["csv_monitor"]["output_path"] = str(folder / "Train_Samples_lr.csv")
    with pytest.raises(OSError, match="csv_monitor: cannot create"):
        zinc.initialize(doc)


def test_a_driven_engine_logs_every_steps_per_print_steps(doc, capfd):
    # DeepSpeed's engine logs every steps_per_print steps, with
    # wall_clock_breakdown its timers; zinc.initialize's printed nothing.
    doc["steps_per_print"] = 2
    doc["wall_clock_breakdown"] = True
    capfd.readouterr()
    with zinc.initialize(doc) as e:
        losses = [e.train_batch() for _ in range(4)]
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if "] info: step " in l]
    assert [l.split("info: ")[1].split(" |")[0] for l in lines] == ["step 2", "step 4"], err
    assert f"loss {losses[1]:.4f}" in lines[0] and "time so far: forward" in lines[0], lines


def test_deepspeeds_call_forms_are_taken(doc, tmp_path):
    # engine.backward(loss) and an int tag, as DeepSpeed's scripts write
    # them, failed on pybind's "incompatible function arguments".
    with zinc.initialize(doc) as e:
        loss = e.forward()
        with pytest.raises(ValueError, match="is not the last forward's"):
            e.backward(loss + 1.0)
        with pytest.raises(TypeError, match="loss must be the float forward"):
            e.backward("x")
        e.backward(loss)
        e.step()
        e.save_checkpoint(str(tmp_path / "ck"), 1)
        assert (tmp_path / "ck" / "1").is_dir()
        with pytest.raises(TypeError, match="tag must be a str or an int"):
            e.save_checkpoint(str(tmp_path / "ck"), 1.5)
        e.load_checkpoint(str(tmp_path / "ck"), 1)
        assert e.global_steps == 1


def test_online_monitors_are_refused(doc):
    for key in ("wandb", "comet"):
        doc[key] = {"enabled": True}
        with pytest.raises(ValueError, match="tensorboard or csv_monitor"):
            list(zinc.train(doc))
        doc[key] = {"enabled": False}


def test_masked_targets_and_packed_positions(doc):
    """-100 targets count for nothing; positions pack documents: a document
    packed behind another gets the loss it has alone."""
    doc["bf16"]["enabled"] = False  # fp32: the two shapes agree to rounding
    rng = np.random.default_rng(3)
    T = doc["data"]["seq_len"]
    a, b = 5, T - 5  # two documents in one row
    x = rng.integers(0, 64, size=(1, T), dtype=np.int32)
    y = rng.integers(0, 64, size=(1, T), dtype=np.int32)
    y_second = y.copy()
    y_second[0, :a] = -100  # only the second document's targets
    pos = np.concatenate([np.arange(a), np.arange(b)]).astype(np.int32)[None, :]
    with zinc.initialize(doc) as engine:
        packed = engine.evaluate({"inputs": x, "targets": y_second, "positions": pos})
        alone = engine.evaluate((np.ascontiguousarray(x[:, a:]), np.ascontiguousarray(y[:, a:])))
        assert packed == pytest.approx(alone, rel=1e-5)
        flat = engine.evaluate((x, y_second))  # without positions it sees the first document
        assert abs(flat - alone) > 1e-4
        with pytest.raises(ValueError, match=r"targets\[0, 1\] = -1 "):
            y_bad = y.copy()
            y_bad[0, 1] = -1
            engine.evaluate((x, y_bad))
        bad = pos.copy()
        bad[0, 3] = 7
        # A bad argument's ValueError, named by the call, as for the tokens.
        with pytest.raises(ValueError, match=r"zinc.Engine.evaluate: positions\[0, 3\] = 7; each row starts at 0"):
            engine.evaluate({"inputs": x, "targets": y, "positions": bad})


def test_an_object_made_by_new_without_its_constructor_raises_type_error():
    # Note [an instance made with __new__]: Engine.__new__(Engine) and
    # AdamW.__new__(AdamW) gave methods uninitialised memory: a property read
    # garbage, a call segfaulted or hung. In a child process, so that a
    # crash fails this test and not the session.
    script = textwrap.dedent("""
        import numpy as np, zinc, zinc.optim
        def refused(f, words):
            try:
                f()
            except TypeError as e:
                assert words in str(e), str(e)
                return
            raise AssertionError("not refused")
        e = zinc.Engine.__new__(zinc.Engine)
        refused(lambda: e.closed, "made by __new__ without its constructor, so it has no closed")
        refused(lambda: e.forward(), "so it has no forward")
        def in_with():
            with e:
                pass
        refused(in_with, "made by __new__ without its constructor")
        refused(lambda: zinc.Engine.__exit__(5, None, None, None), "expected an instance of Engine, got int")
        o = zinc.optim.AdamW.__new__(zinc.optim.AdamW)
        p = np.ones(1000, np.float32)
        refused(lambda: o.lr, "so it has no lr")
        refused(lambda: o.step(1, p, p.copy(), p.copy(), p.copy()), "so it has no step")
        r = zinc._zinc._TrainRun.__new__(zinc._zinc._TrainRun)
        refused(lambda: r.start(), "so it has no start")
        assert type(e) is zinc.Engine and e.__class__ is zinc.Engine
        assert zinc.optim.AdamW(lr=0.5).lr == 0.5  # made properly: as before
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


def test_an_allocation_that_fails_inside_a_call_closes_the_engine_and_says_so(doc):
    # Note [an allocation that failed mid-call]: a std::bad_alloc past the
    # batch's room check left the engine mid-step, holding what it had
    # allocated; the next call then segfaulted inside oneDNN under the same
    # memory limit. ZINC_FAULT_ALLOC_BYTES fails the large mappings, as an
    # exhausted limit does. In a child process: a crash fails this test.
    script = textwrap.dedent("""
        import json, os, sys, numpy as np, zinc
        doc = json.loads(sys.argv[1])
        x = np.random.randint(0, 64, (2, 16), dtype=np.int32)
        e = zinc.initialize(doc)
        e.forward((x, x))
        os.environ["ZINC_FAULT_ALLOC_BYTES"] = str(1 << 20)
        big = np.random.randint(0, 64, (64, 64), dtype=np.int32)
        try:
            e.forward((big, big))
            raise AssertionError("no MemoryError")
        except MemoryError as err:
            text = str(err)
        assert "zinc.Engine.forward: out of memory: an allocation failed" in text, text
        assert "the engine is closed, its memory freed" in text, text
        assert e.closed
        try:
            e.forward((x, x))
            raise AssertionError("a closed engine ran")
        except ValueError as err:
            assert "the engine is closed" in str(err), str(err)
        del os.environ["ZINC_FAULT_ALLOC_BYTES"]
        with zinc.initialize(doc) as again:
            assert np.isfinite(again.forward((x, x)))
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script, json.dumps(doc)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr)


def test_an_address_space_limit_is_room_the_batch_check_knows():
    # Under `ulimit -v` (RLIMIT_AS) the room check read MemAvailable only and
    # let a batch through that could not fit, and train_batch() with the
    # config's data was not checked at all: std::bad_alloc, after which the
    # next forward segfaulted inside oneDNN.
    script = textwrap.dedent("""
        import json, resource, sys, numpy as np
        resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))
        import zinc
        doc = json.loads(sys.argv[1])
        doc["model"] = {"type": "gpt", "n_layer": 2, "n_head": 8, "n_embd": 256}
        doc["train_batch_size"] = 256
        doc["data"]["seq_len"] = 1024
        e = zinc.initialize(doc)
        try:
            e.train_batch()
            raise AssertionError("no MemoryError")
        except MemoryError as err:
            text = str(err)
        assert "zinc.Engine.train_batch: a batch of 256 x 1024 tokens needs about" in text, text
        assert "RLIMIT_AS (ulimit -v) 1.50 GiB" in text, text
        x = np.random.randint(0, 64, (4, 16), dtype=np.int32)
        assert np.isfinite(e.forward((x, x)))  # refused before anything was allocated: still usable
        print("ok")
    """)
    doc = json.loads((REPO / "configs" / "default.json").read_text())
    r = subprocess.run([sys.executable, "-c", script, json.dumps(doc)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr)
