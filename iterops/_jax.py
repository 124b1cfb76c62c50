"""JAX backend: iterops Ops have no JAX implementation, and say so clearly.

Every iterops Op is a :class:`~iterops._fused.FusedOp` whose loop runs in a
Numba kernel.  There is no JAX kernel yet, so graphs holding an iterops Op
cannot be compiled by PyTensor's JAX linker (``mode="JAX"``) nor sampled by
PyMC's JAX samplers (``pm.sample(nuts_sampler="numpyro")`` or ``"blackjax"``,
which JAX-ify the model's logp).  Without this module PyTensor says
``No JAX conversion for the given `Op```; with it, the error names the Op and
the samplers that do work.

Importing JAX is slow, so nothing here imports it.  :func:`install` registers
the error with ``pytensor.link.jax.dispatch.jax_funcify`` right away when that
module is already loaded, and otherwise through a one-shot import hook that
runs the registration just after PyTensor loads its JAX dispatch module (which
happens only when a JAX mode or JAX sampler is used).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

__all__ = ["install", "no_jax_message"]

_DISPATCH_MODULE = "pytensor.link.jax.dispatch.basic"


def no_jax_message(op) -> str:
    return (
        f"{op} is an iterops Op: its loop is a Numba kernel and iterops has no JAX implementation of it, "
        "so it cannot run under PyTensor's JAX backend (mode='JAX') or the JAX-based NUTS samplers "
        "(pm.sample(nuts_sampler='numpyro' or 'blackjax')). Sample with PyMC's default NUTS "
        "(pm.sample(nuts_sampler='pymc')) or with nutpie (nuts_sampler='nutpie'), which compile with Numba."
    )


def _register(jax_funcify) -> None:
    from iterops._fused import FusedOp

    @jax_funcify.register(FusedOp)
    def _jax_funcify_fused(op, node=None, **kwargs):
        raise NotImplementedError(no_jax_message(op))


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of PyTensor's JAX dispatch module to register afterwards."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DISPATCH_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _uninstall_hook()
            _register(module.jax_funcify)

        loader.exec_module = exec_and_register
        return spec


_hook = _RegisterAfterImport()


def _uninstall_hook() -> None:
    if _hook in sys.meta_path:
        sys.meta_path.remove(_hook)


def install() -> None:
    """Register the clear JAX error now, or as soon as PyTensor's JAX dispatch loads."""
    module = sys.modules.get(_DISPATCH_MODULE)
    if module is not None and hasattr(module, "jax_funcify"):
        _register(module.jax_funcify)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
