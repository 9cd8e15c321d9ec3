// The language model's RMSNorm in the kernels' arithmetic (kernels.h's rms_norm_row): plain C++ whose
// every float step is fixed by the source (16 lane sums in a fixed order, no reassociation: the module
// is built with -ffp-contract=off and without -ffast-math), so every path and compiler target gives
// the same bits.

#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace mineru_fast {

void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* y) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += x[i + j] * x[i + j];
  for (int64_t j = 0; i + j < n; ++j) lane[j] += x[i + j] * x[i + j];
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)  // lanes o + 8, then o + 4, o + 2, o + 1
    for (int64_t j = 0; j < width; ++j) lane[j] += lane[j + width];
  const float inverse = 1.0f / std::sqrt(lane[0] / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) y[k] = x[k] * inverse * weight[k];
}

}  // namespace mineru_fast
