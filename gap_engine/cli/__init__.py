"""The ``gap`` command line (also ``python -m gap_engine``): ``main`` runs one command.

``parser`` defines every subcommand and names its handler in one of the ``*_commands``
modules, imported only when that command runs (``main``).
"""

from gap_engine.cli.main import main

__all__ = ["main"]
