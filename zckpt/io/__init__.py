"""How bytes move, whatever the file format: positional reads, streaming and dtype conversion, O_DIRECT writes,
CRC checks, all-or-nothing output folders, jobs, worker threads and termination signals.
"""
