"""What the gateway's adaptive controller assumes by default. Shared with the primary's precision
autotune, which predicts the controller's gains on each candidate precision's verify curve, so that
both read one definition (the gateway's flags may override them for the gateway alone).
"""

from __future__ import annotations

# Task-type priors for the acceptance rate alpha (the article: JSON 89 %, prose 18 %).
PRIOR_ACCEPTANCE_STRUCTURED = 0.8
PRIOR_ACCEPTANCE_CODE = 0.6
PRIOR_ACCEPTANCE_CREATIVE = 0.3
# A request's own prediction of its output (Predicted Outputs) is mostly right where it is aligned:
# an edit changes a few lines of a file. The prediction decoder's prior, whatever the task type.
PRIOR_ACCEPTANCE_PREDICTION = 0.9
PLAIN_OVERHEAD_MS = 1.0  # Decode RPC + state write + Python, per plain step
SPECULATIVE_OVERHEAD_MS = 4.0  # Propose, Verify, Validate RPCs, logits transfer, state write
# Lookahead decoding's Jacobi window (draft_svc/strategies/lookahead.py): W positions x (N - 1)
# levels, that many extra rows in every verify it rides in (what the cost model prices).
LOOKAHEAD_WINDOW = 4
LOOKAHEAD_LEVELS = 3
LOOKAHEAD_ROWS = LOOKAHEAD_WINDOW * LOOKAHEAD_LEVELS
