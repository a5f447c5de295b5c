"""The public API: the per-request loop (propose -> verify -> validate -> commit) and its controller."""
