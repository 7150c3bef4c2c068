// Proves the Gloo wrapper: two processes (fork) rendezvous through a file
// store and run alltoallv over the TCP transport with uneven splits.
#include <gloo/alltoallv.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

namespace {

// Rank r sends (r + 1) * (peer + 1) floats to each peer, valued 100*r + peer.
int RunRank(int rank, int size, const std::string& dir) {
  gloo::rendezvous::FileStore store(dir);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->connectFullMesh(store, device);

  std::vector<int64_t> send_counts, recv_counts;
  std::vector<float> send, recv;
  for (int peer = 0; peer < size; ++peer) {
    send_counts.push_back((rank + 1) * (peer + 1));
    recv_counts.push_back((peer + 1) * (rank + 1));
    send.insert(send.end(), send_counts.back(), 100.0f * rank + peer);
  }
  int64_t total_recv = 0;
  for (int64_t c : recv_counts) total_recv += c;
  recv.assign(total_recv, -1.0f);

  gloo::AlltoallvOptions opts(context);
  opts.setInput(send.data(), send_counts);
  opts.setOutput(recv.data(), recv_counts);
  gloo::alltoallv(opts);

  size_t at = 0;
  for (int peer = 0; peer < size; ++peer) {
    for (int64_t i = 0; i < recv_counts[peer]; ++i, ++at) {
      if (recv[at] != 100.0f * peer + rank) return 2;
    }
  }
  return 0;
}

TEST(GlooWrapper, AllToAllvBetweenTwoProcesses) {
  char dir_template[] = "/tmp/muond-gloo-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const int size = 2;
  std::vector<pid_t> children;
  for (int rank = 0; rank < size; ++rank) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) _exit(RunRank(rank, size, dir_template));
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "rank process " << pid;
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir_template, ignored);
}

}  // namespace
