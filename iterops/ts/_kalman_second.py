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
from pytensor.graph.rewriting.basic import copy_stack_trace, node_rewriter
from pytensor.graph.traversal import ancestors
from pytensor.tensor.blockwise import Blockwise

from iterops._abi import Abi, Barrier, Struct
from iterops._fused import entry_point, register_fused_op
from iterops._second_order import not_twice_differentiable
from iterops._validate import check_shape
from iterops.ts._kalman_adjoint import InputCotangents
from iterops.ts._kalman_hvp import SecondWanted, Tangents, hessian_vector_kernel
from iterops.ts._kalman_steps import Options, System
from iterops.ts.kalman import (
    _OUT_SIG, _SKIPPABLE, COTANGENTS, FILTER_OUTPUTS, IN_SIG, INPUT_COTANGENTS, INPUT_NAMES, INPUTS, OPTIONS,
    KalmanFilterGrad, KalmanOpBase, _own_dims, check_inputs, contiguous, cotangents_of, gradient_tuple,
    input_cotangents_like, inputs_of,
)

__all__ = ["KalmanFilterHVP", "adjoint_pullback", "gradient_from_hvp"]

#: the kernel's arguments (:mod:`iterops._abi`): the filter's inputs and options, the outputs' cotangents ``g``,
#: the direction ``w``, the written ``x_bar`` and ``J w``, which of T's and Z's cotangents are read
HVP_ABI = Abi(inputs=INPUTS, options=OPTIONS, cot=COTANGENTS, direction=INPUT_COTANGENTS, grad=INPUT_COTANGENTS,
              tangent=Struct(Tangents, loglik=1, **FILTER_OUTPUTS.kinds), value=INPUT_COTANGENTS,
              want=Struct(SecondWanted, T="b", Z="b", value="b"))
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


@numba.njit(cache=True)
def _no_cotangents(x, fill):
    """Empty :class:`InputCotangents` (the first-order gradient not asked for)."""
    e2, e3 = np.empty((0, 0)), np.empty((0, 0, 0))
    return InputCotangents(e2, np.empty(0), e2, System(e2, e2, e3, e3, e3, e3, e3))


@numba.njit(cache=True)
def _with_value(second, value):
    """The outputs of :class:`KalmanFilterHVP` with ``with_gradient``: ``second`` (18), then ``value`` (10)."""
    return (*second, *gradient_tuple(value))


@numba.njit(cache=True)
def _without_value(second, value):
    """The outputs of :class:`KalmanFilterHVP`: ``second`` (18)."""
    return second


@entry_point
def _hvp_entry(tv: tuple, jitter: float, mv: float, use_mv: bool, unused: tuple = (), with_gradient: bool = False):
    """Entry point of :class:`KalmanFilterHVP` for its props: checks the shapes, runs the kernel."""
    call = _HVP.call
    want = SecondWanted("T" not in unused, "Z" not in unused, with_gradient)
    value_like, finish = (input_cotangents_like, _with_value) if with_gradient else (_no_cotangents, _without_value)

    @numba.njit
    def kalman_filter_hvp_fn(*args):
        """``(10 inputs, 8 output cotangents, 10 directions) -> (10 x_bar, 8 J w[, 10 J^T g])``; a shape mismatch
        raises."""
        func = "kalman_filter second derivative"
        x = inputs_of(args[:10])
        check_inputs(func, x, tv)
        cot = cotangents_of(func, args[10], args[11:18], x)
        w = inputs_of(args[18:28])
        _check_directions(func, x, w)
        grad, tangent = input_cotangents_like(x, 0.0), _tangents_like(args[10:18])
        value = value_like(x, 0.0)
        call(x, Options(jitter, mv, use_mv), cot, w, grad, tangent, value, want)
        ll = np.empty((), dtype=np.float64)
        ll[()] = tangent.loglik[0]
        return finish((*gradient_tuple(grad), ll, tangent.loglik_obs, tangent.filtered_state, tangent.filtered_cov,
                       tangent.predicted_state, tangent.predicted_cov, tangent.forecast_error,
                       tangent.forecast_error_cov), value)

    return kalman_filter_hvp_fn


_G_SIG = tuple(_own_dims(s, f"g{i}") for i, s in enumerate(_OUT_SIG))


_SIGNATURE = ",".join([*IN_SIG, *_G_SIG, *IN_SIG]) + "->" + ",".join([*IN_SIG, *_G_SIG])


@register_fused_op
class KalmanFilterHVP(KalmanOpBase):
    """Pullback of :class:`~iterops.ts.kalman.KalmanFilterGrad` (module docstring): ``(x (10), g (8), w (10)) ->
    (x_bar (10), J w (8))``.  ``unused``: names among ``("T", "Z")`` whose ``x_bar`` nothing reads (set by
    :func:`iterops.ts.kalman.kalman_unused_outputs`; they come out 0).  ``with_gradient``: 10 more outputs, the
    first-order gradient ``J(x)^T g`` (what :class:`~iterops.ts.kalman.KalmanFilterGrad` of the same ``x``, ``g``
    computes; set by :func:`gradient_from_hvp`)."""

    __props__ = (*KalmanOpBase.__props__, "unused", "with_gradient")
    skips_unused = True  # as KalmanFilterGrad's

    def __init__(self, time_varying=(False,) * 7, cov_jitter=0.0, missing_value=None, unused=(),
                 with_gradient=False):
        super().__init__(time_varying, cov_jitter, missing_value)
        self.unused = tuple(x for x in _SKIPPABLE if x in unused)
        self.with_gradient = bool(with_gradient)

    @property
    def gufunc_signature(self):
        """``x, g, w -> x_bar, J w`` (then the gradient, of ``x``'s core shapes, ``with_gradient``)."""
        return _SIGNATURE + ("," + ",".join(IN_SIG) if self.with_gradient else "")

    def outputs_of(self, name):
        """Indices of the outputs that are cotangents of the input ``name`` (``x_bar``, and the gradient's)."""
        k = INPUT_NAMES.index(name)
        return (k, 18 + k) if self.with_gradient else (k,)

    def make_node(self, *inputs):
        """28 inputs (``x``, ``g``, ``w``); outputs of the types of ``x`` and ``g`` (float64), then ``x``'s again
        (``with_gradient``)."""
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        if len(inputs) != 28:
            raise TypeError(f"KalmanFilterHVP takes 28 inputs (x, g, w), got {len(inputs)}")
        like = inputs[:18] + (inputs[:10] if self.with_gradient else [])
        outs = [pt.tensor(dtype="float64", shape=x.type.shape) for x in like]
        return Apply(self, inputs, outs)

    def infer_shape(self, node, input_shapes):
        """``x_bar`` of ``x``'s shapes, ``J w`` of ``g``'s, the gradient of ``x``'s."""
        return list(input_shapes[:18]) + (list(input_shapes[:10]) if self.with_gradient else [])

    def numba_fn(self, node):
        """The jitted entry point for this Op's props (:func:`_hvp_entry`)."""
        return _hvp_entry(*self._entry_args(), self.unused, self.with_gradient)

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


@node_rewriter([Blockwise, KalmanFilterHVP])
def gradient_from_hvp(fgraph, node):
    """A graph that holds :class:`~iterops.ts.kalman.KalmanFilterGrad` ``u = J(x)^T g`` and its pullback
    :class:`KalmanFilterHVP` on the same ``x``, ``g`` (a Hessian-vector product of a transformed model: PyMC's
    and pymc-extras' ``hessp``, ``compile_d2logp``) runs one kernel: the HVP kernel's real part is ``u``
    (:mod:`iterops.ts._kalman_hvp`), so its ``with_gradient`` form replaces both, and the filter pass that fed the
    adjoint Op (``predicted_state``, ``predicted_cov``) goes too when nothing else reads it.  ``u`` is then the
    gradient of the recursion run in full (every step, the multivariate update), equal to the adjoint Op's to
    rounding.  Left alone: a batched pair (``Blockwise`` with a batch dimension not statically 1), and a direction
    ``w`` computed from ``u`` (the merged node would depend on itself)."""
    hvp = _unbatched_core(node)
    if not isinstance(hvp, KalmanFilterHVP) or hvp.with_gradient:
        return None
    x, g = node.inputs[:10], node.inputs[10:18]
    props = _props(hvp)
    adjoints = [c for c, _ in fgraph.clients[x[0]]
                if isinstance(_unbatched_core(c), KalmanFilterGrad) and c.inputs[:10] == x and c.inputs[12:20] == g
                and _props(_unbatched_core(c)) == props]
    if not adjoints or set(adjoints[0].outputs) & set(ancestors(node.inputs[18:])):
        return None
    adjoint = adjoints[0]
    unused = tuple(set(hvp.unused) & set(_unbatched_core(adjoint).unused))
    merged = KalmanFilterHVP(*props, unused, with_gradient=True)
    outs = (Blockwise(merged) if isinstance(node.op, Blockwise) else merged)(*node.inputs, return_list=True)
    old = [*node.outputs, *adjoint.outputs]
    if any(o.type != n.type for o, n in zip(old, outs)):
        return None
    copy_stack_trace(node.outputs, outs[:18])
    copy_stack_trace(adjoint.outputs, outs[18:])
    return dict(zip(old, outs))


def _props(op):
    """The options two Kalman Ops must share to run on one kernel."""
    return op.time_varying, op.cov_jitter, op.missing_value


def _unbatched_core(node):
    """``node``'s Op, or its ``Blockwise``'s core Op when every input's batch dimensions are statically 1."""
    if not isinstance(node.op, Blockwise):
        return node.op
    for x, sig in zip(node.inputs, node.op.inputs_sig):
        if any(d != 1 for d in x.type.shape[:x.type.ndim - len(sig)]):
            return None
    return node.op.core_op
