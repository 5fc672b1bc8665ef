"""Tooling above every layer: benchmarks, parity and the demo; it may import any package."""
