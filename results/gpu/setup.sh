# Sourced by the GPU scripts: the suite's pure-Python dependencies the GPU image lacks, carried as wheels in .whl/
# (made here with `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl jsonargparse
# docstring_parser typeshed_client torchdata torch_fidelity diffusers importlib_metadata defusedxml platformdirs
# more-itertools truststore timm`, the versions of this venv), installed beside the image's torch; the suite itself
# is imported from the working tree.
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
