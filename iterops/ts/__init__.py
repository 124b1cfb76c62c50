"""Fused time-series Ops (Kalman filter, Levinson-Durbin family)."""

__all__: list[str] = []
