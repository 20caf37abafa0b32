"""Degrees above 2: the other layout tests run each axis at 2, where a rank's shard is "the other
half" and an index mix-up between ranks 1 and 2 cannot show. Here each axis runs 4-way on its own
(every rank holding a quarter, or a quarter of the stages) and every parameter's gradient, the loss
and the grad norm of one step must equal one process's."""

from __future__ import annotations

import pytest

from layout_grads import assert_same_step, layout_grads

STEP = ["train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1"]
LINEAR_TYPES = "[linear_attention,full_attention,linear_attention,linear_attention,full_attention]"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout", "extra"), [
    # tp 4: 4 attention heads one a rank, the 2 K/V heads each repeated on two ranks; 4 / 8
    # GatedDeltaNet key / value heads; vocabulary and MLP in quarters
    ("qwen3_5", ["parallel.tp=4", "parallel.dp_shard=1"],
     ["+model.overrides.linear_num_key_heads=4", "+model.overrides.linear_num_value_heads=8"]),
    # cp 4: four sequence shards of 8 tokens, Ulysses over 4 heads (one a rank)
    ("qwen3_5", ["parallel.cp=4", "parallel.dp_shard=1"], []),
    # ep 4: 2 of the 8 experts a rank, each token to 3 of them (routes crossing every rank pair)
    ("qwen3_5_moe", ["parallel.ep=4", "parallel.dp_shard=4"], ["+model.overrides.num_experts_per_tok=3"]),
    # pp 2 x vpp 2 over 5 layers: four virtual stages that cannot all hold the same count
    ("qwen3_5", ["parallel.pp=2", "parallel.vpp=2", "parallel.dp_shard=1", "parallel.pp_schedule=interleaved_1f1b"],
     ["model.num_hidden_layers=5", f"+model.overrides.layer_types={LINEAR_TYPES}"]),
], ids=["tp4", "cp4", "ep4_top3", "pp2_vpp2_5_layers"])
def test_four_way_gradients_equal_one_process(model: str, layout: list[str], extra: list[str]) -> None:
    base = [f"model={model}", *STEP, *extra]
    ref = layout_grads(["parallel=single", *base], 1)
    world = 2 if "parallel.pp=2" in layout else 4
    got = layout_grads(["parallel=single", f"parallel.world_size={world}", "parallel.name=custom", *layout, *base], world)
    assert_same_step(ref, got, f"{model} {' '.join(layout)} {' '.join(extra)}")
