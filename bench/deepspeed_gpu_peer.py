#!/usr/bin/env python3
"""DeepSpeed's ZeRO-Offload on one GPU: the DeepSpeed peer of zinc-bench gpu-train-step.

The model is bench/torch_gpt_peer.py's (zinc's GPT, or with --model llama
zinc's ~1B Llama), at gpu-train-step's sizes and accumulation, trained by a
DeepSpeed engine: bf16 weights with fp32 master copies, AdamW (lr 3e-4,
weight decay 0.1; DeepSpeedCPUAdam when the optimizer is offloaded, which
DeepSpeed builds just in time with the machine's C++ compiler), clipping 1.0,
ZeRO stage 2 (or 3) with overlap_comm and contiguous gradients, and the
optimizer states in page-locked host memory (--offload cpu, the default) or
on the GPU (--offload none). Prints tokens/s and model FLOP/s with zinc's
FLOP count, one JSON line with --json.

  python3 bench/deepspeed_gpu_peer.py [--large] [--model gpt|llama] [--stage 2|3] [--offload cpu|none] [--json]
  # the script itself, on a CPU (DeepSpeed's CPU accelerator):
  DS_ACCELERATOR=cpu python3 bench/deepspeed_gpu_peer.py --tiny --device cpu

gpu-bundle/run.sh's "deepspeed" part runs it, with DeepSpeed installed
from the wheels the bundle carries where the machine lacks it.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from torch_gpt_peer import GPT, LLAMA_SIZES, Llama, report, timed_steps  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large", action="store_true", help="the 355M GPT (gpu-train-step --large)")
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--offload", choices=("cpu", "none"), default="cpu",
                    help="offload_optimizer (and at stage 3 offload_param) device")
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a toy size for checking the script")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # after DS_ACCELERATOR: DeepSpeed picks its accelerator on import

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl" if a.device == "cuda" else "gloo")
    torch.manual_seed(0)
    if a.model == "llama":
        case = "llama-tiny" if a.tiny else "llama-1.1b"
        B, T, C, H, K, D, I, L, V = LLAMA_SIZES[case]
        model = Llama(V, T, C, H, K, D, I, L)
        matmul_params = L * (C * (H + 2 * K) * D + H * D * C + 3 * C * I) + V * C
        flops_per_token = 6 * matmul_params + L * 3 * 2 * 2 * T * H * D
    else:
        case = "tiny" if a.tiny else ("large" if a.large else "reference")
        B, T, C, H, L, V = {"tiny": (2, 32, 64, 4, 2, 64), "large": (8, 1024, 1024, 16, 24, 50304),
                            "reference": (8, 256, 384, 6, 6, 256)}[case]
        model = GPT(V, T, C, H, L)
        matmul_params = L * 12 * C * C + V * C
        flops_per_token = 6 * matmul_params + L * 3 * 2 * 2 * T * C
    zero = {"stage": a.stage, "overlap_comm": True, "contiguous_gradients": True}
    if a.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if a.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": a.gas, "gradient_clipping": 1.0,
           "zero_optimization": zero, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = engine.device
    g = torch.Generator(device="cpu").manual_seed(1)

    def step():
        for _ in range(a.gas):
            idx = torch.randint(0, V, (B, T + 1), generator=g).to(dev)
            loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()  # DeepSpeed updates at the accumulation boundary
        if a.device == "cuda":
            torch.cuda.synchronize()

    t = timed_steps(step, a.rounds, a.steps)
    tokens_per_s = B * T * a.gas / t
    line = {"bench": "deepspeed-gpu-peer", "case": case, "deepspeed": deepspeed.__version__,
            "device": str(dev) + (" " + torch.cuda.get_device_name() if a.device == "cuda" else ""),
            "torch": torch.__version__, "stage": a.stage, "offload": a.offload, "dtype": "bf16",
            "optimizer": type(engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer")
                              else engine.optimizer).__name__,
            "tokens_per_s": tokens_per_s, "model_tflops": flops_per_token * tokens_per_s / 1e12, "step_s": t,
            "gradient_accumulation_steps": a.gas}
    report(line, f"deepspeed-gpu-peer ({case}, {line['device']}, DeepSpeed {deepspeed.__version__}, "
                 f"stage {a.stage}, optimizer on {a.offload if a.offload == 'cpu' else a.device} "
                 f"({line['optimizer']})): {tokens_per_s:.0f} tokens/s, {line['model_tflops']:.2f} TFLOP/s "
                 f"model FLOPs, {t:.3f} s/step", a.json)


if __name__ == "__main__":
    main()
