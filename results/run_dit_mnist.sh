#!/usr/bin/env bash
# Reproduces results/dit_mnist.md: the MNIST classifier, then MoH-DiT-T/4 at 90% / 75% and the dense DiT-T/4, each
# trained for the same 1,500 steps, sampled (300 images, 30 per class) and scored by the classifier.
# One heavy process at a time; OMP_NUM_THREADS=1 because the CPU is shared (2 threads oversubscribe it badly).
set -euo pipefail
export OMP_NUM_THREADS=1
OUT=${OUT:-runs/dit_mnist}
CLASSIFIER=${CLASSIFIER:-}
if [[ -z "$CLASSIFIER" ]]; then
  moh fit --config vit_tiny_mnist_75.yaml --trainer.logger.init_args.save_dir "$OUT" \
    --trainer.logger.init_args.version final
  CLASSIFIER="$OUT/vit_tiny_mnist_75/final/checkpoints/last.ckpt"
fi
for budget in 90 75 100; do
  moh fit --config "dit_mnist_$budget.yaml" --trainer.logger.init_args.save_dir "$OUT" \
    --trainer.logger.init_args.version final
  moh sample --checkpoint "$OUT/dit_mnist_$budget/final/checkpoints/last.ckpt" --out_dir "$OUT/samples_$budget" \
    --num_samples 300 --classes "[0,1,2,3,4,5,6,7,8,9]" --sampler ddim --steps 50 --cfg_scale 3.0 --seed 0
  moh digit_quality --samples "$OUT/samples_$budget/samples.npz" --classifier "$CLASSIFIER" \
    --out "results/dit_mnist_$budget.json"
  cp "$OUT/samples_$budget/grid.png" "results/dit_mnist_${budget}_grid.png"
done
