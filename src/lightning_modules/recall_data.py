"""Former home of the byte recall corpus, kept as an alias for scripts that name it.

The corpus and its DataModule live in ``hedgecats.data.recall_bytes``; import them from there
(``benchmarks/testbed_continue_gpu.sh`` still imports ``write_recall_mc_tasks`` from here). This
module defines nothing.
"""

from ..data.recall_bytes import *
from ..data.recall_bytes import __all__  # noqa: F401
