#include "cli/commands.h"
#include "core/check.h"
namespace mf::cli {
int cmd_tokenize(const Args&) { MF_FAIL("not yet"); }
}
