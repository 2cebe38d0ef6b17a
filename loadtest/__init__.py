"""HTTP load generator for OpenAI-compatible servers: streaming requests, open or closed loop,
chat and agent workloads, latency percentiles (`python -m loadtest --help`)."""
