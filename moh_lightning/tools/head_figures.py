"""``moh head-figures``: the head-load heatmaps of a finished run as paper figures (PDF and PNG), without a checkpoint.

``HeadLoadCallback`` saves the per-layer loads of every validation in the run folder (``head_load/loads.json``, the
latest; ``head_load/loads_history.jsonl``, the layer loads of each one). This command draws from them:

* ``layers.{pdf,png}``: layers x heads, the share of tokens each head serves, shared heads marked;
* ``<group>_layer_XX.{pdf,png}`` for every routed layer: the load of each routed head per class / text source / noise
  level (the paper's Fig. 3, as a heatmap).

    moh head-figures --run runs/vit_tiny_mnist_75/version_0 --out figs/
"""
from __future__ import annotations

from pathlib import Path

from jsonargparse.typing import PositiveInt

from moh_lightning.callbacks.head_load.loads import HISTORY_FILE, LOADS_FILE, HeadLoadSnapshot
from moh_lightning.callbacks.head_load.render import snapshot_figures
from moh_lightning.outputs import check_output_folder, created_folder


def _find_loads(run: Path) -> Path:
    for candidate in (run / "head_load" / LOADS_FILE, run / LOADS_FILE):
        if candidate.is_file():
            return candidate
    versions = sorted(run.glob("version_*/head_load/" + LOADS_FILE),
                      key=lambda path: int(path.parent.parent.name.removeprefix("version_") or 0))
    if versions:
        return versions[-1]
    raise SystemExit(f"moh head-figures: --run {run}: no head_load/{LOADS_FILE} there; point it at a run folder "
                     "(runs/<name>/version_N) whose training ran at least one validation with HeadLoadCallback.")


def head_figures(run: str, out: str = "figs", formats: list[str] | None = None, max_groups: PositiveInt = 20,
                 layers: list[int] | None = None, dpi: PositiveInt = 300, overwrite: bool = False) -> list[str]:
    """Renders the head-load heatmaps of a run folder as PDF / PNG figures.

    Args:
        run: Run folder (``runs/<name>/version_N``; ``runs/<name>`` takes its newest version), or a ``loads.json``.
        out: Folder for the figures (created); refused when it holds anything already, unless ``overwrite``.
        formats: File formats to write; PDF (vector) and PNG by default.
        max_groups: Groups (classes, sources) per group heatmap, the first ones by id.
        layers: Only these layers' group heatmaps (by layer number); all routed layers when None.
        dpi: Resolution of raster formats.
        overwrite: Write into an ``out`` that holds files already, replacing those of the same names.

    Returns:
        The paths written.
    """
    target = check_output_folder(out, "--out", overwrite)
    path = Path(run)
    loads = path if path.is_file() else _find_loads(path)
    try:
        snapshot = HeadLoadSnapshot.load(loads)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise SystemExit(f"moh head-figures: --run {run}: not a head-load record ({LOADS_FILE}); point it at a run "
                         f"folder (runs/<name>/version_N) or at its head_load/{LOADS_FILE}.") from None
    written = []
    with created_folder(target):
        for stem, figure in snapshot_figures(snapshot, max_groups).items():
            if layers is not None and stem != "layers" and int(stem.rsplit("_", 1)[-1]) not in layers:
                continue
            for extension in formats or ["pdf", "png"]:
                file = target / f"{stem}.{extension.lstrip('.')}"
                figure.savefig(file, dpi=dpi, bbox_inches="tight", pad_inches=0.03)
                written.append(str(file))
    history = loads.parent / HISTORY_FILE
    print(f"head-figures: {len(written)} files in {target} from {loads} (step {snapshot.step}, {snapshot.split}"
          + (f"; earlier validations in {history}" if history.is_file() else "") + ")")
    return written


__all__ = ["head_figures"]
