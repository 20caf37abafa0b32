"""``train.fused_head_loss``: a head that hands its matmul to the objective gives the objective, and
every parameter's gradient, of the unfused head and loss (MoE with MTP: two fused sums, each with its
own gradient hint), and keeps logits wherever it does not apply."""

from __future__ import annotations

import torch
from torch import nn

import fixtures
from hyperpar.models.layers.lm_head import HeadInput, LMHead, fuse_head_loss
from hyperpar.models.output import ModelOutput
from hyperpar.models.qwen3_5_moe import Qwen3_5MoeArgs, Qwen3_5MoeForCausalLM
from hyperpar.train.objective import Objective


def _tiny_moe_with_mtp() -> Qwen3_5MoeForCausalLM:
    args = Qwen3_5MoeArgs.from_hf_config(fixtures.qwen3_5_moe(mtp_num_hidden_layers=1)).replace(mtp_loss_weight=0.3)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(args)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial values everywhere (zero norms would hide bugs)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.train()


def _step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[ModelOutput, float, dict]:
    model.zero_grad(set_to_none=True)
    objective = Objective(mtp_weight=model.args.mtp_loss_weight)
    totals = objective.totals([labels], 1, lambda t: t)
    out = model(ids)
    loss, _ = objective(out, labels, totals)
    loss.backward()
    return out, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_head_gives_the_unfused_objective_and_gradients():
    model = _tiny_moe_with_mtp()
    ids = torch.randint(0, 900, (2, 40), generator=torch.Generator().manual_seed(2))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[0, 5:9] = -100  # masked tokens inside a row

    assert fuse_head_loss(model) == 1
    fused_out, fused_loss, fused = _step(model, ids, labels)
    assert isinstance(fused_out.logits, HeadInput) and isinstance(fused_out.mtp_logits, HeadInput)
    fuse_head_loss(model, False)
    plain_out, plain_loss, plain = _step(model, ids, labels)
    assert isinstance(plain_out.logits, torch.Tensor)

    assert abs(fused_loss - plain_loss) <= 1e-6 * abs(plain_loss)
    assert fused.keys() == plain.keys() and "lm_head.weight" in fused and any(k.startswith("mtp.") for k in fused)
    for name, g in plain.items():
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (fused[name] - g).abs().max().item() <= 1e-5 * scale + 1e-9, name


def test_head_keeps_logits_where_fusing_does_not_apply():
    head = LMHead(8, 50, bias=False)
    head.fused_loss = True
    x = torch.randn(2, 3, 8)
    assert isinstance(head(x), HeadInput)
    with torch.no_grad():  # evaluation: logits
        assert head(x).shape == (2, 3, 50)
    from hyperpar.models.layers import cpu_matmul
    before = cpu_matmul.set_policy("native")
    try:  # a 16-bit head with the CPU's 16-bit GEMM: logits
        assert head.bfloat16()(x.bfloat16()).shape == (2, 3, 50)
        cpu_matmul.set_policy("fp32")  # its 16-bit matmuls as fp32 GEMMs: fused, rounding as the head would
        assert isinstance(head(x.bfloat16()), HeadInput)
    finally:
        cpu_matmul.set_policy(before)
    head.float()
    head.fused_loss = False
    assert torch.equal(head(x), x @ head.weight.t())


def test_16bit_fused_head_gives_the_unfused_objective_and_gradients():
    """bf16 where the CPU's 16-bit matmuls run as fp32 GEMMs (cpu_matmul=fp32): the fused heads (main
    and MTP) round where the unfused bf16 heads do, so the objective and every gradient come out the same."""
    from hyperpar.models.layers import cpu_matmul

    model = _tiny_moe_with_mtp().bfloat16()
    ids = torch.randint(0, 900, (2, 40), generator=torch.Generator().manual_seed(2))
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[0, 5:9] = -100
    before = cpu_matmul.set_policy("fp32")
    try:
        fuse_head_loss(model)
        fused_out, fused_loss, fused = _step(model, ids, labels)
        assert isinstance(fused_out.logits, HeadInput) and isinstance(fused_out.mtp_logits, HeadInput)
        fuse_head_loss(model, False)
        plain_out, plain_loss, plain = _step(model, ids, labels)
        assert isinstance(plain_out.logits, torch.Tensor) and plain_out.logits.dtype == torch.bfloat16
    finally:
        cpu_matmul.set_policy(before)
    assert abs(fused_loss - plain_loss) <= 1e-6 * abs(plain_loss)
    assert fused.keys() == plain.keys() and "lm_head.weight" in fused
    for name, g in plain.items():
        assert fused[name].dtype == torch.bfloat16 and g.abs().max().item() > 0, name
        assert torch.equal(fused[name], g), name
