"""The developer's benchmarks: scripts beside the package (``python benchmarks/<name>.py --help``), never installed.

A package only so that their tests import them as ``benchmarks.<name>`` and the ``moh fit`` that ``parity`` times
loads its callback by that name.
"""
