# Sourced (from the repository root) by bench/gpu.sh and bench/gpu/session.sh: the Python environment of a device call.
# Wheels carried in .whl/ (bench/gpu/fetch-wheels.sh) are installed into /tmp/daedalus-site, where they shadow the
# image's versions of the same packages; that and trainer/ go on PYTHONPATH. Done once per call: a script started
# by another that sourced this file (session.sh -> gpu.sh) inherits the environment (DAEDALUS_GPU_ENV) and skips it.
if [ -z "${DAEDALUS_GPU_ENV:-}" ]; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/daedalus-site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/daedalus-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD/trainer${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false DAEDALUS_GPU_ENV=1
fi
