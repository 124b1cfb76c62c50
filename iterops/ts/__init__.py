"""Fused time-series Ops (Kalman filter, Levinson-Durbin family)."""

from iterops.ts.toeplitz import solve_toeplitz
from iterops.ts.levinson import LevinsonDurbinResult, acovf, levinson_durbin, yule_walker
from iterops.ts.ar import ar_to_acov, ar_to_pacf, pacf_to_ar
from iterops.ts.kalman import KalmanFilterResult, kalman_filter, stationary_cov
from iterops.ts.kalman_smoother import KalmanSmootherResult, kalman_smoother

__all__: list[str] = [
    "KalmanFilterResult",
    "KalmanSmootherResult",
    "LevinsonDurbinResult",
    "kalman_filter",
    "kalman_smoother",
    "stationary_cov",
    "acovf",
    "ar_to_acov",
    "ar_to_pacf",
    "levinson_durbin",
    "pacf_to_ar",
    "solve_toeplitz",
    "yule_walker",
]
