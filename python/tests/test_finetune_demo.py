"""scripts/finetune_demo.sh end to end, shortened to 30 + 30 steps: Debian's
fortunes and WordNet -> zinc.prepare -> a Llama pretrained and exported ->
fine-tuned on the masked, packed questions and exported -> transformers'
generate() (where transformers and torch are installed)."""
import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from conftest import REPO, zinc_train_path

CORPORA = [pathlib.Path("/usr/share/games/fortunes"), pathlib.Path("/usr/share/wordnet")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    zt = zinc_train_path()
    if zt is None:
        pytest.skip("zinc-train is not built (set ZINC_TRAIN)")
    for p in CORPORA:
        if not p.is_dir():
            pytest.skip(f"{p} is missing (scripts/setup.sh installs Debian's fortunes and wordnet-base)")
    pytest.importorskip("tokenizers")
    work = tmp_path_factory.mktemp("demo")
    env = dict(os.environ, ZINC_DEMO_SETUP="0", ZINC_DEMO_WORKDIR=str(work), ZINC_DEMO_STEPS="30 30",
               ZINC_TRAIN=str(zt), OMP_NUM_THREADS="2")
    r = subprocess.run(["bash", str(REPO / "scripts" / "finetune_demo.sh")], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work / "runs" / "demo", r.stdout


def test_the_walk_through_prepares_pretrains_finetunes_and_exports(demo):
    out, log = demo
    for name in ("fortunes", "wordnet"):
        m = json.loads((out / f"{name}.json").read_text())
        assert m["vocab_size"] == 2048 and m["tokens"] > 100_000
    # The questions' prompts are masked, the fortunes are not.
    assert json.loads((out / "wordnet.json").read_text())["masked_share"] > 0.3
    assert json.loads((out / "fortunes.json").read_text())["masked_share"] == 0.0
    for folder in ("fortunes-llama", "wordnet-llama"):
        d = out / folder
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 2048
        assert (d / "tokenizer.json").is_file() and (d / "tokenizer_config.json").is_file()
        from safetensors.numpy import load_file
        weights = load_file(str(d / "model.safetensors"))
        assert all(np.isfinite(w).all() for w in weights.values())
    # The fine-tune started from the pretrained export, not from random weights.
    a = load_file(str(out / "fortunes-llama" / "model.safetensors"))
    b = load_file(str(out / "wordnet-llama" / "model.safetensors"))
    assert a.keys() == b.keys()
    name = "model.layers.0.mlp.down_proj.weight"
    assert 0 < np.abs(a[name] - b[name]).max() < 0.5
    assert log.count(": LlamaForCausalLM, 39 tensors") == 2, log[-2000:]


def test_the_export_generates_in_transformers(demo):
    pytest.importorskip("torch", reason="transformers' generate() needs torch (bench/peers has a venv with both)")
    pytest.importorskip("transformers")
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    from demo_generate import answer
    text = answer(str(demo[0] / "wordnet-llama"), 'What does the noun "lantern" mean?', max_new_tokens=8)
    assert isinstance(text, str)


def test_the_lora_fine_tune_writes_a_peft_adapter_on_the_frozen_base(demo):
    out, log = demo
    d = out / "wordnet-lora"
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16 and len(cfg["target_modules"]) == 7
    from safetensors.numpy import load_file
    adapters = load_file(str(d / "adapter_model.safetensors"))
    assert len(adapters) == 4 * 7 * 2  # 4 layers, 7 modules, A and B
    assert all(np.isfinite(w).all() for w in adapters.values())
    assert any(np.abs(w).max() > 0 for k, w in adapters.items() if "lora_B" in k)  # trained from zero
    assert "save-adapter: " in log and "LoRA adapters, the base frozen" in log


def test_the_adapter_generates_through_peft(demo):
    pytest.importorskip("torch", reason="PeftModel needs torch (bench/peers has a venv with it and peft)")
    pytest.importorskip("peft", reason="peft is not installed here (bench/peers has it)")
    import sys
    sys.path.insert(0, str(REPO / "scripts"))
    from demo_generate import answer
    text = answer(str(demo[0] / "fortunes-llama"), 'What does the noun "lantern" mean?', max_new_tokens=8,
                  adapter=str(demo[0] / "wordnet-lora"))
    assert isinstance(text, str)
