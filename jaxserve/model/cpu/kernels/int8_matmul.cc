// int8 x int8 -> int32 matmul for XLA on the CPU, as an XLA FFI handler:
// out[r, n] = sum_k a[r, k] * w[n, k], with a [R, K] and w [N, K] int8, row-major.
//
// Integer sums are exact, so the result equals XLA's own dot_general bit for bit, whatever
// the order: this is a drop-in for that dot, which XLA hands to YNNPACK, whose call repacks
// the weight matrix every time (jaxserve/model/cpu_int8.py says what was measured). Here the
// weights are read once, as stored, in blocks of rows shared out over XLA's intra-op thread
// pool. Requires a in [-127, 127] (w may be -128). No allocation, no state between calls.
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockBytes = 16384;  // weight bytes of one block of output columns

struct Job {
  const int8_t* a;
  const int8_t* w;
  int32_t* out;
  int64_t rows, k, n, block, num_blocks;
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> done{0};
};

inline int32_t Scalar(const int8_t* a, const int8_t* w, int64_t from, int64_t k) {
  int32_t s = 0;
  for (int64_t i = from; i < k; ++i) s += int32_t(a[i]) * int32_t(w[i]);
  return s;
}

#if defined(__AVX2__)
inline int32_t HorizontalSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// a * w for 32 pairs as int32x8: |w| (unsigned, 128 for -128) times a with w's sign; each
// pair of products fits int16 (2 * 128 * 127 < 32768), so maddubs never saturates.
inline __m256i Products(__m256i abs_w, __m256i w, __m256i a, __m256i ones) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(a, w)), ones);
}
#endif

void Block(const Job& j, int64_t b) {
  const int64_t n0 = b * j.block, n1 = std::min(j.n, n0 + j.block), k = j.k;
  int64_t r = 0;
#if defined(__AVX2__)
  const int64_t k32 = k / 32 * 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (; r + 2 <= j.rows; r += 2) {
    const int8_t* a0 = j.a + r * k;
    const int8_t* a1 = a0 + k;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = j.w + n * k;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int64_t i = 0; i < k32; i += 32) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
        const __m256i aw = _mm256_abs_epi8(wv);
        s0 = _mm256_add_epi32(s0, Products(aw, wv, _mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(a0 + i)), ones));
        s1 = _mm256_add_epi32(s1, Products(aw, wv, _mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(a1 + i)), ones));
      }
      j.out[r * j.n + n] = HorizontalSum(s0) + Scalar(a0, w, k32, k);
      j.out[(r + 1) * j.n + n] = HorizontalSum(s1) + Scalar(a1, w, k32, k);
    }
  }
  for (; r < j.rows; ++r) {
    const int8_t* a0 = j.a + r * k;
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = j.w + n * k;
      __m256i s0 = _mm256_setzero_si256();
      for (int64_t i = 0; i < k32; i += 32) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
        s0 = _mm256_add_epi32(s0, Products(_mm256_abs_epi8(wv), wv, _mm256_loadu_si256(
                                      reinterpret_cast<const __m256i*>(a0 + i)), ones));
      }
      j.out[r * j.n + n] = HorizontalSum(s0) + Scalar(a0, w, k32, k);
    }
  }
#else
  for (; r < j.rows; ++r)
    for (int64_t n = n0; n < n1; ++n) j.out[r * j.n + n] = Scalar(j.a + r * k, j.w + n * k, 0, k);
#endif
}

void Work(Job& j) {
  for (int64_t b; (b = j.next.fetch_add(1, std::memory_order_relaxed)) < j.num_blocks;) {
    Block(j, b);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> a, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<ffi::S32> out) {
  auto ad = a.dimensions(), wd = w.dimensions();
  if (ad.size() != 2 || wd.size() != 2 || ad[1] != wd[1])
    return ffi::Error::InvalidArgument("int8_matmul: a [R, K] and w [N, K] expected");
  auto job = std::make_shared<Job>();
  job->a = a.typed_data();
  job->w = w.typed_data();
  job->out = out->typed_data();
  job->rows = ad[0];
  job->k = ad[1];
  job->n = wd[0];
  job->block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, job->k));
  job->num_blocks = (job->n + job->block - 1) / job->block;
  // The caller works too and only waits for blocks others have started, so a pool that runs
  // none of the helpers (busy, or of one thread) cannot stall it; a helper that starts late
  // finds nothing left and holds the job alive through its own reference.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->num_blocks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->num_blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
