"""Benchmarks: scripts that print and record figures (never timed assertions)."""
