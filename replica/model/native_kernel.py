"""The C++ source of the CPU paged decode kernel that `native_attention.py` builds and loads.

Kept as a string so that the package needs no data files. Plain C++17 and no torch headers: g++
(or $CXX) builds it in well under a second. The model's page size, KV heads, query heads per KV
head and head size are compile-time constants (`-DBS=… -DKVH=… -DGROUP=… -DHD=…`), so every inner
loop has a fixed trip count and vectorises (AVX-512 intrinsics for the dot products where the
compiler targets it, plain `omp simd` loops elsewhere).

Per sequence, one thread: (optionally) write the new token's K and V rows into their slot, then
  1. scores: q · k for every visible key, each K row read once in place from its page (the K and V
     rows a few positions ahead are prefetched: pages are scattered, so the hardware prefetcher
     starts cold at every page);
  2. softmax per query head over the visible keys (rows padded to whole vectors with -inf; `exp`
     by Cephes' polynomial, vectorised: within 1.02 ulp of the exact value over [-87, 0], 0 below);
  3. the weighted sum of V rows, per KV head, its group of query heads' sums in registers.
Only the keys the query sees are read: no padding to the batch's longest context and no mask.
"""

from __future__ import annotations

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

constexpr int64_t H = KVH * GROUP;       // query heads
constexpr int64_t ROW = KVH * HD;        // one position's K (or V) row, every KV head
constexpr int64_t PAGE = 2 * BS * ROW;   // a page: BS K rows, then BS V rows
constexpr int64_t AHEAD = 8;             // rows prefetched ahead
constexpr int64_t LINE = 64 / sizeof(float);
constexpr int64_t LANES = 16;            // score rows are padded to this many floats

// 16 floats (GCC / clang vector extensions: vector instructions on any target, no intrinsics)
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vfloat load(const float* p) {
    vfloat v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (scores minus their maximum), lane by lane; -inf and anything below -87 give 0.
// Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n by the exponent.
static inline vfloat exp_nonpos(vfloat x) {
    const vfloat c = x < -87.0f ? vfloat{} - 87.0f : x;
    const vfloat t = c * 1.44269504088896341f + 0.5f;
    const vint truncated = __builtin_convertvector(t, vint);  // toward zero
    const vint n = truncated + (t < __builtin_convertvector(truncated, vfloat));  // floor: -1 where t < trunc
    const vfloat nf = __builtin_convertvector(n, vfloat);
    const vfloat r = c - nf * 0.693359375f + nf * 2.12194440e-4f;
    vfloat p = vfloat{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vfloat scale = reinterpret_cast<vfloat>((n + 127) << 23);
    return x < -87.0f ? vfloat{} : p * scale;
}

// K (part 0) or V (part 1) row of position `pos` in a sequence's pages
static inline const float* row_at(const float* layer, const int64_t* pages, int64_t pos, int64_t part) {
    return layer + pages[pos / BS] * PAGE + part * BS * ROW + (pos % BS) * ROW;
}

static inline void prefetch_row(const float* row) {
    for (int64_t c = 0; c < ROW; c += LINE) __builtin_prefetch(row + c);
}

// out[h] = q_h . k_(h / GROUP) for every query head h
static inline void head_scores(const float* q, const float* k, float* out) {
    int64_t h = 0;
#if defined(__AVX512F__)
    if constexpr (HD % 16 == 0) {
        // four heads at a time: their 16-lane partial sums reduced together (hadd), not one by one
        for (h = 0; h + 4 <= H; h += 4) {
            __m256 half[4];
            for (int64_t j = 0; j < 4; ++j) {
                const float* qh = q + (h + j) * HD;
                const float* kh = k + ((h + j) / GROUP) * HD;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kh));
                for (int64_t d = 16; d < HD; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(kh + d), acc);
                const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
                half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc), high);
            }
            const __m256 t =
                _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
            _mm_storeu_ps(out + h, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
        }
        h = H / 4 * 4;  // a constant: the loop below then has a known trip count (or none)
    }
#endif
    for (; h < H; ++h) {
        const float* qh = q + h * HD;
        const float* kh = k + (h / GROUP) * HD;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < HD; ++d) acc += qh[d] * kh[d];
        out[h] = acc;
    }
}

// scores (H, stride) of one sequence's visible keys; rows read once, K and V rows prefetched ahead
static void scores(const float* q, const float* layer, const int64_t* pages, int64_t first, int64_t n,
                   int64_t stride, float* sc) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
    float row[H];
    for (int64_t i = 0; i < n; ++i) {
        if (i + AHEAD < n) {  // V too: it is read right after this pass
            prefetch_row(row_at(layer, pages, first + i + AHEAD, 0));
            prefetch_row(row_at(layer, pages, first + i + AHEAD, 1));
        }
        head_scores(q, row_at(layer, pages, first + i, 0), row);
        for (int64_t h = 0; h < H; ++h) sc[h * stride + i] = row[h] * scale;
    }
}

// each score row (n keys, padded to stride, a multiple of LANES) becomes its softmax
static void softmax_rows(float* sc, int64_t n, int64_t stride) {
    for (int64_t h = 0; h < H; ++h) {
        float* row = sc + h * stride;
        for (int64_t i = n; i < stride; ++i) row[i] = -INFINITY;
        vfloat top = load(row);
        for (int64_t i = LANES; i < stride; i += LANES) {
            const vfloat x = load(row + i);
            top = x > top ? x : top;
        }
        float m = top[0];
        for (int64_t j = 1; j < LANES; ++j) m = top[j] > m ? top[j] : m;
        vfloat sums{};
        for (int64_t i = 0; i < stride; i += LANES) {
            const vfloat e = exp_nonpos(load(row + i) - m);
            store(row + i, e);
            sums += e;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < LANES; ++j) sum += sums[j];
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < stride; i += LANES) store(row + i, load(row + i) * inv);
    }
}

// out[g] = sum_i p[g][i] * v_i (KV head kv) for the GROUP query heads of KV head kv
static void weighted_values(const float* layer, const int64_t* pages, int64_t first, int64_t n,
                            const float* p, int64_t stride, int64_t kv, float* out) {
    float acc[GROUP][HD];
    std::memset(acc, 0, sizeof acc);
    for (int64_t i = 0; i < n; ++i) {
        const float* v = row_at(layer, pages, first + i, 1) + kv * HD;
        for (int64_t g = 0; g < GROUP; ++g) {
            const float w = p[g * stride + i];
#pragma omp simd
            for (int64_t d = 0; d < HD; ++d) acc[g][d] += w * v[d];
        }
    }
    std::memcpy(out, acc, sizeof acc);
}

extern "C" void paged_decode(
    const float* q, int64_t q_stride,      // (seqs, H, HD), rows q_stride apart
    const float* k, int64_t k_stride,      // (seqs, KVH * HD) new keys, or unused without slots
    const float* v, int64_t v_stride,      // (seqs, KVH * HD) new values
    const int64_t* slots,                  // (seqs,) K row of each new token in the layer; null: no write
    float* layer,                          // (blocks, 2, BS, KVH, HD)
    const int64_t* table, int64_t max_pages,  // (seqs, max_pages) page ids
    const int64_t* q_pos,                  // (seqs,) the query's position
    int64_t window,                        // keys within this many positions; <= 0: all
    float* out,                            // (seqs, H * HD)
    int64_t seqs) {
    static thread_local std::vector<float> buffer;
    for (int64_t s = 0; s < seqs; ++s) {
        if (slots != nullptr) {
            std::memcpy(layer + slots[s] * ROW, k + s * k_stride, ROW * sizeof(float));
            std::memcpy(layer + (slots[s] + BS) * ROW, v + s * v_stride, ROW * sizeof(float));
        }
    }
    for (int64_t s = 0; s < seqs; ++s) {
        const int64_t last = q_pos[s];
        const int64_t first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
        const int64_t n = last - first + 1;
        const int64_t stride = (n + LANES - 1) / LANES * LANES;
        if (static_cast<int64_t>(buffer.size()) < stride * H) buffer.resize(stride * H);
        float* sc = buffer.data();
        const int64_t* pages = table + s * max_pages;
        scores(q + s * q_stride, layer, pages, first, n, stride, sc);
        softmax_rows(sc, n, stride);
        for (int64_t kv = 0; kv < KVH; ++kv)
            weighted_values(layer, pages, first, n, sc + kv * GROUP * stride, stride, kv,
                            out + s * H * HD + kv * GROUP * HD);
    }
}
"""
