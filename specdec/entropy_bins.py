"""The bands of primary entropy that draft acceptance is counted in: the validator counts each
step's decisions per band, the gateway sums them per request (GenerationStats.entropy_bins).

Left-closed bins [e_i, e_{i+1}) in nats; 2.8 is the reference article's threshold (acceptance
stays >= 75 % below it).
"""

from __future__ import annotations

import math

DEFAULT_ENTROPY_BIN_EDGES = (0.0, 0.5, 1.0, 1.5, 2.0, 2.8, 4.0, math.inf)
