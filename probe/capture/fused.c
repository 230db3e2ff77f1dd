/* A block of attention scores' softmax and its per-query statistics, in one pass per row.
 *
 * For each query row s (its keys' scores, masked keys at the lowest float), with m = max s,
 * e = exp(s - m) and z = sum e:
 *
 *     pattern   p = e / z
 *     entropy   -sum p log p = log z - (sum e (s - m)) / z
 *     top       max p = 1 / z                  (e is exactly 1 at the maximum)
 *     first     the first key whose p is top   (as torch's max and argmax name it)
 *     received  += w p                         (w: the query's weight, when given)
 *
 * The row is read from memory once, and the later sweeps find it in the processor's cache; torch
 * would make a pass over the whole block for each of these. Built by probe.capture.fused with
 * -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math, under which every loop
 * below is vectorised.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0, within 1e-7 relative (Cephes' expf: exp(x) = 2^n exp(r), |r| <= ln 2 / 2,
 * exp(r) a polynomial), exactly 1 at 0, and exactly 0 below -87, where exp(x) is no longer a
 * normal float: a masked key's weight is 0, as in torch's softmax. */
static inline float exp_nonpositive(float x)
{
    const float low = -87.0f;
    float xc = x < low ? low : x;
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f + n * 2.12194440e-4f; /* ln 2 in two parts */
    float q = 1.9875691500e-4f;
    q = q * r + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    float y = q * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n: n is in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < low ? 0.0f : y * scale;
}

#define CHUNK 64 /* keys a sweep checks at a time for the first largest weight */

static void query_rows(const float *scores, float *pattern, int64_t rows, int64_t keys,
                       const float *weight, float *received, float *entropy, float *top,
                       int64_t *first)
{
    for (int64_t i = 0; i < rows; i++) {
        const float *s = scores + i * keys;
        float *p = pattern + i * keys;
        float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < keys; j++)
            m = s[j] > m ? s[j] : m;
        float z = 0.0f, a = 0.0f; /* sum e and sum e (s - m) */
#pragma omp simd reduction(+ : z, a)
        for (int64_t j = 0; j < keys; j++) {
            float d = s[j] - m;
            float e = exp_nonpositive(d);
            p[j] = e;
            z += e;
            a += e * d;
        }
        float inv = 1.0f / z;
        entropy[i] = (float)(log((double)z) - (double)a / (double)z);
        top[i] = inv;
        float w = weight ? weight[i] : 0.0f;
        int64_t at = -1;
        for (int64_t j0 = 0; j0 < keys; j0 += CHUNK) {
            int64_t n = keys - j0 < CHUNK ? keys - j0 : CHUNK;
            float *pc = p + j0, *rc = received + j0;
            int hit = 0;
            if (w != 0.0f) {
#pragma omp simd reduction(| : hit)
                for (int64_t k = 0; k < n; k++) {
                    float v = pc[k] * inv;
                    pc[k] = v;
                    rc[k] += w * v;
                    hit |= v == inv;
                }
            } else {
#pragma omp simd reduction(| : hit)
                for (int64_t k = 0; k < n; k++) {
                    float v = pc[k] * inv;
                    pc[k] = v;
                    hit |= v == inv;
                }
            }
            if (hit && at < 0)
                for (int64_t k = 0; k < n; k++)
                    if (pc[k] == inv) {
                        at = j0 + k;
                        break;
                    }
        }
        first[i] = at;
    }
}

/* The (batch, head) pairs [from, to) of a block laid out [batch * heads, rows, keys]: weight is
 * [batch, rows] (or NULL), received [batch * heads, keys], the others [batch * heads, rows]. One
 * thread's share: each pair's rows, and its keys' received, are one thread's alone. */
void block_stats(const float *scores, float *pattern, int64_t from, int64_t to, int64_t heads,
                 int64_t rows, int64_t keys, const float *weight, float *received,
                 float *entropy, float *top, int64_t *first)
{
    for (int64_t bh = from; bh < to; bh++) {
        int64_t at = bh * rows * keys, row = bh * rows;
        query_rows(scores + at, pattern + at, rows, keys, weight ? weight + bh / heads * rows : 0,
                   received ? received + bh * keys : 0, entropy + row, top + row, first + row);
    }
}
