// Scalar conversions between fp32 and the two 16-bit float formats found in model files.
//
//   bf16: the top 16 bits of an fp32 (1 sign, 8 exponent, 7 mantissa bits). fp32 -> bf16 rounds
//         to nearest, ties to even; a NaN stays a NaN (the quiet bit is set so that truncating
//         the mantissa cannot turn it into an infinity); overflow past the largest bf16 rounds
//         to infinity, as IEEE rounding does. bf16 -> fp32 is exact.
//   f16:  IEEE 754 binary16 (1 sign, 5 exponent, 10 mantissa bits, bias 15). f16 -> fp32 is exact
//         for every input: normals, subnormals (scaled by 2^-24), +-0, +-inf, NaN (payload kept).
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

}  // namespace mf
