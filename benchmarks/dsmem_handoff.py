"""How long one DSMEM hand-off between the two CTAs of a cluster takes on this GPU (issue #8, lever 3 of session 36).

Question: the whole-V backward's GVA pair sums could pass through distributed shared memory. The two CTAs of a pair
would form a 2-CTA cluster, and one would send each rounded dq / dk tile into the other's shared memory, which adds
the two and stores the sum. That drops the host's memset (0.083 ms at 16/32 one 32k sequence on an H100, about
0.63 us for each of the ~132 walk steps).

Shared memory has room for one 4 KB tile only (6 KB free), so each step would need 8 quarter tiles, passed one at a
time. This micro-kernel measures what one such hand-off costs when nothing hides it:
- rank 1 waits until the buffer is free, writes 4 KB into rank 0's buffer (st.shared::cluster.v4, 32 B a thread),
  and arrives on rank 0's ``full`` barrier (release, cluster scope);
- rank 0 waits on ``full`` (acquire, cluster scope), reads the tile, adds it into a running sum, and arrives on rank
  1's ``empty`` barrier;
- both repeat ``iters`` times.
The cycles per round trip (clock64 on each CTA's thread 0) is the exposed cost of one hand-off; the sums check that
every tile arrived whole (rank 0's sum of the values rank 1 wrote, which the host knows in closed form).

Grid: ``pairs`` clusters of 2 CTAs, 128 threads each, 4 KB buffer + two mbarriers per CTA.

usage (device): python benchmarks/dsmem_handoff.py [--pairs 64] [--iters 2000] [--json out.json]
CPU: ``--source`` prints the CUDA source after lowering for sm_90a (tests/test_dsmem_handoff.py checks it).
"""

from __future__ import annotations

import argparse
import json
import sys

THREADS = 128
TILE_BYTES = 4096      # HANDOFF_SRC moves it as two 16-byte stores per thread, 2048 bytes apart

# Plain CUDA types only (imported sources precede TileLang's headers).  Every thread of both CTAs runs it.
HANDOFF_SRC = r"""
__device__ __forceinline__ unsigned flq_smem_u32(const void *p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ unsigned flq_mapa(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ unsigned flq_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned flq_cluster_size() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void flq_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void flq_wait_cluster(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void flq_arrive_remote(unsigned remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(remote_bar) : "memory");
}
// one CTA of the pair; buf: its 4 KB tile, bars: [full, empty]; out[cta] = (cycles, checksum bits)
__device__ void flq_handoff(void *buf, void *bars, int iters, const void *out_v) {
  long long *out = (long long *)out_v;
  unsigned tx = threadIdx.x;
  unsigned rank = flq_cluster_rank();
  if (flq_cluster_size() != 2u) {   // launched without clusters: say so rather than wait forever
    if (tx == 0) { out[2 * blockIdx.x] = -1; out[2 * blockIdx.x + 1] = -1; }
    return;
  }
  unsigned full = flq_smem_u32(bars), empty = full + 8;
  if (tx == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(full), "r"(128));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(empty), "r"(128));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  flq_cluster_sync();           // both CTAs' barriers initialised before any remote arrive
  unsigned peer = rank ^ 1u;
  unsigned my_tile = flq_smem_u32(buf) + tx * 16u;
  unsigned peer_tile = flq_mapa(my_tile, peer);
  unsigned peer_full = flq_mapa(full, peer), peer_empty = flq_mapa(empty, peer);
  float sum = 0.f;
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    if (rank == 1) {
      flq_wait_cluster(empty, (unsigned)((it & 1) ^ 1));
      float a = (float)(it + 1), b = (float)tx;
      unsigned ua = __float_as_uint(a), ub = __float_as_uint(b);
      asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %1, %2};" :: "r"(peer_tile), "r"(ua), "r"(ub) : "memory");
      asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %1, %2};" :: "r"(peer_tile + 2048u), "r"(ua), "r"(ub)
                   : "memory");
      flq_arrive_remote(peer_full);
    } else {
      flq_wait_cluster(full, (unsigned)(it & 1));
      float4 x, y;
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                   : "r"(my_tile) : "memory");
      asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(y.x), "=f"(y.y), "=f"(y.z), "=f"(y.w)
                   : "r"(my_tile + 2048u) : "memory");
      // a = it + 1 four times, b = tx four times: the host knows the sum
      sum += (x.x + x.z + y.x + y.z) * (1.0f / 4.0f) - (float)(it + 1);
      sum += (x.y + x.w + y.y + y.w) * (1.0f / 4.0f) - (float)tx;
      flq_arrive_remote(peer_empty);
    }
  }
  long long t1 = clock64();
  flq_cluster_sync();           // no CTA leaves while its peer may still arrive on its barriers
  if (tx == 0) {
    long long cta = (long long)blockIdx.x;
    out[2 * cta] = t1 - t0;
    out[2 * cta + 1] = (long long)__float_as_uint(sum);
  }
}
"""


def build_handoff():
    """The ping-pong kernel: grid ``(2 * pairs,)`` in clusters of 2, ``out [2 * pairs, 2]`` int64."""
    import tilelang.language as T

    NB = T.dynamic("NB")

    @T.prim_func
    def dsmem_handoff(out: T.Tensor((NB, 2), "int64"), iters: T.int32):
        with T.Kernel(NB, threads=THREADS, cluster_dims=2) as bx:
            T.import_source(HANDOFF_SRC)
            buf = T.alloc_shared((TILE_BYTES // 4,), "float32")
            bars = T.alloc_shared((2,), "uint64")
            T.call_extern("handle", "flq_handoff", buf.access_ptr("rw"), bars.access_ptr("rw"), iters, out.data)

    return dsmem_handoff


def compile_handoff(target=None):
    import tilelang
    if target is None:
        from flashqla.backends.tilelang._compile import TARGET as target
    return tilelang.compile(build_handoff(), out_idx=None, target=target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--source", action="store_true", help="print the CUDA source (no GPU needed)")
    args = ap.parse_args(argv)
    kern = compile_handoff()
    if args.source:
        print(kern.get_kernel_source())
        return 0
    import struct

    import torch
    out = torch.zeros(2 * args.pairs, 2, dtype=torch.int64, device="cuda")
    kern(out, 10)                  # warm-up launch
    torch.cuda.synchronize()
    rows = []
    for iters in (args.iters // 4, args.iters):
        out.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kern(out, iters)
        end.record()
        torch.cuda.synchronize()
        res = out.cpu().tolist()
        if any(r[0] < 0 for r in res):
            print("the kernel ran without clusters of 2 (%cluster_nctarank != 2)")
            return 1
        ms = start.elapsed_time(end)
        cycles = [r[0] for r in res]
        sums = [struct.unpack("f", struct.pack("I", r[1] & 0xFFFFFFFF))[0] for r in res[0::2]]
        rows.append({"iters": iters, "pairs": args.pairs, "kernel_ms": ms,
                     "cycles_per_handoff_max": max(cycles) / iters,
                     "cycles_per_handoff_median": sorted(cycles)[len(cycles) // 2] / iters,
                     "ns_per_handoff": ms * 1e6 / iters,
                     "receiver_checksum_max_abs": max(abs(s) for s in sums)})
        r = rows[-1]
        print(f"{iters} hand-offs x {args.pairs} pairs: {r['kernel_ms']:.3f} ms, {r['ns_per_handoff']:.0f} ns and "
              f"{r['cycles_per_handoff_median']:.0f} cycles (median CTA; max {r['cycles_per_handoff_max']:.0f}) "
              f"per hand-off; receiver checksum {r['receiver_checksum_max_abs']:.3g} (0 = every tile whole)")
    ok = all(r["receiver_checksum_max_abs"] == 0 for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
