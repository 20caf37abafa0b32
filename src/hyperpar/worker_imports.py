"""What every worker imports, imported once by the fork server (``worker_fork``) before it forks
the workers. Nothing here runs code beyond imports: no threads, no device, no process group."""

import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401

import hyperpar.checkpoint.manager  # noqa: F401
import hyperpar.data.loader  # noqa: F401
import hyperpar.distributed.materialize  # noqa: F401
import hyperpar.launch  # noqa: F401
import hyperpar.models.qwen3_5  # noqa: F401
import hyperpar.models.qwen3_5_moe  # noqa: F401
import hyperpar.models.qwen3_vl_moe  # noqa: F401
import hyperpar.train.trainer  # noqa: F401
