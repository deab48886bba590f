"""zinc-export, checked with the real `safetensors` package.

zinc-train trains, saves a checkpoint and writes the engine's own full fp32
weights (--save-weights, gathered from the ranks' memory); zinc-export then
rebuilds the weights from the checkpoint's files alone. The two must be equal
bit for bit, at one rank and at two ranks under ZeRO-3 with NVMe offload
(where every rank file holds only a shard of each block).

Run by CTest (export_safetensors) with ZINC_TRAIN, ZINC_EXPORT and ZINC_ROOT
set; by hand: python3 -m pytest tests/tools/test_export.py from the repo
root after a build.
"""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file

ROOT = os.environ.get("ZINC_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
ZINC_TRAIN = os.environ.get("ZINC_TRAIN", os.path.join(ROOT, "build", "tools", "zinc-train"))
ZINC_EXPORT = os.environ.get("ZINC_EXPORT", os.path.join(ROOT, "build", "tools", "zinc-export"))
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def mpirun(n):
    cmd = ["mpirun", "--oversubscribe", "-np", str(n), "-x", "OMP_NUM_THREADS=1"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


def train(tmp, config, ranks=1, steps=12, extra=()):
    """Trains `steps` steps, checkpointing at the end; returns (checkpoint dir, engine weights file)."""
    ck, weights = str(tmp / "ck"), str(tmp / "engine.safetensors")
    cmd = [ZINC_TRAIN, os.path.join(ROOT, "configs", config), "--steps", str(steps),
           "--set", "run.checkpoint_dir=" + ck, "--set", "run.checkpoint_interval=%d" % steps,
           "--set", "run.eval_interval=0", "--save-weights", weights, "--json", *extra]
    if ranks > 1:
        cmd = mpirun(ranks) + cmd
    subprocess.run(cmd, check=True, env=ENV, capture_output=True, text=True)
    return ck, weights


def export(ck, out, *args, check=True):
    return subprocess.run([ZINC_EXPORT, ck, "--out", str(out), *args], env=ENV, capture_output=True,
                          text=True, check=check)


def bf16_round(a):
    """fp32 -> bf16 bits, round to nearest even (zinc's float_to_bf16; no NaN here)."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def expect_equal_weights(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == np.float32 and got[name].shape == want[name].shape, name
        assert np.array_equal(got[name].view(np.uint32), want[name].view(np.uint32)), name


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    return train(tmp, "default.json")


@pytest.fixture(scope="module")
def two_ranks_zero3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    nvme = tmp / "nvme"
    nvme.mkdir()
    return train(tmp, "zero3.json", ranks=2, extra=(
        "--set", "zero_optimization.offload_optimizer.nvme_path=" + str(nvme),
        "--set", "zero_optimization.offload_param.nvme_path=" + str(nvme)))


@pytest.mark.parametrize("case", ["one_rank", "two_ranks_zero3"])
def test_export_equals_the_engines_weights(case, request, tmp_path):
    ck, engine_weights = request.getfixturevalue(case)
    out = tmp_path / "model.safetensors"
    r = export(ck, out)
    assert "1 file" in r.stdout, r.stdout
    got, want = load_file(str(out)), load_file(engine_weights)
    expect_equal_weights(got, want)
    # The model's parameter names and shapes (configs: n_embd 384 / 128, vocabulary 64, block 64).
    c = want["embed.wte"].shape[1]
    assert want["embed.wte"].shape == (64, c) and want["embed.wpe"].shape == (64, c)
    assert want["h.0.attn.c_attn.weight"].shape == (3 * c, c)
    assert want["h.0.mlp.c_proj.weight"].shape == (c, 4 * c)
    assert want["ln_f.bias"].shape == (c,)
    with safe_open(str(out), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["zinc_model"] == "gpt"
    assert meta["zinc_checkpoint"] == "global_step12" and meta["zinc_global_steps"] == "12"
    # The layout in exact terms: header length, 8-byte aligned data, no gaps.
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == len(raw) - 8 - n


def test_bf16_export_is_the_fp32_weights_rounded_to_nearest_even(one_rank, tmp_path):
    ck, engine_weights = one_rank
    out = tmp_path / "model16.safetensors"
    export(ck, out, "--dtype", "bf16")
    want = load_file(engine_weights)
    # numpy has no bf16: the package's own deserializer checks the file and hands back the bytes.
    tensors = dict(safetensors.deserialize(out.read_bytes()))
    assert sorted(tensors) == sorted(want)
    for name, t in tensors.items():
        assert t["dtype"] == "BF16" and list(t["shape"]) == list(want[name].shape), name
        bits = np.frombuffer(bytes(t["data"]), dtype="<u2").reshape(want[name].shape)
        assert np.array_equal(bits, bf16_round(want[name])), name


def test_sharded_export_round_trips_through_its_index(two_ranks_zero3, tmp_path):
    ck, engine_weights = two_ranks_zero3
    limit = 150_000
    r = export(ck, tmp_path / "model.safetensors", "--max-shard-size", "150KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and "%d files" % len(files) in r.stdout, r.stdout
    assert files == ["model-%05d-of-%05d.safetensors" % (k + 1, len(files)) for k in range(len(files))]
    assert not (tmp_path / "model.safetensors").exists()
    got, total = {}, 0
    for name in files:
        part = load_file(str(tmp_path / name))
        part_bytes = sum(a.nbytes for a in part.values())
        assert part_bytes <= limit or len(part) == 1, (name, part_bytes)
        for k, a in part.items():
            assert index["weight_map"][k] == name
            got[k] = a
        total += part_bytes
    assert index["metadata"]["total_size"] == total
    expect_equal_weights(got, load_file(engine_weights))


def test_a_corrupted_checkpoint_fails_naming_file_and_tensor_and_writes_nothing(one_rank, tmp_path):
    ck, _ = one_rank
    bad = tmp_path / "ck"
    shutil.copytree(ck, bad)
    rank_file = bad / "global_step12" / "rank00000.bin"
    data = bytearray(rank_file.read_bytes())
    data[100] ^= 0x01  # inside the first block's master weights: embed.wte
    rank_file.write_bytes(bytes(data))
    out = tmp_path / "model.safetensors"
    r = export(str(bad), out, check=False)
    assert r.returncode == 1
    assert "rank00000.bin is corrupted" in r.stderr and "tensor embed.wte" in r.stderr, r.stderr
    assert os.listdir(tmp_path) == ["ck"], os.listdir(tmp_path)  # no output, no .tmp


def test_bad_arguments_are_named(one_rank, tmp_path):
    ck, _ = one_rank
    r = export(ck, tmp_path / "m.safetensors", "--max-shard-size", "5 parsecs", check=False)
    assert r.returncode == 1 and "--max-shard-size: '5 parsecs' is not a size" in r.stderr, r.stderr
    r = export(ck, tmp_path / "m.bin", check=False)
    assert r.returncode == 1 and "must name a .safetensors file" in r.stderr, r.stderr
    r = export(ck, tmp_path / "m.safetensors", "--tag", "global_step999", check=False)
    assert r.returncode == 1 and "global_step999" in r.stderr and "not found" in r.stderr, r.stderr
    r = export(str(tmp_path / "nothing"), tmp_path / "m.safetensors", check=False)
    assert r.returncode == 1 and "latest not found" in r.stderr, r.stderr
    r = export(ck, tmp_path / "no" / "such" / "m.safetensors", check=False)
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr


def test_a_users_tmp_files_survive_and_a_killed_exports_temporaries_go(two_ranks_zero3, tmp_path):
    """The export's temporaries are hidden and zinc's own (.NAME.zinc-tmp): files a user named NAME.tmp
    are neither overwritten nor removed, and what a killed export of NAME left is removed by the next."""
    ck, engine_weights = two_ranks_zero3
    users = {"model.safetensors.tmp": b"mine", "model.safetensors.index.json.tmp": b"{}",
             "model-00001-of-00003.safetensors.tmp": b"also mine"}
    for name, data in users.items():
        (tmp_path / name).write_bytes(data)
    killed = [".model.safetensors.index.json.zinc-tmp", ".model-00002-of-00009.safetensors.zinc-tmp"]
    others = [".other.safetensors.zinc-tmp", ".model.safetensors.zinc-tmp.keep"]  # not this export's
    for name in killed + others:
        (tmp_path / name).write_bytes(b"half")
    export(ck, tmp_path / "model.safetensors", "--max-shard-size", "150KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(list(users) + others + files + ["model.safetensors.index.json"]), left
    for name, data in users.items():
        assert (tmp_path / name).read_bytes() == data, name
    got = {}
    for name in files:
        got.update(load_file(str(tmp_path / name)))
    expect_equal_weights(got, load_file(engine_weights))
    # One file, as --save-weights writes it too.
    export(ck, tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors.tmp").read_bytes() == b"mine"
    expect_equal_weights(load_file(str(tmp_path / "model.safetensors")), load_file(engine_weights))
