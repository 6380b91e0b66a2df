#include "cli/commands.h"
#include "core/check.h"
namespace mf::cli {
}
