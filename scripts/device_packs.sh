# Sourced by the device scripts that A/B carried packs (scripts/build_pack.sh): unpacks each named pack stem from
# .prebuilt/pack/ into .prebuilt/, sets up the environment, and records the card into $OUT/smi_$TAG.txt.
#   OUT=... TAG=... source scripts/device_packs.sh s56 dqe ...; then use_pack NAME before each build's runs.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/${TAG:-packs}}; mkdir -p "$OUT"
for stem in "$@"; do
  python3 -c "import tarfile; tarfile.open('.prebuilt/pack/$stem.tar.xz').extractall('.prebuilt')" || exit 1
done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv | tee "$OUT/smi_${TAG:-packs}.txt"
use_pack() { cp -f ".prebuilt/$1/_C.abi3.so" flash_attn_hopper/_C.abi3.so || exit 1; }
