"""A package, so that pytest imports this folder's conftest as ``benchmarks.tests.conftest``, apart from the
``conftest`` that ``tests/``' modules import their helpers from."""
