"""Spec-Bench-compatible benchmark harness."""
