"""Helpers that build tiny models and tokenizers offline, for tests, the demo and benchmarks."""
