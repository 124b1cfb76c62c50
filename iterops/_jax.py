"""JAX backend: registers iterops' JAX implementations (:mod:`iterops.jax`) with PyTensor, lazily.

Every iterops Op has a JAX implementation in :mod:`iterops.jax`, so graphs holding iterops Ops compile
with PyTensor's JAX linker (``mode="JAX"``) and run in PyMC's JAX samplers
(``pm.sample(nuts_sampler="numpyro")`` or ``"blackjax"``, which JAX-ify the model's logp and its
gradient graph).

Importing JAX is slow, so nothing here imports it.  :func:`install` registers the implementations with
``pytensor.link.jax.dispatch.jax_funcify`` right away when that module is already loaded, and otherwise
through a one-shot import hook that runs the registration just after PyTensor loads its JAX dispatch
module (which happens only when a JAX mode or JAX sampler is used).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

__all__ = ["install"]

_DISPATCH_MODULE = "pytensor.link.jax.dispatch.basic"


def _register(jax_funcify) -> None:
    from iterops.jax import register

    register(jax_funcify)


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
    """Register the JAX implementations now, or as soon as PyTensor's JAX dispatch loads."""
    module = sys.modules.get(_DISPATCH_MODULE)
    if module is not None and hasattr(module, "jax_funcify"):
        _register(module.jax_funcify)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
