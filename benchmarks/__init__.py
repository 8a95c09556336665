"""H200 benchmarks; ``gpu_suite.py`` runs them all with the gpu tests (see README)."""
