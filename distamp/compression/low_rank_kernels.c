/*
 * PowerSGD's three passes over a gradient matrix on CPU, each one pass over memory.
 *
 * Built and loaded by low_rank_kernels.py (ctypes; no torch headers). The
 * hook's cost on CPU is memory traffic, not arithmetic: with torch ops the
 * first pass alone (widen the 16-bit gradient, divide by the loss scale,
 * add the error, M Q) reads and writes the matrix four times. Here:
 *
 *   start:   M = G / scale + E and P = M Q, one pass (reads G and E, writes M);
 *   project: Q^T = P^T M, one pass (reads M);
 *   finish:  A = P Q^T, out = A * scale (BF16 or FP32) and M -= A, one pass.
 *
 * Every result has a fixed order of operations, written out below, and the
 * library is compiled with -ffp-contract=off (no fused multiply-adds): the
 * bits are those of IEEE single precision evaluated in that order, the same
 * on every x86 or ARM host and for any split of the rows or columns among
 * threads.
 *
 *   M[i][j] = G[i][j] * (1 / scale) + E[i][j]  for a power-of-two scale (the
 *             same bits as G / scale + E), else G[i][j] / scale + E[i][j];
 *   P[i][k] = (lane[0] + lane[1] + ... + lane[15]) + M[i][t] Q^T[k][t] for each
 *             tail column t in order, where lane[l] is the running sum, in
 *             column order, of M[i][j] Q^T[k][j] over the columns j < 16 *
 *             floor(cols / 16) with j % 16 == l;
 *   Q^T[k][j] = running sum over i in row order of P[i][k] M[i][j], from 0;
 *   A[i][j] = running sum over k in order of P[i][k] Q^T[k][j], from the k = 0 term;
 *   BF16 out: A * scale rounded to nearest even (NaN -> 0x7FC0), as torch rounds.
 *
 * orthogonalize: Gram-Schmidt on the r vectors of P (its columns) or Q^T
 * (its rows), in order: v_i /= |v_i| (left as it is where |v_i| is 0, so an
 * all-zero gradient column makes no NaN), then v_c -= (v_i . v_c) v_i for
 * each later c. Norms and dot products are summed in double, element by
 * element in order, and rounded once to single.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define LANES 16
#define K_BLOCK 4
#define FINISH_CHUNK 512

typedef float f32xL __attribute__((vector_size(4 * LANES)));
typedef uint32_t u32xL __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16xL __attribute__((vector_size(2 * LANES)));

static inline f32xL load_f32(const float *x) { f32xL v; memcpy(&v, x, sizeof v); return v; }
static inline void store_f32(float *x, f32xL v) { memcpy(x, &v, sizeof v); }

/* A store that bypasses the cache where the ISA has one (M and the gradient are not read again soon:
 * a cached store would first read the line it overwrites). Same bits either way. */
static inline void stream_f32(float *x, f32xL v) {
#if defined(__AVX512F__)
    if (((uintptr_t)x & 63) == 0) { _mm512_stream_ps(x, (__m512)v); return; }
#elif defined(__AVX__)
    if (((uintptr_t)x & 31) == 0) {
        __m256 lo, hi;
        memcpy(&lo, &v, 32);
        memcpy(&hi, (const char *)&v + 32, 32);
        _mm256_stream_ps(x, lo);
        _mm256_stream_ps(x + 8, hi);
        return;
    }
#endif
    store_f32(x, v);
}

static inline void stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static inline f32xL load_bf16(const uint16_t *x) {
    u16xL h;
    memcpy(&h, x, sizeof h);
    u32xL w = __builtin_convertvector(h, u32xL) << 16;
    f32xL f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void stream_bf16(uint16_t *x, f32xL f) {
    u32xL u;
    memcpy(&u, &f, sizeof u);
    u32xL nan = (u32xL)((u & 0x7fffffffu) > 0x7f800000u);
    u32xL rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    u16xL h = __builtin_convertvector((rounded & ~nan) | (0x7fc0u & nan), u16xL);
#if defined(__AVX__)
    if (((uintptr_t)x & 31) == 0) {
        __m256i w;
        memcpy(&w, &h, sizeof w);
        _mm256_stream_si256((__m256i *)x, w);
        return;
    }
#endif
    memcpy(x, &h, sizeof h);
}

static inline float unscale(float g, float scale, float inverse, int by_inverse) {
    return by_inverse ? g * inverse : g / scale;
}

/* M = G / scale (+ E) and P = M Q for rows [row0, row1). G is BF16 (g_is_bf16) or FP32 (may be M itself). */
void distamp_start(int g_is_bf16, const void *g, const float *e, float *m, const float *qt, float *p,
                   int64_t row0, int64_t row1, int64_t cols, int64_t rank, float scale, int by_inverse) {
    const float inverse = 1.0f / scale;
    const int64_t body = cols - cols % LANES;
    for (int64_t i = row0; i < row1; i++) {
        const uint16_t *g16 = g_is_bf16 ? (const uint16_t *)g + i * cols : 0;
        const float *g32 = g_is_bf16 ? 0 : (const float *)g + i * cols;
        const float *er = e ? e + i * cols : 0;
        float *mr = m + i * cols;
        for (int64_t k0 = 0; k0 < rank; k0 += K_BLOCK) {
            const int64_t kb = rank - k0 < K_BLOCK ? rank - k0 : K_BLOCK;
            /* Rows past the block's last read row k0 again; their sums are not stored. */
            const float *q0 = qt + k0 * cols;
            const float *q1 = kb > 1 ? q0 + cols : q0, *q2 = kb > 2 ? q0 + 2 * cols : q0;
            const float *q3 = kb > 3 ? q0 + 3 * cols : q0;
            f32xL a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            if (k0 == 0) {
                for (int64_t j = 0; j < body; j += LANES) {
                    f32xL x = g_is_bf16 ? load_bf16(g16 + j) : load_f32(g32 + j);
                    x = by_inverse ? x * inverse : x / scale;
                    if (er) x += load_f32(er + j);
                    stream_f32(mr + j, x);
                    a0 += x * load_f32(q0 + j);
                    a1 += x * load_f32(q1 + j);
                    a2 += x * load_f32(q2 + j);
                    a3 += x * load_f32(q3 + j);
                }
                for (int64_t j = body; j < cols; j++) {
                    float x = unscale(g_is_bf16 ? bf16_to_f32(g16[j]) : g32[j], scale, inverse, by_inverse);
                    mr[j] = er ? x + er[j] : x;
                }
            } else {
                for (int64_t j = 0; j < body; j += LANES) {
                    f32xL x = load_f32(mr + j);
                    a0 += x * load_f32(q0 + j);
                    a1 += x * load_f32(q1 + j);
                    a2 += x * load_f32(q2 + j);
                    a3 += x * load_f32(q3 + j);
                }
            }
            float s[K_BLOCK] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int l = 0; l < LANES; l++) {
                s[0] += a0[l];
                s[1] += a1[l];
                s[2] += a2[l];
                s[3] += a3[l];
            }
            for (int64_t j = body; j < cols; j++) {
                s[0] += mr[j] * q0[j];
                s[1] += mr[j] * q1[j];
                s[2] += mr[j] * q2[j];
                s[3] += mr[j] * q3[j];
            }
            for (int64_t k = 0; k < kb; k++) p[i * rank + k0 + k] = s[k];
        }
    }
    stream_fence();
}

/* Q^T[:, col0:col1] = P^T M[:, col0:col1], four rows of M per sweep over Q^T (the sums stay in row order). */
void distamp_project(const float *m, const float *p, float *qt, int64_t rows, int64_t cols, int64_t rank,
                     int64_t col0, int64_t col1) {
    for (int64_t k = 0; k < rank; k++) memset(qt + k * cols + col0, 0, sizeof(float) * (col1 - col0));
    const int64_t body = col1 - (col1 - col0) % LANES;
    int64_t i = 0;
    for (; i + 4 <= rows; i += 4) {
        const float *m0 = m + i * cols, *m1 = m0 + cols, *m2 = m1 + cols, *m3 = m2 + cols;
        const float *p0 = p + i * rank, *p1 = p0 + rank, *p2 = p1 + rank, *p3 = p2 + rank;
        for (int64_t j = col0; j < body; j += LANES) {
            const f32xL x0 = load_f32(m0 + j), x1 = load_f32(m1 + j), x2 = load_f32(m2 + j), x3 = load_f32(m3 + j);
            for (int64_t k = 0; k < rank; k++) {
                f32xL q = load_f32(qt + k * cols + j);
                q += p0[k] * x0;
                q += p1[k] * x1;
                q += p2[k] * x2;
                q += p3[k] * x3;
                store_f32(qt + k * cols + j, q);
            }
        }
        for (int64_t k = 0; k < rank; k++)
            for (int64_t j = body; j < col1; j++) {
                float q = qt[k * cols + j];
                q += p0[k] * m0[j];
                q += p1[k] * m1[j];
                q += p2[k] * m2[j];
                q += p3[k] * m3[j];
                qt[k * cols + j] = q;
            }
    }
    for (; i < rows; i++)
        for (int64_t k = 0; k < rank; k++)
            for (int64_t j = col0; j < col1; j++) qt[k * cols + j] += p[i * rank + k] * m[i * cols + j];
}

/* Gram-Schmidt on `count` vectors of `length` elements; element j of vector k is at x[k * step + j * stride]. */
void distamp_orthogonalize(float *x, int64_t count, int64_t length, int64_t step, int64_t stride) {
    for (int64_t i = 0; i < count; i++) {
        float *v = x + i * step;
        double squares = 0.0;
        for (int64_t j = 0; j < length; j++) squares += (double)v[j * stride] * (double)v[j * stride];
        const float norm = (float)sqrt(squares);
        if (norm > 0.0f)
            for (int64_t j = 0; j < length; j++) v[j * stride] /= norm;
        for (int64_t c = i + 1; c < count; c++) {
            float *w = x + c * step;
            double dot = 0.0;
            for (int64_t j = 0; j < length; j++) dot += (double)v[j * stride] * (double)w[j * stride];
            const float d = (float)dot;
            for (int64_t j = 0; j < length; j++) w[j * stride] -= d * v[j * stride];
        }
    }
}

/* A = P Q^T for rows [row0, row1): out = A * scale (BF16 or FP32), and M -= A when m is given. */
void distamp_finish(int out_is_bf16, void *out, float *m, const float *p, const float *qt, int64_t row0,
                    int64_t row1, int64_t cols, int64_t rank, float scale) {
    float a[FINISH_CHUNK];
    for (int64_t i = row0; i < row1; i++) {
        const float *pr = p + i * rank;
        for (int64_t j0 = 0; j0 < cols; j0 += FINISH_CHUNK) {
            const int64_t n = cols - j0 < FINISH_CHUNK ? cols - j0 : FINISH_CHUNK;
            const int64_t body = n - n % LANES;
            for (int64_t j = 0; j < n; j++) a[j] = pr[0] * qt[j0 + j];
            for (int64_t k = 1; k < rank; k++) {
                const float pk = pr[k];
                const float *q = qt + k * cols + j0;
                for (int64_t j = 0; j < n; j++) a[j] += pk * q[j];
            }
            if (out_is_bf16) {
                uint16_t *o = (uint16_t *)out + i * cols + j0;
                for (int64_t j = 0; j < body; j += LANES) stream_bf16(o + j, load_f32(a + j) * scale);
                for (int64_t j = body; j < n; j++) o[j] = f32_to_bf16(a[j] * scale);
            } else {
                float *o = (float *)out + i * cols + j0;
                for (int64_t j = 0; j < body; j += LANES) stream_f32(o + j, load_f32(a + j) * scale);
                for (int64_t j = body; j < n; j++) o[j] = a[j] * scale;
            }
            if (m) {
                float *mr = m + i * cols + j0;
                for (int64_t j = 0; j < n; j++) mr[j] -= a[j];
            }
        }
    }
    stream_fence();
}
