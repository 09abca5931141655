/* The loops of converter._native, included once per instruction set by _native.c.
 *
 * Before each inclusion _native.c defines SUFFIX (appended to every function name),
 * KERNEL_ATTR (a function attribute such as __attribute__((target("avx2,fma"))), or
 * nothing), KERNEL_AVX2 and KERNEL_AVX512 (1 where those intrinsics of <immintrin.h> may
 * be used) and VW (the lanes of gemv8's vectors: 8, or 16 for AVX-512).  The code uses
 * GCC/Clang vector extensions of VW lanes of 32 bits, which the compiler maps onto AVX2
 * or AVX-512 registers in those builds and onto pairs of SSE2 registers (or NEON)
 * otherwise.  Nothing here touches Python objects: the callers in _native.c
 * check the shapes and release the GIL around these calls.
 *
 * Marlin's B (shared/spec/checkpoint-formats.md section 4.3, and the docstring of
 * converter/marlin/layout.py): code q[k, n] with k = 16*kt + 8*rh + 2*rp + rl and
 * n = 64*nb + 16*j + 8*ch + cl lives in word B[kt, 128*nb + 16*cl + 4*rp + j], nibble
 * 4*rl + 2*ch + rh.  One (kt, nb) tile is 128 consecutive words holding 16 x 64 codes.
 */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUFFIX)

/* One (kt, nb) tile's 128 words from tmp[4*rp + j][cl] into B order, 16*cl + 4*rp + j. */
KERNEL_ATTR static inline void FN(store_tile)(uint32_t *o, uint32_t tmp[16][8]) {
    for (int cl = 0; cl < 8; cl++)
        for (int t = 0; t < 16; t++) o[16 * cl + t] = tmp[t][cl];
}

/* uint8 codes [K, N] -> B, tile rows [kt0, kt1). */
KERNEL_ATTR static void FN(pack_codes)(const uint8_t *q, uint32_t *out, Py_ssize_t n_cols, Py_ssize_t kt0,
                                        Py_ssize_t kt1) {
    const Py_ssize_t nbs = n_cols / 64;
    for (Py_ssize_t kt = kt0; kt < kt1; kt++) {
        const uint8_t *rows = q + kt * 16 * n_cols;
        for (Py_ssize_t nb = 0; nb < nbs; nb++) {
            /* tmp[4*rp + j][cl]: one word per lane; the lanes (cl) read 8 consecutive codes. */
            uint32_t tmp[16][8];
            for (int rp = 0; rp < 4; rp++) {
                for (int j = 0; j < 4; j++) {
                    const uint8_t *c = rows + 64 * nb + 16 * j;
                    const uint8_t *r0 = c + (2 * rp) * n_cols, *r1 = c + (2 * rp + 1) * n_cols;
                    const uint8_t *r8 = c + (8 + 2 * rp) * n_cols, *r9 = c + (9 + 2 * rp) * n_cols;
                    for (int cl = 0; cl < 8; cl++) {
                        /* nibble 4*rl + 2*ch + rh */
                        tmp[4 * rp + j][cl] = (uint32_t)r0[cl] | (uint32_t)r8[cl] << 4 | (uint32_t)r0[cl + 8] << 8 |
                                              (uint32_t)r8[cl + 8] << 12 | (uint32_t)r1[cl] << 16 |
                                              (uint32_t)r9[cl] << 20 | (uint32_t)r1[cl + 8] << 24 |
                                              (uint32_t)r9[cl + 8] << 28;
                    }
                }
            }
            FN(store_tile)(out + kt * 2 * n_cols + 128 * nb, tmp);
        }
    }
}

/* 4-bit GPTQ qweight words [K/8, N] (row 2*kt + rh holds k = 16*kt + 8*rh + i in nibble i)
 * -> B, tile rows [kt0, kt1).  Byte rp of a GPTQ word holds rows 2*rp (low nibble) and
 * 2*rp + 1 (high nibble) of its half tile: merging the rh = 0 and rh = 1 words per byte
 * and a 4 x 4 byte transpose give the Marlin words, the same bit steps as the NumPy
 * reference pack_b_from_gptq4_numpy, on 8 columns (cl) at a time. */
KERNEL_ATTR static void FN(pack_gptq4)(const uint32_t *u, uint32_t *out, Py_ssize_t n_cols, Py_ssize_t kt0,
                                        Py_ssize_t kt1) {
    const Py_ssize_t nbs = n_cols / 64;
    for (Py_ssize_t kt = kt0; kt < kt1; kt++) {
        const uint32_t *a_row = u + (2 * kt) * n_cols, *b_row = u + (2 * kt + 1) * n_cols;
        for (Py_ssize_t nb = 0; nb < nbs; nb++) {
            uint32_t tmp[16][8];
            for (int j = 0; j < 4; j++) {
                const Py_ssize_t n0 = 64 * nb + 16 * j;
                for (int cl = 0; cl < 8; cl++) {
                    const uint32_t a0 = a_row[n0 + cl], b0 = b_row[n0 + cl];         /* ch = 0 */
                    const uint32_t a1 = a_row[n0 + 8 + cl], b1 = b_row[n0 + 8 + cl]; /* ch = 1 */
                    /* byte rp: rh = 0's nibble low, rh = 1's high; x for rl = 0, y for rl = 1 */
                    const uint32_t x0 = (a0 & 0x0F0F0F0Fu) | ((b0 & 0x0F0F0F0Fu) << 4);
                    const uint32_t y0 = ((a0 >> 4) & 0x0F0F0F0Fu) | (b0 & 0xF0F0F0F0u);
                    const uint32_t x1 = (a1 & 0x0F0F0F0Fu) | ((b1 & 0x0F0F0F0Fu) << 4);
                    const uint32_t y1 = ((a1 >> 4) & 0x0F0F0F0Fu) | (b1 & 0xF0F0F0F0u);
                    /* word rp = bytes (x0[rp], x1[rp], y0[rp], y1[rp]): byte 2*rl + ch */
                    const uint32_t lo0 = (x0 & 0xFFFFu) | (y0 << 16), hi0 = (x0 >> 16) | (y0 & 0xFFFF0000u);
                    const uint32_t lo1 = (x1 & 0xFFFFu) | (y1 << 16), hi1 = (x1 >> 16) | (y1 & 0xFFFF0000u);
                    tmp[0 + j][cl] = (lo0 & 0x00FF00FFu) | ((lo1 & 0x00FF00FFu) << 8);
                    tmp[4 + j][cl] = ((lo0 >> 8) & 0x00FF00FFu) | (lo1 & 0xFF00FF00u);
                    tmp[8 + j][cl] = (hi0 & 0x00FF00FFu) | ((hi1 & 0x00FF00FFu) << 8);
                    tmp[12 + j][cl] = ((hi0 >> 8) & 0x00FF00FFu) | (hi1 & 0xFF00FF00u);
                }
            }
            FN(store_tile)(out + kt * 2 * n_cols + 128 * nb, tmp);
        }
    }
}

/* B -> uint8 codes [K, N], tile rows [kt0, kt1).  Written from the closed form above
 * (word and nibble of each code), not as a reversal of the packers' steps. */
KERNEL_ATTR static void FN(unpack_b)(const uint32_t *b, uint8_t *q, Py_ssize_t n_cols, Py_ssize_t kt0,
                                      Py_ssize_t kt1) {
    const Py_ssize_t nbs = n_cols / 64;
    for (Py_ssize_t kt = kt0; kt < kt1; kt++) {
        uint8_t *rows = q + kt * 16 * n_cols;
        for (Py_ssize_t nb = 0; nb < nbs; nb++) {
            const uint32_t *w = b + kt * 2 * n_cols + 128 * nb;
            uint32_t tmp[16][8]; /* [4*rp + j][cl] */
            for (int cl = 0; cl < 8; cl++)
                for (int t = 0; t < 16; t++) tmp[t][cl] = w[16 * cl + t];
            for (int rp = 0; rp < 4; rp++) {
                for (int j = 0; j < 4; j++) {
                    /* nib[i][cl]: nibble i of word cl, i.e. the code of row 8*rh + 2*rp + rl and
                     * column 16*j + 8*ch + cl with i = 4*rl + 2*ch + rh. */
                    uint8_t nib[8][8];
#if KERNEL_AVX2
                    /* Byte t of the 8 words (nibbles 2t and 2t + 1) gathered into 64-bit lane t. */
                    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8,
                                                          12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
                    const __m256i low = _mm256_set1_epi8(0x0F);
                    __m256i v = _mm256_loadu_si256((const __m256i *)tmp[4 * rp + j]);
                    v = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, pick), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                    uint64_t even[4], odd[4];
                    _mm256_storeu_si256((__m256i *)even, _mm256_and_si256(v, low));
                    _mm256_storeu_si256((__m256i *)odd, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
                    for (int t = 0; t < 4; t++) {
                        memcpy(nib[2 * t], &even[t], 8);
                        memcpy(nib[2 * t + 1], &odd[t], 8);
                    }
#else
                    for (int i = 0; i < 8; i++)
                        for (int cl = 0; cl < 8; cl++) nib[i][cl] = (uint8_t)((tmp[4 * rp + j][cl] >> (4 * i)) & 15u);
#endif
                    for (int i = 0; i < 8; i++) {
                        const int rl = i >> 2, ch = (i >> 1) & 1, rh = i & 1;
                        memcpy(rows + (8 * rh + 2 * rp + rl) * n_cols + 64 * nb + 16 * j + 8 * ch, nib[i], 8);
                    }
                }
            }
        }
    }
}

/* Words packed down axis 0 ([R, N], b-bit codes LSB first, b in {2, 4, 8}) -> uint8
 * codes [R * 32 / b, N], word rows [r0, r1). */
KERNEL_ATTR static void FN(unpack_rows)(const uint32_t *u, uint8_t *q, Py_ssize_t n_cols, int bits, Py_ssize_t r0,
                                         Py_ssize_t r1) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const uint32_t *src = u + r * n_cols;
        for (int i = 0; i < per; i++) {
            uint8_t *dst = q + (r * per + i) * n_cols;
            const int shift = bits * i;
            for (Py_ssize_t n = 0; n < n_cols; n++) dst[n] = (uint8_t)((src[n] >> shift) & mask);
        }
    }
}

/* words [rows, W] -> codes [rows, W * 32/bits] along each row (GPTQ qzeros: field i of
 * word j is code j * 32/bits + i), rows [r0, r1). */
__attribute__((always_inline)) static inline void FN(unpack_cols_k)(const uint32_t *u, uint8_t *q, Py_ssize_t n_words,
                                                                     const int bits, Py_ssize_t r0, Py_ssize_t r1) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const uint32_t *src = u + r * n_words;
        uint8_t *dst = q + r * n_words * per;
        for (Py_ssize_t j = 0; j < n_words; j++)
            for (int i = 0; i < per; i++) dst[j * per + i] = (uint8_t)((src[j] >> (bits * i)) & mask);
    }
}

KERNEL_ATTR static void FN(unpack_cols)(const uint32_t *u, uint8_t *q, Py_ssize_t n_words, int bits, Py_ssize_t r0,
                                        Py_ssize_t r1) {
    switch (bits) {
        case 2:
            FN(unpack_cols_k)(u, q, n_words, 2, r0, r1);
            break;
        case 4:
            FN(unpack_cols_k)(u, q, n_words, 4, r0, r1);
            break;
        default:
            FN(unpack_cols_k)(u, q, n_words, 8, r0, r1);
    }
}

/* The first code of q [rows * 32/bits, N] that differs from what unpack_rows makes of
 * words [rows, N], word rows [r0, r1): its flat index into q, or -1 when all agree.  A
 * code wider than the field (a byte above 2**bits - 1) differs.  Per word the codes are
 * packed back and compared with it (one pass, nothing written); only a word row that
 * differs is searched for the first code.  bits is a constant in each caller below, so
 * the column loop vectorizes. */
__attribute__((always_inline)) static inline Py_ssize_t FN(diff_rows_k)(const uint32_t *u, const uint8_t *q,
                                                                         Py_ssize_t n_cols, const int bits,
                                                                         Py_ssize_t r0, Py_ssize_t r1) {
    const int per = 32 / bits;
    const uint32_t mask = (1u << bits) - 1u;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const uint32_t *src = u + r * n_cols;
        const uint8_t *rows = q + r * per * n_cols;
        uint32_t bad = 0;
        for (Py_ssize_t n = 0; n < n_cols; n++) {
            uint32_t packed = 0, high = 0;
            for (int i = 0; i < per; i++) {
                const uint32_t c = rows[i * n_cols + n];
                packed |= c << (bits * i);
                high |= c;
            }
            bad |= (packed ^ src[n]) | (high & ~mask);
        }
        if (bad) {
            for (int i = 0; i < per; i++)
                for (Py_ssize_t n = 0; n < n_cols; n++)
                    if (rows[i * n_cols + n] != ((src[n] >> (bits * i)) & mask)) return (r * per + i) * n_cols + n;
        }
    }
    return -1;
}

KERNEL_ATTR static Py_ssize_t FN(diff_rows)(const uint32_t *u, const uint8_t *q, Py_ssize_t n_cols, int bits,
                                           Py_ssize_t r0, Py_ssize_t r1) {
    switch (bits) {
        case 2:
            return FN(diff_rows_k)(u, q, n_cols, 2, r0, r1);
        case 4:
            return FN(diff_rows_k)(u, q, n_cols, 4, r0, r1);
        default:
            return FN(diff_rows_k)(u, q, n_cols, 8, r0, r1);
    }
}

/* y[m, n] += sum over rows r of x[r, m] * w[r, n], m < 8, columns [n0, n1) (multiples of
 * 64), where w comes from uint8 codes q [rows, N] and per-group f32 [G, N] parameters of
 * row r's group g = r / group:
 *   factored == 0:  w = (q - c) * a + b, evaluated per weight (a source formula);
 *   factored == 1:  per group, a * (sum x * q - c * sum x) + b * sum x: what the GPU
 *                   decode kernel does (codes multiplied as integers, the scale and the
 *                   offset applied once per group).
 * c and b may be NULL (c then is the constant c0, b zero).  xt is x transposed, [rows, 8];
 * xs holds the row sums of x per block of at most BLOCK_ROWS rows inside a group
 * ([blocks, 8], see gemv8 in _native.c).  No fp32 weight matrix is formed: weights live
 * in registers, VW columns at a time (VW = 8 lanes, or 16 with AVX-512). */
typedef float FN(vf) __attribute__((vector_size(4 * VW)));
typedef int32_t FN(vi) __attribute__((vector_size(4 * VW)));
typedef uint8_t FN(vb) __attribute__((vector_size(VW)));

/* Vectors are moved with memcpy (no alignment assumed) and never passed by value, so the
 * baseline build's ABI does not depend on AVX. */
#define LOAD_V(dst, ptr) memcpy(&(dst), (ptr), sizeof(dst))
#if KERNEL_AVX512
#define LOAD_CODES(dst, ptr)                                                                                \
    do {                                                                                                    \
        __m512 f_ = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ptr))));   \
        memcpy(&(dst), &f_, sizeof(dst));                                                                   \
    } while (0)
#elif KERNEL_AVX2
/* One vpmovzxbd + vcvtdq2ps (GCC lowers the generic conversion below to scalar code). */
#define LOAD_CODES(dst, ptr)                                                                                \
    do {                                                                                                    \
        __m256 f_ = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ptr))));   \
        memcpy(&(dst), &f_, sizeof(dst));                                                                   \
    } while (0)
#else
#define LOAD_CODES(dst, ptr)                                                                                \
    do {                                                                                                    \
        FN(vb) raw_;                                                                                        \
        memcpy(&raw_, (ptr), VW);                                                                           \
        (dst) = __builtin_convertvector(__builtin_convertvector(raw_, FN(vi)), FN(vf));                     \
    } while (0)
#endif

KERNEL_ATTR static void FN(gemv8)(const float *xt, const float *xs, const uint8_t *q, Py_ssize_t rows,
                                   Py_ssize_t n_cols, Py_ssize_t group, const float *a, const float *c, float c0,
                                   const float *b, int factored, float *y, Py_ssize_t n0, Py_ssize_t n1) {
    typedef FN(vf) vf;
    /* A block's codes for 64 columns, copied out contiguously: rows of q are N bytes apart,
     * and with N a multiple of 2048 (as in most models) they would all fall into the same
     * few L1 sets. */
    uint8_t tile[BLOCK_ROWS][64] __attribute__((aligned(64)));
    Py_ssize_t blk = 0;
    for (Py_ssize_t g0 = 0; g0 < rows; g0 += group) {
        const Py_ssize_t g = g0 / group;
        const Py_ssize_t g1 = g0 + group < rows ? g0 + group : rows;
        for (Py_ssize_t s0 = g0; s0 < g1; s0 += BLOCK_ROWS, blk++) {
            const Py_ssize_t s1 = s0 + BLOCK_ROWS < g1 ? s0 + BLOCK_ROWS : g1, len = s1 - s0;
            const float *sums = xs + 8 * blk;
            const float *xb = xt + 8 * s0;
            for (Py_ssize_t t0 = n0; t0 < n1; t0 += 64) {
                for (Py_ssize_t r = 0; r < len; r++) {
                    const uint8_t *src = q + (s0 + r) * n_cols + t0;
                    if (t0 + 64 < n1) __builtin_prefetch(src + 64);
                    memcpy(tile[r], src, 64);
                }
                for (Py_ssize_t n = t0; n < t0 + 64; n += VW) {
                    const uint8_t *col = &tile[0][n - t0];
                    vf va, vc = (vf){0} + c0, vb = (vf){0};
                    LOAD_V(va, a + g * n_cols + n);
                    if (c) LOAD_V(vc, c + g * n_cols + n);
                    if (b) LOAD_V(vb, b + g * n_cols + n);
                    vf acc[8];
                    for (int m = 0; m < 8; m++) acc[m] = (vf){0};
                    if (factored) {
                        for (Py_ssize_t r = 0; r < len; r++) {
                            vf w;
                            LOAD_CODES(w, col + 64 * r);
                            const float *xr = xb + 8 * r;
                            for (int m = 0; m < 8; m++) acc[m] += xr[m] * w;
                        }
                        for (int m = 0; m < 8; m++) {
                            float *out = y + m * n_cols + n;
                            vf v;
                            LOAD_V(v, out);
                            v += va * (acc[m] - vc * sums[m]) + vb * sums[m];
                            memcpy(out, &v, sizeof v);
                        }
                    } else {
                        for (Py_ssize_t r = 0; r < len; r++) {
                            vf w;
                            LOAD_CODES(w, col + 64 * r);
                            w = (w - vc) * va + vb;
                            const float *xr = xb + 8 * r;
                            for (int m = 0; m < 8; m++) acc[m] += xr[m] * w;
                        }
                        for (int m = 0; m < 8; m++) {
                            float *out = y + m * n_cols + n;
                            vf v;
                            LOAD_V(v, out);
                            v += acc[m];
                            memcpy(out, &v, sizeof v);
                        }
                    }
                }
            }
        }
    }
}

#undef LOAD_V
#undef LOAD_CODES
#undef FN
