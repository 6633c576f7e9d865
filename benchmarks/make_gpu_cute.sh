#!/usr/bin/env bash
# Build .gpu_cute: the bundles a cutlass device call carries (carry [".gpu_cute"], then
# `source .gpu_cute/setup.sh && ...`): nvidia-cutlass-dsl 4.3.5 + the peers (FLA, flash-qla) from
# ../shared/gpu/prepare.sh, plus apache-tvm-ffi 0.1.12 taken out of the tilelang bundle (tvmffi.tar.xz, 1.8 MB):
# the cutlass on-disk cache exports and loads its kernels through CuTe DSL's TVM-FFI path, and the cutedsl
# bundle does not ship it (session 14 run 4).  ~42 MB in all; .gpu (tilelang) does not fit beside it.
#   bash benchmarks/make_gpu_cute.sh          # needs .gpu/tilelang.tar.xz (prepare.sh tilelang peers) first
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ -f .gpu/tilelang.tar.xz ] || bash ../shared/gpu/prepare.sh tilelang peers
scratch=$(mktemp -d)
( cd "$scratch" && bash "$root/../shared/gpu/prepare.sh" cutedsl peers > /dev/null )
rm -rf .gpu_cute && mv "$scratch/.gpu" .gpu_cute
mkdir "$scratch/tvm" && tar xJf .gpu/tilelang.tar.xz -C "$scratch/tvm" --wildcards './tvm_ffi/*' './apache_tvm_ffi-*.dist-info/*'
( cd "$scratch/tvm" && tar cf - . ) | xz -6 -T2 > .gpu_cute/tvmffi.tar.xz
rm -rf "$scratch"
grep -qx '/.gpu_cute/' .git/info/exclude 2>/dev/null || echo '/.gpu_cute/' >> .git/info/exclude
du -sh .gpu_cute
