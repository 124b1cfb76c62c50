r"""Stationary AR(p) maps: partial autocorrelations <-> AR coefficients -> autocovariances.

Convention: ``x_t = sum_{j=1}^p phi_j x_{t-j} + e_t``, ``Var(e_t) = sigma2``, AR
polynomial ``1 - sum_j phi_j z^j`` (statsmodels' ``ar=np.r_[1, -phi]``).

The Durbin-Levinson lattice links the partial autocorrelations
``pacf = (kappa_1, ..., kappa_p)`` to the AR(k) coefficients ``phi_{k,.}`` of
every order ``k`` (Barndorff-Nielsen & Schou 1973; Monahan 1984, eq. 2.2):

.. math::
    \phi_{k,k} = \kappa_k,\qquad \phi_{k,j} = \phi_{k-1,j} - \kappa_k\,\phi_{k-1,k-j}
    \quad (j < k)  \qquad\text{("step-up")}

and, inverted,

.. math::
    \phi_{k-1,j} = \frac{\phi_{k,j} + \kappa_k\,\phi_{k,k-j}}{1-\kappa_k^2}
    \qquad\text{("step-down")}.

``phi = phi_{p,.}`` is stationary (all roots of the AR polynomial outside the
unit circle) if and only if every ``|kappa_k| < 1``, so :func:`pacf_to_ar` maps
the open cube ``(-1, 1)^p`` one-to-one onto the stationary region: put a prior
on ``pacf`` (e.g. ``2 * Beta - 1`` or ``tanh`` of a Normal) and get stationary
AR coefficients.  :func:`ar_to_pacf` is its inverse.  The stationary
autocovariances follow from the same lattice (:func:`ar_to_acov`):

.. math::
    \gamma_0 = \frac{\sigma^2}{\prod_k (1-\kappa_k^2)},\qquad
    \gamma_m = \sum_{j=1}^{\min(m,p)} \phi_{\min(m,p),j}\,\gamma_{m-j}\quad(m \ge 1).

All three are O(p^2) loops in one fused Numba kernel each, batched over
leading dimensions.

Failure is a value: ``|pacf_k| >= 1`` (pacf_to_ar), a non-stationary ``phi``
(ar_to_pacf, ar_to_acov) or non-finite input give an all-NaN result.

Gradients: hand-written reverse (and forward) passes of the lattice recursions,
in fused kernels (:class:`ARDerivative`).  The step-up adjoint

.. math::
    \bar\kappa_k = \bar\phi_{k,k} - \sum_{j<k} \bar\phi_{k,j}\,\phi_{k-1,k-j},\qquad
    \bar\phi_{k-1,i} = \bar\phi_{k,i} - \kappa_k\,\bar\phi_{k,k-i}

uses only stored forward levels and no division, so the gradient of
:func:`pacf_to_ar` is exact and stable as ``|pacf| -> 1``.  The step-down
adjoint (ar_to_pacf, ar_to_acov) carries the factor ``1/(1-kappa_k^2)`` that
the map itself has.  First derivatives in reverse and forward mode are exact.
Second derivatives (the derivative Op's own pullback, :func:`_second_order`):
``sum_i b_i Hess f_i(x) a`` by reverse mode twice through :func:`lattice_graph`, the
lattice unrolled into a PyTensor graph over the static order ``p`` (O(p^2) nodes: meant
for the small orders of AR models), or written as ``pytensor.scan`` loops where ``p`` is
symbolic (:func:`lattice_scan`); NaN where the map fails.
"""

from __future__ import annotations

import operator
from functools import reduce

import numba
import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply
from pytensor.graph.replace import graph_replace
from pytensor.tensor.variable import TensorVariable

from iterops._fused import FirstInputShaped, FusedOp, apply_batched, entry_point, register_fused_op
from iterops._validate import as_tensor, float_dtype

__all__ = [
    "pacf_to_ar",
    "ar_to_pacf",
    "ar_to_acov",
    "PacfToAR",
    "ARToPacf",
    "ARToAcov",
    "ARDerivative",
]

# ---------------------------------------------------------------------------
# Kernels.  Levels: A[k, :k+1] holds phi_{k+1, 1..k+1} (0-based rows).
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _pacf_ok(kappa):
    for k in range(kappa.shape[0]):
        if not (np.abs(kappa[k]) < 1.0):  # also catches NaN
            return False
    return True


@numba.njit(cache=True)
def _step_up(kappa):
    """Levels of the step-up recursion from ``kappa`` (p,)."""
    p = kappa.shape[0]
    A = np.zeros((p, p))
    for k in range(p):
        for j in range(k):
            A[k, j] = A[k - 1, j] - kappa[k] * A[k - 1, k - 1 - j]
        A[k, k] = kappa[k]
    return A


@numba.njit(cache=True)
def _step_up_vjp(kappa, A, phi_bar):
    """Cotangent of ``kappa`` given the cotangent ``phi_bar`` of the last level.

    Level k: ``phi_{k,k} = kappa_k``, ``phi_{k,j} = phi_{k-1,j} - kappa_k phi_{k-1,k-j}``, so
    ``kappa_bar_k = g_k - sum_j g_j phi_{k-1,k-j}`` and ``g_i <- g_i - kappa_k g_{k-i}``,
    done in place on the pairs (i, k-1-i) (0-based).
    """
    p = kappa.shape[0]
    g = phi_bar.copy()  # cotangent of level k (first k+1 entries)
    kappa_bar = np.zeros(p)
    for k in range(p - 1, -1, -1):
        kap = kappa[k]
        kb = g[k]
        for i in range(k // 2):
            i2 = k - 1 - i
            a = g[i]
            b = g[i2]
            kb -= a * A[k - 1, i2] + b * A[k - 1, i]
            g[i] = a - kap * b
            g[i2] = b - kap * a
        if k % 2 == 1:  # middle element pairs with itself
            i = k // 2
            a = g[i]
            kb -= a * A[k - 1, i]
            g[i] = a - kap * a
        kappa_bar[k] = kb
    return kappa_bar


@numba.njit(cache=True)
def _step_up_jvp(kappa, A, kappa_dot):
    """Tangent of the last level given ``kappa_dot``."""
    p = kappa.shape[0]
    d = np.zeros(p)
    new = np.zeros(p)
    for k in range(p):
        for j in range(k):
            new[j] = d[j] - kappa_dot[k] * A[k - 1, k - 1 - j] - kappa[k] * d[k - 1 - j]
        new[k] = kappa_dot[k]
        d, new = new, d
    return d


@numba.njit(cache=True)
def _step_down(phi):
    """(kappa, levels, ok): the step-down recursion from ``phi`` (p,)."""
    p = phi.shape[0]
    A = np.zeros((p, p))
    kappa = np.zeros(p)
    if p == 0:
        return kappa, A, True
    for j in range(p):  # A[p - 1, :] = phi (a slice assignment compiles Numba's shape-mismatch message)
        A[p - 1, j] = phi[j]
    for k in range(p - 1, -1, -1):
        kap = A[k, k]
        if not (np.abs(kap) < 1.0):
            return kappa, A, False
        kappa[k] = kap
        d = 1.0 - kap * kap
        for j in range(k):
            A[k - 1, j] = (A[k, j] + kap * A[k, k - 1 - j]) / d
    return kappa, A, True


@numba.njit(cache=True)
def _step_down_vjp(A, kappa_bar, level_bar):
    """Cotangent of ``phi`` given cotangents of ``kappa`` and of every level."""
    p = kappa_bar.shape[0]
    g = np.zeros(p)  # cotangent of level k-1 (first k entries)
    new = np.zeros(p)
    for k in range(p):
        kap = A[k, k]
        d = 1.0 - kap * kap
        # A[k-1, j] = (A[k, j] + kap A[k, k-1-j]) / d  for j < k
        kb = level_bar[k, k] + kappa_bar[k]
        for j in range(k):
            kb += g[j] * (A[k, k - 1 - j] + 2.0 * kap * A[k - 1, j]) / d
        for i in range(k):
            new[i] = level_bar[k, i] + (g[i] + kap * g[k - 1 - i]) / d
        new[k] = kb
        g, new = new, g
    return g


@numba.njit(cache=True)
def _step_down_jvp(A, phi_dot):
    """(kappa_dot, level tangents) given ``phi_dot``."""
    p = phi_dot.shape[0]
    D = np.zeros((p, p))
    kappa_dot = np.zeros(p)
    if p == 0:
        return kappa_dot, D
    for j in range(p):  # D[p - 1, :] = phi_dot
        D[p - 1, j] = phi_dot[j]
    for k in range(p - 1, -1, -1):
        kap = A[k, k]
        kd = D[k, k]
        kappa_dot[k] = kd
        d = 1.0 - kap * kap
        for j in range(k):
            D[k - 1, j] = (D[k, j] + kd * A[k, k - 1 - j] + kap * D[k, k - 1 - j] + 2.0 * kap * kd * A[k - 1, j]) / d
    return kappa_dot, D


@numba.njit(cache=True)
def _acov(kappa, A, sigma2, nlags):
    """gamma_0..gamma_nlags from the lattice levels."""
    p = kappa.shape[0]
    gam = np.zeros(nlags + 1)
    prod = 1.0
    for k in range(p):
        prod *= 1.0 - kappa[k] * kappa[k]
    gam[0] = sigma2 / prod
    for m in range(1, nlags + 1):
        q = min(m, p)
        acc = 0.0
        for j in range(1, q + 1):
            acc += A[q - 1, j - 1] * gam[m - j]
        gam[m] = acc
    return gam


@numba.njit(cache=True)
def _acov_vjp(kappa, A, gam, gam_bar):
    """(kappa_bar, level_bar) of ``_acov`` with sigma2 fixed."""
    p = kappa.shape[0]
    nlags = gam.shape[0] - 1
    gb = gam_bar.copy()
    level_bar = np.zeros((p, p))
    for m in range(nlags, 0, -1):
        q = min(m, p)
        for j in range(1, q + 1):
            level_bar[q - 1, j - 1] += gb[m] * gam[m - j]
            gb[m - j] += gb[m] * A[q - 1, j - 1]
    kappa_bar = np.zeros(p)
    for k in range(p):  # gamma_0 = sigma2 / prod(1 - kappa^2)
        kappa_bar[k] = gb[0] * gam[0] * 2.0 * kappa[k] / (1.0 - kappa[k] * kappa[k])
    return kappa_bar, level_bar


@numba.njit(cache=True)
def _acov_jvp(kappa, A, gam, kappa_dot, D):
    """Tangent of ``_acov`` (sigma2 fixed) given kappa and level tangents."""
    p = kappa.shape[0]
    nlags = gam.shape[0] - 1
    gd = np.zeros(nlags + 1)
    s = 0.0
    for k in range(p):
        s += 2.0 * kappa[k] * kappa_dot[k] / (1.0 - kappa[k] * kappa[k])
    gd[0] = gam[0] * s
    for m in range(1, nlags + 1):
        q = min(m, p)
        acc = 0.0
        for j in range(1, q + 1):
            acc += D[q - 1, j - 1] * gam[m - j] + A[q - 1, j - 1] * gd[m - j]
        gd[m] = acc
    return gd


@numba.njit(cache=True, inline="always")
def pacf_to_ar_kernel(kappa):
    """AR(p) coefficients from partial autocorrelations; NaN unless all |kappa| < 1.

    The step-up recursion in place on the pairs (j, k-1-j): no stored levels.
    """
    p = kappa.shape[0]
    if not _pacf_ok(kappa):
        return np.full(p, np.nan)
    phi = np.zeros(p)
    for k in range(p):
        kap = kappa[k]
        for i in range(k // 2):
            i2 = k - 1 - i
            a = phi[i]
            b = phi[i2]
            phi[i] = a - kap * b
            phi[i2] = b - kap * a
        if k % 2 == 1:
            i = k // 2
            phi[i] = phi[i] * (1.0 - kap)
        phi[k] = kap
    return phi


@numba.njit(cache=True, inline="always")
def ar_to_pacf_kernel(phi):
    """Partial autocorrelations of a stationary AR(p); NaN if ``phi`` is not stationary."""
    kappa, A, ok = _step_down(phi)
    if not ok:
        return np.full(phi.shape[0], np.nan)
    return kappa


@numba.njit(cache=True, inline="always")
def ar_to_acov_kernel(phi, sigma2, nlags):
    """gamma_0..gamma_nlags of a stationary AR(p); NaN if not stationary or not finite."""
    kappa, A, ok = _step_down(phi)
    if not ok or not np.isfinite(sigma2):
        return np.full(nlags + 1, np.nan)
    return _acov(kappa, A, sigma2, nlags)


@numba.njit(cache=True, inline="always")
def ar_derivative_kernel(fn, mode, x, v, nlags):
    """Linearizations of the three maps at ``x``; ``v`` is the (co)tangent.

    fn: 0 pacf_to_ar, 1 ar_to_pacf, 2 ar_to_acov (with sigma2 = 1);
    mode: 0 vjp, 1 jvp.  NaN where the map itself fails.
    """
    p = x.shape[0]
    n_out = p if (fn != 2 or mode == 0) else nlags + 1
    if fn == 0:
        if not _pacf_ok(x):
            return np.full(n_out, np.nan)
        A = _step_up(x)
        return _step_up_vjp(x, A, v) if mode == 0 else _step_up_jvp(x, A, v)
    kappa, A, ok = _step_down(x)
    if not ok:
        return np.full(n_out, np.nan)
    if fn == 1:
        if mode == 0:
            return _step_down_vjp(A, v, np.zeros((p, p)))
        kappa_dot, D = _step_down_jvp(A, v)
        return kappa_dot
    gam = _acov(kappa, A, 1.0, nlags)
    if mode == 0:
        kappa_bar, level_bar = _acov_vjp(kappa, A, gam, v)
        return _step_down_vjp(A, kappa_bar, level_bar)
    kappa_dot, D = _step_down_jvp(A, v)
    return _acov_jvp(kappa, A, gam, kappa_dot, D)


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------

_FNS = {"pacf_to_ar": 0, "ar_to_pacf": 1, "ar_to_acov": 2}
_MODES = {"vjp": 0, "jvp": 1}


@entry_point
def _vec_entry(fn: str, out_dtype: str):
    out = np.dtype(out_dtype).type
    kernel = pacf_to_ar_kernel if fn == "pacf_to_ar" else ar_to_pacf_kernel

    @numba.njit
    def run(x):
        return kernel(np.ascontiguousarray(x).astype(np.float64)).astype(out)

    return run


@entry_point
def _acov_entry(nlags: int, out_dtype: str):
    out = np.dtype(out_dtype).type

    @numba.njit
    def run(phi, sigma2):
        return ar_to_acov_kernel(np.ascontiguousarray(phi).astype(np.float64), np.float64(sigma2.item()), nlags).astype(
            out
        )

    return run


@entry_point
def _derivative_entry(fn: int, mode: int, nlags: int, out_dtype: str):
    out = np.dtype(out_dtype).type

    @numba.njit
    def run(x, v):
        return ar_derivative_kernel(
            fn, mode, np.ascontiguousarray(x).astype(np.float64), np.ascontiguousarray(v).astype(np.float64), nlags
        ).astype(out)

    return run


class _VectorMap(FirstInputShaped):
    """Core Op ``(p)->(p)`` shared by :class:`PacfToAR` and :class:`ARToPacf`."""

    __props__ = ()
    gufunc_signature = "(p)->(p)"
    fn: str

    def numba_fn(self, node):
        return _vec_entry(self.fn, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        (x,) = inputs
        (g,) = cotangents
        if isinstance(g.type, DisconnectedType):
            return [disconnected_type()]
        return [_derivative(self.fn, "vjp", x, g)]

    def pushforward(self, inputs, outputs, tangents):
        (x,) = inputs
        (t,) = tangents
        if isinstance(t.type, DisconnectedType):
            return [disconnected_type()]
        return [_derivative(self.fn, "jvp", x, t)]


@register_fused_op
class PacfToAR(_VectorMap):
    """Core Op ``(p)->(p)``: step-up recursion; use :func:`pacf_to_ar`."""

    fn = "pacf_to_ar"


@register_fused_op
class ARToPacf(_VectorMap):
    """Core Op ``(p)->(p)``: step-down recursion; use :func:`ar_to_pacf`."""

    fn = "ar_to_pacf"


@register_fused_op
class ARToAcov(FusedOp):
    """Core Op ``(p),()->(l)`` with ``l = nlags + 1``; use :func:`ar_to_acov`."""

    __props__ = ("nlags",)
    gufunc_signature = "(p),()->(l)"

    def __init__(self, nlags: int):
        self.nlags = int(nlags)

    def make_node(self, phi, sigma2):
        phi, sigma2 = pt.as_tensor_variable(phi), pt.as_tensor_variable(sigma2)
        return Apply(self, [phi, sigma2], [pt.tensor(dtype=float_dtype(phi, sigma2), shape=(self.nlags + 1,))])

    def infer_shape(self, node, input_shapes):
        return [(self.nlags + 1,)]

    def numba_fn(self, node):
        return _acov_entry(self.nlags, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        phi, sigma2 = inputs
        (g,) = cotangents
        if isinstance(g.type, DisconnectedType):
            return [disconnected_type(), disconnected_type()]
        # gamma(phi, sigma2) = sigma2 * gamma(phi, 1): linear in sigma2
        phi_bar = sigma2 * _derivative("ar_to_acov", "vjp", phi, g, self.nlags)
        sigma2_bar = pt.sum(g * self(phi, pt.ones_like(sigma2)))
        return [phi_bar, sigma2_bar]

    def pushforward(self, inputs, outputs, tangents):
        phi, sigma2 = inputs
        phi_dot, sigma2_dot = tangents
        terms = []
        if not isinstance(phi_dot.type, DisconnectedType):
            terms.append(sigma2 * _derivative("ar_to_acov", "jvp", phi, phi_dot, self.nlags))
        if not isinstance(sigma2_dot.type, DisconnectedType):
            terms.append(self(phi, sigma2_dot))
        if not terms:
            return [disconnected_type()]
        return [sum(terms[1:], terms[0])]


@register_fused_op
class ARDerivative(FusedOp):
    """Core Op ``(p),(q)->(r)``: the linearization of one lattice map at ``x``.

    ``fn`` in {"pacf_to_ar", "ar_to_pacf", "ar_to_acov"} (the latter with
    ``sigma2 = 1``), ``mode`` "vjp" (``v`` a cotangent of the output, returns
    ``J(x)^T v``) or "jvp" (``v`` a tangent of ``x``, returns ``J(x) v``).
    Linear in ``v``: its derivative in ``v`` is the other mode.  Its derivative in
    ``x`` (second derivatives of the map): :func:`_second_order`, reverse mode; forward
    mode of ``mode="jvp"`` in ``x`` raises ``NotImplementedError``.
    """

    __props__ = ("fn", "mode", "nlags")
    gufunc_signature = "(p),(q)->(r)"

    def __init__(self, fn: str, mode: str, nlags: int = -1):
        self.fn = fn
        self.mode = mode
        self.nlags = int(nlags)

    def _out_len(self, p):
        return self.nlags + 1 if (self.fn == "ar_to_acov" and self.mode == "jvp") else p

    def make_node(self, x, v):
        x, v = pt.as_tensor_variable(x), pt.as_tensor_variable(v)
        n = self.nlags + 1 if (self.fn == "ar_to_acov" and self.mode == "jvp") else x.type.shape[-1]
        return Apply(self, [x, v], [pt.tensor(dtype=float_dtype(x, v), shape=(n,))])

    def infer_shape(self, node, input_shapes):
        return [(self._out_len(input_shapes[0][0]),)]

    def numba_fn(self, node):
        return _derivative_entry(_FNS[self.fn], _MODES[self.mode], self.nlags, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        x, v = inputs
        (w,) = cotangents
        if isinstance(w.type, DisconnectedType):
            return [disconnected_type(), disconnected_type()]
        other = "jvp" if self.mode == "vjp" else "vjp"
        # <w, J^T v> = <v, J w> (vjp) and <w, J v> (jvp): x_bar = sum_i b_i Hess f_i a
        a, b = (w, v) if self.mode == "vjp" else (v, w)
        x_bar = pt.switch(pt.isnan(outputs[0].sum(axis=-1, keepdims=True)), np.nan,
                          _second_order(self.fn, x, a, b, self.nlags))
        return [x_bar, _derivative(self.fn, other, x, w, self.nlags)]

    def pushforward(self, inputs, outputs, tangents):
        x, v = inputs
        x_dot, v_dot = tangents
        terms = []
        if not isinstance(x_dot.type, DisconnectedType):
            if self.mode == "jvp":
                raise NotImplementedError(
                    f"Forward-mode second derivatives of {self.fn} (pushforward of ARDerivative(mode='jvp') "
                    "with respect to x) are not implemented; reverse mode (pytensor.grad, pytensor.hessian) is."
                )
            terms.append(_second_order(self.fn, x, x_dot, v, self.nlags))  # d/de J(x + e x_dot)^T v
        if not isinstance(v_dot.type, DisconnectedType):
            terms.append(_derivative(self.fn, self.mode, x, v_dot, self.nlags))
        if not terms:
            return [disconnected_type()]
        return [sum(terms[1:], terms[0])]


def _derivative(fn, mode, x, v, nlags=-1):
    return apply_batched(ARDerivative(fn, mode, nlags), x, v)


# ---------------------------------------------------------------------------
# Second derivatives: the lattices unrolled into a PyTensor graph (static p), differentiated twice
# ---------------------------------------------------------------------------


def lattice_graph(fn, x, nlags=-1):
    """The map ``fn`` as a PyTensor graph (``ar_to_acov`` with ``sigma2 = 1``), batched over leading
    dimensions: unrolled over the static order ``p = x.shape[-1]`` (O(p^2) scalar nodes, O(p (p + nlags))
    for ``ar_to_acov``), or, where ``p`` is symbolic, :func:`lattice_scan` on a core vector.  No failure
    value: the caller masks with the fused map's."""
    p = x.type.shape[-1]
    if p is None:
        return lattice_scan(fn, x, nlags)
    c = [x[..., j] for j in range(p)]
    if fn == "pacf_to_ar":  # step-up: phi_{k,j} = phi_{k-1,j} - kappa_k phi_{k-1,k-j}, phi_{k,k} = kappa_k
        phi = []
        for k in range(p):
            phi = [phi[j] - c[k] * phi[k - 1 - j] for j in range(k)] + [c[k]]
        return pt.stack(phi, axis=-1)
    # step-down: kappa_k = phi_{k,k}, phi_{k-1,j} = (phi_{k,j} + kappa_k phi_{k,k-j}) / (1 - kappa_k^2)
    levels, kappa = {p: c}, [None] * p
    for k in range(p, 0, -1):
        phi, kap = levels[k], levels[k][k - 1]
        kappa[k - 1] = kap
        levels[k - 1] = [(phi[j] + kap * phi[k - 2 - j]) / (1.0 - kap * kap) for j in range(k - 1)]
    if fn == "ar_to_pacf":
        return pt.stack(kappa, axis=-1)
    # gamma_0 = 1 / prod(1 - kappa_k^2), gamma_m = sum_{j <= q} phi_{q,j} gamma_{m-j}, q = min(m, p)
    gam = [1.0 / reduce(operator.mul, [1.0 - k_ * k_ for k_ in kappa], pt.ones_like(x.sum(axis=-1)))]
    for m in range(1, nlags + 1):
        q = min(m, p)
        gam.append(sum((levels[q][j - 1] * gam[m - j] for j in range(2, q + 1)), levels[q][0] * gam[m - 1]))
    return pt.stack(gam, axis=-1)


def lattice_scan(fn, x, nlags=-1):
    """:func:`lattice_graph` for a core vector ``x`` (p,) of symbolic length: the step-up / step-down
    recursions as ``pytensor.scan`` loops over the order, on zero-padded (p,) levels; the autocovariances
    unrolled over the static ``nlags``."""
    p = x.shape[0]
    j = pt.arange(p)
    if fn == "pacf_to_ar":
        def up(k, kap, phi):  # level k from level k - 1
            return pt.where(j < k - 1, phi - kap * phi[pt.maximum(k - 2 - j, 0)], pt.where(pt.eq(j, k - 1), kap, 0.0))

        return pytensor.scan(up, sequences=[pt.arange(1, p + 1), x], outputs_info=[pt.zeros_like(x)],
                             return_updates=False)[-1]

    def down(k, phi):  # level k - 1 from level k (kappa_k = phi_{k,k})
        kap = phi[k - 1]
        return pt.where(j < k - 1, (phi + kap * phi[pt.maximum(k - 2 - j, 0)]) / (1.0 - kap * kap), 0.0)

    lower = pytensor.scan(down, sequences=[pt.arange(p, 0, -1)], outputs_info=[x], return_updates=False)
    levels = pt.concatenate([lower[::-1][1:], x[None]], axis=0)  # levels[q - 1]: phi_{q,.}, q = 1..p
    kaps = pt.diagonal(levels)  # kappa_q = phi_{q,q}
    if fn == "ar_to_pacf":
        return kaps

    # gamma_m = sum_{i <= q} phi_{q,i} gamma_{m-i}, q = min(m, p): unrolled over the static nlags
    i = j + 1
    gam = [1.0 / pt.prod(1.0 - kaps * kaps, no_zeros_in_input=True)]  # non-zero where stationary
    for m in range(1, nlags + 1):
        terms = levels[pt.minimum(m, p) - 1] * pt.stack(gam)[pt.clip(m - i, 0, m - 1)]
        gam.append(pt.sum(pt.where(i <= m, terms, 0.0)))
    return pt.stack(gam)


def _second_order(fn, x, a, b, nlags):
    """``sum_i b_i Hess f_i(x) a = grad_x <a, J(x)^T b>`` for the map ``fn`` (``J`` its Jacobian),
    by reverse mode twice through :func:`lattice_graph` on fresh copies (partial derivatives: in the
    caller's graph ``a`` and ``b`` may depend on ``x``)."""
    x_, a_, b_ = x.type(), a.type(), b.type()
    f = lattice_graph(fn, x_, nlags)
    jtb = pytensor.grad(pt.sum(b_ * f), x_)
    hab = pytensor.grad(pt.sum(a_ * jtb), x_)
    return graph_replace(hab, {x_: x, a_: a, b_: b}, strict=False)


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _check_vector(func, name, x):
    x = as_tensor(func, name, x, min_ndim=1)
    if x.type.numpy_dtype.kind == "c":
        raise TypeError(f"{func}: complex {name} is not supported (got dtype {x.type.dtype})")
    return x


def pacf_to_ar(pacf) -> TensorVariable:
    r"""Stationary AR(p) coefficients from partial autocorrelations (Monahan 1984).

    Step-up recursion ``phi_{k,k} = pacf_k``, ``phi_{k,j} = phi_{k-1,j} - pacf_k phi_{k-1,k-j}``.

    Parameters
    ----------
    pacf : tensor (..., p)
        Partial autocorrelations (reflection coefficients) at lags 1..p, each in (-1, 1).

    Returns
    -------
    phi : tensor (..., p)
        Coefficients of ``x_t = sum_j phi_j x_{t-j} + e_t``; the AR polynomial
        ``1 - sum_j phi_j z^j`` has all roots outside the unit circle.  All-NaN
        (per batch entry) if some ``|pacf_k| >= 1`` or is not finite.

    Replaces the Scan over the order ``k``::

        def step(k, kappa_k, phi_prev):  # phi_prev: (p,) zero-padded AR(k-1)
            new = phi_prev - kappa_k * pt.roll(phi_prev[::-1], k)  # phi_{k-1, k-j} at j
            new = pt.set_subtensor(new[k - 1], kappa_k)
            return pt.where(pt.arange(p) < k, new, 0.0)
        phis, _ = pytensor.scan(step, sequences=[pt.arange(1, p + 1), pacf], outputs_info=[pt.zeros(p)])
        phi = phis[-1]

    Gradient: the hand-written adjoint of the recursion (no division: stable as
    ``|pacf| -> 1``).

    Examples
    --------
    >>> import iterops
    >>> iterops.ts.pacf_to_ar([0.5, 0.2]).eval()
    array([0.4, 0.2])
    """
    return apply_batched(PacfToAR(), _check_vector("pacf_to_ar", "pacf", pacf))


def ar_to_pacf(phi) -> TensorVariable:
    r"""Partial autocorrelations of a stationary AR(p): the inverse of :func:`pacf_to_ar`.

    Step-down recursion ``pacf_k = phi_{k,k}``,
    ``phi_{k-1,j} = (phi_{k,j} + pacf_k phi_{k,k-j}) / (1 - pacf_k^2)``.

    Parameters
    ----------
    phi : tensor (..., p)
        AR coefficients (``x_t = sum_j phi_j x_{t-j} + e_t``).

    Returns
    -------
    pacf : tensor (..., p)
        Partial autocorrelations at lags 1..p.  All-NaN if ``phi`` is not
        stationary (some ``|pacf_k| >= 1``) or not finite: a stationarity test.

    Examples
    --------
    >>> import iterops
    >>> iterops.ts.ar_to_pacf([0.4, 0.2]).eval()
    array([0.5, 0.2])
    """
    return apply_batched(ARToPacf(), _check_vector("ar_to_pacf", "phi", phi))


def ar_to_acov(phi, sigma2, nlags: int) -> TensorVariable:
    r"""Autocovariances ``gamma_0..gamma_nlags`` of a stationary AR(p).

    Equal to ``statsmodels.tsa.arima_process.arma_acovf(np.r_[1, -phi], [1],
    nobs=nlags + 1, sigma2=sigma2)``, computed by the step-down recursion in
    O(p^2 + p * nlags) instead of a dense solve.

    Parameters
    ----------
    phi : tensor (..., p)
        AR coefficients (``x_t = sum_j phi_j x_{t-j} + e_t``).
    sigma2 : tensor (...)
        Innovation variance; broadcasts with the leading dimensions of ``phi``.
    nlags : int
        Static number of lags (>= 0); the result has ``nlags + 1`` entries.

    Returns
    -------
    gamma : tensor (..., nlags + 1)
        ``gamma_0 = sigma2 / prod(1 - pacf_k^2)``, ``gamma_m = sum_j phi_{min(m,p), j} gamma_{m-j}``.
        All-NaN if ``phi`` is not stationary or an input is not finite.

    Examples
    --------
    >>> import iterops
    >>> iterops.ts.ar_to_acov([0.5], 1.0, nlags=2).eval().round(4)
    array([1.3333, 0.6667, 0.3333])
    """
    func = "ar_to_acov"
    nlags = _static_int(func, "nlags", nlags, minimum=0)
    phi = _check_vector(func, "phi", phi)
    sigma2 = as_tensor(func, "sigma2", sigma2)
    if sigma2.type.numpy_dtype.kind == "c":
        raise TypeError(f"{func}: complex sigma2 is not supported (got dtype {sigma2.type.dtype})")
    return apply_batched(ARToAcov(nlags), phi, sigma2)


def _static_int(func: str, name: str, value, minimum: int) -> int:
    """A static Python integer >= ``minimum`` (ValueError naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(
            f"{func}: {name} must be a static Python integer, got {value!r} of type {type(value).__name__}"
        )
    if value < minimum:
        raise ValueError(f"{func}: {name} must be >= {minimum}, got {value}")
    return int(value)
