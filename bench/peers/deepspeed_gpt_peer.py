#!/usr/bin/env python3
"""zinc's reference GPT trained by DeepSpeed on CPU ranks: the peer of `zinc-bench train-step`.

The model is bench/torch_gpt_peer.py's (zinc's GPT architecture and sizes:
6 x 384, 6 heads, seq 256, micro-batch 8, vocabulary 256), the optimizer
DeepSpeed's AdamW (DeepSpeedCPUAdam where it JIT-builds, lr 3e-4, weight decay
0.1), clipping 1.0, at the ZeRO stage and offload asked for. DeepSpeed runs on
CPU ranks with DS_ACCELERATOR=cpu over gloo. Prints tokens/s (global) and the
peak RSS of this rank; one JSON line with --json.

  # the peers venv: bash bench/peers/setup.sh
  DS_ACCELERATOR=cpu bench/peers/.venv/bin/python bench/peers/deepspeed_gpt_peer.py --stage 2 [--fp32] [--offload cpu]
  # 2 ranks
  DS_ACCELERATOR=cpu bench/peers/.venv/bin/torchrun --nproc_per_node 2 bench/peers/deepspeed_gpt_peer.py --stage 2

Run one rank's threads as zinc's run uses them (OMP_NUM_THREADS=2 at one
rank, 1 per rank at two on a 2-core machine).
"""
import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from torch_gpt_peer import GPT, SIZES, add_run_args, report, timed_steps  # noqa: E402  (bench/torch_gpt_peer.py)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=0, choices=(0, 1, 2, 3))
    ap.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                    help="offload_optimizer (and at stage 3 offload_param) device")
    ap.add_argument("--nvme-path", default="/tmp/ds_peer_nvme", help="--offload nvme: the folder DeepSpeed swaps to")
    add_run_args(ap)
    ap.add_argument("--gas", type=int, default=1)
    a = ap.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    B, T, C, H, L, V = SIZES["tiny" if a.tiny else a.size](world)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = GPT(V, T, C, H, L)
    zero = {"stage": a.stage}
    if a.offload != "none":
        zero["offload_optimizer"] = {"device": a.offload}
        if a.stage == 3:
            zero["offload_param"] = {"device": a.offload}
        if a.offload == "nvme":
            os.makedirs(a.nvme_path, exist_ok=True)
            for k in [k for k in ("offload_optimizer", "offload_param") if k in zero]:
                zero[k]["nvme_path"] = a.nvme_path
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": a.gas,
           "gradient_clipping": 1.0, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
           "bf16": {"enabled": not a.fp32}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1 + rank)

    def step():
        for _ in range(a.gas):
            idx = torch.randint(0, V, (B, T + 1), generator=g)
            loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()

    t = timed_steps(step, a.rounds, a.steps, torch.distributed.barrier)
    tokens_per_s = world * B * T * a.gas / t
    line = {"bench": "deepspeed-gpt-peer", "deepspeed": deepspeed.__version__, "torch": torch.__version__,
            "ranks": world, "stage": a.stage, "offload": a.offload, "dtype": "fp32" if a.fp32 else "bf16",
            "threads_per_rank": torch.get_num_threads(), "size": "tiny" if a.tiny else a.size, "micro_batch": B,
            "optimizer": type(engine.optimizer).__name__, "tokens_per_s": tokens_per_s, "step_s": t}
    if rank == 0:
        report(line, f"deepspeed-gpt-peer (DeepSpeed {deepspeed.__version__}, {world} rank(s) x "
                     f"{line['threads_per_rank']} threads, stage {a.stage}, offload {a.offload}, {line['dtype']}): "
                     f"{tokens_per_s:.0f} tokens/s, {t:.3f} s/step (rank 0)", a.json)

if __name__ == "__main__":
    main()
