"""Benchmarks: this engine's modes against peer baselines, side by side."""
