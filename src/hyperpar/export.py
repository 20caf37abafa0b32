"""Export a training checkpoint as a Hugging Face model directory.

    python -m hyperpar.export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--max-shard-size 2GB] [--config config.yaml]

CHECKPOINT_DIR is a ``checkpoints/step_<n>`` directory, or a run / checkpoints directory (its newest
complete checkpoint). The model is taken from the run's resolved config.yaml (copied next to every
checkpoint; else two levels up). One process, no process group: the sharded DCP checkpoint of any
layout is read into a plain CPU model, then written through the model family's adapter
(config.json + safetensors, sharded with an index above ``--max-shard-size``).
"""

from __future__ import annotations

import argparse
import sys

from hyperpar.errors import HyperparError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyperpar.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoints/step_<n> directory, or a run directory (newest checkpoint)")
    parser.add_argument("out", help="output directory (config.json + *.safetensors)")
    parser.add_argument("--dtype", default="float32", help="float32 (default, the master weights), bfloat16 or float16")
    parser.add_argument("--max-shard-size", default="2GB", help="largest safetensors file, e.g. 2GB, 500MB (default 2GB)")
    parser.add_argument("--config", default=None, help="the run's resolved config.yaml, if not next to the checkpoint")
    args = parser.parse_args(argv)
    try:

        from hyperpar.checkpoint.hf_export import export_checkpoint
        from hyperpar.config import dtype_of
        from hyperpar.models.hf_io import parse_size

        try:
            shard = parse_size(args.max_shard_size)
        except ValueError as e:
            from hyperpar.errors import ConfigError

            raise ConfigError(str(e)) from None
        out = export_checkpoint(args.checkpoint, args.out, config=args.config, dtype=dtype_of(args.dtype),
                                max_shard_size=shard)
    except HyperparError as e:
        print(e.one_line(), file=sys.stderr)
        return 2
    print(f"[hyperpar] exported {args.checkpoint} -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
