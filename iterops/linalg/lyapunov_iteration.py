r"""Lyapunov loops as the user runs them: one fused Numba kernel, the exact adjoint of the recursion.

``smith_doubling_loop`` (Smith's doubling), with ``alpha_0 = A``, ``gamma_0 = Q``:

.. math::  \alpha_{k+1} = \alpha_k \alpha_k,\qquad
           \gamma_{k+1} = \gamma_k + (\alpha_k \gamma_k) \alpha_k^T

``lyapunov_fixed_point_loop``, from ``X_0``, plain or damped by a scalar ``w``
(``damping="convex"`` / ``"increment"``: equal in exact arithmetic, each rounded as written;
``Y_k = (A X_k) A^T + Q``):

.. math::  X_{k+1} = (A X_k) A^T + Q,\qquad X_{k+1} = (1 - w) X_k + w Y_k,\qquad X_{k+1} = X_k + w (Y_k - X_k)

Shapes: ``A``, ``Q``, ``X0``, ``alpha``, ``gamma``, ``X`` (..., m, m); ``tol``, ``w`` scalars; ``n_steps`` an
integer scalar.  Failure is a value: the kernels never raise and never loop beyond ``n_steps``; overflow
(an unstable ``A``) gives inf/NaN that propagate as in the loop.

Code map:

* the steps and their reverses (``_doubling_step``, ``_fixed_point_step``, ``*_vjp``);
* the doubling runs (``smith_doubling_kernel``, ``smith_doubling_adjoint_kernel``);
* the fixed point on named arguments (:class:`Matrices`, :class:`Iterates`, :class:`Run`, :class:`Start`,
  :class:`Seed`, :class:`Bars`): its steps (``_fixed_point_steps``, into two alternating slots or a kept trace),
  the run growing a kept trace (``_fixed_point_run``), the reverse of a trace (``_fixed_point_reverse``);
* one C-ABI kernel per mode, an :class:`iterops._abi.Barrier` on an :class:`~iterops._abi.Abi` of those
  NamedTuples: ``_DOUBLING`` and ``_DOUBLING_ADJOINT`` per (``A``, ``Q``) dtypes; ``_STEPS`` (forward, traced
  forward), ``_ADJOINT`` (run and reverse) and ``_REVERSE`` (of a trace) per dtype;
* one entry point per Op (``_doubling_entry``, ``_doubling_adjoint_entry``, ``_fixed_point_entry``,
  ``_fixed_point_adjoint_entry``, ``_fixed_point_trace_entry``, ``_fixed_point_trace_adjoint_entry``), the
  fixed point's binding the Op's inputs by name (``_named_call``);
* the Ops (:class:`SmithDoublingLoop`, :class:`LyapunovFixedPointLoop`, their ``Grad`` and ``Trace`` Ops),
  :func:`share_fixed_point_trace`, second derivatives (``_loop_second_order``), then the public functions
  :func:`smith_doubling_loop` and :func:`lyapunov_fixed_point_loop`.

Why not :func:`iterops.solve_discrete_lyapunov`: it returns the *solution* of ``A X A^T - X + Q = 0``.
A loop returns something else when it stops early (a tolerance, an iteration guard) or does not converge to
the solution (a unit root ``Q`` does not excite, a rotation, an unstable ``A``).  These Ops run **the loop
itself**: its values and gradients, to rounding, on every input where the loop runs.

Stop rule: each runs ``k = 0 .. n_steps - 1`` and stops after the first step whose change
``d = new - old`` (of ``gamma`` or ``X``) satisfies it; that step's values are kept.

* ``"max_lt"``: ``max|d| < tol``; ``"max_le"``: ``max|d| <= tol``;
* ``"fro_lt"``: ``sqrt(sum d^2) < tol``, summed in the loop dtype like ``pt.linalg.norm``;
* ``None``: exactly ``n_steps`` steps.
* The change is compared with ``tol`` in float64 (PyTensor's upcast comparison); a NaN change or
  ``tol`` never stops the loop.  ``n_steps <= 0`` returns the initial values.

Arithmetic follows the user's loop:

* the same association of products, in the loop's dtype (float32 stays float32; the doubling loop's
  ``alpha`` keeps ``A``'s dtype, ``gamma`` the upcast of ``A`` and ``Q``);
* products by BLAS gemm as ``pt.dot`` computes them, plain loops below 5x5 (see ``_mm``);
* the damping is a run-time code and leaves the undamped step's arithmetic untouched; ``w = 1`` is *not*
  the undamped loop when ``X_k`` holds inf/NaN (``0 * inf`` is NaN), so it is never shortcut.

Gradients: the reverse-mode adjoint of the recursion *as run*, what PyTensor's autodiff of the Scan
computes (the number of steps is a constant, the stop rule is not differentiated).

* The adjoint kernel runs the loop again keeping every iterate and each step's first product
  (``A X_k``, ``alpha_k gamma_k``; memory ``O(steps run * m^2)``, as the Scan's gradient), then goes back.
* Where a graph has the fixed-point loop's value and its gradient, the Numba backend runs the loop once
  (:func:`share_fixed_point_trace`): the forward keeps the trace as an output, the reverse reads it.
* Reverse mode only (no ``pushforward``).  ``tol`` gets a zero gradient, ``n_steps`` none (disconnected).

With cotangents ``Ga``, ``Gg`` of ``alpha_{k+1}``, ``gamma_{k+1}`` (matrix calculus, e.g. Giles 2008,
"Collected matrix derivative results for forward and reverse mode AD"):

.. math::
    \bar\gamma_k = \bar\gamma_{k+1} + \alpha_k^T \bar\gamma_{k+1} \alpha_k,\qquad
    \bar\alpha_k = \bar\alpha_{k+1}\alpha_k^T + \alpha_k^T\bar\alpha_{k+1}
                 + \bar\gamma_{k+1}\alpha_k\gamma_k^T + \bar\gamma_{k+1}^T\alpha_k\gamma_k ,

``A_bar = alpha_bar_0``, ``Q_bar = gamma_bar_0``; and for the fixed point (``X0_bar = X_bar_0``)

.. math::
    \bar X_k = A^T \bar X_{k+1} A,\qquad
    \bar Q = \sum_{k\ge 1} \bar X_k,\qquad
    \bar A = \sum_{k\ge 0} \bar X_{k+1} A X_k^T + \bar X_{k+1}^T A X_k ,

and for the damped loop, with ``Ybar = w Xbar_{k+1}`` and ``Y_k`` from the kept ``(A X_k) A^T``,

.. math::
    \bar X_k = A^T \bar Y A + (1 - w) \bar X_{k+1},\qquad
    \bar w = \sum_{k\ge 0} \langle \bar X_{k+1}, Y_k - X_k\rangle ,

``Q_bar`` and ``A_bar`` as above with ``Ybar`` for ``X_bar_{k+1}``.

Second derivatives: the pullbacks of :class:`SmithDoublingLoopGrad` and :class:`LyapunovFixedPointLoopGrad` run
reverse mode twice through the same loop written as a ``pytensor.scan`` with the same stop rule
(:func:`_loop_second_order`): exact, not fused.  The trace Ops raise ``NotImplementedError`` when differentiated;
:func:`share_fixed_point_trace` puts them only into a graph being compiled, whose gradients are already built.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import NamedTuple

import numba
import numpy as np
from numba.extending import overload
import pytensor
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply
from pytensor.graph.rewriting.basic import copy_stack_trace, node_rewriter
from pytensor.scan.utils import until
from pytensor.tensor.exceptions import ShapeError
from pytensor.tensor.variable import TensorVariable

from iterops._abi import Abi, Barrier, Struct
from iterops._fused import FusedOp, apply_batched, entry_point, register_fused_op
from iterops._linalg_kernels import copy_into
from iterops._second_order import not_twice_differentiable, reverse_twice
from iterops._validate import as_tensor, check_dim_match, check_shape, check_square, float_dtype

__all__ = [
    "smith_doubling_loop",
    "lyapunov_fixed_point_loop",
    "SmithDoublingLoop",
    "SmithDoublingLoopGrad",
    "LyapunovFixedPointLoop",
    "LyapunovFixedPointLoopGrad",
    "LyapunovFixedPointTrace",
    "LyapunovFixedPointTraceGrad",
]

#: stop rule of the user's ``until(...)``, as a kernel code
_STOPS = {None: 0, "max_lt": 1, "max_le": 2, "fro_lt": 3}
#: damping of the fixed-point loop, as a kernel code: none, ``(1 - w) X + w Y``, ``X + w (Y - X)``
_DAMPINGS = {None: 0, "convex": 1, "increment": 2}

# ---------------------------------------------------------------------------
# Kernels (the single implementation)
# ---------------------------------------------------------------------------

#: from this size on (the first operand's rows), products of operands of one dtype go to BLAS gemm
_BLAS_MIN = 5


def _mm(X, Y, out, tX=False, tY=False):
    """``out = op(X) @ op(Y)``, ``op`` a transpose where flagged, in ``out``'s dtype (Numba only).

    The user's loop computes its products with ``pt.dot``, which PyTensor's backends run as BLAS
    gemm in the loop's dtype (float32 stays float32).  So do these kernels from
    :data:`_BLAS_MIN` on, for operands of one dtype: ``np.dot`` on C-contiguous arrays and their
    transposes (Numba hands them to gemm as transpose flags, no copy), the user's loop's own
    summation.  Plain loops, summing in ``out``'s dtype, take the rest: below that size (a gemm
    call costs more than the product) and for operands of mixed dtypes (the doubling loop with a
    float32 ``A`` and a float64 ``Q``: no gemm; the entries upcast exactly, as PyTensor's ``Dot``
    upcasts them).  Both give the loop's product to rounding (BLAS itself sums small products in a
    size-dependent order).

    Not the shared :func:`iterops._linalg_kernels.matmul`: it accumulates in float64 (a float32
    loop would be summed more precisely than the Scan sums it).
    """
    raise NotImplementedError("_mm is only called from Numba kernels")


@numba.njit(cache=True)
def _mm_loops(X, Y, out, tX=False, tY=False):
    n = X.shape[1] if tX else X.shape[0]
    k = X.shape[0] if tX else X.shape[1]
    m = Y.shape[0] if tY else Y.shape[1]
    for i in range(n):
        for j in range(m):
            s = out.dtype.type(0)
            for l in range(k):
                s += (X[l, i] if tX else X[i, l]) * (Y[j, l] if tY else Y[l, j])
            out[i, j] = s


def _mm_gemm(X, Y, out, tX=False, tY=False):
    if min(X.shape[0], X.shape[1], out.shape[1]) < _BLAS_MIN:
        _mm_loops(X, Y, out, tX, tY)
    elif tX and tY:
        np.dot(X.T, Y.T, out)
    elif tX:
        np.dot(X.T, Y, out)
    elif tY:
        np.dot(X, Y.T, out)
    else:
        np.dot(X, Y, out)


def _mm_mixed(X, Y, out, tX=False, tY=False):
    _mm_loops(X, Y, out, tX, tY)


@overload(_mm)
def _mm_overload(X, Y, out, tX=False, tY=False):
    """gemm (from :data:`_BLAS_MIN` on) for operands of ``out``'s dtype, loops otherwise (chosen when typed)."""
    return _mm_gemm if X.dtype == Y.dtype == out.dtype else _mm_mixed


@numba.njit(cache=True)
def _add_into(out, X):
    """``out += X`` for (m, m) arrays (explicit loops: Numba's in-place array expression on views costs more
    than the sum at these sizes)."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] += X[i, j]


class _Work(NamedTuple):
    """Two (m, m) scratch matrices of a reverse step."""

    P: np.ndarray
    W: np.ndarray


@numba.njit(cache=True)
def _stopped(new, old, tol, stop):
    """The user's ``until(stop(new, old, tol))``; False whenever the change is NaN."""
    if stop == 0:
        return False
    m, p = new.shape
    if stop == 3:  # pt.linalg.norm(new - old) < tol: sum of squares in the loop dtype
        s = new.dtype.type(0)
        for i in range(m):
            for j in range(p):
                d = new[i, j] - old[i, j]
                s += d * d
        return np.float64(np.sqrt(s)) < tol
    # pt.max(pt.abs(new - old)) < tol (or <=): every |d| < tol, a NaN one failing as PyTensor's NaN-propagating
    # Max does.  Returns at the first entry that fails: far from convergence that is the first one.
    for i in range(m):
        for j in range(p):
            a = np.float64(np.abs(new[i, j] - old[i, j]))
            if not (a < tol if stop == 1 else a <= tol):
                return False
    return True


@numba.njit(cache=True)
def _slot(k, keep):
    """Buffer slot of iterate ``k``: all iterates kept (for the adjoint) or two alternating."""
    return k if keep else k % 2


@numba.njit(cache=True)
def _trace_slots(n_steps):
    """Initial number of slots of a kept trace for a loop of at most ``n_steps`` steps (:func:`_grow` doubles it:
    a trace allocated at once for ``n_steps`` costs more in fresh pages than the copies)."""
    return min(n_steps, 15) + 1


@numba.njit(cache=True)
def _buffer(n_steps, keep, m, dtype):
    """Iterate buffer (slots, m, m); with ``keep`` it starts at :func:`_trace_slots` and :func:`_grow` doubles it."""
    return np.empty((_trace_slots(n_steps) if keep else 2, m, m), dtype=dtype)


@numba.njit(cache=True)
def _grow(buf, n_steps):
    """``buf`` with twice the slots (at most ``n_steps + 1``), the old ones copied."""
    new = np.empty((min(2 * buf.shape[0] - 1, n_steps) + 1, buf.shape[1], buf.shape[2]), dtype=buf.dtype)
    new[: buf.shape[0]] = buf
    return new


# --- Smith doubling --------------------------------------------------------


@numba.njit(cache=True)
def _doubling_step(alpha, gamma, alpha_new, gamma_new, work):
    """``gamma_new = gamma + (alpha gamma) alpha^T``, ``alpha_new = alpha alpha`` (the user's association);
    ``work`` receives ``alpha gamma`` (kept for the adjoint)."""
    _mm(alpha, gamma, work)
    _mm(work, alpha, gamma_new, tY=True)
    _add_into(gamma_new, gamma)
    _mm(alpha, alpha, alpha_new)


@numba.njit(cache=True)
def _doubling_step_vjp(alpha, gamma, alpha_gamma, Ga, Gg, Ga_out, Gg_out, work):
    """Cotangents of (alpha, gamma) before a step from those after it (module docstring);
    ``alpha_gamma`` is the step's ``alpha gamma``; ``work`` scratch (:class:`_Work`)."""
    P, W = work.P, work.W
    _mm(Gg, alpha, P)                                 # P = Gg alpha
    _mm(alpha, P, Gg_out, tX=True)                    # Gg_out = Gg + alpha^T Gg alpha
    _add_into(Gg_out, Gg)
    _mm(Ga, alpha, Ga_out, tY=True)                   # Ga_out = Ga alpha^T + alpha^T Ga   (alpha alpha)
    _mm(alpha, Ga, W, tX=True)
    _add_into(Ga_out, W)
    _mm(P, gamma, W, tY=True)                         #        + Gg alpha gamma^T          (alpha gamma alpha^T)
    _add_into(Ga_out, W)
    _mm(Gg, alpha_gamma, W, tX=True)                  #        + Gg^T alpha gamma
    _add_into(Ga_out, W)


@numba.njit(cache=True)
def _doubling_run(A, Q, tol, n_steps, stop, keep):
    """Run the doubling loop: (alphas, gammas, alpha_gammas, steps run), iterate ``k`` in slot
    ``_slot(k, keep)``; with ``keep``, ``alpha_gammas[k]`` is step ``k``'s ``alpha_k gamma_k``."""
    m = A.shape[0]
    n_steps = max(n_steps, 0)
    alphas = _buffer(n_steps, keep, m, A.dtype)
    gammas = _buffer(n_steps, keep, m, Q.dtype)
    works = _buffer(n_steps, keep, m, Q.dtype)
    alphas[0] = A
    gammas[0] = Q
    k = 0
    while k < n_steps:
        if keep and k + 1 == alphas.shape[0]:
            alphas = _grow(alphas, n_steps)
            gammas = _grow(gammas, n_steps)
            works = _grow(works, n_steps)
        old, new = _slot(k, keep), _slot(k + 1, keep)
        _doubling_step(alphas[old], gammas[old], alphas[new], gammas[new], works[old])
        k += 1
        if _stopped(gammas[new], gammas[old], tol, stop):
            break
    return alphas, gammas, works, k


@numba.njit(cache=True)
def smith_doubling_kernel(A, Q, tol, n_steps, stop):
    """Final ``(alpha, gamma)`` of the doubling loop for one (m, m) system.

    ``A``: (m, m) float; ``Q``: (m, m) float of the dtype ``gamma`` takes;
    ``tol`` float64; ``n_steps`` int; ``stop`` a code of ``_STOPS``.
    """
    alphas, gammas, _, n_run = _doubling_run(A, Q, tol, n_steps, stop, False)
    last = _slot(n_run, False)
    return alphas[last], gammas[last]


@numba.njit(cache=True)
def smith_doubling_adjoint_kernel(A, Q, tol, n_steps, stop, Ga, Gg):
    """``(A_bar, Q_bar)`` from cotangents ``Ga``, ``Gg`` of the final (alpha, gamma).

    Reverse pass in ``Q``'s dtype; ``A_bar`` is returned in ``A``'s.
    """
    alphas, gammas, works, n_run = _doubling_run(A, Q, tol, n_steps, stop, True)
    m = A.shape[0]
    Ga_k = Ga.astype(Q.dtype)
    Gg_k = Gg.astype(Q.dtype)
    Ga_prev = np.empty_like(Ga_k)
    Gg_prev = np.empty_like(Gg_k)
    work = _Work(np.empty((m, m), dtype=Q.dtype), np.empty((m, m), dtype=Q.dtype))
    for k in range(n_run - 1, -1, -1):
        _doubling_step_vjp(alphas[k], gammas[k], works[k], Ga_k, Gg_k, Ga_prev, Gg_prev, work)
        Ga_k, Ga_prev = Ga_prev, Ga_k
        Gg_k, Gg_prev = Gg_prev, Gg_k
    return Ga_k.astype(A.dtype), Gg_k


# --- Fixed point -----------------------------------------------------------


@numba.njit(cache=True)
def _fixed_point_step(A, At, Q, X, X_new, work, Y, damp, w):
    """``X_new = (A X) A^T + Q`` (the user's association; ``At`` is ``A^T`` laid out contiguously: gemm of a
    plain operand is faster than of a transposed one); ``work`` receives ``A X`` (kept for the adjoint).
    With ``damp`` (a code of :data:`_DAMPINGS`) the product ``(A X) A^T`` goes to ``Y`` (kept for the
    adjoint's ``w_bar``) and ``Y + Q`` is damped by ``w`` into ``X_new`` (:func:`_damp_into`)."""
    _mm(A, X, work)
    if damp == 0:
        _mm(work, At, X_new)
        _add_into(X_new, Q)
    else:
        _mm(work, At, Y)
        _damp_into(X_new, Y, Q, X, damp, w)


@numba.njit(cache=True)
def _damp_into(out, P, Q, X, damp, w):
    """``out <- (1 - w) X + w Y`` (``damp`` 1) or ``X + w (Y - X)`` (``damp`` 2), ``Y = P + Q``, elementwise
    in the loop dtype as the user's fused elementwise graph computes it (``1 - w`` rounded first)."""
    c = out.dtype.type(1) - w
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            y = P[i, j] + Q[i, j]
            out[i, j] = c * X[i, j] + w * y if damp == 1 else X[i, j] + w * (y - X[i, j])


@numba.njit(cache=True)
def _damped_step_vjp_pre(Q, X, P, w, G, Gw):
    """First half of the damped step's reverse (``damp`` 1 or 2, the same derivatives): ``Gw = w G``, the
    cotangent of ``Y = (A X) A^T + Q``, for the undamped step's reverse (``X_bar = A^T Gw A + (1 - w) G``,
    :func:`_damped_step_vjp_post`); returns ``sum(G * (Y - X))``, this step's term of ``w_bar``, with ``Y``
    from the forward's kept product ``P = (A X) A^T``."""
    s = G.dtype.type(0)
    for i in range(G.shape[0]):
        for j in range(G.shape[1]):
            s += G[i, j] * ((P[i, j] + Q[i, j]) - X[i, j])
            Gw[i, j] = w * G[i, j]
    return s


@numba.njit(cache=True)
def _damped_step_vjp_post(G, G_out, w):
    """``G_out += (1 - w) G`` (the damped step's direct path from ``X_k`` to ``X_{k+1}``)."""
    c = G.dtype.type(1) - w
    for i in range(G.shape[0]):
        for j in range(G.shape[1]):
            G_out[i, j] += c * G[i, j]


@numba.njit(cache=True)
def _fixed_point_step_vjp(A, X, AX, G, G_out, bars, work):
    """Cotangent of ``X_k`` from that of ``X_{k+1}`` (``G``); accumulates ``bars.A``, ``bars.Q``.  ``AX`` is the
    step's ``A X_k``.  Products as ``op(U)^T op(V)^T``, which gemm runs faster than ``U V^T``."""
    PT, W = work.P, work.W
    _add_into(bars.Q, G)                        # Q_bar  += G
    _mm(A, G, PT, tX=True, tY=True)             # PT = (G A)^T = A^T G^T
    _mm(A, PT, G_out, tX=True, tY=True)         # G_out = A^T (G A) = A^T G A
    _mm(PT, X, W, tX=True, tY=True)             # A_bar  += (G A) X^T
    _add_into(bars.A, W)
    _mm(G, AX, W, tX=True)                      #         + G^T A X
    _add_into(bars.A, W)


class Matrices(NamedTuple):
    """A loop's matrices, (m, m) each (or their cotangents)."""

    A: np.ndarray
    Q: np.ndarray


class Iterates(NamedTuple):
    """A run's iterates and kept products, (slots, m, m) each: iterate ``j`` in slot ``_slot(j, keep)``."""

    Xs: np.ndarray  #: ``X_j``
    AXs: np.ndarray  #: step ``j``'s ``A X_j``
    Ps: np.ndarray  #: damped: step ``j``'s ``(A X_j) A^T``; undamped (0, m, m)


class _Rule(NamedTuple):
    """How the fixed-point loop runs: its stop rule, whether the whole trace is kept, its damping."""

    tol: float
    n_steps: int  #: at least 0
    stop: int
    keep: bool
    damp: int
    w: float  #: float64, used in the iterates' dtype


class Run(NamedTuple):
    """A run of the loop from iterate ``start`` (already in its slot of the :class:`Iterates`) by ``rule``."""

    start: int
    rule: _Rule


class Start(NamedTuple):
    """The loop's start ``X0`` (m, m)."""

    X0: np.ndarray


class Seed(NamedTuple):
    """What the reverse pass starts from: the cotangent ``G`` (m, m) of the last iterate, and the damping."""

    G: np.ndarray
    damp: int
    w: float  #: float64, used in the iterates' dtype


class Bars(NamedTuple):
    """The reverse pass's results: the cotangents of ``A``, ``Q``, ``X0`` (m, m) and of ``w`` (1,)."""

    A: np.ndarray
    Q: np.ndarray
    X0: np.ndarray
    w: np.ndarray


@numba.njit(cache=True)
def _fixed_point_steps(mats, its, run):
    """Steps of the loop from iterate ``run.start`` until the stop rule holds, ``n_steps`` steps are run or (with
    ``keep``) ``its`` is full: ``(steps run, done)``.  Step ``j`` writes ``A X_j`` to ``AXs[_slot(j, keep)]``
    and, damped, ``(A X_j) A^T`` to ``Ps[_slot(j, keep)]``."""
    rule = run.rule
    keep, damp = rule.keep, rule.damp
    Xs, AXs, Ps = its.Xs, its.AXs, its.Ps
    At = np.ascontiguousarray(mats.A.T)
    w = Xs.dtype.type(rule.w)
    k = run.start
    while k < rule.n_steps:
        if keep and k + 1 == Xs.shape[0]:
            return k, False
        old, new = _slot(k, keep), _slot(k + 1, keep)
        _fixed_point_step(mats.A, At, mats.Q, Xs[old], Xs[new], AXs[old], Ps[old] if damp != 0 else AXs[old], damp, w)
        k += 1
        if _stopped(Xs[new], Xs[old], rule.tol, rule.stop):
            break
    return k, True


@numba.njit(cache=True)
def _iterates(n_steps, keep, damp, m, dtype):
    """Empty :class:`Iterates` for a run of at most ``n_steps`` steps (:func:`_buffer`; ``Ps`` (0, m, m) undamped)."""
    Ps = _buffer(n_steps, keep, m, dtype) if damp != 0 else np.empty((0, m, m), dtype=dtype)
    return Iterates(_buffer(n_steps, keep, m, dtype), _buffer(n_steps, keep, m, dtype), Ps)


@numba.njit(cache=True)
def _grown(its, n_steps):
    """:class:`Iterates` with twice the slots (:func:`_grow`)."""
    Ps = _grow(its.Ps, n_steps) if its.Ps.shape[0] > 0 else its.Ps
    return Iterates(_grow(its.Xs, n_steps), _grow(its.AXs, n_steps), Ps)


@numba.njit(cache=True)
def _trimmed(its, k):
    """The trace of ``k`` steps kept in ``its``: ``Xs`` k + 1 slots, ``AXs`` and damped ``Ps`` k."""
    return Iterates(its.Xs[:k + 1], its.AXs[:k], its.Ps[:min(k, its.Ps.shape[0])])


@numba.njit(cache=True)
def _fixed_point_steps_code(mats, its, run):
    """:func:`_fixed_point_steps` as one number, ``2 * (steps run) + done`` (what its kernel returns)."""
    k, done = _fixed_point_steps(mats, its, run)
    return 2 * k + (1 if done else 0)


@numba.njit(cache=True)
def _steps_decode(code):
    """``(steps run, done)`` from :func:`_fixed_point_steps_code`'s number."""
    k = int(code)
    return k // 2, k % 2 == 1


@cache
def _fixed_point_run(steps):
    """Jitted ``run(mats, X0, rule) -> (Iterates, steps run)``: the loop from ``X0`` by ``rule``, iterate ``k`` in
    slot ``_slot(k, keep)``, its steps run by ``steps(mats, its, run)`` (:func:`_fixed_point_steps_code`, or a call
    of its kernel); a kept trace grows (:func:`_grown`) whenever it is full.  (A function made per ``steps``, not a
    parameter: a function passed as a value cannot be cached.)"""

    @numba.njit
    def run(mats, X0, rule):
        its = _iterates(rule.n_steps, rule.keep, rule.damp, X0.shape[0], X0.dtype)
        copy_into(X0, its.Xs[0])
        k, done = _steps_decode(steps(mats, its, Run(0, rule)))
        while not done:
            its = _grown(its, rule.n_steps)
            k, done = _steps_decode(steps(mats, its, Run(k, rule)))
        return its, k

    return run


_run_fixed_point = _fixed_point_run(_fixed_point_steps_code)


@numba.njit(cache=True)
def _fixed_point_reverse(mats, its, seed, bars):
    """Writes :class:`Bars` from the cotangent ``seed.G`` of the last iterate ``X_K`` and the trace of the ``K``
    steps run (``its.Xs`` K + 1 slots, ``AXs`` and damped ``Ps`` K slots, :func:`_fixed_point_steps` with
    ``keep``); ``w_bar`` 0 undamped."""
    Xs, AXs, Ps = its.Xs, its.AXs, its.Ps
    m, damp, w = Xs.shape[1], seed.damp, Xs.dtype.type(seed.w)
    G_k = seed.G.astype(Xs.dtype)
    G_prev = np.empty_like(G_k)
    bars.A[:] = 0
    bars.Q[:] = 0
    work = _Work(np.empty((m, m), dtype=Xs.dtype), np.empty((m, m), dtype=Xs.dtype))
    Gw = np.empty((m if damp != 0 else 0, m), dtype=Xs.dtype)
    w_bar = Xs.dtype.type(0)
    for k in range(AXs.shape[0] - 1, -1, -1):
        if damp == 0:  # one call site of the step's reverse (code size: the cold compile)
            Gy = G_k
        else:
            w_bar += _damped_step_vjp_pre(mats.Q, Xs[k], Ps[k], w, G_k, Gw)
            Gy = Gw
        _fixed_point_step_vjp(mats.A, Xs[k], AXs[k], Gy, G_prev, bars, work)
        if damp != 0:
            _damped_step_vjp_post(G_k, G_prev, w)
        G_k, G_prev = G_prev, G_k
    copy_into(G_k, bars.X0)
    bars.w[0] = w_bar
    return 0


@numba.njit(cache=True)
def _fixed_point_adjoint(mats, start, rule, seed, bars):
    """Writes :class:`Bars` from the cotangent ``seed.G`` of the last iterate: the loop run from ``start.X0``
    keeping its trace (``rule.keep``), then :func:`_fixed_point_reverse`."""
    its, k = _run_fixed_point(mats, start.X0, rule)
    return _fixed_point_reverse(mats, _trimmed(its, k), seed, bars)


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


# C-ABI barriers (see :class:`iterops._fused.OpaqueKernel`): a new graph links to these symbols
# instead of compiling the kernels into itself again.  Arrays travel as C-contiguous
# pointers (:class:`iterops._abi.Abi`); results are written into the caller's arrays.


class Doubling(NamedTuple):
    """The doubling loop's state or its cotangent, (m, m) each: ``alpha`` in ``A``'s dtype, ``gamma`` in ``Q``'s."""

    alpha: np.ndarray
    gamma: np.ndarray


class _Stop(NamedTuple):
    """The doubling loop's stop rule: at most ``n_steps`` steps, ``stop`` a code of :data:`_STOPS`."""

    tol: float
    n_steps: int
    stop: int


@numba.njit(cache=True)
def _doubling_forward(mats, rule, out):
    """Writes the final ``(alpha, gamma)`` of the loop from ``mats`` (a :class:`Matrices`) into ``out``."""
    alpha, gamma = smith_doubling_kernel(mats.A, mats.Q, rule.tol, rule.n_steps, rule.stop)
    copy_into(alpha, out.alpha)
    copy_into(gamma, out.gamma)
    return 0


@numba.njit(cache=True)
def _doubling_adjoint(mats, rule, cot, bars):
    """Writes ``(A_bar, Q_bar)`` into ``bars`` (a :class:`Matrices`) from ``cot``, the cotangents of the final state."""
    A_bar, Q_bar = smith_doubling_adjoint_kernel(mats.A, mats.Q, rule.tol, rule.n_steps, rule.stop, cot.alpha,
                                                 cot.gamma)
    copy_into(A_bar, bars.A)
    copy_into(Q_bar, bars.Q)
    return 0


#: (dtype of A / alpha, dtype of Q / gamma) of the doubling kernels
_DOUBLING_DTYPES = (("float32", "float32"), ("float32", "float64"), ("float64", "float64"))
_STOP = Struct(_Stop, tol="f", n_steps="i", stop="i")


#: the doubling kernels per (A, Q) dtypes: the forward run, and its adjoint
_DOUBLING, _DOUBLING_ADJOINT = {}, {}
for _a, _q in _DOUBLING_DTYPES:
    _mats, _state = Struct(Matrices, A=(2, _a), Q=(2, _q)), Struct(Doubling, alpha=(2, _a), gamma=(2, _q))
    _DOUBLING[_a, _q] = Barrier(_doubling_forward, Abi(mats=_mats, rule=_STOP, out=_state), f"{_a}_{_q}")
    _DOUBLING_ADJOINT[_a, _q] = Barrier(_doubling_adjoint, Abi(mats=_mats, rule=_STOP, cot=_state, bars=_mats),
                                        f"{_a}_{_q}")

_MATRICES, _ITERATES = Struct(Matrices, A=2, Q=2), Struct(Iterates, Xs=3, AXs=3, Ps=3)
_RULE = Struct(_Rule, tol="f", n_steps="i", stop="i", keep="b", damp="i", w="f")
_SEED, _BARS = Struct(Seed, G=2, damp="i", w="f"), Struct(Bars, A=2, Q=2, X0=2, w=1)
_DTYPES = ("float32", "float64")  #: the fixed-point kernels' working dtypes
#: the fixed-point kernels per working dtype: the loop's steps (forward, and traced in the caller's buffers)
_STEPS = {d: Barrier(_fixed_point_steps_code, Abi(dtype=d, mats=_MATRICES, its=_ITERATES,
                                                  run=Struct(Run, start="i", rule=_RULE)), d) for d in _DTYPES}
#: the loop run again keeping its trace, then its reverse (the gradient Op)
_ADJOINT = {d: Barrier(_fixed_point_adjoint, Abi(dtype=d, mats=_MATRICES, start=Struct(Start, X0=2), rule=_RULE,
                                                 seed=_SEED, bars=_BARS), d) for d in _DTYPES}
#: the reverse of a kept trace (the gradient Op beside a traced forward)
_REVERSE = {d: Barrier(_fixed_point_reverse, Abi(dtype=d, mats=_MATRICES, its=_ITERATES, seed=_SEED, bars=_BARS), d)
            for d in _DTYPES}


@numba.njit
def _square(func, name, X, m):
    """``X`` C-contiguous after checking that it is (m, m), ``m = A.shape[0]``."""
    check_shape(func, name, X, "(m, m), m = A.shape[0]", (m, m))
    # dtypes are the node's (make_node casts); only the layout may need a copy
    return np.ascontiguousarray(X)


@numba.njit
def _fixed_point_inputs(func, A, Q, X0, tol, n_steps, stop, keep, damp, w):
    """The loop's checked inputs: ``(Matrices, X0, _Rule)`` (``w`` a 0-d array, or None undamped)."""
    m = A.shape[0]
    mats = Matrices(_square(func, "A", A, m), _square(func, "Q", Q, m))
    w_ = 0.0 if w is None else np.float64(w.item())
    rule = _Rule(np.float64(tol.item()), max(np.int64(n_steps.item()), 0), stop, keep, damp, w_)
    return mats, _square(func, "X0", X0, m), rule


@numba.njit
def _bars_like(X0):
    """:class:`Bars` to be written, ``w`` zero."""
    return Bars(np.empty_like(X0), np.empty_like(X0), np.empty_like(X0), np.zeros(1, dtype=X0.dtype))


@numba.njit
def _zero_d(x):
    """A 0-d array holding the (1,) array ``x``'s entry."""
    out = np.empty((), dtype=x.dtype)
    out[()] = x[0]
    return out


@cache
def _bars_out(damped: bool):
    """Jitted: the gradient Ops' outputs from :class:`Bars`, ``(A_bar, Q_bar, X0_bar)``, ``damped`` also ``w_bar``
    (0-d)."""
    if damped:
        return numba.njit(lambda bars: (bars.A, bars.Q, bars.X0, _zero_d(bars.w)))
    return numba.njit(lambda bars: (bars.A, bars.Q, bars.X0))


def _named_call(core, names: tuple[str, ...]):
    """``core`` behind a jitted function whose parameters are an Op's inputs ``names`` (PyTensor calls an entry
    point with one argument per input): each of ``core``'s parameters gets the input of its name, or None."""
    params = inspect.signature(core.py_func).parameters
    scope = {"core": core}
    exec(f"def call({', '.join(names)}):\n"  # noqa: S102  (names are the Op's input names)
         f"    return core({', '.join(p if p in names else 'None' for p in params)})\n", scope)
    return numba.njit(scope["call"])


_FUNC = "lyapunov_fixed_point_loop"


@entry_point
def _fixed_point_entry(stop: int, dtype: str, damp: int, names: tuple[str, ...]):
    """:class:`LyapunovFixedPointLoop`'s entry point: ``(A, Q, X0, tol, n_steps[, w]) -> X``."""
    steps, t = _STEPS[dtype].call, np.dtype(dtype).type

    @numba.njit
    def forward(A, Q, X0, tol, n_steps, w):
        mats, X0, rule = _fixed_point_inputs(_FUNC, A, Q, X0, tol, n_steps, stop, False, damp, w)
        m = X0.shape[0]
        # two alternating slots (not kept): the kernel runs to the end in one call (no glue to grow a trace)
        its = Iterates(np.empty((2, m, m), t), np.empty((2, m, m), t), np.empty((2 if damp != 0 else 0, m, m), t))
        copy_into(X0, its.Xs[0])
        k, _ = _steps_decode(steps(mats, its, Run(0, rule)))
        return its.Xs[_slot(k, False)]

    return _named_call(forward, names)


@entry_point
def _fixed_point_adjoint_entry(stop: int, dtype: str, damp: int, names: tuple[str, ...]):
    """:class:`LyapunovFixedPointLoopGrad`'s entry point:
    ``(A, Q, X0, tol, n_steps[, w], G) -> (A_bar, Q_bar, X0_bar[, w_bar])``."""
    adjoint_kernel = _ADJOINT[dtype].call
    func, outputs = _FUNC + " gradient", _bars_out(damp != 0)

    @numba.njit
    def adjoint(A, Q, X0, tol, n_steps, w, G):
        mats, X0, rule = _fixed_point_inputs(func, A, Q, X0, tol, n_steps, stop, True, damp, w)
        seed = Seed(_square(func, "cotangent", G, X0.shape[0]), damp, rule.w)
        bars = _bars_like(X0)
        adjoint_kernel(mats, Start(X0), rule, seed, bars)
        return outputs(bars)

    return _named_call(adjoint, names)


@entry_point
def _fixed_point_trace_entry(stop: int, dtype: str, damp: int, names: tuple[str, ...]):
    """:class:`LyapunovFixedPointTrace`'s: ``(A, Q, X0, tol, n_steps[, w]) -> (X, Xs, AXs, Ps)``."""
    run = _fixed_point_run(_STEPS[dtype].call)

    @numba.njit
    def traced(A, Q, X0, tol, n_steps, w):
        mats, X0, rule = _fixed_point_inputs(_FUNC, A, Q, X0, tol, n_steps, stop, True, damp, w)
        its, k = run(mats, X0, rule)
        its = _trimmed(its, k)
        return its.Xs[k].copy(), its.Xs, its.AXs, its.Ps

    return _named_call(traced, names)


@entry_point
def _fixed_point_trace_adjoint_entry(dtype: str, damp: int, names: tuple[str, ...]):
    """:class:`LyapunovFixedPointTraceGrad`'s: ``(A, Q, X0, Xs, AXs, Ps[, w], G) -> (A_bar, Q_bar, X0_bar[, w_bar])``,
    the reverse of the trace of a :class:`LyapunovFixedPointTrace`."""
    reverse = _REVERSE[dtype].call
    func, outputs = _FUNC + " gradient", _bars_out(damp != 0)

    @numba.njit
    def from_trace(A, Q, X0, Xs, AXs, Ps, w, G):
        m = A.shape[0]
        mats = Matrices(_square(func, "A", A, m), _square(func, "Q", Q, m))
        X0, G = _square(func, "X0", X0, m), _square(func, "cotangent", G, m)
        k = AXs.shape[0]
        check_shape(func, "Xs", Xs, "(k + 1, m, m), k = len(AXs)", (k + 1, m, m))
        check_shape(func, "AXs", AXs, "(k, m, m)", (k, m, m))
        check_shape(func, "Ps", Ps, "(k or 0 undamped, m, m)", (k if damp != 0 else 0, m, m))
        its = Iterates(np.ascontiguousarray(Xs), np.ascontiguousarray(AXs), np.ascontiguousarray(Ps))
        bars = _bars_like(X0)
        reverse(mats, its, Seed(G, damp, 0.0 if w is None else np.float64(w.item())), bars)
        return outputs(bars)

    return _named_call(from_trace, names)


_DOUBLING_FUNC = "smith_doubling_loop"


@numba.njit
def _doubling_inputs(func, A, Q, tol, n_steps, stop):
    """The doubling loop's checked inputs: ``(Matrices, _Stop)``."""
    m = A.shape[0]
    mats = Matrices(_square(func, "A", A, m), _square(func, "Q", Q, m))
    return mats, _Stop(np.float64(tol.item()), np.int64(n_steps.item()), stop)


@entry_point
def _doubling_entry(stop: int, a_dtype: str, q_dtype: str):
    """:class:`SmithDoublingLoop`'s entry point: ``(A, Q, tol, n_steps) -> (alpha, gamma)``."""
    call = _DOUBLING[a_dtype, q_dtype].call
    a_t, q_t = np.dtype(a_dtype).type, np.dtype(q_dtype).type

    @numba.njit
    def forward(A, Q, tol, n_steps):
        mats, rule = _doubling_inputs(_DOUBLING_FUNC, A, Q, tol, n_steps, stop)
        m = A.shape[0]
        out = Doubling(np.empty((m, m), dtype=a_t), np.empty((m, m), dtype=q_t))
        call(mats, rule, out)
        return out.alpha, out.gamma

    return forward


@entry_point
def _doubling_adjoint_entry(stop: int, a_dtype: str, q_dtype: str):
    """:class:`SmithDoublingLoopGrad`'s: ``(A, Q, tol, n_steps, Ga, Gg) -> (A_bar, Q_bar)``."""
    call = _DOUBLING_ADJOINT[a_dtype, q_dtype].call
    a_t, q_t = np.dtype(a_dtype).type, np.dtype(q_dtype).type
    func = _DOUBLING_FUNC + " gradient"

    @numba.njit
    def adjoint(A, Q, tol, n_steps, Ga, Gg):
        mats, rule = _doubling_inputs(func, A, Q, tol, n_steps, stop)
        m = A.shape[0]
        cot = Doubling(_square(func, "alpha cotangent", Ga, m), _square(func, "gamma cotangent", Gg, m))
        bars = Matrices(np.empty((m, m), dtype=a_t), np.empty((m, m), dtype=q_t))
        call(mats, rule, cot, bars)
        return bars.A, bars.Q

    return adjoint


def _control_inputs(tol, n_steps):
    """``tol`` as float64, ``n_steps`` as int64 (the kernels' types)."""
    return pt.cast(pt.as_tensor_variable(tol), "float64"), pt.cast(pt.as_tensor_variable(n_steps), "int64")


class _LoopOp(FusedOp):
    """Shared by the loop Ops and their gradients: the stop rule is the only prop."""

    __props__ = ("stop",)

    def __init__(self, stop="max_lt"):
        if stop not in _STOPS:
            raise ValueError(f"{type(self).__name__}: stop must be one of {list(_STOPS)}, got {stop!r}")
        self.stop = stop

    def infer_shape(self, node, input_shapes):
        return [input_shapes[i] for i in self._output_shape_from]


@register_fused_op
class SmithDoublingLoop(_LoopOp):
    """Core Op ``(m,m),(m,m),(),()->(m,m),(m,m)``: (A, Q, tol, n_steps) -> (alpha, gamma);
    use :func:`smith_doubling_loop`."""

    gufunc_signature = "(m,m),(m,m),(),()->(m,m),(m,m)"
    _output_shape_from = (0, 1)

    def make_node(self, A, Q, tol, n_steps):
        A, Q = pt.as_tensor_variable(A), pt.as_tensor_variable(Q)
        A, Q = A.astype(float_dtype(A)), Q.astype(float_dtype(A, Q))
        tol, n_steps = _control_inputs(tol, n_steps)
        return Apply(self, [A, Q, tol, n_steps], [A.type(), Q.type()])

    def numba_fn(self, node):
        return _doubling_entry(_STOPS[self.stop], *(x.type.dtype for x in node.inputs[:2]))

    def connection_pattern(self, node):
        # (alpha, gamma) per input; tol gets a zero gradient, n_steps none
        return [[True, True], [False, True], [True, True], [False, False]]

    def pullback(self, inputs, outputs, cotangents):
        A, Q, tol, n_steps = inputs
        connected = [not isinstance(g.type, DisconnectedType) for g in cotangents]
        Ga, Gg = (g if c else pt.zeros_like(out) for g, c, out in zip(cotangents, connected, outputs))
        A_bar, Q_bar = apply_batched(SmithDoublingLoopGrad(self.stop), A, Q, tol, n_steps, Ga, Gg)
        return [A_bar, Q_bar if connected[1] else disconnected_type(), pt.zeros_like(tol), disconnected_type()]


@register_fused_op
class SmithDoublingLoopGrad(_LoopOp):
    """Core Op ``(m,m),(m,m),(),(),(m,m),(m,m)->(m,m),(m,m)``: (A, Q, tol, n_steps, Ga, Gg) -> (A_bar, Q_bar),
    the reverse pass of :class:`SmithDoublingLoop`.  Its pullback (second derivatives): reverse mode twice
    through the loop as a Scan (:func:`_loop_second_order`)."""

    gufunc_signature = "(m,m),(m,m),(),(),(m,m),(m,m)->(m,m),(m,m)"
    _output_shape_from = (0, 1)

    def make_node(self, A, Q, tol, n_steps, Ga, Gg):
        A, Q, Ga, Gg = map(pt.as_tensor_variable, (A, Q, Ga, Gg))
        A, Q = A.astype(float_dtype(A)), Q.astype(float_dtype(A, Q))  # as the forward Op
        Ga, Gg = Ga.astype(A.type.dtype), Gg.astype(Q.type.dtype)
        tol, n_steps = _control_inputs(tol, n_steps)
        return Apply(self, [A, Q, tol, n_steps, Ga, Gg], [A.type(), Q.type()])

    def numba_fn(self, node):
        return _doubling_adjoint_entry(_STOPS[self.stop], *(x.type.dtype for x in node.inputs[:2]))

    def connection_pattern(self, node):
        return [[True, True]] * 3 + [[False, False]] + [[True, True]] * 2

    def pullback(self, inputs, outputs, cotangents):
        return _loop_second_order(self, inputs, cotangents)


class _FixedPointOp(_LoopOp):
    """The fixed-point Ops: props ``stop`` and ``damping`` (a key of :data:`_DAMPINGS`); a damped Op takes
    the damping factor ``w`` (a scalar of the loop dtype) after ``n_steps``."""

    __props__ = ("stop", "damping")

    def __init__(self, stop="max_lt", damping=None):
        super().__init__(stop)
        if damping not in _DAMPINGS:
            raise ValueError(f"{type(self).__name__}: damping must be one of {list(_DAMPINGS)}, got {damping!r}")
        self.damping = damping

    @property
    def _w(self):
        """``[w]`` for a damped Op, else ``[]`` (where ``w`` sits in the inputs)."""
        return [0] if self.damping else []

    #: the inputs' names, ``w`` where a damped Op has it (:meth:`input_names`); the entry points bind them by name
    _INPUTS = ("A", "Q", "X0", "tol", "n_steps", "w")

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name in self._INPUTS if name != "w" or self.damping)

    def _entry(self, node, entry):
        """``entry``'s entry point for this Op's stop rule, dtype and damping."""
        return entry(_STOPS[self.stop], node.inputs[0].type.dtype, _DAMPINGS[self.damping], self.input_names)

    def _inputs(self, A, Q, X0, tol, n_steps, w, *cotangents):
        mats = list(map(pt.as_tensor_variable, (A, Q, X0)))
        w = [pt.as_tensor_variable(w)] if self.damping else []
        dtype = float_dtype(*mats, *w)
        tol, n_steps = _control_inputs(tol, n_steps)
        cts = [pt.as_tensor_variable(g).astype(dtype) for g in cotangents]
        return [*(x.astype(dtype) for x in mats), tol, n_steps, *(x.astype(dtype) for x in w), *cts]


@register_fused_op
class LyapunovFixedPointLoop(_FixedPointOp):
    """Core Op ``(m,m),(m,m),(m,m),(),()->(m,m)``: (A, Q, X0, tol, n_steps) -> X; damped,
    ``(m,m),(m,m),(m,m),(),(),()->(m,m)``: (A, Q, X0, tol, n_steps, w) -> X.
    Use :func:`lyapunov_fixed_point_loop`."""

    _output_shape_from = (2,)

    @property
    def gufunc_signature(self):
        return "(m,m),(m,m),(m,m),(),()" + ",()" * len(self._w) + "->(m,m)"

    def make_node(self, A, Q, X0, tol, n_steps, *w):
        if len(w) != len(self._w):
            raise TypeError(f"{self}: expected {5 + len(self._w)} inputs, got {5 + len(w)}")
        inputs = self._inputs(A, Q, X0, tol, n_steps, *(w or [None]))
        return Apply(self, inputs, [inputs[2].type()])

    def numba_fn(self, node):
        return self._entry(node, _fixed_point_entry)

    def connection_pattern(self, node):
        return [[True], [True], [True], [True], [False]] + [[True]] * len(self._w)

    def pullback(self, inputs, outputs, cotangents):
        A, Q, X0, tol, n_steps, *w = inputs
        (G,) = cotangents
        bars = apply_batched(LyapunovFixedPointLoopGrad(self.stop, self.damping), A, Q, X0, tol, n_steps, *w, G)
        return [*bars[:3], pt.zeros_like(tol), disconnected_type(), *bars[3:]]


@register_fused_op
class LyapunovFixedPointLoopGrad(_FixedPointOp):
    """Core Op ``(m,m),(m,m),(m,m),(),(),(m,m)->(m,m),(m,m),(m,m)``: (A, Q, X0, tol, n_steps, G) ->
    (A_bar, Q_bar, X0_bar), the reverse pass of :class:`LyapunovFixedPointLoop`; damped,
    (A, Q, X0, tol, n_steps, w, G) -> (A_bar, Q_bar, X0_bar, w_bar).  Its pullback (second derivatives):
    reverse mode twice through the loop as a Scan (:func:`_loop_second_order`)."""

    @property
    def _output_shape_from(self):
        return (0, 1, 2, *([5] if self.damping else []))

    @property
    def gufunc_signature(self):
        w = len(self._w)
        return "(m,m),(m,m),(m,m),(),()" + ",()" * w + ",(m,m)->(m,m),(m,m),(m,m)" + ",()" * w

    def make_node(self, A, Q, X0, tol, n_steps, *rest):
        if len(rest) != 1 + len(self._w):
            raise TypeError(f"{self}: expected {6 + len(self._w)} inputs, got {5 + len(rest)}")
        *w, G = rest
        inputs = self._inputs(A, Q, X0, tol, n_steps, *(w or [None]), G)
        return Apply(self, inputs, [x.type() for x in (*inputs[:3], *inputs[5:5 + len(self._w)])])

    _INPUTS = (*_FixedPointOp._INPUTS, "G")

    def numba_fn(self, node):
        return self._entry(node, _fixed_point_adjoint_entry)

    def connection_pattern(self, node):
        n_out = 3 + len(self._w)
        return [[True] * n_out] * 4 + [[False] * n_out] + [[True] * n_out] * (1 + len(self._w))

    def pullback(self, inputs, outputs, cotangents):
        return _loop_second_order(self, inputs, cotangents)


@register_fused_op
class LyapunovFixedPointTrace(_FixedPointOp):
    """Core Op (A, Q, X0, tol, n_steps[, w]) -> (X, Xs, AXs, Ps): :class:`LyapunovFixedPointLoop`'s ``X`` (the
    same kernel, bit for bit) and the trace its reverse pass reads: ``Xs`` (K + 1, m, m) the iterates
    ``X_0 .. X_K``, ``AXs`` (K, m, m) each step's ``A X_k``, ``Ps`` (K, m, m) damped each step's
    ``(A X_k) A^T`` (undamped (0, m, m)), ``K`` the steps run.  Put in the graph by
    :func:`share_fixed_point_trace`; unbatched, not differentiable."""

    def make_node(self, A, Q, X0, tol, n_steps, *w):
        inputs = self._inputs(A, Q, X0, tol, n_steps, *(w or [None]))
        X = inputs[2]
        trace = pt.tensor(dtype=X.type.dtype, shape=(None, *X.type.shape))
        return Apply(self, inputs, [X.type(), trace.type(), trace.type(), trace.type()])

    def infer_shape(self, node, input_shapes):
        raise ShapeError("the trace's length is the number of steps run")  # PyTensor then reads the outputs' shapes

    def numba_fn(self, node):
        return self._entry(node, _fixed_point_trace_entry)

    def pullback(self, inputs, outputs, cotangents):
        return _not_differentiable(self, inputs)


@register_fused_op
class LyapunovFixedPointTraceGrad(_FixedPointOp):
    """Core Op (A, Q, X0, Xs, AXs, Ps[, w], G) -> (A_bar, Q_bar, X0_bar[, w_bar]):
    :class:`LyapunovFixedPointLoopGrad`'s reverse pass (the same kernel) on the trace of a
    :class:`LyapunovFixedPointTrace` instead of a second run of the loop (``X0`` gives only the type of
    ``X0_bar``).  Not differentiable."""

    @property
    def _output_shape_from(self):
        return (0, 1, 2, *([6] if self.damping else []))

    def make_node(self, A, Q, X0, Xs, AXs, Ps, *rest):
        if len(rest) != 1 + len(self._w):
            raise TypeError(f"{self}: expected {7 + len(self._w)} inputs, got {6 + len(rest)}")
        inputs = list(map(pt.as_tensor_variable, (A, Q, X0, Xs, AXs, Ps, *rest)))
        return Apply(self, inputs, [x.type() for x in (*inputs[:3], *inputs[6:6 + len(self._w)])])

    _INPUTS = ("A", "Q", "X0", "Xs", "AXs", "Ps", "w", "G")

    def numba_fn(self, node):
        return _fixed_point_trace_adjoint_entry(node.inputs[0].type.dtype, _DAMPINGS[self.damping], self.input_names)

    def pullback(self, inputs, outputs, cotangents):
        return _not_differentiable(self, inputs)


@node_rewriter([LyapunovFixedPointLoopGrad])
def share_fixed_point_trace(fgraph, node):
    """A loop's value and its gradient in one graph: the gradient reads the forward run's trace.

    :class:`LyapunovFixedPointLoopGrad` runs the loop again to keep its iterates.  Where the graph also
    computes the loop's value (a :class:`LyapunovFixedPointLoop` on the same inputs, what
    ``pytensor.grad`` of a cost of ``X`` builds), both become one :class:`LyapunovFixedPointTrace` (the same
    run, keeping the trace) and a :class:`LyapunovFixedPointTraceGrad` reading it: the same arithmetic, one
    run of the loop instead of two.  Core Ops only (a batched loop keeps its Ops); registered for the Numba
    backend (``specialize``, tags ``numba``, ``iterops``)."""
    op = node.op
    inputs = node.inputs[:-1]
    forward = LyapunovFixedPointLoop(op.stop, op.damping)
    fwd = next((c for c, _ in fgraph.clients.get(inputs[0], ())
                if c is not node and c.op == forward and list(c.inputs) == list(inputs)), None)
    if fwd is None:
        return None
    X, Xs, AXs, Ps = LyapunovFixedPointTrace(op.stop, op.damping)(*inputs)
    w = inputs[5:]
    bars = LyapunovFixedPointTraceGrad(op.stop, op.damping)(*inputs[:3], Xs, AXs, Ps, *w, node.inputs[-1])
    copy_stack_trace(fwd.outputs[0], X)
    return {fwd.outputs[0]: X, **dict(zip(node.outputs, bars))}


# registered in iterops.rewrites


def _not_differentiable(op, inputs):
    func = "smith_doubling_loop" if isinstance(op, SmithDoublingLoopGrad) else "lyapunov_fixed_point_loop"
    names = [name for name, x in zip(("A", "Q", "X0"), inputs[:3]) if x.type.ndim >= 2]
    not_twice_differentiable(op, f"iterops.linalg.{func}", names,
                             "iterops.solve_discrete_lyapunov (the same fixed point) differentiates twice.")


# ---------------------------------------------------------------------------
# Second derivatives: the loop as a Scan, differentiated twice
# ---------------------------------------------------------------------------


def _until(stop, new, old, tol):
    """The Scan's stop condition for ``stop`` (a key of :data:`_STOPS`); None for ``stop=None``."""
    d = new - old
    if stop is None:
        return None
    if stop == "fro_lt":
        return pt.sqrt(pt.sum(d * d)) < tol
    change = pt.max(pt.abs(d))
    return change < tol if stop == "max_lt" else change <= tol


def _loop_scan(stop, step, init, n_steps, non_sequences):
    """The last states of ``pytensor.scan(step, outputs_info=init, ...)`` stopping by ``stop``; ``init``
    where ``n_steps <= 0`` (where the Scan itself has no last state)."""
    def body(*args):
        states, tol = args[: len(init)], args[-1]
        new = step(*states, *args[len(init):-1])
        cond = _until(stop, new[-1], states[-1], tol)
        return list(new) if cond is None else (list(new), until(cond))

    outs = pytensor.scan(body, outputs_info=list(init), non_sequences=non_sequences, n_steps=pt.maximum(n_steps, 1),
                         return_updates=False)
    outs = outs if isinstance(outs, list | tuple) else [outs]
    return [pt.switch(n_steps > 0, o[-1], x) for o, x in zip(outs, init)]


def _doubling_graph(stop, tol, n_steps):
    def graph(A, Q):
        def step(alpha, gamma):
            return alpha @ alpha, gamma + (alpha @ gamma) @ alpha.T

        return _loop_scan(stop, step, [A, Q], n_steps, [tol])

    return graph


def _fixed_point_graph(stop, damping, tol, n_steps):
    def graph(A, Q, X0, *w):
        def step(X, A, Q, *w):
            Y = (A @ X) @ A.T + Q
            if damping == "convex":
                return [(1 - w[0]) * X + w[0] * Y]
            return [X + w[0] * (Y - X)] if damping == "increment" else [Y]

        return _loop_scan(stop, step, [X0], n_steps, [A, Q, *w, tol])

    return graph


def _loop_second_order(op, inputs, cotangents):
    """Pullback of a loop's gradient Op (inputs: the loop's inputs, ``w`` last for a damped loop, then the
    cotangents ``g`` of the loop's outputs): reverse mode twice through the loop written as a Scan
    (:func:`iterops._second_order.reverse_twice`), which runs the same steps with the same stop rule.
    Exact, not fused: what ``pytensor.hessian`` of the user's Scan costs."""
    if isinstance(op, SmithDoublingLoopGrad):
        tol, n_steps = inputs[2], inputs[3]
        x, g = list(inputs[:2]), list(inputs[4:])
        graph = _doubling_graph(op.stop, tol, n_steps)
    else:
        tol, n_steps = inputs[3], inputs[4]
        x, g = [*inputs[:3], *inputs[5:5 + len(op._w)]], list(inputs[5 + len(op._w):])
        graph = _fixed_point_graph(op.stop, op.damping, tol, n_steps)
    w = [None if isinstance(v.type, DisconnectedType) else v for v in cotangents]
    if all(v is None for v in w):
        x_bar, g_bar = [pt.zeros_like(v) for v in x], [pt.zeros_like(v) for v in g]
    else:
        x_bar, g_bar = reverse_twice(graph, x, g, w)
    if isinstance(op, SmithDoublingLoopGrad):
        return [*x_bar, pt.zeros_like(tol), disconnected_type(), *g_bar]
    return [*x_bar[:3], pt.zeros_like(tol), disconnected_type(), *x_bar[3:], *g_bar]


# ---------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------


def _check_loop_args(func, stop, tol, n_steps):
    if stop not in _STOPS:
        raise ValueError(f"{func}: stop must be one of {list(_STOPS)}, got {stop!r}")
    tol = as_tensor(func, "tol", tol)
    if tol.type.numpy_dtype.kind == "c":
        raise TypeError(f"{func}: tol must be real, got tol with dtype {tol.type.dtype}")
    n_steps = as_tensor(func, "n_steps", n_steps)
    if n_steps.type.numpy_dtype.kind not in "iu":
        raise TypeError(
            f"{func}: n_steps must be an integer, got n_steps with dtype {n_steps.type.dtype} "
            f"and shape {n_steps.type.shape}"
        )
    return tol, n_steps


def _real_matrix(func, name, x):
    x = as_tensor(func, name, x, min_ndim=2)
    if x.type.numpy_dtype.kind == "c":
        raise TypeError(f"{func}: complex {name} is not supported, got {name} with dtype {x.type.dtype}")
    check_square(func, name, x)
    return x


def _check_same_m(func, **mats):
    (name0, x0), *rest = mats.items()
    for name, x in rest:
        check_dim_match(func, name0, x0.type.shape[-1], name, x.type.shape[-1],
                        f"{name0} and {name} must have the same m (last dimension)")


def smith_doubling_loop(A, Q, tol, n_steps, stop="max_lt") -> tuple[TensorVariable, TensorVariable]:
    r"""Run Smith's doubling loop as written, in one fused kernel: ``(alpha, gamma)`` after it stops.

    ``alpha_0 = A``, ``gamma_0 = Q``; for ``k = 0 .. n_steps - 1``

    .. math::  \alpha_{k+1} = \alpha_k \alpha_k,\qquad
               \gamma_{k+1} = \gamma_k + (\alpha_k \gamma_k) \alpha_k^T ,

    stopping after the first step where ``stop(gamma_{k+1}, gamma_k, tol)``
    holds.  For a stable ``A``, ``gamma_k`` is the partial sum of the first
    ``2^k`` terms of the solution ``X = sum_j A^j Q (A^T)^j`` of
    ``A X A^T - X + Q = 0``; unlike :func:`iterops.solve_discrete_lyapunov` this
    returns what the loop returns, also when it stops early or ``A`` is not
    stable.

    Parameters
    ----------
    A : tensor, shape (..., m, m)
        Real.  ``alpha`` keeps its dtype (integers become floatX).
    Q : tensor, shape (..., m, m)
        Real.  ``gamma`` takes the upcast dtype of ``A`` and ``Q``.
    tol : scalar tensor, shape (...)
        Stopping tolerance (compared in float64).  Negative or NaN: never stops.
    n_steps : integer scalar tensor, shape (...)
        Maximum number of steps (the Scan's ``n_steps``); ``<= 0`` runs none.
    stop : {"max_lt", "max_le", "fro_lt", None}
        ``max|d| < tol``, ``max|d| <= tol``, ``||d||_F < tol`` with
        ``d = gamma_{k+1} - gamma_k``, or no stop (exactly ``n_steps`` steps).
        Leading dimensions of all arguments broadcast.

    Returns
    -------
    alpha, gamma : tensors, shape (broadcast(...), m, m)
        ``A^(2^K)`` and the ``K``-th partial sum, ``K`` the number of steps run.

    Replaces the Scan::

        def step(alpha, gamma, tol):
            new_gamma = gamma + alpha @ gamma @ alpha.T
            return (alpha @ alpha, new_gamma), until(pt.max(pt.abs(new_gamma - gamma)) < tol)
        (alphas, gammas), _ = pytensor.scan(step, outputs_info=[A, Q], non_sequences=[tol], n_steps=n_steps)
        alpha, gamma = alphas[-1], gammas[-1]

    (except that ``n_steps <= 0``, where that Scan fails to index its empty
    result, gives ``(A, Q)``).

    Failure is a value: nothing raises at run time; an unstable ``A``
    overflows to inf/NaN exactly as the loop does, and a NaN change never
    satisfies the stop, so the loop then runs all ``n_steps`` steps.

    Gradient: the exact adjoint of the steps run (module docstring), with
    respect to ``A`` and ``Q``, cotangents on either or both outputs; zero for
    ``tol``, none for ``n_steps``.  Reverse mode only; second derivatives through
    the loop as a Scan (exact, not fused).

    Examples
    --------
    >>> import numpy as np, iterops
    >>> alpha, gamma = iterops.linalg.smith_doubling_loop(0.5 * np.eye(2), np.eye(2), tol=1e-12, n_steps=2)
    >>> gamma.eval()  # two doublings: 1 + 1/4 + 1/16 + 1/64 (the sum is 4/3)
    array([[1.328125, 0.      ],
           [0.      , 1.328125]])
    """
    func = "smith_doubling_loop"
    tol, n_steps = _check_loop_args(func, stop, tol, n_steps)
    A, Q = _real_matrix(func, "A", A), _real_matrix(func, "Q", Q)
    _check_same_m(func, A=A, Q=Q)
    alpha, gamma = apply_batched(SmithDoublingLoop(stop), A, Q, tol, n_steps)
    return alpha, gamma


def lyapunov_fixed_point_loop(A, Q, X0, tol, n_steps, stop="max_lt", *, w=None,
                              damping="convex") -> TensorVariable:
    r"""Run the fixed-point Lyapunov loop as written, in one fused kernel: ``X`` after it stops.

    From ``X_0``, for ``k = 0 .. n_steps - 1``

    .. math::  X_{k+1} = (A X_k) A^T + Q ,

    or, with a damping factor ``w``, ``Y_k = (A X_k) A^T + Q`` and
    ``X_{k+1} = (1 - w) X_k + w Y_k`` (``damping="convex"``) or
    ``X_k + w (Y_k - X_k)`` (``damping="increment"``: the same in exact
    arithmetic, rounded as written), stopping after the first step where
    ``stop(X_{k+1}, X_k, tol)`` holds.
    For a stable ``A`` it converges (linearly, rate ``rho(A)^2``) to the
    solution of ``A X A^T - X + Q = 0``; this returns the iterate the loop
    stops at, also when that is not the solution (an early stop, a unit root
    that ``Q`` does not excite: that part of ``X_0`` is kept; a rotation).

    Parameters
    ----------
    A, Q, X0 : tensors, shape (..., m, m)
        Real; computed in their upcast dtype (float32 stays float32).
    tol : scalar tensor, shape (...)
        Stopping tolerance (compared in float64).  Negative or NaN: never stops.
    n_steps : integer scalar tensor, shape (...)
        Maximum number of steps (the Scan's ``n_steps``); ``<= 0`` runs none.
    stop : {"max_lt", "max_le", "fro_lt", None}
        ``max|d| < tol``, ``max|d| <= tol``, ``||d||_F < tol`` with
        ``d = X_{k+1} - X_k``, or no stop (exactly ``n_steps`` steps).
        Leading dimensions of all arguments broadcast.
    w : scalar tensor, shape (...), optional
        Damping factor (any real value: ``w = 0`` keeps ``X_0``, ``w > 1``
        over-relaxes); ``None``: the undamped loop.  Joins the upcast dtype.
    damping : {"convex", "increment"}
        How the damped update is written (see above).

    Returns
    -------
    X : tensor, shape (broadcast(...), m, m)

    Replaces the Scan::

        def step(X, A, Q, tol):
            X_new = A @ X @ A.T + Q
            return X_new, until(pt.max(pt.abs(X_new - X)) < tol)
        Xs, _ = pytensor.scan(step, outputs_info=[X0], non_sequences=[A, Q, tol], n_steps=n_steps)
        X = Xs[-1]

    (except that ``n_steps <= 0``, where that Scan fails to index its empty
    result, gives ``X0``).

    Failure is a value: nothing raises at run time; an unstable ``A``
    overflows to inf/NaN exactly as the loop does, and a NaN change never
    satisfies the stop, so the loop then runs all ``n_steps`` steps.

    The damped loop replaces the Scan whose step is
    ``X_new = (1 - w) * X + w * (A @ X @ A.T + Q)`` (or
    ``X + w * (A @ X @ A.T + Q - X)``), ``w`` a non-sequence or a constant.

    Gradient: the exact adjoint of the steps run (module docstring) with
    respect to ``A``, ``Q``, ``X0`` and ``w``; zero for ``tol``, none for
    ``n_steps``.  Reverse mode only; second derivatives through the loop as a
    Scan (exact, not fused).

    Examples
    --------
    >>> import numpy as np, iterops
    >>> X = iterops.linalg.lyapunov_fixed_point_loop(
    ...     np.diag([1.0, 0.5]), np.diag([0.0, 1.0]), 1e6 * np.eye(2), 1e-9, 1000)
    >>> X.eval().round(4)  # the unit root keeps X0's 1e6
    array([[1.0000e+06, 0.0000e+00],
           [0.0000e+00, 1.3333e+00]])
    """
    func = "lyapunov_fixed_point_loop"
    tol, n_steps = _check_loop_args(func, stop, tol, n_steps)
    A, Q, X0 = (_real_matrix(func, name, x) for name, x in (("A", A), ("Q", Q), ("X0", X0)))
    _check_same_m(func, A=A, Q=Q, X0=X0)
    if w is None:
        return apply_batched(LyapunovFixedPointLoop(stop), A, Q, X0, tol, n_steps)
    if damping not in ("convex", "increment"):
        raise ValueError(f"{func}: damping must be 'convex' or 'increment', got {damping!r}")
    w = as_tensor(func, "w", w)
    if w.type.numpy_dtype.kind not in "fiu":
        raise TypeError(f"{func}: w must be real, got w with dtype {w.type.dtype} and shape {w.type.shape}")
    return apply_batched(LyapunovFixedPointLoop(stop, damping), A, Q, X0, tol, n_steps, w)
