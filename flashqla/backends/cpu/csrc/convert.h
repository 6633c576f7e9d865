// fp32 <-> bf16 / fp16 conversions (round to nearest even).  Every function here is `static`, so each
// translation unit gets its own copy compiled for its own instruction set (no ODR sharing across the
// per-ISA kernel units).
#pragma once

namespace flashqla_cpu {
namespace {

static inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f32(uint16_t h) { return u2f(uint32_t(h) << 16); }

static inline uint16_t f32_to_bf16(float x) {
  uint32_t u = f2u(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return u2f(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return u2f(sign);
    // subnormal: value = man * 2^-24
    float r = float(man) * 5.9604644775390625e-8f;
    return sign ? -r : r;
  }
  return u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16(float x) {
  uint32_t u = f2u(x);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);       // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);      // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                       // below the smallest normal half
    // subnormal half: round a * 2^24 to an integer (nearest even) using float arithmetic
    float f = u2f(a) * 16777216.0f;                             // exact scaling by 2^24
    float r = (f + 12582912.0f) - 12582912.0f;                  // round to nearest even integer
    return uint16_t(sign | uint16_t(r));
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits (nearest even)
  uint32_t m = a - 0x38000000u;  // exponent - 112
  m += 0xfffu + ((m >> 13) & 1u);
  return uint16_t(sign | uint16_t(m >> 13));
}

static inline float load_elem(const void* base, int dt, int64_t i) {
  switch (dt) {
    case DT_BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DT_F16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// dst[0..n) = src[off .. off+n) converted to fp32
static inline void load_row(const void* base, int dt, int64_t off, int n, float* dst) {
  if (dt == DT_F32) {
    std::memcpy(dst, static_cast<const float*>(base) + off, sizeof(float) * size_t(n));
  } else if (dt == DT_BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(base) + off;
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(base) + off;
    for (int i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  }
}

static inline void store_elem(void* base, int dt, int64_t i, float x) {
  switch (dt) {
    case DT_BF16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(x); break;
    case DT_F16: static_cast<uint16_t*>(base)[i] = f32_to_f16(x); break;
    default: static_cast<float*>(base)[i] = x;
  }
}

// dst[off .. off+n) = src[0..n) * mul, converted
static inline void store_row(void* base, int dt, int64_t off, int n, const float* src, float mul) {
  if (dt == DT_F32) {
    float* d = static_cast<float*>(base) + off;
    for (int i = 0; i < n; ++i) d[i] = src[i] * mul;
  } else if (dt == DT_BF16) {
    uint16_t* d = static_cast<uint16_t*>(base) + off;
    for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i] * mul);
  } else {
    uint16_t* d = static_cast<uint16_t*>(base) + off;
    for (int i = 0; i < n; ++i) d[i] = f32_to_f16(src[i] * mul);
  }
}

}  // namespace
}  // namespace flashqla_cpu
