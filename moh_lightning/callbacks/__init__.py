"""Cross-cutting concerns of every task, as Lightning callbacks."""
from moh_lightning.callbacks.ema import EMAWeightAveraging
from moh_lightning.callbacks.head_load import HeadLoadCallback
from moh_lightning.callbacks.logger_runs import LoggerRuns
from moh_lightning.callbacks.predictions import PredictionWriter
from moh_lightning.callbacks.reliability import ExactResumeCallback, FiniteLossGuard, StepCheckpoint
from moh_lightning.callbacks.run_summary import RunSummary
from moh_lightning.callbacks.shutdown import RunShutdown
from moh_lightning.callbacks.throughput import MoHThroughputMonitor

__all__ = ["EMAWeightAveraging", "ExactResumeCallback", "FiniteLossGuard", "HeadLoadCallback", "LoggerRuns",
           "MoHThroughputMonitor", "PredictionWriter", "RunShutdown", "RunSummary", "StepCheckpoint"]
