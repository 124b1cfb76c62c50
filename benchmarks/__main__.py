"""Run every ``benchmarks/bench_*.py`` side by side and write ``benchmarks/RESULTS.md``.

    scripts/dev bench            # all benchmarks (the numbers in RESULTS.md)
    scripts/dev bench --quick    # smaller sizes, for a smoke run
    scripts/dev bench lyapunov   # only modules whose name contains "lyapunov" (printed, RESULTS.md kept)
    scripts/dev bench --update pymc   # ... and their sections replaced in RESULTS.md
    scripts/dev bench --cold     # cold / warm compile times in fresh subprocesses (bench_compile),
                                 # its section replaced in RESULTS.md

``bench_compile`` (cold compiles: minutes of CPU) runs only with ``--cold`` or when named.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pkgutil
import platform
import re
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
    parser.add_argument("--update", action="store_true",
                        help="with a subset: replace (or add) its sections in RESULTS.md, keep the others")
    parser.add_argument("--cold", action="store_true",
                        help="cold and warm compile times, each in a fresh subprocess (benchmarks/bench_compile.py); "
                             "updates its section of RESULTS.md")
    args = parser.parse_args(argv)
    if args.cold:
        args.only, args.update = [*args.only, "bench_compile"], True

    warnings.simplefilter("ignore")
    import numba
    import pytensor

    import iterops

    modules = sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))
    if args.only:
        modules = [m for m in modules if any(s in m for s in args.only)]
    else:
        modules = [m for m in modules if m != "bench_compile"]
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
    if args.only and args.update:
        print("\n".join(body))
        stamp = (f"_Regenerated on {datetime.datetime.now():%Y-%m-%d %H:%M} with `scripts/dev bench "
                 f"{'--cold' if args.cold else '--update ' + ' '.join(args.only)}`"
                 + (" (--quick)" if args.quick else "") + "._")
        update_sections(Path(args.output), [s.to_markdown() for s in sections], stamp)
        print(f"updated {len(sections)} section(s) of {args.output}")
    elif args.only:
        print("\n".join(body))
        print("(subset run: RESULTS.md not rewritten; --update replaces its sections)")
    else:
        out = Path(args.output)
        old = out.read_text() if out.exists() else ""
        out.write_text("\n".join(header + body))
        # the cold-compile section comes from `--cold` runs only: keep it
        kept = re.search(r"^## Compile time: cold.*?(?=^## |\Z)", old, flags=re.S | re.M)
        if kept:
            out.write_text(out.read_text().rstrip("\n") + "\n\n" + kept.group(0))
        print(f"wrote {args.output}")
    return 1 if failures else 0


def update_sections(path: Path, sections: list[str], stamp: str) -> None:
    """Replace the sections of ``path`` whose ``## title`` line matches one of ``sections`` (append the
    others), each preceded by ``stamp``; the rest of the file is kept as it is."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    for md in sections:
        title = md.splitlines()[0]
        block = f"{title}\n\n{stamp}" + md[len(title):]
        lines = text.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == title), None)
        if start is None:
            text = text.rstrip("\n") + "\n\n" + block
            continue
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        text = "".join(lines[:start]) + block + ("\n" if end < len(lines) else "") + "".join(lines[end:])
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
