#pragma once
// Host-memory communicator over Gloo's TCP transport (CPU mode). Gloo stays
// inside gloo_communicator.cc; its exceptions never cross this interface.
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/comm/communicator.h"
#include "core/comm/kv_store.h"

namespace muond {

struct GlooOptions {
  // Bounds every operation, and the rendezvous: waiting for the peers'
  // addresses in the store, then connecting to them (Gloo's own 5x connect
  // wait is cut at 1x), so a dead peer makes the survivors fail instead of
  // hang.
  absl::Duration timeout = absl::Seconds(60);
  // Address to listen on; empty: Gloo's default (this host name resolved).
  // Tests and single-host launches use "127.0.0.1".
  std::string hostname;
  // Network interface to listen on instead of `hostname` (e.g. "eth0").
  std::string iface;
  // Polled while waiting for peers' addresses in the store or connections;
  // once it returns true the rendezvous stops with Cancelled instead of
  // waiting out the timeout. Unset: never cancelled.
  std::function<bool()> cancelled;
};

// Joins the group of `size` ranks that rendezvous under `prefix` in `store`
// (keys "<prefix>/gloo/<rank>"; use a fresh prefix per communicator, see
// groups.h), connects to every peer and ends with a barrier, so every rank
// has finished connecting when any returns. size 1 returns a LocalCommunicator
// without touching the store. `store` is used only during this call.
// A rank whose rendezvous fails leaves its error under "<prefix>/gloo/failed"
// and its peers stop at once (within a store poll) with Unavailable quoting
// it, rather than wait for connections that will not come.
// Errors: InvalidArgument (rank/size/timeout); DeadlineExceeded naming the
// missing key when a peer does not show up within the timeout, or the peer
// that did not connect; Unavailable for transport failures and a peer's
// failed rendezvous; Cancelled (GlooOptions.cancelled).
absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    KeyValueStore* store, const std::string& prefix, int rank, int size,
    const GlooOptions& options = {});

}  // namespace muond
