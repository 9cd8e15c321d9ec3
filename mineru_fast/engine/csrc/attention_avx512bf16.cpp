// The vision encoder's attention in bfloat16 dot products with a float32 softmax (AVX-512 BF16:
// AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids and later): see kernels.h's
// bfloat16 attention (ImageAttention) for the arithmetic.
//
// Per head: the queries (times scale * log2(e)), keys and values are rounded to bfloat16 and packed
// for vdpbf16ps, which multiplies pairs of bfloat16 values and adds both products to a float32 lane:
//   q   [n_pad][d/2] pairs (q[i, 2c], q[i, 2c+1]) of a row, broadcast one pair at a time;
//   k   [n_pad/16][d/2][16 keys] pairs: a 64-byte load holds one pair of 16 keys;
//   v   [n_pad/2][d] pairs (v[2p, j], v[2p+1, j]): a 64-byte load holds 16 dims of two keys.
// Four query rows at a time take a block of 64 keys: the scores (4 x 4 registers), the block's
// maximum and 2^(s - max) in float32 (online softmax: the running output and sum are rescaled when
// the maximum grows), the probabilities rounded to bfloat16 (adjacent keys are a pair as they lie
// in memory), then the running output [4][d] += p v. Keys past n are masked to probability 0.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#define ISA_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma"
#include "isa_begin.h"
#include "simd_math.h"

namespace mineru_fast {

#if defined(MINERU_FAST_X86)
namespace {

constexpr int64_t kRows = kAttentionRows;
constexpr int64_t kKeyBlock = 64;  // keys per softmax step (4 registers of 16)

// Round-to-nearest-even float32 -> bfloat16 of 16 values (vcvtneps2bf16), as raw 16-bit integers.
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

inline __m512 dot_pairs(__m512 acc, uint32_t pair, __m512i packed) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), (__m512bh)packed);
}

// Four query rows [row, row + 4) of one head against all keys, written to out. DV = d / 16.
template <int DV>
void query_rows(const ImageAttention& a, const uint32_t* qp, const uint16_t* kp, const uint16_t* vp, int64_t n_pad,
                int64_t head, int64_t row) {
  constexpr int64_t d = DV * 16, pairs = d / 2;
  float o[kRows][d];
  float running_max[kRows];
  alignas(64) float running_sum[kRows][16];  // per lane: reduced once, at the end
  alignas(64) uint16_t prob[kRows][kKeyBlock];
  for (int64_t r = 0; r < kRows; ++r) {
    running_max[r] = -INFINITY;
    for (int j = 0; j < 16; ++j) running_sum[r][j] = 0.0f;
    for (int64_t j = 0; j < d; ++j) o[r][j] = 0.0f;
  }
  const uint32_t* q = qp + row * pairs;
  for (int64_t key = 0; key < n_pad; key += kKeyBlock) {
    // scores s[r][g] for keys key + 16 g + lane
    __m512 s[kRows][4];
    for (int64_t r = 0; r < kRows; ++r)
      for (int g = 0; g < 4; ++g) s[r][g] = _mm512_setzero_ps();
    const uint16_t* kb = kp + (key / 16) * pairs * 32;
    for (int64_t c = 0; c < pairs; ++c) {
      __m512i kv[4];
      for (int g = 0; g < 4; ++g) kv[g] = _mm512_loadu_si512(kb + (g * pairs + c) * 32);
      for (int64_t r = 0; r < kRows; ++r) {
        const uint32_t pair = q[r * pairs + c];
        for (int g = 0; g < 4; ++g) s[r][g] = dot_pairs(s[r][g], pair, kv[g]);
      }
    }
    const int64_t valid = std::min<int64_t>(kKeyBlock, a.n - key);
    float scale_old[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      for (int g = 0; g < 4; ++g) {
        const int64_t lanes = std::clamp<int64_t>(valid - 16 * g, 0, 16);
        const __mmask16 live = static_cast<__mmask16>((1u << lanes) - 1u);
        s[r][g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s[r][g]);
      }
      const __m512 block_max = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
      const float new_max = std::max(running_max[r], _mm512_reduce_max_ps(block_max));
      scale_old[r] = running_max[r] == -INFINITY ? 0.0f : std::exp2(running_max[r] - new_max);
      running_max[r] = new_max;
      const __m512 m = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int g = 0; g < 4; ++g) {
        const __m512 p = exp2_nonpositive(_mm512_sub_ps(s[r][g], m));
        const __m256i p16 = to_bf16(p);
        // the sum is of the probabilities as rounded, the weights the values are summed with
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p16), 16)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(&prob[r][16 * g]), p16);
      }
      const __m512 old_sum = _mm512_load_ps(running_sum[r]);
      _mm512_store_ps(running_sum[r], _mm512_fmadd_ps(old_sum, _mm512_set1_ps(scale_old[r]), sum));
    }
    // o[r] = o[r] * scale_old[r] + sum over the block's key pairs of p v
    __m512 acc[kRows][DV];
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 f = _mm512_set1_ps(scale_old[r]);
      for (int t = 0; t < DV; ++t) acc[r][t] = _mm512_mul_ps(_mm512_loadu_ps(&o[r][16 * t]), f);
    }
    const int64_t block_pairs = std::min<int64_t>(kKeyBlock, n_pad - key) / 2;
    const uint16_t* vb = vp + (key / 2) * d * 2;
    for (int64_t p = 0; p < block_pairs; ++p) {
      __m512i vv[DV];
      for (int t = 0; t < DV; ++t) vv[t] = _mm512_loadu_si512(vb + (p * d + 16 * t) * 2);
      for (int64_t r = 0; r < kRows; ++r) {
        uint32_t pair;
        std::memcpy(&pair, &prob[r][2 * p], sizeof pair);
        for (int t = 0; t < DV; ++t) acc[r][t] = dot_pairs(acc[r][t], pair, vv[t]);
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (int t = 0; t < DV; ++t) _mm512_storeu_ps(&o[r][16 * t], acc[r][t]);
  }
  for (int64_t r = 0; r < kRows && row + r < a.n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(running_sum[r])));
    float* y = a.out + (row + r) * a.out_row_stride + head * d;
    for (int t = 0; t < DV; ++t) _mm512_storeu_ps(y + 16 * t, _mm512_mul_ps(_mm512_loadu_ps(&o[r][16 * t]), inv));
  }
}

}  // namespace

void attention_pack_avx512bf16(const ImageAttention& a, int64_t head, int64_t block_begin, int64_t block_end,
                               const BF16AttentionBuffers& b) {
  const int64_t d = a.d, pairs = d / 2;
  const __m512 qf = _mm512_set1_ps(a.scale * 1.4426950408889634f);  // log2(e): powers of 2
  const float* q = a.q + head * a.head_stride[0];
  const float* k = a.k + head * a.head_stride[1];
  const float* v = a.v + head * a.head_stride[2];
  uint16_t* qp = reinterpret_cast<uint16_t*>(b.q + head * b.n_pad * pairs);  // a row's pairs: the row in order
  uint32_t* kp = reinterpret_cast<uint32_t*>(b.k + head * b.n_pad * d);
  uint16_t* vp = b.v + head * b.n_pad * d;
  // v's pair interleave: the 16 dims of row 2p (lanes 0-15) and of row 2p + 1 (lanes 16-31) ->
  // dim 0 of both, dim 1 of both, ...
  alignas(64) uint16_t order[32];
  for (int j = 0; j < 16; ++j) {
    order[2 * j] = static_cast<uint16_t>(j);
    order[2 * j + 1] = static_cast<uint16_t>(16 + j);
  }
  const __m512i interleave = _mm512_load_si512(order);
  alignas(64) uint16_t keys[16][128];  // the block's keys in bfloat16, a row each (d <= 128)
  alignas(64) uint16_t values[2][128];
  for (int64_t blk = block_begin; blk < block_end; ++blk) {  // 16 rows: queries, keys and values
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t i = blk * 16 + r;
      uint16_t* value = values[r % 2];
      if (i < a.n) {
        for (int64_t j = 0; j < d; j += 16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i * d + j),
                              to_bf16(_mm512_mul_ps(_mm512_loadu_ps(q + i * a.row_stride[0] + j), qf)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(&keys[r][j]),
                             to_bf16(_mm512_loadu_ps(k + i * a.row_stride[1] + j)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(&value[j]),
                             to_bf16(_mm512_loadu_ps(v + i * a.row_stride[2] + j)));
        }
      } else {  // past n: zero queries, keys (masked anyway) and values
        std::memset(qp + i * d, 0, d * sizeof(uint16_t));
        std::memset(keys[r], 0, d * sizeof(uint16_t));
        std::memset(value, 0, d * sizeof(uint16_t));
      }
      if (r % 2 == 1) {
        for (int64_t j = 0; j < d; j += 16) {
          const __m512i both = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(&values[0][j]))),
              _mm256_load_si256(reinterpret_cast<const __m256i*>(&values[1][j])), 1);
          _mm512_storeu_si512(vp + ((i / 2) * d + j) * 2, _mm512_permutexvar_epi16(interleave, both));
        }
      }
    }
    // k: [pairs][16 keys] of the block's pairs (a transpose of 32-bit pairs)
    uint32_t* kd = kp + blk * pairs * 16;
    for (int64_t c = 0; c < pairs; ++c)
      for (int64_t r = 0; r < 16; ++r) std::memcpy(&kd[c * 16 + r], &keys[r][2 * c], sizeof(uint32_t));
  }
}

void attention_rows_avx512bf16(const ImageAttention& a, int64_t head, int64_t tile_begin, int64_t tile_end,
                               const BF16AttentionBuffers& b) {
  const int64_t pairs = a.d / 2;
  const uint32_t* qp = b.q + head * b.n_pad * pairs;
  const uint16_t* kp = b.k + head * b.n_pad * a.d;
  const uint16_t* vp = b.v + head * b.n_pad * a.d;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t row = t * kRows;
    switch (a.d / 16) {
      case 1: query_rows<1>(a, qp, kp, vp, b.n_pad, head, row); break;
      case 2: query_rows<2>(a, qp, kp, vp, b.n_pad, head, row); break;
      case 3: query_rows<3>(a, qp, kp, vp, b.n_pad, head, row); break;
      case 4: query_rows<4>(a, qp, kp, vp, b.n_pad, head, row); break;
      case 5: query_rows<5>(a, qp, kp, vp, b.n_pad, head, row); break;
      case 6: query_rows<6>(a, qp, kp, vp, b.n_pad, head, row); break;
      case 7: query_rows<7>(a, qp, kp, vp, b.n_pad, head, row); break;
      default: query_rows<8>(a, qp, kp, vp, b.n_pad, head, row);
    }
  }
}
#else
void attention_pack_avx512bf16(const ImageAttention&, int64_t, int64_t, int64_t, const BF16AttentionBuffers&) {}
void attention_rows_avx512bf16(const ImageAttention&, int64_t, int64_t, int64_t, const BF16AttentionBuffers&) {}
#endif

}  // namespace mineru_fast

#include "isa_end.h"
