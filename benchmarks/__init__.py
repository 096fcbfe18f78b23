"""Speed and memory benchmarks of hedgecats: run each as ``python -m benchmarks.<name>`` from the
repository root (README.md in this folder lists them, their commands and their results)."""
