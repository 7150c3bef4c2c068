// The pure rules of memory registration:
// aliasing (view_overlap), shm names, other users' objects, shrunk objects
// (RecheckMemory), bounded names and echoes, quoted dtypes. The
// multi-process cases (a real muond-daemon) are in tests/reliability/
// input_guard_test.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/echo.h"
#include "server/daemon/registration.h"
#include "server/daemon/view_overlap.h"

namespace muond {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// --- aliasing -------------------------------------------------------------

struct Spans {
  std::vector<MatrixView> views;
  std::vector<std::string> names;
  std::vector<bool> grads;
  void Add(float* data, int64_t rows, int64_t cols, int64_t row_stride,
           std::string name, bool grad) {
    views.push_back({data, DType::kFloat32, rows, cols, row_stride});
    names.push_back(std::move(name));
    grads.push_back(grad);
  }
  absl::Status Check() const {
    std::vector<TensorSpan> s;
    for (size_t i = 0; i < views.size(); ++i) {
      s.push_back({&views[i], &names[i], grads[i]});
    }
    return CheckNoAliasing(s);
  }
};

TEST(Aliasing, DisjointViewsAreAccepted) {
  std::vector<float> buf(1024);
  Spans s;
  s.Add(&buf[0], 4, 8, 8, "a", false);
  s.Add(&buf[32], 4, 8, 8, "a", true);
  s.Add(&buf[64], 1, 16, 16, "b", false);
  EXPECT_TRUE(s.Check().ok()) << s.Check();
}

TEST(Aliasing, TwoParamsOverlappingAreRefusedNamingBoth) {
  std::vector<float> buf(1024);
  Spans s;
  s.Add(&buf[0], 4, 8, 8, "a", false);
  s.Add(&buf[100], 4, 8, 8, "a", true);
  s.Add(&buf[31], 1, 4, 4, "b", false);  // shares a's last element
  const absl::Status st = s.Check();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("param 'a' param and param 'b' param"));
  EXPECT_THAT(st.message(), HasSubstr("must not overlap"));
}

TEST(Aliasing, AGradOverlappingAParamIsRefused) {
  std::vector<float> buf(1024);
  Spans s;
  s.Add(&buf[0], 4, 8, 8, "a", false);
  s.Add(&buf[0], 4, 8, 8, "a", true);  // its own grad, same memory
  EXPECT_THAT(s.Check().message(),
              HasSubstr("param 'a' param and param 'a' grad"));
  Spans t;
  t.Add(&buf[0], 4, 8, 8, "a", false);
  t.Add(&buf[200], 4, 8, 8, "a", true);
  t.Add(&buf[300], 4, 8, 8, "b", false);
  t.Add(&buf[16], 4, 8, 8, "b", true);  // b's grad inside a's param
  EXPECT_THAT(t.Check().message(),
              HasSubstr("param 'a' param and param 'b' grad"));
}

TEST(Aliasing, GradsMaySharememory) {
  std::vector<float> buf(1024);
  Spans s;
  s.Add(&buf[0], 4, 8, 8, "a", false);
  s.Add(&buf[500], 4, 8, 8, "a", true);
  s.Add(&buf[100], 4, 8, 8, "b", false);
  s.Add(&buf[500], 4, 8, 8, "b", true);
  EXPECT_TRUE(s.Check().ok()) << s.Check();
}

TEST(Aliasing, InterleavedColumnBlocksAreAcceptedOverlappingOnesNot) {
  // A fused [8, 24] weight split into three [8, 8] column views.
  std::vector<float> buf(8 * 24 * 2);
  Spans s;
  for (int k = 0; k < 3; ++k) {
    s.Add(&buf[8 * k], 8, 8, 24, absl::StrCat("qkv", k), false);
    s.Add(&buf[192 + 8 * k], 8, 8, 24, absl::StrCat("qkv", k), true);
  }
  EXPECT_TRUE(s.Check().ok()) << s.Check();
  // Shifted by one column, the second block overlaps the first.
  Spans t = s;
  t.views[2].data = &buf[7];
  EXPECT_THAT(t.Check().message(),
              HasSubstr("param 'qkv0' param and param 'qkv1' param"));
}

TEST(Aliasing, AHundredThousandParamsAreCheckedFast) {
  constexpr int kParams = 100000;
  std::vector<float> buf(size_t(kParams) * 2 * 16);
  Spans s;
  s.views.reserve(2 * kParams);
  for (int i = 0; i < kParams; ++i) {
    s.Add(&buf[size_t(i) * 32], 1, 16, 16, absl::StrCat("p", i), false);
    s.Add(&buf[size_t(i) * 32 + 16], 1, 16, 16, absl::StrCat("p", i), true);
  }
  // Sorted, ~0.2 s here; a pairwise check (2 * 10^10 pairs) would run
  // past the test's timeout.
  EXPECT_TRUE(s.Check().ok());
  // One overlap among them is still found.
  s.views[2 * 77777].data = &buf[size_t(77776) * 32 + 8];
  EXPECT_THAT(s.Check().message(),
              HasSubstr("param 'p77776' param and param 'p77777' param"));
}

// --- registration of shm regions -----------------------------------------

class ShmObject {
 public:
  explicit ShmObject(size_t bytes)
      : name_(absl::StrCat("/muond-guard-", getpid(), "-", counter_++)) {
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, bytes), 0);
  }
  ~ShmObject() {
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  int fd() const { return fd_; }

 private:
  static inline int counter_ = 0;
  std::string name_;
  int fd_;
};

v1::TensorRef* Ref(v1::TensorRef* r, uint64_t offset) {
  r->set_region("r");
  r->set_byte_offset(offset);
  r->set_dtype(v1::DTYPE_FP32);
  r->add_shape(4);
  r->add_shape(8);
  r->add_strides(8);
  r->add_strides(1);
  return r;
}

// Two 4x8 fp32 params (128 bytes each) and their grads in one region.
v1::RegisterParamsRequest Request(const std::string& shm, uint64_t bytes) {
  v1::RegisterParamsRequest req;
  req.set_job_id("j");
  req.set_client_id("c");
  v1::MemoryRegion* region = req.add_regions();
  region->set_name("r");
  region->set_kind(v1::MEMORY_KIND_HOST_SHM);
  region->set_shm_name(shm);
  region->set_byte_size(bytes);
  v1::ParamGroup* g = req.add_groups();
  g->set_name("g");
  g->set_algorithm(v1::ALGORITHM_MUON);
  g->mutable_domain()->set_name("d");
  g->mutable_domain()->set_gtp_size(1);
  g->mutable_domain()->set_tp_size(1);
  for (int i = 0; i < 2; ++i) {
    v1::Param* p = g->add_params();
    p->set_name(absl::StrCat("w", i));
    p->add_full_shape(4);
    p->add_full_shape(8);
    Ref(p->mutable_param(), 256 * i);
    Ref(p->mutable_grad(), 256 * i + 128);
  }
  return req;
}

absl::StatusOr<std::unique_ptr<Registration>> Build(
    const v1::RegisterParamsRequest& req, HandleOpener& opener) {
  return BuildRegistration(req, {"j", 1}, opener);
}

TEST(Registration, AValidRequestBinds) {
  ShmObject shm(512);
  HandleOpener opener;
  absl::StatusOr<std::unique_ptr<Registration>> reg =
      Build(Request(shm.name(), 512), opener);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE((*reg)->RecheckMemory().ok());
}

// Uneven GTP blocks (FSDP2's torch.chunk): rank g = 1 of a G = 2 domain
// holds no row of a 3-row weight (gtp_rows {3, 0}) and no element of a
// 5-element bias ({5, 0}). Its empty views register at any offset up to
// byte_size, overlap nothing (even inside another param), and the manifest
// carries the blocks.
v1::RegisterParamsRequest EmptyShardRequest(const std::string& shm) {
  v1::RegisterParamsRequest req = Request(shm, 512);
  req.mutable_groups(0)->mutable_params()->RemoveLast();
  v1::Domain* d = req.mutable_groups(0)->mutable_domain();
  d->set_gtp_size(2);
  d->set_g(1);
  v1::Param* w = req.mutable_groups(0)->add_params();
  w->set_name("w_empty");
  w->add_full_shape(3);
  w->add_full_shape(8);
  w->mutable_tags()->set_is_gtp_weight_remat(true);
  w->mutable_tags()->add_gtp_rows(3);
  w->mutable_tags()->add_gtp_rows(0);
  Ref(w->mutable_param(), 512)->set_shape(0, 0);  // at byte_size
  Ref(w->mutable_grad(), 64)->set_shape(0, 0);    // inside w0's param
  v1::ParamGroup* adamw = req.add_groups();
  adamw->set_name("adamw");
  adamw->set_algorithm(v1::ALGORITHM_ADAMW);
  *adamw->mutable_domain() = *d;
  v1::Param* b = adamw->add_params();
  b->set_name("b_empty");
  b->add_full_shape(5);
  b->mutable_tags()->set_is_gtp_weight_remat(true);
  b->mutable_tags()->add_gtp_rows(5);
  b->mutable_tags()->add_gtp_rows(0);
  for (v1::TensorRef* r : {b->mutable_param(), b->mutable_grad()}) {
    r->set_region("r");
    r->set_byte_offset(300);
    r->set_dtype(v1::DTYPE_FP32);
    r->add_shape(0);
    r->add_strides(1);
  }
  return req;
}

TEST(Registration, EmptyUnevenShardsRegisterAndOverlapNothing) {
  ShmObject shm(512);
  HandleOpener opener;
  absl::StatusOr<std::unique_ptr<Registration>> reg =
      BuildRegistration(EmptyShardRequest(shm.name()), {"j", 2}, opener);
  ASSERT_TRUE(reg.ok()) << reg.status();
  const BoundParam& w = (*reg)->groups[0].params[1];
  EXPECT_EQ(w.local_shape, (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(w.param.numel(), 0);
  EXPECT_EQ((*reg)->groups[1].params[0].local_shape, (std::vector<int64_t>{0}));
  const v1::PublishManifestRequest m = (*reg)->Manifest("j", 1);
  ASSERT_EQ(m.groups(0).params_size(), 2);
  EXPECT_THAT(m.groups(0).params(1).tags().gtp_rows(),
              ::testing::ElementsAre(3, 0));
  EXPECT_THAT(m.groups(0).params(1).local_shape(),
              ::testing::ElementsAre(0, 8));
}

TEST(Registration, BadEmptyShardsAreRefusedNamingParamAndRule) {
  ShmObject shm(512);
  HandleOpener opener;
  auto refused = [&](v1::RegisterParamsRequest req, const char* rule) {
    const absl::Status st = BuildRegistration(req, {"j", 2}, opener).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << rule;
    EXPECT_THAT(st.message(), HasSubstr(rule));
  };
  v1::RegisterParamsRequest req = EmptyShardRequest(shm.name());
  req.mutable_groups(0)->mutable_params(1)->mutable_param()->set_byte_offset(
      516);  // past byte_size, even with no byte
  refused(req, "runs past region");
  req = EmptyShardRequest(shm.name());
  req.mutable_groups(0)->mutable_params(1)->mutable_tags()->set_gtp_rows(1, 1);
  refused(req, "'w_empty': local rows 0 != gtp_rows[1] = 1");
  req = EmptyShardRequest(shm.name());
  req.mutable_groups(0)->mutable_params(1)->mutable_tags()->add_gtp_rows(0);
  refused(req, "'w_empty': gtp_rows [3, 0, 0] has 3 entries");
  req = EmptyShardRequest(shm.name());
  req.mutable_groups(0)->mutable_params(1)->mutable_tags()->clear_gtp_rows();
  refused(req, "'w_empty': local shape [0, 8] has a dimension <= 0");
  req = EmptyShardRequest(shm.name());
  req.mutable_groups(1)->mutable_params(0)->mutable_tags()->set_gtp_rows(0, 4);
  refused(req, "'b_empty': gtp_rows [4, 0] sum to 4");
  req = EmptyShardRequest(shm.name());
  req.mutable_groups(1)
      ->mutable_params(0)
      ->mutable_tags()
      ->set_is_gtp_weight_remat(false);
  refused(req,
          "'b_empty': gtp_rows [5, 0] given but the param is not "
          "GTP-sharded");
}

TEST(Registration, OverlappingParamsAreRefused) {
  ShmObject shm(512);
  HandleOpener opener;
  v1::RegisterParamsRequest req = Request(shm.name(), 512);
  // w1's param onto w0's grad.
  req.mutable_groups(0)->mutable_params(1)->mutable_param()->set_byte_offset(
      128);
  const absl::Status st = Build(req, opener).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("param 'w0' grad and param 'w1' param"));
}

TEST(Registration, AHardLinkToARegisteredObjectIsAnAlias) {
  ShmObject shm(512);
  const std::string link = absl::StrCat(shm.name(), "-link");
  ASSERT_EQ(
      ::link(("/dev/shm" + shm.name()).c_str(), ("/dev/shm" + link).c_str()),
      0);
  HandleOpener opener;
  v1::RegisterParamsRequest req = Request(shm.name(), 256);
  v1::MemoryRegion* second = req.add_regions();
  *second = req.regions(0);
  second->set_name("r2");
  second->set_shm_name(link);
  // w1 in the second region, at the bytes w0 uses in the first.
  v1::Param* w1 = req.mutable_groups(0)->mutable_params(1);
  w1->mutable_param()->set_region("r2");
  w1->mutable_param()->set_byte_offset(0);
  w1->mutable_grad()->set_region("r2");
  w1->mutable_grad()->set_byte_offset(128);
  const absl::Status st = Build(req, opener).status();
  shm_unlink(link.c_str());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("is the same object as region 'r'"));
}

TEST(Registration, AShrunkObjectIsRefusedBeforeAnyStep) {
  ShmObject shm(512);
  HandleOpener opener;
  absl::StatusOr<std::unique_ptr<Registration>> reg =
      Build(Request(shm.name(), 512), opener);
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_EQ(ftruncate(shm.fd(), 100), 0);
  const absl::Status st = (*reg)->RecheckMemory();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("region 'r'"));
  EXPECT_THAT(st.message(), HasSubstr("shrank to 100 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("byte_size 512"));
  ASSERT_EQ(ftruncate(shm.fd(), 512), 0);
  EXPECT_TRUE((*reg)->RecheckMemory().ok());
}

TEST(Registration, PathTricksInShmNamesAreInvalidArgument) {
  HandleOpener opener;
  for (const std::string name : {"/..", "/.", "/a/../b", "/a\nb", "/"}) {
    const absl::Status st = Build(Request(name, 512), opener).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name << st;
    EXPECT_THAT(st.message(), HasSubstr("shm_name"));
  }
}

TEST(Registration, AnotherUsersObjectIsRefusedUnlessAllowed) {
  ShmObject shm(512);
  HandleOpener opener;
  // As root, really give the object away; otherwise make the daemon's uid
  // another one (the same rule either way).
  const bool chowned = geteuid() == 0 && fchown(shm.fd(), 4242, 4242) == 0;
  if (!chowned) opener.set_shm_owner_uid(geteuid() + 1);
  const absl::Status st = Build(Request(shm.name(), 512), opener).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_THAT(st.message(),
              HasSubstr(absl::StrCat("belongs to uid ",
                                     chowned ? uid_t(4242) : geteuid())));
  EXPECT_THAT(st.message(), HasSubstr("--allow_foreign_shm"));
  opener.set_allow_foreign_shm(true);
  EXPECT_TRUE(Build(Request(shm.name(), 512), opener).ok());
}

TEST(Registration, LongNamesAreRefusedAndEchoesAreBounded) {
  ShmObject shm(512);
  HandleOpener opener;
  v1::RegisterParamsRequest req = Request(shm.name(), 512);
  const std::string huge(1 << 20, 'x');
  req.mutable_groups(0)->mutable_params(0)->set_name(huge);
  absl::Status st = Build(req, opener).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("param name"));
  EXPECT_THAT(st.message(), HasSubstr("is 1048576 bytes; names are at most "
                                      "1024 bytes"));
  EXPECT_LT(st.message().size(), 400u);
  // Echoed, not refused: an undeclared region name of any length.
  req = Request(shm.name(), 512);
  req.mutable_groups(0)->mutable_params(0)->mutable_param()->set_region(huge);
  st = Build(req, opener).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("...(1048576 bytes)"));
  EXPECT_LT(st.message().size(), 400u);
}

TEST(Registration, AnUnnamedDtypeIsShownQuoted) {
  ShmObject shm(512);
  HandleOpener opener;
  v1::RegisterParamsRequest req = Request(shm.name(), 512);
  req.mutable_groups(0)->mutable_params(0)->mutable_param()->set_dtype(
      static_cast<v1::DType>(9));
  EXPECT_THAT(Build(req, opener).status().message(),
              HasSubstr("dtype '9' is not supported"));
  req.mutable_groups(0)->mutable_params(0)->mutable_param()->set_dtype(
      v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(Build(req, opener).status().message(),
              HasSubstr("dtype 'DTYPE_UNSPECIFIED' is not supported"));
}

TEST(Echo, ShortTextIsEscapedLongTextCut) {
  EXPECT_EQ(Echo("w1"), "w1");
  EXPECT_EQ(Echo("a\nb"), "a\\nb");
  const std::string echoed = Echo(std::string(1000, 'y'));
  EXPECT_EQ(echoed, std::string(kMaxEchoBytes, 'y') + "...(1000 bytes)");
  // Never cuts a UTF-8 character: 127 ASCII bytes then a 2-byte character.
  const std::string utf8 = std::string(127, 'a') + "\xc3\xa9" + "tail";
  EXPECT_EQ(Echo(utf8), std::string(127, 'a') + "...(133 bytes)");
}

}  // namespace
}  // namespace muond
