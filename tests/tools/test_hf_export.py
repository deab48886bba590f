"""zinc-train --save-pretrained, checked with the real `safetensors` package
and, where it is installed, with transformers itself.

A run of 0 steps from a Hugging Face folder (model.from_pretrained) that
saves in fp32 is a format conversion: every tensor must come back bit for
bit, under the same names and shapes, with config.json's architecture and
sizes and the tokenizer files copied unchanged; at one rank and at two ranks
under ZeRO-3 with NVMe parameter offload (each rank reading only its shard).
Saved in bf16, a bf16 source comes back bit for bit too. When `transformers`
and `torch` import (bench/peers/setup.sh's venv), AutoModelForCausalLM must
load the export with no missing or unexpected keys; the test command's
Python has neither, and that test skips saying so.

Run by CTest (export_hf) with ZINC_TRAIN and ZINC_ROOT set.
"""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
ZINC_TRAIN = os.environ.get("ZINC_TRAIN", os.path.join(ROOT, "build", "tools", "zinc-train"))
ZINC_EXPORT = os.environ.get("ZINC_EXPORT", os.path.join(ROOT, "build", "tools", "zinc-export"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
# The fixtures whose family zinc implements (one list for every test).
with open(os.path.join(FIXTURES, "loaded.txt")) as _f:
    LOADED = [l.strip() for l in _f if l.strip() and not l.startswith("#")]


def mpirun(n):
    cmd = ["mpirun", "--oversubscribe", "-np", str(n), "-x", "OMP_NUM_THREADS=1"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


class Raw:
    """A tensor as stored: dtype string, shape and bytes (numpy has no bfloat16)."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, tuple(shape), data

    def tobytes(self):
        return self.data


def read_raw(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: Raw(v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def weights(folder):
    """Every tensor of a folder (model.safetensors or its index's shards), raw."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        out.update(read_raw(os.path.join(folder, name)))
    # The real package reads what zinc wrote (fp32 files; numpy has no bfloat16).
    if all(t.dtype == "F32" for t in out.values()):
        for name in files:
            for k, v in load_file(os.path.join(folder, name)).items():
                assert v.tobytes() == out[k].data, k
    return out


def config(tmp, fixture, stage, nvme=None):
    ds = {"train_batch_size": 2, "zero_optimization": {"stage": stage},
          "model": {"from_pretrained": os.path.join(FIXTURES, fixture)},
          "data": {"type": "synthetic", "vocab_size": 96, "seq_len": 12},
          "run": {"steps": 1, "output_dir": str(tmp / "run")}}
    if nvme:
        ds["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    path = tmp / "cfg.json"
    path.write_text(json.dumps(ds))
    return str(path)


def save(tmp, fixture, stage=0, ranks=1, extra=(), nvme=None, steps=0):
    out = tmp / "out"
    cmd = ([] if ranks == 1 else mpirun(ranks)) + [
        ZINC_TRAIN, config(tmp, fixture, stage, nvme), "--steps", str(steps), "--save-pretrained", str(out), *extra]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(out), r.stdout


@pytest.mark.parametrize("fixture,stage,ranks", [
    ("gpt2", 0, 1), ("llama_gqa", 0, 1), ("llama_bias_hd", 2, 1), ("mistral", 1, 1), ("qwen3", 2, 1),
    ("gemma", 1, 1), ("gemma2", 2, 1), ("gemma3", 0, 1), ("olmo2", 2, 1), ("phi3", 1, 1), ("gpt_neox", 2, 1), ("gpt_neox_seq", 0, 1), ("mixtral", 1, 1), ("qwen3_moe", 2, 1),
    ("llama_gqa", 3, 2), ("gpt2", 3, 2), ("qwen3", 3, 2), ("gemma2", 3, 2), ("gemma3", 3, 2), ("phi3", 3, 2), ("gpt_neox", 3, 2), ("qwen3_moe", 3, 2)])
def test_zero_steps_fp32_round_trip_is_bit_identical(tmp_path, fixture, stage, ranks):
    nvme = str(tmp_path / "nvme") if stage == 3 else None
    if nvme:
        os.makedirs(nvme)
    out, stdout = save(tmp_path, fixture, stage, ranks, ("--save-dtype", "fp32"), nvme)
    src, got = weights(os.path.join(FIXTURES, fixture)), weights(out)
    assert sorted(got) == sorted(src)
    for name, want in src.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].tobytes() == want.tobytes(), name
    with open(os.path.join(FIXTURES, fixture, "config.json")) as f:
        want_cfg = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        got_cfg = json.load(f)
    assert got_cfg["architectures"] == want_cfg["architectures"]
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "n_embd", "n_layer"):
        assert got_cfg.get(k) == want_cfg.get(k), k
    assert got_cfg["torch_dtype"] == "float32"
    # The tokenizer files, unchanged.
    for name in ("tokenizer_config.json", "generation_config.json"):
        src_file = os.path.join(FIXTURES, fixture, name)
        if os.path.exists(src_file):
            with open(src_file, "rb") as a, open(os.path.join(out, name), "rb") as b:
                assert a.read() == b.read(), name


def test_bf16_source_saved_in_its_own_dtype_is_bit_identical(tmp_path):
    out, _ = save(tmp_path, "qwen2_tied")  # no --save-dtype: the folder's bfloat16
    src, got = weights(os.path.join(FIXTURES, "qwen2_tied")), weights(out)
    assert sorted(got) == sorted(src)
    for name, want in src.items():
        assert got[name].tobytes() == want.tobytes(), name
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def test_sharded_export_writes_an_index(tmp_path):
    out, _ = save(tmp_path, "llama_gqa", extra=("--save-dtype", "fp32", "--max-shard-size", "30KB"))
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.exists(os.path.join(out, n)) for n in files)
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    src = weights(os.path.join(FIXTURES, "llama_gqa"))
    assert sorted(index["weight_map"]) == sorted(src)
    got = weights(out)
    for name, want in src.items():
        assert got[name].tobytes() == want.tobytes(), name


def test_transformers_loads_the_export(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here (bench/peers/setup.sh has it)")
    torch = pytest.importorskip("torch")
    for fixture in LOADED:
        os.makedirs(tmp_path / fixture)
        out, _ = save(tmp_path / fixture, fixture, extra=("--save-dtype", "fp32"))
        model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (fixture, info)
        ref = load_file(os.path.join(FIXTURES, fixture, "reference.safetensors"))
        with torch.no_grad():
            logits = model(torch.from_numpy(ref["input_ids"].astype(np.int64))).logits.float().numpy()
        assert np.abs(logits - ref["logits"]).max() < 1e-4, fixture


@pytest.mark.parametrize("fixture,stage,ranks", [("llama_gqa", 0, 1), ("gpt2", 2, 2)])
def test_zinc_export_format_hf_equals_save_pretrained(tmp_path, fixture, stage, ranks):
    """After training, the checkpoint exported with --format hf is what the run itself saved."""
    ck = str(tmp_path / "ck")
    out, _ = save(tmp_path, fixture, stage, ranks, steps=3,
                  extra=("--save-dtype", "fp32", "--set", "run.checkpoint_interval=3", "--set", f"run.checkpoint_dir={ck}"))
    exported = str(tmp_path / "exported")
    r = subprocess.run([ZINC_EXPORT, ck, "--format", "hf", "--out", exported, "--dtype", "fp32"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = weights(out), weights(exported)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    # Trained: not the fixture's weights any more.
    src = weights(os.path.join(FIXTURES, fixture))
    assert any(a[n].tobytes() != src[n].tobytes() for n in src)
    for name in ("config.json", "tokenizer_config.json"):
        with open(os.path.join(out, name), "rb") as x, open(os.path.join(exported, name), "rb") as y:
            assert x.read() == y.read(), name


def test_zinc_export_format_hf_refuses_a_checkpoint_without_a_config(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = tmp_path / "mlp.json"
    cfg.write_text(json.dumps({"train_batch_size": 2, "model": {"type": "mlp"},
                               "data": {"type": "synthetic", "vocab_size": 16, "seq_len": 8},
                               "run": {"steps": 1, "checkpoint_interval": 1, "checkpoint_dir": ck,
                                       "output_dir": str(tmp_path / "run")}}))
    r = subprocess.run([ZINC_TRAIN, str(cfg)], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([ZINC_EXPORT, ck, "--format", "hf", "--out", str(tmp_path / "x")],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "holds no Hugging Face config" in r.stderr and 'model "mlp"' in r.stderr, r.stderr
    r = subprocess.run([ZINC_TRAIN, str(cfg), "--steps", "0", "--save-pretrained", str(tmp_path / "y")],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and 'has no Hugging Face architecture' in r.stderr, r.stderr


def test_save_pretrained_onto_a_file_is_refused_before_training(tmp_path):
    target = tmp_path / "a_file"
    target.write_text("keep me")
    cmd = [ZINC_TRAIN, config(tmp_path, "llama_gqa", 0), "--steps", "1", "--save-pretrained", str(target)]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "exists and is not a folder" in r.stderr, r.stderr
    assert "step 1" not in r.stdout and target.read_text() == "keep me"
    r = subprocess.run(cmd[:-2] + ["--save-pretrained", str(tmp_path / "o"), "--max-shard-size", "lots"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--max-shard-size: 'lots' is not a size" in r.stderr, r.stderr


# Each Llama-style family built from zinc's own `model` section (the sizes
# below, the rest the family's defaults), trained two steps and saved: its
# config.json (the family's config_json) must read back as the same model,
# so a run from the folder that saves again writes the same tensors, and
# transformers, where installed, must load it with no missing or unexpected
# keys.
SECTION_FAMILIES = ["llama", "qwen3", "smollm3", "granite", "gemma", "gemma2", "gemma3", "olmo2", "phi3", "gpt_neox",
                    "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("family", SECTION_FAMILIES)
def test_a_model_built_from_its_section_exports_a_folder_that_reads_back(tmp_path, family):
    model = {"type": family, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4 if family == "gpt_neox" else 2, "head_dim": 8}
    cfg = tmp_path / "built.json"
    cfg.write_text(json.dumps({"train_batch_size": 2, "model": model,
                               "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 12},
                               "run": {"steps": 2, "output_dir": str(tmp_path / "run0")}}))
    first = tmp_path / "first"
    r = subprocess.run([ZINC_TRAIN, str(cfg), "--save-pretrained", str(first), "--save-dtype", "fp32"],
                       env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(first / "config.json") as f:
        written = json.load(f)
    assert written["architectures"][0].lower().startswith(family.replace("_", "")[:5]), written["architectures"]
    cfg2 = tmp_path / "again.json"
    cfg2.write_text(json.dumps({"train_batch_size": 2, "model": {"from_pretrained": str(first)},
                                "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 12},
                                "run": {"steps": 1, "output_dir": str(tmp_path / "run1")}}))
    second = tmp_path / "second"
    r = subprocess.run([ZINC_TRAIN, str(cfg2), "--steps", "0", "--save-pretrained", str(second), "--save-dtype", "fp32"],
                       env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = weights(str(first)), weights(str(second))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    try:
        import transformers  # noqa: F401 (bench/peers/setup.sh's venv)
    except ImportError:
        return
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(first), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (family, info)


def test_a_gpt_neox_section_with_grouped_query_attention_is_refused_naming_the_key(tmp_path):
    cfg = tmp_path / "neox.json"
    cfg.write_text(json.dumps({"train_batch_size": 2,
                               "model": {"type": "gpt_neox", "hidden_size": 32, "intermediate_size": 40,
                                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
                               "data": {"type": "synthetic", "vocab_size": 64, "seq_len": 12},
                               "run": {"steps": 1, "output_dir": str(tmp_path / "run")}}))
    r = subprocess.run([ZINC_TRAIN, str(cfg)], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "model.num_key_value_heads" in r.stderr and "grouped-query" in r.stderr, r.stderr


def test_files_made_in_the_folder_during_an_export_are_kept(tmp_path):
    """Note [files made during an export]: a writer in the export folder between the export's link pass and its
    swap (zinc.prepare committing a set there, an editor saving a README through a new file) lost its files: the
    swap took them away with the old folder. The export stops there (ZINC_EXPORT_FAULT=linked:stop), a file is
    made and another replaced by a rename, and both are in the new folder; the export's own files are its own."""
    ck = str(tmp_path / "ck")
    save(tmp_path, "llama_gqa", steps=1, extra=("--set", "run.checkpoint_interval=1", "--set", f"run.checkpoint_dir={ck}"))
    out = tmp_path / "hf"
    r = subprocess.run([ZINC_EXPORT, ck, "--format", "hf", "--out", str(out)], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    (out / "README.md").write_text("first\n")
    old_config = (out / "config.json").read_bytes()
    p = subprocess.Popen([ZINC_EXPORT, ck, "--format", "hf", "--out", str(out), "--dtype", "fp32"],
                         env=dict(ENV, ZINC_EXPORT_FAULT="linked:stop"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    for _ in range(600):  # until it stops itself
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "T":
                break
        time.sleep(0.05)
    else:
        p.kill()
        raise AssertionError("the export never reached its link pass")
    (out / "p.bin").write_bytes(b"made during the export")
    (out / ".README.md.tmp").write_text("second\n")
    os.rename(out / ".README.md.tmp", out / "README.md")
    (out / ".config.json.tmp").write_text("{}")  # the export's own name: the export's file wins
    os.rename(out / ".config.json.tmp", out / "config.json")
    os.kill(p.pid, signal.SIGCONT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert (out / "p.bin").read_bytes() == b"made during the export"
    assert (out / "README.md").read_text() == "second\n"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32", old_config
    assert "p.bin was made or replaced in the folder during the export; it is kept" in err, err
    assert not any(x.name.startswith(".hf.zinc-") for x in tmp_path.iterdir())  # no staging or old folder left
