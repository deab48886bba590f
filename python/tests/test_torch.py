"""zinc.torch.CPUAdamW against torch.optim.AdamW / Adam; skipped where torch is not installed."""
import copy

import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: zinc.torch.CPUAdamW needs it (zinc does not)")

import zinc.torch  # noqa: E402

# The C++ tests' tolerance (tests/optim/optim_test.cpp, test_optim.py): a few
# ulps of the update, per element, relative to 1 + |w|.
TOL = 2e-6


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 3))


def groups(model, wd):
    """Two param groups: decay on matrices, none on biases (the usual split)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def assert_close(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        err = (pa.detach().double() - pb.detach().double()).abs()
        bound = TOL * (1 + pb.detach().double().abs())
        assert bool((err <= bound).all()), "%s: max error %g" % (name, float(err.max()))


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_over_100_steps(adamw_mode):
    ours, ref = small_model(), small_model()
    start = copy.deepcopy(list(ref.parameters()))
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    opt = zinc.torch.CPUAdamW(groups(ours, 0.1), adamw_mode=adamw_mode, **kw)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam  # Adam: L2 decay added to the gradient
    ref_opt = ref_cls(groups(ref, 0.1), foreach=False, **kw)
    train(ours, opt, 100)
    train(ref, ref_opt, 100)
    assert_close(ours, ref)
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), start))  # it trained
    for p, q in zip(ours.parameters(), ref.parameters()):
        s, r = opt.state[p], ref_opt.state[q]
        assert int(s["step"]) == int(r["step"]) == 100
        assert torch.allclose(s["exp_avg"], r["exp_avg"], rtol=1e-4, atol=1e-7)
        assert torch.allclose(s["exp_avg_sq"], r["exp_avg_sq"], rtol=1e-4, atol=1e-9)


def test_defaults_are_deepspeeds():
    model = small_model()
    opt = zinc.torch.CPUAdamW(model.parameters())
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0)
    assert d["bias_correction"] and d["adamw_mode"] and not d["amsgrad"] and opt.fp32_optimizer_states
    assert isinstance(opt, torch.optim.Optimizer)


def test_zero_copy_in_place():
    model = small_model()
    opt = zinc.torch.CPUAdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    states = [(id(opt.state[p]["exp_avg"]), opt.state[p]["exp_avg"].data_ptr(), opt.state[p]["exp_avg_sq"].data_ptr())
              for p in params]
    before = [p.detach().clone() for p in params]
    train(model, opt, 5)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert [(id(opt.state[p]["exp_avg"]), opt.state[p]["exp_avg"].data_ptr(), opt.state[p]["exp_avg_sq"].data_ptr())
            for p in params] == states
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # updated where they live


def test_state_dict_round_trip_and_torch_compatibility():
    # 10 steps, save; a fresh optimizer loads it and both run 10 more: bit for bit.
    a = small_model()
    opt_a = zinc.torch.CPUAdamW(groups(a, 0.05), lr=1e-2)
    train(a, opt_a, 10)
    sd = copy.deepcopy(opt_a.state_dict())
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == 10.0
    b = copy.deepcopy(a)
    opt_b = zinc.torch.CPUAdamW(groups(b, 0.05), lr=1e-2)
    opt_b.load_state_dict(sd)
    train(a, opt_a, 10, seed=2)
    train(b, opt_b, 10, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # The same state_dict loads into torch.optim.AdamW, which continues where we left off.
    c = copy.deepcopy(b)
    sd_b = copy.deepcopy(opt_b.state_dict())
    opt_c = torch.optim.AdamW(groups(c, 0.05), lr=1e-2, foreach=False)
    opt_c.load_state_dict(sd_b)
    train(b, opt_b, 10, seed=3)
    train(c, opt_c, 10, seed=3)
    assert_close(b, c)
    # And torch's state_dict loads into ours.
    d = copy.deepcopy(c)
    opt_d = zinc.torch.CPUAdamW(groups(d, 0.05), lr=1e-2)
    opt_d.load_state_dict(copy.deepcopy(opt_c.state_dict()))
    train(c, opt_c, 10, seed=4)
    train(d, opt_d, 10, seed=4)
    assert_close(d, c)


def test_lr_schedule_through_param_groups():
    a, b = small_model(), small_model()
    opt_a = zinc.torch.CPUAdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0, foreach=False)
    sa = torch.optim.lr_scheduler.StepLR(opt_a, step_size=3, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(10):
        x = torch.randn(8, 12, generator=gen)
        for m, o, s in ((a, opt_a, sa), (b, opt_b, sb)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            s.step()
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] < 1e-2
    assert_close(a, b)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        zinc.torch.CPUAdamW(small_model().parameters(), amsgrad=True)
    with pytest.raises(TypeError, match=r"params\[0\] of param group 0 must have dtype torch.float32"):
        zinc.torch.CPUAdamW([torch.zeros(4, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(ValueError, match=r"params\[1\] of param group 0 must be contiguous"):
        zinc.torch.CPUAdamW([torch.zeros(4, requires_grad=True), torch.zeros(4, 3).t().requires_grad_()])
    with pytest.raises(ValueError, match=r"params\[0\] of param group 0 must be on the CPU, got device meta"):
        zinc.torch.CPUAdamW([torch.zeros(4, device="meta", requires_grad=True)])
    with pytest.raises(ValueError, match="param group 0: betas must be"):
        zinc.torch.CPUAdamW(small_model().parameters(), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="param group 0: lr must be a float32 number >= 0"):
        zinc.torch.CPUAdamW(small_model().parameters(), lr=-1.0)
    # Sparse gradients (an Embedding with sparse=True).
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = zinc.torch.CPUAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"the gradient of params\[0\] of param group 0 is sparse"):
        opt.step()
    # A non-contiguous gradient (torch itself refuses a gradient of another dtype).
    p = torch.zeros(3, 4, requires_grad=True)
    opt = zinc.torch.CPUAdamW([p])
    p.grad = torch.ones(4, 3).t()
    with pytest.raises(ValueError, match=r"the gradient of params\[0\] of param group 0 must be contiguous"):
        opt.step()
    p.grad = torch.ones(3, 4)
    with pytest.raises(TypeError, match=r"fp16_param_groups\[0\]\[0\] is torch.float32; expected float16 or bfloat16"):
        opt.step(fp16_param_groups=[[torch.zeros(3, 4)]])
    with pytest.raises(ValueError, match=r"fp16_param_groups\[0\]\[0\] has shape \(4, 3\)"):
        opt.step(fp16_param_groups=[[torch.zeros(4, 3, dtype=torch.float16)]])
    with pytest.raises(ValueError, match=r"fp16_param_groups has 2 groups; the optimizer has 1"):
        opt.step(fp16_param_groups=[[], []])
    assert torch.equal(p, torch.zeros(3, 4))  # nothing was updated by the failed steps


def test_closure_and_params_without_grad():
    model = small_model()
    frozen = torch.zeros(5, requires_grad=True)  # never gets a gradient: skipped, no state
    opt = zinc.torch.CPUAdamW([{"params": list(model.parameters())}, {"params": [frozen]}], lr=1e-2)
    x = torch.randn(4, 12)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and frozen not in opt.state and len(opt.state) == 6


def test_fp16_param_groups_receive_the_updated_parameters():
    # DeepSpeedCPUAdam's copy-out: after each step the 16-bit tensors hold
    # the new float32 parameters rounded to nearest even; a parameter without
    # a gradient leaves its tensor alone.
    torch.manual_seed(3)
    a = torch.randn(7, 5, requires_grad=True)
    b = torch.randn(11, requires_grad=True)
    c = torch.randn(4, requires_grad=True)  # no gradient
    opt = zinc.torch.CPUAdamW([{"params": [a, c]}, {"params": [b], "lr": 0.01}], lr=0.05, weight_decay=0.1)
    ha, hc = torch.zeros(7, 5, dtype=torch.float16), torch.full((4,), 7.0, dtype=torch.float16)
    hb = torch.zeros(11, dtype=torch.bfloat16)
    for _ in range(3):
        a.grad = torch.randn(7, 5)
        b.grad = torch.randn(11)
        opt.step(fp16_param_groups=[[ha, hc], [hb]])
        assert torch.equal(ha, a.detach().half())
        assert torch.equal(hb, b.detach().bfloat16())
        assert torch.equal(hc, torch.full((4,), 7.0, dtype=torch.float16))


def test_a_failed_step_changes_nothing_and_unsupported_settings_are_refused():
    """Every parameter is checked before any is updated: a step that raises (a later group's bad lr, a
    gradient aliasing its parameter, a lazy negation) leaves every parameter, state and step counter as
    it was. maximize=True and settings past float32 are refused naming the group; a torch.optim.Adam
    state's decoupled_weight_decay False becomes L2 decay (adamw_mode False)."""
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = zinc.torch.CPUAdamW([{"params": [a]}, {"params": [b]}], lr=0.1, weight_decay=0.1)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    before = (a.detach().clone(), b.detach().clone(), {k: v.clone() for k, v in opt.state[a].items()})
    for spoil, words in (
            (lambda: opt.param_groups[1].__setitem__("lr", -0.1), "param group 1: lr must be"),
            (lambda: opt.param_groups[1].__setitem__("lr", 1e39), "param group 1: lr must be a float32 number"),
            (lambda: opt.param_groups[1].__setitem__("eps", float("inf")), "param group 1: eps must be"),
            (lambda: opt.param_groups[1].__setitem__("maximize", True), "param group 1: maximize=True"),
            (lambda: setattr(b, "grad", b.detach()), "the parameter and its gradient of params[0] of param group 1"),
            (lambda: setattr(b, "grad", torch.ones(3)._neg_view()), "lazy negation")):
        group = dict(opt.param_groups[1])
        spoil()
        with pytest.raises(ValueError, match=re.escape(words)):
            opt.step()
        opt.param_groups[1].clear()
        opt.param_groups[1].update(group)
        b.grad = torch.ones(3)
        assert torch.equal(a, before[0]) and torch.equal(b, before[1])
        assert all(torch.equal(opt.state[a][k], v) for k, v in before[2].items())
    opt.step()  # and then it steps as before
    assert not torch.equal(a, before[0]) and float(opt.state[a]["step"]) == 2
    # torch.optim.Adam's L2 decay survives a load into CPUAdamW.
    w = torch.ones(3, requires_grad=True)
    adam = torch.optim.Adam([w], lr=0.1, weight_decay=0.5)
    w.grad = torch.ones(3)
    adam.step()
    mine = zinc.torch.CPUAdamW([torch.ones(3, requires_grad=True)])
    mine.load_state_dict(adam.state_dict())
    assert mine.param_groups[0]["adamw_mode"] is False
