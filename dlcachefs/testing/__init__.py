"""Helpers shared by the tests and the benchmarks: fake sources and engine runners, and
the subprocess mount helper with its daemon-log and ``verify`` oracle."""
