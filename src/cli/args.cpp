// Option values: integers and numbers, range-checked, errors naming the option (see args.h).
#include "cli/args.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace mf::cli {

namespace {

// The whole of `value` as a number, or false (empty, trailing text, out of the double range).
bool to_double(const std::string& value, double* out) {
    if (value.empty() || std::isspace(static_cast<unsigned char>(value[0]))) return false;
    char* end = nullptr;
    errno = 0;
    *out = std::strtod(value.c_str(), &end);
    return end == value.c_str() + value.size() && errno != ERANGE;
}

}  // namespace

int64_t parse_int_option(const std::string& value, const char* option) {
    return parse_int_option(value, option, 0, std::numeric_limits<int64_t>::max());
}

int64_t parse_int_option(const std::string& value, const char* option, int64_t min, int64_t max) {
    const std::string range = max == std::numeric_limits<int64_t>::max()
                                  ? (min == 0 ? "a non-negative integer" : "an integer >= " + std::to_string(min))
                                  : "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    const bool digits_only = !value.empty() &&
                             value.find_first_not_of("0123456789", value[0] == '-' ? 1 : 0) == std::string::npos &&
                             value != "-";
    char* end = nullptr;
    errno = 0;
    const long long v = digits_only ? std::strtoll(value.c_str(), &end, 10) : 0;
    if (!digits_only || errno == ERANGE || v < min || v > max)
        fail("option --", option, ": expected ", range, ", got \"", value, "\"");
    return v;
}

double parse_number_option(const std::string& value, const char* option, double min, double max) {
    double d = 0;
    const bool number = to_double(value, &d);
    std::string why;
    if (number && std::isnan(d))
        why = " (NaN is not allowed)";
    else if (number && std::isinf(d))
        why = " (infinities are not allowed)";
    if (!number || !std::isfinite(d) || d < min || d > max) {
        char range[96];
        std::snprintf(range, sizeof range, "a finite number in [%g, %g]", min, max);
        fail("option --", option, ": expected ", range, ", got \"", value, "\"", why);
    }
    return d;
}

}  // namespace mf::cli
