#include "cli/commands.h"
#include "core/check.h"
namespace mf::cli {
int cmd_init(const Args&) { MF_FAIL("not yet"); }
int cmd_info(const Args&) { MF_FAIL("not yet"); }
int cmd_eval(const Args&) { MF_FAIL("not yet"); }
int cmd_finetune(const Args&) { MF_FAIL("not yet"); }
int cmd_tokenize(const Args&) { MF_FAIL("not yet"); }
}
