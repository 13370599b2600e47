#!/usr/bin/env bash
# One GPU lease, second call: the three tasks' GPU default configs (vit_s_75, dit_s2_75, llm_s_75) trained a few
# hundred steps in bf16-mixed on data made here (no hub): scikit-learn's digits as an image folder, random VAE
# latents in the latent cache's layout, the interpreter's standard library as bytes.
# Run from the repository root with .whl/ carried: STEPS=300 bash results/gpu/train.sh
set -u
. results/gpu/setup.sh
STEPS=${STEPS:-300}
ACC=${ACC:-gpu}
WORK=${WORK:-/tmp/gpu_train}
LOGS=${OUT:-$WORK}
mkdir -p "$WORK" && cd "$WORK"
[ -d digits ] || python3 -m moh_lightning.data.images digits digits > /dev/null
python3 - <<'PY'
import json, pathlib
import numpy as np
cache = pathlib.Path("latents")
if not (cache / "done.json").is_file():
    cache.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    np.save(cache / "latents.npy", rng.standard_normal((2048, 2, 4, 32, 32), dtype=np.float32).astype(np.float16))
    np.save(cache / "labels.npy", rng.integers(0, 1000, 2048))
    (cache / "done.json").write_text(json.dumps({"images": 2048}))
PY
common=(--trainer.accelerator "$ACC" --trainer.devices 1 --trainer.precision bf16-mixed --trainer.max_steps "$STEPS"
        --trainer.log_every_n_steps 25 --trainer.enable_progress_bar false)
run() {   # name, timeout, args...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" python3 -m moh_lightning.cli fit "$@" "${common[@]}" > "$LOGS/train_$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s"; tail -15 "$LOGS/train_$name.log"
}
run vit_s_75 ${LIMIT:-90} --config vit_s_75.yaml --data.init_args.data_dir digits --data.init_args.batch_size ${BATCH:-128}
run dit_s2_75 ${LIMIT:-90} --config dit_s2_75.yaml --data.init_args.data_path digits/train \
    --data.init_args.cache_dir latents --data.init_args.batch_size ${BATCH:-128}
run llm_s_75 ${LIMIT:-90} --config llm_s_75.yaml --data.init_args.tokenizer byte --data.init_args.sources null \
    --data.init_args.seq_len 1024 --data.init_args.batch_size ${LM_BATCH:-8} --trainer.accumulate_grad_batches 1 \
    --data.init_args.val_samples 64 --trainer.limit_val_batches 8
# The last logged value of each training scalar (loss, throughput, MFU, head load) per run, from TensorBoard's files.
python3 - <<'PY' | tee "$LOGS/train_scalars.txt"
import glob
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for folder in sorted(glob.glob("runs/*/version_*")):
    events = EventAccumulator(folder, size_guidance={"scalars": 0}).Reload()
    print(f"## {folder}")
    for tag in sorted(events.Tags()["scalars"]):
        if tag.split("/")[0] in ("train", "val", "throughput") or tag.endswith("active_fraction"):
            points = events.Scalars(tag)
            print(f"{tag}: step {points[-1].step} = {points[-1].value:.4g} (first {points[0].value:.4g})")
PY
