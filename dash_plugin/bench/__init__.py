"""dash-bench: the benchmark harness (the protocol: docs/benchmarks/README.md).

Modules: ``protocol`` (shapes, FLOPs), ``peers`` (the implementations), ``runner`` (timing,
determinism and memory per cell), ``report`` (JSON, markdown, PNG, target verdicts),
``autotable`` (the ``auto`` schedule rule derived from a results file), ``cli`` (``dash-bench``).
"""
