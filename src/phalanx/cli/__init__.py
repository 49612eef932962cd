"""The ``phalanx`` command line (typer + rich)."""
