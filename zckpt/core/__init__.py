"""Leaf types every layer uses: errors, dtypes, the checkpoint index and training state, the rules
for untrusted names, byte sizes as people write them, and the folders trainers keep checkpoints in.

Nothing here imports zckpt code outside ``core``.
"""
