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

with ``a_t, P_t`` the filter's predictions, ``P_t`` through ``sym(P_t)`` as in the filter (at ``t = 0``,
``P0`` need not be symmetric: the smoothed moments are those of ``sym(P0)``).  With ``cov_jitter=0`` this equals
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

from iterops._abi import SIGNATURE, Abi
from iterops._fused import data_ptr, entry_point, keep_alive, opaque_kernel, register_fused_op
from iterops._linalg_kernels import cho_inverse, copy_into, matmul, sym_inplace
from iterops.ts._kalman_filter import kalman_filter_kernel
from iterops.ts._kalman_steps import (
    Options, System, closed_loop, find_structure, loglik, observe, structure, system_at, update_cov, update_work,
    varies_over_time,
)
from iterops.ts.kalman import (
    INPUTS, IN_SIG, MOMENTS, OPTIONS, Inputs, KalmanOpBase, Moments, apply_kalman_op, check_inputs, inputs_of,
)

__all__ = ["kalman_smoother", "KalmanSmootherResult", "KalmanSmoother", "kalman_smoother_kernel"]


class KalmanSmootherResult(NamedTuple):
    smoothed_state: TensorVariable  #: (..., n, m)
    smoothed_cov: TensorVariable  #: (..., n, m, m)


@numba.njit(cache=True, inline="always")
def kalman_smoother_kernel(y, a0, P0, system, options):
    """Smoothed states and covariances of one series (arguments as
    :func:`iterops.ts._kalman_filter.kalman_filter_kernel`).

    Reuses the filter's kernel and its measurement-update stages, so the gain and ``F_oo^{-1}``
    are bitwise those of the filter."""
    n, p = y.shape
    m = a0.shape[0]
    ll, out = kalman_filter_kernel(y, a0, P0, system, options)
    a_s = np.full((n, m), np.nan)
    P_s = np.full((n, m, m), np.nan)
    if not np.isfinite(ll) and ll < 0:
        return a_s, P_s
    ap, Pp = out.predicted_state, out.predicted_cov
    ws, ws_own = update_work(m, p)
    obs, _, _, Zo, _, L, K, w = ws
    v, F, Pf, Finv = np.empty(p), np.empty((p, p)), np.empty((m, m)), np.empty((p, p))
    A, Lt, W, FZ = np.empty((m, m)), np.empty((m, m)), np.empty((m, m)), np.empty((p, m))
    r, r_new, N = np.zeros(m), np.empty(m), np.zeros((m, m))
    vary = varies_over_time(system)
    st = system_at(system, 0)  # step t's matrices
    sx, sx_own = structure(m, p)  # Z's zeros skipped in update_cov as in the filter (bitwise its gain)
    find_structure(st.T, st.Z, sx)
    for t in range(n - 1, -1, -1):
        if vary:
            st = system_at(system, t)
            find_structure(st.T, st.Z, sx)
        P = Pp[t]
        k = observe(ap[t], y[t], st.d, st.Z, options, v, obs)
        _, logdet = update_cov(P, st.Z, st.H, options.jitter, k, ws, F, Pf, sx)
        loglik(v, obs, k, logdet, L, w)  # w = F_oo^{-1} v_o
        cho_inverse(L, k, Finv)
        closed_loop(K, Zo, k, A)
        matmul(st.T, A, Lt)  # L_t = T A
        for i in range(m):  # r <- Zo^T w + L_t^T r
            s = 0.0
            for l in range(k):
                s += Zo[l, i] * w[l]
            for l in range(m):
                s += Lt[l, i] * r[l]
            r_new[i] = s
        copy_into(r_new, r)
        matmul(N, Lt, W)  # N <- L_t^T N L_t + Zo^T Finv Zo
        matmul(Lt.T, W, N)
        matmul(Finv[:k, :k], Zo[:k], FZ[:k])
        matmul(Zo[:k].T, FZ[:k], W)
        for i in range(m):
            for j in range(m):
                N[i, j] += W[i, j]
        sym_inplace(N)
        S = ws.Ps  # sym(P), as the filter uses P (P0 need not be symmetric)
        for i in range(m):  # a_s = a + S r ; P_s = S - S N S
            s = ap[t, i]
            for l in range(m):
                s += S[i, l] * r[l]
            a_s[t, i] = s
        matmul(N, S, W)
        matmul(S, W, P_s[t])
        for i in range(m):
            for j in range(m):
                P_s[t, i, j] = S[i, j] - P_s[t, i, j]
        sym_inplace(P_s[t])
    keep_alive((ws_own, sx_own))
    return a_s, P_s


#: the arguments of :func:`_smoother_abi`
SMOOTHER_ABI = Abi(inputs=INPUTS, options=OPTIONS, out=MOMENTS)
_smoother_args = SMOOTHER_ABI.unpack


@opaque_kernel(SIGNATURE)
def _smoother_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`kalman_smoother_kernel` (as the filter's, in :mod:`iterops.ts.kalman`)."""
    x, options, out = _smoother_args(ptrs, dims, vals)
    a_s, P_s = kalman_smoother_kernel(x.y, x.a0, x.P0, x.system, options)
    copy_into(a_s, out.state)
    copy_into(P_s, out.cov)
    return 0.0


@entry_point
def _smoother_entry(tv: tuple, jitter: float, mv: float, use_mv: bool):
    abi, pack = _smoother_abi.external, SMOOTHER_ABI.pack

    @numba.njit
    def kalman_smoother_fn(*args):
        x = inputs_of(args)
        check_inputs("kalman_smoother", x, tv)
        n, m = x.y.shape[0], x.a0.shape[0]
        out = Moments(np.empty((n, m)), np.empty((n, m, m)))
        ptrs, dims, vals = pack(x, Options(jitter, mv, use_mv), out)
        abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
        keep_alive((x, out, ptrs, dims, vals))
        return out.state, out.cov

    return kalman_smoother_fn


@register_fused_op
class KalmanSmoother(KalmanOpBase):
    """Core Op of :func:`kalman_smoother` (options as :class:`iterops.ts.kalman.KalmanOpBase`)."""

    gufunc_signature = ",".join(IN_SIG) + "->(n,m),(n,m,m)"

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
    y, a0, P0, *,
    c=None, d=None, T, Z, R, H, Q,
    time_varying=(),
    cov_jitter: float = 0.0,
    missing_value: float | None = None,
) -> KalmanSmootherResult:
    """Smoothed states ``(..., n, m)`` and covariances ``(..., n, m, m)``.

    Arguments, shapes, batching and options exactly as :func:`iterops.ts.kalman_filter`: ``y, a0, P0``
    positional, the system matrices by keyword only (``c`` and ``d`` default to zeros).
    Not differentiable (asking for its gradient raises ``NullTypeGradError``).

    Examples
    --------
    >>> import numpy as np, iterops
    >>> res = iterops.ts.kalman_smoother(np.array([[1.0], [np.nan], [0.5]]), [0.0], [[1.0]],
    ...                                  T=[[1.0]], Z=[[1.0]], R=[[1.0]], H=[[1.0]], Q=[[0.5]])
    >>> res.smoothed_state.eval().round(4).ravel()  # = statsmodels' KalmanSmoother
    array([0.5, 0.5, 0.5])
    """
    args = Inputs(y, a0, P0, System(c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q))
    outs = apply_kalman_op("kalman_smoother", KalmanSmoother, args, time_varying, cov_jitter, missing_value)
    return KalmanSmootherResult(*outs)
