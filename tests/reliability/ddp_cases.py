"""Each task's shipped CPU config shrunk to seconds, for the DDP and FSDP runs of every registered task (and the DiT
head-load settings of the exact-resume runs)."""
import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def write_text_corpus(folder: Path) -> None:
    """Twelve small 'documents', so the LM test tokenises kilobytes rather than the standard library."""
    words = ["def", "return", "self", "x", "=", "(", ")", ":", "if", "for"]
    folder.mkdir()
    for i in range(12):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words[(i * j) % len(words)] for j in range(2000)))


# DiT's head-load cards (a routed layer's load per class and per timestep bucket) take seconds to draw: 2 classes, no
# timestep buckets. They are counted, summed over the ranks and drawn as ever.
HEAD_LOAD_CARDS_SHRUNK = ["--head_load.max_groups=2", "--head_load.timestep_buckets=0"]
# Each shipped config shrunk to seconds: 2 blocks, 3 optimizer steps on each of 2 processes, one validation batch at
# the end.
DIT_SHRUNK = ["--data.init_args.batch_size=8", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=3",
              "--model.init_args.arch.depth=2", "--model.init_args.arch.embed_dim=64",
              "--model.init_args.arch.moh.num_shared_heads=4", "--model.init_args.arch.moh.top_k=2",
              *HEAD_LOAD_CARDS_SHRUNK]
DDP_TASKS = {
    "classification": ("vit_tiny_mnist_75", ["--data.init_args.batch_size=16", "--trainer.limit_val_batches=1",
                                             "--trainer.val_check_interval=3", "--model.init_args.arch.depth=2"]),
    # dit_mnist_90's own callbacks (EMA from step 400, sample grids every 1000 steps) are replaced so that the
    # EMA is updated and a grid is sampled on rank 0 within the 3 steps; the head-load dashboards and last.ckpt
    # are the always-on callbacks'.
    "diffusion": ("dit_mnist_90", [*DIT_SHRUNK, "--trainer.callbacks=" + json.dumps([
        {"class_path": "moh_lightning.callbacks.EMAWeightAveraging",
         "init_args": {"decay": 0.9, "update_starting_at_step": 1}},
        {"class_path": "moh_lightning.callbacks.sample_grid.SampleGridCallback",
         "init_args": {"every_n_steps": 2, "num_per_class": 1, "steps": 2}}])]),
    "language_model": ("llm_stdlib_75", [
        "--data.init_args.sources=[{path: corpus, val_fraction: 0.3}]", "--data.init_args.cache_dir=token_cache",
        "--data.init_args.seq_len=64", "--data.init_args.batch_size=4", "--model.init_args.arch.depth=2",
        "--model.init_args.arch.embed_dim=64", "--model.init_args.arch.head_dim=8",
        "--model.init_args.arch.intermediate_size=128", "--model.init_args.arch.block_size=64",
        "--trainer.limit_val_batches=1", "--trainer.val_check_interval=3"]),
}


def logged_scalars(run: Path, tag: str) -> list[float]:
    accumulator = EventAccumulator(str(run)).Reload()
    return [event.value for event in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []
