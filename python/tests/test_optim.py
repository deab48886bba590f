"""zinc.optim.AdamW: PyTorch's AdamW formula, in place, zero-copy, checked arguments."""
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import zinc.optim


def reference(w, m, v, g, t, lr, b1, b2, eps, wd, adamw, bias_correction):
    """PyTorch's AdamW (adamw=True) / Adam with L2 decay, in float64."""
    if not adamw:
        g = g + wd * w
    m[:] = b1 * m + (1 - b1) * g
    v[:] = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1**t) if bias_correction else m
    vfac = 1 / np.sqrt(1 - b2**t) if bias_correction else 1.0
    if adamw:
        w -= lr * wd * w
    w -= lr * mhat / (np.sqrt(v) * vfac + eps)


def bf16_round(x):
    """float32 -> bf16 bits, round to nearest even (finite values)."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("adamw, bias_correction, wd", [(True, True, 0.1), (False, True, 0.1), (True, False, 0.0),
                                                         (False, False, 0.01)])
def test_matches_the_formula(adamw, bias_correction, wd):
    rng = np.random.default_rng(11)
    n = 1031  # odd: the vector bodies and the scalar tail
    opt = zinc.optim.AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, bias_correction=bias_correction,
                           adamw_mode=adamw)
    w = rng.standard_normal(n).astype(np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    wd64, md, vd = w.astype(np.float64), np.zeros(n), np.zeros(n)
    for t in range(1, 6):
        g = (rng.standard_normal(n) * 0.1).astype(np.float32)
        opt.step(t, w, g, m, v, grad_scale=0.5)
        reference(wd64, md, vd, 0.5 * g.astype(np.float64), t, 1e-2, 0.9, 0.999, 1e-8, wd, adamw, bias_correction)
    # The C++ tests' tolerance (tests/optim/optim_test.cpp): a few ulps of the update.
    err = np.abs(w.astype(np.float64) - wd64)
    assert np.all(err <= 2e-6 * (1 + np.abs(wd64))), err.max()
    assert not np.array_equal(w, wd64.astype(np.float32) * 0)  # it moved


def test_bf16_copy_out_and_bf16_gradients():
    rng = np.random.default_rng(3)
    n = 257
    opt = zinc.optim.AdamW(lr=1e-3, weight_decay=0.01)
    w1 = rng.standard_normal(n).astype(np.float32)
    w2 = w1.copy()
    m1, v1, m2, v2 = (np.zeros(n, np.float32) for _ in range(4))
    out = np.zeros(n, np.uint16)
    g16 = bf16_round(rng.standard_normal(n).astype(np.float32))
    g32 = (g16.astype(np.uint32) << 16).view(np.float32)  # the same values in fp32
    opt.step(1, w1, g16, m1, v1, bf16_out=out)
    opt.step(1, w2, g32, m2, v2)
    assert np.array_equal(w1, w2) and np.array_equal(m1, m2) and np.array_equal(v1, v2)
    assert np.array_equal(out, bf16_round(w1))


def test_zero_copy_and_no_allocation_growth():
    n = 4096
    opt = zinc.optim.AdamW(lr=1e-3)
    arrays = [np.full(n, 1.0, np.float32), np.full(n, 0.1, np.float32), np.zeros(n, np.float32),
              np.zeros(n, np.float32), np.zeros(n, np.uint16)]
    ids = [id(a) for a in arrays]
    addresses = [a.__array_interface__["data"][0] for a in arrays]
    p, g, m, v, out = arrays
    for t in range(1, 11):
        opt.step(t, p, g, m, v, bf16_out=out)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for t in range(11, 1011):
        opt.step(t, p, g, m, v, bf16_out=out)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 4096, grown  # numpy's allocations are traced: no per-step array
    assert [id(a) for a in arrays] == ids
    assert [a.__array_interface__["data"][0] for a in arrays] == addresses
    assert p[0] < 1.0 and out[0] == bf16_round(p[:1])[0]  # updated where they live


def good(n=16):
    return [np.zeros(n, np.float32) for _ in range(4)]


@pytest.mark.parametrize(
    "make, exc, words",
    [
        (lambda: (np.zeros(16, np.float64), *good()[1:]), TypeError, "param must have dtype float32"),
        (lambda: (good()[0], np.zeros(16, np.int32), *good()[2:]), TypeError, "grad must have dtype float32"),
        (lambda: (*good()[:2], [0.0] * 16, good()[3]), TypeError, "exp_avg must be a numpy.ndarray"),
        (lambda: (np.zeros(32, np.float32)[::2], *good()[1:]), ValueError, "param must be C-contiguous"),
        (lambda: (*good()[:3], np.zeros(17, np.float32)), ValueError, "exp_avg_sq has 17 elements; param has 16"),
        # Byte-swapped arrays hold other numbers: refused, not updated.
        (lambda: (np.zeros(16, ">f4"), *good()[1:]), TypeError, "param must have dtype float32 in this machine's byte order"),
        (lambda: (good()[0], np.zeros(16, ">f4"), *good()[2:]), TypeError, "grad must have dtype float32"),
    ],
)
def test_bad_arrays_name_the_argument(make, exc, words):
    opt = zinc.optim.AdamW()
    with pytest.raises(exc) as e:
        opt.step(1, *make())
    assert words in str(e.value)


def test_arrays_of_other_shapes_are_refused_unless_flat():
    """Elements pair in memory order: a transposed grad would pair the wrong ones (refused, naming both
    shapes); a flat buffer of the same size is taken."""
    opt = zinc.optim.AdamW()
    p = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match=re.escape("grad has shape (4, 3); param has (3, 4)")):
        opt.step(1, p, np.ones((4, 3), np.float32), np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32))
    opt.step(1, p, np.ones(12, np.float32), np.zeros(12, np.float32), np.zeros((3, 4), np.float32))


def test_a_child_forked_after_a_parallel_step_steps_on_one_thread():
    """Note [OpenMP across fork]: OpenMP's threads do not survive fork(); a child forked after the parent's
    parallel step once waited for them forever. It now steps on its own thread, with the same result."""
    code = (
        "import os, sys, numpy as np, zinc.optim\n"
        "n = 1 << 20\n"
        "opt = zinc.optim.AdamW(lr=1e-3)\n"
        "arrays = [np.full(n, 0.5, np.float32), np.full(n, 0.25, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)]\n"
        "opt.step(1, *arrays)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    opt.step(2, *arrays)\n"
        "    os._exit(0 if np.all(arrays[0] == arrays[0][0]) else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_read_only_aliasing_and_values():
    opt = zinc.optim.AdamW()
    p, g, m, v = good()
    ro = np.zeros(16, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="exp_avg must be writeable"):
        opt.step(1, p, g, ro, v)
    with pytest.raises(ValueError, match="param and exp_avg share memory"):
        opt.step(1, p, g, p, v)
    big = np.zeros(24, np.float32)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        opt.step(1, p, g, big[:16], big[8:])
    with pytest.raises(ValueError, match="bf16_out"):
        opt.step(1, p, g, m, v, bf16_out=np.zeros(15, np.uint16))
    with pytest.raises(ValueError, match="step must be >= 1"):
        opt.step(0, p, g, m, v)
    with pytest.raises(ValueError, match="betas must be in"):
        zinc.optim.AdamW(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr"):
        opt.lr = -1
    opt.lr = 0.5
    assert opt.lr == 0.5
    assert zinc.optim.isa() in ("scalar", "avx2", "avx512", "avx512_bf16")


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("scale, shown", [(NAN, "nan"), (INF, "inf"), (-INF, "-inf"), (-0.5, "-0.5"),
                                          (1e39, "1e+39")])  # 1e39 is inf as a float32
def test_bad_grad_scale_is_refused_before_anything_is_written(scale, shown):
    # Before the check, grad_scale=nan wrote NaN into every parameter.
    opt = zinc.optim.AdamW(lr=1e-2, weight_decay=0.1)
    rng = np.random.default_rng(5)
    p, g, m, v = (rng.standard_normal(33).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    before = [x.copy() for x in (p, g, m, v)]
    with pytest.raises(ValueError) as e:
        opt.step(1, p, g, m, v, grad_scale=scale)
    assert str(e.value) == ("zinc.optim.AdamW.step: grad_scale must be a finite number >= 0 (a float32), got "
                            + shown)
    for x, y in zip((p, g, m, v), before):
        assert np.array_equal(x, y)
    opt.step(1, p, g, m, v, grad_scale=0.0)  # zero gradients: allowed, a decay-only step
    assert np.all(np.isfinite(p)) and not np.array_equal(p, before[0])


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=NAN), "lr"), (dict(lr=INF), "lr"), (dict(lr=1e39), "lr"),
    (dict(eps=NAN), "eps"), (dict(eps=INF), "eps"),
    (dict(weight_decay=NAN), "weight_decay"), (dict(weight_decay=INF), "weight_decay"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(NAN, 0.9)), "betas"), (dict(betas=(0.9, INF)), "betas"),
])
def test_non_finite_hyperparameters_are_refused_naming_them(kwargs, name):
    with pytest.raises(ValueError, match="zinc.optim.AdamW: " + name + " must be"):
        zinc.optim.AdamW(**kwargs)


@pytest.mark.parametrize("lr", [NAN, INF, -INF, 1e39])
def test_lr_setter_refuses_non_finite(lr):
    opt = zinc.optim.AdamW(lr=0.25)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        opt.lr = lr
    assert opt.lr == 0.25


@pytest.mark.parametrize("call, words", [
    (lambda o, a: zinc.optim.AdamW(lr="0.1"), "zinc.optim.AdamW: lr must be a number, got str"),
    (lambda o, a: zinc.optim.AdamW(eps=None), "zinc.optim.AdamW: eps must be a number, got NoneType"),
    (lambda o, a: zinc.optim.AdamW(betas=(0.9, 0.9, 0.9)), "betas must be a pair of numbers (beta1, beta2), got tuple "
                                                            "of 3 items"),
    (lambda o, a: zinc.optim.AdamW(betas=0.9), "betas must be a pair of numbers (beta1, beta2), got float"),
    (lambda o, a: zinc.optim.AdamW(betas=(0.9, "x")), "betas[1] must be a number, got str"),
    (lambda o, a: zinc.optim.AdamW(adamw_mode=1), "adamw_mode must be True or False, got int"),
    (lambda o, a: o.step(1.5, *a), "zinc.optim.AdamW.step: step must be an int, got float"),
    (lambda o, a: o.step("1", *a), "step must be an int, got str"),
    (lambda o, a: o.step(1, *a, grad_scale="2"), "zinc.optim.AdamW.step: grad_scale must be a number, got str"),
    (lambda o, a: setattr(o, "lr", "x"), "zinc.optim.AdamW: lr must be a number, got str"),
])
def test_scalar_arguments_of_a_wrong_type_are_named(call, words):
    """A wrong type got pybind's "incompatible function arguments" and the whole signature."""
    o = zinc.optim.AdamW(lr=0.5)
    arrays = [np.zeros(4, np.float32) for _ in range(4)]
    with pytest.raises(TypeError) as e:
        call(o, arrays)
    assert str(e.value) == words or words in str(e.value), str(e.value)
    assert "incompatible" not in str(e.value) and o.lr == 0.5


def test_a_number_past_a_floats_range_is_a_value_error():
    with pytest.raises(ValueError, match="lr must be a finite number >= 0 .* got an int past a float's range"):
        zinc.optim.AdamW(lr=10 ** 400)


def test_scalar_arguments_take_what_float_and_index_take():
    o = zinc.optim.AdamW(lr=np.float32(0.5), betas=[0.9, np.float64(0.99)], eps=1, weight_decay=0,
                         bias_correction=np.bool_(True), adamw_mode=False)
    assert (o.lr, o.betas, o.eps, o.bias_correction, o.adamw_mode) == (0.5, (0.9, 0.99), 1.0, True, False)
    p, g, m, v = (np.full(4, 1.0, np.float32) for _ in range(4))
    o.step(np.int64(1), p, g, m, v, grad_scale=np.float32(1))
    o.lr = 1
    assert o.lr == 1.0


def test_import_zinc_does_not_import_torch():
    # zinc does not depend on torch: only zinc.torch imports it.
    code = "import sys, zinc, zinc.optim; assert 'torch' not in sys.modules, 'zinc imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
