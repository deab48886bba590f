"""One engine, several Python threads: every call either runs or is refused
with RuntimeError, and close() from another thread never frees an engine
under a running call (Note [one call at a time] in python/src/module.cpp).

Each test runs its threads in a child process: before the engine refused
concurrent calls, these crashed the interpreter, and a crash must fail the
test, not the test runner.
"""
import pathlib
import subprocess
import sys
import textwrap

HERE = pathlib.Path(__file__).parent

PRELUDE = """
import sys, threading, time, traceback
sys.path.insert(0, %r)
import numpy as np
import zinc
from conftest import default_doc
REFUSED = "an engine is driven by one thread at a time"
""" % str(HERE)


def run_child(body, timeout=300):
    script = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, "exit %d\nstdout:\n%s\nstderr:\n%s" % (r.returncode, r.stdout, r.stderr[-4000:])
    return r.stdout


def test_a_call_during_another_is_refused_and_close_lets_it_finish():
    # Deterministic: train_batch reads its batches from a generator, which
    # runs inside the call; it waits there while the main thread calls in.
    out = run_child(
        """
        e = zinc.initialize(default_doc())
        x = np.random.default_rng(1).integers(0, 64, size=(64, 64), dtype=np.int32)
        inside, tried, result = threading.Event(), threading.Event(), {}

        def batches():
            inside.set()
            assert tried.wait(60)
            yield (x, np.roll(x, -1, axis=1))

        def train():
            try:
                result["loss"] = e.train_batch(batches())
            except BaseException as exc:
                result["error"] = repr(exc)

        t = threading.Thread(target=train)
        t.start()
        assert inside.wait(60)
        for name, call in [("forward", lambda: e.forward()), ("backward", e.backward), ("step", e.step),
                           ("train_batch", lambda: e.train_batch()), ("evaluate", lambda: e.evaluate((x, x))),
                           ("save_checkpoint", lambda: e.save_checkpoint("/nonexistent/x")),
                           ("global_steps", lambda: e.global_steps), ("learning_rate", lambda: e.learning_rate)]:
            try:
                call()
                raise AssertionError(name + " ran inside another thread's train_batch")
            except RuntimeError as exc:
                want = ("zinc.Engine.%s: another thread is inside zinc.Engine.train_batch; "
                        "an engine is driven by one thread at a time" % name)
                assert str(exc) == want, (str(exc), want)
        assert e.closed is False
        e.close()                    # returns at once: the call in flight frees the engine when it ends
        assert e.closed
        tried.set()
        t.join(120)
        assert not t.is_alive()
        assert "loss" in result and np.isfinite(result["loss"]), result
        for call in (lambda: e.forward(), lambda: e.global_steps):
            try:
                call()
                raise AssertionError("a closed engine ran a call")
            except ValueError as exc:
                assert "the engine is closed" in str(exc), str(exc)
        e.close()
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_a_call_from_inside_a_call_on_the_same_thread_is_refused():
    out = run_child(
        """
        with zinc.initialize(default_doc()) as e:
            x = np.zeros((4, 8), np.int32)
            seen = []

            def batches():
                try:
                    e.forward((x, x))
                except RuntimeError as exc:
                    seen.append(str(exc))
                e.close()            # deferred: train_batch goes on, then frees the engine
                yield (x, x)

            loss = e.train_batch(batches())
            assert np.isfinite(loss)
            assert seen == ["zinc.Engine.forward: called from inside zinc.Engine.train_batch on the same thread "
                            "(e.g. from the data it iterates); an engine runs one call at a time"], seen
            assert e.closed
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_threads_hammering_one_engine_end_alive():
    # Three threads each run forward/backward/step 40 times, a fourth reads
    # properties. Every call runs or raises: the refusal, or the engine's
    # own error for a call out of order (another thread's forward came
    # between this one's forward and backward). Nothing else, no crash.
    out = run_child(
        """
        e = zinc.initialize(default_doc())
        counts = {"ran": 0, "refused": 0, "out_of_order": 0}
        other = []
        lock = threading.Lock()
        stop = threading.Event()

        def outcome(call):
            try:
                call()
                kind = "ran"
            except RuntimeError as exc:
                msg = str(exc)
                if REFUSED in msg:
                    kind = "refused"
                elif isinstance(exc, zinc.Error) and ("without a preceding forward" in msg
                                                        or "has not been stepped" in msg):
                    kind = "out_of_order"
                else:
                    kind = None
                    other.append(repr(exc))
            except BaseException as exc:
                kind = None
                other.append(traceback.format_exc())
            if kind:
                with lock:
                    counts[kind] += 1

        def trainer():
            for _ in range(40):
                outcome(lambda: e.forward())
                outcome(e.backward)
                outcome(e.step)

        def reader():
            while not stop.is_set():
                outcome(lambda: (e.global_steps, e.grad_norm, e.loss_scale, e.closed))
                time.sleep(0.001)

        threads = [threading.Thread(target=trainer) for _ in range(3)]
        r = threading.Thread(target=reader)
        for t in threads + [r]:
            t.start()
        for t in threads:
            t.join(240)
        stop.set()
        r.join(60)
        assert not any(t.is_alive() for t in threads + [r])
        assert not other, other[:3]
        assert counts["ran"] > 0, counts
        print(counts)
        e.close()
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_close_from_another_thread_during_train_batch():
    # close() at various moments of a stream of train_batch calls: the
    # training thread ends with "the engine is closed" (or a refusal, if it
    # called in while close() was freeing), never with a crash.
    out = run_child(
        """
        for delay in (0.0, 0.01, 0.05, 0.2):
            e = zinc.initialize(default_doc())
            result = {}

            def train():
                n = 0
                try:
                    while True:
                        e.train_batch()
                        n += 1
                except (ValueError, RuntimeError) as exc:
                    result["steps"], result["error"] = n, str(exc)

            t = threading.Thread(target=train)
            t.start()
            time.sleep(delay)
            e.close()
            assert e.closed
            t.join(120)
            assert not t.is_alive()
            err = result["error"]
            assert "the engine is closed" in err or REFUSED in err, err
            print(delay, result)
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_a_train_run_driven_from_two_threads():
    # zinc.train's step object: two threads stepping one run, and a third
    # calling into its engine. Each step runs whole or is refused.
    out = run_child(
        """
        run = zinc._zinc._TrainRun(default_doc(), 30)
        run.start()
        counts = {"steps": 0, "refused": 0}
        other = []
        lock = threading.Lock()
        done = threading.Event()

        def stepper():
            while not done.is_set():
                try:
                    if run.step() is None:
                        done.set()
                    else:
                        with lock:
                            counts["steps"] += 1
                except RuntimeError as exc:
                    if REFUSED not in str(exc):
                        other.append(repr(exc))
                    with lock:
                        counts["refused"] += 1
                    time.sleep(0.001)

        def poker():
            while not done.is_set():
                try:
                    run.engine.global_steps
                except RuntimeError as exc:
                    if "another thread is inside zinc.train" not in str(exc):
                        other.append(repr(exc))
                time.sleep(0.001)

        threads = [threading.Thread(target=stepper) for _ in range(2)] + [threading.Thread(target=poker)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not other, other[:3]
        assert counts["steps"] == 30, counts
        assert run.summary()["steps"] == 30
        run.engine.close()
        print(counts)
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_the_interpreter_exits_cleanly_while_a_daemon_thread_trains():
    # The main thread returns while a daemon thread is inside train_batch
    # (and inside a zinc.train step): the call that ends after finalisation
    # began does not take the GIL back (CPython would pthread_exit the
    # thread through a C++ destructor: SIGABRT, exit 134, every time).
    for body in (
        """
        e = zinc.initialize(default_doc())
        def loop():
            while True:
                e.train_batch()
        threading.Thread(target=loop, daemon=True).start()
        time.sleep(0.5)
        print("returning")
        """,
        """
        def loop():
            for _ in zinc.train(default_doc()):
                pass
        threading.Thread(target=loop, daemon=True).start()
        time.sleep(1.0)
        print("returning")
        """,
    ):
        assert run_child(body).strip().endswith("returning")


def test_a_forked_child_refuses_the_parents_engine_and_exits(tmp_path):
    # Note [engines across fork] in python/src/module.cpp: the child of a
    # process with a ZeRO-3 NVMe engine hung for ever in its first step, or
    # at exit (closing the engine joined threads the child does not have).
    # Now every call there is refused, its exit lets the copy go, and the
    # parent's engine (and its NVMe files) train on.
    out = run_child(
        """
        import os
        nvme = %r
        os.makedirs(nvme)
        doc = default_doc()
        off = {"device": "nvme", "nvme_path": nvme}
        doc["zero_optimization"] = {"stage": 3, "offload_optimizer": dict(off), "offload_param": dict(off)}
        e = zinc.initialize(doc)
        e.train_batch()
        pid = os.fork()
        if pid == 0:
            try:
                e.train_batch()
                code = 3
            except zinc.Error as exc:
                code = 0 if "os.fork()ed this one" in str(exc) else 4
            sys.exit(code)  # atexit closes the engine: it must not hang
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        e.train_batch()
        e.close()
        print("parent ok")
        """ % str(tmp_path / "nvme"),
        timeout=120,
    )
    assert "child 0" in out and out.strip().endswith("parent ok"), out
