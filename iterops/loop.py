r"""A structured, JAX-like loop API on top of PyTensor's Scan: :func:`loop` and :func:`taps`.

``loop(step, init, xs, n_steps)`` is the PyTensor counterpart of
:func:`jax.lax.scan` (and, with a break condition, of a bounded
:func:`jax.lax.while_loop`).  The carry, the sequences and the traced outputs
are *pytrees* (nested tuples, lists, dicts and namedtuples whose leaves are
tensors; ``None`` is an empty subtree), instead of Scan's flat, order-dependent
``sequences`` / ``outputs_info`` / ``non_sequences`` signature.  Semantics, as
a reference Python loop::

    def loop(step, init, xs=None, n_steps=None):
        carry, ys = init, []
        for t in range(n_steps):                 # n_steps defaults to len(xs)
            x = tree_map(lambda leaf: leaf[t], xs)
            carry, y, *brk = step(carry, x)      # see "What step returns"
            ys.append(y)
            if brk and brk[0]:
                break
        final = carry
        return (final, stack(ys)) + ((bool(brk and brk[0]),) if has_break else ())

It builds one ordinary :class:`pytensor.scan.op.Scan` (through
:func:`pytensor.scan`), so every Scan rewrite applies: unused outputs are
pruned, a carry whose history nobody reads is stored without a trace, and
iterops' scan-fusion rewrites see the same graph a hand-written ``scan`` would
give.  Gradients are Scan's gradients (backpropagation through the loop),
including through the carry of a while-loop.

What ``step`` returns
---------------------
``step(carry, x)`` may return

* ``new_carry``,
* ``(new_carry, y)``: ``y`` is a pytree of tensors traced at every step
  (``None`` traces nothing, as in JAX),
* ``(new_carry, y, break_cond)``: a scalar boolean; when it is true after a
  step, the loop stops (that step's carry and ``y`` are kept).  The loop is
  then a while-loop and ``n_steps`` is the maximum number of steps.

The three forms are told apart by the *tree structure* of ``init``: the return
value is read as ``(new_carry, y[, break_cond])`` when it is a 2- or 3-tuple
whose first element has the structure of ``init``, and as a bare ``new_carry``
when it has itself the structure of ``init``.  Both cannot hold at once (a
tree never has its own structure as a child), so a tuple carry is never
mistaken for ``(new_carry, y)``.  Anything else is an error that shows both
structures.

Carry types
-----------
``new_carry`` must have exactly the structure of ``init`` (same node types,
same dict keys, same namedtuple class) and every tensor leaf the same dtype,
ndim and broadcastable pattern as the matching leaf of ``init``; a mismatch
raises ``TypeError`` naming the leaf's path (``new_carry['state'][1]``) and both
types.  Python scalars and NumPy arrays in ``init`` become tensors of their
NumPy dtype (``0`` is int64, ``0.0`` float64).  Leaves without a shape, such as
random generators, may live in the carry: they are updated every step and
their last value comes back in ``final``; they cannot be traced as ``y``.

Taps
----
``taps(x, taps=[-2, -1])`` in ``init`` is a recurrence on several past values
(Scan's "mit-sot").  ``x`` holds the ``-min(taps)`` initial entries along its
first axis (``x[-1]`` is the most recent).  The step receives an object that
unpacks and indexes to the tapped values in the order of ``taps`` and whose
``push(value)`` returns the next carry for that leaf; it must be called
exactly once per step and its result returned at the same place in
``new_carry``.  In ``final`` the leaf is the last ``-min(taps)`` entries, with
the shape of ``x`` (so ``final`` can be fed back as ``init``).

``taps(seq, taps=[0, 1])`` in ``xs`` gives look-ahead slices
``(seq[t], seq[t+1])`` (non-negative taps); ``n_steps`` is then
``len(seq) - max(taps)``.  Pushing to a sequence is an error.

``n_steps``
-----------
Inferred from ``xs`` (all leaves must agree on their usable length); when both
are given they must agree (checked statically where the lengths are known,
otherwise at run time).  ``n_steps = 0`` is valid: ``final`` equals ``init``
and every ``y`` leaf is an empty array.  Its trailing shape is the static
shape of ``y`` where that is fully known, under the Numba (default)
backend; PyTensor's Python and C Scan implementations (``FAST_COMPILE``,
``CVM``) return ``(0, 0, ...)`` instead (a known limitation of
``Scan.perform``), as do all backends when the static shape is not known.

Examples
--------
A cumulative sum with a traced output:

>>> import numpy as np, pytensor, pytensor.tensor as pt
>>> from iterops import loop, taps
>>> xs = pt.vector("xs")
>>> final, ys = loop(lambda c, x: (c + x, c + x), pt.zeros(()), xs)
>>> pytensor.function([xs], [final, ys])(np.array([1.0, 2.0, 3.0]))
[array(6.), array([1., 3., 6.])]

A dict carry and a while-loop (Smith doubling for ``A X A' - X + Q = 0``):

>>> A, Q = pt.matrix("A"), pt.matrix("Q")
>>> def doubling(c, _):
...     gamma = c["gamma"] + c["alpha"] @ c["gamma"] @ c["alpha"].T
...     stop = pt.max(pt.abs(gamma - c["gamma"])) < 1e-12
...     return {"alpha": c["alpha"] @ c["alpha"], "gamma": gamma}, None, stop
>>> final, _, done = loop(doubling, {"alpha": A, "gamma": Q}, n_steps=50)
>>> X = final["gamma"]

An AR(2) recursion with :func:`taps`:

>>> eps = pt.vector("eps")
>>> def ar2(c, e):
...     y2, y1 = c                     # y[t-2], y[t-1]
...     y = 0.5 * y1 - 0.2 * y2 + e
...     return c.push(y), y
>>> last_two, y = loop(ar2, taps(pt.zeros(2), taps=[-2, -1]), eps)

The same AR(2) with ``pytensor.scan`` needs ``outputs_info=[dict(initial=...,
taps=[-2, -1])]`` and a step whose positional arguments follow Scan's ordering
rules; the trace comes back but the last two values must be sliced out of it
(and do not exist when ``n_steps`` is 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.basic import Variable
from pytensor.graph.replace import clone_replace
from pytensor.raise_op import Assert
from pytensor.scan.op import Scan
from pytensor.scan.utils import until
from pytensor.tensor.random.type import RandomType
from pytensor.tensor.subtensor import Subtensor
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.type import TensorType, integer_dtypes
from pytensor.tensor.variable import TensorVariable

__all__ = ["loop", "taps", "Taps", "TapsView"]

# ---------------------------------------------------------------------------
# A tiny pytree: tuples, lists, dicts, namedtuples, None; everything else a leaf
# ---------------------------------------------------------------------------
# A tree definition is a hashable nested tuple:
#   ("*",)                      a leaf
#   ("None",)                   None (no leaves)
#   (tuple | list, children)    a tuple or list
#   (cls, children)             a namedtuple of class cls
#   (dict, keys, children)      a dict; keys sorted as in JAX


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _sort_keys(d: dict) -> list:
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _flatten(tree, path: str = ""):
    """``(leaves, paths, treedef)`` of ``tree``; paths are ``[0]['a'].field`` strings."""
    leaves: list = []
    paths: list[str] = []

    def rec(node, p):
        if node is None:
            return ("None",)
        if _is_namedtuple(node):
            kids = tuple(rec(getattr(node, f), f"{p}.{f}") for f in type(node)._fields)
            return (type(node), kids)
        if type(node) in (tuple, list):
            return (type(node), tuple(rec(c, f"{p}[{i}]") for i, c in enumerate(node)))
        if type(node) is dict:
            keys = _sort_keys(node)
            return (dict, tuple(keys), tuple(rec(node[k], f"{p}[{k!r}]") for k in keys))
        leaves.append(node)
        paths.append(p)
        return ("*",)

    treedef = rec(tree, path)
    return leaves, paths, treedef


def _unflatten(treedef, leaves):
    it = iter(leaves)

    def rec(td):
        if td[0] == "*":
            return next(it)
        if td[0] == "None":
            return None
        if td[0] is dict:
            return {k: rec(c) for k, c in zip(td[1], td[2], strict=True)}
        kids = [rec(c) for c in td[1]]
        if td[0] in (tuple, list):
            return td[0](kids)
        return td[0](*kids)  # namedtuple

    out = rec(treedef)
    if next(it, _END) is not _END:
        raise ValueError("too many leaves for the tree structure")
    return out


_END = object()


def _describe(td) -> str:
    """Human-readable tree structure, ``*`` for a leaf: ``tuple(*, {'a': *})``."""
    if td[0] == "*":
        return "*"
    if td[0] == "None":
        return "None"
    if td[0] is dict:
        return "{" + ", ".join(f"{k!r}: {_describe(c)}" for k, c in zip(td[1], td[2], strict=True)) + "}"
    inner = ", ".join(_describe(c) for c in td[1])
    if td[0] is tuple:
        return f"({inner},)" if len(td[1]) == 1 else f"({inner})"
    if td[0] is list:
        return f"[{inner}]"
    return f"{td[0].__name__}({inner})"


# ---------------------------------------------------------------------------
# Taps
# ---------------------------------------------------------------------------


class Taps:
    """Marker for a tapped carry (in ``init``) or a tapped sequence (in ``xs``).

    Create it with :func:`taps`; see that function for the semantics.
    """

    __slots__ = ("x", "taps")

    def __init__(self, x, taps: Sequence[int] | None):
        self.x = x
        self.taps = None if taps is None else tuple(taps)

    def __repr__(self) -> str:
        return f"taps({self.x}, taps={list(self.taps) if self.taps is not None else None})"


def taps(x, taps: Sequence[int] | None = None) -> Taps:
    """Mark ``x`` as a tapped carry in ``init`` or a tapped sequence in ``xs`` of :func:`loop`.

    Parameters
    ----------
    x : tensor-like, ndim >= 1
        In ``init``: the initial entries along the first axis, oldest first,
        ``x.shape[0] == -min(taps)`` (``x[-1]`` is the value at ``t - 1``).
        In ``xs``: the sequence.
    taps : sequence of distinct int, optional
        In ``init``: negative offsets, e.g. ``[-2, -1]`` gives the step
        ``(value[t-2], value[t-1])``.  ``None`` means every entry of ``x``
        (``range(-len(x), 0)``, the length must be known statically).
        In ``xs``: non-negative offsets, e.g. ``[0, 1]`` gives
        ``(seq[t], seq[t+1])``; required.

    The step receives a :class:`TapsView`: ``a, b = view``, ``view[0]``,
    ``len(view)``; for a carry ``view.push(value)`` returns the next carry of
    that leaf and must be called exactly once.

    Examples
    --------
    >>> import pytensor.tensor as pt
    >>> from iterops import loop, taps
    >>> def fib(c, _):
    ...     a, b = c
    ...     return c.push(a + b), a + b
    >>> last_two, seq = loop(fib, taps(pt.as_tensor([0, 1]), taps=[-2, -1]), n_steps=10)
    >>> seq.eval()
    array([ 1,  2,  3,  5,  8, 13, 21, 34, 55, 89])
    """
    return Taps(x, taps)


class TapsView(Sequence):
    """What the step receives for a :func:`taps` leaf: the tapped values in the order of ``taps``.

    Unpacks and indexes like a tuple.  For a carry, :meth:`push` returns the
    next carry of this leaf; for a sequence it raises.
    """

    def __init__(self, values, taps_, path: str, is_carry: bool):
        self._values = tuple(values)
        self.taps = taps_
        self._path = path
        self._is_carry = is_carry
        self._pushed = None

    def __getitem__(self, i):
        return self._values[i]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"TapsView({self._path}, taps={list(self.taps)})"

    def push(self, value) -> _Pushed:
        """The next carry of this tapped leaf: ``value`` becomes the entry at ``t``."""
        if not self._is_carry:
            raise TypeError(
                f"loop: {self._path} is a tapped sequence (look-ahead slices of xs); only tapped "
                "carries in init can be pushed to."
            )
        if self._pushed is not None:
            raise RuntimeError(
                f"loop: push() was called more than once on the tapped carry {self._path} in one "
                "step; call it exactly once and return its result in new_carry."
            )
        self._pushed = _Pushed(self, value)
        return self._pushed


class _Pushed:
    __slots__ = ("view", "value")

    def __init__(self, view: TapsView, value):
        self.view = view
        self.value = value

    def __repr__(self) -> str:
        return f"{self.view!r}.push({self.value})"


# ---------------------------------------------------------------------------
# Leaf specifications
# ---------------------------------------------------------------------------


class _Carry(NamedTuple):
    kind: str  # "state" (sit-sot), "taps" (mit-sot) or "untraced" (no shape, e.g. RNG)
    init: Variable  # for "taps": x, checked to hold -min(taps) entries
    taps: tuple[int, ...] | None
    path: str


def _as_variable(value, what: str) -> Variable:
    if isinstance(value, Variable):
        return value
    try:
        return pt.as_tensor_variable(np.asarray(value))
    except (TypeError, ValueError) as err:
        raise TypeError(f"loop: {what} must be a tensor-like or a PyTensor variable, got {value!r}: {err}") from None


def _slice_type(x: TensorVariable) -> TensorType:
    """The type of ``x[t]``."""
    return TensorType(x.type.dtype, shape=x.type.shape[1:])


def _static_len(x: TensorVariable):
    return x.type.shape[0]


def _carry_spec(leaf, path: str) -> _Carry:
    if isinstance(leaf, Taps):
        x = _as_variable(leaf.x, f"the value of taps {path}")
        if not isinstance(x, TensorVariable) or x.type.ndim < 1:
            raise ValueError(
                f"loop: taps {path} needs a tensor with the initial entries along its first axis, "
                f"got {x.type}"
            )
        tp = leaf.taps
        if tp is None:
            n = _static_len(x)
            if n is None:
                raise ValueError(
                    f"loop: taps {path} has taps=None but the length of its first axis is not known "
                    f"statically (type {x.type}); pass taps explicitly, e.g. taps=[-2, -1]."
                )
            tp = tuple(range(-n, 0))
        if not tp or any(not isinstance(k, int | np.integer) or k >= 0 for k in tp) or len(set(tp)) != len(tp):
            raise ValueError(f"loop: taps of a carry ({path}) must be distinct negative integers, got {list(tp)}")
        tp = tuple(int(k) for k in tp)
        n_init = -min(tp)
        n_have = _static_len(x)
        if n_have is not None and n_have != n_init:
            raise ValueError(
                f"loop: taps {path} with taps={list(tp)} needs {n_init} initial entries along the first "
                f"axis, got shape {x.type.shape}"
            )
        if n_have is None:
            x = pt.specify_shape(x, (n_init,) + (None,) * (x.type.ndim - 1))
        return _Carry("taps", x, tp, path)
    if isinstance(leaf, TapsView | _Pushed):
        raise TypeError(f"loop: init{path} is a step-time taps object ({leaf!r}); use taps(x, ...) in init")
    x = _as_variable(leaf, f"init{path}")
    if isinstance(x, TensorVariable):
        return _Carry("state", x, None, path)
    if hasattr(x.type, "shape") and not isinstance(x.type, RandomType):
        raise TypeError(f"loop: init{path} has unsupported type {x.type}; carry leaves must be tensors or random generators")
    return _Carry("untraced", x, None, path)


def _type_str(v) -> str:
    t = v.type
    if isinstance(t, TensorType):
        return f"{t} (dtype={t.dtype}, ndim={t.ndim}, broadcastable={t.broadcastable})"
    return str(t)


def _check_same_type(new: Variable, ref_type, path: str, what: str) -> Variable:
    """``new`` must match ``ref_type`` in dtype, ndim and broadcastable pattern (or equal it)."""
    if isinstance(ref_type, TensorType):
        if not isinstance(new, TensorVariable):
            raise TypeError(f"loop: {what}{path} must be a tensor of type {ref_type}, got {new!r} of type {new.type}")
        t = new.type
        if t.dtype != ref_type.dtype or t.ndim != ref_type.ndim or t.broadcastable != ref_type.broadcastable:
            hint = ""
            if t.dtype != ref_type.dtype:
                hint = f" Cast it with .astype({ref_type.dtype!r}) or give init that dtype."
            elif t.broadcastable != ref_type.broadcastable:
                hint = (
                    " Dimensions of length 1 must be length 1 in both (see pt.specify_broadcastable) "
                    "or in neither."
                )
            raise TypeError(
                f"loop: the carry must keep its type; {what}{path} has type {_type_str(new)} but "
                f"init{path} has type {ref_type} (dtype={ref_type.dtype}, ndim={ref_type.ndim}, "
                f"broadcastable={ref_type.broadcastable}).{hint}"
            )
        if t.shape != ref_type.shape and not ref_type.is_super(t):
            if any(a is not None and b is not None and a != b for a, b in zip(t.shape, ref_type.shape)):
                raise TypeError(
                    f"loop: the carry must keep its shape; {what}{path} has static shape {t.shape} but "
                    f"init{path} has static shape {ref_type.shape}"
                )
            # Less static knowledge than init: pin the shape (checked at run time).
            new = pt.specify_shape(new, ref_type.shape)
        return new
    if new.type != ref_type:
        raise TypeError(f"loop: the carry must keep its type; {what}{path} has type {new.type} but init{path} has type {ref_type}")
    return new


# ---------------------------------------------------------------------------
# loop
# ---------------------------------------------------------------------------

_RETURN_FORMS = "new_carry, (new_carry, y) or (new_carry, y, break_cond)"


def _split_return(out, init_def):
    """``(new_carry, y, cond, has_cond)`` from what ``step`` returned (rule in the module docstring)."""

    def structure(tree):
        return _flatten(tree)[2]

    if type(out) is tuple and len(out) in (2, 3) and structure(out[0]) == init_def:
        return out[0], out[1], (out[2] if len(out) == 3 else None), len(out) == 3
    if structure(out) == init_def:
        return out, None, None, False
    raise TypeError(
        f"loop: step must return {_RETURN_FORMS}, where new_carry has the structure of init, "
        f"{_describe(init_def)}; got a value with structure {_describe(structure(out))}"
    )


def _scan_buffer(v):
    """The raw Scan output behind ``v`` (``raw[init_len:]``), or None."""
    if v.owner is not None and isinstance(v.owner.op, Subtensor):
        raw = v.owner.inputs[0]
        if raw.owner is not None and isinstance(raw.owner.op, Scan):
            return raw
    return None


def _n_steps_from(lengths: list, n_steps):
    """The number of steps: ``n_steps`` or the usable length of the sequences, checked to agree.

    ``lengths`` holds ``(path, length)`` per sequence, ``length`` an int when
    known statically.  Disagreements between known values raise here; where a
    value is symbolic, an ``Assert`` checks it at run time.
    """
    static = [(p, n) for p, n in lengths if isinstance(n, int)]
    for p, n in static[1:]:
        if n != static[0][1]:
            raise ValueError(
                f"loop: all sequences in xs must have the same usable length along axis 0, got "
                f"{static[0][1]} for xs{static[0][0]} and {n} for xs{p}"
            )
    n_const = n_steps if isinstance(n_steps, int) else None
    if n_steps is not None and n_const is None:
        try:
            n_const = int(pt.get_scalar_constant_value(n_steps))
        except NotScalarConstantError:
            pass
    if static and n_const is not None and n_const != static[0][1]:
        raise ValueError(
            f"loop: n_steps={n_const} does not match the usable length of xs ({static[0][1]} for "
            f"xs{static[0][0]}); omit n_steps or pass the same value"
        )
    if n_steps is not None:
        base = n_steps
    elif static:
        base = static[0][1]
    else:
        base = lengths[0][1]
    checks = [
        pt.eq(base, n)
        for _, n in lengths
        if n is not base and not (isinstance(n, int) and isinstance(base, int))
    ]
    if checks:
        base = Assert("loop: n_steps and the lengths of the sequences in xs must agree")(
            pt.as_tensor(base, dtype="int64"), *checks
        )
    return base


def loop(step, init, xs=None, n_steps=None, *, name: str | None = None):
    """Run ``step`` over a pytree carry and pytree sequences as one PyTensor ``Scan``.

    Parameters
    ----------
    step : callable ``(carry, x) -> new_carry | (new_carry, y) | (new_carry, y, break_cond)``
        Builds one iteration.  ``carry`` has the structure of ``init`` (tensors,
        with :class:`TapsView` for :func:`taps` leaves); ``x`` has the
        structure of ``xs`` with each leaf sliced at ``t`` along axis 0
        (``None`` when ``xs`` is None).  See "What step returns" in the module
        docstring for how the three return forms are told apart.
    init : pytree
        The initial carry: tensors (or tensor-likes), :func:`taps` markers,
        random generators.
    xs : pytree, optional
        Sequences, sliced along their first axis; :func:`taps` markers give
        look-ahead slices.
    n_steps : int or scalar integer tensor, optional
        Number of steps (the maximum with a break condition).  Inferred from
        ``xs`` when omitted; must agree with ``xs`` when both are given.
        May be 0.
    name : str, optional
        Name of the Scan (shown in profiles and debugprint).

    Returns
    -------
    final : pytree like ``init``
        The carry after the last step (``init`` when no step ran).  A
        :func:`taps` leaf comes back as its last ``-min(taps)`` entries.
    ys : pytree like ``y``
        Each leaf stacked along a new first axis of length ``n_steps`` (the
        number of steps run for a while-loop).
    done : boolean scalar, only with a break condition
        Whether ``break_cond`` became true (False when ``n_steps`` is 0).

    Raises
    ------
    TypeError
        ``step`` returns a value of the wrong structure, a carry leaf changes
        type (the message names the leaf path and both types), ``y`` holds an
        untraceable variable (e.g. a random generator), or the break condition
        is not a boolean scalar.
    ValueError
        ``n_steps`` is missing (and there are no ``xs``), negative, or does not
        match ``xs``; malformed :func:`taps`.
    RuntimeError
        A tapped carry is not pushed exactly once.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from iterops import loop
    >>> x0, xs = pt.vector("x0"), pt.matrix("xs")
    >>> def step(c, x):
    ...     new = {"sum": c["sum"] + x, "n": c["n"] + 1}
    ...     return new, {"mean": new["sum"] / new["n"]}
    >>> final, ys = loop(step, {"sum": x0, "n": np.float64(0.0)}, xs)
    >>> f = pytensor.function([x0, xs], [final["sum"], ys["mean"]])
    >>> f(np.zeros(2), np.array([[1.0, 2.0], [3.0, 4.0]]))
    [array([4., 6.]), array([[1., 2.],
           [2., 3.]])]
    """
    if not callable(step):
        raise TypeError(f"loop: step must be callable, got {step!r}")
    init_leaves, init_paths, init_def = _flatten(init)
    carries = [_carry_spec(leaf, p) for leaf, p in zip(init_leaves, init_paths, strict=True)]
    seqs, xs_def = _sequence_specs(xs)
    n_eff = _effective_n_steps(seqs, _check_n_steps(n_steps))
    traced = _trace_step(step, carries, init_def, seqs, xs_def)
    if not (traced.new_carry or traced.ys or traced.has_cond):  # nothing to compute: no carry, y or break
        final = _unflatten(init_def, [c.init for c in carries])
        ys = _unflatten(traced.y_def, [])
        return (final, ys, pt.as_tensor(np.array(False))) if traced.has_cond else (final, ys)
    results, replayed = _build_scan(carries, seqs, traced, n_eff, name)
    finals, done, ys_out = _unpack_outputs(carries, traced, results, replayed)
    final = _unflatten(init_def, finals)
    ys = _unflatten(traced.y_def, ys_out)
    if traced.has_cond:
        return final, ys, done
    return final, ys


# ---------------------------------------------------------------------------
# The stages of loop: arguments, tracing the step, the Scan, its outputs
# ---------------------------------------------------------------------------


class _Seq(NamedTuple):
    x: TensorVariable
    taps: tuple[int, ...]  # (0,) for a plain sequence
    path: str
    is_taps: bool  # given as a taps(...) marker (the step receives a TapsView)


def _sequence_specs(xs) -> tuple[list[_Seq], tuple | None]:
    """The leaves of ``xs`` as :class:`_Seq` (validated) and the tree definition of ``xs``."""
    if xs is None:
        return [], None
    seqs = []
    xs_leaves, xs_paths, xs_def = _flatten(xs)
    for leaf, p in zip(xs_leaves, xs_paths, strict=True):
        leaf_in, tp = leaf, (0,)
        if isinstance(leaf, Taps):
            if leaf.taps is None:
                raise ValueError(f"loop: taps xs{p} needs explicit non-negative taps, e.g. taps=[0, 1]")
            tp = leaf.taps
            if not tp or any(not isinstance(k, int | np.integer) or k < 0 for k in tp) or len(set(tp)) != len(tp):
                raise ValueError(
                    f"loop: taps of a sequence (xs{p}) must be distinct non-negative integers (look-ahead), "
                    f"got {list(tp)}"
                )
            tp = tuple(int(k) for k in tp)
            leaf = leaf.x
        s = _as_variable(leaf, f"xs{p}")
        if not isinstance(s, TensorVariable) or s.type.ndim < 1:
            raise ValueError(f"loop: xs{p} must be a tensor with at least one dimension to slice, got {s.type}")
        seqs.append(_Seq(s, tp, p, isinstance(leaf_in, Taps)))
    return seqs, xs_def


def _check_n_steps(n_steps):
    """``n_steps`` as None, a non-negative int or an integer scalar tensor (errors otherwise)."""
    if n_steps is None:
        return None
    if isinstance(n_steps, bool) or (isinstance(n_steps, int | np.integer) and n_steps < 0):
        raise ValueError(f"loop: n_steps must be a non-negative integer, got {n_steps!r}")
    if isinstance(n_steps, np.integer):
        return int(n_steps)
    if isinstance(n_steps, int):
        return n_steps
    n_steps = pt.as_tensor_variable(n_steps)
    if n_steps.type.ndim != 0 or n_steps.type.dtype not in integer_dtypes:
        raise TypeError(f"loop: n_steps must be an integer scalar, got type {n_steps.type}")
    try:
        if int(pt.get_scalar_constant_value(n_steps)) < 0:
            raise ValueError(f"loop: n_steps must be non-negative, got {n_steps}")
    except NotScalarConstantError:
        pass
    return n_steps


def _effective_n_steps(seqs: list[_Seq], n_steps):
    """The Scan's ``n_steps``: the given one, or the usable length of the sequences (checked to agree)."""
    if not seqs:
        if n_steps is None:
            raise ValueError("loop: n_steps is required when xs is None")
        return n_steps
    lengths = []
    for s in seqs:
        n0 = _static_len(s.x)
        lengths.append((s.path, n0 - max(s.taps) if n0 is not None else s.x.shape[0] - max(s.taps)))
    for p, n in lengths:
        if isinstance(n, int) and n < 0:
            raise ValueError(f"loop: xs{p} is too short for its taps")
    return _n_steps_from(lengths, n_steps)


class _Traced(NamedTuple):
    """The step traced once on placeholders (Scan's inner-argument order: sequence slices, then carries)."""

    seq_args: list  # placeholders of the sequence slices
    carry_args: list  # placeholders of the carries (each tap of a taps carry)
    new_carry: list  # one inner output per carry leaf
    ys: list  # the traced outputs
    y_def: tuple  # tree definition of y
    cond: Variable | None  # the break condition (boolean scalar), if any

    @property
    def has_cond(self) -> bool:
        return self.cond is not None


def _trace_step(step, carries: list[_Carry], init_def, seqs: list[_Seq], xs_def) -> _Traced:
    """Call ``step`` on placeholders and check what it returns (structure, carry types, y, break)."""
    seq_args, carry_args = [], []
    x_leaves_step = []
    for s in seqs:
        vals = [_slice_type(s.x)() for _ in s.taps]
        seq_args += vals
        x_leaves_step.append(TapsView(vals, s.taps, f"xs{s.path}", False) if s.is_taps else vals[0])
    carry_leaves_step = []
    for c in carries:
        if c.kind == "taps":
            vals = [_slice_type(c.init)() for _ in c.taps]
            carry_args += vals
            carry_leaves_step.append(TapsView(vals, c.taps, f"init{c.path}", True))
        else:
            v = c.init.type()
            carry_args.append(v)
            carry_leaves_step.append(v)
    x_step = _unflatten(xs_def, x_leaves_step) if xs_def is not None else None
    carry_step = _unflatten(init_def, carry_leaves_step)

    new_carry, y, cond, has_cond = _split_return(step(carry_step, x_step), init_def)
    new_vals = _new_carry_values(carries, carry_leaves_step, new_carry, init_def)
    y_vals, y_def = _traced_values(y)
    cond_var = _break_condition(cond) if has_cond else None
    return _Traced(seq_args, carry_args, new_vals, y_vals, y_def, cond_var)


def _new_carry_values(carries: list[_Carry], carry_leaves_step: list, new_carry, init_def) -> list[Variable]:
    """The inner output of each carry leaf, checked to keep the leaf's type (taps: pushed exactly once)."""
    new_leaves, new_paths, new_def = _flatten(new_carry)
    assert new_def == init_def
    new_vals = []
    for c, v_step, new, p in zip(carries, carry_leaves_step, new_leaves, new_paths, strict=True):
        if c.kind == "taps":
            if not isinstance(new, _Pushed):
                raise RuntimeError(
                    f"loop: init{p} is a tapped carry; the step must return carry.push(value) at "
                    f"new_carry{p}, got {new!r}" + ("" if v_step._pushed is not None else " (push() was never called)")
                )
            if new.view is not v_step:
                raise RuntimeError(
                    f"loop: new_carry{p} holds the push() of {new.view._path}, not of init{p}; push each tapped "
                    "carry and return it at its own place"
                )
            val = _as_variable(new.value, f"the value pushed to init{p}")
            new_vals.append(_check_same_type(val, v_step[0].type, p, "new_carry"))
        else:
            if isinstance(new, TapsView | _Pushed):
                raise TypeError(f"loop: new_carry{p} is a taps object ({new!r}) but init{p} is not a tapped carry")
            val = _as_variable(new, f"new_carry{p}")
            new_vals.append(_check_same_type(val, c.init.type, p, "new_carry"))
    return new_vals


def _traced_values(y) -> tuple[list[TensorVariable], tuple]:
    """The leaves of ``y`` as tensors (errors for taps objects and random generators), and its tree definition."""
    y_leaves, y_paths, y_def = _flatten(y, "")
    y_vals = []
    for leaf, p in zip(y_leaves, y_paths, strict=True):
        if isinstance(leaf, TapsView | _Pushed):
            raise TypeError(f"loop: y{p} is a taps object ({leaf!r}); trace tensors, e.g. the pushed value")
        val = _as_variable(leaf, f"y{p}")
        if isinstance(val.type, RandomType):
            raise TypeError(
                f"loop: y{p} is a random generator ({val.type}), which cannot be traced (stacked over steps); "
                "keep it in the carry: its last value comes back in final."
            )
        if not isinstance(val, TensorVariable):
            raise TypeError(f"loop: y{p} has type {val.type}, which cannot be traced; only tensors can be traced")
        y_vals.append(val)
    return y_vals, y_def


def _break_condition(cond) -> TensorVariable:
    """``break_cond`` as a boolean scalar (integers: non-zero)."""
    c_var = _as_variable(cond, "break_cond")
    if not isinstance(c_var, TensorVariable) or c_var.type.ndim != 0 or c_var.type.dtype not in ("bool", *integer_dtypes):
        raise TypeError(f"loop: break_cond must be a boolean scalar, got type {c_var.type}")
    return c_var if c_var.type.dtype == "bool" else pt.neq(c_var, 0)


def _build_scan(carries: list[_Carry], seqs: list[_Seq], traced: _Traced, n_eff, name):
    """``pytensor.scan`` over the traced step: ``(results, replayed)``.

    Outputs in order: one per carry leaf, the ``done`` flag (with a break condition), one per
    ``y`` leaf.  ``replayed`` holds the inner outputs of the last call of the inner function (what
    the outputs are when PyTensor's scan replaces a single constant step by the step itself).
    """
    outputs_info = []
    for c in carries:
        if c.kind == "taps":
            outputs_info.append({"initial": c.init, "taps": list(c.taps)})
        else:
            outputs_info.append(c.init)
    carry_args = list(traced.carry_args)
    if traced.has_cond:
        outputs_info.append(pt.as_tensor(np.array(False)))  # the `done` flag
        carry_args.append(pt.scalar(dtype="bool"))
    outputs_info += [None] * len(traced.ys)
    cond_out = [traced.cond] if traced.has_cond else []
    # inner outputs: new carries, `done` (= the condition), ys; then the condition again for `until`
    inner_outs = traced.new_carry + cond_out + traced.ys + cond_out
    placeholders = traced.seq_args + carry_args
    replayed: list = []

    def inner_fn(*args):
        outs = clone_replace(inner_outs, replace=dict(zip(placeholders, args[: len(placeholders)], strict=True)))
        replayed[:] = outs
        if traced.has_cond:
            return outs[:-1], until(outs[-1])
        return outs

    sequences = [s.x if s.taps == (0,) else {"input": s.x, "taps": list(s.taps)} for s in seqs]
    results = pytensor.scan(
        inner_fn,
        sequences=sequences,
        outputs_info=outputs_info,
        n_steps=n_eff,
        name=name,
        return_list=True,
        return_updates=False,
    )
    return results, replayed


def _unpack_outputs(carries: list[_Carry], traced: _Traced, results: list, replayed: list):
    """``(finals, done, ys)`` (flat) from the Scan's outputs: the last carry, the last ``done``, the traces."""
    n_carry, has_cond = len(carries), traced.has_cond
    n_inner = n_carry + int(has_cond) + len(traced.ys)
    scan_path = any(_scan_buffer(r) is not None or (r.owner is not None and isinstance(r.owner.op, Scan)) for r in results)
    finals = []
    if scan_path:
        for c, r in zip(carries, results[:n_carry], strict=True):
            if c.kind == "untraced":
                finals.append(r)
            else:
                raw = _scan_buffer(r)
                finals.append(raw[-1] if c.kind == "state" else raw[-(-min(c.taps)) :])
        done = _scan_buffer(results[n_carry])[-1] if has_cond else None
        return finals, done, list(results[n_carry + int(has_cond) :])
    # PyTensor's scan replaces a single (constant) step by the step itself
    for c, r in zip(carries, replayed[:n_carry], strict=True):
        if c.kind == "taps":
            finals.append(pt.concatenate([c.init, r[None]], axis=0)[-(-min(c.taps)) :])
        else:
            finals.append(r)
    done = replayed[n_carry] if has_cond else None
    return finals, done, [pt.shape_padleft(r) for r in replayed[n_carry + int(has_cond) : n_inner]]
