"""The throughput benchmark behind ``tools/benchmark.py``: a runner (the real trainer, warm-up +
measured iterations, per-rank resources, trace) and a pure report (the HybridFlow/NeMo-RL table)."""
