r"""Kalman filter: one fused Numba kernel forward, one fused Numba adjoint backward.

Model (Durbin & Koopman 2012, the notation of statsmodels and pymc-extras), ``m`` states, ``p``
observables, ``r`` state shocks, ``n`` time steps::

    y_t       = d_t + Z_t alpha_t + eps_t,      eps_t ~ N(0, H_t)
    alpha_t+1 = c_t + T_t alpha_t + R_t eta_t,  eta_t ~ N(0, Q_t)
    alpha_1   ~ N(a0, P0)

Shapes: ``y`` (n, p), ``a0`` (m,), ``P0`` (m, m), ``c`` (m,), ``d`` (p,), ``T`` (m, m), ``Z`` (p, m),
``R`` (m, r), ``H`` (p, p), ``Q`` (r, r); a matrix named in ``time_varying`` has an extra axis of length n first.
Failure value: ``loglik = -inf`` from the first step whose ``F[o, o]`` is not positive definite (or not
finite), NaN after; the gradient is NaN.  Only a shape mismatch raises (``ValueError``).

Code map, in reading order:

* ``iterops/_linalg_kernels.py``: small dense-matrix helpers of every kernel;
* ``iterops/ts/_kalman_steps.py``: the stages of one step, each followed by its reverse; ``System``, ``Options``;
* ``iterops/ts/_kalman_filter.py``, ``_kalman_adjoint.py``, ``_kalman_diffuse.py``: the forward loop, the
  reverse loop, the exact diffuse steps; ``_kalman_hvp.py``, ``_kalman_second.py``: second derivatives;
* this module: the C-ABI kernels (arguments declared once as :class:`iterops._abi.Abi`, e.g. :data:`FILTER_ABI`),
  the run-time shape checks (:func:`check_inputs`), the entry points, the Ops, :func:`kalman_filter`,
  :func:`stationary_cov`;
* ``iterops/ts/kalman_smoother.py``: :func:`iterops.ts.kalman_smoother`.

One step (``a, P`` = prediction of alpha_t given y_1..y_{t-1}; ``o`` = the observed components of
``y_t``, ``k = |o|``; ``sym(X) = (X + X^T)/2``; ``j`` = ``cov_jitter``)::

    v   = y_t - d_t - Z_t a                         forecast error (NaN where missing)
    S   = sym(P)                                    (P enters only through S)
    F   = Z_t S Z_t^T + sym(H_t) + j I              forecast error covariance (all p rows)
    L   = chol(F[o, o])                             -> loglik = -inf if not PD
    M   = S Z_o^T;  K = M F_oo^{-1}                 gain (Cholesky solves)
    ll  = -(k log 2 pi + log|F_oo| + v_o^T F_oo^{-1} v_o) / 2
    a_f = a + K v_o
    P_f = S - K M^T - j K K^T + j I
    a'  = T_t a_f + c_t
    P'  = T_t P_f T_t^T + R_t sym(Q_t) R_t^T

* Symmetric matrices are computed on one triangle and mirrored: covariances are exactly symmetric.
* ``P_f`` is the Joseph form ``(I - K Z_o) S (I - K Z_o)^T + K H_oo K^T + j I`` for this gain
  (pymc-extras' update), in O(m^2 k) instead of O(m^3) (statsmodels' conventional update).
* ``P0`` enters through ``sym(P0)``, so its gradient is symmetric (plus the cotangent of
  ``predicted_cov[0]``, which is ``P0``).
* A fully missing row gives ``ll = 0``, ``a_f = a``, ``P_f = sym(P) + j I``.
* Steady state (statsmodels' shortcut): with static ``T, Z, R, H, Q``, once the predicted covariance has
  converged entry by entry on its own scale, ``|P_{t+1} - P_t|_ij <= 1e-14 sqrt(P_{t+1,ii} P_{t+1,jj})``, it
  is frozen and fully observed steps run only the mean recursion.  The test is invariant under a rescaling
  of the states (``P -> D P D``), so states in different units (thousands next to percent) are frozen
  only when each has converged; why this changes no result beyond rounding:
  :func:`iterops.ts._kalman_steps.steady`.
* Failure: at the failing step ``t``, ``loglik_obs[t] = -inf``; later ``loglik_obs`` and every
  filtered or predicted quantity from ``t`` on are NaN.
* Time-varying matrices are declared, never guessed: ``time_varying=("T", "Z")`` means ``T`` is
  (..., n, m, m) and ``Z`` (..., n, p, m), row ``t`` used at step ``t`` (``c_t, T_t, R_t, Q_t`` move
  alpha_t to alpha_{t+1}).

Oracles:

* ``cov_jitter=0`` (the default) is statsmodels' conventional filter with ``initialize_known(a0, P0)``:
  every output of ``statsmodels.tsa.statespace.kalman_filter.KalmanFilter`` to rounding, missing data
  included (NaN ``forecast_error`` on missing components, full-size ``forecast_error_cov``).
* ``kalman_filter(..., cov_jitter=1e-8, missing_value=-9999.0)`` is pymc-extras'
  ``StandardFilter(cov_jitter=1e-8, missing_fill_value=-9999.0)`` (their defaults):

  - their ``stabilize(H, jitter)`` in ``F`` and ``stabilize(P_filtered, jitter)`` are ``j`` above;
    ``K H K^T`` uses the un-jittered ``H``; no jitter on the predicted covariance;
  - entries equal to ``missing_value`` are missing, as are NaN entries; their masking (zeroed rows of
    ``Z``, ``d``, ``H``, ``y``, ones on the masked diagonal of ``F``) is "drop the missing components";
  - log-likelihood constant ``-(k/2) log(2 pi)``, ``k`` the observed components;
  - their ``predicted_states``/``predicted_covariances`` are our ``predicted_state[..., :-1, :]``/
    ``predicted_cov[..., :-1, :, :]``; ``filtered_*`` and ``loglike_obs`` are ours;
  - their ``observed_states`` is ``where(missing, 0, d_t + Z_t @ predicted_state[t])``; their
    ``observed_covariances`` is our ``forecast_error_cov`` on observed rows and columns, 0 off the
    diagonal and ``cov_jitter`` on the diagonal of missing ones;
  - agreement to ~1e-12 relative, not bitwise: we symmetrize ``F`` before the Cholesky.

Gradient (:class:`KalmanFilterGrad`, a second fused Numba Op): a hand-written reverse-mode adjoint.

* It re-runs each step's update from the stored ``predicted_state``, ``predicted_cov`` and reverses it
  stage by stage (:mod:`iterops.ts._kalman_steps`).
* Cotangents of every output, w.r.t. every input (``y`` where observed, 0 where missing); a
  disconnected cotangent arrives as a zero-size placeholder.
* Over a steady-state stretch the covariance cotangents follow from one Lyapunov equation, so only the
  O(m p + m^2) mean path runs per step (:func:`iterops.ts._kalman_adjoint._steady_adjoint_run`).
* Second derivatives: one fused kernel, forward mode over this adjoint (:mod:`iterops.ts._kalman_second`,
  :mod:`iterops.ts._kalman_hvp`); the diffuse filter's adjoint raises ``NotImplementedError`` when differentiated.

Options:

* Structured systems: the zeros of finite, at most half nonzero ``T`` and ``Z`` (shift, companion,
  identity blocks) are skipped in the products, O(m nnz) instead of O(m^3), with the dense products'
  results and failures (:mod:`iterops.ts._kalman_steps`).  The gradient w.r.t. ``T`` stays dense.
* ``univariate="auto" | True | False``: where ``sym(H_t)`` is diagonal, the observed components are
  processed one at a time (Durbin & Koopman 2012, sec. 6.4; statsmodels' ``filter_univariate``)::

      for i in o:  v_i = y_i - d_i - Z_i a_f;  F_i = Z_i P_f Z_i^T + H_ii + j   (a_f = a, P_f = S first)
                   u = P_f Z_i^T / F_i;  a_f += u v_i;  P_f -= u u^T F_i;  ll_i = -(log 2 pi + log F_i + v_i^2/F_i)/2
      P_f += j I - j K K^T                                                       (K from the sequential gains)

  This is the update above with ``F_oo = L D L^T`` (the ``F_i`` are the pivots of D): the same outputs
  to rounding, the same failing steps, O(k m^2).  ``forecast_error`` and ``forecast_error_cov`` stay
  the multivariate ones.  Kernel: :func:`iterops.ts._kalman_steps.update_univariate`; the ``"auto"``
  rule: :func:`iterops.ts._kalman_steps.prefers_univariate`.  The adjoint is the multivariate one.
* ``diffuse=mask_or_P_inf``: Durbin & Koopman's exact initial filter, ``P_1 = P0 + kappa P_inf``,
  ``kappa -> infinity``, as statsmodels' ``initialization='diffuse'`` (:mod:`iterops.ts._kalman_diffuse`).
  :class:`KalmanFilterDiffuse` runs the diffuse steps, then the ordinary entry point; its adjoint
  :class:`KalmanFilterDiffuseGrad` reverses both.  A model without ``diffuse`` compiles only the ordinary kernels.

The kernels sit behind a C-ABI barrier (:class:`iterops._fused.OpaqueKernel`): compiled once per machine,
cached on disk; a new graph compiles only its glue.

Reference loop this replaces (what pymc-extras writes with ``pytensor.scan``)::

    def step(y, a, P, c, d, T, Z, R, H, Q):
        v = y - d - Z @ a; F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F); A = pt.eye(m) - K @ Z
        ll = pm.logp(pm.MvNormal.dist(0, F), v)
        a_f = a + K @ v; P_f = A @ P @ A.T + K @ H @ K.T
        return a_f, P_f, T @ a_f + c, T @ P_f @ T.T + R @ Q @ R.T, ll
    outs, _ = pytensor.scan(step, sequences=[y], outputs_info=[None, None, a0, P0, None], ...)
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType
from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.rewriting.basic import copy_stack_trace, node_rewriter
from pytensor.tensor.basic import get_underlying_scalar_constant_value
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.variable import TensorVariable

from iterops._second_order import not_twice_differentiable
from iterops._abi import SIGNATURE, Abi, Struct
from iterops._fused import FusedOp, data_ptr, entry_point, keep_alive, opaque_kernel, register_fused_op, writable
from iterops._validate import as_tensor, check_shape, float_dtype
from iterops.ts._kalman_adjoint import Cotangents, InputCotangents, kalman_adjoint_kernel
from iterops.ts._kalman_diffuse import DiffuseOutputs, diffuse_adjoint, diffuse_filter, diffuse_outputs
from iterops.ts._kalman_filter import FilterOutputs, filter_into, filter_outputs, kalman_filter_kernel
from iterops.ts._kalman_steps import (
    AUTO, MULTIVARIATE, SYSTEM_NAMES, UNIVARIATE, Options, System, Wanted, diagonal, prefers_univariate,
)

__all__ = [
    "kalman_filter",
    "stationary_cov",
    "KalmanFilterResult",
    "KalmanFilter",
    "KalmanFilterGrad",
    "KalmanFilterDiffuse",
    "KalmanFilterDiffuseGrad",
    "kalman_filter_kernel",
    "kalman_adjoint_kernel",
]

#: each system matrix's core ndim (without its time axis), in argument order (:data:`SYSTEM_NAMES`)
SYSTEM_NDIM = dict(zip(SYSTEM_NAMES, (1, 1, 2, 2, 2, 2, 2)))
#: the filter Ops' inputs, in order (the gradient Ops take ``predicted_state``, ``predicted_cov`` and the 8
#: output cotangents after them)
INPUT_NAMES = ("y", "a0", "P0", *SYSTEM_NAMES)
#: core signature of each input (time axis "t<name>" of length 1 when static, n when time-varying)
IN_SIG = (
    "(n,p)", "(m)", "(m,m)",
    "(tc,m)", "(td,p)", "(tT,m,m)", "(tZ,p,m)", "(tR,m,r)", "(tH,p,p)", "(tQ,r,r)",
)
_OUT_SIG = ("()", "(n)", "(n,m)", "(n,m,m)", "(n1,m)", "(n1,m,m)", "(n,p)", "(n,p,p)")
OUTPUT_NAMES = (
    "loglik", "loglik_obs", "filtered_state", "filtered_cov",
    "predicted_state", "predicted_cov", "forecast_error", "forecast_error_cov",
)


class KalmanFilterResult(NamedTuple):
    """Outputs of :func:`kalman_filter` (``...`` = batch dimensions)."""

    loglik: TensorVariable  #: (...,) total log-likelihood
    loglik_obs: TensorVariable  #: (..., n) per-step log-likelihood
    filtered_state: TensorVariable  #: (..., n, m) E[alpha_t | y_1..y_t]
    filtered_cov: TensorVariable  #: (..., n, m, m)
    predicted_state: TensorVariable  #: (..., n+1, m) E[alpha_t | y_1..y_{t-1}]; row 0 = a0
    predicted_cov: TensorVariable  #: (..., n+1, m, m); row 0 = P0
    forecast_error: TensorVariable  #: (..., n, p) y_t - d_t - Z_t a_t; NaN where missing
    forecast_error_cov: TensorVariable  #: (..., n, p, p) Z_t P_t Z_t^T + H_t (+ jitter I)


# ---------------------------------------------------------------------------
# C-ABI entry points (shared with the smoother)
# ---------------------------------------------------------------------------

#: ``kalman_filter(univariate=...)`` -> the forward kernel's update mode (:mod:`iterops.ts._kalman_steps`)
UPDATE_MODES = {False: MULTIVARIATE, "auto": AUTO, True: UNIVARIATE}


class Inputs(NamedTuple):
    """The filter's inputs as its kernels take them (C-contiguous float64)."""

    y: np.ndarray  #: (n, p)
    a0: np.ndarray  #: (m,)
    P0: np.ndarray  #: (m, m)
    system: System  #: time axes of length 1 or n


class Moments(NamedTuple):
    """A state mean and covariance per step: the predictions (n + 1 rows), the smoothed moments (n rows)."""

    state: np.ndarray  #: (rows, m)
    cov: np.ndarray  #: (rows, m, m)


class Mode(NamedTuple):
    """How the forward kernel runs: the update mode (:data:`UPDATE_MODES`), whether ``F`` is read, whether
    ``filtered_cov`` or ``predicted_cov`` is (:func:`kalman_unused_outputs`)."""

    univariate: int
    need_F: bool
    need_P: bool


class DiffuseStart(NamedTuple):
    """The diffuse filter's extra input and what it reports: ``status = [d, ok]`` (written)."""

    P_inf: np.ndarray  #: (m, m)
    status: np.ndarray  #: (2,) the first non-diffuse step d, 1.0 if no step failed


class DiffuseCotangents(NamedTuple):
    """Cotangents of the hand-off ``(a_d, P_d)`` (read) and of ``P_inf`` (written), and ``d``."""

    a: np.ndarray  #: (m,)
    P: np.ndarray  #: (m, m)
    P_inf: np.ndarray  #: (m, m)
    d: int


SYSTEM = Struct(System, **{k: nd + 1 for k, nd in SYSTEM_NDIM.items()})  # with the time axis
INPUTS = Struct(Inputs, y=2, a0=1, P0=2, system=SYSTEM)
OPTIONS = Struct(Options, jitter="f", missing_value="f", use_missing_value="b")
MOMENTS = Struct(Moments, state=2, cov=3)
FILTER_OUTPUTS = Struct(FilterOutputs, loglik_obs=1, filtered_state=2, filtered_cov=3, predicted_state=2,
                        predicted_cov=3, forecast_error=2, forecast_error_cov=3)
COTANGENTS = Struct(Cotangents, loglik="f", **{k: v for k, v in FILTER_OUTPUTS.kinds.items()})
INPUT_COTANGENTS = Struct(InputCotangents, y=2, a0=1, P0=2, system=SYSTEM)
DIFFUSE_OUTPUTS = Struct(DiffuseOutputs, **FILTER_OUTPUTS.kinds, predicted_inf=3)

#: the arguments of each C-ABI kernel below (every one has the signature :data:`iterops._abi.SIGNATURE`)
FILTER_ABI = Abi(inputs=INPUTS, options=OPTIONS,
                 mode=Struct(Mode, univariate="i", need_F="b", need_P="b"), out=FILTER_OUTPUTS)
ADJOINT_ABI = Abi(inputs=INPUTS, options=OPTIONS, predicted=MOMENTS, cot=COTANGENTS, grad=INPUT_COTANGENTS,
                  want=Struct(Wanted, T="b", Z="b"))
DIFFUSE_FILTER_ABI = Abi(inputs=INPUTS, options=OPTIONS, start=Struct(DiffuseStart, P_inf=2, status=1),
                         out=DIFFUSE_OUTPUTS)
DIFFUSE_ADJOINT_ABI = Abi(inputs=INPUTS, options=OPTIONS, tape=DIFFUSE_OUTPUTS, cot=COTANGENTS,
                          hand_off=Struct(DiffuseCotangents, a=1, P=2, P_inf=2, d="i"), grad=INPUT_COTANGENTS)
# the unpackers, as globals that jitted code can call
_filter_args, _adjoint_args = FILTER_ABI.unpack, ADJOINT_ABI.unpack
_diffuse_filter_args, _diffuse_adjoint_args = DIFFUSE_FILTER_ABI.unpack, DIFFUSE_ADJOINT_ABI.unpack


@numba.njit(cache=True)
def contiguous(x):
    """C-contiguous, writable-typed float64 view or copy: the kernels and helpers are compiled (and cached)
    for that one type (C layouts also run several times faster than strided views)."""
    return writable(np.ascontiguousarray(x))


@numba.njit(cache=True)
def inputs_of(args):
    """:class:`Inputs` of an entry point's leading ``(y, a0, P0, c, d, T, Z, R, H, Q)`` arguments."""
    c = contiguous
    return Inputs(c(args[0]), c(args[1]), c(args[2]), System(
        c(args[3]), c(args[4]), c(args[5]), c(args[6]), c(args[7]), c(args[8]), c(args[9])))


#: the shape each input must have, as :class:`~iterops._validate.ShapeError` shows it; built here once (a
#: string concatenated inside the jitted check is allocated on every call: 7% of a small filter's call)
_WHERE = ", m = len(a0), p = y.shape[1], r = Q.shape[-1], t = n = len(y) if time-varying else 1"
_SPECS = tuple(f"{s}{_WHERE}" for s in ("(m, m)", "(t, m)", "(t, p)", "(t, m, m)", "(t, p, m)", "(t, m, r)",
                                        "(t, p, p)", "(t, r, r)"))


@numba.njit(cache=True)
def check_inputs(func, x, tv):
    """Raise ``ValueError`` naming the argument unless every shape matches ``y`` (n, p), ``a0`` (m,) and
    ``Q`` (r, r), with a time axis of 1 or n (``tv``) on each system matrix: what the kernels rely on."""
    n, p = x.y.shape
    m, r = x.a0.shape[0], x.system.Q.shape[-1]
    s = x.system
    t = (n if tv[0] else 1, n if tv[1] else 1, n if tv[2] else 1, n if tv[3] else 1, n if tv[4] else 1,
         n if tv[5] else 1, n if tv[6] else 1)
    check_shape(func, "P0", x.P0, _SPECS[0], (m, m))
    check_shape(func, "c", s.c, _SPECS[1], (t[0], m))
    check_shape(func, "d", s.d, _SPECS[2], (t[1], p))
    check_shape(func, "T", s.T, _SPECS[3], (t[2], m, m))
    check_shape(func, "Z", s.Z, _SPECS[4], (t[3], p, m))
    check_shape(func, "R", s.R, _SPECS[5], (t[4], m, r))
    check_shape(func, "H", s.H, _SPECS[6], (t[5], p, p))
    check_shape(func, "Q", s.Q, _SPECS[7], (t[6], r, r))


@numba.njit(inline="always")
def _cotangent(func, name, g, want):
    """A per-step cotangent checked against ``want`` (contiguous), or, disconnected (no rows), an empty one
    of ``want``'s other dimensions."""
    if g.shape[0] == 0:
        return np.zeros((0,) + want[1:])
    check_shape(func, name, g, "(rows of the output, ...)", want)
    return g


@numba.njit(inline="always")
def _contiguous7(g):
    """:func:`contiguous` of each of 7 arrays (one compiled helper for any mix of layouts)."""
    c = contiguous
    return c(g[0]), c(g[1]), c(g[2]), c(g[3]), c(g[4]), c(g[5]), c(g[6])


@numba.njit(inline="always")
def cotangents_of(func, gll, g, x):
    """:class:`Cotangents` of the log-likelihood's cotangent ``gll`` (0-d) and the per-step cotangents ``g``
    (7 arrays, as :class:`FilterOutputs`) of a filter on the :class:`Inputs` ``x``, checked."""
    return _checked_cotangents(func, gll[()], _contiguous7(g), x)


@numba.njit(cache=True)
def _checked_cotangents(func, gll, g, x):
    """:class:`Cotangents` of ``gll`` (float) and the 7 contiguous per-step cotangents ``g``, each checked against
    its output's shape on the :class:`Inputs` ``x`` (n steps, m states, p observables): ``ValueError`` naming
    it on a mismatch, a zero-row one (disconnected) kept empty."""
    (n, p), m = x.y.shape, x.a0.shape[0]
    return Cotangents(
        gll, _cotangent(func, "loglik_obs cotangent", g[0], (n,)),
        _cotangent(func, "filtered_state cotangent", g[1], (n, m)),
        _cotangent(func, "filtered_cov cotangent", g[2], (n, m, m)),
        _cotangent(func, "predicted_state cotangent", g[3], (n + 1, m)),
        _cotangent(func, "predicted_cov cotangent", g[4], (n + 1, m, m)),
        _cotangent(func, "forecast_error cotangent", g[5], (n, p)),
        _cotangent(func, "forecast_error_cov cotangent", g[6], (n, p, p)),
    )


@numba.njit(inline="always")
def predictions_of(func, ap, Pp, x):
    """The :class:`Moments` of the predictions ``(ap, Pp)`` a gradient Op gets, checked against ``x``."""
    return _checked_predictions(func, contiguous(ap), contiguous(Pp), x)


@numba.njit(cache=True)
def _checked_predictions(func, ap, Pp, x):
    """:class:`Moments` of ``ap`` (n + 1, m) and ``Pp`` (n + 1, m, m); ``ValueError`` naming the one whose shape
    does not match the :class:`Inputs` ``x``."""
    n, m = x.y.shape[0], x.a0.shape[0]
    check_shape(func, "predicted_state", ap, "(n + 1, m)", (n + 1, m))
    check_shape(func, "predicted_cov", Pp, "(n + 1, m, m)", (n + 1, m, m))
    return Moments(ap, Pp)


@numba.njit(cache=True)
def input_cotangents_like(x, fill):
    """:class:`InputCotangents` of the shapes of the :class:`Inputs` ``x``, every entry ``fill``."""
    s = x.system
    return InputCotangents(
        np.full_like(x.y, fill), np.full_like(x.a0, fill), np.full_like(x.P0, fill), System(
            np.full_like(s.c, fill), np.full_like(s.d, fill), np.full_like(s.T, fill), np.full_like(s.Z, fill),
            np.full_like(s.R, fill), np.full_like(s.H, fill), np.full_like(s.Q, fill)),
    )


@numba.njit(cache=True)
def gradient_tuple(grad):
    """The gradient Op's outputs ``(y, a0, P0, c, d, T, Z, R, H, Q)`` of an :class:`InputCotangents`."""
    s = grad.system
    return grad.y, grad.a0, grad.P0, s.c, s.d, s.T, s.Z, s.R, s.H, s.Q


@opaque_kernel(SIGNATURE)
def _filter_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`iterops.ts._kalman_filter.filter_into` (arguments: :data:`FILTER_ABI`;
    see :class:`iterops._fused.OpaqueKernel` for why).  Returns the log-likelihood."""
    x, options, mode, out = _filter_args(ptrs, dims, vals)
    return filter_into(x.y, x.a0, x.P0, x.system, options, out, mode.univariate, mode.need_F, mode.need_P)


@opaque_kernel(SIGNATURE)
def _adjoint_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`iterops.ts._kalman_adjoint.kalman_adjoint_kernel` (arguments:
    :data:`ADJOINT_ABI`; ``grad`` written).  Returns 0."""
    x, options, predicted, cot, grad, want = _adjoint_args(ptrs, dims, vals)
    kalman_adjoint_kernel(x.y, x.system, options, predicted.state, predicted.cov, cot, grad, want)
    return 0.0


# a graph with the filter nearly always has its gradient too: on a first use both compile at once
_filter_abi.companions = ("iterops.ts.kalman._adjoint_abi",)


@entry_point
def _filter_runner(jitter: float, mv: float, use_mv: bool, univariate="auto", forecast_cov: bool = True,
                   covariances: bool = True):
    """A jitted ``run(x) -> (loglik, FilterOutputs)`` for checked :class:`Inputs` ``x``: the filter through its
    C-ABI barrier (:func:`_filter_abi`), outputs allocated here.  Shared by the filter's and the diffuse
    filter's entry points (memoized on the options, so one compile serves both)."""
    update, need_F, need_P = UPDATE_MODES[univariate], bool(forecast_cov), bool(covariances)
    abi, pack = _filter_abi.external, FILTER_ABI.pack  # opaque call: a new graph does not recompile the kernel

    # inlined into its callers (a call to a separate jitted function made a new graph's compile 1.2x longer)
    @numba.njit(inline="always")
    def run(x):
        """``(loglik, FilterOutputs)`` of the filter on ``x`` (loglik ``-inf`` on failure)."""
        options, mode = Options(jitter, mv, use_mv), Mode(update, need_F, need_P)
        (n, p), m = x.y.shape, x.a0.shape[0]
        out = filter_outputs(n, m, p)
        ptrs, dims, vals = pack(x, options, mode, out)
        ll = abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
        keep_alive((x, out, ptrs, dims, vals))
        return ll, out

    return run


@numba.njit(inline="always")
def filter_result(ll, out):
    """The 8 outputs of :class:`KalmanFilterResult` (``loglik`` 0-d) of a log-likelihood and its :class:`FilterOutputs`."""
    total = np.empty((), dtype=np.float64)
    total[()] = ll
    return (total, out.loglik_obs, out.filtered_state, out.filtered_cov, out.predicted_state, out.predicted_cov,
            out.forecast_error, out.forecast_error_cov)


@entry_point
def _filter_entry(tv: tuple, jitter: float, mv: float, use_mv: bool, univariate="auto", forecast_cov: bool = True,
                  covariances: bool = True):
    """Entry point of :class:`KalmanFilter` for its props (``tv``: 7 time-varying flags; ``mv``, ``use_mv``: the
    missing-value sentinel; the rest as the Op's): checks the shapes, runs :func:`_filter_runner`'s filter and
    returns the 8 outputs of :class:`KalmanFilterResult` (float64).  Failure value as in the module docstring
    (``loglik = -inf``)."""
    run = _filter_runner(jitter, mv, use_mv, univariate, forecast_cov, covariances)

    @numba.njit
    def kalman_filter_fn(*args):
        """``(y, a0, P0, c, d, T, Z, R, H, Q) -> (loglik, loglik_obs, filtered_state, filtered_cov,
        predicted_state, predicted_cov, forecast_error, forecast_error_cov)``; a shape mismatch raises."""
        x = inputs_of(args)
        check_inputs("kalman_filter", x, tv)
        ll, out = run(x)
        return filter_result(ll, out)

    return kalman_filter_fn


@entry_point
def _adjoint_runner(jitter: float, mv: float, use_mv: bool, unused: tuple = ()):
    """A jitted ``run(x, predicted, cot) -> InputCotangents`` for checked :class:`Inputs` ``x``, the filter's
    predictions (:class:`Moments`) and the outputs' :class:`Cotangents`: the adjoint through its C-ABI barrier
    (:func:`_adjoint_abi`).  The cotangents of the inputs named in ``unused`` (of "T", "Z") are not computed
    and come out NaN; the filter's failure gives NaN cotangents."""
    abi, pack = _adjoint_abi.external, ADJOINT_ABI.pack
    skip_T, skip_Z = "T" in unused, "Z" in unused

    @numba.njit(inline="always")  # as _filter_runner's
    def run(x, predicted, cot):
        """The :class:`InputCotangents` of ``x``."""
        grad = input_cotangents_like(x, 0.0)
        ptrs, dims, vals = pack(x, Options(jitter, mv, use_mv), predicted, cot, grad, Wanted(not skip_T, not skip_Z))
        abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
        keep_alive((x, predicted, cot, grad, ptrs, dims, vals))
        if skip_T:
            grad.system.T[...] = np.nan
        if skip_Z:
            grad.system.Z[...] = np.nan
        return grad

    return run


@entry_point
def _adjoint_entry(tv: tuple, jitter: float, mv: float, use_mv: bool, unused: tuple = ()):
    """Entry point of :class:`KalmanFilterGrad`: checks the shapes, runs :func:`_adjoint_runner`'s adjoint."""
    run = _adjoint_runner(jitter, mv, use_mv, unused)

    @numba.njit
    def kalman_filter_grad_fn(*args):
        """``(10 inputs, predicted_state, predicted_cov, 8 output cotangents) -> the 10 inputs' cotangents``;
        a shape mismatch raises; the filter's failure gives NaN cotangents."""
        func = "kalman_filter gradient"
        x = inputs_of(args[:10])
        check_inputs(func, x, tv)
        predicted = predictions_of(func, args[10], args[11], x)
        cot = cotangents_of(func, args[12], args[13:], x)
        return gradient_tuple(run(x, predicted, cot))

    return kalman_filter_grad_fn


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


def _props_common(tv, cov_jitter, missing_value):
    """The entry points' static arguments: ``(time_varying, jitter, missing_value or 0, use_missing_value)``."""
    return tuple(bool(x) for x in tv), float(cov_jitter), missing_value or 0.0, missing_value is not None


class KalmanOpBase(FusedOp):
    """Options shared by the filter and smoother core Ops (float64 inputs; system matrices carry
    a time axis).  ``time_varying``: tuple of 7 bools for (c, d, T, Z, R, H, Q); a static matrix
    has a time axis of length 1."""

    __props__ = ("time_varying", "cov_jitter", "missing_value")

    def __init__(self, time_varying=(False,) * 7, cov_jitter=0.0, missing_value=None):
        """Props, normalized so that equal options give equal Ops (PyTensor merges them; entry points are
        memoized on them)."""
        self.time_varying = tuple(bool(x) for x in time_varying)
        self.cov_jitter = float(cov_jitter)
        # NaN entries are always missing: a NaN ``missing_value`` is no extra sentinel (and a NaN prop
        # would not equal itself)
        mv = None if missing_value is None else float(missing_value)
        self.missing_value = None if mv is None or np.isnan(mv) else mv

    def _entry_args(self):
        """The entry points' static arguments ``(tv, jitter, missing_value or 0, use_missing_value)``."""
        return _props_common(self.time_varying, self.cov_jitter, self.missing_value)


@register_fused_op
class KalmanFilter(KalmanOpBase):
    """Core Op of :func:`kalman_filter` (see :class:`KalmanOpBase` for the options; ``univariate``:
    ``"auto"``, True or False, the forward's measurement update, :func:`kalman_filter`).
    ``forecast_cov=False`` (set by the rewrite :func:`kalman_unused_outputs` when nothing uses
    the output): univariate steps leave ``forecast_error_cov`` NaN instead of computing it.
    ``covariances=False`` (the same rewrite, when nothing reads ``filtered_cov`` or ``predicted_cov``, as in
    PyMC's logp): a steady stretch leaves their rows unwritten (unspecified values).  One flag for both, so
    that graphs reading either share one compiled variant."""

    __props__ = (*KalmanOpBase.__props__, "univariate", "forecast_cov", "covariances")
    gufunc_signature = ",".join(IN_SIG) + "->" + ",".join(_OUT_SIG)

    def __init__(self, time_varying=(False,) * 7, cov_jitter=0.0, missing_value=None, univariate="auto",
                 forecast_cov=True, covariances=True):
        """``univariate``: ``"auto"``, True or False (else ``ValueError``); the flags as in the class docstring."""
        super().__init__(time_varying, cov_jitter, missing_value)
        if univariate not in UPDATE_MODES:
            raise ValueError(f"univariate must be 'auto', True or False, got {univariate!r}")
        self.univariate = univariate if univariate == "auto" else bool(univariate)
        self.forecast_cov = bool(forecast_cov)
        self.covariances = bool(covariances)

    def make_node(self, *inputs):
        """Inputs ``y, a0, P0, c, d, T, Z, R, H, Q`` (core shapes :data:`IN_SIG`; the diffuse Op has ``P_inf``
        after ``P0``), float64, validated by :func:`kalman_filter`; the 8 float64 outputs with the static n, m, p of
        ``y`` and ``a0``."""
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        y, a0 = inputs[0], inputs[1]
        n, p = y.type.shape
        m = a0.type.shape[0]
        n1 = None if n is None else n + 1
        f = "float64"
        outs = [
            pt.tensor(dtype=f, shape=()), pt.tensor(dtype=f, shape=(n,)),
            pt.tensor(dtype=f, shape=(n, m)), pt.tensor(dtype=f, shape=(n, m, m)),
            pt.tensor(dtype=f, shape=(n1, m)), pt.tensor(dtype=f, shape=(n1, m, m)),
            pt.tensor(dtype=f, shape=(n, p)), pt.tensor(dtype=f, shape=(n, p, p)),
        ]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        """Output shapes from ``y`` (n, p) and ``a0`` (m,): ``(), (n,), (n, m), (n, m, m), (n+1, m), (n+1, m, m),
        (n, p), (n, p, p)``."""
        (n, p), (m,) = input_shapes[0], input_shapes[1]
        return [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]

    def numba_fn(self, node):
        """The jitted entry point for this Op's props (:func:`_filter_entry`)."""
        return _filter_entry(*self._entry_args(), self.univariate, self.forecast_cov, self.covariances)

    def pullback(self, inputs, outputs, cotangents):
        """Cotangents of the 10 inputs from :class:`KalmanFilterGrad` (zeros when no output's cotangent is
        connected)."""
        connected = [not isinstance(g.type, DisconnectedType) for g in cotangents]
        if not any(connected):
            return [pt.zeros_like(x) for x in inputs]
        # a disconnected cotangent is a zero-size placeholder (0 for loglik): the kernel skips it
        cts = [g if h else pt.zeros((0,) * out.type.ndim) for g, h, out in zip(cotangents, connected, outputs)]
        grad_op = KalmanFilterGrad(self.time_varying, self.cov_jitter, self.missing_value)
        return list(grad_op(*inputs, outputs[4], outputs[5], *cts))


def _own_dims(sig, tag):
    """``"(n,m)" -> "(n_tag,m_tag)"``: core dimensions that nothing else constrains."""
    dims = [x for x in sig.strip("()").split(",") if x]
    return "(" + ",".join(f"{x}_{tag}" for x in dims) + ")"


@register_fused_op
class KalmanFilterGrad(KalmanOpBase):
    """Adjoint Op of :class:`KalmanFilter`: (inputs, predicted_state, predicted_cov, cotangents of
    the 8 outputs) -> cotangents of the 10 inputs.  A disconnected cotangent is a zero-size array
    (the loglik one: 0).  Its pullback (second derivatives) is one fused Op,
    :class:`iterops.ts._kalman_second.KalmanFilterHVP`."""

    #: :func:`kalman_unused_outputs` may set ``unused`` (its entry point skips those cotangents)
    skips_unused = True

    __props__ = (*KalmanOpBase.__props__, "unused")
    # cotangent dimensions are their own: a zero-size placeholder matches no other input
    gufunc_signature = (
        ",".join([*IN_SIG, "(n1,m)", "(n1,m,m)", *(_own_dims(s, f"g{i}") for i, s in enumerate(_OUT_SIG))])
        + "->" + ",".join(IN_SIG)
    )

    def __init__(self, time_varying=(False,) * 7, cov_jitter=0.0, missing_value=None, unused=()):
        """``unused``: names among :data:`_SKIPPABLE` whose cotangents are not computed (they come out NaN)."""
        super().__init__(time_varying, cov_jitter, missing_value)
        self.unused = tuple(x for x in _SKIPPABLE if x in unused)

    def make_node(self, *inputs):
        """Inputs: the filter's 10, ``predicted_state``, ``predicted_cov``, the 8 output cotangents; outputs: one
        float64 cotangent per filter input, of its shape."""
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        outs = [pt.tensor(dtype="float64", shape=x.type.shape) for x in inputs[:10]]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        """Each cotangent has its input's shape."""
        return list(input_shapes[:10])

    def numba_fn(self, node):
        """The jitted entry point for this Op's props (:func:`_adjoint_entry`)."""
        return _adjoint_entry(*self._entry_args(), self.unused)

    def outputs_of(self, name):
        """Index of the output that is the cotangent of the input ``name`` (in input order)."""
        return (INPUT_NAMES.index(name),)

    def connection_pattern(self, node):
        """Every output is connected to every input but ``predicted_state`` and ``predicted_cov`` (functions of the
        inputs, counted through them): a second derivative then builds no adjoint pass for their zero cotangents."""
        n_x = len(node.outputs)
        return [[i not in (n_x, n_x + 1)] * n_x for i in range(len(node.inputs))]

    def pullback(self, inputs, outputs, cotangents):
        """Second derivatives: one fused kernel call, :class:`iterops.ts._kalman_second.KalmanFilterHVP`."""
        return _kalman_second.adjoint_pullback(self, inputs, cotangents)


#: the inputs whose cotangents :class:`KalmanFilterGrad` can leave out (``unused``): each costs O(m^3) (T) or
#: O(m^2) (Z) per step; the others cost O(m) per step or are computed once
_SKIPPABLE = ("T", "Z")


@node_rewriter([Blockwise, KalmanOpBase])
def kalman_unused_outputs(fgraph, node):
    """Kalman Ops leave out the work of outputs nothing in the graph reads; every other output is unchanged.

    * :class:`KalmanFilter` whose ``forecast_error_cov`` is unused gets ``forecast_cov=False``: its univariate
      steps skip ``F = Z P Z^T + H`` (O(p m^2 + p^2 m) per step, the multivariate update's cost the univariate
      one avoids).  With neither ``filtered_cov`` nor ``predicted_cov`` read (PyMC's logp) it gets
      ``covariances=False``: a steady stretch skips their per-step copies (2 m^2 per step, most of a frozen
      step's time).
    * :class:`KalmanFilterGrad` whose cotangent of ``T`` (or ``Z``) is unused gets ``unused=("T", ...)``: its
      reverse steps skip ``T_bar += 2 G T P_f`` (a dense m^3 product per step, most of a structural model's
      reverse step) or the m^2 terms of ``Z_bar``; those outputs come out NaN.  The same for the second
      derivatives' :class:`~iterops.ts._kalman_second.KalmanFilterHVP` (its unread outputs come out 0).  A PyMC
      model whose ``T`` and ``Z`` hold no free parameter never reads them.
    * A gradient Op whose output cotangents are all zero (constants, a zero ``Alloc``, disconnected placeholders)
      is replaced by zeros: a second derivative of PyMC's logp differentiates ``switch(loglik == -inf, ...)``,
      whose condition gives the filter a zero cotangent, and would otherwise run an adjoint pass for it."""
    blockwise = isinstance(node.op, Blockwise)
    core = node.op.core_op if blockwise else node.op
    if isinstance(core, KalmanFilterGrad) and all(_is_zero(g) for g in node.inputs[len(node.outputs) + 2:]):
        # J^T 0: no reverse pass.  Shapes from the inputs (an output's own shape would keep the node alive)
        in_shapes = [[x.shape[i] for i in range(x.type.ndim)] for x in node.inputs]
        shapes = node.op.infer_shape(node, in_shapes)  # Blockwise: batch dimensions broadcast
        zeros = [pt.zeros(shape, dtype=out.type.dtype) for shape, out in zip(shapes, node.outputs)]
        copy_stack_trace(node.outputs, zeros)
        return zeros
    if type(core) is KalmanFilter:
        forecast_cov = core.forecast_cov and bool(fgraph.clients[node.outputs[7]])
        covariances = core.covariances and bool(fgraph.clients[node.outputs[3]] or fgraph.clients[node.outputs[5]])
        if forecast_cov == core.forecast_cov and covariances == core.covariances:
            return None
        new = KalmanFilter(core.time_varying, core.cov_jitter, core.missing_value, core.univariate,
                           forecast_cov=forecast_cov, covariances=covariances)
    elif getattr(core, "skips_unused", False):  # KalmanFilterGrad, KalmanFilterHVP
        unused = tuple(x for x in _SKIPPABLE if not any(fgraph.clients[node.outputs[i]] for i in core.outputs_of(x)))
        if set(unused) <= set(core.unused):
            return None
        new = type(core)(**{**core._props_dict(), "unused": (*core.unused, *unused)})
    else:
        return None
    outs = (Blockwise(new) if blockwise else new)(*node.inputs, return_list=True)
    copy_stack_trace(node.outputs, outs)
    return outs


def _is_zero(g) -> bool:
    """Whether the cotangent ``g`` is zero in the graph: a zero-size placeholder (disconnected) or a constant 0
    (through ``Alloc``, ``DimShuffle``, casts: PyTensor's ``get_underlying_scalar_constant_value``)."""
    if 0 in g.type.shape:
        return True
    try:
        return get_underlying_scalar_constant_value(g) == 0
    except NotScalarConstantError:
        return False


# registered in iterops.rewrites


# ---------------------------------------------------------------------------
# Exact diffuse initialization (kalman_filter(..., diffuse=...)); kernels in iterops.ts._kalman_diffuse
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _tail(X, start, flag):
    """Rows ``start:`` of a time-varying system matrix (``flag``), the static one whole."""
    return X[start:] if flag else X[0:]


@numba.njit(cache=True)
def _tail_or_empty(g, start):
    """Rows ``start:`` of a per-step cotangent; a disconnected (zero-row) one stays zero-row."""
    return g[start:] if g.shape[0] > 0 else g[0:]


@opaque_kernel(SIGNATURE)
def _diffuse_filter_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`iterops.ts._kalman_diffuse.diffuse_filter` (arguments:
    :data:`DIFFUSE_FILTER_ABI`; writes ``start.status``).  Returns the log-likelihood of the diffuse steps."""
    x, options, start, out = _diffuse_filter_args(ptrs, dims, vals)
    ll, dd, ok = diffuse_filter(x.y, x.a0, x.P0, start.P_inf, x.system, options, out)
    start.status[0] = dd
    start.status[1] = 1.0 if ok else 0.0
    return ll


@opaque_kernel(SIGNATURE)
def _diffuse_adjoint_abi(ptrs, dims, vals):
    """C-ABI barrier around :func:`iterops.ts._kalman_diffuse.diffuse_adjoint` (arguments:
    :data:`DIFFUSE_ADJOINT_ABI`: accumulates into ``grad``, writes ``hand_off.P_inf``).  Returns 0."""
    x, options, tape, cot, hand, grad = _diffuse_adjoint_args(ptrs, dims, vals)
    hand.P_inf[:, :] = diffuse_adjoint(x.y, x.system, options, tape, hand.d, cot, hand.a, hand.P, grad)
    return 0.0


# the diffuse filter runs the ordinary filter on its tail; its gradient, both adjoints
_diffuse_filter_abi.companions = ("iterops.ts.kalman._diffuse_adjoint_abi", "iterops.ts.kalman._adjoint_abi")


def _diffuse_runner(mv, use_mv):
    """A jitted ``run(x, P_inf) -> (loglik, d, ok, DiffuseOutputs)`` for :class:`Inputs` ``x``: the diffuse
    steps through their C-ABI barrier (:func:`_diffuse_filter_abi`)."""
    abi, pack = _diffuse_filter_abi.external, DIFFUSE_FILTER_ABI.pack

    @numba.njit
    def run(x, P_inf):
        """``(loglik of the diffuse steps, d = first non-diffuse step, ok, DiffuseOutputs)``."""
        (n, p), m = x.y.shape, x.a0.shape[0]
        out = diffuse_outputs(n, m, p)
        start = DiffuseStart(P_inf, np.zeros(2))
        ptrs, dims, vals = pack(x, Options(0.0, mv, use_mv), start, out)
        ll = abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
        keep_alive((x, start, ptrs, dims, vals))
        return ll, int(start.status[0]), start.status[1] != 0.0, out

    return run


@numba.njit(cache=True)
def _diffuse_inputs(func, args, tv):
    """``(Inputs, P_inf)`` of the diffuse Ops' leading arguments ``(y, a0, P0, P_inf, c, ..., Q)``, checked."""
    x = inputs_of((args[0], args[1], args[2]) + args[4:11])
    check_inputs(func, x, tv)
    m = x.a0.shape[0]
    check_shape(func, "diffuse", args[3], "(m, m), m = len(a0)", (m, m))
    return x, contiguous(args[3])


@numba.njit(cache=True)
def _inputs_from(x, d, a, P, tv):
    """The :class:`Inputs` of steps ``d..n-1`` of ``x``: ``y[d:]``, start ``(a, P)``, the time-varying system
    matrices (``tv``) from row ``d``, the static ones whole (C-contiguous, as :func:`inputs_of`'s)."""
    s, c = x.system, contiguous
    return Inputs(c(x.y[d:]), c(a), c(P), System(
        c(_tail(s.c, d, tv[0])), c(_tail(s.d, d, tv[1])), c(_tail(s.T, d, tv[2])), c(_tail(s.Z, d, tv[3])),
        c(_tail(s.R, d, tv[4])), c(_tail(s.H, d, tv[5])), c(_tail(s.Q, d, tv[6]))))


@numba.njit(cache=True)
def _copy_rows_from(out, d, tail):
    """Rows ``d:`` of each of the :class:`FilterOutputs` ``out`` = those of ``tail`` (a filter of steps ``d..``)."""
    out.loglik_obs[d:] = tail.loglik_obs
    out.filtered_state[d:] = tail.filtered_state
    out.filtered_cov[d:] = tail.filtered_cov
    out.predicted_state[d:] = tail.predicted_state
    out.predicted_cov[d:] = tail.predicted_cov
    out.forecast_error[d:] = tail.forecast_error
    out.forecast_error_cov[d:] = tail.forecast_error_cov


@numba.njit(cache=True)
def _cotangents_from(cot, d):
    """The :class:`Cotangents` of steps ``d..n-1``: the per-step ones from row ``d`` (disconnected ones empty),
    C-contiguous."""
    c, t = contiguous, _tail_or_empty
    return Cotangents(cot.loglik, c(t(cot.loglik_obs, d)), c(t(cot.filtered_state, d)), c(t(cot.filtered_cov, d)),
                      c(t(cot.predicted_state, d)), c(t(cot.predicted_cov, d)), c(t(cot.forecast_error, d)),
                      c(t(cot.forecast_error_cov, d)))


@numba.njit(cache=True)
def _add_rows_from(grad, d, tail, tv):
    """Rows ``d:`` of ``grad``'s ``y`` and of its time-varying (``tv``) system cotangents = ``tail``'s (the
    :class:`InputCotangents` of steps ``d..``); its static ones get ``tail``'s whole."""
    g, h = grad.system, tail.system
    grad.y[d:] = tail.y
    _tail(g.c, d, tv[0])[:] = h.c
    _tail(g.d, d, tv[1])[:] = h.d
    _tail(g.T, d, tv[2])[:] = h.T
    _tail(g.Z, d, tv[3])[:] = h.Z
    _tail(g.R, d, tv[4])[:] = h.R
    _tail(g.H, d, tv[5])[:] = h.H
    _tail(g.Q, d, tv[6])[:] = h.Q


@entry_point
def _diffuse_filter_entry(tv: tuple, mv: float, use_mv: bool):
    """Forward entry of :class:`KalmanFilterDiffuse`: the diffuse steps (:func:`diffuse_filter`, behind its
    C-ABI barrier), then the ordinary filter (:func:`_filter_runner`) on steps ``d..n-1`` from ``(a_d, P_d)``,
    its outputs copied into rows ``d:``."""
    filt = _filter_runner(0.0, mv, use_mv)
    run = _diffuse_runner(mv, use_mv)

    @numba.njit
    def kalman_filter_diffuse_fn(*args):
        """``(y, a0, P0, P_inf, c, d, T, Z, R, H, Q) ->`` the 8 outputs of :class:`KalmanFilterResult`; a shape
        mismatch raises; failure value as in the module docstring (``loglik = -inf``)."""
        x, P_inf = _diffuse_inputs("kalman_filter(diffuse=...)", args[:11], tv)
        ll, dd, ok, out = run(x, P_inf)
        if ok and dd < x.y.shape[0]:
            ll_tail, tail = filt(_inputs_from(x, dd, out.predicted_state[dd], out.predicted_cov[dd], tv))
            ll += ll_tail
            _copy_rows_from(out, dd, tail)
        # not ok: diffuse_filter has already NaN-filled the rows from the failing step on
        return filter_result(ll, out)

    return kalman_filter_diffuse_fn


@entry_point
def _diffuse_adjoint_entry(tv: tuple, mv: float, use_mv: bool):
    """Adjoint entry of :class:`KalmanFilterDiffuse`: re-runs the diffuse steps (their tape), runs the ordinary
    adjoint (:func:`_adjoint_runner`) on steps ``d..n-1``, then reverses the diffuse steps
    (:func:`diffuse_adjoint`, behind its C-ABI barrier) from the cotangents of ``(a_d, P_d)``."""
    adj = _adjoint_runner(0.0, mv, use_mv)
    run = _diffuse_runner(mv, use_mv)
    abi, pack = _diffuse_adjoint_abi.external, DIFFUSE_ADJOINT_ABI.pack

    @numba.njit
    def kalman_filter_diffuse_grad_fn(*args):
        """``(11 inputs, predicted_state, predicted_cov, 8 output cotangents) -> the 11 inputs' cotangents``
        (``P_inf``'s after ``P0``'s); a shape mismatch raises; every cotangent NaN if the filter failed."""
        func = "kalman_filter(diffuse=...) gradient"
        x, P_inf = _diffuse_inputs(func, args[:11], tv)
        predicted = predictions_of(func, args[11], args[12], x)
        cot = cotangents_of(func, args[13], args[14:], x)
        n, m = x.y.shape[0], x.a0.shape[0]
        _, dd, ok, tape = run(x, P_inf)
        grad = input_cotangents_like(x, 0.0 if ok else np.nan)  # failure: every cotangent NaN
        P_inf_bar = np.full((m, m), 0.0 if ok else np.nan)
        if not ok:
            return _with_p_inf(grad, P_inf_bar)
        a_bar, P_bar = np.zeros(m), np.zeros((m, m))
        if dd < n:
            tail = adj(
                _inputs_from(x, dd, predicted.state[dd], predicted.cov[dd], tv),
                Moments(contiguous(predicted.state[dd:]), contiguous(predicted.cov[dd:])), _cotangents_from(cot, dd),
            )
            _add_rows_from(grad, dd, tail, tv)
            a_bar[:] = tail.a0
            P_bar[:, :] = tail.P0
        else:
            if cot.predicted_state.shape[0] > 0:
                a_bar[:] = cot.predicted_state[n]
            if cot.predicted_cov.shape[0] > 0:
                P_bar[:, :] = cot.predicted_cov[n]
        hand = DiffuseCotangents(a_bar, P_bar, P_inf_bar, dd)
        ptrs, dims, vals = pack(x, Options(0.0, mv, use_mv), tape, cot, hand, grad)
        abi(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
        keep_alive((x, tape, cot, hand, grad, ptrs, dims, vals))
        return _with_p_inf(grad, P_inf_bar)

    return kalman_filter_diffuse_grad_fn


@numba.njit(cache=True)
def _with_p_inf(grad, P_inf_bar):
    """The diffuse gradient Op's outputs: those of :func:`gradient_tuple` of the :class:`InputCotangents`
    ``grad``, with ``P_inf``'s cotangent ``P_inf_bar`` after ``P0``'s."""
    s = grad.system
    return grad.y, grad.a0, grad.P0, P_inf_bar, s.c, s.d, s.T, s.Z, s.R, s.H, s.Q


#: core signature of the diffuse Op's inputs: ``P_inf`` (m, m) after ``P0``
DIFFUSE_IN_SIG = (*IN_SIG[:3], "(m,m)", *IN_SIG[3:])
DIFFUSE_INPUT_NAMES = (*INPUT_NAMES[:3], "P_inf", *INPUT_NAMES[3:])


@register_fused_op
class KalmanFilterDiffuse(KalmanFilter):
    """Core Op of ``kalman_filter(..., diffuse=...)``: inputs ``y, a0, P0 (= P_star), P_inf, c, d, T, Z, R,
    H, Q``, the outputs of :class:`KalmanFilter`.  ``cov_jitter`` must be 0.

    One Op rather than a diffuse Op composed with :class:`KalmanFilter` in the graph: the number of
    diffuse steps ``d`` is data-dependent, and handing ``(a_d, P_d)`` to a second Op at step ``d`` would
    need data-dependent slicing of its inputs and outputs, which JAX (static shapes) and ``Blockwise``
    batching make awkward.  Inside the entry point it is a slice: the ordinary filter's entry point runs
    on steps ``d..n-1`` unchanged (its kernels are the ones a model without ``diffuse`` compiles)."""

    gufunc_signature = ",".join(DIFFUSE_IN_SIG) + "->" + ",".join(_OUT_SIG)

    def numba_fn(self, node):
        """The jitted entry point for this Op's props (:func:`_diffuse_filter_entry`; ``cov_jitter`` is 0)."""
        tv, _, mv, use_mv = self._entry_args()
        return _diffuse_filter_entry(tv, mv, use_mv)

    def pullback(self, inputs, outputs, cotangents):
        """Cotangents of the 11 inputs from :class:`KalmanFilterDiffuseGrad` (zeros when no output's cotangent
        is connected)."""
        connected = [not isinstance(g.type, DisconnectedType) for g in cotangents]
        if not any(connected):
            return [pt.zeros_like(x) for x in inputs]
        cts = [g if h else pt.zeros((0,) * out.type.ndim) for g, h, out in zip(cotangents, connected, outputs)]
        grad_op = KalmanFilterDiffuseGrad(self.time_varying, self.cov_jitter, self.missing_value)
        return list(grad_op(*inputs, outputs[4], outputs[5], *cts))


@register_fused_op
class KalmanFilterDiffuseGrad(KalmanFilterGrad):
    """Adjoint Op of :class:`KalmanFilterDiffuse`: (its 11 inputs, predicted_state, predicted_cov,
    cotangents of the 8 outputs) -> cotangents of the 11 inputs (``P_inf`` included: the diffuse
    log-likelihood depends on its scale through ``log F_inf``).  Not differentiable itself (its pullback
    raises ``NotImplementedError``)."""

    skips_unused = False  # its entry point computes every cotangent
    gufunc_signature = (
        ",".join([*DIFFUSE_IN_SIG, "(n1,m)", "(n1,m,m)", *(_own_dims(s, f"g{i}") for i, s in enumerate(_OUT_SIG))])
        + "->" + ",".join(DIFFUSE_IN_SIG)
    )

    def make_node(self, *inputs):
        """Inputs: the diffuse filter's 11, ``predicted_state``, ``predicted_cov``, the 8 output cotangents;
        outputs: one float64 cotangent per filter input, of its shape."""
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        outs = [pt.tensor(dtype="float64", shape=x.type.shape) for x in inputs[:11]]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        """Each cotangent has its input's shape."""
        return list(input_shapes[:11])

    def numba_fn(self, node):
        """The jitted entry point for this Op's props (:func:`_diffuse_adjoint_entry`)."""
        tv, _, mv, use_mv = self._entry_args()
        return _diffuse_adjoint_entry(tv, mv, use_mv)

    def pullback(self, inputs, outputs, cotangents):
        """Raises ``NotImplementedError``: second derivatives of the diffuse filter are not implemented."""
        not_twice_differentiable(self, "kalman_filter(..., diffuse=...)", DIFFUSE_INPUT_NAMES)


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _normalize_time_varying(func, time_varying):
    """``time_varying`` (a name or names of :data:`SYSTEM_NAMES`) as 7 bools in that order; ``ValueError``
    naming the unknown names."""
    if isinstance(time_varying, str):
        time_varying = (time_varying,)
    tv = tuple(time_varying)
    unknown = [x for x in tv if x not in SYSTEM_NAMES]
    if unknown:
        raise ValueError(
            f"{func}: time_varying may only name {SYSTEM_NAMES}, got unknown name(s) {unknown}"
        )
    return tuple(name in tv for name in SYSTEM_NAMES)


def _prepare_inputs(func, args, time_varying):
    """Validate at graph-build time; return float64 core-ready inputs (in :data:`INPUT_NAMES` order), tv flags
    and the output dtype.  ``args``: the user's :class:`Inputs` (any array-likes).

    ``c`` / ``d`` may be None: zeros of length m / p (static, so ``time_varying`` may not name them)."""
    tv = _normalize_time_varying(func, time_varying)
    y = as_tensor(func, "y", args.y, min_ndim=2)
    a0 = as_tensor(func, "a0", args.a0, min_ndim=1)
    P0 = as_tensor(func, "P0", args.P0, min_ndim=2)
    given = args.system._asdict()
    for name, is_tv in zip(("c", "d"), tv[:2]):
        if given[name] is None and is_tv:
            raise ValueError(f"{func}: time_varying names {name!r} but {name} was not given (it defaults to zeros)")
    if given["c"] is None:
        given["c"] = pt.zeros(a0.shape[-1:], dtype=a0.type.dtype)
    if given["d"] is None:
        given["d"] = pt.zeros(y.shape[-1:], dtype=y.type.dtype)
    mats = {}
    for name, is_tv in zip(SYSTEM_NAMES, tv):
        x = given[name]
        nd = SYSTEM_NDIM[name] + is_tv
        x = as_tensor(func, name, x, min_ndim=nd)
        mats[name] = x
    out_dtype = float_dtype(y, a0, P0, *mats.values())
    n, p = y.type.shape[-2:]
    m = a0.type.shape[-1]

    def require(cond, msg):
        """Raise ``ValueError(f"{func}: {msg}")`` when ``cond`` (the condition is the failure)."""
        if cond:
            raise ValueError(f"{func}: {msg}")

    def eq(a, b):
        """Static lengths that may be equal: equal, or either unknown (None)."""
        return a is None or b is None or a == b

    shapes = ", ".join(
        [f"y {y.type.shape}", f"a0 {a0.type.shape}", f"P0 {P0.type.shape}"]
        + [f"{k} {v.type.shape}" for k, v in mats.items()]
    )
    suffix = f" (static shapes, None = unknown; time_varying={tuple(n_ for n_, f_ in zip(SYSTEM_NAMES, tv) if f_)}; got {shapes})"
    # dimensions: m from a0 (else T), p from y, r from Q
    if m is None:
        m = mats["T"].type.shape[-1]
    r = mats["Q"].type.shape[-1]
    require(not (eq(P0.type.shape[-1], m) and eq(P0.type.shape[-2], m)), f"P0 must be (m, m) with m = len(a0) = {m}" + suffix)
    expected = {"c": (m,), "d": (p,), "T": (m, m), "Z": (p, m), "R": (m, r), "H": (p, p), "Q": (r, r)}
    what = {
        "c": "c must have m entries (state dimension)",
        "d": "d must have p entries (y's last dimension)",
        "T": "T must be square (m, m)",
        "Z": "Z must be (p, m): p rows = y columns, m columns = states",
        "R": "R must be (m, r): m rows = states, r columns = Q's size",
        "H": "H must be square (p, p) with p = y columns",
        "Q": "Q must be square (r, r)",
    }
    for name in ("T", "H", "Q"):
        cs = mats[name].type.shape[-2:]
        require(not eq(cs[0], cs[1]), what[name] + suffix)
    for name, is_tv in zip(SYSTEM_NAMES, tv):
        x = mats[name]
        cs = x.type.shape[x.type.ndim - SYSTEM_NDIM[name]:]
        require(not all(eq(a_, b_) for a_, b_ in zip(cs, expected[name])), what[name] + suffix)
        if is_tv:
            tlen = x.type.shape[x.type.ndim - SYSTEM_NDIM[name] - 1]
            require(not eq(tlen, n), f"time-varying {name} must have length n_time = {n} along axis "
                    f"{-SYSTEM_NDIM[name] - 1}, got {tlen}" + suffix)
    f64 = lambda x: pt.cast(x, "float64") if x.type.dtype != "float64" else x  # noqa: E731
    system = [
        f64(mats[name]) if is_tv else pt.expand_dims(f64(mats[name]), -SYSTEM_NDIM[name] - 1)
        for name, is_tv in zip(SYSTEM_NAMES, tv)
    ]
    return [f64(y), f64(a0), f64(P0), *system], tv, out_dtype


def apply_kalman_op(func, op_type, args, time_varying, cov_jitter, missing_value, **options):
    """Validate (graph-build time), apply ``op_type`` through ``Blockwise``, cast back to the input precision.
    ``args``: the user's :class:`Inputs`; ``options``: further props of ``op_type``."""
    inputs, tv, out_dtype = _prepare_inputs(func, args, time_varying)
    if not np.isfinite(cov_jitter) or cov_jitter < 0:
        raise ValueError(f"{func}: cov_jitter must be finite and >= 0, got {cov_jitter}")
    outs = Blockwise(op_type(tv, cov_jitter, missing_value, **options))(*inputs)
    if out_dtype != "float64":
        outs = [pt.cast(o, out_dtype) for o in outs]
    return outs


def kalman_filter(
    y, a0, P0, *,
    c=None, d=None, T, Z, R, H, Q,
    time_varying=(),
    cov_jitter: float = 0.0,
    missing_value: float | None = None,
    diffuse=None,
    univariate="auto",
) -> KalmanFilterResult:
    r"""Kalman filter log-likelihood, filtered and predicted moments; one fused Numba loop.

    See the module docstring for the equations, the pymc-extras correspondence and
    the failure behaviour.

    Parameters
    ----------
    y : (..., n, p)
        Observations; NaN entries (and entries equal to ``missing_value``) are missing.
    a0 : (..., m), P0 : (..., m, m)
        Mean and covariance of alpha_1 (known initialization; see :func:`stationary_cov`).  ``P0`` is
        used through its symmetric part ``(P0 + P0^T) / 2`` on every path (multivariate, univariate,
        one observable, diffuse, the smoother); ``predicted_cov[0]`` is ``P0`` as given.
    c : (..., m), d : (..., p), T : (..., m, m), Z : (..., p, m), R : (..., m, r),
    H : (..., p, p), Q : (..., r, r)
        System matrices, **keyword-only** (a positional call raises ``TypeError``: with
        matching shapes, swapped ``H``/``Q`` or ``c``/``d`` would silently change the result).
        ``c`` and ``d`` default to zeros (no intercepts); the others are required.  A name
        listed in ``time_varying`` carries an extra time axis of length ``n`` right before
        its core dimensions, e.g. ``T`` (..., n, m, m).
    time_varying : iterable of {"c", "d", "T", "Z", "R", "H", "Q"}
        Which system matrices vary over time (explicit; shapes are not guessed).
    cov_jitter : float
        Added to the diagonal of ``F`` and of the filtered covariance at each step
        (pymc-extras' ``cov_jitter``).  0 reproduces statsmodels.
    missing_value : float, optional
        Extra sentinel marking missing observations (pymc-extras' ``missing_fill_value``, -9999.0).
    diffuse : None, sequence of m bools, or (..., m, m) tensor ``P_inf``
        Exact diffuse initialization (Durbin & Koopman 2012, sec. 5.2-5.3; statsmodels'
        ``initialization='diffuse'``): ``alpha_1 ~ N(a0, P0 + kappa P_inf)``, ``kappa -> infinity``,
        with ``P0`` playing ``P_star``.  A boolean mask marks the diffuse states (``P_inf =
        diag(mask)``; give ``P0`` zero rows and columns there, as statsmodels' mixed
        ``Initialization`` does); a matrix is ``P_inf`` itself (symmetric PSD; differentiable: the
        likelihood depends on its scale through ``log F_inf``).  While ``P_inf,t != 0`` the filter
        runs the exact initial steps, one observed component at a time (statsmodels' univariate
        treatment; ``H`` must be diagonal in those steps), each diffuse component adding
        ``-(log 2 pi + log F_inf)/2`` to the log-likelihood; from the first step ``d`` with
        ``P_inf,d = 0`` the ordinary recursion above runs from ``(a_d, P_d)``.  Every output equals
        statsmodels' exact diffuse filter (``loglikelihood_burn = 0``; in diffuse steps
        ``forecast_error`` is the sequential one and ``forecast_error_cov`` diagonal).  Failure:
        ``loglik = -inf`` (NaN outputs from the failing step) if a component has ``F_inf`` and
        ``F_star`` both ``<= 1e-10`` (or non-finite), ``H`` is not diagonal in a diffuse step, or
        ``P_inf`` is still nonzero after the last step.  Not combinable with ``cov_jitter > 0``
        (``ValueError``).  Kernels: :mod:`iterops.ts._kalman_diffuse`.
    univariate : "auto" (default), True or False
        The measurement update of steps where ``sym(H_t)`` is diagonal: one observed component at a
        time (Durbin & Koopman 2012, sec. 6.4; statsmodels' ``filter_univariate``; O(k m^2) per step
        instead of the Cholesky's O(k^3 + k^2 m)) or the multivariate one above.  The same function:
        every output, ``forecast_error`` and the full ``forecast_error_cov`` included, is the
        multivariate filter's to rounding (``cov_jitter`` and missing components included), and both
        fail (``-inf``) at the same steps, since the univariate variances are the pivots of
        ``F_oo = L D L^T``.  When nothing uses ``forecast_error_cov`` (a graph rewrite,
        :func:`kalman_unused_outputs`, sees it), univariate steps do not compute it (it holds NaN
        there); otherwise they compute it, at the cost of the multivariate ``Z P Z^T``.  ``"auto"``
        takes the univariate update where it is faster (:func:`_choose_update`, the kernel's rule:
        ``p >= 2`` and ``m <= 16``, or ``p >= 5 m / 6`` when ``forecast_error_cov`` is used; measured in
        ``benchmarks/bench_kalman.py``), True wherever H is diagonal.
        H is checked from its values, once per call for a static H and every step for a time-varying
        one; ``univariate=True`` with a constant non-diagonal ``H`` is a ``ValueError``, with a
        symbolic one a non-diagonal step takes the multivariate update.  The step entering a steady
        state (see :func:`iterops.ts._kalman_filter.kalman_filter_kernel`) and the gradient (the
        adjoint recomputes each step's update from the stored predictions) are multivariate.  In
        exact diffuse steps the update is univariate anyway.

    Leading (batch) dimensions of all arguments broadcast.

    Returns
    -------
    KalmanFilterResult
        ``loglik`` (...), ``loglik_obs`` (..., n), ``filtered_state`` (..., n, m),
        ``filtered_cov`` (..., n, m, m), ``predicted_state`` (..., n+1, m),
        ``predicted_cov`` (..., n+1, m, m), ``forecast_error`` (..., n, p),
        ``forecast_error_cov`` (..., n, p, p).  dtype: float64, or float32 if all inputs are float32.

    Examples
    --------
    >>> import numpy as np, iterops
    >>> y = np.array([[1.0], [np.nan], [0.5]])
    >>> res = iterops.ts.kalman_filter(y, [0.0], [[1.0]], T=[[1.0]], Z=[[1.0]], R=[[1.0]],
    ...                                H=[[1.0]], Q=[[0.5]])
    >>> round(float(res.loglik.eval()), 6)  # statsmodels' KalmanFilter llf: -2.892596
    -2.892596
    """
    args = Inputs(y, a0, P0, System(c=c, d=d, T=T, Z=Z, R=R, H=H, Q=Q))
    if diffuse is not None:
        return _kalman_filter_diffuse(args, time_varying, cov_jitter, missing_value, diffuse)
    _check_univariate("kalman_filter", univariate, H)
    outs = apply_kalman_op("kalman_filter", KalmanFilter, args, time_varying, cov_jitter, missing_value,
                           univariate=univariate)
    return KalmanFilterResult(*outs)


def _choose_update(m, p, H, univariate="auto", forecast_cov=True):
    """"univariate" or "multivariate": the update the forward kernel takes on a step with m states, p
    observables and (core) H, for the ``univariate`` option, when ``forecast_error_cov`` is used
    (``forecast_cov``) or not (the kernel's own rule, :func:`iterops.ts._kalman_steps.prefers_univariate`,
    run in Python)."""
    H = np.asarray(H, dtype=float)
    mode = UPDATE_MODES[univariate]
    uni = mode == UNIVARIATE or (mode == AUTO and prefers_univariate.py_func(m, p, forecast_cov))
    diag = diagonal.py_func(H)  # the kernel's own check, run in Python
    return "univariate" if uni and diag else "multivariate"


def _check_univariate(func, univariate, H):
    """Graph-build checks of ``univariate``: one of its values; True needs a diagonal H when H is a constant."""
    if not (isinstance(univariate, (bool, np.bool_)) or univariate == "auto"):
        raise ValueError(f"{func}: univariate must be 'auto', True or False, got {univariate!r}")
    if univariate is not True:
        return
    H = H if isinstance(H, Variable) else pt.as_tensor_variable(H)
    if not isinstance(H, Constant) or H.type.ndim < 2:
        return  # symbolic: a non-diagonal step takes the multivariate update at run time
    Hv = np.asarray(H.data, dtype=float)
    if np.any((Hv + np.swapaxes(Hv, -1, -2))[..., ~np.eye(Hv.shape[-1], dtype=bool)] != 0.0):
        raise ValueError(
            f"{func}: univariate=True needs a diagonal H (the update processes one observed component at a "
            f"time), but the constant H (shape {Hv.shape}, dtype {Hv.dtype}) has nonzero off-diagonal entries; "
            "use univariate='auto' or False"
        )


def _kalman_filter_diffuse(args, time_varying, cov_jitter, missing_value, diffuse):
    """``kalman_filter(..., diffuse=...)``: validate ``diffuse`` (graph-build time), apply :class:`KalmanFilterDiffuse`."""
    func = "kalman_filter"
    if cov_jitter != 0.0:
        raise ValueError(
            f"{func}: diffuse=... is not supported together with cov_jitter > 0 (got cov_jitter={cov_jitter}); "
            "the exact diffuse filter is statsmodels' arithmetic, without jitter"
        )
    inputs, tv, out_dtype = _prepare_inputs(func, args, time_varying)
    a0 = dict(zip(INPUT_NAMES, inputs))["a0"]
    m = a0.type.shape[-1]
    if isinstance(diffuse, (list, tuple, np.ndarray)) and np.asarray(diffuse).dtype == bool:
        mask = np.asarray(diffuse)
        if mask.ndim != 1 or (m is not None and mask.shape[0] != m):
            raise ValueError(
                f"{func}: a diffuse mask must be a sequence of m = {m} bools (one per state, m = len(a0)); "
                f"got shape {mask.shape} (a0 {a0.type.shape})"
            )
        P_inf = pt.as_tensor_variable(np.diag(mask.astype("float64")))
    else:
        P_inf = as_tensor(func, "diffuse", diffuse, min_ndim=2)
        cs = P_inf.type.shape[-2:]
        if any(x is not None and m is not None and x != m for x in cs) or (
            cs[0] is not None and cs[1] is not None and cs[0] != cs[1]
        ):
            raise ValueError(
                f"{func}: diffuse given as a matrix must be P_inf of shape (..., m, m) with m = len(a0) = {m}; "
                f"got diffuse {P_inf.type.shape}, a0 {a0.type.shape}"
            )
        if P_inf.type.dtype != "float64":
            P_inf = pt.cast(P_inf, "float64")
    outs = Blockwise(KalmanFilterDiffuse(tv, 0.0, missing_value))(*inputs[:3], P_inf, *inputs[3:])
    if out_dtype != "float64":
        outs = [pt.cast(o, out_dtype) for o in outs]
    return KalmanFilterResult(*outs)


def stationary_cov(T, R, Q) -> TensorVariable:
    r"""Stationary initialization ``P0`` solving ``P0 = T P0 T^T + R Q R^T``.

    ``T`` (..., m, m) must have spectral radius below one; ``R`` (..., m, r),
    ``Q`` (..., r, r).  Calls :func:`iterops.solve_discrete_lyapunov`, so it is
    fused, batched and differentiable.
    """
    from iterops.linalg.lyapunov import solve_discrete_lyapunov

    func = "stationary_cov"
    T = as_tensor(func, "T", T, min_ndim=2)
    R = as_tensor(func, "R", R, min_ndim=2)
    Q = as_tensor(func, "Q", Q, min_ndim=2)
    if T.type.shape[-1] is not None and R.type.shape[-2] is not None and T.type.shape[-1] != R.type.shape[-2]:
        raise ValueError(f"{func}: R must have m = {T.type.shape[-1]} rows, got R with shape {R.type.shape}")
    if Q.type.shape[-1] is not None and R.type.shape[-1] is not None and Q.type.shape[-1] != R.type.shape[-1]:
        raise ValueError(f"{func}: Q must be (r, r) with r = R's columns, got Q {Q.type.shape}, R {R.type.shape}")
    return solve_discrete_lyapunov(T, R @ Q @ R.mT)


# second derivatives: KalmanFilterGrad's pullback Op (imported last: that module imports this one)
from iterops.ts import _kalman_second  # noqa: E402
