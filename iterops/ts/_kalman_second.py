r"""Second derivatives of :func:`iterops.ts.kalman_filter`: :class:`KalmanFilterHVP`, the pullback of its adjoint Op.

:class:`~iterops.ts.kalman.KalmanFilterGrad` computes ``u = J(x)^T g``; with a cotangent ``w`` of ``u`` its
pullback is ``x_bar = grad_x <w, J(x)^T g>`` (Hessian-vector products) and ``g_bar = J(x) w``.  Both come from
one fused kernel call, :func:`iterops.ts._kalman_hvp.hessian_vector_kernel` (forward mode over the hand-written
reverse mode; its module docstring has the equations, paths and failure value).  ``pytensor.hessian``,
PyMC's ``compile_d2logp``, pymc-extras' ``find_MAP(compute_hessian=True)`` and ``fit_laplace`` reach it
through :meth:`KalmanFilterGrad.pullback <iterops.ts.kalman.KalmanFilterGrad.pullback>`.

Shapes: :class:`KalmanFilterHVP` takes the filter's 10 inputs ``x``, the 8 output cotangents ``g`` (a
disconnected one is a zero-size placeholder; the loglik one is 0-d) and the 10 directions ``w`` (of ``x``'s
shapes); it returns the 10 ``x_bar`` (of ``x``'s shapes) and the 8 ``J w`` (each of its ``g``'s shape: a
placeholder's is empty).  Batched over leading dimensions by ``Blockwise``.  Failure: NaN where the filter
fails (``loglik = -inf``).  Third derivatives raise ``NotImplementedError``.

It replaces PyTensor's reverse mode twice through a ``pytensor.scan`` of the recursion.
"""

from __future__ import annotations

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, disconnected_type
from pytensor.graph.basic import Apply

from iterops._abi import Abi, Barrier, Struct
from iterops._fused import entry_point, register_fused_op
from iterops._second_order import not_twice_differentiable
from iterops._validate import check_shape
from iterops.ts._kalman_hvp import Tangents, hessian_vector_kernel
from iterops.ts._kalman_steps import Options, Wanted
from iterops.ts.kalman import (
    _OUT_SIG, _SKIPPABLE, COTANGENTS, FILTER_OUTPUTS, IN_SIG, INPUT_COTANGENTS, INPUT_NAMES, INPUTS, OPTIONS,
    KalmanOpBase, _own_dims, check_inputs, contiguous, cotangents_of, gradient_tuple, input_cotangents_like, inputs_of,
)

__all__ = ["KalmanFilterHVP", "adjoint_pullback"]

#: the kernel's arguments (:mod:`iterops._abi`): the filter's inputs and options, the outputs' cotangents ``g``,
#: the direction ``w``, the written ``x_bar`` and ``J w``, which of T's and Z's cotangents are read
HVP_ABI = Abi(inputs=INPUTS, options=OPTIONS, cot=COTANGENTS, direction=INPUT_COTANGENTS, grad=INPUT_COTANGENTS,
              tangent=Struct(Tangents, loglik=1, **FILTER_OUTPUTS.kinds), want=Struct(Wanted, T="b", Z="b"))
# compiled when first called (51 CPU s cold): most models never take a second derivative
_HVP = Barrier(hessian_vector_kernel, HVP_ABI, "kalman", on_demand=True)

_WHERE_W = "(the shape of the filter input it is a direction of)"


@numba.njit(cache=True)
def _check_directions(func, x, w):
    """``ValueError`` naming the direction whose shape is not its input's."""
    s, ws = x.system, w.system
    check_shape(func, "y direction", w.y, _WHERE_W, x.y.shape)
    check_shape(func, "a0 direction", w.a0, _WHERE_W, x.a0.shape)
    check_shape(func, "P0 direction", w.P0, _WHERE_W, x.P0.shape)
    check_shape(func, "c direction", ws.c, _WHERE_W, s.c.shape)
    check_shape(func, "d direction", ws.d, _WHERE_W, s.d.shape)
    check_shape(func, "T direction", ws.T, _WHERE_W, s.T.shape)
    check_shape(func, "Z direction", ws.Z, _WHERE_W, s.Z.shape)
    check_shape(func, "R direction", ws.R, _WHERE_W, s.R.shape)
    check_shape(func, "H direction", ws.H, _WHERE_W, s.H.shape)
    check_shape(func, "Q direction", ws.Q, _WHERE_W, s.Q.shape)


@numba.njit(inline="always")
def _tangents_like(g):
    """:class:`Tangents` of the shapes of the 8 output cotangents ``g`` (the loglik one (1,))."""
    e = np.empty_like
    return Tangents(np.empty(1), e(contiguous(g[1])), e(contiguous(g[2])), e(contiguous(g[3])), e(contiguous(g[4])),
                    e(contiguous(g[5])), e(contiguous(g[6])), e(contiguous(g[7])))


@entry_point
def _hvp_entry(tv: tuple, jitter: float, mv: float, use_mv: bool, unused: tuple = ()):
    """Entry point of :class:`KalmanFilterHVP` for its props: checks the shapes, runs the kernel."""
    call = _HVP.call
    want = Wanted("T" not in unused, "Z" not in unused)

    @numba.njit
    def kalman_filter_hvp_fn(*args):
        """``(10 inputs, 8 output cotangents, 10 directions) -> (10 x_bar, 8 J w)``; a shape mismatch raises."""
        func = "kalman_filter second derivative"
        x = inputs_of(args[:10])
        check_inputs(func, x, tv)
        cot = cotangents_of(func, args[10], args[11:18], x)
        w = inputs_of(args[18:28])
        _check_directions(func, x, w)
        grad, tangent = input_cotangents_like(x, 0.0), _tangents_like(args[10:18])
        call(x, Options(jitter, mv, use_mv), cot, w, grad, tangent, want)
        ll = np.empty((), dtype=np.float64)
        ll[()] = tangent.loglik[0]
        return (*gradient_tuple(grad), ll, tangent.loglik_obs, tangent.filtered_state, tangent.filtered_cov,
                tangent.predicted_state, tangent.predicted_cov, tangent.forecast_error, tangent.forecast_error_cov)

    return kalman_filter_hvp_fn


_G_SIG = tuple(_own_dims(s, f"g{i}") for i, s in enumerate(_OUT_SIG))


@register_fused_op
class KalmanFilterHVP(KalmanOpBase):
    """Pullback of :class:`~iterops.ts.kalman.KalmanFilterGrad` (module docstring): ``(x (10), g (8), w (10)) ->
    (x_bar (10), J w (8))``.  ``unused``: names among ``("T", "Z")`` whose ``x_bar`` nothing reads (set by
    :func:`iterops.ts.kalman.kalman_unused_outputs`; they come out 0)."""

    __props__ = (*KalmanOpBase.__props__, "unused")
    skips_unused = True  # as KalmanFilterGrad's
    gufunc_signature = ",".join([*IN_SIG, *_G_SIG, *IN_SIG]) + "->" + ",".join([*IN_SIG, *_G_SIG])

    def __init__(self, time_varying=(False,) * 7, cov_jitter=0.0, missing_value=None, unused=()):
        super().__init__(time_varying, cov_jitter, missing_value)
        self.unused = tuple(x for x in _SKIPPABLE if x in unused)

    def make_node(self, *inputs):
        """28 inputs (``x``, ``g``, ``w``); outputs of the types of ``x`` and ``g`` (float64)."""
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        if len(inputs) != 28:
            raise TypeError(f"KalmanFilterHVP takes 28 inputs (x, g, w), got {len(inputs)}")
        outs = [pt.tensor(dtype="float64", shape=x.type.shape) for x in inputs[:18]]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        """``x_bar`` of ``x``'s shapes, ``J w`` of ``g``'s."""
        return list(input_shapes[:18])

    def numba_fn(self, node):
        """The jitted entry point for this Op's props (:func:`_hvp_entry`)."""
        return _hvp_entry(*self._entry_args(), self.unused)

    def pullback(self, inputs, outputs, cotangents):
        """Raises ``NotImplementedError``: third derivatives of the filter are not implemented."""
        not_twice_differentiable(self, "kalman_filter", INPUT_NAMES, order=3)


def adjoint_pullback(op, inputs, cotangents):
    """Pullback of :class:`~iterops.ts.kalman.KalmanFilterGrad` ``op`` (module docstring): cotangents of its 20
    inputs ``(x (10), predicted_state, predicted_cov, g (8))`` given the cotangents ``w`` of its 10 outputs.
    ``predicted_state``/``_cov`` are functions of ``x`` already counted through ``x``: disconnected (the Op's
    ``connection_pattern``)."""
    x, g = list(inputs[:10]), list(inputs[12:20])
    connected = [not isinstance(v.type, DisconnectedType) for v in cotangents]
    if not any(connected):
        return [*(pt.zeros_like(v) for v in x), disconnected_type(), disconnected_type(), *(pt.zeros_like(v) for v in g)]
    w = [v if c else pt.zeros_like(xi) for v, c, xi in zip(cotangents, connected, x)]
    hvp = KalmanFilterHVP(op.time_varying, op.cov_jitter, op.missing_value)
    outs = hvp(*x, *g, *w, return_list=True)
    return [*outs[:10], disconnected_type(), disconnected_type(), *outs[10:]]
