"""Kalman filter: iterops vs statsmodels (forward) and pymc-extras' StandardFilter (forward + gradient).

Cases: a small multivariate model (m=4, p=2, n=500), a larger one (m=20, p=5, n=200) and a long
univariate local level (n=10,000); then real model matrices (structural, SARIMAX, VAR, dense m=20)
with pymc-extras' arithmetic (``cov_jitter=1e-8``), the forward against its operand-shape limit
(:func:`_limit_steps`) and the gradient with jitter against without: :func:`run_real_models`; then the univariate
measurement update (``kalman_filter(univariate=...)``): the crossover grid its automatic rule comes
from and dynamic factor models, :func:`run_univariate`.
All PyTensor functions compile in PyTensor's default mode (Numba linker).
"""

from __future__ import annotations

import time

import numba
import numpy as np
import pytensor
import pytensor.tensor as pt

from benchmarks._harness import Section, Target, best_time, compile_time, ms
from iterops._linalg_kernels import SMALL, cho_solve_vec, cholesky, matmul

CASES = [("m=4, p=2, n=500", 4, 2, 500), ("m=20, p=5, n=200", 20, 5, 200), ("local level, n=10,000", 1, 1, 10_000)]
NAMES = ("y", "a0", "P0", "c", "d", "T", "Z", "R", "H", "Q")


def _model(m, p, n, seed=0):
    rng = np.random.default_rng(seed)
    if m == 1:
        T = np.eye(1)  # local level: a random walk observed with noise
    else:
        T = 0.7 * np.eye(m) + 0.2 * rng.normal(size=(m, m)) / np.sqrt(m)
    Z = rng.normal(size=(p, m))
    R = np.eye(m)
    Q = 0.1 * np.eye(m)
    H = 0.5 * np.eye(p)
    c, d, a0, P0 = np.zeros(m), np.zeros(p), np.zeros(m), np.eye(m)
    # simulate
    a = rng.normal(size=m)
    y = np.empty((n, p))
    for t in range(n):
        y[t] = Z @ a + rng.normal(size=p) * np.sqrt(0.5)
        a = T @ a + rng.normal(size=m) * np.sqrt(0.1)
    return dict(y=y, a0=a0, P0=P0, c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q)


def _statsmodels(model, univariate=False):
    """statsmodels' ``loglike`` of ``model`` (known initialization); ``univariate``: its univariate filter."""
    from statsmodels.tsa.statespace.kalman_filter import KalmanFilter

    y = model["y"]
    n, p = y.shape
    m = model["a0"].shape[0]
    kf = KalmanFilter(k_endog=p, k_states=m, k_posdef=m)
    kf.bind(np.asfortranarray(y.T))
    for k, name in dict(T="transition", Z="design", R="selection", H="obs_cov", Q="state_cov").items():
        kf[name] = model[k]
    kf.initialize_known(model["a0"], model["P0"])
    kf.filter_univariate = univariate
    return kf.loglike


def _inputs(model):
    return [pt.tensor(name=k, dtype="float64", shape=model[k].shape) for k in NAMES]


def _iterops_fns(model):
    from iterops.ts import kalman_filter

    def build_fwd():
        ins = _inputs(model)
        fn = pytensor.function(ins, kalman_filter(*ins[:3], **dict(zip(NAMES[3:], ins[3:]))).loglik, trust_input=True)
        fn(*[model[k] for k in NAMES])
        return fn

    def build_grad():
        ins = _inputs(model)
        ll = kalman_filter(*ins[:3], **dict(zip(NAMES[3:], ins[3:]))).loglik
        fn = pytensor.function(ins, [ll, *pytensor.grad(ll, ins[1:])], trust_input=True)
        fn(*[model[k] for k in NAMES])
        return fn

    t_fwd, fwd = compile_time(build_fwd)
    t_grad, grad = compile_time(build_grad)
    return fwd, grad, t_grad


def _pymc_extras_fn(model):
    from pymc_extras.statespace.filters.kalman_filter import StandardFilter

    def build():
        ins = _inputs(model)
        outs = StandardFilter().build_graph(*ins)
        ll = outs[-1].sum()
        fn = pytensor.function(ins, [ll, *pytensor.grad(ll, ins[1:])], trust_input=True,
                             mode=pytensor.compile.get_default_mode().excluding("iterops"))  # the Scan, not fused
        fn(*[model[k] for k in NAMES])
        return fn

    return compile_time(build)


def _warm_up():
    """One-off work before any timing: load (or compile, when their sources changed) the Kalman filter's
    and adjoint's kernels (:class:`iterops._fused.OpaqueKernel`, as ``iterops.warmup.warm_kernels`` does
    for all of them), then one throwaway build of each side's compiled functions on a tiny model (anything
    else they need: glue, PyTensor's Numba dispatch, pymc-extras' import).  Returns (iterops s, pymc-extras s)."""
    from iterops._fused import OPAQUE_KERNELS

    t0 = time.perf_counter()
    for kernel in OPAQUE_KERNELS:
        if kernel.name in ("iterops.ts.kalman._filter_abi", "iterops.ts.kalman._adjoint_abi"):
            kernel.compile()
    tiny = _model(2, 1, 5)
    _iterops_fns(tiny)
    t1 = time.perf_counter()
    _pymc_extras_fn(tiny)
    return t1 - t0, time.perf_counter() - t1


def run(quick: bool = False) -> list[Section]:
    min_time = 0.05 if quick else 0.3
    repeat = 3 if quick else 5
    warm_ours, warm_theirs = _warm_up()
    sec = Section(
        title="Kalman filter: iterops.ts.kalman_filter",
        columns=[
            "case", "statsmodels loglik (ms)", "iterops loglik (ms)", "fwd speed-up",
            "pymc-extras loglik+grad (ms)", "iterops loglik+grad (ms)", "fwd+grad speed-up",
            "pymc-extras compile (s)", "iterops compile (s)", "compile ratio",
        ],
        notes=(
            "\n".join([
                "- statsmodels: `KalmanFilter.loglike` (Cython, known initialization, its steady-state shortcut "
                "on).",
                "- pymc-extras: `StandardFilter().build_graph` log-likelihood + `pytensor.grad` (Scan), default "
                "mode.",
                "- iterops: `kalman_filter(...).loglik` (+ `pytensor.grad`), default mode, cov_jitter=0.",
                "- Compile = graph construction + `pytensor.function` + first call (loglik+grad), warm on-disk "
                "caches.",
                "- Before any timing, `_warm_up` loads iterops' Kalman kernels and builds both sides once on a "
                f"tiny model (this run: iterops {warm_ours:.1f} s, pymc-extras {warm_theirs:.1f} s, its import and "
                "a first Scan compile). No compile column holds a kernel compile or an import.",
                "- Each case's graph is new to the process; its compile reads the on-disk caches a previous run "
                "left.",
            ])
        ),
    )
    for label, m, p, n in CASES:
        model = _model(m, p, n)
        args = [model[k] for k in NAMES]
        sm = _statsmodels(model)
        fwd, grad, t_ours = _iterops_fns(model)
        t_theirs, theirs = _pymc_extras_fn(model)
        # correctness guard: same log-likelihood
        ll_sm, ll_ours = sm(), float(fwd(*args))
        assert abs(ll_sm - ll_ours) <= 1e-6 * abs(ll_sm), (label, ll_sm, ll_ours)
        ts = best_time(sm, min_time=min_time, repeat=repeat)
        tf = best_time(fwd, *args, min_time=min_time, repeat=repeat)
        tg_theirs = best_time(theirs, *args, min_time=min_time, repeat=repeat)
        tg = best_time(grad, *args, min_time=min_time, repeat=repeat)
        sec.rows.append([
            label, ms(ts), ms(tf), ts / tf, ms(tg_theirs), ms(tg), tg_theirs / tg, t_theirs, t_ours, t_theirs / t_ours,
        ])
        sec.targets += [
            Target(f"{label}: forward vs statsmodels", ts / tf, 3.0),
            Target(f"{label}: forward+gradient vs pymc-extras", tg_theirs / tg, 25.0),
            Target(f"{label}: compile time, pymc-extras / iterops", t_theirs / t_ours, 10.0),
        ]
    return [sec, *run_real_models(quick), *run_cost_model(quick), *run_univariate(quick)]


# ---------------------------------------------------------------------------
# Real model matrices: statsmodels-built systems, pymc-extras' arithmetic (cov_jitter=1e-8)
# ---------------------------------------------------------------------------


def _from_statsmodels(mod, params):
    """System matrices of a statsmodels state-space model at ``params`` (static ones only)."""
    mod.update(params)
    ssm = mod.ssm
    get = lambda name: np.array(ssm[name], dtype=float)  # noqa: E731
    T, Z, R = get("transition"), get("design"), get("selection")
    H, Q = get("obs_cov"), get("state_cov")
    c, d = get("state_intercept").ravel(), get("obs_intercept").ravel()
    return dict(c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q)


def _real_models(n):
    """(label, statsmodels model bound to simulated data, our input dict): four cases."""
    import scipy.linalg
    from statsmodels.tsa.statespace.sarimax import SARIMAX
    from statsmodels.tsa.statespace.structural import UnobservedComponents
    from statsmodels.tsa.statespace.varmax import VARMAX

    rng = np.random.default_rng(18)
    out = []

    def add(label, build, params, P0=None):
        mod0 = build(np.zeros((n, build.k_endog)) if build.k_endog > 1 else np.zeros(n))
        m0 = mod0.ssm.k_states
        y = np.asarray(mod0.simulate(params, n, initial_state=np.zeros(m0), random_state=rng)).reshape(n, -1)
        mod = build(y if y.shape[1] > 1 else y[:, 0])
        mats = _from_statsmodels(mod, params)
        m = mats["T"].shape[0]
        if P0 is None:  # stationary start: P0 = T P0 T' + R Q R'
            P0 = scipy.linalg.solve_discrete_lyapunov(mats["T"], mats["R"] @ mats["Q"] @ mats["R"].T)
        a0 = np.zeros(m)
        mod.ssm.initialize_known(a0, P0)
        mod.ssm.loglikelihood_burn = 0  # every observation counts, as in the other filters
        out.append((label, mod, dict(y=y, a0=a0, P0=P0, **mats)))

    def uc(y):
        return UnobservedComponents(y, level="lltrend", seasonal=12)
    uc.k_endog = 1
    add("structural: level+trend+seasonal(12)+noise, m=13", uc, [1.0, 0.1, 0.01, 0.05], P0=10.0 * np.eye(13))

    def sarimax(y):
        return SARIMAX(y, order=(2, 0, 1), seasonal_order=(1, 0, 1, 12))
    sarimax.k_endog = 1
    add("SARIMAX(2,0,1)x(1,0,1,12), m=14", sarimax, [0.5, 0.2, 0.3, 0.6, -0.2, 1.0])

    def var(y):
        return VARMAX(y, order=(2, 0), trend="n")
    var.k_endog = 3
    A1 = np.array([[0.5, 0.1, 0.0], [0.0, 0.4, 0.1], [0.1, 0.0, 0.3]])
    A2 = np.array([[0.1, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.05, 0.1]])
    chol = [1.0, 0.2, 0.8, 0.1, 0.1, 0.7]  # lower Cholesky factor of the innovation covariance, by rows
    add("VAR(2), 3 variables, m=6", var, [*np.concatenate([A1, A2], axis=1).ravel(), *chol])

    model = _model(20, 5, n, seed=3)
    y = model["y"]
    from statsmodels.tsa.statespace.mlemodel import MLEModel

    class Dense(MLEModel):  # the dense m=20 case as a statsmodels model, for its filter
        def __init__(self, y):
            super().__init__(y, k_states=20, k_posdef=20)
            for k, name in dict(T="transition", Z="design", R="selection", H="obs_cov", Q="state_cov").items():
                self.ssm[name] = model[k]

    mod = Dense(y)
    mod.ssm.initialize_known(model["a0"], model["P0"])
    out.append(("dense, m=20, p=5", mod, model))
    return out


def _fused_result(model, jitter, tv=()):
    from iterops.ts import kalman_filter

    ins = _inputs(model)
    y, a0, P0, c, d, T, Z, R, H, Q = ins
    return ins, kalman_filter(y, a0, P0, c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q, cov_jitter=jitter,
                              missing_value=-9999.0, time_varying=tv)


def _fused_fns(model, jitter, tv=()):
    """The forward (the log-likelihood alone, as statsmodels' ``loglike``: no covariance output, which the
    kernel would then write at every step) and the log-likelihood with its gradient w.r.t. every input but y."""
    ins, res = _fused_result(model, jitter, tv)
    fwd = pytensor.function(ins, res.loglik, trust_input=True)
    grad = pytensor.function(ins, [res.loglik, *pytensor.grad(res.loglik, ins[1:])], trust_input=True)
    return fwd, grad


def _fused_frozen(model, jitter, tv=()):
    """:func:`_frozen_steps` of the iterops forward on ``model`` (a separate function reads ``predicted_cov``)."""
    ins, res = _fused_result(model, jitter, tv)
    return _frozen_steps(pytensor.function(ins, res.predicted_cov, trust_input=True)(*[model[k] for k in NAMES]))


def _pymc_extras_scan(model):
    from pymc_extras.statespace.filters.kalman_filter import StandardFilter

    ins = _inputs(model)
    ll = StandardFilter(cov_jitter=1e-8).build_graph(*ins)[-1].sum()
    mode = pytensor.compile.get_default_mode().excluding("iterops")
    return pytensor.function(ins, [ll, *pytensor.grad(ll, ins[1:])], trust_input=True, mode=mode)


def _flop_rate():
    """Double-precision flop rate of one large matrix product (BLAS, all threads: the machine's peak),
    flops per second."""
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(500, 500)), rng.normal(size=(500, 500))
    return 2 * 500**3 / best_time(np.dot, A, B, min_time=0.2, repeat=5)


def _flop_estimate(m, p, n_full, n_steady):
    """Flops of the forward filter: a full step (P Z', F, Cholesky, gain, P_f on one triangle, T P_f T')
    ``3 m^3 + 3 m^2 p + 3 m p^2 + p^3/3``; a steady step (v, F^{-1} v, a + K v, T a_f) ``4 m p + 2 m^2 + 2 p^2``."""
    full = 3 * m**3 + 3 * m**2 * p + 3 * m * p**2 + p**3 / 3
    steady = 4 * m * p + 2 * m**2 + 2 * p**2
    return n_full * full + n_steady * steady


#: how :func:`_limit_steps` multiplies matrices: BLAS into ``out`` (``np.dot(X, Y, out)``), plain loops,
#: loops up to ``SMALL**3`` multiply-adds and BLAS into ``out`` above (iterops' size rule), or iterops' own
#: helper (``iterops._linalg_kernels.matmul``: the same rule; above it BLAS into ``out`` for whole operands or
#: their transposes, else contiguous copies of the operands, an allocating ``np.dot`` and a copy into ``out``)
BLAS, LOOPS, MIXED, HELPER = 0, 1, 2, 3


@numba.njit(cache=True)
def _product(X, Y, out, how):
    """out = X @ Y, by ``how`` (:data:`BLAS`, :data:`LOOPS`, :data:`MIXED`, :data:`HELPER`)."""
    if how == BLAS or (how == MIXED and X.shape[0] * X.shape[1] * Y.shape[1] > SMALL**3):
        np.dot(X, Y, out)
    elif how == HELPER:
        matmul(X, Y, out)
    else:
        for i in range(X.shape[0]):
            for j in range(Y.shape[1]):
                s = 0.0
                for l in range(X.shape[1]):
                    s += X[i, l] * Y[l, j]
                out[i, j] = s


@numba.njit(cache=True)
def _limit_steps(y, c, d, a0, P0, T, Z, H, RQR, n_full, n_steady, how, P, PZ, F, K, Pf, TP, Pn, a, af, v, w):
    """The matrix work of a dense forward filter and nothing else: ``n_full`` full steps, then ``n_steady``
    steps with the covariance frozen; every work array preallocated (no allocation in the loop), no
    missing-value handling, no outputs but the quadratic form's sum.  A full step: ``PZ = P Z^T`` (m x m x
    p), ``F = Z PZ + H`` (p x m x p), ``F = L L^T`` in place (p^3 / 3), ``K = PZ F^{-1}`` (two triangular
    solves per row, m p^2), ``P_f = P - K PZ^T`` (m x p x m), ``P' = T P_f T^T + R Q R^T`` (two m x m x m).
    Every step: ``v = y - d - Z a``, ``w = F^{-1} v``, ``a_f = a + K v``, ``a' = T a_f + c`` (loops)."""
    m, p = T.shape[0], Z.shape[0]
    for i in range(m):
        a[i] = a0[i]
        for j in range(m):
            P[i, j] = P0[i, j]
    total = 0.0
    n = y.shape[0]
    for t in range(n_full + n_steady):
        if t < n_full:
            _product(P, Z.T, PZ, how)
            _product(Z, PZ, F, how)
            for i in range(p):
                for j in range(p):
                    F[i, j] += H[i, j]
            cholesky(F, F, p)
            for i in range(m):
                cho_solve_vec(F, p, PZ[i], K[i])
            _product(K, PZ.T, Pf, how)
            for i in range(m):
                for j in range(m):
                    Pf[i, j] = P[i, j] - Pf[i, j]
            _product(T, Pf, TP, how)
            _product(TP, T.T, Pn, how)
            for i in range(m):
                for j in range(m):
                    P[i, j] = Pn[i, j] + RQR[i, j]
        yt = y[t % n]
        for i in range(p):
            s = yt[i] - d[i]
            for l in range(m):
                s -= Z[i, l] * a[l]
            v[i] = s
        cho_solve_vec(F, p, v, w)
        for i in range(p):
            total += v[i] * w[i]
        for i in range(m):
            s = a[i]
            for j in range(p):
                s += K[i, j] * v[j]
            af[i] = s
        for i in range(m):
            s = c[i]
            for l in range(m):
                s += T[i, l] * af[l]
            a[i] = s
    return total


def _limit_args(model, n_full, n_steady, how):
    """Arguments of :func:`_limit_steps` for ``model`` (dense, at its shapes), its work arrays allocated;
    also returns ``R Q R^T``."""
    m, p = model["T"].shape[0], model["Z"].shape[0]
    R, Q = model["R"], model["Q"]
    RQR = R @ (0.5 * (Q + Q.T)) @ R.T
    work = [np.empty(s) for s in ((m, m), (m, p), (p, p), (m, p), (m, m), (m, m), (m, m), m, m, p, p)]
    args = [np.ascontiguousarray(model[k], dtype=float) for k in ("y", "c", "d", "a0", "P0", "T", "Z", "H")]
    return [*args, RQR, n_full, n_steady, how, *work], RQR


def _limit_time(model, n_full, n_steady, how, min_time=0.2, repeat=5):
    """Seconds of :func:`_limit_steps` on ``model``'s matrices (dense, at their shapes), best of ``repeat``."""
    return best_time(_limit_steps, *_limit_args(model, n_full, n_steady, how)[0], min_time=min_time, repeat=repeat)


def _frozen_steps(Pp):
    """Predicted covariances equal to the previous one: the steps the filter ran with its covariance frozen."""
    return sum(np.array_equal(Pp[t], Pp[t - 1]) for t in range(1, Pp.shape[0]))


def _cpu_best(fn, args, number, repeat):
    """Best-of-``repeat`` process CPU seconds per call of ``fn(*args)``, ``number`` calls per repeat."""
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(number):
            fn(*args)
        times.append((time.process_time() - t0) / number)
    return min(times)


def _interleaved_ratios(fa, fb, args, rounds, min_time):
    """``rounds`` ratios cpu(fa) / cpu(fb), each of a best-of-5 of fa then one of fb, interleaved (ABAB...).
    Process CPU time, not wall time: on a shared machine other processes' load then costs nothing (the
    kernels run one thread; wall-time ratios of the same pairs spread over 0.5-2x at load 3)."""
    fa(*args), fb(*args)
    number = max(1, int(min_time / 5 / best_time(fb, *args, min_time=min_time / 5, repeat=1)))
    return np.array([_cpu_best(fa, args, number, 5) / _cpu_best(fb, args, number, 5) for _ in range(rounds)])


def _cpu_time(fn, args, min_time):
    """Best-of-5 process CPU seconds per call of ``fn(*args)`` (about ``min_time`` in all)."""
    fn(*args)
    number = max(1, int(min_time / 5 / best_time(fn, *args, min_time=min_time / 5, repeat=1)))
    return _cpu_best(fn, args, number, 5)


def per_full_step(model, n_full, min_time=0.3):
    """CPU seconds per full step (no covariance frozen: the first ``n_full`` observations) of the iterops
    forward (``"iterops"``: less its time on the first observation, over ``n_full - 1``) and of
    :func:`_limit_steps` by each product method (:data:`BLAS`, :data:`LOOPS`, :data:`MIXED`, :data:`HELPER`)."""
    heads = [dict(model, y=model["y"][:k]) for k in (1, n_full)]
    t_head = [_cpu_time(_fused_fns(h, 1e-8)[0], [h[k] for k in NAMES], min_time) for h in heads]
    out = {"iterops": (t_head[1] - t_head[0]) / (n_full - 1)}
    for how in (BLAS, LOOPS, MIXED, HELPER):
        limit_args, RQR = _limit_args(heads[1], n_full, 0, how)
        quad = _dense_quad(heads[1], RQR)
        # correctness guard: the limit does the filter's arithmetic (its sum of v' F^{-1} v, a dense NumPy filter's)
        assert abs(_limit_steps(*limit_args) - quad) <= 1e-8 * abs(quad), (how, quad)
        out[how] = _cpu_time(_limit_steps, limit_args, min_time) / n_full
    return out


def _dense_quad(model, RQR):
    """Sum over t of ``v_t' F_t^{-1} v_t`` from a textbook dense NumPy filter of ``model`` (every step full)."""
    a, P, T, Z, H = model["a0"], model["P0"], model["T"], model["Z"], model["H"]
    quad = 0.0
    for yt in model["y"]:
        F = Z @ P @ Z.T + H
        v = yt - model["d"] - Z @ a
        quad += v @ np.linalg.solve(F, v)
        K = P @ Z.T @ np.linalg.inv(F)
        a = T @ (a + K @ v) + model["c"]
        P = T @ (P - K @ Z @ P) @ T.T + RQR
    return quad


def run_real_models(quick: bool = False) -> list[Section]:
    min_time = 0.05 if quick else 0.3
    repeat = 3 if quick else 5
    rounds = 5 if quick else 11
    n = 120 if quick else 300
    sec = Section(
        title="Kalman filter on real model matrices (pymc-extras' arithmetic: cov_jitter=1e-8)",
        columns=[
            "case", "statsmodels fwd (ms)", "pymc-extras Scan f+g (ms)", "iterops fwd (ms)", "iterops f+g (ms)",
            "iterops f+g, jitter 0 (ms)", "f+g jitter / jitter 0, median (min-max)", "frozen steps, jitter / 0",
            "peak-rate flop estimate fwd (ms)", "operand-shape limit fwd (ms)", "fwd vs statsmodels",
            "f+g vs pymc-extras", "fwd / operand-shape limit",
        ],
        notes=(
            "\n".join([
                f"- n={n} simulated observations per model. System matrices from statsmodels at fixed parameters: "
                "`UnobservedComponents('lltrend', seasonal=12)`, `SARIMAX`, `VARMAX(order=(2, 0))`; and the "
                "random dense model above.",
                "- Known initialization for every filter: the stationary P0, or 10 I for the structural model.",
                "- statsmodels: `ssm.loglike()` (conventional filter, its steady state).",
                "- pymc-extras: `StandardFilter(cov_jitter=1e-8).build_graph` log-likelihood + `pytensor.grad`, "
                "compiled with `mode.excluding('iterops')` (the Scan, not fused).",
                "- iterops: `kalman_filter(..., cov_jitter=1e-8, missing_value=-9999.0)` log-likelihood, + "
                "gradient w.r.t. a0, P0 and every system matrix. The jitter-0 column: the same without jitter. "
                "The forward is a function of the log-likelihood alone, as statsmodels' `loglike` (which stores "
                "no covariance); until 2026-12-05 it also returned `predicted_cov`, whose per-step copies the "
                "forward then made (SARIMAX: 0.134 against 0.120 ms).",
                f"- `f+g jitter / jitter 0`: median (min-max) of {rounds} ratios of process CPU time, each a "
                "best-of-5, jitter 1e-8 and 0 interleaved in one process (`_interleaved_ratios`). The two "
                "separate f+g columns are single best-of measurements taken minutes apart.",
                "- `frozen steps`: predicted covariances equal to the previous one (the steps the forward ran "
                "frozen, from `predicted_cov`), jitter 1e-8 / 0.",
                "- `peak-rate flop estimate`: `_flop_estimate` (full steps until the covariance froze, then "
                "mean-only steps) over the flop rate of a 500x500 BLAS product on all cores. Unreachable at m <= "
                "20 and load-dependent: shown, not used.",
                "- `operand-shape limit`: `_limit_steps`, a Numba loop doing only the dense matrix work of the "
                "same full and frozen steps at the model's shapes (P Z^T, F = Z P Z^T + H, chol(F), the gain's "
                "solves, P_f, T P_f T^T + R Q R^T; v, the solve with v, a + K v, T a_f).",
                "- The limit preallocates its work arrays and takes the fastest of BLAS, plain loops, or loops up "
                "to 10^3 multiply-adds. It has no missing values, no outputs and no structure of T or Z: a sparse "
                "T or Z lets the filter beat it.",
                "- The dense m=20 target is the operand-shape limit over the forward; the next section measures "
                "the gap per step.",
                "",
                "The dense m=20 target (forward within 1.5x of the operand-shape limit) sits at its goal:",
                "- 2026-12-05: the forward timed as statsmodels' `loglike` runs, a function of the log-likelihood "
                "alone (until then it also returned `predicted_cov`, so the kernel copied the frozen covariance "
                "into it at every steady step): 0.565 -> 0.52-0.53 ms, limit / forward 0.64 -> 0.65-0.68 in "
                "three runs on a quiet machine (0.58 in one at load 2): the goal, 0.667, within the run-to-run "
                "noise. `matmul` now writes BLAS products into the output directly "
                "(no operand copies, allocation or copy back) for whole operands or their transposes: dense f+g "
                "2.28 -> 2.17-2.22 ms, the forward unchanged.",
                "",
                "Before (measured 2026-12-02, load 3, n=300):",
                "- Per full step the forward takes 1.8-2.0x the operand-shape limit (CPU time 10.5-13.6 us "
                "against 5.8-6.9 us).",
                "- iterops' product helper (`matmul`: copies of transposed operands, an allocating `np.dot`, a "
                "copy into the output) costs 1.24-1.45x at these shapes.",
                "- perf over the 79 full steps: 65% of samples in Numba-compiled code, 22% in OpenBLAS, 5.6% in "
                "libc (the helper's allocations), 4.7% in Python.",
                "- The rest is scalar work the limit does not do: the symmetrizations, P_f's rank-5 update in "
                "loops, the convergence test, the copies into the outputs.",
                "",
                "Why the structural targets are missed (measured 2026-12-02, n=300, load 5-7):",
                "- The model never reaches a steady state: the covariance's relative change per step is 1.8e-5 at "
                "t=299, against the shortcut's 1e-14 (closed-loop eigenvalue 0.992). Every step is a full step, "
                "in statsmodels too.",
                "- Forward: the structured scalar loops and the helper's copies cost more than the zeros they "
                "skip. The dense operand-shape limit is faster (1.7-3.0 us against 4.0-4.2 us per full step).",
                "- 3x needs about 1.5x fewer operations per step, or vectorised loops, which change the summation "
                "order.",
                "- Adjoint: most of f+g, about 7 us per step in scalar loops (perf: 75% in the compiled loops, "
                "4.4% in BLAS). 25x needs the update's reverse loops merged and the forward's stored update "
                "reused.",
                "- Since 2026-12-02 a reverse step no longer rebuilds the steady-stretch cache (adjoint 1.4-1.6x "
                "faster). Since 2026-12-03 a one-observable step is a rank-one update with a merged reverse: see "
                "`Kalman filter: cost model`.",
                "",
                "Why the SARIMAX forward is short of 3x statsmodels (measured 2026-12-05, n=300, load 1): 122 full "
                "steps at 0.76 us (92 us), as the structural model's (the cost model's bound), then 178 frozen "
                "steps at about 0.09 us (16 us: the mean recursion, a chain of dependent operations from step to "
                "step) and 8 us per call (the function's and the kernel's fixed costs, n = 1). 3x needs about "
                "0.6 us per full step.",
                "",
                "Jitter 1e-8 against 0 (measured 2026-12-02, n=300, load 3, 11 interleaved rounds):",
                "- f+g jitter / 0: 0.98 structural, 1.15 SARIMAX, 1.04 VAR, 1.07 dense. The forward alone does "
                "the same work either way.",
                "- Both freeze the same steps, so the difference is in the adjoint's steady stretch. With j != 0, "
                "`_jitter_congruence` adds two m x m x m products, twice per frozen reverse step in the stretch's "
                "window.",
                "- SARIMAX (closed-loop radius 0.87): the window covers all 178 frozen steps, about 1.1 ms, "
                "against a measured difference of 1.25 ms. Dense (radius 0.81): 128 of 221 steps, 0.57 ms, 7-9% "
                "of f+g.",
                "- Those terms have relative size about j^2 = 1e-16. Whether to skip them is a kernel question, "
                "not settled here.",
            ])
        ),

    )
    steps = Section(
        title="Kalman forward per full step: iterops vs the operand-shape limit",
        columns=[
            "case", "m, p", "full steps (of n)", "iterops fwd per full step (us)", "limit, BLAS (us)",
            "limit, loops (us)", "limit, loops/BLAS by size (us)", "same, iterops' matmul helper (us)",
            "iterops / best limit", "helper / loops-BLAS by size",
        ],
        notes=(
            "\n".join([
                "- Process CPU time per full step (`per_full_step`; the kernels run one thread, so other "
                "processes' load does not count).",
                "- iterops: the forward (`kalman_filter(..., cov_jitter=1e-8).loglik`, default mode) on the first "
                "`full steps` observations (no covariance frozen yet), less the same on the first observation "
                "(the call's fixed cost), over `full steps` - 1. n/a below 10 full steps.",
                "- Limits: `_limit_steps` (section above) per full step, its products by BLAS into a preallocated "
                "output (`np.dot(X, Y, out)`), by plain loops, or by loops up to 10^3 multiply-adds and BLAS "
                "above (iterops' size rule, `_linalg_kernels.SMALL`).",
                "- Helper: the same with iterops' `_linalg_kernels.matmul` (the size rule; above it BLAS into "
                "the output for whole operands or their transposes, as here, else operand copies, an allocating "
                "`np.dot` and an output copy: how the filter's products run).",
                "- `iterops / best limit`: over the fastest of the first three limits. `helper / loops-BLAS by "
                "size`: what the helper costs at these shapes (until 2026-12-05 its copies and allocations: "
                "1.13 at m = 20).",
            ])
        ),
    )
    rate = _flop_rate()
    for label, mod, model in _real_models(n):
        args = [model[k] for k in NAMES]
        m, p = model["T"].shape[0], model["y"].shape[1]
        fwd, grad = _fused_fns(model, 1e-8)
        _, grad0 = _fused_fns(model, 0.0)
        theirs = _pymc_extras_scan(model)
        ll_sm = mod.ssm.loglike()
        ll_ours = fwd(*args)
        ll_theirs = float(theirs(*args)[0])
        assert abs(ll_sm - float(ll_ours)) <= 1e-6 * abs(ll_sm), (label, ll_sm, ll_ours)
        assert abs(ll_theirs - float(ll_ours)) <= 1e-6 * abs(ll_sm), (label, ll_theirs, ll_ours)
        n_steady, n_steady0 = _fused_frozen(model, 1e-8), _fused_frozen(model, 0.0)
        n_full = n - n_steady
        t_peak = _flop_estimate(m, p, n_full, n_steady) / rate
        t_lim = {how: _limit_time(model, n_full, n_steady, how, min_time, repeat) for how in (BLAS, LOOPS, MIXED)}
        t_limit = min(t_lim.values())
        ts = best_time(mod.ssm.loglike, min_time=min_time, repeat=repeat)
        tf = best_time(fwd, *args, min_time=min_time, repeat=repeat)
        tg_theirs = best_time(theirs, *args, min_time=min_time, repeat=repeat)
        tg = best_time(grad, *args, min_time=min_time, repeat=repeat)
        tg0 = best_time(grad0, *args, min_time=min_time, repeat=repeat)
        jr = _interleaved_ratios(grad, grad0, args, rounds, min_time)
        sec.rows.append([
            label, ms(ts), ms(tg_theirs), ms(tf), ms(tg), ms(tg0),
            f"{np.median(jr):.3g} ({jr.min():.3g}-{jr.max():.3g})", f"{n_steady} / {n_steady0}",
            ms(t_peak), ms(t_limit), ts / tf, tg_theirs / tg, tf / t_limit,
        ])
        if label.startswith("structural"):
            sec.targets += [
                Target("structural: forward vs statsmodels", ts / tf, 3.0),
                Target("structural: forward+gradient vs pymc-extras' Scan (jitter on)", tg_theirs / tg, 25.0),
            ]
        if label.startswith("SARIMAX"):
            sec.targets.append(Target("SARIMAX: forward vs statsmodels", ts / tf, 3.0))
        if label.startswith("dense"):
            sec.targets.append(Target("dense m=20: operand-shape limit / forward (>= 1/1.5)", t_limit / tf, 1 / 1.5))
        # per full step: the first n_full observations (no covariance frozen yet), less one observation's
        # call (the function call's fixed cost), over n_full - 1
        if n_full < 10:
            steps.rows.append([label, f"{m}, {p}", f"{n_full} (of {n})", *[float("nan")] * 7])
            continue
        per = per_full_step(model, n_full, min_time)
        best = min(per[BLAS], per[LOOPS], per[MIXED])
        steps.rows.append([
            label, f"{m}, {p}", f"{n_full} (of {n})", 1e6 * per["iterops"], 1e6 * per[BLAS], 1e6 * per[LOOPS],
            1e6 * per[MIXED], 1e6 * per[HELPER], per["iterops"] / best, per[HELPER] / per[MIXED],
        ])
    return [sec, steps]


# ---------------------------------------------------------------------------
# Cost model: multiply-adds per full step at each model's sparsity, against the measured small-product rate
# ---------------------------------------------------------------------------


def step_madds(model):
    """Multiply-adds of one full step (the covariance recursion running) of the forward and of the adjoint,
    at ``model``'s sparsity: ``(forward, adjoint)``.  ``z = nnz(Z)``, ``t = nnz(T)``, m states, p series.

    Forward: ``P Z^T`` (m z), ``F`` on one triangle (z (p + 1) / 2), Cholesky and gain (p^3 / 6 + m p^2;
    for p = 1 a division per state), ``P_f = P - K (M + j K)^T`` on one triangle (m (m + 1) p), ``T P_f``
    (t m) and ``(T P_f) T^T`` on one triangle (t (m + 1) / 2), the mean (z + m p + t).
    Adjoint: the forward's update again (it recomputes it from the stored prediction), ``T^T G T``
    (2 t m), the dense cotangent of T, ``2 (G T) P_f`` (m^3: an entry of T that is zero at this draw may
    be a parameter), ``a_bar a_f^T`` and ``T^T a_bar`` (2 m^2), the update's reverse (``S K``, ``S M``,
    ``M_bar^T P``, the cotangent of P: 4 m^2 p, and ``K_bar F^{-1}``: m p^2)."""
    T, Z = model["T"], model["Z"]
    m, p = T.shape[0], Z.shape[0]
    t, z = int(np.count_nonzero(T)), int(np.count_nonzero(Z))
    update = m * z + z * (p + 1) / 2 + (m if p == 1 else p**3 / 6 + m * p**2) + m * (m + 1) * p
    fwd = update + t * m + t * (m + 1) / 2 + z + m * p + t
    adj = update + z + m * p + 2 * t * m + m**3 + 2 * m**2 + 4 * m**2 * p + m * p**2
    return fwd, adj


@numba.njit(cache=True)
def _products(X, Y, out, number, how):
    """``number`` dense products ``out = X @ Y`` into a preallocated output, by :data:`BLAS`
    (``np.dot(X, Y, out)``) or plain :data:`LOOPS` (:func:`_product`)."""
    for _ in range(number):
        _product(X, Y, out, how)


def small_product_rate(m, how, min_time=0.2):
    """Multiply-adds per second of one (m, m) x (m, m) product into a preallocated output, process CPU time:
    by BLAS (vectorised: the rate the step's arithmetic could run at were it all dense products) or by plain
    Numba loops (one multiply-add after the other: the rate of a scalar loop over lists of nonzeros)."""
    rng = np.random.default_rng(0)
    X, Y, out = rng.normal(size=(m, m)), rng.normal(size=(m, m)), np.empty((m, m))
    number = 2000
    return m**3 * number / _cpu_time(_products, [X, Y, out, number, how], min_time)


def _cost_models(n):
    """(label, model, time-varying names) of the cost model's cases: the real models' structural, SARIMAX and
    dense m=20 (:func:`_real_models`), a dynamic factor model with time-varying H (every step full) and a
    local level."""
    out = [(label, model, ()) for label, _, model in _real_models(n) if not label.startswith("VAR")]
    out.append(("DFM m=3, p=12, H time-varying", _dfm(3, 12, n, tv_h=True), ("H",)))
    out.append(("local level", _model(1, 1, n), ()))
    return out


_COST_NOTES = "\n".join([
    "- n={n}. The floor: multiply-adds per full step over the machine's small-product rate; arithmetic only (no "
    "index loads, no tests, no output writes).",
    "- `step_madds`: the forward's and the adjoint's arithmetic at the model's sparsity, one triangle of each "
    "symmetric matrix, the dense cotangent of T included.",
    "- `small_product_rate`: an (m, m) x (m, m) product into a preallocated output at the model's m, process CPU "
    "time (at m = 1, m = 2's rate). Two rates: BLAS's vectorised one (unreachable for loops over lists of "
    "nonzeros) and plain loops' (the one the ratios use).",
    "- Per step: process CPU time of `kalman_filter(..., cov_jitter=1e-8).loglik` (fwd) and of loglik + gradient "
    "w.r.t. every input (f+g). On the first `full steps` observations, less the first observation's, over `full "
    "steps` - 1; adjoint = f+g - fwd; n/a below 10 full steps.",
    "- Last row: one call of a local level at n=10 (the fixed cost of a call).",
    "",
    "What bounds the structural forward at about 3.4x its loop floor (the table: 2026-12-05 at load ~1 on the 2 "
    "cores):",
    "- 2026-12-03: a one-observable step is a rank-one update on P_t (no Cholesky, symmetrization or copy); "
    "the adjoint reverses it in four merged passes. Forward 3.06 -> 1.28 us per full step, f+g 7.9 -> 3.99.",
    "- 2026-12-04, from perf of logp + gradient: the per-step time went to marshalling the NamedTuple "
    "arguments of the stage calls (a 7 KB stack frame, pushes and spills before each call) and to passes that "
    "summed a matrix in one floating-point chain (`all_finite`: 103 ns at m = 13, latency-bound). The stages of "
    "a one-observable step are now inlined into the kernels; finiteness is tested by comparisons; "
    "symmetrizations run by whole rows; T P_f T^T and T^T G T are two passes of row axpys. Forward 1.28 -> "
    "0.84 us per full step, adjoint 2.71 -> 1.75, f+g 3.99 -> 2.58; the local level's per-step cost 0.50 -> "
    "0.13 us forward, 0.98 -> 0.41 us adjoint (the fixed cost that was left).",
    "- 2026-12-04, later: the sparse products with T no longer test finiteness inside (a third of a "
    "product's time at m = 13); the transposed copy between the two products tests W, the forward's second "
    "product computes P's upper triangle only, and one pass adds R Q R^T, mirrors, tests finiteness and takes "
    "the scale, after which the steady-state test stops at the first entry over its tolerance. The reverse sums "
    "G into the R, Q cotangent while it tests it, and skips sym(P_bar) where it is exactly symmetric. Same "
    "results bitwise; on pymc-extras' structural inputs (n = 240) forward 0.95 -> 0.85 us per step, adjoint "
    "1.30 -> 1.09.",
    "- 2026-12-05: the forward's second product reads W = T P_f's columns in place, in the pass that adds "
    "R Q R^T, mirrors and tests (no transposed copy of W; a row of T with one nonzero makes a row of P' a "
    "scaled column of W). Same results bitwise; forward 0.85 -> 0.79 us per step on pymc-extras' inputs.",
    "- 2026-12-05, later: the reverse of the one-observable update writes sym(P_f_bar) into P_bar itself and, "
    "where Z skips its zeros, adds the rank terms on the rows and columns of Z's nonzeros only: one pass over "
    "m x m fewer per reverse step, the gradient bitwise the same; adjoint 1.10-1.15 -> 1.09-1.10 us per step "
    "(pymc-extras' inputs, gradient w.r.t. a0, P0, H, Q; interleaved runs), within this machine's noise in "
    "the bench. Tried, no gain (the same day): the products with T on rows padded to 16 columns (fixed trip "
    "counts: 119-138 against 86-91 ns for W = T P_f), and W's rows summed in four scalar accumulators over "
    "the nonzeros of a row (121-138 against 97-168 ns). A pass over 13 x 13 stays at 50-110 ns whatever its "
    "trip counts or arithmetic: index and loop overhead, and a store-to-load chain per row axpy.",
    "- Remaining: loops over rows of 13 entries vectorise only in part (4 or 8 wide, then a scalar "
    "remainder); loops over lists of nonzeros load an index per row axpy; both triangles of P_f and P' are "
    "stored (they are outputs). Ablation of the forward (each stage run twice per step, 2026-12-04, before "
    "the 2026-12-05 change): the prediction of P (two products, the transposed copy, the add-and-test pass) was "
    "about 60% of a step, the rank-one update 12%, the mean recursion and likelihood under 10%. A pass over "
    "13 x 13 costs 60-110 ns whatever its arithmetic; the forward now makes about six per step.",
    "- Measured 2026-12-05, not built: the prediction of P as straight-line code generated for the structural "
    "T's nonzero pattern (T's values still read at run time; the same terms in the same order, so bitwise the "
    "same P') takes 165 ns against 455 ns for the loops over index lists (`spmm_rows` + `_sparse_congruence`), "
    "which would bring the forward to about 0.5 us per full step. But that one function took 10 s to compile "
    "(37 s with W as an array), once per nonzero pattern, and pymc-extras builds T at run time, so the pattern "
    "is known only at the first call: a cold-compile cost the compile targets rule out as it stands.",
    "- The adjoint's floor is dominated by T's dense cotangent (2 G T P_f: 2197 of 4086 multiply-adds, about 0.25 "
    "us by BLAS).",
])


def run_cost_model(quick: bool = False) -> list[Section]:
    min_time = 0.05 if quick else 0.3
    n = 120 if quick else 300
    sec = Section(
        title="Kalman filter: cost model, per full step against the floor",
        columns=[
            "case", "m, p", "nnz T, Z", "full steps (of n)", "fwd madds/step", "adjoint madds/step",
            "rate BLAS, loops (G madd/s)", "fwd floor BLAS, loops (us)", "fwd per step (us)", "fwd / loop floor",
            "adjoint loop floor (us)", "adjoint per step (us)", "adjoint / loop floor", "f+g per step (us)",
        ],
        notes=_COST_NOTES.format(n=n),
    )
    for label, model, tv in _cost_models(n):
        m, p = model["T"].shape[0], model["y"].shape[1]
        n_full = n - _fused_frozen(model, 1e-8, tv)
        f_madds, a_madds = step_madds(model)
        rate_blas, rate = (small_product_rate(max(m, 2), how, min_time) for how in (BLAS, LOOPS))
        cells = [
            label, f"{m}, {p}", f"{np.count_nonzero(model['T'])}, {np.count_nonzero(model['Z'])}",
            f"{n_full} (of {n})", f_madds, a_madds, f"{rate_blas / 1e9:.3g}, {rate / 1e9:.3g}",
            f"{1e6 * f_madds / rate_blas:.3g}, {1e6 * f_madds / rate:.3g}",
        ]
        if n_full < 10:
            sec.rows.append([*cells, *[float("nan")] * 6])
            continue
        heads = [dict(model, y=model["y"][:k], **{name: model[name][:k] for name in tv}) for k in (1, n_full)]
        t = {}
        for what in (0, 1):
            th = [_cpu_time(_fused_fns(h, 1e-8, tv)[what], [h[k] for k in NAMES], min_time) for h in heads]
            t[what] = (th[1] - th[0]) / (n_full - 1)
        t_adj = t[1] - t[0]
        sec.rows.append([
            *cells, 1e6 * t[0], t[0] * rate / f_madds, 1e6 * a_madds / rate, 1e6 * t_adj, t_adj * rate / a_madds,
            1e6 * t[1],
        ])
        if label.startswith("structural"):
            sec.targets.append(Target("structural: forward loop floor / forward per full step (>= 1/1.5)",
                                      f_madds / rate / t[0], 1 / 1.5))
    model = _model(1, 1, 10)
    fwd, grad = _fused_fns(model, 0.0)
    args = [model[k] for k in NAMES]
    sec.rows.append([
        "local level, n=10: one call (us)", "1, 1", "1, 1", "-", float("nan"), float("nan"), "-", "-",
        1e6 * _cpu_time(fwd, args, min_time), float("nan"), float("nan"), float("nan"), float("nan"),
        1e6 * _cpu_time(grad, args, min_time),
    ])
    return [sec]


# ---------------------------------------------------------------------------
# Univariate measurement update: crossover of kalman_filter(univariate=True / False)
# ---------------------------------------------------------------------------


def _dfm(m, p, n, seed=0, tv_h=False):
    """A dynamic factor model: m AR factors (diagonal T), p series loading on all of them, diagonal H
    (``tv_h``: H time-varying, so that the covariance never freezes and every step runs the update)."""
    rng = np.random.default_rng(seed)
    model = _model(m, p, n, seed)
    model["T"] = np.diag(rng.uniform(0.3, 0.9, m))
    model["H"] = np.diag(rng.uniform(0.2, 1.0, p))
    if tv_h:
        model["H"] = model["H"] * (1.0 + 0.1 * rng.random(size=(n, 1, 1)))
    return model


def _update_fns(tv, with_F=False):
    """Compiled ``kalman_filter(...).loglik`` (and ``forecast_error_cov`` when ``with_F``) for univariate
    False / True / "auto", unknown sizes (one compile serves every case); and the loglik + gradient for
    False / True."""
    from iterops.ts import kalman_filter

    nd = dict(y=2, a0=1, P0=2, c=1, d=1, T=2, Z=2, R=2, H=2 + ("H" in tv), Q=2)
    ins = [pt.tensor(name=k, dtype="float64", shape=(None,) * nd[k]) for k in NAMES]
    fwd, grad = {}, {}
    for uni in (False, True, "auto"):
        res = kalman_filter(*ins[:3], **dict(zip(NAMES[3:], ins[3:])), time_varying=tv, univariate=uni)
        fwd[uni] = pytensor.function(ins, [res.loglik, res.forecast_error_cov] if with_F else res.loglik,
                                     trust_input=True)
        if uni != "auto":
            grad[uni] = pytensor.function(ins, [res.loglik, *pytensor.grad(res.loglik, ins[1:])], trust_input=True)
    return fwd, grad


def run_univariate(quick: bool = False) -> list[Section]:
    min_time = 0.02 if quick else 0.1
    repeat = 3 if quick else 5
    n = 200
    ms_, ps_ = (2, 4, 8, 14, 20), (1, 2, 4, 8, 16)
    grid = Section(
        title="Kalman filter: univariate vs multivariate measurement update (forward time ratio)",
        columns=["m \\ p", *(f"p={p}" for p in ps_)],
        notes=(
            f"Dynamic factor models (`_dfm`: m AR(1) factors, p series, diagonal H), n={n}, H time-varying so that "
            "every step runs the update (no steady state).  Each entry: forward time of `kalman_filter(..., "
            "univariate=False).loglik` / `univariate=True` (> 1: the univariate update is faster), measured side by "
            "side; in parentheses the same when `forecast_error_cov` is an output too (the univariate steps then "
            "compute it).  `univariate='auto'` takes the univariate update where `prefers_univariate(m, p, need_F)`."
        ),
    )
    tv_fns, tvF_fns, st_fns = _update_fns(("H",)), _update_fns(("H",), with_F=True), _update_fns(())
    for m in ms_:
        row = [f"m={m}"]
        for p in ps_:
            ratios = []
            args = [_dfm(m, p, n, tv_h=True)[k] for k in NAMES]
            for fns in (tv_fns, tvF_fns):
                t = {uni: best_time(fns[0][uni], *args, min_time=min_time, repeat=repeat) for uni in (False, True)}
                ratios.append(t[False] / t[True])
            row.append(f"{ratios[0]:.2f} ({ratios[1]:.2f})")
        grid.rows.append(row)
    dfm = Section(
        title="Kalman filter: dynamic factor models, univariate measurement update",
        columns=[
            "case", "statsmodels fwd (ms)", "statsmodels univariate fwd (ms)", "iterops multivariate fwd (ms)",
            "iterops univariate fwd (ms)", "iterops auto fwd (ms)", "iterops multivariate f+g (ms)",
            "iterops univariate f+g (ms)", "fwd: multivariate / univariate", "f+g: multivariate / univariate",
        ],
        notes=(
            "n=200, static diagonal H (`_dfm`), known initialization.  statsmodels: `KalmanFilter.loglike`, "
            "conventional and `filter_univariate = True`.  iterops: `kalman_filter(..., univariate=False | True | "
            "'auto').loglik`, + `pytensor.grad` w.r.t. a0, P0 and the system matrices (the adjoint is the same for "
            "both: it recomputes each step's multivariate update from the stored predictions)."
        ),
    )
    for label, m, p in (("DFM m=3, p=12", 3, 12), ("m=14, p=4", 14, 4)):
        model = _dfm(m, p, n)
        args = [model[k] for k in NAMES]
        sm, smu = _statsmodels(model), _statsmodels(model, univariate=True)
        ll = {uni: float(st_fns[0][uni](*args)) for uni in (False, True, "auto")}
        for v in (smu(), *ll.values()):
            assert abs(v - sm()) <= 1e-8 * abs(sm()), (label, sm(), v)
        t = {k: best_time(f, min_time=min_time, repeat=repeat) for k, f in (("sm", sm), ("smu", smu))}
        for uni in (False, True, "auto"):
            t[uni] = best_time(st_fns[0][uni], *args, min_time=min_time, repeat=repeat)
        tg = {uni: best_time(st_fns[1][uni], *args, min_time=min_time, repeat=repeat) for uni in (False, True)}
        dfm.rows.append([
            label, ms(t["sm"]), ms(t["smu"]), ms(t[False]), ms(t[True]), ms(t["auto"]), ms(tg[False]), ms(tg[True]),
            t[False] / t[True], tg[False] / tg[True],
        ])
    return [grid, dfm]
