"""The serving runtime: request contract, preparation, model, passes, backends, heads and finishing.

Importing it sets MKL's strict reproducibility mode (unless the environment already chose one):
the heads' float32 products on the CPU are then the same bytes whatever the number of threads
(MKL 2024.2's default mode rounded a 5-row product differently on 1 and 2 threads). MKL reads the
variable at its first call, so this must run before any product in the process.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
