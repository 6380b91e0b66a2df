#include "core/check.h"

#include <cstring>

namespace mf::detail {

void throw_error(const char* expr, const char* file, int line, const char* func, const std::string& msg) {
    const char* base = std::strrchr(file, '/');
    std::ostringstream os;
    os << msg;
    if (expr != nullptr)
        os << (msg.empty() ? "" : " ") << "[check `" << expr << "` failed";
    else
        os << " [";
    os << " at " << (base != nullptr ? base + 1 : file) << ":" << line << " in " << func << "]";
    throw Error(os.str());
}

}  // namespace mf::detail
