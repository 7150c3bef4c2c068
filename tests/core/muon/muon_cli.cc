// A small CLI over muond's CPU math for the Python peer-oracle test: raw
// little-endian fp32 files in and out, arguments as key=value.
//   muon_cli ns rows=R cols=C type=quintic steps=5 eps=1e-15 in=F out=F
//            [custom=a,b,c;a,b,c]
//   muon_cli muon rows=R cols=C iters=K lr= momentum= wd= nesterov=0|1
//            type=simple steps=5 eps=1e-7 scale=original extra=1
//            wd_method=decoupled param=F grads=F(K*R*C) out=F
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/backend/cpu_backend.h"
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
  o.eps = std::stof(a["eps"]);
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

int Main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string mode = argv[1];
  std::map<std::string, std::string> a;
  for (int i = 2; i < argc; ++i) {
    const std::string s = argv[i];
    const size_t eq = s.find('=');
    a[s.substr(0, eq)] = s.substr(eq + 1);
  }
  const int64_t rows = std::stoll(a["rows"]), cols = std::stoll(a["cols"]);
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
                     grads = ReadF32(a["grads"], iters * n);
  std::vector<float> m(n, 0.0f), scratch(n);
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
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) { return muond::Main(argc, argv); }
