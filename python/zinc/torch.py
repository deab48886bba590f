"""zinc.torch: zinc's CPU AdamW as a torch.optim.Optimizer (importable where torch is).

    import zinc.torch
    opt = zinc.torch.CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loss.backward(); opt.step(); opt.zero_grad()

CPUAdamW takes DeepSpeedCPUAdam's constructor arguments and follows its
semantics (PyTorch's AdamW with adamw_mode=True, Adam with L2 decay with
adamw_mode=False), and keeps torch's optimizer conventions: param groups,
state "exp_avg", "exp_avg_sq" and "step" per parameter, state_dict and
load_state_dict (a state_dict loads into torch.optim.AdamW and back). The
update runs zinc's kernels (zinc.optim.AdamW: vectorised, threaded, the GIL
released) directly on the tensors' memory: tensor.numpy() of a CPU tensor
shares its storage, so nothing is copied.

zinc does not depend on torch: `import zinc` never imports it, and importing
zinc.torch without torch raises ImportError.
"""

import numbers

import numpy as np

import torch  # the top-level torch (absolute import), not this module

from . import optim as _optim

__all__ = ["CPUAdamW"]

_NAME = "zinc.torch.CPUAdamW"


def _check_tensor(t, what):
    """A CPU, dense, C-contiguous float32 tensor, or an exception naming `what`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: %s must be a torch.Tensor, got %s" % (_NAME, what, type(t).__name__))
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError("%s: %s is sparse (layout %s); only dense tensors are supported" % (_NAME, what, t.layout))
    if t.device.type != "cpu":
        raise ValueError("%s: %s must be on the CPU, got device %s (use torch.optim.AdamW for device tensors)" %
                         (_NAME, what, t.device))
    if t.dtype != torch.float32:
        raise TypeError("%s: %s must have dtype torch.float32, got %s" % (_NAME, what, t.dtype))
    if not t.is_contiguous():
        raise ValueError("%s: %s must be contiguous (the update works in place on its memory; "
                         "a contiguous copy would not be the parameter)" % (_NAME, what))


def _array(t):
    """The tensor's memory as a NumPy array (shared, no copy)."""
    return t.detach().numpy()


class CPUAdamW(torch.optim.Optimizer):
    """AdamW on CPU float32 tensors with zinc's kernels; DeepSpeedCPUAdam's arguments.

    model_params: an iterable of tensors or of param-group dicts.
    lr, betas, eps, weight_decay: as in torch.optim.AdamW (weight_decay
        defaults to 0, as in DeepSpeedCPUAdam).
    bias_correction: divide the moments by 1 - beta^step (False: do not).
    amsgrad: must be False (True raises ValueError: not supported, as in
        DeepSpeedCPUAdam).
    adamw_mode: True: decoupled decay (torch.optim.AdamW); False: L2 decay
        added to the gradient (torch.optim.Adam's weight_decay).
    fp32_optimizer_states: accepted for DeepSpeedCPUAdam's signature; the
        parameters are float32, so the states are float32 either way.

    Parameters and gradients must be dense, contiguous float32 tensors on the
    CPU; anything else raises TypeError or ValueError naming the parameter
    (or its gradient), as do maximize=True and settings past float32. All is
    checked before anything is updated: a step that raises changes nothing. Each group's lr, betas, eps, weight_decay,
    bias_correction and adamw_mode may be changed between steps (schedulers
    set group["lr"]).
    """

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        amsgrad=amsgrad, adamw_mode=adamw_mode)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        super().__init__(model_params, defaults)

    def add_param_group(self, param_group):
        """Adds a group (torch's rules), checking its parameters and settings."""
        super().add_param_group(param_group)
        g = len(self.param_groups) - 1
        group = self.param_groups[g]
        _check_group(group, g)
        for i, p in enumerate(group["params"]):
            _check_tensor(p, "params[%d] of param group %d" % (i, g))

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            # A torch.optim.Adam or AdamW group says its decay by decoupled_weight_decay (Adam's L2 is
            # adamw_mode False here); taken over where the group has no adamw_mode of its own.
            if "adamw_mode" not in group and "decoupled_weight_decay" in group:
                group["adamw_mode"] = bool(group["decoupled_weight_decay"])
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One update of every parameter that has a gradient; returns closure()'s loss.

        closure: re-evaluates the model and returns the loss (run with grad
        enabled before the update). fp16_param_groups: as DeepSpeedCPUAdam's,
        a list per param group of 16-bit tensors (float16 or bfloat16, on any
        device), indexed like the group's params; each updated parameter is
        copied into its tensor (rounded to nearest even).
        """
        if fp16_param_groups is not None:
            _check_fp16_groups(fp16_param_groups, self.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Everything is checked before anything changes: a step that raises leaves every parameter, state
        # and step counter as it was (a retry does not update the earlier groups twice).
        jobs = []
        for g, group in enumerate(self.param_groups):
            _check_group(group, g)
            beta1, beta2 = group["betas"]
            kernel = _optim.AdamW(lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
                                  weight_decay=float(group["weight_decay"]),
                                  bias_correction=bool(group["bias_correction"]), adamw_mode=bool(group["adamw_mode"]))
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                what = "params[%d] of param group %d" % (i, g)
                _check_tensor(p, what)
                _check_tensor(p.grad, "the gradient of " + what)
                if p.grad.shape != p.shape:
                    raise ValueError("%s: the gradient of %s has shape %s; the parameter has %s" %
                                     (_NAME, what, tuple(p.grad.shape), tuple(p.shape)))
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                for key in ("exp_avg", "exp_avg_sq"):
                    st = state[key]
                    if st.dtype != torch.float32 or st.device.type != "cpu" or not st.is_contiguous():
                        # Loaded from a state_dict in another form: made ours once, then updated in place.
                        state[key] = st = st.to(device="cpu", dtype=torch.float32).contiguous()
                    if st.shape != p.shape:
                        raise ValueError("%s: state %r of %s has shape %s; the parameter has %s" %
                                         (_NAME, key, what, tuple(st.shape), tuple(p.shape)))
                arrays = []
                for t, name in ((p, "it"), (p.grad, "its gradient"), (state["exp_avg"], "its exp_avg"),
                                (state["exp_avg_sq"], "its exp_avg_sq")):
                    if t.is_neg() or t.is_conj():
                        raise ValueError("%s: %s of %s is a lazy negation or conjugate view (resolve_neg() it)" %
                                         (_NAME, name, what))
                    arrays.append(_array(t))
                names = ("the parameter", "its gradient", "its exp_avg", "its exp_avg_sq")
                for x in range(4):
                    for y in range(x + 1, 4):
                        if np.shares_memory(arrays[x], arrays[y]):
                            raise ValueError("%s: %s and %s of %s share memory; the update needs them apart" %
                                             (_NAME, names[x], names[y], what))
                jobs.append((kernel, g, i, p, state, arrays))
        for kernel, g, i, p, state, arrays in jobs:
            # torch keeps "step" as a float32 tensor (DeepSpeed as an int): both are read.
            step = state["step"]
            t = int(step.item() if isinstance(step, torch.Tensor) else step) + 1
            kernel.step(t, *arrays)
            if isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.dim() == 0:
                step.fill_(t)
            else:
                state["step"] = torch.tensor(float(t), dtype=torch.float32)
            if fp16_param_groups is not None:
                fp16_param_groups[g][i].copy_(p)
        return loss


def _check_fp16_groups(groups, param_groups):
    """fp16_param_groups[g][i] must be a 16-bit tensor shaped like param_groups[g]["params"][i]."""
    if len(groups) != len(param_groups):
        raise ValueError("%s.step: fp16_param_groups has %d groups; the optimizer has %d" %
                         (_NAME, len(groups), len(param_groups)))
    for g, (half, group) in enumerate(zip(groups, param_groups)):
        if len(half) != len(group["params"]):
            raise ValueError("%s.step: fp16_param_groups[%d] has %d tensors; param group %d has %d parameters" %
                             (_NAME, g, len(half), g, len(group["params"])))
        for i, (h, p) in enumerate(zip(half, group["params"])):
            what = "fp16_param_groups[%d][%d]" % (g, i)
            if not isinstance(h, torch.Tensor):
                raise TypeError("%s.step: %s is a %s, not a tensor" % (_NAME, what, type(h).__name__))
            if h.dtype not in (torch.float16, torch.bfloat16):
                raise TypeError("%s.step: %s is %s; expected float16 or bfloat16" % (_NAME, what, h.dtype))
            if h.shape != p.shape:
                raise ValueError("%s.step: %s has shape %s; params[%d] of param group %d has %s" %
                                 (_NAME, what, tuple(h.shape), i, g, tuple(p.shape)))


_FP32_MAX = 3.4028234663852886e38


def _check_group(group, g):
    where = "%s: param group %d" % (_NAME, g)
    if group.get("amsgrad", False):
        raise ValueError("%s: amsgrad=True is not supported (nor is it by DeepSpeedCPUAdam); "
                         "use torch.optim.AdamW(amsgrad=True)" % where)
    if group.get("maximize", False):
        raise ValueError("%s: maximize=True is not supported (DeepSpeedCPUAdam ignores it and descends); "
                         "minimize the negated loss, or use torch.optim.AdamW(maximize=True)" % where)
    lr = group["lr"]
    lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
    if not 0 <= lr <= _FP32_MAX:
        raise ValueError("%s: lr must be a float32 number >= 0, got %r" % (where, lr))
    betas = group["betas"]
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2 or
            not all(isinstance(b, numbers.Real) and 0 <= b < 1 for b in betas)):
        raise ValueError("%s: betas must be two numbers in [0, 1), got %r" % (where, betas))
    for key in ("eps", "weight_decay"):
        if not 0 <= float(group[key]) <= _FP32_MAX:
            raise ValueError("%s: %s must be a float32 number >= 0, got %r" % (where, key, group[key]))
