/* bnbw_relayout.h: square tiles of 2- or 4-byte elements transposed, for moving dense tensors
 * between channel-first and channel-last (bnbw_native/_relayout.pyx).
 *
 * A tile is one 64-byte line a side (16 x 16 four-byte elements, 32 x 32 two-byte ones), so
 * each line of either matrix is read or written whole, once.  Inside a whole tile the elements
 * move as 4 x 4 (4-byte) or 8 x 8 (2-byte) blocks through 16-byte registers: SSE2, which every
 * x86-64 has, or NEON on AArch64; so do a partial tile's whole blocks.  What is left past them,
 * and every tile elsewhere, goes one element at a time (memcpy: no type is assumed).  Only bits
 * move, so every path gives the same result.
 * Block strides count elements; source and destination must not overlap.
 */
#ifndef BNBW_RELAYOUT_H
#define BNBW_RELAYOUT_H

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define BNBW__TILE_SSE2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define BNBW__TILE_NEON 1
#endif

#if defined(BNBW__TILE_SSE2) || defined(BNBW__TILE_NEON)

/* dst[j * ds + i] = src[i * ss + j] for i < 4, j < 4 */
static inline void bnbw__block4x4(const uint32_t *src, int64_t ss, uint32_t *dst, int64_t ds)
{
#if defined(BNBW__TILE_SSE2)
    __m128i r0 = _mm_loadu_si128((const __m128i *)(const void *)(src));
    __m128i r1 = _mm_loadu_si128((const __m128i *)(const void *)(src + ss));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * ss));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(const void *)(src + 3 * ss));
    __m128i a = _mm_unpacklo_epi32(r0, r1), b = _mm_unpackhi_epi32(r0, r1);
    __m128i c = _mm_unpacklo_epi32(r2, r3), d = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)(void *)(dst), _mm_unpacklo_epi64(a, c));
    _mm_storeu_si128((__m128i *)(void *)(dst + ds), _mm_unpackhi_epi64(a, c));
    _mm_storeu_si128((__m128i *)(void *)(dst + 2 * ds), _mm_unpacklo_epi64(b, d));
    _mm_storeu_si128((__m128i *)(void *)(dst + 3 * ds), _mm_unpackhi_epi64(b, d));
#elif defined(BNBW__TILE_NEON)
    uint32x4_t r0 = vld1q_u32(src), r1 = vld1q_u32(src + ss);
    uint32x4_t r2 = vld1q_u32(src + 2 * ss), r3 = vld1q_u32(src + 3 * ss);
    uint32x4_t a = vtrn1q_u32(r0, r1), b = vtrn2q_u32(r0, r1);
    uint32x4_t c = vtrn1q_u32(r2, r3), d = vtrn2q_u32(r2, r3);
    vst1q_u32(dst, vreinterpretq_u32_u64(vtrn1q_u64(vreinterpretq_u64_u32(a),
                                                    vreinterpretq_u64_u32(c))));
    vst1q_u32(dst + ds, vreinterpretq_u32_u64(vtrn1q_u64(vreinterpretq_u64_u32(b),
                                                         vreinterpretq_u64_u32(d))));
    vst1q_u32(dst + 2 * ds, vreinterpretq_u32_u64(vtrn2q_u64(vreinterpretq_u64_u32(a),
                                                             vreinterpretq_u64_u32(c))));
    vst1q_u32(dst + 3 * ds, vreinterpretq_u32_u64(vtrn2q_u64(vreinterpretq_u64_u32(b),
                                                             vreinterpretq_u64_u32(d))));
#endif
}

/* dst[j * ds + i] = src[i * ss + j] for i < 8, j < 8 */
static inline void bnbw__block8x8(const uint16_t *src, int64_t ss, uint16_t *dst, int64_t ds)
{
#if defined(BNBW__TILE_SSE2)
    __m128i r[8], s[8], t[8];
    for (int i = 0; i < 8; ++i)
        r[i] = _mm_loadu_si128((const __m128i *)(const void *)(src + i * ss));
    for (int i = 0; i < 4; ++i) {             /* pairs of rows, 16-bit interleaved */
        s[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        s[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {             /* quads of rows, 32-bit interleaved */
        t[4 * i] = _mm_unpacklo_epi32(s[4 * i], s[4 * i + 2]);
        t[4 * i + 1] = _mm_unpackhi_epi32(s[4 * i], s[4 * i + 2]);
        t[4 * i + 2] = _mm_unpacklo_epi32(s[4 * i + 1], s[4 * i + 3]);
        t[4 * i + 3] = _mm_unpackhi_epi32(s[4 * i + 1], s[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {             /* column 2j and 2j+1 of all eight rows */
        _mm_storeu_si128((__m128i *)(void *)(dst + 2 * j * ds), _mm_unpacklo_epi64(t[j], t[4 + j]));
        _mm_storeu_si128((__m128i *)(void *)(dst + (2 * j + 1) * ds),
                         _mm_unpackhi_epi64(t[j], t[4 + j]));
    }
#elif defined(BNBW__TILE_NEON)
    uint16x8_t r[8];
    uint32x4_t a[8], b[8];
    for (int i = 0; i < 8; ++i)
        r[i] = vld1q_u16(src + i * ss);
    for (int i = 0; i < 8; i += 2) {          /* pairs of rows: even and odd columns */
        a[i] = vreinterpretq_u32_u16(vtrn1q_u16(r[i], r[i + 1]));
        a[i + 1] = vreinterpretq_u32_u16(vtrn2q_u16(r[i], r[i + 1]));
    }
    for (int h = 0; h < 8; h += 4)            /* quads of rows: columns c and c + 4 */
        for (int k = 0; k < 2; ++k) {
            b[h + k] = vtrn1q_u32(a[h + k], a[h + k + 2]);         /* columns k, k + 4 */
            b[h + k + 2] = vtrn2q_u32(a[h + k], a[h + k + 2]);     /* columns k + 2, k + 6 */
        }
    for (int c = 0; c < 4; ++c) {             /* rows 0-3 from b[c], rows 4-7 from b[4 + c] */
        uint64x2_t lo = vreinterpretq_u64_u32(b[c]), hi = vreinterpretq_u64_u32(b[4 + c]);
        vst1q_u16(dst + c * ds, vreinterpretq_u16_u64(vtrn1q_u64(lo, hi)));
        vst1q_u16(dst + (c + 4) * ds, vreinterpretq_u16_u64(vtrn2q_u64(lo, hi)));
    }
#endif
}
#endif

/* Elements (i, j) of src for i0 <= i < i1, j0 <= j < j1, one at a time, into dst (each size a
 * constant, so that every copy is one move even where the function is not inlined). */
#define BNBW__ELEMENTS(SIZE)                                                                \
    for (int64_t i = i0; i < i1; ++i)                                                       \
        for (int64_t j = j0; j < j1; ++j)                                                   \
            memcpy(d + (j * rows + i) * (SIZE), s + (i * cols + j) * (SIZE), (SIZE))
static inline void bnbw__elements(const char *s, char *d, int64_t rows, int64_t cols, int64_t i0,
                                  int64_t i1, int64_t j0, int64_t j1, int size)
{
    if (size == 4)
        BNBW__ELEMENTS(4);
    else
        BNBW__ELEMENTS(2);
}
#undef BNBW__ELEMENTS

#if defined(BNBW__TILE_SSE2) || defined(BNBW__TILE_NEON)
/* The block of elements (i.., j..) of src into dst. */
static inline void bnbw__block(const char *s, char *d, int64_t rows, int64_t cols, int64_t i,
                               int64_t j, int size)
{
    const char *from = s + (i * cols + j) * size;
    char *to = d + (j * rows + i) * size;
    if (size == 4)
        bnbw__block4x4((const uint32_t *)(const void *)from, cols, (uint32_t *)(void *)to, rows);
    else
        bnbw__block8x8((const uint16_t *)(const void *)from, cols, (uint16_t *)(void *)to, rows);
}
#endif

/* One tile of a (rows, cols) matrix src into dst (cols, rows) of `size`-byte elements (2 or 4;
 * a constant where it is inlined): elements (i0.., j0..), up to 64 / size of each.  The whole
 * blocks of a partial tile (a plane's edge, or a side shorter than a tile) move as blocks too:
 * only the rows and columns past the last whole block go one element at a time. */
static inline void bnbw_tile(const void *src, void *dst, int64_t rows, int64_t cols, int64_t i0,
                             int64_t j0, int size)
{
    const int64_t side = 64 / size;
    const int64_t ni = rows - i0 < side ? rows - i0 : side, nj = cols - j0 < side ? cols - j0 : side;
    const char *s = (const char *)src;
    char *d = (char *)dst;
#if defined(BNBW__TILE_SSE2) || defined(BNBW__TILE_NEON)
    const int64_t block = 16 / size;                       /* a block: one 16-byte register */
    const int64_t bi = ni - ni % block, bj = nj - nj % block;
    /* The loop over one side's blocks runs inside the other's, so the inner side has a whole
     * tile's lines (16 or 32) open at once, each filled 16 bytes at a time.  dst's go outside
     * where its lines lie a multiple of 2 KiB apart: then they fall into one or two L1 sets,
     * and written in pieces, they would be evicted before they are whole. */
    if ((rows * size) % 2048 == 0) {
        for (int64_t j = j0; j < j0 + bj; j += block)
            for (int64_t i = i0; i < i0 + bi; i += block)
                bnbw__block(s, d, rows, cols, i, j, size);
    } else {
        for (int64_t i = i0; i < i0 + bi; i += block)
            for (int64_t j = j0; j < j0 + bj; j += block)
                bnbw__block(s, d, rows, cols, i, j, size);
    }
    bnbw__elements(s, d, rows, cols, i0, i0 + bi, j0 + bj, j0 + nj, size);
    bnbw__elements(s, d, rows, cols, i0 + bi, i0 + ni, j0, j0 + nj, size);
#else
    bnbw__elements(s, d, rows, cols, i0, i0 + ni, j0, j0 + nj, size);
#endif
}

#endif
