"""Kalman filter: iterops vs statsmodels (forward) and pymc-extras' StandardFilter (forward + gradient).

Cases: a small multivariate model (m=4, p=2, n=500), a larger one (m=20, p=5, n=200) and a long
univariate local level (n=10,000); then real model matrices (structural, SARIMAX, VAR, dense m=20)
with pymc-extras' arithmetic (``cov_jitter=1e-8``): :func:`run_real_models`; then the univariate
measurement update (``kalman_filter(univariate=...)``): the crossover grid its automatic rule comes
from and dynamic factor models, :func:`run_univariate`.
All PyTensor functions compile in PyTensor's default mode (Numba linker).
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt

from benchmarks._harness import Section, Target, best_time, compile_time, ms

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


def run(quick: bool = False) -> list[Section]:
    min_time = 0.05 if quick else 0.3
    repeat = 3 if quick else 5
    sec = Section(
        title="Kalman filter: iterops.ts.kalman_filter",
        columns=[
            "case", "statsmodels loglik (ms)", "iterops loglik (ms)", "fwd speed-up",
            "pymc-extras loglik+grad (ms)", "iterops loglik+grad (ms)", "fwd+grad speed-up",
            "pymc-extras compile (s)", "iterops compile (s)", "compile ratio",
        ],
        notes=(
            "statsmodels: `KalmanFilter.loglike` (Cython, known initialization, its steady-state shortcut on). "
            "pymc-extras: `StandardFilter().build_graph` log-likelihood + `pytensor.grad` (Scan), default mode. "
            "iterops: `kalman_filter(...).loglik` (+ `pytensor.grad`), default mode, cov_jitter=0. "
            "Compile = graph construction + `pytensor.function` + first call (loglik+grad), warm on-disk caches."
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
    return [sec, run_real_models(quick), *run_univariate(quick)]


# ---------------------------------------------------------------------------
# Real model matrices (issue 18): statsmodels-built systems, pymc-extras' arithmetic (cov_jitter=1e-8)
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
    """(label, statsmodels model bound to simulated data, our input dict): the issue's four cases."""
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


def _fused_fns(model, jitter):
    from iterops.ts import kalman_filter

    ins = _inputs(model)
    y, a0, P0, c, d, T, Z, R, H, Q = ins
    res = kalman_filter(y, a0, P0, c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q, cov_jitter=jitter, missing_value=-9999.0)
    fwd = pytensor.function(ins, [res.loglik, res.predicted_cov], trust_input=True)
    grad = pytensor.function(ins, [res.loglik, *pytensor.grad(res.loglik, ins[1:])], trust_input=True)
    return fwd, grad


def _pymc_extras_scan(model):
    from pymc_extras.statespace.filters.kalman_filter import StandardFilter

    ins = _inputs(model)
    ll = StandardFilter(cov_jitter=1e-8).build_graph(*ins)[-1].sum()
    mode = pytensor.compile.get_default_mode().excluding("iterops")
    return pytensor.function(ins, [ll, *pytensor.grad(ll, ins[1:])], trust_input=True, mode=mode)


def _flop_rate():
    """Double-precision flop rate of one large matrix product (BLAS), flops per second."""
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(500, 500)), rng.normal(size=(500, 500))
    return 2 * 500**3 / best_time(np.dot, A, B, min_time=0.2, repeat=5)


def _flop_estimate(m, p, n_full, n_steady):
    """Flops of the forward filter: a full step (P Z', F, Cholesky, gain, P_f on one triangle, T P_f T')
    ``3 m^3 + 3 m^2 p + 3 m p^2 + p^3/3``; a steady step (v, F^{-1} v, a + K v, T a_f) ``4 m p + 2 m^2 + 2 p^2``."""
    full = 3 * m**3 + 3 * m**2 * p + 3 * m * p**2 + p**3 / 3
    steady = 4 * m * p + 2 * m**2 + 2 * p**2
    return n_full * full + n_steady * steady


def run_real_models(quick: bool = False) -> Section:
    min_time = 0.05 if quick else 0.3
    repeat = 3 if quick else 5
    n = 120 if quick else 300
    sec = Section(
        title="Kalman filter on real model matrices (pymc-extras' arithmetic: cov_jitter=1e-8)",
        columns=[
            "case", "statsmodels fwd (ms)", "pymc-extras Scan f+g (ms)", "iterops fwd (ms)", "iterops f+g (ms)",
            "iterops f+g, jitter 0 (ms)", "flop estimate fwd (ms)", "fwd vs statsmodels", "f+g vs pymc-extras",
            "fwd / flop estimate",
        ],
        notes=(
            f"n={n} simulated observations per model.  System matrices from statsmodels at fixed parameters "
            "(`UnobservedComponents('lltrend', seasonal=12)`, `SARIMAX`, `VARMAX(order=(2, 0))`, and the random "
            "dense model of the section above), known initialization (stationary P0, or 10 I for the structural "
            "model) for every filter.  statsmodels: `ssm.loglike()` (conventional filter, its steady state). "
            "pymc-extras: `StandardFilter(cov_jitter=1e-8).build_graph` log-likelihood + `pytensor.grad`, compiled "
            "with `mode.excluding('iterops')` (the Scan, not fused).  iterops: `kalman_filter(..., cov_jitter=1e-8, "
            "missing_value=-9999.0)` log-likelihood (+ gradient w.r.t. a0, P0 and every system matrix); the "
            "jitter-0 column is the same without jitter.  Flop estimate: the forward filter's flop count "
            "(`_flop_estimate`: the full steps before the covariance converged, as counted from iterops' output, then "
            "mean-only steps) at the flop rate of one 500x500 BLAS matrix product on this machine.\n\n"
            "Why the structural targets are not met (measured 2026-12-02, n=300, at load 5-7; see issue 18's "
            "note): (1) the structural model never reaches a steady state, with or without jitter: the relative "
            "change of the predicted covariance per step is 1e-1 at t=10, 2e-3 at t=100 and 1.8e-5 at t=299 "
            "against the shortcut's tolerance of 1e-14, and a dense NumPy filter of the same recursion converges "
            "only at step 1655 (the closed loop's largest eigenvalue is 0.992), so every step is a full step and "
            "no tolerance or jitter change could legitimately help; statsmodels runs the same full steps.  (2) "
            "The forward's full step costs about 2.7 us (loaded) of scalar-loop arithmetic with the structured "
            "products of `T`/`Z` (about 1.5-1.8x statsmodels); 3x needs about 1.5x fewer operations per step or "
            "vectorised loops, which change the summation order.  (3) The adjoint is most of f+g: it recomputes "
            "each step's update and spends about 7 us per step (loaded) in scalar loops (perf: 75% of samples in "
            "the compiled loops, 4.4% in BLAS including the dense `T` cotangent, 3% malloc/free), so `T`'s dense "
            "cotangent is not the bound; 25x needs the update's reverse loops merged and the forward's stored "
            "update reused.  Since 2026-12-02 a reverse step no longer rebuilds the steady-stretch cache (1.4-1.6x "
            "faster adjoint here) and thin products no longer go to BLAS.  SARIMAX enters its steady state at "
            "step 123 (178 frozen steps; the adjoint's Lyapunov-summed shortcut needs 256, so it runs them "
            "exactly).  Earlier tables' 'jitter 0 slower than jitter 1e-8' for SARIMAX did not reproduce in "
            "same-process repeats (both do identical work): it was load noise."
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
        ll_ours, Pp = fwd(*args)
        ll_theirs = float(theirs(*args)[0])
        assert abs(ll_sm - float(ll_ours)) <= 1e-6 * abs(ll_sm), (label, ll_sm, ll_ours)
        assert abs(ll_theirs - float(ll_ours)) <= 1e-6 * abs(ll_sm), (label, ll_theirs, ll_ours)
        n_steady = sum(np.array_equal(Pp[t], Pp[t - 1]) for t in range(1, n + 1))
        t_flops = _flop_estimate(m, p, n - n_steady, n_steady) / rate
        ts = best_time(mod.ssm.loglike, min_time=min_time, repeat=repeat)
        tf = best_time(fwd, *args, min_time=min_time, repeat=repeat)
        tg_theirs = best_time(theirs, *args, min_time=min_time, repeat=repeat)
        tg = best_time(grad, *args, min_time=min_time, repeat=repeat)
        tg0 = best_time(grad0, *args, min_time=min_time, repeat=repeat)
        sec.rows.append([
            label, ms(ts), ms(tg_theirs), ms(tf), ms(tg), ms(tg0), ms(t_flops), ts / tf, tg_theirs / tg, tf / t_flops,
        ])
        if label.startswith("structural"):
            sec.targets += [
                Target("structural: forward vs statsmodels", ts / tf, 3.0),
                Target("structural: forward+gradient vs pymc-extras' Scan (jitter on)", tg_theirs / tg, 25.0),
            ]
        if label.startswith("dense"):
            sec.targets.append(Target("dense m=20: flop estimate / forward (>= 1/1.5)", t_flops / tf, 1 / 1.5))
    return sec


# ---------------------------------------------------------------------------
# Univariate measurement update (issue 18): crossover of kalman_filter(univariate=True / False)
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
