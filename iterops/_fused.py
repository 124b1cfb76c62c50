"""The fused-loop Op pattern shared by every iterops Op.

Each algorithm lives in one module holding

* a **kernel**: a plain NumPy-subset function jitted once with ``numba.njit``
  (``cache=True``).  It is the single implementation of the algorithm.  It
  never raises: failure is a value (NaN, ``-inf``) so that samplers reject the
  point;
* a **core Op** on core dimensions (``gufunc_signature``, ``__props__``,
  ``infer_shape``) deriving from :class:`FusedOp`.  Its :meth:`FusedOp.numba_fn`
  returns a jitted entry point (casts + kernel call) which is what ``perform``
  calls *and* what PyTensor's Numba backend inlines, so both run the same
  machine code;
* a gradient written with public functions (``pullback`` / ``pushforward``);
* a lowercase public function that validates shapes and dtypes at graph-build
  time and wraps the core Op in ``Blockwise`` for leading batch dimensions.

:func:`register_fused_op` registers the Op with PyTensor's Numba dispatch
(with a props-based cache key, so compiled graphs are cached on disk).  Without
that registration the Numba linker falls back to object mode.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from functools import cache

import llvmlite.binding
import numba
import numpy as np
from numba.extending import intrinsic
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.utils import _parse_gufunc_signature

__all__ = [
    "FusedOp", "apply_batched", "register_fused_op", "entry_point", "data_ptr", "keep_alive", "F64P", "OpaqueKernel",
    "opaque_kernel",
]

#: ``double*`` in a ``numba.cfunc`` signature (see :func:`data_ptr`).
F64P = numba.types.CPointer(numba.types.float64)


class OpaqueKernel:
    """A kernel behind a C-ABI barrier: ``numba.cfunc(signature, cache=True)`` compiled on first use,
    its address registered with LLVM under a symbol named after the module's source hash, and
    called from jitted code as ``numba.types.ExternalFunction`` (:attr:`external`).

    Why: a jitted function that calls another jitted function links the callee's IR into its own
    module and optimizes and code-generates it again.  For a large kernel (the Kalman adjoint) that
    costs tens of seconds for *every* new PyTensor graph that uses the Op.  A call through a symbol
    is opaque, so a new graph compiles only its glue, and the glue stays cacheable on disk (an
    embedded address would not be).  The cfunc rebuilds arrays from :func:`data_ptr` pointers with
    ``numba.carray``.  The symbol is registered when an Op's ``numba_fn`` builds its entry point,
    which PyTensor does for every node before it loads a cached graph, so cached graphs resolve it.
    """

    def __init__(self, signature, pyfunc, tag: str = ""):
        self.signature = signature
        self.pyfunc = pyfunc
        src = inspect.getsource(sys.modules[pyfunc.__module__])
        digest = hashlib.sha256(src.encode()).hexdigest()[:16]
        name = f"{pyfunc.__module__}.{pyfunc.__name__}{tag}".replace(".", "_")
        self.symbol = f"iterops_{name}_{digest}"  # ``tag``: one pyfunc, several signatures

    @property
    def external(self):
        return _register_opaque(self)


@cache
def _register_opaque(kernel: OpaqueKernel):
    compiled = numba.cfunc(kernel.signature, cache=True)(kernel.pyfunc)
    llvmlite.binding.add_symbol(kernel.symbol, compiled.address)
    return numba.types.ExternalFunction(kernel.symbol, kernel.signature)


def opaque_kernel(signature):
    """Decorator: ``@opaque_kernel(sig)`` turns a function into an :class:`OpaqueKernel`."""
    return lambda pyfunc: OpaqueKernel(signature, pyfunc)


@intrinsic
def keep_alive(typingctx, arrays):
    """No-op use of a tuple of arrays.  Call it after an :class:`OpaqueKernel` call with every
    array whose :func:`data_ptr` was passed: Numba frees an array after its last use, and a raw
    pointer does not count as one, so without this a temporary (a contiguous copy, a dummy) could be
    freed before the kernel reads it."""
    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return numba.types.none(arrays), codegen


@intrinsic
def data_ptr(typingctx, arr):
    """Pointer to the data of a C-contiguous array, to pass it to an :class:`OpaqueKernel`
    (keep the array alive past the call with :func:`keep_alive`)."""
    sig = numba.types.CPointer(arr.dtype)(arr)

    def codegen(context, builder, signature, args):
        return context.make_array(arr)(context, builder, value=args[0]).data

    return sig, codegen


class FusedOp(Op):
    """Base class of iterops' fused-loop core Ops.

    Subclasses implement ``make_node``, ``infer_shape``, ``pullback`` and
    :meth:`numba_fn`; ``perform`` is inherited.
    """

    #: bump when a kernel's semantics change, to invalidate on-disk caches
    kernel_version: int = 1

    def numba_fn(self, node: Apply):
        """Return the jitted callable ``f(*inputs) -> output | tuple(outputs)``.

        Must return arrays of exactly the node's output dtypes and ndims.
        Implementations memoize on (props, dtypes) via :func:`entry_point`.
        """
        raise NotImplementedError

    def perform(self, node, inputs, output_storage):
        fn = self.numba_fn(node)
        result = fn(*inputs)
        if len(node.outputs) == 1:
            result = (result,)
        for storage, value, out in zip(output_storage, result, node.outputs):
            storage[0] = np.asarray(value, dtype=out.type.dtype)


def apply_batched(op: Op, *inputs):
    """Apply core ``op``; through ``Blockwise`` only when some input has batch dimensions.

    Unbatched calls keep the core Op in the graph, so its own ``pushforward``
    is used by forward-mode autodiff (``Blockwise`` has no pushforward in
    PyTensor 3.3; batched forward mode goes through PyTensor's default
    double-pullback, which uses our ``pullback``).
    """
    in_sig, _ = _parse_gufunc_signature(op.gufunc_signature)
    if all(x.type.ndim == len(sig) for x, sig in zip(inputs, in_sig)):
        return op(*inputs)
    return Blockwise(op)(*inputs)


def register_fused_op(op_type):
    """Class decorator: register ``op_type`` with PyTensor's Numba backend."""

    # PyTensor caches compiled graphs on disk keyed by the Op's props and this
    # integer.  Hashing the defining module's source means an edited kernel is
    # never served stale from the cache (no manual version bumps needed).
    source = inspect.getsource(sys.modules[op_type.__module__])
    source_key = int(hashlib.sha256(source.encode()).hexdigest()[:12], 16)

    @register_funcify_default_op_cache_key(op_type)
    def _numba_funcify(op, node=None, **kwargs):
        return op.numba_fn(node), source_key + op.kernel_version

    return op_type


def entry_point(builder):
    """Memoize a factory of jitted entry points on its (hashable) arguments.

    ``builder(*static_args)`` returns a ``numba.njit`` function.  Entry points
    are thin: they cast inputs to the working precision, call the module's
    kernel and cast back, so compiling them is cheap while the kernel itself
    is cached on disk.
    """
    return cache(builder)


def dtype_name(var) -> str:
    return var.type.dtype if hasattr(var, "type") else np.dtype(var).name
