"""The Kalman filter's second derivatives: :class:`iterops.ts._kalman_second.KalmanFilterHVP`, one fused kernel.

Oracles: PyTensor's reverse mode twice through a ``pytensor.scan`` of the recursion (``kalman_scan_oracle``,
autodiff of a reference Scan) for the Op's two outputs on random systems; central differences of the fused
(first-order) gradient for Hessians as users write them.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kalman_scan_oracle import filter_graph, scan_pullback
from pytensor.gradient import hessian_vector_product, jacobian

from conftest import FAST_PY, SCAN_ORACLE
from iterops import ts
from iterops.ts._kalman_second import KalmanFilterHVP
from iterops.ts.kalman import KalmanFilter

pytestmark = pytest.mark.python_run

OUT_NDIM = (0, 1, 2, 3, 2, 3, 2, 3)


def _system(rng, n, m, p, r, tv, missing_value):
    """Random inputs (y with NaN and sentinel entries, positive definite H, Q, P0; a stable-ish T)."""
    y = rng.normal(size=(n, p))
    y[rng.random(size=(n, p)) < 0.2] = np.nan
    if missing_value is not None:
        y[rng.random(size=(n, p)) < 0.15] = missing_value
    rows = [n if flag else 1 for flag in tv]

    def spd(k, t):
        A = rng.normal(size=(t, k, k))
        return A @ A.transpose(0, 2, 1) + np.eye(k)

    C = rng.normal(size=(m, m))
    return [y, rng.normal(size=m), C @ C.T + np.eye(m), rng.normal(size=(rows[0], m)), rng.normal(size=(rows[1], p)),
            0.4 * rng.normal(size=(rows[2], m, m)), rng.normal(size=(rows[3], p, m)), rng.normal(size=(rows[4], m, r)),
            spd(p, rows[5]), spd(r, rows[6])]


def _both(x, g, w, tv, jitter, missing_value):
    """``(fused outputs, Scan oracle outputs)``: x_bar (10) and J w of each connected output."""
    xs = [pt.tensor(f"x{i}", shape=v.shape) for i, v in enumerate(x)]
    gs = [None if v is None else pt.tensor(f"g{i}", shape=np.shape(v)) for i, v in enumerate(g)]
    ws = [pt.tensor(f"w{i}", shape=v.shape) for i, v in enumerate(w)]
    placeholders = [pt.zeros((0,) * nd) if v is None else v for v, nd in zip(gs, OUT_NDIM)]
    placeholders[0] = pt.as_tensor(0.0) if gs[0] is None else gs[0]
    fused = KalmanFilterHVP(tv, jitter, missing_value)(*xs, *placeholders, *ws, return_list=True)
    x_bar, g_bar = scan_pullback(xs, gs, ws, tv, jitter, missing_value)
    keep = [i for i, v in enumerate(g) if v is not None]
    ins = [*xs, *(gs[i] for i in keep), *ws]
    vals = [*x, *(g[i] for i in keep), *w]
    f_fused = pytensor.function(ins, [*fused[:10], *(fused[10 + i] for i in keep)], on_unused_input="ignore")
    f_scan = pytensor.function(ins, [*x_bar, *(g_bar[i] for i in keep)], mode=FAST_PY, on_unused_input="ignore")
    return f_fused(*vals), f_scan(*vals)


def _check_against_the_scan(data):
    """Random shapes, missing entries, sentinel, jitter, time-varying flags, connected outputs and directions:
    x_bar and J w equal PyTensor's reverse mode twice through the filter's Scan."""
    n, m, p, r = (data.draw(st.integers(lo, hi)) for lo, hi in ((1, 6), (1, 3), (1, 3), (1, 2)))
    tv = tuple(data.draw(st.lists(st.booleans(), min_size=7, max_size=7)))
    jitter = data.draw(st.sampled_from([0.0, 1e-3]))
    missing_value = data.draw(st.sampled_from([None, -9999.0]))
    connected = [data.draw(st.booleans()) for _ in range(8)]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    x = _system(rng, n, m, p, r, tv, missing_value)
    shapes = [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]
    g = [rng.normal(size=s) if c else None for s, c in zip(shapes, connected)]
    w = [rng.normal(size=v.shape) for v in x]
    fused, scan = _both(x, g, w, tv, jitter, missing_value)
    for a, b in zip(fused, scan):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9 * max(1.0, np.max(np.abs(b), initial=0.0)))


#: each example builds and rewrites a new second-order Scan graph (about 12 CPU s): a few in the default suite, a
#: deep run under ``-m slow``
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_hvp_equals_reverse_twice_through_the_scan(data):
    _check_against_the_scan(data)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_hvp_equals_reverse_twice_through_the_scan_deep(data):
    _check_against_the_scan(data)


@pytest.mark.parametrize("tv_TZ", [(False, False), (True, True)], ids=["static", "time_varying"])
def test_sparse_transition_and_design_equal_the_scan(rng, tv_TZ):
    """T and Z mostly zero (structural models: the kernel's products skip their zeros), static or time-varying with
    the pattern changing over time, directions on their nonzeros (so the perturbed matrices stay sparse): x_bar and
    J w equal the Scan's."""
    n, m, p, r = 6, 5, 2, 2
    tv = (False, False, *tv_TZ, False, False, False)
    x = _system(rng, n, m, p, r, tv, None)
    for k in (5, 6):
        x[k] = x[k] * (rng.random(size=x[k].shape) < 0.3)
    g = [rng.normal(size=s) for s in [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]]
    w = [rng.normal(size=v.shape) for v in x]
    for k in (5, 6):
        w[k] = w[k] * (x[k] != 0)
    fused, scan = _both(x, g, w, tv, 0.0, None)
    for a, b in zip(fused, scan):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9 * max(1.0, np.max(np.abs(b), initial=0.0)))


def test_hessian_of_loglik_and_loglik_obs_together_matches_finite_differences(rng):
    """Regression: a cost reading both ``loglik`` and ``loglik_obs`` (the Scan route took the ``loglik_obs``
    cotangent as the whole cotangent of the per-step log-likelihoods and dropped the ``loglik`` one)."""
    y = rng.normal(size=(10, 1))
    y[4] = np.nan
    th = pt.vector("th", shape=(4,))
    T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
    r = ts.kalman_filter(y, pt.zeros(2), pt.eye(2), T=T, Z=pt.as_tensor([[1.0, 0.3]]), R=pt.as_tensor([[1.0], [0.0]]),
                         H=pt.reshape(th[3] ** 2, (1, 1)), Q=pt.reshape(th[2] ** 2, (1, 1)))
    obs = pt.switch(pt.isnan(r.loglik_obs), 0.0, r.loglik_obs)
    cost = r.loglik + 0.3 * pt.sum(obs**2)
    g = pytensor.grad(cost, th)
    H = pytensor.function([th], jacobian(g, th))
    fg = pytensor.function([th], g)
    x0, eps = np.array([0.5, -0.2, 1.0, 0.6]), 1e-5
    fd = np.stack([(fg(x0 + eps * e) - fg(x0 - eps * e)) / (2 * eps) for e in np.eye(4)], axis=1)
    np.testing.assert_allclose(H(x0), fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


def _hvp_graph(y, p=2):
    th, v = pt.vector("th", shape=(5,)), pt.vector("v", shape=(5,))
    T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
    H = pt.eye(p) * th[3] ** 2 + 0.1
    Z = pt.as_tensor(np.ones((p, 2)) * [1.0, 0.3])
    ll = ts.kalman_filter(y, pt.zeros(2), pt.eye(2) * th[4], T=T, Z=Z, R=pt.as_tensor([[1.0], [0.0]]), H=H,
                          Q=pt.reshape(th[2] ** 2, (1, 1))).loglik
    return th, v, ll, hessian_vector_product(ll, th, v)


def test_hvp_graph_is_one_fused_op_without_scans(rng):
    """A Hessian-vector product: one KalmanFilterHVP, no Scan, no adjoint Op (the HVP kernel's real part is the
    gradient the squared parameters' second-order term needs); Z's x_bar unread (Z holds no parameter), so the
    rewrite leaves it out; equal to central differences of the gradient along ``v``."""
    y = rng.normal(size=(12, 2))
    th, v, ll, hvp = _hvp_graph(y)
    f = pytensor.function([th, v], hvp)
    ops = [getattr(n.op, "core_op", n.op) for n in f.maker.fgraph.apply_nodes]
    names = [type(op).__name__ for op in ops]
    assert names.count("KalmanFilterHVP") == 1 and "Scan" not in names and "KalmanFilterGrad" not in names, names
    assert "Z" in next(op for op in ops if isinstance(op, KalmanFilterHVP)).unused
    fg = pytensor.function([th], pytensor.grad(ll, th))
    x0, v0, eps = np.array([0.5, -0.2, 1.0, 0.6, 1.5]), rng.normal(size=5), 1e-5
    fd = (fg(x0 + eps * v0) - fg(x0 - eps * v0)) / (2 * eps)
    np.testing.assert_allclose(f(x0, v0), fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


def test_hvp_is_nan_where_the_filter_fails(rng):
    """F not positive definite at a step (a negative H): loglik = -inf and a NaN Hessian-vector product."""
    y = rng.normal(size=(6, 2))
    th, v, ll, hvp = _hvp_graph(y)
    f = pytensor.function([th, v], [ll, hvp])
    ll_bad, hvp_bad = f(np.array([0.5, -0.2, 1.0, 0.0, -0.5]), rng.normal(size=5))  # P0 = -0.5 I, H = 0.1
    assert ll_bad == -np.inf and np.all(np.isnan(hvp_bad))


def test_third_derivatives_raise_not_implemented(rng):
    y = rng.normal(size=(6, 2))
    th, v, ll, hvp = _hvp_graph(y)
    with pytest.raises(NotImplementedError, match=r"order 3.*KalmanFilterHVP"):
        pytensor.grad(hvp.sum(), th)


def test_direction_of_the_wrong_shape_raises_naming_it(rng):
    """At run time, a direction whose shape is not its input's: ValueError naming it; a direction too large for
    the complex step (beyond 2^900): NaN, not a result that lost its precision."""
    x = _system(rng, 4, 2, 1, 1, (False,) * 7, None)
    xs = [pt.tensor(shape=(None,) * v.ndim) for v in x]
    ws = [pt.tensor(shape=(None,) * v.ndim) for v in x]
    outs = KalmanFilter()(*xs)
    g = [pt.as_tensor(1.0), *(pt.zeros((0,) * o.ndim) for o in outs[1:])]
    f = pytensor.function([*xs, *ws], KalmanFilterHVP()(*xs, *g, *ws)[:10], mode="NUMBA")
    w = [np.ones_like(v) for v in x]
    w[5] = np.ones((1, 3, 3))  # T is (1, 2, 2)
    with pytest.raises(ValueError, match="T direction"):
        f(*x, *w)
    assert all(np.all(np.isnan(v)) for v in f(*x, *(np.full_like(v, 1e300) for v in x)))


def test_second_derivative_runs_no_adjoint_pass_for_a_zero_cotangent(rng):
    """A cost that tests ``loglik_obs == -inf`` (as a PyMC logp does): differentiating the gradient's
    ``switch`` condition gives the filter an all-zero cotangent (a zero ``Alloc``), and the rewrite drops the
    adjoint pass it would run.  One adjoint Op is left; the Hessian equals central differences."""
    y = rng.normal(size=(10, 1))
    th = pt.vector("th", shape=(4,))
    T = pt.stack([th[:2], pt.as_tensor([1.0, 0.0])])
    llo = ts.kalman_filter(y, pt.zeros(2), pt.eye(2), T=T, Z=pt.as_tensor([[1.0, 0.3]]), R=pt.as_tensor([[1.0], [0.0]]),
                           H=pt.reshape(th[3] ** 2, (1, 1)), Q=pt.reshape(th[2] ** 2, (1, 1))).loglik_obs
    cost = pt.sum(pt.switch(pt.eq(llo, -np.inf), 0.0, llo))
    g = pytensor.grad(cost, th)
    f = pytensor.function([th], jacobian(g, th, vectorize=True))
    names = [type(getattr(n.op, "core_op", n.op)).__name__ for n in f.maker.fgraph.apply_nodes]
    assert names.count("KalmanFilterGrad") == 1 and names.count("KalmanFilterHVP") == 1, names
    fg = pytensor.function([th], g)
    x0, eps = np.array([0.5, -0.2, 1.0, 0.6]), 1e-5
    fd = np.stack([(fg(x0 + eps * e) - fg(x0 - eps * e)) / (2 * eps) for e in np.eye(4)], axis=1)
    np.testing.assert_allclose(f(x0), fd, rtol=0, atol=1e-6 * np.max(np.abs(fd)))


def _transformed_model(kalman_filter, y):
    """A log-likelihood of ``th`` through nonlinear transforms (``tanh``, ``exp``: a Hessian-vector product needs the
    first-order gradient too), the filter given as ``kalman_filter(y, a0, P0, c, d, T, Z, R, H, Q)``."""
    th = pt.vector("th", shape=(5,))
    T = pt.stack([pt.tanh(th[:2]), pt.as_tensor([1.0, 0.0])])
    Z = pt.as_tensor(np.ones((y.shape[1], 2)) * [1.0, 0.3])
    H = pt.eye(y.shape[1]) * pt.exp(th[3]) + 0.1
    ll = kalman_filter(y, pt.zeros(2), pt.eye(2) * pt.exp(th[4]), pt.zeros(2), pt.zeros(y.shape[1]), T, Z,
                       pt.as_tensor([[1.0], [0.0]]), H, pt.reshape(pt.exp(th[2]), (1, 1)))
    return th, ll


@pytest.mark.parametrize("direction", ["random", "huge", "nan"])
def test_gradient_and_hvp_together_run_one_kernel_and_equal_the_scan(rng, direction):
    """Regression (issue 51): a function of the gradient and a Hessian-vector product (pymc-extras' ``hessp`` of a
    transformed model reads both) runs the HVP kernel alone, its real part the gradient; both equal PyTensor's
    autodiff of the reference Scan.  A direction the complex step cannot take (beyond 2^900, NaN): NaN products,
    the gradient unchanged."""
    y = rng.normal(size=(15, 2))
    y[3, 0] = np.nan
    v = pt.vector("v", shape=(5,))
    outs = {}
    for name, filt in (("fused", lambda y, a0, P0, c, d, T, Z, R, H, Q: ts.kalman_filter(
            y, a0, P0, c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q).loglik),
            ("scan", lambda y, a0, P0, *system: filter_graph(
                y, a0, P0, *(pt.as_tensor(x)[None] for x in system), (False,) * 7, 0.0, None,
                needed=(True,) + (False,) * 7)[0])):
        th, ll = _transformed_model(filt, y)
        outs[name] = th, [pytensor.grad(ll, th), hessian_vector_product(ll, th, v)[0]]
    th, (g, hv) = outs["fused"]
    f = pytensor.function([th, v], [g, hv])
    names = [type(getattr(n.op, "core_op", n.op)).__name__ for n in f.maker.fgraph.apply_nodes]
    assert names.count("KalmanFilterHVP") == 1 and "KalmanFilterGrad" not in names, names
    th_s, outs_s = outs["scan"]
    f_scan = pytensor.function([th_s, v], outs_s, mode=SCAN_ORACLE)
    x0, v0 = np.array([0.5, -0.2, 0.1, -0.3, 0.4]), rng.normal(size=5)
    v0 = {"random": v0, "huge": np.full(5, 1e300), "nan": np.r_[np.nan, v0[1:]]}[direction]
    (g_f, hv_f), (g_s, hv_s) = f(x0, v0), f_scan(x0, v0)
    np.testing.assert_allclose(g_f, g_s, rtol=1e-10, atol=1e-12)
    if direction == "random":
        np.testing.assert_allclose(hv_f, hv_s, rtol=1e-9, atol=1e-12)
    else:
        assert np.all(np.isnan(hv_f))
