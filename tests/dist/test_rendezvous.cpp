// Rendezvous environment parsing: torchrun / moeforge launch variables, SLURM variables and their
// precedence, the compressed SLURM node-list forms, and malformed values named in the error.
#include <gtest/gtest.h>

#include "core/check.h"
#include "parallel/rendezvous.h"

namespace mf::parallel {
namespace {

std::string error_of(const std::map<std::string, std::string>& vars) {
    try {
        dist_env_from(vars);
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(DistEnv, DefaultsToASingleRank) {
    const DistEnv env = dist_env_from(std::map<std::string, std::string>{});
    EXPECT_EQ(env.rank, 0);
    EXPECT_EQ(env.world_size, 1);
    EXPECT_EQ(env.local_rank, 0);
    EXPECT_EQ(env.master_addr, "127.0.0.1");
    EXPECT_EQ(env.master_port, kDefaultMasterPort);
}

TEST(DistEnv, TorchrunVariables) {
    const DistEnv env = dist_env_from({{"RANK", "5"},
                                       {"WORLD_SIZE", "8"},
                                       {"LOCAL_RANK", "1"},
                                       {"MASTER_ADDR", "10.1.2.3"},
                                       {"MASTER_PORT", "29600"}});
    EXPECT_EQ(env.rank, 5);
    EXPECT_EQ(env.world_size, 8);
    EXPECT_EQ(env.local_rank, 1);
    EXPECT_EQ(env.master_addr, "10.1.2.3");
    EXPECT_EQ(env.master_port, 29600);
}

TEST(DistEnv, SlurmVariablesAndFirstHostAsMaster) {
    const DistEnv env = dist_env_from({{"SLURM_PROCID", "6"},
                                       {"SLURM_NTASKS", "16"},
                                       {"SLURM_LOCALID", "2"},
                                       {"SLURM_JOB_NODELIST", "gpu[07-08,11],login1"}});
    EXPECT_EQ(env.rank, 6);
    EXPECT_EQ(env.world_size, 16);
    EXPECT_EQ(env.local_rank, 2);
    EXPECT_EQ(env.master_addr, "gpu07");
    EXPECT_EQ(env.master_port, kDefaultMasterPort);
}

TEST(DistEnv, TorchrunVariablesWinOverSlurm) {
    const DistEnv env = dist_env_from({{"RANK", "1"},
                                       {"WORLD_SIZE", "2"},
                                       {"SLURM_PROCID", "9"},
                                       {"SLURM_NTASKS", "32"},
                                       {"MASTER_ADDR", "host-a"},
                                       {"SLURM_JOB_NODELIST", "node[01-04]"}});
    EXPECT_EQ(env.rank, 1);
    EXPECT_EQ(env.world_size, 2);
    EXPECT_EQ(env.master_addr, "host-a");
}

TEST(DistEnv, MalformedValuesAreNamed) {
    EXPECT_NE(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}).find("RANK='abc'"), std::string::npos);
    EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}).find("RANK=2: expected an integer in [0, 1]"),
              std::string::npos);
    EXPECT_NE(error_of({{"WORLD_SIZE", "0"}}).find("WORLD_SIZE=0"), std::string::npos);
    EXPECT_NE(error_of({{"MASTER_PORT", "70000"}}).find("MASTER_PORT=70000"), std::string::npos);
    EXPECT_NE(error_of({{"SLURM_PROCID", "-1"}, {"SLURM_NTASKS", "4"}}).find("SLURM_PROCID='-1'"), std::string::npos);
    EXPECT_NE(error_of({{"RANK", "99999999999999"}}).find("RANK="), std::string::npos);
    EXPECT_NE(error_of({{"SLURM_JOB_NODELIST", "node[01-"}}).find("node[01-"), std::string::npos);
}

TEST(SlurmNodelist, CompressedForms) {
    using V = std::vector<std::string>;
    EXPECT_EQ(expand_slurm_nodelist("node01"), V{"node01"});
    EXPECT_EQ(expand_slurm_nodelist("node[01-04,07]"), (V{"node01", "node02", "node03", "node04", "node07"}));
    EXPECT_EQ(expand_slurm_nodelist("a,b[1-2],c"), (V{"a", "b1", "b2", "c"}));
    EXPECT_EQ(expand_slurm_nodelist("x[9-11]"), (V{"x9", "x10", "x11"}));
    EXPECT_EQ(expand_slurm_nodelist("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
    EXPECT_EQ(expand_slurm_nodelist("rack[1-2]-gpu[3,5]"), (V{"rack1-gpu3", "rack1-gpu5", "rack2-gpu3", "rack2-gpu5"}));
    EXPECT_EQ(expand_slurm_nodelist("gpu-[7]x"), V{"gpu-7x"});
}

TEST(SlurmNodelist, MalformedFormsThrow) {
    for (const char* bad : {"node[01-", "node]01[", "node[3-1]", "node[a-b]", "node[]", "a,,b", "node[1-2", "n[[1]]",
                            "n[1-1000000000]", ""}) {
        try {
            expand_slurm_nodelist(bad);
            ADD_FAILURE() << "accepted '" << bad << "'";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
        }
    }
}

}  // namespace
}  // namespace mf::parallel
