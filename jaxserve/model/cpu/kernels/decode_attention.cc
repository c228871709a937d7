// Paged decode attention for XLA on the CPU, as an XLA FFI handler: one query row per
// request, read against that request's K/V straight from the paged cache (no gathered copy).
//
// q [S, Hq, D], k/v pages [L, N, page_size, Hkv, D] (float32, or fp8 e4m3fn / e5m2: each
// byte read through a 256-entry table of its float value, the caller applying the layer's
// scales outside: jaxserve/model/kv_quant.py), layer [] i32, page_table [S, P] i32,
// kv_lens [S] i32, num_decode [] i32 -> out [S, Hq, D]. Request s < num_decode
// attends to positions [lo, kv_lens[s]) (lo = kv_lens - window with a sliding window, else
// 0); other requests' rows are zero. Scores are q . k * sm_scale, then soft_cap * tanh(s /
// soft_cap) where soft_cap > 0; softmax in float32, online over blocks of positions. Work is
// one task per (request, KV head), its query heads together, shared out over XLA's intra-op
// thread pool. Page ids and lengths are clamped to the arrays, so bad metadata cannot read
// outside them. jaxserve/model/cpu_attention.py says when it runs and what it replaced.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 128;  // positions scored before their softmax update
constexpr int kMaxFast = 8;      // query heads per KV head with register-held accumulators

// The float value of every byte of an fp8 format (exponent bias, mantissa bits, whether the
// all-ones exponent is inf/NaN as in e5m2, or only S.1111.111 is NaN as in e4m3fn).
std::vector<float> Fp8Table(int bias, int mantissa_bits, bool ieee_special) {
  std::vector<float> table(256);
  const int exp_bits = 7 - mantissa_bits, top = (1 << exp_bits) - 1, m_max = 1 << mantissa_bits;
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> mantissa_bits) & top, m = b & (m_max - 1);
    float x;
    if (e == 0)
      x = std::ldexp(float(m) / m_max, 1 - bias);
    else if (ieee_special && e == top)
      x = m == 0 ? INFINITY : NAN;
    else if (!ieee_special && e == top && m == m_max - 1)
      x = NAN;
    else
      x = std::ldexp(1.f + float(m) / m_max, e - bias);
    table[b] = (b & 0x80) ? -x : x;
  }
  return table;
}

const float* E4M3Table() {
  static const std::vector<float> table = Fp8Table(7, 3, false);
  return table.data();
}

const float* E5M2Table() {
  static const std::vector<float> table = Fp8Table(15, 2, true);
  return table.data();
}

struct Job {
  const float* q;
  const void *k, *v;     // pages: float32, or fp8 bytes when fp8 is set
  const float* fp8;      // the fp8 format's 256 values; nullptr: float32 pages
  float* out;
  const int32_t *table, *lens;
  int64_t seqs, heads, kv_heads, dim, group, pages, page_size, table_pages, layer_offset;
  int64_t num_decode, window;
  float scale, cap;
  int64_t tasks;
  int64_t chunk;  // tasks claimed at a time
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
};

inline float Dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// The G query heads' scores against NP key rows at once: G * NP independent FMA chains
// (one chain a dot measured latency-bound: ~3x slower at G = 3).
template <int G, int NP>
inline void Scores(const float* qs, const float* const* rows, int64_t d, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[NP][G];
  for (int p = 0; p < NP; ++p)
    for (int g = 0; g < G; ++g) acc[p][g] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 x[NP];
    for (int p = 0; p < NP; ++p) x[p] = _mm256_loadu_ps(rows[p] + i);
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(qs + g * d + i);
      for (int p = 0; p < NP; ++p) acc[p][g] = _mm256_fmadd_ps(qv, x[p], acc[p][g]);
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int g = 0; g < G; ++g) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[p][g]),
                            _mm256_extractf128_ps(acc[p][g], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
      float s = _mm_cvtss_f32(h);
      for (int64_t j = i; j < d; ++j) s += qs[g * d + j] * rows[p][j];
      out[p * G + g] = s;
    }
#else
  for (int p = 0; p < NP; ++p)
    for (int g = 0; g < G; ++g) out[p * G + g] = Dot(qs + g * d, rows[p], d);
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// out[c:c+8V] += sum_i p[i] * rows[i][c:c+8V], held in registers across the rows, even and
// odd rows in separate accumulators: 2V independent FMA chains (one chain a column block
// measured latency-bound: half the kernel's time at head_dim 16).
template <int V>
inline void WeightedColumns(const float* p, const float* const* rows, int64_t n, int64_t c,
                            float* out) {
  __m256 a[2][V];
  for (int k = 0; k < V; ++k) {
    a[0][k] = _mm256_loadu_ps(out + c + 8 * k);
    a[1][k] = _mm256_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 2 <= n; i += 2)
    for (int r = 0; r < 2; ++r) {
      const __m256 w = _mm256_set1_ps(p[i + r]);
      const float* v = rows[i + r] + c;
      for (int k = 0; k < V; ++k) a[r][k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * k), a[r][k]);
    }
  if (i < n) {
    const __m256 w = _mm256_set1_ps(p[i]);
    for (int k = 0; k < V; ++k)
      a[0][k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[i] + c + 8 * k), a[0][k]);
  }
  for (int k = 0; k < V; ++k) _mm256_storeu_ps(out + c + 8 * k, _mm256_add_ps(a[0][k], a[1][k]));
}
#endif

// out[0:d] += sum_i p[i] * rows[i][0:d]
inline void WeightedSum(const float* p, const float* const* rows, int64_t n, int64_t d,
                        float* out) {
  int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 64 <= d; c += 64) WeightedColumns<8>(p, rows, n, c, out);
  switch ((d - c) / 8) {
    case 7: WeightedColumns<7>(p, rows, n, c, out); break;
    case 6: WeightedColumns<6>(p, rows, n, c, out); break;
    case 5: WeightedColumns<5>(p, rows, n, c, out); break;
    case 4: WeightedColumns<4>(p, rows, n, c, out); break;
    case 3: WeightedColumns<3>(p, rows, n, c, out); break;
    case 2: WeightedColumns<2>(p, rows, n, c, out); break;
    case 1: WeightedColumns<1>(p, rows, n, c, out); break;
    default: break;
  }
  c += (d - c) / 8 * 8;
#endif
  for (; c < d; ++c)
    for (int64_t i = 0; i < n; ++i) out[c] += p[i] * rows[i][c];
}

// p[i] = exp(p[i] - max) for i < n; returns their sum. AVX2: exp as 2^k * a degree-6
// polynomial on |r| <= ln 2 / 2 (relative error ~1e-7), scalar std::exp elsewhere.
inline float ExpShifted(float* p, int64_t n, float max) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(max), lo = _mm256_set1_ps(-87.0f);
  const __m256 log2e = _mm256_set1_ps(1.44269504f), ln2_hi = _mm256_set1_ps(0.693145752f),
               ln2_lo = _mm256_set1_ps(1.42860677e-6f);
  const float c[7] = {1.f, 1.f, 0.5f, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
  __m256 total = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), m), lo);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
    __m256 y = _mm256_set1_ps(c[6]);
    for (int t = 5; t >= 0; --t) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c[t]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    _mm256_storeu_ps(p + i, y);
    total = _mm256_add_ps(total, y);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (float x : lanes) sum += x;
#endif
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - max));
  return sum;
}

void Task(const Job& j, int64_t t, std::vector<float>& scratch) {
  const int64_t s = t / j.kv_heads, h = t % j.kv_heads, g_n = j.group, d = j.dim;
  float* out = j.out + (s * j.heads + h * g_n) * d;
  std::fill(out, out + g_n * d, 0.f);
  const int64_t len = s < j.num_decode
      ? std::min<int64_t>(std::max<int32_t>(j.lens[s], 0), j.table_pages * j.page_size) : 0;
  if (len == 0) return;
  const int64_t lo = j.window > 0 ? std::max<int64_t>(len - j.window, 0) : 0;
  scratch.resize(g_n * (d + kBlock + 2) + (j.fp8 ? 2 * kBlock * d : 0));
  float* qs = scratch.data();            // [G, D] scaled queries
  float* sc = qs + g_n * d;              // [G, kBlock] scores, then probabilities
  float* m = sc + g_n * kBlock;          // [G] running max
  float* l = m + g_n;                    // [G] running sum
  float* kf = l + g_n;                   // fp8 pages: [kBlock, D] K rows as floats
  float* vf = kf + kBlock * d;           // and V rows
  for (int64_t g = 0; g < g_n; ++g) {
    const float* qr = j.q + (s * j.heads + h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) qs[g * d + i] = qr[i] * j.scale;
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  const int32_t* table = j.table + s * j.table_pages;
  const int64_t stride = j.kv_heads * d;  // floats between positions of one page
  const float* krows[kBlock + 1];
  const float* vrows[kBlock];
  for (int64_t b0 = lo; b0 < len; b0 += kBlock) {
    const int64_t n = std::min(kBlock, len - b0);
    for (int64_t i = 0; i < n; ++i) {  // this head's K/V rows, fetched ahead of their use
      const int64_t pos = b0 + i;
      const int64_t page = std::clamp<int64_t>(table[pos / j.page_size], 0, j.pages - 1);
      const int64_t offset = j.layer_offset + (page * j.page_size + pos % j.page_size) * stride
                             + h * d;
      if (j.fp8) {  // this block's rows as floats (the table is 1 KiB: it stays in cache)
        const uint8_t* kb = static_cast<const uint8_t*>(j.k) + offset;
        const uint8_t* vb = static_cast<const uint8_t*>(j.v) + offset;
        float* kr = kf + i * d;
        float* vr = vf + i * d;
        for (int64_t c = 0; c < d; ++c) {
          kr[c] = j.fp8[kb[c]];
          vr[c] = j.fp8[vb[c]];
        }
        krows[i] = kr;
        vrows[i] = vr;
        continue;
      }
      krows[i] = static_cast<const float*>(j.k) + offset;
      vrows[i] = static_cast<const float*>(j.v) + offset;
      for (int64_t b = 0; b < d; b += 16) {
        __builtin_prefetch(krows[i] + b);
        __builtin_prefetch(vrows[i] + b);
      }
    }
    krows[n] = krows[n - 1];  // pairs of rows: an odd block's last pair repeats its row
    for (int64_t i = 0; i < n; i += 2) {
      const float* const* rows = krows + i;
      float x[2 * kMaxFast];
      switch (g_n) {  // fixed G: the accumulators stay in registers
        case 1: Scores<1, 2>(qs, rows, d, x); break;
        case 2: Scores<2, 2>(qs, rows, d, x); break;
        case 3: Scores<3, 2>(qs, rows, d, x); break;
        case 4: Scores<4, 2>(qs, rows, d, x); break;
        case 5: Scores<5, 1>(qs, rows, d, x); Scores<5, 1>(qs, rows + 1, d, x + 5); break;
        case 6: Scores<6, 1>(qs, rows, d, x); Scores<6, 1>(qs, rows + 1, d, x + 6); break;
        case 7: Scores<7, 1>(qs, rows, d, x); Scores<7, 1>(qs, rows + 1, d, x + 7); break;
        case 8: Scores<8, 1>(qs, rows, d, x); Scores<8, 1>(qs, rows + 1, d, x + 8); break;
        default: break;
      }
      for (int64_t p = 0; p < 2 && i + p < n; ++p)
        for (int64_t g = 0; g < g_n; ++g) {
          const float y = g_n <= kMaxFast ? x[p * g_n + g] : Dot(qs + g * d, rows[p], d);
          sc[g * kBlock + i + p] = j.cap > 0.f ? j.cap * std::tanh(y / j.cap) : y;
        }
    }
    for (int64_t g = 0; g < g_n; ++g) {
      float* p = sc + g * kBlock;
      const float new_max = std::max(m[g], *std::max_element(p, p + n));
      const float rescale = std::exp(m[g] - new_max);  // 0 on the first block
      l[g] = l[g] * rescale + ExpShifted(p, n, new_max);
      m[g] = new_max;
      for (int64_t i = 0; i < d; ++i) out[g * d + i] *= rescale;
      WeightedSum(p, vrows, n, d, out + g * d);
    }
  }
  for (int64_t g = 0; g < g_n; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] *= inv;
  }
}

void Work(Job& j) {
  std::vector<float> scratch;
  for (int64_t t0; (t0 = j.next.fetch_add(j.chunk, std::memory_order_relaxed)) < j.tasks;) {
    const int64_t t1 = std::min(j.tasks, t0 + j.chunk);
    for (int64_t t = t0; t < t1; ++t) Task(j, t, scratch);
    j.done.fetch_add(t1 - t0, std::memory_order_release);
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
                           ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> num_decode,
                           ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                           int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || td[0] != qd[0] ||
      kd[4] != qd[2] || qd[1] % kd[3] != 0 || v.element_count() != k.element_count() ||
      lens.dimensions().size() != 1 || lens.dimensions()[0] != qd[0])
    return ffi::Error::InvalidArgument("decode_attention: shapes do not match");
  const ffi::DataType kv_type = k.element_type();
  if (v.element_type() != kv_type)
    return ffi::Error::InvalidArgument("decode_attention: K and V pages differ in dtype");
  const float* fp8 = nullptr;
  if (kv_type == ffi::DataType::F8E4M3FN)
    fp8 = E4M3Table();
  else if (kv_type == ffi::DataType::F8E5M2)
    fp8 = E5M2Table();
  else if (kv_type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(
        "decode_attention: pages must be float32, float8_e4m3fn or float8_e5m2");
  auto job = std::make_shared<Job>();
  job->q = q.typed_data();
  job->k = k.untyped_data();
  job->v = v.untyped_data();
  job->fp8 = fp8;
  job->out = out->typed_data();
  job->table = table.typed_data();
  job->lens = lens.typed_data();
  job->seqs = qd[0];
  job->heads = qd[1];
  job->dim = qd[2];
  job->kv_heads = kd[3];
  job->group = qd[1] / kd[3];
  job->pages = kd[1];
  job->page_size = kd[2];
  job->table_pages = td[1];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1);
  job->layer_offset = l * kd[1] * kd[2] * kd[3] * kd[4];
  job->num_decode = std::clamp<int64_t>(num_decode.typed_data()[0], 0, qd[0]);
  job->window = window;
  job->scale = sm_scale;
  job->cap = soft_cap;
  job->tasks = job->seqs * job->kv_heads;
  // As in int8_matmul.cc: the caller works too and waits only for tasks others started.
  // Tasks go in contiguous chunks (one atomic and one output region per chunk, not per
  // task), and a step with little work runs on the caller alone: waking a helper and
  // sharing counters cost more than ~30 us of work (tiny models: 250 us a layer for 128
  // small tasks over two threads, 60 us on one).
  int64_t work = 0;
  for (int64_t s = 0; s < job->num_decode; ++s)
    work += std::clamp<int64_t>(job->lens[s], 0, td[1] * kd[2]);
  work *= job->heads * job->dim;  // multiply-adds of the scores (as many again for values)
  const int64_t threads = work < (int64_t(1) << 18) ? 1 : std::max<int64_t>(1, pool.num_threads());
  job->chunk = std::max<int64_t>(1, job->tasks / (4 * threads));
  const int64_t helpers = std::min<int64_t>(threads, (job->tasks + job->chunk - 1) / job->chunk) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));
