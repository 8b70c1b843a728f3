# The GPU machine's environment for the bench scripts, sourced from the repository root: the carried wheels
# (gguf, structlog, pytest-asyncio, transformers in .whl/) installed into /tmp/site, unbuffered output, and the
# kernel cache in the repository (it survives between calls on a warm machine).
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 STRATA_CACHE="$PWD/.cache"
out=${OUT:-/tmp}                  # the scripts' logs: $OUT comes back from the device tool

# make_flash PATH: the flash file made in the background when it is missing (flash preset, realistic mix and
# routing: ~2 minutes on the GPU machine, while the caller runs its tests), logged to $OUT/make_model.log; the
# caller `wait`s before reading it
make_flash() {
    [ -f "$1" ] && return 0
    mkdir -p "$(dirname "$1")"
    python3 cli.py make-model "$1" --preset flash --ple-base 2000000 --routing realistic --threads 12 \
        > "${OUT:-/tmp}/make_model.log" 2>&1 &
}
