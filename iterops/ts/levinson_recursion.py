r"""The Levinson-Durbin loop as users write it: one fused Numba kernel, exact adjoint of the recursion.

Runs Durbin's recursion (Durbin 1960; Brockwell & Davis, *Time Series: Theory
and Methods*, Prop. 5.2.1) exactly as the ``pytensor.scan`` loop below does,
step for step, in the dtype of ``gamma`` (float32 or float64).  With ``phi``
carried as a zero-padded vector of length ``p`` and ``k = 0..p-1``:

.. math::
    \kappa_k = \frac{\gamma_{k+1} - \sum_{j<k} \phi^{(k)}_j \gamma_{k-j}}{v_k},\quad
    \phi^{(k+1)}_j = \phi^{(k)}_j - \kappa_k \phi^{(k)}_{k-1-j}\ (j<k),\quad
    \phi^{(k+1)}_k = \kappa_k,\quad
    v_{k+1} = v_k (1 - \kappa_k^2),

with :math:`\phi^{(0)} = 0`, :math:`v_0 = \gamma_0`; outputs
``phi = phi^(p)``, ``sigma2 = v_p`` and ``kappa = (kappa_0..kappa_{p-1})``.
The loop (what the Scan-fusion rewrite replaces) is
:func:`iterops.reference_loops.levinson_loop` with :func:`~iterops.reference_loops.levinson_step`
(written out in :func:`levinson_recursion`'s docstring).

The kernel performs the same floating-point operations in the same order
(inner product summed over ascending ``j``; ``kappa = (gamma[k+1] - acc) / v``;
``phi[j] - kappa * phi[k-1-j]``; ``v * (1 - kappa * kappa)``), so values agree
with the loop to rounding.

Failure behaviour: none of its own, it is the loop's arithmetic.  Nothing is
checked and nothing stops early: a ``v_k <= 0`` (a ``gamma`` that is not a
positive-definite autocovariance sequence) simply continues, ``v_k = 0`` divides
by zero (inf/NaN where the loop has them) and non-finite inputs propagate.  The
one exception is a ``gamma`` shorter than ``order + 1`` at run time (the loop
would index out of bounds): every output is NaN.  This differs from
:func:`iterops.ts.levinson_durbin`, which returns NaN for a non-positive-definite
input, computes in float64 and differentiates by the implicit function theorem.

Gradient: the exact reverse-mode adjoint of the recursion as run, i.e. what
PyTensor's autodiff through the Scan computes.  A second kernel re-runs the
forward pass storing ``phi^(k)``, ``v_k``, ``kappa_k`` for every step (a (p, p)
tape), then walks ``k = p-1..0`` through :func:`_step_vjp`, the adjoint of
:func:`_step`: with cotangents ``phi_bar``, ``v_bar`` of the step's outputs
and ``kappa_bar_k`` of its ``kappa``,

.. math::
    \bar\kappa &= \bar\kappa_k + \bar\phi_k + \textstyle\sum_{j<k} -\bar\phi_j\phi^{(k)}_{k-1-j}
                  - 2\bar v\, v_k\kappa_k, \\
    \bar\phi^{(k)}_j &= \bar\phi_j - \kappa_k\bar\phi_{k-1-j}
                        - (\bar\kappa / v_k)\,\gamma_{k-j}\ (j<k),\qquad \bar\phi^{(k)}_k = 0, \\
    \bar v_k &= \bar v (1-\kappa_k^2) - \bar\kappa\,\mathrm{num}_k / v_k^2, \\
    \bar\gamma_{k+1} &\mathrel{+}= \bar\kappa / v_k,\qquad
    \bar\gamma_{k-j} \mathrel{-}= (\bar\kappa / v_k)\,\phi^{(k)}_j\ (j<k),

and finally :math:`\bar\gamma_0 \mathrel{+}= \bar v_0`.  Any subset of the
three outputs may carry a cotangent; disconnected ones count as zero (as in the
Scan's gradient, so inf/NaN values spread into the gradient as they do there).
Second derivatives: the gradient Op's pullback is reverse mode twice through the loop itself
(:func:`iterops.reference_loops.levinson_loop`; exact, not fused,
:func:`iterops._second_order.reverse_twice`).  Forward mode is not implemented.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply
from pytensor.tensor.variable import TensorVariable

from iterops._second_order import reverse_twice
from iterops.reference_loops import LEVINSON_V_UPDATES, levinson_loop, levinson_spelled_step
from iterops._fused import FirstInputShaped, FusedOp, apply_batched, as_dtype, entry_point, register_fused_op
from iterops._validate import as_tensor, check_at_least, check_shape, float_dtype
from iterops.ts.ar import _static_int

__all__ = [
    "LevinsonRecursionResult",
    "levinson_recursion",
    "LevinsonRecursion",
    "LevinsonRecursionGrad",
    "levinson_recursion_kernel",
    "levinson_recursion_vjp_kernel",
]


class LevinsonRecursionResult(NamedTuple):
    """Result of :func:`levinson_recursion` (the loop's ``phis[-1]``, ``vs[-1]``, ``kappas``).

    phi : (..., order)
        Coefficients after the last step.
    sigma2 : (...)
        ``v`` after the last step.
    kappa : (..., order)
        ``kappa`` of every step (the partial autocorrelations for a PD ``gamma``).
    """

    phi: TensorVariable
    sigma2: TensorVariable
    kappa: TensorVariable


# ---------------------------------------------------------------------------
# Kernels: one step of the loop and its adjoint, side by side
# ---------------------------------------------------------------------------

# Python's error model would raise ZeroDivisionError on v == 0; the loop gives inf/NaN.
_njit = numba.njit(cache=True, error_model="numpy")


@_njit
def _numerator(gamma, k, phi):
    """``gamma[k + 1] - sum_{j<k} phi[j] * gamma[k - j]`` (ascending ``j``, as the loop's sum)."""
    acc = gamma.dtype.type(0)
    for j in range(k):
        acc += phi[j] * gamma[k - j]
    return gamma[k + 1] - acc


@_njit
def _reflect(x, k, c):
    """``x[:k] <- x[:k] - c * x[:k][::-1]`` in place (each pair read before it is written).

    The map ``I - c R`` (``R`` reverses ``x[:k]``) is symmetric, so it is its own adjoint.
    """
    for j in range(k // 2):
        a = x[j]
        b = x[k - 1 - j]
        x[j] = a - c * b
        x[k - 1 - j] = b - c * a
    if k % 2 == 1:
        m = k // 2
        x[m] = x[m] - c * x[m]


#: How the loop spells the variance update (``v_update``, :data:`iterops.reference_loops.LEVINSON_V_UPDATES`),
#: in the order of the Op's ``v_form``: the kernel runs the same operations, so that cancellation near
#: ``|kappa| = 1``, the sign of a zero ``v`` and overflow are the loop's.
V_UPDATES = tuple(LEVINSON_V_UPDATES)


@_njit
def _new_v(v, kappa, v_form, one):
    """``v (1 - kappa^2)`` as the loop spells it: 0 ``v * (1 - kappa**2)``, 1 ``v - kappa**2 * v``,
    2 ``v * (1 - kappa) * (1 + kappa)`` (``one``: 1 in the loop's dtype)."""
    if v_form == 1:
        return v - (kappa * kappa) * v
    if v_form == 2:
        return v * (one - kappa) * (one + kappa)
    return v * (one - kappa * kappa)


@_njit
def _step(gamma, k, phi, v, v_form):
    """Step ``k`` of the loop: updates ``phi`` in place, returns ``(kappa, new v)``."""
    kappa = _numerator(gamma, k, phi) / v
    _reflect(phi, k, kappa)  # phi[:k] - kappa * phi[:k][::-1]
    phi[k] = kappa
    return kappa, _new_v(v, kappa, v_form, gamma.dtype.type(1))


@_njit
def _step_vjp(gamma, k, phi, v, kappa, phi_bar, v_bar, kappa_bar, gamma_bar):
    """Adjoint of :func:`_step` at its inputs ``phi`` (entering step ``k``), ``v``, and its ``kappa``.

    ``phi_bar`` (cotangent of the step's new ``phi``) becomes, in place, the cotangent of ``phi``
    entering the step; ``gamma_bar`` is accumulated; returns the cotangent of ``v`` entering it.
    ``kappa_bar``: cotangent of the step's ``kappa`` output.  Same operations as PyTensor's
    autodiff of the step (e.g. ``d(num / v)/dv = -(g num) / (v v)``).
    """
    one = gamma.dtype.type(1)
    # v_new = v * (1 - kappa^2)
    v_bar_in = v_bar * (one - kappa * kappa)
    kb = kappa_bar - (v_bar * v) * (kappa + kappa)
    # new_phi[k] = kappa (overwrites phi[k])
    kb += phi_bar[k]
    phi_bar[k] = 0
    # new_phi[:k] = phi[:k] - kappa * phi[:k][::-1]
    for j in range(k):
        kb -= phi_bar[j] * phi[k - 1 - j]
    _reflect(phi_bar, k, kappa)
    # kappa = num / v
    num = _numerator(gamma, k, phi)
    num_bar = kb / v
    v_bar_in -= (kb * num) / (v * v)
    # num = gamma[k + 1] - sum_{j<k} phi[j] gamma[k - j]
    gamma_bar[k + 1] += num_bar
    for j in range(k):
        phi_bar[j] -= num_bar * gamma[k - j]
        gamma_bar[k - j] -= num_bar * phi[j]
    return v_bar_in


@_njit
def _run(gamma, order, v_form, phi, kappa, keep, tape_phi, tape_v):
    """The loop over ``k = 0..order-1`` (``gamma`` long enough) into ``phi`` (zeroed here) and ``kappa`` (order,);
    with ``keep``, the ``phi`` and ``v`` entering each step into ``tape_phi`` (order, order) and ``tape_v`` (order,)
    (what the reverse pass reads).  Returns the last ``v``."""
    phi[:] = 0
    v = gamma[0]
    for k in range(order):
        if keep:
            tape_phi[k, :] = phi
            tape_v[k] = v
        kappa[k], v = _step(gamma, k, phi, v, v_form)
    return v


@_njit
def levinson_recursion_kernel(gamma, order, v_form=0):
    """The loop on a 1-d float32/float64 ``gamma`` (n,), computed in its dtype.

    Returns ``(phi (order,), v, kappa (order,))``; all NaN if ``n < order + 1``.
    """
    p = order
    if gamma.shape[0] < p + 1:
        nan = gamma.dtype.type(np.nan)
        return np.full(p, nan, dtype=gamma.dtype), nan, np.full(p, nan, dtype=gamma.dtype)
    phi, kappa = np.empty(p, dtype=gamma.dtype), np.empty(p, dtype=gamma.dtype)
    v = _run(gamma, p, v_form, phi, kappa, False, kappa.reshape((1, p)), kappa)  # no tape (the last two unused)
    return phi, v, kappa


@_njit
def levinson_recursion_vjp_kernel(gamma, order, phi_bar, v_bar, kappa_bar, v_form=0):
    """Cotangent of ``gamma`` (n,) given cotangents of ``phi`` (order,), ``v`` and ``kappa`` (order,).

    All in ``gamma``'s dtype; all NaN if ``n < order + 1``.  The inputs are only read.
    """
    n, p = gamma.shape[0], order
    gamma_bar = np.zeros(n, dtype=gamma.dtype)
    if n < p + 1:
        gamma_bar[:] = np.nan
        return gamma_bar
    work = np.empty(p * p + 4 * p, dtype=gamma.dtype)  # the tape and the work vectors: one allocation
    tape_phi, tape_v = work[: p * p].reshape((p, p)), work[p * p: p * p + p]
    kappa, phi, phi_b = work[p * p + p: p * p + 2 * p], work[p * p + 2 * p: p * p + 3 * p], work[p * p + 3 * p:]
    _run(gamma, p, v_form, phi, kappa, True, tape_phi, tape_v)
    phi_b[:] = phi_bar
    for k in range(p - 1, -1, -1):
        v_bar = _step_vjp(gamma, k, tape_phi[k], tape_v[k], kappa[k], phi_b, v_bar, kappa_bar[k], gamma_bar)
    gamma_bar[0] += v_bar  # v_0 = gamma[0]
    return gamma_bar


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


@entry_point
def _recursion_entry(order: int, v_form: int, dtype: str):
    work = np.dtype(dtype).type

    @numba.njit(error_model="numpy")
    def run(gamma):
        check_at_least("levinson_recursion", "gamma", gamma, "(n,), n >= order + 1", order + 1)
        phi, v, kappa = levinson_recursion_kernel(as_dtype(gamma, work), order, v_form)
        return phi, np.asarray(v), kappa

    return run


@register_fused_op
class LevinsonRecursion(FusedOp):
    """Core Op ``(n)->(p),(),(p)``: the loop's ``(phi, sigma2, kappa)``; use :func:`levinson_recursion`."""

    __props__ = ("order", "v_form")
    gufunc_signature = "(n)->(p),(),(p)"

    def __init__(self, order: int, v_form: int = 0):
        self.order = int(order)
        self.v_form = int(v_form)

    def make_node(self, gamma):
        gamma = pt.as_tensor_variable(gamma)
        dt, p = float_dtype(gamma), self.order
        outputs = [pt.tensor(dtype=dt, shape=(p,)), pt.tensor(dtype=dt, shape=()), pt.tensor(dtype=dt, shape=(p,))]
        return Apply(self, [gamma], outputs)

    def infer_shape(self, node, input_shapes):
        return [(self.order,), (), (self.order,)]

    def numba_fn(self, node):
        return _recursion_entry(self.order, self.v_form, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        (gamma,) = inputs
        if all(isinstance(c.type, DisconnectedType) for c in cotangents):
            return [disconnected_type()]
        # a disconnected output contributes a zero cotangent, as in the Scan's gradient
        bars = [
            pt.zeros_like(out) if isinstance(c.type, DisconnectedType) else c for out, c in zip(outputs, cotangents)
        ]
        return [apply_batched(LevinsonRecursionGrad(self.order, self.v_form), gamma, *bars)]


@entry_point
def _vjp_entry(order: int, v_form: int, dtype: str):
    work = np.dtype(dtype).type

    @numba.njit(error_model="numpy")
    def run(gamma, phi_bar, v_bar, kappa_bar):
        check_at_least("levinson_recursion gradient", "gamma", gamma, "(n,), n >= order + 1", order + 1)
        check_shape("levinson_recursion gradient", "phi_bar", phi_bar, "(order,)", (order,))
        check_shape("levinson_recursion gradient", "kappa_bar", kappa_bar, "(order,)", (order,))
        return levinson_recursion_vjp_kernel(
            as_dtype(gamma, work),
            order,
            as_dtype(phi_bar, work),
            work(v_bar.item()),
            as_dtype(kappa_bar, work),
            v_form,
        )

    return run


@register_fused_op
class LevinsonRecursionGrad(FirstInputShaped):
    """Core Op ``(n),(p),(),(p)->(n)``: ``gamma_bar`` from ``(phi_bar, sigma2_bar, kappa_bar)``.

    The reverse pass of :class:`LevinsonRecursion` (module docstring); differentiated through the loop.
    """

    __props__ = ("order", "v_form")
    gufunc_signature = "(n),(p),(),(p)->(n)"

    def __init__(self, order: int, v_form: int = 0):
        self.order = int(order)
        self.v_form = int(v_form)

    def numba_fn(self, node):
        return _vjp_entry(self.order, self.v_form, node.outputs[0].type.dtype)

    def pullback(self, inputs, outputs, cotangents):
        # second derivatives: reverse mode twice through the loop itself (exact, not fused)
        gamma, bars = inputs[0], list(inputs[1:])
        (w,) = cotangents
        if isinstance(w.type, DisconnectedType):
            return [pt.zeros_like(x) for x in inputs]
        step = levinson_spelled_step(V_UPDATES[self.v_form])
        (gamma_bar,), bars_bar = reverse_twice(lambda g: list(levinson_loop(g, self.order, step=step)), [gamma], bars, [w])
        return [gamma_bar, *bars_bar]


# ---------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------


def levinson_recursion(gamma, order: int, *, v_update: str = "square") -> LevinsonRecursionResult:
    r"""Run the Levinson-Durbin loop (as written with ``pytensor.scan``) in one fused kernel.

    For ``k = 0..p-1``, starting from ``phi = 0`` (length ``p``) and ``v = gamma_0``:

    .. math::
        \kappa_k = (\gamma_{k+1} - \textstyle\sum_{j<k}\phi_j\gamma_{k-j}) / v,\quad
        \phi_{:k} \leftarrow \phi_{:k} - \kappa_k \phi_{:k}[::-1],\quad \phi_k \leftarrow \kappa_k,\quad
        v \leftarrow v(1-\kappa_k^2).

    Parameters
    ----------
    gamma : tensor (..., n)
        Autocovariance-like sequence ``gamma_0, gamma_1, ...``; the first ``order + 1`` entries are
        used.  float32 or float64 (the computation runs in this dtype); integers become floatX.
    order : int
        Static number of steps ``p >= 1``; ``n >= p + 1`` is checked at graph build when ``n`` is
        known, at run time otherwise (``ValueError``).
    v_update : {"square", "minus", "factored"}
        How the loop spells the variance update: ``v * (1 - kappa**2)`` (default), ``v - kappa**2 * v``
        or ``v * (1 - kappa) * (1 + kappa)``.  The same value in exact arithmetic; the kernel runs the
        loop's spelling so that cancellation near ``|kappa| = 1``, the sign of a zero ``v`` (hence
        the sign of the next ``kappa``'s infinity) and overflow are the loop's.

    Returns
    -------
    LevinsonRecursionResult(phi (..., p), sigma2 (...), kappa (..., p))
        The loop's ``phis[-1]``, ``vs[-1]`` and ``kappas``, to rounding.  For a positive-definite
        autocovariance sequence: the AR(p) Yule-Walker coefficients, innovation variance and partial
        autocorrelations (statsmodels' ``levinson_durbin(gamma, p, isacov=True)`` ``arcoefs``,
        ``sigma_v``, ``pacf[1:]``).

    Failure behaviour: none, it is the loop's arithmetic.  A non-positive-definite ``gamma`` gives
    whatever the loop gives (finite numbers, or inf/NaN where some ``v`` is 0); non-finite inputs
    propagate.  A ``gamma`` shorter than ``order + 1`` raises ``ValueError``, as the loop raises ``IndexError``.

    Gradient: the exact reverse-mode adjoint of the recursion (PyTensor's autodiff of the Scan, to
    rounding), for cotangents on any subset of the outputs, in a second fused kernel.  Batched over
    leading dimensions.  Second derivatives through the loop itself (exact, not fused); no forward mode.

    Replicates the Scan::

        def step(k, phi, v, gamma):
            kappa = (gamma[k + 1] - pt.sum(phi[:k] * gamma[1:k + 1][::-1])) / v
            new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
            new_phi = pt.set_subtensor(new_phi[k], kappa)
            return new_phi, v * (1 - kappa**2), kappa

        (phis, vs, kappas) = pytensor.scan(step, sequences=[pt.arange(p)],
                                           outputs_info=[pt.zeros(p), gamma[0], None],
                                           non_sequences=[gamma], return_updates=False)
        phi, sigma2, pacf = phis[-1], vs[-1], kappas

    (for a float32 ``gamma`` the loop needs ``pt.zeros(p, dtype=gamma.dtype)``: the Scan rejects a
    float64 carry for a float32 ``v``).

    Examples
    --------
    >>> from iterops.ts.levinson_recursion import levinson_recursion
    >>> r = levinson_recursion([4.0, 2.0, 0.5], 2)
    >>> r.phi.eval(), float(r.sigma2.eval()), r.kappa.eval()
    (array([ 0.58333333, -0.16666667]), 2.9166666666666665, array([ 0.5       , -0.16666667]))
    >>> levinson_recursion([1.0, 0.0, 0.0, 1.5], 3).phi.eval()  # not positive definite: finite anyway
    array([0. , 0. , 1.5])
    """
    func = "levinson_recursion"
    order = _static_int(func, "order", order, minimum=1)
    gamma = as_tensor(func, "gamma", gamma, min_ndim=1)
    kind, itemsize = gamma.type.numpy_dtype.kind, gamma.type.numpy_dtype.itemsize
    if kind == "c" or (kind == "f" and itemsize not in (4, 8)):
        raise TypeError(
            f"{func}: gamma must be float32 or float64 (or integer), got gamma with dtype {gamma.type.dtype}"
        )
    n = gamma.type.shape[-1]
    if n is not None and n < order + 1:
        raise ValueError(
            f"{func}: gamma needs at least order + 1 = {order + 1} entries in its last dimension, "
            f"got order={order} and gamma with shape {gamma.type.shape}"
        )
    if v_update not in V_UPDATES:
        raise ValueError(f"{func}: v_update must be one of {V_UPDATES}, got {v_update!r}")
    if kind in "biu":
        gamma = pt.cast(gamma, float_dtype(gamma))
    return LevinsonRecursionResult(*apply_batched(LevinsonRecursion(order, V_UPDATES.index(v_update)), gamma))
