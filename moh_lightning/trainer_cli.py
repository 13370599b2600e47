"""``moh fit`` / ``validate`` / ``test`` / ``predict``: LightningCLI over the suite's tasks, with the callbacks every
run needs, its run folder, ``--ckpt_path last`` and one-line errors.

Every run writes into its own run folder ``runs/<name>/version_N/`` (events, resolved config, checkpoints; see
``moh_lightning.runs``); a ``--config`` name resolves against the shipped ``cli_configs/`` and may ``extends:`` others
(``moh_lightning.cli_args``).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities.model_helpers import is_overridden

from moh_lightning import lightning_compat as compat
from moh_lightning.callbacks import (
    ExactResumeCallback,
    FiniteLossGuard,
    HeadLoadCallback,
    LoggerRuns,
    MoHThroughputMonitor,
    PredictionWriter,
    RunSummary,
    StepCheckpoint,
)
from moh_lightning.callbacks.logger_runs import FOLDER_LOGGERS, SaveRunConfig, keep_csv_rows, run_folder
from moh_lightning.callbacks.shutdown import RunShutdown, run_as_a_whole
from moh_lightning.cli_args import CONFIG_FLAGS, null_group_args, resolve_config_args, run_name
from moh_lightning.cli_errors import OneLineErrors, one_line_error
from moh_lightning.cli_init_from import network_of_init_from, tokenizer_of_init_from
from moh_lightning.errors import UsageError, debugging, missing_extra
from moh_lightning.lightning_compat import MoHRichProgressBar
from moh_lightning.runs import (
    check_resumable,
    check_run_names,
    latest_loadable_checkpoint,
    logger_runs,
    logs_in_folders,
    name_for_budget,
    next_version,
    read_kept_tokenizer,
    record_changes,
    resolve_init_from,
    resolve_source_paths,
    run_root,
    use_run_folder,
)
from moh_lightning.serialization import load_file
from moh_lightning.settings import (
    LINKED_SIZES,
    checkpoint_settings,
    compare_with_checkpoint,
    flat,
    typed_model_keys,
    with_run_config,
)
from moh_lightning.tasks.base import MoHTask

EVALUATIONS = ("validate", "test", "predict")

# What every run shares: crash-safe checkpoint writes, and TensorBoard events in runs/<name>/version_N/.
TRAINER_DEFAULTS = {
    "plugins": [{"class_path": "moh_lightning.checkpoint_io.AtomicCheckpointIO"}],
    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
               # The head-load callback writes the HParams record with the run's real metrics; Lightning's
               # placeholder hp_metric (-1) would only add an empty chart.
               "init_args": {"save_dir": "runs", "name": None, "default_hp_metric": False}},
}


class OneLineErrorParser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser with one-line errors, which name the listing of the whole config."""

    def one_line(self, message: str) -> str:
        return f"moh: {one_line_error(message)}"


class MoHLightningCLI(compat.CheckpointSettingsCLI):
    """LightningCLI over any of the suite's tasks and data modules, chosen by ``class_path`` in the config.

    The callbacks every run needs are always on, each configured under its own key: ``head_load``
    (``HeadLoadCallback``), ``checkpoint`` (``StepCheckpoint``), ``exact_resume``, ``finite_loss_guard``,
    ``run_summary``, ``throughput`` (``MoHThroughputMonitor``), ``predictions`` (``PredictionWriter``, what
    ``moh predict`` writes), ``shutdown`` (``RunShutdown``) and ``logger_runs``.
    ``--ckpt_path last`` resumes the newest checkpoint of this run's name, in its own run folder, and refuses a
    run that differs from the one saved with it in what makes it that run (``moh_lightning.runs``); a longer budget
    or other workers continue, with one line saying what changed.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        from_command_line = args is None
        given = list(sys.argv[1:] if from_command_line else args)
        if given[:1] and given[0] in EVALUATIONS:
            given = [given[0], *with_run_config(given[0], given[1:], CONFIG_FLAGS)]
        self.run_name = run_name(given)
        self.command = given[0] if given else None
        with threads_restored():  # set for forked processes once the trainer exists; this process keeps its own
            super().__init__(
                LightningModule,
                LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_callback=SaveRunConfig,
                save_config_kwargs={"overwrite": True},
                parser_class=OneLineErrorParser,
                trainer_defaults=TRAINER_DEFAULTS,
                args=null_group_args(resolve_config_args(given)),
                run=run,
            )

    def subcommands(self) -> dict[str, set[str]]:
        # The parser of the command being run only: LightningCLI builds one for each of its four commands, the
        # larger part of a command's start (a second of the ~1.3 s of `moh fit --print_config` on a quiet machine).
        every = super().subcommands()
        return {self.command: every[self.command]} if self.command in every else every

    def parse_arguments(self, parser: LightningArgumentParser, args: Sequence[str]) -> None:
        # ``args`` is this command line with its configs expanded, while sys.argv keeps what was typed: Lightning's
        # DDP launcher starts each further process from sys.argv, which then expands it the same way. (LightningCLI
        # warns when both are given, a guard against mistakes that does not apply here.)
        self.config = parser.parse_args(args)
        self.given_args, self.checkpoint_hparams, self.resumed = list(args), None, None
        # An explicit checkpoint's settings are read next (_parse_ckpt_path); a missing file, one that names a type no
        # checkpoint needs and another task's checkpoint are refused here first, in one line.
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path:
            task = getattr(self.config[subcommand].get("model"), "class_path", None)
            self.checkpoint_hparams = checkpoint_settings(subcommand, str(ckpt_path), task)

    def checkpoint_settings_into_config(self) -> None:
        """The network settings saved with an explicit ``--ckpt_path``, with the ``--model.*`` keys typed on the
        command line on top (``moh_lightning.settings``). LightningCLI's own puts the saved ones over everything, so
        that a ``top_k`` typed for an evaluation was silently the checkpoint's."""
        hparams = {k: v for k, v in (self.checkpoint_hparams or {}).items() if k != "_instantiator"}
        self.config_model_keys = {}
        if not hparams:
            return
        subcommand = self.config.subcommand
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        named_model = self._named_model_keys()
        typed = typed_model_keys(self.given_args)
        init_args = self.config[subcommand].model.init_args
        for key, value in named_model.items():
            if any(key == name or key.startswith(f"{name}.") for name in typed):
                init_args[key] = value
            else:
                self.config_model_keys[key] = value

    def _named_model_keys(self) -> dict:
        """The ``model.init_args`` keys this command names in its config files and options, flat, without the
        defaults. Parsed unvalidated, since a class named without its required arguments (``--trainer.logger
        CSVLogger``) is whole only with them."""
        named = compat.parse_unvalidated(self.parser, self.given_args)
        named = named[named.subcommand] if named.get("subcommand") else named
        return flat(getattr(named.get("model"), "init_args", None) or {})

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(HeadLoadCallback, "head_load")
        parser.add_lightning_class_args(StepCheckpoint, "checkpoint")
        parser.add_lightning_class_args(ExactResumeCallback, "exact_resume")
        parser.add_lightning_class_args(FiniteLossGuard, "finite_loss_guard")
        parser.add_lightning_class_args(RunSummary, "run_summary")
        parser.add_lightning_class_args(MoHThroughputMonitor, "throughput")
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        parser.add_lightning_class_args(RunShutdown, "shutdown")
        parser.add_lightning_class_args(LoggerRuns, "logger_runs")
        # Sizes flow from the data: a data module that has the attribute sets the model's value when both are
        # instantiated (a value in the config is overwritten). jsonargparse skips a link whose source attribute the
        # data module lacks (the folder module without its folder, a text module whose tokenizer cannot load) or
        # whose target the task's arch lacks (LlamaConfig has no num_classes, ViTConfig no vocab_size). A link must
        # not name a target that a task combined with that data module lacks: jsonargparse 4.53 would still pass the
        # value into the task's recorded hyper-parameters, and its checkpoint would not load. So every image task
        # takes img_size (a pixel-space DiT's input_size) and class_names.
        for key in LINKED_SIZES:
            parser.link_arguments(f"data.{key}", f"model.init_args.arch.{key}", apply_on="instantiate")
        # The class names travel with the checkpoint, for `moh sample --classes` and the per-class views.
        parser.link_arguments("data.class_names", "model.init_args.class_names", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        # Before `last` is compared with the run it would continue, whose config.yaml holds the source's network.
        tokenizer_of_init_from(config)
        if not self.checkpoint_hparams:  # a run from a checkpoint has the network saved with it
            network_of_init_from(config, self._named_model_keys)
        if self.subcommand == "fit":
            resolve_source_paths(getattr(config.get("data"), "init_args", None))
            resolve_init_from(getattr(config.get("model"), "init_args", None))
        if self.run_name:  # once the network is whole, a continue-tuned one's heads included
            self.run_name = name_for_budget(self.run_name, config.get("model"), typed_model_keys(self.given_args))
        logger = config.trainer.get("logger")
        init_args = getattr(logger, "init_args", None)
        if init_args is not None and "name" in init_args and init_args.name is None:
            init_args.name = self.run_name or "default"
        check_run_names(logger)
        if self.subcommand and config.get("ckpt_path") == "last" and init_args is not None:
            self._resume_last(config, init_args)
        if self.subcommand in EVALUATIONS and init_args is not None:
            self._beside_its_run(config, init_args)
        if init_args is not None and not logs_in_folders(logger) and config.trainer.get("default_root_dir") is None:
            folder = next_version(run_root(logger, self.run_name or "default"))  # a new run of such a logger
            use_run_folder(config, folder, f"{folder.parent.name}/{folder.name}")
        accelerator = config.trainer.get("accelerator")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise SystemExit(f"moh: trainer.accelerator={accelerator} but this machine has no CUDA GPU; run the same "
                             f"config on the CPU with --trainer.accelerator cpu --trainer.devices 2 (DDP over gloo).")

    def _beside_its_run(self, config, logger_args) -> None:
        """Evaluating a run's checkpoint logs into ``<run>/eval/<subcommand>-<checkpoint>/`` (``-2``, ``-3`` when
        repeated), beside the run it scores, instead of a new version of the training run's name."""
        ckpt_path = config.get("ckpt_path")
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        checkpoints = Path(ckpt_path).resolve().parent
        if checkpoints.name != "checkpoints":
            return
        run, base = checkpoints.parent, f"{self.subcommand}-{Path(ckpt_path).stem}"
        version, repeat = base, 1
        while (run / "eval" / version).exists():
            repeat += 1
            version = f"{base}-{repeat}"
        if logs_in_folders(config.trainer.logger):
            logger_args.save_dir, logger_args.name, logger_args.version = str(run), "eval", version
        else:  # MLflow nests this run under the checkpoint's own
            use_run_folder(config, run / "eval" / version, f"{run.parent.name}/{run.name}/eval/{version}",
                           logger_runs(Path(ckpt_path)))
        # The run's checkpoint callbacks keep the training folder they saved in; nothing is saved while evaluating.
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")

    def fit(self, **kwargs) -> None:
        made = self._run_folder_to_make() if self.trainer.world_size == 1 else None
        try:
            # SIGTERM, Ctrl-C, a hung rank and a lost node end every process of the run (callbacks/shutdown.py).
            with run_as_a_whole(self.trainer):
                self.trainer.fit(**kwargs)
        except (UsageError, SystemExit) as error:
            # A mistake found before the first step (the data, a shape) leaves no run folder behind; a signal, a
            # failure later on and a resumed run's folder are left as they are.
            mistake = isinstance(error, UsageError) or error.code not in (None, 0, 130, 143)
            if made is not None and mistake and self.trainer.global_step == 0:
                shutil.rmtree(made, ignore_errors=True)
            raise

    def _run_folder_to_make(self) -> Path | None:
        """The outermost folder of this run's that does not exist yet (``runs/<name>`` for a new name, else its
        ``version_N``), None when the run writes into folders that exist (a resumed run) or logs nowhere."""
        logger = self.trainer.logger
        folder = logger.log_dir if isinstance(logger, FOLDER_LOGGERS) else self.trainer.default_root_dir
        if logger is None or folder is None or Path(folder).exists():
            return None
        folder = Path(folder).resolve()
        while not folder.parent.exists():
            folder = folder.parent
        return folder

    def before_test(self) -> None:
        if not is_overridden("test_step", self.model):
            raise SystemExit(f"moh test: {type(self.model).__name__} has no test split to score; `moh validate` "
                             f"scores its validation split.")

    def after_validate(self) -> None:
        self._say_where_it_wrote()

    def after_test(self) -> None:
        self._say_where_it_wrote()

    def _say_where_it_wrote(self) -> None:
        """One line naming the folder that holds this evaluation's metrics and head load (none without a logger)."""
        folder = run_folder(self.trainer)
        if folder is not None and self.trainer.is_global_zero:
            shown = folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder
            print(f"moh {self.subcommand}: metrics and head load in {shown}")

    def _resume_last(self, config, logger_args) -> None:
        """Points ``ckpt_path`` at this run name's newest checkpoint that loads, if any, and the logger at that run
        (TensorBoard's and CSV's version folder; the MLflow or W&B run kept in the checkpoint, in its folder)."""
        found = latest_loadable_checkpoint(run_root(config.trainer.logger, self.run_name or "default"))
        if found is None:
            config.ckpt_path = None  # the first start of a run that will be resumed later: start fresh
            return
        version_dir, checkpoint = found
        if logs_in_folders(config.trainer.logger):
            logger_args.version = int(version_dir.name.removeprefix("version_"))
        else:  # the same MLflow or W&B run, kept in the checkpoint, in the same folder
            use_run_folder(config, version_dir, f"{version_dir.parent.name}/{version_dir.name}",
                           logger_runs(checkpoint), continues=True)
        read_kept_tokenizer(version_dir, getattr(config.get("data"), "init_args", None))
        current = yaml.safe_load(compat.subcommand_parser(self, self.subcommand).dump(config, skip_none=False))
        # Said once the task is built, with what the change does to its schedule (_say_what_the_resume_changes).
        self.resumed = (version_dir, checkpoint, check_resumable(version_dir, current))
        config.ckpt_path = str(checkpoint)
        # The checkpoint folder Lightning warns "exists and is not empty" holds the checkpoints this run continues,
        # named as Lightning names it: from the logger's save_dir as given, or resolved where a dirpath is.
        for folder in {os.path.join(logger_args.get("save_dir") or "", version_dir.parent.name, version_dir.name,
                                    "checkpoints"), os.path.realpath(version_dir / "checkpoints")}:
            warnings.filterwarnings("ignore", message=f"Checkpoint directory {re.escape(folder)} exists and is not "
                                                      f"empty")

    def _say_what_the_resume_changes(self) -> None:
        """One line, and the run folder's resumes.log, saying what ``--ckpt_path last`` continues with otherwise than
        the run was saved with: its settings, and what they do to the task's schedule (``schedule_change``)."""
        version_dir, checkpoint, changes = self.resumed
        schedule_change = getattr(self.model, "schedule_change", None)
        if self.subcommand == "fit" and schedule_change is not None and not checkpoint.is_dir():
            schedule = schedule_change(load_file(checkpoint, mmap=True), self.datamodule, self.trainer)
            changes = "; ".join(part for part in (changes, schedule) if part) or None
        if changes:
            record_changes(version_dir, checkpoint, changes)

    def before_predict(self) -> None:
        """``moh predict`` where the task or the data cannot predict (no images or prompts given, a diffusion model)
        stops in one line saying what to do, before the trainer starts: their ``predict_problem``."""
        for part in (self.model, self.datamodule):
            problem = part.predict_problem() if hasattr(part, "predict_problem") else None
            if problem:
                raise SystemExit(f"moh predict: {problem}")

    def instantiate_trainer(self, **kwargs) -> Trainer:
        # The bar Lightning adds when none is configured becomes the suite's, which labels unlimited epochs truthfully.
        # Lightning adds its own callbacks to the configured list itself, so that is copied first.
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        configured = config.trainer.get("callbacks") or []
        configured = list(configured) if isinstance(configured, list) else [configured]
        trainer = super().instantiate_trainer(**kwargs)
        keep_csv_rows(trainer.loggers)  # before Lightning's CSV writer deletes a continued run's rows
        for i, callback in enumerate(trainer.callbacks):
            if type(callback) is RichProgressBar and not any(callback is given for given in configured):
                trainer.callbacks[i] = MoHRichProgressBar()
        return trainer

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:  # an __init__ check (e.g. a head budget) inside jsonargparse's nested report
            if debugging():
                raise
            raise missing_extra(error) or SystemExit(f"moh: {one_line_error(str(error))}") from None
        one_thread_per_forked_cpu_process(self.trainer)  # fit, validate, test and predict alike
        if self.checkpoint_hparams and isinstance(self.model, LightningModule):
            # After the data module passed its sizes on, before anything is written.
            line = compare_with_checkpoint(self.subcommand, str(self.config[self.subcommand].ckpt_path),
                                           self.checkpoint_hparams, self.model.hparams, self.config_model_keys)
            if line:
                print(line, file=sys.stderr)
        if self.subcommand and isinstance(self.model, MoHTask):
            self.model.restores_checkpoint = bool(self.config[self.subcommand].get("ckpt_path"))
        if self.resumed is not None:
            self._say_what_the_resume_changes()


def one_thread_per_forked_cpu_process(trainer) -> None:
    """CPU processes forked from this one (``ddp_fork``, ``ddp_notebook``) run one thread each, with a warning.

    This process has run OpenMP threads (building the model), and GNU OpenMP is not fork-safe: a forked process that
    runs more than one thread deadlocks at its first parallel operation, DDP's first broadcast, and never says why.
    Lightning gives each process ``cores / processes`` threads unless ``OMP_NUM_THREADS`` is set, so it is set here.
    """
    launcher = trainer.strategy.launcher
    forks = launcher is not None and launcher.is_interactive_compatible and trainer.num_devices > 1
    if not forks or not isinstance(trainer.accelerator, CPUAccelerator):
        return
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print(f"moh: the {trainer.num_devices} CPU processes forked by trainer.strategy run one thread each (OpenMP "
              "deadlocks in a process forked from a threaded one); trainer.strategy=ddp starts them afresh, "
              "with OMP_NUM_THREADS threads each.", file=sys.stderr)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@contextmanager
def threads_restored() -> Iterator[None]:
    """Puts this process's torch thread count and ``OMP_NUM_THREADS`` back as they were on the way out."""
    threads, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if variable is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = variable
