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

Cache keys cover every source a kernel depends on.  A kernel calls helpers from
other modules (the smoother calls the filter's), so keying a compiled kernel on
its own module would serve a stale helper after an edit.  :data:`PACKAGE_DIGEST`
hashes all kernel-bearing modules (:data:`KERNEL_SOURCES`) once at import; it is
part of PyTensor's cache key of every fused Op, of every :class:`OpaqueKernel`
symbol, and of the freshness stamp of Numba's on-disk cache (``cache=True``) for
every function defined in the package (:class:`PackageCacheLocator`).  Editing
any of those modules recompiles what depends on them; nothing is bumped by hand.

Op options are cache keys too (:func:`entry_point` memoizes on them, PyTensor
merges equal Ops), so they must be hashable and equal to themselves: an Op's
constructor turns an option that could be NaN into ``None`` (``missing_value``).
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import logging
import os
import sys
import threading
from functools import cache
from pathlib import Path

import llvmlite.binding
import numba
import numpy as np
import pytensor.tensor as pt
from llvmlite import ir
from numba.core.caching import CacheImpl, _CacheLocator
from numba.core.imputils import impl_ret_borrowed
from numba.core.typing.ctypes_utils import to_ctypes
from numba.extending import intrinsic, overload
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.utils import _parse_gufunc_signature

from iterops import _background
from iterops._validate import float_dtype

__all__ = [
    "FusedOp", "apply_batched", "register_fused_op", "entry_point", "data_ptr", "keep_alive", "as_dtype", "F64P",
    "OpaqueKernel",
    "opaque_kernel", "LazyKernel", "PACKAGE_DIGEST", "KERNEL_SOURCES", "PackageCacheLocator", "OPAQUE_KERNELS",
]

#: ``double*`` in a ``numba.cfunc`` signature (see :func:`data_ptr`).
F64P = numba.types.CPointer(numba.types.float64)

# ---------------------------------------------------------------------------
# Cache keys that cover every source a kernel depends on
# ---------------------------------------------------------------------------

_PACKAGE_DIR = Path(__file__).resolve().parent

#: Globs, relative to the package directory, of every module holding kernels or helpers that
#: kernels call (this module, ``_*.py`` helper modules, ``linalg/``, ``ts/``).  A new directory
#: of kernels must be added here.
KERNEL_SOURCES = ("_*.py", "linalg/*.py", "ts/*.py")


def package_digest(root: Path = _PACKAGE_DIR, patterns=KERNEL_SOURCES) -> str:
    """sha256 over the relative paths and bytes of the files matching ``patterns`` under ``root``."""
    h = hashlib.sha256()
    for path in sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()}):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


#: Digest of every kernel-bearing source of the package, computed once at import.
PACKAGE_DIGEST = package_digest()


def kernel_cache_dir() -> Path | None:
    """Where Numba caches iterops' compiled kernels when ``NUMBA_CACHE_DIR`` is not set.

    ``<checkout>/.cache/numba`` when iterops runs from a source checkout (the folder ``scripts/dev``
    uses); otherwise the user cache folder: ``$XDG_CACHE_HOME/iterops/numba`` (default
    ``~/.cache/iterops/numba``), ``~/Library/Caches/iterops/numba`` on macOS,
    ``%LOCALAPPDATA%\\iterops\\numba`` on Windows.  ``ITEROPS_CACHE_DIR`` overrides both.
    """
    if os.environ.get("ITEROPS_CACHE_DIR"):
        return Path(os.environ["ITEROPS_CACHE_DIR"]).expanduser()
    checkout = _PACKAGE_DIR.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "iterops" / "__init__.py").is_file():
        return checkout / ".cache" / "numba"
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "iterops" / "numba"


class PackageCacheLocator(_CacheLocator):
    """Numba on-disk cache locator for functions defined in this package.

    Numba stamps a function's cache index with a hash of the file that defines it and
    reloads the cached machine code while that stamp matches, so a kernel whose helper lives in
    another module kept running the old helper after an edit (numba issue #1833).  This
    locator keeps Numba's disambiguator (it wraps the locator Numba would have chosen) and adds
    :data:`PACKAGE_DIGEST` to the stamp: editing any kernel-bearing module makes every cached
    iterops function stale, so it is recompiled and its index rewritten.

    Location: ``NUMBA_CACHE_DIR`` when the user set it (Numba's own locator); otherwise
    :func:`kernel_cache_dir`, with the same sub-folder layout, so ``python script.py``,
    ``pytest``, notebooks and ``scripts/dev`` (which sets ``NUMBA_CACHE_DIR`` to the checkout's
    ``.cache/numba``) share one cache.  If that folder is not writable, Numba's default
    (``__pycache__``, then its user-wide folder) is used.
    """

    def __init__(self, inner: _CacheLocator, cache_path: str | None = None):
        self._inner = inner
        self._cache_path = cache_path

    def get_cache_path(self):
        return self._cache_path or self._inner.get_cache_path()

    def get_source_stamp(self):
        return (self._inner.get_source_stamp(), PACKAGE_DIGEST)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @property
    def _py_file(self):
        """The defining file, which Numba reads off the locator to warn where a function cannot be cached."""
        return self._inner._py_file

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file)
        if not path.is_file() or not path.resolve().is_relative_to(_PACKAGE_DIR):  # also "<string>"
            return None
        for other in CacheImpl._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    break
        else:
            return None
        root = None if numba.core.config.CACHE_DIR else kernel_cache_dir()
        if root is not None:
            self = cls(inner, os.path.join(root, cls.get_suitable_cache_subpath(py_file)))
            try:
                self.ensure_cache_path()
                return self
            except OSError:
                pass
        return cls(inner)


if not any(c.__name__ == PackageCacheLocator.__name__ and c.__module__ == __name__
           for c in CacheImpl._locator_classes):
    CacheImpl._locator_classes.insert(0, PackageCacheLocator)


class OpaqueKernel:
    """A kernel behind a C-ABI barrier: ``numba.cfunc(signature, cache=True)`` compiled on first use,
    its address registered with LLVM under a symbol named after :data:`PACKAGE_DIGEST`, and
    called from jitted code as ``numba.types.ExternalFunction`` (:attr:`external`).

    Why: a jitted function that calls another jitted function links the callee's IR into its own
    module and optimizes and code-generates it again.  For a large kernel (the Kalman adjoint) that
    costs tens of seconds for *every* new PyTensor graph that uses the Op.  A call through a symbol
    is opaque, so a new graph compiles only its glue, and the glue stays cacheable on disk (an
    embedded address would not be).  The cfunc rebuilds arrays from :func:`data_ptr` pointers with
    ``numba.carray``.  The symbol is registered when an Op's ``numba_fn`` builds its entry point,
    which PyTensor does for every node before it loads a cached graph, so cached graphs resolve it.
    """

    #: ``module.function`` names of the kernels a graph using this one nearly always needs too (the Kalman
    #: filter's adjoint): when this kernel is not cached, they are compiled in a background process while
    #: this one compiles here (:func:`_compile_companions`), so a first use on a machine with two cores
    #: waits for the longer of the two compiles, not for their sum.
    companions: tuple[str, ...] = ()
    #: After the kernel was compiled or loaded in this process: whether its machine code came from the
    #: on-disk cache (``None`` before).
    from_cache: bool | None = None
    #: Compiled on first use, not by ``python -m iterops.warmup`` without ``--all-dtypes``: a kernel most
    #: models never reach (the Kalman filter's second derivatives), whose compile a deployment need not pay.
    on_demand: bool = False

    def __init__(self, signature, pyfunc, tag: str = "", dtype: str = "float64"):
        self.signature = signature
        self.pyfunc = pyfunc
        #: the dtype of its arrays: for a kernel on :data:`iterops._abi.SIGNATURE`, its :class:`~iterops._abi.Abi`'s
        #: (the signature's pointers do not show it)
        self.dtype = dtype
        name = f"{pyfunc.__module__}.{pyfunc.__name__}{tag}".replace(".", "_")
        self.name = f"{pyfunc.__module__}.{pyfunc.__name__}{tag}"
        # the digest covers every module the kernel may call into; ``tag``: one pyfunc, several signatures
        self.symbol = f"iterops_{name}_{PACKAGE_DIGEST[:16]}"
        OPAQUE_KERNELS.append(self)

    @property
    def external(self):
        return _register_opaque(self)

    @property
    def float64_only(self) -> bool:
        """True when :attr:`dtype` is float64 and every pointer argument is float64 or int64 (the kernels PyMC
        models reach by default; float32 and complex variants are compiled when first used)."""
        ok = {numba.types.float64, numba.types.int64}
        pointers = (a for a in self.signature.args if isinstance(a, numba.types.CPointer))
        return self.dtype == "float64" and all(a.dtype in ok for a in pointers)

    def _cfunc(self):
        from numba.core.ccallback import CFunc
        from numba.core.sigutils import normalize_signature

        cfunc = CFunc(self.pyfunc, normalize_signature(self.signature), locals={}, options={})
        cfunc.enable_caching()
        return cfunc

    def compile(self) -> None:
        """Compile the kernel now (or load it from the on-disk cache) and register it."""
        self.external  # noqa: B018

    def is_cached(self) -> bool:
        """Whether Numba's on-disk cache holds this kernel's machine code for the current sources
        (then loading it takes milliseconds; otherwise the first use compiles it)."""
        try:
            cfunc = self._cfunc()
            key = cfunc._cache._index_key(cfunc._sig, cfunc._targetdescr.target_context.codegen())
            return key in cfunc._cache._cache_file._load_index()
        except Exception:  # a Numba internal changed: assume cached, say nothing
            return True


#: Every :class:`OpaqueKernel` defined by the package (``iterops.warmup`` compiles them all).
OPAQUE_KERNELS: list[OpaqueKernel] = []

_log = logging.getLogger("iterops")
_first_compile_said = False


def _say_first_compile(kernel: OpaqueKernel) -> None:
    """One line per process, before the first kernel that is not in the on-disk cache compiles."""
    global _first_compile_said
    if _first_compile_said:
        return
    _first_compile_said = True
    where = numba.core.config.CACHE_DIR or kernel_cache_dir()
    _log.warning(
        "iterops: compiling Numba kernels for first use on this machine (%s first; up to about a minute "
        "per kernel family, once: cached in %s). `python -m iterops.warmup` compiles them all ahead of time.",
        kernel.name, where,
    )


def _compile_companions(kernel: OpaqueKernel) -> None:
    """Start compiling ``kernel.companions`` that are not cached in a background process
    (:mod:`iterops._background`; not when it is switched off)."""
    if not kernel.companions or not _background.enabled:
        return
    known = {f"{k.pyfunc.__module__}.{k.pyfunc.__name__}": k for k in OPAQUE_KERNELS if k.float64_only}
    todo = sorted(name for name in kernel.companions if name in known and not known[name].is_cached())
    try:
        _background.start(todo, str(_PACKAGE_DIR.parent))
    except Exception:  # never let a background convenience stop a compile
        _log.exception("iterops: could not start a background compile")


@cache
def _register_opaque(kernel: OpaqueKernel):
    _background.wait()
    cfunc = kernel._cfunc()
    if not kernel.is_cached():
        _say_first_compile(kernel)
        _compile_companions(kernel)
    cfunc.compile()
    kernel.from_cache = cfunc._cache_hits > 0
    llvmlite.binding.add_symbol(kernel.symbol, cfunc.address)
    return numba.types.ExternalFunction(kernel.symbol, kernel.signature)


class LazyKernel(OpaqueKernel):
    """An :class:`OpaqueKernel` compiled when it is first *called*, not when code calling it compiles.

    For a rarely needed path of a kernel (the Lyapunov solver's Schur fallback, taken only when
    the doubling iteration fails): code that calls it compiles no faster or slower than code
    calling an :class:`OpaqueKernel`, but nobody pays the fallback's own compile until some input
    needs it.  Results are those of the same function behind an :class:`OpaqueKernel`.

    Mechanism: :attr:`external` is an intrinsic that loads the kernel's address from a
    pointer-sized cell, an external *data* symbol named after :data:`PACKAGE_DIGEST` (so the
    calling code stays cacheable on disk, like a call through an :class:`OpaqueKernel` symbol),
    and calls it.  The cell starts out holding a ctypes callback: the first call runs it, it
    compiles the ``numba.cfunc`` (or loads it from the on-disk cache, announced like any first
    compile), writes the cfunc's address into the cell and forwards the call; every later call
    goes straight to the machine code.  The callback takes the GIL (ctypes does), so a first call
    from a thread that does not hold it (nutpie's) works too; if compiling fails the callback
    returns 0, which a caller must treat as failure (a kernel's "not solved": NaN, never a crash).
    Only pointer, integer and float arguments and an integer or float result are supported.
    """

    def __init__(self, signature, pyfunc, tag: str = "", dtype: str = "float64"):
        super().__init__(signature, pyfunc, tag, dtype)
        self._lock = threading.Lock()
        self._compiled = None
        c_args = [ctypes.c_void_p if isinstance(a, numba.types.CPointer) else to_ctypes(a) for a in signature.args]
        self._c_type = ctypes.CFUNCTYPE(to_ctypes(signature.return_type), *c_args)
        self._trampoline = self._c_type(self._first_call)  # kept alive with the kernel
        self._cell = ctypes.c_void_p(ctypes.cast(self._trampoline, ctypes.c_void_p).value)
        self.cell_symbol = self.symbol + "_cell"
        llvmlite.binding.add_symbol(self.cell_symbol, ctypes.addressof(self._cell))
        self._external = _indirect_call(self.cell_symbol, signature)

    @property
    def external(self):
        return self._external

    def compile(self) -> None:
        with self._lock:
            if self._compiled is None:
                _background.wait()
                cfunc = self._cfunc()
                if not self.is_cached():
                    _say_first_compile(self)
                cfunc.compile()
                self.from_cache = cfunc._cache_hits > 0
                self._compiled = (cfunc, self._c_type(cfunc.address))
                self._cell.value = cfunc.address

    def _first_call(self, *args):
        try:
            self.compile()
        except Exception:  # failure is a value: the caller reads 0 as "not solved"
            _log.exception("iterops: compiling %s failed", self.name)
            return 0
        return self._compiled[1](*args)


def _indirect_call(cell_symbol: str, signature):
    """An intrinsic ``f(*args)`` calling, with the C ABI and ``signature``, the function whose
    address is stored at the external data symbol ``cell_symbol``."""
    params = ", ".join(f"a{i}" for i in range(len(signature.args)))

    def codegen(context, builder, sig, args):
        mod = builder.module
        fnty = ir.FunctionType(context.get_value_type(signature.return_type),
                               [context.get_value_type(a) for a in signature.args])
        cell = mod.globals.get(cell_symbol)
        if cell is None:
            cell = ir.GlobalVariable(mod, fnty.as_pointer(), name=cell_symbol)
            cell.linkage = "external"
        return builder.call(builder.load(cell), args)

    def typer(typingctx, *argtys):
        return signature, codegen

    namespace = {"typer": typer}
    exec(f"def call(typingctx, {params}):\n    return typer(typingctx, {params})", namespace)
    return intrinsic(namespace["call"])


def opaque_kernel(signature, dtype: str = "float64"):
    """Decorator: ``@opaque_kernel(sig)`` turns a function into an :class:`OpaqueKernel` (of ``dtype`` arrays)."""
    return lambda pyfunc: OpaqueKernel(signature, pyfunc, dtype=dtype)


@intrinsic
def keep_alive(typingctx, arrays):
    """No-op use of a tuple of arrays.  Call it after an :class:`OpaqueKernel` call with every
    array whose :func:`data_ptr` was passed: Numba frees an array after its last use, and a raw
    pointer does not count as one, so without this a temporary (a contiguous copy, a dummy) could be
    freed before the kernel reads it."""
    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return numba.types.none(arrays), codegen


def as_dtype(x, dtype):
    """``np.ascontiguousarray(x).astype(dtype)`` for an entry point's inputs, without the copy when ``x`` already
    has that dtype (then a C-contiguous ``x`` is returned itself: only for arrays the kernel reads, never writes).
    ``dtype``: a NumPy scalar type (``np.float64``).  In Numba the choice is made when the call is typed."""
    return np.ascontiguousarray(x).astype(dtype)


@overload(as_dtype)
def _as_dtype(x, dtype):
    if isinstance(dtype, numba.types.NumberClass) and x.dtype == dtype.instance_type:
        return lambda x, dtype: np.ascontiguousarray(x)
    return lambda x, dtype: np.ascontiguousarray(x).astype(dtype)


@intrinsic
def writable(typingctx, arr):
    """``arr`` typed as writable (no copy): a read-only input (a graph constant) then shares the entry
    point's compiled specialisation with a writable one.  Kernels never write their inputs."""
    sig = arr.copy(readonly=False)(arr)

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, signature.return_type, args[0])

    return sig, codegen


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
    :meth:`numba_fn`; ``perform`` is inherited.  Ops are equal when their props are (a
    constructor normalises an option that could be NaN, so that props equal themselves).
    """

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


class FirstInputShaped(FusedOp):
    """A :class:`FusedOp` with one output of its first input's shape, in the inputs' floating dtype
    (a gradient with respect to the first input, an elementwise map)."""

    def make_node(self, *inputs):
        inputs = [pt.as_tensor_variable(x) for x in inputs]
        return Apply(self, inputs, [pt.tensor(dtype=float_dtype(inputs[0]), shape=inputs[0].type.shape)])

    def infer_shape(self, node, input_shapes):
        return [input_shapes[0]]


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

    # PyTensor caches compiled graphs on disk keyed by the Op's props and this integer.  The
    # package digest covers the Op's module and every module its kernels call into, so an edited
    # kernel or helper is never served stale from the cache (no manual version bumps).
    source_key = int(PACKAGE_DIGEST[:15], 16)

    @register_funcify_default_op_cache_key(op_type)
    def _numba_funcify(op, node=None, **kwargs):
        fn = op.numba_fn(node)
        if node is not None and inspect.getfullargspec(fn.py_func).varargs is not None:
            fn = _fixed_arity(fn, len(node.inputs))
        return fn, source_key

    return op_type


@cache
def _fixed_arity(fn, n: int):
    """``fn`` (a jitted ``def fn(*args)``) behind a jitted function of exactly ``n`` parameters: PyTensor's
    Numba ``Blockwise`` calls the core function with one argument per input and checks its arity."""
    names = ", ".join(f"x{i}" for i in range(n))
    scope = {"inner": fn}
    exec(f"def call({names}):\n    return inner({names})\n", scope)  # noqa: S102  (names are generated above)
    return numba.njit(scope["call"])


def entry_point(builder):
    """Memoize a factory of jitted entry points on its (hashable) arguments.

    ``builder(*static_args)`` returns a ``numba.njit`` function.  Entry points are thin: they check
    the run-time shapes, cast inputs to the working precision, call the module's kernel and cast back,
    so compiling them is cheap while the kernel itself is cached on disk.  ``perform`` asks for the
    entry point on every call, so the memo must hit: arguments must equal themselves (no NaN).
    ``cache_info()`` counts builds (misses).
    """
    return cache(builder)


def dtype_name(var) -> str:
    return var.type.dtype if hasattr(var, "type") else np.dtype(var).name
