# Sourced by the GPU scripts: the suite's pure-Python dependencies the GPU image lacks, carried as wheels in .whl/
# (see gpu/README.md), installed beside the image's torch; then the suite itself from the working tree.
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
