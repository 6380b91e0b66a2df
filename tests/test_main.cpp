// Shared gtest main. A test binary under gpu/ calls mf_test_require_gpu() (test_util.h), which
// exits with 77 (ctest's SKIP_RETURN_CODE) and a visible message when no CUDA device exists.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
