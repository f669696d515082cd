"""The operations, composing the formats: consolidate, reshard, to-universal, PEFT, verify, diff, inspect,
nvme-plan, and the Python API.
"""
