"""Parameter names as the model and its checkpoint know them, whatever wraps the modules.

Activation checkpointing, ``torch.compile`` and FSDP1 insert a module between a parent and its
child, and with it an extra segment in every parameter name below. Initialisation, loading and
export key by the name without those segments, so they do not depend on those settings.
"""

from __future__ import annotations

WRAPPER_ATTRS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """``name`` without the wrapper segments."""
    for attr in WRAPPER_ATTRS:
        name = name.replace(attr + ".", "")
    return name
