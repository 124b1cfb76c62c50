r"""Levinson-Durbin recursion, Yule-Walker estimates and sample autocovariances.

Given autocovariances ``gamma_0..gamma_p`` the Yule-Walker equations

.. math::  \Gamma_p \phi = \gamma_{1:p},\qquad \Gamma_p = \mathrm{toeplitz}(\gamma_{0:p-1}),
           \qquad \sigma^2 = \gamma_0 - \gamma_{1:p}^T \phi

are solved in O(p^2) by Durbin's recursion (Durbin 1960; Brockwell & Davis,
*Time Series: Theory and Methods*, Prop. 5.2.1), which also yields the partial
autocorrelations ``kappa_k = phi_{k,k}``:

.. math::
    \kappa_k = \frac{\gamma_k - \sum_{j<k} \phi_{k-1,j}\gamma_{k-j}}{v_{k-1}},\quad
    \phi_{k,j} = \phi_{k-1,j} - \kappa_k\phi_{k-1,k-j},\quad
    v_k = v_{k-1}(1-\kappa_k^2),\quad v_0 = \gamma_0 .

One fused Numba kernel, batched over leading dimensions.

Failure is a value: if ``gamma_0 <= 0``, the Toeplitz matrix ``Gamma_{p+1}`` is
not positive definite (some ``v_k <= 0``, i.e. ``|kappa_k| >= 1``) or an input is
not finite, every output is NaN.  An ``acov`` shorter than ``order + 1`` raises ``ValueError``.

Gradients (exact): reverse mode is one fused kernel, :class:`LevinsonDurbinGrad`
(:func:`levinson_durbin_vjp_kernel`, about 3 p^2 multiply-adds in loops without a recurrence).
By the implicit function theorem on ``F(phi; gamma) = Gamma_p phi - gamma_{1:p}``,
``lam = Gamma_p^{-1} phi_bar_total`` with ``phi_bar_total = phi_bar - sigma2_bar gamma_{1:p}``
(``sigma2 = gamma_0 - gamma_{1:p}^T phi``), computed by the Gohberg-Semencul formula

.. math::  \Gamma_p^{-1} = \frac{1}{v_{p-1}}\left(L(u)L(u)^T - L(w)L(w)^T\right),\quad
           u = (1, -a_1, \dots, -a_{p-1}),\quad w = (0, -a_{p-1}, \dots, -a_1)

(Gohberg & Semencul 1972; Golub & Van Loan, *Matrix Computations*, 4th ed., Sec. 4.7) from the
order ``p - 1`` predictor ``a``, one step-down of ``phi`` (:mod:`iterops.ts.ar`); ``L(.)`` is
lower-triangular Toeplitz.  Then ``gamma_{1:p}`` gets ``lam``, ``gamma_{0:p-1}`` the symmetric
diagonal sums of ``-lam phi^T``.  A ``pacf`` cotangent reaches ``phi`` through the adjoint of
:func:`ar_to_pacf`.  Second derivatives: the gradient Op's pullback differentiates the same formula
written with public functions (:func:`solve_toeplitz`, :func:`~iterops.ts.toeplitz.outer_diagonal_sums`),
which the kernel equals wherever ``phi`` is the forward's.  Forward mode:
``Gamma_p phi_dot = gamma_dot_{1:p} - Gamma_dot_p phi`` by :func:`solve_toeplitz`.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply
from pytensor.graph.replace import graph_replace
from pytensor.tensor.signal import convolve1d
from pytensor.tensor.variable import TensorVariable

from iterops._fused import FirstInputShaped, FusedOp, apply_batched, entry_point, register_fused_op
from iterops._validate import as_tensor, check_at_least, check_shape, float_dtype
from iterops.ts.ar import _derivative, _static_int
from iterops.ts.toeplitz import outer_diagonal_sums, solve_toeplitz, toeplitz_matrix

__all__ = [
    "LevinsonDurbinResult",
    "levinson_durbin",
    "yule_walker",
    "acovf",
    "LevinsonDurbin",
    "LevinsonDurbinGrad",
    "AutoCov",
    "levinson_durbin_kernel",
    "levinson_durbin_vjp_kernel",
]


class LevinsonDurbinResult(NamedTuple):
    """Result of :func:`levinson_durbin`.

    ar : (..., order)
        AR coefficients ``phi_1..phi_p`` (``x_t = sum_j phi_j x_{t-j} + e_t``);
        statsmodels' ``arcoefs``.
    sigma2 : (...)
        Innovation variance ``v_p``; statsmodels' ``sigma_v``.
    pacf : (..., order)
        Partial autocorrelations at lags 1..p.  statsmodels' ``pacf`` has
        ``order + 1`` entries starting with the lag-0 value 1: ours is its ``[1:]``.
    """

    ar: TensorVariable
    sigma2: TensorVariable
    pacf: TensorVariable


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def levinson_durbin_kernel(acov, order):
    """Durbin's recursion on float64 ``acov`` (m,), m >= order + 1.

    Returns ``(phi (order,), sigma2, pacf (order,))``; all NaN on failure.
    """
    p = order
    phi = np.zeros(p)
    pacf = np.zeros(p)
    prev = np.zeros(p)
    nan = (np.full(p, np.nan), np.nan, np.full(p, np.nan))
    if acov.shape[0] < p + 1 or not acov[0] > 0.0:
        return nan
    for k in range(p + 1):  # (loops: no array expression to compile)
        if not np.isfinite(acov[k]):
            return nan
    v = acov[0]
    for k in range(p):  # order k + 1
        num = acov[k + 1]
        for j in range(k):
            num -= prev[j] * acov[k - j]
        kap = num / v
        for j in range(k):
            phi[j] = prev[j] - kap * prev[k - 1 - j]
        phi[k] = kap
        pacf[k] = kap
        v = v * (1.0 - kap * kap)
        if not v > 0.0:  # Gamma_{k+2} not positive definite
            return nan
        for j in range(k + 1):  # (explicit loop: numba slice copies are slow)
            prev[j] = phi[j]
    return phi, v, pacf


@numba.njit(cache=True)
def levinson_durbin_vjp_kernel(acov, phi, phi_bar, sigma2_bar):
    """``acov_bar`` (m,) of ``(phi, sigma2) = levinson_durbin(acov, p)`` for float64 ``acov`` (m,), ``phi`` (p,)
    (the forward's, ``p >= 1``), cotangents ``phi_bar`` (p,) and ``sigma2_bar`` (a float).

    ``lam = Gamma_p^{-1} (phi_bar - sigma2_bar gamma_{1:p})`` by the Gohberg-Semencul formula from the
    order-(p-1) predictor (``phi`` stepped down once), then ``gamma_{1:p}`` gets ``lam - sigma2_bar phi``,
    ``gamma_0`` gets ``sigma2_bar`` and ``gamma_{0:p-1}`` the symmetric diagonal sums of ``-lam phi^T``.
    About 3 p^2 multiply-adds in loops without a recurrence.  All NaN where the forward failed.
    """
    m, p = acov.shape[0], phi.shape[0]
    out = np.zeros(m)
    kap = phi[p - 1]
    den = 1.0 - kap * kap
    if not den > 0.0:  # |kappa_p| >= 1 or NaN: the forward failed
        out[:] = np.nan
        return out
    # order p-1 predictor a (step-down) and its error variance v_{p-1}; the Gohberg-Semencul
    # generators u = [1, -a_1, ..., -a_{p-1}], w = [0, -a_{p-1}, ..., -a_1]:
    # Gamma_p^{-1} = (L(u) L(u)^T - L(w) L(w)^T) / v_{p-1}, L(.) lower-triangular Toeplitz
    u = np.zeros(p)
    w = np.zeros(p)
    u[0] = 1.0
    v = acov[0]
    for j in range(p - 1):
        a = (phi[j] + kap * phi[p - 2 - j]) / den
        u[j + 1] = -a
        w[p - 1 - j] = -a
        v -= acov[j + 1] * a
    if not v > 0.0:
        out[:] = np.nan
        return out
    b = np.empty(p)  # total cotangent of phi (sigma2 = gamma_0 - gamma_{1:p}.phi contributes)
    for i in range(p):
        b[i] = phi_bar[i] - sigma2_bar * acov[i + 1]
    t1 = np.zeros(p)  # L(u)^T b
    t2 = np.zeros(p)  # L(w)^T b
    for d in range(p):
        ud, wd, bd = u[d], w[d], b[d:]  # (views, here and below: indices LLVM can vectorize)
        for i in range(p - d):
            t1[i] += ud * bd[i]
            t2[i] += wd * bd[i]
    lam = np.zeros(p)  # L(u) t1 - L(w) t2
    for d in range(p):
        ud, wd, lamd = u[d], w[d], lam[d:]
        for i in range(p - d):
            lamd[i] += ud * t1[i] - wd * t2[i]
    for i in range(p):
        lam[i] /= v
    s = np.zeros(2 * p - 1)  # s[p - 1 + i - j] = sum of lam_i phi_j along diagonal i - j
    for j in range(p):
        pj = phi[j]
        sj = s[p - 1 - j : 2 * p - 1 - j]
        for i in range(p):
            sj[i] += pj * lam[i]
    out[0] = sigma2_bar - s[p - 1]
    for k in range(1, p):
        out[k] = -(s[p - 1 + k] + s[p - 1 - k])
    for i in range(p):
        out[i + 1] += lam[i] - sigma2_bar * phi[i]
    return out


@numba.njit(cache=True)
def autocov_kernel(x, nlags, adjusted):
    """``sum_{t} x[t+k] x[t] / d_k`` for k = 0..nlags, ``d_k = n`` or ``n - k``; NaN for k >= n."""
    n = x.shape[0]
    out = np.full(nlags + 1, np.nan)
    for k in range(min(nlags + 1, n)):
        acc = 0.0
        for t in range(n - k):
            acc += x[t + k] * x[t]
        out[k] = acc / ((n - k) if adjusted else n)
    return out


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


@entry_point
def _ld_entry(order: int, out_dtype: str):
    out = np.dtype(out_dtype).type

    @numba.njit
    def run(acov):
        check_at_least("levinson_durbin", "acov", acov, "(m,), m >= order + 1", order + 1)
        phi, v, pacf = levinson_durbin_kernel(np.ascontiguousarray(acov).astype(np.float64), order)
        return phi.astype(out), np.asarray(v).astype(out), pacf.astype(out)

    return run


@register_fused_op
class LevinsonDurbin(FusedOp):
    """Core Op ``(m)->(p),(),(p)``: (ar, sigma2, pacf); use :func:`levinson_durbin`."""

    __props__ = ("order",)
    gufunc_signature = "(m)->(p),(),(p)"

    def __init__(self, order: int):
        self.order = int(order)

    def make_node(self, acov):
        acov = pt.as_tensor_variable(acov)
        dt = float_dtype(acov)
        p = self.order
        outputs = [pt.tensor(dtype=dt, shape=(p,)), pt.tensor(dtype=dt, shape=()), pt.tensor(dtype=dt, shape=(p,))]
        return Apply(self, [acov], outputs)

    def infer_shape(self, node, input_shapes):
        return [(self.order,), (), (self.order,)]

    def numba_fn(self, node):
        return _ld_entry(self.order, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        (acov,) = inputs
        phi, sigma2, _ = outputs
        phi_bar, sigma2_bar, pacf_bar = cotangents
        connected = [not isinstance(v.type, DisconnectedType) for v in cotangents]
        if not any(connected):
            return [disconnected_type()]
        # cotangent of phi, direct and via pacf = ar_to_pacf(phi); sigma2's goes to the kernel
        terms = [phi_bar] if connected[0] else []
        if connected[2]:
            terms.append(_derivative("ar_to_pacf", "vjp", phi, pacf_bar))
        phi_bar = sum(terms[1:], terms[0]) if terms else pt.zeros_like(phi)
        sigma2_bar = sigma2_bar if connected[1] else pt.zeros_like(sigma2)
        return [apply_batched(LevinsonDurbinGrad(self.order), acov, phi, phi_bar, sigma2_bar)]

    def pushforward(self, inputs, outputs, tangents):
        (acov,) = inputs
        phi, _, _ = outputs
        (acov_dot,) = tangents
        if isinstance(acov_dot.type, DisconnectedType):
            return [disconnected_type()] * 3
        p = self.order
        # Gamma_p phi_dot = gamma_dot_{1:p} - Gamma_dot_p phi
        phi_dot = solve_toeplitz(acov[:p], acov_dot[1 : p + 1] - toeplitz_matrix(acov_dot[:p]) @ phi)
        sigma2_dot = acov_dot[0] - pt.dot(acov_dot[1 : p + 1], phi) - pt.dot(acov[1 : p + 1], phi_dot)
        pacf_dot = _derivative("ar_to_pacf", "jvp", phi, phi_dot)
        return [phi_dot, sigma2_dot, pacf_dot]


def _vjp_graph(acov, phi, phi_bar, sigma2_bar, p):
    """:class:`LevinsonDurbinGrad`'s value written with public functions (a Toeplitz solve and a
    cross-correlation): what its own pullback differentiates, and the JAX backend's formula."""
    # IFT on Gamma_p phi = gamma_{1:p} (Gamma_p symmetric): lam = Gamma_p^{-1} phi_total,
    # gamma_{1:p} gets lam, gamma_{0:p-1} the symmetric diagonal sums of -lam phi^T
    lam = solve_toeplitz(acov[:p], phi_bar - sigma2_bar * acov[1 : p + 1])
    S = -outer_diagonal_sums(lam[:, None], phi[:, None])  # (2p - 1,): diagonal i - j = d at p - 1 + d
    sym = S[p - 1 :] + pt.concatenate([pt.zeros((1,), dtype=S.dtype), S[: p - 1][::-1]])
    acov_bar = pt.inc_subtensor(pt.zeros_like(acov)[0], sigma2_bar)
    acov_bar = pt.inc_subtensor(acov_bar[:p], sym)
    return pt.inc_subtensor(acov_bar[1 : p + 1], lam - sigma2_bar * phi)


@entry_point
def _vjp_entry(order: int, out_dtype: str):
    out = np.dtype(out_dtype).type

    @numba.njit
    def run(acov, phi, phi_bar, sigma2_bar):
        func = "levinson_durbin gradient"
        check_at_least(func, "acov", acov, "(m,), m >= order + 1", order + 1)
        check_shape(func, "phi", phi, "(order,)", (order,))
        check_shape(func, "phi_bar", phi_bar, "(order,)", (order,))
        f64 = np.float64
        return levinson_durbin_vjp_kernel(
            np.ascontiguousarray(acov).astype(f64),
            np.ascontiguousarray(phi).astype(f64),
            np.ascontiguousarray(phi_bar).astype(f64),
            f64(sigma2_bar.item()),
        ).astype(out)

    return run


@register_fused_op
class LevinsonDurbinGrad(FirstInputShaped):
    """Core Op ``(m),(p),(p),()->(m)``: ``acov_bar`` from ``(acov, phi, phi_bar, sigma2_bar)``.

    The reverse pass of :class:`LevinsonDurbin` (:func:`levinson_durbin_vjp_kernel`); ``phi`` must be the
    forward's ``ar`` at ``acov``.  Its pullback differentiates :func:`_vjp_graph`, which equals the
    kernel wherever ``phi = levinson_durbin(acov).ar``, so second derivatives along that graph are exact.
    """

    __props__ = ("order",)
    gufunc_signature = "(m),(p),(p),()->(m)"

    def __init__(self, order: int):
        self.order = int(order)

    def numba_fn(self, node):
        return _vjp_entry(self.order, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        (w,) = cotangents
        if isinstance(w.type, DisconnectedType):
            return [disconnected_type()] * 4
        # partial derivatives: on fresh copies of the inputs (phi depends on acov in the caller's graph)
        fresh = [x.type() for x in inputs]
        w_ = w.type()
        bars = pytensor.grad(pt.sum(w_ * _vjp_graph(*fresh, self.order)), fresh,
                             disconnected_inputs="ignore", return_disconnected="zero")
        return graph_replace(bars, dict(zip([*fresh, w_], [*inputs, w])), strict=False)


@entry_point
def _acov_entry(nlags: int, adjusted: bool, out_dtype: str):
    out = np.dtype(out_dtype).type

    @numba.njit
    def run(x):
        return autocov_kernel(np.ascontiguousarray(x).astype(np.float64), nlags, adjusted).astype(out)

    return run


@register_fused_op
class AutoCov(FusedOp):
    """Core Op ``(n)->(l)``, ``l = nlags + 1``: lagged products of an (already demeaned) series."""

    __props__ = ("nlags", "adjusted")
    gufunc_signature = "(n)->(l)"

    def __init__(self, nlags: int, adjusted: bool = False):
        self.nlags = int(nlags)
        self.adjusted = bool(adjusted)

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [pt.tensor(dtype=float_dtype(x), shape=(self.nlags + 1,))])

    def infer_shape(self, node, input_shapes):
        return [(self.nlags + 1,)]

    def numba_fn(self, node):
        return _acov_entry(self.nlags, self.adjusted, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        (x,) = inputs
        (g,) = cotangents
        if isinstance(g.type, DisconnectedType):
            return [disconnected_type()]
        # acov_k = sum_t x_{t+k} x_t / d_k  =>  x_bar_m = sum_k h_k (x_{m-k} + x_{m+k}),  h = g / d
        n, L = x.shape[0], self.nlags
        # the divisor in x's dtype: an int64 one upcasts float32 to float64, and PyTensor's Numba
        # convolve1d fails on mixed dtypes
        d = pt.cast((n - pt.arange(L + 1)) if self.adjusted else n, x.dtype)
        h = g / d
        if L == 0:
            return [2 * h[0] * x]  # acov_0 = x.x / d_0 (PyTensor's Numba convolution rejects a length-1 kernel)
        back = convolve1d(x, h, mode="full")[:n]  # sum_k h_k x_{m-k}
        fwd = convolve1d(x, h[::-1], mode="full")[L : L + n]  # sum_k h_k x_{m+k}
        return [back + fwd]


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _check_acov(func, acov, order):
    order = _static_int(func, "order", order, minimum=1)
    acov = as_tensor(func, "acov", acov, min_ndim=1)
    if acov.type.numpy_dtype.kind == "c":
        raise TypeError(f"{func}: complex acov is not supported (got dtype {acov.type.dtype})")
    m = acov.type.shape[-1]
    if m is not None and order > m - 1:
        raise ValueError(
            f"{func}: order must be <= len(acov) - 1, got order={order} and acov with shape {acov.type.shape}"
        )
    return acov, order


def levinson_durbin(acov, order: int) -> LevinsonDurbinResult:
    r"""AR(order) coefficients, innovation variance and partial autocorrelations from autocovariances.

    Durbin's O(p^2) recursion for the Yule-Walker equations (module docstring).

    Parameters
    ----------
    acov : tensor (..., m)
        Autocovariances ``gamma_0, gamma_1, ...``; the first ``order + 1`` are used.
    order : int
        Static AR order ``p >= 1``, at most ``m - 1`` (``ValueError`` otherwise: at graph build when
        ``m`` is known, at run time otherwise).

    Returns
    -------
    LevinsonDurbinResult(ar (..., p), sigma2 (...), pacf (..., p))
        Equal to ``statsmodels.tsa.stattools.levinson_durbin(acov, nlags=p,
        isacov=True)``'s ``arcoefs``, ``sigma_v`` and ``pacf[1:]`` (statsmodels
        prepends the lag-0 value 1).  All NaN if ``gamma_0 <= 0``, the Toeplitz
        matrix of ``gamma_0..gamma_p`` is not positive definite or an input is not
        finite.

    Replaces the double loop (or a ``pytensor.scan`` over ``k``)::

        for k in range(1, p + 1):
            kappa = (gamma[k] - phi[:k-1] @ gamma[1:k][::-1]) / v
            phi[:k-1] = phi[:k-1] - kappa * phi[:k-1][::-1]; phi[k-1] = kappa
            v = v * (1 - kappa**2)

    Examples
    --------
    >>> import iterops
    >>> r = iterops.ts.levinson_durbin([4.0, 2.0, 0.5], 2)
    >>> r.ar.eval(), float(r.sigma2.eval()), r.pacf.eval()
    (array([ 0.58333333, -0.16666667]), 2.9166666666666665, array([ 0.5       , -0.16666667]))
    """
    acov, order = _check_acov("levinson_durbin", acov, order)
    ar, sigma2, pacf = apply_batched(LevinsonDurbin(order), acov)
    return LevinsonDurbinResult(ar, sigma2, pacf)


def yule_walker(acov, order: int) -> tuple[TensorVariable, TensorVariable]:
    r"""Yule-Walker AR(order) estimate ``(phi, sigma2)`` from autocovariances.

    Solves ``toeplitz(gamma_{0:p-1}) phi = gamma_{1:p}``, ``sigma2 = gamma_0 -
    gamma_{1:p} . phi`` by :func:`levinson_durbin` (same arguments, failure
    values and gradients).  ``yule_walker(acovf(x, p), p)`` equals
    ``statsmodels.regression.linear_model.yule_walker(x, p, method="mle")``,
    except that statsmodels returns ``sigma = sqrt(sigma2)``;
    ``acovf(x, p, adjusted=True)`` gives its ``method="adjusted"``.

    Returns
    -------
    phi : tensor (..., order)
    sigma2 : tensor (...)

    Examples
    --------
    >>> import iterops
    >>> phi, sigma2 = iterops.ts.yule_walker([2.0, 1.0], 1)
    >>> phi.eval(), sigma2.eval()
    (array([0.5]), array(1.5))
    """
    res = levinson_durbin(acov, order)
    return res.ar, res.sigma2


def acovf(x, nlags: int, demean: bool = True, adjusted: bool = False) -> TensorVariable:
    r"""Sample autocovariances ``gamma_0..gamma_nlags`` of the series along the last axis.

    .. math::  \hat\gamma_k = \frac{1}{d_k}\sum_{t=0}^{n-1-k} (x_{t+k}-\bar x)(x_t - \bar x),
               \qquad d_k = n \ (\text{default}),\quad d_k = n - k\ (\text{adjusted})

    as ``statsmodels.tsa.stattools.acovf(x, nlag=nlags, demean=demean,
    adjusted=adjusted, fft=False)``.  O(n * nlags) in a fused kernel; the
    gradient is two 1-d convolutions.

    Parameters
    ----------
    x : tensor (..., n)
    nlags : int
        Static number of lags (>= 0); ``nlags <= n - 1`` is checked when ``n``
        is known at graph build, otherwise lags ``>= n`` are NaN at run time.
    demean : bool
        Subtract the mean of ``x`` first.
    adjusted : bool
        Divide by ``n - k`` instead of ``n``.

    Returns
    -------
    acov : tensor (..., nlags + 1)

    Examples
    --------
    >>> import iterops
    >>> iterops.ts.acovf([1.0, 2.0, 3.0, 4.0], 2).eval()
    array([ 1.25  ,  0.3125, -0.375 ])
    """
    func = "acovf"
    nlags = _static_int(func, "nlags", nlags, minimum=0)
    x = as_tensor(func, "x", x, min_ndim=1)
    if x.type.numpy_dtype.kind == "c":
        raise TypeError(f"{func}: complex x is not supported (got dtype {x.type.dtype})")
    n = x.type.shape[-1]
    if n is not None and nlags > n - 1:
        raise ValueError(f"{func}: nlags must be <= n - 1, got nlags={nlags} and x with shape {x.type.shape}")
    if x.type.numpy_dtype.kind in "biu":
        x = pt.cast(x, float_dtype(x))
    if demean:
        x = x - pt.mean(x, axis=-1, keepdims=True)
    return apply_batched(AutoCov(nlags, adjusted), x)
