"""``python benchmarks/loader.py``: the ImageNet recipe's training loader alone, in images/s and images/s per worker.

What is measured is ``ImageFolderDataModule.train_dataloader`` built with the data settings of
``cli_configs/recipes/vit_imagenet.yaml`` (224 px random-resized crops, batch 128, RandAugment, Random Erasing 0.25),
only ``num_workers`` and ``device_augment`` varied: ``true`` is what a GPU run uses (the workers hand over uint8
images; normalisation and Random Erasing run on the GPU after the copy, so not here), ``false`` has the workers
finish float tensors. No model runs. For each worker count: the images of ``batches`` batches per worker over the
seconds they took, counted after each worker's first batch (starting workers and filling their queues is not the
steady rate); per worker = images/s / workers (the main process is the one worker at ``workers=0``). By default the
images are synthetic JPEGs of ImageNet's typical sizes, written to a temporary folder that is deleted afterwards;
just written, they are read from the page cache, so decoding and augmenting are measured, not a disk. Rows go to
``loader.json`` after each measurement, and the page ``loader.md`` beside it, so a stopped run keeps them.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from jsonargparse import CLI
from PIL import Image

from moh_lightning.configs import load_config
from moh_lightning.data.images import ImageFolderDataModule
from moh_lightning.errors import MissingDataError, UsageError
from moh_lightning.tools.bench.report import cpu_name, shared_machine

RECIPE = "recipes/vit_imagenet.yaml"
SIZES = ((500, 375), (375, 500), (500, 333), (333, 500))  # (width, height): ImageNet's commonest photo shapes
CLASSES = 10
QUICK_BATCH = 16
GPU_STEPS = Path("results/gpu/steps.json")


def usable_cores() -> int:
    """The cores this process may run on: a container's CPU set, not the host's count that ``os.cpu_count`` gives."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers() -> list[int]:
    """1, every power of two up to the core count, and the core count."""
    cores = usable_cores()
    return sorted({2 ** k for k in range(cores.bit_length()) if 2 ** k <= cores} | {cores})


def bench(workers: list[int] | None = None, data: str | None = None, batches: int = 20, quick: bool = False,
          output: str = "results/loader.json") -> Path:
    """The ImageNet recipe's training loader alone, in images/s and images/s per worker.

    For each worker count, ``device_augment`` true and false, on JPEGs of ImageNet's typical sizes. Rows into
    ``output`` and the page ``<stem>.md`` beside it, after each measurement.

    Args:
        workers: The loader's worker counts (0: the main process); None: 1, each power of two up to the count of
            cores this process may use, and that count.
        data: An ImageNet-layout folder of your own (``train/<class>/``, ``val/<class>/``, or ``<class>/`` folders)
            to load instead of synthetic JPEGs; it is only read.
        batches: Timed batches per worker, after each worker's first.
        quick: Batches of 16, one timed batch per worker.
        output: The rows' JSON file.
    """
    given = {"workers": (workers, None), "data": (data, None), "batches": (batches, 20)}
    command = " ".join(["python benchmarks/loader.py"] + (["--quick true"] if quick else [])
                       + [f"--{k} {str(v).replace(' ', '')}" for k, (v, default) in given.items() if v != default]
                       + ([f"--output {output}"] if output != "results/loader.json" else []))
    return bench_loader(output, workers, data, batches, quick, command)


def bench_loader(output: str = "results/loader.json", workers: list[int] | None = None, data: str | None = None,
                 batches: int = 20, quick: bool = False, command: str = "python benchmarks/loader.py") -> Path:
    """Measures each (device_augment, worker count), prints each row, rewrites ``output`` and its page after each."""
    if data is not None and not Path(data).expanduser().is_dir():
        raise MissingDataError(f"--data {data}: no such folder; give an ImageNet-layout folder "
                               f"(train/<class>/ and val/<class>/, or <class>/ folders), or leave it out for "
                               f"synthetic JPEGs.")
    counts = workers if workers is not None else default_workers()
    settings = load_config(RECIPE)["data"]["init_args"]
    if quick:
        settings["batch_size"], batches = QUICK_BATCH, 1
    path, rows = Path(output), []
    load_before, started = os.getloadavg(), time.time()
    with contextlib.ExitStack() as stack:
        if data is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moh_loader_")))
            print(f"loader: writing synthetic JPEGs into {scratch} (deleted afterwards)", flush=True)
            root = write_jpegs(scratch, settings["batch_size"] * (batches + 1) * max(max(counts), 1))
        else:
            root = Path(data).expanduser()
        images = {}
        for device_augment in (True, False):
            for count in counts:
                module = ImageFolderDataModule(str(root), **{**settings, "num_workers": count,
                                                             "device_augment": device_augment})
                module.setup("fit")
                images = images or describe([file for file, _ in module.train_set.samples], data is None)
                rows.append(measure(module, count, device_augment, batches))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(rows, indent=1) + "\n")
                path.with_suffix(".md").write_text(page(rows, images, command, load_before, os.getloadavg(),
                                                        time.time() - started, settings))
                row = rows[-1]
                print(f"loader: device_augment {device_augment}, workers {count}: "
                      f"{row['images_per_s']:.0f} images/s, {row['per_worker']:.0f} per worker -> {path}", flush=True)
    return path


def measure(module: ImageFolderDataModule, workers: int, device_augment: bool, batches: int) -> dict:
    """One row: the steady images/s of the module's training loader after each worker's first batch."""
    loader = module.train_dataloader()
    if len(loader) == 0:
        raise MissingDataError(f"--data {module.hparams.data_dir}: fewer training images than one batch "
                               f"({module.hparams.batch_size}).")
    load = os.getloadavg()[0]
    stream = _endless(loader)  # a folder smaller than the measurement is read again, epoch after epoch
    warm = max(workers, 1)
    for _ in range(warm):
        images = next(stream)[0]
    start = time.perf_counter()
    for _ in range(batches * warm):
        next(stream)
    seconds = time.perf_counter() - start
    stream.close()
    rate = batches * warm * module.hparams.batch_size / seconds
    return {"device_augment": device_augment, "workers": workers, "images_per_s": rate, "per_worker": rate / warm,
            "batch": module.hparams.batch_size, "batches": batches * warm, "seconds": seconds,
            "dtype": str(images.dtype).removeprefix("torch."), "shape": list(images.shape[1:]), "cpu": cpu_name(),
            "cores": usable_cores(), "load": [load, os.getloadavg()[0]]}


def _endless(loader):
    while True:
        yield from loader


def write_jpegs(root: Path, count: int) -> Path:
    """``count`` synthetic photos as ``train/<class>/*.JPEG`` and one per class in ``val/`` (the layout's split)."""
    jobs = [(root / "train" / f"n{i % CLASSES:08d}" / f"{i:07d}.JPEG", i) for i in range(count)]
    jobs += [(root / "val" / f"n{i:08d}" / f"{count + i:07d}.JPEG", count + i) for i in range(CLASSES)]
    with ProcessPoolExecutor(min(usable_cores(), max(1, count // 64))) as pool:
        list(pool.map(_write_jpeg, jobs, chunksize=64))
    return root


def _write_jpeg(job: tuple[Path, int]) -> None:
    # Smooth colour fields (sky, walls, blurred backgrounds), coarser texture and luminance noise like a camera's:
    # at quality 90 that compresses about as photos do (noise-free fields would make files of a few KB).
    path, index = job
    rng = np.random.default_rng(index)
    width, height = SIZES[index % len(SIZES)]
    field = rng.integers(0, 256, (*rng.integers(3, 9, 2), 3), dtype=np.uint8)
    texture = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    pixels = (0.7 * np.asarray(Image.fromarray(field).resize((width, height), Image.BICUBIC), np.float32)
              + 0.3 * np.asarray(Image.fromarray(texture).resize((width, height), Image.BICUBIC), np.float32)
              + rng.normal(0, 12, (height, width, 1)))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def describe(files: list[str], synthetic: bool, sample: int = 1000) -> dict:
    """The training images' count, and mean file size and pixel size over up to ``sample`` of them."""
    chosen = files[::max(1, len(files) // sample)]
    sizes = np.array([_pixels(file) for file in chosen], dtype=float)
    kilobytes = np.mean([os.path.getsize(file) for file in chosen]) / 1e3
    return {"images": len(files), "synthetic": synthetic, "mean_kb": kilobytes,
            "mean_width": sizes[:, 0].mean(), "mean_height": sizes[:, 1].mean(),
            "mean_megapixels": sizes.prod(1).mean() / 1e6, "sampled": len(chosen)}


def _pixels(file: str) -> tuple[int, int]:
    with Image.open(file) as image:  # reads the header only
        return image.size


def dense_vit_s_rate(steps: Path = GPU_STEPS) -> tuple[float, str] | None:
    """(images/s, GPU) of the compiled dense ViT-S step in ``benchmarks/steps.py``'s rows; None until measured."""
    rows = json.loads(steps.read_text()) if steps.is_file() else []
    for row in rows:
        if row.get("baseline") == "vit_s_100" and row.get("compile") and row.get("device") != "cpu":
            return row["batch"] / row["baseline_ms"] * 1e3, row["device"]
    return None


def page(rows: list[dict], images: dict, command: str, load_before, load_after, seconds: float,
         settings: dict) -> str:
    """``loader.json`` as a Markdown page: the machine, its load, the images, the table, the GPU comparison."""
    busy = shared_machine(load_before, load_before, threshold=0.5)
    made = (f"{images['images']} synthetic JPEGs (quality 90, {' / '.join(f'{w}x{h}' for w, h in SIZES)} in turn)"
            if images["synthetic"] else f"{images['images']} training images of the given folder")
    lines = [
        "# Image pipeline: the ImageNet recipe's training loader alone", "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {seconds / 60:.1f} min. "
        f"Machine: {rows[0]['cpu']}, {rows[0]['cores']} CPU cores.",
        f"Load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}, after: "
        f"{'/'.join(f'{x:.2f}' for x in load_after)} (after includes the bench's own workers). "
        + (f"{busy} before the bench started: the rates below are what that work left over." if busy else
           "Quiet before the bench started."), "",
        f"Images: {made}; on average {images['mean_kb']:.0f} KB a file, {images['mean_width']:.0f} x "
        f"{images['mean_height']:.0f} px and {images['mean_megapixels']:.2f} megapixels (over {images['sampled']} of "
        f"them); read from the page cache.", "",
        f"Loader: `ImageFolderDataModule.train_dataloader` with `{RECIPE}`'s data settings "
        f"({', '.join(f'{k} {v}' for k, v in settings.items() if k != 'num_workers')}; the rest the module's "
        f"defaults), the workers and `device_augment` below. `true` (a GPU run's setting) hands over uint8 images: "
        f"normalisation and Random Erasing then run on the GPU and are not counted here; `false` has the workers do "
        f"them. Images/s over the batches after each worker's first; per worker = images/s / workers (the main "
        f"process at 0 workers).", "",
        "| device_augment | workers | images/s | per worker | batches timed | handed over | load (1 min) during |",
        "|" + "---|" * 7]
    lines += [f"| {r['device_augment']} | {r['workers']} | {r['images_per_s']:.0f} | {r['per_worker']:.0f} | "
              f"{r['batches']} x {r['batch']} | {r['dtype']} {'x'.join(map(str, r['shape']))} | "
              f"{r['load'][0]:.2f} -> {r['load'][1]:.2f} |" for r in rows]
    lines += against_gpu(rows)
    return "\n".join(lines) + "\n"


def against_gpu(rows: list[dict]) -> list[str]:
    """The compiled dense ViT-S step's images/s against the loader's, and the workers a GPU step needs: N / the rate
    per worker, at one worker's rate (a core's) and at the most workers'. From the device_augment true rows."""
    used = sorted((r for r in rows if r["device_augment"]), key=lambda r: r["workers"])
    if not used:
        return []
    gpu, widest = dense_vit_s_rate(), used[-1]
    if gpu is None:
        lines = [f"The compiled dense ViT-S step's images/s: not yet measured on a GPU (`{GPU_STEPS}` has no compiled "
                 f"`vit_s_100` CUDA row)."]
    else:
        verdict = "enough" if widest["images_per_s"] >= gpu[0] else "**not enough**"
        lines = [f"The compiled dense ViT-S step on {gpu[1]}: {gpu[0]:.0f} images/s (`{GPU_STEPS}`). This loader "
                 f"with {widest['workers']} workers (device_augment true): {widest['images_per_s']:.0f} images/s, "
                 f"{verdict}."]
    rate = gpu[0] if gpu else 1000
    needed = " and ".join(f"{rate:.0f} / {r['per_worker']:.0f} = {rate / r['per_worker']:.1f} at the rate of "
                          f"{r['workers']} worker{'s' if r['workers'] != 1 else ''}"
                          for r in {id(r): r for r in (used[0], widest)}.values())
    lines.append(f"Estimate (arithmetic, not measured; device_augment true, assuming the workers scale to that many "
                 f"cores): a GPU step taking N images/s needs N / (images/s per worker) workers: "
                 f"{'for its' if gpu else 'per 1,000 images/s,'} {needed}.")
    return ["", "## Against the GPU step", "", *lines]


def main(args: list[str] | None = None) -> Path:
    try:
        return CLI(bench, args=args, as_positional=False)
    except UsageError as error:  # a folder that is not there: one line, no traceback
        raise SystemExit(f"loader: {error}") from None


if __name__ == "__main__":
    main()
