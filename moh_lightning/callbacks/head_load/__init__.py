"""Head-load dashboards: which heads each MoH layer uses, in TensorBoard, Weights & Biases, MLflow and the run folder.

A package because the dashboards are concerns that change for different reasons, one per module: what is measured
(``loads``: plain numbers, the schema of ``loads.json``), counting it (``counting``: gates, DDP sums, collapse), drawing
it (``render``: the one matplotlib renderer, shared with ``moh head-figures``), showing it in each logger (``loggers``)
and putting it in words (``summary``); ``callback`` holds only the Lightning hooks.

A head is *loaded* by a token when its gate is non-zero (``MoHAttention.last_gates``); its load is the share of tokens
that use it. Counts are summed over a logging window of training batches and over DDP ranks, and over the whole
validation set. A routed head's *balanced* load is top-k / routed heads. What is logged, with the same names in every
task (TensorBoard groups tags by their first path part, so the images come first, in one group):

* ``head_load/heatmap_train`` (every ``images_every_n_windows``-th logging window, the first one included, and the
  last step's: the steps after the last full window close one more when training ends),
  ``head_load/heatmap_val`` (every ``images_every_n_validations``-th validation of a fit and its last) and
  ``head_load/heatmap_test`` (``moh test``): layers x heads, shared heads marked, loads in % of tokens written in the
  cells, coloured by load / balanced load. ``moh validate`` / ``moh test`` log at their checkpoint's step.
* ``head_load/over_time_layer_XX`` (with ``heatmap_train``, every routed layer): the load of each routed head over
  the windows so far, one colour and legend entry per head, the even load dashed.
* ``head_load/per_<group>_layer_XX`` (with ``heatmap_val``, every routed layer): groups x routed heads, the groups being
  what the task's ``head_load_groups`` returns, named by its ``head_load_group_name`` (class, source), and for a task
  that exposes ``last_timesteps`` (diffusion) also the timestep in ``timestep_buckets`` buckets (``per_timestep``).
* ``head_load_per_head/layer_XX/head_YY``: the exact load of every routed head each window (shared heads serve every
  token and are not repeated as constant series); a custom-scalars layout draws one chart per layer, one line per
  head.
* ``head_load_vs_even/layer_XX``: a histogram of the routed heads' load ÷ balanced load every window (Histograms
  and Distributions tabs): the band narrows onto 1 as the layer balances.
* ``head_load_balance/layer_XX/busiest_head_vs_balanced`` and ``.../idlest_head_vs_balanced``: the largest and the
  smallest routed load divided by the balanced load (1 = even, 0 = an unused head), and at the end of training
  ``head_load_balance/final_load_entropy`` (mean over routed layers of the normalised entropy of the routed loads).
* ``head_load/layer_XX/collapsed_heads``: only from the first window in which a head of that layer collapsed.
* HParams under one vocabulary (``run_hparams``: ``moh/activated_fraction``, ``moh/shared_heads``, ``moh/top_k``,
  ``moh/load_balance_beta``, ``moh/router`` ...) with the run's final metrics (``hparam_metrics``).
* ``head_load/summary`` at the end of training: a markdown report per layer (Text tab and ``head_load/summary.md``).

TensorBoard gets images, histograms, scalars, the custom-scalars layout, text and HParams; Weights & Biases images,
scalars, line-series charts, a table, HTML text and config; MLflow step images, metrics, figures, text and params.
Whatever the logger (CSV or none too), the run folder's ``head_load/`` receives the latest heatmaps as PNG,
``loads.json`` (what ``moh head-figures`` draws paper figures from), ``loads_history.jsonl``, ``loads_over_time.png``
and ``summary.md``.
"""
from moh_lightning.callbacks.head_load.callback import HeadLoadCallback
from moh_lightning.callbacks.head_load.summary import run_hparams

__all__ = ["HeadLoadCallback", "run_hparams"]
