"""zinc.initialize from a Hugging Face folder (model.from_pretrained) and
Engine.save_pretrained, against the fixtures of tests/fixtures/hf (made by
the real transformers; reference logits, loss and gradients in
reference.safetensors). Needs numpy and safetensors only."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import zinc

from conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "hf"
# The fixtures whose family zinc implements (one list for every test).
LOADED = [l for l in (FIXTURES / "loaded.txt").read_text().splitlines() if l and not l.startswith("#")]


def doc_for(fixture, stage=0, bf16=False):
    ref = load_file(str(FIXTURES / fixture / "reference.safetensors"))
    B, T = ref["input_ids"].shape
    return {"train_batch_size": int(B), "gradient_clipping": 0.0, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage},
            "model": {"from_pretrained": str(FIXTURES / fixture)},
            "data": {"type": "synthetic", "vocab_size": 96, "seq_len": int(T)},
            "run": {"steps": 1}}, ref


@pytest.mark.parametrize("fixture", LOADED)
def test_the_loss_is_transformers(fixture):
    doc, ref = doc_for(fixture, stage=2)
    with zinc.initialize(doc) as engine:
        loss = engine.evaluate((ref["input_ids"], ref["targets"]))
    assert loss == pytest.approx(float(ref["loss"][0]), rel=1e-5)


def test_save_pretrained_round_trips_and_training_changes_the_weights(tmp_path):
    doc, ref = doc_for("llama_gqa")
    src = load_file(str(FIXTURES / "llama_gqa" / "model.safetensors"))
    with zinc.initialize(doc) as engine:
        info = engine.save_pretrained(str(tmp_path / "same"), dtype="fp32")
        assert info["tensors"] == len(src) and info["dtype"] == "fp32"
        assert "tokenizer_config.json" in info["copied"]
        got = load_file(str(tmp_path / "same" / "model.safetensors"))
        assert sorted(got) == sorted(src)
        for k in src:
            assert got[k].tobytes() == src[k].tobytes(), k
        engine.forward((ref["input_ids"], ref["targets"]))
        engine.backward()
        engine.step()
        engine.save_pretrained(str(tmp_path / "trained"), dtype="fp32", max_shard_size="40KB")
    with open(tmp_path / "trained" / "model.safetensors.index.json") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    trained = {}
    for s in shards:
        trained.update(load_file(str(tmp_path / "trained" / s)))
    assert sorted(trained) == sorted(src)
    assert any(trained[k].tobytes() != src[k].tobytes() for k in src)
    with open(tmp_path / "trained" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_errors_name_the_file_and_the_key(tmp_path):
    doc, _ = doc_for("llama_gqa")
    doc["model"]["num_hidden_layers"] = 5
    with pytest.raises(zinc.ConfigError, match="model.num_hidden_layers: 5 disagrees with .*llama_gqa/config.json"):
        zinc.initialize(doc)
    doc, _ = doc_for("llama_gqa")
    doc["model"]["from_pretrained"] = str(tmp_path / "missing")
    with pytest.raises(OSError, match="cannot open the model's config.json .*missing/config.json: No such file"):
        zinc.initialize(doc)
    mlp = {"train_batch_size": 2, "model": {"type": "mlp"}, "data": {"type": "synthetic", "vocab_size": 16, "seq_len": 8}}
    with zinc.initialize(mlp) as engine:
        with pytest.raises(zinc.Error, match='model "mlp" has no Hugging Face architecture'):
            engine.save_pretrained(str(tmp_path / "x"))


def test_save_pretrained_never_replaces_the_model_it_was_loaded_from(tmp_path):
    """Issue 49: the source folder, also through a symlink or src/../src, is refused, and left byte for byte."""
    import shutil
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_gqa", src)
    before = {f: (src / f).read_bytes() for f in os.listdir(src)}
    doc, _ = doc_for("llama_gqa")
    doc["model"]["from_pretrained"] = str(src)
    os.symlink(src, tmp_path / "link")
    with zinc.initialize(doc) as engine:
        for out in (src, tmp_path / "link", src / ".." / "src", tmp_path):
            with pytest.raises(zinc.Error, match="save_pretrained .*(which this run reads|holds the folder)"):
                engine.save_pretrained(str(out), dtype="bf16")
        # A NUL byte would cut the path short (a stray folder "a"): refused, nothing made.
        with pytest.raises(zinc.Error, match="NUL byte"):
            engine.save_pretrained(str(tmp_path / "a\0b"))
        assert not os.path.exists(tmp_path / "a")
    assert {f: (src / f).read_bytes() for f in os.listdir(src)} == before


def test_evaluate_takes_the_models_vocabulary_and_has_no_loss_without_targets():
    """A from_pretrained model with the default small data section: tokens up to the model's vocabulary
    are valid; a batch whose targets are all -100 has no loss (NaN), never 0."""
    doc, ref = doc_for("llama_gqa")
    doc["data"] = {"type": "synthetic", "vocab_size": 8, "seq_len": int(ref["input_ids"].shape[1])}
    with zinc.initialize(doc) as engine:
        assert int(ref["input_ids"].max()) >= 8  # beyond the data's vocabulary, within the model's
        assert engine.evaluate((ref["input_ids"], ref["targets"])) == pytest.approx(float(ref["loss"][0]), rel=1e-5)
        none = np.full_like(ref["targets"], -100)
        assert np.isnan(engine.evaluate((ref["input_ids"], none)))


def test_lora_through_python_trains_only_the_adapters_and_saves_them(tmp_path):
    """model.lora through zinc.initialize: PEFT's references (the lora_llama fixture) for the loss, the base
    frozen, save_adapter in PEFT's format, save_pretrained refused without merge=True and merging with it."""
    lora_dir = FIXTURES / "lora_llama"
    ref = load_file(str(lora_dir / "reference.safetensors"))
    doc, _ = doc_for("llama_gqa")
    doc["model"]["adapter"] = str(lora_dir)
    with zinc.initialize(doc) as engine:
        loss = engine.evaluate((ref["input_ids"], ref["targets"]))
        assert loss == pytest.approx(float(ref["loss"][0]), rel=1e-5)
        engine.forward((ref["input_ids"], ref["targets"]))
        engine.backward()
        engine.step()
        info = engine.save_adapter(str(tmp_path / "adapter"))
        assert info["tensors"] == 28
        with pytest.raises(Exception, match="--merge|merge"):
            engine.save_pretrained(str(tmp_path / "refused"), dtype="fp32")
        engine.save_pretrained(str(tmp_path / "merged"), dtype="fp32", merge=True)
    before = load_file(str(lora_dir / "adapter_model.safetensors"))
    after = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(before[k].tobytes() != after[k].tobytes() for k in before)  # every adapter trained
    base = load_file(str(FIXTURES / "llama_gqa" / "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged["model.norm.weight"].tobytes() == base["model.norm.weight"].tobytes()  # frozen, not adapted
    assert not np.array_equal(merged["model.layers.0.self_attn.q_proj.weight"],
                              base["model.layers.0.self_attn.q_proj.weight"])
    assert not (tmp_path / "refused").exists()
