// Block-wise INT8 linear, portable path: plain C++ for any CPU (arithmetic: kernels.h), its
// activations' quantization included. Built with -ffp-contract=off, so the only
// fused multiply-add is the explicit std::fma of the arithmetic.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace mineru_fast {

namespace {

// A float rounded to the nearest int32, half to even, as the x86 conversion instructions do under
// the default rounding mode: NaN and values outside int32 give INT32_MIN; then saturated to
// -127..127 (|q| <= 127 keeps the AVX2 path's sign trick exact).
int8_t round_to_int8(float v) {
  int32_t r;
  if (std::isnan(v) || !(std::fabs(v) < 2147483648.0f))
    r = INT32_MIN;
  else
    r = static_cast<int32_t>(std::nearbyint(v));
  return static_cast<int8_t>(std::min<int32_t>(127, std::max<int32_t>(-127, r)));
}

}  // namespace

void quantize_blocks_portable(const float* x, int64_t k_size, const BlockActivations& a, int64_t row) {
  int8_t* q = a.q + row * a.k_pad;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const int64_t k0 = b * kBlock, valid = std::min(kBlock, k_size - k0);
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < valid; ++i) {
      nan = nan || std::isnan(x[k0 + i]);
      amax = std::max(amax, std::fabs(x[k0 + i]));
    }
    if (nan) amax = NAN;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int8_t v = i < valid ? round_to_int8(x[k0 + i] * inv) : 0;
      q[k0 + i] = v;
      sum += v;
    }
    a.scale[row * a.blocks + b] = amax / 127.0f;
    a.sum[row * a.blocks + b] = sum;
  }
}

void block_steps_portable(const BlockLinear& l, const BlockActivations& a, int64_t step_begin, int64_t step_end) {
  const int64_t groups = a.k_pad / 4;
  const int64_t t_end = std::min(l.tiles, step_end * kStepTiles);
  for (int64_t t = step_begin * kStepTiles; t < t_end; ++t) {
    const uint8_t* w = l.weight + t * groups * 64;
    const float* ws = l.weight_scale + t * a.blocks * kLanes;
    for (int64_t m = 0; m < l.m_size; ++m) {
      const int8_t* q = a.q + m * a.k_pad;
      float acc[kLanes] = {};
      for (int64_t b = 0; b < a.blocks; ++b) {
        int32_t dot[kLanes] = {};
        for (int64_t g = b * (kBlock / 4); g < (b + 1) * (kBlock / 4); ++g)
          for (int64_t i = 0; i < kLanes; ++i)
            for (int64_t j = 0; j < 4; ++j)
              dot[i] += (static_cast<int32_t>(w[(g * kLanes + i) * 4 + j]) - 128) * q[g * 4 + j];
        const float xs = a.scale[m * a.blocks + b];
        for (int64_t i = 0; i < kLanes; ++i) {
          const float s = ws[b * kLanes + i] * xs;
          acc[i] = std::fma(static_cast<float>(dot[i]), s, acc[i]);
        }
      }
      for (int64_t i = 0; i < kLanes && t * kLanes + i < l.n_size; ++i) {
        const int64_t n = t * kLanes + i;
        l.y[m * l.n_size + n] = l.bias ? acc[i] + l.bias[n] : acc[i];
      }
    }
  }
}

}  // namespace mineru_fast
