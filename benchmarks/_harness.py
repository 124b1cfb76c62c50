"""Side-by-side timing helpers for ``benchmarks/``.

Every benchmark module ``bench_*.py`` defines ``run(quick: bool) -> list[Section]``.
Rows are measured side by side in one process and reported as ratios to a
baseline, never as absolute pass/fail thresholds in tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def best_time(fn, *args, min_time: float = 0.2, repeat: int = 5) -> float:
    """Best-of-``repeat`` seconds per call of ``fn(*args)``, auto-ranged."""
    fn(*args)  # warm up (and JIT)
    number = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn(*args)
        dt = time.perf_counter() - t0
        if dt >= min_time / repeat or number >= 1 << 20:
            break
        number *= 4
    times = [dt / number]
    for _ in range(repeat - 1):
        t0 = time.perf_counter()
        for _ in range(number):
            fn(*args)
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def best_time_any_blas_threads(fn, *args, **kw) -> float:
    """:func:`best_time` with OpenBLAS's default threads and with one thread, the lower of the two.

    On a loaded 2-core machine, BLAS threads waiting for a busy core can make a 50 x 50 product or a
    200 x 200 solve 10-1000x slower; a baseline that calls BLAS gets its better setting."""
    from threadpoolctl import threadpool_limits  # noqa: PLC0415  (a dependency of PyMC, dev-only here)

    with threadpool_limits(limits=1, user_api="blas"):
        one = best_time(fn, *args, **kw)
    return min(one, best_time(fn, *args, **kw))


def compile_time(build, repeat: int = 1) -> tuple[float, object]:
    """Best-of-``repeat`` seconds to run ``build()`` (graph construction + ``pytensor.function``).

    On-disk caches persist between runs, which is how users experience
    re-compiles; that is the number reported.
    """
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = build()
        best = min(best, time.perf_counter() - t0)
    return best, out


@dataclass
class Target:
    description: str
    ratio: float
    goal: float  # the target ratio; met when ratio >= goal

    @property
    def met(self) -> bool:
        return bool(np.isfinite(self.ratio) and self.ratio >= self.goal)


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: str = ""

    def to_markdown(self) -> str:
        out = [f"## {self.title}", ""]
        if self.notes:
            out += [self.notes, ""]
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "---|" * len(self.columns))
        for r in self.rows:
            out.append("| " + " | ".join(_fmt(v) for v in r) + " |")
        if self.targets:
            out += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
            for t in self.targets:
                out.append(f"| {t.description} | {t.ratio:.3g}x | >= {t.goal:g}x | {'yes' if t.met else '**no**'} |")
        return "\n".join(out) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.3g}"
    return str(v)


def child_result(code: str, *args: str, what: str, env: dict | None = None) -> dict:
    """Run ``code`` with ``python -c`` in a new process (in the repository root, ``args`` as its ``sys.argv[1:]``);
    the JSON it printed on a line ``RESULT {...}``.  A failed process raises ``RuntimeError`` naming ``what``, with
    the end of its stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def ms(seconds: float) -> float:
    return seconds * 1e3
