#!/usr/bin/env bash
# Run the parity sweep of every family over every supported layout against `single` (fp32, CPU,
# tiny debug models), then regenerate docs/guide/support_matrix.md from the reports.
# Usage: bash scripts/support_matrix.sh [extra overrides...]   (about 20-40 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${MATRIX_DIR:-multirun/support_matrix}
run=(train.seq_len=32 train.global_batch_size=4 train.micro_batch_size=1 launch.threads_per_rank=1 train.steps=8
     parity.tolerance_step=1e-5 "$@")
dense=single,ddp2,fsdp2,hsdp2x2,tp2,fsdp_tp2,hsdp2_tp2,fsdp2_tp2_nosp,cp2,fsdp2_cp2,hsdp2_cp2,tp2_cp2
moe=$dense,ep2,fsdp4_ep2,fsdp2_tp2_ep2,fsdp2_cp2_ep2
pp=pp2,pp2_1f1b,pp2_vpp2,pp2_zb,fsdp2_pp2,tp2_pp2  # pipeline layouts (every family)
sweeps=()
for spec in qwen3_5:$dense,$pp,cp2_pp2 qwen3_5_vl:$dense,$pp,cp2_pp2 qwen3_5_moe:$moe,$pp,cp2_pp2,ep2_pp2 \
            qwen3_5_moe_vl:$moe,$pp,cp2_pp2,ep2_pp2 qwen3_vl_moe:$moe,$pp,cp2_pp2,ep2_pp2; do
  model=${spec%%:*} layouts=${spec#*:}
  extra=()
  [[ $model == qwen3_5_moe* ]] && extra=(model.mtp_loss_weight=0.3)  # the MTP head trains too
  python -m hyperpar -m "model=$model" "parallel=$layouts" +experiment=parity "${run[@]}" "${extra[@]}" \
    "hydra.sweep.dir=$out/$model" || true  # a failing layout shows in the matrix; keep going
  sweeps+=("$out/$model")
done
python -m hyperpar.parity.matrix "${sweeps[@]}" --out docs/guide/support_matrix.md
