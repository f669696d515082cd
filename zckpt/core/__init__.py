"""Leaf types every layer uses: errors, dtypes, the checkpoint index and training state, the rules for untrusted names.

Nothing here imports zckpt code outside ``core``.
"""
