"""Bad input: an exception of the right type naming what was wrong, never a crash."""
import numpy as np
import pytest

import zinc


@pytest.fixture(scope="module")
def engine():
    from conftest import default_doc

    with zinc.initialize(default_doc()) as e:
        yield e


def ids(shape, dtype=np.int32):
    return np.zeros(shape, dtype=dtype)


def test_exception_hierarchy():
    assert issubclass(zinc.ConfigError, ValueError)
    assert issubclass(zinc.CommError, zinc.Error) and issubclass(zinc.Error, RuntimeError)


@pytest.mark.parametrize(
    "change, path, words",
    [
        (lambda d: d.update(optimzer={}), "optimzer", "did you mean 'optimizer'"),
        (lambda d: d["optimizer"]["params"].update(lr="abc"), "optimizer.params.lr", "expected a number"),
        (lambda d: d["zero_optimization"].update(stage=4), "zero_optimization.stage", "must be"),
        (lambda d: d.update(gradient_accumulation_steps=3), "train_batch_size", ""),
        (lambda d: d["model"].update(n_embd=[1]), "model.n_embd", ""),
    ],
)
def test_config_error_carries_the_json_path(doc, change, path, words):
    change(doc)
    with pytest.raises(zinc.ConfigError) as e:
        zinc.initialize(doc)
    assert e.value.path == path
    assert str(e.value).startswith(path) and words in str(e.value)


def test_config_values_must_be_json(doc):
    doc["run"]["seed"] = object()
    with pytest.raises(zinc.ConfigError) as e:
        zinc.initialize(doc)
    assert e.value.path == "run.seed"


def test_config_of_wrong_type():
    with pytest.raises(TypeError, match="config must be a dict or a path"):
        zinc.initialize(42)


def test_missing_config_file_is_oserror(tmp_path):
    with pytest.raises(OSError, match="nope.json"):
        zinc.initialize(tmp_path / "nope.json")


def test_missing_data_file_names_the_key(doc, tmp_path):
    doc["data"] = {"type": "text", "path": str(tmp_path / "none.txt"), "seq_len": 64}
    with pytest.raises((zinc.ConfigError, OSError), match="none.txt"):
        zinc.initialize(doc)


def test_train_steps_must_be_positive(doc):
    with pytest.raises(ValueError, match="steps must be positive"):
        next(zinc.train(doc, steps=0))


@pytest.mark.parametrize(
    "batch, exc, words",
    [
        ((ids((4, 64), np.int64), ids((4, 64))), TypeError, "inputs must have dtype int32, got int64"),
        ((ids((4, 64)), ids((4, 64), np.float32)), TypeError, "targets must have dtype int32"),
        ((ids((4, 128))[:, ::2], ids((4, 64))), ValueError, "inputs must be C-contiguous"),
        ((ids((4, 64)), np.asfortranarray(ids((4, 64)))), ValueError, "targets must be C-contiguous"),
        ((ids((256,)), ids((256,))), ValueError, "inputs must have 2 dimensions"),
        ((ids((4, 64)), ids((4, 32))), ValueError, "targets must have the shape of inputs (4, 64), got (4, 32)"),
        ((ids((0, 64)), ids((0, 64))), ValueError, "inputs must not be empty"),
        ((ids((2, 65)), ids((2, 65))), ValueError, "block_size is 64"),
        (([[1, 2]], ids((1, 2))), TypeError, "inputs must be a numpy.ndarray"),
        ((ids((2, 8)) + 64, ids((2, 8))), ValueError, "inputs[0, 0] = 64 is outside the vocabulary [0, 64)"),
        ((ids((2, 8)), ids((2, 8)) - 1), ValueError, "targets[0, 0] = -1 is outside the vocabulary"),
        ({"inputs": ids((2, 8))}, ValueError, "keys 'inputs' and 'targets'"),
        ("tokens", TypeError, "batch must be an (inputs, targets) pair"),
    ],
)
def test_bad_batches_name_the_argument(engine, batch, exc, words):
    steps = engine.global_steps
    for call in (engine.forward, engine.evaluate):
        with pytest.raises(exc) as e:
            call(batch)
        assert words in str(e.value)
    assert engine.global_steps == steps
    engine.forward((ids((2, 8)), ids((2, 8))))  # still usable
    engine.backward()
    engine.step()


def test_train_batch_needs_one_batch_per_accumulation_step(engine):
    with pytest.raises(ValueError, match="gradient_accumulation_steps = 1 batches, got 2"):
        engine.train_batch([(ids((2, 8)), ids((2, 8)))] * 2)


def test_backward_without_forward_is_an_error():
    from conftest import default_doc

    with zinc.initialize(default_doc()) as e:
        with pytest.raises(zinc.Error, match="without a preceding forward"):
            e.backward()


def test_closed_engine():
    from conftest import default_doc

    e = zinc.initialize(default_doc())
    e.close()
    assert e.closed
    for call in (lambda: e.train_batch(), lambda: e.forward(), lambda: e.global_steps, lambda: e.save_checkpoint("x")):
        with pytest.raises(ValueError, match="the engine is closed"):
            call()
    e.close()  # idempotent


def test_load_missing_checkpoint_is_oserror(engine, tmp_path):
    with pytest.raises(OSError):
        engine.load_checkpoint(str(tmp_path / "none"))


def test_evaluate_without_held_out_data():
    from conftest import default_doc

    d = default_doc()
    d["run"]["eval_interval"] = 0
    with zinc.initialize(d) as e:
        with pytest.raises(ValueError, match="no held-out data"):
            e.evaluate()
