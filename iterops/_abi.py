"""One C-ABI shape for the kernels behind an :class:`iterops._fused.OpaqueKernel`, generated from NamedTuples.

A kernel takes NamedTuples of arrays (of one dtype, float64 by default, unless declared) and scalars (``System``,
``FilterOutputs``, ``Cotangents``, ...).  :class:`Struct` declares one (the NamedTuple and each field's kind: an
array's ndim, or ``(ndim, dtype)`` for an array of another dtype than the :class:`Abi`'s; ``"f"``/``"i"``/``"b"``
for a float, int or bool scalar; or a nested :class:`Struct`).  :class:`Abi` lists a kernel's arguments and
generates two jitted functions from them:

* ``abi.pack(*args) -> (ptrs, dims, vals)`` on the caller's side: each array's address, its shape, each scalar;
* ``abi.unpack(ptrs, dims, vals) -> args`` inside the kernel: the same NamedTuples, arrays rebuilt with
  ``numba.carray``.

Every such kernel has the one signature :data:`SIGNATURE`, ``float64(int64*, int64*, float64*)``.  A field added
to a NamedTuple must be declared in its :class:`Struct` (a mismatch raises at import); it then crosses
the barrier with no other change.  ``abi.source`` shows the generated code.  Shapes are checked by the
caller before packing (:func:`iterops._validate.check_shape`): ``unpack`` trusts ``dims``.

:class:`Barrier` puts a jitted function of such arguments behind the barrier with no code written per kernel:
``Barrier(fn, abi, tag)`` is the :class:`iterops._fused.OpaqueKernel` running ``fn(*abi.unpack(ptrs, dims, vals))``
and, for entry points, ``call(*args)`` packing ``fn``'s arguments for it.
"""

from __future__ import annotations

import hashlib
import inspect
import types
from pathlib import Path

import numba
import numpy as np
import pytensor
from numba.extending import intrinsic
from pytensor.link.numba.cache import compile_numba_function_src

from iterops._fused import F64P, PACKAGE_DIGEST, LazyKernel, OpaqueKernel, data_ptr, keep_alive

__all__ = ["Struct", "Abi", "Barrier", "SIGNATURE", "address"]

_I64P = numba.types.CPointer(numba.types.int64)
#: the C signature of every kernel built on :class:`Abi`: ``(ptrs, dims, vals) -> float64``
SIGNATURE = numba.types.float64(_I64P, _I64P, F64P)
_SCALARS = {"f": "float({})", "i": "int({})", "b": "({} != 0.0)"}


@intrinsic
def address(typingctx, arr):
    """The address of an array's data, as an int64 (keep the array alive past its use)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(arr)(context, builder, value=args[0]).data
        return builder.ptrtoint(data, context.get_value_type(numba.types.int64))

    return numba.types.int64(arr), codegen


def _pointer_at(dtype):
    """An intrinsic ``f(addr)``: the ``dtype*`` at the int64 address ``addr`` (inverse of :func:`address`)."""
    ptr = numba.types.CPointer(numba.from_dtype(np.dtype(dtype)))

    @intrinsic
    def pointer_at(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(addr), codegen

    return pointer_at


class Struct:
    """ABI declaration of a NamedTuple class: ``Struct(System, c=2, d=2, T=3, ...)`` (every field, in order)."""

    def __init__(self, cls, **kinds):
        if tuple(kinds) != tuple(cls._fields):
            raise TypeError(f"Struct({cls.__name__}): declare every field in order, {cls._fields}; got {tuple(kinds)}")
        self.cls, self.kinds = cls, kinds


class Abi:
    """A kernel's arguments: ``Abi(inputs=INPUTS, options=OPTIONS, out=OUTPUTS)`` (names are for reading);
    ``dtype``: of every array not declared with its own (float64 unless given)."""

    def __init__(self, dtype: str = "float64", **args: Struct):
        self.args = args
        self._np = self._nd = self._nv = 0
        self.dtype, self._dtypes = dtype, set()  #: of every array, by :meth:`_emit`
        packs, unpacks = [], []
        for name, struct in args.items():
            unpacks.append(self._emit(struct, name, packs))
        self.source = (
            "def pack(" + ", ".join(args) + "):\n"
            f"    ptrs = np.empty({max(self._np, 1)}, dtype=np.int64)\n"
            f"    dims = np.empty({max(self._nd, 1)}, dtype=np.int64)\n"
            f"    vals = np.empty({max(self._nv, 1)}, dtype=np.float64)\n"
            + "".join(f"    {line}\n" for line in packs)
            + "    return ptrs, dims, vals\n\n\n"
            "def unpack(ptrs, dims, vals):\n"
            "    return (\n" + "".join(f"        {u},\n" for u in unpacks) + "    )\n"
        )
        namespace = {"__name__": __name__, "np": np, "numba": numba, "address": address}
        namespace |= {f"pointer_at_{d}": _pointer_at(d) for d in self._dtypes}
        namespace |= {s.cls.__name__: s.cls for s in self._structs(args.values())}
        # cached on disk like PyTensor's generated functions (its locator, keyed by the source): a new
        # process or a new graph loads the packer instead of compiling it (unless PyTensor's cache is off)
        cache = bool(pytensor.config.numba__cache)
        self.pack, self.unpack = (
            numba.njit(compile_numba_function_src(self.source, name, namespace,
                                                  cache_key=self._key(name, dtype) if cache else None), cache=cache)
            for name in ("pack", "unpack"))

    def _key(self, name: str, dtype: str) -> str:
        """The disk-cache key of the generated ``name``: its source, the NamedTuples' modules and ``dtype``."""
        return hashlib.sha256(f"{name} {dtype} {PACKAGE_DIGEST}\n{self.source}".encode()).hexdigest()

    def _structs(self, structs):
        for s in structs:
            yield s
            yield from self._structs(k for k in s.kinds.values() if isinstance(k, Struct))

    def _emit(self, struct: Struct, path: str, packs: list) -> str:
        """Append the packing lines of ``path`` (a ``struct``) to ``packs``; return its unpacking expression."""
        items = []
        for field, kind in struct.kinds.items():
            here = f"{path}.{field}"
            if isinstance(kind, Struct):
                items.append(self._emit(kind, here, packs))
            elif kind in _SCALARS:
                packs.append(f"vals[{self._nv}] = {here}")
                items.append(_SCALARS[kind].format(f"vals[{self._nv}]"))
                self._nv += 1
            else:
                ndim, dtype = kind if isinstance(kind, tuple) else (kind, self.dtype)
                self._dtypes.add(dtype)
                packs.append(f"ptrs[{self._np}] = address({here})")
                shape = []
                for axis in range(ndim):
                    packs.append(f"dims[{self._nd}] = {here}.shape[{axis}]")
                    shape.append(f"dims[{self._nd}]")
                    self._nd += 1
                items.append(f"numba.carray(pointer_at_{dtype}(ptrs[{self._np}]), ({', '.join(shape)},))")
                self._np += 1
        return f"{struct.cls.__name__}(" + ", ".join(items) + ")"


def _barrier(ptrs, dims, vals):
    """The function of every :class:`Barrier`: a copy of this one whose globals ``fn``, ``unpack`` are its own."""
    return float(fn(*unpack(ptrs, dims, vals)))  # noqa: F821  (globals of each copy)


class Barrier:
    """``fn``, a jitted function of the NamedTuples that ``abi`` declares returning a number, behind a C-ABI barrier.

    * ``kernel``: the :class:`iterops._fused.OpaqueKernel` (signature :data:`SIGNATURE`) whose function is a copy of
      :func:`_barrier` named ``fn``'s name and ``tag``: ``fn(*abi.unpack(ptrs, dims, vals))`` as a float64.  A copy
      per barrier, as Numba caches one cfunc per function: on disk in the package's kernel cache (stamped with
      :data:`iterops._fused.PACKAGE_DIGEST`), under its name and a hash of ``fn``'s file and of ``abi``'s
      generated code, which Numba's own stamp (the template's file) does not see; ``(fn, tag)`` names one barrier.
    * ``call``: a jitted ``call(*args) -> float`` for entry points, ``args`` as ``fn`` takes them: packed
      (:meth:`Abi.pack`), passed to the kernel, kept alive past the call.  Built on first use, which compiles the
      kernel (or loads it from the cache) and registers its symbol, as an entry point's construction must.
    * ``on_demand=True``: the kernel is a :class:`iterops._fused.LazyKernel`, compiled when first *called* and left
      out of the default warm-up (:attr:`iterops._fused.OpaqueKernel.on_demand`).
    """

    _names: dict[str, Barrier] = {}

    def __init__(self, fn, abi: Abi, tag: str, on_demand: bool = False):
        name = f"{fn.__name__}_{tag}"
        key = f"{fn.__module__}.{name}"
        if key in Barrier._names:
            raise ValueError(f"Barrier {key} is defined twice (Numba would cache both under one name)")
        Barrier._names[key] = self
        pyfunc = types.FunctionType(_barrier.__code__, {**_barrier.__globals__, "fn": fn, "unpack": abi.unpack}, name)
        source = Path(inspect.getsourcefile(getattr(fn, "py_func", fn))).read_bytes() + abi.source.encode()
        pyfunc.__qualname__ = f"{key}_{hashlib.sha256(source).hexdigest()[:16]}"  # names the cache file
        pyfunc.__module__ = fn.__module__
        # its arrays' dtypes (the C signature's addresses do not show them): float64-only when they all are
        kind = LazyKernel if on_demand else OpaqueKernel
        self.abi, self.kernel = abi, kind(SIGNATURE, pyfunc, dtype=" ".join(sorted(abi._dtypes)) or abi.dtype)
        self.kernel.on_demand = on_demand
        self._call = None

    @property
    def call(self):
        if self._call is None:
            external, pack = self.kernel.external, self.abi.pack

            @numba.njit
            def call(*args):
                ptrs, dims, vals = pack(*args)
                r = external(data_ptr(ptrs), data_ptr(dims), data_ptr(vals))
                keep_alive((args, ptrs, dims, vals))
                return r

            self._call = call
        return self._call

