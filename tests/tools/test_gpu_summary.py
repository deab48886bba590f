"""bench/gpu_summary.py, which turns the GPU bundle's result files into issue 53's table.

The files are written here as run.sh writes them (JSON lines among the lines
tee kept), with figures chosen so that each ratio is known: the table must
pair each zinc case with its peer, tell the plain cases from the variants,
say which aims are met, and say "not measured" for what is missing.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "bench", "gpu_summary.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import gpu_summary  # noqa: E402


def zinc(case, states, stage, tps, ratio=1.0, env=None, omp=8, **extra):
    line = {"bench": "gpu-train-step", "case": case, "optimizer_states": states, "zero_stage": stage,
            "offload_ratio": 0.0 if states == "gpu" else ratio, "tokens_per_s": tps,
            "step_s": 32768 / tps if isinstance(tps, float) else None,
            "ratio": 0.6, "env": env or {}, "omp_threads": omp}
    line.update(extra)
    return line


def write(folder, name, lines):
    with open(os.path.join(folder, name), "w") as f:
        f.write("machine: a header line tee kept\n")
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def table(folder):
    rows, notes = gpu_summary.summarise(str(folder))
    return {(r[0], r[1].split(" (")[0] if r[1].startswith("stage 3 /") else r[1]): (r[2], r[4]) for r in rows}, notes


def test_each_case_against_its_peer_and_the_aims(tmp_path):
    write(tmp_path, "gpu-train-step.jsonl", [
        zinc("large", "gpu", 2, 100.0),
        zinc("large", "cpu", 2, 90.0),
        zinc("large", "cpu", 3, 70.0, prefetched_share=0.9, upload_floor_s=0.1, step_s=0.5),
        zinc("large", "cpu", 2, 95.0, ratio=0.5),
        zinc("large", "cpu", 2, 60.0, env={"ZINC_GPU_UPDATE_BEHIND": "0"}),
        zinc("large", "cpu", 2, 99.0, omp=15),
        zinc("large", "gpu", 2, 50.0, env={"ZINC_CUDA_MATMUL_BIAS": "separate"}),
        # A --lora line: its figures are the full model's of the same rounds, but it is a variant.
        zinc("llama-1.1b", "gpu", 2, 40.0, lora={"step_s": 0.4, "vs_full_step": 0.55}),
        "{this line was cut by a time limit",
    ])
    write(tmp_path, "torch-peer.jsonl", [
        {"bench": "torch-gpt-peer", "case": "large", "offload": False, "tokens_per_s": 80.0},
        {"bench": "torch-gpt-peer", "case": "large", "offload": True, "tokens_per_s": 50.0},
    ])
    t, notes = table(tmp_path)
    gpt = "355M GPT"
    assert t[(gpt, "states on the GPU / PyTorch (SDPA, fused AdamW)")] == ("1.25", "met")
    assert t[(gpt, "states on the GPU / cuBLAS bound")] == ("0.60", "met")
    assert t[(gpt, "ZeRO-Offload / PyTorch's CPU-AdamW loop")] == ("1.80", "met")
    assert t[(gpt, "ZeRO-Offload step / resident step")] == ("1.11", "met")
    assert t[(gpt, "  offload ratio 0.5: step / resident step")] == ("1.05", "met")
    assert t[(gpt, "stage 3 / stage-2 offload")] == ("0.78", "met")
    assert t[(gpt, "ZeRO-Offload / DeepSpeed's (stage 2, CPU Adam)")] == ("-", "not measured")
    # The variants, each against its plain case, never taken for it.
    assert t[(gpt, "  offload (ZINC_GPU_UPDATE_BEHIND=0) / plain")] == ("0.67", "measured")
    assert t[(gpt, "  resident (ZINC_CUDA_MATMUL_BIAS=separate) / plain")] == ("0.50", "measured")
    assert t[(gpt, "  offload, 15 CPU threads / 8")] == ("1.10", "measured")
    assert t[("~1B Llama", "  LoRA step / full step (resident, same rounds)")] == ("0.55", "measured")
    # The Llama's plain cases were not run (the LoRA line is not taken for one): every row says so.
    llama = [v for (m, _), v in t.items() if m == "~1B Llama" and v[1] != "measured"]
    assert llama and all(v == ("-", "not measured") for v in llama)
    assert any("not JSON" in n for n in notes)
    rows, _ = gpu_summary.summarise(str(tmp_path))
    s3 = [r for r in rows if r[0] == gpt and r[1].startswith("stage 3 /")][0]
    assert "90% prefetched" in s3[1] and "uploads alone 0.20 of the step" in s3[1]


def test_aims_not_met_and_the_deepspeed_peer(tmp_path):
    write(tmp_path, "gpu-train-step.jsonl", [
        zinc("llama-1.1b", "gpu", 2, 100.0, ratio=0.3),
        zinc("llama-1.1b", "cpu", 2, 50.0),
        zinc("llama-1.1b", "cpu", 3, 20.0),
    ])
    write(tmp_path, "torch-peer.jsonl", [
        {"bench": "torch-gpt-peer", "case": "llama-1.1b", "offload": False, "tokens_per_s": 200.0},
        {"bench": "torch-gpt-peer", "case": "llama-1.1b", "offload": True, "tokens_per_s": 40.0},
    ])
    write(tmp_path, "deepspeed-peer.jsonl", [
        {"bench": "deepspeed-gpu-peer", "case": "llama-1.1b", "stage": 2, "offload": "cpu", "tokens_per_s": 25.0},
    ])
    t, _ = table(tmp_path)
    m = "~1B Llama"
    assert t[(m, "states on the GPU / PyTorch (SDPA, fused AdamW)")] == ("0.50", "not met")
    assert t[(m, "ZeRO-Offload / PyTorch's CPU-AdamW loop")] == ("1.25", "not met")
    assert t[(m, "ZeRO-Offload step / resident step")] == ("2.00", "not met")
    assert t[(m, "stage 3 / stage-2 offload")] == ("0.40", "not met")
    assert t[(m, "ZeRO-Offload / DeepSpeed's (stage 2, CPU Adam)")] == ("2.00", "measured")


def test_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.startswith("| model | figure |")
    assert "not measured" in out.stdout
    missing = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
    usage = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_a_line_without_its_figure_is_noted_not_taken(tmp_path):
    write(tmp_path, "gpu-train-step.jsonl", [
        {"bench": "gpu-train-step", "case": "large", "optimizer_states": "gpu", "zero_stage": 2},
        "[1, 2, 3]",
    ])
    write(tmp_path, "torch-peer.jsonl", [{"bench": "torch-gpt-peer", "case": "large", "offload": False,
                                          "tokens_per_s": 80.0}])
    t, notes = table(tmp_path)
    assert t[("355M GPT", "states on the GPU / PyTorch (SDPA, fused AdamW)")] == ("-", "not measured")
    assert any("without tokens_per_s" in n for n in notes)


def test_fields_of_the_wrong_type_are_skipped_not_fatal(tmp_path):
    write(tmp_path, "gpu-train-step.jsonl", [
        zinc("large", "cpu", 2, 90.0, ratio="half"),
        zinc("large", "gpu", 2, "fast", env=None),
        {"bench": "gpu-train-step", "case": "large", "optimizer_states": "cpu", "zero_stage": 2, "env": ["x"],
         "tokens_per_s": 1.0, "offload_ratio": 1.0},
        zinc("large", "cpu", 3, 70.0, prefetched_share="most", upload_floor_s=None, step_s=True),
        zinc("large", "gpu", 2, 70.0, lora="fast"),
    ])
    rows, notes = gpu_summary.summarise(str(tmp_path))
    assert rows and any("without tokens_per_s" in n for n in notes)
    s3 = [r for r in rows if r[1].startswith("stage 3 /") and r[0] == "355M GPT"][0]
    assert "- prefetched" in s3[1]
    assert any("lora is not an object" in n for n in notes)
