"""The ``zckpt`` command's typer front end.
"""
