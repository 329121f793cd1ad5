"""``python -m mlora``: the ``mlora`` console script."""

from mlora.cli.app import main

main()
