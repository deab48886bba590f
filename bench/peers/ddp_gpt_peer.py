#!/usr/bin/env python3
"""zinc's reference GPT trained by PyTorch DistributedDataParallel on CPU
ranks over gloo: the peer of a 2-rank zinc-train run at stage 0-2 (issue 28).

The model is bench/torch_gpt_peer.py's copy of zinc's GPT (6 x 384, 6 heads,
seq 256, micro-batch 8 per rank, vocabulary 256), AdamW (lr 3e-4, weight
decay 0.1, PyTorch's fused CPU kernel), clipping 1.0, fp32 or bf16 autocast
with fp32 weights. Prints the global tokens/s and rank 0's peak RSS; one JSON
line with --json.

  bash bench/peers/setup.sh
  OMP_NUM_THREADS=1 bench/peers/.venv/bin/torchrun --nproc_per_node 2 bench/peers/ddp_gpt_peer.py [--fp32]

Run the ranks' threads as zinc's ranks use them (1 per rank on a 2-core
machine). --tiny checks the script at a toy size.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_gpt_peer import GPT, SIZES, add_run_args, report, timed_steps  # noqa: E402  (bench/torch_gpt_peer.py)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap)
    a = ap.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    B, T, C, H, L, V = SIZES["tiny" if a.tiny else a.size](world)
    torch.manual_seed(0)
    model = DDP(GPT(V, T, C, H, L))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    amp = torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=not a.fp32)
    g = torch.Generator().manual_seed(1 + rank)

    losses = []

    def step():
        idx = torch.randint(0, V, (B, T + 1), generator=g)
        with amp:
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()  # DDP all-reduces the gradients in buckets, overlapped with the backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    t = timed_steps(step, a.rounds, a.steps, dist.barrier)
    tokens_per_s = world * B * T / t
    line = {"bench": "ddp-gpt-peer", "torch": torch.__version__, "ranks": world,
            "dtype": "fp32" if a.fp32 else "bf16", "threads_per_rank": torch.get_num_threads(),
            "tokens_per_s": tokens_per_s, "step_s": t, "loss": losses[-1], "size": "tiny" if a.tiny else a.size,
            "micro_batch": B}
    if rank == 0:
        report(line, f"ddp-gpt-peer (PyTorch {torch.__version__} DDP over gloo, {world} rank(s) x "
                     f"{line['threads_per_rank']} threads, {line['dtype']}): {tokens_per_s:.0f} tokens/s, "
                     f"{t:.3f} s/step (rank 0)", a.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
