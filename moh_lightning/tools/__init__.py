"""Tools above the tasks: sampling, generation, export, evaluation (fidelity, digit quality, lm-eval), benchmarks.

Each ``moh <tool>`` command is a typed function in one of these modules (see ``moh_lightning.cli.TOOLS``).
"""
