"""LoRA through zinc-train, checked with PEFT itself where it is installed.

A run with model.lora writes its adapters with --save-adapter (PEFT's
adapter_config.json and adapter_model.safetensors) and the model with the
adapters merged with --save-pretrained --merge. Without torch (the test
command's Python): the files' names, shapes and configuration are PEFT's,
the frozen base comes back bit for bit in the merged folder where no adapter
touches it, an adapter saved and read back (model.adapter) continues from the
same values at every ZeRO stage and at two ranks, and the refusals name what
is wrong. With torch and peft (bench/peers/setup.sh's venv):
peft.PeftModel.from_pretrained loads the adapter onto the base with no
missing or unexpected keys and gives the logits of transformers on the
merged folder, which equals PEFT's merge_and_unload.

Run by CTest (export_peft) with ZINC_TRAIN and ZINC_ROOT set.
"""
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
ZINC_TRAIN = os.environ.get("ZINC_TRAIN", os.path.join(ROOT, "build", "tools", "zinc-train"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
BASE = os.path.join(FIXTURES, "llama_gqa")
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def mpirun(n):
    cmd = ["mpirun", "--oversubscribe", "-np", str(n), "-x", "OMP_NUM_THREADS=1"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def run(tmp, model, args=(), stage=0, ranks=1, steps=3, bf16=False, expect_ok=True):
    ds = {"train_batch_size": 2 * ranks, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
          "model": model, "data": {"type": "synthetic", "vocab_size": 96, "seq_len": 12},
          "run": {"steps": steps, "output_dir": str(tmp / "run")}}
    if bf16:
        ds["bf16"] = {"enabled": True}
    if stage == 3:
        os.makedirs(tmp / "nvme", exist_ok=True)
        ds["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp / "nvme")}
    path = tmp / "cfg.json"
    path.write_text(json.dumps(ds))
    cmd = ([] if ranks == 1 else mpirun(ranks)) + [ZINC_TRAIN, str(path), *args]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    if expect_ok:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def digest(stdout):
    return [l for l in stdout.splitlines() if "digest" in l]


def test_gpt2_adapters_are_peft_conv1d_adapters(tmp_path):
    """GPT-2's all-linear: c_attn, c_proj (the attention's and the MLP's) and c_fc, fan_in_fan_out as PEFT sets it."""
    run(tmp_path, {"from_pretrained": os.path.join(FIXTURES, "gpt2"), "lora": LORA}, ("--save-adapter", str(tmp_path / "a")))
    with open(tmp_path / "a" / "adapter_config.json") as f:
        cfg = json.load(f)
    assert cfg["target_modules"] == ["c_attn", "c_proj", "c_fc"] and cfg["fan_in_fan_out"] is True
    got = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert got["base_model.model.transformer.h.0.mlp.c_proj.lora_A.weight"].shape == (4, 128)
    assert len(got) == 2 * 2 * 4  # A and B, 2 layers, 4 linear layers


def test_adapter_folder_is_peft_and_merge_keeps_the_base(tmp_path):
    r = run(tmp_path, {"from_pretrained": BASE, "lora": LORA},
            ("--save-adapter", str(tmp_path / "adapter"), "--save-pretrained", str(tmp_path / "merged"), "--merge",
             "--save-dtype", "fp32"))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(got) == 2 * 2 * 7  # A and B, 2 layers, 7 modules
    a = got["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
    b = got["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"]
    assert a.shape == (4, 32) and b.shape == (16, 4) and a.dtype == np.float32
    assert np.abs(b).max() > 0  # trained away from PEFT's zero start
    base = load_file(os.path.join(BASE, "model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(merged) == sorted(base)
    for k in base:
        if k.endswith("norm.weight") or "embed" in k or k == "lm_head.weight":
            assert merged[k].tobytes() == base[k].tobytes(), k  # frozen and not adapted: the file's bits
        else:
            assert not np.array_equal(merged[k], base[k]), k  # every linear layer carries its adapter


@pytest.mark.parametrize("stage,ranks", [(0, 1), (2, 1), (3, 1), (1, 2), (3, 2)])
def test_an_adapter_read_back_continues_from_the_same_values(tmp_path, stage, ranks):
    """Saved after 3 steps, read back with model.adapter and saved again after 0 steps: the same bits."""
    run(tmp_path, {"from_pretrained": BASE, "lora": LORA}, ("--save-adapter", str(tmp_path / "a1")), stage, ranks)
    run(tmp_path, {"from_pretrained": BASE, "adapter": str(tmp_path / "a1")}, ("--save-adapter", str(tmp_path / "a2")),
        stage, ranks, steps=0)
    one, two = load_file(str(tmp_path / "a1" / "adapter_model.safetensors")), load_file(
        str(tmp_path / "a2" / "adapter_model.safetensors"))
    assert sorted(one) == sorted(two)
    for k in one:
        assert one[k].tobytes() == two[k].tobytes(), k


def test_lora_exports_are_refused_before_training(tmp_path):
    r = run(tmp_path, {"from_pretrained": BASE, "lora": LORA}, ("--save-pretrained", str(tmp_path / "out")),
            expect_ok=False)
    assert r.returncode != 0 and "--merge" in r.stderr and "--save-adapter" in r.stderr
    assert not (tmp_path / "run").exists() or "step" not in r.stdout
    r = run(tmp_path, {"from_pretrained": BASE}, ("--save-adapter", str(tmp_path / "out")), expect_ok=False)
    assert r.returncode != 0 and "no LoRA adapters" in r.stderr
    r = run(tmp_path, {"from_pretrained": BASE, "lora": {"r": 4, "target_modules": ["q_proj", "c_attn"]}},
            expect_ok=False)
    assert r.returncode != 0 and "model.lora.target_modules" in r.stderr and "c_attn" in r.stderr
    r = run(tmp_path, {"from_pretrained": BASE, "lora": {"r": 4, "lora_dropout": 1.0}}, expect_ok=False)
    assert r.returncode != 0 and "model.lora.lora_dropout" in r.stderr
    # A mixture of experts: PEFT's all-linear reaches the experts (target_parameters), which zinc does not do.
    r = run(tmp_path, {"from_pretrained": os.path.join(FIXTURES, "mixtral"), "lora": LORA}, expect_ok=False)
    assert r.returncode != 0 and "model.lora.target_modules" in r.stderr and "target_parameters" in r.stderr
    # Phi-3: PEFT has no default target_modules; its fused modules by name work.
    r = run(tmp_path, {"from_pretrained": os.path.join(FIXTURES, "phi3"), "lora": {"r": 4}}, expect_ok=False)
    assert r.returncode != 0 and "model.lora.target_modules" in r.stderr and "qkv_proj" in r.stderr, r.stderr
    run(tmp_path, {"from_pretrained": os.path.join(FIXTURES, "phi3"), "lora": LORA},
        ("--save-adapter", str(tmp_path / "phi3")))
    assert "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight" in \
        load_file(str(tmp_path / "phi3" / "adapter_model.safetensors"))


def test_lora_dropout_trains_and_goes_into_the_adapter_config(tmp_path):
    """lora_dropout 0.1 trains (a loss other than the run without it), is written to adapter_config.json, and
    comes back from it with model.adapter."""
    losses = []
    for p in (0.0, 0.1):
        r = run(tmp_path, {"from_pretrained": BASE, "lora": dict(LORA, lora_dropout=p)},
                ("--save-adapter", str(tmp_path / ("a%g" % p))))
        losses.append([l for l in r.stdout.splitlines() if l.startswith("step 3/3")])
    assert losses[0] != losses[1], losses
    with open(tmp_path / "a0.1" / "adapter_config.json") as f:
        assert json.load(f)["lora_dropout"] == 0.1
    # The adapter read back trains with its dropout: edited to 0, it trains otherwise.
    r = run(tmp_path, {"from_pretrained": BASE, "adapter": str(tmp_path / "a0.1")})
    cont = [l for l in r.stdout.splitlines() if l.startswith("step 3/3")]
    cfg = json.loads((tmp_path / "a0.1" / "adapter_config.json").read_text())
    cfg["lora_dropout"] = 0.0
    (tmp_path / "a0.1" / "adapter_config.json").write_text(json.dumps(cfg))
    r = run(tmp_path, {"from_pretrained": BASE, "adapter": str(tmp_path / "a0.1")})
    assert [l for l in r.stdout.splitlines() if l.startswith("step 3/3")] != cont, cont


def saved_modules_train_and_read_back(tmp_path, base_dir, names, tensors):
    """A LoRA run of base_dir with modules_to_save `names`: adapter_config.json names them, the adapter file holds
    `tensors` (the base's names) under PEFT's prefix, trained (not the base's values), the merged folder holds the
    trained ones, and the adapter read back trains on. Returns the adapter file's tensors."""
    run(tmp_path, {"from_pretrained": base_dir, "lora": dict(LORA, modules_to_save=names)},
        ("--save-adapter", str(tmp_path / "a"), "--save-pretrained", str(tmp_path / "m"), "--merge",
         "--save-dtype", "fp32"))
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["modules_to_save"] == names
    got = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    for name in tensors:
        trained = got["base_model.model." + name]
        assert trained.shape == base[name].shape and not np.array_equal(trained, base[name].astype(np.float32)), name
        assert merged[name].tobytes() == trained.tobytes(), name
    r = run(tmp_path, {"from_pretrained": base_dir, "adapter": str(tmp_path / "a")}, ("--save-adapter", str(tmp_path / "b")))
    assert "step 3/3" in r.stdout
    return got


def test_modules_to_save_train_whole_and_go_into_the_adapter_folder(tmp_path):
    """modules_to_save [embed_tokens, lm_head]: both train (their values in the adapter file under PEFT's names
    differ from the base's), the merged folder holds the trained ones, and the adapter read back continues; on a
    model whose head is its embedding they are refused naming the key."""
    lora = dict(LORA, modules_to_save=["embed_tokens", "lm_head"])
    got = saved_modules_train_and_read_back(tmp_path, BASE, ["embed_tokens", "lm_head"],
                                            ("model.embed_tokens.weight", "lm_head.weight"))
    assert len(got) == 28 + 2
    r = run(tmp_path, {"from_pretrained": os.path.join(FIXTURES, "gpt2"), "lora": lora}, expect_ok=False)
    assert r.returncode != 0 and "model.lora.modules_to_save" in r.stderr, r.stderr
    # A resume without the modules the checkpoint's run saved names them (it said only "7 blocks; this one has 6").
    (tmp_path / "resume").mkdir()
    run(tmp_path / "resume", {"from_pretrained": BASE, "lora": dict(LORA, modules_to_save=["lm_head"])},
        ("--set", "run.checkpoint_interval=3"))
    r = run(tmp_path / "resume", {"from_pretrained": BASE, "lora": LORA}, ("--resume", "--steps", "4"), expect_ok=False)
    assert r.returncode == 1 and "(only in the checkpoint: 'lm_head')" in r.stderr and \
        "modules_to_save trains the head in a block of its own" in r.stderr, r.stderr


def test_modules_to_save_take_the_familys_module_names(tmp_path):
    """GPT-NeoX names its embedding and head embed_in and embed_out, as PEFT's modules_to_save must: those train
    and go into the adapter under PEFT's names (the head failed on a tensor gpt_neox.lm_head.lm_head.weight),
    and the Llama's names, which PEFT would match to no module of this model, are refused naming the family's."""
    neox = os.path.join(FIXTURES, "gpt_neox")
    got = saved_modules_train_and_read_back(tmp_path, neox, ["embed_in", "embed_out"],
                                            ("gpt_neox.embed_in.weight", "embed_out.weight"))
    assert load_file(str(tmp_path / "b" / "adapter_model.safetensors")).keys() == got.keys()
    for wrong in ("lm_head", "embed_tokens"):
        r = run(tmp_path, {"from_pretrained": neox, "lora": dict(LORA, modules_to_save=[wrong])}, expect_ok=False)
        assert r.returncode != 0 and "model.lora.modules_to_save" in r.stderr and "embed_in and embed_out" in r.stderr, \
            r.stderr


@pytest.mark.parametrize("fixture,saved", [("llama_gqa", False), ("gpt2", False), ("llama_gqa", True),
                                           ("phi3", False), ("gpt_neox", False), ("gpt_neox", True)])
def test_peft_loads_the_adapter_and_merges_as_zinc_does(tmp_path, fixture, saved):
    torch = pytest.importorskip("torch", reason="torch is not installed here (bench/peers/setup.sh has it)")
    peft = pytest.importorskip("peft", reason="peft is not installed here (bench/peers/setup.sh has it)")
    transformers = pytest.importorskip("transformers")
    base_dir = os.path.join(FIXTURES, fixture)
    run(tmp_path, {"from_pretrained": base_dir,
                   "lora": dict(LORA, modules_to_save=(["embed_in", "embed_out"] if fixture == "gpt_neox" else
                                                       ["embed_tokens", "lm_head"])) if saved else LORA},
        ("--save-adapter", str(tmp_path / "adapter"), "--save-pretrained", str(tmp_path / "merged"), "--merge",
         "--save-dtype", "fp32"), bf16=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64, attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    state = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    result = peft.set_peft_model_state_dict(model, {k: torch.from_numpy(v) for k, v in state.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys
    ids = torch.from_numpy(load_file(os.path.join(base_dir, "reference.safetensors"))["input_ids"].astype(np.int64))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged_ref = model.merge_and_unload().state_dict()
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float64, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
    assert float((logits - adapted).abs().max()) < 1e-5
    zinc_merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    renamed = {"embed_out.weight": "lm_head.weight"}  # transformers 5 renames GPT-NeoX's head on load
    for k, v in zinc_merged.items():
        want = merged_ref[k] if k in merged_ref else merged_ref[renamed[k]]
        if want.shape != v.shape:  # GPT-2's Conv1D: the state dict's layout is the file's
            want = want.t()
        assert float((torch.from_numpy(v).double() - want).abs().max()) < 1e-6, k


def test_zinc_export_of_a_lora_checkpoint_writes_the_adapters_alone(tmp_path):
    """The frozen base is not in a LoRA checkpoint: zinc-export writes the adapters (never zeros for the base) and
    --format hf is refused naming why."""
    zinc_export = os.environ.get("ZINC_EXPORT", os.path.join(ROOT, "build", "tools", "zinc-export"))
    run(tmp_path, {"from_pretrained": BASE, "lora": LORA}, ("--set", "run.checkpoint_interval=3"))
    ck = str(tmp_path / "run" / "checkpoints")
    r = subprocess.run([zinc_export, ck, "--out", str(tmp_path / "w.safetensors")], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "frozen tensors are not in it" in r.stdout
    got = load_file(str(tmp_path / "w.safetensors"))
    assert len(got) == 28 and all(".lora." in k for k in got)
    r = subprocess.run([zinc_export, ck, "--format", "hf", "--out", str(tmp_path / "hf")], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "LoRA checkpoint" in r.stderr and not (tmp_path / "hf").exists()


def test_zinc_export_format_peft_writes_the_checkpoints_adapters_as_save_adapter_does(tmp_path):
    """zinc-export --format peft of a LoRA checkpoint is the adapter folder --save-adapter writes at that step, byte
    for byte; a checkpoint without adapters, and an output folder that is the checkpoint, are refused."""
    zinc_export = os.environ.get("ZINC_EXPORT", os.path.join(ROOT, "build", "tools", "zinc-export"))
    gpt2 = {"from_pretrained": os.path.join(FIXTURES, "gpt2"), "lora": dict(LORA, use_rslora=True)}
    saved = {"from_pretrained": BASE, "lora": dict(LORA, modules_to_save=["lm_head"])}
    for name, model in (("llama", {"from_pretrained": BASE, "lora": LORA}), ("gpt2", gpt2), ("saved", saved)):
        tmp = tmp_path / name
        tmp.mkdir()
        run(tmp, model, ("--set", "run.checkpoint_interval=3", "--save-adapter", str(tmp / "a")))
        ck = str(tmp / "run" / "checkpoints")
        r = subprocess.run([zinc_export, ck, "--format", "peft", "--out", str(tmp / "e")], env=ENV,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "LoRA tensors" in r.stdout, r.stdout
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert (tmp / "e" / f).read_bytes() == (tmp / "a" / f).read_bytes(), (name, f)
        r = subprocess.run([zinc_export, ck, "--format", "peft", "--out", ck], env=ENV, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and "zinc-export: error:" in r.stderr, r.stderr
        assert (tmp / "run" / "checkpoints" / "latest").exists()
    # --max-shard-size would do nothing here (it was taken without a word).
    r = subprocess.run([zinc_export, ck, "--format", "peft", "--out", str(tmp_path / "shard"), "--max-shard-size", "1KB"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--max-shard-size: --format peft writes one adapter_model.safetensors" in r.stderr, \
        r.stderr
    assert not (tmp_path / "shard").exists()
    run(tmp_path / "llama", {"from_pretrained": BASE}, ("--set", "run.checkpoint_interval=3",
                                                        "--set", "run.output_dir=" + str(tmp_path / "full")))
    r = subprocess.run([zinc_export, str(tmp_path / "full" / "checkpoints"), "--format", "peft", "--out",
                        str(tmp_path / "none")], env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not a LoRA checkpoint" in r.stderr, r.stderr
    assert not (tmp_path / "none").exists()


def test_an_adapter_is_never_written_over_the_adapter_the_run_reads(tmp_path):
    run(tmp_path, {"from_pretrained": BASE, "lora": LORA}, ("--save-adapter", str(tmp_path / "a1")))
    before = (tmp_path / "a1" / "adapter_model.safetensors").read_bytes()
    r = run(tmp_path, {"from_pretrained": BASE, "adapter": str(tmp_path / "a1")}, ("--save-adapter", str(tmp_path / "a1")),
            expect_ok=False)
    assert r.returncode != 0 and "which this run reads" in r.stderr
    assert (tmp_path / "a1" / "adapter_model.safetensors").read_bytes() == before


@pytest.mark.parametrize("phase", ["shard", "staged", "linked", "swapped"])
def test_a_kill_during_save_adapter_leaves_the_old_adapter_or_the_new(tmp_path, phase):
    """--save-adapter over an earlier adapter A, killed (SIGKILL, ZINC_EXPORT_FAULT) at each phase of its write:
    the folder holds A's files byte for byte before the swap and B's (an uninterrupted run's) after it, and the
    user's own file in it is kept."""
    out = tmp_path / "adapter"
    run(tmp_path, {"from_pretrained": BASE, "lora": LORA}, ("--save-adapter", str(out)), steps=2)
    (out / "NOTES.txt").write_text("mine")
    old = {f: (out / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}
    run(tmp_path, {"from_pretrained": BASE, "lora": LORA}, ("--save-adapter", str(tmp_path / "b")), steps=4)
    new = {f: (tmp_path / "b" / f).read_bytes() for f in old}
    env = dict(ENV, ZINC_EXPORT_FAULT=phase)
    ds = {"train_batch_size": 2, "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
          "model": {"from_pretrained": BASE, "lora": LORA},
          "data": {"type": "synthetic", "vocab_size": 96, "seq_len": 12},
          "run": {"steps": 4, "output_dir": str(tmp_path / "run")}}
    (tmp_path / "k.json").write_text(json.dumps(ds))
    r = subprocess.run([ZINC_TRAIN, str(tmp_path / "k.json"), "--save-adapter", str(out)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    got = {f: (out / f).read_bytes() for f in old}
    assert got == (new if phase == "swapped" else old), phase
    assert (out / "NOTES.txt").read_text() == "mine"
    load_file(str(out / "adapter_model.safetensors"))  # the real package reads what is there
