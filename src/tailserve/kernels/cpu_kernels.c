/* tailserve's fused CPU kernels: the small per-layer ops of a step one call each, paged decode
 * attention, and (with AMX) paged prompt attention and the int4 layer and Q8_0 head matmuls. See
 * docs/ENGINE.md.
 *
 * Built at first use by cpu_kernels.py (cc -O3 -march=native -ffast-math, cached by source hash)
 * and called through ctypes on raw tensor pointers. Every kernel is row-wise (or per sequence and
 * head), so a row's result never depends on the other rows of the batch. bf16 is carried as
 * uint16_t and rounded to nearest even, as torch does; arithmetic inside a kernel is float32.
 * -ffast-math assumes finite values: a NaN in the activations is already a broken model.
 */
#define _GNU_SOURCE /* syscall() */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef uint16_t bf16;

/* What the build has for the tile kernels (see ts_q4_matmul): AMX, else AVX512-BF16 dot products. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TS_AMX 1
#endif
#if defined(__AVX512BF16__)
#define TS_DPBF16 1
#endif

static inline float bf16_to_f32(bf16 x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

static inline bf16 f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((v.u >> 16) | 0x40u); /* quiet NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (bf16)((v.u + rounding) >> 16);
}

int ts_abi_version(void) { return 7; }

/* --- Threads: the matmuls and decode attention split their independent outputs -----------------
 *
 * A job is n chunks (output tiles, rows, or a sequence's segment of keys), claimed one at a time
 * from a shared counter by the threads of an OpenMP team, so a thread slowed by a busy or stolen
 * core takes fewer. Each chunk writes its own outputs (decode attention's segments their own
 * partials, combined in a fixed order): results are the same bits at any thread count. The team is
 * torch's own: torch loads its libgomp first and this library binds to the loaded copy (same
 * soname), so torch's ops and these kernels share one set of threads instead of two pools spinning
 * against each other on the same cores. Built without OpenMP (no libgomp for the compiler), every
 * job runs on the caller's thread. */
typedef void (*chunk_fn)(const void *job, int64_t chunk);

/* Threads a kernel uses, the caller's included (ts_set_threads): the calling thread's own, so two
 * threads can run kernels side by side with a share of the cores each (the engine's prefill lane). */
static __thread int pool_threads = 1;

/* Threads the kernels called from this thread use from now on (1: the caller's alone); returns the
 * count in effect. */
int ts_set_threads(int n) {
#if defined(_OPENMP)
    pool_threads = n < 1 ? 1 : n > 256 ? 256 : n;
#else
    (void)n;
    pool_threads = 1;
#endif
    return pool_threads;
}

int ts_threads(void) { return pool_threads; }

/* Run chunks 0 .. n-1 of a job over the kernels' threads. */
static void parallel_chunks(chunk_fn run, const void *args, int64_t n) {
    const int threads = n < pool_threads ? (int)n : pool_threads;
    if (threads <= 1) {
        for (int64_t c = 0; c < n; c++) run(args, c);
        return;
    }
#if defined(_OPENMP)
    _Atomic int64_t next = 0;
#pragma omp parallel num_threads(threads)
    for (int64_t c; (c = atomic_fetch_add_explicit(&next, 1, memory_order_relaxed)) < n;) run(args, c);
#endif
}

/* Chunks of about `per` items out of `items`, at least one per thread where items allow. */
static inline int64_t chunk_count(int64_t items, int64_t per) {
    int64_t n = (items + per - 1) / per;
    return n < 1 ? 1 : n;
}

/* Row-wise kernels split into chunks of rows once a call is big enough (prompt rows) to pay for
 * waking the team; a decode step's few rows stay on the caller's thread. */
#define ROW_SPLIT_ELEMENTS (1 << 16)
typedef void (*rows_fn)(const void *args, int64_t r0, int64_t r1);
typedef struct {
    rows_fn run;
    const void *args;
    int64_t rows, per;
} rows_job;

static void rows_chunk(const void *arg, int64_t chunk) {
    const rows_job *j = (const rows_job *)arg;
    const int64_t r0 = chunk * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    j->run(j->args, r0, r1);
}

static void parallel_rows(rows_fn run, const void *args, int64_t rows, int64_t width) {
    if (pool_threads <= 1 || rows * width < ROW_SPLIT_ELEMENTS) {
        run(args, 0, rows);
        return;
    }
    int64_t per = rows / (4 * (int64_t)pool_threads);
    per = per < 1 ? 1 : per;
    const rows_job job = {run, args, rows, per};
    parallel_chunks(rows_chunk, &job, chunk_count(rows, per));
}

typedef struct {
    float *h;
    const bf16 *delta;
    int64_t delta_stride, dim;
    const float *w;
    bf16 *out;
    float eps;
} norm_args;

static void rms_norm_rows(const void *arg, int64_t r0, int64_t r1) {
    const norm_args *a = (const norm_args *)arg;
    const int64_t dim = a->dim;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->h + r * dim;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + a->eps);
        bf16 *o = a->out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = f32_to_bf16(x[i] * inv * a->w[i]);
    }
}

/* out[r] = bf16(h[r] * rsqrt(mean(h[r]^2) + eps) * w), h float32 [rows, dim]. */
void ts_rms_norm(const float *h, const float *w, bf16 *out, int64_t rows, int64_t dim, float eps) {
    const norm_args a = {(float *)h, NULL, 0, dim, w, out, eps};
    parallel_rows(rms_norm_rows, &a, rows, dim);
}

static void add_rms_norm_rows(const void *arg, int64_t r0, int64_t r1) {
    const norm_args *a = (const norm_args *)arg;
    const int64_t dim = a->dim;
    for (int64_t r = r0; r < r1; r++) {
        float *x = a->h + r * dim;
        const bf16 *d = a->delta + r * a->delta_stride;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float v = x[i] + bf16_to_f32(d[i]);
            x[i] = v;
            ss += v * v;
        }
        if (a->w == NULL) continue;
        float inv = 1.0f / sqrtf(ss / (float)dim + a->eps);
        bf16 *o = a->out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = f32_to_bf16(x[i] * inv * a->w[i]);
    }
}

/* The residual add after a sublayer, then (if w) the next norm:
 * h[r] += delta[r] (bf16, row stride delta_stride); out[r] = bf16(rms_norm(h[r]) * w). */
void ts_add_rms_norm(float *h, const bf16 *delta, int64_t delta_stride, const float *w, bf16 *out,
                     int64_t rows, int64_t dim, float eps) {
    const norm_args a = {h, delta, delta_stride, dim, w, out, eps};
    parallel_rows(add_rms_norm_rows, &a, rows, dim);
}

/* Rotary embedding (rotate-half layout) of q and k in place inside the fused qkv rows, then the
 * rotated k and the v of every row written to the cache at its slot.
 * qkv bf16 [rows, (heads + 2 * kv_heads) * dim]; cos_half / sin_half float32 [positions, dim / 2];
 * k_cache / v_cache bf16 [slots, kv_heads, dim]. */
typedef struct {
    bf16 *qkv;
    const int64_t *positions, *slots;
    const float *cos_half, *sin_half;
    bf16 *k_cache, *v_cache;
    int64_t heads, kv_heads, dim;
} rope_args;

static void rope_write_kv_rows(const void *arg, int64_t r0, int64_t r1) {
    const rope_args *a = (const rope_args *)arg;
    const int64_t dim = a->dim, half = dim / 2, heads = a->heads, kv_heads = a->kv_heads;
    const int64_t width = (heads + 2 * kv_heads) * dim;
    const int64_t kv_width = kv_heads * dim;
    for (int64_t r = r0; r < r1; r++) {
        bf16 *row = a->qkv + r * width;
        const float *c = a->cos_half + a->positions[r] * half;
        const float *s = a->sin_half + a->positions[r] * half;
        for (int64_t hd = 0; hd < heads + kv_heads; hd++) {
            bf16 *x = row + hd * dim;
            for (int64_t i = 0; i < half; i++) {
                float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(x1 * c[i] - x2 * s[i]);
                x[i + half] = f32_to_bf16(x2 * c[i] + x1 * s[i]);
            }
        }
        memcpy(a->k_cache + a->slots[r] * kv_width, row + heads * dim, (size_t)kv_width * sizeof(bf16));
        memcpy(a->v_cache + a->slots[r] * kv_width, row + (heads + kv_heads) * dim, (size_t)kv_width * sizeof(bf16));
    }
}

/* Rows split over the pool like the norms: every row writes its own cache slot. */
void ts_rope_write_kv(bf16 *qkv, const int64_t *positions, const float *cos_half, const float *sin_half,
                      const int64_t *slots, bf16 *k_cache, bf16 *v_cache, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t dim) {
    const rope_args a = {qkv, positions, slots, cos_half, sin_half, k_cache, v_cache, heads, kv_heads, dim};
    parallel_rows(rope_write_kv_rows, &a, rows, (heads + 2 * kv_heads) * dim);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 bf16 values at p, widened to float32. */
static inline __m512 load16_bf16(const bf16 *p) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* 16 float32 values rounded to bf16 at p, as f32_to_bf16 rounds each (nearest even, NaN quiet). */
static inline void store16_bf16(bf16 *p, __m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

/* e^x, 16 at a time: 2^(x log2 e) split into 2^n 2^f, the fraction by its Taylor series. */
static inline __m512 exp512(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n); /* 2^t = 2^n * 2^f, |f| <= 1/2; 2^f = e^(f ln 2), Taylor to f^7 */
    __m512 p = _mm512_set1_ps(1.5252734e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* 2^t for t < 127 (or very negative: 0): 2^floor(t) times a degree-4 fit of 2^f on f = t - floor(t)
 * in [0, 1) (relative error < 3e-6, far below P's bf16 rounding): six vector operations where the
 * degree-5 Taylor on |f| <= 1/2 it replaced took eight, in the prompt kernel's largest single cost. */
static inline __m512 exp2_512(__m512 t) {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF); /* t - floor(t) */
    __m512 p = _mm512_set1_ps(1.3520600e-02f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2037430e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4142749e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300662e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000025f));
    return _mm512_scalef_ps(p, t); /* p 2^floor(t) */
}
#endif

#if defined(TS_AMX)

/* bf16(silu(g) * u) at p, 16 lanes: e = e^-g by exp2_512 (its exponent -g log2 e clamped to 126, so
 * e and 1 + e stay finite), the quotient g u / (1 + e) by a reciprocal estimate and one Newton step
 * on it (within a float32 ulp or two of the division), rounded to nearest even by VCVTNEPS2BF16
 * (which flushes results below 2^-126 to zero). 14 vector operations and the rounding where
 * exp512, a division and the integer rounding took ~28: this is the int4 gate|up prompt rows'
 * epilogue, where vector work adds to the tile products' time rather than overlapping it. Below
 * g = -87 the result is 0, where the division form gives NaN (-ffast-math makes a vector division a
 * reciprocal estimate and a Newton step: an overflowed e^-g times a zero reciprocal), in the
 * AVX-512 loop and in the compiler-vectorized scalar loop alike. */
static inline void store16_silu_mul(bf16 *p, __m512 g, __m512 u) {
    const __m512 t = _mm512_min_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f)), _mm512_set1_ps(126.0f));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp2_512(t));
    const __m512 a = _mm512_mul_ps(g, u);
    const __m512 r = _mm512_rcp14_ps(d);
    const __m512 y0 = _mm512_mul_ps(a, r);
    const __m512 y = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, y0, a), y0);
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(y));
}
#endif

typedef struct {
    const bf16 *gu;
    bf16 *out;
    int64_t inter;
} silu_args;

/* Rows of out = bf16(silu(gate) * up), the float32 arithmetic of the scalar loop 16 lanes at a time
 * where AVX-512 is (e^-x from exp512, within a few float32 ulps of expf: the same bf16 result but
 * for rare last-bit ties; e^-g clamped at e^80, so gates far below zero give ~0, not NaN). Builds with AMX run
 * store16_silu_mul instead (as close to the formula, 0 for such gates; a row's last inter % 16
 * still run the scalar loop), the arithmetic of the int4 gate|up prompt rows' fused epilogue, so the
 * two paths keep the same bits. */
static void silu_mul_rows(const void *arg, int64_t r0, int64_t r1) {
    const silu_args *a = (const silu_args *)arg;
    const int64_t inter = a->inter;
    for (int64_t r = r0; r < r1; r++) {
        const bf16 *g = a->gu + r * 2 * inter;
        const bf16 *u = g + inter;
        bf16 *o = a->out + r * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= inter; i += 16) {
#if defined(TS_AMX)
            (void)one;
            store16_silu_mul(o + i, load16_bf16(g + i), load16_bf16(u + i));
#else
            const __m512 x = load16_bf16(g + i);
            /* -x clamped to 80: e^-x stays finite, so the division (a reciprocal and a Newton step
             * under -ffast-math) gives ~0 for very negative gates, not inf x 0 = NaN. */
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(80.0f)));
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
            store16_bf16(o + i, _mm512_mul_ps(silu, load16_bf16(u + i)));
#endif
        }
#endif
        for (; i < inter; i++) {
            float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(x / (1.0f + expf(fminf(-x, 80.0f))) * bf16_to_f32(u[i]));
        }
    }
}

/* out[r, i] = bf16(silu(gu[r, i]) * gu[r, inter + i]), gu bf16 [rows, 2 * inter] (gate | up). */
void ts_silu_mul(const bf16 *gu, bf16 *out, int64_t rows, int64_t inter) {
    const silu_args a = {gu, out, inter};
    parallel_rows(silu_mul_rows, &a, rows, 2 * inter);
}

/* scores[j] = q[j] . k over dim for the `group` query heads that share the key row k. */
static inline __attribute__((always_inline)) void dot_group(const float *qf, const bf16 *k, int64_t group, int64_t dim, float *scores,
                             int64_t score_stride) {
#if defined(__AVX512F__)
    if (dim % 16 == 0 && dim <= 256) {
        __m512 kv[16];
        const int64_t n = dim / 16;
        for (int64_t v = 0; v < n; v++) kv[v] = load16_bf16(k + 16 * v);
        for (int64_t j = 0; j < group; j++) {
            const float *qj = qf + j * dim;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
            for (int64_t v = 1; v < n; v++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * v), kv[v], acc);
            scores[j * score_stride] = _mm512_reduce_add_ps(acc);
        }
        return;
    }
#endif
    for (int64_t j = 0; j < group; j++) {
        const float *qj = qf + j * dim;
        float dot = 0.0f;
        for (int64_t i = 0; i < dim; i++) dot += qj[i] * bf16_to_f32(k[i]);
        scores[j * score_stride] = dot;
    }
}

/* acc[j] += p[j] * v over dim for the `group` query heads that share the value row v. */
static inline __attribute__((always_inline)) void axpy_group(float *acc, const bf16 *v, const float *p, int64_t p_stride, int64_t group,
                              int64_t dim) {
#if defined(__AVX512F__)
    if (dim % 16 == 0 && dim <= 256) {
        __m512 vv[16];
        const int64_t n = dim / 16;
        for (int64_t x = 0; x < n; x++) vv[x] = load16_bf16(v + 16 * x);
        for (int64_t j = 0; j < group; j++) {
            const __m512 pj = _mm512_set1_ps(p[j * p_stride]);
            float *a = acc + j * dim;
            for (int64_t x = 0; x < n; x++)
                _mm512_storeu_ps(a + 16 * x, _mm512_fmadd_ps(pj, vv[x], _mm512_loadu_ps(a + 16 * x)));
        }
        return;
    }
#endif
    for (int64_t j = 0; j < group; j++) {
        const float pj = p[j * p_stride];
        float *a = acc + j * dim;
        for (int64_t i = 0; i < dim; i++) a[i] += pj * bf16_to_f32(v[i]);
    }
}

/* --- Decode attention, split into key segments ---------------------------------------------------
 *
 * A sequence's keys are cut into segments of DA_SEGMENT_KEYS at absolute positions 0, 256, 512, ...,
 * and each (sequence, segment) is one work item for the threads, so one long sequence spreads over
 * every thread instead of keeping one busy while the others idle. An item leaves its segment's
 * partial softmax, per query head h (a segment's `partial`, heads * (dim + 2) floats):
 *   partial[h]                  m, the largest of its scores
 *   partial[heads + h]          l, the sum of e^(s - m) over its keys
 *   partial[2 heads + h dim ..] acc, the sum of e^(s - m) v over its keys (dim floats)
 * and the sequence's segments are combined in segment order (combine_segments). An item's arithmetic
 * depends on its keys and q alone and the order is fixed, so the bits are the same at any thread
 * count and beside any other sequences. A multiple of 16 (the AMX scores' tiles of 16 keys); 256
 * cuts a 1,000-2,000-key chat context into 4-8 items, enough to even out 2-3 threads, while an
 * item's fixed cost (q converted, a partial written, the combine) stays small next to reading its
 * keys and values (192 KB at 3 kv heads of 64). */
#define DA_SEGMENT_KEYS 256

#if defined(__AVX512F__)
/* Scores of the GROUP query heads of one kv head over its paged keys k0 .. k1 - 1 (key t's at
 * scores[j * score_stride + t - k0]), q vectors held in registers. */
static inline __attribute__((always_inline)) void qk_avx512(
    const float *qf, const bf16 *k_cache, const int64_t *table, int64_t k0, int64_t k1, int64_t kv_width,
    int64_t block_size, float *scores, int64_t score_stride, int64_t group, int64_t dim) {
    __m512 qv[4][8];
    const int64_t n = dim / 16;
    for (int64_t j = 0; j < group; j++)
        for (int64_t v = 0; v < n; v++) qv[j][v] = _mm512_loadu_ps(qf + j * dim + 16 * v);
    for (int64_t t0 = k0, m; t0 < k1; t0 += m) {
        const int64_t r0 = t0 % block_size;
        const bf16 *rows = k_cache + (table[t0 / block_size] * block_size + r0) * kv_width;
        float *s = scores + (t0 - k0);
        m = block_size - r0 < k1 - t0 ? block_size - r0 : k1 - t0;
        for (int64_t t = 0; t < m; t++) {
            const bf16 *k = rows + t * kv_width;
            __m512 kv[8];
            for (int64_t v = 0; v < n; v++) kv[v] = load16_bf16(k + 16 * v);
            for (int64_t j = 0; j < group; j++) {
                __m512 acc = _mm512_mul_ps(qv[j][0], kv[0]);
                for (int64_t v = 1; v < n; v++) acc = _mm512_fmadd_ps(qv[j][v], kv[v], acc);
                s[j * score_stride + t] = _mm512_reduce_add_ps(acc);
            }
        }
    }
}

/* acc_out = sum_t p[t] v[t] over keys k0 .. k1 - 1 (key t's weight for head j at
 * p[j * p_head_stride + (t - k0) * p_key_stride]) for the GROUP query heads of one kv head,
 * accumulators in registers. The head's value rows two blocks on (inside the segment) are asked for
 * into L1 at each block: a decode step reads every sequence's cache from memory, from blocks
 * wherever the pool put them, and the values' loads were the decode attention's stalls (2 sequences
 * x 30 layers, random blocks, 1 thread, 2026-12-05: 1,000 keys 0.88-0.94x, 2,000 keys 0.68-0.74x;
 * keys prefetched too in the AMX scores: no better). */
static inline __attribute__((always_inline)) void pv_avx512(
    const float *p, const bf16 *v_cache, const int64_t *table, int64_t k0, int64_t k1, int64_t kv_width,
    int64_t block_size, int64_t p_head_stride, int64_t p_key_stride, float *acc_out, int64_t group, int64_t dim) {
    __m512 acc[4][8];
    const int64_t n = dim / 16;
    for (int64_t j = 0; j < group; j++)
        for (int64_t x = 0; x < n; x++) acc[j][x] = _mm512_setzero_ps();
    for (int64_t t0 = k0, m; t0 < k1; t0 += m) {
        const int64_t r0 = t0 % block_size, ahead = t0 - r0 + 2 * block_size;
        const bf16 *rows = v_cache + (table[t0 / block_size] * block_size + r0) * kv_width;
        const float *pt = p + (t0 - k0) * p_key_stride;
        m = block_size - r0 < k1 - t0 ? block_size - r0 : k1 - t0;
        if (ahead < k1) { /* this head's values two blocks on */
            const int64_t n_ahead = k1 - ahead < block_size ? k1 - ahead : block_size;
            const bf16 *next = v_cache + table[ahead / block_size] * block_size * kv_width;
            for (int64_t t = 0; t < n_ahead; t++)
                for (int64_t i = 0; i < dim; i += 32) __builtin_prefetch(next + t * kv_width + i, 0, 3);
        }
        for (int64_t t = 0; t < m; t++) {
            const bf16 *vr = rows + t * kv_width;
            __m512 vv[8];
            for (int64_t x = 0; x < n; x++) vv[x] = load16_bf16(vr + 16 * x);
            for (int64_t j = 0; j < group; j++) {
                const __m512 pj = _mm512_set1_ps(pt[j * p_head_stride + t * p_key_stride]);
                for (int64_t x = 0; x < n; x++) acc[j][x] = _mm512_fmadd_ps(pj, vv[x], acc[j][x]);
            }
        }
    }
    for (int64_t j = 0; j < group; j++)
        for (int64_t x = 0; x < n; x++) _mm512_storeu_ps(acc_out + j * dim + 16 * x, acc[j][x]);
}
#endif

/* Cache row of key t (its first kv head) through the sequence's block table. */
static inline const bf16 *cache_row(const bf16 *cache, const int64_t *table, int64_t t, int64_t block_size,
                                    int64_t kv_width) {
    return cache + (table[t / block_size] * block_size + t % block_size) * kv_width;
}

/* The partial (see DA_SEGMENT_KEYS) of keys k0 .. k1 - 1 of one sequence, scores [heads, DA_SEGMENT_KEYS]
 * on AVX-512 dot products or portable loops; inlined per head_dim so the row loops unroll. */
static inline __attribute__((always_inline)) void attend_segment(
    const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *table, int64_t k0, int64_t k1,
    int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale, float *scores, float *qf,
    float *partial) {
    const int64_t group = heads / kv_heads, kv_width = kv_heads * dim, n = k1 - k0, stride = DA_SEGMENT_KEYS;
    float *acc = partial + 2 * heads;
    for (int64_t i = 0; i < heads * dim; i++) qf[i] = bf16_to_f32(q[i]) * scale;
#if defined(__AVX512F__)
    const int fast = dim % 16 == 0 && dim <= 128 && group <= 4;
#else
    const int fast = 0;
#endif
    if (fast) {
#if defined(__AVX512F__)
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *qg = qf + g * group * dim;
            const bf16 *kg = k_cache + g * dim;
            float *sg = scores + g * group * stride;
            switch (group) { /* a constant group size lets the q registers stay registers */
            case 1: qk_avx512(qg, kg, table, k0, k1, kv_width, block_size, sg, stride, 1, dim); break;
            case 2: qk_avx512(qg, kg, table, k0, k1, kv_width, block_size, sg, stride, 2, dim); break;
            case 3: qk_avx512(qg, kg, table, k0, k1, kv_width, block_size, sg, stride, 3, dim); break;
            default: qk_avx512(qg, kg, table, k0, k1, kv_width, block_size, sg, stride, 4, dim);
            }
        }
#endif
    } else {
        for (int64_t t = k0; t < k1; t++) {
            const bf16 *row = cache_row(k_cache, table, t, block_size, kv_width);
            for (int64_t g = 0; g < kv_heads; g++)
                dot_group(qf + g * group * dim, row + g * dim, group, dim, scores + g * group * stride + t - k0,
                          stride);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *sc = scores + h * stride;
        float top = -FLT_MAX;
        for (int64_t t = 0; t < n; t++) top = sc[t] > top ? sc[t] : top;
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            sc[t] = expf(sc[t] - top);
            sum += sc[t];
        }
        partial[h] = top;
        partial[heads + h] = sum;
    }
    if (fast) {
#if defined(__AVX512F__)
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *pg = scores + g * group * stride;
            const bf16 *vg = v_cache + g * dim;
            float *ag = acc + g * group * dim;
            switch (group) {
            case 1: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, stride, 1, ag, 1, dim); break;
            case 2: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, stride, 1, ag, 2, dim); break;
            case 3: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, stride, 1, ag, 3, dim); break;
            default: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, stride, 1, ag, 4, dim);
            }
        }
#endif
    } else {
        memset(acc, 0, (size_t)(heads * dim) * sizeof(float));
        for (int64_t t = k0; t < k1; t++) {
            const bf16 *row = cache_row(v_cache, table, t, block_size, kv_width);
            for (int64_t g = 0; g < kv_heads; g++)
                axpy_group(acc + g * group * dim, row + g * dim, scores + g * group * stride + t - k0, stride, group,
                           dim);
        }
    }
}

/* out (bf16 [heads, dim]) = one sequence's attention from its segments' partials (one after another,
 * `segments` of them), taken in segment order: each rescaled by e^(m_i - m) to the largest maximum m,
 * the sums l and the weighted values added up, then acc / l. One segment gives its acc / l as it is
 * (e^0 = 1). The first partial's acc is overwritten. */
static void combine_segments(float *partials, int64_t segments, int64_t heads, int64_t dim, bf16 *out) {
    const int64_t stride = heads * (dim + 2);
    for (int64_t h = 0; h < heads; h++) {
        float top = -FLT_MAX;
        for (int64_t i = 0; i < segments; i++) top = partials[i * stride + h] > top ? partials[i * stride + h] : top;
        float *acc = partials + 2 * heads + h * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < segments; i++) {
            const float *p = partials + i * stride, *a = p + 2 * heads + h * dim;
            const float w = expf(p[h] - top);
            sum += p[heads + h] * w;
            if (i == 0)
                for (int64_t x = 0; x < dim; x++) acc[x] *= w;
            else
                for (int64_t x = 0; x < dim; x++) acc[x] += a[x] * w;
        }
        const float inv = 1.0f / sum;
        for (int64_t x = 0; x < dim; x++) out[h * dim + x] = f32_to_bf16(acc[x] * inv);
    }
}

/* --- Matmuls on bf16 tiles: int4 layer weights and the int8 LM head, exact to the file's blocks ---
 *
 * Both take bf16 activations x [rows, k] and weights in groups of 32 along k, each group of each
 * output with its own float32 scale: w = scale * q (+ min). Per block of 16 output channels and
 * group, the codes are widened into a bf16 tile (exactly: |q| <= 255 fits bf16's 8 significant
 * bits), multiplied with up to 16 rows at once with float32 sums, and the group's scale is applied
 * to the float32 result, so nothing is rounded but x (already bf16) and the output. Rows are
 * independent: a row's result does not depend on the other rows. k must be a multiple of 32, n_out of
 * 16. The tile product runs on AMX (TDPBF16PS) where the CPU has it and the OS grants tile data
 * (ts_amx_init asks), else on AVX512-BF16 dot products (VDPBF16PS: AMD Zen 4, Intel Cooper Lake):
 * the same packed weights and the same sums per group, in another order (a few float32 ulps apart).
 * ts_tile_isa says which runs. */
#define TILE_N 16
#define GROUP_K 32

static int amx_ready = 0; /* set by ts_amx_init once the OS granted tile data */

int ts_amx_init(void) {
#if defined(TS_AMX)
    amx_ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_ready;
#else
    return 0;
#endif
}

/* A decode step reads each layer's weights once, from memory, and the hardware prefetcher alone
 * kept too few lines in flight; so the decode kernels (amx_tile, dp_tile) ask for the weights
 * 32 KB ahead of the group they widen into L2 and 4 KB ahead into L1 (past a tile's end, the next
 * tile's, which the next pass widens). 1 thread, 1-4 rows, 2026-12-05: one prefetch 8 KB ahead
 * into L1 on the old AMX schedule: 30 layers 0.85-0.88x, head 0.78-0.82x (AVX512-BF16 build:
 * 0.78-0.83x both); 1 KB or 16 KB ahead did less well; the two levels 0.95-0.97x of 8 KB into L1. */
static inline void prefetch_weights(const uint8_t *group, int group_bytes) {
    for (int i = 0; i < group_bytes; i += 64) {
        __builtin_prefetch(group + 32768 + i, 0, 2); /* prefetcht1 */
        __builtin_prefetch(group + 4096 + i, 0, 3);  /* prefetcht0 */
    }
}

#if defined(TS_DPBF16)
/* One group's B tile in registers: row i holds k-pair (2i, 2i + 1) of the group for the 16
 * outputs, element 2j + e = output j at k = 2i + e. q4: a nibble q becomes the bf16 number 128 + q
 * by OR-ing it into 0x4300 (the caller takes the 128 back out through sum(x)); q8: int8 -> float
 * -> bf16, exact. */
static inline void widen_q4_regs(const uint8_t *w, __m512i *b) {
    const __m512i low = _mm512_set1_epi16(0x000f), magic = _mm512_set1_epi16(0x4300);
    for (int c = 0; c < 8; c++) {
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + c * 32)));
        b[2 * c] = _mm512_ternarylogic_epi32(words, low, magic, 0xEA);
        b[2 * c + 1] = _mm512_or_si512(_mm512_srli_epi16(words, 4), magic);
    }
}

static inline void widen_q8_regs(const int8_t *w, __m512i *b) {
    for (int i = 0; i < 16; i++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + i * 32));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
        b[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
}

/* acc[r] (16 outputs) += d * c (+ m * xsum of the row's group g): one row's group on AVX512-BF16. */
static inline void dp_epilogue(__m512 c, __m512 d, __m512 m, int q4, const float *xsum, int64_t groups, int64_t g,
                               int64_t r, float *acc) {
    __m512 a = _mm512_loadu_ps(acc + r * 16);
    if (q4) a = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), a);
    _mm512_storeu_ps(acc + r * 16, _mm512_fmadd_ps(d, c, a));
}

/* acc [rows, 16] += the tile's outputs over all groups, on AVX512-BF16: per group, its B tile
 * widened once into registers, then each row's 16 x pairs broadcast against it (four float32
 * chains, summed in a fixed order) and the group's epilogue as on AMX. q4 as in amx_tile. */
static inline void dp_tile(const bf16 *x, int64_t k, const void *w, int q4, const float *scale,
                           const float *shifted_min, const float *xsum, float *acc, int64_t rows) {
    const int64_t groups = k / GROUP_K, group_bytes = q4 ? 256 : 512;
    const uint8_t *wb = (const uint8_t *)w;
    __m512i b[16];
    for (int64_t g = 0; g < groups; g++) {
        prefetch_weights(wb + g * group_bytes, (int)group_bytes);
        if (q4)
            widen_q4_regs(wb + g * group_bytes, b);
        else
            widen_q8_regs((const int8_t *)wb + g * group_bytes, b);
        const __m512 d = _mm512_loadu_ps(scale + g * 16);
        const __m512 m = q4 ? _mm512_loadu_ps(shifted_min + g * 16) : _mm512_setzero_ps();
        int64_t r = 0;
        for (; r + 1 < rows; r += 2) { /* two rows at a time: eight independent chains */
            const int32_t *xp = (const int32_t *)(x + r * k + g * GROUP_K); /* the row's 16 k-pairs */
            const int32_t *xq = (const int32_t *)(x + (r + 1) * k + g * GROUP_K);
            __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, e0 = c0, e1 = c0, e2 = c0, e3 = c0;
            for (int i = 0; i < 16; i += 4) {
                c0 = _mm512_dpbf16_ps(c0, (__m512bh)b[i], (__m512bh)_mm512_set1_epi32(xp[i]));
                e0 = _mm512_dpbf16_ps(e0, (__m512bh)b[i], (__m512bh)_mm512_set1_epi32(xq[i]));
                c1 = _mm512_dpbf16_ps(c1, (__m512bh)b[i + 1], (__m512bh)_mm512_set1_epi32(xp[i + 1]));
                e1 = _mm512_dpbf16_ps(e1, (__m512bh)b[i + 1], (__m512bh)_mm512_set1_epi32(xq[i + 1]));
                c2 = _mm512_dpbf16_ps(c2, (__m512bh)b[i + 2], (__m512bh)_mm512_set1_epi32(xp[i + 2]));
                e2 = _mm512_dpbf16_ps(e2, (__m512bh)b[i + 2], (__m512bh)_mm512_set1_epi32(xq[i + 2]));
                c3 = _mm512_dpbf16_ps(c3, (__m512bh)b[i + 3], (__m512bh)_mm512_set1_epi32(xp[i + 3]));
                e3 = _mm512_dpbf16_ps(e3, (__m512bh)b[i + 3], (__m512bh)_mm512_set1_epi32(xq[i + 3]));
            }
            dp_epilogue(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)), d, m, q4, xsum, groups, g, r, acc);
            dp_epilogue(_mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3)), d, m, q4, xsum, groups, g, r + 1, acc);
        }
        for (; r < rows; r++) {
            const int32_t *xp = (const int32_t *)(x + r * k + g * GROUP_K);
            __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
            for (int i = 0; i < 16; i += 4) {
                c0 = _mm512_dpbf16_ps(c0, (__m512bh)b[i], (__m512bh)_mm512_set1_epi32(xp[i]));
                c1 = _mm512_dpbf16_ps(c1, (__m512bh)b[i + 1], (__m512bh)_mm512_set1_epi32(xp[i + 1]));
                c2 = _mm512_dpbf16_ps(c2, (__m512bh)b[i + 2], (__m512bh)_mm512_set1_epi32(xp[i + 2]));
                c3 = _mm512_dpbf16_ps(c3, (__m512bh)b[i + 3], (__m512bh)_mm512_set1_epi32(xp[i + 3]));
            }
            dp_epilogue(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)), d, m, q4, xsum, groups, g, r, acc);
        }
    }
}
#endif

#if defined(TS_AMX)
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* LDTILECFG of `c`. GCC does not model the instruction as reading the 64 bytes, and at -O3 it has
 * dropped the stores that fill a config on the stack (seen: a fault on an uninitialised config), so
 * a compiler barrier keeps them. */
static inline void load_tile_config(const tile_config *c) {
    __asm__ __volatile__("" : : "r"(c) : "memory");
    _tile_loadconfig(c);
}

/* Two tile sets (amx_tile: a group's by its parity): tiles 0 / 3: C, rows x 16 float32; 1 / 4: A,
 * rows x 32 bf16; 2 / 5: B, 16 k-pairs x 16 outputs. */
static void amx_config(int64_t rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 6; i++) {
        c.rows[i] = i % 3 == 2 ? 16 : (uint8_t)rows;
        c.colsb[i] = 64;
    }
    load_tile_config(&c);
}

/* acc[r] (16 outputs) += scale * c[r] (+ shifted_min * xsum[r]): a group's float32 tile result scaled. */
static inline void amx_epilogue(const float *c_buf, float *acc, int64_t rows, const float *scale,
                                const float *shifted_min, const float *xsum, int64_t xsum_stride) {
    const __m512 d = _mm512_loadu_ps(scale);
    if (shifted_min != NULL) {
        const __m512 m = _mm512_loadu_ps(shifted_min);
        for (int64_t r = 0; r < rows; r++) {
            __m512 a = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * xsum_stride]), _mm512_loadu_ps(acc + r * 16));
            _mm512_storeu_ps(acc + r * 16, _mm512_fmadd_ps(d, _mm512_loadu_ps(c_buf + r * 16), a));
        }
    } else {
        for (int64_t r = 0; r < rows; r++)
            _mm512_storeu_ps(acc + r * 16, _mm512_fmadd_ps(d, _mm512_loadu_ps(c_buf + r * 16), _mm512_loadu_ps(acc + r * 16)));
    }
}

/* One group's B tile from its 8 packed k-quads (q4) or 16 k-pair rows (q8), into memory (AMX). */
static inline void widen_q4_group(const uint8_t *w, bf16 *b_tile) {
    __m512i b[16];
    widen_q4_regs(w, b);
    for (int i = 0; i < 16; i++) _mm512_store_si512(b_tile + i * 32, b[i]);
}

static inline void widen_q8_group(const int8_t *w, bf16 *b_tile) {
    __m512i b[16];
    widen_q8_regs(w, b);
    for (int i = 0; i < 16; i++) _mm512_store_si512(b_tile + i * 32, b[i]);
}


/* Groups widened ahead of their tile product in amx_tile. */
#define AMX_AHEAD 3

/* One group's B tile into b_tile (and the weights ahead of it asked for). */
static inline void widen_group(const uint8_t *w, int q4, bf16 *b_tile) {
    prefetch_weights(w, q4 ? 256 : 512);
    if (q4)
        widen_q4_group(w, b_tile);
    else
        widen_q8_group((const int8_t *)w, b_tile);
}

/* acc [rows, 16] += the tile's outputs over all groups. q4 (w uint8, 256 bytes a group, with
 * shifted_min and xsum) or q8 (w int8, 512 bytes a group). A tile load waits until the stores that
 * widened its B tile have left the core, and stores leave in program order, behind the previous
 * group's tile store, which waits for its product: widened just before its product, a group's
 * widening, product, store and epilogue ran as one chain (~24 ns a group at 1 row with the
 * weights in L2). So a group is widened AMX_AHEAD groups before its product (a ring of
 * AMX_AHEAD + 1 B buffers), and its epilogue runs after the next group's product (two C buffers,
 * on tile sets 0-2 and 3-5 by the group's parity): ~16 ns. Each group's product still starts from
 * a zeroed C tile and the epilogues still add in group order: the bits are the same. */
static inline void amx_tile(const bf16 *x, int64_t k, const void *w, int q4, const float *scale,
                            const float *shifted_min, const float *xsum, float *acc, int64_t rows) {
    const int64_t groups = k / GROUP_K, group_bytes = q4 ? 256 : 512;
    const uint8_t *wb = (const uint8_t *)w;
    bf16 b[AMX_AHEAD + 1][16 * 32] __attribute__((aligned(64)));
    float c[2][16 * 16] __attribute__((aligned(64)));
    for (int64_t g = 0; g < AMX_AHEAD && g < groups; g++) widen_group(wb + g * group_bytes, q4, b[g]);
    for (int64_t g = 0; g <= groups; g++) {
        const int64_t ahead = g + AMX_AHEAD;
        if (ahead < groups) widen_group(wb + ahead * group_bytes, q4, b[ahead % (AMX_AHEAD + 1)]);
        if (g < groups) {
            const bf16 *bg = b[g % (AMX_AHEAD + 1)];
            if (g & 1) {
                _tile_loadd(4, x + g * GROUP_K, k * 2);
                _tile_loadd(5, bg, 64);
                _tile_zero(3);
                _tile_dpbf16ps(3, 4, 5);
                _tile_stored(3, c[1], 64);
            } else {
                _tile_loadd(1, x + g * GROUP_K, k * 2);
                _tile_loadd(2, bg, 64);
                _tile_zero(0);
                _tile_dpbf16ps(0, 1, 2);
                _tile_stored(0, c[0], 64);
            }
        }
        if (g == 0) continue;
        const int64_t e = g - 1; /* the previous group's epilogue, behind this group's product */
        amx_epilogue(c[e & 1], acc, rows, scale + e * 16, shifted_min ? shifted_min + e * 16 : NULL,
                     xsum ? xsum + e : NULL, groups);
    }
}

/* The partial (see DA_SEGMENT_KEYS) of keys k0 .. k1 - 1 of one sequence with the scores on AMX: per
 * 16 keys, S^T = K q^T is one tile product per kv head and 32 dims (A: 16 cache rows read in place,
 * B: that head group's q, transposed into the tile's pair layout in bq, zeros elsewhere), all kv
 * heads summed into one 16 keys x 16 heads tile, so no horizontal sums. Scores are [keys][16]
 * float32; the softmax runs over all heads at once; values stay on AVX-512 FMAs. Needs heads <= 16,
 * dim % 32 == 0, block_size % 16 == 0 (1: it ran). bq: kv_heads * dim / 32 * 512 bf16, already
 * holding this q's when bq_ready. */
static int attend_segment_amx(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *table,
                              int64_t k0, int64_t k1, int64_t heads, int64_t kv_heads, int64_t dim,
                              int64_t block_size, float scale, float *scores, bf16 *bq, int bq_ready,
                              float *partial) {
    if (!amx_ready || heads > 16 || dim % 32 != 0 || dim > 256 || block_size % 16 != 0) return 0;
    const int64_t group = heads / kv_heads, kv_width = kv_heads * dim, chunks = dim / 32, n = k1 - k0;
    if (!bq_ready) {
        memset(bq, 0, (size_t)(kv_heads * chunks * 512) * sizeof(bf16));
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t i = 0; i < 16; i++)
                    for (int64_t j = 0; j < group; j++) {
                        const int64_t h = g * group + j;
                        bf16 *row = bq + ((g * chunks + c) * 16 + i) * 32;
                        row[2 * h] = q[h * dim + c * 32 + 2 * i];
                        row[2 * h + 1] = q[h * dim + c * 32 + 2 * i + 1];
                    }
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    load_tile_config(&cfg);
    for (int64_t t0 = k0; t0 < k1; t0 += 16) { /* k0 % 16 == 0: 16 keys never cross a block */
        const bf16 *keys = cache_row(k_cache, table, t0, block_size, kv_width);
        /* The values of the segment's first two blocks, which pv_avx512 (asking two blocks ahead)
         * never asks for: two rows a tile into L2, so they come while the scores are made. */
        const int64_t first = k0 + (t0 - k0) / 8, last = k1 < k0 + 2 * block_size ? k1 : k0 + 2 * block_size;
        for (int64_t t = first; t < first + 2 && t < last; t++) {
            const bf16 *row = cache_row(v_cache, table, t, block_size, kv_width);
            for (int64_t i = 0; i < kv_width; i += 32) __builtin_prefetch(row + i, 0, 2);
        }
        _tile_zero(0);
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(1, keys + g * dim + c * 32, kv_width * 2);
                _tile_loadd(2, bq + (g * chunks + c) * 512, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
        _tile_stored(0, scores + (t0 - k0) * 16, 64); /* rows past k1: another segment's or sequence's: unused */
    }
    _tile_release();
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < n; t++) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(scores + t * 16), sc);
        _mm512_storeu_ps(scores + t * 16, v);
        top = _mm512_max_ps(top, v);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + t * 16), top));
        _mm512_storeu_ps(scores + t * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    float tops[16], sums[16];
    _mm512_storeu_ps(tops, top);
    _mm512_storeu_ps(sums, sum);
    for (int64_t h = 0; h < heads; h++) partial[h] = tops[h], partial[heads + h] = sums[h];
    for (int64_t g = 0; g < kv_heads; g++) {
        const float *pg = scores + g * group;
        float *ag = partial + 2 * heads + g * group * dim;
        const bf16 *vg = v_cache + g * dim;
        switch (group * 1000 + dim) { /* constant sizes keep the accumulators in registers */
        case 1064: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, 1, 16, ag, 1, 64); break;
        case 2064: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, 1, 16, ag, 2, 64); break;
        case 3064: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, 1, 16, ag, 3, 64); break;
        case 4064: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, 1, 16, ag, 4, 64); break;
        case 1128: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, 1, 16, ag, 1, 128); break;
        case 2128: pv_avx512(pg, vg, table, k0, k1, kv_width, block_size, 1, 16, ag, 2, 128); break;
        default:
            memset(ag, 0, (size_t)(group * dim) * sizeof(float));
            for (int64_t t = k0; t < k1; t++)
                axpy_group(ag, cache_row(vg, table, t, block_size, kv_width), pg + (t - k0) * 16, 1, group, dim);
        }
    }
    return 1;
}
#endif

/* Layer linears from Q4_0 / Q4_1 groups: w = scale * q + min, q in 0..15. y bf16 [rows, n_out] (+ bias).
 * Packed per 16 outputs and k-quad c: 32 bytes, byte 2j holding output j's codes for k = 4c and
 * 4c + 2 (low, high nibble), byte 2j + 1 those for 4c + 1 and 4c + 3. A nibble q widens to the bf16
 * number 128 + q by OR-ing it into 0x4300, so the tile sums (128 + q) x, and the caller passes
 * shifted_min = min - 128 * scale to take the 128 back out through sum(x) of the group.
 * scale / shifted_min float32 [n_out / 16, k / 32, 16]. */
#if defined(TS_DPBF16)
typedef struct {
    const bf16 *x;
    int64_t rows, k, n_out, tiles_per_chunk, tiles;
    const void *packed;
    const float *scale, *shifted_min, *xsum; /* shifted_min / xsum NULL: q8 */
    const bf16 *bias;
    void *y; /* bf16 (q4) or float32 (q8) [rows, n_out] */
} tile_job;

/* One chunk of ts_q4_matmul / ts_q8_matmul: its output tiles for every row, on AMX when `amx`. */
static inline void tile_chunk_on(const tile_job *j, int64_t chunk, int amx) {
    const int q4 = j->xsum != NULL;
    const int64_t groups = j->k / GROUP_K, t0 = chunk * j->tiles_per_chunk;
    const int64_t t1 = t0 + j->tiles_per_chunk < j->tiles ? t0 + j->tiles_per_chunk : j->tiles;
    const int64_t tile_bytes = q4 ? (j->k / 4) * 32 : groups * 512;
    float acc[16 * 16] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < j->rows; m0 += 16) {
        const int64_t mb = j->rows - m0 < 16 ? j->rows - m0 : 16;
#if defined(TS_AMX)
        if (amx) amx_config(mb);
#endif
        for (int64_t t = t0; t < t1; t++) {
            memset(acc, 0, sizeof acc);
            const uint8_t *w = (const uint8_t *)j->packed + t * tile_bytes;
            const float *scale = j->scale + t * groups * 16;
            const float *shifted_min = q4 ? j->shifted_min + t * groups * 16 : NULL;
            const float *xsum = q4 ? j->xsum + m0 * groups : NULL;
#if defined(TS_AMX)
            if (amx)
                amx_tile(j->x + m0 * j->k, j->k, w, q4, scale, shifted_min, xsum, acc, mb);
            else
#endif
                dp_tile(j->x + m0 * j->k, j->k, w, q4, scale, shifted_min, xsum, acc, mb);
            for (int64_t r = 0; r < mb; r++) {
                __m512 out = _mm512_loadu_ps(acc + r * 16);
                if (q4) {
                    if (j->bias != NULL) out = _mm512_add_ps(out, load16_bf16(j->bias + t * 16));
                    _mm256_storeu_si256((__m256i *)((bf16 *)j->y + (m0 + r) * j->n_out + t * 16),
                                        (__m256i)_mm512_cvtneps_pbh(out));
                } else {
                    _mm512_storeu_ps((float *)j->y + (m0 + r) * j->n_out + t * 16, out);
                }
            }
        }
    }
#if defined(TS_AMX)
    if (amx) _tile_release();
#else
    (void)amx;
#endif
}

static void tile_chunk(const void *arg, int64_t chunk) { tile_chunk_on((const tile_job *)arg, chunk, amx_ready); }

/* Output tiles per chunk: about four chunks a thread, so a late or slow thread is made up for. */
static inline int64_t tiles_per_chunk(int64_t tiles) {
    const int64_t want = 4 * (int64_t)pool_threads;
    const int64_t per = tiles / want;
    return pool_threads <= 1 ? tiles : per < 1 ? 1 : per;
}
#endif

/* Which tile product ts_q4_matmul / ts_q8_matmul run: 2 AMX, 1 AVX512-BF16, 0 none (the calls
 * then do nothing: the caller must not use them). Asks the OS for AMX tile data first. */
int ts_tile_isa(void) {
    if (ts_amx_init()) return 2;
#if defined(TS_DPBF16)
    return 1;
#else
    return 0;
#endif
}

void ts_q4_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *packed, const float *scale,
                  const float *shifted_min, const bf16 *bias, int64_t n_out, bf16 *y) {
#if defined(TS_DPBF16)
    const int64_t tiles = n_out / TILE_N, groups = k / GROUP_K;
    float *xsum = (float *)malloc((size_t)(rows * groups) * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = 0; i < GROUP_K; i++) s += bf16_to_f32(x[r * k + g * GROUP_K + i]);
            xsum[r * groups + g] = s;
        }
    const int64_t per = tiles_per_chunk(tiles);
    const tile_job job = {x, rows, k, n_out, per, tiles, packed, scale, shifted_min, xsum, bias, y};
    parallel_chunks(tile_chunk, &job, chunk_count(tiles, per));
    free(xsum);
#else
    (void)x, (void)rows, (void)k, (void)packed, (void)scale, (void)shifted_min, (void)bias, (void)n_out, (void)y;
#endif
}

/* Prompt rows from the same packed int4 groups: each group widened once per call to bf16 weights
 * (scale * q + min in float32, rounded once: the values of the dense bf16 copy, which is therefore
 * not kept), and the tile product summed over all groups in float32 with no per-group epilogue.
 * For many rows (a prompt chunk) this is ~2x ts_q4_matmul's speed and on a par with oneDNN's bf16
 * GEMM; decode rows keep the exact kernel. min is unshifted here. The codes go to 32-bit lanes by
 * one zero-extension of 16 bytes and a mask or a shift (were: bytes to words, words to dwords and an
 * extract, seven shuffles a 64 weights where two are now): 31 -> 27 ns a group, one thread, L2. */
#if defined(TS_AMX)
static inline void widen_q4_group_dense(const uint8_t *w, const float *scale, const float *min, bf16 *b_tile) {
    const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const __m512 d = _mm512_loadu_ps(scale), m = _mm512_loadu_ps(min);
    const __m512 d_lo = _mm512_permutexvar_ps(pairs_lo, d), d_hi = _mm512_permutexvar_ps(pairs_hi, d);
    const __m512 m_lo = _mm512_permutexvar_ps(pairs_lo, m), m_hi = _mm512_permutexvar_ps(pairs_hi, m);
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int64_t c = 0; c < 8; c++) { /* byte i: its low nibble lane i of row 2 c, its high one of row 2 c + 1 */
        const __m512i bytes_lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + c * 32)));
        const __m512i bytes_hi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + c * 32 + 16)));
        const __m512i halves[2][2] = {{_mm512_and_si512(bytes_lo, low), _mm512_and_si512(bytes_hi, low)},
                                      {_mm512_srli_epi32(bytes_lo, 4), _mm512_srli_epi32(bytes_hi, 4)}};
        for (int h = 0; h < 2; h++) {
            const __m512 w_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(halves[h][0]), d_lo, m_lo);
            const __m512 w_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(halves[h][1]), d_hi, m_hi);
            _mm512_store_si512(b_tile + (2 * c + h) * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
        }
    }
}
#endif

#if defined(TS_AMX)
typedef struct {
    const bf16 *x;
    int64_t rows, k, n_out, tiles;
    const uint8_t *packed;
    const float *scale, *min;
    const bf16 *bias;
    bf16 *y;
    int64_t pairs, pairs_per_chunk;
    int64_t row_block, row_blocks; /* chunk c: pairs of block c / row_blocks, rows of block c % row_blocks */
    int64_t call;                  /* this call's number: which widened weights a thread's buffer holds */
    int64_t second; /* a pair's second tile: 1 after its first, or the gate's tile count (silu) */
    int silu;       /* y = silu(gate) * up, the tiles of a pair being one gate tile and its up tile */
    int stream;     /* a pair's output lines written with non-temporal stores (see PREFILL_STREAM_BYTES) */
} prefill_job;

/* 32 rows x 16 outputs per C tile pair: tiles 0-3 are C (row half r, output tile p at 2 r + p),
 * 4 / 5 the two row halves' A, 6 / 7 the two output tiles' B. Every tile 16 rows. */
static void amx_config_2x2(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    load_tile_config(&c);
}

/* y[rows, 16] (output tile t) from a float32 tile result, + bias, rounded to bf16. */
static inline void prefill_store(const prefill_job *j, const float *c, int64_t m0, int64_t rows, int64_t t) {
    for (int64_t r = 0; r < rows; r++) {
        __m512 out = _mm512_loadu_ps(c + r * 16);
        if (j->bias != NULL) out = _mm512_add_ps(out, load16_bf16(j->bias + t * 16));
        _mm256_storeu_si256((__m256i *)(j->y + (m0 + r) * j->n_out + t * 16), (__m256i)_mm512_cvtneps_pbh(out));
    }
}

/* The same value through bf16 and back: what a bf16 tensor holds. */
static inline __m512 round_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* Output tile t of y = silu(gate) * up from gate tile t's and up tile t + second's float32 results:
 * each rounded to bf16 first (+ bias), then silu_mul_rows' arithmetic (store16_silu_mul), so the bits are
 * those of the gate|up matmul followed by ts_silu_mul. */
static inline void prefill_store_silu(const prefill_job *j, const float *cg, const float *cu, int64_t m0, int64_t rows,
                                      int64_t t) {
    for (int64_t r = 0; r < rows; r++) {
        __m512 g = _mm512_loadu_ps(cg + r * 16), u = _mm512_loadu_ps(cu + r * 16);
        if (j->bias != NULL) {
            g = _mm512_add_ps(g, load16_bf16(j->bias + t * 16));
            u = _mm512_add_ps(u, load16_bf16(j->bias + (t + j->second) * 16));
        }
        store16_silu_mul(j->y + (m0 + r) * j->n_out + t * 16, round_bf16(g), round_bf16(u));
    }
}

/* A pair's two 16-row results: stored as tiles t and t + second, or as silu(gate) * up at tile t. */
static inline void prefill_pair_out(const prefill_job *j, const float *ca, const float *cb, int64_t m0, int64_t rows,
                                    int64_t t) {
    if (j->silu) {
        prefill_store_silu(j, ca, cb, m0, rows, t);
    } else if (j->stream) { /* tiles t and t + 1: one 64-byte line of each row */
        for (int64_t r = 0; r < rows; r++) {
            __m512 a = _mm512_loadu_ps(ca + r * 16), b = _mm512_loadu_ps(cb + r * 16);
            if (j->bias != NULL) {
                a = _mm512_add_ps(a, load16_bf16(j->bias + t * 16));
                b = _mm512_add_ps(b, load16_bf16(j->bias + (t + 1) * 16));
            }
            _mm512_stream_si512((__m512i *)(j->y + (m0 + r) * j->n_out + t * 16), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    } else {
        prefill_store(j, ca, m0, rows, t);
        prefill_store(j, cb, m0, rows, t + j->second);
    }
}

/* A grow-only buffer per thread for a chunk's widened weights (see scratch_buf below), and which
 * call's pair block it holds (call -1: none), so a thread's next row block of the same pairs skips
 * the widening. */
static __thread struct {
    void *data;
    size_t bytes;
    int64_t call, pair_block;
} widened_scratch = {NULL, 0, -1, -1};

static bf16 *widened_buffer(size_t bytes) {
    if (bytes > widened_scratch.bytes) {
        free(widened_scratch.data);
        widened_scratch.data = aligned_alloc(64, (bytes + 63) / 64 * 64);
        widened_scratch.bytes = widened_scratch.data == NULL ? 0 : bytes;
        widened_scratch.call = -1;
    }
    return (bf16 *)widened_scratch.data;
}

/* Numbers the prompt-row calls (widened_scratch.call). */
static _Atomic int64_t prefill_calls;

/* Rows m0 .. m0 + rows - 1 (fewer than 32, or a lone last tile) of output tiles t, t + second (pair 2)
 * or t alone (pair 1) from their widened weights w0 / w1, 16 rows at a time through two C tiles. Each
 * output's sum runs over the groups in order in one C tile, as in prefill_block: the same bits for any
 * row count. `configured`: the tile configuration in force (rows a tile, 32 for the 2 x 2 one). */
static void prefill_rows(const prefill_job *j, int64_t m0, int64_t rows, int64_t t, int64_t pair, const bf16 *w0,
                         const bf16 *w1, int64_t *configured) {
    const int64_t k = j->k, groups = k / GROUP_K, end = m0 + rows;
    float c0[16 * 16] __attribute__((aligned(64))), c1[16 * 16] __attribute__((aligned(64)));
    for (; m0 < end; m0 += 16) {
        const int64_t mb = end - m0 < 16 ? end - m0 : 16;
        if (*configured != mb) amx_config(mb), *configured = mb;
        const bf16 *xb = j->x + m0 * k;
        _tile_zero(0);
        _tile_zero(3);
        for (int64_t g = 0; g < groups; g++) {
            _tile_loadd(1, xb + g * GROUP_K, k * 2);
            _tile_stream_loadd(2, w0 + g * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
            if (pair == 2) {
                _tile_stream_loadd(5, w1 + g * 512, 64);
                _tile_dpbf16ps(3, 1, 5);
            }
        }
        _tile_stored(0, c0, 64);
        if (pair == 2) {
            _tile_stored(3, c1, 64);
            prefill_pair_out(j, c0, c1, m0, mb, t);
        } else {
            prefill_store(j, c0, m0, mb, t);
        }
    }
}

/* A 32-row x pair block's float32 results waiting for their epilogue (t < 0: none): c0 | c1 | c2 | c3,
 * C tile 2 r + p holding row half r of the pair's tile p. */
typedef struct {
    float c[4 * 256] __attribute__((aligned(64)));
    int64_t m0, t;
} prefill_pending;

/* The epilogue of rows r0 .. r1 - 1 (of 32) of the pending block. */
static inline void prefill_pending_rows(const prefill_job *j, const prefill_pending *q, int64_t r0, int64_t r1) {
    if (r0 < 16) {
        const int64_t e = r1 < 16 ? r1 : 16;
        prefill_pair_out(j, q->c + r0 * 16, q->c + 256 + r0 * 16, q->m0 + r0, e - r0, q->t);
    }
    if (r1 > 16) {
        const int64_t s = r0 > 16 ? r0 : 16;
        prefill_pair_out(j, q->c + 512 + (s - 16) * 16, q->c + 768 + (s - 16) * 16, q->m0 + s, r1 - s, q->t);
    }
}

/* The pending block's whole epilogue, now. */
static inline void prefill_flush(const prefill_job *j, prefill_pending *q) {
    if (q->t >= 0) prefill_pending_rows(j, q, 0, 32);
    q->t = -1;
}

/* Rows m0 .. m0 + 31 of output tiles t, t + second from their widened weights w0 / w1 in one 2 x 2 block:
 * four C tiles (row half r, tile p at 2 r + p) fed by two A and two B tiles (each tile load serves two
 * products), every output summed over the groups in order in one C tile. The pending block's epilogue
 * (the previous block's results, already stored) is spread over this block's groups (1-2 rows a group
 * at k = 576), and this block's results become the pending ones. Why both, measured 2026-12-06 on the 2-vCPU
 * Sapphire Rapids VM (the 30 layers' matmuls, --silu, best of 7, against ead1c3d in one process):
 * - The B tiles load with the T1 hint (TILELOADDT1: reused, but not needed in the nearest cache). A
 *   pair's widened B at k = 576 is 36 KB, the 32-row A block 36 KB: both streaming through L1 (48 KB,
 *   12 ways) left 18 lines a set between two uses of an A line, so A came from L2 too, 4 KB a group
 *   where the hint leaves 2 KB. Alone: 0.83-0.86x at 256-1,600 rows on two threads, 0.87x at 256 on one.
 * - The epilogue: where it ran after the block's tile stores, the next block's products could not
 *   start until it had left the reorder buffer (~800 vector operations for a SiLU block's 32 rows),
 *   so vector and tile work took turns; a few rows between each group's products run in the shadow of
 *   the tile products instead. Alone: 0.85-0.89x on two threads, 0.89-0.91x at 256 rows on one.
 * Together: 0.73-0.77x at 256-1,600 rows on two threads, 0.73-0.78x at 256-512 rows on one; the prompt
 * step in process 0.79x at 512 tokens, 0.88x at 1,600 (see docs/ENGINE.md).
 * Tried and not kept (same runs): K in blocks of 9 groups through a per-pair buffer of partial sums (A
 * in L1 without the hint: 0.86-0.88x alone, but with the hint and the spread epilogue, blocking only
 * down's K = 1,536 into 3 was 0.74-0.80x against 0.73-0.78x without); two 2 x 1 blocks a pair on
 * alternating C tiles, so no block waits for the previous one's tile stores (A loaded twice a pair:
 * 1.06-1.16x without the hint, 0.88-0.96x with it); a pair's two tiles stored as one 64-byte line
 * (VCVTNE2PS2BF16) in the plain matmuls: 0.95-0.98x best of 7, medians 0.97-1.01x: noise. */
static void prefill_block(const prefill_job *j, int64_t m0, int64_t t, const bf16 *w0, const bf16 *w1,
                          prefill_pending *q, int64_t *configured) {
    const int64_t k = j->k, groups = k / GROUP_K;
    if (*configured != 32) amx_config_2x2(), *configured = 32;
    const bf16 *xa = j->x + m0 * k, *xb = xa + 16 * k;
    const int pending = q->t >= 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < groups; g++) {
        _tile_loadd(4, xa + g * GROUP_K, k * 2);
        _tile_stream_loadd(6, w0 + g * 512, 64);
        _tile_stream_loadd(7, w1 + g * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xb + g * GROUP_K, k * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (pending) prefill_pending_rows(j, q, g * 32 / groups, (g + 1) * 32 / groups);
    }
    _tile_stored(0, q->c, 64);
    _tile_stored(1, q->c + 256, 64);
    _tile_stored(2, q->c + 512, 64);
    _tile_stored(3, q->c + 768, 64);
    q->m0 = m0, q->t = t;
}

/* One chunk of ts_q4_prefill_matmul: `pairs_per_chunk` pairs of output tiles, their weights widened
 * once per thread (a thread that takes the same pairs' next row block reuses them), for a block of
 * rows (see prefill_run). The rows go PREFILL_ROW_STEP at a time through all the chunk's pairs before
 * the next step, so a step's activations are read from memory once per chunk and stay close across
 * its pairs (in L1 at k = 576: 36 KB) while the widened weights come from L2 (one pair a chunk over
 * all rows read every activation from memory per pair: at 1,600+ rows that, not the tile products,
 * was the matmul's time), and each output line is finished while it is still in L1: one pair
 * through blocks of 256 rows before the next wrote half of each line of the SiLU output, and the
 * other half after the line had left L1 (the fused kernel at 1,600 rows, one thread: ~5.65 -> ~5.35
 * ms with this order alone). */
#define PREFILL_ROW_STEP 32
static void prefill_chunk(const void *arg, int64_t chunk) {
    const prefill_job *j = (const prefill_job *)arg;
    const int64_t k = j->k, groups = k / GROUP_K, pairs = j->pairs;
    const int64_t pair_block = chunk / j->row_blocks, row_block = chunk % j->row_blocks;
    const int64_t p0 = pair_block * j->pairs_per_chunk;
    const int64_t p1 = p0 + j->pairs_per_chunk < pairs ? p0 + j->pairs_per_chunk : pairs;
    const int64_t r0 = row_block * j->row_block, r1 = r0 + j->row_block < j->rows ? r0 + j->row_block : j->rows;
    const int64_t tile_elems = groups * 512, step = j->silu ? 1 : 2;
    bf16 *widened = widened_buffer((size_t)(2 * (p1 - p0) * tile_elems) * sizeof(bf16));
    if (widened == NULL) abort();
    const int reuse = widened_scratch.call == j->call && widened_scratch.pair_block == pair_block;
    widened_scratch.call = j->call, widened_scratch.pair_block = pair_block;
    for (int64_t p = p0; p < p1 && !reuse; p++)
        for (int64_t half = 0; half < 2; half++) {
            const int64_t t = step * p + half * j->second;
            if (t >= j->tiles) continue;
            const uint8_t *w = j->packed + t * (k / 4) * 32;
            for (int64_t g = 0; g < groups; g++)
                widen_q4_group_dense(w + g * 256, j->scale + (t * groups + g) * 16, j->min + (t * groups + g) * 16,
                                     widened + (2 * (p - p0) + half) * tile_elems + g * 512);
        }
    int64_t configured = -1;
    prefill_pending pending;
    pending.t = -1;
    for (int64_t m0 = r0; m0 < r1; m0 += PREFILL_ROW_STEP) {
        const int64_t rows = r1 - m0 < PREFILL_ROW_STEP ? r1 - m0 : PREFILL_ROW_STEP;
        for (int64_t p = p0; p < p1; p++) {
            const int64_t t = step * p, pair = t + j->second < j->tiles ? 2 : 1;
            const bf16 *w0 = widened + 2 * (p - p0) * tile_elems;
            if (rows == 32 && pair == 2) {
                prefill_block(j, m0, t, w0, w0 + tile_elems, &pending, &configured);
            } else {
                prefill_flush(j, &pending);
                prefill_rows(j, m0, rows, t, pair, w0, w0 + tile_elems, &configured);
            }
        }
    }
    prefill_flush(j, &pending);
    if (j->stream) _mm_sfence();
    _tile_release();
}
#endif

#if defined(TS_AMX)
/* From this many bytes of output on (twice a core's L2), the plain matmul's output lines go out by
 * non-temporal stores, a pair's two tiles as one 64-byte line: no read for ownership of each line,
 * no eviction of the widened weights and activations the chunk still reads; the same bits. Two
 * threads, one layer at 4,000 rows (best of 20): qkv 2.11 -> 1.82 ms, o 1.18 -> 1.10, down 3.20 ->
 * 3.10 (one thread: 3.98 -> 3.34, 2.01 -> 2.05, 5.81 -> 5.59); a 4,000-token step in process 970 ->
 * 913 ms. Not below: from 2 MB on, a 2,000-token step was 383 -> 403 ms (the next kernel then reads
 * from memory an output it found in L3), and at 1,600 rows qkv alone 0.82 -> 0.84 ms. */
#define PREFILL_STREAM_BYTES (4 << 20)

/* The work split. Pairs a chunk: widened weights of at most ~768 KB (they stay in L2 beside a row
 * block), one pair a chunk for a few rows (nothing to reuse). Below PREFILL_SPLIT_ROWS rows a chunk
 * takes every row and there are at least 4 chunks a thread for balance. From PREFILL_SPLIT_ROWS rows
 * on, the chunks are pair blocks x row blocks of ~PREFILL_ROW_BLOCK rows: one pair block a thread
 * (when the 768 KB allow), the row blocks giving the balance. A chunk then writes longer runs of each
 * output row and reads fewer rows' activations per pair block; a thread widens a pair block once and
 * keeps it for the row blocks it takes after (chunks go pair block by pair block). Two threads,
 * one layer at 1,600 rows (best of 30, two runs each): qkv 0.97-1.06 -> 0.83-0.97 ms, o 0.62-0.69 ->
 * 0.51-0.54, down 1.43-1.52 -> 1.23-1.30, SiLU gate|up 2.62-2.69 -> 2.45-2.66; the 30 layers'
 * (benchmarks/kernel_ab.py --silu) 0.87x at 1,600 rows, 0.83x at 4,000, ~1.0x at 512-768 (so not
 * below 1,024: at 256 rows, one pair block a thread was 1.07x). Rows are independent: same bits.
 * Below PREFILL_SPLIT_ROWS the pairs a chunk may grow (up to 2x, within the 768 KB) where that gives
 * the busiest thread fewer pairs: o and down have 18 pairs, 9 chunks of 2 at two threads (one thread
 * took 5, the other 4), now 6 of 3 (down at 512 rows, 2 threads: 0.47 -> 0.44 ms). */
#define PREFILL_SPLIT_ROWS 1024
#define PREFILL_ROW_BLOCK 256
static void prefill_run(prefill_job *job) {
    const int split = job->rows >= PREFILL_SPLIT_ROWS;
    int64_t per = (768 << 10) / (2 * job->k * TILE_N * (int64_t)sizeof(bf16));
    const int64_t balance = job->pairs / ((split ? 1 : 4) * (int64_t)pool_threads);
    const int64_t cap = per;
    per = per < balance ? per : balance;
    if (!split && per >= 1 && pool_threads > 1) { /* see PREFILL_SPLIT_ROWS: the busiest thread's pairs */
        int64_t best = per, least = INT64_MAX;
        for (int64_t p = per; p <= cap && p <= 2 * per; p++) {
            const int64_t blocks = (job->pairs + p - 1) / p, busiest = (blocks + pool_threads - 1) / pool_threads * p;
            if (busiest < least) least = busiest, best = p;
        }
        per = best;
    }
    job->pairs_per_chunk = job->rows < 64 || per < 1 ? 1 : per;
    const int64_t pair_blocks = (job->pairs + job->pairs_per_chunk - 1) / job->pairs_per_chunk;
    job->pairs_per_chunk = (job->pairs + pair_blocks - 1) / pair_blocks; /* the blocks evened out */
    const int64_t row_blocks = split ? (job->rows + PREFILL_ROW_BLOCK / 2) / PREFILL_ROW_BLOCK : 1;
    const int64_t row_block = (job->rows + row_blocks - 1) / row_blocks;
    job->row_block = (row_block + PREFILL_ROW_STEP - 1) / PREFILL_ROW_STEP * PREFILL_ROW_STEP;
    job->row_blocks = (job->rows + job->row_block - 1) / job->row_block;
    job->call = atomic_fetch_add_explicit(&prefill_calls, 1, memory_order_relaxed);
    parallel_chunks(prefill_chunk, job, pair_blocks * job->row_blocks);
}
#endif

void ts_q4_prefill_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *packed, const float *scale,
                          const float *min, const bf16 *bias, int64_t n_out, bf16 *y) {
#if defined(TS_AMX)
    const int64_t tiles = n_out / TILE_N;
    const int stream = rows * n_out * (int64_t)sizeof(bf16) >= PREFILL_STREAM_BYTES && (uintptr_t)y % 64 == 0 &&
                       n_out % 32 == 0;
    prefill_job job = {x, rows, k, n_out, tiles, packed, scale, min, bias, y, (tiles + 1) / 2, 1, 0, 1, 0, 1, 0, stream};
    prefill_run(&job);
#else
    (void)x, (void)rows, (void)k, (void)packed, (void)scale, (void)min, (void)bias, (void)n_out, (void)y;
#endif
}

/* act [rows, inter] = bf16(silu(gate) * up) of the prompt rows' gate|up product, the weights' first
 * inter outputs the gate's and the next inter the up's (inter % 16 == 0): the same bits as
 * ts_q4_prefill_matmul into [rows, 2 inter] then ts_silu_mul, without writing or reading the product. */
void ts_q4_prefill_silu_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *packed, const float *scale,
                               const float *min, const bf16 *bias, int64_t inter, bf16 *act) {
#if defined(TS_AMX)
    const int64_t half = inter / TILE_N;
    prefill_job job = {x, rows, k, inter, 2 * half, packed, scale, min, bias, act, half, 1, 0, 1, 0, half, 1, 0};
    prefill_run(&job);
#else
    (void)x, (void)rows, (void)k, (void)packed, (void)scale, (void)min, (void)bias, (void)inter, (void)act;
#endif
}

/* The LM head from Q8_0 groups: w = scale * q, q in -128..127; y float32 [rows, n_out].
 * Packed per 16 outputs and group: 16 rows of 32 bytes, row i byte 2j + e = output j's code for
 * k = 32 g + 2 i + e (the tile's pair layout). scale float32 [n_out / 16, k / 32, 16]. */
void ts_q8_matmul(const bf16 *x, int64_t rows, int64_t k, const int8_t *packed, const float *scale,
                  int64_t n_out, float *y) {
#if defined(TS_DPBF16)
    const int64_t tiles = n_out / TILE_N, per = tiles_per_chunk(tiles);
    const tile_job job = {x, rows, k, n_out, per, tiles, packed, scale, NULL, NULL, NULL, y};
    parallel_chunks(tile_chunk, &job, chunk_count(tiles, per));
#else
    (void)x, (void)rows, (void)k, (void)packed, (void)scale, (void)n_out, (void)y;
#endif
}

/* One query token per sequence over its paged context, read in place from the cache (no gather).
 * q bf16 [seqs, heads, dim] with row stride q_stride (elements); caches bf16 [slots, kv_heads, dim];
 * block_tables int64 [seqs, table_width]; lens int64 [seqs]; out bf16 [seqs, heads, dim].
 * Work items are (sequence, segment of DA_SEGMENT_KEYS keys); each item's scores are kept whole
 * (max, then exp and sum, then the weighted values), and the segments combine exactly in float32. */

/* Floats of the AMX path's q, transposed into tile pairs per kv head and 32 dims (bf16). */
#define DA_BQ_FLOATS(kv_heads, dim) ((kv_heads) * (((dim) + 31) / 32) * 256)

/* One item: keys k0 .. k1 - 1 of sequence seq, segment `index` of its `segments`. */
typedef struct {
    int64_t seq, k0, k1, index, segments;
    float *partials;       /* the sequence's segments' partials, one after another; NULL: one segment */
    _Atomic int64_t *left; /* the sequence's items not yet done: the last one combines them */
} decode_item;

typedef struct {
    const bf16 *q, *k_cache, *v_cache;
    int64_t q_stride, table_width, heads, kv_heads, dim, block_size;
    const int64_t *block_tables;
    const decode_item *items;
    bf16 *out;
    float scale;
    int64_t call; /* this call's number (decode_calls) */
} attention_job;

/* A grow-only buffer, kept between calls (a thread's own when declared __thread): a fresh
 * allocation of a few hundred KB per call goes to mmap, and its page faults are paid every call. */
typedef struct {
    void *data;
    size_t bytes;
} scratch_buf;

/* At least `bytes` of the buffer, 64-byte aligned; NULL: out of memory. */
static void *scratch_grow(scratch_buf *s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->data);
        s->data = aligned_alloc(64, ((bytes + 63) / 64) * 64);
        s->bytes = s->data == NULL ? 0 : bytes;
    }
    return s->data;
}

/* A thread's scratch for attention (one per pool thread). */
static __thread scratch_buf attention_scratch;

static float *thread_scratch(size_t floats) { return (float *)scratch_grow(&attention_scratch, floats * sizeof(float)); }

/* Which call and sequence the q transposed at the front of this thread's scratch is (the AMX path's):
 * a thread taking several segments of one sequence transposes its q once. */
static __thread int64_t bq_call = -1, bq_seq = -1;
static _Atomic int64_t decode_calls; /* numbers the calls of ts_paged_decode_attention */

/* The partial of one item into `partial`, on AMX where it runs, else AVX-512 or portable loops; buf:
 * the thread's scratch (attention_chunk). */
static void segment_partial(const attention_job *j, const decode_item *it, float *buf, float *partial) {
    const int64_t heads = j->heads, dim = j->dim, kv_heads = j->kv_heads, block_size = j->block_size;
    float *qf = buf + DA_BQ_FLOATS(kv_heads, dim) + heads * (dim + 2), *scores = qf + heads * dim;
    const bf16 *q = j->q + it->seq * j->q_stride;
    const int64_t *table = j->block_tables + it->seq * j->table_width, k0 = it->k0, k1 = it->k1;
#if defined(TS_AMX)
    const int bq_ready = bq_call == j->call && bq_seq == it->seq;
    if (attend_segment_amx(q, j->k_cache, j->v_cache, table, k0, k1, heads, kv_heads, dim, block_size, j->scale,
                           scores, (bf16 *)buf, bq_ready, partial)) {
        bq_call = j->call, bq_seq = it->seq;
        return;
    }
#endif
    if (dim == 64)
        attend_segment(q, j->k_cache, j->v_cache, table, k0, k1, heads, kv_heads, 64, block_size, j->scale, scores,
                       qf, partial);
    else if (dim == 128)
        attend_segment(q, j->k_cache, j->v_cache, table, k0, k1, heads, kv_heads, 128, block_size, j->scale, scores,
                       qf, partial);
    else
        attend_segment(q, j->k_cache, j->v_cache, table, k0, k1, heads, kv_heads, dim, block_size, j->scale, scores,
                       qf, partial);
}

/* One chunk of ts_paged_decode_attention: one item. A sequence of one segment is finished here; of
 * several, by whichever thread finishes its last item, always combining in segment order. The
 * thread's scratch: the AMX path's transposed q, a one-segment sequence's partial, q in float32,
 * the scores. */
static void attention_chunk(const void *arg, int64_t i) {
    const attention_job *j = (const attention_job *)arg;
    const decode_item *it = j->items + i;
    const int64_t heads = j->heads, dim = j->dim, part = heads * (dim + 2);
    const int64_t tile = DA_SEGMENT_KEYS * 16, score = heads * DA_SEGMENT_KEYS;
    const int64_t bq = DA_BQ_FLOATS(j->kv_heads, dim);
    float *buf = thread_scratch((size_t)(bq + part + heads * dim + (tile > score ? tile : score)));
    if (buf == NULL) abort(); /* out of memory for a few hundred KB of scratch */
    bf16 *out = j->out + it->seq * heads * dim;
    if (it->partials == NULL) {
        segment_partial(j, it, buf, buf + bq);
        combine_segments(buf + bq, 1, heads, dim, out);
        return;
    }
    segment_partial(j, it, buf, it->partials + it->index * part);
    if (atomic_fetch_sub_explicit(it->left, 1, memory_order_acq_rel) == 1) /* sees the others' partials */
        combine_segments(it->partials, it->segments, heads, dim, out);
}

/* Segments of a sequence of `len` keys (one at least). */
static inline int64_t decode_segments(int64_t len) {
    return len <= DA_SEGMENT_KEYS ? 1 : (len + DA_SEGMENT_KEYS - 1) / DA_SEGMENT_KEYS;
}

/* A call's items, counters and partials live in the caller's plan; sequences are taken a wave at a
 * time, each wave's partials at most DA_WAVE_FLOATS (a prompt of thousands of rows, when the prompt
 * kernel declines, comes here as thousands of sequences). Waves change nothing in the bits. */
#define DA_WAVE_FLOATS (1 << 20)
static __thread scratch_buf decode_plan;

static inline size_t align64(size_t bytes) { return (bytes + 63) / 64 * 64; }

void ts_paged_decode_attention(const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache,
                               const int64_t *block_tables, int64_t table_width, const int64_t *lens,
                               bf16 *out, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                               int64_t block_size, float scale) {
    const int64_t part = heads * (dim + 2);
    attention_job job = {q, k_cache, v_cache, q_stride, table_width, heads, kv_heads, dim, block_size,
                         block_tables, NULL, out, scale, atomic_fetch_add(&decode_calls, 1)};
    for (int64_t s0 = 0, s1; s0 < seqs; s0 = s1) {
        int64_t items = 0, split = 0, floats = 0;
        for (s1 = s0; s1 < seqs; s1++) {
            const int64_t segments = decode_segments(lens[s1]), need = segments > 1 ? segments * part : 0;
            if (s1 > s0 && floats + need > DA_WAVE_FLOATS) break;
            items += segments, split += segments > 1, floats += need;
        }
        const size_t item_bytes = align64((size_t)items * sizeof(decode_item));
        const size_t left_bytes = align64((size_t)split * sizeof(_Atomic int64_t));
        char *plan = (char *)scratch_grow(&decode_plan, item_bytes + left_bytes + (size_t)floats * sizeof(float));
        if (plan == NULL) abort();
        decode_item *item = (decode_item *)plan;
        _Atomic int64_t *left = (_Atomic int64_t *)(plan + item_bytes);
        float *partials = (float *)(plan + item_bytes + left_bytes);
        int64_t n = 0;
        for (int64_t s = s0; s < s1; s++) {
            const int64_t segments = decode_segments(lens[s]);
            if (segments > 1) atomic_init(left, segments);
            for (int64_t i = 0; i < segments; i++) {
                const int64_t k0 = i * DA_SEGMENT_KEYS, end = k0 + DA_SEGMENT_KEYS;
                item[n++] = (decode_item){s, k0, end < lens[s] ? end : lens[s], i, segments,
                                          segments > 1 ? partials : NULL, segments > 1 ? left : NULL};
            }
            if (segments > 1) partials += segments * part, left++;
        }
        job.items = item;
        parallel_chunks(attention_chunk, &job, n);
    }
}

/* Prompt attention on AMX: one prompt chunk of one sequence (rows at positions start_pos ..
 * start_pos + rows - 1 over its paged cache, causal), flash-attention style. Per kv head, the rows
 * of its query heads are stacked (position-major: row r = chunk row r / group, head r % group) and
 * taken 16 at a time as the N side of two tile products per 32 keys, so the softmax runs down
 * columns (one zmm = one key's scores for 16 rows: no horizontal sums):
 *   S^T [32 keys, 16 rows] = K Q^T  A: 16 cache rows of K read in place, B: the 16 rows' q in pairs
 *   O^T [dim, 16 rows]   += V^T P^T A: V transposed (once per call, per kv head and 32 keys),
 *                                    B: P rounded to bf16, key pairs interleaved
 * with float32 sums, O^T held in four tiles for the whole key loop. The softmax is online and exact
 * in float32, lazily rescaled: P = 2^(s - m) against the row's running maximum m, which moves (and
 * rescales O and the sum) only when a block's maximum passes it by more than 2^8, so P <= 256.
 * Key blocks sit at absolute positions 0, 32, 64, ... in that order, and every step is per row
 * (masked keys give P = 0 exactly, a rescale multiplies other rows by 1.0), so a row's result does
 * not depend on which rows share its tile or chunk: a prompt chunked 256 + 256 + ... gives the bits
 * one chunk gives. Needs AMX, head_dim 32 or 64 (O^T in at most four tiles), block_size % 16 == 0;
 * returns 0 (nothing written) otherwise, and the caller runs the decode kernel per row. */
#if defined(TS_AMX)
#define PA_KEYS 32
#define PA_LAZY_LOG2 8.0f
#define PA_SCORES_AT 6 /* the key pair of a block's weights after which the next block's scores go in */
#define PA_RECHECK_SUM 128.0f /* a block's weights sum past this (as a weight past 2^8 makes them): check its maximum */

typedef struct {
    const bf16 *q, *k_cache, *v_cache;
    const int64_t *table;
    int64_t q_stride, rows, start_pos, heads, kv_heads, dim, block_size, ctx, key_blocks, row_tiles, repack_per;
    bf16 *vt; /* [kv_heads][key_blocks][dim / 16][16 dims][32 keys] */
    bf16 *out;
    float scale_log2; /* softmax scale times log2(e): scores in the base-2 domain */
} prompt_job;

/* The 16 keys from `key` (one cache block holds them: block_size % 16 == 0) of kv head g. */
static inline const bf16 *prompt_keys(const prompt_job *j, int64_t g, int64_t key) {
    const int64_t bs = j->block_size;
    return j->k_cache + (j->table[key / bs] * bs + key % bs) * j->kv_heads * j->dim + g * j->dim;
}

/* S^T of the 32 keys from k0 for the job's 16 rows into tiles 0 and 1 (zeros for the upper 16 keys
 * when no row sees them: the cache may not hold them). Tile 2 takes K, tile 3 q^T. */
static inline void prompt_scores(const prompt_job *j, int64_t g, int64_t k0, int64_t max_pos, const bf16 *qt,
                                 int64_t chunks) {
    const int64_t kv_stride = j->kv_heads * j->dim * 2;
    const int hi = k0 + 16 <= max_pos;
    const bf16 *k_lo = prompt_keys(j, g, k0), *k_hi = hi ? prompt_keys(j, g, k0 + 16) : NULL;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(3, qt, 64);
    _tile_loadd(2, k_lo, kv_stride);
    _tile_dpbf16ps(0, 2, 3);
    if (hi) {
        _tile_loadd(2, k_hi, kv_stride);
        _tile_dpbf16ps(1, 2, 3);
    }
    if (chunks == 2) {
        _tile_loadd(3, qt + 512, 64);
        _tile_loadd(2, k_lo + 32, kv_stride);
        _tile_dpbf16ps(0, 2, 3);
        if (hi) {
            _tile_loadd(2, k_hi + 32, kv_stride);
            _tile_dpbf16ps(1, 2, 3);
        }
    }
}

/* O^T (tiles 4-7) += V^T P^T for key block kb: P^T in tile 3, V^T through tiles 0-2. */
static inline void prompt_values(const prompt_job *j, int64_t g, int64_t kb, const bf16 *pt, int64_t dtiles) {
    const bf16 *vt = j->vt + (g * j->key_blocks + kb) * dtiles * 512;
    __asm__ volatile("" ::: "memory"); /* TILELOADD is an asm without a memory clobber: P^T's stores first */
    _tile_loadd(3, pt, 64);
    _tile_loadd(0, vt, 64);
    _tile_dpbf16ps(4, 0, 3);
    _tile_loadd(1, vt + 512, 64);
    _tile_dpbf16ps(5, 1, 3);
    if (dtiles == 4) {
        _tile_loadd(2, vt + 1024, 64);
        _tile_dpbf16ps(6, 2, 3);
        _tile_loadd(0, vt + 1536, 64);
        _tile_dpbf16ps(7, 0, 3);
    }
}

/* r[i][l] <-> r[l][i]: a 16 x 16 transpose of 32-bit lanes, by swapping off-diagonal blocks of 8, 4, 2, 1. */
static const int32_t transpose_lo[4][16] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const int32_t transpose_hi[4][16] __attribute__((aligned(64))) = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};

static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    for (int round = 0; round < 4; round++) {
        const int s = 8 >> round;
        const __m512i idx_lo = _mm512_load_si512(transpose_lo[round]), idx_hi = _mm512_load_si512(transpose_hi[round]);
        for (int i = 0; i < 16; i++) {
            if (i & s) continue;
            const __m512i a = r[i], b = r[i + s];
            r[i] = _mm512_permutex2var_epi32(a, idx_lo, b);
            r[i + s] = _mm512_permutex2var_epi32(a, idx_hi, b);
        }
    }
}

/* V^T for kv head g and key blocks kb0 .. kb0 + repack_per - 1; keys past the context are zeros.
 * Per 16 dims: key rows 2 i and 2 i + 1 interleaved (16-bit lanes: dword d = their values at dim d),
 * then those 16 x 16 dwords transposed, so row d holds keys 0 .. 31 at dim d in order. The scalar
 * loop it replaced wrote one value at a time: 16-20% of the prompt attention at 256-512 rows. */
static void prompt_repack_chunk(const void *arg, int64_t chunk) {
    const prompt_job *j = (const prompt_job *)arg;
    const int64_t per_head = (j->key_blocks + j->repack_per - 1) / j->repack_per;
    const int64_t g = chunk / per_head, kb0 = (chunk % per_head) * j->repack_per;
    const int64_t kb1 = kb0 + j->repack_per < j->key_blocks ? kb0 + j->repack_per : j->key_blocks;
    const int64_t dim = j->dim, dtiles = dim / 16, kv_width = j->kv_heads * dim, bs = j->block_size;
    const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int64_t kb = kb0; kb < kb1; kb++) {
        const bf16 *rows[PA_KEYS];
        for (int64_t k = 0; k < PA_KEYS; k++) {
            const int64_t key = kb * PA_KEYS + k;
            rows[k] = key < j->ctx ? j->v_cache + (j->table[key / bs] * bs + key % bs) * kv_width + g * dim : NULL;
        }
        bf16 *dst = j->vt + (g * j->key_blocks + kb) * dtiles * 512;
        for (int64_t dt = 0; dt < dtiles; dt++) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++) {
                const bf16 *a = rows[2 * i], *b = rows[2 * i + 1];
                const __m512i va = a == NULL ? _mm512_setzero_si512()
                                             : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + dt * 16)));
                const __m512i vb = b == NULL ? _mm512_setzero_si512()
                                             : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + dt * 16)));
                r[i] = _mm512_permutex2var_epi16(va, pairs, vb);
            }
            transpose16_epi32(r);
            for (int64_t d = 0; d < 16; d++) _mm512_store_si512(dst + dt * 512 + d * 32, r[d]);
        }
    }
}

/* P^T (bf16, the pair layout of tile B) of key pairs kp0 .. kp1 - 1 of the block at k0 from its
 * scores s, against each row's running maximum top (base 2); returns the block's weights so far
 * (`part`, that of pairs 0 .. kp0 - 1), summed pair by pair in key order. */
static inline __attribute__((always_inline)) __m512 prompt_probs(const float *s, bf16 *pt, int64_t kp0, int64_t kp1,
                                                                 int64_t k0, int diagonal, __m512i posv, __m512 sc,
                                                                 __m512 top, __m512 part) {
    const __m512i pair_order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t kp = kp0; kp < kp1; kp++) {
        const int64_t k = 2 * kp;
        __m512 p0 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(s + 16 * k), sc, top));
        __m512 p1 = exp2_512(_mm512_fmsub_ps(_mm512_load_ps(s + 16 * k + 16), sc, top));
        if (diagonal) { /* a masked key weighs exactly 0 */
            p0 = _mm512_maskz_mov_ps(_mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + k)), _MM_CMPINT_NLT), p0);
            p1 = _mm512_maskz_mov_ps(_mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + k + 1)), _MM_CMPINT_NLT), p1);
        }
        __m512 pair = _mm512_add_ps(p0, p1);
        __asm__("" : "+v"(pair)); /* this order whatever the code around: -ffast-math re-associates */
        part = kp == 0 ? pair : _mm512_add_ps(part, pair);
        __asm__("" : "+v"(part));
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0's 16 rows low, p1's high */
        _mm512_store_si512(pt + 32 * kp, _mm512_permutexvar_epi16(pair_order, both));
    }
    return part;
}

/* Each row's maximum over the scores s of the block at k0 that it sees, scaled to base 2 once (rounding
 * keeps the order; masked keys left out on the diagonal). */
static inline __attribute__((always_inline)) __m512 prompt_block_top(const float *s, int64_t k0, int diagonal,
                                                                     __m512i posv, __m512 sc) {
    __m512 block_top = _mm512_set1_ps(-1e30f);
    for (int64_t k = 0; k < PA_KEYS; k++) {
        const __m512 x = _mm512_load_ps(s + 16 * k);
        const __mmask16 sees =
            diagonal ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + k)), _MM_CMPINT_NLT) : 0xffff;
        block_top = _mm512_mask_max_ps(block_top, sees, block_top, x);
    }
    return _mm512_mul_ps(block_top, sc);
}

/* 16 stacked rows (row tile t) of kv head g over every key block they see; the tiles configured. */
static void prompt_tile(const prompt_job *j, int64_t g, int64_t t) {
    const int64_t kv_heads = j->kv_heads, group = j->heads / kv_heads, dim = j->dim;
    const int64_t chunks = dim / 32, dtiles = dim / 16;
    const int64_t stacked = j->rows * group;
    bf16 qt[2 * 512] __attribute__((aligned(64)));
    bf16 pt[2][512] __attribute__((aligned(64))); /* P^T of blocks kb and kb - 1 */
    float s[PA_KEYS * 16] __attribute__((aligned(64)));
    float o[64 * 16] __attribute__((aligned(64)));
    int32_t pos[16];
    int64_t min_pos = INT64_MAX, max_pos = -1;
    __m512i qr[2][16]; /* per chunk of 32 dims, row m's 16 dim pairs, transposed below into B's layout */
    for (int64_t m = 0; m < 16; m++) {
        const int64_t r = 16 * t + m;
        if (r >= stacked) {
            pos[m] = -1; /* padding: every key masked, never written */
            qr[0][m] = qr[1][m] = _mm512_setzero_si512();
            continue;
        }
        const int64_t i = r / group, h = g * group + r % group;
        pos[m] = (int32_t)(j->start_pos + i);
        min_pos = pos[m] < min_pos ? pos[m] : min_pos;
        max_pos = pos[m] > max_pos ? pos[m] : max_pos;
        const bf16 *row = j->q + i * j->q_stride + h * dim;
        for (int64_t c = 0; c < chunks; c++) qr[c][m] = _mm512_loadu_si512(row + c * 32);
    }
    for (int64_t c = 0; c < chunks; c++) { /* B row i2 holds dims 2 i2, 2 i2 + 1 of the 16 rows */
        transpose16_epi32(qr[c]);
        for (int64_t i2 = 0; i2 < 16; i2++) _mm512_store_si512(qt + c * 512 + i2 * 32, qr[c][i2]);
    }
    __asm__ volatile("" ::: "memory"); /* q^T stored before the tile loads (no memory clobber) read it */
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const __m512i posv = _mm512_loadu_si512(pos);
    const __m512 sc = _mm512_set1_ps(j->scale_log2), masked = _mm512_set1_ps(-1e30f);
    const __m512 lazy = _mm512_set1_ps(PA_LAZY_LOG2);
    __m512 top = masked, sum = _mm512_setzero_ps();
    const int64_t blocks = max_pos / PA_KEYS + 1;
    /* Pipelined: block kb - 1's values and block kb + 1's scores run on the tiles while block kb's
     * softmax runs on AVX-512. Each goes in where the out-of-order core still overlaps it with the
     * vector work around it (issued together at the top of a block, 12-15% slower): the values first,
     * the scores a few key pairs into the weights. A block's weights are taken against the running
     * maximum before its own maximum is known: a block that moves the maximum has a weight above
     * 2^8, so its weights sum past PA_RECHECK_SUM; only such a block (rare after the first) pays the
     * maximum pass, the rescale and its weights again: the same maximum, test and weights as a maximum
     * pass before the weights gives (the 05:05 kernel's, a pass of 32 loads and maxima a block). A
     * row's sum takes each block's weights summed in key order, that order pinned against -ffast-math
     * (GCC re-associated the old sum differently in different copies of the loop). */
    prompt_scores(j, g, 0, max_pos, qt, chunks);
    _tile_stored(0, s, 64);
    _tile_stored(1, s + 256, 64);
    for (int64_t kb = 0; kb < blocks; kb++) {
        const int64_t k0 = kb * PA_KEYS;
        const int diagonal = k0 + PA_KEYS - 1 > min_pos; /* keys past some row's position: masked for it */
        if (kb == 0) top = prompt_block_top(s, k0, diagonal, posv, sc);
        else prompt_values(j, g, kb - 1, pt[(kb - 1) & 1], dtiles);
        __m512 part = prompt_probs(s, pt[kb & 1], 0, PA_SCORES_AT, k0, diagonal, posv, sc, top, _mm512_setzero_ps());
        if (kb + 1 < blocks) prompt_scores(j, g, k0 + PA_KEYS, max_pos, qt, chunks);
        part = prompt_probs(s, pt[kb & 1], PA_SCORES_AT, PA_KEYS / 2, k0, diagonal, posv, sc, top, part);
        if (kb > 0 && _mm512_cmp_ps_mask(part, _mm512_set1_ps(PA_RECHECK_SUM), _CMP_NLE_UQ)) {
            const __m512 block_top = prompt_block_top(s, k0, diagonal, posv, sc);
            const __mmask16 moves = _mm512_cmp_ps_mask(block_top, _mm512_add_ps(top, lazy), _CMP_GT_OQ);
            if (moves) { /* rescale O and the sum of the rows whose maximum moved (others by 1) */
                const __m512 fresh = _mm512_mask_mov_ps(top, moves, block_top);
                const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moves, exp2_512(_mm512_sub_ps(top, fresh)));
                _tile_stored(4, o, 64);
                _tile_stored(5, o + 256, 64);
                _tile_stored(6, o + 512, 64);
                _tile_stored(7, o + 768, 64);
                for (int64_t d = 0; d < dim; d++) _mm512_store_ps(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(o + 16 * d), alpha));
                __asm__ volatile("" ::: "memory"); /* the rescaled O^T stored before the tiles read it */
                _tile_loadd(4, o, 64);
                _tile_loadd(5, o + 256, 64);
                _tile_loadd(6, o + 512, 64);
                _tile_loadd(7, o + 768, 64);
                top = fresh;
                sum = _mm512_mul_ps(sum, alpha);
                __asm__("" : "+v"(sum)); /* a product, not an FMA with the block's weights */
                part = prompt_probs(s, pt[kb & 1], 0, PA_KEYS / 2, k0, diagonal, posv, sc, top, _mm512_setzero_ps());
            }
        }
        sum = _mm512_add_ps(sum, part);
        if (kb + 1 < blocks) { /* the next block's scores, done by now */
            _tile_stored(0, s, 64);
            _tile_stored(1, s + 256, 64);
        }
    }
    prompt_values(j, g, blocks - 1, pt[(blocks - 1) & 1], dtiles);
    _tile_stored(4, o, 64);
    _tile_stored(5, o + 256, 64);
    _tile_stored(6, o + 512, 64);
    _tile_stored(7, o + 768, 64);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(sum, _mm512_set1_ps(FLT_MIN)));
    for (int64_t dt = 0; dt < dtiles; dt++) { /* O^T's 16 x 16 blocks transposed: row m's 16 dims */
        __m512i r[16];
        for (int64_t d = 0; d < 16; d++) r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(o + (dt * 16 + d) * 16), inv));
        transpose16_epi32(r);
        for (int64_t m = 0; m < 16 && 16 * t + m < stacked; m++) {
            const int64_t row = 16 * t + m, i = row / group, h = g * group + row % group;
            _mm256_storeu_si256((__m256i *)(j->out + (i * j->heads + h) * dim + dt * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[m])));
        }
    }
}

/* A few row tiles of one kv head (heaviest first: the last rows see the most keys), one tile
 * configuration for all of them. The chunks go kv head by kv head, so the K and V^T a thread reads
 * stay one head's (1 MB at 4,000 keys, which its 2 MB L2 holds; three heads' it did not hold: 4,000
 * rows, one layer, 2 threads, 14.0 -> 12.7 ms). */
#define PA_TILES_PER_CHUNK 4
static void prompt_tile_chunk(const void *arg, int64_t chunk) {
    const prompt_job *j = (const prompt_job *)arg;
    const int64_t per_head = (j->row_tiles + PA_TILES_PER_CHUNK - 1) / PA_TILES_PER_CHUNK;
    const int64_t g = chunk / per_head, first = (chunk % per_head) * PA_TILES_PER_CHUNK;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    load_tile_config(&cfg);
    for (int64_t n = first; n < first + PA_TILES_PER_CHUNK && n < j->row_tiles; n++) prompt_tile(j, g, j->row_tiles - 1 - n);
    _tile_release();
}
#endif

/* --- Prompt attention without AMX: float32 FMAs, flash-attention style --------------------------
 *
 * Where the build has AVX-512 but no AMX (a Zen 4; a Xeon whose VM hides AMX and AVX512-BF16), the
 * same tiling as the AMX kernel with float32 fused multiply-adds: 16 stacked rows (a chunk's rows x
 * the query heads of one kv head) against key blocks of 32 at absolute positions 0, 32, 64, ..., the
 * scores S^T one vector per key (16 rows' scores), softmax online per row. Before the tiles, each kv
 * head's keys and values up to the context are widened once to float32 (zeros past it: a reused pool
 * slot may hold NaN, and 0 x NaN is NaN). Per block: S^T[k] = sum over d of q^T[d] x K[k][d] (a
 * broadcast), each row's maximum moves to the block's if larger (O and the sum rescaled by
 * 2^(old - new), exactly 1 for rows it did not move), P = 2^(s - max) with masked keys exactly 0,
 * O^T[d] += sum over k of P^T[k] x V[k][d]. Every sum runs in a fixed order and every step is per
 * row, so a row's bits do not depend on the rows beside it, the chunk it came in, or the thread
 * count. The per-row decode kernel it replaces for prompts runs a scalar exp per score and a
 * horizontal sum per dot product: 1,600 rows x 30 layers of the default model, 2 threads of a
 * 2-vCPU Xeon without AMX: 1,020 ms (docs/ENGINE.md, "CPUs without bf16 arithmetic").
 *
 * Where the build has AVX512-VNNI (Ice Lake and later, Zen 4) the scores S^T come from int8 dot
 * products instead (PF_QK_INT8): each key rounded to int8 per group of 32 dims when widened, each
 * row's q (times the scale) likewise per tile, VPDPBUSD multiplying 64 byte pairs an instruction
 * where an FMA multiplies 16 floats; group sums exact in int32, scaled and added in order, so the
 * row invariance above holds. P V stays on float32 FMAs: P rounded to bytes loses the small weights
 * of a long context. One layer of the default model at 4,000 rows, 2 threads: 141 -> 97 ms;
 * quality gate: docs/ENGINE.md, "Prompt scores on int8 dot products". */
#if !defined(TS_AMX) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define TS_PROMPT_FMA 1
#define PF_KEYS 32
#define PF_MAX_DIM 256
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(PF_FLOAT_SCORES)
#define PF_QK_INT8 1 /* the scores on int8 dot products (PF_FLOAT_SCORES keeps them float32, to compare) */
#endif

typedef struct {
    const bf16 *q, *k_cache, *v_cache;
    const int64_t *table;
    int64_t q_stride, rows, start_pos, heads, kv_heads, dim, block_size, ctx, key_blocks, row_tiles;
    float *kf, *vf; /* [kv_heads][key_blocks * PF_KEYS][dim], float32, zeros past ctx */
    bf16 *out;
    float scale_log2; /* softmax scale times log2(e): scores in the base-2 domain */
    int qk_int8;      /* int8 scores: a VNNI build and dim a multiple of 32 (else float32 keys in kf) */
#if defined(PF_QK_INT8)
    int8_t *k8;  /* [kv_heads][key_blocks * PF_KEYS][dim]: each key rounded to int8 per group of 32 */
    float *ks;   /* [kv_heads][key_blocks * PF_KEYS][dim / 32]: the groups' scales */
    int32_t *kc; /* the same: -128 x the group's code sum (the unsigned q codes' offset taken back) */
#endif
} fma_prompt_job;

#if defined(PF_QK_INT8)
/* 32 values (lo, hi) rounded to int8: code = x x (127 / top) rounded to nearest (even on a tie),
 * d = top / 127, top the group's largest |x| (codes and d 0 for a group of zeros). Each division
 * and product is one correctly rounded operation by a rounding-mode intrinsic, which -ffast-math
 * leaves alone (it rewrote 127 / top as 1 / d, which moves codes of values near a tie: a
 * reference must be able to repeat the rule). */
#define PF_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __attribute__((always_inline)) void pf_round_group(__m512 lo, __m512 hi, int32_t *codes, float *d) {
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 topv = _mm512_set1_ps(top), lim = _mm512_set1_ps(127.0f);
    const __m512 inv = top > 0.0f ? _mm512_div_round_ps(lim, topv, PF_RN) : _mm512_setzero_ps();
    _mm512_storeu_si512(codes, _mm512_cvtps_epi32(_mm512_mul_round_ps(lo, inv, PF_RN)));
    _mm512_storeu_si512(codes + 16, _mm512_cvtps_epi32(_mm512_mul_round_ps(hi, inv, PF_RN)));
    *d = _mm512_cvtss_f32(_mm512_div_round_ps(topv, lim, PF_RN));
}

/* One key (bf16, dim values) as int8 codes, a scale and -128 x the code sum per group of 32. */
static void pf_round_keys(const bf16 *k, int64_t dim, int8_t *codes, float *d, int32_t *offset) {
    for (int64_t g = 0; g < dim / 32; g++) {
        int32_t c[32] __attribute__((aligned(64)));
        pf_round_group(load16_bf16(k + 32 * g), load16_bf16(k + 32 * g + 16), c, d + g);
        const __m512i lo = _mm512_load_si512(c), hi = _mm512_load_si512(c + 16);
        _mm_storeu_si128((__m128i *)(codes + 32 * g), _mm512_cvtsepi32_epi8(lo));
        _mm_storeu_si128((__m128i *)(codes + 32 * g + 16), _mm512_cvtsepi32_epi8(hi));
        offset[g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    }
}
#endif

/* K and V of kv head g, key blocks 8 c .. 8 c + 7 of its share, widened to float32 (K rounded to
 * int8 per group of 32 where the build has VNNI). */
static void fma_prompt_widen_chunk(const void *arg, int64_t chunk) {
    const fma_prompt_job *j = (const fma_prompt_job *)arg;
    const int64_t per_head = (j->key_blocks + 7) / 8;
    const int64_t g = chunk / per_head, kb0 = (chunk % per_head) * 8;
    const int64_t kb1 = kb0 + 8 < j->key_blocks ? kb0 + 8 : j->key_blocks;
    const int64_t dim = j->dim, kv_width = j->kv_heads * dim, bs = j->block_size;
    for (int64_t key = kb0 * PF_KEYS; key < kb1 * PF_KEYS; key++) {
        const int64_t at = g * j->key_blocks * PF_KEYS + key;
        float *vd = j->vf + at * dim;
        const int int8 = j->qk_int8;
        if (key >= j->ctx) {
#if defined(PF_QK_INT8)
            if (int8) {
                memset(j->k8 + at * dim, 0, (size_t)dim);
                memset(j->ks + at * (dim / 32), 0, (size_t)(dim / 32) * sizeof(float));
                memset(j->kc + at * (dim / 32), 0, (size_t)(dim / 32) * sizeof(int32_t));
            }
#endif
            if (!int8) memset(j->kf + at * dim, 0, (size_t)dim * sizeof(float));
            memset(vd, 0, (size_t)dim * sizeof(float));
            continue;
        }
        const int64_t slot = j->table[key / bs] * bs + key % bs;
        const bf16 *kr = j->k_cache + slot * kv_width + g * dim, *vr = j->v_cache + slot * kv_width + g * dim;
        for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(vd + d, load16_bf16(vr + d));
#if defined(PF_QK_INT8)
        if (int8) pf_round_keys(kr, dim, j->k8 + at * dim, j->ks + at * (dim / 32), j->kc + at * (dim / 32));
#endif
        if (!int8)
            for (int64_t d = 0; d < dim; d += 16) _mm512_store_ps(j->kf + at * dim + d, load16_bf16(kr + d));
    }
}

/* S^T of keys k0 .. k0 + 15 (float32 rows kh, dim apart) for the tile's 16 rows into s. */
static inline __attribute__((always_inline)) void fma_prompt_scores(const float *qt, const float *kh, int64_t dim,
                                                                    float *s) {
    __m512 acc[16];
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const __m512 qd = _mm512_load_ps(qt + 16 * d);
        for (int k = 0; k < 16; k++) acc[k] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kh[k * dim + d]), acc[k]);
    }
    for (int k = 0; k < 16; k++) _mm512_store_ps(s + 16 * k, acc[k]);
}

#if defined(PF_QK_INT8)
/* S^T of keys k0 .. k0 + 15 from int8 dot products: qt8 the tile's 16 rows' codes + 128 (unsigned),
 * 4 dims a lane, [dim / 4][16][4]; qd their scales [dim / 32][16]; kh, khd, khc the keys' codes,
 * scales and offsets (pf_round_keys). S^T[k] = sum over groups g (in order) of
 * qd[g] x khd[k][g] x (the group's integer sum of q codes x k codes), exact in int32. */
static inline __attribute__((always_inline)) void vnni_prompt_scores(const uint8_t *qt8, const float *qd,
                                                                     const int8_t *kh, const float *khd,
                                                                     const int32_t *khc, int64_t dim, float *s) {
    const int64_t groups = dim / 32;
    for (int k8 = 0; k8 < 16; k8 += 8) {
        __m512 f[8];
        for (int k = 0; k < 8; k++) f[k] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512i acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm512_set1_epi32(khc[(k8 + k) * groups + g]);
            for (int64_t c = 0; c < 8; c++) {
                const __m512i qv = _mm512_load_si512(qt8 + 64 * (8 * g + c));
                for (int k = 0; k < 8; k++) {
                    int32_t quad;
                    memcpy(&quad, kh + (k8 + k) * dim + 32 * g + 4 * c, 4);
                    acc[k] = _mm512_dpbusd_epi32(acc[k], qv, _mm512_set1_epi32(quad));
                }
            }
            const __m512 qg = _mm512_load_ps(qd + 16 * g);
            for (int k = 0; k < 8; k++)
                f[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k]),
                                       _mm512_mul_ps(qg, _mm512_set1_ps(khd[(k8 + k) * groups + g])), f[k]);
        }
        for (int k = 0; k < 8; k++) _mm512_store_ps(s + 16 * (k8 + k), f[k]);
    }
}
#endif

/* O^T[d0 .. d0 + 15] (16 rows each, in o) rescaled by alpha, plus the nk keys' P^T (in s) times
 * their values (float32 rows vk, dim apart). */
static inline __attribute__((always_inline)) void fma_prompt_values(float *o, const float *s, const float *vk,
                                                                    int64_t dim, int64_t d0, int64_t nk,
                                                                    __m512 alpha) {
    __m512 acc[16];
    for (int dd = 0; dd < 16; dd++) acc[dd] = _mm512_mul_ps(_mm512_load_ps(o + 16 * (d0 + dd)), alpha);
    for (int64_t k = 0; k < nk; k++) {
        const __m512 p = _mm512_load_ps(s + 16 * k);
        const float *v = vk + k * dim + d0;
        for (int dd = 0; dd < 16; dd++) acc[dd] = _mm512_fmadd_ps(p, _mm512_set1_ps(v[dd]), acc[dd]);
    }
    for (int dd = 0; dd < 16; dd++) _mm512_store_ps(o + 16 * (d0 + dd), acc[dd]);
}

/* 16 stacked rows (row tile t) of kv head g over every key block they see. */
static void fma_prompt_tile(const fma_prompt_job *j, int64_t g, int64_t t) {
    const int64_t group = j->heads / j->kv_heads, dim = j->dim, stacked = j->rows * group;
    float qt[PF_MAX_DIM * 16] __attribute__((aligned(64)));
    float o[PF_MAX_DIM * 16] __attribute__((aligned(64)));
    float s[PF_KEYS * 16] __attribute__((aligned(64)));
    int32_t pos[16];
    int64_t min_pos = INT64_MAX, max_pos = -1;
    for (int64_t m = 0; m < 16; m++) {
        const int64_t r = 16 * t + m;
        if (r >= stacked) { /* padding: every key masked, never written */
            pos[m] = -1;
            for (int64_t d = 0; d < dim; d++) qt[16 * d + m] = 0.0f;
            continue;
        }
        const int64_t i = r / group, h = g * group + r % group;
        pos[m] = (int32_t)(j->start_pos + i);
        min_pos = pos[m] < min_pos ? pos[m] : min_pos;
        max_pos = pos[m] > max_pos ? pos[m] : max_pos;
        const bf16 *row = j->q + i * j->q_stride + h * dim;
        for (int64_t d = 0; d < dim; d++) qt[16 * d + m] = bf16_to_f32(row[d]) * j->scale_log2;
    }
#if defined(PF_QK_INT8)
    /* each row's q (scaled) rounded to int8 per group of 32, stored + 128 four dims a lane */
    uint8_t qt8[PF_MAX_DIM * 16] __attribute__((aligned(64)));
    float qd[PF_MAX_DIM / 32 * 16] __attribute__((aligned(64)));
    for (int64_t m = 0; m < 16 && j->qk_int8; m++) {
        float col[PF_MAX_DIM] __attribute__((aligned(64)));
        int32_t codes[PF_MAX_DIM] __attribute__((aligned(64)));
        for (int64_t d = 0; d < dim; d++) col[d] = qt[16 * d + m];
        for (int64_t g = 0; g < dim / 32; g++)
            pf_round_group(_mm512_load_ps(col + 32 * g), _mm512_load_ps(col + 32 * g + 16), codes + 32 * g,
                           qd + 16 * g + m);
        for (int64_t d = 0; d < dim; d++) qt8[64 * (d / 4) + 4 * m + d % 4] = (uint8_t)(codes[d] + 128);
    }
    const int64_t head_keys = g * j->key_blocks * PF_KEYS;
#endif
    memset(o, 0, (size_t)(16 * dim) * sizeof(float));
    const __m512i posv = _mm512_loadu_si512(pos);
    const __m512 masked = _mm512_set1_ps(-1e30f);
    __m512 top = masked, sum = _mm512_setzero_ps();
    const float *kf = j->kf, *vf = j->vf + g * j->key_blocks * PF_KEYS * dim;
    if (kf != NULL) kf += g * j->key_blocks * PF_KEYS * dim; /* float32 keys: no int8 scores here */
    const int64_t blocks = max_pos / PF_KEYS + 1;
    for (int64_t kb = 0; kb < blocks; kb++) {
        const int64_t k0 = kb * PF_KEYS;
        const int64_t nk = k0 + 16 <= max_pos ? PF_KEYS : 16; /* the upper 16 keys: only if some row sees one */
        const int diagonal = k0 + PF_KEYS - 1 > min_pos;      /* keys past some row's position: masked for it */
#if defined(PF_QK_INT8)
        if (j->qk_int8)
            for (int64_t h16 = 0; h16 < nk; h16 += 16) {
                const int64_t key = head_keys + k0 + h16;
                vnni_prompt_scores(qt8, qd, j->k8 + key * dim, j->ks + key * (dim / 32), j->kc + key * (dim / 32),
                                   dim, s + 16 * h16);
            }
        else
#endif
        {
            fma_prompt_scores(qt, kf + k0 * dim, dim, s);
            if (nk == PF_KEYS) fma_prompt_scores(qt, kf + (k0 + 16) * dim, dim, s + 256);
        }
        __m512 block_top = masked;
        for (int64_t k = 0; k < nk; k++) {
            const __mmask16 sees =
                diagonal ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + k)), _MM_CMPINT_NLT) : 0xffff;
            block_top = _mm512_mask_max_ps(block_top, sees, block_top, _mm512_load_ps(s + 16 * k));
        }
        const __m512 fresh = _mm512_max_ps(top, block_top);
        const __m512 alpha = exp2_512(_mm512_sub_ps(top, fresh)); /* 1 where the maximum stayed */
        top = fresh;
        __m512 part = _mm512_setzero_ps();
        for (int64_t k = 0; k < nk; k++) {
            __m512 p = exp2_512(_mm512_sub_ps(_mm512_load_ps(s + 16 * k), top));
            if (diagonal) /* a masked key weighs exactly 0 */
                p = _mm512_maskz_mov_ps(_mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + k)), _MM_CMPINT_NLT), p);
            _mm512_store_ps(s + 16 * k, p);
            part = _mm512_add_ps(part, p);
            __asm__("" : "+v"(part)); /* key order, whatever -ffast-math would re-associate */
        }
        sum = _mm512_fmadd_ps(sum, alpha, part);
        for (int64_t d0 = 0; d0 < dim; d0 += 16) fma_prompt_values(o, s, vf + k0 * dim, dim, d0, nk, alpha);
    }
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(sum, _mm512_set1_ps(FLT_MIN))));
    for (int64_t m = 0; m < 16 && 16 * t + m < stacked; m++) {
        const int64_t r = 16 * t + m, i = r / group, h = g * group + r % group;
        bf16 *dst = j->out + (i * j->heads + h) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = f32_to_bf16(o[16 * d + m] * inv[m]);
    }
}

/* A few row tiles of one kv head, heaviest first (the last rows see the most keys). */
#define PF_TILES_PER_CHUNK 4
static void fma_prompt_tile_chunk(const void *arg, int64_t chunk) {
    const fma_prompt_job *j = (const fma_prompt_job *)arg;
    const int64_t per_head = (j->row_tiles + PF_TILES_PER_CHUNK - 1) / PF_TILES_PER_CHUNK;
    const int64_t g = chunk / per_head, first = (chunk % per_head) * PF_TILES_PER_CHUNK;
    for (int64_t n = first; n < first + PF_TILES_PER_CHUNK && n < j->row_tiles; n++)
        fma_prompt_tile(j, g, j->row_tiles - 1 - n);
}
#endif

/* --- Prompt attention on AVX2 FMAs, where the CPU has no AVX-512 (AMD Zen 3 seen) -----------------
 *
 * The AVX-512 kernel above with tiles of 8 stacked rows (a ymm register's lanes) and blocks of 16
 * keys: K and V of a kv head widened once to float32, then per tile S^T = K Q^T on float32 FMAs, an
 * online softmax in base 2 and O^T += V^T P^T on float32 FMAs, key blocks in position order. Each row
 * sees only its own q and the keys, in one fixed order, so its bits depend neither on the rows beside
 * it nor on how a prompt is chunked. Without it an AVX2 build ran each prompt row through the decode
 * kernel: 2,265 of a 5,072 ms 1,600-token prefill on a 2-core Zen 3 (benchmarks/prefill_breakdown.py). */
#if !defined(TS_AMX) && !defined(TS_PROMPT_FMA) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_PROMPT_AVX2 1
#define PV_KEYS 16
#define PV_MAX_DIM 256

typedef struct {
    const bf16 *q, *k_cache, *v_cache;
    const int64_t *table;
    int64_t q_stride, rows, start_pos, heads, kv_heads, dim, block_size, ctx, key_blocks, row_tiles;
    float *kf, *vf; /* [kv_heads][key_blocks * PV_KEYS][dim], float32, zeros past ctx */
    bf16 *out;
    float scale_log2; /* softmax scale times log2(e): scores in the base-2 domain */
} avx2_prompt_job;

/* 2^t, 8 lanes, for t clamped to [-126, 127]: 2^floor(t) (built in the exponent bits) times
 * exp2_512's degree-4 fit of 2^f on f = t - floor(t). Below -126 it gives 2^-126 times the fit, not
 * 0: masked keys are zeroed apart, and a weight that small adds nothing a float32 sum keeps. */
static inline __m256 exp2_256(__m256 t) {
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(127.0f));
    const __m256 fl = _mm256_floor_ps(t), f = _mm256_sub_ps(t, fl);
    __m256 p = _mm256_set1_ps(1.3520600e-02f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.2037430e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4142749e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9300662e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000025f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* K and V of kv head g, key blocks 8 c .. 8 c + 7 of its share, widened to float32. */
static void avx2_prompt_widen_chunk(const void *arg, int64_t chunk) {
    const avx2_prompt_job *j = (const avx2_prompt_job *)arg;
    const int64_t per_head = (j->key_blocks + 7) / 8;
    const int64_t g = chunk / per_head, kb0 = (chunk % per_head) * 8;
    const int64_t kb1 = kb0 + 8 < j->key_blocks ? kb0 + 8 : j->key_blocks;
    const int64_t dim = j->dim, kv_width = j->kv_heads * dim, bs = j->block_size;
    for (int64_t key = kb0 * PV_KEYS; key < kb1 * PV_KEYS; key++) {
        const int64_t at = (g * j->key_blocks * PV_KEYS + key) * dim;
        float *kd = j->kf + at, *vd = j->vf + at;
        if (key >= j->ctx) {
            memset(kd, 0, (size_t)dim * sizeof(float));
            memset(vd, 0, (size_t)dim * sizeof(float));
            continue;
        }
        const int64_t slot = j->table[key / bs] * bs + key % bs;
        const bf16 *kr = j->k_cache + slot * kv_width + g * dim, *vr = j->v_cache + slot * kv_width + g * dim;
        for (int64_t d = 0; d < dim; d++) kd[d] = bf16_to_f32(kr[d]);
        for (int64_t d = 0; d < dim; d++) vd[d] = bf16_to_f32(vr[d]);
    }
}

/* S^T of keys k0 .. k0 + 7 (float32 rows kh, dim apart) for the tile's 8 rows into s. */
static inline __attribute__((always_inline)) void avx2_prompt_scores(const float *qt, const float *kh, int64_t dim,
                                                                     float *s) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const __m256 qd = _mm256_load_ps(qt + 8 * d);
        for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kh + k * dim + d), acc[k]);
    }
    for (int k = 0; k < 8; k++) _mm256_store_ps(s + 8 * k, acc[k]);
}

/* O^T[d0 .. d0 + 7] (8 rows each, in o) rescaled by alpha, plus the block's P^T (in s) times its
 * values (float32 rows vk, dim apart). */
static inline __attribute__((always_inline)) void avx2_prompt_values(float *o, const float *s, const float *vk,
                                                                     int64_t dim, int64_t d0, __m256 alpha) {
    __m256 acc[8];
    for (int dd = 0; dd < 8; dd++) acc[dd] = _mm256_mul_ps(_mm256_load_ps(o + 8 * (d0 + dd)), alpha);
    for (int64_t k = 0; k < PV_KEYS; k++) {
        const __m256 p = _mm256_load_ps(s + 8 * k);
        const float *v = vk + k * dim + d0;
        for (int dd = 0; dd < 8; dd++) acc[dd] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(v + dd), acc[dd]);
    }
    for (int dd = 0; dd < 8; dd++) _mm256_store_ps(o + 8 * (d0 + dd), acc[dd]);
}

/* 8 stacked rows (row tile t) of kv head g over every key block they see. */
static void avx2_prompt_tile(const avx2_prompt_job *j, int64_t g, int64_t t) {
    const int64_t group = j->heads / j->kv_heads, dim = j->dim, stacked = j->rows * group;
    float qt[PV_MAX_DIM * 8] __attribute__((aligned(32)));
    float o[PV_MAX_DIM * 8] __attribute__((aligned(32)));
    float s[PV_KEYS * 8] __attribute__((aligned(32)));
    int32_t pos[8];
    int64_t min_pos = INT64_MAX, max_pos = -1;
    for (int64_t m = 0; m < 8; m++) {
        const int64_t r = 8 * t + m;
        if (r >= stacked) { /* padding: every key masked, never written */
            pos[m] = -1;
            for (int64_t d = 0; d < dim; d++) qt[8 * d + m] = 0.0f;
            continue;
        }
        const int64_t i = r / group, h = g * group + r % group;
        pos[m] = (int32_t)(j->start_pos + i);
        min_pos = pos[m] < min_pos ? pos[m] : min_pos;
        max_pos = pos[m] > max_pos ? pos[m] : max_pos;
        const bf16 *row = j->q + i * j->q_stride + h * dim;
        for (int64_t d = 0; d < dim; d++) qt[8 * d + m] = bf16_to_f32(row[d]) * j->scale_log2;
    }
    memset(o, 0, (size_t)(8 * dim) * sizeof(float));
    const __m256i posv = _mm256_loadu_si256((const __m256i *)pos);
    const __m256 masked = _mm256_set1_ps(-1e30f);
    __m256 top = masked, sum = _mm256_setzero_ps();
    const float *kf = j->kf + g * j->key_blocks * PV_KEYS * dim, *vf = j->vf + g * j->key_blocks * PV_KEYS * dim;
    const int64_t blocks = max_pos / PV_KEYS + 1;
    for (int64_t kb = 0; kb < blocks; kb++) {
        const int64_t k0 = kb * PV_KEYS;
        const int diagonal = k0 + PV_KEYS - 1 > min_pos; /* keys past some row's position: masked for it */
        avx2_prompt_scores(qt, kf + k0 * dim, dim, s);
        avx2_prompt_scores(qt, kf + (k0 + 8) * dim, dim, s + 64);
        __m256 block_top = masked;
        for (int64_t k = 0; k < PV_KEYS; k++) {
            const __m256 sk = _mm256_load_ps(s + 8 * k);
            if (diagonal) { /* the rows at position >= k0 + k see key k0 + k */
                const __m256 sees = _mm256_castsi256_ps(_mm256_cmpgt_epi32(posv, _mm256_set1_epi32((int32_t)(k0 + k - 1))));
                block_top = _mm256_blendv_ps(block_top, _mm256_max_ps(block_top, sk), sees);
            } else {
                block_top = _mm256_max_ps(block_top, sk);
            }
        }
        const __m256 fresh = _mm256_max_ps(top, block_top);
        const __m256 alpha = exp2_256(_mm256_sub_ps(top, fresh)); /* 1 where the maximum stayed */
        top = fresh;
        __m256 part = _mm256_setzero_ps();
        for (int64_t k = 0; k < PV_KEYS; k++) {
            __m256 p = exp2_256(_mm256_sub_ps(_mm256_load_ps(s + 8 * k), top));
            if (diagonal) /* a masked key weighs exactly 0 */
                p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(posv, _mm256_set1_epi32((int32_t)(k0 + k - 1)))));
            _mm256_store_ps(s + 8 * k, p);
            part = _mm256_add_ps(part, p);
            __asm__("" : "+x"(part)); /* key order, whatever -ffast-math would re-associate */
        }
        sum = _mm256_fmadd_ps(sum, alpha, part);
        for (int64_t d0 = 0; d0 < dim; d0 += 8) avx2_prompt_values(o, s, vf + k0 * dim, dim, d0, alpha);
    }
    float inv[8];
    _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(sum, _mm256_set1_ps(FLT_MIN))));
    for (int64_t m = 0; m < 8 && 8 * t + m < stacked; m++) {
        const int64_t r = 8 * t + m, i = r / group, h = g * group + r % group;
        bf16 *dst = j->out + (i * j->heads + h) * dim;
        for (int64_t d = 0; d < dim; d++) dst[d] = f32_to_bf16(o[8 * d + m] * inv[m]);
    }
}

/* A few row tiles of one kv head, heaviest first (the last rows see the most keys). */
#define PV_TILES_PER_CHUNK 8
static void avx2_prompt_tile_chunk(const void *arg, int64_t chunk) {
    const avx2_prompt_job *j = (const avx2_prompt_job *)arg;
    const int64_t per_head = (j->row_tiles + PV_TILES_PER_CHUNK - 1) / PV_TILES_PER_CHUNK;
    const int64_t g = chunk / per_head, first = (chunk % per_head) * PV_TILES_PER_CHUNK;
    for (int64_t n = first; n < first + PV_TILES_PER_CHUNK && n < j->row_tiles; n++)
        avx2_prompt_tile(j, g, j->row_tiles - 1 - n);
}
#endif

int ts_paged_prompt_attention(const bf16 *q, int64_t q_stride, const bf16 *k_cache, const bf16 *v_cache,
                              const int64_t *block_table, int64_t rows, int64_t start_pos, bf16 *out, int64_t heads,
                              int64_t kv_heads, int64_t dim, int64_t block_size, float scale) {
#if defined(TS_AMX)
    if (!amx_ready || (dim != 32 && dim != 64) || block_size % 16 != 0 || rows < 1 || heads % kv_heads != 0) return 0;
    const int64_t ctx = start_pos + rows, key_blocks = (ctx + PA_KEYS - 1) / PA_KEYS;
    const int64_t row_tiles = (rows * (heads / kv_heads) + 15) / 16;
    static __thread scratch_buf values_scratch; /* the caller's; its chunks write disjoint parts */
    bf16 *vt = (bf16 *)scratch_grow(&values_scratch, (size_t)(kv_heads * key_blocks * dim * PA_KEYS) * sizeof(bf16));
    if (vt == NULL) abort();
    const prompt_job job = {q, k_cache, v_cache, block_table, q_stride, rows, start_pos, heads, kv_heads, dim,
                            block_size, ctx, key_blocks, row_tiles, 8, vt, out, scale * 1.44269504088896341f};
    parallel_chunks(prompt_repack_chunk, &job, kv_heads * ((key_blocks + 7) / 8));
    parallel_chunks(prompt_tile_chunk, &job, kv_heads * ((row_tiles + PA_TILES_PER_CHUNK - 1) / PA_TILES_PER_CHUNK));
    return 1;
#elif defined(TS_PROMPT_FMA)
    if (dim % 16 != 0 || dim > PF_MAX_DIM || rows < 1 || heads % kv_heads != 0) return 0;
    const int64_t ctx = start_pos + rows, key_blocks = (ctx + PF_KEYS - 1) / PF_KEYS;
    const int64_t row_tiles = (rows * (heads / kv_heads) + 15) / 16;
    static __thread scratch_buf widened_scratch; /* the caller's; its chunks write disjoint parts */
    const size_t per = (size_t)(kv_heads * key_blocks * PF_KEYS * dim);
#if defined(PF_QK_INT8)
    const int int8 = dim % 32 == 0; /* a head size off whole groups of 32 keeps float32 scores */
#else
    const int int8 = 0;
#endif
    /* V float32, then K: float32, or its codes, scales and offsets (per / 32 groups) */
    const size_t k_bytes = int8 ? per + 2 * (per / 32) * 4 : per * sizeof(float);
    float *vf = (float *)scratch_grow(&widened_scratch, per * sizeof(float) + k_bytes);
    if (vf == NULL) abort();
    fma_prompt_job job = {q, k_cache, v_cache, block_table, q_stride, rows, start_pos, heads, kv_heads, dim,
                          block_size, ctx, key_blocks, row_tiles, int8 ? NULL : vf + per, vf, out,
                          scale * 1.44269504088896341f, int8};
#if defined(PF_QK_INT8)
    job.k8 = int8 ? (int8_t *)(vf + per) : NULL;
    job.ks = int8 ? (float *)(job.k8 + per) : NULL;
    job.kc = int8 ? (int32_t *)(job.ks + per / 32) : NULL;
#endif
    parallel_chunks(fma_prompt_widen_chunk, &job, kv_heads * ((key_blocks + 7) / 8));
    parallel_chunks(fma_prompt_tile_chunk, &job, kv_heads * ((row_tiles + PF_TILES_PER_CHUNK - 1) / PF_TILES_PER_CHUNK));
    return 1;
#elif defined(TS_PROMPT_AVX2)
    if (dim % 16 != 0 || dim > PV_MAX_DIM || rows < 1 || heads % kv_heads != 0) return 0;
    const int64_t ctx = start_pos + rows, key_blocks = (ctx + PV_KEYS - 1) / PV_KEYS;
    const int64_t row_tiles = (rows * (heads / kv_heads) + 7) / 8;
    static __thread scratch_buf widened_scratch; /* the caller's; its chunks write disjoint parts */
    const size_t per = (size_t)(kv_heads * key_blocks * PV_KEYS * dim);
    float *vf = (float *)scratch_grow(&widened_scratch, 2 * per * sizeof(float));
    if (vf == NULL) abort();
    const avx2_prompt_job job = {q, k_cache, v_cache, block_table, q_stride, rows, start_pos, heads, kv_heads, dim,
                                 block_size, ctx, key_blocks, row_tiles, vf + per, vf, out,
                                 scale * 1.44269504088896341f};
    parallel_chunks(avx2_prompt_widen_chunk, &job, kv_heads * ((key_blocks + 7) / 8));
    parallel_chunks(avx2_prompt_tile_chunk, &job, kv_heads * ((row_tiles + PV_TILES_PER_CHUNK - 1) / PV_TILES_PER_CHUNK));
    return 1;
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_table, (void)rows, (void)start_pos, (void)out;
    (void)heads, (void)kv_heads, (void)dim, (void)block_size, (void)scale;
    return 0;
#endif
}

/* --- Prompt rows on int8 dot products (VNNI), where the CPU has no bf16 arithmetic ----------------
 *
 * A CPU with AVX512-VNNI but neither AMX nor AVX512-BF16 (Ice Lake; a Xeon VM that hides both) runs
 * torch's bf16 GEMM emulated (~60 GFLOP/s on 2 vCPUs) and its float32 GEMM at ~290, while
 * VPDPBUSD multiplies 64 byte pairs an instruction. So prompt rows go through the file's int4
 * groups as they are, times the activations rounded to int8 per row and group of 32 inputs (the
 * scheme of llama.cpp's Q4_1 x Q8_1 dot products):
 *   x[m, k] ~ xq[m, k] * d[m, g]   (d = the group's largest |x| / 127, xq rounded to nearest, |xq| <= 127)
 *   y[m, n] = sum over g of d[m, g] (scale[n, g] (sum over the group of code[n, k] xq[m, k])
 *                                   + min[n, g] (sum over the group of xq[m, k]))   (+ bias[n])
 * with w = scale * code + min the groups' exact weights: the exact product of the weights and the
 * rounded activations. Both sums over a group are integers (exact, any order); the groups are
 * added in order in float32 and the result rounded once to bf16. (The min term over the exact x
 * instead, tried first, multiplies each activation's rounding error by scale * code, 0 .. 15
 * scales, not by the weight itself, centred on 0: the quality gate's prompt rows fell to 90%.) Every step is per row and
 * output, so a row's bits do not depend on the rows beside it or the thread count (which lets a
 * prefill lane run over it). Codes laid out per 16 outputs and k-quad c: lane j holds codes (j,
 * 4c .. 4c + 3), 64 bytes (ts_pack_q4a8); scale and min float32 [N/16, K/32, 16] as ts_q4_matmul's. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TS_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TS_QA_AVX2 1 /* the same products on AVX2: below this build's */
#endif

#if defined(TS_VNNI) || defined(TS_QA_AVX2)
#define QA_TILES 4 /* 16-output tiles of a job chunk */
#define QA_ROWS 60  /* rows of a job chunk: blocks of 6 (VNNI) or 4 (AVX2) */

typedef struct {
    const bf16 *x;
    int8_t *xq, *xlo; /* xlo: NULL, or (a16) the low 7 bits of each value, xq then its high bits */
    float *d, *xsum;
    int64_t k, groups;
} qa_quant_args;

typedef struct {
    const int8_t *xq, *xlo; /* xlo: as qa_quant_args' */
    const float *d, *xsum;
    const uint8_t *w;
    const float *scale, *min;
    const bf16 *bias;
    bf16 *out;
    float *out32; /* or float32 outputs here (out unused), unrounded: the LM head's logits */
    int64_t rows, k, groups, n_out, tiles, tile_blocks;
    int wide; /* codes 0 .. 255 (the q8 head's): AVX2 runs them as two nibbles; VPDPBUSD takes them whole */
} qa_job;

static __thread scratch_buf qa_scratch; /* the caller's: the rounded activations of a call */
#endif

#if defined(TS_VNNI)

/* One group of 32 activations rounded to int8 (to int16 within +-16383 where low is set: q = 128 xq
 * + low, low in 0 .. 127, xq in -128 .. 127) by limit / its largest |x|, which it returns; *sum the
 * exact sum of the rounded values. */
static inline float qa_quant_group(const bf16 *src, float limit, int8_t *dst, int8_t *low, int32_t *sum) {
    const __m512 lo = load16_bf16(src), hi = load16_bf16(src + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? limit / top : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    if (low == NULL) {
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(qhi));
    } else {
        const __m512i low7 = _mm512_set1_epi32(127);
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(_mm512_srai_epi32(qlo, 7)));
        _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qhi, 7)));
        _mm_storeu_si128((__m128i *)low, _mm512_cvtepi32_epi8(_mm512_and_si512(qlo, low7)));
        _mm_storeu_si128((__m128i *)(low + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(qhi, low7)));
    }
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    return top;
}

/* Rows m .. m + MR - 1 x tiles t .. t + NT - 1 of the output, every group in order. */
static inline __attribute__((always_inline)) void qa_pass(__m512i acc[6][2], const uint8_t *w, int64_t tile_bytes,
                                                          const int8_t *xg, int64_t k, const int MR, const int NT) {
    for (int c = 0; c < 8; c++) {
        __m512i wv[2];
        for (int u = 0; u < NT; u++) wv[u] = _mm512_loadu_si512(w + u * tile_bytes + 64 * c);
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xg + i * k + 4 * c, 4);
            const __m512i xb = _mm512_set1_epi32(quad);
            for (int u = 0; u < NT; u++) acc[i][u] = _mm512_dpbusd_epi32(acc[i][u], wv[u], xb);
        }
    }
}

/* A16 (compile-time in every call): the activations' low bytes in a second pass (ts_q4a16_matmul). */
static inline __attribute__((always_inline)) void qa_block(const qa_job *j, int64_t t, int64_t m, const int MR,
                                                           const int NT, const int A16) {
    const int64_t k = j->k, groups = j->groups, tile_bytes = (k / 4) * 64;
    __m512 out[6][2];
    for (int i = 0; i < MR; i++)
        for (int u = 0; u < NT; u++) out[i][u] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[6][2];
        for (int i = 0; i < MR; i++)
            for (int u = 0; u < NT; u++) acc[i][u] = _mm512_setzero_si512();
        const uint8_t *w = j->w + t * tile_bytes + g * 8 * 64;
        qa_pass(acc, w, tile_bytes, j->xq + m * k + 32 * g, k, MR, NT);
        if (A16) { /* 128 x (codes . high bits) + codes . low bits, exact in int32 */
            for (int i = 0; i < MR; i++)
                for (int u = 0; u < NT; u++) acc[i][u] = _mm512_slli_epi32(acc[i][u], 7);
            qa_pass(acc, w, tile_bytes, j->xlo + m * k + 32 * g, k, MR, NT);
        }
        for (int u = 0; u < NT; u++) {
            const __m512 sc = _mm512_loadu_ps(j->scale + ((t + u) * groups + g) * 16);
            const __m512 mn = _mm512_loadu_ps(j->min + ((t + u) * groups + g) * 16);
            for (int i = 0; i < MR; i++) {
                const __m512 sd = _mm512_mul_ps(sc, _mm512_set1_ps(j->d[(m + i) * groups + g]));
                out[i][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][u]), sd, out[i][u]);
                out[i][u] = _mm512_fmadd_ps(mn, _mm512_set1_ps(j->xsum[(m + i) * groups + g]), out[i][u]);
            }
        }
    }
    for (int u = 0; u < NT; u++) {
        const __m512 b = j->bias == NULL ? _mm512_setzero_ps() : load16_bf16(j->bias + (t + u) * 16);
        for (int i = 0; i < MR; i++) {
            const int64_t at = (m + i) * j->n_out + (t + u) * 16;
            if (j->out32 != NULL) _mm512_storeu_ps(j->out32 + at, _mm512_add_ps(out[i][u], b));
            else store16_bf16(j->out + at, _mm512_add_ps(out[i][u], b));
        }
    }
}

static inline __attribute__((always_inline)) void qa_chunk_as(const qa_job *j, int64_t chunk, const int A16) {
    const int64_t tb = chunk % j->tile_blocks, rb = chunk / j->tile_blocks;
    const int64_t t0 = tb * QA_TILES, t1 = t0 + QA_TILES < j->tiles ? t0 + QA_TILES : j->tiles;
    const int64_t m0 = rb * QA_ROWS, m1 = m0 + QA_ROWS < j->rows ? m0 + QA_ROWS : j->rows;
    for (int64_t t = t0; t < t1; t += 2) {
        const int pair = t + 1 < t1;
        int64_t m = m0;
        for (; m + 6 <= m1; m += 6) {
            if (pair) qa_block(j, t, m, 6, 2, A16);
            else qa_block(j, t, m, 6, 1, A16);
        }
        for (; m + 2 <= m1; m += 2) {
            if (pair) qa_block(j, t, m, 2, 2, A16);
            else qa_block(j, t, m, 2, 1, A16);
        }
        for (; m < m1; m++) {
            if (pair) qa_block(j, t, m, 1, 2, A16);
            else qa_block(j, t, m, 1, 1, A16);
        }
    }
}

static void qa_chunk(const void *arg, int64_t chunk) {
    const qa_job *j = (const qa_job *)arg;
    if (j->xlo != NULL) qa_chunk_as(j, chunk, 1);
    else qa_chunk_as(j, chunk, 0);
}
#endif

/* The same products on AVX2 (no AVX-512: AMD Zen 3 seen), from the same packed codes: VPMADDUBSW
 * multiplies 32 byte pairs (codes 0 .. 15 unsigned, activations signed) and adds them in pairs to
 * int16; a group's 8 k-quads add up there (each pair at most 2 x 15 x 128, eight of them below
 * 2^15, so no sum saturates), then VPMADDWD by ones takes each output's four int16 sums to int32:
 * the group's exact integer sum, as VPDPBUSD gives it. 8-bit codes (the q8 head's, 0 .. 255) run
 * as their high and low nibbles, 16 x high + low. The float32 epilogue is the VNNI kernel's, in its
 * order, so both builds give the same bits. */
#if defined(TS_QA_AVX2)

/* qa_quant_group of the VNNI build, element by element (the same values). */
static inline float qa_quant_group(const bf16 *src, float limit, int8_t *dst, int8_t *low, int32_t *sum) {
    float v[32], top = 0.0f;
    for (int i = 0; i < 32; i++) {
        v[i] = bf16_to_f32(src[i]);
        top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
    }
    const float inv = top > 0.0f ? limit / top : 0.0f;
    int32_t total = 0;
    for (int i = 0; i < 32; i++) {
        const int32_t q = (int32_t)lrintf(v[i] * inv);
        total += q;
        if (low == NULL) {
            dst[i] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        } else {
            dst[i] = (int8_t)(q >> 7);
            low[i] = (int8_t)(q & 127);
        }
    }
    *sum = total;
    return top;
}

/* Rows m .. m + MR - 1 x tile t of the output from their float32 sums (out[i][h]: outputs 8h .. 8h +
 * 7), plus the bias, into out (rounded to bf16) or out32 (as they are). */
static inline __attribute__((always_inline)) void qa_store(const qa_job *j, __m256 out[][2], int64_t t, int64_t m,
                                                           const int MR) {
    for (int i = 0; i < MR; i++) {
        float y[16];
        _mm256_storeu_ps(y, out[i][0]);
        _mm256_storeu_ps(y + 8, out[i][1]);
        const int64_t at = (m + i) * j->n_out + t * 16;
        for (int n = 0; n < 16; n++) {
            const float b = j->bias == NULL ? 0.0f : bf16_to_f32(j->bias[t * 16 + n]);
            if (j->out32 != NULL) j->out32[at + n] = y[n] + b;
            else j->out[at + n] = f32_to_bf16(y[n] + b);
        }
    }
}

/* Group g of rows m .. m + MR - 1 x one 16-output tile (w its codes): acc[i][h] the exact int32 sums
 * of outputs 8h .. 8h + 7. NIB: 0 the codes as stored (0 .. 15), 1 their low nibble, 2 their high. */
static inline __attribute__((always_inline)) void qa_pass(__m256i acc[4][2], const uint8_t *w, const int8_t *xg,
                                                          int64_t k, const int MR, const int NIB) {
    __m256i s16[4][2];
    for (int i = 0; i < MR; i++) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
    const __m256i nib = _mm256_set1_epi8(15);
    for (int c = 0; c < 8; c++) {
        __m256i wv[2];
        for (int h = 0; h < 2; h++) {
            wv[h] = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * h));
            if (NIB == 1) wv[h] = _mm256_and_si256(wv[h], nib);
            if (NIB == 2) wv[h] = _mm256_and_si256(_mm256_srli_epi16(wv[h], 4), nib);
        }
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, xg + i * k + 4 * c, 4);
            const __m256i xb = _mm256_set1_epi32(quad);
            for (int h = 0; h < 2; h++) s16[i][h] = _mm256_add_epi16(s16[i][h], _mm256_maddubs_epi16(wv[h], xb));
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++) acc[i][h] = _mm256_madd_epi16(s16[i][h], ones);
}

/* Rows m .. m + MR - 1 x tile t of the output, every group in order. A16 / WIDE: compile-time. */
static inline __attribute__((always_inline)) void qa_block(const qa_job *j, int64_t t, int64_t m, const int MR,
                                                           const int A16, const int WIDE) {
    const int64_t k = j->k, groups = j->groups, tile_bytes = (k / 4) * 64;
    __m256 out[4][2];
    for (int i = 0; i < MR; i++) out[i][0] = out[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[4][2], more[4][2];
        const uint8_t *w = j->w + t * tile_bytes + g * 8 * 64;
        const int8_t *xg = j->xq + m * k + 32 * g;
        if (WIDE) { /* 16 x (high nibbles . x) + low nibbles . x */
            qa_pass(acc, w, xg, k, MR, 2);
            qa_pass(more, w, xg, k, MR, 1);
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++) acc[i][h] = _mm256_add_epi32(_mm256_slli_epi32(acc[i][h], 4), more[i][h]);
        } else {
            qa_pass(acc, w, xg, k, MR, 0);
        }
        if (A16) { /* 128 x (codes . high bits) + codes . low bits, exact in int32 */
            qa_pass(more, w, j->xlo + m * k + 32 * g, k, MR, 0);
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++) acc[i][h] = _mm256_add_epi32(_mm256_slli_epi32(acc[i][h], 7), more[i][h]);
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sc = _mm256_loadu_ps(j->scale + (t * groups + g) * 16 + 8 * h);
            const __m256 mn = _mm256_loadu_ps(j->min + (t * groups + g) * 16 + 8 * h);
            for (int i = 0; i < MR; i++) {
                const __m256 sd = _mm256_mul_ps(sc, _mm256_set1_ps(j->d[(m + i) * groups + g]));
                out[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), sd, out[i][h]);
                out[i][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(j->xsum[(m + i) * groups + g]), out[i][h]);
            }
        }
    }
    qa_store(j, out, t, m, MR);
}

/* qa_block's A16 products in one pass over the codes: each k-quad's two code vectors meet both
 * activation bytes of every row before the next quad loads, and the quad loop is not unrolled
 * (unrolled, gcc spilled the accumulators of two passes to the stack). The same integer sums and
 * float32 epilogue in the same order, so the same bits as qa_block; a decode step's 30 layers of
 * int4a16 matmuls 0-20% faster (even at 1-4 rows, 10% at 8-32, 13-20% at 64-256; 2-vCPU Zen 3,
 * 2 threads, 2026-12-08). MR at most 2: 4 int16 sums a row and h, 16 registers. */
static inline __attribute__((always_inline)) void qa_block_a16(const qa_job *j, int64_t t, int64_t m, const int MR) {
    const int64_t k = j->k, groups = j->groups, tile_bytes = (k / 4) * 64;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 out[2][2];
    for (int i = 0; i < MR; i++) out[i][0] = out[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *w = j->w + t * tile_bytes + g * 8 * 64;
        const int8_t *xh = j->xq + m * k + 32 * g, *xl = j->xlo + m * k + 32 * g;
        __m256i hi[2][2], lo[2][2];
        for (int i = 0; i < MR; i++) hi[i][0] = hi[i][1] = lo[i][0] = lo[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int c = 0; c < 8; c++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32));
            for (int i = 0; i < MR; i++) {
                int32_t qh, ql;
                memcpy(&qh, xh + i * k + 4 * c, 4);
                memcpy(&ql, xl + i * k + 4 * c, 4);
                const __m256i bh = _mm256_set1_epi32(qh), bl = _mm256_set1_epi32(ql);
                hi[i][0] = _mm256_add_epi16(hi[i][0], _mm256_maddubs_epi16(w0, bh));
                hi[i][1] = _mm256_add_epi16(hi[i][1], _mm256_maddubs_epi16(w1, bh));
                lo[i][0] = _mm256_add_epi16(lo[i][0], _mm256_maddubs_epi16(w0, bl));
                lo[i][1] = _mm256_add_epi16(lo[i][1], _mm256_maddubs_epi16(w1, bl));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sc = _mm256_loadu_ps(j->scale + (t * groups + g) * 16 + 8 * h);
            const __m256 mn = _mm256_loadu_ps(j->min + (t * groups + g) * 16 + 8 * h);
            for (int i = 0; i < MR; i++) {
                const __m256i acc = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi[i][h], ones), 7),
                                                     _mm256_madd_epi16(lo[i][h], ones));
                const __m256 sd = _mm256_mul_ps(sc, _mm256_set1_ps(j->d[(m + i) * groups + g]));
                out[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), sd, out[i][h]);
                out[i][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(j->xsum[(m + i) * groups + g]), out[i][h]);
            }
        }
    }
    qa_store(j, out, t, m, MR);
}

static inline __attribute__((always_inline)) void qa_chunk_as(const qa_job *j, int64_t chunk, const int A16,
                                                              const int WIDE) {
    const int64_t tb = chunk % j->tile_blocks, rb = chunk / j->tile_blocks;
    const int64_t t0 = tb * QA_TILES, t1 = t0 + QA_TILES < j->tiles ? t0 + QA_TILES : j->tiles;
    const int64_t m0 = rb * QA_ROWS, m1 = m0 + QA_ROWS < j->rows ? m0 + QA_ROWS : j->rows;
    for (int64_t t = t0; t < t1; t++) {
        int64_t m = m0;
        if (A16) { /* never with out32 (the q8 head's float32 logits are WIDE, not A16) */
            for (; m + 2 <= m1; m += 2) qa_block_a16(j, t, m, 2);
            for (; m < m1; m++) qa_block_a16(j, t, m, 1);
            continue;
        }
        for (; m + 4 <= m1; m += 4) qa_block(j, t, m, 4, A16, WIDE);
        for (; m + 2 <= m1; m += 2) qa_block(j, t, m, 2, A16, WIDE);
        for (; m < m1; m++) qa_block(j, t, m, 1, A16, WIDE);
    }
}

static void qa_chunk(const void *arg, int64_t chunk) {
    const qa_job *j = (const qa_job *)arg;
    if (j->wide) qa_chunk_as(j, chunk, 0, 1);
    else if (j->xlo != NULL) qa_chunk_as(j, chunk, 1, 0);
    else qa_chunk_as(j, chunk, 0, 0);
}
#endif

/* How ts_paged_prompt_attention computes a prompt's scores: 0 it declines every prompt (the decode
 * kernel runs them), 1 AMX bf16 tiles, 2 float32 FMAs, 3 int8 dot products (q and k rounded per
 * group of 32, PF_QK_INT8) for head sizes that are multiples of 32, float32 FMAs for the others. */
int ts_prompt_scores(void) {
#if defined(TS_AMX)
    return 1;
#elif defined(PF_QK_INT8)
    return 3;
#elif defined(TS_PROMPT_FMA) || defined(TS_PROMPT_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* Which int8 dot products the build has: 1 AVX512-VNNI (VPDPBUSD), 2 AVX2 (VPMADDUBSW + VPMADDWD:
 * the same sums and bits, about half the products a cycle), 0 none. */
int ts_vnni(void) {
#if defined(TS_VNNI)
    return 1;
#elif defined(TS_QA_AVX2)
    return 2;
#else
    return 0;
#endif
}

#if defined(TS_VNNI) || defined(TS_QA_AVX2)
/* Rows r0 .. r1 - 1 of x rounded per group of 32 (qa_quant_group), with each group's d (its
 * largest |x| / limit) and exact sum times d. */
static void qa_quant_rows(const void *arg, int64_t r0, int64_t r1) {
    const qa_quant_args *a = (const qa_quant_args *)arg;
    const float limit = a->xlo == NULL ? 127.0f : 16383.0f;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < a->groups; g++) {
            const int64_t at = r * a->k + 32 * g;
            int32_t sum;
            const float top = qa_quant_group(a->x + at, limit, a->xq + at, a->xlo == NULL ? NULL : a->xlo + at, &sum);
            const float d = top / limit;
            a->d[r * a->groups + g] = d;
            a->xsum[r * a->groups + g] = d * (float)sum;
        }
}

static void qa_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                      const float *min, const bf16 *bias, int64_t n_out, bf16 *out, float *out32, int a16) {
    const int64_t groups = k / 32, tiles = n_out / 16;
    const size_t xq_bytes = (size_t)(rows * k + 63) / 64 * 64;
    const size_t bytes = (a16 ? 2 : 1) * xq_bytes + 2 * (size_t)(rows * groups) * sizeof(float);
    uint8_t *buf = (uint8_t *)scratch_grow(&qa_scratch, bytes);
    if (buf == NULL) abort();
    int8_t *xq = (int8_t *)buf, *xlo = a16 ? (int8_t *)(buf + xq_bytes) : NULL;
    float *d = (float *)(buf + (a16 ? 2 : 1) * xq_bytes), *xsum = d + rows * groups;
    const qa_quant_args qa = {x, xq, xlo, d, xsum, k, groups};
    parallel_rows(qa_quant_rows, &qa, rows, k);
    const int64_t tile_blocks = (tiles + QA_TILES - 1) / QA_TILES;
    const qa_job job = {xq, xlo, d, xsum, codes, scale, min, bias, out, out32, rows, k, groups, n_out, tiles, tile_blocks,
                        out32 != NULL};
    parallel_chunks(qa_chunk, &job, tile_blocks * ((rows + QA_ROWS - 1) / QA_ROWS));
}
#endif

/* out [rows, n_out] bf16 = x [rows, k] bf16 through the int4 groups, the activations rounded to
 * int8 per group of 32 (see above); n_out and k multiples of 16 and 32. Returns 0 (nothing
 * written) where the build has neither VNNI nor AVX2. Prompt rows; decode rows take ts_q4a16_matmul (below). */
int ts_q4a8_prefill_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                           const float *min, const bf16 *bias, int64_t n_out, bf16 *out) {
#if defined(TS_VNNI) || defined(TS_QA_AVX2)
    qa_matmul(x, rows, k, codes, scale, min, bias, n_out, out, NULL, 0);
    return 1;
#else
    (void)x, (void)rows, (void)k, (void)codes, (void)scale, (void)min, (void)bias, (void)n_out, (void)out;
    return 0;
#endif
}

/* The LM head on the same dot products: float32 logits [rows, n_out] = x through the file's Q8_0
 * groups, laid out as ts_q4a8_prefill_matmul's with each code stored plus 128 (0 .. 255) and min =
 * -128 scale (w = scale * stored + min, exact: -128 scale is a power-of-two multiple). Returns 0
 * (nothing written) where the build has neither VNNI nor AVX2. */
int ts_q8a8_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                   const float *min, int64_t n_out, float *out) {
#if defined(TS_VNNI) || defined(TS_QA_AVX2)
    qa_matmul(x, rows, k, codes, scale, min, NULL, n_out, NULL, out, 0);
    return 1;
#else
    (void)x, (void)rows, (void)k, (void)codes, (void)scale, (void)min, (void)n_out, (void)out;
    return 0;
#endif
}

/* Lay int4 codes [n_out, k] (one code a byte, 0..15; n_out a multiple of 16, k of 32) out as
 * ts_q4_matmul reads them: per 16 outputs and k-quad c, byte 2j = code(j, 4c) | code(j, 4c + 2) << 4,
 * byte 2j + 1 = code(j, 4c + 1) | code(j, 4c + 3) << 4. One pass (start-up packs every layer). */
void ts_pack_q4(const uint8_t *codes, int64_t n_out, int64_t k, uint8_t *packed) {
    for (int64_t t = 0; t < n_out / 16; t++)
        for (int64_t c = 0; c < k / 4; c++) {
            uint8_t *dst = packed + (t * (k / 4) + c) * 32;
            for (int64_t j = 0; j < 16; j++) {
                const uint8_t *src = codes + (t * 16 + j) * k + 4 * c;
                dst[2 * j] = (uint8_t)((src[0] & 15) | (src[2] << 4));
                dst[2 * j + 1] = (uint8_t)((src[1] & 15) | (src[3] << 4));
            }
        }
}

/* Structured outputs: -inf on every token a row's bitmask leaves unset (token t is allowed when bit
 * t % 32 of word t / 32 is set), in place on float32 logits. rows[r] is the logits row of bitmask
 * row r; tokens past the bitmask's width are banned. A full word (32 allowed tokens, the common case
 * inside a string) costs one compare. -inf is stored as its bit pattern: -ffast-math assumes finite
 * arithmetic, and no arithmetic touches it here. */
void ts_apply_token_bitmask(float *logits, int64_t row_stride, const int32_t *words, int64_t words_per_row,
                            const int64_t *rows, int64_t n_rows, int64_t vocab) {
    const uint32_t neg_inf = 0xff800000u;
    for (int64_t r = 0; r < n_rows; r++) {
        uint32_t *row = (uint32_t *)(logits + rows[r] * row_stride);
        const uint32_t *w = (const uint32_t *)(words + r * words_per_row);
        int64_t covered = words_per_row * 32 < vocab ? words_per_row * 32 : vocab;
        for (int64_t t0 = 0; t0 < covered; t0 += 32) {
            uint32_t bits = w[t0 >> 5];
            if (bits == 0xffffffffu) continue;
            int64_t end = t0 + 32 < covered ? t0 + 32 : covered;
            for (int64_t t = t0; t < end; t++)
                if (!((bits >> (t - t0)) & 1u)) row[t] = neg_inf;
        }
        for (int64_t t = covered; t < vocab; t++) row[t] = neg_inf;
    }
}

/* Decode rows where the CPU has VNNI but no bf16 arithmetic (`int4a16`): ts_q4a8_prefill_matmul's
 * groups and layout, the activations rounded to int16 (within +-16383, 2^-14 of the group's largest
 * |x|: nearly exact, where int8's 1/254 cost a decode row's top-1 1.4 points) and split in two
 * bytes, 128 x high + low, each multiplied on VPDPBUSD: twice the dot products of int8 activations,
 * the same codes read. Integer sums, so a row's bits hold at any thread count and batch. Returns 0
 * (nothing written) where the build has neither VNNI nor AVX2. */
int ts_q4a16_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                    const float *min, const bf16 *bias, int64_t n_out, bf16 *out) {
#if defined(TS_VNNI) || defined(TS_QA_AVX2)
    qa_matmul(x, rows, k, codes, scale, min, bias, n_out, out, NULL, 1);
    return 1;
#else
    (void)x, (void)rows, (void)k, (void)codes, (void)scale, (void)min, (void)bias, (void)n_out, (void)out;
    return 0;
#endif
}

/* The VNNI matmuls as ts_decode_layers calls its matmuls (the caller checked ts_vnni). */
static void q4a8_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                        const float *min, const bf16 *bias, int64_t n_out, bf16 *out) {
    (void)ts_q4a8_prefill_matmul(x, rows, k, codes, scale, min, bias, n_out, out);
}

static void q4a16_matmul(const bf16 *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                         const float *min, const bf16 *bias, int64_t n_out, bf16 *out) {
    (void)ts_q4a16_matmul(x, rows, k, codes, scale, min, bias, n_out, out);
}

/* --- A decode step's layers from one call ------------------------------------------------------
 *
 * A step of decode rows only runs every layer's kernels from this loop: the calls and arguments of
 * the fused forward's layer-by-layer path (cpu_fused.py), so its bits, without a Python call between
 * two kernels (a few microseconds each, nine a layer, the team's other threads spinning meanwhile).
 * `vnni` picks the matmul: 0 the int4 tile kernel (ts_q4_matmul), 1 int8 activations
 * (ts_q4a8_prefill_matmul), 2 int16 activations (ts_q4a16_matmul); 1 and 2 read codes, scale and
 * min where 0 reads packed, scale and shifted min. */
typedef struct {
    const uint8_t *packed[4]; /* qkv, o, gate|up, down: ts_q4_matmul's packed groups */
    const float *scale[4];
    const float *shifted_min[4];
    const bf16 *bias[4]; /* or NULL */
    const float *input_norm, *post_norm;
    bf16 *k_cache, *v_cache;
} ts_decode_layer;

void ts_decode_layers(const ts_decode_layer *layers, int64_t n_layers, float *h, bf16 *x, bf16 *qkv, bf16 *attn,
                      bf16 *o, bf16 *gate_up, bf16 *act, int64_t rows, int64_t dim, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t inter, const int64_t *positions, const float *cos_half,
                      const float *sin_half, const int64_t *slots, const int64_t *block_tables, int64_t table_width,
                      const int64_t *lens, int64_t block_size, float eps, float scale, int vnni) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim, q_size = heads * head_dim;
    void (*const mm)(const bf16 *, int64_t, int64_t, const uint8_t *, const float *, const float *, const bf16 *,
                     int64_t, bf16 *) = vnni == 2 ? q4a16_matmul : vnni == 1 ? q4a8_matmul : ts_q4_matmul;
    for (int64_t i = 0; i < n_layers; i++) {
        const ts_decode_layer *l = &layers[i];
        mm(x, rows, dim, l->packed[0], l->scale[0], l->shifted_min[0], l->bias[0], width, qkv);
        ts_rope_write_kv(qkv, positions, cos_half, sin_half, slots, l->k_cache, l->v_cache, rows, heads, kv_heads,
                         head_dim);
        ts_paged_decode_attention(qkv, width, l->k_cache, l->v_cache, block_tables, table_width, lens, attn, rows,
                                  heads, kv_heads, head_dim, block_size, scale);
        mm(attn, rows, q_size, l->packed[1], l->scale[1], l->shifted_min[1], l->bias[1], dim, o);
        ts_add_rms_norm(h, o, dim, l->post_norm, x, rows, dim, eps);
        mm(x, rows, dim, l->packed[2], l->scale[2], l->shifted_min[2], l->bias[2], 2 * inter, gate_up);
        ts_silu_mul(gate_up, act, rows, inter);
        mm(act, rows, inter, l->packed[3], l->scale[3], l->shifted_min[3], l->bias[3], dim, o);
        ts_add_rms_norm(h, o, dim, i + 1 < n_layers ? layers[i + 1].input_norm : NULL, x, rows, dim, eps);
    }
}
