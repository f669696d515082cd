"""The ``zckpt`` command's typer front end: one module per command, the options and progress bars
they share (:mod:`.shared`), the table from errors to exit codes (:mod:`.errors`), termination
signals (:mod:`.signals`), and the app with ``main`` (:mod:`.app`).
"""
