"""Kalman filter: iterops vs statsmodels (forward) and pymc-extras' StandardFilter (forward + gradient).

Cases: a small multivariate model (m=4, p=2, n=500), a larger one (m=20, p=5, n=200) and a long
univariate local level (n=10,000).
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


def _statsmodels(model):
    from statsmodels.tsa.statespace.kalman_filter import KalmanFilter

    y = model["y"]
    n, p = y.shape
    m = model["a0"].shape[0]
    kf = KalmanFilter(k_endog=p, k_states=m, k_posdef=m)
    kf.bind(np.asfortranarray(y.T))
    for k, name in dict(T="transition", Z="design", R="selection", H="obs_cov", Q="state_cov").items():
        kf[name] = model[k]
    kf.initialize_known(model["a0"], model["P0"])
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
        fn = pytensor.function(ins, [ll, *pytensor.grad(ll, ins[1:])], trust_input=True)
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
    return [sec]
