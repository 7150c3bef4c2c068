#pragma once
// The Muon param group the multi-process tests (tests/server system trainer,
// tests/reliability harness) register: lr 0.02, momentum 0.95 (Nesterov),
// weight decay 0.01, domain "dense" of gtp_size x tp_size at coordinates
// (g, t). Params are added by the caller.
#include "muond/v1/muond.pb.h"

namespace muond::testing {

inline v1::ParamGroup DenseMuonGroup(int gtp_size, int tp_size, int g, int t) {
  v1::ParamGroup group;
  group.set_name("muon");
  group.set_algorithm(v1::ALGORITHM_MUON);
  v1::MuonHyperparams* h = group.mutable_muon();
  h->set_lr(0.02);
  h->set_momentum(0.95);
  h->set_nesterov(true);
  h->set_weight_decay(0.01);
  v1::Domain* d = group.mutable_domain();
  d->set_name("dense");
  d->set_gtp_size(gtp_size);
  d->set_tp_size(tp_size);
  d->set_g(g);
  d->set_t(t);
  return group;
}

}  // namespace muond::testing
