// Per-token dynamic INT8 linear for a few rows (decode steps), AVX-512 VNNI.
//
// y[m, n] = (sum_k q_x[m, k] * w[n, k]) * w_scale[n] * x_scale[m] (+ bias[n]) where q_x is x's
// row m quantized symmetrically to -127..127 with x_scale = max|x[m]| / 127, rounded half up.
// The arithmetic is the one of quantize.py's oneDNN path, operation for operation, so the output is
// bit-identical to it (tested): the integer products are exact, and every float step rounds as
// the PyTorch operator it replaces does.
//
// q_x is stored as q_x + 128 (uint8) for vpdpbusd (u8 x s8 -> s32); the 128 * sum_k w[n, k] this
// adds is taken off with the per-row weight sums passed in.

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 16;  // rows of x per call (a decode batch); more go to a GEMM

// Row m of x to uint8 (q + 128) and its scale, as quantize.py's _token_scales + addcmul + copy_.
void quantize_row(const float* x, int64_t k_size, uint8_t* q, float* scale) {
  __m512 vmax = _mm512_set1_ps(-INFINITY), vmin = _mm512_set1_ps(INFINITY);
  int64_t k = 0;
  for (; k + 16 <= k_size; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    vmax = _mm512_max_ps(vmax, v);
    vmin = _mm512_min_ps(vmin, v);
  }
  float amax = _mm512_reduce_max_ps(vmax), amin = _mm512_reduce_min_ps(vmin);
  for (; k < k_size; ++k) {
    amax = std::max(amax, x[k]);
    amin = std::min(amin, x[k]);
  }
  float absmax = std::max(std::max(amax, -amin), 127e-12f);
  *scale = absmax / 127.0f;
  const float inv = (1.0f / absmax) * 127.0f;
  for (k = 0; k < k_size; ++k) {
    // addcmul(128.5, x, inv): 128.5 + x * inv in one fused multiply-add, as PyTorch's kernel does.
    q[k] = static_cast<uint8_t>(static_cast<int32_t>(std::fma(x[k], inv, 128.5f)));
  }
}

// Integer dot products of ROWS weight rows (from n) with M_TILE quantized x rows (from m).
template <int ROWS, int M_TILE>
void dot_tile(const int8_t* w, int64_t k_size, const uint8_t* qx, int64_t qx_stride, int64_t n, int64_t m,
              int64_t m_count, int32_t* out /* [m_count][ROWS] */) {
  __m512i acc[ROWS][M_TILE];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < M_TILE; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* rows[ROWS];
  for (int r = 0; r < ROWS; ++r) rows[r] = w + (n + r) * k_size;
  int64_t k = 0;
  for (; k + 64 <= k_size; k += 64) {
    __m512i xv[M_TILE];
    for (int j = 0; j < M_TILE; ++j)
      xv[j] = j < m_count ? _mm512_loadu_si512(qx + (m + j) * qx_stride + k) : _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) {
      __m512i wv = _mm512_loadu_si512(rows[r] + k);
      for (int j = 0; j < M_TILE; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv[j], wv);
    }
  }
  if (k < k_size) {
    const __mmask64 mask = (~0ULL) >> (64 - (k_size - k));
    __m512i xv[M_TILE];
    for (int j = 0; j < M_TILE; ++j)
      xv[j] = j < m_count ? _mm512_maskz_loadu_epi8(mask, qx + (m + j) * qx_stride + k) : _mm512_setzero_si512();
    for (int r = 0; r < ROWS; ++r) {
      __m512i wv = _mm512_maskz_loadu_epi8(mask, rows[r] + k);
      for (int j = 0; j < M_TILE; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv[j], wv);
    }
  }
  for (int j = 0; j < M_TILE && j < m_count; ++j)
    for (int r = 0; r < ROWS; ++r) out[j * ROWS + r] = _mm512_reduce_add_epi32(acc[r][j]);
}

}  // namespace

// x [M, K] float32 (M <= 16), weight [N, K] int8, weight_sum [N] int32, weight_scale [N] float32,
// bias [N] float32 or None -> [M, N] float32.
at::Tensor int8_linear_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_sum,
                               const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "weight: [N, K] contiguous int8");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_size, "x and weight disagree on K");
  TORCH_CHECK(m_size >= 1 && m_size <= kMaxRows, "1 to 16 rows of x");
  TORCH_CHECK(weight_sum.numel() == n_size && weight_sum.scalar_type() == at::kInt, "weight_sum: [N] int32");
  TORCH_CHECK(weight_scale.numel() == n_size && weight_scale.scalar_type() == at::kFloat, "weight_scale: [N] float32");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_size && bias->scalar_type() == at::kFloat, "bias: [N] float32");
    bias_ptr = bias->data_ptr<float>();
  }
  std::vector<uint8_t> qx(m_size * k_size);
  std::vector<float> x_scale(m_size);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < m_size; ++m) quantize_row(xp + m * k_size, k_size, qx.data() + m * k_size, &x_scale[m]);

  auto y = at::empty({m_size, n_size}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int32_t* sums = weight_sum.data_ptr<int32_t>();
  const float* scales = weight_scale.data_ptr<float>();
  constexpr int64_t kRows = 4;  // weight rows per tile
  const int64_t tiles = (n_size + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    int32_t dots[kMaxRows * kRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kRows, rows = std::min(kRows, n_size - n);
      for (int64_t m = 0; m < m_size; m += 4) {
        const int64_t count = std::min<int64_t>(4, m_size - m);
        if (rows == kRows) {
          switch (count) {  // as many accumulators as rows of x: no product of a missing row
            case 1: dot_tile<kRows, 1>(wp, k_size, qx.data(), k_size, n, m, count, dots); break;
            case 2: dot_tile<kRows, 2>(wp, k_size, qx.data(), k_size, n, m, count, dots); break;
            case 3: dot_tile<kRows, 3>(wp, k_size, qx.data(), k_size, n, m, count, dots); break;
            default: dot_tile<kRows, 4>(wp, k_size, qx.data(), k_size, n, m, count, dots);
          }
          for (int64_t j = 0; j < count; ++j)
            for (int64_t r = 0; r < kRows; ++r) {
              const int64_t row = m + j, col = n + r;
              const float v = static_cast<float>(dots[j * kRows + r] - 128 * sums[col]) * scales[col];
              yp[row * n_size + col] = bias_ptr ? std::fma(v, x_scale[row], bias_ptr[col]) : v * x_scale[row];
            }
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            dot_tile<1, 4>(wp, k_size, qx.data(), k_size, n + r, m, count, dots);
            for (int64_t j = 0; j < count; ++j) {
              const int64_t row = m + j, col = n + r;
              const float v = static_cast<float>(dots[j] - 128 * sums[col]) * scales[col];
              yp[row * n_size + col] = bias_ptr ? std::fma(v, x_scale[row], bias_ptr[col]) : v * x_scale[row];
            }
          }
        }
      }
    }
  });
  return y;
}

TORCH_LIBRARY(mineru_fast, m) {
  m.def("int8_linear_rows(Tensor x, Tensor weight, Tensor weight_sum, Tensor weight_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(mineru_fast, CPU, m) { m.impl("int8_linear_rows", &int8_linear_rows); }
