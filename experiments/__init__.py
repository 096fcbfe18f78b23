"""Research studies of hedgecats that can be rerun: ``python -m experiments.<name>`` from the
repository root (README.md in this folder lists them, their commands and their results)."""
