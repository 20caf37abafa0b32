"""Read a DCP checkpoint without running code from it.

``torch.distributed.checkpoint.FileSystemReader`` reads the ``.metadata`` index with a plain
``pickle.load``: a crafted file runs whatever it names (``os.system``, ...) on resume and on export.
:class:`SafeFileSystemReader` reads it with an allow-list unpickler, the idea of
``torch.load(weights_only=True)``: only the DCP metadata classes and the plain types they hold
(``torch.Size``, dtypes, layouts, paths) may be constructed; anything else is refused before it runs.
It also refuses to load non-tensor (``BYTE_IO``) items, which DCP would ``torch.load`` with
``weights_only=False``; our checkpoints hold tensors only.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader

from hyperpar.errors import CheckpointError

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


def _metadata_class(name: str) -> Any:
    import torch.distributed.checkpoint.metadata as m

    obj = getattr(m, name, None)
    # Classes *defined* in DCP's metadata module (not names it imports), and only plain records.
    if isinstance(obj, type) and obj.__module__ == _METADATA_MODULE and (
            dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
        return obj
    return None


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, f: BinaryIO, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE and _metadata_class(name) is not None:
            return _metadata_class(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint file '{self.where}' asks to load '{module}.{name}', which is not checkpoint metadata: "
            "refused before running it",
            hint="the file was tampered with or is not a torch.distributed.checkpoint index; use a checkpoint you trust")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"checkpoint file '{self.where}' holds a persistent reference: refused")


def load_metadata(f: BinaryIO, where: str) -> Any:
    """Unpickle a DCP ``.metadata`` stream with the allow list; it must yield a ``Metadata``."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _AllowListUnpickler(f, where).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise CheckpointError(f"checkpoint file '{where}' is corrupt or truncated ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint file '{where}' is not a torch.distributed.checkpoint index "
                              f"(it holds a {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read with the allow-list unpickler (resume and export)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as f:
            md = load_metadata(f, str(path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType

        pickled = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if pickled:
            # DCP would torch.load(weights_only=False) these; our checkpoints never hold them.
            raise CheckpointError(f"checkpoint '{self.path}' stores '{pickled[0].dest_index.fqn}' as pickled bytes, "
                                  "not a tensor: refused", hint="use a checkpoint written by hyperpar")
        return super().read_data(plan, planner)


def read_metadata_file(ckpt_dir: Path) -> Any:
    """The ``.metadata`` of a checkpoint directory, read safely."""
    return SafeFileSystemReader(str(ckpt_dir)).read_metadata()
