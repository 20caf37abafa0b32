"""``python -m hyperpar``: the Hydra driver (see hyperpar.cli)."""

from hyperpar.cli import cli

if __name__ == "__main__":
    cli()
