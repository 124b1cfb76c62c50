"""Kernel compiles in a background process (imports nothing from iterops).

:func:`start` runs ``python -m iterops.warmup --kernels ...`` in a child process and records it in
:data:`RUNNING`; :func:`wait` (called before a kernel compiles or loads here) waits for those children,
so a kernel is never compiled twice at once, once here and once beside it.  :data:`enabled` is the one
switch (``ITEROPS_BACKGROUND_COMPILE=0`` sets it off at import; the warm-up command sets it off itself).
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading

__all__ = ["RUNNING", "enabled", "start", "wait"]

#: Background compile processes started by :func:`start` and not yet waited for.
RUNNING: list[subprocess.Popen] = []
#: Whether :func:`start` may start a process (off on a one-core machine).
enabled = os.environ.get("ITEROPS_BACKGROUND_COMPILE") != "0" and (os.cpu_count() or 1) >= 2

_LOCK = threading.Lock()  # first calls of kernels come from several sampler threads
_log = logging.getLogger("iterops")


def start(kernels: list[str], package_parent: str) -> subprocess.Popen | None:
    """Compile the C-ABI kernels named ``module.function`` in ``kernels`` into the on-disk cache in a child
    process (``package_parent``: the folder holding the ``iterops`` package, appended to the child's
    ``sys.path`` so that an iterops put on the path by hand is found).  ``None`` when there is nothing to do.
    The child's output is dropped unless it fails; it is ended when this process exits."""
    if not kernels:
        return None
    code = (f"import sys; sys.path.append({package_parent!r}); "
            f"from iterops.warmup import main; sys.exit(main({['--quiet', '--kernels', *kernels]!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    RUNNING.append(proc)
    atexit.register(lambda: proc.poll() is None and proc.terminate())
    return proc


def wait() -> None:
    """Wait for every running background compile (then the kernels it compiled load from the cache)."""
    with _LOCK:
        while RUNNING:
            proc = RUNNING.pop(0)
            if proc.poll() is None:
                _log.info("iterops: waiting for the background kernel compile (pid %s)", proc.pid)
                proc.wait()
