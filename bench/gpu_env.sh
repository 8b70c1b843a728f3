# The GPU machine's environment for the bench scripts, sourced from the repository root: the carried wheels
# (gguf, structlog, pytest-asyncio, transformers in .whl/) installed into /tmp/site, unbuffered output, and the
# kernel cache in the repository (it survives between calls on a warm machine).
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 STRATA_CACHE="$PWD/.cache"
