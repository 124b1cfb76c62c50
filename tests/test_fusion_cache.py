"""The matcher's memo (:mod:`iterops.fusion.cache`): the same verdicts as matching without it.

Oracle: the matcher itself on its first run (in-process memos cleared, an empty disk cache), which computes
everything.  Each loop (every pattern's reference loop from the fuzzer's harnesses, and mutants that stay
Scans) is matched twice: uncached, and from the disk cache the first run filled with the in-process memos
cleared (a new process); the match (pattern, variant, bound outer variables, uses) or the rejections
(pattern, reason, score) must be the same.  Work is counted (canonicalizations, cache hits),
never timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.fg import FunctionGraph
from pytensor.scan.op import Scan

import iterops
from iterops import reference_loops as ref
from iterops.fusion import PATTERNS, cache, canonical, matcher, unify
from test_fusion_fuzz import GRAPH_MUTATIONS, HARNESSES, NotApplicable, _is_invalid, mutated

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """The disk cache in a fresh folder, in-process memos cleared before and after; counters reset."""
    monkeypatch.setattr(cache, "DIRECTORY", tmp_path)
    monkeypatch.setattr(cache, "enabled", True)
    cache.STATS.clear()
    matcher.forget()
    yield tmp_path
    matcher.forget()


@pytest.fixture
def canonicalizations(monkeypatch):
    """Counts calls of the canonicalizer (user steps and reference steps)."""
    calls = []
    orig = canonical._canonicalize

    def counted(fg):
        calls.append(fg)
        return orig(fg)

    monkeypatch.setattr(canonical, "_canonicalize", counted)
    monkeypatch.setattr(unify, "_canonicalize", counted)
    return calls


def _scans(outputs):
    fg = FunctionGraph(outputs=list(outputs), clone=True, copy_inputs=False)
    return fg, [n for n in fg.toposort() if isinstance(n.op, Scan)]


def _summary(fg, node):
    """What :func:`match_scan` decided for ``node``, as plain data (bound outer variables by their position
    among the Scan node's inputs, or their value for constants)."""
    match, rejections = matcher.match_scan(fg, node, PATTERNS.values())
    if match is None:
        return ("kept", [(name, str(r), r.score) for name, r in rejections])
    where = {v: i for i, v in enumerate(node.inputs)}

    def outer(v):
        if v in where:
            return ("input", where[v])
        data = getattr(v, "data", None)
        return ("constant", np.asarray(data).tolist()) if data is not None else ("other", str(v))

    return ("fused", match.pattern.name, match.variant, sorted((k, outer(v)) for k, v in match.outer.items()),
            sorted((k, [kind for _, kind in u]) for k, u in match.uses.items()), sorted(match.time_varying))


def _two_ways(outputs, folder):
    """Summaries of every Scan of ``outputs``: uncached (every in-process memo cleared, an empty disk cache in
    ``folder``, which this run fills), then read from the disk cache with every in-process memo cleared; and
    the number of verdicts the second run read from disk."""
    fg, nodes = _scans(outputs)
    cache.DIRECTORY = folder
    matcher.forget()
    uncached = [_summary(fg, n) for n in nodes]
    matcher.forget()
    hits_before = cache.STATS["verdict hit"]
    read = [_summary(fg, n) for n in nodes]
    return uncached, read, cache.STATS["verdict hit"] - hits_before


#: patterns whose reference steps take seconds to canonicalize: their harness loop only (the near-miss
#: test below covers a Kalman mutant)
_COSTLY = {"kalman_textbook", "kalman_textbook_filtered", "kalman_pymc_extras"}


def _loops():
    """Every pattern's harness loop, and for the cheaper ones a mutant (the first applicable mutation)."""
    for name, h in sorted(HARNESSES.items()):
        yield name, "none", h.build(h.step, None, 0)[1]
        found = 0
        for kind in sorted(GRAPH_MUTATIONS):
            if found == (0 if name in _COSTLY else 1):
                break
            try:
                yield name, kind, h.build(mutated(h.step, kind, 1), None, 1)[1]
                found += 1
            except NotApplicable:
                continue
            except Exception as err:  # noqa: BLE001
                if not _is_invalid(err):
                    raise


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_cached_verdicts_equal_uncached_ones(disk, name):
    """For the reference loop (and a mutant) of each pattern: the same match or rejections, uncached and read
    from the disk cache."""
    checked = 0
    for pattern, kind, outputs in _loops():
        if pattern != name:
            continue
        uncached, read, hits = _two_ways(outputs, disk / kind)
        assert read == uncached, (kind, read, uncached)
        assert hits > 0, "the third run did not read the disk cache"
        if kind == "none":
            assert uncached[0][0] == "fused", uncached  # the harness loop is recognized
        checked += 1
    assert checked >= (1 if name in _COSTLY else 2)


def test_a_second_run_canonicalizes_nothing(disk, canonicalizations):
    """With the disk cache filled, matching the textbook Kalman filter again (a new process's state) neither
    canonicalizes a step nor unifies it, and finds the same match."""
    h = HARNESSES["kalman_textbook"]
    outputs = h.build(h.step, None, 0)[1]
    fg, (node,) = _scans(outputs)
    first = _summary(fg, node)
    assert first[0] == "fused" and canonicalizations
    matcher.forget()
    canonicalizations.clear()
    cache.STATS.clear()
    assert _summary(fg, node) == first
    assert canonicalizations == []
    assert cache.STATS["unified hit"] >= 1 and cache.STATS["verdict miss"] == 0, dict(cache.STATS)


def _textbook_with(op):
    def step(y, a, P, T, Z, R, H, Q, log2pi_p):
        v = y - Z @ a
        F = Z @ P @ Z.T + H
        K = P @ Z.T @ pt.linalg.inv(F)
        a_f = a + K @ v
        P_f = op(P, K @ Z @ P)  # the textbook's P - K Z P, or another operation
        ll = -0.5 * (log2pi_p + pt.log(pt.linalg.det(F)) + v @ pt.linalg.inv(F) @ v)
        return T @ a_f, T @ P_f @ T.T + R @ Q @ R.T, ll

    return HARNESSES["kalman_textbook"].build(step, None, 0)[1]


def test_an_edited_step_misses(disk):
    """A step with one Op changed has another key: it is matched afresh (and kept), not given the cached
    verdict of the step it came from."""
    fg, (node,) = _scans(_textbook_with(lambda a, b: a - b))
    assert _summary(fg, node)[0] == "fused"
    fg2, (node2,) = _scans(_textbook_with(lambda a, b: a + b))
    assert cache.step_key(node2.op) != cache.step_key(node.op)
    cache.STATS.clear()
    kept = _summary(fg2, node2)
    assert kept[0] == "kept" and cache.STATS["verdict hit"] == 0 and cache.STATS["verdict miss"] >= 1, kept


def _step_key(out):
    return cache.step_key(next(n.op for n in pytensor.graph.traversal.apply_ancestors([out])
                               if isinstance(n.op, Scan)))


def test_equal_steps_share_a_key_in_another_process(disk):
    """:func:`step_key` is the same for the same loop built in another process (no addresses, no salted
    hashes), and differs for another constant."""
    code = """
        import pytensor.tensor as pt, iterops
        from iterops import reference_loops as ref
        from iterops.fusion import cache
        A, Q = pt.matrix("A"), pt.matrix("Q")
        from pytensor.graph.traversal import apply_ancestors
        from pytensor.scan.op import Scan
        out = ref.doubling_loop(A, Q)
        print("KEY", cache.step_key(next(n.op for n in apply_ancestors([out]) if isinstance(n.op, Scan))))
    """
    A, Q = pt.matrix("A"), pt.matrix("Q")
    here = _step_key(ref.doubling_loop(A, Q))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert here is not None and f"KEY {here}" in out
    assert _step_key(ref.doubling_loop(A, Q)) == here  # built again
    assert _step_key(ref.doubling_loop(A, Q, tol=1e-11)) != here  # another constant


def test_a_corrupt_cache_is_ignored(disk):
    """Truncated, garbage and empty files count as misses: the verdicts are recomputed, the same."""
    h = HARNESSES["levinson_durbin"]
    fg, nodes = _scans(h.build(h.step, None, 0)[1])
    want = [_summary(fg, n) for n in nodes]
    files = sorted(p for p in disk.rglob("*.pkl"))
    assert files
    for i, p in enumerate(files):
        p.write_bytes([b"", b"garbage", p.read_bytes()[: len(p.read_bytes()) // 2]][i % 3])
    matcher.forget()
    cache.STATS.clear()
    assert [_summary(fg, n) for n in nodes] == want
    assert cache.STATS["verdict miss"] >= 1 and cache.STATS["verdict hit"] == 0, dict(cache.STATS)


def test_an_unwritable_cache_is_ignored(disk, monkeypatch):
    """A cache folder that cannot be created: nothing stored, the same verdicts."""
    blocker = disk / "file"
    blocker.write_text("")
    monkeypatch.setattr(cache, "DIRECTORY", blocker)  # a file: its sub-folder cannot be made
    h = HARNESSES["block_diag_indexed"]
    fg, nodes = _scans(h.build(h.step, None, 0)[1])
    assert _summary(fg, nodes[0])[0] == "fused"
    assert cache.STATS["verdict store"] == 0


_CHILD = """
import json, sys
import pytensor, pytensor.tensor as pt
import iterops
from iterops import reference_loops as ref
from iterops.fusion import cache, canonical, unify
cache.DIRECTORY, cache._DIGEST = sys.argv[1], sys.argv[2]
calls = []
orig = canonical._canonicalize
canonical._canonicalize = unify._canonicalize = lambda fg: (calls.append(1), orig(fg))[1]
A, Q = pt.matrix("A"), pt.matrix("Q")
gamma = pt.vector("gamma")
outs = iterops.fuse_loops([ref.doubling_loop(A, Q), *ref.levinson_loop(gamma, 3)[:2]])
ops = sorted({type(getattr(n.op, "core_op", n.op)).__name__ for n in pytensor.graph.traversal.applys_between(
    [A, Q, gamma], outs)})
print("RESULT " + json.dumps({"canonicalizations": len(calls), "stats": dict(cache.STATS), "ops": ops}))
"""


def test_a_new_process_reuses_the_disk_cache(disk):
    """Two processes compile the same loops: the second canonicalizes nothing and fuses the same."""
    def child():
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(disk), cache.digest()], cwd=ROOT,
                              capture_output=True, text=True, check=True)
        return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])

    first, second = child(), child()
    assert first["canonicalizations"] > 0 and "Scan" not in first["ops"], first
    assert second["canonicalizations"] == 0, second
    assert second["ops"] == first["ops"]
    assert second["stats"].get("verdict hit", 0) >= 2 and "verdict miss" not in second["stats"], second


def test_a_near_miss_stays_a_scan_with_the_same_reason(disk):
    """A near miss (the textbook filter with ``P + K Z P``) read from the disk cache: still a Scan, and
    ``explain`` gives the reason it gave uncached."""
    outputs = _textbook_with(lambda a, b: a + b)
    want = str(iterops.explain(outputs))  # the first run: computes, fills the cache
    assert "kept as a Scan" in want and "kalman_textbook" in want
    matcher.forget()
    cache.STATS.clear()
    assert str(iterops.explain(outputs)) == want
    assert cache.STATS["verdict hit"] >= 1, dict(cache.STATS)
    assert _scans(iterops.fuse_loops(outputs))[1], "the near miss was replaced"


def test_the_digest_covers_sources_and_versions(monkeypatch):
    """Another iterops source tree (an edited pattern), or another PyTensor, gives another cache folder."""
    import iterops._fused

    monkeypatch.setattr(cache, "_DIGEST", None)
    base = cache.digest()
    for patch in ((iterops._fused, "package_digest", lambda **kw: "edited sources"),
                  (pytensor, "__version__", "0.0.0")):
        with monkeypatch.context() as m:
            m.setattr(*patch)
            m.setattr(cache, "_DIGEST", None)
            assert cache.digest() != base, patch[1]
    src = ROOT / "iterops" / "fusion" / "patterns" / "levinson.py"
    assert src.read_bytes() in b"".join(p.read_bytes() for p in (ROOT / "iterops").rglob("*.py"))
