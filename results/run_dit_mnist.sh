#!/usr/bin/env bash
# Reproduces results/dit_mnist.md: MoH-DiT-T/4 at 90% / 75% and the dense DiT-T/4, each trained for the same
# 1,500 steps (the shipped configs), the 90% model continued to 3,500 and 7,000 steps, then 300 samples each
# (30 per class, DDIM 50 steps, guidance 3) scored by an MNIST classifier (CLASSIFIER=<ImageClassifier .ckpt>;
# trained here with the classification task's embedded config when unset). CFG=1.5 gives the cfg-1.5 columns.
# One heavy process at a time; OMP_NUM_THREADS=1 because the CPU is shared (2 threads oversubscribe it badly).
set -euo pipefail
export OMP_NUM_THREADS=1
OUT=${OUT:-runs/dit_mnist}
CLASSIFIER=${CLASSIFIER:-}
if [[ -z "$CLASSIFIER" ]]; then
  moh fit --config vit_tiny_mnist_75.yaml --trainer.logger.init_args.save_dir "$OUT" \
    --trainer.logger.init_args.version final
  CLASSIFIER=$(ls "$OUT"/vit_tiny_mnist_75/final/checkpoints/epoch=*.ckpt | head -1)
fi
for budget in 90 75 100; do
  moh fit --config "dit_mnist_$budget.yaml" --trainer.logger.init_args.save_dir "$OUT" \
    --trainer.logger.init_args.version final
done
previous=final
for steps in 3500:long 7000:longer; do
  moh fit --config dit_mnist_90.yaml --ckpt_path "$OUT/dit_mnist_90/$previous/checkpoints/last.ckpt" \
    --trainer.max_steps "${steps%%:*}" --trainer.logger.init_args.save_dir "$OUT" \
    --trainer.logger.init_args.version "${steps#*:}"
  previous=${steps#*:}
done
for run in 90:dit_mnist_90/final 75:dit_mnist_75/final 100:dit_mnist_100/final 90_long:dit_mnist_90/long \
           90_longer:dit_mnist_90/longer; do
  tag=${run%%:*}
  moh sample --checkpoint "$OUT/${run#*:}/checkpoints/last.ckpt" --out_dir "$OUT/samples_$tag" --num_samples 300 \
    --classes "[0,1,2,3,4,5,6,7,8,9]" --sampler ddim --steps 50 --cfg_scale "${CFG:-3.0}" --seed 0 --batch_size 150
  moh digit_quality --samples "$OUT/samples_$tag/samples.npz" --classifier "$CLASSIFIER" \
    --out "results/dit_mnist_${tag}${CFG:+_cfg$CFG}.json"
  cp "$OUT/samples_$tag/grid.png" "results/dit_mnist_${tag}${CFG:+_cfg$CFG}_grid.png"
done
