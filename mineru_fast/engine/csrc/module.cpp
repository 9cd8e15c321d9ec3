// The extension module mineru_fast.engine._kernels: CPython's limited API (one build serves every
// Python from 3.10, abi3), no PyTorch headers. Tensors come in as raw pointers (data_ptr()) with
// their sizes; the caller (engine/kernels.py) checks dtypes, shapes and contiguity, this file checks
// that the sizes agree. The work is split over OpenMP threads (the OpenMP runtime PyTorch loaded:
// the same libgomp, so the same thread pool), the GIL released meanwhile.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kernels.h"

#ifndef MINERU_FAST_SOURCE_DIGEST
#define MINERU_FAST_SOURCE_DIGEST "unknown"
#endif

namespace mf = mineru_fast;

namespace {

enum Path : int { kPortable = 0, kAvx2 = 1, kAvx512Vnni = 2 };

bool cpu_has(Path path) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (path) {
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
#else
  return path == kPortable;
#endif
}

// body(begin, end) over [0, count) in contiguous chunks, one per thread (at most `threads`, and
// none smaller than `grain`); inline when one chunk would do.
template <class Body>
void parallel(int threads, int64_t count, int64_t grain, const Body& body) {
  const int64_t chunks = std::min<int64_t>(threads, (count + grain - 1) / grain);
#if defined(_OPENMP)
  if (chunks > 1) {
#pragma omp parallel num_threads(static_cast<int>(chunks))
    {
      const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
      const int64_t size = (count + team - 1) / team, begin = me * size, end = std::min(count, begin + size);
      if (begin < end) body(begin, end);
    }
    return;
  }
#endif
  if (count > 0) body(0, count);
}

// body(head, first, last) over items [0, heads * per_head) numbered head-major, split over the threads as
// parallel splits them (none fewer than `grain` items): one call per run of one head's items
// [first, last) within a thread's share.
template <class Body>
void parallel_heads(int threads, int64_t heads, int64_t per_head, int64_t grain, const Body& body) {
  parallel(threads, heads * per_head, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end;) {
      const int64_t head = item / per_head, first = item % per_head;
      const int64_t last = std::min(per_head, first + (end - item));
      body(head, first, last);
      item += last - first;
    }
  });
}

// The quantized activations of a block-wise linear call: sized once for its rows and widest input.
struct BlockScratch {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;

  bool reserve(int64_t rows, int64_t k_pad) {
    try {
      q.resize(rows * k_pad);
      scale.resize(rows * (k_pad / mf::kBlock));
      sum.resize(rows * (k_pad / mf::kBlock));
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }
};

// y = block-wise linear of x [l.m_size][k] (kernels.h), its input padded to k_pad; no GIL needed.
void run_block(Path path, int threads, const float* x, int64_t k, int64_t k_pad, const mf::BlockLinear& l,
               BlockScratch& scratch) {
  const mf::BlockActivations a{scratch.q.data(), scratch.scale.data(), scratch.sum.data(), k_pad, k_pad / mf::kBlock};
  parallel(threads, l.m_size, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      switch (path) {
        case kAvx512Vnni: mf::quantize_blocks_avx512(x + row * k, k, a, row); break;
        case kAvx2: mf::quantize_blocks_avx2(x + row * k, k, a, row); break;
        default: mf::quantize_blocks_portable(x + row * k, k, a, row);
      }
    }
  });
  const int64_t steps = (l.tiles + mf::kStepTiles - 1) / mf::kStepTiles;
  parallel(threads, steps, 1, [&](int64_t begin, int64_t end) {
    switch (path) {
      case kAvx512Vnni: mf::block_steps_avx512(l, a, begin, end); break;
      case kAvx2: mf::block_steps_avx2(l, a, begin, end); break;
      default: mf::block_steps_portable(l, a, begin, end);
    }
  });
}

template <class T>
T* as_pointer(unsigned long long address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// The longest row (its position + 1) of a decode step, or -1 with a Python ValueError set when a row's
// slot or position is outside the KV cache.
int64_t checked_longest(const int64_t* row_slots, const int64_t* positions, int64_t batch, int64_t slots,
                        int64_t max_len) {
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (row_slots[b] < 0 || row_slots[b] >= slots) {
      PyErr_Format(PyExc_ValueError, "slot %lld of row %lld is outside the KV cache (%lld slots)",
                   (long long)row_slots[b], (long long)b, (long long)slots);
      return -1;
    }
    if (positions[b] < 0 || positions[b] >= max_len) {
      PyErr_Format(PyExc_ValueError, "position %lld of row %lld is outside the KV cache (max_len %lld)",
                   (long long)positions[b], (long long)b, (long long)max_len);
      return -1;
    }
    longest = std::max<int64_t>(longest, positions[b] + 1);
  }
  return longest;
}

// The decode attention of a step (kernels.h) on the avx512_vnni or avx2 path; no GIL needed. False
// when a thread's score buffer could not be allocated.
bool run_decode_attention(Path path, int threads, const mf::DecodeAttention& a, int64_t longest) {
  const int64_t padded = (longest + 15) / 16 * 16;
  const bool wide = path == kAvx512Vnni;
  bool no_memory = false;
  for (int64_t b = 0; b < a.batch; ++b) wide ? mf::decode_write_avx512(a, b) : mf::decode_write_avx2(a, b);
  parallel(threads, a.batch * a.heads, 1, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<float[]> scores(new (std::nothrow) float[padded]);
    if (!scores) {
#pragma omp atomic write
      no_memory = true;
      return;
    }
    if (wide)
      mf::decode_heads_avx512(a, begin, end, scores.get());
    else
      mf::decode_heads_avx2(a, begin, end, scores.get());
  });
  return !no_memory;
}

PyObject* cpu_paths(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  const std::pair<Path, const char*> names[] = {{kAvx512Vnni, "avx512_vnni"}, {kAvx2, "avx2"}, {kPortable, "portable"}};
  for (const auto& [path, name] : names) {
    if (!cpu_has(path)) continue;
    PyObject* item = PyUnicode_FromString(name);
    if (item == nullptr || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return out;
}

// block_linear(path, threads, x, m, k, weight, tiles, k_pad, weight_scale, bias, n, y)
PyObject* block_linear(PyObject*, PyObject* args) {
  int path, threads;
  unsigned long long x_p, w_p, ws_p, bias_p, y_p;
  long long m, k, tiles, k_pad, n;
  if (!PyArg_ParseTuple(args, "iiKLLKLLKKLK", &path, &threads, &x_p, &m, &k, &w_p, &tiles, &k_pad, &ws_p, &bias_p,
                        &n, &y_p))
    return nullptr;
  if (path < kPortable || path > kAvx512Vnni || !cpu_has(static_cast<Path>(path))) {
    PyErr_Format(PyExc_ValueError, "kernel path %d does not run on this CPU", path);
    return nullptr;
  }
  if (m < 0 || k < 1 || tiles < 1 || k_pad % mf::kBlock != 0 || k > k_pad || k <= k_pad - mf::kBlock ||
      n <= (tiles - 1) * mf::kLanes || n > tiles * mf::kLanes) {
    PyErr_Format(PyExc_ValueError, "sizes disagree: m=%lld k=%lld k_pad=%lld tiles=%lld n=%lld", m, k, k_pad, tiles, n);
    return nullptr;
  }
  if (m == 0) Py_RETURN_NONE;  // an empty x and y have no storage
  if (x_p == 0 || w_p == 0 || ws_p == 0 || y_p == 0) {
    PyErr_SetString(PyExc_ValueError, "a null tensor pointer");
    return nullptr;
  }
  BlockScratch scratch;
  if (!scratch.reserve(m, k_pad)) return PyErr_NoMemory();
  const mf::BlockLinear l{as_pointer<const uint8_t>(w_p), as_pointer<const float>(ws_p), as_pointer<const float>(bias_p),
                          as_pointer<float>(y_p), m, n, tiles};
  const float* x = as_pointer<const float>(x_p);
  const Path chosen = static_cast<Path>(path);
  Py_BEGIN_ALLOW_THREADS;
  run_block(chosen, threads, x, k, k_pad, l, scratch);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// gemv_linear(threads, x, m, k, weight, weight_sum, weight_scale, bias, n, y)
PyObject* gemv_linear(PyObject*, PyObject* args) {
  int threads;
  unsigned long long x_p, w_p, sum_p, scale_p, bias_p, y_p;
  long long m, k, n;
  if (!PyArg_ParseTuple(args, "iKLLKKKKLK", &threads, &x_p, &m, &k, &w_p, &sum_p, &scale_p, &bias_p, &n, &y_p))
    return nullptr;
  if (!cpu_has(kAvx512Vnni)) {
    PyErr_SetString(PyExc_ValueError, "the INT8 GEMV needs AVX-512 VNNI");
    return nullptr;
  }
  if (m < 1 || m > mf::kGemvMaxRows || k < 1 || n < 1) {
    PyErr_Format(PyExc_ValueError, "sizes: m=%lld (1 to %lld), k=%lld, n=%lld", m, (long long)mf::kGemvMaxRows, k, n);
    return nullptr;
  }
  if (x_p == 0 || w_p == 0 || sum_p == 0 || scale_p == 0 || y_p == 0) {
    PyErr_SetString(PyExc_ValueError, "a null tensor pointer");
    return nullptr;
  }
  const mf::GemvLinear l{as_pointer<const float>(x_p),     as_pointer<const int8_t>(w_p),
                         as_pointer<const int32_t>(sum_p), as_pointer<const float>(scale_p),
                         as_pointer<const float>(bias_p),  as_pointer<float>(y_p),
                         m,                                k,
                         n};
  std::vector<uint8_t> qx;
  std::vector<float> x_scale;
  try {
    qx.resize(m * k);
    x_scale.resize(m);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  Py_BEGIN_ALLOW_THREADS;
  mf::gemv_quantize_avx512(l, qx.data(), x_scale.data());
  const int64_t tiles = (n + mf::kGemvTileRows - 1) / mf::kGemvTileRows;
  parallel(threads, tiles, 16, [&](int64_t begin, int64_t end) {
    mf::gemv_tiles_avx512(l, qx.data(), x_scale.data(), begin, end);
  });
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

bool cpu_has_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return cpu_has(kAvx512Vnni) && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

PyObject* attention_runs(PyObject*, PyObject*) { return PyBool_FromLong(cpu_has_bf16()); }

// The arguments of attention_bf16 and attention_f32: (threads, q, k, v, q_head_stride, k_head_stride,
// v_head_stride, q_row_stride, k_row_stride, v_row_stride, heads, n, d, scale, out, out_row_stride),
// the sizes checked; false with a Python ValueError set when they do not parse or fit.
bool image_attention_args(PyObject* args, int& threads, mf::ImageAttention& a) {
  unsigned long long q_p, k_p, v_p, out_p;
  long long head_stride[3], row_stride[3], heads, n, d, stride;
  float scale;
  if (!PyArg_ParseTuple(args, "iKKKLLLLLLLLLfKL", &threads, &q_p, &k_p, &v_p, &head_stride[0], &head_stride[1],
                        &head_stride[2], &row_stride[0], &row_stride[1], &row_stride[2], &heads, &n, &d, &scale,
                        &out_p, &stride))
    return false;
  if (heads < 1 || n < 1 || d < 16 || d > 128 || d % 16 != 0 || stride < heads * d) {
    PyErr_Format(PyExc_ValueError, "sizes: heads=%lld n=%lld d=%lld (16 to 128, a multiple of 16) out_row_stride=%lld",
                 heads, n, d, stride);
    return false;
  }
  for (int t = 0; t < 3; ++t) {
    if (head_stride[t] < 0 || row_stride[t] < 0) {
      PyErr_SetString(PyExc_ValueError, "a negative stride");
      return false;
    }
  }
  if (q_p == 0 || k_p == 0 || v_p == 0 || out_p == 0) {
    PyErr_SetString(PyExc_ValueError, "a null tensor pointer");
    return false;
  }
  a = mf::ImageAttention{as_pointer<const float>(q_p),
                         as_pointer<const float>(k_p),
                         as_pointer<const float>(v_p),
                         {head_stride[0], head_stride[1], head_stride[2]},
                         {row_stride[0], row_stride[1], row_stride[2]},
                         as_pointer<float>(out_p),
                         stride,
                         heads,
                         n,
                         d,
                         scale};
  return true;
}

// attention_bf16(the arguments of image_attention_args)
PyObject* attention_bf16(PyObject*, PyObject* args) {
  int threads;
  mf::ImageAttention a{};
  if (!image_attention_args(args, threads, a)) return nullptr;
  if (!cpu_has_bf16()) {
    PyErr_SetString(PyExc_ValueError, "the bfloat16 attention needs AVX-512 BF16");
    return nullptr;
  }
  const int64_t heads = a.heads, n = a.n, d = a.d;
  const int64_t n_pad = (n + 63) / 64 * 64;
  // left uninitialised: the packing writes every element, rows past n included
  const std::unique_ptr<uint32_t[]> q(new (std::nothrow) uint32_t[heads * n_pad * d / 2]);
  const std::unique_ptr<uint16_t[]> k(new (std::nothrow) uint16_t[heads * n_pad * d]);
  const std::unique_ptr<uint16_t[]> v(new (std::nothrow) uint16_t[heads * n_pad * d]);
  if (!q || !k || !v) return PyErr_NoMemory();
  const mf::BF16AttentionBuffers b{q.get(), k.get(), v.get(), n_pad};
  const int64_t blocks = n_pad / 16, tiles = (n + mf::kAttentionRows - 1) / mf::kAttentionRows;
  Py_BEGIN_ALLOW_THREADS;
  // work items are (head, block) and (head, tile) pairs
  parallel_heads(threads, heads, blocks, 16, [&](int64_t head, int64_t first, int64_t last) {
    mf::attention_pack_avx512bf16(a, head, first, last, b);
  });
  parallel_heads(threads, heads, tiles, 4, [&](int64_t head, int64_t first, int64_t last) {
    mf::attention_rows_avx512bf16(a, head, first, last, b);
  });
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// The first 32-byte boundary at or after p (p a float array with 8 floats to spare).
float* align32(float* p) { return p + ((32 - reinterpret_cast<uintptr_t>(p) % 32) % 32) / sizeof(float); }

// attention_f32(the arguments of image_attention_args)
PyObject* attention_f32(PyObject*, PyObject* args) {
  int threads;
  mf::ImageAttention a{};
  if (!image_attention_args(args, threads, a)) return nullptr;
  if (!cpu_has(kAvx2)) {
    PyErr_SetString(PyExc_ValueError, "the float32 attention needs AVX2 and FMA");
    return nullptr;
  }
  const int64_t heads = a.heads, n = a.n, d = a.d;
  constexpr int64_t block_rows = mf::kF32AttentionQueryTiles * mf::kF32AttentionTileRows;
  const int64_t n_pad = (n + block_rows - 1) / block_rows * block_rows;
  // left uninitialised: the packing writes every element, rows past n included
  // 8 floats more than the operands: each starts on a 32-byte boundary (the kernel's aligned loads)
  const int64_t size = heads * n_pad * d;
  const std::unique_ptr<float[]> q(new (std::nothrow) float[size + 8]);
  const std::unique_ptr<float[]> k(new (std::nothrow) float[size + 8]);
  const std::unique_ptr<float[]> v(new (std::nothrow) float[size + 8]);
  if (!q || !k || !v) return PyErr_NoMemory();
  const mf::F32AttentionBuffers b{align32(q.get()), align32(k.get()), align32(v.get()), n_pad};
  const int64_t packs = n_pad / 16, blocks = n_pad / block_rows;
  Py_BEGIN_ALLOW_THREADS;
  // work items are (head, 16 rows) and (head, query block) pairs
  parallel_heads(threads, heads, packs, 16, [&](int64_t head, int64_t first, int64_t last) {
    mf::attention_pack_avx2(a, head, first, last, b);
  });
  parallel_heads(threads, heads, blocks, 1, [&](int64_t head, int64_t first, int64_t last) {
    mf::attention_rows_avx2(a, head, first, last, b);
  });
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// decode_attention(path, threads, qkv, batch, heads, kv_heads, d, cos, sin, k_cache, v_cache, slots, max_len,
//                  row_slots, positions, out, scale)
PyObject* decode_attention(PyObject*, PyObject* args) {
  int path, threads;
  unsigned long long qkv_p, cos_p, sin_p, k_p, v_p, row_slots_p, pos_p, out_p;
  long long batch, heads, kv_heads, d, slots, max_len;
  float scale;
  if (!PyArg_ParseTuple(args, "iiKLLLLKKKKLLKKKf", &path, &threads, &qkv_p, &batch, &heads, &kv_heads, &d, &cos_p,
                        &sin_p, &k_p, &v_p, &slots, &max_len, &row_slots_p, &pos_p, &out_p, &scale))
    return nullptr;
  if ((path != kAvx2 && path != kAvx512Vnni) || !cpu_has(static_cast<Path>(path))) {
    PyErr_Format(PyExc_ValueError, "the decode attention runs on the avx2 and avx512_vnni paths, not path %d here",
                 path);
    return nullptr;
  }
  if (batch < 1 || slots < 1 || kv_heads < 1 || heads < kv_heads || heads % kv_heads != 0 || d < 16 || d > 128 ||
      d % 16 != 0 || max_len < 1) {
    PyErr_Format(PyExc_ValueError,
                 "sizes: batch=%lld slots=%lld (at least 1) heads=%lld kv_heads=%lld (a divisor) d=%lld (16 to 128, a "
                 "multiple of 16) max_len=%lld",
                 batch, slots, heads, kv_heads, d, max_len);
    return nullptr;
  }
  if (qkv_p == 0 || cos_p == 0 || sin_p == 0 || k_p == 0 || v_p == 0 || row_slots_p == 0 || pos_p == 0 ||
      out_p == 0) {
    PyErr_SetString(PyExc_ValueError, "a null tensor pointer");
    return nullptr;
  }
  const int64_t* row_slots = as_pointer<const int64_t>(row_slots_p);
  const int64_t* positions = as_pointer<const int64_t>(pos_p);
  const int64_t longest = checked_longest(row_slots, positions, batch, slots, max_len);
  if (longest < 0) return nullptr;
  const mf::DecodeAttention a{as_pointer<const float>(qkv_p), as_pointer<const float>(cos_p),
                              as_pointer<const float>(sin_p), as_pointer<float>(k_p),
                              as_pointer<float>(v_p),        row_slots,
                              positions,                     as_pointer<float>(out_p),
                              batch,                         heads,
                              kv_heads,                      d,
                              max_len,                       scale};
  bool done;
  Py_BEGIN_ALLOW_THREADS;
  done = run_decode_attention(static_cast<Path>(path), threads, a, longest);
  Py_END_ALLOW_THREADS;
  if (!done) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

// What a call over m rows of n values may do: run; nothing (m == 0, where a tensor's data pointer may be
// null); or fail, with a Python ValueError set (a negative m, an empty row, a null pointer).
enum class RowsCall { kRun, kNothing, kFail };
RowsCall check_rows(long long m, long long n, std::initializer_list<unsigned long long> pointers) {
  if (m < 0 || n < 1) {
    PyErr_Format(PyExc_ValueError, "sizes: m=%lld n=%lld", m, n);
    return RowsCall::kFail;
  }
  if (m == 0) return RowsCall::kNothing;
  for (const unsigned long long pointer : pointers) {
    if (pointer == 0) {
      PyErr_SetString(PyExc_ValueError, "a null tensor pointer");
      return RowsCall::kFail;
    }
  }
  return RowsCall::kRun;
}

// rms_norm(threads, x, m, n, weight, eps, y): rows of x [m][n] -> y [m][n] (kernels.h's rms_norm_row)
PyObject* rms_norm(PyObject*, PyObject* args) {
  int threads;
  unsigned long long x_p, w_p, y_p;
  long long m, n;
  float eps;
  if (!PyArg_ParseTuple(args, "iKLLKfK", &threads, &x_p, &m, &n, &w_p, &eps, &y_p)) return nullptr;
  const RowsCall call = check_rows(m, n, {x_p, w_p, y_p});
  if (call == RowsCall::kFail) return nullptr;
  if (call == RowsCall::kNothing) Py_RETURN_NONE;
  const float* x = as_pointer<const float>(x_p);
  const float* w = as_pointer<const float>(w_p);
  float* y = as_pointer<float>(y_p);
  Py_BEGIN_ALLOW_THREADS;
  parallel(threads, m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) mf::rms_norm_row(x + row * n, w, n, eps, y + row * n);
  });
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// quantize_tokens(threads, x, m, n, q, scale): rows x [m][n] float32 -> q [m][n] uint8 and scale [m]
PyObject* quantize_tokens(PyObject*, PyObject* args) {
  int threads;
  unsigned long long x_p, q_p, s_p;
  long long m, n;
  if (!PyArg_ParseTuple(args, "iKLLKK", &threads, &x_p, &m, &n, &q_p, &s_p)) return nullptr;
  if (!cpu_has(kAvx2)) {
    PyErr_SetString(PyExc_ValueError, "the token quantization needs AVX2 and FMA");
    return nullptr;
  }
  const RowsCall call = check_rows(m, n, {x_p, q_p, s_p});
  if (call == RowsCall::kFail) return nullptr;
  if (call == RowsCall::kNothing) Py_RETURN_NONE;
  const float* x = as_pointer<const float>(x_p);
  uint8_t* q = as_pointer<uint8_t>(q_p);
  float* scale = as_pointer<float>(s_p);
  Py_BEGIN_ALLOW_THREADS;
  // each row is its own: any split gives the same bits; at least ~65,536 values per thread (a fork
  // costs about as much as quantizing them)
  parallel(threads, m, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) mf::quantize_tokens_avx2(x + row * n, n, q + row * n, scale + row);
  });
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// per_channel_gemm(threads, x, m, k, weight, weight_offset, panels, weight_scale, x_scale, bias, y, n):
// kernels.h's per-channel INT8 GEMM (AVX2 + FMA) of x [m][k] uint8 -> y [m][n] float32, in work items
// of kGemmRowBlock rows by kGemmItemPanels panels (each output is computed whole by one item: any
// split gives the same bits)
PyObject* per_channel_gemm(PyObject*, PyObject* args) {
  int threads;
  unsigned long long x_p, w_p, off_p, ws_p, xs_p, bias_p, y_p;
  long long m, k, panels, n;
  if (!PyArg_ParseTuple(args, "iKLLKKLKKKKL", &threads, &x_p, &m, &k, &w_p, &off_p, &panels, &ws_p, &xs_p, &bias_p,
                        &y_p, &n))
    return nullptr;
  if (!cpu_has(kAvx2)) {
    PyErr_SetString(PyExc_ValueError, "the per-channel INT8 GEMM needs AVX2 and FMA");
    return nullptr;
  }
  if (m < 0 || k < 4 || k % 4 != 0 || n < 1 || panels != (n + mf::kGemmPanel - 1) / mf::kGemmPanel) {
    PyErr_Format(PyExc_ValueError,
                 "sizes: m=%lld (at least 0) k=%lld (a positive multiple of 4) n=%lld (at least 1) panels=%lld "
                 "(n / %lld rounded up)",
                 m, k, n, panels, (long long)mf::kGemmPanel);
    return nullptr;
  }
  const RowsCall call = check_rows(m, k, {x_p, w_p, off_p, ws_p, xs_p, y_p});
  if (call == RowsCall::kFail) return nullptr;
  if (call == RowsCall::kNothing) Py_RETURN_NONE;
  const mf::PerChannelGemm g{as_pointer<const uint8_t>(x_p), as_pointer<const int8_t>(w_p),
                             as_pointer<const int32_t>(off_p), as_pointer<const float>(ws_p),
                             as_pointer<const float>(xs_p), as_pointer<const float>(bias_p),
                             as_pointer<float>(y_p), m, k, n, panels};
  const int64_t row_blocks = (m + mf::kGemmRowBlock - 1) / mf::kGemmRowBlock;
  const int64_t groups = (panels + mf::kGemmItemPanels - 1) / mf::kGemmItemPanels;
  Py_BEGIN_ALLOW_THREADS;
  parallel(threads, row_blocks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / groups * mf::kGemmRowBlock, panel = item % groups * mf::kGemmItemPanels;
      mf::per_channel_gemm_avx2(g, row, std::min<int64_t>(m, row + mf::kGemmRowBlock), panel,
                                std::min<int64_t>(panels, panel + mf::kGemmItemPanels));
    }
  });
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

void silu_mul_values(Path path, const float* gate, const float* up, int64_t n, float* y) {
  if (path == kAvx512Vnni)
    mf::silu_mul_avx512(gate, up, n, y);
  else
    mf::silu_mul_avx2(gate, up, n, y);
}

// silu_mul of rows of gate_up [m][2n] -> y [m][n], in segments of kSiluSegment values split over the
// threads (each value's arithmetic is its own: any split gives the same bits); a decode row's 4,864
// values stay on one thread (a fork costs more than half of them).
constexpr int64_t kSiluSegment = 1024;
void silu_mul_rows(Path path, int threads, const float* gate_up, int64_t m, int64_t n, float* y) {
  const int64_t per_row = (n + kSiluSegment - 1) / kSiluSegment;
  parallel(threads, m * per_row, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / per_row, start = item % per_row * kSiluSegment;
      const float* gate = gate_up + row * 2 * n + start;
      silu_mul_values(path, gate, gate + n, std::min(kSiluSegment, n - start), y + row * n + start);
    }
  });
}

// silu_mul(path, threads, gate_up, m, n, y): rows of gate_up [m][2n] (the gate, then the up values)
// -> y [m][n] (kernels.h's silu_mul), on the avx512_vnni or avx2 path
PyObject* silu_mul(PyObject*, PyObject* args) {
  int path, threads;
  unsigned long long x_p, y_p;
  long long m, n;
  if (!PyArg_ParseTuple(args, "iiKLLK", &path, &threads, &x_p, &m, &n, &y_p)) return nullptr;
  if ((path != kAvx2 && path != kAvx512Vnni) || !cpu_has(static_cast<Path>(path))) {
    PyErr_Format(PyExc_ValueError, "silu_mul runs on the avx2 and avx512_vnni paths, not path %d here", path);
    return nullptr;
  }
  const RowsCall call = check_rows(m, n, {x_p, y_p});
  if (call == RowsCall::kFail) return nullptr;
  if (call == RowsCall::kNothing) Py_RETURN_NONE;
  const float* x = as_pointer<const float>(x_p);
  float* y = as_pointer<float>(y_p);
  const Path chosen = static_cast<Path>(path);
  Py_BEGIN_ALLOW_THREADS;
  silu_mul_rows(chosen, threads, x, m, n, y);
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// Whether a block-wise layer's tiles and padded input hold n outputs of k inputs (as block_linear checks).
bool block_sizes_agree(const mf::BlockWeights& w, int64_t k, int64_t n) {
  return w.weight != nullptr && w.scale != nullptr && w.tiles >= 1 && w.k_pad % mf::kBlock == 0 && k <= w.k_pad &&
         k > w.k_pad - mf::kBlock && n > (w.tiles - 1) * mf::kLanes && n <= w.tiles * mf::kLanes;
}

// decode_layers(path, threads, plan, layers, h, batch, hidden, heads, kv_heads, d, intermediate, eps, cos, sin,
//               slots, max_len, row_slots, positions, scale)
// One decode step through every decoder layer, h [batch][hidden] updated in place: per layer
//   h += o(attention(qkv(rms_norm(h)))),  h += down(silu_mul(gate_up(rms_norm(h))))
// with the block-wise linears, the decode attention (DecodeAttention's arguments: the layer's cache,
// cos, sin, row_slots, positions, scale) and rms_norm_row / silu_mul of kernels.h: the same operations
// as those calls one by one. plan: layers x kDecoderPlanFields int64 (DecoderLayerWeights).
PyObject* decode_layers(PyObject*, PyObject* args) {
  int path, threads;
  unsigned long long plan_p, h_p, cos_p, sin_p, row_slots_p, pos_p;
  long long layers, batch, hidden, heads, kv_heads, d, intermediate, slots, max_len;
  float eps, scale;
  if (!PyArg_ParseTuple(args, "iiKLKLLLLLLfKKLLKKf", &path, &threads, &plan_p, &layers, &h_p, &batch, &hidden, &heads,
                        &kv_heads, &d, &intermediate, &eps, &cos_p, &sin_p, &slots, &max_len, &row_slots_p, &pos_p,
                        &scale))
    return nullptr;
  if ((path != kAvx2 && path != kAvx512Vnni) || !cpu_has(static_cast<Path>(path))) {
    PyErr_Format(PyExc_ValueError, "decode_layers runs on the avx2 and avx512_vnni paths, not path %d here", path);
    return nullptr;
  }
  if (layers < 1 || batch < 1 || hidden < 1 || intermediate < 1 || slots < 1 || kv_heads < 1 || heads < kv_heads ||
      heads % kv_heads != 0 || d < 16 || d > 128 || d % 16 != 0 || max_len < 1) {
    PyErr_Format(PyExc_ValueError,
                 "sizes: layers=%lld batch=%lld hidden=%lld intermediate=%lld slots=%lld (at least 1) heads=%lld "
                 "kv_heads=%lld (a divisor) d=%lld (16 to 128, a multiple of 16) max_len=%lld",
                 layers, batch, hidden, intermediate, slots, heads, kv_heads, d, max_len);
    return nullptr;
  }
  if (plan_p == 0 || h_p == 0 || cos_p == 0 || sin_p == 0 || row_slots_p == 0 || pos_p == 0) {
    PyErr_SetString(PyExc_ValueError, "a null tensor pointer");
    return nullptr;
  }
  static_assert(sizeof(mf::DecoderLayerWeights) == mf::kDecoderPlanFields * sizeof(int64_t),
                "DecoderLayerWeights is kDecoderPlanFields 8-byte fields");
  const int64_t qkv_n = (heads + 2 * kv_heads) * d, attention_n = heads * d;
  std::vector<mf::DecoderLayerWeights> plan;
  std::vector<float> normed, qkv, attention, o, gate_up, act;
  BlockScratch scratch;
  try {
    plan.resize(layers);
    normed.resize(batch * hidden);
    qkv.resize(batch * qkv_n);
    attention.resize(batch * attention_n);
    o.resize(batch * hidden);
    gate_up.resize(batch * 2 * intermediate);
    act.resize(batch * intermediate);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  std::memcpy(plan.data(), as_pointer<const void>(plan_p), plan.size() * sizeof(mf::DecoderLayerWeights));
  int64_t widest = 0;
  for (int64_t i = 0; i < layers; ++i) {
    const mf::DecoderLayerWeights& w = plan[i];
    if (w.attention_norm == nullptr || w.ffn_norm == nullptr || w.k_cache == nullptr || w.v_cache == nullptr ||
        !block_sizes_agree(w.qkv, hidden, qkv_n) || !block_sizes_agree(w.o, attention_n, hidden) ||
        !block_sizes_agree(w.gate_up, hidden, 2 * intermediate) || !block_sizes_agree(w.down, intermediate, hidden)) {
      PyErr_Format(PyExc_ValueError, "layer %lld: a null pointer or a linear whose sizes disagree with the model's",
                   (long long)i);
      return nullptr;
    }
    widest = std::max({widest, w.qkv.k_pad, w.o.k_pad, w.gate_up.k_pad, w.down.k_pad});
  }
  if (!scratch.reserve(batch, widest)) return PyErr_NoMemory();
  const int64_t* row_slots = as_pointer<const int64_t>(row_slots_p);
  const int64_t* positions = as_pointer<const int64_t>(pos_p);
  const int64_t longest = checked_longest(row_slots, positions, batch, slots, max_len);
  if (longest < 0) return nullptr;
  float* h = as_pointer<float>(h_p);
  const Path chosen = static_cast<Path>(path);
  bool done = true;
  Py_BEGIN_ALLOW_THREADS;
  const auto linear = [&](const mf::BlockWeights& w, const float* x, int64_t k, float* y, int64_t n) {
    run_block(chosen, threads, x, k, w.k_pad, mf::BlockLinear{w.weight, w.scale, w.bias, y, batch, n, w.tiles},
              scratch);
  };
  const auto residual = [&]() {
    for (int64_t i = 0; i < batch * hidden; ++i) h[i] += o[i];
  };
  for (int64_t i = 0; i < layers; ++i) {
    const mf::DecoderLayerWeights& w = plan[i];
    for (int64_t b = 0; b < batch; ++b)
      mf::rms_norm_row(h + b * hidden, w.attention_norm, hidden, eps, normed.data() + b * hidden);
    linear(w.qkv, normed.data(), hidden, qkv.data(), qkv_n);
    const mf::DecodeAttention a{qkv.data(), as_pointer<const float>(cos_p), as_pointer<const float>(sin_p),
                                w.k_cache,  w.v_cache,                      row_slots,
                                positions,  attention.data(),               batch,
                                heads,      kv_heads,                       d,
                                max_len,    scale};
    done = run_decode_attention(chosen, threads, a, longest);
    if (!done) break;
    linear(w.o, attention.data(), attention_n, o.data(), hidden);
    residual();
    for (int64_t b = 0; b < batch; ++b)
      mf::rms_norm_row(h + b * hidden, w.ffn_norm, hidden, eps, normed.data() + b * hidden);
    linear(w.gate_up, normed.data(), hidden, gate_up.data(), 2 * intermediate);
    silu_mul_rows(chosen, threads, gate_up.data(), batch, intermediate, act.data());
    linear(w.down, act.data(), intermediate, o.data(), hidden);
    residual();
  }
  Py_END_ALLOW_THREADS;
  if (!done) return PyErr_NoMemory();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"cpu_paths", cpu_paths, METH_NOARGS, "The block kernel's paths this CPU runs, fastest first."},
    {"block_linear", block_linear, METH_VARARGS, "Block-wise INT8 linear on raw pointers (engine/kernels.py)."},
    {"gemv_linear", gemv_linear, METH_VARARGS, "Per-token INT8 GEMV on raw pointers (engine/kernels.py)."},
    {"attention_runs", attention_runs, METH_NOARGS, "Whether this CPU runs the bfloat16 attention (AVX-512 BF16)."},
    {"attention_bf16", attention_bf16, METH_VARARGS, "Bfloat16 attention of one image's heads (engine/kernels.py)."},
    {"attention_f32", attention_f32, METH_VARARGS, "Float32 attention of one image's heads, AVX2 (engine/kernels.py)."},
    {"decode_attention", decode_attention, METH_VARARGS, "The language model's decode-step attention (engine/kernels.py)."},
    {"quantize_tokens", quantize_tokens, METH_VARARGS, "Per-token INT8 quantization of rows (engine/kernels.py)."},
    {"per_channel_gemm", per_channel_gemm, METH_VARARGS, "Per-channel INT8 GEMM, AVX2 (engine/kernels.py)."},
    {"rms_norm", rms_norm, METH_VARARGS, "The language model's RMSNorm of rows (engine/kernels.py)."},
    {"silu_mul", silu_mul, METH_VARARGS, "The feed-forward's SiLU-gated product of rows (engine/kernels.py)."},
    {"decode_layers", decode_layers, METH_VARARGS, "A decode step through every decoder layer (engine/kernels.py)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_kernels", "mineru-fast's own kernels (INT8 linears, attention).",
                          -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__kernels(void) {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (PyModule_AddStringConstant(module, "SOURCE_DIGEST", MINERU_FAST_SOURCE_DIGEST) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
