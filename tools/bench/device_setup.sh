# Sourced at the start of a GPU call (after tools/bench/device_carry.sh built the carry here):
# installs the carried wheels and NIXL under /tmp/site and exports what the mesh needs.
#   source tools/bench/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl .whl-hf/*.whl
# NIXL only where carried: a call that needs none (device_vision.sh) leaves .nixl out to fit the 64 MiB carry.
[ -f .nixl/nixl_cu13.tar.xz ] && tar xJf .nixl/nixl_cu13.tar.xz -C /tmp/site
export PYTHONPATH="$PWD:/tmp/site" PATH="$PWD/.bin:$PATH" PYTHONUNBUFFERED=1
# The raw files' header (tools/bench/raw_file.py): the device copy has no reliable git HEAD.
export INFERMESH_COMMIT="${INFERMESH_COMMIT:-${COMMIT:-unknown}}"
