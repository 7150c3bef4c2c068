// A corpus of malformed requests against a live 2x2 job (real
// muond-coordinator + 4 muond daemons). Every case must answer an error
// status; afterwards every server is still up and a valid step still equals
// the single-process reference bitwise.
//
// The corpus is the table below: each case names itself, the RPC, and how it
// breaks a valid request (truncated handles, regions undeclared, declared
// twice or of size 0, huge/negative shapes, strides that overflow, views past
// their region, bad dtypes, wrong job/rank, duplicate joins, manifests that
// disagree, oversized messages, ...).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

using RegisterMutation = std::function<void(v1::RegisterParamsRequest*)>;
struct RegisterCase {
  std::string name;
  RegisterMutation mutate;
};

v1::TensorRef* Ref(v1::RegisterParamsRequest* r, int param, bool grad) {
  v1::Param* p = r->mutable_groups(0)->mutable_params(param);
  return grad ? p->mutable_grad() : p->mutable_param();
}

void SetRepeated(google::protobuf::RepeatedField<int64_t>* f,
                 std::vector<int64_t> v) {
  f->Clear();
  for (int64_t x : v) f->Add(x);
}

std::vector<RegisterCase> RegisterCorpus() {
  std::vector<RegisterCase> c;
  auto add = [&](std::string n, RegisterMutation m) {
    c.push_back({std::move(n), std::move(m)});
  };
  // Per-ref families, on the param and the grad ref of params 0 ("col",
  // strided view) and 2 ("pad", own buffer).
  for (int param : {0, 2}) {
    for (bool grad : {false, true}) {
      const std::string at =
          absl::StrCat("param", param, grad ? ".grad" : ".param", ": ");
      auto ref = [=](v1::RegisterParamsRequest* r) {
        return Ref(r, param, grad);
      };
      for (std::vector<int64_t> shape :
           std::vector<std::vector<int64_t>>{{},
                                             {0, 8},
                                             {-1, 8},
                                             {8, -8},
                                             {int64_t(1) << 40, 8},
                                             {kMax, 2},
                                             {2, 3, 4},
                                             {7}}) {
        add(at + "shape " + absl::StrJoin(shape, "x"),
            [=](auto* r) { SetRepeated(ref(r)->mutable_shape(), shape); });
      }
      for (std::vector<int64_t> strides :
           std::vector<std::vector<int64_t>>{{kMax, 1},
                                             {int64_t(1) << 62, 1},
                                             {-16, 1},
                                             {16, 2},
                                             {16, 0},
                                             {1},
                                             {16, 1, 1}}) {
        add(at + "strides " + absl::StrJoin(strides, ","),
            [=](auto* r) { SetRepeated(ref(r)->mutable_strides(), strides); });
      }
      for (uint64_t off : {uint64_t(1) << 40, ~uint64_t(0), uint64_t(1) << 20,
                           ~uint64_t(0) - 3}) {
        add(at + absl::StrCat("offset ", off),
            [=](auto* r) { ref(r)->set_byte_offset(off); });
      }
      add(at + "unaligned offset",
          [=](auto* r) { ref(r)->set_byte_offset(ref(r)->byte_offset() + 1); });
      add(at + "no region", [=](auto* r) { ref(r)->clear_region(); });
      add(at + "region not declared",
          [=](auto* r) { ref(r)->set_region("muond-no-such-region"); });
      add(at + "dtype unspecified",
          [=](auto* r) { ref(r)->set_dtype(v1::DTYPE_UNSPECIFIED); });
      add(at + "dtype 9",
          [=](auto* r) { ref(r)->set_dtype(static_cast<v1::DType>(9)); });
    }
  }
  // Region-level: the one region every ref of the valid request lies in. The
  // handle cases (names, kinds, CUDA IPC) were per-ref before handles moved
  // into regions.
  auto region = [](v1::RegisterParamsRequest* r) {
    return r->mutable_regions(0);
  };
  add("region: no regions", [](auto* r) { r->clear_regions(); });
  add("region: empty name", [=](auto* r) { region(r)->clear_name(); });
  add("region: renamed (every ref names an undeclared region)",
      [=](auto* r) { region(r)->set_name("renamed"); });
  add("region: declared twice",
      [](auto* r) { *r->add_regions() = r->regions(0); });
  add("region: same shm object under two names", [](auto* r) {
    v1::MemoryRegion* alias = r->add_regions();
    *alias = r->regions(0);
    alias->set_name("alias");
  });
  add("region: byte_size 0", [=](auto* r) { region(r)->set_byte_size(0); });
  add("region: byte_size past its shm object",
      [=](auto* r) { region(r)->set_byte_size(region(r)->byte_size() + 1); });
  add("region: byte_size huge",
      [=](auto* r) { region(r)->set_byte_size(~uint64_t(0)); });
  add("region: byte_size below its views (views beyond the region)",
      [=](auto* r) { region(r)->set_byte_size(64); });
  // The same object again under a name shm_open cuts at the NUL.
  add("region: same shm object under two names, one with a NUL", [](auto* r) {
    v1::MemoryRegion* alias = r->add_regions();
    *alias = r->regions(0);
    alias->set_name("alias");
    alias->set_shm_name(r->regions(0).shm_name() + std::string(1, '\0') + "x");
  });
  add("region: no shm name", [=](auto* r) { region(r)->clear_shm_name(); });
  add("region: missing shm",
      [=](auto* r) { region(r)->set_shm_name("/muond-no-such-object"); });
  add("region: shm path traversal",
      [=](auto* r) { region(r)->set_shm_name("/../../etc/passwd"); });
  add("region: long shm name",
      [=](auto* r) { region(r)->set_shm_name("/" + std::string(5000, 'x')); });
  add("region: kind unspecified",
      [=](auto* r) { region(r)->set_kind(v1::MEMORY_KIND_UNSPECIFIED); });
  add("region: kind 42 (unknown)",
      [=](auto* r) { region(r)->set_kind(static_cast<v1::MemoryKind>(42)); });
  add("region: truncated CUDA IPC handle", [=](auto* r) {
    region(r)->set_kind(v1::MEMORY_KIND_CUDA_IPC);
    region(r)->set_cuda_ipc_handle(std::string(10, '\x01'));
  });
  // A well-formed handle is still refused: these daemons run in host mode.
  add("region: CUDA IPC on a host daemon", [=](auto* r) {
    region(r)->set_kind(v1::MEMORY_KIND_CUDA_IPC);
    region(r)->set_cuda_ipc_handle(std::string(64, '\x01'));
  });
  // Param-level.
  for (std::vector<int64_t> full : std::vector<std::vector<int64_t>>{
           {}, {32}, {31, 16}, {0, 16}, {-32, 16}, {32, 16, 1}, {kMax, kMax}}) {
    add("full_shape " + absl::StrJoin(full, "x"), [=](auto* r) {
      SetRepeated(r->mutable_groups(0)->mutable_params(0)->mutable_full_shape(),
                  full);
    });
  }
  auto tags = [](v1::RegisterParamsRequest* r, int p) {
    return r->mutable_groups(0)->mutable_params(p)->mutable_tags();
  };
  add("partition_dim 2", [=](auto* r) { tags(r, 0)->set_partition_dim(2); });
  add("partition_dim -1", [=](auto* r) { tags(r, 0)->set_partition_dim(-1); });
  add("pad_length -1", [=](auto* r) { tags(r, 2)->set_pad_length(-1); });
  add("pad_length huge", [=](auto* r) { tags(r, 2)->set_pad_length(kMax); });
  add("pad_length on unpadded",
      [=](auto* r) { tags(r, 0)->set_pad_length(4); });
  add("TP tag off on a TP param",
      [=](auto* r) { tags(r, 0)->set_tensor_model_parallel(false); });
  add("TP without GTP in a GTP domain",
      [=](auto* r) { tags(r, 0)->set_is_gtp_weight_remat(false); });
  add("empty param name",
      [](auto* r) { r->mutable_groups(0)->mutable_params(1)->clear_name(); });
  add("duplicate param name", [](auto* r) {
    r->mutable_groups(0)->mutable_params(1)->set_name(
        r->groups(0).params(0).name());
  });
  add("param without refs",
      [](auto* r) { r->mutable_groups(0)->mutable_params(1)->clear_param(); });
  add("param without grad",
      [](auto* r) { r->mutable_groups(0)->mutable_params(1)->clear_grad(); });
  add("grad shape differs from param", [](auto* r) {
    SetRepeated(Ref(r, 1, true)->mutable_shape(), {4, 4});
  });
  // Group-level.
  auto muon = [](v1::RegisterParamsRequest* r) {
    return r->mutable_groups(0)->mutable_muon();
  };
  auto dom = [](v1::RegisterParamsRequest* r) {
    return r->mutable_groups(0)->mutable_domain();
  };
  add("empty group name", [](auto* r) { r->mutable_groups(0)->clear_name(); });
  add("algorithm 7", [](auto* r) {
    r->mutable_groups(0)->set_algorithm(static_cast<v1::Algorithm>(7));
  });
  add("duplicate group", [](auto* r) { *r->add_groups() = r->groups(0); });
  add("no groups", [](auto* r) { r->clear_groups(); });
  add("empty group", [](auto* r) { r->mutable_groups(0)->clear_params(); });
  add("gtp_size 0", [=](auto* r) { dom(r)->set_gtp_size(0); });
  add("tp_size -1", [=](auto* r) { dom(r)->set_tp_size(-1); });
  add("g outside domain", [=](auto* r) { dom(r)->set_g(2); });
  add("t negative", [=](auto* r) { dom(r)->set_t(-1); });
  add("domain larger than the world", [=](auto* r) {
    dom(r)->set_gtp_size(4);
    dom(r)->set_tp_size(4);
  });
  add("domain huge", [=](auto* r) {
    dom(r)->set_gtp_size(1 << 30);
    dom(r)->set_tp_size(1 << 30);
  });
  add("empty domain name", [=](auto* r) { dom(r)->clear_name(); });
  add("lr NaN", [=](auto* r) {
    muon(r)->set_lr(std::numeric_limits<double>::quiet_NaN());
  });
  add("lr negative", [=](auto* r) { muon(r)->set_lr(-1); });
  add("lr inf", [=](auto* r) {
    muon(r)->set_lr(std::numeric_limits<double>::infinity());
  });
  add("momentum 2", [=](auto* r) { muon(r)->set_momentum(2); });
  add("momentum -0.5", [=](auto* r) { muon(r)->set_momentum(-0.5); });
  add("weight_decay negative", [=](auto* r) { muon(r)->set_weight_decay(-1); });
  // Enum numbers the wire API does not define (an open proto3 enum keeps
  // them).
  add("weight_decay_method bogus", [=](auto* r) {
    muon(r)->set_weight_decay_method(static_cast<v1::WeightDecayMethod>(99));
  });
  add("coefficient_type bogus", [=](auto* r) {
    muon(r)->set_coefficient_type(static_cast<v1::CoefficientType>(99));
  });
  add("custom coefficients not triples", [=](auto* r) {
    muon(r)->set_coefficient_type(v1::COEFFICIENT_TYPE_CUSTOM);
    muon(r)->add_custom_coefficients(1.0);
  });
  add("num_ns_steps -1", [=](auto* r) { muon(r)->set_num_ns_steps(-1); });
  add("num_ns_steps huge",
      [=](auto* r) { muon(r)->set_num_ns_steps(1 << 30); });
  add("eps negative", [=](auto* r) { muon(r)->set_eps(-1); });
  add("scale_mode bogus", [=](auto* r) {
    muon(r)->set_scale_mode(static_cast<v1::ScaleMode>(99));
  });
  add("ns_batch_size -1", [=](auto* r) { muon(r)->set_ns_batch_size(-1); });
  // Optional fields: an explicit 0 is a value (refused), not the default.
  add("num_ns_steps explicit 0",
      [=](auto* r) { muon(r)->set_num_ns_steps(0); });
  add("eps explicit 0", [=](auto* r) { muon(r)->set_eps(0); });
  add("ns_batch_size -2", [=](auto* r) { muon(r)->set_ns_batch_size(-2); });
  add("extra_scale_factor explicit 0",
      [=](auto* r) { muon(r)->set_extra_scale_factor(0); });
  add("fp32_matmul_prec bogus", [=](auto* r) {
    muon(r)->set_fp32_matmul_prec(static_cast<v1::MatmulPrecision>(99));
  });
  // TF32 is CUDA only; these daemons run in host mode.
  add("fp32_matmul_prec high on a host daemon", [=](auto* r) {
    muon(r)->set_fp32_matmul_prec(v1::MATMUL_PRECISION_HIGH);
  });
  add("extra_scale_factor NaN", [=](auto* r) {
    muon(r)->set_extra_scale_factor(std::numeric_limits<double>::quiet_NaN());
  });
  // Request-level.
  add("wrong job", [](auto* r) { r->set_job_id("other-job"); });
  add("empty job", [](auto* r) { r->clear_job_id(); });
  return c;
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<Cluster>(Cluster::Options{});
    cluster_->StartAll();
    trainers_ = std::make_unique<Trainers>(*cluster_);
    daemon_ = v1::Optimizer::NewStub(grpc::CreateChannel(
        "unix://" + cluster_->socket(0), grpc::InsecureChannelCredentials()));
    coordinator_ = cluster_->CoordinatorStub();
  }

  // Runs one case; records it.
  void Expect(const std::string& name, const grpc::Status& st) {
    ++cases_;
    EXPECT_FALSE(st.ok()) << "case '" << name << "' was accepted";
    EXPECT_FALSE(st.error_message().empty()) << name;
  }

  template <typename Req, typename Resp, typename Fn>
  grpc::Status Call(Fn fn, const Req& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    Resp resp;
    return fn(&ctx, req, &resp);
  }

  v1::RegisterParamsRequest ValidRegister(int rank) {
    v1::RegisterParamsRequest r;
    r.set_job_id(cluster_->job());
    r.set_client_id(absl::StrCat("trainer", rank));
    *r.add_regions() = trainers_->Region(rank);
    *r.add_groups() = trainers_->Group(rank);
    return r;
  }

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Trainers> trainers_;
  std::unique_ptr<v1::Optimizer::Stub> daemon_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
  int cases_ = 0;
};

TEST_F(BadInputTest, CorpusIsRefusedAndTheJobStillStepsExactly) {
  // 1. RegisterParams corpus on rank 0 before anything is registered.
  for (const RegisterCase& c : RegisterCorpus()) {
    v1::RegisterParamsRequest req = ValidRegister(0);
    c.mutate(&req);
    const grpc::Status st =
        Call<v1::RegisterParamsRequest, v1::RegisterParamsResponse>(
            [&](auto* ctx, auto& r, auto* resp) {
              return daemon_->RegisterParams(ctx, r, resp);
            },
            req);
    Expect("RegisterParams: " + c.name, st);
    if (st.ok()) {  // keep going: undo the wrongly accepted registration
      v1::UnregisterParamsRequest un;
      un.set_job_id(req.job_id());
      un.set_client_id(req.client_id());
      Call<v1::UnregisterParamsRequest, v1::UnregisterParamsResponse>(
          [&](auto* ctx, auto& r, auto* resp) {
            return daemon_->UnregisterParams(ctx, r, resp);
          },
          un);
    }
  }
  {
    // Oversized message (> the daemon's 64 MiB limit).
    v1::RegisterParamsRequest req = ValidRegister(0);
    req.mutable_groups(0)->mutable_params(0)->set_name(
        std::string(65 << 20, 'n'));
    Expect("RegisterParams: oversized",
           Call<v1::RegisterParamsRequest, v1::RegisterParamsResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return daemon_->RegisterParams(ctx, r, resp);
               },
               req));
  }
  auto step = [&](v1::StepRequest req) {
    return Call<v1::StepRequest, v1::StepResponse>(
        [&](auto* ctx, auto& r, auto* resp) {
          return daemon_->Step(ctx, r, resp);
        },
        req);
  };
  v1::StepRequest step1;
  step1.set_job_id(cluster_->job());
  step1.set_client_id("trainer0");
  step1.set_step_id(1);
  Expect("Step before registration", step(step1));

  // 2. The valid job: every rank registers, step 1.
  ASSERT_TRUE(trainers_->RegisterAll().ok());
  ASSERT_TRUE(trainers_->RunSteps(1, 1).ok());
  Expect("RegisterParams twice",
         Call<v1::RegisterParamsRequest, v1::RegisterParamsResponse>(
             [&](auto* ctx, auto& r, auto* resp) {
               return daemon_->RegisterParams(ctx, r, resp);
             },
             ValidRegister(0)));

  // 3. Step / Unregister / state corpus on the registered daemon.
  std::vector<std::pair<std::string, std::function<void(v1::StepRequest*)>>>
      steps = {
          {"wrong job", [](auto* r) { r->set_job_id("other"); }},
          {"empty job", [](auto* r) { r->clear_job_id(); }},
          {"other client", [](auto* r) { r->set_client_id("intruder"); }},
          {"no client", [](auto* r) { r->clear_client_id(); }},
          {"gap", [](auto* r) { r->set_step_id(5); }},
          {"backwards", [](auto* r) { r->set_step_id(0); }},
          {"negative id", [](auto* r) { r->set_step_id(-7); }},
          {"max id", [](auto* r) { r->set_step_id(kMax); }},
          {"unknown override group",
           [](auto* r) { r->add_overrides()->set_group("nope"); }},
          {"override lr NaN",
           [](auto* r) {
             auto* o = r->add_overrides();
             o->set_group("muon");
             o->set_lr(std::numeric_limits<double>::quiet_NaN());
           }},
          {"override lr negative",
           [](auto* r) {
             auto* o = r->add_overrides();
             o->set_group("muon");
             o->set_lr(-1);
           }},
          {"override wd inf",
           [](auto* r) {
             auto* o = r->add_overrides();
             o->set_group("muon");
             o->set_weight_decay(std::numeric_limits<double>::infinity());
           }},
      };
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& [name, mutate] = steps[i];
    v1::StepRequest req = step1;
    req.set_step_id(2);
    mutate(&req);
    // The job votes on every step (core/step/job_vote.h): rank
    // 0's refusal of a step id or an override reaches the other ranks' Step 2
    // at once and they refuse it too, so they step along here (a Step sent
    // to one rank alone waits for its peers in the vote). Requests refused
    // before the vote (wrong job or client: the first four) go alone.
    const bool voted = i >= 4;
    std::vector<absl::StatusOr<v1::StepResponse>> peers(
        kWorld, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 1; voted && r < kWorld; ++r) {
      threads.emplace_back([&, r] { peers[r] = trainers_->client(r).Step(2); });
    }
    Expect("Step: " + name, step(req));
    for (auto& t : threads) t.join();
    for (int r = 1; voted && r < kWorld; ++r) {
      EXPECT_FALSE(peers[r].ok()) << name << ": rank " << r;
    }
  }
  for (const std::string& job : {std::string("other"), std::string()}) {
    v1::UnregisterParamsRequest un;
    un.set_job_id(job);
    un.set_client_id("trainer0");
    Expect("Unregister: job '" + job + "'",
           Call<v1::UnregisterParamsRequest, v1::UnregisterParamsResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return daemon_->UnregisterParams(ctx, r, resp);
               },
               un));
  }
  const std::string garbage = cluster_->dir() + "/garbage.safetensors";
  {
    FILE* f = fopen(garbage.c_str(), "w");
    fputs("\xff\xff\xff\xff\xff\xff\xff\x7fnot json", f);
    fclose(f);
  }
  for (const std::string& path :
       {std::string(), std::string("/nonexistent/x.safetensors"),
        cluster_->dir(), garbage, std::string("/proc/self/mem")}) {
    v1::LoadStateRequest load;
    load.set_path(path);
    Expect("LoadState '" + path + "'",
           Call<v1::LoadStateRequest, v1::LoadStateResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return daemon_->LoadState(ctx, r, resp);
               },
               load));
  }
  for (const std::string& path :
       {std::string(), std::string("/nonexistent/dir/x.safetensors"),
        cluster_->dir()}) {
    v1::SaveStateRequest save;
    save.set_path(path);
    Expect("SaveState '" + path + "'",
           Call<v1::SaveStateRequest, v1::SaveStateResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return daemon_->SaveState(ctx, r, resp);
               },
               save));
  }

  // 4. Coordinator corpus.
  auto join = [&](v1::JoinRequest req) {
    return Call<v1::JoinRequest, v1::JoinResponse>(
        [&](auto* ctx, auto& r, auto* resp) {
          return coordinator_->Join(ctx, r, resp);
        },
        req);
  };
  v1::JoinRequest valid_join;
  valid_join.set_job_id(cluster_->job());
  valid_join.set_rank(0);
  valid_join.set_world_size(kWorld);
  std::vector<std::pair<std::string, std::function<void(v1::JoinRequest*)>>>
      joins = {
          {"duplicate live rank", [](auto*) {}},
          {"empty job", [](auto* r) { r->clear_job_id(); }},
          {"world 0", [](auto* r) { r->set_world_size(0); }},
          {"world -3", [](auto* r) { r->set_world_size(-3); }},
          {"rank = world", [](auto* r) { r->set_rank(kWorld); }},
          {"rank -1", [](auto* r) { r->set_rank(-1); }},
          {"world differs from the job's",
           [](auto* r) { r->set_world_size(8); }},
          {"token on a tokenless job",
           [](auto* r) {
             r->set_rank(1);
             r->set_token("t");
           }},
      };
  for (auto& [name, mutate] : joins) {
    v1::JoinRequest req = valid_join;
    mutate(&req);
    Expect("Join: " + name, join(req));
  }
  auto kv_set = [&](v1::KvSetRequest req) {
    return Call<v1::KvSetRequest, v1::KvSetResponse>(
        [&](auto* ctx, auto& r, auto* resp) {
          return coordinator_->KvSet(ctx, r, resp);
        },
        req);
  };
  v1::KvSetRequest set;
  set.set_job_id("no-such-job");
  set.set_key("k");
  Expect("KvSet: unknown job", kv_set(set));
  set.set_job_id(cluster_->job());
  set.clear_key();
  Expect("KvSet: empty key", kv_set(set));
  set.set_key("big");
  set.set_value(std::string(17 << 20, 'v'));
  Expect("KvSet: oversized value (> 16 MiB)", kv_set(set));
  for (auto [job, key, timeout] :
       std::vector<std::tuple<std::string, std::string, int64_t>>{
           {"no-such-job", "k", 10},
           {cluster_->job(), "", 10},
           {cluster_->job(), "never-set", 50},
           {cluster_->job(), "never-set", -5}}) {
    v1::KvGetRequest get;
    get.set_job_id(job);
    get.set_key(key);
    get.set_timeout_ms(timeout);
    Expect(absl::StrCat("KvGet: job '", job, "' key '", key, "' ", timeout),
           Call<v1::KvGetRequest, v1::KvGetResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return coordinator_->KvGet(ctx, r, resp);
               },
               get));
  }
  // Manifests: from the daemon's own view of rank 1's group, disagreeing.
  auto publish = [&](v1::PublishManifestRequest req) {
    return Call<v1::PublishManifestRequest, v1::PublishManifestResponse>(
        [&](auto* ctx, auto& r, auto* resp) {
          return coordinator_->PublishManifest(ctx, r, resp);
        },
        req);
  };
  // On a second job where rank 0 has published (a rank of a live job that
  // publishes anew starts a re-registration round, which is not an error).
  const std::string mjob = cluster_->job() + "-manifests";
  auto manifest_of = [&](int rank) {
    v1::PublishManifestRequest manifest;
    manifest.set_job_id(mjob);
    manifest.set_rank(rank);
    v1::GroupManifest* g = manifest.add_groups();
    const v1::ParamGroup group = trainers_->Group(rank);
    g->set_group(group.name());
    g->set_algorithm(group.algorithm());
    *g->mutable_domain() = group.domain();
    for (const v1::Param& p : group.params()) {
      v1::ParamSpec* s = g->add_params();
      s->set_name(p.name());
      *s->mutable_full_shape() = p.full_shape();
      *s->mutable_local_shape() = p.param().shape();
      *s->mutable_tags() = p.tags();
    }
    return manifest;
  };
  for (int r : {0, 1}) {
    v1::JoinRequest j = valid_join;
    j.set_job_id(mjob);
    j.set_rank(r);
    ASSERT_TRUE(join(j).ok());
  }
  ASSERT_TRUE(publish(manifest_of(0)).ok());
  const v1::PublishManifestRequest manifest = manifest_of(1);
  std::vector<
      std::pair<std::string, std::function<void(v1::PublishManifestRequest*)>>>
      manifests = {
          {"unknown job", [](auto* r) { r->set_job_id("no-such-job"); }},
          {"rank not joined", [](auto* r) { r->set_rank(kWorld + 3); }},
          {"param renamed (disagrees with rank 0)",
           [](auto* r) {
             r->mutable_groups(0)->mutable_params(0)->set_name("renamed");
           }},
          {"full shape differs",
           [](auto* r) {
             r->mutable_groups(0)->mutable_params(1)->set_full_shape(0, 18);
           }},
          {"param missing",
           [](auto* r) {
             r->mutable_groups(0)->mutable_params()->RemoveLast();
           }},
          {"duplicate params",
           [](auto* r) {
             *r->mutable_groups(0)->add_params() = r->groups(0).params(0);
           }},
          {"empty group name",
           [](auto* r) { r->mutable_groups(0)->clear_group(); }},
          {"duplicate groups",
           [](auto* r) { *r->add_groups() = r->groups(0); }},
          {"domain without the rank",
           [](auto* r) { r->mutable_groups(0)->mutable_domain()->set_t(0); }},
          {"claims rank 0's coordinates",
           [](auto* r) {
             r->mutable_groups(0)->mutable_domain()->set_g(0);
             r->mutable_groups(0)->mutable_domain()->set_t(0);
           }},
          {"domain sizes differ",
           [](auto* r) {
             r->mutable_groups(0)->mutable_domain()->set_tp_size(4);
           }},
      };
  for (auto& [name, mutate] : manifests) {
    // A refused publish refuses its whole registration round
    // (CoordinatorCore::RefuseRound), so rank 0 publishes again before each
    // case and every case meets a peer to disagree with.
    ASSERT_TRUE(publish(manifest_of(0)).ok()) << name;
    v1::PublishManifestRequest req = manifest;
    mutate(&req);
    Expect("PublishManifest: " + name, publish(req));
  }
  auto rebalance = [&](v1::RebalanceRequest req) {
    return Call<v1::RebalanceRequest, v1::Plan>(
        [&](auto* ctx, auto& r, auto* resp) {
          return coordinator_->Rebalance(ctx, r, resp);
        },
        req);
  };
  std::vector<
      std::pair<std::string, std::function<void(v1::RebalanceRequest*)>>>
      rebalances = {
          {"unknown job", [](auto* r) { r->set_job_id("no-such-job"); }},
          {"unknown cost model",
           [](auto* r) { r->set_cost_model(static_cast<v1::CostModel>(99)); }},
          {"negative activation",
           [](auto* r) { r->set_activate_after_steps(-1); }},
          {"explicit activation 0",
           [](auto* r) { r->set_activate_after_steps(0); }},
          {"3-D cost shape",
           [](auto* r) {
             auto* t = r->add_cost_table();
             for (int d : {2, 2, 2}) t->add_shape(d);
             t->set_ns_us(1);
           }},
          {"negative cost",
           [](auto* r) {
             auto* t = r->add_cost_table();
             t->add_shape(32);
             t->add_shape(16);
             t->set_ns_us(-1);
           }},
          {"NaN cost",
           [](auto* r) {
             auto* t = r->add_cost_table();
             t->add_shape(32);
             t->add_shape(16);
             t->set_ns_us(std::numeric_limits<double>::quiet_NaN());
           }},
      };
  for (auto& [name, mutate] : rebalances) {
    v1::RebalanceRequest req;
    req.set_job_id(cluster_->job());
    mutate(&req);
    Expect("Rebalance: " + name, rebalance(req));
  }
  for (auto& [name, mutate] :
       std::vector<std::pair<std::string,
                             std::function<void(v1::ReportTimingsRequest*)>>>{
           {"unknown job", [](auto* r) { r->set_job_id("no-such-job"); }},
           {"rank not joined", [](auto* r) { r->set_rank(99); }},
           {"1-D shape",
            [](auto* r) {
              auto* s = r->add_shapes();
              s->add_shape(4);
              s->set_count(1);
            }},
           {"count 0",
            [](auto* r) {
              auto* s = r->add_shapes();
              s->add_shape(4);
              s->add_shape(4);
            }},
           {"negative time", [](auto* r) {
              auto* s = r->add_shapes();
              s->add_shape(4);
              s->add_shape(4);
              s->set_count(1);
              s->set_ns_us(-3);
            }}}) {
    v1::ReportTimingsRequest req;
    req.set_job_id(cluster_->job());
    req.set_rank(0);
    mutate(&req);
    Expect("ReportTimings: " + name,
           Call<v1::ReportTimingsRequest, v1::ReportTimingsResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return coordinator_->ReportTimings(ctx, r, resp);
               },
               req));
  }
  {
    v1::GetPlanRequest req;
    req.set_job_id("no-such-job");
    Expect("GetPlan: unknown job", Call<v1::GetPlanRequest, v1::Plan>(
                                       [&](auto* ctx, auto& r, auto* resp) {
                                         return coordinator_->GetPlan(ctx, r,
                                                                      resp);
                                       },
                                       req));
    v1::ListDaemonsRequest list;
    list.set_job_id("no-such-job");
    Expect("ListDaemons: unknown job",
           Call<v1::ListDaemonsRequest, v1::ListDaemonsResponse>(
               [&](auto* ctx, auto& r, auto* resp) {
                 return coordinator_->ListDaemons(ctx, r, resp);
               },
               list));
  }
  EXPECT_GE(cases_, 100);
  std::printf("%d malformed requests refused\n", cases_);

  // 5. Everything is still up, and a valid step still equals the reference.
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(cluster_->DaemonAlive(r)) << r;
  ASSERT_TRUE(cluster_->WaitDaemonsLive(true, absl::Seconds(5)));
  ASSERT_TRUE(trainers_->RunSteps(2, 2).ok());
  const std::vector<float> got = trainers_->Shards();
  const std::vector<float> want = trainers_->ReferenceShards({1, 2});
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(memcmp(got.data(), want.data(), 4 * got.size()), 0);
}

}  // namespace
}  // namespace muond::reliability
