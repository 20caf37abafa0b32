"""Training checkpoints (torch.distributed.checkpoint, atomic, resharding on resume) and HF export.

``manager.Checkpointer`` is what the worker and Trainer use; ``directory`` is the on-disk layout,
``state`` what a checkpoint holds, ``preemption`` SIGTERM handling, ``hf_export`` the HF directory.
"""

from hyperpar.checkpoint.manager import Checkpointer, build_checkpointer

__all__ = ["Checkpointer", "build_checkpointer"]
