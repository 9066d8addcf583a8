"""agentkv benchmarks: scripts run as ``python -m bench.<name>``; speed lives here, never in tests."""
