r"""Fixed-interval (Rauch-Tung-Striebel) Kalman smoother: one fused Numba kernel.

Same model, inputs and options as :func:`iterops.ts.kalman_filter`.  The
smoothed moments ``E[alpha_t | y_1..y_n]`` and ``Var[alpha_t | y_1..y_n]`` are
those of the RTS smoother.  They are computed with the equivalent
Durbin-Koopman backward recursion (DK 2012, eqs. 4.44 and 4.69), which needs no
inverse of the predicted covariance (the RTS gain ``P_f T^T P_{t+1}^{-1}`` does,
and ``P_{t+1}`` is singular for states without process noise)::

    r = 0; N = 0
    for t = n-1, ..., 0:                 # o = observed components at t
        L_t = T_t (I - K_t Z_o)          # K_t = P_t Z_o^T F_oo^{-1}, the filter's gain
        r = Z_o^T F_oo^{-1} v_o + L_t^T r
        N = Z_o^T F_oo^{-1} Z_o + L_t^T N L_t
        smoothed_state[t] = a_t + P_t r
        smoothed_cov[t]   = P_t - P_t N P_t

with ``a_t, P_t`` the filter's predictions.  With ``cov_jitter=0`` this equals
statsmodels' ``KalmanSmoother`` (and the RTS recursion) to rounding; with a
jitter it is the DK smoother of the jittered filter (pymc-extras'
``DisturbanceSmoother`` arithmetic, except that smoother adds no jitter of its own).

Failure: where the filter fails (``loglik = -inf``), all smoothed outputs are NaN.
Gradient: not implemented (``grad_not_implemented``); differentiate the filter.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import grad_not_implemented
from pytensor.graph.basic import Apply
from pytensor.tensor.variable import TensorVariable

from iterops._fused import F64P, data_ptr, entry_point, keep_alive, opaque_kernel, register_fused_op
from iterops.ts.kalman import (
    _F64,
    _I64,
    _IN_SIG,
    KalmanOpBase,
    _apply_kalman_op,
    _c,
    _check_shapes_jit,
    _cho_inverse,
    _closed_loop,
    _cov_update,
    _matmul,
    _mean_update,
    _observe,
    _sym_inplace,
    _ti,
    _workspace,
    kalman_filter_kernel,
)

__all__ = ["kalman_smoother", "KalmanSmootherResult", "KalmanSmoother", "kalman_smoother_kernel"]


class KalmanSmootherResult(NamedTuple):
    smoothed_state: TensorVariable  #: (..., n, m)
    smoothed_cov: TensorVariable  #: (..., n, m, m)


@numba.njit(cache=True)
def kalman_smoother_kernel(y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv):
    """Smoothed states and covariances of one series (shapes as :func:`kalman_filter_kernel`).

    Reuses the filter's kernel and its measurement-update helpers, so the gain and ``F_oo^{-1}``
    are bitwise those of the filter."""
    n, p = y.shape
    m = a0.shape[0]
    r_dim = Q.shape[1]
    ll, _, _, _, ap, Pp, _, _ = kalman_filter_kernel(y, a0, P0, c, d, T, Z, R, H, Q, jitter, mv, use_mv)
    a_s = np.full((n, m), np.nan)
    P_s = np.full((n, m, m), np.nan)
    if not np.isfinite(ll) and ll < 0:
        return a_s, P_s
    obs, Ps, PZ, Zo, M, L, K, w = _workspace(m, p, r_dim)
    A = np.empty((m, m))
    FZ = np.empty((p, m))
    v = np.empty(p)
    F = np.empty((p, p))
    af = np.empty(m)
    Pf = np.empty((m, m))
    r = np.zeros(m)
    N = np.zeros((m, m))
    r_new = np.empty(m)
    Lt = np.empty((m, m))
    W = np.empty((m, m))
    Finv = np.empty((p, p))
    for t in range(n - 1, -1, -1):
        Zt = Z[_ti(Z, t)]
        P = Pp[t]
        k = _observe(ap[t], y[t], d[_ti(d, t)], Zt, mv, use_mv, v, obs)
        ok, logdet = _cov_update(P, Zt, H[_ti(H, t)], jitter, obs, k, Ps, PZ, F, Zo, M, L, K, Pf)
        _mean_update(ap[t], v, obs, k, logdet, L, K, w, af)
        _cho_inverse(L, k, Finv)
        _closed_loop(K, Zo, k, A)
        _matmul(T[_ti(T, t)], A, Lt)  # L_t = T A
        # r <- Zo^T w + L_t^T r
        for i in range(m):
            s = 0.0
            for l in range(k):
                s += Zo[l, i] * w[l]
            for l in range(m):
                s += Lt[l, i] * r[l]
            r_new[i] = s
        r[:] = r_new
        # N <- L_t^T N L_t + Zo^T Finv Zo
        _matmul(N, Lt, W)
        _matmul(Lt.T, W, N)
        _matmul(Finv[:k, :k], Zo[:k], FZ[:k])
        _matmul(Zo[:k].T, FZ[:k], W)
        for i in range(m):
            for j in range(m):
                N[i, j] += W[i, j]
        _sym_inplace(N)
        # a_s = a + P r ; P_s = P - P N P
        for i in range(m):
            s = ap[t, i]
            for l in range(m):
                s += P[i, l] * r[l]
            a_s[t, i] = s
        _matmul(N, P, W)
        _matmul(P, W, P_s[t])
        for i in range(m):
            for j in range(m):
                P_s[t, i, j] = P[i, j] - P_s[t, i, j]
        _sym_inplace(P_s[t])
    return a_s, P_s


@opaque_kernel(numba.types.void(*([F64P] * 12), *([_I64] * 11), _F64, _F64, _I64))
def _smoother_abi(y, a0, P0, c, d, T, Z, R, H, Q, oa, oP, n, p, m, r, tc, td, tT, tZ, tR, tH, tQ, jitter, mv, use_mv):
    """C-ABI barrier around :func:`kalman_smoother_kernel` (as ``iterops.ts.kalman._filter_abi``)."""
    a_s, P_s = kalman_smoother_kernel(
        numba.carray(y, (n, p)), numba.carray(a0, (m,)), numba.carray(P0, (m, m)),
        numba.carray(c, (tc, m)), numba.carray(d, (td, p)), numba.carray(T, (tT, m, m)),
        numba.carray(Z, (tZ, p, m)), numba.carray(R, (tR, m, r)), numba.carray(H, (tH, p, p)),
        numba.carray(Q, (tQ, r, r)), jitter, mv, use_mv != 0,
    )
    numba.carray(oa, (n, m))[:] = a_s
    numba.carray(oP, (n, m, m))[:] = P_s


@entry_point
def _smoother_entry(tv: tuple, jitter: float, mv: float, use_mv: bool):
    flag = int(use_mv)
    abi = _smoother_abi.external

    @numba.njit
    def kalman_smoother_fn(y, a0, P0, c, d, T, Z, R, H, Q):
        if _check_shapes_jit(y, a0, P0, c, d, T, Z, R, H, Q, tv):
            raise ValueError("kalman_smoother: inconsistent input shapes at run time")
        y_, a0_, P0_, c_, d_ = _c(y), _c(a0), _c(P0), _c(c), _c(d)
        T_, Z_, R_, H_, Q_ = _c(T), _c(Z), _c(R), _c(H), _c(Q)
        n, p = y_.shape
        m = a0_.shape[0]
        a_s = np.empty((n, m))
        P_s = np.empty((n, m, m))
        abi(
            data_ptr(y_), data_ptr(a0_), data_ptr(P0_), data_ptr(c_), data_ptr(d_), data_ptr(T_),
            data_ptr(Z_), data_ptr(R_), data_ptr(H_), data_ptr(Q_), data_ptr(a_s), data_ptr(P_s),
            n, p, m, Q_.shape[1], c_.shape[0], d_.shape[0], T_.shape[0], Z_.shape[0], R_.shape[0],
            H_.shape[0], Q_.shape[0], jitter, mv, flag,
        )
        keep_alive((y_, a0_, P0_, c_, d_, T_, Z_, R_, H_, Q_))
        return a_s, P_s

    return kalman_smoother_fn


@register_fused_op
class KalmanSmoother(KalmanOpBase):
    """Core Op of :func:`kalman_smoother` (options as :class:`iterops.ts.kalman.KalmanOpBase`)."""

    gufunc_signature = ",".join(_IN_SIG) + "->(n,m),(n,m,m)"

    def make_node(self, *inputs):
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        n = inputs[0].type.shape[0]
        m = inputs[1].type.shape[0]
        outs = [pt.tensor(dtype="float64", shape=(n, m)), pt.tensor(dtype="float64", shape=(n, m, m))]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        (n, _), (m,) = input_shapes[0], input_shapes[1]
        return [(n, m), (n, m, m)]

    def numba_fn(self, node):
        return _smoother_entry(*self._entry_args())

    def pullback(self, inputs, outputs, cotangents):
        return [
            grad_not_implemented(
                self, i, x,
                "the gradient of kalman_smoother is not implemented; differentiate kalman_filter outputs instead",
            )
            for i, x in enumerate(inputs)
        ]


def kalman_smoother(
    y, a0, P0, c, d, T, Z, R, H, Q, *,
    time_varying=(),
    cov_jitter: float = 0.0,
    missing_value: float | None = None,
) -> KalmanSmootherResult:
    """Smoothed states ``(..., n, m)`` and covariances ``(..., n, m, m)``.

    Arguments, shapes, batching and options exactly as :func:`iterops.ts.kalman_filter`.
    Not differentiable (asking for its gradient raises ``NullTypeGradError``).

    Examples
    --------
    >>> import numpy as np, iterops
    >>> res = iterops.ts.kalman_smoother(np.array([[1.0], [np.nan], [0.5]]), [0.0], [[1.0]], [0.0], [0.0],
    ...                                  [[1.0]], [[1.0]], [[1.0]], [[1.0]], [[0.5]])
    >>> res.smoothed_state.eval().round(4).ravel()  # = statsmodels' KalmanSmoother
    array([0.5, 0.5, 0.5])
    """
    outs = _apply_kalman_op(
        "kalman_smoother", KalmanSmoother, (y, a0, P0, c, d, T, Z, R, H, Q), time_varying, cov_jitter, missing_value
    )
    return KalmanSmootherResult(*outs)
