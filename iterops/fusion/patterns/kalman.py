r"""Kalman filter loops -> :func:`iterops.ts.kalman_filter`.

Two families of loops are recognized; every state and per-step output the
user's loop returns may be used (the log-likelihoods, the predicted and
filtered states and covariances, ...); only those used are rebuilt from the
fused Op's outputs.

``kalman_pymc_extras`` -- pymc-extras' ``StandardFilter`` Scan
(``pymc_extras/statespace/filters/kalman_filter.py``), exactly as
``PyMCStateSpace.build_statespace_graph`` builds it for models whose system
matrices are all static (no ``time_varying_names``)::

    def kalman_step(y, a, P, c, d, T, Z, R, H, Q):
        nan_mask = isnan(y) | (y == missing_fill_value)
        W = diag(~nan_mask)                   # zero the missing rows
        y, Z, H, d = set_subtensor(y[nan_mask], 0), W Z, W H W^T, W d
        y_hat = d + Z a;  v = y - y_hat
        F = Z P Z^T + H + jitter I
        F_chol = cholesky(F * outer(obs, obs) + diag(1 - obs))
        K = cho_solve(F_chol, (P Z^T)^T)^T;  I_KZ = I - K Z
        a_f = a + K v;  P_f = sym(I_KZ P I_KZ^T) + sym(K H K^T) + jitter I
        ll = -(sum(obs) log 2 pi + 2 sum log diag F_chol + v^T cho_solve(F_chol, v)) / 2
        return a_f, T a_f + c, y_hat, P_f, sym(T P_f T^T) + sym(R Q R^T), F, ll

with ``jitter`` (``cov_jitter``) and ``missing_fill_value`` any constants
(jitter >= 0).  Replaced by ``kalman_filter(..., cov_jitter=jitter,
missing_value=missing_fill_value)``, whose docstring states the
correspondence of the outputs (``y_hat`` and ``F`` are rebuilt with the
masking above).  Loops over time-varying matrices (sequences) stay Scans.

``kalman_textbook`` -- the covariance form from a textbook (Durbin & Koopman
(2012) section 4.3), states ``(a, P)`` = the prediction of alpha_t, per-step
output the log-likelihood::

    def step(y, a, P, T, Z, R, H, Q):
        v = y - Z @ a                         # or y - Z @ a - d
        F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F)        # or pt.linalg.solve(F, Z @ P).T
        a_f = a + K @ v
        P_f = P - K @ Z @ P                   # or (pt.eye(m) - K @ Z) @ P
        ll = -0.5 * (p * np.log(2 * np.pi) + pt.log(pt.linalg.det(F)) + v @ pt.linalg.inv(F) @ v)
        #    the quadratic form may be v @ pt.linalg.solve(F, v)
        return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll    # T @ a_f + c with an intercept

Recognized spellings: the gain with ``inv(F)`` (and then ``v @ inv(F) @ v``)
or with ``solve(F, Z @ P).T`` (and then ``v @ solve(F, v)``), the update
``P - K Z P`` or ``(I - K Z) P``, with or without the intercepts ``c``
(state) and ``d`` (observation), the log-determinant as ``log(det(F))``; the
constant ``p log(2 pi)`` written as a number (checked against ``y``'s static
size).  The output order, argument order and names are free.  The fused filter
computes the same update on one triangle and mirrors it (exactly symmetric),
which is the same matrix in exact arithmetic: results agree to rounding for
well-conditioned ``F``.  The textbook loop has no missing-data handling: NaN observations make
its log-likelihood and states NaN from that step on, and so does the
replacement; its covariances stay finite, and so do the replacement's.

Both: the loop runs over the rows of ``y`` (``y[:n_steps]``), and only
``pytensor.scan``'s usual views of each output are used (the whole trace, its
last element).

Gradients with respect to the covariance inputs ``P0`` and ``H``: the fused
filter's adjoint is symmetric, the loop's is not (its Cholesky reads one
triangle of the unsymmetrized ``F``), so for the raw entries of these matrices
the two split each off-diagonal derivative differently between ``(i, j)`` and
``(j, i)``; the sums ``g_ij + g_ji``, hence the gradient along every symmetric
direction and with respect to any parameters the matrices are built from
(``sigma``, a Cholesky factor, ...), agree to rounding.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt

from iterops.fusion.matcher import constant_value
from iterops.fusion.proofs import is_psd, is_symmetric
from iterops.fusion.registry import Pattern, Role, register_pattern
from iterops.ts.kalman import kalman_filter

__all__: list[str] = []

_LOG_2PI = float(np.log(2.0 * np.pi))
_MVN_CONST = lambda: pt.log(2 * pt.constant(np.pi, dtype="float64"))  # noqa: E731  (as pymc-extras writes it)


def _sym(X):
    return 0.5 * (X + X.mT)


def _quad_sym(A, B):
    return _sym(A @ B @ A.mT)


# ---------------------------------------------------------------------------
# pymc-extras StandardFilter
# ---------------------------------------------------------------------------


def _pymc_extras_step(y, a, P, c, d, T, Z, R, H, Q, jitter, fill):
    """pymc-extras' ``BaseFilter.kalman_step`` + ``StandardFilter.update`` (static matrices)."""
    nan_mask = pt.or_(pt.isnan(y), pt.eq(y, fill))
    W = pt.diag(pt.bitwise_not(nan_mask).astype(y.dtype))
    y_m = pt.set_subtensor(y[nan_mask], 0.0)
    Z_m, H_m, d_m = W.dot(Z), W.dot(H).dot(W.mT), W.dot(d)
    # StandardFilter.update
    y_hat = d_m + Z_m @ a
    v = y_m - y_hat
    PZT = P.dot(Z_m.mT)
    F = Z_m.dot(PZT) + (H_m + pt.identity_like(H_m) * jitter)
    observed = pt.bitwise_not(nan_mask).astype(F.dtype)
    F_scored = F * pt.outer(observed, observed) + pt.diag(1 - observed)
    F_chol = pt.linalg.cholesky(F_scored, lower=True)
    K = pt.linalg.cho_solve((F_chol, True), PZT.mT).mT
    I_KZ = pt.eye(a.shape[0]) - K.dot(Z_m)
    a_filtered = a + K @ v
    P_filtered = _quad_sym(I_KZ, P) + _quad_sym(K, H_m)
    F_inv_v = pt.linalg.cho_solve((F_chol, True), v)
    inner_term = v.T @ F_inv_v
    F_logdet = 2 * pt.log(pt.diag(F_chol)).sum()
    ll = -0.5 * (observed.sum() * _MVN_CONST() + F_logdet + inner_term).ravel()[0]
    # kalman_step: stabilize, predict
    P_filtered = P_filtered + pt.identity_like(P_filtered) * jitter
    a_hat = T @ a_filtered + c
    P_hat = _quad_sym(T, P_filtered) + _quad_sym(R, Q)
    return a_hat, P_hat, a_filtered, y_hat, P_filtered, F, ll


def _static_float(m, name):
    v = m.outer[name]
    c = constant_value(v)
    return None if c is None else float(c)


def _n_steps_rows(m, y):
    """The rows of the sequence ``y`` the loop reads."""
    return y[: m.n_steps]


def _unproven(m, names, proof, what):
    """A reason naming the first covariance input of ``names`` that ``proof`` cannot show to be ``what``."""
    for name in names:
        if not proof(m.outer[name]):
            return (f"{_COV_NAMES[name]} is not provably {what} from how it is built (the fused filter reads "
                    f"its symmetric part and needs {what} inputs to compute what the loop computes)")
    return None


_COV_NAMES = {"P": "the initial covariance P0", "H": "the observation covariance H", "Q": "the state covariance Q"}


def _check_pymc_extras(m):
    jitter = _static_float(m, "jitter")
    if jitter is None or not np.isfinite(jitter) or jitter < 0:
        return "the covariance jitter is not a finite non-negative constant"
    if _static_float(m, "fill") is None:
        return "the missing-value sentinel is not a constant"
    # the step symmetrizes R Q R^T itself; it reads P0 and H raw
    return _unproven(m, ("P", "H"), is_symmetric, "symmetric")


def _missing(y, fill):
    return pt.or_(pt.isnan(y), pt.eq(y, fill))


def _build_pymc_extras(m):
    o = m.outer
    jitter, fill = _static_float(m, "jitter"), _static_float(m, "fill")
    y = _n_steps_rows(m, o["y"])
    res = kalman_filter(y, o["a"], o["P"], c=o["c"], d=o["d"], T=o["T"], Z=o["Z"], R=o["R"], H=o["H"],
                        Q=o["Q"], cov_jitter=jitter, missing_value=fill)
    out = {
        "a": res.predicted_state[1:],
        "P": res.predicted_cov[1:],
        "a_filtered": res.filtered_state,
        "P_filtered": res.filtered_cov,
        # a failed Cholesky factorisation: the loop's (on_error="nan") NaN where the fused filter says -inf
        "ll": pt.switch(pt.isneginf(res.loglik_obs), np.nan, res.loglik_obs),
    }
    uses = m.uses
    if uses.get("y_hat") or uses.get("F"):
        miss = _missing(y, fill)
        obs = pt.cast(~miss, res.forecast_error_cov.dtype)
        if uses.get("y_hat"):
            y_hat = o["d"] + pt.tensordot(res.predicted_state[:-1], o["Z"], axes=[[1], [1]])
            out["y_hat"] = pt.switch(miss, 0.0, y_hat)
        if uses.get("F"):
            p = res.forecast_error_cov.shape[-1]
            out["F"] = (res.forecast_error_cov * obs[:, :, None] * obs[:, None, :]
                        + pt.eye(p) * ((1.0 - obs) * jitter)[:, :, None])
    return out


register_pattern(Pattern(
    name="kalman_pymc_extras",
    replaces_with="iterops.ts.kalman_filter",
    step=(_pymc_extras_step,),
    sequences=(Role("y", 1),),
    states=(Role("a", 1), Role("P", 2)),
    non_sequences=(Role("c", 1), Role("d", 1), Role("T", 2), Role("Z", 2), Role("R", 2), Role("H", 2),
                   Role("Q", 2), Role("jitter", 0, constant_ok=True), Role("fill", 0, constant_ok=True)),
    outputs=(Role("a_filtered", 1), Role("y_hat", 1), Role("P_filtered", 2), Role("F", 2), Role("ll", 0)),
    provides={"a": "trace", "P": "trace"},
    check=_check_pymc_extras,
    build=_build_pymc_extras,
    doc="pymc-extras StandardFilter.kalman_step (static system matrices, missing-value masking)",
))


# ---------------------------------------------------------------------------
# Textbook covariance form
# ---------------------------------------------------------------------------


def _textbook_step(gain, update, intercepts):
    def step(y, a, P, c, d, T, Z, R, H, Q, log2pi_p):
        v = y - Z @ a - d if intercepts else y - Z @ a
        F = Z @ P @ Z.T + H
        if gain == "inv":
            F_inv = pt.linalg.inv(F)
            K = P @ Z.T @ F_inv
            quad = v @ F_inv @ v
        else:
            K = pt.linalg.solve(F, Z @ P).T
            quad = v @ pt.linalg.solve(F, v)
        a_f = a + K @ v
        P_f = P - K @ Z @ P if update == "minus" else (pt.eye(a.shape[0]) - K @ Z) @ P
        ll = -0.5 * (log2pi_p + pt.log(pt.linalg.det(F)) + quad)
        a_next = T @ a_f + c if intercepts else T @ a_f
        return a_next, T @ P_f @ T.T + R @ Q @ R.T, ll

    return step


def _check_textbook(m):
    # with det(F) the loop runs on through an indefinite F, where the fused filter's Cholesky fails
    reason = _unproven(m, ("P", "H", "Q"), is_psd, "symmetric positive semi-definite")
    if reason or not m.uses.get("ll"):
        return reason
    c = _static_float(m, "log2pi_p")
    p = m.outer["y"].type.shape[-1]
    if p is None:
        return "the observation dimension p (y's last axis) is not static, so p log(2 pi) cannot be checked"
    if c is None or not np.isclose(c, p * _LOG_2PI, rtol=1e-6 if m.dtype == "float32" else 1e-12, atol=0):
        return f"the log-likelihood constant {c} is not p log(2 pi) = {p * _LOG_2PI} for p = {p}"
    return None


def _build_textbook(m):
    o = m.outer
    y = _n_steps_rows(m, o["y"])
    m_dim, p_dim = o["a"].shape[-1], y.shape[-1]
    c = o.get("c", pt.zeros((m_dim,), dtype=m.dtype))
    d = o.get("d", pt.zeros((p_dim,), dtype=m.dtype))
    # The loop has no missing-data handling: a NaN observation poisons its states and log-likelihoods from
    # that step on, while its covariances, which never read y, stay finite.  The fused filter skips NaN
    # rows, so it runs on y with NaN read as 0 (the covariance recursion is the loop's) and the poisoned
    # entries are set to NaN afterwards.
    missing = pt.isnan(y)
    bad = pt.gt(pt.cumsum(pt.cast(pt.any(missing, axis=-1), "int64")), 0)
    res = kalman_filter(pt.switch(missing, 0.0, y), o["a"], o["P"], c=c, d=d, T=o["T"], Z=o["Z"], R=o["R"],
                        H=o["H"], Q=o["Q"])
    nan = np.array(np.nan, dtype=res.loglik_obs.dtype)
    return {
        "a": pt.switch(bad[:, None], nan, res.predicted_state[1:]),
        "P": res.predicted_cov[1:],
        "ll": pt.switch(bad, nan, res.loglik_obs),
    }


register_pattern(Pattern(
    name="kalman_textbook",
    replaces_with="iterops.ts.kalman_filter",
    step=tuple(_textbook_step(g, u, i) for i in (False, True) for g in ("inv", "solve") for u in ("minus", "factor")),
    sequences=(Role("y", 1),),
    states=(Role("a", 1), Role("P", 2)),
    non_sequences=(Role("c", 1), Role("d", 1), Role("T", 2), Role("Z", 2), Role("R", 2), Role("H", 2),
                   Role("Q", 2), Role("log2pi_p", 0, constant_ok=True)),
    outputs=(Role("ll", 0),),
    provides={"a": "trace", "P": "trace"},
    check=_check_textbook,
    build=_build_textbook,
    doc="textbook covariance-form Kalman filter (predict/update with inv or solve, loglik via det)",
))
