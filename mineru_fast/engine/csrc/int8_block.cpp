// Block-wise INT8 linear, AVX-512 VNNI: weights and activations with one scale per block of 32
// consecutive input values (the granularity of llama.cpp's Q8_0), any number of rows.
//
// y[m, n] = sum over blocks b of float(dot_b(m, n)) * (w_scale[n, b] * x_scale[m, b])  (+ bias[n])
//   dot_b(m, n) = sum over the 32 k of block b of q_w[n, k] * q_x[m, k]   (exact, int32)
//   q_x[m, k]   = x[m, k] * (127 / max|x[m, block]|) rounded half to even, in -127..127;
//   x_scale     = max|x[m, block]| / 127   (an all-zero block: scale 0, q_x 0)
// Float steps, for every output in the same order: the scale product (one rounding), then
// acc = fma(float(dot_b), scale, acc) over b = 0, 1, ...; then + bias. A row's outputs therefore
// do not depend on the other rows of the call (a sequence's numerics do not depend on its batch
// neighbours, and a prefill row equals the same row decoded alone).
//
// Layout, made by quantize.BlockInt8Linear: N padded to a multiple of 16 and K to one of 32 (zero
// weights, scale 0). weight [N/16][K/4][16][4] uint8 = q_w + 128: one 64-byte load holds 4
// consecutive k of 16 outputs, and vpdpbusd (u8 x s8 -> s32) with 4 int8 values of x broadcast
// adds all 16 outputs' products; the 128 * sum(q_x) this adds to each block is taken off by
// starting the block's sum at its negative. weight_scale [N/16][K/32][16] float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // input values per scale
constexpr int64_t kLanes = 16;  // outputs per weight tile (one zmm of float32)

__mmask16 lane_mask(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// Row x [k_size] -> q [k_pad] int8 (zero past k_size), scale [blocks], offset [blocks] = 128 * sum q.
void quantize_blocks(const float* x, int64_t k_size, int64_t blocks, int8_t* q, float* scale, int32_t* offset) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, valid = std::min(kBlock, k_size - k0);
    const __m512 lo = _mm512_maskz_loadu_ps(lane_mask(valid), x + k0);
    const __m512 hi = _mm512_maskz_loadu_ps(lane_mask(std::max<int64_t>(valid - kLanes, 0)), x + k0 + kLanes);
    // a NaN makes the block's scale NaN, so it reaches the outputs (max_ps would drop it)
    const bool nan = (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) != 0;
    const float amax = nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;  // NaN > 0 is false
    const __m512 vinv = _mm512_set1_ps(inv);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q_lo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, vinv), kRound);
    const __m512i q_hi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, vinv), kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtsepi32_epi8(q_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + kLanes), _mm512_cvtsepi32_epi8(q_hi));
    scale[b] = amax / 127.0f;
    offset[b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
  }
}

struct Quantized {
  const int8_t* q;       // [M][k_pad]
  const float* scale;    // [M][blocks]
  const int32_t* offset; // [M][blocks]
  int64_t k_pad, blocks;
};

// Outputs of MR rows (from m) and NR weight tiles (from tile t), written to y (bias added).
template <int MR, int NR>
void block_tile(const uint8_t* w, const float* ws, const Quantized& x, int64_t m, int64_t t, float* y,
                int64_t n_size, const float* bias) {
  const int64_t groups = x.k_pad / 4;
  __m512 facc[MR][NR];
  for (int j = 0; j < MR; ++j)
    for (int r = 0; r < NR; ++r) facc[j][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i acc[MR][NR];  // each starts at -128 * sum(q_x): what the + 128 of the weights adds
    for (int j = 0; j < MR; ++j) {
      const __m512i start = _mm512_set1_epi32(-x.offset[(m + j) * x.blocks + b]);
      for (int r = 0; r < NR; ++r) acc[j][r] = start;
    }
    for (int64_t g = b * (kBlock / 4); g < (b + 1) * (kBlock / 4); ++g) {
      __m512i wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(w + ((t + r) * groups + g) * 64);
      for (int j = 0; j < MR; ++j) {
        int32_t four;
        std::memcpy(&four, x.q + (m + j) * x.k_pad + g * 4, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_dpbusd_epi32(acc[j][r], wv[r], xv);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 wsv = _mm512_loadu_ps(ws + ((t + r) * x.blocks + b) * kLanes);
      for (int j = 0; j < MR; ++j) {
        const __m512 s = _mm512_mul_ps(wsv, _mm512_set1_ps(x.scale[(m + j) * x.blocks + b]));
        facc[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j][r]), s, facc[j][r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const int64_t n0 = (t + r) * kLanes;
    const __mmask16 mask = lane_mask(n_size - n0);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int j = 0; j < MR; ++j) {
      const __m512 v = bias ? _mm512_add_ps(facc[j][r], bv) : facc[j][r];
      _mm512_mask_storeu_ps(y + (m + j) * n_size + n0, mask, v);
    }
  }
}

template <int NR>
void rows_of_tiles(const uint8_t* w, const float* ws, const Quantized& x, int64_t m_size, int64_t t, float* y,
                   int64_t n_size, const float* bias) {
  int64_t m = 0;
  for (; m + 4 <= m_size; m += 4) block_tile<4, NR>(w, ws, x, m, t, y, n_size, bias);
  switch (m_size - m) {
    case 3: block_tile<3, NR>(w, ws, x, m, t, y, n_size, bias); break;
    case 2: block_tile<2, NR>(w, ws, x, m, t, y, n_size, bias); break;
    case 1: block_tile<1, NR>(w, ws, x, m, t, y, n_size, bias); break;
    default: break;
  }
}

}  // namespace

// x [M, K] float32, weight [N_pad/16, K_pad/4, 16, 4] uint8, weight_scale [N_pad/16, K_pad/32, 16]
// float32, bias [N] float32 or None, n_size = N -> [M, N] float32.
at::Tensor int8_block_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                             const std::optional<at::Tensor>& bias, int64_t n_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] contiguous float32");
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(2) == kLanes && weight.size(3) == 4,
              "weight: [N/16, K/4, 16, 4] contiguous uint8");
  const int64_t m_size = x.size(0), k_size = x.size(1), tiles = weight.size(0), k_pad = weight.size(1) * 4;
  const int64_t blocks = k_pad / kBlock;
  TORCH_CHECK(k_pad % kBlock == 0 && k_size <= k_pad && k_size > k_pad - kBlock, "x and weight disagree on K");
  TORCH_CHECK(n_size > (tiles - 1) * kLanes && n_size <= tiles * kLanes, "n_size and weight disagree on N");
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.numel() == tiles * blocks * kLanes,
              "weight_scale: [N/16, K/32, 16] contiguous float32");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_size && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias: [N] float32");
    bias_ptr = bias->data_ptr<float>();
  }
  auto y = at::empty({m_size, n_size}, x.options());
  if (m_size == 0) return y;

  std::vector<int8_t> q(m_size * k_pad);
  std::vector<float> scale(m_size * blocks);
  std::vector<int32_t> offset(m_size * blocks);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m_size, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_blocks(xp + m * k_size, k_size, blocks, q.data() + m * k_pad, scale.data() + m * blocks,
                      offset.data() + m * blocks);
  });
  const Quantized quantized{q.data(), scale.data(), offset.data(), k_pad, blocks};

  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* wsp = weight_scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kTiles = 2;  // weight tiles per step: 2 x 16 outputs
  const int64_t steps = (tiles + kTiles - 1) / kTiles;
  at::parallel_for(0, steps, 1, [&](int64_t begin, int64_t end) {
    for (int64_t step = begin; step < end; ++step) {
      const int64_t t = step * kTiles;
      if (t + kTiles <= tiles)
        rows_of_tiles<kTiles>(wp, wsp, quantized, m_size, t, yp, n_size, bias_ptr);
      else
        rows_of_tiles<1>(wp, wsp, quantized, m_size, t, yp, n_size, bias_ptr);
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(mineru_fast, m) {
  m.def("int8_block_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, int n_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(mineru_fast, CPU, m) { m.impl("int8_block_linear", &int8_block_linear); }
