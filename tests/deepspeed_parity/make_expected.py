#!/usr/bin/env python3
"""Writes tests/deepspeed_parity/expected.json: what the real DeepSpeed computes
for the learning-rate schedules, the batch triad, the dynamic loss scaler and
Adam/AdamW, for parity_test.cpp to compare zinc against (issue 32).

Run with the Python that has DeepSpeed (bench/peers/setup.sh pins the
version), no network needed:

    DS_ACCELERATOR=cpu /tmp/peervenv/bin/python tests/deepspeed_parity/make_expected.py

Every value comes from DeepSpeed's own code, driven the way its engine drives
it; nothing here restates a formula.

Step alignment of the schedules (Note [schedule step alignment] in the JSON):
DeepSpeed's engine calls optimizer.step() and then lr_scheduler.step() for
every applied step (runtime/engine.py, _take_model_step), so its optimizer
step k (k = 0 first) runs with the scheduler at last_batch_iteration = k - 1:
step 0 at the value the scheduler's constructor set (last_batch_iteration
-1, recorded as "lr_before_first_step"), step k >= 1 at the value after k
scheduler.step() calls. zinc's LrSchedule::lr_at(s) is documented as
DeepSpeed's value at last_batch_iteration = s and zinc's optimizer step s
uses lr_at(s) (engine/engine.cpp): zinc runs one scheduler position ahead of
DeepSpeed's engine. "lr"[s] below is the value at last_batch_iteration = s
(read from the optimizer's param group, which is what DeepSpeed's engine
steps with, one optimizer step later), so zinc's lr_at(s) must equal
"lr"[s].
"""
import copy
import json
import math
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm  # noqa: E402
from deepspeed.runtime import lr_schedules  # noqa: E402
from deepspeed.runtime import config as ds_config_module  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler  # noqa: E402
from deepspeed.runtime.precision_config import get_float16_config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "expected.json")


class FakeDist:
    """Stands in for deepspeed.comm where DeepSpeed asks for the rank and the
    world size: no process group is started. DeepSpeedConfig.__init__ reads
    dist.get_rank() and then (no mpu, no mesh) dist.get_world_size() for its
    data-parallel size; DynamicLossScaler.update_scale asks dist.get_rank()
    before logging an overflow."""

    def __init__(self, world_size):
        self.world_size = world_size

    def get_rank(self):
        return 0

    def get_world_size(self, group=None):
        return self.world_size


# ---- schedules ---------------------------------------------------------------

def schedule_case(name, typ, params, base_lr, steps):
    """Drives DeepSpeed's scheduler class `typ` exactly as the engine does:
    built from the config's params over a real torch optimizer (engine.py
    _scheduler_from_config: scheduler(optimizer, **scheduler_params)), then per
    applied step optimizer.step() followed by scheduler.step()."""
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([w], lr=base_lr, betas=(0.9, 0.999))
    sched = getattr(lr_schedules, typ)(opt, **copy.deepcopy(params))
    group = opt.param_groups[0]
    engine_lr, engine_betas = [], []
    for _ in range(steps + 1):
        engine_lr.append(float(group["lr"]))  # what this optimizer.step() uses
        engine_betas.append([float(b) for b in group["betas"]])
        w.grad = torch.zeros_like(w)
        opt.step()
        sched.step()
    case = {
        "name": name,
        "type": typ,
        "params": params,
        "optimizer_lr": base_lr,
        "steps": steps,
        "lr_before_first_step": engine_lr[0],
        # lr[s]: last_batch_iteration = s (zinc's lr_at(s)).
        "lr": engine_lr[1:],
    }
    cycles_momentum = typ == "OneCycle" and params.get("cycle_momentum", True)
    if cycles_momentum:
        case["betas_before_first_step"] = engine_betas[0]
        case["beta1"] = [b[0] for b in engine_betas[1:]]
        case["beta2"] = [b[1] for b in engine_betas[1:]]
    return case


def schedules():
    cases = []
    for wt in ("log", "linear"):
        cases.append(schedule_case(f"WarmupLR_{wt}", "WarmupLR",
                                   {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 20,
                                    "warmup_type": wt}, 1e-3, 60))
        cases.append(schedule_case(f"WarmupDecayLR_{wt}", "WarmupDecayLR",
                                   {"warmup_min_lr": 2e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 15,
                                    "warmup_type": wt, "total_num_steps": 70}, 1e-3, 90))
        cases.append(schedule_case(f"WarmupCosineLR_{wt}", "WarmupCosineLR",
                                   {"warmup_min_ratio": 0.05, "warmup_num_steps": 12, "cos_min_ratio": 0.02,
                                    "warmup_type": wt, "total_num_steps": 80}, 6e-4, 100))
    # warmup_num_steps 1: DeepSpeed warms up over max(2, n) steps.
    cases.append(schedule_case("WarmupLR_one_warmup_step", "WarmupLR",
                               {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 1}, 1e-3, 8))
    # total_num_steps below warmup_num_steps: straight to the floor after warmup.
    cases.append(schedule_case("WarmupDecayLR_total_below_warmup", "WarmupDecayLR",
                               {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10,
                                "total_num_steps": 6, "warmup_type": "linear"}, 1e-3, 20))
    cases.append(schedule_case("WarmupCosineLR_total_below_warmup", "WarmupCosineLR",
                               {"warmup_num_steps": 10, "total_num_steps": 6, "warmup_type": "linear"}, 1e-3, 20))
    # DeepSpeed's defaults (only the required keys given).
    cases.append(schedule_case("WarmupDecayLR_defaults", "WarmupDecayLR", {"total_num_steps": 1500}, 1e-3, 1600))
    cases.append(schedule_case("WarmupCosineLR_defaults", "WarmupCosineLR", {"total_num_steps": 1500}, 2e-3, 1600))
    # WarmupLR without warmup_max_lr: DeepSpeed 0.19 warms up to the optimizer's lr.
    cases.append(schedule_case("WarmupLR_max_lr_from_optimizer", "WarmupLR",
                               {"warmup_min_lr": 0.0, "warmup_num_steps": 10, "warmup_type": "linear"}, 4e-3, 20))

    one = {"cycle_min_lr": 1e-4, "cycle_max_lr": 2e-3}
    cases.append(schedule_case("OneCycle_plain", "OneCycle",
                               dict(one, cycle_first_step_size=20, cycle_momentum=False), 1e-3, 80))
    cases.append(schedule_case("OneCycle_uneven_halves_momentum", "OneCycle",
                               dict(one, cycle_first_step_size=12, cycle_second_step_size=28,
                                    cycle_min_mom=0.85, cycle_max_mom=0.95), 1e-3, 90))
    cases.append(schedule_case("OneCycle_decay_lr_and_mom", "OneCycle",
                               dict(one, cycle_first_step_size=15, cycle_second_step_size=25, decay_step_size=7,
                                    decay_lr_rate=0.3, decay_mom_rate=0.01, cycle_min_mom=0.8,
                                    cycle_max_mom=0.9), 1e-3, 120))
    cases.append(schedule_case("OneCycle_decay_step_without_rate", "OneCycle",
                               dict(one, cycle_first_step_size=10, decay_step_size=5), 1e-3, 60))
    cases.append(schedule_case("OneCycle_stairs_first_only", "OneCycle",
                               dict(one, cycle_first_step_size=20, cycle_first_stair_count=4), 1e-3, 80))
    cases.append(schedule_case("OneCycle_stairs_both_uneven", "OneCycle",
                               dict(one, cycle_first_step_size=18, cycle_second_step_size=30,
                                    cycle_first_stair_count=3, cycle_second_stair_count=5, decay_step_size=6,
                                    decay_lr_rate=0.2, decay_mom_rate=0.005), 1e-3, 120))
    cases.append(schedule_case("OneCycle_stairs_second_only", "OneCycle",
                               dict(one, cycle_first_step_size=16, cycle_second_step_size=24,
                                    cycle_first_stair_count=0, cycle_second_stair_count=6,
                                    cycle_momentum=False), 1e-3, 70))
    cases.append(schedule_case("OneCycle_stairs_uneven_division", "OneCycle",
                               dict(one, cycle_first_step_size=7, cycle_second_step_size=11,
                                    cycle_first_stair_count=3, cycle_second_stair_count=4), 1e-3, 60))
    # A second half of 0 steps, which DeepSpeed 0.19 allows (non-negative): a sawtooth.
    cases.append(schedule_case("OneCycle_second_step_size_zero", "OneCycle",
                               dict(one, cycle_first_step_size=6, cycle_second_step_size=0,
                                    cycle_momentum=False), 1e-3, 20))
    return cases


# ---- batch triad -----------------------------------------------------------

# DeepSpeed's own cases (tests/unit/runtime/test_ds_config_dict.py,
# TestBatchConfig: (batch, micro_batch, gas) at world size 2, each with several
# of the three given), here with every non-empty subset given and at world
# sizes 1, 2 and 4, plus a few more triples.
BATCH_TRIPLES = [(32, 16, 1), (32, 8, 2), (33, 17, 2), (32, 18, 1), (64, 4, 4), (24, 3, 2), (6, 5, 1)]
SUBSETS = [("b", "m", "g"), ("b", "m"), ("b", "g"), ("m", "g"), ("b",), ("m",), ("g",)]
KEYS = {"b": "train_batch_size", "m": "train_micro_batch_size_per_gpu", "g": "gradient_accumulation_steps"}


def batch_case(cfg, world):
    """DeepSpeedConfig(cfg) with its data-parallel size read from the fake
    dist (see FakeDist): the constructor resolves the triad
    (_set_batch_related_parameters) and asserts it (_batch_assertion)."""
    saved = ds_config_module.dist
    ds_config_module.dist = FakeDist(world)
    try:
        c = DeepSpeedConfig(copy.deepcopy(cfg))
        assert c.world_size == world, (c.world_size, world)
        return {"resolved": [c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps]}
    except AssertionError as e:
        return {"refused": str(e).splitlines()[0][:160] if str(e) else "AssertionError"}
    finally:
        ds_config_module.dist = saved


def batches():
    cases, seen = [], set()
    for world in (1, 2, 4):
        for triple in BATCH_TRIPLES:
            for subset in SUBSETS:
                cfg = {KEYS[k]: v for k, v in zip("bmg", triple) if k in subset}
                key = (world, json.dumps(cfg, sort_keys=True))
                if key in seen:
                    continue
                seen.add(key)
                cases.append(dict({"world_size": world, "config": cfg}, **batch_case(cfg, world)))
        cases.append(dict({"world_size": world, "config": {}}, **batch_case({}, world)))
    return cases


# ---- dynamic loss scaler ---------------------------------------------------

# A fixed pattern of overflow (1) and clean (0) steps: bursts, isolated
# overflows, long clean runs that pass several windows.
PATTERN = ([1, 1, 1] + [0] * 5 + [1] + [0] * 9 + [1, 0, 1, 0, 0, 1, 1] + [0] * 13 + [1, 1, 0, 1] + [0] * 8 +
           [1] * 2 + [0] * 3 + [1, 0, 0, 0])

SCALER_SETTINGS = [
    ("defaults_window4", {"initial_scale_power": 16, "loss_scale_window": 4}),
    ("window1_hysteresis1", {"initial_scale_power": 8, "loss_scale_window": 1, "hysteresis": 1}),
    ("hysteresis3", {"initial_scale_power": 12, "loss_scale_window": 5, "hysteresis": 3}),
    ("consecutive_hysteresis", {"initial_scale_power": 10, "loss_scale_window": 3, "hysteresis": 2,
                                "consecutive_hysteresis": True}),
    ("min_scale_floor", {"initial_scale_power": 4, "loss_scale_window": 6, "hysteresis": 1,
                         "min_loss_scale": 2}),
    ("raises_at_min", {"initial_scale_power": 2, "loss_scale_window": 100, "hysteresis": 1,
                       "min_loss_scale": 1}),
]


def scaler_case(name, fp16):
    fp16 = dict({"enabled": True, "loss_scale": 0}, **fp16)
    args = get_float16_config({"fp16": fp16}).dynamic_loss_scale_args()
    saved = ds_loss_scaler.dist
    ds_loss_scaler.dist = FakeDist(1)
    try:
        s = ds_loss_scaler.CreateLossScaler(torch.half, 0, True, args)
        steps = []
        for overflow in PATTERN:
            before = float(s.cur_scale)
            try:
                s.update_scale(bool(overflow))
            except Exception as e:  # DeepSpeed raises at min_loss_scale
                steps.append({"overflow": bool(overflow), "scale_before": before, "skipped": True, "raises": True})
                break
            steps.append({"overflow": bool(overflow), "scale_before": before, "skipped": bool(overflow),
                          "scale_after": float(s.cur_scale)})
    finally:
        ds_loss_scaler.dist = saved
    return {"name": name, "fp16": fp16, "dynamic_loss_scale_args": args, "steps": steps}


# ---- Adam / AdamW ------------------------------------------------------------

N_PARAMS = 37
ADAM_STEPS = 5


def f32(x):
    return float(torch.tensor(x, dtype=torch.float32).item())


def adam_inputs():
    w0 = [f32(math.sin(0.7 * i + 0.3) * 0.8) for i in range(N_PARAMS)]
    grads = [[f32(math.cos(0.37 * i + 1.1 * t) * 0.05 * (1 + 0.1 * t)) for i in range(N_PARAMS)]
             for t in range(1, ADAM_STEPS + 1)]
    return w0, grads


def cpu_adam_class():
    """DeepSpeedCPUAdam where its extension builds (JIT, ninja), else None."""
    if os.environ.get("ZINC_PARITY_TORCH_ADAM"):
        return None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        p = torch.nn.Parameter(torch.zeros(2))
        o = DeepSpeedCPUAdam([p], lr=1e-3)
        p.grad = torch.ones(2)
        o.step()
        return DeepSpeedCPUAdam
    except Exception as e:  # no compiler, no ninja, ...
        print(f"DeepSpeedCPUAdam unavailable ({type(e).__name__}: {e}); using torch.optim", file=sys.stderr)
        return None


def adam_case(cls, name, adamw_mode, bias_correction, weight_decay, w0, grads):
    lr, betas, eps = 1e-2, (0.9, 0.999), 1e-8
    w = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    if cls is not None:
        opt = cls([w], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                  adamw_mode=adamw_mode)
        impl = "deepspeed.ops.adam.DeepSpeedCPUAdam"
    else:
        if not bias_correction:
            return None  # torch's Adam/AdamW always correct the bias
        tcls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        opt = tcls([w], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        impl = f"torch.optim.{tcls.__name__}"
    after = []
    for g in grads:
        w.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        after.append([float(x) for x in w.detach().tolist()])
    return {"name": name, "implementation": impl, "lr": lr, "betas": list(betas), "eps": eps,
            "weight_decay": weight_decay, "adam_w_mode": adamw_mode, "bias_correction": bias_correction,
            "params_after_step": after}


def adams():
    cls = cpu_adam_class()
    w0, grads = adam_inputs()
    cases = []
    for adamw in (True, False):
        for bc in (True, False):
            for wd in (0.0, 0.1):
                mode = "adamw" if adamw else "adam_l2"
                c = adam_case(cls, f"{mode}_bc{int(bc)}_wd{wd}", adamw, bc, wd, w0, grads)
                if c is not None:
                    cases.append(c)
    return {"initial_params": w0, "grads": grads, "cases": cases}


def main():
    doc = {
        "generated_by": "tests/deepspeed_parity/make_expected.py",
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "step_alignment": (
            "lr[s], beta1[s], beta2[s]: DeepSpeed's scheduler at last_batch_iteration = s, i.e. after s + 1 "
            "scheduler.step() calls, read from the optimizer's param group. DeepSpeed's engine runs optimizer "
            "step k with the value after k scheduler.step() calls (optimizer.step() then lr_scheduler.step(), "
            "runtime/engine.py _take_model_step): step 0 with lr_before_first_step, step k >= 1 with lr[k - 1]. "
            "zinc's optimizer step s uses LrSchedule::lr_at(s) == lr[s]: one scheduler position ahead of "
            "DeepSpeed's engine."),
        "schedules": schedules(),
        "batch": batches(),
        "loss_scaler": {"pattern": PATTERN, "cases": [scaler_case(n, f) for n, f in SCALER_SETTINGS]},
        "adam": adams(),
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes): {len(doc['schedules'])} schedules, "
          f"{len(doc['batch'])} batch cases, {len(doc['loss_scaler']['cases'])} scaler settings, "
          f"{len(doc['adam']['cases'])} Adam cases ({doc['adam']['cases'][0]['implementation']})")


if __name__ == "__main__":
    main()
