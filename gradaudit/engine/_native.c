/*
 * Single-pass CPU stats kernel: every statistic of a tensor in one read of its bytes.
 *
 * Why this exists: on a CPU, eager PyTorch needs a dozen passes (masks, counts,
 * max, a float64 copy for the sum of squares) and torch.compile a serial float64
 * chain; both are 7-11x a plain sum pass. Reading each element once and keeping
 * every statistic in registers brings a whole audit to about the cost of reading
 * the bytes. This file is plain C99 with no torch headers, so it compiles in a
 * second at install time; when it cannot be built gradaudit falls back to the
 * eager kernel (same numbers, slower).
 *
 * The stats row it writes is the engine's: [nan, +inf, -inf, zeros, max_abs, scale, ssq],
 * sum of squares of the finite elements = scale^2 * ssq (see gradaudit/stats.py).
 *
 * Classification works on the bits (IEEE-754 magnitude order equals unsigned
 * integer order), so NaN tests never depend on compiler floating-point modes.
 * Squares of float32/16/bf16 values are exact in float64 and accumulate there
 * (no overflow possible); float64 input is divided by a power of two above each
 * block's max |x| and blocks merge with the engine's rescaling rule.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bumped whenever the Python side's expectations change: a stale build is ignored. */
#define NATIVE_ABI 6

enum { DT_F32 = 0, DT_F64 = 1, DT_F16 = 2, DT_BF16 = 3, DT_E4M3 = 4, DT_E5M2 = 5 };

/* Elements per inner block: counts fit in uint32 and the block stays in L1. */
#define BLOCK 4096
/* Below this many bytes per thread a second thread costs more than it saves. */
#define MIN_BYTES_PER_THREAD (2u << 20)
#define MAX_THREADS 64

typedef struct {
    uint64_t nan, pos_inf, neg_inf, zeros;
    double max_abs;
    double scale;
    double ssq;
    /* The AVX-512 paths' "the last block held NaN or Inf" (see avx512_f32), kept here so a
     * tensor read in pieces (with histograms, see run_with_histogram) reads as if whole. */
    int special;
} acc_t;

static void acc_init(acc_t *a) {
    memset(a, 0, sizeof(*a));
    a->scale = 1.0;
}

/* The engine's merge rule: counts add, maxima max, ssq rescaled to the larger scale. */
static void acc_merge(acc_t *a, const acc_t *b) {
    a->nan += b->nan;
    a->pos_inf += b->pos_inf;
    a->neg_inf += b->neg_inf;
    a->zeros += b->zeros;
    if (b->max_abs > a->max_abs) a->max_abs = b->max_abs;
    if (!(b->ssq > 0)) return;
    if (!(a->ssq > 0)) {
        a->scale = b->scale;
        a->ssq = b->ssq;
    } else if (b->scale > a->scale) {
        double r = a->scale / b->scale;
        a->ssq = a->ssq * r * r + b->ssq;
        a->scale = b->scale;
    } else {
        double r = b->scale / a->scale;
        a->ssq += b->ssq * r * r;
    }
}

static inline double f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

/* float16 magnitude bits (finite) -> its value, exactly: subnormals are integers
 * times 2**-24, normals rebias their exponent into float32's (+112). */
static inline double half_value(uint32_t m) {
    return m < 0x400u ? (double)m * 0x1p-24 : f32_from_bits((m << 13) + (112u << 23));
}

/* ---- portable path: plain scalar C, the reference for the vector path ------ */

static size_t itemsize(int dtype) {
    switch (dtype) {
        case DT_F64: return 8;
        case DT_F32: return 4;
        case DT_E4M3:
        case DT_E5M2: return 1;
        default: return 2;
    }
}

/* fp8 e4m3fn magnitude bits (finite) -> value: subnormals are integers times
 * 2**-9, normals rebias their exponent into float32's (+120). No infinities. */
static inline double e4m3_value(uint32_t m) {
    return m < 8u ? (double)m * 0x1p-9 : f32_from_bits((m << 20) + (120u << 23));
}

/* The value of a finite magnitude (sign bit cleared) of each format below float64. */
static inline double magnitude_value(int dtype, uint32_t m) {
    switch (dtype) {
        case DT_F32: return f32_from_bits(m);
        case DT_BF16: return f32_from_bits(m << 16);
        case DT_F16: return half_value(m);
        case DT_E5M2: return half_value(m << 8); /* e5m2 is the top byte of a float16 */
        default: return e4m3_value(m);
    }
}

/* The magnitude bits of +Inf of each format below float64 (e4m3fn has no infinity: those of
 * its only non-finite magnitude, NaN); every magnitude above them is NaN. */
static inline uint32_t inf_pattern(int dtype) {
    switch (dtype) {
        case DT_F32: return 0x7f800000u;
        case DT_BF16: return 0x7f80u;
        case DT_F16: return 0x7c00u;
        case DT_E5M2: return 0x7cu;
        default: return 0x7fu;
    }
}

/* The portable loop in the vector extensions of GCC and Clang: 16-byte vectors, which the
 * compiler makes SSE2 on x86-64, NEON on aarch64 and scalar code elsewhere. It is the path a
 * CPU without AVX2 runs (an Arm server or laptop among them) and the one fp8 takes on every
 * CPU. As one scalar loop, each square's addition waited for the last: about four cycles an
 * element, 12x a sum pass on a Zen 5 core. */
typedef int32_t pv_i32 __attribute__((vector_size(16)));
typedef uint32_t pv_u32 __attribute__((vector_size(16)));
typedef float pv_f32 __attribute__((vector_size(16)));
typedef float pv_f32_half __attribute__((vector_size(8)));
typedef double pv_f64 __attribute__((vector_size(16)));

/* Bytes per step: two 16-byte vectors (8 float32, 16 half or 32 fp8 elements). */
#define PORTABLE_STEP_BYTES 32

/* The lane-wise maximum of two vectors of non-negative float32 values: one instruction where
 * the baseline has it (a compare and a blend were a five-cycle chain per vector). */
#if defined(__SSE2__)
#include <emmintrin.h>
#define PORTABLE_MAX(a, b) ((pv_f32)_mm_max_ps((__m128)(a), (__m128)(b)))
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define PORTABLE_MAX(a, b) ((pv_f32)vmaxq_f32((float32x4_t)(a), (float32x4_t)(b)))
#else
static inline pv_f32 portable_max(pv_f32 a, pv_f32 b) {
    pv_i32 above = a > b;
    return (pv_f32)(((pv_i32)a & above) | ((pv_i32)b & ~above));
}
#define PORTABLE_MAX(a, b) portable_max((a), (b))
#endif

/* The values (as float32, exactly) of four finite magnitude patterns of a format below
 * float64, without a branch. A subnormal of a narrow format (exponent field 0) is rebiased
 * one binade higher than a normal is, which makes it 2**e * (1 + f) for the format's
 * smallest normal exponent e; 2**e is then subtracted (exact): 2**e * f, its value. */
static inline __attribute__((always_inline)) pv_f32 portable_values(int dtype, pv_i32 m) {
    if (dtype == DT_F32) return (pv_f32)m;
    if (dtype == DT_BF16) return (pv_f32)(m << 16);
    /* float16 and e5m2 (the top byte of a float16): 10 mantissa bits, rebias 112, e = -14;
     * e4m3fn: 3 mantissa bits, rebias 120, e = -6. */
    const int half = dtype == DT_F16 || dtype == DT_E5M2;
    const pv_i32 h = dtype == DT_E5M2 ? m << 8 : m;
    const pv_i32 subnormal = h < (half ? 0x400 : 8); /* -1 or 0 per lane */
    const pv_i32 bits =
        (h << (half ? 13 : 20)) + ((half ? 112 : 120) << 23) + (subnormal & (1 << 23));
    const pv_i32 least = subnormal & (half ? 0x38800000 : 0x3c800000); /* 2**-14, 2**-6 */
    return (pv_f32)bits - (pv_f32)least;
}

/* The NaN and +-Inf counts of n elements, one by one: for a block that held one. */
static inline __attribute__((always_inline)) void portable_specials(const void *data, size_t n,
                                                                     acc_t *a, int dtype) {
    const int bits = 8 * (int)itemsize(dtype);
    const uint32_t sign = 1u << (bits - 1), abs_mask = sign - 1u, inf_bits = inf_pattern(dtype);
    const int has_inf = dtype != DT_E4M3;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = bits == 32   ? ((const uint32_t *)data)[i]
                     : bits == 16 ? ((const uint16_t *)data)[i]
                                  : ((const uint8_t *)data)[i];
        uint32_t m = b & abs_mask;
        a->nan += has_inf ? m > inf_bits : m == inf_bits;
        if (has_inf) {
            a->pos_inf += b == inf_bits;
            a->neg_inf += b == (inf_bits | sign);
        }
    }
}

/* What a block adds to a row: its zeros, largest value and sum of squares. */
typedef struct {
    int64_t zeros;
    float top;
    double ssq;
} portable_block_t;

/* Four magnitude patterns (in 32-bit lanes) into the lanes. `exact`: NaN and +-Inf read as
 * zeros (their count is the zero count's, taken before); else they go in as they are, and
 * the block's sum or largest value shows them (portable_scan). The largest value is kept as
 * float32 values, not patterns: for magnitudes the order is the same, and a float maximum
 * is one instruction; each 16-byte vector of a step has its own (`ta`, `tb`: two chains). */
#define PORTABLE_FOUR(pattern, sa, sb, tp)                                            \
    do {                                                                              \
        pv_i32 m_ = (pattern);                                                        \
        zeros += m_ == 0;                                                             \
        if (exact) m_ &= m_ < inf_bits;                                               \
        pv_f32 v_ = portable_values(dtype, m_);                                       \
        tp = PORTABLE_MAX(v_, tp);                                                    \
        pv_f32_half low_, high_;                                                      \
        memcpy(&low_, &v_, sizeof low_);                                              \
        memcpy(&high_, (const char *)&v_ + sizeof low_, sizeof high_);                \
        pv_f64 a_ = __builtin_convertvector(low_, pv_f64);                            \
        pv_f64 b_ = __builtin_convertvector(high_, pv_f64);                           \
        sa += a_ * a_;                                                                \
        sb += b_ * b_;                                                                \
    } while (0)

/* One 16-byte vector of elements at `p` into the lanes: the magnitude patterns of its
 * elements in 32-bit lanes (a lane of two half elements gives two patterns, of four fp8
 * four; the order of elements does not matter to a count, a maximum or a sum's lanes). */
#define PORTABLE_VECTOR(p, sa, sb, tp)                                                \
    do {                                                                              \
        pv_u32 w_;                                                                    \
        memcpy(&w_, (p), sizeof w_);                                                  \
        if (size == 4) {                                                              \
            PORTABLE_FOUR((pv_i32)(w_ & 0x7fffffffu), sa, sb, tp);                    \
        } else if (size == 2) {                                                       \
            PORTABLE_FOUR((pv_i32)(w_ & 0x7fffu), sa, sb, tp);                        \
            PORTABLE_FOUR((pv_i32)((w_ >> 16) & 0x7fffu), sa, sb, tp);                \
        } else {                                                                      \
            PORTABLE_FOUR((pv_i32)(w_ & 0x7fu), sa, sb, tp);                          \
            PORTABLE_FOUR((pv_i32)((w_ >> 8) & 0x7fu), sa, sb, tp);                   \
            PORTABLE_FOUR((pv_i32)((w_ >> 16) & 0x7fu), sa, sb, tp);                  \
            PORTABLE_FOUR((pv_i32)((w_ >> 24) & 0x7fu), sa, sb, tp);                  \
        }                                                                             \
    } while (0)

/* The block of `len` (<= BLOCK) elements at `p`: whole steps in place, the rest from a copy
 * padded with zeros (taken off the zero count); the lanes added in a fixed order. */
static inline __attribute__((always_inline)) portable_block_t portable_block(int dtype,
                                                                             const char *p,
                                                                             size_t len,
                                                                             int exact) {
    const size_t size = itemsize(dtype);
    const int32_t inf_bits = (int32_t)inf_pattern(dtype);
    const size_t per_step = PORTABLE_STEP_BYTES / size;
    const size_t whole = len / per_step * per_step;
    pv_i32 zeros = {0, 0, 0, 0};
    pv_f32 ta = {0, 0, 0, 0}, tb = {0, 0, 0, 0};
    pv_f64 s0 = {0, 0}, s1 = {0, 0}, s2 = {0, 0}, s3 = {0, 0};
    for (size_t i = 0; i < whole; i += per_step) {
        const char *at = p + i * size;
        PORTABLE_VECTOR(at, s0, s1, ta);
        PORTABLE_VECTOR(at + 16, s2, s3, tb);
    }
    portable_block_t block = {0, 0.0f, 0.0};
    if (whole < len) {
        char padded[PORTABLE_STEP_BYTES] = {0};
        memcpy(padded, p + whole * size, (len - whole) * size);
        PORTABLE_VECTOR(padded, s0, s1, ta);
        PORTABLE_VECTOR(padded + 16, s2, s3, tb);
        block.zeros = -(int64_t)(whole + per_step - len);
    }
    const pv_f32 top = PORTABLE_MAX(ta, tb);
    const pv_f64 sums = (s0 + s1) + (s2 + s3);
    for (int k = 0; k < 4; k++) { /* lane counts are -1 per zero */
        block.zeros -= zeros[k];
        block.top = top[k] > block.top ? top[k] : block.top;
    }
    block.ssq = sums[0] + sums[1];
    return block;
}
#undef PORTABLE_VECTOR
#undef PORTABLE_FOUR

/* One loop for every format below float64, specialised by the compiler for each constant
 * dtype (the callers below). A format is its width and the bits of +Inf (e4m3fn has none:
 * its only non-finite magnitude, NaN, takes that place). Per BLOCK, the lanes count zeros,
 * keep the largest value and sum squares (four float64 sums of two lanes), with no test for
 * NaN or +-Inf: a block that held one shows it, by a sum that is not finite (float32 and
 * bfloat16, where they are float NaN and infinities) or by a largest value past the
 * format's largest finite one (the narrow formats, whose NaN and infinity patterns read as
 * the next binade up). Such a block is read again with them taken out, and they are
 * counted one by one (a healthy tensor never is). The lanes are then added in a fixed
 * order, the block's sum to the total: rounding error grows with BLOCK + n / BLOCK terms,
 * not n. */
static inline __attribute__((always_inline)) void portable_scan(const void *data, size_t n,
                                                                 acc_t *a, int dtype) {
    const double largest_finite = magnitude_value(dtype, inf_pattern(dtype) - 1u);
    float peak = 0.0f;
    for (size_t start = 0; start < n; start += BLOCK) {
        const size_t len = n - start < BLOCK ? n - start : BLOCK;
        const char *p = (const char *)data + start * itemsize(dtype);
        portable_block_t block = portable_block(dtype, p, len, 0);
        if (!(block.ssq <= 0x1.fffffffffffffp+1023) || block.top > largest_finite) {
            block = portable_block(dtype, p, len, 1);
            portable_specials(p, len, a, dtype);
        }
        a->zeros += (uint64_t)block.zeros;
        a->ssq += block.ssq;
        peak = block.top > peak ? block.top : peak;
    }
    if ((double)peak > a->max_abs) a->max_abs = (double)peak;
}

static void portable_f32(const uint32_t *p, size_t n, acc_t *a) { portable_scan(p, n, a, DT_F32); }

static void portable_16(const uint16_t *p, size_t n, acc_t *a, int bf16) {
    if (bf16)
        portable_scan(p, n, a, DT_BF16);
    else
        portable_scan(p, n, a, DT_F16);
}

static void portable_f8(const uint8_t *p, size_t n, acc_t *a, int e5m2) {
    if (e5m2)
        portable_scan(p, n, a, DT_E5M2);
    else
        portable_scan(p, n, a, DT_E4M3);
}

#define F64_ABS 0x7fffffffffffffffull
#define F64_INF 0x7ff0000000000000ull
#define F64_NINF 0xfff0000000000000ull

/* Counts and the largest finite magnitude (as bits) of one float64 block. */
static uint64_t portable_f64_counts(const uint64_t *p, size_t n, acc_t *a) {
    uint64_t peak = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t b = p[i], m = b & F64_ABS;
        a->nan += m > F64_INF;
        a->pos_inf += b == F64_INF;
        a->neg_inf += b == F64_NINF;
        a->zeros += m == 0;
        if (m < F64_INF && m > peak) peak = m;
    }
    return peak;
}

/* Sum of (x * inverse)^2, or (x / scale)^2 where the inverse is not a normal double. */
static double portable_f64_squares(const uint64_t *p, size_t n, double scale, double inverse,
                                   int invertible) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) {
        uint64_t m = p[i] & F64_ABS;
        if (m < F64_INF) {
            double d;
            memcpy(&d, &m, sizeof d);
            d = invertible ? d * inverse : d / scale;
            s += d * d;
        }
    }
    return s;
}

/* ---- AVX2 path (x86-64 with AVX2, FMA and F16C, chosen at import) ----------
 *
 * Per 8 or 16 elements: a handful of integer compares whose -1 masks are
 * subtracted from lane counters, a lane-wise max of the finite magnitudes, and
 * float64 fused multiply-adds into four independent accumulators. Lane counters
 * are folded every BLOCK elements, before 16-bit lanes could overflow. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* The hardware prefetcher alone left these loops at a third of the memory
 * bandwidth (measured: 4.8 GB/s per thread, 2x faster with this). 2 KiB ahead:
 * on a 2-core Xeon VM, one thread over a 256 MiB tensor, 1 KiB read fp32 at 8.8-11.3
 * GB/s and bf16 at 8.6-10.2, 2 KiB at 10.2-12.4 and 9.9-10.8, 4 KiB no better
 * (variants built side by side, best of 7, interleaved in one process). */
#define PREFETCH(address) _mm_prefetch((const char *)(address) + 2048, _MM_HINT_T0)

typedef struct {
    __m256i nan, inf, ninf, zero, peak;
    __m256d s0, s1, s2, s3;
} lanes_t;

AVX2_INLINE void lanes_init(lanes_t *l) {
    l->nan = l->inf = l->ninf = l->zero = l->peak = _mm256_setzero_si256();
    l->s0 = l->s1 = l->s2 = l->s3 = _mm256_setzero_pd();
}

AVX2_INLINE double hsum_pd(__m256d v) {
    __m128d x = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(x, _mm_unpackhi_pd(x, x)));
}

AVX2_INLINE uint64_t hsum_epi32(__m256i v) {
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, v);
    uint64_t s = 0;
    for (int i = 0; i < 8; i++) s += lanes[i];
    return s;
}

/* 16-bit counters (negative masks summed) -> 32-bit lanes, then a total. */
AVX2_INLINE uint64_t count16(__m256i v) {
    __m256i ones = _mm256_set1_epi16(1);
    /* counters hold -count; madd with -1 would overflow nothing: |lane| <= BLOCK/16 */
    __m256i neg = _mm256_sub_epi16(_mm256_setzero_si256(), v);
    return hsum_epi32(_mm256_madd_epi16(neg, ones));
}

AVX2_INLINE uint64_t count32(__m256i v) {
    return hsum_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), v));
}

/* Add a block's lanes to the accumulator: counters (16-bit lanes for half
 * formats, 32-bit otherwise) hold minus the counts; the peak is a lane-wise max. */
AVX2_INLINE void lanes_fold(const lanes_t *l, acc_t *a, uint32_t *peak, int halves) {
    uint64_t ninf = halves ? count16(l->ninf) : count32(l->ninf);
    a->nan += halves ? count16(l->nan) : count32(l->nan);
    a->pos_inf += (halves ? count16(l->inf) : count32(l->inf)) - ninf;
    a->neg_inf += ninf;
    a->zeros += halves ? count16(l->zero) : count32(l->zero);
    a->ssq += hsum_pd(_mm256_add_pd(_mm256_add_pd(l->s0, l->s1), _mm256_add_pd(l->s2, l->s3)));
    uint32_t top = 0;
    if (halves) {
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i *)lanes, l->peak);
        for (int i = 0; i < 16; i++)
            if (lanes[i] > top) top = lanes[i];
    } else {
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, l->peak);
        for (int i = 0; i < 8; i++)
            if (lanes[i] > top) top = lanes[i];
    }
    if (top > *peak) *peak = top;
}

AVX2_INLINE void square8(lanes_t *l, __m256 v, int which) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    if (which) {
        l->s2 = _mm256_fmadd_pd(lo, lo, l->s2);
        l->s3 = _mm256_fmadd_pd(hi, hi, l->s3);
    } else {
        l->s0 = _mm256_fmadd_pd(lo, lo, l->s0);
        l->s1 = _mm256_fmadd_pd(hi, hi, l->s1);
    }
}

AVX2_INLINE __m256i classify32(lanes_t *l, __m256i b) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    const __m256i ninf = _mm256_set1_epi32((int32_t)0xff800000u);
    __m256i m = _mm256_and_si256(b, abs_mask);
    l->nan = _mm256_add_epi32(l->nan, _mm256_cmpgt_epi32(m, inf));
    l->inf = _mm256_add_epi32(l->inf, _mm256_cmpeq_epi32(m, inf));
    l->ninf = _mm256_add_epi32(l->ninf, _mm256_cmpeq_epi32(b, ninf));
    l->zero = _mm256_add_epi32(l->zero, _mm256_cmpeq_epi32(m, _mm256_setzero_si256()));
    __m256i f = _mm256_and_si256(m, _mm256_cmpgt_epi32(inf, m));
    l->peak = _mm256_max_epi32(l->peak, f);
    return f;
}

AVX2 static void avx2_f32(const uint32_t *x, size_t n, acc_t *a) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    uint32_t peak = 0;
    uint64_t masked = 0;
    size_t done = 0;
    while (done < n) {
        size_t len = n - done < BLOCK ? n - done : BLOCK;
        size_t whole = len & ~(size_t)15;
        const uint32_t *p = x + done;
        lanes_t l;
        lanes_init(&l);
        for (size_t i = 0; i < whole; i += 16) {
            PREFETCH(p + i);
            __m256i f0 = classify32(&l, _mm256_loadu_si256((const __m256i *)(p + i)));
            __m256i f1 = classify32(&l, _mm256_loadu_si256((const __m256i *)(p + i + 8)));
            square8(&l, _mm256_castsi256_ps(f0), 0);
            square8(&l, _mm256_castsi256_ps(f1), 1);
        }
        /* The last 1-15 elements by masked loads, not the scalar loop: with 100,000
         * tensors of a few hundred elements the scalar tails were a fifth of the kernel's
         * time (perf). A masked load reads no byte outside the tensor; the lanes it
         * leaves out read as +0.0, so they count as zeros, taken back below. */
        for (size_t i = whole; i < len; i += 8) {
            size_t k = len - i < 8 ? len - i : 8;
            __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), lane);
            __m256i f = classify32(&l, _mm256_maskload_epi32((const int *)(p + i), mask));
            square8(&l, _mm256_castsi256_ps(f), 0);
            masked += 8 - k;
        }
        lanes_fold(&l, a, &peak, 0);
        done += len;
    }
    a->zeros -= masked;
    double peak_value = f32_from_bits(peak);
    if (peak_value > a->max_abs) a->max_abs = peak_value;
}

/* 16 half-precision words: counts on 16-bit lanes, values widened to float32. */
AVX2 static void avx2_16(const uint16_t *x, size_t n, acc_t *a, int bf16) {
    const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
    const __m256i inf = _mm256_set1_epi16(bf16 ? 0x7f80 : 0x7c00);
    const __m256i ninf = _mm256_set1_epi16((int16_t)(bf16 ? 0xff80u : 0xfc00u));
    const __m256i zero = _mm256_setzero_si256();
    uint32_t peak = 0;
    size_t done = 0;
    while (n - done >= 16) {
        size_t len = (n - done < BLOCK ? n - done : BLOCK) & ~(size_t)15;
        const uint16_t *p = x + done;
        lanes_t l;
        lanes_init(&l);
        for (size_t i = 0; i < len; i += 16) {
            PREFETCH(p + i);
            __m256i b = _mm256_loadu_si256((const __m256i *)(p + i));
            __m256i m = _mm256_and_si256(b, abs_mask);
            l.nan = _mm256_add_epi16(l.nan, _mm256_cmpgt_epi16(m, inf));
            l.inf = _mm256_add_epi16(l.inf, _mm256_cmpeq_epi16(m, inf));
            l.ninf = _mm256_add_epi16(l.ninf, _mm256_cmpeq_epi16(b, ninf));
            l.zero = _mm256_add_epi16(l.zero, _mm256_cmpeq_epi16(m, zero));
            __m256i f = _mm256_and_si256(m, _mm256_cmpgt_epi16(inf, m));
            l.peak = _mm256_max_epi16(l.peak, f);
            __m256 v0, v1;
            if (bf16) {
                /* bf16 bits are the top half of float32 bits; lane order is irrelevant to a sum. */
                v0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, f));
                v1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, f));
            } else {
                v0 = _mm256_cvtph_ps(_mm256_castsi256_si128(f));
                v1 = _mm256_cvtph_ps(_mm256_extracti128_si256(f, 1));
            }
            square8(&l, v0, 0);
            square8(&l, v1, 1);
        }
        lanes_fold(&l, a, &peak, 1);
        done += len;
    }
    double peak_value = bf16 ? f32_from_bits(peak << 16) : half_value(peak);
    if (peak_value > a->max_abs) a->max_abs = peak_value;
    portable_16(x + done, n - done, a, bf16);
}

/* Half formats, the common case first: a block with no NaN or Inf needs only the
 * zero count, the largest magnitude and the squares. One max over every magnitude
 * tells afterwards whether the block was such a block; the rare one that was not
 * is read again by avx2_16's full classification (nothing of the first read kept).
 *
 * Measured why (bf16 on a 2-core Xeon VM): avx2_16 spends 8 lane-shuffle uops per
 * 16 elements (two unpacks, two extracts, four float->double widenings) on one
 * shuffle port, which made bf16 read at 11 GB/s from cache against fp32's 17.
 * Here values are widened from 128-bit loads: bf16 by a shift and a mask (its bits
 * are the top half of float32's; the lane order is irrelevant to a sum), fp16 by
 * F16C from 64-bit loads, so only the four widenings to float64 use that port, and
 * five compares per 16 elements become one. */
AVX2_INLINE void avx2_16_fast(const uint16_t *x, size_t n, acc_t *a, int bf16) {
    const __m256i abs_mask = _mm256_set1_epi16(0x7fff);
    const __m128i top_half = _mm_set1_epi32((int32_t)0xffff0000u);
    const __m256i zero = _mm256_setzero_si256();
    const uint32_t inf_bits = bf16 ? 0x7f80u : 0x7c00u;
    uint32_t peak = 0;
    size_t done = 0;
    while (n - done >= 16) {
        size_t len = (n - done < BLOCK ? n - done : BLOCK) & ~(size_t)15;
        const uint16_t *p = x + done;
        __m256i top = zero, zeros = zero;
        __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
        for (size_t i = 0; i < len; i += 16) {
            PREFETCH(p + i);
            __m256i m = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), abs_mask);
            top = _mm256_max_epu16(top, m);
            zeros = _mm256_add_epi16(zeros, _mm256_cmpeq_epi16(m, zero));
            __m256d v0, v1, v2, v3;
            if (bf16) {
                __m128i lo = _mm_loadu_si128((const __m128i *)(p + i));
                __m128i hi = _mm_loadu_si128((const __m128i *)(p + i + 8));
                v0 = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(lo, 16)));
                v1 = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_and_si128(lo, top_half)));
                v2 = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(hi, 16)));
                v3 = _mm256_cvtps_pd(_mm_castsi128_ps(_mm_and_si128(hi, top_half)));
            } else {
                v0 = _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p + i))));
                v1 = _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p + i + 4))));
                v2 = _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p + i + 8))));
                v3 = _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p + i + 12))));
            }
            s0 = _mm256_fmadd_pd(v0, v0, s0);
            s1 = _mm256_fmadd_pd(v1, v1, s1);
            s2 = _mm256_fmadd_pd(v2, v2, s2);
            s3 = _mm256_fmadd_pd(v3, v3, s3);
        }
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i *)lanes, top);
        uint32_t block_top = 0;
        for (int i = 0; i < 16; i++)
            if (lanes[i] > block_top) block_top = lanes[i];
        if (block_top >= inf_bits) {
            avx2_16(p, len, a, bf16); /* NaN or Inf in this block: classify it in full */
        } else {
            a->zeros += count16(zeros);
            a->ssq += hsum_pd(_mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
            if (block_top > peak) peak = block_top;
        }
        done += len;
    }
    double peak_value = bf16 ? f32_from_bits(peak << 16) : half_value(peak);
    if (peak_value > a->max_abs) a->max_abs = peak_value;
    portable_16(x + done, n - done, a, bf16);
}

AVX2 static void avx2_bf16(const uint16_t *x, size_t n, acc_t *a) { avx2_16_fast(x, n, a, 1); }
AVX2 static void avx2_f16(const uint16_t *x, size_t n, acc_t *a) { avx2_16_fast(x, n, a, 0); }

AVX2 static uint64_t avx2_f64_counts(const uint64_t *p, size_t n, acc_t *a) {
    const __m256i abs_mask = _mm256_set1_epi64x((int64_t)F64_ABS);
    const __m256i inf = _mm256_set1_epi64x((int64_t)F64_INF);
    const __m256i ninf = _mm256_set1_epi64x((int64_t)F64_NINF);
    __m256i nan_c = _mm256_setzero_si256(), inf_c = nan_c, ninf_c = nan_c, zero_c = nan_c;
    __m256i peak = nan_c;
    size_t vec = n & ~(size_t)3;
    for (size_t i = 0; i < vec; i += 4) {
        PREFETCH(p + i);
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i m = _mm256_and_si256(b, abs_mask);
        nan_c = _mm256_sub_epi64(nan_c, _mm256_cmpgt_epi64(m, inf));
        inf_c = _mm256_sub_epi64(inf_c, _mm256_cmpeq_epi64(m, inf));
        ninf_c = _mm256_sub_epi64(ninf_c, _mm256_cmpeq_epi64(b, ninf));
        zero_c = _mm256_sub_epi64(zero_c, _mm256_cmpeq_epi64(m, _mm256_setzero_si256()));
        __m256i f = _mm256_and_si256(m, _mm256_cmpgt_epi64(inf, m));
        peak = _mm256_blendv_epi8(peak, f, _mm256_cmpgt_epi64(f, peak));
    }
    uint64_t lanes[4][5];
    _mm256_storeu_si256((__m256i *)lanes[0], nan_c);
    _mm256_storeu_si256((__m256i *)lanes[1], inf_c);
    _mm256_storeu_si256((__m256i *)lanes[2], ninf_c);
    _mm256_storeu_si256((__m256i *)lanes[3], zero_c);
    uint64_t top[4];
    _mm256_storeu_si256((__m256i *)top, peak);
    uint64_t result = 0;
    for (int i = 0; i < 4; i++) {
        uint64_t ninf_i = lanes[2][i];
        a->nan += lanes[0][i];
        a->pos_inf += lanes[1][i] - ninf_i;
        a->neg_inf += ninf_i;
        a->zeros += lanes[3][i];
        if (top[i] > result) result = top[i];
    }
    uint64_t rest = portable_f64_counts(p + vec, n - vec, a);
    return rest > result ? rest : result;
}

AVX2 static double avx2_f64_squares(const uint64_t *p, size_t n, double scale, double inverse,
                                    int invertible) {
    const __m256i abs_mask = _mm256_set1_epi64x((int64_t)F64_ABS);
    const __m256i inf = _mm256_set1_epi64x((int64_t)F64_INF);
    const __m256d by = _mm256_set1_pd(invertible ? inverse : scale);
    __m256d s0 = _mm256_setzero_pd(), s1 = s0;
    size_t vec = n & ~(size_t)7;
    for (size_t i = 0; i < vec; i += 8) {
        __m256i m0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), abs_mask);
        __m256i m1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i + 4)), abs_mask);
        __m256d d0 = _mm256_castsi256_pd(_mm256_and_si256(m0, _mm256_cmpgt_epi64(inf, m0)));
        __m256d d1 = _mm256_castsi256_pd(_mm256_and_si256(m1, _mm256_cmpgt_epi64(inf, m1)));
        d0 = invertible ? _mm256_mul_pd(d0, by) : _mm256_div_pd(d0, by);
        d1 = invertible ? _mm256_mul_pd(d1, by) : _mm256_div_pd(d1, by);
        s0 = _mm256_fmadd_pd(d0, d0, s0);
        s1 = _mm256_fmadd_pd(d1, d1, s1);
    }
    return hsum_pd(_mm256_add_pd(s0, s1)) +
           portable_f64_squares(p + vec, n - vec, scale, inverse, invertible);
}
#endif

/* ---- AVX-512 path (x86-64 with AVX-512 F/BW/DQ/VL, chosen at import over AVX2) ----
 *
 * Why a third path: on a Zen 5 EPYC the AVX2 path read large fp32/bf16 tensors at
 * 1.5-2x a torch.sum pass (which uses AVX-512 there): its full classification costs
 * about 34 uops per 16 elements, so it was bound by the core, not by memory.
 *
 * Every format below float64 reads a block (BLOCK elements) the common way first: a
 * lane-wise max and min of the magnitudes and the squares, 7 vector uops per 16 float32
 * (the loop is bound by them: from L3 it read 85 GB/s with the zero count in it, 98 without).
 * If the max shows no NaN or Inf the block is done, and only a block whose min is zero has
 * its zeros counted, by a second read from L1. Otherwise the block is read again with the
 * full classification (NaN, +Inf, -Inf and zeros by mask compares; the peak and the squares
 * over the finite lanes only), and nothing of the first read is kept. The last 1-63
 * elements of a block (1-31 words) are left to the full read too: masked loads, which read
 * (and fault on) no byte outside the tensor; their masked-out lanes read as zero and are
 * left out of the zero count by the mask. Both reads give the same stats; only the order
 * of the float64 additions differs between paths, as between the AVX2 and portable ones.
 *
 * Squares are still widened to float64 before they are added: every square of a float32,
 * float16 or bfloat16 value is exact in float64 and their sum cannot overflow there, which
 * is what the engine's norms promise (the error of a float64 sum). The exact float32 ways
 * cost more here, not less: a float16 square is exact in float32 but its sum is not, and
 * a compensated (TwoSum) float32 sum takes 6 more operations per vector where widening
 * takes one conversion and one FMA per 8 elements. */
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 7))
#define HAVE_AVX512 1
#define AVX512_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#define AVX512 __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))
/* 8 KiB ahead, not the AVX2 path's 2 KiB: on a 2-core Zen 5 EPYC VM (one thread, 24
 * tensors of 16 MiB, each variant built side by side and interleaved in one process, best
 * and median of 9 against torch.sum), fp32 read at 1.06-1.20x a sum pass with 2 KiB,
 * 0.92-1.07 with none and 0.95-1.03 with 8 KiB; bf16 and fp16 at 0.93-1.07 with 2 KiB or
 * none and 0.72-0.92 with 8 KiB (torch.sum widens them, so it is slower than memory there). */
#define PREFETCH512(address) _mm_prefetch((const char *)(address) + 8192, _MM_HINT_T0)

/* Squares of 16 float32 values (any sign), widened to float64, into two accumulators. */
AVX512_INLINE void square16(__m512 v, __m512d *a, __m512d *b) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
    *a = _mm512_fmadd_pd(lo, lo, *a);
    *b = _mm512_fmadd_pd(hi, hi, *b);
}

/* Squares of 32 half-precision magnitudes: bf16 bits are the top half of float32 bits
 * (a shift for the even words, a mask for the odd ones; the lane order is irrelevant to a
 * sum), float16 is widened exactly by F16C. */
AVX512_INLINE void square32(__m512i m, int bf16, __m512d *s0, __m512d *s1, __m512d *s2,
                            __m512d *s3) {
    __m512 lo, hi;
    if (bf16) {
        lo = _mm512_castsi512_ps(_mm512_slli_epi32(m, 16));
        hi = _mm512_castsi512_ps(_mm512_and_si512(m, _mm512_set1_epi32((int32_t)0xffff0000u)));
    } else {
        lo = _mm512_cvtph_ps(_mm512_castsi512_si256(m));
        hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(m, 1));
    }
    square16(lo, s0, s1);
    square16(hi, s2, s3);
}

AVX512_INLINE double sum4_pd(__m512d a, __m512d b, __m512d c, __m512d d) {
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a, b), _mm512_add_pd(c, d)));
}

/* Lane counters of 16-bit words (at most BLOCK / 32 each) -> their total. */
AVX512_INLINE uint64_t count16_512(__m512i v) {
    return (uint64_t)(uint32_t)_mm512_reduce_add_epi32(_mm512_madd_epi16(v, _mm512_set1_epi16(1)));
}

AVX512_INLINE uint64_t count32_512(__m512i v) {
    return (uint64_t)(uint32_t)_mm512_reduce_add_epi32(v);
}

/* The largest 16-bit word of a vector. */
AVX512_INLINE uint32_t max16_512(__m512i v) {
    const __m512i low = _mm512_set1_epi32(0xffff);
    return (uint32_t)_mm512_reduce_max_epu32(
        _mm512_max_epu32(_mm512_and_si512(v, low), _mm512_srli_epi32(v, 16)));
}

/* -- float32 -- */

/* 16 elements of the common read: the largest and smallest magnitudes, and the squares
 * widened straight from memory (8 at a time: a widening load needs no shuffle). */
AVX512_INLINE void f32_clean16(const uint32_t *p, __m512i *top, __m512i *low, __m512d *a,
                               __m512d *b) {
    __m512i m = _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(0x7fffffff));
    *top = _mm512_max_epu32(*top, m);
    *low = _mm512_min_epu32(*low, m);
    __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps((const float *)p));
    __m512d hi = _mm512_cvtps_pd(_mm256_loadu_ps((const float *)p + 8));
    *a = _mm512_fmadd_pd(lo, lo, *a);
    *b = _mm512_fmadd_pd(hi, hi, *b);
}

/* The zeros among `n` (a multiple of 16) float32, read again from L1. */
AVX512_INLINE uint64_t f32_zeros(const uint32_t *p, size_t n) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512i zeros = _mm512_setzero_si512();
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 zero = _mm512_testn_epi32_mask(_mm512_loadu_si512(p + i), abs_mask);
        zeros = _mm512_mask_add_epi32(zeros, zero, zeros, _mm512_set1_epi32(1));
    }
    return count32_512(zeros);
}

/* One block of float32 read the common way; 0 (and nothing changed) when it holds NaN or Inf,
 * else 1 + the elements read: the last 1-63 of a block are left to the full read.
 * The common read does not count zeros: a lane-wise min of the magnitudes says whether the
 * block has any, and only then are they counted, from L1. Eight accumulators keep the FMA
 * chains short of their latency even where the loop runs from cache. */
AVX512_INLINE int f32_block_clean(const uint32_t *p, size_t len, acc_t *a, __m512i *peak) {
    __m512i top = _mm512_setzero_si512(), low = _mm512_set1_epi32(-1);
    __m512d s0 = _mm512_setzero_pd(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0,
            s7 = s0;
    size_t whole = len & ~(size_t)63;
    for (size_t i = 0; i < whole; i += 64) {
        PREFETCH512(p + i);
        PREFETCH512(p + i + 16);
        PREFETCH512(p + i + 32);
        PREFETCH512(p + i + 48);
        f32_clean16(p + i, &top, &low, &s0, &s1);
        f32_clean16(p + i + 16, &top, &low, &s2, &s3);
        f32_clean16(p + i + 32, &top, &low, &s4, &s5);
        f32_clean16(p + i + 48, &top, &low, &s6, &s7);
    }
    if (_mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(0x7f800000)) != 0) return 0;
    if (_mm512_testn_epi32_mask(low, low) != 0) a->zeros += f32_zeros(p, whole);
    a->ssq += sum4_pd(_mm512_add_pd(s0, s4), _mm512_add_pd(s1, s5), _mm512_add_pd(s2, s6),
                      _mm512_add_pd(s3, s7));
    *peak = _mm512_max_epu32(*peak, top);
    return (int)whole + 1;
}

/* Lane counters and running values of a full classification (float32: 32-bit lanes,
 * half formats: 16-bit lanes). */
typedef struct {
    __m512i nan, inf, ninf, zero, top;
    __m512d s0, s1, s2, s3;
} full512_t;

AVX512_INLINE void full512_init(full512_t *f, __m512i peak) {
    f->nan = f->inf = f->ninf = f->zero = _mm512_setzero_si512();
    f->top = peak;
    f->s0 = f->s1 = f->s2 = f->s3 = _mm512_setzero_pd();
}

/* 16 float32 of a full read; lanes outside `in` read as +0.0 (masked loads): not NaN, not
 * Inf, and left out of the zeros by the mask. */
AVX512_INLINE void f32_full16(full512_t *f, __m512i b, __mmask16 in, int odd) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i ninf = _mm512_set1_epi32((int32_t)0xff800000u);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i m = _mm512_and_si512(b, abs_mask);
    __mmask16 finite = _mm512_cmplt_epu32_mask(m, inf);
    f->nan = _mm512_mask_add_epi32(f->nan, _mm512_cmpgt_epu32_mask(m, inf), f->nan, one);
    f->inf = _mm512_mask_add_epi32(f->inf, _mm512_cmpeq_epi32_mask(m, inf), f->inf, one);
    f->ninf = _mm512_mask_add_epi32(f->ninf, _mm512_cmpeq_epi32_mask(b, ninf), f->ninf, one);
    f->zero = _mm512_mask_add_epi32(f->zero, _mm512_mask_testn_epi32_mask(in, m, m), f->zero, one);
    f->top = _mm512_mask_max_epu32(f->top, finite, f->top, m);
    __m512 v = _mm512_castsi512_ps(_mm512_maskz_mov_epi32(finite, m));
    if (odd)
        square16(v, &f->s2, &f->s3);
    else
        square16(v, &f->s0, &f->s1);
}

/* One block of float32 classified in full; whether it held NaN or Inf. Plain loads and the
 * prefetch for whole vectors (it may be read straight from memory, see avx512_f32), a
 * masked load for the last 1-15 elements. */
AVX512_INLINE int f32_block_full(const uint32_t *p, size_t len, acc_t *a, __m512i *peak) {
    full512_t f;
    full512_init(&f, *peak);
    size_t whole = len & ~(size_t)31, i = 0;
    for (; i < whole; i += 32) {
        PREFETCH512(p + i);
        PREFETCH512(p + i + 16);
        f32_full16(&f, _mm512_loadu_si512(p + i), 0xffff, 0);
        f32_full16(&f, _mm512_loadu_si512(p + i + 16), 0xffff, 1);
    }
    for (; i < len; i += 16) {
        size_t k = len - i < 16 ? len - i : 16;
        __mmask16 in = (__mmask16)((1u << k) - 1u);
        f32_full16(&f, _mm512_maskz_loadu_epi32(in, p + i), in, 0);
    }
    uint64_t nan_n = count32_512(f.nan), inf_n = count32_512(f.inf), ninf_n = count32_512(f.ninf);
    a->nan += nan_n;
    a->pos_inf += inf_n - ninf_n;
    a->neg_inf += ninf_n;
    a->zeros += count32_512(f.zero);
    a->ssq += sum4_pd(f.s0, f.s1, f.s2, f.s3);
    *peak = f.top;
    return nan_n + inf_n > 0;
}

AVX512 static void avx512_f32(const uint32_t *x, size_t n, acc_t *a) {
    __m512i peak = _mm512_setzero_si512();
    /* After a block with NaN or Inf the next is read in full at once: a tensor full of
     * them (a diverged step) is read once, not twice. */
    int special = a->special;
    for (size_t done = 0; done < n; done += BLOCK) {
        size_t len = n - done < BLOCK ? n - done : BLOCK;
        int clean = special ? 0 : f32_block_clean(x + done, len, a, &peak);
        if (!clean)
            special = f32_block_full(x + done, len, a, &peak);
        else if ((size_t)(clean - 1) < len)
            f32_block_full(x + done + (clean - 1), len - (size_t)(clean - 1), a, &peak);
    }
    a->special = special;
    double peak_value = f32_from_bits((uint32_t)_mm512_reduce_max_epu32(peak));
    if (peak_value > a->max_abs) a->max_abs = peak_value;
}

/* -- float16 and bfloat16: 32 words a vector, counters on 16-bit lanes -- */

AVX512_INLINE __mmask32 words_in(size_t k) {
    return k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << k) - 1u);
}

/* Squares of 16 half-precision words (any sign) read from memory as 256 bits, so that no
 * 512-bit register is split by a shuffle: bf16 widened by a shift (even words) and a mask
 * (odd words; the lane order is irrelevant to a sum), float16 by F16C 8 at a time. */
AVX512_INLINE void square16_words(const uint16_t *p, int bf16, __m512d *a, __m512d *b) {
    __m256 lo, hi;
    if (bf16) {
        __m256i w = _mm256_loadu_si256((const __m256i *)p);
        lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int32_t)0xffff0000u)));
    } else {
        lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    }
    __m512d dlo = _mm512_cvtps_pd(lo), dhi = _mm512_cvtps_pd(hi);
    *a = _mm512_fmadd_pd(dlo, dlo, *a);
    *b = _mm512_fmadd_pd(dhi, dhi, *b);
}

/* The zeros among `n` (a multiple of 32) half-precision words, read again from L1. */
AVX512_INLINE uint64_t half_zeros(const uint16_t *p, size_t n) {
    const __m512i abs_mask = _mm512_set1_epi16(0x7fff);
    __m512i zeros = _mm512_setzero_si512();
    for (size_t i = 0; i < n; i += 32) {
        __mmask32 zero = _mm512_testn_epi16_mask(_mm512_loadu_si512(p + i), abs_mask);
        zeros = _mm512_mask_add_epi16(zeros, zero, zeros, _mm512_set1_epi16(1));
    }
    return count16_512(zeros);
}

/* One block of half words read the common way, as f32_block_clean: 0 when it holds NaN or
 * Inf, else 1 + the words read (the last 1-31 are left to the full read). */
AVX512_INLINE int half_block_clean(const uint16_t *p, size_t len, acc_t *a, __m512i *peak,
                                   int bf16) {
    const __m512i abs_mask = _mm512_set1_epi16(0x7fff);
    __m512i top = _mm512_setzero_si512(), low = _mm512_set1_epi32(-1);
    __m512d s0 = _mm512_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
    size_t whole = len & ~(size_t)31;
    for (size_t i = 0; i < whole; i += 32) {
        PREFETCH512(p + i);
        __m512i m = _mm512_and_si512(_mm512_loadu_si512(p + i), abs_mask);
        top = _mm512_max_epu16(top, m);
        low = _mm512_min_epu16(low, m);
        square16_words(p + i, bf16, &s0, &s1);
        square16_words(p + i + 16, bf16, &s2, &s3);
    }
    const __m512i inf = _mm512_set1_epi16((int16_t)(bf16 ? 0x7f80 : 0x7c00));
    if (_mm512_cmpge_epu16_mask(top, inf) != 0) return 0;
    if (_mm512_testn_epi16_mask(low, low) != 0) a->zeros += half_zeros(p, whole);
    a->ssq += sum4_pd(s0, s1, s2, s3);
    *peak = _mm512_max_epu16(*peak, top);
    return (int)whole + 1;
}

/* 32 half words of a full read, as f32_full16. */
AVX512_INLINE void half_full32(full512_t *f, __m512i b, __mmask32 in, int bf16) {
    const __m512i abs_mask = _mm512_set1_epi16(0x7fff);
    const __m512i inf = _mm512_set1_epi16((int16_t)(bf16 ? 0x7f80 : 0x7c00));
    const __m512i ninf = _mm512_set1_epi16((int16_t)(bf16 ? 0xff80u : 0xfc00u));
    const __m512i one = _mm512_set1_epi16(1);
    __m512i m = _mm512_and_si512(b, abs_mask);
    __mmask32 finite = _mm512_cmplt_epu16_mask(m, inf);
    f->nan = _mm512_mask_add_epi16(f->nan, _mm512_cmpgt_epu16_mask(m, inf), f->nan, one);
    f->inf = _mm512_mask_add_epi16(f->inf, _mm512_cmpeq_epi16_mask(m, inf), f->inf, one);
    f->ninf = _mm512_mask_add_epi16(f->ninf, _mm512_cmpeq_epi16_mask(b, ninf), f->ninf, one);
    f->zero = _mm512_mask_add_epi16(f->zero, _mm512_mask_testn_epi16_mask(in, m, m), f->zero, one);
    f->top = _mm512_mask_max_epu16(f->top, finite, f->top, m);
    square32(_mm512_maskz_mov_epi16(finite, m), bf16, &f->s0, &f->s1, &f->s2, &f->s3);
}

/* One block of half words classified in full, as f32_block_full. */
AVX512_INLINE int half_block_full(const uint16_t *p, size_t len, acc_t *a, __m512i *peak,
                                  int bf16) {
    full512_t f;
    full512_init(&f, *peak);
    size_t whole = len & ~(size_t)31, i = 0;
    for (; i < whole; i += 32) {
        PREFETCH512(p + i);
        half_full32(&f, _mm512_loadu_si512(p + i), 0xffffffffu, bf16);
    }
    if (i < len) {
        __mmask32 in = words_in(len - i);
        half_full32(&f, _mm512_maskz_loadu_epi16(in, p + i), in, bf16);
    }
    uint64_t nan_n = count16_512(f.nan), inf_n = count16_512(f.inf), ninf_n = count16_512(f.ninf);
    a->nan += nan_n;
    a->pos_inf += inf_n - ninf_n;
    a->neg_inf += ninf_n;
    a->zeros += count16_512(f.zero);
    a->ssq += sum4_pd(f.s0, f.s1, f.s2, f.s3);
    *peak = f.top;
    return nan_n + inf_n > 0;
}

AVX512_INLINE void avx512_16(const uint16_t *x, size_t n, acc_t *a, int bf16) {
    __m512i peak = _mm512_setzero_si512();
    int special = a->special; /* as in avx512_f32 */
    for (size_t done = 0; done < n; done += BLOCK) {
        size_t len = n - done < BLOCK ? n - done : BLOCK;
        int clean = special ? 0 : half_block_clean(x + done, len, a, &peak, bf16);
        if (!clean)
            special = half_block_full(x + done, len, a, &peak, bf16);
        else if ((size_t)(clean - 1) < len)
            half_block_full(x + done + (clean - 1), len - (size_t)(clean - 1), a, &peak, bf16);
    }
    a->special = special;
    uint32_t top = max16_512(peak);
    double peak_value = bf16 ? f32_from_bits(top << 16) : half_value(top);
    if (peak_value > a->max_abs) a->max_abs = peak_value;
}

AVX512 static void avx512_bf16(const uint16_t *x, size_t n, acc_t *a) { avx512_16(x, n, a, 1); }
AVX512 static void avx512_f16(const uint16_t *x, size_t n, acc_t *a) { avx512_16(x, n, a, 0); }

/* -- float64 (one block at a time: run_f64 scales each block by its own peak) -- */

AVX512 static uint64_t avx512_f64_counts(const uint64_t *p, size_t n, acc_t *a) {
    const __m512i abs_mask = _mm512_set1_epi64((int64_t)F64_ABS);
    const __m512i inf = _mm512_set1_epi64((int64_t)F64_INF);
    const __m512i ninf = _mm512_set1_epi64((int64_t)F64_NINF);
    const __m512i one = _mm512_set1_epi64(1);
    __m512i nan_c = _mm512_setzero_si512(), inf_c = nan_c, ninf_c = nan_c, zero_c = nan_c;
    __m512i peak = nan_c;
    for (size_t i = 0; i < n; i += 8) {
        size_t k = n - i < 8 ? n - i : 8;
        __mmask8 in = (__mmask8)((1u << k) - 1u);
        PREFETCH512(p + i);
        __m512i b = _mm512_maskz_loadu_epi64(in, p + i);
        __m512i m = _mm512_and_si512(b, abs_mask);
        nan_c = _mm512_mask_add_epi64(nan_c, _mm512_cmpgt_epu64_mask(m, inf), nan_c, one);
        inf_c = _mm512_mask_add_epi64(inf_c, _mm512_cmpeq_epi64_mask(m, inf), inf_c, one);
        ninf_c = _mm512_mask_add_epi64(ninf_c, _mm512_cmpeq_epi64_mask(b, ninf), ninf_c, one);
        zero_c = _mm512_mask_add_epi64(zero_c, _mm512_mask_testn_epi64_mask(in, m, m), zero_c, one);
        peak = _mm512_mask_max_epu64(peak, _mm512_cmplt_epu64_mask(m, inf), peak, m);
    }
    uint64_t ninf_n = (uint64_t)_mm512_reduce_add_epi64(ninf_c);
    a->nan += (uint64_t)_mm512_reduce_add_epi64(nan_c);
    a->pos_inf += (uint64_t)_mm512_reduce_add_epi64(inf_c) - ninf_n;
    a->neg_inf += ninf_n;
    a->zeros += (uint64_t)_mm512_reduce_add_epi64(zero_c);
    return (uint64_t)_mm512_reduce_max_epu64(peak);
}

AVX512 static double avx512_f64_squares(const uint64_t *p, size_t n, double scale, double inverse,
                                        int invertible) {
    const __m512i abs_mask = _mm512_set1_epi64((int64_t)F64_ABS);
    const __m512i inf = _mm512_set1_epi64((int64_t)F64_INF);
    const __m512d by = _mm512_set1_pd(invertible ? inverse : scale);
    __m512d s0 = _mm512_setzero_pd(), s1 = s0;
    for (size_t i = 0; i < n; i += 8) {
        size_t k = n - i < 8 ? n - i : 8;
        __mmask8 in = (__mmask8)((1u << k) - 1u);
        __m512i m = _mm512_and_si512(_mm512_maskz_loadu_epi64(in, p + i), abs_mask);
        __m512d d = _mm512_castsi512_pd(_mm512_maskz_mov_epi64(_mm512_cmplt_epu64_mask(m, inf), m));
        d = invertible ? _mm512_mul_pd(d, by) : _mm512_div_pd(d, by);
        if ((i / 8) & 1)
            s1 = _mm512_fmadd_pd(d, d, s1);
        else
            s0 = _mm512_fmadd_pd(d, d, s0);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}
#endif

/* The kernel's code paths, narrowest first. The widest the CPU has is chosen at import;
 * tests and benchmarks may pick a narrower one (set_path). */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *const isa_names[] = {"portable", "avx2", "avx512"};
static int isa = ISA_PORTABLE;

static void run_f32(const uint32_t *x, size_t n, acc_t *a) {
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) {
        avx512_f32(x, n, a);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) {
        avx2_f32(x, n, a);
        return;
    }
#endif
    portable_f32(x, n, a);
}

static void run_16(const uint16_t *x, size_t n, acc_t *a, int bf16) {
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) {
        if (bf16)
            avx512_bf16(x, n, a);
        else
            avx512_f16(x, n, a);
        return;
    }
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) {
        if (bf16)
            avx2_bf16(x, n, a);
        else
            avx2_f16(x, n, a);
        return;
    }
#endif
    portable_16(x, n, a, bf16);
}

static void run_f16(const uint16_t *x, size_t n, acc_t *a) { run_16(x, n, a, 0); }
static void run_bf16(const uint16_t *x, size_t n, acc_t *a) { run_16(x, n, a, 1); }

/* ---- float64: squares can overflow, so each block is scaled ---------------- */

static uint64_t f64_counts(const uint64_t *p, size_t n, acc_t *a) {
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) return avx512_f64_counts(p, n, a);
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) return avx2_f64_counts(p, n, a);
#endif
    return portable_f64_counts(p, n, a);
}

static double f64_squares(const uint64_t *p, size_t n, double scale, double inverse,
                          int invertible) {
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512) return avx512_f64_squares(p, n, scale, inverse, invertible);
#endif
#ifdef HAVE_AVX2
    if (isa == ISA_AVX2) return avx2_f64_squares(p, n, scale, inverse, invertible);
#endif
    return portable_f64_squares(p, n, scale, inverse, invertible);
}

static void run_f64(const uint64_t *x, size_t n, acc_t *a) {
    for (size_t start = 0; start < n; start += BLOCK) {
        size_t len = n - start < BLOCK ? n - start : BLOCK;
        const uint64_t *p = x + start;
        acc_t block;
        acc_init(&block);
        uint64_t peak = f64_counts(p, len, &block);
        if (peak != 0) {
            double peak_value;
            memcpy(&peak_value, &peak, sizeof peak_value);
            int exponent;
            frexp(peak_value, &exponent);
            /* 2**(e-1): every |x| / scale < 2 and the scale itself stays finite. */
            double scale = ldexp(1.0, exponent - 1);
            /* Multiplying by the inverse is exact when the inverse is a normal double. */
            int invertible = exponent >= -1020;
            double inverse = invertible ? ldexp(1.0, 1 - exponent) : 1.0;
            block.ssq = f64_squares(p, len, scale, inverse, invertible);
            block.max_abs = peak_value;
            block.scale = scale;
        }
        acc_merge(a, &block);
    }
}

/* ---- dispatch and threads -------------------------------------------------- */

static void run(int dtype, const void *data, size_t n, acc_t *a) {
    switch (dtype) {
        case DT_F32: run_f32((const uint32_t *)data, n, a); break;
        case DT_F64: run_f64((const uint64_t *)data, n, a); break;
        case DT_F16: run_f16((const uint16_t *)data, n, a); break;
        case DT_BF16: run_bf16((const uint16_t *)data, n, a); break;
        case DT_E4M3: portable_f8((const uint8_t *)data, n, a, 0); break;
        case DT_E5M2: portable_f8((const uint8_t *)data, n, a, 1); break;
    }
}

/* ---- the exponent histogram (scan --precision), in the same read ----------------------
 *
 * Why here: as a pass of its own (torch's bucketize and index_add_) it cost 13-43x a sum
 * pass. With histograms asked for, each thread reads its part of a tensor in pieces of
 * BLOCK elements: the stats of a piece, then the piece's histogram while its bytes are in
 * L1, so the bytes come from memory once. Pieces are whole blocks from the part's start and
 * acc_t carries the AVX-512 paths' state across them, so the stats row is the one a single
 * call writes, bit for bit. Without histograms nothing here runs.
 *
 * The layout is gradaudit/precision.py's, handed over once (set_layout) as its sorted
 * boundaries, float32 bit patterns of |x|: bin i holds boundaries[i-1] <= bits < boundaries[i]
 * (bin 0 is exact zero, the last bin NaN and Inf: the last boundary is +Inf's bits), the
 * torch.bucketize(right=True) of the reference. Half, bfloat16 and fp8 magnitudes map to
 * their bin through a table of every pattern; a float32 magnitude through a table of its
 * top 15 bits, and by a binary search in the few cells a boundary splits. float64 is
 * rounded to float32 first, as the casts to the narrow formats do; a non-zero double that
 * rounds to zero counts in float32's lowest binade (bits 1). Counts add: across pieces,
 * threads, chunks and files, the one merge rule of every statistic. On the AVX-512 path,
 * float32, bfloat16 and float16 are counted in vector registers instead (the window below);
 * these tables then count only what falls outside the window. */
#define HIST_MAX_BINS 1024
#define HIST_SPLIT 0xffffu
/* Below this many elements a tensor's counts go straight to its row of the output. */
#define HIST_DIRECT 1024

static int hist_bins = 0; /* 0 until set_layout */
static uint32_t hist_bounds[HIST_MAX_BINS];
static uint16_t hist_cells[1 << 15];
static uint16_t hist_f16[1 << 15], hist_bf16[1 << 15], hist_e4m3[128], hist_e5m2[128];

/* The bin of a float32 magnitude: how many boundaries are <= m. */
static uint32_t hist_search(uint32_t m) {
    uint32_t lo = 0, hi = (uint32_t)hist_bins - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (hist_bounds[mid] <= m)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The bin of a magnitude pattern of a format below float32 (its non-finite ones last). */
static uint16_t pattern_bin(int dtype, uint32_t m) {
    if (m >= inf_pattern(dtype)) return (uint16_t)(hist_bins - 1);
    return (uint16_t)hist_search(float_bits((float)magnitude_value(dtype, m)));
}

/* Zero is bin 0 (set_layout takes no boundary at 0), chosen without a branch: its cell,
 * split by the subnormal binades' boundaries, sent every zero to the binary search, and
 * zeros scattered among other values made the split test a coin toss for the predictor
 * (a ReLU gradient's histogram took ~10x a plain one's). */
static inline __attribute__((always_inline)) uint32_t f32_bin(uint32_t m) {
    uint32_t b = hist_cells[m >> 16];
    b &= 0u - (uint32_t)(m != 0);
    return b == HIST_SPLIT ? hist_search(m) : b;
}

static inline __attribute__((always_inline)) uint32_t f64_magnitude(uint64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    uint32_t m = float_bits((float)d) & 0x7fffffffu;
    return m == 0 && (bits & F64_ABS) != 0 ? 1u : m;
}

/* The bin of element i. */
static inline __attribute__((always_inline)) uint32_t element_bin(int dtype, const void *data,
                                                                  size_t i) {
    switch (dtype) {
        case DT_F32: return f32_bin(((const uint32_t *)data)[i] & 0x7fffffffu);
        case DT_F64: return f32_bin(f64_magnitude(((const uint64_t *)data)[i]));
        case DT_F16: return hist_f16[((const uint16_t *)data)[i] & 0x7fffu];
        case DT_BF16: return hist_bf16[((const uint16_t *)data)[i] & 0x7fffu];
        case DT_E4M3: return hist_e4m3[((const uint8_t *)data)[i] & 0x7fu];
        default: return hist_e5m2[((const uint8_t *)data)[i] & 0x7fu];
    }
}

/* Counts of n elements into four interleaved uint32 histograms (`sub`, `stride` apart): an
 * increment does not wait for the previous one to the same bin, which is the common case
 * (most values of a tensor share a few binades). Specialised per constant dtype. */
static inline __attribute__((always_inline)) void hist_piece_of(int dtype, const void *data,
                                                                 size_t n, uint32_t *sub,
                                                                 size_t stride) {
    uint32_t *s0 = sub, *s1 = sub + stride, *s2 = sub + 2 * stride, *s3 = sub + 3 * stride;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint32_t b0 = element_bin(dtype, data, i), b1 = element_bin(dtype, data, i + 1);
        uint32_t b2 = element_bin(dtype, data, i + 2), b3 = element_bin(dtype, data, i + 3);
        s0[b0]++;
        s1[b1]++;
        s2[b2]++;
        s3[b3]++;
    }
    for (; i < n; i++) s0[element_bin(dtype, data, i)]++;
}

static void hist_piece(int dtype, const void *data, size_t n, uint32_t *sub, size_t stride) {
    switch (dtype) {
        case DT_F32: hist_piece_of(DT_F32, data, n, sub, stride); break;
        case DT_F64: hist_piece_of(DT_F64, data, n, sub, stride); break;
        case DT_F16: hist_piece_of(DT_F16, data, n, sub, stride); break;
        case DT_BF16: hist_piece_of(DT_BF16, data, n, sub, stride); break;
        case DT_E4M3: hist_piece_of(DT_E4M3, data, n, sub, stride); break;
        default: hist_piece_of(DT_E5M2, data, n, sub, stride); break;
    }
}

static void hist_fold(uint32_t *sub, size_t stride, uint64_t *out) {
    for (int b = 0; b < hist_bins; b++) {
        out[b] += (uint64_t)sub[b] + sub[stride + b] + sub[2 * stride + b] + sub[3 * stride + b];
        sub[b] = sub[stride + b] = sub[2 * stride + b] = sub[3 * stride + b] = 0;
    }
}

/* ---- the histogram in vector registers (AVX-512: float32, bfloat16, float16) ----------
 *
 * Why: the scalar count above is one table load and one increment per element, ~2 cycles,
 * 4-6x a sum pass on a Zen 5 core. A tensor's values fill a few dozen bins, so here each
 * element becomes a one-hot 32-bit word (its bin's bit among 32 window positions) and the
 * words are added bit-sliced (Harley-Seal carry-save adders, two vpternlogd each): about a
 * dozen vector operations per 16 elements, whatever the bins.
 *
 * The window is 32 positions: consecutive binades (float32 exponent fields lo, lo + 1, ...)
 * from just above the largest value of the block that chose it downwards, each binade as
 * many positions as it has bins (one more per rounding boundary inside it; the position
 * comes out of one table lookup and one addition, see window_word). An element is in the
 * window when its exponent field is; the rest (zeros, values below or above the window,
 * subnormal float32, NaN, Inf) make no bit. Each block checks that the elements it put in
 * the planes (their total, once a block) plus its zeros (the stats row's count of the same
 * elements) are all its elements; when not, a second pass over the block, from L1, counts
 * the others one by one with the scalar path's bins. Positions become bins when the
 * window changes and at the end of the part. bfloat16 and float16 are counted as their
 * float32 values (exact widening), on the same layout; bfloat16 on its own 16-bit words. */
#define WINDOW 32

/* Per float32 exponent field 1..254: the bin of its first value and the boundaries
 * strictly inside it (at most two in gradaudit's layout; a binade with more is never in a
 * window). Filled by set_layout. */
static uint16_t binade_bin[256];
static uint8_t binade_cuts[256];
static uint32_t binade_cut[256][2];

#ifdef HAVE_AVX512
#define WINDOW_GROUP 16 /* one-hot words per Harley-Seal round */
#define WINDOW_PAUSE 15 /* blocks counted by the tables after one mostly outside the window */

typedef struct {
    int lo, binades;      /* lo == 0: no window yet */
    uint32_t pos[WINDOW]; /* each binade's first position (window_flush) */
    /* The vector loops' tables (see window_word), by exponent field mod 32: for float32
     * patterns, float16 values widened to them, bfloat16 words. */
    uint32_t add_f32[WINDOW], add_f16[WINDOW];
    uint16_t add_bf16[WINDOW];
    /* Whether a value of the format can pass the second cut of the window's binade with two
     * cuts (at most one), and what makes it carry: past_second for float32 patterns (float16
     * widened), past_second16 for bfloat16 words. */
    int second_f32, second_f16, second_bf16;
    uint32_t past_second;
    uint16_t past_second16;
} window_t;

/* The least finite float16 magnitude whose value is >= the float32 pattern `cut` (0xffff
 * when none is). Values are monotone in the patterns: a binary search. */
static uint16_t half_threshold(uint32_t cut) {
    if (cut == 0xffffffffu || float_bits((float)half_value(0x7bffu)) < cut) return 0xffffu;
    uint32_t lo = 0, hi = 0x7bffu;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (float_bits((float)half_value(mid)) >= cut)
            hi = mid;
        else
            lo = mid + 1;
    }
    return (uint16_t)lo;
}

/* The window whose top binade is just above `top` (an exponent field 1..254). */
static void window_choose(window_t *w, int top) {
    int hi = top < 254 ? top + 1 : 254, lo = hi, used = 0, twos = 0;
    /* At most one binade with two cuts: window_word passes the second with one addition. */
    while (lo >= 1 && binade_cuts[lo] <= 2 && used + 1 + binade_cuts[lo] <= WINDOW &&
           (binade_cuts[lo] < 2 || !twos)) {
        twos |= binade_cuts[lo] == 2;
        used += 1 + binade_cuts[lo];
        lo--;
    }
    lo++;
    if (lo > hi) lo = hi; /* cannot happen with gradaudit's layout; keeps one binade */
    w->lo = lo;
    w->binades = hi - lo + 1;
    int two = 0; /* the binade with two cuts, 0 when none */
    uint32_t at = 0;
    for (int d = 0; d < WINDOW; d++) {
        int e = lo + d;
        w->pos[d] = d < w->binades ? at : 0;
        if (d >= w->binades) continue;
        if (binade_cuts[e] == 2) two = e;
        at += 1u + binade_cuts[e];
    }
    w->second_f32 = w->second_f16 = w->second_bf16 = 0;
    if (two != 0) {
        uint32_t cut = binade_cut[two][1], end = (uint32_t)(two + 1) << 23;
        uint32_t word = (cut + 0xffffu) >> 16; /* the least bfloat16 word that reaches it */
        uint16_t half = half_threshold(cut);
        w->second_f32 = 1; /* the cut is inside the binade */
        w->second_f16 = half != 0xffffu && float_bits((float)half_value(half)) < end;
        w->second_bf16 = word < ((uint32_t)(two + 1) << 7);
        w->past_second = (1u << 29) - cut;
        w->past_second16 = (uint16_t)(0x8000u - word);
    }
    for (uint32_t r = 0; r < WINDOW; r++) {
        /* The window's binade e with e % 32 == r: its first position P minus e in the
         * exponent's bits, and in the mantissa's the distance from its (first) cut to its
         * end, so that (m + add) >> 23 is P, P + 1 past the cut. Past a second cut every
         * larger value gets one more (window_word), so the binades above it start a
         * position lower. */
        uint32_t d = (r - (uint32_t)lo) % WINDOW, e = (uint32_t)lo + d;
        if ((int)d >= w->binades) { /* no binade of the window: 48 + 32j, never 0..31 */
            w->add_f32[r] = w->add_f16[r] = (48u - r) << 23;
            w->add_bf16[r] = (uint16_t)((48u - r) << 7);
            continue;
        }
        uint32_t cut = binade_cuts[e] >= 1 ? binade_cut[e][0] : 0, p = w->pos[d];
        uint32_t to_end = cut != 0 ? ((e + 1) << 23) - cut : 0;
        uint32_t to_end16 = cut != 0 ? ((e + 1) << 7) - ((cut + 0xffffu) >> 16) : 0;
        uint32_t above = two != 0 && (int)e > two;
        w->add_f32[r] = to_end + ((p - (above & (uint32_t)w->second_f32) - e) << 23);
        w->add_f16[r] = to_end + ((p - (above & (uint32_t)w->second_f16) - e) << 23);
        w->add_bf16[r] = (uint16_t)(to_end16 + ((p - (above & (uint32_t)w->second_bf16) - e) << 7));
    }
}

typedef struct {
    int words;                         /* 16-bit lanes (bfloat16's upper positions), not 32 */
    __m512i ones, twos, fours, eights; /* weights 1, 2, 4, 8 */
    /* weight 16: the adder of two rounds' sixteens, and a round's held for the next one */
    __m512i sixteens, held;
    int holding;
    __m512i q[7];            /* weights 32 .. 2048: a ripple counter of thirty-twos */
    uint64_t counts[WINDOW]; /* what has been resolved, per position */
} planes_t;

/* counts[p] += weight * (lanes of w with bit p set), for the positions any lane has; lanes
 * of 32 bits, or of 16 with `words`. */
AVX512_INLINE void planes_resolve(__m512i w, uint64_t weight, uint64_t *counts, int words) {
    uint32_t bits = (uint32_t)_mm512_reduce_or_epi32(w);
    if (words) bits = (bits | (bits >> 16)) & 0xffffu;
    for (; bits; bits &= bits - 1) {
        int p = __builtin_ctz(bits);
        uint32_t lanes = words ? (uint32_t)_mm512_test_epi16_mask(
                                     w, _mm512_set1_epi16((int16_t)(uint16_t)(1u << p)))
                               : (uint32_t)_mm512_test_epi32_mask(
                                     w, _mm512_set1_epi32((int)(1u << p)));
        counts[p] += weight * (uint64_t)__builtin_popcount(lanes);
    }
}

AVX512 static void planes_init(planes_t *s, int words) {
    s->words = words;
    s->ones = s->twos = s->fours = s->eights = s->sixteens = s->held = _mm512_setzero_si512();
    s->holding = 0;
    for (int k = 0; k < 7; k++) s->q[k] = _mm512_setzero_si512();
    memset(s->counts, 0, sizeof(s->counts));
}

/* Every plane into counts, and the planes cleared. */
AVX512 static void planes_drain(planes_t *s) {
    planes_resolve(s->ones, 1, s->counts, s->words);
    planes_resolve(s->twos, 2, s->counts, s->words);
    planes_resolve(s->fours, 4, s->counts, s->words);
    planes_resolve(s->eights, 8, s->counts, s->words);
    planes_resolve(s->sixteens, 16, s->counts, s->words);
    planes_resolve(s->held, 16, s->counts, s->words);
    for (int k = 0; k < 7; k++) planes_resolve(s->q[k], (uint64_t)32 << k, s->counts, s->words);
    s->ones = s->twos = s->fours = s->eights = s->sixteens = s->held = _mm512_setzero_si512();
    s->holding = 0;
    for (int k = 0; k < 7; k++) s->q[k] = _mm512_setzero_si512();
}

/* Set bits of each 64-bit lane of v (nibble table and byte sums: AVX512F/BW only). */
AVX512_INLINE __m512i popcount_lanes(__m512i v) {
    const __m512i table =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4));
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, nibble));
    __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
    return _mm512_sad_epu8(_mm512_add_epi8(lo, hi), _mm512_setzero_si512());
}

/* Everything the planes and counts hold: the elements counted since the last flush (each
 * in-window element sets one bit of one word). Once a block, instead of an in-window count
 * per vector (a compare and a masked add per 16 elements). */
AVX512 static uint64_t planes_total(const planes_t *s) {
    __m512i sum = popcount_lanes(s->ones);
    sum = _mm512_add_epi64(sum, _mm512_slli_epi64(popcount_lanes(s->twos), 1));
    sum = _mm512_add_epi64(sum, _mm512_slli_epi64(popcount_lanes(s->fours), 2));
    sum = _mm512_add_epi64(sum, _mm512_slli_epi64(popcount_lanes(s->eights), 3));
    sum = _mm512_add_epi64(sum, _mm512_slli_epi64(popcount_lanes(s->sixteens), 4));
    sum = _mm512_add_epi64(sum, _mm512_slli_epi64(popcount_lanes(s->held), 4));
    for (int k = 0; k < 7; k++)
        sum = _mm512_add_epi64(sum, _mm512_slli_epi64(popcount_lanes(s->q[k]), 5 + k));
    uint64_t total = (uint64_t)_mm512_reduce_add_epi64(sum);
    for (int p = 0; p < WINDOW; p++) total += s->counts[p];
    return total;
}

/* The window's counts into the part's bins, and the counts cleared; `upper` holds
 * positions 16..31 of bfloat16's words. */
static void window_flush(const window_t *w, planes_t *s, planes_t *upper, uint64_t *out) {
    planes_drain(s);
    planes_drain(upper);
    for (int p = 0; p < 16; p++) s->counts[p + 16] += upper->counts[p];
    memset(upper->counts, 0, sizeof(upper->counts));
    for (int d = 0; d < w->binades; d++) {
        int e = w->lo + d;
        for (int j = 0; j <= binade_cuts[e]; j++) out[binade_bin[e] + j] += s->counts[w->pos[d] + j];
    }
    memset(s->counts, 0, sizeof(s->counts));
}

/* Carry-save adder: h:l = a + b + c, bit by bit. */
#define CSA(h, l, a, b, c)                                  \
    do {                                                    \
        __m512i a_ = (a), b_ = (b), c_ = (c);               \
        h = _mm512_ternarylogic_epi32(a_, b_, c_, 0xe8);    \
        l = _mm512_ternarylogic_epi32(a_, b_, c_, 0x96);    \
    } while (0)

/* The sixteens of a Harley-Seal round: every second round's, with the one held from the
 * round before, through one more adder and into the ripple counter (its 14 operations once
 * per 32 words, not 16: ~0.5 an element); what carries out of its top (weight 4096,
 * rare) is resolved at once. */
AVX512_INLINE void planes_carry(planes_t *s, __m512i sixteens) {
    if (!s->holding) {
        s->held = sixteens;
        s->holding = 1;
        return;
    }
    __m512i c, t;
    CSA(c, s->sixteens, s->sixteens, s->held, sixteens);
    s->held = _mm512_setzero_si512();
    s->holding = 0;
#pragma GCC unroll 7
    for (int k = 0; k < 7; k++) {
        t = _mm512_and_si512(s->q[k], c);
        s->q[k] = _mm512_xor_si512(s->q[k], c);
        c = t;
    }
    if (_mm512_test_epi32_mask(c, c) != 0) planes_resolve(c, 4096, s->counts, s->words);
}

/* The window's tables in registers, for float32 or float16. */
typedef struct {
    __m512i add0, add1, past;
} window_regs_t;

AVX512_INLINE void window_regs(const window_t *w, int dtype, window_regs_t *r) {
    const uint32_t *add = dtype == DT_F16 ? w->add_f16 : w->add_f32;
    r->add0 = _mm512_loadu_si512(add);
    r->add1 = _mm512_loadu_si512(add + 16);
    r->past = _mm512_set1_epi32((int)w->past_second);
}

/* The one-hot word of 16 float32 patterns (any sign): no bit outside the window.
 *
 * The position comes out of one addition: the table entry, looked up by the exponent field
 * mod 32 (vpermt2d reads an index's low 5 bits), holds the binade's first position minus
 * its exponent field in the exponent's bits and, in the mantissa's, the distance from the
 * binade's cut to its end. (m + add) >> 23 is then the position, one more when the mantissa
 * carried (m has passed the cut), mod 512. An element of another binade with the same field
 * mod 32 lands 32k (k = +-1..7) away, of a binade outside the window at 48 + 32j: both 32
 * or more, and a variable shift of 32 or more makes 0, no bit. Zeros, subnormals (field 0),
 * NaN and Inf (255) are such elements. With `second`, the shifted bit is 2, not 1, for the
 * window's values past the second cut: (m + 2**29 - cut) >> 28 is 1 below it, 2 above, for
 * every m within 2**28 of the cut (32 binades). The looked-up position and a compare per
 * cut, each a compare and a masked add (the previous form), took 12-15 operations for 5-7. */
AVX512_INLINE __m512i window_word(__m512i b, const window_regs_t *r, int second) {
    __m512i m = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    __m512i e = _mm512_srli_epi32(b, 23); /* the sign lands in bit 8: not in the index */
    __m512i add = _mm512_permutex2var_epi32(r->add0, e, r->add1);
    __m512i pos = _mm512_srli_epi32(_mm512_add_epi32(m, add), 23);
    __m512i bit = _mm512_set1_epi32(1);
    if (second) bit = _mm512_srli_epi32(_mm512_add_epi32(m, r->past), 28);
    return _mm512_sllv_epi32(bit, pos);
}

/* Vector k (0..15) of 16 float32 patterns of the 256 elements at `p`; `left` elements are
 * there (lanes past them read +0.0: masked loads read no byte outside the tensor).
 * bfloat16 words become float32 by a shift (even words) and a mask (odd words): vectors
 * 2j and 2j+1 come from the same 32 words, in another lane order (a count has none). */
AVX512_INLINE __m512i window_load(int dtype, const void *p, int k, size_t left) {
    if (dtype == DT_F32) {
        const uint32_t *x = (const uint32_t *)p + 16 * k;
        size_t at = 16 * (size_t)k;
        if (left >= at + 16) return _mm512_loadu_si512(x);
        __mmask16 in = left > at ? (__mmask16)((1u << (left - at)) - 1u) : 0;
        return _mm512_maskz_loadu_epi32(in, x);
    }
    if (dtype == DT_F16) {
        const uint16_t *x = (const uint16_t *)p + 16 * k;
        size_t at = 16 * (size_t)k;
        __m256i h;
        if (left >= at + 16)
            h = _mm256_loadu_si256((const __m256i *)x);
        else
            h = _mm256_maskz_loadu_epi16(left > at ? (__mmask16)((1u << (left - at)) - 1u) : 0, x);
        return _mm512_castps_si512(_mm512_cvtph_ps(h));
    }
    const uint16_t *x = (const uint16_t *)p + 32 * (k / 2);
    size_t at = 32 * (size_t)(k / 2);
    __m512i w;
    if (left >= at + 32)
        w = _mm512_loadu_si512(x);
    else
        w = _mm512_maskz_loadu_epi16(left > at ? words_in(left - at) : 0, x);
    return k % 2 == 0 ? _mm512_slli_epi32(w, 16)
                      : _mm512_and_si512(w, _mm512_set1_epi32((int32_t)0xffff0000u));
}

/* The one-hot words of the 256 elements at `p` (`left` of them there, all when `full`) into
 * the planes, two words at a time into the carry-save adders (the 16 words of a round are
 * never all live: they would not fit in the registers with the tables); the adders' low
 * planes are `s` (locals), the ripple counter and the counts `home`'s. */
AVX512_INLINE void window_group(int dtype, const char *p, size_t left, int full,
                                const window_regs_t *r, int second, planes_t *s,
                                planes_t *home) {
    const size_t there = full ? 16 * WINDOW_GROUP : left;
    __m512i twosA, twosB, foursA, foursB, eightsA, eightsB, sixteens;
#define WORDS(a, b, k)                                                        \
    do {                                                                      \
        a = window_word(window_load(dtype, p, k, there), r, second);          \
        b = window_word(window_load(dtype, p, k + 1, there), r, second);      \
    } while (0)
    __m512i a, b;
    WORDS(a, b, 0);
    CSA(twosA, s->ones, s->ones, a, b);
    WORDS(a, b, 2);
    CSA(twosB, s->ones, s->ones, a, b);
    CSA(foursA, s->twos, s->twos, twosA, twosB);
    WORDS(a, b, 4);
    CSA(twosA, s->ones, s->ones, a, b);
    WORDS(a, b, 6);
    CSA(twosB, s->ones, s->ones, a, b);
    CSA(foursB, s->twos, s->twos, twosA, twosB);
    CSA(eightsA, s->fours, s->fours, foursA, foursB);
    WORDS(a, b, 8);
    CSA(twosA, s->ones, s->ones, a, b);
    WORDS(a, b, 10);
    CSA(twosB, s->ones, s->ones, a, b);
    CSA(foursA, s->twos, s->twos, twosA, twosB);
    WORDS(a, b, 12);
    CSA(twosA, s->ones, s->ones, a, b);
    WORDS(a, b, 14);
    CSA(twosB, s->ones, s->ones, a, b);
    CSA(foursB, s->twos, s->twos, twosA, twosB);
    CSA(eightsB, s->fours, s->fours, foursA, foursB);
    CSA(sixteens, s->eights, s->eights, eightsA, eightsB);
#undef WORDS
    planes_carry(home, sixteens);
}

/* The in-window elements of n (<= BLOCK) at `data` into the planes. */
AVX512_INLINE void window_block_of(int dtype, const void *data, size_t n, const window_t *w,
                                   planes_t *s, int second) {
    window_regs_t r;
    window_regs(w, dtype, &r);
    const size_t size = dtype == DT_F32 ? 4 : 2;
    /* The adders' planes in locals for the block: through `s` they were stored every round. */
    planes_t *home = s, local;
    local.ones = home->ones, local.twos = home->twos, local.fours = home->fours,
    local.eights = home->eights;
    s = &local;
    size_t i = 0;
    for (; i + 16 * WINDOW_GROUP <= n; i += 16 * WINDOW_GROUP) {
        const char *p = (const char *)data + i * size;
        /* Ahead of the stats read of the next block: memory keeps streaming meanwhile. */
#ifndef NO_WINDOW_PREFETCH
        for (size_t line = 0; line < 16 * WINDOW_GROUP * size; line += 64)
            _mm_prefetch(p + BLOCK * size + 8192 + line, _MM_HINT_T0);
#endif
        window_group(dtype, p, 0, 1, &r, second, s, home);
    }
    if (i < n) window_group(dtype, (const char *)data + i * size, n - i, 0, &r, second, s, home);
    home->ones = local.ones, home->twos = local.twos, home->fours = local.fours,
    home->eights = local.eights;
}

AVX512 static void window_block(int dtype, const void *data, size_t n, const window_t *w,
                                planes_t *s) {
    switch (dtype * 2 + (dtype == DT_F16 ? w->second_f16 : w->second_f32)) {
        case DT_F32 * 2: window_block_of(DT_F32, data, n, w, s, 0); break;
        case DT_F32 * 2 + 1: window_block_of(DT_F32, data, n, w, s, 1); break;
        case DT_F16 * 2: window_block_of(DT_F16, data, n, w, s, 0); break;
        case DT_F16 * 2 + 1: window_block_of(DT_F16, data, n, w, s, 1); break;
        case DT_BF16 * 2: window_block_of(DT_BF16, data, n, w, s, 0); break;
        default: window_block_of(DT_BF16, data, n, w, s, 1); break;
    }
}

/* bfloat16 on 16-bit lanes: 32 elements a vector, fewer operations than widening them.
 * The 32 positions do not fit a 16-bit lane, so each vector makes two one-hot words, one
 * for positions 0..15 (`s`) and one for 16..31 (`upper`), each with its own adders. The
 * position is window_word's, on bfloat16's own bits (exponent at bit 7, 9 bits above it
 * as in float32): a shift of 16 or more makes 0 in a 16-bit lane, so pos gives the low
 * word and pos ^ 16 the high one (0..15 become 16..31, 32 and more stay so). float16 is
 * counted as float32 (window_load widens it exactly): its cuts need all 10 mantissa bits,
 * which the upper half of a float32 pattern does not hold. */
typedef struct {
    __m512i add, past;
} window_regs16_t;

AVX512_INLINE void window_words16(__m512i v, const window_regs16_t *r, int second,
                                  __m512i *low, __m512i *high) {
    const __m512i one = _mm512_set1_epi16(1);
    __m512i m = _mm512_and_si512(v, _mm512_set1_epi16(0x7fff));
    __m512i e = _mm512_srli_epi16(v, 7);
    __m512i pos = _mm512_srli_epi16(_mm512_add_epi16(m, _mm512_permutexvar_epi16(e, r->add)), 7);
    /* Past the second cut one more (a shifted 2 would lose position 16 between the words). */
    if (second) pos = _mm512_add_epi16(pos, _mm512_srli_epi16(_mm512_add_epi16(m, r->past), 15));
    *low = _mm512_sllv_epi16(one, pos);
    *high = _mm512_sllv_epi16(one, _mm512_xor_si512(pos, _mm512_set1_epi16(16)));
}

/* 512 words at `p` (`left` of them there): each vector's two words go to the two adder
 * sets; the rounds of both are interleaved by making the 16 vectors' words in pairs. */
AVX512_INLINE void window_group16(const uint16_t *p, size_t left, int full,
                                  const window_regs16_t *r, int second, planes_t *lo_set,
                                  planes_t *hi_set, planes_t *lo_home, planes_t *hi_home) {
    const size_t there = full ? 512 : left;
    __m512i la, lb, ha, hb, lo_sixteens, hi_sixteens;
    __m512i lo_twosA, lo_twosB, lo_foursA, lo_foursB, lo_eightsA, lo_eightsB;
    __m512i hi_twosA, hi_twosB, hi_foursA, hi_foursB, hi_eightsA, hi_eightsB;
#define LOAD16(k)                                                                         \
    (there >= 32 * (size_t)(k) + 32                                                       \
         ? _mm512_loadu_si512(p + 32 * (k))                                               \
         : _mm512_maskz_loadu_epi16(there > 32 * (size_t)(k) ? words_in(there - 32 * (size_t)(k)) : 0, \
                                    p + 32 * (k)))
#define PAIR(k)                                                                   \
    do {                                                                          \
        window_words16(LOAD16(k), r, second, &la, &ha);                           \
        window_words16(LOAD16(k + 1), r, second, &lb, &hb);                       \
    } while (0)
#define STEP(k, T)                                                                \
    do {                                                                          \
        PAIR(k);                                                                  \
        CSA(lo_##T, lo_set->ones, lo_set->ones, la, lb);                          \
        CSA(hi_##T, hi_set->ones, hi_set->ones, ha, hb);                          \
    } while (0)
#define BOTH(H, L, A, B, LEVEL)                                                   \
    do {                                                                          \
        CSA(lo_##H, lo_set->LEVEL, lo_set->LEVEL, lo_##A, lo_##B);                \
        CSA(hi_##H, hi_set->LEVEL, hi_set->LEVEL, hi_##A, hi_##B);                \
    } while (0)
    STEP(0, twosA);
    STEP(2, twosB);
    BOTH(foursA, twos, twosA, twosB, twos);
    STEP(4, twosA);
    STEP(6, twosB);
    BOTH(foursB, twos, twosA, twosB, twos);
    BOTH(eightsA, fours, foursA, foursB, fours);
    STEP(8, twosA);
    STEP(10, twosB);
    BOTH(foursA, twos, twosA, twosB, twos);
    STEP(12, twosA);
    STEP(14, twosB);
    BOTH(foursB, twos, twosA, twosB, twos);
    BOTH(eightsB, fours, foursA, foursB, fours);
    BOTH(sixteens, eights, eightsA, eightsB, eights);
#undef LOAD16
#undef PAIR
#undef STEP
#undef BOTH
    planes_carry(lo_home, lo_sixteens);
    planes_carry(hi_home, hi_sixteens);
}

/* As window_block, for bfloat16 on 16-bit lanes. */
AVX512_INLINE void window_block16_of(const uint16_t *x, size_t n, const window_t *w,
                                     planes_t *s, planes_t *upper, int second) {
    window_regs16_t r;
    r.add = _mm512_loadu_si512(w->add_bf16);
    r.past = _mm512_set1_epi16((int16_t)w->past_second16);
    planes_t lo_set, hi_set;
    lo_set.ones = s->ones, lo_set.twos = s->twos, lo_set.fours = s->fours, lo_set.eights = s->eights;
    hi_set.ones = upper->ones, hi_set.twos = upper->twos, hi_set.fours = upper->fours,
    hi_set.eights = upper->eights;
    size_t i = 0;
    for (; i + 512 <= n; i += 512) {
        for (size_t line = 0; line < 1024; line += 64)
            _mm_prefetch((const char *)(x + i) + 2 * BLOCK + 8192 + line, _MM_HINT_T0);
        window_group16(x + i, 0, 1, &r, second, &lo_set, &hi_set, s, upper);
    }
    if (i < n) window_group16(x + i, n - i, 0, &r, second, &lo_set, &hi_set, s, upper);
    s->ones = lo_set.ones, s->twos = lo_set.twos, s->fours = lo_set.fours, s->eights = lo_set.eights;
    upper->ones = hi_set.ones, upper->twos = hi_set.twos, upper->fours = hi_set.fours,
    upper->eights = hi_set.eights;
}

AVX512 static void window_block_16(const void *data, size_t n, const window_t *w,
                                   planes_t *s, planes_t *upper) {
    const uint16_t *x = (const uint16_t *)data;
    if (w->second_bf16)
        window_block16_of(x, n, w, s, upper, 1);
    else
        window_block16_of(x, n, w, s, upper, 0);
}

/* The elements of a block outside the window (zeros aside), counted one by one into `out`;
 * returns how many. */
AVX512 static size_t window_rest(int dtype, const void *data, size_t n, const window_t *w,
                                 uint64_t *out) {
    const __m512i lo = _mm512_set1_epi32(w->lo), binades = _mm512_set1_epi32(w->binades);
    const size_t size = dtype == DT_F32 ? 4 : 2;
    size_t rest = 0;
    for (size_t i = 0; i < n; i += 16 * WINDOW_GROUP) {
        const char *p = (const char *)data + i * size;
        for (int k = 0; k < WINDOW_GROUP; k++) {
            __m512i m = _mm512_and_si512(window_load(dtype, p, k, n - i),
                                         _mm512_set1_epi32(0x7fffffff));
            __m512i d = _mm512_sub_epi32(_mm512_srli_epi32(m, 23), lo);
            __mmask16 outside = _mm512_mask_cmpge_epu32_mask(_mm512_test_epi32_mask(m, m), d,
                                                             binades);
            if (outside == 0) continue;
            uint32_t lanes[16];
            _mm512_storeu_si512(lanes, m);
            for (unsigned bits = outside; bits; bits &= bits - 1) {
                out[f32_bin(lanes[__builtin_ctz(bits)])]++;
                rest++;
            }
        }
    }
    return rest;
}

/* The largest exponent field of a block's finite values (0 when it has none but zeros
 * and subnormals). */
AVX512 static int window_top(int dtype, const void *data, size_t n) {
    __m512i top = _mm512_setzero_si512();
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const size_t size = dtype == DT_F32 ? 4 : 2;
    for (size_t i = 0; i < n; i += 16 * WINDOW_GROUP) {
        const char *p = (const char *)data + i * size;
        for (int k = 0; k < WINDOW_GROUP; k++) {
            __m512i m = _mm512_and_si512(window_load(dtype, p, k, n - i),
                                         _mm512_set1_epi32(0x7fffffff));
            top = _mm512_mask_max_epu32(top, _mm512_cmplt_epu32_mask(m, inf), top, m);
        }
    }
    return (int)(_mm512_reduce_max_epu32(top) >> 23);
}

/* run() and the histogram, as run_with_histogram, with the histogram in vector registers. */
AVX512 static void avx512_run_with_histogram(int dtype, const void *data, size_t n, acc_t *a,
                                             uint64_t *out) {
    const size_t size = itemsize(dtype);
    window_t w;
    memset(&w, 0, sizeof w); /* no window yet (lo 0): every element is outside */
    planes_t s, upper;
    planes_init(&s, dtype == DT_BF16);
    planes_init(&upper, 1);
    /* Values spread wider than any window (random bits, a log-normal of huge variance) make
     * the window pass plus the one-by-one pass ~3x the table count alone: after a block
     * mostly outside, the next WINDOW_PAUSE blocks are counted by the tables, then the
     * window is tried again. */
    uint32_t sub[4 * HIST_MAX_BINS];
    const size_t stride = HIST_MAX_BINS;
    size_t since_fold = 0, paused = 0;
    int sub_used = 0;
    uint64_t in_planes = 0; /* planes_total after the last block counted in the window */
    for (size_t done = 0; done < n; done += BLOCK) {
        size_t len = n - done < BLOCK ? n - done : BLOCK;
        const char *piece = (const char *)data + done * size;
        uint64_t zeros = a->zeros;
        run(dtype, piece, len, a);
        zeros = a->zeros - zeros;
        if (paused > 0) {
            paused--;
            if (!sub_used) {
                for (int k = 0; k < 4; k++)
                    memset(sub + k * stride, 0, sizeof(uint32_t) * (size_t)hist_bins);
                sub_used = 1;
            }
            hist_piece(dtype, piece, len, sub, stride);
            since_fold += len;
            if (since_fold >= ((size_t)1 << 31)) { /* before a uint32 count could wrap */
                hist_fold(sub, stride, out);
                since_fold = 0;
            }
            continue;
        }
        out[0] += zeros;
        if (w.lo == 0) {
            /* The part's first block (or the first after blocks of nothing but zeros,
             * subnormals, NaN and Inf): a window around its largest before it is counted.
             * Counted with no window, the block was all outside and paused the next
             * WINDOW_PAUSE blocks: a tensor of up to 16 blocks (64 Ki elements, most of a
             * model's gradients) never reached the window. */
            int first_top = window_top(dtype, piece, len);
            if (first_top != 0) window_choose(&w, first_top);
        }
        size_t counted = 0;
        if (w.lo != 0) {
            if (dtype == DT_BF16)
                window_block_16(piece, len, &w, &s, &upper);
            else
                window_block(dtype, piece, len, &w, &s);
            uint64_t total = planes_total(&s) + (dtype == DT_BF16 ? planes_total(&upper) : 0);
            counted = (size_t)(total - in_planes);
            in_planes = total;
        }
        if (counted + zeros == len) continue;
        size_t rest = window_rest(dtype, piece, len, &w, out);
        if (rest > len / 4) paused = WINDOW_PAUSE;
        /* Many outside (or no window yet): the values moved, and the next blocks get a
         * window around this one's largest. Few outside: the tail of a distribution. */
        if (w.lo != 0 && rest <= len / 64) continue;
        int top = window_top(dtype, piece, len);
        if (top == 0) continue; /* nothing but zeros, subnormals, NaN and Inf */
        window_t next;
        window_choose(&next, top);
        if (next.lo == w.lo) continue;
        if (w.lo != 0) window_flush(&w, &s, &upper, out);
        in_planes = 0;
        w = next;
    }
    if (w.lo != 0) window_flush(&w, &s, &upper, out);
    if (sub_used) hist_fold(sub, stride, out);
}
#endif

/* run() and the histogram of the same elements, added to `out` (hist_bins counts). */
static void run_with_histogram(int dtype, const void *data, size_t n, acc_t *a, uint64_t *out) {
    const size_t size = itemsize(dtype);
    if (n < HIST_DIRECT) {
        run(dtype, data, n, a);
        for (size_t i = 0; i < n; i++) out[element_bin(dtype, data, i)]++;
        return;
    }
#ifdef HAVE_AVX512
    if (isa == ISA_AVX512 && (dtype == DT_F32 || dtype == DT_F16 || dtype == DT_BF16)) {
        avx512_run_with_histogram(dtype, data, n, a, out);
        return;
    }
#endif
    uint32_t sub[4 * HIST_MAX_BINS];
    const size_t stride = HIST_MAX_BINS;
    for (int k = 0; k < 4; k++) memset(sub + k * stride, 0, sizeof(uint32_t) * (size_t)hist_bins);
    size_t since_fold = 0;
    for (size_t done = 0; done < n; done += BLOCK) {
        size_t len = n - done < BLOCK ? n - done : BLOCK;
        const char *piece = (const char *)data + done * size;
        run(dtype, piece, len, a);
        hist_piece(dtype, piece, len, sub, stride);
        since_fold += len;
        if (since_fold >= ((size_t)1 << 31)) { /* before a uint32 count could wrap */
            hist_fold(sub, stride, out);
            since_fold = 0;
        }
    }
    hist_fold(sub, stride, out);
}

static void write_row(const acc_t *a, double *row) {
    row[0] = (double)a->nan;
    row[1] = (double)a->pos_inf;
    row[2] = (double)a->neg_inf;
    row[3] = (double)a->zeros;
    row[4] = a->max_abs;
    row[5] = a->ssq > 0 ? a->scale : 1.0;
    row[6] = a->ssq;
}

/* ---- many tensors, split over threads by bytes ----------------------------
 *
 * Thread j reduces bytes [total*j/k, total*(j+1)/k) of the tensors laid end to
 * end, so a large tensor is shared between threads and a run of small ones is
 * not one thread launch each (a launch and wake-up cost ~100 us on a VM, as much
 * as reducing a megabyte). Each thread keeps its own accumulator per tensor;
 * they are merged afterwards with the engine's rule. Both neighbours map a
 * boundary to the same element (floor), so nothing is counted twice or missed. */

typedef struct {
    const uint64_t *ptrs, *counts;
    const int32_t *dtypes;
    size_t count;
    uint64_t begin, end;
    acc_t *accs;
    /* With histograms: the counts of tensors hist_first, hist_first + 1, ... (hist_bins
     * each) of this part, or NULL without. */
    uint64_t *hist;
    size_t hist_first;
} part_t;

/* IEEE mode for the kernel's own arithmetic. A thread may be in flush-to-zero mode (x86's
 * MXCSR FTZ and DAZ bits): a library built with -ffast-math sets them when it is loaded -
 * torch 2.4's inductor CPU kernels do - and then every subnormal reads as 0, so a tensor of
 * 1e-310 would report max |x| 0 and norm 0. Each thread that computes saves the mode, clears
 * both bits and puts the mode back before it returns: exact rows whatever the host did. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_BITS 0x8040u /* FTZ (bit 15) | DAZ (bit 6) */
static unsigned int ieee_enter(void) {
    unsigned int saved = _mm_getcsr();
    if (saved & FLUSH_BITS) _mm_setcsr(saved & ~FLUSH_BITS);
    return saved;
}
static void ieee_leave(unsigned int saved) {
    if (saved & FLUSH_BITS) _mm_setcsr(saved);
}
#else
static unsigned int ieee_enter(void) { return 0; }
static void ieee_leave(unsigned int saved) { (void)saved; }
#endif

static void *run_part(void *arg) {
    unsigned int mode = ieee_enter();
    part_t *part = (part_t *)arg;
    uint64_t offset = 0;
    for (size_t i = 0; i < part->count && offset < part->end; i++) {
        uint64_t size = itemsize(part->dtypes[i]);
        uint64_t bytes = part->counts[i] * size;
        uint64_t lo = offset > part->begin ? offset : part->begin;
        uint64_t hi = offset + bytes < part->end ? offset + bytes : part->end;
        if (lo < hi) {
            uint64_t first = (lo - offset) / size, last = (hi - offset) / size;
            const char *data = (const char *)(uintptr_t)part->ptrs[i] + first * size;
            if (part->hist != NULL)
                run_with_histogram(part->dtypes[i], data, (size_t)(last - first), &part->accs[i],
                                   part->hist + (i - part->hist_first) * (size_t)hist_bins);
            else
                run(part->dtypes[i], data, (size_t)(last - first), &part->accs[i]);
        }
        offset += bytes;
    }
    ieee_leave(mode);
    return NULL;
}

/* The tensors part j reads bytes of, [*first, *last]; *first > *last when none. */
static void part_span(const part_t *part, size_t *first, size_t *last) {
    uint64_t offset = 0;
    *first = 1;
    *last = 0;
    int any = 0;
    for (size_t i = 0; i < part->count && offset < part->end; i++) {
        uint64_t bytes = part->counts[i] * itemsize(part->dtypes[i]);
        if (bytes && offset + bytes > part->begin) {
            if (!any) *first = i;
            any = 1;
            *last = i;
        }
        offset += bytes;
    }
}

/* Rows of `count` tensors into rows[7 * i] and, when `hist` is not NULL, their exponent
 * histograms into hist[hist_bins * i] (set_layout first); returns 0, or -1 when out of
 * memory. Each thread counts into its own histograms (the first thread into `hist`), added
 * up afterwards. */
static int batch_stats_ieee(const uint64_t *ptrs, const uint64_t *counts, const int32_t *dtypes,
                            size_t count, double *rows, int threads, uint64_t *hist);

static int batch_stats(const uint64_t *ptrs, const uint64_t *counts, const int32_t *dtypes,
                       size_t count, double *rows, int threads, uint64_t *hist) {
    unsigned int mode = ieee_enter(); /* the merge and the rows are float64 arithmetic too */
    int failed = batch_stats_ieee(ptrs, counts, dtypes, count, rows, threads, hist);
    ieee_leave(mode);
    return failed;
}

static int batch_stats_ieee(const uint64_t *ptrs, const uint64_t *counts, const int32_t *dtypes,
                            size_t count, double *rows, int threads, uint64_t *hist) {
    uint64_t total = 0;
    for (size_t i = 0; i < count; i++) total += counts[i] * itemsize(dtypes[i]);
    size_t k = (size_t)(total / MIN_BYTES_PER_THREAD);
    if (k > (size_t)threads) k = (size_t)threads;
    if (k > MAX_THREADS) k = MAX_THREADS;
    if (k < 1) k = 1;
    acc_t *accs = (acc_t *)malloc(sizeof(acc_t) * (count ? count : 1) * k);
    if (accs == NULL) return -1;
    for (size_t i = 0; i < count * k; i++) acc_init(&accs[i]);
    part_t parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (size_t j = 0; j < k; j++) {
        parts[j] = (part_t){ptrs, counts, dtypes, count, total / k * j,
                            j + 1 == k ? total : total / k * (j + 1), accs + j * count, NULL, 0};
    }
    if (hist != NULL) {
        memset(hist, 0, sizeof(uint64_t) * count * (size_t)hist_bins);
        parts[0].hist = hist;
        for (size_t j = 1; j < k; j++) {
            size_t first, last;
            part_span(&parts[j], &first, &last);
            if (first > last) continue; /* nothing to read: no counts */
            parts[j].hist_first = first;
            parts[j].hist = (uint64_t *)calloc((last - first + 1) * (size_t)hist_bins, 8);
            if (parts[j].hist == NULL) {
                for (size_t i = 1; i < j; i++) free(parts[i].hist);
                free(accs);
                return -1;
            }
        }
    }
    for (size_t j = 1; j < k; j++) {
        started[j] = pthread_create(&ids[j], NULL, run_part, &parts[j]) == 0;
        if (!started[j]) run_part(&parts[j]);
    }
    run_part(&parts[0]);
    for (size_t j = 1; j < k; j++)
        if (started[j]) pthread_join(ids[j], NULL);
    for (size_t i = 0; i < count; i++) {
        acc_t merged;
        acc_init(&merged);
        for (size_t j = 0; j < k; j++) acc_merge(&merged, &accs[j * count + i]);
        write_row(&merged, rows + 7 * i);
    }
    if (hist != NULL) {
        for (size_t j = 1; j < k; j++) {
            if (parts[j].hist == NULL) continue;
            size_t first, last;
            part_span(&parts[j], &first, &last);
            size_t n = (last - first + 1) * (size_t)hist_bins;
            uint64_t *to = hist + first * (size_t)hist_bins;
            for (size_t b = 0; b < n; b++) to[b] += parts[j].hist[b];
            free(parts[j].hist);
        }
    }
    free(accs);
    return 0;
}

/* ---- Python bindings -------------------------------------------------------- */

static int cpu_has_avx2(void) {
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* __builtin_cpu_supports also asks the OS (XGETBV) whether it saves the AVX-512 state. */
static int cpu_has_avx512(void) {
#ifdef HAVE_AVX512
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

/* Whether this build and this CPU can run a path. */
static int isa_runs(int which) {
    switch (which) {
        case ISA_PORTABLE: return 1;
        case ISA_AVX2: return cpu_has_avx2();
        case ISA_AVX512: return cpu_has_avx512();
        default: return 0;
    }
}

/* The widest path this CPU runs. */
static int widest_isa(void) {
    for (int which = ISA_AVX512; which > ISA_PORTABLE; which--)
        if (isa_runs(which)) return which;
    return ISA_PORTABLE;
}

static int valid_dtype(int dtype) { return dtype >= DT_F32 && dtype <= DT_E5M2; }

PyDoc_STRVAR(stats_doc,
    "stats(data_ptr, numel, dtype_code, row_ptr, threads)\n\n"
    "Write the stats row of one contiguous CPU tensor into 7 float64 at row_ptr.\n"
    "Releases the GIL while it runs.");

static PyObject *py_stats(PyObject *self, PyObject *args) {
    unsigned long long data, row;
    Py_ssize_t n;
    int dtype, threads, failed;
    (void)self;
    if (!PyArg_ParseTuple(args, "KniKi", &data, &n, &dtype, &row, &threads)) return NULL;
    if (!valid_dtype(dtype) || n < 0 || row == 0 || (n > 0 && data == 0)) {
        PyErr_SetString(PyExc_ValueError, "invalid arguments");
        return NULL;
    }
    uint64_t ptr = data, count = (uint64_t)n;
    int32_t code = dtype;
    Py_BEGIN_ALLOW_THREADS
    failed = batch_stats(&ptr, &count, &code, 1, (double *)(uintptr_t)row, threads < 1 ? 1 : threads,
                         NULL);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stats_batch_doc,
    "stats_batch(ptrs, counts, dtypes, rows_ptr, threads, hist_ptr=0)\n\n"
    "Stats rows of many contiguous CPU tensors in one call: ptrs and counts\n"
    "are buffers of uint64, dtypes a buffer of int32 codes, one per tensor;\n"
    "row i goes to rows_ptr + 7*i float64. The bytes are split between threads.\n"
    "With hist_ptr, also each tensor's exponent histogram, read in the same pass:\n"
    "bins() uint64 counts per tensor at hist_ptr + 8*bins()*i (set_layout first).");

static PyObject *py_stats_batch(PyObject *self, PyObject *args) {
    Py_buffer ptrs, counts, dtypes;
    unsigned long long rows, hist = 0;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*Ki|K", &ptrs, &counts, &dtypes, &rows, &threads, &hist))
        return NULL;
    PyObject *result = NULL;
    size_t count = (size_t)ptrs.len / 8;
    if ((size_t)ptrs.len != 8 * count || (size_t)counts.len != 8 * count ||
        (size_t)dtypes.len != 4 * count || rows == 0) {
        PyErr_SetString(PyExc_ValueError, "invalid arguments");
        goto done;
    }
    if (hist != 0 && hist_bins == 0) {
        PyErr_SetString(PyExc_ValueError, "histograms need the layout first (set_layout)");
        goto done;
    }
    for (size_t i = 0; i < count; i++) {
        if (!valid_dtype(((const int32_t *)dtypes.buf)[i])) {
            PyErr_SetString(PyExc_ValueError, "invalid dtype code");
            goto done;
        }
    }
    {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = batch_stats((const uint64_t *)ptrs.buf, (const uint64_t *)counts.buf,
                             (const int32_t *)dtypes.buf, count, (double *)(uintptr_t)rows,
                             threads < 1 ? 1 : threads, (uint64_t *)(uintptr_t)hist);
        Py_END_ALLOW_THREADS
        if (failed) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&ptrs);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&dtypes);
    return result;
}

PyDoc_STRVAR(set_layout_doc,
    "set_layout(boundaries) -> bins\n\n"
    "The exponent histogram's layout: a buffer of uint32, the sorted float32 bit patterns\n"
    "of |x| where bins start, the last one +Inf's (0x7f800000). Once per process: a second\n"
    "call must give the same layout (batches may be running).");

static PyObject *py_set_layout(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    size_t n = (size_t)view.len / 4;
    const uint32_t *bounds = (const uint32_t *)view.buf;
    int ok = (size_t)view.len == 4 * n && n >= 2 && n < HIST_MAX_BINS && bounds[0] >= 1 &&
             bounds[n - 1] == 0x7f800000u;
    for (size_t i = 1; ok && i < n; i++) ok = bounds[i] > bounds[i - 1];
    if (!ok) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "a layout is sorted float32 patterns ending at +Inf");
        return NULL;
    }
    if (hist_bins != 0) {
        int same = (size_t)hist_bins == n + 1 && memcmp(hist_bounds, bounds, 4 * n) == 0;
        PyBuffer_Release(&view);
        if (!same) {
            PyErr_SetString(PyExc_ValueError, "the histogram layout is set already");
            return NULL;
        }
        return PyLong_FromLong(hist_bins);
    }
    memcpy(hist_bounds, bounds, 4 * n);
    PyBuffer_Release(&view);
    hist_bins = (int)n + 1; /* hist_search reads it; the tables below need it */
    for (uint32_t c = 0; c < (1u << 15); c++) {
        uint32_t lo = hist_search(c << 16), hi = hist_search((c << 16) | 0xffffu);
        hist_cells[c] = lo == hi ? (uint16_t)lo : (uint16_t)HIST_SPLIT;
        hist_f16[c] = pattern_bin(DT_F16, c);
        hist_bf16[c] = pattern_bin(DT_BF16, c);
    }
    for (uint32_t e = 1; e < 255; e++) {
        uint32_t first = hist_search(e << 23), last = hist_search(((e + 1) << 23) - 1u);
        binade_bin[e] = (uint16_t)first;
        binade_cuts[e] = (uint8_t)(last - first > 3 ? 3 : last - first);
        for (uint32_t j = 0; j < 2 && first + j < last; j++) binade_cut[e][j] = hist_bounds[first + j];
    }
    for (uint32_t c = 0; c < 128; c++) {
        hist_e4m3[c] = pattern_bin(DT_E4M3, c);
        hist_e5m2[c] = pattern_bin(DT_E5M2, c);
    }
    return PyLong_FromLong(hist_bins);
}

PyDoc_STRVAR(set_path_doc,
    "set_path(name) -> previous\n\n"
    "Choose the kernel path: 'avx512', 'avx2' (each needs its CPU features) or 'portable'.\n"
    "For tests and benchmarks; the widest the CPU has is chosen at import.");

static PyObject *py_set_path(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    const char *previous = isa_names[isa];
    for (int which = ISA_PORTABLE; which <= ISA_AVX512; which++) {
        if (strcmp(name, isa_names[which]) == 0 && isa_runs(which)) {
            isa = which;
            return PyUnicode_FromString(previous);
        }
    }
    PyErr_Format(PyExc_ValueError, "kernel path %R is not available", arg);
    return NULL;
}

PyDoc_STRVAR(path_doc, "path() -> name\n\nThe kernel path in use: 'avx512', 'avx2' or 'portable'.");

static PyObject *py_path(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(isa_names[isa]);
}

PyDoc_STRVAR(paths_doc,
    "paths() -> tuple\n\nThe kernel paths this build runs on this CPU, narrowest first.");

static PyObject *py_paths(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    for (int which = ISA_PORTABLE; which <= ISA_AVX512; which++) {
        if (!isa_runs(which)) continue;
        PyObject *name = PyUnicode_FromString(isa_names[which]);
        if (name == NULL || PyList_Append(names, name)) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

/* ---- safetensors header columns ------------------------------------------------------
 *
 * A header of a million tiny tensors is 74 MB of JSON; parsed into Python objects it
 * cost ~550 bytes and a few microseconds per entry. This scanner reads the common form
 * that writers produce, {"__metadata__":{...},"name":{"dtype":"F32","shape":[4],
 * "data_offsets":[0,16]},...} (JSON whitespace allowed between tokens, keys in that
 * order), straight into columns. It decides nothing about validity beyond the grammar:
 * anything else (an escape in a name, another key order, a number that is negative,
 * fractional or beyond int64, an unknown dtype) returns None and the caller's full JSON
 * parser takes the header, which also names every problem. The pure-Python
 * gradaudit/io/header_columns.py accepts exactly the same texts. */

typedef struct {
    char *data;
    size_t len, cap;
} growbuf_t;

static int grow_put(growbuf_t *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *data = realloc(b->data, cap);
        if (data == NULL) return -1;
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static inline const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

/* A JSON integer without sign, fraction or exponent that fits int64; NULL otherwise. */
static const char *scan_count(const char *p, const char *end, int64_t *out) {
    if (p >= end || *p < '0' || *p > '9') return NULL;
    if (*p == '0') {
        p++;
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9'))) return NULL;
        *out = 0;
        return p;
    }
    uint64_t value = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        value = value * 10 + (uint64_t)(*p - '0');
        if (value > (uint64_t)INT64_MAX) return NULL;
        p++;
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return NULL;
    *out = (int64_t)value;
    return p;
}

/* A string with no escape and no control character: [*start, *stop) is its content. */
static const char *scan_plain_string(const char *p, const char *end, const char **start,
                                     const char **stop) {
    if (p >= end || *p != '"') return NULL;
    p++;
    *start = p;
    while (p < end && *p != '"') {
        if (*p == '\\' || (unsigned char)*p < 0x20) return NULL;
        p++;
    }
    if (p >= end) return NULL;
    *stop = p;
    return p + 1;
}

/* Any JSON string (escapes skipped over, not decoded); the caller's parser reads it. */
static const char *skip_string(const char *p, const char *end) {
    if (p >= end || *p != '"') return NULL;
    p++;
    while (p < end && *p != '"') {
        if ((unsigned char)*p < 0x20) return NULL;
        if (*p == '\\') p++;
        p++;
    }
    return p < end ? p + 1 : NULL;
}

static const char *expect(const char *p, const char *end, const char *literal) {
    size_t n = strlen(literal);
    p = skip_ws(p, end);
    if ((size_t)(end - p) < n || memcmp(p, literal, n) != 0) return NULL;
    return skip_ws(p + n, end);
}

/* The __metadata__ object when it is string to string: its end, or NULL. */
static const char *skip_metadata(const char *p, const char *end) {
    if (p >= end || *p != '{') return NULL;
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}') return p + 1;
    for (;;) {
        p = skip_string(p, end);
        if (p == NULL || (p = expect(p, end, ":")) == NULL) return NULL;
        p = skip_string(p, end);
        if (p == NULL) return NULL;
        p = skip_ws(p, end);
        if (p < end && *p == '}') return p + 1;
        if (p >= end || *p != ',') return NULL;
        p = skip_ws(p + 1, end);
    }
}

PyDoc_STRVAR(header_columns_doc,
    "header_columns(header, dtypes) -> (names, codes, ranks, dims, offsets, meta) or None\n\n"
    "Columns of a safetensors header in its common form; dtypes is the tuple of dtype\n"
    "spellings (codes index it). names: list of str; codes: bytes; ranks, dims, offsets:\n"
    "bytes of int64 (offsets two per tensor); meta: (start, end) of the __metadata__\n"
    "object in header, or None. None when the text is not in that form.");

static PyObject *py_header_columns(PyObject *self, PyObject *args) {
    Py_buffer text;
    PyObject *dtypes;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!", &text, &PyTuple_Type, &dtypes)) return NULL;
    Py_ssize_t ndtypes = PyTuple_GET_SIZE(dtypes);
    if (ndtypes > 255) {
        PyBuffer_Release(&text);
        PyErr_SetString(PyExc_ValueError, "too many dtypes");
        return NULL;
    }
    const char *base = text.buf, *end = base + text.len, *p;
    growbuf_t codes = {0}, ranks = {0}, dims = {0}, offsets = {0};
    PyObject *names = PyList_New(0), *result = NULL, *meta = Py_None;
    Py_INCREF(Py_None);
    const char *spelling[255];
    Py_ssize_t spelling_len[255];
    if (names == NULL) goto fail;
    for (Py_ssize_t k = 0; k < ndtypes; k++) {
        PyObject *item = PyTuple_GET_ITEM(dtypes, k);
        spelling[k] = PyUnicode_Check(item) ? PyUnicode_AsUTF8AndSize(item, &spelling_len[k]) : NULL;
        if (spelling[k] == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "dtypes must be str");
            goto fail;
        }
    }
    p = expect(base, end, "{");
    if (p == NULL) goto reject;
    if (p < end && *p == '}') goto reject; /* no tensors: the full parser says so */
    for (int first = 1;; first = 0) {
        const char *name, *name_end;
        p = scan_plain_string(p, end, &name, &name_end);
        if (p == NULL || (p = expect(p, end, ":")) == NULL) goto reject;
        if (first && name_end - name == 12 && memcmp(name, "__metadata__", 12) == 0) {
            const char *meta_end = skip_metadata(p, end);
            if (meta_end == NULL) goto reject;
            Py_DECREF(meta);
            meta = Py_BuildValue("nn", (Py_ssize_t)(p - base), (Py_ssize_t)(meta_end - base));
            if (meta == NULL) goto fail;
            p = expect(meta_end, end, ",");
            if (p == NULL) goto reject;
            continue;
        }
        const char *dtype, *dtype_end;
        if ((p = expect(p, end, "{")) == NULL || (p = expect(p, end, "\"dtype\"")) == NULL ||
            (p = expect(p, end, ":")) == NULL)
            goto reject;
        p = scan_plain_string(p, end, &dtype, &dtype_end);
        if (p == NULL) goto reject;
        Py_ssize_t k;
        for (k = 0; k < ndtypes; k++) {
            if (spelling_len[k] == dtype_end - dtype &&
                memcmp(spelling[k], dtype, (size_t)spelling_len[k]) == 0)
                break;
        }
        if (k == ndtypes) goto reject;
        unsigned char code = (unsigned char)k;
        if ((p = expect(p, end, ",")) == NULL || (p = expect(p, end, "\"shape\"")) == NULL ||
            (p = expect(p, end, ":")) == NULL || (p = expect(p, end, "[")) == NULL)
            goto reject;
        int64_t rank = 0, value;
        if (p < end && *p != ']') {
            for (;;) {
                p = scan_count(p, end, &value);
                if (p == NULL || grow_put(&dims, &value, 8)) goto reject_or_fail;
                rank++;
                p = skip_ws(p, end);
                if (p < end && *p == ']') break;
                if (p >= end || *p != ',') goto reject;
                p = skip_ws(p + 1, end);
            }
        }
        if ((p = expect(p, end, "]")) == NULL || (p = expect(p, end, ",")) == NULL ||
            (p = expect(p, end, "\"data_offsets\"")) == NULL || (p = expect(p, end, ":")) == NULL ||
            (p = expect(p, end, "[")) == NULL)
            goto reject;
        int64_t pair[2];
        if ((p = scan_count(p, end, &pair[0])) == NULL || (p = expect(p, end, ",")) == NULL ||
            (p = scan_count(p, end, &pair[1])) == NULL || (p = expect(p, end, "]")) == NULL ||
            (p = expect(p, end, "}")) == NULL)
            goto reject;
        PyObject *item = PyUnicode_DecodeUTF8(name, name_end - name, NULL);
        if (item == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto fail;
            PyErr_Clear();
            goto reject;
        }
        int appended = PyList_Append(names, item);
        Py_DECREF(item);
        if (appended) goto fail;
        if (grow_put(&codes, &code, 1) || grow_put(&ranks, &rank, 8) ||
            grow_put(&offsets, pair, 16)) {
            PyErr_NoMemory();
            goto fail;
        }
        if (p < end && *p == '}') {
            p = skip_ws(p + 1, end);
            if (p != end) goto reject;
            break;
        }
        if (p >= end || *p != ',') goto reject;
        p = skip_ws(p + 1, end);
    }
    result = Py_BuildValue("(Oy#y#y#y#O)", names, codes.data ? codes.data : "",
                           (Py_ssize_t)codes.len, ranks.data ? ranks.data : "",
                           (Py_ssize_t)ranks.len, dims.data ? dims.data : "", (Py_ssize_t)dims.len,
                           offsets.data ? offsets.data : "", (Py_ssize_t)offsets.len, meta);
    goto done;
reject_or_fail:
    if (p != NULL) {
        PyErr_NoMemory();
        goto fail;
    }
reject:
    Py_INCREF(Py_None);
    result = Py_None;
    goto done;
fail:
    result = NULL;
done:
    Py_XDECREF(names);
    Py_XDECREF(meta);
    free(codes.data);
    free(ranks.data);
    free(dims.data);
    free(offsets.data);
    PyBuffer_Release(&text);
    return result;
}

/* ---- in-memory tensors' facts, as columns ---------------------------------------------
 *
 * audit() of 100,000 tiny tensors read five facts of each (dtype, is_cpu,
 * is_contiguous(), data_ptr(), shape) in a Python loop, then zipped them into columns:
 * per-tensor Python that cost more than the kernel reads. This loop asks each tensor the
 * same five questions through the same public attributes (no torch headers: the answers
 * come from torch's own Python binding, so they mean what they mean in Python), and
 * writes the columns the kernel and the results take. Most of what is left is waiting on
 * memory: each tensor's objects are a few cache misses away from the previous one's,
 * so the next tensor's Python object is prefetched while this one is asked. Where torch's
 * C shim is bound (shim_tensor_facts, below) the same facts are read with no Python at
 * all: 6.5 instead of 49 ms for 100,000 tiny tensors.
 *
 * A tensor the kernel cannot read as it is (not of an exact type in `plain`, a dtype not
 * in `codes`, not on the CPU, not contiguous, or a layout whose is_contiguous() or
 * data_ptr() raises RuntimeError) is marked 0 in `ok`; its other columns hold nothing
 * (rank 0) and the caller sends it the per-tensor way. */

PyDoc_STRVAR(tensor_facts_doc,
    "tensor_facts(tensors, codes, plain, shim_codes=None, device_type=0, device_index=-1)\n"
    "    -> (ok, pointers, counts, codes, ranks, dims, nbytes)\n\n"
    "Columns of a list of tensors: ok (uint8 per tensor), pointers and counts (uint64),\n"
    "kernel codes (int32), ranks (int64), dims (int64, every ok tensor's shape back to\n"
    "back) and the bytes of the ok tensors in all. codes maps torch dtypes to kernel codes;\n"
    "plain is a tuple of the exact types taken. With shim_codes (int32 per torch scalar\n"
    "type: its kernel code or -1) the facts are read through torch's C shim (bind_shim),\n"
    "of tensors on the device of that type and index as the shim numbers them (the CPU's\n"
    "by default), and codes is not used.");

static PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_data_ptr, *s_shape;

/* For a call's result: 0 when it returned `value`, 1 when it raised RuntimeError (then
 * cleared: torch's way of saying a layout has no such thing), -1 for any other error. */
static int runtime_error(PyObject *value) {
    if (value != NULL) return 0;
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError)) return -1;
    PyErr_Clear();
    return 1;
}

/* Whether `t` is of one of the exact types in the tuple `plain`. */
static int plain_type(PyObject *t, PyObject *plain) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(plain); k++) {
        if ((PyObject *)Py_TYPE(t) == PyTuple_GET_ITEM(plain, k)) return 1;
    }
    return 0;
}

/* One tensor's facts; 1 when the kernel can read it as it is, 0 when not, -1 on error. */
static int one_tensor_facts(PyObject *t, PyObject *codes, PyObject *plain, uint64_t *pointer,
                            uint64_t *count, int32_t *code, int64_t *rank, growbuf_t *dims) {
    if (!plain_type(t, plain)) return 0;
    PyObject *dtype = PyObject_GetAttr(t, s_dtype);
    if (dtype == NULL) return -1;
    PyObject *value = PyDict_GetItemWithError(codes, dtype); /* borrowed */
    Py_DECREF(dtype);
    if (value == NULL) return PyErr_Occurred() ? -1 : 0;
    long dtype_code = PyLong_AsLong(value);
    if (dtype_code == -1 && PyErr_Occurred()) return -1;
    if (!valid_dtype((int)dtype_code)) {
        PyErr_SetString(PyExc_ValueError, "invalid dtype code");
        return -1;
    }
    PyObject *flag = PyObject_GetAttr(t, s_is_cpu);
    if (flag == NULL) return -1;
    int on_cpu = flag == Py_True;
    Py_DECREF(flag);
    if (!on_cpu) return 0;
    flag = PyObject_CallMethodNoArgs(t, s_is_contiguous);
    int raised = runtime_error(flag);
    if (raised) return raised < 0 ? -1 : 0;
    int contiguous = flag == Py_True;
    Py_DECREF(flag);
    if (!contiguous) return 0;
    PyObject *address = PyObject_CallMethodNoArgs(t, s_data_ptr);
    raised = runtime_error(address);
    if (raised) return raised < 0 ? -1 : 0;
    unsigned long long where = PyLong_AsUnsignedLongLong(address);
    Py_DECREF(address);
    if (where == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (shape == NULL) return -1;
    if (!PyTuple_Check(shape)) {
        Py_DECREF(shape);
        PyErr_SetString(PyExc_TypeError, "a tensor's shape is not a tuple");
        return -1;
    }
    size_t start = dims->len;
    uint64_t elements = 1;
    int fits = 1;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(shape); j++) {
        long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, j));
        if ((size == -1 && PyErr_Occurred()) || grow_put(dims, &size, sizeof(size))) {
            Py_DECREF(shape);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
        if (size < 0 || (size > 0 && elements > UINT64_MAX / (uint64_t)size)) {
            fits = 0;
        } else {
            elements *= (uint64_t)size;
        }
    }
    Py_ssize_t dimensions = PyTuple_GET_SIZE(shape);
    Py_DECREF(shape);
    if (!fits) { /* not a shape a tensor in memory can have; the per-tensor path decides */
        dims->len = start;
        return 0;
    }
    *pointer = where;
    *count = elements;
    *code = (int32_t)dtype_code;
    *rank = dimensions;
    return 1;
}

/* As one_tensor_facts, through torch's C shim (defined with it, below). */
static int shim_tensor_facts(PyObject *t, const int32_t *shim_codes, size_t known_types,
                             int32_t device_type, int32_t device_index, PyObject *plain,
                             uint64_t *pointer, uint64_t *count, int32_t *code, int64_t *rank,
                             growbuf_t *dims);
static int shim_unbound(void);
static inline void shim_prefetch(PyObject *tensors, PyObject *plain, Py_ssize_t i);

static PyObject *py_tensor_facts(PyObject *self, PyObject *args) {
    PyObject *tensors, *codes, *plain;
    const char *shim_codes = NULL;
    Py_ssize_t shim_length = 0;
    int device_type = 0, device_index = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!|z#ii", &PyList_Type, &tensors, &PyDict_Type, &codes,
                          &PyTuple_Type, &plain, &shim_codes, &shim_length, &device_type,
                          &device_index)) {
        return NULL;
    }
    if (shim_codes != NULL) {
        if (shim_unbound()) return NULL;
        for (Py_ssize_t k = 0; k < shim_length / (Py_ssize_t)sizeof(int32_t); k++) {
            int32_t known;
            memcpy(&known, shim_codes + k * sizeof(int32_t), sizeof known);
            if (known != -1 && !valid_dtype(known)) {
                PyErr_SetString(PyExc_ValueError, "invalid dtype code");
                return NULL;
            }
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    PyObject *result = NULL;
    uint8_t *ok = calloc((size_t)n + 1, 1);
    uint64_t *pointers = calloc((size_t)n + 1, 8), *counts = calloc((size_t)n + 1, 8);
    int32_t *dtype_codes = calloc((size_t)n + 1, 4);
    int64_t *ranks = calloc((size_t)n + 1, 8);
    growbuf_t dims = {NULL, 0, 0};
    uint64_t nbytes = 0;
    if (!ok || !pointers || !counts || !dtype_codes || !ranks) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(tensors)) { /* an attribute's Python code shortened it */
            PyErr_SetString(PyExc_RuntimeError, "the list of tensors changed while read");
            goto done;
        }
        if (shim_codes != NULL) {
            shim_prefetch(tensors, plain, i);
        }
#if defined(__GNUC__)
        else if (i + 2 < PyList_GET_SIZE(tensors)) {
            __builtin_prefetch(PyList_GET_ITEM(tensors, i + 2));
        }
#endif
        PyObject *t = PyList_GET_ITEM(tensors, i);
        Py_INCREF(t);
        int taken = shim_codes != NULL
                        ? shim_tensor_facts(t, (const int32_t *)shim_codes,
                                            (size_t)shim_length / sizeof(int32_t),
                                            (int32_t)device_type, (int32_t)device_index,
                                            plain, &pointers[i], &counts[i], &dtype_codes[i],
                                            &ranks[i], &dims)
                        : one_tensor_facts(t, codes, plain, &pointers[i], &counts[i],
                                           &dtype_codes[i], &ranks[i], &dims);
        Py_DECREF(t);
        if (taken < 0) goto done;
        ok[i] = (uint8_t)taken;
        if (taken) nbytes += counts[i] * itemsize(dtype_codes[i]);
    }
    result = Py_BuildValue("(y#y#y#y#y#y#K)", (const char *)ok, n, (const char *)pointers, 8 * n,
                           (const char *)counts, 8 * n, (const char *)dtype_codes, 4 * n,
                           (const char *)ranks, 8 * n, dims.data ? dims.data : "",
                           (Py_ssize_t)dims.len, (unsigned long long)nbytes);
done:
    free(ok);
    free(pointers);
    free(counts);
    free(dtype_codes);
    free(ranks);
    free(dims.data);
    return result;
}

/* ---- a planned list's facts checked, its addresses read, in one pass -------------------
 *
 * A training loop's Triton flush is planned once per list of tensors (triton_plan.py);
 * each step must check that every tensor still has the plan's dtype, shape, device index
 * and contiguity, then read its address. Five passes of `map` over torch's accessors
 * touch every tensor's Python object, TensorImpl and storage five times: with 10,000
 * gradients that is more than the caches hold, and each pass paid the misses again. This
 * loop asks each tensor the same questions through the same accessors (passed in: no torch
 * headers) once, with the next tensor's object prefetched, and stops at the first
 * difference. */

PyDoc_STRVAR(planned_pointers_doc,
    "planned_pointers(tensors, plain, dtypes, shapes, devices, get_device, is_contiguous,\n"
    "                 data_ptr) -> bytes | None\n\n"
    "The address of every tensor (int64, native order) when each is of an exact type in\n"
    "plain, has dtypes[i] (the same object), shapes[i] (equal), devices[i] (equal) and is\n"
    "contiguous; None at the first tensor that differs (or whose layout has no contiguity\n"
    "or address: RuntimeError).");

static PyObject *py_planned_pointers(PyObject *self, PyObject *args) {
    PyObject *tensors, *plain, *dtypes, *shapes, *devices, *get_device, *is_contiguous, *data_ptr;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OOO", &PyList_Type, &tensors, &PyTuple_Type, &plain,
                          &PyList_Type, &dtypes, &PyList_Type, &shapes, &PyList_Type, &devices,
                          &get_device, &is_contiguous, &data_ptr)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    if (PyList_GET_SIZE(dtypes) != n || PyList_GET_SIZE(shapes) != n ||
        PyList_GET_SIZE(devices) != n) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (out == NULL) return NULL;
    int64_t *pointers = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(tensors)) { /* an accessor's Python code shortened it */
            Py_DECREF(out);
            PyErr_SetString(PyExc_RuntimeError, "the list of tensors changed while read");
            return NULL;
        }
#if defined(__GNUC__)
        if (i + 2 < PyList_GET_SIZE(tensors)) __builtin_prefetch(PyList_GET_ITEM(tensors, i + 2));
#endif
        PyObject *t = PyList_GET_ITEM(tensors, i);
        Py_INCREF(t);
        int same = plain_type(t, plain), failed = 0;
        PyObject *value = NULL;
        if (same) {
            value = PyObject_GetAttr(t, s_dtype);
            if (value == NULL) failed = 1;
            else same = value == PyList_GET_ITEM(dtypes, i);
            Py_XDECREF(value);
        }
        if (same && !failed) {
            value = PyObject_GetAttr(t, s_shape);
            if (value == NULL) failed = 1;
            else {
                same = PyObject_RichCompareBool(value, PyList_GET_ITEM(shapes, i), Py_EQ);
                if (same < 0) failed = 1;
                Py_DECREF(value);
            }
        }
        if (same && !failed) {
            value = PyObject_Vectorcall(get_device, &t, 1, NULL);
            if (value == NULL) failed = 1;
            else {
                same = PyObject_RichCompareBool(value, PyList_GET_ITEM(devices, i), Py_EQ);
                if (same < 0) failed = 1;
                Py_DECREF(value);
            }
        }
        if (same && !failed) {
            value = PyObject_Vectorcall(is_contiguous, &t, 1, NULL);
            int raised = runtime_error(value);
            if (raised < 0) failed = 1;
            else if (raised) same = 0;
            else {
                same = value == Py_True;
                Py_DECREF(value);
            }
        }
        if (same && !failed) {
            value = PyObject_Vectorcall(data_ptr, &t, 1, NULL);
            int raised = runtime_error(value);
            if (raised < 0) failed = 1;
            else if (raised) same = 0;
            else {
                pointers[i] = (int64_t)PyLong_AsLongLong(value);
                Py_DECREF(value);
                if (pointers[i] == -1 && PyErr_Occurred()) failed = 1;
            }
        }
        Py_DECREF(t);
        if (failed) {
            Py_DECREF(out);
            return NULL;
        }
        if (!same) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    return out;
}

/* ---- a tensor's facts through torch's C shim, with no Python per tensor ----------------
 *
 * planned_pointers asks each tensor five questions through torch's Python binding: about
 * 0.3-0.7 us a tensor, 3-7 ms a step for 10,000 gradients. torch also answers them in C:
 * the shim AOTInductor's compiled models call (aoti_torch_get_dtype, _sizes, _data_ptr,
 * ...: extern "C", exported by libtorch, a stable interface), given an at::Tensor *. A
 * tensor's Python object holds its at::Tensor right after the object's header; where it
 * does (torch_shim.py checks that against torch's own answers on probe tensors before
 * binding, and binds nothing otherwise), each question is a C call of a few nanoseconds.
 * The functions' addresses are handed in by torch_shim.py (ctypes), so this file needs
 * no torch headers and links nothing. */

typedef int32_t (*shim_pointer_fn)(void *, void **);
typedef int32_t (*shim_array_fn)(void *, int64_t **);
typedef int32_t (*shim_i64_fn)(void *, int64_t *);
typedef int32_t (*shim_i32_fn)(void *, int32_t *);
typedef int32_t (*shim_bool_fn)(void *, _Bool *);

static struct {
    Py_ssize_t offset; /* of the at::Tensor in a tensor's Python object; 0: not bound */
    int32_t strided;   /* the strided layout's code */
    shim_pointer_fn data_ptr;
    shim_i64_fn dim;
    shim_array_fn sizes;
    shim_i32_fn dtype, device_type, device_index, layout;
    shim_bool_fn contiguous;
} shim;

/* A tensor's facts: 0 when read, 1 when torch could not answer (a layout without strides
 * or contiguity: the caller's slow path decides), never a Python error. */
typedef struct {
    int32_t dtype, device_type, device_index, layout;
    _Bool contiguous;
    int64_t dim;
    const int64_t *sizes;
    void *address;
} shim_facts_t;

static int shim_read(PyObject *t, shim_facts_t *f) {
    void *h = (char *)t + shim.offset;
    if (shim.dtype(h, &f->dtype) || shim.device_type(h, &f->device_type) ||
        shim.device_index(h, &f->device_index) || shim.layout(h, &f->layout)) {
        return 1;
    }
    if (f->layout != shim.strided) return 1;
    int64_t *sizes = NULL;
    if (shim.dim(h, &f->dim) || shim.sizes(h, &sizes) || shim.contiguous(h, &f->contiguous) ||
        shim.data_ptr(h, &f->address)) {
        return 1;
    }
    f->sizes = sizes;
    return 0;
}


/* Tensor i + SHIM_AHEAD's TensorImpl (its first three cache lines) fetched ahead (its
 * address is in the tensor's object, read from a plain tensor only), and the object itself
 * twice as far: with a list cold in cache (a backward pass between two steps) each
 * tensor's TensorImpl, sizes and storage are fetched from memory one after the other.
 * shim_pointers over 10,000 tensors after a 64 MiB pass over other memory: 1.6-1.8 ms
 * without, 1.0-1.1 with one line of the TensorImpl fetched 8 ahead (4 to 64 ahead did no
 * better), 0.65-0.95 with three (alternating builds, four runs each). Fetching the storage
 * too (its address is a TensorImpl word, findable on probes) made no difference that this
 * machine's noise let through, and was not kept. */
#define SHIM_AHEAD 8
static inline void shim_prefetch(PyObject *tensors, PyObject *plain, Py_ssize_t i) {
#if defined(__GNUC__)
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    if (i + 2 * SHIM_AHEAD < n) __builtin_prefetch(PyList_GET_ITEM(tensors, i + 2 * SHIM_AHEAD));
    if (i + SHIM_AHEAD < n) {
        PyObject *ahead = PyList_GET_ITEM(tensors, i + SHIM_AHEAD);
        if (plain_type(ahead, plain)) {
            const char *impl = *(const char *const *)((const char *)ahead + shim.offset);
            for (int line = 0; line < 3; line++) __builtin_prefetch(impl + 64 * line);
        }
    }
#else
    (void)tensors, (void)plain, (void)i;
#endif
}

static int shim_tensor_facts(PyObject *t, const int32_t *shim_codes, size_t known_types,
                             int32_t device_type, int32_t device_index, PyObject *plain,
                             uint64_t *pointer, uint64_t *count, int32_t *code, int64_t *rank,
                             growbuf_t *dims) {
    shim_facts_t f;
    if (!plain_type(t, plain) || shim_read(t, &f) || !f.contiguous ||
        f.device_type != device_type || f.device_index != device_index ||
        f.dtype < 0 || (size_t)f.dtype >= known_types || shim_codes[f.dtype] < 0) {
        return 0;
    }
    uint64_t elements = 1;
    for (int64_t d = 0; d < f.dim; d++) {
        int64_t size = f.sizes[d];
        if (size < 0 || (size > 0 && elements > UINT64_MAX / (uint64_t)size)) return 0;
        elements *= (uint64_t)size;
    }
    if (f.dim && grow_put(dims, f.sizes, sizeof(int64_t) * (size_t)f.dim)) {
        PyErr_NoMemory();
        return -1;
    }
    *pointer = (uint64_t)(uintptr_t)f.address;
    *count = elements;
    *code = shim_codes[f.dtype];
    *rank = f.dim;
    return 1;
}

PyDoc_STRVAR(bind_shim_doc,
    "bind_shim(offset, strided, data_ptr, dim, sizes, dtype, device_type, device_index,\n"
    "          layout, is_contiguous) -> None\n\n"
    "Bind the aoti_torch_* functions at these addresses (0 offset: unbind), to be called\n"
    "with the at::Tensor at `offset` bytes into a tensor's Python object.");

static PyObject *py_bind_shim(PyObject *self, PyObject *args) {
    Py_ssize_t offset;
    int strided;
    unsigned long long f[8];
    (void)self;
    if (!PyArg_ParseTuple(args, "niKKKKKKKK", &offset, &strided, &f[0], &f[1], &f[2], &f[3],
                          &f[4], &f[5], &f[6], &f[7])) {
        return NULL;
    }
    for (int k = 0; k < 8 && offset; k++) {
        if (f[k] == 0) {
            PyErr_SetString(PyExc_ValueError, "a shim function's address is 0");
            return NULL;
        }
    }
    if (offset < 0 || (offset && offset < (Py_ssize_t)sizeof(PyObject))) {
        PyErr_SetString(PyExc_ValueError, "the offset is inside the object's header");
        return NULL;
    }
    shim.offset = 0;
    shim.strided = strided;
    shim.data_ptr = (shim_pointer_fn)(uintptr_t)f[0];
    shim.dim = (shim_i64_fn)(uintptr_t)f[1];
    shim.sizes = (shim_array_fn)(uintptr_t)f[2];
    shim.dtype = (shim_i32_fn)(uintptr_t)f[3];
    shim.device_type = (shim_i32_fn)(uintptr_t)f[4];
    shim.device_index = (shim_i32_fn)(uintptr_t)f[5];
    shim.layout = (shim_i32_fn)(uintptr_t)f[6];
    shim.contiguous = (shim_bool_fn)(uintptr_t)f[7];
    shim.offset = offset;
    Py_RETURN_NONE;
}

static int shim_unbound(void) {
    if (shim.offset) return 0;
    PyErr_SetString(PyExc_RuntimeError, "torch's C shim is not bound (bind_shim)");
    return 1;
}

PyDoc_STRVAR(shim_facts_doc,
    "shim_facts(tensor) -> (dtype, device_type, device_index, layout, contiguous, sizes,\n"
    "                      address) | None\n\n"
    "One tensor's facts as torch's C shim gives them (codes as torch numbers them; sizes a\n"
    "tuple), None where it gives none (a layout without strides). For checking the binding.");

static PyObject *py_shim_facts(PyObject *self, PyObject *t) {
    (void)self;
    if (shim_unbound()) return NULL;
    if (Py_TYPE(t)->tp_basicsize < shim.offset + (Py_ssize_t)sizeof(void *)) {
        PyErr_SetString(PyExc_TypeError, "not an object with a tensor at the bound offset");
        return NULL;
    }
    shim_facts_t f;
    if (shim_read(t, &f)) Py_RETURN_NONE;
    PyObject *sizes = PyTuple_New((Py_ssize_t)f.dim);
    if (sizes == NULL) return NULL;
    for (int64_t d = 0; d < f.dim; d++) {
        PyObject *size = PyLong_FromLongLong(f.sizes[d]);
        if (size == NULL) {
            Py_DECREF(sizes);
            return NULL;
        }
        PyTuple_SET_ITEM(sizes, (Py_ssize_t)d, size);
    }
    return Py_BuildValue("(iiiiNNK)", f.dtype, f.device_type, f.device_index, f.layout,
                         PyBool_FromLong(f.contiguous), sizes,
                         (unsigned long long)(uintptr_t)f.address);
}

/* A list's signature: per tensor dtype, device type, device index, rank, then its sizes
 * (int64 each). 1: some tensor has none (not of a plain type, not contiguous, no
 * strides), -1: out of memory. */
static int shim_signature(PyObject *tensors, PyObject *plain, growbuf_t *out) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); i++) {
        PyObject *t = PyList_GET_ITEM(tensors, i);
        shim_facts_t f;
        if (!plain_type(t, plain) || shim_read(t, &f) || !f.contiguous) return 1;
        int64_t head[4] = {f.dtype, f.device_type, f.device_index, f.dim};
        if (grow_put(out, head, sizeof head) ||
            (f.dim && grow_put(out, f.sizes, sizeof(int64_t) * (size_t)f.dim))) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(shim_signature_doc,
    "shim_signature(tensors, plain) -> bytes | None\n\n"
    "What shim_pointers checks a later list against: each tensor's dtype, device and\n"
    "shape (int64s); None when a tensor is not of an exact type in plain, not contiguous or\n"
    "not strided.");

static PyObject *py_shim_signature(PyObject *self, PyObject *args) {
    PyObject *tensors, *plain;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &tensors, &PyTuple_Type, &plain)) {
        return NULL;
    }
    if (shim_unbound()) return NULL;
    growbuf_t out = {NULL, 0, 0};
    int found = shim_signature(tensors, plain, &out);
    PyObject *result = NULL;
    if (found < 0) goto done;
    if (found) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyBytes_FromStringAndSize(out.data ? out.data : "", (Py_ssize_t)out.len);
done:
    free(out.data);
    return result;
}

PyDoc_STRVAR(shim_pointers_doc,
    "shim_pointers(tensors, plain, signature) -> bytes | None\n\n"
    "Every tensor's address (int64, native order) when the list has this signature\n"
    "(shim_signature's) and each tensor is of an exact type in plain and contiguous; None at\n"
    "the first difference. No Python is called: the list cannot change while it is read.");

static PyObject *py_shim_pointers(PyObject *self, PyObject *args) {
    PyObject *tensors, *plain;
    const char *signature;
    Py_ssize_t length;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!y#", &PyList_Type, &tensors, &PyTuple_Type, &plain,
                          &signature, &length)) {
        return NULL;
    }
    if (shim_unbound()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tensors);
    const int64_t *expected = (const int64_t *)signature;
    size_t left = (size_t)length / sizeof(int64_t);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (out == NULL) return NULL;
    int64_t *pointers = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        shim_prefetch(tensors, plain, i);
        PyObject *t = PyList_GET_ITEM(tensors, i);
        shim_facts_t f;
        int same = plain_type(t, plain) && !shim_read(t, &f) && f.contiguous && left >= 4 &&
                   expected[0] == f.dtype && expected[1] == f.device_type &&
                   expected[2] == f.device_index && expected[3] == f.dim &&
                   left - 4 >= (size_t)f.dim &&
                   (f.dim == 0 || !memcmp(expected + 4, f.sizes, sizeof(int64_t) * (size_t)f.dim));
        if (!same) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        expected += 4 + f.dim;
        left -= 4 + (size_t)f.dim;
        pointers[i] = (int64_t)(intptr_t)f.address;
    }
    if (left) { /* a signature of a longer list */
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"set_path", py_set_path, METH_O, set_path_doc},
    {"set_layout", py_set_layout, METH_O, set_layout_doc},
    {"path", py_path, METH_NOARGS, path_doc},
    {"paths", py_paths, METH_NOARGS, paths_doc},
    {"stats", py_stats, METH_VARARGS, stats_doc},
    {"stats_batch", py_stats_batch, METH_VARARGS, stats_batch_doc},
    {"header_columns", py_header_columns, METH_VARARGS, header_columns_doc},
    {"tensor_facts", py_tensor_facts, METH_VARARGS, tensor_facts_doc},
    {"planned_pointers", py_planned_pointers, METH_VARARGS, planned_pointers_doc},
    {"bind_shim", py_bind_shim, METH_VARARGS, bind_shim_doc},
    {"shim_facts", py_shim_facts, METH_O, shim_facts_doc},
    {"shim_signature", py_shim_signature, METH_VARARGS, shim_signature_doc},
    {"shim_pointers", py_shim_pointers, METH_VARARGS, shim_pointers_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Single-pass CPU stats kernel (see gradaudit/native.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    isa = widest_isa();
    if (!(s_dtype = PyUnicode_InternFromString("dtype")) ||
        !(s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
        !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) ||
        !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
        !(s_shape = PyUnicode_InternFromString("shape"))) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", NATIVE_ABI) ||
        PyModule_AddIntConstant(m, "F32", DT_F32) || PyModule_AddIntConstant(m, "F64", DT_F64) ||
        PyModule_AddIntConstant(m, "F16", DT_F16) || PyModule_AddIntConstant(m, "BF16", DT_BF16) ||
        PyModule_AddIntConstant(m, "E4M3", DT_E4M3) || PyModule_AddIntConstant(m, "E5M2", DT_E5M2)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
