"""Shape and dtype validation shared by the public functions and the entry points.

Graph-build time (``as_tensor``, ``check_square``, ``check_dim_match``): errors name the argument and
show the static shapes, e.g. ``ValueError: solve_discrete_lyapunov: A must be square in its last two
dimensions, got A with shape (3, 4) (static shape; None = unknown)``.

Run time (:func:`check_shape`, jitted): every entry point checks each shape relation its kernel relies
on before an array reaches the kernel (or its pointer crosses a C-ABI barrier, where a wrong shape is an
out-of-bounds read), and raises :class:`ShapeError` (a ``ValueError``) naming the argument.
"""

from __future__ import annotations

import numba
import pytensor.tensor as pt
from pytensor.tensor.variable import TensorVariable

_NUMERIC_KINDS = "biufc"


def as_tensor(func: str, name: str, x, *, min_ndim: int = 0, allow_int: bool = True) -> TensorVariable:
    """Convert ``x`` to a tensor, checking its dtype is numeric and ndim >= ``min_ndim``."""
    try:
        x = pt.as_tensor_variable(x)
    except (TypeError, ValueError) as err:
        dtype = getattr(x, "dtype", None)
        raise TypeError(
            f"{func}: {name} must be a numeric tensor-like array, got {type(x).__name__}"
            + (f" with dtype {dtype}" if dtype is not None else "")
            + f" ({err})"
        ) from None
    kind = x.type.numpy_dtype.kind
    if kind not in _NUMERIC_KINDS or (not allow_int and kind in "biu"):
        raise TypeError(f"{func}: {name} must have a numeric dtype, got {name} with dtype {x.type.dtype}")
    if x.type.ndim < min_ndim:
        raise ValueError(
            f"{func}: {name} must have at least {min_ndim} dimensions, got {name} with ndim {x.type.ndim} "
            f"and shape {x.type.shape}"
        )
    return x


def check_square(func: str, name: str, x: TensorVariable) -> None:
    """Last two static dims of ``x`` must agree where known."""
    r, c = x.type.shape[-2:]
    if r is not None and c is not None and r != c:
        raise ValueError(
            f"{func}: {name} must be square in its last two dimensions, got {name} with shape {x.type.shape} "
            "(static shape; None = unknown)"
        )


def check_dim_match(func: str, name_a: str, dim_a, name_b: str, dim_b, what: str) -> None:
    """Two static dimensions must agree where both are known."""
    if dim_a is not None and dim_b is not None and dim_a != dim_b:
        raise ValueError(f"{func}: {what}: {name_a} has {dim_a} but {name_b} has {dim_b}")


def float_dtype(*xs) -> str:
    """The floating dtype the result takes: upcast of the inputs, ints -> floatX."""
    import pytensor

    dtype = pytensor.scalar.upcast(*(x.type.dtype for x in xs))
    if dtype.startswith(("int", "uint", "bool")):
        return pytensor.config.floatX
    return dtype


class ShapeError(ValueError):
    """A run-time shape mismatch: ``ShapeError(func, name, spec, got, want)``; ``-1`` in ``want`` = any."""

    def __str__(self):
        if len(self.args) != 5:
            return super().__str__()
        func, name, spec, got, want = self.args
        want = "(" + ", ".join("?" if w < 0 else str(w) for w in want) + ("," if len(want) == 1 else "") + ")"
        return f"{func}: {name} must have shape {spec} = {want} at run time, got {name} with shape {tuple(got)}"


_str = numba.types.unicode_type
#: the checks' compiled signatures: shapes of 1 to 4 dimensions.  Explicit signatures keep string arguments,
#: which Numba types as literals at each call site, from compiling one specialisation per message.
_CHECK_SIGNATURES = [numba.types.none(_str, _str, _str, numba.types.UniTuple(numba.types.int64, k),
                                      numba.types.UniTuple(numba.types.int64, k)) for k in range(1, 5)]


@numba.njit(_CHECK_SIGNATURES, cache=True)
def _check_dims(func, name, spec, got, want):
    for i in range(len(want)):
        if want[i] >= 0 and got[i] != want[i]:
            raise ShapeError(func, name, spec, got, want)


@numba.njit(_CHECK_SIGNATURES, cache=True)
def _check_min(func, name, spec, got, want):
    if got[0] < want[0]:
        raise ShapeError(func, name, spec, got, want)


@numba.njit(inline="always")
def check_shape(func, name, x, spec, want):
    """Raise :class:`ShapeError` unless ``x.shape`` matches ``want`` (a tuple; ``-1`` = any size).

    ``spec`` says where ``want`` comes from, e.g. ``"(n, k), n = len(c)"``."""
    _check_dims(func, name, spec, x.shape, want)


@numba.njit(inline="always")
def check_at_least(func, name, x, spec, length):
    """Raise :class:`ShapeError` unless the 1-d ``x`` has at least ``length`` entries."""
    _check_min(func, name, spec, x.shape, (length,))
