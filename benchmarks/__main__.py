"""Run every ``benchmarks/bench_*.py`` side by side and write ``benchmarks/RESULTS.md``.

    scripts/dev bench            # all benchmarks (the numbers in RESULTS.md)
    scripts/dev bench --quick    # smaller sizes, for a smoke run
    scripts/dev bench lyapunov   # only modules whose name contains "lyapunov"
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pkgutil
import platform
import sys
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("only", nargs="*", help="substrings of benchmark module names to run")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--output", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)

    warnings.simplefilter("ignore")
    import numba
    import pytensor

    import iterops

    modules = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))
    if args.only:
        modules = [m for m in modules if any(s in m for s in args.only)]
    sections, failures = [], []
    for name in modules:
        print(f"[bench] {name}", flush=True)
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
            sections.extend(mod.run(quick=args.quick))
        except Exception:
            failures.append((name, traceback.format_exc()))
            print(failures[-1][1], file=sys.stderr)

    header = [
        "# Benchmark results",
        "",
        "Regenerate with `scripts/dev bench` (writes this file).  All timings in one process, side by side;",
        "ratios are what matter (this machine is shared and noisy).  Compile times include graph rewriting and",
        "Numba code generation with warm on-disk caches, as users see them on a second run.",
        "",
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}; machine: {platform.machine()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}; pytensor {pytensor.__version__}; numba {numba.__version__}; "
        f"iterops {iterops.__version__}" + ("; **--quick run**" if args.quick else ""),
        "",
    ]
    body = [s.to_markdown() for s in sections]
    if failures:
        body.append("## Failed benchmark modules\n\n" + "\n".join(f"- {n}" for n, _ in failures) + "\n")
    if args.only:
        print("\n".join(body))
        print("(subset run: RESULTS.md not rewritten)")
    else:
        Path(args.output).write_text("\n".join(header + body))
        print(f"wrote {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
