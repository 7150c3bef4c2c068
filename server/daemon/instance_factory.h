#pragma once
// muond-daemon's optimizer instances (optimizer_table.h): each its own
// DaemonCore, step engine factory and coordinator link, joined to the
// instance's job on the coordinator (InstanceJobId: "<job>/<name>", the
// default instance "" the job itself) with the daemon's rank, world size and
// token, so the instance's communicators rendezvous in their own store.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/daemon_core.h"
#include "server/daemon/engine_factory.h"
#include "server/daemon/optimizer_table.h"

namespace muond {

struct InstanceSettings {
  std::string coordinator;  // host:port
  std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials;
  // The daemon's Join (job_id: the user's job); an instance joins its own.
  v1::JoinRequest join;
  // Every instance's config (on_readiness is the table's) and engine options
  // (job_id is the instance's job).
  DaemonConfig config;
  EngineOptions engine;
  int device = -1;  // -1: host mode (shm regions only)
  bool allow_foreign_shm = false;
  // How long an instance's start retries its Join.
  absl::Duration coordinator_timeout = absl::Seconds(60);
};

InstanceFactory MakeInstanceFactory(InstanceSettings settings);

}  // namespace muond
