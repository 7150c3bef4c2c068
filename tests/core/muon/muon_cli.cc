// A small CLI over muond's CPU math, the single-process reference of the
// Python tests (peer oracles, the split-mode system test): raw little-endian
// fp32 files in and out, arguments as key=value. Floating-point arguments are
// parsed as double (Python repr round-trips) and narrowed like the daemon
// narrows the proto's doubles.
//   muon_cli ns rows=R cols=C type=quintic steps=5 eps=1e-15 in=F out=F
//            [custom=a,b,c;a,b,c]
//   muon_cli muon rows=R cols=C iters=K lr= momentum= wd= nesterov=0|1
//            type=simple steps=5 eps=1e-7 scale=original extra=1
//            wd_method=decoupled param=F grads=F(K*R*C) out=F
//            [custom=...] [momentum_in=F] [momentum_out=F]
//     K Muon steps (MuonStepFullMatrix) of one full matrix; the momentum
//     starts at momentum_in (zeros when absent) and is written to
//     momentum_out.
//   muon_cli adamw rows=R cols=C iters=K lr= beta1= beta2= eps= wd=
//            param=F grads=F(K*R*C) out=F [first_step=1]
//            [exp_avg_in=F exp_avg_sq_in=F] [exp_avg_out=F exp_avg_sq_out=F]
//     K AdamW steps (AdamWStep) numbered first_step, first_step + 1, ...
//     (1-D params: rows=1).
// Exit 0 on success, 1 on a math/option error, 2 on a usage/file error.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "core/backend/openblas_core.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"

namespace muond {
namespace {

std::vector<float> ReadF32(const std::string& path, size_t n) {
  std::vector<float> v(n);
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4));
  if (!f) {
    std::cerr << "cannot read " << n << " floats from " << path << "\n";
    std::exit(2);
  }
  return v;
}

void WriteF32(const std::string& path, const std::vector<float>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()),
          std::streamsize(v.size() * 4));
}

int Fail(const absl::Status& s) {
  std::cerr << s << "\n";
  return 1;
}

absl::StatusOr<NsOptions> NsFromArgs(std::map<std::string, std::string>& a) {
  NsOptions o;
  auto type = ParseCoefficientType(a["type"]);
  if (!type.ok()) return type.status();
  o.coefficient_type = *type;
  o.num_steps = std::stoi(a["steps"]);
  o.eps = float(std::stod(a["eps"]));
  if (!a["custom"].empty()) {
    std::stringstream ss(a["custom"]);
    std::string tuple;
    while (std::getline(ss, tuple, ';')) {
      NsCoefficients k;
      if (std::sscanf(tuple.c_str(), "%f,%f,%f", &k.a, &k.b, &k.c) != 3) {
        return absl::InvalidArgumentError("custom: expected a,b,c;...");
      }
      o.custom.push_back(k);
    }
  }
  return o;
}

// Reads `path` when given, else zeros.
std::vector<float> ReadF32OrZeros(const std::string& path, size_t n) {
  return path.empty() ? std::vector<float>(n, 0.0f) : ReadF32(path, n);
}

void WriteIfAsked(const std::string& path, const std::vector<float>& v) {
  if (!path.empty()) WriteF32(path, v);
}

int RunAdamW(std::map<std::string, std::string>& a, int64_t rows,
             int64_t cols) {
  auto backend = MakeCpuBackend();
  AdamWOptions o;
  o.lr = std::stod(a["lr"]);
  o.beta1 = std::stod(a["beta1"]);
  o.beta2 = std::stod(a["beta2"]);
  o.eps = std::stod(a["eps"]);
  o.weight_decay = std::stod(a["wd"]);
  if (absl::Status s = o.Validate(); !s.ok()) return Fail(s);
  const int iters = std::stoi(a["iters"]);
  const int64_t first = a.count("first_step") ? std::stoll(a["first_step"]) : 1;
  const int64_t n = rows * cols;
  std::vector<float> p = ReadF32(a["param"], n),
                     grads = ReadF32(a["grads"], iters * n),
                     m = ReadF32OrZeros(a["exp_avg_in"], n),
                     v = ReadF32OrZeros(a["exp_avg_sq_in"], n);
  auto view = [&](float* d) {
    return ContiguousView(d, DType::kFloat32, rows, cols);
  };
  for (int t = 0; t < iters; ++t) {
    absl::Status s =
        AdamWStep(*backend, o, first + t, view(p.data()),
                  view(grads.data() + t * n), view(m.data()), view(v.data()));
    if (!s.ok()) return Fail(s);
  }
  WriteF32(a["out"], p);
  WriteIfAsked(a["exp_avg_out"], m);
  WriteIfAsked(a["exp_avg_sq_out"], v);
  return 0;
}

int Main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string mode = argv[1];
  std::map<std::string, std::string> a;
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    const size_t eq = s.find('=');
    if (eq == std::string::npos) {
      std::cerr << "argument '" << s << "' is not key=value\n";
      return 2;
    }
    a[s.substr(0, eq)] = s.substr(eq + 1);
  }
  const int64_t rows = std::stoll(a["rows"]), cols = std::stoll(a["cols"]);
  if (mode == "adamw") return RunAdamW(a, rows, cols);
  auto backend = MakeCpuBackend();
  auto ns_opts = NsFromArgs(a);
  if (!ns_opts.ok()) return Fail(ns_opts.status());
  auto ns = NewtonSchulz::Create(backend.get(), *ns_opts, rows, cols);
  if (!ns.ok()) return Fail(ns.status());
  if (mode == "ns") {
    std::vector<float> in = ReadF32(a["in"], rows * cols), out(rows * cols);
    absl::Status s =
        (*ns)->Run(ContiguousView(in.data(), DType::kFloat32, rows, cols),
                   ContiguousView(out.data(), DType::kFloat32, rows, cols), 1);
    if (!s.ok()) return Fail(s);
    WriteF32(a["out"], out);
    return 0;
  }
  if (mode != "muon") return 2;
  MuonOptions o;
  o.ns = *ns_opts;
  o.lr = std::stod(a["lr"]);
  o.momentum = std::stod(a["momentum"]);
  o.weight_decay = std::stod(a["wd"]);
  o.nesterov = a["nesterov"] == "1";
  o.extra_scale_factor = a.count("extra") ? std::stod(a["extra"]) : 1.0;
  auto scale = ParseScaleMode(a["scale"]);
  if (!scale.ok()) return Fail(scale.status());
  o.scale_mode = *scale;
  auto wd = ParseWeightDecayMethod(a.count("wd_method") ? a["wd_method"]
                                                        : "decoupled");
  if (!wd.ok()) return Fail(wd.status());
  o.weight_decay_method = *wd;
  if (absl::Status s = o.Validate(); !s.ok()) return Fail(s);
  const int iters = std::stoi(a["iters"]);
  const int64_t n = rows * cols;
  std::vector<float> p = ReadF32(a["param"], n),
                     grads = ReadF32(a["grads"], iters * n),
                     m = ReadF32OrZeros(a["momentum_in"], n), scratch(n);
  auto view = [&](float* d) {
    return ContiguousView(d, DType::kFloat32, rows, cols);
  };
  for (int t = 0; t < iters; ++t) {
    absl::Status s = MuonStepFullMatrix(*backend, o, **ns, view(p.data()),
                                        view(grads.data() + t * n),
                                        view(m.data()), view(scratch.data()));
    if (!s.ok()) return Fail(s);
  }
  WriteF32(a["out"], p);
  WriteIfAsked(a["momentum_out"], m);
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) {
  // The daemons pick these kernels too: its values stay bitwise theirs.
  muond::ReexecWithBetterOpenBlasCore(argv);
  return muond::Main(argc, argv);
}
