"""The Qwen3-VL vision tower shared by the vision-language families (MODELS.md 8)."""

from hyperpar.models.vision.args import VisionArgs
from hyperpar.models.vision.merger import PatchMerger
from hyperpar.models.vision.rotary import cu_seqlens, frame_runs, patch_coords, position_interpolation, vision_rotary
from hyperpar.models.vision.tower import PatchEmbed, VisionAttention, VisionBlock, VisionMLP, VisionTower

__all__ = [
    "PatchEmbed",
    "PatchMerger",
    "VisionArgs",
    "VisionAttention",
    "VisionBlock",
    "VisionMLP",
    "VisionTower",
    "cu_seqlens",
    "frame_runs",
    "patch_coords",
    "position_interpolation",
    "vision_rotary",
]
