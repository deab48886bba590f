#!/usr/bin/env python3
"""What DeepSpeed itself says about each real config in this folder.

Run with a Python that has DeepSpeed (0.19.8 when deepspeed_accepts.json was
written), CPU torch and transformers:

    DS_ACCELERATOR=cpu /tmp/peervenv/bin/python tests/configs/real/deepspeed_accepts.py \
        > tests/configs/real/deepspeed_accepts.json

For every config (each *.json here except expect.json and this script's own
output) and each world size 1 and 2 it builds DeepSpeed's own
`deepspeed.runtime.config.DeepSpeedConfig` and records "accepted" with the
resolved batch triad, or "refused" with DeepSpeed's message, shortened.

The world size.  DeepSpeedConfig.__init__ asks `deepspeed.comm` for it:
`dist.get_rank()` and then, with no mpu and no mesh_device (the Hugging Face
Trainer's and Accelerate's path), `dist.get_world_size()` (divided by a
top-level `sequence_parallel_size` when the config has one); if those raise
(no process group) it falls back to world size 1.  No process group is
started here: for the duration of each parse, `deepspeed.comm.get_rank` is
replaced by one returning 0 and `deepspeed.comm.get_world_size` by one
returning the world size under test.  Nothing else is faked; the parse is
DeepSpeed's own code from the installed package.

"auto" values.  A config with "auto" anywhere is written for the Hugging Face
Trainer, which fills it before DeepSpeed sees it.  Such configs go through
transformers' own `HfTrainerDeepSpeedConfig.trainer_config_process` and
`trainer_config_finalize` (transformers.integrations.deepspeed, the installed
version), called on a shim: transformers inherits the small accessors
(find_config_node, get_value, is_true, is_zero3) from Accelerate's
HfDeepSpeedConfig, which is not installed, so the shim carries equivalents of
those four and nothing else.  The TrainingArguments are a namespace with
transformers' defaults (per_device_train_batch_size 8,
gradient_accumulation_steps 1, learning_rate 5e-5, adam betas 0.9/0.999,
adam_epsilon 1e-8, weight_decay 0, warmup_steps 0, max_grad_norm 1.0, fp16 and
bf16 off, save_on_each_node off), except where the config states a concrete
value for the same setting: the Trainer refuses a config that disagrees with
its arguments ("Please correct the following DeepSpeed config values that
mismatch TrainingArguments"), so a user of that config sets the argument to
match (a concrete micro-batch, accumulation, gradient_clipping, optimizer lr,
betas, eps or weight_decay, `fp16.enabled: true`, `bf16.enabled: true`).
Any mismatch left after that is recorded under "hf_mismatches" (the Trainer
would refuse the config; DeepSpeed's verdict is still recorded).  The model
for the hidden-size-based "auto" buckets has hidden_size 64 (the model
tests/tools/real_configs_test.sh trains), and num_training_steps is 100.
Note that transformers fills `bf16.enabled` only: a `bfloat16` section's
"auto" (DeepSpeed's older spelling of `bf16`) reaches DeepSpeed unfilled, and
DeepSpeed's config models drop any "auto" value they are given (the field
keeps its default), so DeepSpeed reads it as bf16 off.  "precision" records
what DeepSpeed resolved (bf16, fp16 or fp32), "zero_stage" the ZeRO stage.
"""
import copy
import io
import json
import logging
import math
import os
import sys
import types
from contextlib import redirect_stderr, redirect_stdout

os.environ.setdefault("DS_ACCELERATOR", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = {"expect.json", "deepspeed_accepts.json"}
WORLD_SIZES = (1, 2)
HIDDEN_SIZE = 64
NUM_TRAINING_STEPS = 100


def has_auto(v):
    if isinstance(v, dict):
        return any(has_auto(x) for x in v.values())
    if isinstance(v, list):
        return any(has_auto(x) for x in v)
    return v == "auto"


def get(d, dotted):
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def concrete(v):
    return v is not None and v != "auto"


def training_args(cfg, world_size):
    """TrainingArguments defaults, matched to the config's concrete values."""
    a = types.SimpleNamespace(
        world_size=world_size, per_device_train_batch_size=8, gradient_accumulation_steps=1,
        max_grad_norm=1.0, learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        weight_decay=0.0, warmup_steps=0, save_on_each_node=False,
        fp16=False, bf16=False, fp16_full_eval=False, bf16_full_eval=False)
    a.get_warmup_steps = lambda n: int(a.warmup_steps) if a.warmup_steps >= 1 else math.ceil(n * a.warmup_steps)
    for key, attr in (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("gradient_clipping", "max_grad_norm"),
                      ("optimizer.params.lr", "learning_rate"),
                      ("optimizer.params.eps", "adam_epsilon"),
                      ("optimizer.params.weight_decay", "weight_decay")):
        v = get(cfg, key)
        if concrete(v) and isinstance(v, (int, float)) and not isinstance(v, bool):
            setattr(a, attr, v)
    betas = get(cfg, "optimizer.params.betas")
    if concrete(betas) and isinstance(betas, list) and len(betas) == 2:
        a.adam_beta1, a.adam_beta2 = betas
    a.fp16 = get(cfg, "fp16.enabled") is True
    a.bf16 = get(cfg, "bf16.enabled") is True
    return a


def hf_fill(cfg, world_size):
    """The Hugging Face Trainer's filling of "auto", by transformers' own code."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class Shim(HfTrainerDeepSpeedConfig):
        # Accelerate's HfDeepSpeedConfig accessors, which transformers inherits.
        def __init__(self, config):
            self.config = config
            self._dtype = None
            self.mismatches = []

        def find_config_node(self, ds_key_long):
            config = self.config
            nodes = ds_key_long.split(".")
            ds_key = nodes.pop()
            for node in nodes:
                config = config.get(node)
                if config is None:
                    return None, ds_key
            return config, ds_key

        def get_value(self, ds_key_long, default=None):
            config, ds_key = self.find_config_node(ds_key_long)
            if config is None:
                return default
            return config.get(ds_key, default)

        def is_true(self, ds_key_long):
            value = self.get_value(ds_key_long)
            return False if value is None else bool(value)

        def is_zero3(self):
            return self.get_value("zero_optimization.stage", -1) == 3

    shim = Shim(copy.deepcopy(cfg))
    args = training_args(cfg, world_size)
    shim.trainer_config_process(args)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=HIDDEN_SIZE))
    mismatches = list(shim.mismatches)
    shim.mismatches = []
    try:
        shim.trainer_config_finalize(args, model, NUM_TRAINING_STEPS)
    except ValueError:
        pass  # the mismatches, recorded below
    mismatches += shim.mismatches
    return shim.config, [m.lstrip("- ") for m in mismatches]


def shorten(e):
    msg = " ".join(str(e).split())
    if not msg:
        msg = type(e).__name__
    # pydantic's messages end with a documentation link; keep the substance.
    msg = msg.split(" For further information visit")[0]
    return (type(e).__name__ + ": " + msg)[:300]


def ds_verdict(cfg, world_size):
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda group=None: 0
    dist.get_world_size = lambda group=None: world_size
    try:
        sink = io.StringIO()
        with redirect_stdout(sink), redirect_stderr(sink):
            c = DeepSpeedConfig(copy.deepcopy(cfg))
        return {"verdict": "accepted",
                "triad": [c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps],
                "precision": "bf16" if c.bfloat16_config.enabled else "fp16" if c.float16_config.enabled else "fp32",
                "zero_stage": int(c.zero_optimization_stage)}
    except Exception as e:  # DeepSpeed refuses with AssertionError, ValueError, pydantic errors...
        return {"verdict": "refused", "error": shorten(e)}
    finally:
        dist.get_rank, dist.get_world_size = saved


def main():
    import deepspeed
    import transformers
    logging.disable(logging.WARNING)
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.ERROR)
    out = {"_about": "DeepSpeed's own DeepSpeedConfig on each real config at world sizes 1 and 2, "
                     "\"auto\" filled by transformers' HfTrainerDeepSpeedConfig first; written by "
                     "deepspeed_accepts.py (see its docstring for how the world size is set and "
                     "how \"auto\" is resolved). triad: [train_batch_size, "
                     "train_micro_batch_size_per_gpu, gradient_accumulation_steps]; precision: what "
                     "DeepSpeed resolved.",
           "_versions": {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__}}
    for name in sorted(os.listdir(HERE)):
        if not name.endswith(".json") or name in SKIP:
            continue
        with open(os.path.join(HERE, name)) as f:
            cfg = json.load(f)
        entry = {"hf_auto": has_auto(cfg)}
        for ws in WORLD_SIZES:
            c = cfg
            r = {}
            if entry["hf_auto"]:
                c, mism = hf_fill(cfg, ws)
                if mism:
                    r["hf_mismatches"] = mism
            r.update(ds_verdict(c, ws))
            entry[str(ws)] = r
        out[name] = entry
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
