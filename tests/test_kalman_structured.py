"""The structured path of iterops.ts.kalman_filter: products with T and Z that skip their zero
entries (shift, companion, identity blocks, zero columns), forward and adjoint.

Oracles: NumPy's dense products (the helpers), statsmodels' KalmanSmoother (filter and smoother
outputs, static, time-varying, missing data), the dense step-by-step NumPy filter with
pymc-extras' arithmetic (jitter), PyTensor autodiff of pymc-extras' ``StandardFilter`` Scan
(compiled without iterops' rewrites), finite differences (verify_grad), and the dense recursion's
own non-finite arithmetic (``0 * inf = NaN``) for the failure cases.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.gradient import verify_grad
from statsmodels.tsa.statespace.sarimax import SARIMAX
from statsmodels.tsa.statespace.structural import UnobservedComponents
from statsmodels.tsa.statespace.varmax import VARMAX
from test_kalman import FIELDS, assert_close, kf, ks, model_args, sm_outputs, statsmodels_results, symbolic_inputs
from test_kalman_steady import assert_loglik_grads_close, call_filter, dense_filter, gradient_fns
from test_kalman_steady import symbolic_inputs as plain_inputs

from conftest import SCAN_ORACLE

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from iterops._linalg_kernels import (
    all_finite, matmul, nonzero_index, spmm, spmm_rows, sym_finite, sym_into, transpose_finite,
)
from iterops.ts._kalman_steps import _sparse_congruence, _triangle_test

#: graphs compiled without a mode run by perform under NUMBA mode's rewrites (tests/conftest.py, ``_python_run``)
pytestmark = pytest.mark.python_run

INPUTS = ("y", "a0", "P0", "c", "d", "T", "Z", "R", "H", "Q")


# ---------------------------------------------------------------------------
# the helpers, against NumPy
# ---------------------------------------------------------------------------


def sparse_matrix(rng, n, m, density):
    X = rng.normal(size=(n, m))
    X[rng.random(size=(n, m)) > density] = 0.0
    return X


@pytest.mark.parametrize("density", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(3, 4, 5), (13, 13, 13), (12, 1, 12)])
def test_spmm_matches_dense_product(rng, density, shape):
    n, k, m = shape
    X = sparse_matrix(rng, n, k, density)
    Y = rng.normal(size=(k, m))
    idx = np.empty((n, k + 1), dtype=np.int64)
    nonzero_index(X, idx)
    for alpha, beta in [(1.0, 0.0), (-2.0, 1.0), (0.5, 0.3)]:
        out0 = rng.normal(size=(n, m))
        out = out0.copy()
        total = spmm(X, idx, Y, out, alpha, beta)
        np.testing.assert_allclose(out, alpha * X @ Y + beta * out0, rtol=1e-13, atol=1e-13)
        assert np.isfinite(total)
        if density > 0:  # an infinite entry of Y on a nonzero of X: an infinite product, said by the result
            Yinf = Y.copy()
            Yinf[np.flatnonzero(X.any(axis=0))[0], 0] = np.inf
            assert not np.isfinite(spmm(X, idx, Yinf, out0.copy(), alpha, beta))
    # transposed views: operand, other factor and output
    idx_t = np.empty((k, n + 1), dtype=np.int64)
    nonzero_index(np.ascontiguousarray(X.T), idx_t)
    out = np.empty((m, k)).T  # a (k, m) view
    Y2 = rng.normal(size=(m, n))
    spmm(X.T, idx_t, Y2.T, out)
    np.testing.assert_allclose(out, X.T @ Y2.T, rtol=1e-13, atol=1e-13)


# entries a filter meets: ordinary, huge (their sum overflows), tiny, zero, and not finite
_ENTRIES = st.one_of(
    st.floats(-1e3, 1e3), st.sampled_from([1e308, -1e308, 5e-324, 0.0, -0.0, np.inf, -np.inf, np.nan]),
)


@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=16), elements=_ENTRIES))
def test_finiteness_and_symmetrization_match_numpy(X):
    """``all_finite`` is NumPy's ``isfinite(X).all()`` exactly (huge finite entries whose sum overflows
    included); ``sym_into``/``sym_finite`` give ``(X + X^T) / 2``, exactly symmetric, and its finiteness."""
    assert all_finite(X) == np.isfinite(X).all()
    assert all_finite(np.asfortranarray(X)) == np.isfinite(X).all()
    S = X[:, : min(X.shape)][: min(X.shape)]
    S = np.ascontiguousarray(S)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = 0.5 * (S + S.T)
    out = np.empty_like(S)
    sym_into(S, out)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(out, out.T)
    out2 = np.empty_like(S)
    assert sym_finite(S, out2) == np.isfinite(expected).all()
    np.testing.assert_array_equal(out2, expected)


@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=16), elements=_ENTRIES))
def test_transpose_finite_matches_numpy(X):
    """``transpose_finite`` copies X^T and says whether X is finite (NumPy's ``isfinite(X).all()``)."""
    S = np.ascontiguousarray(X[: min(X.shape), : min(X.shape)])
    out = np.empty_like(S)
    assert transpose_finite(S, out) == np.isfinite(S).all()
    np.testing.assert_array_equal(out, S.T)


@pytest.mark.parametrize("density", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("m", [1, 5, 13])
def test_spmm_rows_matches_numpy(rng, density, m):
    """``spmm_rows`` (the product over X's nonzeros, no finiteness test) is the dense product to rounding,
    with ``alpha`` scaling it."""
    X = sparse_matrix(rng, m, m, density)
    Y = rng.normal(size=(m, m))
    idx = np.empty((m, m + 1), dtype=np.int64)
    nonzero_index(X, idx)
    out = np.full((m, m), 7.0)
    spmm_rows(X, idx, Y, out, -1.0)
    np.testing.assert_allclose(out, -X @ Y, rtol=1e-13, atol=1e-13)
    full = np.empty((m, m))
    spmm_rows(X, idx, Y, full)
    np.testing.assert_allclose(full, X @ Y, rtol=1e-13, atol=1e-13)


@given(
    X=hnp.arrays(np.float64, (5, 5), elements=_ENTRIES),
    scale=st.sampled_from([1.0, 1e-300, 1e300]),
    change=st.sampled_from([0.0, 1e-15, 0.9e-14, 1.1e-14, 1e-13, 1.0, np.nan, np.inf]),
    where=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    test=st.booleans(),
)
def test_triangle_test_matches_numpy(X, scale, change, where, test):
    """The forward's steady-state test (dense path): ``(P' finite, max|P' - P_old| <= 1e-14 max|P'|)`` as NumPy
    computes it for the symmetric P' and P_old (the test is False unless asked, or when P' is not finite: the
    next step fails whatever it says)."""
    with np.errstate(over="ignore", invalid="ignore"):
        P_new = np.triu(X * scale) + np.triu(X * scale, 1).T  # symmetric, entries of every kind
        P_old = P_new.copy()
        i, j = where
        P_old[i, j] = P_old[j, i] = P_new[i, j] + change * np.max(np.abs(P_new))
        finite = bool(np.isfinite(P_new).all())
        converged = test and finite and bool(np.max(np.abs(P_new - P_old)) <= 1e-14 * np.max(np.abs(P_new)))
    work = P_new.copy()
    assert _triangle_test(work, P_old, test) == (finite, converged)
    np.testing.assert_array_equal(work, P_new)


@given(
    rows=st.lists(st.sampled_from(["zero", "one", "shift", "scaled", "two", "dense"]), min_size=1, max_size=14),
    scale=st.sampled_from([1.0, 1e-300, 1e150, 1e300]),
    change=st.sampled_from([0.0, 0.9e-14, 1.1e-14, 1.0]),
    test=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sparse_congruence_matches_numpy(rows, scale, change, test, seed):
    """The forward's second product with T: ``P' = T W^T + RQR`` (W = T P_f) on the upper triangle, mirrored,
    over T's nonzeros, reading W's columns in place, for rows of T of every kind (zero, one nonzero of 1, a
    shifted 1, one scaled entry, two, dense).  P' matches NumPy's product to rounding, is exactly symmetric and
    is bitwise what the product with W's transposed copy gave (``spmm_rows``' upper triangle, plus RQR,
    mirrored); the returned ``(finite, converged)`` are NumPy's tests of that P' (P_f's entries up to 1e300;
    a W that is not finite is the caller's dense case, not this function's)."""
    rng = np.random.default_rng(seed)
    m = len(rows)
    T = np.zeros((m, m))
    for i, kind in enumerate(rows):
        if kind == "one":
            T[i, i] = 1.0
        elif kind == "shift":
            T[i, (i - 1) % m] = 1.0
        elif kind == "scaled":
            T[i, rng.integers(m)] = rng.normal() * 3.0
        elif kind == "two":
            T[i, rng.choice(m, min(2, m), replace=False)] = rng.normal(size=min(2, m))
        elif kind == "dense":
            T[i] = -1.0
    A = rng.normal(size=(m, m))
    Pf = (A @ A.T) * scale
    idx = np.empty((m, m + 1), dtype=np.int64)
    nonzero_index(T, idx)
    W = np.empty((m, m))
    spmm_rows(T, idx, Pf, W)
    if not np.isfinite(W).all():  # the caller takes the dense product then
        return
    RQR = np.diag(rng.random(m))
    with np.errstate(over="ignore", invalid="ignore"):
        dense = T @ W.T + RQR
        P_old = np.triu(dense) + np.triu(dense, 1).T
        P_old[0, -1] = P_old[-1, 0] = P_old[0, -1] + change * np.max(np.abs(P_old))
    P_new = np.full((m, m), 5.0)
    finite, converged = _sparse_congruence(T, idx, W, RQR, P_new, P_old, test)
    with np.errstate(over="ignore", invalid="ignore"):
        assert finite == bool(np.isfinite(P_new).all())
        # the per-entry steady-state test: |dP_ij| <= 1e-14 sqrt|P_ii| sqrt|P_jj| (the diagonal: 1e-14 |P_ii|)
        d = np.abs(np.diag(P_new))
        bound = (1e-14 * np.sqrt(d))[:, None] * np.sqrt(d)[None, :]
        np.fill_diagonal(bound, 1e-14 * d)
        upper = np.triu_indices(m)
        expected = test and finite and bool(np.all((np.abs(P_new - P_old) <= bound)[upper]))
        assert converged == expected
        np.testing.assert_array_equal(P_new, P_new.T)
        if finite:
            upper = np.triu(np.ones((m, m), dtype=bool))
            np.testing.assert_allclose(P_new[upper], dense[upper], rtol=1e-12, atol=1e-12 * np.max(np.abs(P_new)))
    # bitwise the product with W's transposed copy (its upper triangle) plus RQR, mirrored
    before = np.empty((m, m))
    spmm_rows(T, idx, np.ascontiguousarray(W.T), before)
    with np.errstate(over="ignore", invalid="ignore"):
        before = np.triu(before) + RQR
    np.testing.assert_array_equal(P_new, np.triu(before) + np.triu(before, 1).T)


@pytest.mark.parametrize("shape", [(3, 4, 5), (14, 1, 14), (14, 14, 1), (1, 14, 14), (40, 2, 40), (14, 14, 14)])
def test_matmul_matches_numpy(rng, shape):
    """The loops (up to SMALL**3 multiply-adds: small or thin products) and BLAS (above), with transposed views."""
    n, k, m = shape
    X, Y = rng.normal(size=(n, k)), rng.normal(size=(k, m))
    for alpha, beta in [(1.0, 0.0), (-2.0, 1.0), (0.5, 0.3)]:
        out0 = rng.normal(size=(n, m))
        out = out0.copy()
        matmul(X, Y, out, alpha, beta)
        np.testing.assert_allclose(out, alpha * X @ Y + beta * out0, rtol=1e-13, atol=1e-13)
    out = np.empty((m, n)).T  # a (n, m) view
    matmul(np.ascontiguousarray(X.T).T, np.ascontiguousarray(Y.T).T, out)
    np.testing.assert_allclose(out, X @ Y, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("m", [11, 14])
def test_matmul_blas_writes_out_directly_unless_it_aliases_an_operand(rng, m):
    """Above SMALL**3 multiply-adds, alpha = 1 and beta = 0, BLAS writes ``out`` directly for whole operands or
    their transposes; an ``out`` sharing memory with an operand (gemm's output must not alias its inputs)
    takes the product into a new array first.  Oracle: NumPy's product of copies."""
    X, Y = rng.normal(size=(m, m)), rng.normal(size=(m, m))
    for a, b in [(X, Y), (X.T, Y), (X, Y.T), (X.T, Y.T)]:
        out = np.empty((m, m))
        matmul(a, b, out)
        np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b), rtol=1e-13, atol=1e-13)
    for how in ("X", "Y", "both", "X.T"):  # out is an operand, or overlaps it
        A, B = X.copy(), Y.copy()
        expected = (A @ A if how == "both" else A.T @ B if how == "X.T" else A @ B)
        args = {"X": (A, B, A), "Y": (A, B, B), "both": (A, A, A), "X.T": (A.T, B, A)}[how]
        matmul(*args)
        np.testing.assert_allclose(args[2], expected, rtol=1e-13, atol=1e-13)
    buf = rng.normal(size=(2 * m, m))  # out = the upper half of the buffer whose overlapping rows are Y
    expected = X @ buf[m // 2: m // 2 + m]
    matmul(X, buf[m // 2: m // 2 + m], buf[:m])
    np.testing.assert_allclose(buf[:m], expected, rtol=1e-13, atol=1e-13)


def test_nonzero_index_and_its_decision():
    X = np.array([[0.0, 2.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1e-300]])
    idx = np.full((4, 5), -1, dtype=np.int64)
    assert nonzero_index(X, idx)  # 4 of 16 nonzero, finite
    for i in range(4):
        cols = np.flatnonzero(X[i])
        assert idx[i, 0] == len(cols)
        np.testing.assert_array_equal(idx[i, 1:1 + len(cols)], cols)
    assert not nonzero_index(np.ones((3, 3)), np.empty((3, 4), dtype=np.int64))  # dense
    for bad in (np.nan, np.inf):  # a non-finite entry counts as nonzero and turns the structure off
        Y = X.copy()
        Y[1, 1] = bad
        assert not nonzero_index(Y, np.empty((4, 5), dtype=np.int64))
    assert all_finite(X) and not all_finite(np.array([[1.0, np.inf]])) and not all_finite(np.array([[np.nan]]))


# ---------------------------------------------------------------------------
# real model matrices
# ---------------------------------------------------------------------------


def _statsmodels_system(mod, params):
    mod.update(params)
    get = lambda name: np.array(mod.ssm[name], dtype=float)  # noqa: E731
    return dict(c=get("state_intercept").ravel(), d=get("obs_intercept").ravel(), T=get("transition"),
                Z=get("design"), R=get("selection"), H=get("obs_cov"), Q=get("state_cov"))


def structured_model(kind, n, seed=0, missing=True):
    """System matrices of a statsmodels model at fixed parameters (or a random model with block-diagonal,
    shift and zero-column structure), simulated data with gaps, known initialization."""
    rng = np.random.default_rng(seed)
    if kind == "structural":  # level + trend + seasonal(12): T mostly 0/1, Z = e_1 + e_3
        mats = _statsmodels_system(UnobservedComponents(np.zeros(n), level="lltrend", seasonal=12),
                                   [1.0, 0.1, 0.01, 0.05])
    elif kind == "sarimax":  # companion blocks
        mats = _statsmodels_system(SARIMAX(np.zeros(n), order=(2, 0, 1), seasonal_order=(1, 0, 1, 4)),
                                   [0.5, 0.2, 0.3, 0.6, -0.2, 1.0])
    elif kind == "var":  # VAR(2) of 3 variables, 5 lags' companion form would be sparser: here order 4
        A = [0.3 * np.eye(3) + 0.05 * rng.normal(size=(3, 3)) for _ in range(4)]
        chol = [1.0, 0.2, 0.8, 0.1, 0.1, 0.7]
        mats = _statsmodels_system(VARMAX(np.zeros((n, 3)), order=(4, 0), trend="n"),
                                   [*(0.5 * np.concatenate(A, axis=1)).ravel(), *chol])
    else:  # "blocks": two random dense blocks, a shift block, an observed-nowhere state, p = 2
        m = 9
        T = np.zeros((m, m))
        T[:2, :2] = 0.5 * rng.normal(size=(2, 2))
        T[2:4, 2:4] = 0.5 * rng.normal(size=(2, 2))
        T[5:8, 4:7] = np.eye(3)
        T[4, 4:8] = [0.4, -0.2, 0.1, 0.05]
        T[8, 8] = 0.9
        Z = np.zeros((2, m))
        Z[0, [0, 2, 4]] = rng.normal(size=3)
        Z[1, [1, 5]] = rng.normal(size=2)
        R = np.zeros((m, 3))
        R[0, 0], R[2, 1], R[4, 2] = 1.0, 1.0, 1.0
        mats = dict(c=0.1 * rng.normal(size=m), d=0.3 * rng.normal(size=2), T=T, Z=Z, R=R,
                    H=np.array([[0.5, 0.1], [0.1, 0.4]]), Q=np.diag([0.3, 0.2, 0.5]))
    m, p = mats["T"].shape[0], mats["Z"].shape[0]
    y = rng.normal(size=(n, p))
    if missing:
        y[3, 0] = np.nan
        y[n // 2, :] = np.nan
        y[n // 2 + 7:n // 2 + 9, -1] = np.nan
    return dict(y=y, a0=0.1 * rng.normal(size=m), P0=10.0 * np.eye(m), **mats)


KINDS = ["structural", "sarimax", "var", "blocks"]


def test_models_are_structured():
    """The cases below do take the structured path: T (and Z) finite and at most half nonzero."""
    for kind in KINDS:
        model = structured_model(kind, 10)
        m, p = model["Z"].shape[1], model["Z"].shape[0]
        assert nonzero_index(model["T"], np.empty((m, m + 1), dtype=np.int64)), kind
        assert nonzero_index(model["T"].T, np.empty((m, m + 1), dtype=np.int64)), kind
        if kind != "var":
            assert nonzero_index(model["Z"], np.empty((p, m + 1), dtype=np.int64)), kind


@pytest.fixture(scope="module")
def filter_fns():
    """Filter + smoother, static and with time-varying T, Z; compiled once."""
    fns = {}
    for tv in [(), ("T", "Z")]:
        ins = symbolic_inputs({}, tv)
        fns[tv] = pytensor.function(ins, [*kf(ins, time_varying=tv), *ks(ins, time_varying=tv)])
    return fns


@pytest.mark.parametrize("kind", KINDS)
def test_structured_models_match_statsmodels(filter_fns, kind):
    model = structured_model(kind, 60)
    out = filter_fns[()](*model_args(model))
    expected = sm_outputs(statsmodels_results(model))
    for name, value in zip([*FIELDS, "smoothed_state", "smoothed_cov"], out):
        assert_close(value, expected[name], name, rtol=1e-8, atol=1e-8)


def test_time_varying_structure_matches_statsmodels(filter_fns):
    """T and Z vary over time, and so does their structure: shift, dense and diagonal T alternate,
    Z's zero columns move; the index is rebuilt every step."""
    rng = np.random.default_rng(7)
    n = 30
    base = structured_model("blocks", n, seed=2)
    m, p = base["T"].shape[0], base["Z"].shape[0]
    T = np.empty((n, m, m))
    Z = np.zeros((n, p, m))
    for t in range(n):
        kind = t % 3
        T[t] = base["T"] if kind == 0 else (0.3 * rng.normal(size=(m, m)) / np.sqrt(m) if kind == 1
                                            else np.diag(rng.uniform(0.2, 0.9, size=m)))
        cols = rng.choice(m, size=3, replace=False)
        Z[t][:, cols] = rng.normal(size=(p, 3))
    model = dict(base, T=T, Z=Z)
    out = filter_fns[("T", "Z")](*model_args(model))
    expected = sm_outputs(statsmodels_results(model, ("T", "Z")))
    for name, value in zip([*FIELDS, "smoothed_state", "smoothed_cov"], out):
        assert_close(value, expected[name], name, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("kind", KINDS)
def test_structured_with_jitter_matches_dense_stepwise(kind):
    """pymc-extras' arithmetic (cov_jitter, -9999 sentinel next to NaN) against the dense NumPy filter."""
    model = structured_model(kind, 50, seed=3)
    ins = symbolic_inputs(model)
    fn = pytensor.function(ins, list(kf(ins, cov_jitter=1e-8, missing_value=-9999.0)), mode="FAST_COMPILE")
    y = model["y"].copy()
    y[10, 0] = -9999.0
    out = fn(*model_args(dict(model, y=y)))
    y[10, 0] = np.nan
    for name, ours, ref in zip(FIELDS, out, dense_filter(dict(model, y=y), 1e-8)):
        np.testing.assert_allclose(ours, ref, rtol=1e-8, atol=1e-8, equal_nan=True, err_msg=name)


def test_batched_structured_models_match_statsmodels():
    """A batch of two structural models (different variances: different T P T' fill-in) in one Blockwise."""
    models = [structured_model("structural", 40, seed=s) for s in (0, 1)]
    models[1]["Q"] = 2.0 * models[1]["Q"]
    models[1]["T"][0, 1] = 0.0  # a second pattern in the same batch: no trend in the level
    ins = symbolic_inputs({}, batch=1)
    fn = pytensor.function(ins, list(kf(ins)), mode="FAST_COMPILE")
    out = fn(*[np.stack([mod[k] for mod in models]) for k in INPUTS])
    for b, mod in enumerate(models):
        expected = sm_outputs(statsmodels_results(mod))
        for name, value in zip(FIELDS, out):
            assert_close(value[b], expected[name], f"{name}[{b}]", rtol=1e-8, atol=1e-8)


# ---------------------------------------------------------------------------
# non-finite values: as the dense product (0 * inf = NaN)
# ---------------------------------------------------------------------------


def _mul(A, B):
    """A @ B with every product formed (a BLAS may skip zeros: reference dgemm does)."""
    return (A[:, :, None] * B[None, :, :]).sum(axis=1)


def _dense_first_bad_F(model, steps):
    """First step whose innovation covariance F is not finite in the dense recursion (0 * inf = NaN)."""
    T, Z, R, H, Q = (model[k] for k in ("T", "Z", "R", "H", "Q"))
    P = model["P0"]
    with np.errstate(all="ignore"):
        for t in range(steps):
            F = _mul(_mul(Z, P), Z.T) + H
            if not np.isfinite(F).all():
                return t
            K = _mul(_mul(P, Z.T), np.linalg.inv(F))
            P = _mul(_mul(T, P - _mul(_mul(K, Z), P)), T.T) + R @ Q @ R.T
    return None


@pytest.mark.parametrize("case", ["inf_P0_unobserved_state", "overflowing_unobserved_state"])
def test_non_finite_propagates_as_in_the_dense_product(filter_fns, case):
    """A non-finite covariance entry of a state that Z does not see: the dense products turn it into NaN
    (0 * inf) in F, so the filter fails there (loglik_obs = -inf, NaN after); skipping the zeros would
    have hidden it.  The structured path falls back to the dense product for such steps."""
    model = structured_model("blocks", 12, missing=False)
    u = 8  # the state no row of Z reads
    assert not model["Z"][:, u].any()
    if case == "inf_P0_unobserved_state":
        model["P0"][u, u] = np.inf
    else:  # finite inputs whose covariance overflows after a few steps
        model["T"][u, u] = 1e100
        model["P0"][u, u] = 1e10
    t_fail = _dense_first_bad_F(model, 12)
    assert t_fail is not None
    ll, llo, af = filter_fns[()](*model_args(model))[:3]
    assert ll == -np.inf and llo[t_fail] == -np.inf
    assert np.isfinite(llo[:t_fail]).all() and np.isnan(llo[t_fail + 1:]).all() and np.isnan(af[t_fail:]).all()


# ---------------------------------------------------------------------------
# gradients (the cotangent of T is dense)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["structural", "blocks"])
def test_structured_gradient_matches_autodiff_of_pymc_extras(kind):
    rng = np.random.default_rng(5)
    n = 40
    model = structured_model(kind, n, seed=4)
    m = model["T"].shape[0]
    shapes = [(n,), (n, m), (n, m, m), (n, m), (n, m, m)]
    weights = [rng.normal(size=s) / np.sqrt(np.prod(s)) for s in shapes]
    fn_ours, fn_theirs = gradient_fns(1e-8)
    out_ours = fn_ours(*model_args(model), *weights)[:-1]
    out_theirs = fn_theirs(*model_args(model), *weights)
    assert_loglik_grads_close(out_ours, out_theirs)
    # a zero of T (not a parameter here, but it could be one at another draw) gets its cotangent
    assert np.count_nonzero(out_ours[5][model["T"] == 0.0]) > 0


@pytest.mark.parametrize("kind, n, wrt", [
    ("structural", 40, ("a0", "H", "Q")), ("structural", 40, ("T", "Q")), ("structural", 40, ("Z", "H")),
    ("structural", 40, ("T", "Z", "P0")), ("sarimax", 150, ("a0", "P0", "H", "Q")),  # with a steady stretch
])
def test_gradient_of_a_few_inputs_matches_autodiff_of_pymc_extras(kind, n, wrt):
    """PyMC's gradient reads the cotangents of its parameters only: here T or Z (or both) are not among them,
    and the rewrite ``kalman_unused_outputs`` has the reverse pass leave their cotangents out (T's is a dense
    m^3 product per step).  What is read matches autodiff of pymc-extras' Scan."""
    from pymc_extras.statespace.filters.kalman_filter import StandardFilter

    from iterops.ts.kalman import KalmanFilterGrad

    model = structured_model(kind, n, seed=4, missing=kind == "structural")
    ins = plain_inputs()
    xs = [ins[INPUTS.index(k)] for k in wrt]
    ours = call_filter(ins, cov_jitter=1e-8, missing_value=-9999.0).loglik
    got = {v.name: v for v in StandardFilter(cov_jitter=1e-8, missing_fill_value=-9999.0).build_graph(*ins)}
    theirs = got["loglike_obs"].sum()
    fn_ours = pytensor.function(ins, [ours, *pytensor.grad(ours, xs)])
    fn_theirs = pytensor.function(ins, [theirs, *pytensor.grad(theirs, xs)], mode=SCAN_ORACLE)
    grads = [getattr(n.op, "core_op", n.op) for n in fn_ours.maker.fgraph.apply_nodes]
    grads = [op for op in grads if type(op) is KalmanFilterGrad]
    assert len(grads) == 1 and set(grads[0].unused) == {"T", "Z"} - set(wrt)
    out_ours, out_theirs = fn_ours(*model_args(model)), fn_theirs(*model_args(model))
    if kind == "sarimax":  # the reverse takes a steady stretch's path
        Pp = call_filter([pt.as_tensor(x) for x in model_args(model)], cov_jitter=1e-8).predicted_cov.eval()
        assert (Pp[1:] == Pp[:-1]).all(axis=(1, 2)).sum() > 20
    np.testing.assert_allclose(out_ours[0], out_theirs[0], rtol=1e-9)
    for name, g_ours, g_theirs in zip(wrt, out_ours[1:], out_theirs[1:]):
        if name in ("P0", "H", "Q"):  # read through sym() by us, raw by the Scan: compare symmetric parts
            g_ours, g_theirs = 0.5 * (g_ours + g_ours.T), 0.5 * (g_theirs + g_theirs.T)
        scale = np.max(np.abs(g_theirs))
        np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-7, atol=1e-9 * scale, err_msg=f"d/d{name}")


@pytest.mark.parametrize("tv", [(), ("T", "Z")], ids=["static", "time_varying"])
def test_structured_verify_grad(tv):
    rng = np.random.default_rng(9)
    n = 12
    model = structured_model("blocks", n, seed=6)
    if tv:
        # the pattern changes every step (T and its transpose alternate), the values slowly
        model["T"] = np.stack([model["T"] * (1.0 - 0.02 * t) if t % 2 else model["T"].T for t in range(n)])
        model["Z"] = np.stack([model["Z"] * (1.0 + 0.02 * t) for t in range(n)])
    model["P0"] = np.eye(model["a0"].shape[0])  # finite differences of a well-scaled log-likelihood
    missing = np.isnan(model["y"])
    m, p = model["T"].shape[-1], model["Z"].shape[-2]
    shapes = [(), (n,), (n, m), (n, m, m), (n + 1, m), (n + 1, m, m), (n, p), (n, p, p)]
    weights = [rng.normal(size=s) / np.sqrt(max(1, np.prod(s))) for s in shapes]

    def f(y, *rest):
        y = pt.where(missing, np.nan, y)
        total = 0.0
        for w, o, name in zip(weights, kf([y, *rest], time_varying=tv, cov_jitter=1e-3), FIELDS):
            total = total + (w * (pt.where(missing, 0.0, o) if name == "forecast_error" else o)).sum()
        return total

    args = model_args(model)
    args[0] = np.nan_to_num(args[0])
    verify_grad(f, args, rng=rng, abs_tol=1e-5, rel_tol=1e-5, mode="FAST_COMPILE")


@pytest.mark.parametrize("jitter", [1e-8, 0.0])
def test_seasonal_sarimax_steady_gradient_matches_autodiff_of_pymc_extras(jitter):
    """The benchmark's SARIMAX(2,0,1)x(1,0,1,12) (m = 14 > SMALL, p = 1: the adjoint's thin products take
    loops), a missing observation; stationary P0 (scipy).  Its covariance does not reach a steady state: the
    variances of the lag states that neither the AR nor the MA terms reach decay geometrically to 0 (~1e-72
    after 300 steps) and never converge on their own scale (the per-entry steady-state test,
    :func:`iterops.ts._kalman_steps.steady`), so every step runs the full reverse recursion (the steady
    stretches' reverse: ``test_kalman_steady.py``)."""
    import scipy.linalg

    rng = np.random.default_rng(18)
    n = 260
    mats = _statsmodels_system(SARIMAX(np.zeros(n), order=(2, 0, 1), seasonal_order=(1, 0, 1, 12)),
                               [0.5, 0.2, 0.3, 0.6, -0.2, 1.0])
    m = mats["T"].shape[0]
    P0 = scipy.linalg.solve_discrete_lyapunov(mats["T"], mats["R"] @ mats["Q"] @ mats["R"].T)
    model = dict(y=rng.normal(size=(n, 1)), a0=0.1 * rng.normal(size=m), P0=P0, **mats)
    model["y"][[3, 200]] = np.nan
    shapes = [(n,), (n, m), (n, m, m), (n, m), (n, m, m)]
    weights = [rng.normal(size=s) / np.sqrt(np.prod(s)) for s in shapes]
    fn_ours, fn_theirs = gradient_fns(jitter)
    out_ours = fn_ours(*model_args(model), *weights)
    out_theirs = fn_theirs(*model_args(model), *weights)
    out_ours.pop()  # predicted_cov: no steady stretch (see the docstring)
    assert_loglik_grads_close(out_ours, out_theirs)
