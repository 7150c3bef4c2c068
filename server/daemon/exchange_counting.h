#pragma once
// Counts the bytes of a communicator's all_to_allv exchanges for the
// daemon's muond_exchange_bytes_total (server/, so core/ stays free of
// metrics): the engine's domain communicators are wrapped when built.
#include <memory>

#include "core/comm/communicator.h"
#include "server/common/metrics.h"

namespace muond {

// `inner`, counting into `sent` / `received` the bytes each successful
// AllToAllV sends to / receives from the other ranks (the rank's block to
// itself is a local copy: not counted). AllGather (the votes) is not
// counted. The counters must outlive the result.
std::unique_ptr<Communicator> CountingExchangeBytes(
    std::unique_ptr<Communicator> inner, Counter* sent, Counter* received);

}  // namespace muond
