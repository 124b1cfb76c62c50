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
masking above).  Time-varying system matrices (``time_varying_names``: the
loop reads them as sequences, one matrix per step, e.g. a design matrix of
exogenous regressors) are passed to the fused filter as ``time_varying`` (the
rows the loop reads).

pymc-extras' other filters stay Scans, each for a reason shown on pymc-extras'
own outputs in ``tests/test_fusion_kalman.py``:

* ``UnivariateFilter`` (one observation at a time, a nested Scan reading only
  ``diag(H)``) equals the fused filter with ``H = diag(diag(H)) + j I`` (and
  ``j I`` added to the filtered covariance only) *except* where an
  observation's variance ``Z_i P Z_i^T + H_ii`` is exactly 0: it then skips the
  observation (``K = 0``, no ``log F + v^2 / F`` term, ``log 2 pi`` still
  counted), where every fused filter scores it with variance ``j`` (a
  log-likelihood ~1e7 apart).  That happens on ordinary inputs of its stated
  use case (no measurement error and a start ``P0`` singular in an observed
  direction), and ``H_ii > 0`` cannot be proved (``H = 0`` models;
  ``sigma**2`` underflows to 0).  Its observed-state outputs hold only the last
  component's ``y_hat`` and ``F`` per step, which no fused output gives.
* ``SquareRootFilter`` propagates Cholesky factors (QR updates).  Its
  ``stabilize(P_filtered, j)`` adds ``j I`` to the *factor* ``L``, so the
  covariance gets ``j (L + L^T) + j^2 I`` (signs of ``diag(L)`` from the QR), a
  different computation for every ``j > 0``.  With ``j = 0`` the candidate, the
  fused conventional filter, is less stable than the loop: on a near-singular
  start (``P0 = diag(1, 1e-14, 1e-14)``, ``H = 1e-14 I``) the loop is well
  conditioned (outputs move ~1e-10 relative under ulp perturbations) and the
  fused filter's states and log-likelihood are off by ~4e-5 relative, beyond
  the contract's tolerance; and ``j = 0`` makes the loop's ``cholesky(H)`` of a
  masked ``H`` fail (NaN) wherever a value is missing.
* ``ConvergentFilter`` stops the Riccati recursion at its tolerance and
  continues with the frozen gain (values differ from the full filter by the
  tolerance's effect: 3e-5 relative for ``tol=1e-3``), and its gradient is
  pymc-extras' own pullback, which averages the per-step cotangents (its
  gradient of a weighted sum of ``loglike_obs`` is not the filter's).  Its
  Scans (the stopped full filter, the fixed-gain tail, the backward pass) sit
  inside a ``SymbolicOp`` that PyTensor inlines at ``specialize``, after the
  fusion passes, so the rewrite never sees them.

``kalman_textbook`` -- the covariance form from a textbook (Durbin & Koopman
(2012) section 4.3), states ``(a, P)`` = the prediction of alpha_t, per-step
output the log-likelihood::

    def step(y, a, P, T, Z, R, H, Q):
        v = y - Z @ a                         # or y - Z @ a - d
        F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F)        # or pt.linalg.solve(F, Z @ P).T
        a_f = a + K @ v
        P_f = P - K @ Z @ P                   # or (pt.eye(m) - K @ Z) @ P, Joseph form, ...
        ll = -0.5 * (p * np.log(2 * np.pi) + pt.log(pt.linalg.det(F)) + v @ pt.linalg.inv(F) @ v)
        return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll    # T @ a_f + c with an intercept

``kalman_textbook_filtered`` -- the same filter written predict-then-update:
the states are the filtered moments ``(a_{t|t}, P_{t|t})`` (the loop starts
from ``a_{0|0}, P_{0|0}``), the step predicts ``a = T a + c``, ``P = T P T^T +
R Q R^T`` and then updates as above, returning ``(a_f, P_f, ll)``.  Replaced by
the fused filter started from the prediction of the loop's initial values; its
filtered moments are the loop's states.

Accepted spellings of both (each part independently; reference_loops'
``kalman_spelled_step`` writes them all):

==================  =====================================================================
innovation          ``y - Z a``, ``y - Z a - d`` (any order of the terms)
gain ``K``          ``P Z^T inv(F)``; ``solve(F, Z P).T``, ``solve(F, (P Z^T).T).T`` with
                    ``assume_a`` ``"gen"``, ``"sym"`` or ``"pos"``
identity            ``pt.eye(m)`` with ``m`` from ``a`` or ``P``, a constant ``eye``,
                    ``pt.identity_like(P)``
update ``P_f``      ``P - K Z P``; ``(I - K Z) P``; ``P - K F K^T``; Joseph form
                    ``(I - K Z) P (I - K Z)^T + K H K^T``
quadratic form      ``v @ inv(F) @ v``, ``v @ solve(F, v)`` (any ``assume_a``), ``pt.dot``, either
                    operand order; ``v @ cho_solve((L, True), v)`` and the whitened residual
                    ``sum(solve_triangular(L, v, lower=True) ** 2)`` with ``L = cholesky(F)``
log-likelihood      ``-0.5 (p log 2pi + log det F + q)`` (terms in any order);
                    ``-0.5 (log det(2 pi F) + q)``; ``slogdet(F)[1]``, ``2 sum(log(diag(L)))`` or
                    ``2 log(prod(diag(L)))`` for ``log det F``;
                    the ``-0.5`` distributed: ``-0.5 p log 2pi - 0.5 log det F - 0.5 q``;
                    ``pm.logp(pm.MvNormal.dist(mu=0, cov=F), v)`` or
                    ``pm.logp(pm.MvNormal.dist(mu=Z a (+ d), cov=F), y)``
prediction          ``T a_f`` or ``T a_f + c``; ``T P_f T^T + R Q R^T``
==================  =====================================================================

These quadratic forms and Cholesky log-determinants are not references of
their own: :mod:`iterops.fusion.canonical` rewrites them, in the user's step
and the reference alike, to ``v @ (inv(F) @ v)`` (``solve`` of any
``assume_a`` but ``"pos"``) or, for the spellings that factorise ``F``, to
``v @ cho_solve((L, True), v)`` and ``2 sum(log(diag(L)))`` (identities for a
symmetric ``F``).  The reference accepts both kinds because the check proves
``F`` positive semi-definite; where it is not numerically positive definite
the loop's factor fails (NaN, or a raise under FAST_COMPILE), and so does the
fused filter's (its -inf is returned as NaN).

``p log(2 pi)`` (or ``-p log(2 pi) / 2`` distributed) may be written as a
number: it is checked against ``y``'s static size.  The output order, argument
order and names are free.  Every spelling is the same filter in exact
arithmetic when ``K`` is the exact gain (the Joseph form and ``P - K F K^T``
equal ``P - K Z P`` then); the fused filter computes ``P - K Z P`` on one
triangle and mirrors it (exactly symmetric), so results agree to rounding for
well-conditioned ``F``.  The textbook loop has no missing-data handling: NaN
observations make its log-likelihood and states NaN from that step on, and so
does the replacement; its covariances stay finite, and so do the replacement's.
Where ``F`` cannot be factorised (singular, NaN or inf in it) the loop's
``inv(F)`` / ``solve(F, .)`` returns NaN (NUMBA) or raises (FAST_COMPILE); the
replacement's log-likelihood is NaN there and its states NaN from then on, as
the loop's.  ``pm.logp(pm.MvNormal.dist(...))`` raises where ``F`` is not positive definite;
the replacement raises too (``ParameterValueError``) where the fused filter's
Cholesky factor fails.  Spellings matched only when PyMC is already imported
(matching never imports it).

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

import sys

import numpy as np
import pytensor.tensor as pt
from pytensor.raise_op import CheckAndRaise

from iterops._constants import LOG_2PI
from iterops.fusion.matcher import Rejection, constant_value
from iterops.fusion.patterns._common import strip_leading_slices
from iterops.fusion.proofs import is_psd, is_symmetric
from iterops.fusion.registry import OneOf, Pattern, Role, one_of, register_pattern
from iterops.ts.kalman import SYSTEM_NAMES, SYSTEM_NDIM, kalman_filter

__all__: list[str] = []

_MVN_CONST = lambda: pt.log(2 * pt.constant(np.pi, dtype="float64"))  # noqa: E731  (as pymc-extras writes it)


def _sym(X):
    return 0.5 * (X + X.mT)


def _quad_sym(A, B):
    return _sym(A @ B @ A.mT)


# ---------------------------------------------------------------------------
# pymc-extras StandardFilter
# ---------------------------------------------------------------------------


def _pymc_extras_step(y, a, P, c, d, T, Z, R, H, Q, jitter, fill):
    """pymc-extras' ``BaseFilter.kalman_step`` + ``StandardFilter.update`` (system matrices static or, as
    sequences, time-varying: the step reads one matrix either way)."""
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


def _batch_source(v):
    """The batch of matrices a time-varying sequence reads: ``v`` without the row slices Scan adds and the
    shape assertions pymc-extras adds (each row of a batch of symmetric matrices is symmetric)."""
    while v.owner is not None:
        op = v.owner.op
        if isinstance(op, CheckAndRaise):
            v = v.owner.inputs[0]
            continue
        base, slices = strip_leading_slices(v)
        if base is v:
            break
        v = base
    return v


def _unproven(m, names, proof, what, declare):
    """A reason naming the first covariance input of ``names`` that ``proof`` cannot show to be ``what``,
    and the declaration (``assume(x, **declare)``) that would let the loop fuse."""
    for name in names:
        x = _batch_source(m.outer[name]) if name in m.time_varying else m.outer[name]
        if not proof(x):
            label = x.name or _COV_NAMES[name].split()[-1]
            facts = ", ".join(f"{k}=True" for k in declare)
            return (f"{_COV_NAMES[name]} is not provably {what} from how it is built (the fused filter reads "
                    f"its symmetric part and needs {what} inputs to compute what the loop computes); declare "
                    f"it with pytensor.assumptions.assume({label}, {facts}) if it is")
    return None


_COV_NAMES = {"P": "the initial covariance P0", "H": "the observation covariance H", "Q": "the state covariance Q"}


def _check_pymc_extras(m):
    jitter = _static_float(m, "jitter")
    if jitter is None or not np.isfinite(jitter) or jitter < 0:
        return "the covariance jitter is not a finite non-negative constant"
    if _static_float(m, "fill") is None:
        return "the missing-value sentinel is not a constant"
    # the step symmetrizes R Q R^T itself; it reads P0 and H raw
    return _unproven(m, ("P", "H"), is_symmetric, "symmetric", ("symmetric",))


def _missing(y, fill):
    return pt.or_(pt.isnan(y), pt.eq(y, fill))


def _system_inputs(m):
    """``(c, d, T, Z, R, H, Q)`` as the fused filter takes them, and its ``time_varying`` names.

    A matrix the loop reads as a sequence (pymc-extras' ``time_varying_names``) is passed with its
    rows ``[:n_steps]``, those the loop reads.
    """
    o = m.outer
    tv = tuple(n for n in SYSTEM_NAMES if n in m.time_varying)
    return [o[n][: m.n_steps] if n in m.time_varying else o[n] for n in SYSTEM_NAMES], tv


def _build_pymc_extras(m):
    o = m.outer
    jitter, fill = _static_float(m, "jitter"), _static_float(m, "fill")
    y = _n_steps_rows(m, o["y"])
    (c, d, T, Z, R, H, Q), tv = _system_inputs(m)
    res = kalman_filter(y, o["a"], o["P"], c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q, time_varying=tv,
                        cov_jitter=jitter, missing_value=fill)
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
            if "Z" in m.time_varying:
                y_hat = d + (Z @ res.predicted_state[:-1, :, None])[:, :, 0]
            else:
                y_hat = d + pt.tensordot(res.predicted_state[:-1], Z, axes=[[1], [1]])
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
    non_sequences=(*(Role(n, k, time_varying_ok=True) for n, k in SYSTEM_NDIM.items()),
                   Role("jitter", 0, constant_ok=True), Role("fill", 0, constant_ok=True)),
    outputs=(Role("a_filtered", 1), Role("y_hat", 1), Role("P_filtered", 2), Role("F", 2), Role("ll", 0)),
    provides={"a": "trace", "P": "trace"},
    check=_check_pymc_extras,
    build=_build_pymc_extras,
    doc="pymc-extras StandardFilter.kalman_step (static system matrices, missing-value masking)",
))


# ---------------------------------------------------------------------------
# Textbook covariance form
# ---------------------------------------------------------------------------


_SOLVERS = ("gen", "sym", "pos")

#: The step variants of both textbook patterns: ``(assume_a of the solves, intercepts c and d, loglik by
#: pm.logp)``.  The solves of one variant share ``assume_a``: PyTensor's canonicalization upgrades every
#: solve with ``F`` once one solve promises more about ``F`` (``"pos"``), in the user's graph and the
#: reference alike, so spellings of different ``assume_a`` cannot be alternatives of one reference.
#: Intercepts are variants, not alternatives, for a similar reason: rewrites lift ``expand_dims`` through
#: the innovation's subtraction, which an alternative would hide.
_TEXTBOOK_VARIANTS = tuple((s, i, mvn) for mvn in (False, True) for i in (False, True) for s in _SOLVERS)


def _gain(P, Z, F, solver):
    """The Kalman gain ``P Z^T F^{-1}`` as users write it: ``P Z^T inv(F)``, ``solve(F, Z P).T``, ..."""
    return one_of(P @ Z.T @ pt.linalg.inv(F),
                  pt.linalg.solve(F, Z @ P, assume_a=solver).T,
                  pt.linalg.solve(F, (P @ Z.T).T, assume_a=solver).T)


def _textbook_update(y, a, P, d, Z, H, log2pi_p, half_log2pi_p, variant):
    """The measurement update ``(a_f, P_f, ll)`` of the textbook filter, every accepted spelling a ``one_of``."""
    solver, intercepts, mvn = variant
    y_hat = Z @ a + d if intercepts else Z @ a
    v = y - Z @ a - d if intercepts else y - Z @ a
    F = Z @ P @ Z.T + H
    K = _gain(P, Z, F, solver)
    KT = one_of(*(k.T for k in K.owner.inputs))  # transposed alternatives canonicalize as the user's K.T
    # one alternative per gain for the mean (not a + one_of(...) @ v): canonicalization lifts the
    # expand_dims of a matrix-vector product through sums around it, which an opaque one_of would block
    a_f = one_of(*(a + k @ v for k in K.owner.inputs))
    eye = one_of(pt.eye(a.shape[0]), pt.eye(P.shape[0]), pt.eye(P.shape[1]), pt.identity_like(P))
    I_KZ = eye - K @ Z
    P_f = one_of(
        P - K @ Z @ P,                       # covariance form
        I_KZ @ P,                            # (I - K Z) P
        P - K @ F @ KT,                      # P - K F K^T
        I_KZ @ P @ I_KZ.T + K @ H @ KT,      # Joseph form
    )
    if mvn:
        return a_f, P_f, _mvn_loglik(v, y, y_hat, F)
    # the other spellings of v^T F^{-1} v (solve, cho_solve, a whitened residual, either operand order) and of
    # log det F by a Cholesky factor have one of these normal forms (iterops.fusion.canonical); those that
    # factorise F fail where it is not positive definite, as the fused filter does (the check proves F PSD)
    F_inv, L = pt.linalg.inv(F), pt.linalg.cholesky(F)
    quad = one_of(v @ F_inv @ v, v @ (F_inv @ v), v @ pt.linalg.cho_solve((L, True), v))
    logdet = one_of(pt.log(pt.linalg.det(F)), pt.linalg.slogdet(F)[1], 2 * pt.sum(pt.log(pt.diag(L))))
    ll = one_of(
        -0.5 * (log2pi_p + logdet + quad),
        -0.5 * (pt.log(pt.linalg.det(2 * np.pi * F)) + quad),
        half_log2pi_p - 0.5 * logdet - 0.5 * quad,   # the -0.5 distributed
    )
    return a_f, P_f, ll


def _mvn_loglik(v, y, y_hat, F):
    """``pm.logp(pm.MvNormal.dist(...), ...)`` of the innovation (mean 0) or of ``y`` (mean ``Z a (+ d)``).

    Only when PyMC is already imported (a user graph calling ``pm.logp`` imported it; the steps check
    :func:`_needs_pymc`): matching never imports PyMC.
    """
    pm = sys.modules["pymc"]
    mvn = pm.MvNormal.dist
    return one_of(
        pm.logp(mvn(mu=pt.zeros_like(v), cov=F), v),
        pm.logp(mvn(mu=0.0, cov=F), v),
        pm.logp(mvn(mu=y_hat, cov=F), y),
    )


def _textbook_predict(a_f, P_f, c, T, R, Q, intercepts):
    """``(T a_f (+ c), T P_f T^T + R Q R^T)``; with ``a_f`` a ``one_of``, one alternative per spelling of it."""
    alts = a_f.owner.inputs if a_f.owner is not None and isinstance(a_f.owner.op, OneOf) else [a_f]
    a_next = one_of(*(T @ x + c if intercepts else T @ x for x in alts))
    return a_next, T @ P_f @ T.T + R @ Q @ R.T


def _needs_pymc(variant) -> Rejection | None:
    """Why the step ``variant`` cannot be built: its log-likelihood is ``pm.logp`` and PyMC is not imported."""
    if variant[2] and "pymc" not in sys.modules:
        return Rejection("PyMC is not imported (no pm.logp in the loop)")
    return None


def _textbook_step(variant):
    """Update, then predict: the states are the predictions ``(a_t, P_t)``."""

    def step(y, a, P, c, d, T, Z, R, H, Q, log2pi_p, half_log2pi_p):
        if (why := _needs_pymc(variant)) is not None:
            return why
        a_f, P_f, ll = _textbook_update(y, a, P, d, Z, H, log2pi_p, half_log2pi_p, variant)
        a_next, P_next = _textbook_predict(a_f, P_f, c, T, R, Q, variant[1])
        return a_next, P_next, ll

    return step


def _filtered_step(variant):
    """Predict, then update: the states are the filtered ``(a_{t|t}, P_{t|t})``."""

    def step(y, a, P, c, d, T, Z, R, H, Q, log2pi_p, half_log2pi_p):
        if (why := _needs_pymc(variant)) is not None:
            return why
        a_p, P_p = _textbook_predict(a, P, c, T, R, Q, variant[1])
        return _textbook_update(y, a_p, P_p, d, Z, H, log2pi_p, half_log2pi_p, variant)

    return step


def _check_textbook(m):
    # with det(F) the loop runs on through an indefinite F, where the fused filter's Cholesky fails
    reason = _unproven(m, ("P", "H", "Q"), is_psd, "symmetric positive semi-definite",
                      ("symmetric", "positive_definite"))
    if reason or not m.uses.get("ll"):
        return reason
    p = m.outer["y"].type.shape[-1]
    for name, factor in (("log2pi_p", 1.0), ("half_log2pi_p", -0.5)):
        if name not in m.outer:
            continue  # a spelling without this constant (log det(2 pi F), pm.logp)
        if p is None:
            return "the observation dimension p (y's last axis) is not static, so p log(2 pi) cannot be checked"
        c, want = _static_float(m, name), factor * p * LOG_2PI
        if c is None or not np.isclose(c, want, rtol=1e-6 if m.dtype == "float32" else 1e-12, atol=0):
            what = "p log(2 pi)" if factor == 1.0 else "-p log(2 pi) / 2"
            return f"the log-likelihood constant {c} is not {what} = {want} for p = {p}"
    return None


def _textbook_filter(m, a0, P0):
    """The fused filter on the loop's rows of ``y``; returns (result, rows poisoned by a NaN observation)."""
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
    res = kalman_filter(pt.switch(missing, 0.0, y), a0, P0, c=c, d=d, T=o["T"], Z=o["Z"], R=o["R"], H=o["H"],
                        Q=o["Q"])
    return res, bad, c


def _loglik(m, res, bad):
    nan = np.array(np.nan, dtype=res.loglik_obs.dtype)
    # The fused filter says -inf where F's Cholesky factorisation fails (F singular, or NaN / inf in it);
    # there the loop's inv(F) or solve(F, .) raises (FAST_COMPILE) or returns NaN (NUMBA), so its
    # log-likelihood is NaN (or it raised), and so is every later one.
    ll = pt.switch(pt.or_(bad, pt.isneginf(res.loglik_obs)), nan, res.loglik_obs)
    if _TEXTBOOK_VARIANTS[m.variant][2]:
        # pm.logp(pm.MvNormal.dist(...)) raises (ParameterValueError) where F's Cholesky factor fails,
        # the fused filter returns -inf there
        from pymc.logprob.utils import CheckParameterValue  # noqa: PLC0415  (PyMC is imported: the loop uses it)

        ll = CheckParameterValue("posdef covariance")(ll, pt.all(pt.neq(res.loglik_obs, -np.inf)))
    return ll


def _build_textbook(m):
    o = m.outer
    res, bad, _ = _textbook_filter(m, o["a"], o["P"])
    nan = np.array(np.nan, dtype=res.loglik_obs.dtype)
    out = {"a": pt.switch(bad[:, None], nan, res.predicted_state[1:]), "P": res.predicted_cov[1:]}
    if m.uses.get("ll"):
        out["ll"] = _loglik(m, res, bad)
    return out


def _build_filtered(m):
    o = m.outer
    # the loop predicts first: the fused filter starts from the prediction of its initial (filtered) state
    c = o.get("c")
    a0 = o["T"] @ o["a"] + c if c is not None else o["T"] @ o["a"]
    P0 = o["T"] @ o["P"] @ o["T"].T + o["R"] @ o["Q"] @ o["R"].T
    res, bad, _ = _textbook_filter(m, a0, P0)
    nan = np.array(np.nan, dtype=res.loglik_obs.dtype)
    out = {"a": pt.switch(bad[:, None], nan, res.filtered_state), "P": res.filtered_cov}
    if m.uses.get("ll"):
        out["ll"] = _loglik(m, res, bad)
    return out


#: every textbook step computes its gain with one of these (canonicalization may turn a solve into a
#: factorization and triangular solves)
_GAIN_OPS = ("MatrixInverse", "Solve", "SolveTriangular", "Cholesky", "CholeskySolve", "LUFactor", "LUSolve",
             "LUFactorTridiagonal", "SolveLUFactorTridiagonal")

_TEXTBOOK_ROLES = dict(
    needs_ops=_GAIN_OPS,
    sequences=(Role("y", 1),),
    states=(Role("a", 1), Role("P", 2)),
    non_sequences=(Role("c", 1), Role("d", 1), Role("T", 2), Role("Z", 2), Role("R", 2), Role("H", 2),
                   Role("Q", 2), Role("log2pi_p", 0, constant_ok=True), Role("half_log2pi_p", 0, constant_ok=True)),
    outputs=(Role("ll", 0),),
    provides={"a": "trace", "P": "trace"},
    check=_check_textbook,
)

register_pattern(Pattern(
    name="kalman_textbook",
    replaces_with="iterops.ts.kalman_filter",
    step=tuple(_textbook_step(v) for v in _TEXTBOOK_VARIANTS),
    build=_build_textbook,
    doc="textbook covariance-form Kalman filter, update then predict (states: the predictions)",
    **_TEXTBOOK_ROLES,
))

register_pattern(Pattern(
    name="kalman_textbook_filtered",
    replaces_with="iterops.ts.kalman_filter",
    step=tuple(_filtered_step(v) for v in _TEXTBOOK_VARIANTS),
    build=_build_filtered,
    doc="textbook covariance-form Kalman filter, predict then update (states: the filtered moments)",
    **_TEXTBOOK_ROLES,
))
