"""The loops iterops replaces, written once as users write them with ``pytensor.scan``.

These are the *specification* of what each fused Op and each Scan-fusion
pattern must reproduce: tests compare against them (compiled with
``mode.excluding("iterops")`` so nothing rewrites them), benchmarks time them,
the demo fits models with them.  Each loop function takes an optional
``step`` (same signature as the default one) and extra ``pytensor.scan``
keyword arguments, so the fusion fuzzer can build mutants of exactly these
loops.

Every step follows ``pytensor.scan``'s calling convention
``step(*sequences, *states, *non_sequences)``.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.scan.utils import until

from iterops._constants import LOG_2PI

__all__ = [
    "doubling_step", "doubling_loop", "fixed_point_step", "fixed_point_loop", "block_diag_step", "block_diag_loop",
    "kalman_textbook_step", "kalman_textbook_loop", "kalman_spelled_step", "kalman_filtered_step",
    "kalman_filtered_loop", "levinson_step", "levinson_loop", "levinson_spelled_step", "LEVINSON_V_UPDATES",
    "block_diag_backwards_loop",
]


# ---------------------------------------------------------------------------
# Discrete Lyapunov equation A X A^T - X + Q = 0
# ---------------------------------------------------------------------------


def doubling_step(alpha, gamma, tol):
    """Smith's doubling: gamma_{k+1} = gamma_k + alpha_k gamma_k alpha_k^T, alpha_{k+1} = alpha_k^2."""
    new_gamma = gamma + alpha @ gamma @ alpha.T
    return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)


def doubling_loop(A, Q, tol=1e-12, n_steps=100, *, step=doubling_step, **scan_kwargs):
    """The stationary covariance by Smith doubling until the max-abs change is below ``tol``: ``gammas[-1]``."""
    _, gammas = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[pt.as_tensor(tol)], n_steps=n_steps,
                              return_updates=False, **scan_kwargs)
    return gammas[-1]


def fixed_point_step(X, A, Q, tol):
    """The fixed-point iteration X_{k+1} = A X_k A^T + Q."""
    X_new = A @ X @ A.T + Q
    return X_new, until(pt.max(pt.abs(X_new - X)) < tol)


def fixed_point_loop(A, Q, X0=None, tol=1e-12, n_steps=5000, *, step=fixed_point_step, **scan_kwargs):
    """X <- A X A^T + Q from ``X0`` (zeros by default) until the max-abs change is below ``tol``: ``Xs[-1]``."""
    X0 = pt.zeros_like(Q) if X0 is None else X0
    Xs = pytensor.scan(step, outputs_info=[X0], non_sequences=[A, Q, pt.as_tensor(tol)], n_steps=n_steps,
                       return_updates=False, **scan_kwargs)
    return Xs[-1]


def damped_fixed_point_step(X, A, Q, w, tol):
    """The damped fixed-point iteration X_{k+1} = (1 - w) X_k + w (A X_k A^T + Q) (same limit for w != 0)."""
    X_new = (1 - w) * X + w * (A @ X @ A.T + Q)
    return X_new, until(pt.max(pt.abs(X_new - X)) < tol)


def damped_fixed_point_loop(A, Q, w, X0=None, tol=1e-12, n_steps=5000, *, step=damped_fixed_point_step,
                            **scan_kwargs):
    """X <- (1 - w) X + w (A X A^T + Q) from ``X0`` (zeros by default) until the max-abs change is below
    ``tol``: ``Xs[-1]``."""
    X0 = pt.zeros_like(Q) if X0 is None else X0
    Xs = pytensor.scan(step, outputs_info=[X0], non_sequences=[A, Q, pt.as_tensor(w), pt.as_tensor(tol)],
                       n_steps=n_steps, return_updates=False, **scan_kwargs)
    return Xs[-1]


__all__ += ["damped_fixed_point_step", "damped_fixed_point_loop"]


# ---------------------------------------------------------------------------
# Block-diagonal assembly of a (k, n, m) tensor
# ---------------------------------------------------------------------------


def block_diag_step(i, out, x):
    """Write block ``x[i]`` at block position ``(i, i)``."""
    n, m = x.shape[1], x.shape[2]
    return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], x[i])


def block_diag_loop(x, *, step=block_diag_step, **scan_kwargs):
    """``(k, n, m) -> (k n, k m)``: the blocks of ``x`` on the diagonal of a zero matrix."""
    k, n, m = x.shape
    outs = pytensor.scan(step, sequences=[pt.arange(k)], outputs_info=[pt.zeros((k * n, k * m), dtype=x.dtype)],
                         non_sequences=[x], return_updates=False, **scan_kwargs)
    return outs[-1]


# ---------------------------------------------------------------------------
# Kalman filter, covariance form (Durbin & Koopman 2012, section 4.3)
# ---------------------------------------------------------------------------


def kalman_textbook_step(y, a, P, T, Z, R, H, Q, log2pi_p):
    """One predict/update step; states are the predictions ``(a_t, P_t)``, the output the log-likelihood.

    ``log2pi_p`` is the constant ``p log(2 pi)``.
    """
    v = y - Z @ a
    F = Z @ P @ Z.T + H
    F_inv = pt.linalg.inv(F)
    K = P @ Z.T @ F_inv
    a_f = a + K @ v
    P_f = P - K @ Z @ P
    ll = -0.5 * (log2pi_p + pt.log(pt.linalg.det(F)) + v @ F_inv @ v)
    return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll


#: The spellings :func:`kalman_spelled_step` writes (each is the same filter in exact arithmetic).
KALMAN_GAINS = ("inv", "solve", "solve_pos")
KALMAN_UPDATES = ("minus", "factor", "kfk", "joseph")
KALMAN_LOGLIKS = ("det", "logdet_first", "det2pi", "slogdet", "distributed", "dot", "mvn_v", "mvn_y")


def kalman_spelled_step(gain="inv", update="minus", loglik="det", *, intercepts=False, predict_first=False):
    """A textbook filter step in one of the spellings users write.

    ``gain``: ``"inv"`` (``K = P Z^T inv(F)``, quadratic form ``v @ inv(F) @ v``), ``"solve"`` /
    ``"solve_pos"`` (``K = solve(F, Z P).T``, ``v @ solve(F, v)``, ``assume_a="gen"`` / ``"pos"``).
    ``update``: ``"minus"`` ``P - K Z P``, ``"factor"`` ``(I - K Z) P``, ``"kfk"`` ``P - K F K^T``,
    ``"joseph"`` ``(I - K Z) P (I - K Z)^T + K H K^T``.
    ``loglik``: ``"det"`` ``-0.5 (p log 2pi + log det F + q)``, ``"logdet_first"`` ``-0.5 (log det F
    + p log 2pi + q)``, ``"det2pi"`` ``-0.5 (log det(2 pi F) + q)``, ``"slogdet"`` (``slogdet(F)[1]``),
    ``"distributed"`` ``-0.5 p log 2pi - 0.5 log det F - 0.5 q``, ``"dot"`` (``pt.dot`` for ``q``),
    ``"mvn_v"`` ``pm.logp(pm.MvNormal.dist(mu=0, cov=F), v)``, ``"mvn_y"`` ``pm.logp(pm.MvNormal.dist(
    mu=Z a + d, cov=F), y)`` (these two need PyMC).
    ``intercepts``: ``c`` and ``d`` come after the states (``v = y - Z a - d``, ``T a_f + c``).
    ``predict_first``: the states are the filtered moments ``(a_{t-1|t-1}, P_{t-1|t-1})``; the step
    predicts, then updates, and returns the filtered moments of step t (see :func:`kalman_filtered_loop`).

    Signature: ``step(y, a, P, [c, d,] T, Z, R, H, Q, log2pi_p)`` returning ``(a, P, ll)``.
    """

    def update_(y, a, P, d, Z, H, log2pi_p):
        v = y - Z @ a - d if d is not None else y - Z @ a
        F = Z @ P @ Z.T + H
        if gain == "inv":
            F_inv = pt.linalg.inv(F)
            K = P @ Z.T @ F_inv
            quad = pt.dot(v, pt.dot(F_inv, v)) if loglik == "dot" else v @ F_inv @ v
        else:
            assume_a = "pos" if gain == "solve_pos" else "gen"
            K = pt.linalg.solve(F, Z @ P, assume_a=assume_a).T
            F_inv_v = pt.linalg.solve(F, v, assume_a=assume_a)
            quad = pt.dot(v, F_inv_v) if loglik == "dot" else v @ F_inv_v
        a_f = a + K @ v
        I_KZ = pt.eye(a.shape[0]) - K @ Z
        P_f = {"minus": lambda: P - K @ Z @ P, "factor": lambda: I_KZ @ P, "kfk": lambda: P - K @ F @ K.T,
               "joseph": lambda: I_KZ @ P @ I_KZ.T + K @ H @ K.T}[update]()
        if loglik in ("det", "dot"):
            ll = -0.5 * (log2pi_p + pt.log(pt.linalg.det(F)) + quad)
        elif loglik == "logdet_first":
            ll = -0.5 * (pt.log(pt.linalg.det(F)) + log2pi_p + quad)
        elif loglik == "det2pi":
            ll = -0.5 * (pt.log(pt.linalg.det(2 * np.pi * F)) + quad)
        elif loglik == "slogdet":
            _, logdet = pt.linalg.slogdet(F)
            ll = -0.5 * (log2pi_p + logdet + quad)
        elif loglik == "distributed":
            ll = -0.5 * log2pi_p - 0.5 * pt.log(pt.linalg.det(F)) - 0.5 * quad
        else:
            import pymc as pm  # noqa: PLC0415  (only these two spellings need PyMC)

            if loglik == "mvn_v":
                ll = pm.logp(pm.MvNormal.dist(mu=0.0, cov=F), v)
            else:
                ll = pm.logp(pm.MvNormal.dist(mu=Z @ a + d if d is not None else Z @ a, cov=F), y)
        return a_f, P_f, ll

    def predict_(a_f, P_f, c, T, R, Q):
        return (T @ a_f + c if c is not None else T @ a_f), T @ P_f @ T.T + R @ Q @ R.T

    def body(y, a, P, c, d, T, Z, R, H, Q, log2pi_p):
        if predict_first:
            a, P = predict_(a, P, c, T, R, Q)
            return update_(y, a, P, d, Z, H, log2pi_p)
        a_f, P_f, ll = update_(y, a, P, d, Z, H, log2pi_p)
        return (*predict_(a_f, P_f, c, T, R, Q), ll)

    if intercepts:
        return body

    def step(y, a, P, T, Z, R, H, Q, log2pi_p):
        return body(y, a, P, None, None, T, Z, R, H, Q, log2pi_p)

    return step


def kalman_filtered_step(y, a, P, T, Z, R, H, Q, log2pi_p):
    """Predict, then update: the states are the filtered moments; the output the log-likelihood."""
    a_p = T @ a
    P_p = T @ P @ T.T + R @ Q @ R.T
    v = y - Z @ a_p
    F = Z @ P_p @ Z.T + H
    F_inv = pt.linalg.inv(F)
    K = P_p @ Z.T @ F_inv
    ll = -0.5 * (log2pi_p + pt.log(pt.linalg.det(F)) + v @ F_inv @ v)
    return a_p + K @ v, P_p - K @ Z @ P_p, ll


def _kalman_scan(step, y, a0, P0, T, Z, R, H, Q, c, d, scan_kwargs):
    p = y.type.shape[-1]
    if p is None:
        raise ValueError(f"kalman loops: y needs a static last dimension, got shape {y.type.shape}")
    log2pi_p = pt.constant(p * LOG_2PI, dtype=y.dtype)
    intercepts = [] if c is None and d is None else [c, d]
    a, Ps, ll = pytensor.scan(step, sequences=[y], outputs_info=[a0, P0, None],
                              non_sequences=[*intercepts, T, Z, R, H, Q, log2pi_p], return_updates=False,
                              **scan_kwargs)
    return ll, a, Ps


def kalman_textbook_loop(y, a0, P0, T, Z, R, H, Q, *, c=None, d=None, step=kalman_textbook_step, **scan_kwargs):
    """Returns ``(loglik per step (n,), predicted states (n, m), predicted covariances (n, m, m))``.

    ``y`` must have a static observation dimension ``p`` (for ``p log 2 pi``).  With intercepts ``c`` and
    ``d`` (both), the step receives them after the states (see :func:`kalman_spelled_step`).
    """
    return _kalman_scan(step, y, a0, P0, T, Z, R, H, Q, c, d, scan_kwargs)


def kalman_filtered_loop(y, a0, P0, T, Z, R, H, Q, *, c=None, d=None, step=kalman_filtered_step, **scan_kwargs):
    """Predict-then-update loop from the filtered moments ``(a0, P0)`` of time 0.

    Returns ``(loglik per step (n,), filtered states (n, m), filtered covariances (n, m, m))``.
    """
    return _kalman_scan(step, y, a0, P0, T, Z, R, H, Q, c, d, scan_kwargs)


# ---------------------------------------------------------------------------
# Levinson-Durbin recursion for the Yule-Walker equations
# ---------------------------------------------------------------------------


def levinson_step(k, phi, v, gamma):
    """Durbin's recursion, order k + 1 (Brockwell & Davis, Prop. 5.2.1)."""
    kappa = (gamma[k + 1] - pt.sum(phi[:k] * gamma[1:k + 1][::-1])) / v
    new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
    new_phi = pt.set_subtensor(new_phi[k], kappa)
    return new_phi, v * (1 - kappa**2), kappa


#: The innovation variance update ``v (1 - kappa^2)`` as users spell it: ``v_update -> f(v, kappa)``
#: (:func:`levinson_spelled_step`; ``levinson_recursion(v_update=...)`` runs each spelling's operations)
LEVINSON_V_UPDATES = {
    "square": lambda v, kappa: v * (1 - kappa**2),
    "minus": lambda v, kappa: v - kappa**2 * v,
    "factored": lambda v, kappa: v * (1 - kappa) * (1 + kappa),
}


def levinson_spelled_step(v_update="square"):
    """:func:`levinson_step` with the innovation variance update spelled ``v_update``, a key of
    :data:`LEVINSON_V_UPDATES`: ``"square"`` ``v * (1 - kappa**2)``, ``"minus"`` ``v - kappa**2 * v`` or
    ``"factored"`` ``v * (1 - kappa) * (1 + kappa)``."""

    def step(k, phi, v, gamma):
        kappa = (gamma[k + 1] - pt.sum(phi[:k] * gamma[1:k + 1][::-1])) / v
        new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
        new_phi = pt.set_subtensor(new_phi[k], kappa)
        return new_phi, LEVINSON_V_UPDATES[v_update](v, kappa), kappa

    return step


def levinson_loop(gamma, order, *, step=levinson_step, **scan_kwargs):
    """AR(order) coefficients from autocovariances ``gamma``: returns ``(phi, sigma2, pacf)``."""
    phis, vs, kappas = pytensor.scan(step, sequences=[pt.arange(order)],
                                     outputs_info=[pt.zeros(order, dtype=gamma.dtype), gamma[0], None],
                                     non_sequences=[gamma], return_updates=False, **scan_kwargs)
    return phis[-1], vs[-1], kappas


def block_diag_backwards_loop(x, *, step=block_diag_step, **scan_kwargs):
    """:func:`block_diag_loop` with ``go_backwards=True``: the blocks are written last to first."""
    return block_diag_loop(x, step=step, go_backwards=True, **scan_kwargs)


# ---------------------------------------------------------------------------
# Both states of the doubling loop; the step-up recursion (PACF -> AR coefficients)
# ---------------------------------------------------------------------------

__all__ += ["doubling_loop_states", "step_up_step", "step_up_loop"]


def doubling_loop_states(A, Q, tol=1e-12, n_steps=100, *, step=doubling_step, **scan_kwargs):
    """:func:`doubling_loop`, returning both final states ``(alphas[-1], gammas[-1])``."""
    alphas, gammas = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[pt.as_tensor(tol)], n_steps=n_steps,
                                   return_updates=False, **scan_kwargs)
    return alphas[-1], gammas[-1]


def step_up_step(k, kappa, prev):
    """Order ``k`` of the step-up recursion: ``phi_k = [phi_{k-1} - kappa phi_{k-1}[::-1], kappa]``, zero-padded.

    Durbin's recursion driven by the partial autocorrelations (Barndorff-Nielsen & Schou 1973).
    """
    j = pt.arange(prev.shape[0])
    rev = prev[pt.maximum(k - 2 - j, 0)]
    return pt.where(j < k - 1, prev - kappa * rev, pt.where(pt.eq(j, k - 1), kappa, 0.0))


def step_up_loop(pacf, order, *, step=step_up_step, **scan_kwargs):
    """AR(order) coefficients from partial autocorrelations ``pacf`` (:func:`iterops.ts.pacf_to_ar`'s map)."""
    phis = pytensor.scan(step, sequences=[pt.arange(1, order + 1), pacf], outputs_info=[pt.zeros(order)],
                         return_updates=False, **scan_kwargs)
    return phis[-1]


def block_diag_sequence_step(i, xi, out):
    """Write the block ``x_i`` (the blocks tensor read as a Scan sequence) at block position ``(i, i)``."""
    n, m = xi.shape[0], xi.shape[1]
    return pt.set_subtensor(out[i * n:(i + 1) * n, i * m:(i + 1) * m], xi)


def block_diag_sequence_loop(x, *, step=block_diag_sequence_step, **scan_kwargs):
    """:func:`block_diag_loop` with the blocks as a second sequence (``go_backwards=True`` accepted)."""
    k, n, m = x.shape
    outs = pytensor.scan(step, sequences=[pt.arange(k), x], outputs_info=[pt.zeros((k * n, k * m), dtype=x.dtype)],
                         return_updates=False, **scan_kwargs)
    return outs[-1]


__all__ += ["block_diag_sequence_step", "block_diag_sequence_loop"]
