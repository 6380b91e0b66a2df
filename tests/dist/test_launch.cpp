// `moeforge launch`: the children's environment (single and multi node), failure propagation (the
// first non-zero status, the other ranks stopped), signal forwarding, bad options, and a real run
// in which the launched processes (this test binary, as a worker) rendezvous from the environment
// the launcher set and all-reduce over TCP.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dist_test_util.h"
#include "test_util.h"

namespace mf::test {
namespace {

namespace fs = std::filesystem;

std::string self_binary() { return fs::read_symlink("/proc/self/exe").string(); }

// "r" + std::to_string(r) trips a GCC 12 -Wrestrict false positive; append instead.
std::string numbered(const char* prefix, int r) {
    std::string s = prefix;
    s += std::to_string(r);
    return s;
}

std::string launch(const std::string& args) { return moeforge_binary() + " launch " + args; }

double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(Launch, ChildrenGetTheRankEnvironment) {
    const fs::path dir = temp_dir("launch_env");
    std::string out;
    const std::string script =
        "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
        "$NCCL_NVLS_ENABLE > " +
        dir.string() + "/r$RANK";
    const int rc =
        run_command("NCCL_NVLS_ENABLE=1 " +
                        launch("--nproc-per-node 3 --master-port 29999 --program /bin/sh -- -c '" + script + "'"),
                    &out);
    ASSERT_EQ(rc, 0) << out;
    for (int r = 0; r < 3; ++r)
        EXPECT_EQ(read_file(dir / numbered("r", r)),
                  std::to_string(r) + " 3 " + std::to_string(r) + " 3 127.0.0.1 29999 0\n");

    // Node 1 of 2: global ranks 2 and 3, local ranks 0 and 1.
    const int rc2 = run_command(launch("--nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.2 "
                                       "--master-port 1234 --program /bin/sh -- -c '" +
                                       script + "'"),
                                &out);
    ASSERT_EQ(rc2, 0) << out;
    EXPECT_EQ(read_file(dir / "r2"), "2 4 0 2 127.0.0.2 1234 0\n");
    EXPECT_EQ(read_file(dir / "r3"), "3 4 1 2 127.0.0.2 1234 0\n");
    fs::remove_all(dir);
}

TEST(Launch, DefaultRunsThisBinarysSubcommand) {
    std::string out;
    EXPECT_EQ(run_command(launch("--nproc-per-node 2 -- --help"), &out), 0) << out;
    EXPECT_NE(out.find("usage: moeforge"), std::string::npos) << out;
    out.clear();
    // A subcommand that fails in every child: the launcher exits with the children's status.
    EXPECT_EQ(run_command(launch("--nproc-per-node 2 -- info /nonexistent/model/dir"), &out), 1) << out;
    EXPECT_NE(out.find("exited with status 1"), std::string::npos) << out;
}

TEST(Launch, FirstFailureStopsTheOthers) {
    const auto start = std::chrono::steady_clock::now();
    std::string out;
    // Rank 1 fails with 3; the others would sleep for a minute unless the launcher stops them.
    const int rc = run_command(launch("--nproc-per-node 3 --program /bin/sh -- -c "
                                      "'if [ $RANK = 1 ]; then sleep 0.2; exit 3; fi; exec sleep 60'"),
                               &out);
    EXPECT_EQ(rc, 3) << out;
    EXPECT_NE(out.find("rank 1 (local 1, pid"), std::string::npos) << out;
    EXPECT_LT(seconds_since(start), 8.0);
}

TEST(Launch, ForwardsSigterm) {
    const fs::path dir = temp_dir("launch_sig");
    const std::string script = "trap 'echo term > " + dir.string() +
                               "/got$RANK; exit 7' TERM; "
                               "echo up > " +
                               dir.string() + "/up$RANK; while true; do sleep 0.05; done";
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
        const std::string bin = moeforge_binary();
        ::execl(bin.c_str(), bin.c_str(), "launch", "--nproc-per-node", "2", "--program", "/bin/sh", "--", "-c",
                script.c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    const auto start = std::chrono::steady_clock::now();
    while (!(fs::exists(dir / "up0") && fs::exists(dir / "up1")) && seconds_since(start) < 10)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(fs::exists(dir / "up0") && fs::exists(dir / "up1"));
    ::kill(pid, SIGTERM);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
    EXPECT_EQ(read_file(dir / "got0"), "term\n");
    EXPECT_EQ(read_file(dir / "got1"), "term\n");
    EXPECT_LT(seconds_since(start), 8.0);
    fs::remove_all(dir);
}

TEST(Launch, BadOptionsAreErrors) {
    std::string out;
    EXPECT_EQ(run_command(launch("-- info x"), &out), 1);
    EXPECT_NE(out.find("missing required option --nproc-per-node"), std::string::npos) << out;
    out.clear();
    EXPECT_EQ(run_command(launch("--nproc-per-node 0 -- info x"), &out), 1);
    EXPECT_NE(out.find("--nproc-per-node 0"), std::string::npos) << out;
    out.clear();
    EXPECT_EQ(run_command(launch("--nproc-per-node 2"), &out), 1);
    EXPECT_NE(out.find("missing the command"), std::string::npos) << out;
    out.clear();
    EXPECT_EQ(run_command(launch("--nproc-per-node 2 --node-rank 1 -- info x"), &out), 1);
    EXPECT_NE(out.find("--node-rank 1 must be below --nnodes 1"), std::string::npos) << out;
    out.clear();
    EXPECT_EQ(run_command(launch("--nproc-per-node 2 --bogus 1 -- info x"), &out), 1);
    EXPECT_NE(out.find("unknown option --bogus"), std::string::npos) << out;
}

// Runs only inside processes started by the test below (MF_LAUNCH_WORKER_OUT set): rendezvous from
// the launcher's environment, all-reduce the ranks, write the result.
TEST(LaunchWorker, AllReduceFromEnvironment) {
    const char* out_dir = std::getenv("MF_LAUNCH_WORKER_OUT");
    if (out_dir == nullptr) GTEST_SKIP() << "only runs under moeforge launch (Launch.WorkersRendezvousFromEnvironment)";
    const parallel::DistEnv env = parallel::dist_env_from_process();
    parallel::TcpCommunicator comm(env, 20);
    int64_t v[2] = {comm.rank() + 1, env.local_rank};
    comm.all_reduce_sum(v, 2, DType::i64);
    std::ofstream(fs::path(out_dir) / numbered("w", comm.rank())) << comm.size() << " " << v[0] << " " << v[1];
}

TEST(Launch, WorkersRendezvousFromEnvironment) {
    const fs::path dir = temp_dir("launch_workers");
    std::string out;
    const int rc =
        run_command("MF_LAUNCH_WORKER_OUT=" + dir.string() + " " +
                        launch("--nproc-per-node 3 --program " + self_binary() + " -- --gtest_filter=LaunchWorker.*"),
                    &out);
    ASSERT_EQ(rc, 0) << out;
    for (int r = 0; r < 3; ++r) EXPECT_EQ(read_file(dir / numbered("w", r)), "3 6 3") << "rank " << r;
    fs::remove_all(dir);
}

}  // namespace
}  // namespace mf::test
