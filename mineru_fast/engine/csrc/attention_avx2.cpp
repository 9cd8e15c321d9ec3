// The vision encoder's attention in float32, AVX2 + FMA: see kernels.h's float32 attention for the
// arithmetic.
//
// A flash-attention loop shaped for 16 ymm registers. Per head, the queries (times scale * log2(e))
// are copied row-major, the keys transposed into panels of 16 keys, [d][16], and the values into
// 16-column strips, [d / 16][n_pad][16]. A work item is a block of kF32AttentionQueryTiles tiles of
// kRows query rows; for each block of kKeyBlock keys, each tile
//   1. takes its scores, 16 keys at a time: kRows x 16 keys in 12 accumulators, per step of d a
//      broadcast query value for each row and two loads of a key panel (12 FMAs), and the block's
//      lane-wise row maxima;
//   2. updates its rows' online softmax: the running maximum, 2^(s - max) written over the scores
//      (two chains of additions for the sums), and the running output and per-lane sums rescaled
//      by 2^(old - new);
//   3. adds p v to its running output, one 16-column strip at a time (12 accumulators again, a
//      broadcast probability for each row and two loads of a strip per key).
// The key block (its panels and strips, 2 x kKeyBlock x d floats) stays in the L2 cache while the
// block's tiles use it; a tile's scores, kRows x kKeyBlock floats, in L1. Keys past n score
// -infinity (2^x of at most 2^-149 in the sums, none in the outputs: the values' loop stops at n).
// On a 2-core AMX Xeon capped to AVX2 float32 SDPA took 1.07-1.08x its time at a layout image's
// attention (benchmarks/README.md, "AVX2: an own float32 vision attention", with its share of the
// FMA peak).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx2,fma"
#include "isa_begin.h"
#define MINERU_FAST_EXP2_AVX2
#include "simd_math.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

constexpr int64_t kRows = kF32AttentionTileRows;
constexpr int64_t kKeyBlock = kF32AttentionKeyBlock;

// s[r][16 p + lane] for the tile's rows r and the block's panels p < panels; block_max[r] the lane-wise
// maximum of row r's scores over the panels, keys past `valid` set to -infinity in s and left out.
template <int C>
inline void tile_scores(const float* q, const float* panel, int64_t panels, int64_t valid, float* s,
                        __m256 block_max[kRows]) {
  constexpr int64_t d = 16 * C;
  for (int r = 0; r < kRows; ++r) block_max[r] = _mm256_set1_ps(-INFINITY);
  for (int64_t p = 0; p < panels; ++p, panel += d * 16) {
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const __m256 k0 = _mm256_load_ps(panel + c * 16), k1 = _mm256_load_ps(panel + c * 16 + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 x = _mm256_broadcast_ss(q + r * d + c);
        acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
      }
    }
    if (16 * p + 16 > valid) {  // the last panel: keys past n
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i live0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid - 16 * p)), lane);
      const __m256i live1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid - 16 * p - 8)), lane);
      const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
      for (int r = 0; r < kRows; ++r) {
        acc[r][0] = _mm256_blendv_ps(minus_inf, acc[r][0], _mm256_castsi256_ps(live0));
        acc[r][1] = _mm256_blendv_ps(minus_inf, acc[r][1], _mm256_castsi256_ps(live1));
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_store_ps(s + r * kKeyBlock + 16 * p, acc[r][0]);
      _mm256_store_ps(s + r * kKeyBlock + 16 * p + 8, acc[r][1]);
      block_max[r] = _mm256_max_ps(block_max[r], _mm256_max_ps(acc[r][0], acc[r][1]));
    }
  }
}

inline float max_lanes(__m256 v) {
  const __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_shuffle_ps(b, b, 1)));
}

// One block of kQueryTiles tiles (rows [row, row + kQueryTiles * kRows) of one head) against all keys.
template <int C>
void query_block(const ImageAttention& a, const float* qs, const float* kp, const float* vp, int64_t n_pad,
                 int64_t head, int64_t row) {
  constexpr int64_t d = 16 * C, rows = kF32AttentionQueryTiles * kRows;
  alignas(32) float o[rows][d];
  alignas(32) float running_sum[rows][8];  // per lane: reduced once, at the end
  alignas(32) float s[kRows * kKeyBlock];
  float running_max[rows], rescale[kRows];
  for (int64_t r = 0; r < rows; ++r) {
    running_max[r] = -INFINITY;
    for (int j = 0; j < 8; ++j) running_sum[r][j] = 0.0f;
    for (int64_t j = 0; j < d; ++j) o[r][j] = 0.0f;
  }
  for (int64_t key = 0; key < a.n; key += kKeyBlock) {
    const int64_t valid = std::min(kKeyBlock, a.n - key), panels = (valid + 15) / 16;
    for (int64_t t = 0; t < kF32AttentionQueryTiles; ++t) {
      const int64_t r0 = t * kRows;
      __m256 block_max[kRows];
      tile_scores<C>(qs + (row + r0) * d, kp + key * d, panels, valid, s, block_max);
      for (int64_t r = 0; r < kRows; ++r) {
        float* sr = s + r * kKeyBlock;
        const float old_max = running_max[r0 + r], new_max = std::max(old_max, max_lanes(block_max[r]));
        rescale[r] = old_max == -INFINITY ? 0.0f : std::exp2(old_max - new_max);
        running_max[r0 + r] = new_max;
        const __m256 m = _mm256_set1_ps(new_max);
        __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();  // two chains of additions
        for (int64_t j = 0; j < panels * 16; j += 16) {
          const __m256 p0 = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(sr + j), m));
          const __m256 p1 = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(sr + j + 8), m));
          _mm256_store_ps(sr + j, p0);
          _mm256_store_ps(sr + j + 8, p1);
          sum0 = _mm256_add_ps(sum0, p0);
          sum1 = _mm256_add_ps(sum1, p1);
        }
        float* rs = running_sum[r0 + r];
        _mm256_store_ps(rs, _mm256_fmadd_ps(_mm256_load_ps(rs), _mm256_set1_ps(rescale[r]), _mm256_add_ps(sum0, sum1)));
      }
      for (int64_t c = 0; c < C; ++c) {
        __m256 acc[kRows][2];
        for (int r = 0; r < kRows; ++r) {
          const __m256 f = _mm256_set1_ps(rescale[r]);
          acc[r][0] = _mm256_mul_ps(_mm256_load_ps(&o[r0 + r][16 * c]), f);
          acc[r][1] = _mm256_mul_ps(_mm256_load_ps(&o[r0 + r][16 * c + 8]), f);
        }
        const float* vc = vp + (c * n_pad + key) * 16;
        for (int64_t j = 0; j < valid; ++j, vc += 16) {
          const __m256 v0 = _mm256_load_ps(vc), v1 = _mm256_load_ps(vc + 8);
          for (int r = 0; r < kRows; ++r) {
            const __m256 p = _mm256_broadcast_ss(s + r * kKeyBlock + j);
            acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
          }
        }
        for (int r = 0; r < kRows; ++r) {
          _mm256_store_ps(&o[r0 + r][16 * c], acc[r][0]);
          _mm256_store_ps(&o[r0 + r][16 * c + 8], acc[r][1]);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows && row + r < a.n; ++r) {
    const __m256 inv = _mm256_set1_ps(1.0f / sum_lanes(_mm256_load_ps(running_sum[r])));
    float* y = a.out + (row + r) * a.out_row_stride + head * d;
    for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_load_ps(&o[r][j]), inv));
  }
}

}  // namespace

void attention_pack_avx2(const ImageAttention& a, int64_t head, int64_t block_begin, int64_t block_end,
                         const F32AttentionBuffers& b) {
  const int64_t d = a.d;
  const __m256 qf = _mm256_set1_ps(a.scale * 1.4426950408889634f);  // log2(e): powers of 2
  const float* q = a.q + head * a.head_stride[0];
  const float* k = a.k + head * a.head_stride[1];
  float* qs = b.q + head * b.n_pad * d;
  float* kp = b.k + head * b.n_pad * d;
  const float* v = a.v + head * a.head_stride[2];
  float* vp = b.v + head * b.n_pad * d;
  for (int64_t blk = block_begin; blk < block_end; ++blk) {  // rows [16 blk, 16 blk + 16)
    float* panel = kp + blk * 16 * d;
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t i = blk * 16 + r;
      if (i < a.n) {
        for (int64_t j = 0; j < d; j += 8)
          _mm256_storeu_ps(qs + i * d + j, _mm256_mul_ps(_mm256_loadu_ps(q + i * a.row_stride[0] + j), qf));
        for (int64_t j = 0; j < d; ++j) panel[j * 16 + r] = k[i * a.row_stride[1] + j];
        for (int64_t c = 0; c < d / 16; ++c)
          std::memcpy(vp + (c * b.n_pad + i) * 16, v + i * a.row_stride[2] + 16 * c, 16 * sizeof(float));
      } else {  // past n: zero queries and keys (the keys are masked anyway)
        std::memset(qs + i * d, 0, d * sizeof(float));
        for (int64_t j = 0; j < d; ++j) panel[j * 16 + r] = 0.0f;
        for (int64_t c = 0; c < d / 16; ++c) std::memset(vp + (c * b.n_pad + i) * 16, 0, 16 * sizeof(float));
      }
    }
  }
}

void attention_rows_avx2(const ImageAttention& a, int64_t head, int64_t block_begin, int64_t block_end,
                         const F32AttentionBuffers& b) {
  const float* qs = b.q + head * b.n_pad * a.d;
  const float* kp = b.k + head * b.n_pad * a.d;
  const float* vp = b.v + head * b.n_pad * a.d;
  with_chunks(a.d, [&](auto chunks) {
    for (int64_t blk = block_begin; blk < block_end; ++blk)
      query_block<decltype(chunks)::value>(a, qs, kp, vp, b.n_pad, head, blk * kF32AttentionQueryTiles * kRows);
  });
}
#else
void attention_pack_avx2(const ImageAttention&, int64_t, int64_t, int64_t, const F32AttentionBuffers&) {}
void attention_rows_avx2(const ImageAttention&, int64_t, int64_t, int64_t, const F32AttentionBuffers&) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
