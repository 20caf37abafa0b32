"""Megatron-LM indexed corpora (``.bin``/``.idx``), GPT sampling and blends, with megatron-core's
names and sample order (``BlendedDataset`` defaults to megatron-core's blend schedule; the
``"bounded"`` one keeps every corpus within one sample of its weight at every step).
``python -m hyperpar.data.megatron.convert`` turns JSONL into a corpus."""

from hyperpar.data.megatron.blend import (
    SCHEDULES,
    BlendedDataset,
    build_blending_indices,
    build_bounded_blending_indices,
    build_exhaustive_blending_indices,
    build_gpt_dataset,
    get_blend_from_list,
    parse_blend,
)
from hyperpar.data.megatron.gpt import GPTDataset, GPTDatasetConfig, Split
from hyperpar.data.megatron.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from hyperpar.data.megatron.source import MegatronSource

__all__ = [
    "DTYPE_CODES",
    "SCHEDULES",
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronSource",
    "Split",
    "build_blending_indices",
    "build_bounded_blending_indices",
    "build_exhaustive_blending_indices",
    "build_gpt_dataset",
    "get_bin_path",
    "get_blend_from_list",
    "get_idx_path",
    "optimal_dtype",
    "parse_blend",
]
