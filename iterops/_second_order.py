"""The error of a gradient Op that cannot be differentiated again (a second derivative).

PyTensor's ``grad_not_implemented`` surfaces as ``NullTypeGradError: grad encountered a NaN``,
which does not say what is missing; a gradient Op without a pullback raises this instead.
"""

from __future__ import annotations

__all__ = ["not_twice_differentiable"]


def not_twice_differentiable(op, func: str, input_names, alternative: str = "", order: int = 2) -> None:
    """Raise ``NotImplementedError`` naming the derivative Op, the function it differentiates, the inputs
    and the order asked for (2: ``op`` is the first derivative; 3: ``op`` is a second derivative)."""
    what = "Second derivatives (order 2)" if order == 2 else f"Derivatives of order {order}"
    reached = "the first derivative" if order == 2 else f"a derivative of order {order - 1}"
    raise NotImplementedError(
        f"{what} of {func} are not implemented: pytensor.grad reached "
        f"{type(op).__name__}, {reached} of {func}, which cannot be differentiated with respect "
        f"to {', '.join(input_names)}.  Derivatives up to order {order - 1} are exact."
        + (f"  {alternative}" if alternative else "")
    )


def reverse_twice(graph_fn, x, g, w):
    r"""Pullback of a gradient Op ``u = J(x)^T g`` of a function with a PyTensor graph ``graph_fn``.

    With cotangents ``w`` of ``u`` (one per ``x``, None where disconnected):
    ``x_bar = grad_x <w, J(x)^T g>`` (second derivatives) and ``g_bar = J(x) w``, both by reverse
    mode twice through ``graph_fn(*x)`` (a list of outputs; ``g`` holds one cotangent per output,
    None where there is none).  Built on fresh copies of ``x``, ``g``, ``w``: partial derivatives
    (in the caller's graph ``g`` and ``w`` may depend on ``x``).  Returns ``(x_bar, g_bar)``, lists
    with None where ``g`` is None.
    """
    import pytensor  # noqa: PLC0415
    import pytensor.tensor as pt  # noqa: PLC0415
    from pytensor.graph.replace import graph_replace  # noqa: PLC0415

    x_ = [v.type() for v in x]
    g_ = [None if v is None else v.type() for v in g]
    w_ = [None if v is None else v.type() for v in w]
    outs = graph_fn(*x_)
    u = pytensor.grad(None, x_, known_grads={o: gi for o, gi in zip(outs, g_) if gi is not None},
                      disconnected_inputs="ignore", return_disconnected="zero")
    inner = sum(pt.sum(wi * ui) for wi, ui in zip(w_, u) if wi is not None)
    g_on = [gi for gi in g_ if gi is not None]
    bars = pytensor.grad(inner, x_ + g_on, disconnected_inputs="ignore", return_disconnected="zero")
    replace = {a: b for a, b in zip(x_ + g_ + w_, list(x) + list(g) + list(w)) if a is not None}
    bars = graph_replace(bars, replace, strict=False)
    it = iter(bars[len(x):])
    return bars[: len(x)], [None if gi is None else next(it) for gi in g_]
