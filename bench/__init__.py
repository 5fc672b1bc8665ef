"""The measurement tooling: bench workloads, parity, latency, host stages, the traffic suite, the
HTTP load driver and the GPU commands; it drives the runtime through `RuntimeConfig` only."""
