"""``python -m hyperpar``: the Hydra driver (see hyperpar.cli)."""

import gc

from hyperpar.cli import cli

if __name__ == "__main__":
    try:
        cli()
    finally:
        # Python's final collections over torch's module objects took ~0.7 s of the driver's exit (2 AMD
        # cores); nothing this process still holds needs a collection to release it.
        gc.freeze()
