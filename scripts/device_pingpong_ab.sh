cp .prebuilt/A/_C.abi3.so flash_attn_hopper/_C.abi3.so
export PYTHONUNBUFFERED=1
for r in 1 2; do for pp in 1 0; do
  echo "== round $r FAH_FWD_PINGPONG=$pp"
  FAH_FWD_PINGPONG=$pp timeout 200 python3 -m flash_attn_hopper.benchmark --head-dims 128 --features dense,softcap,window --seqlens 1024,4096,16384 --direction fwd --backends ours --no-bar --json $OUT/pp${pp}_r$r.json 2>&1 | grep "^| " | cut -d'|' -f2-6
done; done
FAH_FWD_PINGPONG=0 TAG=npp CASES='128 16384 softcap;128 16384 dense' bash scripts/ncu_fwd.sh
cd $OUT && tar czf pp_json.tar.gz pp*.json && rm -f pp*.json
