// Scalar conversions between fp32 and the two 16-bit float formats found in model files.
//
//   bf16: the top 16 bits of an fp32 (1 sign, 8 exponent, 7 mantissa bits). fp32 -> bf16 rounds
//         to nearest, ties to even; a NaN stays a NaN (the quiet bit is set so that truncating
//         the mantissa cannot turn it into an infinity); overflow past the largest bf16 rounds
//         to infinity, as IEEE rounding does. bf16 -> fp32 is exact.
//   f16:  IEEE 754 binary16 (1 sign, 5 exponent, 10 mantissa bits, bias 15). f16 -> fp32 is exact
//         for every input: normals, subnormals (scaled by 2^-24), +-0, +-inf, NaN (payload kept).
//         fp32 -> f16 rounds to nearest, ties to even, into subnormals below 2^-14 and to infinity
//         past 65504 (as IEEE rounding and torch's .half() do); a NaN stays a quiet NaN.
//
// Values travel as raw bit patterns (uint16_t), so this header needs no 16-bit float type.
#pragma once

#include <bit>
#include <cstdint>

namespace mf {

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

inline uint16_t f32_to_bf16(float value) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
        // NaN: keep sign and the high payload bits, force the quiet bit so the result is NaN.
        return static_cast<uint16_t>((bits >> 16) | 0x0040u);
    }
    // Round to nearest even: add 0x7FFF, plus one more when the bit that survives is odd. The
    // carry may run into the exponent, which is the correct rounding (up to infinity at the top).
    const uint32_t lsb = (bits >> 16) & 1u;
    return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

inline float f16_to_f32(uint16_t half) {
    const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
    const uint32_t exponent = (half >> 10) & 0x1Fu;
    uint32_t mantissa = half & 0x3FFu;
    if (exponent == 0x1Fu) {
        // Infinity (mantissa 0) or NaN (payload moved to the top of the fp32 mantissa).
        return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
    }
    if (exponent != 0) {
        // Normal: rebias the exponent from 15 to 127.
        return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    }
    if (mantissa == 0) return std::bit_cast<float>(sign);  // +-0
    // Subnormal: value = mantissa * 2^-24. Normalise: shift until the implicit bit (0x400) is set;
    // every shift lowers the exponent by one from that of 2^-14 (fp32 biased exponent 113).
    uint32_t fp32_exponent = 113;
    while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --fp32_exponent;
    }
    mantissa &= 0x3FFu;
    return std::bit_cast<float>(sign | (fp32_exponent << 23) | (mantissa << 13));
}

inline uint16_t f32_to_f16(float value) {
    const uint32_t bits = std::bit_cast<uint32_t>(value);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));  // NaN
    if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504: infinity
    if (magnitude >= 0x38800000u) {
        // Normal f16: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to even;
        // a carry into the exponent is the correct rounding.
        const uint32_t lsb = (magnitude >> 13) & 1u;
        return static_cast<uint16_t>(sign | ((magnitude - 0x38000000u + 0xFFFu + lsb) >> 13));
    }
    if (magnitude < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): +-0
    // Subnormal f16: value / 2^-24 rounded to an integer, ties to even.
    const uint32_t exponent = magnitude >> 23;                      // 102 .. 112
    const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;  // with the implicit bit
    const uint32_t shift = 126u - exponent;                         // 14 .. 24
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    uint32_t q = mantissa >> shift;
    if (rest > half || (rest == half && (q & 1u) != 0)) ++q;
    return static_cast<uint16_t>(sign | q);
}

}  // namespace mf
