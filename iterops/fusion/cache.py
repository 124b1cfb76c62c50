"""The matcher's on-disk memo: what a process learnt about a loop, kept for the next one.

Recognizing loops costs most where it finds nothing: every reference step is built and canonicalized
and every variant unified with the user's step.  All of that is a pure function of

* the Scan's step (its inner graph, :class:`~pytensor.scan.op.ScanInfo` and ``truncate_gradient``),
  summarized by :func:`step_key`, a sha256 of a canonical text of the step that is the same in every
  process (op types and props, topology, input types, names, constant data); and
* iterops' sources and the versions of PyTensor, NumPy and Python (:func:`digest`): an edited pattern, an
  edited canonicalizer or another PyTensor gives another directory, and the old ones are removed.

So the matcher (:mod:`iterops.fusion.matcher`, :mod:`iterops.fusion.unify`) keeps, per key, the verdict
of matching a step with a pattern, the canonical reference steps and the patterns' reference facts in
files inside the Numba kernel cache (:func:`directory`).  What depends on the outer graph (uses of the
loop's outputs, static-shape proofs, a pattern's ``check``) is never stored: it is checked per call.

Failure behaviour: the memo is an optimization only.  A step that cannot be described deterministically
(an Op whose props print a memory address, ...) has no key and is not stored; a missing, corrupt,
unreadable or unwritable file counts as a miss (the value is recomputed); writes are atomic (a temporary
file renamed), so concurrent processes see a whole file or none.

``load`` and ``store`` count their hits and misses in :data:`STATS` (tests count work, never time).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

__all__ = ["step_key", "digest", "directory", "load", "store", "STATS", "enabled"]

#: switch for the on-disk memo (the in-process caches of the matcher do not depend on it)
enabled = True
#: overrides :func:`directory` when set (tests, or a user who wants it elsewhere)
DIRECTORY: Path | None = None
#: counters: ``"<namespace> hit"``, ``"<namespace> miss"``, ``"<namespace> store"``
STATS: Counter = Counter()

_DIGEST: str | None = None


def digest() -> str:
    """sha256 over iterops' Python sources and the PyTensor, NumPy and Python versions (computed once)."""
    global _DIGEST
    if _DIGEST is None:
        import pytensor  # noqa: PLC0415

        from iterops._fused import package_digest  # noqa: PLC0415

        h = hashlib.sha256(package_digest(patterns=("**/*.py",)).encode())
        h.update(f"\0{pytensor.__version__}\0{np.__version__}\0{sys.version}\0{pickle.HIGHEST_PROTOCOL}".encode())
        _DIGEST = h.hexdigest()
    return _DIGEST


def directory() -> Path | None:
    """``<kernel cache>/iterops-fusion/<digest>``: inside the Numba cache (``NUMBA_CACHE_DIR`` if set, else
    :func:`iterops._fused.kernel_cache_dir`), one folder per :func:`digest`; deleting the kernel cache
    deletes it too."""
    if DIRECTORY is not None:
        return Path(DIRECTORY) / digest()[:24]
    import numba  # noqa: PLC0415

    from iterops._fused import kernel_cache_dir  # noqa: PLC0415

    root = numba.core.config.CACHE_DIR or kernel_cache_dir()
    return None if not root else Path(root) / "iterops-fusion" / digest()[:24]


_PRUNED = False


#: folders of other digests unused for this long (seconds) are removed (another environment may still use
#: a recent one: PyTensor versions side by side share the folder)
STALE_AFTER = 7 * 24 * 3600


def _prune(here: Path) -> None:
    """Remove the folders of other digests (stale sources or versions) beside ``here``, once per process."""
    global _PRUNED
    if _PRUNED:
        return
    _PRUNED = True
    now = time.time()
    for other in here.parent.iterdir():
        try:
            if other != here and other.is_dir() and now - other.stat().st_mtime > STALE_AFTER:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass


def _path(namespace: str, key: str) -> Path | None:
    where = directory() if enabled else None
    if where is None:
        return None
    return where / f"{namespace}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.pkl"


_MISSING = object()


def load(namespace: str, key: str | None, default=None):
    """The value stored under ``(namespace, key)``, or ``default`` (no key, no file, or an unreadable one)."""
    path = _path(namespace, key) if key is not None else None
    if path is None:
        return default
    if not path.is_file():  # the common miss, tested without raising (matching raises and catches nothing)
        STATS[f"{namespace} miss"] += 1
        return default
    try:
        with open(path, "rb") as f:
            stored_key, value = pickle.load(f)
    except Exception:  # noqa: BLE001  (missing, truncated, corrupt, from another version: a miss)
        STATS[f"{namespace} miss"] += 1
        return default
    if stored_key != key:  # a hash collision of the file name
        STATS[f"{namespace} miss"] += 1
        return default
    STATS[f"{namespace} hit"] += 1
    return value


def store(namespace: str, key: str | None, value) -> None:
    """Write ``value`` under ``(namespace, key)`` atomically; silently nothing when that fails."""
    path = _path(namespace, key) if key is not None else None
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _prune(path.parent)
        data = pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception:  # noqa: BLE001  (read-only folder, a value that does not pickle, ...): not stored
        return
    STATS[f"{namespace} store"] += 1


# ---------------------------------------------------------------------------
# Keys: a canonical text of a graph, the same in every process
# ---------------------------------------------------------------------------


class _NoKey(Exception):
    """The graph holds something whose text is not the same in every process."""


def _text(x) -> str:
    """A text of ``x`` that equal values share in every process (raises :class:`_NoKey` otherwise)."""
    if x is None or isinstance(x, bool | int | float | complex | str | bytes):
        return f"{type(x).__name__}:{x!r}"
    if isinstance(x, np.ndarray | np.generic):
        a = np.ascontiguousarray(x)
        return f"array({a.dtype.str},{a.shape},{hashlib.sha256(a.tobytes()).hexdigest()[:24]})"
    if isinstance(x, np.dtype):
        return f"dtype:{x.str}"
    if isinstance(x, tuple | list):
        return "(" + ",".join(_text(i) for i in x) + ")"
    if isinstance(x, dict) or hasattr(x, "items"):
        return "{" + ",".join(sorted(f"{_text(k)}:{_text(v)}" for k, v in x.items())) + "}"
    if isinstance(x, frozenset | set):
        return "{" + ",".join(sorted(_text(i) for i in x)) + "}"
    from pytensor.graph.op import Op  # noqa: PLC0415
    from pytensor.graph.type import Type  # noqa: PLC0415

    if isinstance(x, Op):
        return _op_text(x)
    if not isinstance(x, type) and isinstance(getattr(type(x), "__props__", None), tuple):  # PyTensor's MetaObjects
        return f"{type(x).__module__}.{type(x).__qualname__}({','.join(_text(getattr(x, p)) for p in x.__props__)})"
    if isinstance(x, type) or callable(x) and hasattr(x, "__qualname__"):  # a class or a module-level function
        if "<locals>" in x.__qualname__ or "<lambda>" in x.__qualname__:
            raise _NoKey(x)
        return f"{x.__module__}.{x.__qualname__}"
    if isinstance(x, Type):
        return _checked(repr(x), x)
    return _checked(f"{type(x).__module__}.{type(x).__qualname__}:{x!r}", x)


def _checked(text: str, x) -> str:
    if " at 0x" in text or "object at" in text:
        raise _NoKey(x)
    return text


def _op_text(op) -> str:
    name = f"{type(op).__module__}.{type(op).__qualname__}"
    inner = getattr(op, "fgraph", None)
    if inner is not None and hasattr(inner, "inputs"):  # Scan, OpFromGraph, Composite: by their inner graph
        extra = {k: getattr(op, k) for k in ("info", "truncate_gradient", "name", "destroy_map", "view_map")
                 if hasattr(op, k)}
        props = getattr(op, "__props__", ())
        extra.update((p, getattr(op, p)) for p in props if p != "fgraph")
        return f"{name}[{_text(extra)}]{_graph_text(list(inner.inputs), list(inner.outputs))}"
    props = getattr(op, "__props__", None)
    if props is not None:
        return f"{name}({','.join(_text(getattr(op, p)) for p in props)})"
    if "output_types_preference" in vars(type(op)) or hasattr(op, "output_types_preference"):  # scalar Ops
        return f"{name}<{_text(getattr(op, 'output_types_preference', None))}>"
    raise _NoKey(op)  # equality by identity or by attributes we cannot see


def _graph_text(inputs, outputs) -> str:
    from pytensor.graph.basic import Constant  # noqa: PLC0415
    from pytensor.graph.traversal import io_toposort  # noqa: PLC0415

    ids, lines = {}, []
    for i, v in enumerate(inputs):
        ids[v] = f"i{i}"
        lines.append(f"i{i}:{_text(v.type)}:{v.name!r}")

    def ref(v):
        if v in ids:
            return ids[v]
        if isinstance(v, Constant):
            return f"c[{_text(v.type)}:{_text(np.asarray(v.data))}]"
        raise _NoKey(v)  # a free variable that is not an input

    for k, node in enumerate(io_toposort(inputs, outputs)):
        args = ",".join(ref(v) for v in node.inputs)
        for j, o in enumerate(node.outputs):
            ids[o] = f"n{k}.{j}"
        outs = ",".join(f"{_text(o.type)}:{o.name!r}" for o in node.outputs)
        lines.append(f"n{k}={_op_text(node.op)}({args})->{outs}")
    lines.append("out:" + ",".join(ref(v) for v in outputs))
    return "[" + ";".join(lines) + "]"


_STEP_KEYS: dict = {}


def step_key(op) -> str | None:
    """sha256 of the canonical text of the Scan ``op``'s step (inner graph, info, ``truncate_gradient``),
    the same for equal steps in every process; None when a part of it has no such text.  Cached per op."""
    key = _STEP_KEYS.get(op, _MISSING)  # Scan ops hash by their inner graph
    if key is not _MISSING:
        return key
    try:
        key = hashlib.sha256(_op_text(op).encode()).hexdigest()
    except _NoKey:
        key = None
    except RecursionError:
        key = None
    _STEP_KEYS[op] = key
    if len(_STEP_KEYS) > 1024:
        _STEP_KEYS.pop(next(iter(_STEP_KEYS)))
    return key
