"""The shared vision tower and the multimodal glue against transformers (fp32, tiny configs)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fixtures import qwen3_5_vision, vl_moe_vision
from hyperpar.models.vision.state_dict import export_vision_param, load_vision_param
from hyperpar.errors import DataError
from hyperpar.models.multimodal import add_deepstack, deepstack_inputs, get_rope_index, scatter_features
from hyperpar.models.vision import VisionArgs, VisionTower, patch_coords, position_interpolation

transformers = pytest.importorskip("transformers")

torch.set_num_threads(1)

VL_MOE_VISION = vl_moe_vision()  # DeepStack on blocks 0 and 2 (tests/fixtures.py)
QWEN3_5_VISION = qwen3_5_vision()  # the same tower, depth 2, no DeepStack

# Items of several sizes, a 2- and a 3-frame video and equal-sized neighbours (one attention run).
GRIDS = torch.tensor([[1, 4, 6], [2, 4, 4], [1, 6, 4], [1, 2, 2], [1, 2, 2], [3, 2, 8]])


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Realistic-scale random weights, norms away from (1, 0) so their layout matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.05 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name and name.endswith("weight") else 0.0))


def _tower_pair(cfg: dict):
    if cfg["model_type"] == "qwen3_vl_moe_vision":
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig as Config
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel as Model
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel as Model
    torch.manual_seed(0)
    hf = Model(Config(**copy.deepcopy(cfg))).float().train()
    _perturb(hf, 1)
    args = VisionArgs.from_hf_config(cfg)
    with torch.device("meta"):
        ours = VisionTower(args)
    ours.to_empty(device="cpu")
    sd = hf.state_dict()
    assert set(sd) == set(hf_names(dict(ours.named_parameters())))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            t = load_vision_param(name, sd.__getitem__)  # our split q/k/v from the fused qkv
            assert p.shape == t.shape, name
            p.copy_(t)
    return hf, ours.train()


def hf_names(tensors: dict) -> dict:
    """Our tower's tensors (parameters or grads) under the checkpoint's names (q/k/v fused)."""
    from hyperpar.models.fused import join_parts

    return dict(join_parts(kv for n, t in tensors.items() for kv in export_vision_param(n, t).items()))


def _pixels(grid: torch.Tensor, width: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(seed))


def test_tower_matches_transformers_with_deepstack() -> None:
    hf, ours = _tower_pair(VL_MOE_VISION)
    px = _pixels(GRIDS, ours.args.patch_dim)
    ref = hf(px, grid_thw=GRIDS)
    feats, deepstack = ours(px, GRIDS)
    assert feats.shape == (int(GRIDS.prod(-1).sum()) // 4, 64)
    assert (feats - ref.pooler_output).abs().max().item() <= 1e-5
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for got, want in zip(deepstack, ref.deepstack_features):
        assert (got - want).abs().max().item() <= 1e-5
    # Gradients agree too (every parameter, the DeepStack mergers included).
    loss_ref = ref.pooler_output.square().sum() + sum(f.sum() for f in ref.deepstack_features)
    loss = feats.square().sum() + sum(f.sum() for f in deepstack)
    loss_ref.backward()
    loss.backward()
    hf_grads = dict(hf.named_parameters())
    assert all(p.grad is not None for p in ours.parameters())
    for name, g in hf_names({n: p.grad for n, p in ours.named_parameters()}).items():
        ref_grad = hf_grads[name].grad
        assert (g - ref_grad).abs().max().item() <= 1e-4 * max(1.0, ref_grad.abs().max().item()), name


def test_tower_with_our_init_matches_transformers() -> None:
    """Our seeded init (as materialize does it), copied into transformers' tower: same outputs. The
    other tests load transformers' weights into ours; this one runs the other way, from our init."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    from hyperpar.distributed.materialize import param_generator

    args = VisionArgs.from_hf_config(VL_MOE_VISION)
    with torch.device("meta"):
        ours = VisionTower(args)
    ours.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in ours.named_parameters():
            full = torch.empty(p.shape)
            ours.init_param(name, full, param_generator(7, name))
            p.copy_(full)
    hf = Qwen3VLMoeVisionModel(Qwen3VLMoeVisionConfig(**VL_MOE_VISION)).float().eval()
    missing, unexpected = hf.load_state_dict(hf_names(dict(ours.named_parameters())), strict=True)
    assert not missing and not unexpected
    px = _pixels(GRIDS, args.patch_dim)
    with torch.no_grad():
        feats, deepstack = ours.eval()(px, GRIDS)
        ref = hf(px, grid_thw=GRIDS)
    assert feats.shape == ref.pooler_output.shape == (34, 64)
    assert feats.abs().max().item() > 1e-3  # the init is not degenerate
    assert (feats - ref.pooler_output).abs().max().item() <= 1e-5
    for got, want in zip(deepstack, ref.deepstack_features, strict=True):
        assert (got - want).abs().max().item() <= 1e-5


def test_qwen3_5_tower_is_the_same_module_without_deepstack() -> None:
    hf, ours = _tower_pair(QWEN3_5_VISION)
    assert ours.args.deepstack_visual_indexes == [] and len(ours.deepstack_merger_list) == 0
    grid = GRIDS[:3]
    px = _pixels(grid, ours.args.patch_dim, seed=5)
    with torch.no_grad():
        ref = hf(px, grid_thw=grid).pooler_output
        feats, deepstack = ours(px, grid)
    assert deepstack == []
    assert (feats - ref).abs().max().item() <= 1e-5


def test_position_interpolation_equals_f_interpolate() -> None:
    side, dim = 8, 5
    table = torch.randn(side * side, dim, generator=torch.Generator().manual_seed(3))
    grid = torch.tensor([[1, 6, 4], [2, 2, 10], [1, 2, 2]])
    coords = patch_coords(grid, 2)
    index, weight = position_interpolation(grid, coords, side)
    got = (table[index] * weight.unsqueeze(-1)).sum(1)
    start = 0
    for t, h, w in grid.tolist():
        img = F.interpolate(table.T.reshape(1, dim, side, side), size=(h, w), mode="bilinear", align_corners=True)[0]
        n = t * h * w
        c = coords[start : start + n]
        want = img[:, c[:, 0], c[:, 1]].T
        assert (got[start : start + n] - want).abs().max().item() <= 1e-6
        start += n
    # merge-block order: the first m² rows are the top-left 2×2 block
    assert patch_coords(torch.tensor([[1, 4, 4]]), 2)[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_init_param_covers_every_tower_parameter() -> None:
    args = VisionArgs.from_hf_config(VL_MOE_VISION)
    tower = VisionTower(args)
    gen = torch.Generator().manual_seed(0)
    for name, p in tower.named_parameters():
        full = torch.empty(p.shape)
        tower.init_param(name, full, gen)
        if name.endswith("norm1.weight") or name.endswith("norm.weight"):
            assert torch.all(full == 1), name
        if name.endswith("bias"):
            assert torch.all(full == 0), name


def test_vision_args_round_trip_and_validation() -> None:
    args = VisionArgs.from_hf_config(VL_MOE_VISION)
    assert VisionArgs.from_hf_config(args.to_hf_config()) == args
    with pytest.raises(Exception, match="perfect square"):
        args.replace(num_position_embeddings=60)
    with pytest.raises(Exception, match="deepstack"):
        args.replace(deepstack_visual_indexes=[3])


# --- 3-D positions -------------------------------------------------------------------------------

IMG, VID, VS, VE = 1000, 1001, 1002, 1003


@pytest.fixture(scope="module")
def hf_vl_model():
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    cfg = Qwen3VLMoeConfig(
        text_config={"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5]}},
        vision_config={**VL_MOE_VISION, "depth": 1, "deepstack_visual_indexes": [0]},
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
    )
    return Qwen3VLMoeForConditionalGeneration(cfg)


def _image_row(gen: torch.Generator, n: int, pre: int = 3, total: int = 24) -> list[int]:
    ids = torch.randint(0, 900, (total,), generator=gen).tolist()
    return ids[:pre] + [VS] + [IMG] * n + [VE] + ids[pre + n + 2 :]


def _types(ids: torch.Tensor) -> torch.Tensor:
    return torch.where(ids == IMG, 1, torch.where(ids == VID, 2, 0)).to(torch.int32)


def _check(hf_vl_model, ids, image_grid=None, video_grid=None, mask=None):
    types = _types(ids)
    ref, ref_delta = hf_vl_model.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=image_grid, video_grid_thw=video_grid, attention_mask=mask
    )
    got, delta = get_rope_index(ids, types, image_grid, video_grid, spatial_merge_size=2, attention_mask=mask)
    assert torch.equal(got, ref)
    assert torch.equal(delta.view(-1), ref_delta.view(-1))
    return got


def test_rope_index_image_batch_matches_transformers(hf_vl_model) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([_image_row(gen, 6), _image_row(gen, 6)])
    pos = _check(hf_vl_model, ids, image_grid=torch.tensor([[1, 4, 6], [1, 6, 4]]))
    # MODELS.md 9.2 worked example: grid (1, 4, 6) after three text tokens and <vision_start>.
    assert pos[:, 0, :12].tolist() == [
        [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8],
        [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8],
        [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8],
    ]


def test_rope_index_video_batch_matches_transformers(hf_vl_model) -> None:
    row = [5, 6, 7]
    for g in range(2):
        row += [100 + g, 101 + g, VS] + [VID] * 4 + [VE]
    row += [8, 9, 10]
    pos = _check(hf_vl_model, torch.tensor([row]), video_grid=torch.tensor([[2, 4, 4]]))
    assert pos[0, 0].tolist()[:16] == [0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 8, 9, 10, 11, 12, 12]


def test_rope_index_mixed_and_padded_batch_matches_transformers(hf_vl_model) -> None:
    gen = torch.Generator().manual_seed(1)
    r0 = _image_row(gen, 4, pre=2, total=30)[:22] + [VS] + [VID] * 2 + [VE] + [1, 2, 3, 4]
    r1 = [0, 0] + _image_row(gen, 6, pre=4, total=28)  # left padding
    r0, r1 = r0[:30], r1[:30]
    ids = torch.tensor([r0, r1])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    _check(hf_vl_model, ids, image_grid=torch.tensor([[1, 4, 4], [1, 4, 6]]), video_grid=torch.tensor([[1, 2, 4]]), mask=mask)


def test_rope_index_needs_token_types_and_matching_grids() -> None:
    ids = torch.tensor([[1, VS, IMG, IMG, VE]])
    with pytest.raises(DataError, match="mm_token_type_ids"):
        get_rope_index(ids, None, torch.tensor([[1, 2, 4]]), spatial_merge_size=2)
    with pytest.raises(DataError, match="2 image placeholder tokens.*gives 4 tokens"):
        get_rope_index(ids, _types(ids), torch.tensor([[1, 4, 4]]), spatial_merge_size=2)


# --- placeholder scatter and DeepStack ------------------------------------------------------------


def test_scatter_is_row_major_and_counts_are_checked() -> None:
    ids = torch.tensor([[1, IMG, IMG, 2], [IMG, 3, 4, IMG]])
    embeds = torch.zeros(2, 4, 3)
    feats = torch.arange(12.0).view(4, 3)
    out = scatter_features(embeds, ids == IMG, feats, "image")
    assert out[0, 1].tolist() == [0, 1, 2] and out[0, 2].tolist() == [3, 4, 5]
    assert out[1, 0].tolist() == [6, 7, 8] and out[1, 3].tolist() == [9, 10, 11]
    with pytest.raises(DataError, match=r"4 image placeholder tokens.* 3 image features"):
        scatter_features(embeds, ids == IMG, feats[:3], "image")


def test_deepstack_joins_images_and_videos_in_sequence_order() -> None:
    ids = torch.tensor([[IMG, VID, 5, IMG], [VID, VID, IMG, 6]])
    img = [torch.tensor([[1.0], [2.0], [3.0]])]
    vid = [torch.tensor([[10.0], [20.0], [30.0]])]
    mask, feats = deepstack_inputs(ids == IMG, ids == VID, img, vid)
    assert feats[0].view(-1).tolist() == [1, 10, 2, 20, 30, 3]
    hidden = torch.zeros(2, 4, 1)
    out = add_deepstack(hidden, mask, feats[0])
    assert out.view(2, 4).tolist() == [[1, 10, 0, 2], [20, 30, 3, 0]]
