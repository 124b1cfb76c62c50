"""Loop recognition: what iterops' Scan-fusion rewrite adds to a compile, and what its disk cache saves.

    scripts/dev bench --update recognition    # runs this module and writes its section into RESULTS.md

The rewrite's CPU (``FuseScan.transform``) inside ``nutpie.compile_pymc_model`` of the pymc-extras structural
model and inside compiles of near misses (a user's loop like a pattern's that no pattern matches), on a first run
and a re-run in a new process (the matcher's disk cache, :mod:`iterops.fusion.cache`), against the compile
without iterops.  Numba's and PyTensor's caches are the machine's (warm).
"""

from __future__ import annotations

import os
import tempfile
import textwrap

from benchmarks._harness import Section, Target, child_result

#: processes per median row
REPEAT = 3


#: a child process: ``argv[1]`` the matcher's disk cache folder; CPU seconds of the compile ``{build}`` and of
#: ``FuseScan.transform`` in it (outermost calls; every other cache is the machine's, warm)
_RECOGNITION = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np, pytensor, pytensor.tensor as pt
import iterops
from iterops.fusion import cache, rewrite
cache.DIRECTORY, cache._DIGEST = sys.argv[1], sys.argv[2]  # the parent's sources, even if edited meanwhile
spent, depth = [0.0], [0]
transform = rewrite.FuseScan.transform
def timed(self, fgraph, node, enforce_tracks=True):
    if depth[0]:
        return transform(self, fgraph, node, enforce_tracks)
    depth[0] += 1
    t = time.process_time()
    try:
        return transform(self, fgraph, node, enforce_tracks)
    finally:
        spent[0] += time.process_time() - t
        depth[0] -= 1
rewrite.FuseScan.transform = timed
t0 = time.process_time()
{build}
total = time.process_time() - t0
print("RESULT " + json.dumps({{"total": total, "fusion": spent[0], "stats": dict(cache.STATS)}}))
"""

_STRUCTURAL_NUTPIE = """
import nutpie
from benchmarks.bench_fusion import _structural_model
model = _structural_model(240)
t0 = time.process_time()
nutpie.compile_pymc_model(model)
"""

#: near misses: a user's loop like a pattern's that no pattern matches (compiled with value and gradient)
_NEAR_MISSES = {
    "Kalman-like (T^T P T predict)": """
def step(y, a, P, T, Z, R, H, Q):
    v = y - Z @ a
    F = Z @ P @ Z.T + H
    K = P @ Z.T @ pt.linalg.inv(F)
    P_f = P - K @ Z @ P
    ll = -0.5 * (pt.log(pt.linalg.det(F)) + v @ pt.linalg.inv(F) @ v)
    return T @ (a + K @ v), T.T @ P_f @ T + R @ Q @ R.T, ll
y, T, Z, R, H, Q, P0 = (pt.dmatrix(n) for n in "yTZRHQP")
a0 = pt.dvector("a0")
_, _, ll = pytensor.scan(step, sequences=[y], outputs_info=[a0, P0, None], non_sequences=[T, Z, R, H, Q],
                         return_updates=False)
ins, cost = [y, a0, P0, T, Z, R, H, Q], ll.sum()
outs = [cost, *pytensor.grad(cost, [T, H, Q])]
""",
    "Levinson-like (v (1 + kappa^2))": """
def step(k, phi, v, gamma):
    kappa = (gamma[k + 1] - pt.sum(phi[:k] * gamma[1:k + 1][::-1])) / v
    new_phi = pt.set_subtensor(phi[:k], phi[:k] - kappa * phi[:k][::-1])
    return pt.set_subtensor(new_phi[k], kappa), v * (1 + kappa**2), kappa
gamma = pt.dvector("gamma")
phis, vs, _ = pytensor.scan(step, sequences=[pt.arange(3)], outputs_info=[pt.zeros(3), gamma[0], None],
                            non_sequences=[gamma], return_updates=False)
ins, cost = [gamma], phis[-1].sum() + vs[-1]
outs = [cost, pytensor.grad(cost, gamma)]
""",
}
_COMPILE = """
mode = pytensor.compile.mode.get_default_mode()
f = pytensor.function(ins, outs, mode=mode.excluding("iterops") if {without} else mode)
"""


def _recognition_run(build: str, folder: str) -> dict:
    code = _RECOGNITION.format(build=textwrap.indent(textwrap.dedent(build), ""))
    from iterops.fusion import cache  # noqa: PLC0415

    return child_result(code, folder, cache.digest(), what="recognition benchmark subprocess")


def _hits(r: dict) -> str:
    stats = r["stats"]
    count = lambda what: sum(v for k, v in stats.items() if k.endswith(what))  # noqa: E731
    return f"{count(' hit')} / {count(' miss')}"


def _median_run(build: str, folder: str, repeat: int = REPEAT) -> dict:
    """The run of median compile CPU of ``repeat`` new processes (a single process's compile moves by 30% here
    with the machine's load)."""
    runs = sorted((_recognition_run(build, folder) for _ in range(repeat)), key=lambda r: r["total"])
    return runs[len(runs) // 2]


def run(quick: bool = False) -> list[Section]:
    """Loop recognition's share of compiles, first run and re-run (each a new process; Numba and PyTensor
    caches warm, the matcher's disk cache fresh for the first run)."""
    load = os.getloadavg()[0]
    section = Section(
        title="Loop recognition: the Scan-fusion rewrite's share of compiles, first run and re-run",
        columns=["compile", "run", "compile CPU (s)", "of which loop recognition (s)", "share",
                 "compile / without iterops", "matcher disk cache: hits / misses"],
        notes=("Each row a new process; Numba's and PyTensor's caches warm. *first run*: the matcher's disk cache "
               "(`iterops.fusion.cache`) empty for this loop (for the near misses: the reference steps cached "
               "by the structural model's first run, as on a machine where iterops has matched something "
               "before); *re-run*: the same model again, the cache filled by the first run. Loop recognition = "
               "CPU in `FuseScan.transform`. *without iterops*: `mode.excluding(\"iterops\")`. The near misses' "
               f"*without iterops* and *re-run* rows are the median of {REPEAT} processes each (one process's "
               "compile of about a second moves by 30% with the load). "
               f"1-minute load average at the start: {load:.1f} on {os.cpu_count()} cores. "
               "Regenerate: `scripts/dev bench --update recognition`."),
    )
    with tempfile.TemporaryDirectory(prefix="iterops-fusion-") as folder:
        runs = {}
        for run_name in ("first run", "re-run"):
            r = runs[run_name] = _recognition_run(_STRUCTURAL_NUTPIE, folder)
            section.rows.append(["pymc-extras structural model (13 states, n = 240), nutpie.compile_pymc_model",
                                 run_name, r["total"], r["fusion"], r["fusion"] / r["total"], "-", _hits(r)])
        rerun = runs["re-run"]
        section.targets += [
            Target("structural re-run: compile / loop recognition (share <= 5%)", rerun["total"] / rerun["fusion"], 20.0),
            Target("structural re-run: 0.2 s / loop recognition (s)", 0.2 / rerun["fusion"], 1.0),
        ]
        for name, build in _NEAR_MISSES.items():
            without = _median_run(build + _COMPILE.format(without=True), folder)
            section.rows.append([f"near miss: {name}", "without iterops", without["total"], 0.0, 0.0, 1.0, "-"])
            with_iterops = build + _COMPILE.format(without=False)
            for run_name, r in (("first run", _recognition_run(with_iterops, folder)),
                                ("re-run", _median_run(with_iterops, folder))):
                section.rows.append([f"near miss: {name}", run_name, r["total"], r["fusion"], r["fusion"] / r["total"],
                                     r["total"] / without["total"], _hits(r)])
            section.targets.append(Target(f"near miss {name}, re-run: 1.2 x without / with",
                                          1.2 * without["total"] / r["total"], 1.0))
    return [section]


if __name__ == "__main__":
    for s in run():
        print(s.to_markdown())
