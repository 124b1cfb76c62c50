"""Graph-build-time validation helpers shared by the public functions.

Errors name the argument and show the shapes/dtypes the user passed, e.g.
``ValueError: solve_discrete_lyapunov: A must be square in its last two
dimensions, got A with shape (3, 4) (static shape; None = unknown)``.
"""

from __future__ import annotations

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
