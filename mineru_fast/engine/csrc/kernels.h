// Declarations shared by the kernels' translation units: one file per instruction set, compiled into
// one extension module (module.cpp) that picks the path at run time from the CPU's features.
//
// Block-wise INT8 linear ("int8-block", the fast preset's language model): weights and activations
// with one scale per 32 consecutive input values (llama.cpp's Q8_0 granularity), any number of rows.
//
//   y[m, n] = sum over blocks b of float(dot_b(m, n)) * (w_scale[n, b] * x_scale[m, b])  (+ bias[n])
//   dot_b(m, n) = sum over the 32 k of block b of q_w[n, k] * q_x[m, k]   (exact, int32)
//   q_x[m, k]   = x[m, k] * (127 / max|x[m, block]|) rounded half to even, saturated to -127..127;
//   x_scale     = max|x[m, block]| / 127   (an all-zero block: scale 0, q_x 0)
//
// Float steps, for every output, on every path: the scale product (one rounding), then
// acc = fma(float(dot_b), scale, acc) over b = 0, 1, ... from acc = +0; then + bias (one rounding).
// The integers are exact on every path and the float steps are the same operations in the same
// order, so every path (AVX-512 VNNI, AVX2, portable) gives the same bits, and a row's outputs do
// not depend on the other rows of the call (a sequence's numerics do not depend on its batch
// neighbours; a prefill row equals the same row decoded alone).
//
// Weight layout, made by quantize.BlockInt8Linear: N padded to a multiple of 16 and K to one of 32
// (zero weights, scale 0). weight [N/16][K/4][16][4] uint8 = q_w + 128: one 64-byte group holds 4
// consecutive k of 16 outputs. weight_scale [N/16][K/32][16] float32.

#pragma once

#include <cstdint>

namespace mineru_fast {

constexpr int64_t kBlock = 32;  // input values per scale
constexpr int64_t kLanes = 16;  // outputs per weight tile

// Activations quantized per block: q [M][k_pad] int8 (zero past K), scale [M][blocks],
// sum [M][blocks] = sum of the block's q (the AVX-512 path's offset for its unsigned weights).
struct BlockActivations {
  int8_t* q;
  float* scale;
  int32_t* sum;
  int64_t k_pad, blocks;
};

// One block-wise linear call. Tiles are processed in steps of kStepTiles tiles (the unit of work
// split across threads).
struct BlockLinear {
  const uint8_t* weight;       // [tiles][k_pad / 4][16][4]
  const float* weight_scale;   // [tiles][blocks][16]
  const float* bias;           // [n_size] or nullptr
  float* y;                    // [m_size][n_size]
  int64_t m_size, n_size, tiles;
};
constexpr int64_t kStepTiles = 2;

// Row x [k_size] -> q, scale and sum of every block (portable; the result is the same on every path).
void quantize_blocks_portable(const float* x, int64_t k_size, const BlockActivations& a, int64_t row);
void quantize_blocks_avx2(const float* x, int64_t k_size, const BlockActivations& a, int64_t row);
void quantize_blocks_avx512(const float* x, int64_t k_size, const BlockActivations& a, int64_t row);

// Outputs of all rows for the tiles of steps [step_begin, step_end).
void block_steps_portable(const BlockLinear& l, const BlockActivations& a, int64_t step_begin, int64_t step_end);
void block_steps_avx2(const BlockLinear& l, const BlockActivations& a, int64_t step_begin, int64_t step_end);
void block_steps_avx512(const BlockLinear& l, const BlockActivations& a, int64_t step_begin, int64_t step_end);

// Per-token dynamic INT8 linear for 1..kGemvMaxRows rows (int8_gemv_avx512.cpp): oneDNN's
// per-channel arithmetic (quantize.OneDnnInt8Linear) on plain [N][K] int8 weights.
constexpr int64_t kGemvMaxRows = 16;
constexpr int64_t kGemvTileRows = 4;  // weight rows per unit of work
struct GemvLinear {
  const float* x;             // [m_size][k_size]
  const int8_t* weight;       // [n_size][k_size]
  const int32_t* weight_sum;  // [n_size]
  const float* weight_scale;  // [n_size]
  const float* bias;          // [n_size] or nullptr
  float* y;                   // [m_size][n_size]
  int64_t m_size, k_size, n_size;
};
// Rows of x -> q + 128 (uint8) [m_size][k_size] and their scales [m_size].
void gemv_quantize_avx512(const GemvLinear& l, uint8_t* qx, float* x_scale);
// Outputs for weight-row tiles [tile_begin, tile_end) of kGemvTileRows rows.
void gemv_tiles_avx512(const GemvLinear& l, const uint8_t* qx, const float* x_scale, int64_t tile_begin,
                       int64_t tile_end);

// The vision encoder's full (unmasked) attention of one image's heads: q, k and v and where each
// head's outputs go, for the bfloat16 kernel and the float32 one below.
struct ImageAttention {
  // [heads][n][d], each row of d contiguous: q[head, i, c] at q + head * head_stride[0] +
  // i * row_stride[0] + c, k's and v's by strides [1] and [2]
  const float* q;
  const float* k;
  const float* v;
  int64_t head_stride[3], row_stride[3];
  float* out;  // row i, head h at out + i * out_row_stride + h * d
  int64_t out_row_stride, heads, n, d;
  float scale;
};

// Attention of one image's heads in bfloat16 dot products with a float32 softmax
// (attention_avx512bf16.cpp, AVX-512 BF16 only):
//
//   out[i, head * d + j] = sum over keys t of p(i, t) * bf16(v[head, t, j]) / sum over t of p(i, t)
//   s(i, t) = sum over c of bf16(q[head, i, c] * scale * log2(e)) * bf16(k[head, t, c])   (float32 sums)
//   p(i, t) = bf16(2^(s(i, t) - m)), m the running maximum of row i's scores over the keys so far
//
// taken over blocks of 64 keys (online softmax: the output and sum so far are rescaled by
// 2^(m_old - m_new) when the maximum grows); bf16() rounds as vcvtneps2bf16 does (to nearest even; a
// NaN stays a NaN; float32 denormals become zero). The float32 sums of the
// bfloat16 products run in the order vdpbf16ps gives, so the result is compared with a float32
// reference of the same roundings within a tolerance (tests/test_kernels.py), not bit for bit.
// Packed bfloat16 operands (see the .cpp): n_pad = n rounded up to 64.
struct BF16AttentionBuffers {
  uint32_t* q;  // [heads][n_pad][d / 2]
  uint16_t* k;  // [heads][n_pad / 16][d / 2][16][2]
  uint16_t* v;  // [heads][n_pad / 2][d][2]
  int64_t n_pad;
};
constexpr int64_t kAttentionRows = 4;  // query rows per unit of work
// Pack rows [16 block_begin, 16 block_end) of one head; then the outputs of query-row tiles
// [tile_begin, tile_end) (kAttentionRows rows each) of one head.
void attention_pack_avx512bf16(const ImageAttention& a, int64_t head, int64_t block_begin, int64_t block_end,
                               const BF16AttentionBuffers& b);
void attention_rows_avx512bf16(const ImageAttention& a, int64_t head, int64_t tile_begin, int64_t tile_end,
                               const BF16AttentionBuffers& b);

// Attention of one image's heads in float32 (attention_avx2.cpp, AVX2 + FMA):
//
//   out[i, head * d + j] = sum over keys t of p(i, t) * v[head, t, j] / sum over t of p(i, t)
//   s(i, t) = sum over c of (q[head, i, c] * scale * log2(e)) * k[head, t, c]
//   p(i, t) = 2^(s(i, t) - m), m the running maximum of row i's scores over the keys so far
//
// taken over blocks of kF32AttentionKeyBlock keys (online softmax, as above); every operation in
// float32, 2^x by simd_math.h's exp2_nonpositive (the rescale of the running output and sum by
// std::exp2). The sums run in the kernel's order, so the result is compared with a float64
// reference within a tolerance (tests/test_kernels.py).
constexpr int64_t kF32AttentionTileRows = 6;      // query rows whose scores share a key panel's loads
constexpr int64_t kF32AttentionQueryTiles = 8;    // tiles per work item: 48 query rows
constexpr int64_t kF32AttentionKeyBlock = 256;    // keys per softmax step
// Packed operands, each starting on a 32-byte boundary (the kernel's aligned loads): n_pad = n
// rounded up to 48 (kF32AttentionQueryTiles * kF32AttentionTileRows).
struct F32AttentionBuffers {
  float* q;  // [heads][n_pad][d]: q * scale * log2(e), zero rows past n
  float* k;  // [heads][n_pad / 16][d][16]: panels of 16 keys, zero keys past n
  float* v;  // [heads][d / 16][n_pad][16]: 16 columns of every key, zero keys past n
  int64_t n_pad;
};
// Pack rows [16 block_begin, 16 block_end) of one head; then the outputs of query blocks
// [block_begin, block_end) (48 rows each) of one head.
void attention_pack_avx2(const ImageAttention& a, int64_t head, int64_t block_begin, int64_t block_end,
                         const F32AttentionBuffers& b);
void attention_rows_avx2(const ImageAttention& a, int64_t head, int64_t block_begin, int64_t block_end,
                         const F32AttentionBuffers& b);

// Per-token INT8 quantization of a row x [cols] float32 (token_quantize_avx2.cpp; the activations
// of quantize.py's per-channel INT8 linears, onednn and gemv backends), PyTorch's operators there
// (quantize._PerTokenInt8Linear) bit for bit:
//
//   a     = max(max(max over j of x[j], -(min over j of x[j])), kTokenScaleFloor)   (NaN if any x[j] is)
//   scale = a / 127;   inv = (1 / a) * 127   (each operation rounded to float32)
//   q[j]  = trunc(fma(x[j], inv, 128.5)) as uint8: x[j] * 127 / a rounded, halves up, + 128
//           (x[j] * inv is within an ulp of [-127, 127]: the sum is positive; one rounding, as
//           PyTorch's addcmul on its AVX2 and AVX-512 builds (tested); its scalar build rounds twice)
//
// A row with a NaN gets scale NaN (its outputs are NaN) and q values of 0; one with an infinity,
// scale infinity (its outputs are not finite either).
constexpr float kTokenScaleFloor = static_cast<float>(127e-12);  // quantize.py's clamp (a double there)
void quantize_tokens_avx2(const float* x, int64_t cols, uint8_t* q, float* scale);

// Per-channel INT8 GEMM without VNNI (int8_gemm_avx2.cpp, AVX2 + FMA): quantize.py's onednn linears
// (the vision encoder's) where oneDNN itself runs vpmaddubsw with 7-bit weights, oneDNN's outputs
// and quantize._PerTokenInt8Linear's rescale bit for bit. For x_q [M][K] uint8 (quantize_tokens'
// q + 128), w [N][K] int8 with |w| <= 63 (quantize.int8_weight_max on CPUs without VNNI):
//
//   acc[m, n] = sum over k of x_q[m, k] * w[n, k] - weight_offset[n]    (exact int32;
//               weight_offset[n] = 128 * sum over k of w[n, k]: the activations' zero point 128)
//   y[m, n]   = float(acc) * weight_scale[n]                            (oneDNN's dequantization)
//   out[m, n] = fma(y, x_scale[m], bias[n]), or y * x_scale[m] without a bias (quantize._rescaled:
//               PyTorch's addcmul on its AVX2 and AVX-512 builds, one rounding, and mul_)
//
// vpmaddubsw adds two u8 x s8 products in int16: 2 * 255 * 63 = 32130 < 32767, never saturated.
// Weight layout (quantize.OneDnnInt8Linear): [N'/32][K/4][32][4] int8, N' = N rounded up to 32 (zero
// weights past N), K a multiple of 4: one 128-byte group holds 4 consecutive k of 32 outputs.
constexpr int64_t kGemmPanel = 32;      // outputs per packed weight panel
constexpr int64_t kGemmRowBlock = 192;  // rows of a work item (their x_q stays in L2 across panels)
constexpr int64_t kGemmItemPanels = 2;  // panels of a work item
constexpr int64_t kGemmDepth = 1536;    // most k per pass over a panel (its weights stay in L1)
struct PerChannelGemm {
  const uint8_t* x;             // [m_size][k_size]
  const int8_t* weight;         // [panels][k_size / 4][32][4]
  const int32_t* weight_offset; // [panels * 32]
  const float* weight_scale;    // [n_size]
  const float* x_scale;         // [m_size]
  const float* bias;            // [n_size] or nullptr
  float* y;                     // [m_size][n_size]
  int64_t m_size, k_size, n_size, panels;
};
// The outputs of rows [row_begin, row_end) (at most kGemmRowBlock) and panels [panel_begin, panel_end).
void per_channel_gemm_avx2(const PerChannelGemm& g, int64_t row_begin, int64_t row_end, int64_t panel_begin,
                           int64_t panel_end);

// The language model's attention for one decode step (decode_attention_avx512.cpp, AVX-512F, and
// decode_attention_avx2.cpp, AVX2 + FMA: the same operations, the same bits), for
// rows b = 0..batch-1 (slot b of the KV cache, float32):
//   1. the rotary embedding of row b's key heads, k' = k * cos + roll(k, d / 2) * signed_sin (three
//      roundings, as model.apply_rotary), k' and v written at position positions[b] of the slot;
//   2. per query head h (grouped: it reads key/value head h / (heads / kv_heads)), its rotated query q'
//      (as k'), s(t) = sum over c of (q'[c] * scale * log2(e)) k[t, c] for t = 0..positions[b], and
//      out[b, h] = sum over t of p(t) v[t] / sum over t of p(t), p(t) = 2^(s(t) - max s).
// The cache positions written are PyTorch's bits (the same three operators). The attention is float32
// in another order than PyTorch's SDPA, and 2^x a polynomial (relative error below 3e-7): the outputs
// are compared with SDPA within a tolerance (tests/test_kernels.py).
struct DecodeAttention {
  const float* qkv;  // [batch][(heads + 2 kv_heads) d]: the query heads, the key heads, the value heads
  const float* cos;  // [batch][d]
  const float* sin;  // [batch][d], its first half negated
  float* k_cache;    // [slots][kv_heads][max_len][d]
  float* v_cache;
  const int64_t* row_slots;  // [batch], each below slots: the slot each row writes and attends to
  const int64_t* positions;  // [batch], each below max_len
  float* out;                // [batch][heads d]
  int64_t batch, heads, kv_heads, d, max_len;  // d a multiple of 16, at most 128
  float scale;
};
// Step 1 for one row; then step 2 for work items [item_begin, item_end), item = row * heads + head,
// with scores a buffer of at least max(positions) + 1 rounded up to 16 floats. Several rows may share
// a slot (speculative decoding verifies draft tokens at consecutive positions): every row's step 1
// runs before any row's step 2, so a row attends to the keys the step's earlier positions wrote.
void decode_write_avx512(const DecodeAttention& a, int64_t row);
void decode_heads_avx512(const DecodeAttention& a, int64_t item_begin, int64_t item_end, float* scores);
void decode_write_avx2(const DecodeAttention& a, int64_t row);
void decode_heads_avx2(const DecodeAttention& a, int64_t item_begin, int64_t item_end, float* scores);

// The language model's RMSNorm and SiLU-gated product in one arithmetic on every path (decoder_ops.cpp,
// ffn_avx512.cpp, ffn_avx2.cpp; the fast preset's decoder where the decode attention runs):
//   rms_norm_row: y[k] = (x[k] * r) * weight[k] (two roundings), r = 1 / sqrt(s / n + eps) (each step
//     correctly rounded), s = sum of x[k]^2 as 16 lane sums (lane j: k = j, j + 16, ... in that order;
//     a product, then a sum: two roundings) added as lanes o + 8, then o + 4, o + 2, o + 1;
//   silu_mul: y[k] = silu(gate[k]) * up[k], silu(g) = g / (1 + t) for g >= 0 and (g * t) / (1 + t)
//     below, t = 2^x, x = -log2(e) * |g| (simd_math.h's exp2_nonpositive: relative error below 3e-7),
//     and t = 0 where x < -150 (or NaN): a very negative gate gives -0, as PyTorch's, -inf a NaN.
// PyTorch's rms_norm sums in an order its build's vector width sets, and its SiLU takes Sleef's exp:
// the RMSNorm is within 4 float32 ulps of PyTorch's, the SiLU product within 4 plus about |g| ulps
// (x is rounded to float32 before 2^x: an error growing with |g|), and both the same bits on every
// path (tests/test_decoder_kernels.py).
constexpr float kSiluLog2e = 1.4426950408889634f;
constexpr float kSiluLowestExponent = -150.0f;
void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* y);
void silu_mul_avx512(const float* gate, const float* up, int64_t n, float* y);
void silu_mul_avx2(const float* gate, const float* up, int64_t n, float* y);

// One decoder layer's weights for a decode step of the whole language model in one call (module.cpp's
// decode_layers): the block-wise linears (layout above), the two RMSNorm weights [hidden] and the
// layer's KV cache (DecodeAttention's). Python passes them as kDecoderPlanFields int64 per layer, in
// this order (engine/kernels.py's BoundDecoder).
struct BlockWeights {
  const uint8_t* weight;
  const float* scale;
  const float* bias;  // or nullptr
  int64_t tiles, k_pad;
};
struct DecoderLayerWeights {
  const float* attention_norm;
  BlockWeights qkv, o;
  const float* ffn_norm;
  BlockWeights gate_up, down;
  float* k_cache;
  float* v_cache;
};
constexpr int64_t kDecoderPlanFields = 24;

}  // namespace mineru_fast
