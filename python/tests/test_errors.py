"""Bad input: an exception of the right type naming what was wrong, never a crash."""
import os
import re

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
        # Byte-swapped int32 would be read as other tokens (all zeros would pass).
        ((ids((2, 8), ">i4"), ids((2, 8))), TypeError, "inputs must have dtype int32 in this machine's byte order"),
        # A key zinc does not read is refused, not dropped: an attention_mask
        # meant to mask padding, a misspelt 'positions'.
        ({"inputs": ids((2, 8)), "targets": ids((2, 8)), "attention_mask": ids((2, 8))}, ValueError,
         "batch has the key 'attention_mask', which zinc does not read"),
        ({"inputs": ids((2, 8)), "targets": ids((2, 8)), "positon": ids((2, 8))}, ValueError, "the key 'positon'"),
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


def test_a_masked_array_is_refused(engine):
    """numpy.ma's mask was dropped without a word, and its masked targets trained on."""
    x = ids((2, 8))
    masked = np.ma.masked_array(ids((2, 8)), mask=np.eye(2, 8, dtype=bool))
    for batch in ((x, masked), (masked, x)):
        with pytest.raises(TypeError, match="numpy.ma masked array, whose mask zinc does not read; mask a target "
                                            "with -100"):
            engine.forward(batch)


def test_train_batch_needs_one_batch_per_accumulation_step(engine):
    with pytest.raises(ValueError, match="gradient_accumulation_steps = 1 batches, got 2"):
        engine.train_batch([(ids((2, 8)), ids((2, 8)))] * 2)


def test_train_batch_takes_the_next_batches_of_an_iterator():
    """Note [the batches train_batch reads]: an iterator gives the next gradient_accumulation_steps batches and
    keeps the rest, as DeepSpeed's train_batch(data_iter); an endless one was read without end (its memory
    growing), and a long one read to its end and then refused, its batches gone."""
    from conftest import default_doc

    doc = default_doc()
    doc["gradient_accumulation_steps"] = 2
    taken = []

    def endless():
        n = 0
        while True:
            taken.append(n)
            n += 1
            yield ids((2, 8)), ids((2, 8))

    with zinc.initialize(doc) as e:
        it = endless()
        e.train_batch(it)
        assert len(taken) == 2 and e.global_steps == 1
        e.train_batch(it)
        assert len(taken) == 4 and e.global_steps == 2
        with pytest.raises(ValueError, match="data ran out after 1 batches; a global batch is "
                                             "gradient_accumulation_steps = 2"):
            e.train_batch(iter([(ids((2, 8)), ids((2, 8)))]))
        with pytest.raises(TypeError, match="got one \\(inputs, targets\\) pair; pass \\[batch\\]"):
            e.train_batch((ids((2, 8)), ids((2, 8))))
        with pytest.raises(TypeError, match="data must be an iterable of batches .*, got int"):
            e.train_batch(5)
        assert e.global_steps == 2


def test_client_state_refuses_what_json_cannot_hold(tmp_path):
    """A NaN or infinity in client_state was saved as null and loaded back as None."""
    from conftest import default_doc

    with zinc.initialize(default_doc()) as e:
        for bad, where in (({"a": float("nan")}, "client_state['a']"),
                           ({"b": [1.0, float("-inf")]}, "client_state['b'][1]")):
            with pytest.raises(ValueError, match=re.escape(where) + " is not a finite number"):
                e.save_checkpoint(str(tmp_path / "ck"), tag="t", client_state=bad)
        assert not (tmp_path / "ck" / "t").exists()
        e.save_checkpoint(tmp_path / "ck", tag="t", client_state={"a": 0.5})  # a pathlib.Path names a folder too
        assert e.load_checkpoint(tmp_path / "ck", tag="t")["a"] == 0.5


def test_backward_without_forward_is_an_error():
    from conftest import default_doc

    with zinc.initialize(default_doc()) as e:
        # The call's name as Python and C++ spell it (it said "Engine::backward() called without ...").
        with pytest.raises(zinc.Error, match=r"^backward\(\) without a forward\(\) before it: call forward\(batch\)"):
            e.backward()


def test_evaluate_between_forward_and_backward_is_refused():
    """The model keeps one pass's activations: an evaluation there made the
    backward differentiate the evaluation's batch, without a word."""
    from conftest import default_doc

    with zinc.initialize(default_doc()) as e:
        e.forward()
        with pytest.raises(zinc.Error, match=r"between forward\(\) and backward\(\)"):
            e.evaluate()
        e.backward()
        e.step()


def test_train_batch_inside_a_global_batch_is_refused():
    from conftest import default_doc

    doc = default_doc()
    doc["gradient_accumulation_steps"] = 2  # micro-batches of 32 (train_batch_size 64)
    with zinc.initialize(doc) as e:
        e.forward()
        e.backward()
        e.step()
        mine = (ids((32, 8)), ids((32, 8)))
        for call in (lambda: e.train_batch(), lambda: e.train_batch([mine, mine])):
            with pytest.raises(zinc.Error, match=r"inside a global batch \(after micro-step 1 of 2"):
                call()
        e.forward()
        e.backward()
        e.step()
        e.train_batch()
        assert e.global_steps == 2


def test_a_batch_whose_activations_cannot_fit_is_a_memory_error():
    """A batch small as an array but whose activations cannot fit (a
    50000-token vocabulary's logits) is refused before anything is
    allocated, naming the need and the limit; the OOM killer ended the
    interpreter before. The engine trains on afterwards."""
    from conftest import default_doc

    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    doc = default_doc()
    doc["model"].update({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50000})
    T = 64
    B = 8 * avail // (T * 50000 * 4) + 1  # the logits alone: 2x the room, in fp32
    with zinc.initialize(doc) as e:
        x = np.zeros((B, T), dtype=np.int32)
        for call in (lambda: e.evaluate((x, x)), lambda: e.forward((x, x))):
            with pytest.raises(MemoryError, match=r"a batch of %d x %d tokens needs about .* pass smaller batches" % (B, T)):
                call()
        assert np.isfinite(e.train_batch())


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


# ---- configs no input may crash or leave unnamed (issue 27, items 7 and 14) ----


def _config_error(doc):
    with pytest.raises(zinc.ConfigError) as e:
        zinc.initialize(doc)
    return e.value


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**400])
def test_int_past_64_bits_is_a_config_error_naming_the_path(doc, value):
    # pybind11 said "Unable to cast Python instance of type int" (not a ConfigError).
    doc["run"]["seed"] = value
    e = _config_error(doc)
    assert e.path == "run.seed"
    assert "does not fit in 64 bits" in str(e)


def test_ints_of_64_bits_are_numbers(doc):
    doc["run"]["seed"] = 2**64 - 1  # uint64, as a file may say
    doc["run"]["eval_interval"] = 0
    with zinc.initialize(doc) as eng:
        assert eng.global_steps == 0


def test_dict_that_contains_itself_names_the_path(doc):
    # The recursion of the conversion overflowed the C++ stack.
    doc["model"]["again"] = doc
    e = _config_error(doc)
    assert e.path == "model.again"
    assert str(e).startswith("model.again: refers to config, which contains it")


def test_list_that_contains_itself_names_the_path(doc):
    betas = [0.9]
    betas.append(betas)
    doc["optimizer"]["params"]["betas"] = betas
    e = _config_error(doc)
    assert e.path == "optimizer.params.betas[1]"
    assert "refers to optimizer.params.betas, which contains it" in str(e)


def test_deep_nesting_is_refused_at_the_limit(doc):
    deep = 1
    for _ in range(100000):
        deep = {"a": deep}
    doc["amp"] = deep
    e = _config_error(doc)
    assert e.path.startswith("amp.a.a.") and e.path.count(".") == 63
    assert "nested deeper than 64 levels" in str(e)


def test_shared_lists_that_expand_past_a_million_values_are_refused(doc):
    # 40 levels of a list holding the next one twice: 2**40 values to convert.
    shared = [0]
    for _ in range(40):
        shared = [shared, shared]
    doc["amp"] = shared
    e = _config_error(doc)
    assert "more than 1000000 values" in str(e)


def test_string_that_is_not_unicode_text_names_the_path(doc):
    doc["run"]["output_dir"] = "runs/\ud800"
    e = _config_error(doc)
    assert e.path == "run.output_dir" and "lone surrogate" in str(e)


def test_key_with_a_nul_is_shown_escaped(doc):
    # A NUL ended the message there: "optim".
    doc["optim\0izer"] = {}
    e = _config_error(doc)
    assert e.path == "optim\\u0000izer"
    assert str(e) == "optim\\u0000izer: unknown key (did you mean 'optimizer'?)"


def test_nan_is_shown_as_nan(doc):
    doc["optimizer"]["params"]["lr"] = float("nan")
    e = _config_error(doc)
    assert e.path == "optimizer.params.lr" and str(e).endswith("must be a finite number, got nan")


def test_config_path_that_is_not_utf8_is_read_by_its_bytes(tmp_path):
    # os.fspath gave a str with a surrogate escape, which pybind11 could not cast.
    path = os.fsdecode(bytes(tmp_path) + b"/caf\xe9.json")
    with pytest.raises(OSError, match=r"cannot open config file .*/caf\\xe9\.json: No such file"):
        zinc.initialize(path)


def test_a_config_path_that_never_ends_is_refused_at_once(tmp_path):
    """Issue 49: /dev/zero or a FIFO named as the config (or as the model's config.json) is refused as not a
    regular file, at once: never read without end, never waited on."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        with pytest.raises(OSError, match="not a regular file"):
            zinc.initialize(path)
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    doc = {"train_batch_size": 2, "model": {"from_pretrained": str(model)},
           "data": {"type": "synthetic", "vocab_size": 16, "seq_len": 8}}
    with pytest.raises(OSError, match="config.json is a FIFO, not a regular file"):
        zinc.initialize(doc)


def test_forward_and_evaluate_take_the_batchs_parts_as_arguments(doc):
    """forward(x, y) gave pybind's "incompatible function arguments" with both arrays dumped."""
    with zinc.initialize(doc) as e:
        t = doc["data"]["seq_len"]
        b = doc["train_micro_batch_size_per_gpu"] if "train_micro_batch_size_per_gpu" in doc else 1
        x = (np.arange(b * t, dtype=np.int32) % 50).reshape(b, t)
        y = np.roll(x, -1, axis=1)
        assert e.evaluate(x, y) == e.evaluate((x, y))
        assert e.evaluate(x, y, positions=None) == e.evaluate({"inputs": x, "targets": y})
        assert e.forward(x, y) == e.forward((x, y))
        e.backward()
        with pytest.raises(ValueError, match="targets must have the shape of inputs"):
            e.evaluate(x, y[:, :-1])
        with pytest.raises(TypeError) as err:
            e.forward(x, y, None, 4)
        assert "incompatible function arguments" in str(err.value)  # four arguments: no form takes them
