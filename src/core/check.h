// Errors. Every failure the engine can report goes through mf::Error, which carries the failed
// expression, the source location and a message built from the remaining arguments.
//
//   MF_CHECK(cond, "what", value, "was expected")   -> throws mf::Error when !cond
//   MF_FAIL("message", ...)                         -> throws unconditionally
//
// NOTE: the condition must already be a bool (write `ptr != nullptr`, not `ptr`), so a
// pointer or integer never converts silently.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace mf {

class Error : public std::runtime_error {
 public:
    explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
    std::ostringstream os;
    (os << ... << std::forward<Args>(args));
    return os.str();
}

[[noreturn]] void throw_error(const char* expr, const char* file, int line, const char* func, const std::string& msg);

}  // namespace detail

// A user-facing error: no source location, just the message (used for bad input).
template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
    throw Error(detail::concat(std::forward<Args>(args)...));
}

}  // namespace mf

#define MF_CHECK(cond, ...)                                                                                            \
    do {                                                                                                               \
        static_assert(std::is_same_v<std::remove_cvref_t<decltype(cond)>, bool>, "MF_CHECK condition must be a bool"); \
        if (!(cond)) [[unlikely]]                                                                                      \
            ::mf::detail::throw_error(#cond, __FILE__, __LINE__, __func__,                                             \
                                      ::mf::detail::concat("" __VA_OPT__(, ) __VA_ARGS__));                            \
    } while (0)

#define MF_FAIL(...) ::mf::detail::throw_error(nullptr, __FILE__, __LINE__, __func__, ::mf::detail::concat(__VA_ARGS__))
