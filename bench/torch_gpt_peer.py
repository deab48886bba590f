#!/usr/bin/env python3
"""The peer of zinc-bench gpu-train-step: the same GPT trained by PyTorch.

Same architecture as zinc's built-in GPT (learned token and position
embeddings, pre-LayerNorm blocks with causal attention and a 4x tanh-GELU
MLP, final LayerNorm, head tied to the token embedding), the same sizes,
batch and accumulation, bf16 autocast with fp32 master weights, AdamW
(lr 3e-4, weight decay 0.1, clipping 1.0). Prints tokens/s and model FLOP/s
with zinc's FLOP count (6 x matmul parameters + attention), one JSON line
with --json. With --offload the optimizer runs on the CPU over fp32 copies,
as zinc's ZeRO-Offload does; without it the optimizer runs on the device
(PyTorch's usual setup, the faster peer where the states fit).

With --model llama the model is zinc-bench gpu-train-step --model llama's
Llama instead (TinyLlama 1.1B's shape: RMSNorm, rotary embeddings, 32
query heads over 4 kv heads in SDPA with enable_gqa, SwiGLU, untied head),
with zinc's FLOP count for it.

  python3 bench/torch_gpt_peer.py [--large] [--model gpt|llama] [--gas 4] [--rounds 5] [--steps 3] [--device cuda] [--fp32] [--json]
"""
import argparse
import json
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, T, C, H, L):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def rotate(x, cos, sin):
    """transformers' rotate_half rotary embedding over the last dimension."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, C, H, K, D, I):
        super().__init__()
        self.H, self.K, self.D = H, K, D
        self.ln_1 = nn.RMSNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, (H + 2 * K) * D, bias=False)
        self.o = nn.Linear(H * D, C, bias=False)
        self.ln_2 = nn.RMSNorm(C, eps=1e-5)
        self.gate_up = nn.Linear(C, 2 * I, bias=False)
        self.down = nn.Linear(I, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split([self.H * self.D, self.K * self.D, self.K * self.D], dim=2)
        q = rotate(q.view(B, T, self.H, self.D).transpose(1, 2), cos, sin)
        k = rotate(k.view(B, T, self.K, self.D).transpose(1, 2), cos, sin)
        v = v.view(B, T, self.K, self.D).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, self.H * self.D))
        g, u = self.gate_up(self.ln_2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, V, T, C, H, K, D, I, L):
        super().__init__()
        self.embed = nn.Embedding(V, C)
        self.h = nn.ModuleList(LlamaBlock(C, H, K, D, I) for _ in range(L))
        self.norm = nn.RMSNorm(C, eps=1e-5)
        self.head = nn.Linear(C, V, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.outer(torch.arange(T).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for b in self.h:
            x = b(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# zinc-bench gpu-train-step --model llama's sizes: (B, T, C, H, K, D, I, L, V).
LLAMA_SIZES = {"llama-1.1b": (8, 1024, 2048, 32, 4, 64, 5632, 22, 32000),
               "llama-tiny": (2, 16, 32, 4, 2, 8, 48, 2, 64)}


def add_run_args(ap):
    """The options every CPU-rank peer shares: precision, timing, size and output."""
    ap.add_argument("--fp32", action="store_true", help="fp32 (default: bf16 over fp32 master weights)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a toy size for checking the script")
    ap.add_argument("--size", choices=sorted(SIZES), default="reference",
                    help="reference: zinc-bench train-step's GPT; default: configs/default.json's (global batch 64)")
    ap.add_argument("--json", action="store_true")


def timed_steps(step, rounds, steps, barrier=None):
    """Two warm-up steps, then `rounds` rounds of `steps` steps: the median
    seconds per step (barrier, if given, lines the ranks up around each round)."""
    step()
    step()
    times = []
    for _ in range(rounds):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if barrier:
            barrier()
        times.append((time.perf_counter() - t0) / steps)
    return sorted(times)[len(times) // 2]


def report(line, text, as_json):
    """Adds this process's peak RSS to the result and prints it: one JSON line, or `text` and the RSS."""
    line["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(line) if as_json else "%s, peak RSS %.0f MiB" % (text, line["peak_rss_mib"]), flush=True)


# (micro-batch B, seq T, width C, heads H, layers L, vocabulary V) of the
# sizes the peers run: zinc-bench train-step's reference GPT, and
# configs/default.json's (global batch 64: B is per rank, 64 / ranks).
SIZES = {"reference": lambda world: (8, 256, 384, 6, 6, 256),
         "default": lambda world: (64 // world, 64, 128, 4, 2, 64),
         "tiny": lambda world: (2, 32, 64, 4, 2, 64)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--offload", action="store_true", help="AdamW on the CPU over fp32 copies (ZeRO-Offload's split)")
    ap.add_argument("--tiny", action="store_true", help="a toy size for checking the script on a CPU")
    ap.add_argument("--size", choices=sorted(SIZES), default="reference",
                    help="reference: zinc-bench train-step's GPT; default: configs/default.json's")
    ap.add_argument("--fp32", action="store_true", help="fp32 throughout (no bf16 autocast): zinc-bench train-step --fp32's peer")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    B, T, C, H, L, V = (8, 1024, 1024, 16, 24, 50304) if a.large else (8, 256, 384, 6, 6, 256)
    if a.tiny or a.size != "reference":
        B, T, C, H, L, V = SIZES["tiny" if a.tiny else a.size](1)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    case = "large" if a.large else ("tiny" if a.tiny else a.size)
    if a.model == "llama":
        case = "llama-tiny" if a.tiny else "llama-1.1b"
        B, T, C, H, K, D, I, L, V = LLAMA_SIZES[case]
        model = Llama(V, T, C, H, K, D, I, L).to(dev)
        matmul_params = L * (C * (H + 2 * K) * D + H * D * C + 3 * C * I) + V * C
        flops_per_token = 6 * matmul_params + L * 3 * 2 * 2 * T * H * D
    else:
        model = GPT(V, T, C, H, L).to(dev)
        matmul_params = L * 12 * C * C + V * C
        flops_per_token = 6 * matmul_params + L * 3 * 2 * 2 * T * C
    if a.offload:
        master = [p.detach().to("cpu", copy=True).float() for p in model.parameters()]
        for m in master:
            m.grad = torch.zeros_like(m)
        opt = torch.optim.AdamW(master, lr=3e-4, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                fused=dev.type in ("cuda", "cpu"))  # fused CPU AdamW since PyTorch 2.4
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=not a.fp32)
    g = torch.Generator(device="cpu").manual_seed(1)

    def step():
        for _ in range(a.gas):
            idx = torch.randint(0, V, (B, T + 1), generator=g).to(dev)
            with amp:
                loss = model(idx[:, :-1], idx[:, 1:]) / a.gas
            loss.backward()
        params = list(model.parameters())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if a.offload:
            for p, m in zip(params, master):
                m.grad.copy_(p.grad, non_blocking=False)
            opt.step()
            for p, m in zip(params, master):
                p.data.copy_(m, non_blocking=False)
        else:
            opt.step()
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t = timed_steps(step, a.rounds, a.steps)
    tokens_per_s = B * T * a.gas / t
    line = {"bench": "torch-gpt-peer", "case": case,
            "device": str(dev) + (" " + torch.cuda.get_device_name() if dev.type == "cuda" else ""),
            "torch": torch.__version__, "offload": a.offload, "dtype": "fp32" if a.fp32 else "bf16",
            "threads": torch.get_num_threads(), "tokens_per_s": tokens_per_s,
            "model_tflops": flops_per_token * tokens_per_s / 1e12, "step_s": t,
            "gradient_accumulation_steps": a.gas}
    report(line, f"torch-gpt-peer ({line['case']}, {line['device']}, torch {torch.__version__}, "
                 f"optimizer on {'cpu' if a.offload else a.device}): {tokens_per_s:.0f} tokens/s, "
                 f"{line['model_tflops']:.2f} TFLOP/s model FLOPs, {t:.3f} s/step", a.json)

if __name__ == "__main__":
    main()
