"""``python -m zckpt`` and the ``zckpt`` command."""

from .io.interrupts import exit_on_signal


def main() -> None:
    exit_on_signal()  # a signal while the CLI's imports run: one line, not a traceback
    from .cli.app import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()
